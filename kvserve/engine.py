"""LLMEngine (add_request / step / abort) and the offline ``LLM.generate`` API, vLLM-shaped."""

from __future__ import annotations

import hashlib
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvserve.config import CacheConfig, ConfigError, EngineConfig, ModelConfig, SchedulerConfig
from kvserve.kv.formats import canonical_kv_format, make_kv_storage
from kvserve.kv.manager import KVCacheManager, cdiv
from kvserve.kv.storage import KVStorage, kv_bytes_per_token, pool_num_blocks
from kvserve.model.loader import load_kv_scales, load_model, resolve_dtype
from kvserve.model.sampler import Sampler
from kvserve.model.tokenizer import IncrementalDetokenizer, Tokenizer
from kvserve.outputs import RequestFamily, build_output, check_stop
from kvserve.request import (
    InvalidRequestError,
    Request,
    RequestOutput,
    RequestStatus,
    SamplingParams,
)
from kvserve.runner import ModelRunner
from kvserve.scheduler import Scheduler

PromptType = str | list[int] | dict[str, Any]
DEFAULT_KV_CACHE_MEMORY = 4 * 1024**3


@dataclass(slots=True)
class EngineStats:
    """A snapshot after a step. Counters are totals since start; gauges are current."""

    num_running: int
    num_waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    kv_cached_free_blocks: int
    token_slots_held: int
    token_slots_allocated: int
    num_preemptions: int
    step_prefill_tokens: int
    step_decode_tokens: int
    prompt_tokens_total: int  # every prompt token of requests that started (vLLM's meaning)
    prefill_tokens_computed_total: int  # prompt tokens actually computed (hits excluded)
    generation_tokens_total: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    prefix_cache_evictions: int
    num_steps: int

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total

    @property
    def token_occupancy(self) -> float:
        if not self.token_slots_allocated:
            return 1.0
        return self.token_slots_held / self.token_slots_allocated


def model_fingerprint(model_dir: Path) -> str:
    """A stable identity of a checkpoint for prefix-cache keys: its config and weight files."""
    h = hashlib.sha256((model_dir / "config.json").read_bytes())
    for p in sorted(model_dir.glob("*.safetensors")):
        h.update(f"{p.name}:{p.stat().st_size}".encode())
    return h.hexdigest()[:32]


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        model_dir = Path(config.model)
        if not model_dir.is_dir():
            raise FileNotFoundError(f"model: directory not found: {model_dir}")
        self.model_config = mc = ModelConfig.from_pretrained(model_dir)
        tok_dir = Path(config.tokenizer or model_dir)
        self.tokenizer: Tokenizer | None = None
        if (tok_dir / "tokenizer.json").exists():
            self.tokenizer = Tokenizer(tok_dir, mc.eos_token_ids)
        self.eos_token_ids = self.tokenizer.eos_token_ids if self.tokenizer else mc.eos_token_ids

        sc = config.scheduler
        self.max_model_len = sc.max_model_len or mc.max_position_embeddings
        if self.max_model_len > mc.max_position_embeddings:
            raise ConfigError(
                f"max_model_len: {self.max_model_len} exceeds the model's "
                f"max_position_embeddings ({mc.max_position_embeddings})"
            )
        self.device = torch.device(config.device)
        self.dtype = resolve_dtype(config.dtype, mc)
        cc = config.cache
        model_dtype = str(self.dtype).removeprefix("torch.")
        try:
            kv_name = canonical_kv_format(cc.kv_cache_dtype, model_dtype)
        except NotImplementedError as e:
            raise ConfigError(str(e)) from None
        self.kv_cache_dtype = kv_name
        self.block_size = cc.block_size
        self.bytes_per_token = kv_bytes_per_token(
            kv_name, mc.num_hidden_layers, mc.num_key_value_heads, mc.head_dim, model_dtype,
            block_size=self.block_size,
        )  # fmt: skip
        self.num_blocks = self._num_blocks(cc, sc)

        self.model = load_model(model_dir, mc, self.dtype, self.device, self.max_model_len)
        k_scales = v_scales = None
        if kv_name.startswith("fp8") and not cc.calculate_kv_scales:
            k_scales, v_scales = load_kv_scales(model_dir, mc)
        self.storage = make_kv_storage(
            kv_name, mc.num_hidden_layers, self.num_blocks, self.block_size,
            mc.num_key_value_heads, mc.head_dim, self.dtype, self.device,
            max_num_seqs=min(sc.max_num_seqs, self.num_blocks),
            k_scales=k_scales, v_scales=v_scales,
        )  # fmt: skip
        layout = kv_name if type(self.storage) is KVStorage else self.storage.format_name
        self.kv = KVCacheManager(
            self.num_blocks,
            self.block_size,
            cc.enable_prefix_caching,
            model_id=model_fingerprint(model_dir),
            kv_format=f"{layout}/bs{self.block_size}",
        )
        if hasattr(self.storage, "attach_pool"):
            self.storage.attach_pool(self.kv.pool)  # reclaims residual slots of freed blocks
        self.scheduler = Scheduler(sc, self.kv)
        self.sampler = Sampler(mc.vocab_size, config.seed, self.device)
        self.runner = ModelRunner(self.model, self.storage, self.sampler, self.kv, self.device)
        self.requests: dict[str, Request] = {}
        self._families: dict[str, RequestFamily] = {}
        self._ids = itertools.count()
        self._last_step = (0, 0)
        self.num_steps = 0
        self.prompt_tokens_total = 0
        self.prefill_tokens_computed_total = 0
        self.generation_tokens_total = 0

    def _num_blocks(self, cc: CacheConfig, sc: SchedulerConfig) -> int:
        if cc.num_gpu_blocks is not None:
            return cc.num_gpu_blocks
        block_bytes = self.bytes_per_token * self.block_size
        if cc.kv_cache_memory is not None:
            mc = self.model_config
            n = pool_num_blocks(
                cc.kv_cache_memory, self.kv_cache_dtype, mc.num_hidden_layers,
                mc.num_key_value_heads, mc.head_dim, str(self.dtype).removeprefix("torch."),
                self.block_size, sc.max_num_seqs,
            )  # fmt: skip
            if n < 1:
                raise ConfigError(
                    f"kv_cache_memory: {cc.kv_cache_memory} bytes holds no block of "
                    f"{int(block_bytes)} bytes after the format's fixed bytes; give more, or "
                    "lower max_num_seqs (KIVI keeps one full-precision block per sequence)"
                )
            return n
        # Default: enough for max_num_seqs full-length sequences, capped at 4 GiB.
        want = sc.max_num_seqs * cdiv(self.max_model_len, self.block_size)
        return max(1, min(want, int(DEFAULT_KV_CACHE_MEMORY // block_bytes)))

    # -- requests -----------------------------------------------------------------------
    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int], str | None]:
        salt = None
        if isinstance(prompt, dict):
            salt = prompt.get("cache_salt")
            if salt is not None and not isinstance(salt, str):
                raise InvalidRequestError("cache_salt: must be a string", "cache_salt")
            if "prompt_token_ids" in prompt:
                prompt = prompt["prompt_token_ids"]
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise InvalidRequestError(
                    "prompt: a prompt dict needs 'prompt' or 'prompt_token_ids'", "prompt"
                )
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt: must not be empty", "prompt")
            if self.tokenizer is None:
                raise InvalidRequestError(
                    "prompt: this model has no tokenizer.json; send token ids", "prompt"
                )
            return prompt, self.tokenizer.encode(prompt), salt
        if isinstance(prompt, list | tuple):
            ids = list(prompt)
            if not ids:
                raise InvalidRequestError("prompt: must not be empty", "prompt")
            v = self.model_config.vocab_size
            for t in ids:
                if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < v:
                    raise InvalidRequestError(
                        f"prompt_token_ids: token id {t!r} is out of range [0, {v})",
                        "prompt_token_ids",
                    )
            return None, ids, salt
        raise InvalidRequestError(
            f"prompt: must be a string, a list of token ids or a prompt dict, "
            f"got {type(prompt).__name__}",
            "prompt",
        )

    def add_request(
        self,
        request_id: str | None,
        prompt: PromptType,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        stream: bool = False,
        return_prompt_logits: bool = False,
    ) -> str:
        """Validate and queue a request; raises :class:`InvalidRequestError` (nothing queued).

        ``return_prompt_logits`` (for evaluation tools such as the quality gate) attaches the
        full ``[prompt_len, vocab]`` log-softmax of the prompt to the output; such a request
        computes every prompt position itself (no prefix-cache hits)."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(
                "sampling_params: must be a SamplingParams", "sampling_params"
            )
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self._families:
            raise InvalidRequestError(
                f"request_id: {request_id!r} is already running", "request_id"
            )
        text, ids, salt = self._tokenize(prompt)
        n_prompt = len(ids)
        if n_prompt >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt: {n_prompt} tokens; the prompt must be shorter than max_model_len "
                f"({self.max_model_len}) to leave room for output",
                "prompt",
            )
        max_tokens = params.max_tokens
        if max_tokens is None:
            max_tokens = self.max_model_len - n_prompt
        if n_prompt + max_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"max_tokens: prompt ({n_prompt} tokens) + max_tokens ({max_tokens}) exceeds "
                f"max_model_len ({self.max_model_len}); allowed max_tokens <= "
                f"{self.max_model_len - n_prompt}",
                "max_tokens",
            )
        need = cdiv(n_prompt + max_tokens, self.block_size)
        if need > self.num_blocks:
            raise InvalidRequestError(
                f"max_tokens: prompt + max_tokens needs {need} KV blocks but the whole pool has "
                f"{self.num_blocks}; lower max_tokens or give a larger kv_cache_memory",
                "max_tokens",
            )
        family = RequestFamily(request_id, text, ids, params, stream)
        family.return_prompt_logits = return_prompt_logits
        for i in range(params.n):
            child_id = request_id if params.n == 1 else f"{request_id}#{i}"
            # As vLLM: sample i of a seeded request uses seed + i, so samples differ.
            child_params = (
                params if params.seed is None or i == 0 else params.clone(seed=params.seed + i)
            )
            req = Request(
                child_id,
                ids,
                child_params,
                max_tokens,
                self.eos_token_ids,
                prompt=text,
                cache_salt=salt,
                arrival_time=arrival_time,
                parent_id=request_id,
                index=i,
            )
            if self.tokenizer is not None:
                req.detokenizer = IncrementalDetokenizer(
                    self.tokenizer, ids, params.skip_special_tokens
                )
            if i == 0 and (return_prompt_logits or params.prompt_logprobs is not None):
                req.prompt_logits = []
            family.children.append(req)
            self.requests[child_id] = req
        self._families[request_id] = family
        # Siblings wait for the first child's prefill and then share its blocks (fork).
        self.scheduler.add_request(family.children[0])
        family.pending_forks = family.children[1:]
        return request_id

    def abort_request(self, request_ids: str | Sequence[str]) -> None:
        """Stop requests now and free their blocks; unknown ids are ignored."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for rid in request_ids:
            family = self._families.pop(rid, None)
            if family is None:
                continue
            for child in family.children:
                if not child.is_finished:
                    self.scheduler.finish(child, RequestStatus.FINISHED_ABORTED)
                self.requests.pop(child.request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self._families)

    # -- the step ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        self._last_step = (sched.num_prefill_tokens, sched.num_decode_tokens)
        if not sched.scheduled:
            return []
        self.num_steps += 1
        sampling, out = self.runner.execute(sched)
        now = time.monotonic()
        for s in sched.scheduled:
            r = s.request
            if r.num_computed_tokens < r.num_prompt_tokens:
                self.prefill_tokens_computed_total += min(
                    s.num_new_tokens, r.num_prompt_tokens - r.num_computed_tokens
                )
            r.num_computed_tokens += s.num_new_tokens
            self.kv.cache_computed_blocks(r)

        touched: dict[str, RequestFamily] = {}
        finished: list[Request] = []
        if out is not None:
            for i, s in enumerate(sampling):
                r = s.request
                token = out.token_ids[i]
                r.all_token_ids.append(token)
                self.generation_tokens_total += 1
                if r.output_logprobs is not None and out.logprobs[i] is not None:
                    r.output_logprobs.append(out.logprobs[i])
                if out.sampled_logprobs is not None:
                    r.cumulative_logprob += out.sampled_logprobs[i]
                if r.metrics.first_token_time is None:
                    r.metrics.first_token_time = now
                    # vLLM's prompt_tokens counts every prompt token, cached or computed.
                    self.prompt_tokens_total += r.num_prompt_tokens
                r.metrics.token_times.append(now)
                family = self._families[r.parent_id]
                if family.pending_forks and r is family.children[0]:
                    self._fork(r, family)
                if check_stop(r, token, family.stream, self.max_model_len):
                    finished.append(r)
                touched[family.request_id] = family
        for r in finished:
            r.metrics.finished_time = now
            self.scheduler.finish(r, r.status)
        outputs = []
        for family in touched.values():
            out_f = build_output(family)
            if out_f is None:
                continue
            outputs.append(out_f)
            if out_f.finished:
                self._families.pop(family.request_id, None)
                for c in family.children:
                    self.requests.pop(c.request_id, None)
        return outputs

    def _fork(self, first: Request, family: RequestFamily) -> None:
        """Give each waiting sibling the first child's prompt blocks; each recomputes only the
        last prompt token (into a private copy of the shared block) to draw its own token."""
        for sib in family.pending_forks:
            self.kv.fork(first, sib)
            sib.num_computed_tokens = sib.num_prompt_tokens - 1
            sib.num_cached_tokens = first.num_cached_tokens
            self.scheduler.waiting.appendleft(sib)
        family.pending_forks = []

    # -- observability -------------------------------------------------------------------
    def stats(self) -> EngineStats:
        pool = self.kv.pool
        held_waste = 0
        for rid, blocks in self.kv.req_blocks.items():
            r = self.requests.get(rid)
            if r is not None and r.status == RequestStatus.RUNNING:
                held_waste += len(blocks) * self.block_size - r.num_computed_tokens
        allocated = pool.num_used_blocks * self.block_size
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_blocks_used=pool.num_used_blocks,
            kv_blocks_total=pool.num_blocks,
            kv_cached_free_blocks=pool.num_cached_free,
            token_slots_held=max(0, allocated - held_waste),
            token_slots_allocated=allocated,
            num_preemptions=self.scheduler.num_preemptions,
            step_prefill_tokens=self._last_step[0],
            step_decode_tokens=self._last_step[1],
            prompt_tokens_total=self.prompt_tokens_total,
            prefill_tokens_computed_total=self.prefill_tokens_computed_total,
            generation_tokens_total=self.generation_tokens_total,
            prefix_cache_queries=self.kv.stats.queries,
            prefix_cache_hits=self.kv.stats.hits,
            prefix_cache_evictions=pool.num_evictions,
            num_steps=self.num_steps,
        )

    def reset_prefix_cache(self) -> bool:
        return self.kv.reset_prefix_cache()

    def replace_storage(self, wrap: Callable[[KVStorage], KVStorage]) -> None:
        """Swap the KV storage for ``wrap(storage)`` (test-only corruptions, instrumented
        storages); only between steps, while no request holds blocks."""
        if self.kv.pool.num_used_blocks:
            raise RuntimeError("replace_storage: requests still hold KV blocks")
        self.storage = self.runner.storage = wrap(self.storage)


def __getattr__(name: str):  # LLM moved to kvserve.llm; keep `from kvserve.engine import LLM`
    if name == "LLM":
        from kvserve.llm import LLM

        return LLM
    raise AttributeError(f"module 'kvserve.engine' has no attribute {name!r}")
