"""From what a caller sends to what the engine core queues: tokenization and validation.

Every check that can refuse a request happens here, before anything is queued, and raises
:class:`~kvserve.sched.request.InvalidRequestError` naming the field and its allowed range.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvserve.config import ConfigError
from kvserve.kv.manager import cdiv
from kvserve.model.tokenizer import Tokenizer
from kvserve.sched.request import InvalidRequestError, RequestTags, SamplingParams
from kvserve.sched.retention import RetentionSpec, parse_retention
from kvserve.sched.workload_classes import UnknownClassError, WorkloadClass, WorkloadClasses

PromptType = str | list[int] | dict[str, Any]


@dataclass(slots=True)
class EngineCoreRequest:
    """A validated request, in tokens: what :class:`~kvserve.engine.core.EngineCore` takes."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int
    arrival_time: float
    cache_salt: str | None = None
    wants_prompt_logits: bool = False
    retention: RetentionSpec | None = None
    priority: int = 0
    workload_class: WorkloadClass | None = None
    kv_transfer_params: dict[str, Any] | None = None


class InputProcessor:
    def __init__(
        self,
        tokenizer: Tokenizer | None,
        vocab_size: int,
        max_model_len: int,
        num_blocks: int,
        block_size: int,
        default_retention: RetentionSpec | None = None,
        max_chunk: int | None = None,
        native_window: int = 0,
        windowed_layers: bool = False,
        kv_format: tuple[str, bool] = ("", True),
        classes: WorkloadClasses | None = None,
        prefix_share: Any = None,
        group_windows: tuple[int | None, ...] = (),
    ) -> None:
        # A hybrid model's layer groups' windows (per-group tables; () for one table).
        self.group_windows = group_windows
        # Workload classes, and (token ids, cache salt) -> the share of them cached now.
        self.classes = classes
        self.prefix_share = prefix_share
        self.windowed_layers = windowed_layers  # some layer has its own sliding window
        self.kv_format = kv_format  # (name, whether it can move single cache entries)
        self.default_retention = default_retention
        self.max_chunk = max_chunk  # the most tokens one step computes for a request
        self.native_window = native_window
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.num_blocks = num_blocks
        self.block_size = block_size

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int], str | None]:
        """(text or None, token ids, cache salt)."""
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
            v = self.vocab_size
            # Whole-list checks in C first (a long prompt is thousands of ids); the loop
            # only runs to name the id that fails them.
            if set(map(type, ids)) != {int} or min(ids) < 0 or max(ids) >= v:
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

    def process(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        arrival_time: float,
        wants_prompt_logits: bool = False,
        tags: RequestTags | None = None,
    ) -> EngineCoreRequest:
        tags = tags or RequestTags()
        self.check_token_ids(params)
        text, ids, salt = self.tokenize(prompt)
        n_prompt = len(ids)
        wclass = self.classify(ids, salt, tags)
        if wclass is not None and params.kv_retention is None and wclass.kv_retention:
            params = params.clone(kv_retention=wclass.kv_retention)
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
        retention = self.retention(params)
        if retention is not None:
            if params.prompt_logprobs is not None:
                raise InvalidRequestError(
                    f"prompt_logprobs: not available under kv_retention "
                    f"{retention.text()!r} (send kv_retention 'none' with it)",
                    "prompt_logprobs",
                )
            retention = retention.for_prompt(n_prompt, self.block_size)
        need = self.blocks_needed(n_prompt, max_tokens, retention)
        if need > self.num_blocks:
            raise InvalidRequestError(
                f"max_tokens: prompt + max_tokens needs {need} KV blocks but the whole pool has "
                f"{self.num_blocks}; lower max_tokens or give a larger kv_cache_memory",
                "max_tokens",
            )
        wants = wants_prompt_logits or params.prompt_logprobs is not None
        priority = tags.priority
        if priority is None:
            priority = wclass.priority if wclass is not None else 0
        return EngineCoreRequest(request_id, text, ids, params, max_tokens, arrival_time, salt,
                                 wants, retention, priority, wclass,
                                 tags.kv_transfer_params)  # fmt: skip

    def check_token_ids(self, params: SamplingParams) -> None:
        """Token ids in the sampling parameters must name tokens of this model: a logits
        processor indexes the vocabulary with them."""
        v = self.vocab_size
        for name, ids in (("logit_bias", params.logit_bias),
                          ("allowed_token_ids", params.allowed_token_ids)):  # fmt: skip
            bad = next((t for t in ids or () if not 0 <= t < v), None)
            if bad is not None:
                raise InvalidRequestError(f"{name}: token id {bad} is out of range [0, {v})", name)

    def classify(self, ids: list[int], salt: str | None, tags: RequestTags) -> WorkloadClass | None:
        """The request's workload class: the one it names, else the first whose match fits
        (None when the engine has no class file)."""
        if self.classes is None:
            if tags.workload_class is not None:
                raise InvalidRequestError(
                    "workload_class: this engine has no workload classes "
                    "(start it with --workload-classes FILE)",
                    "workload_class",
                )
            return None
        share = 0.0
        if self.classes.needs_prefix_share and self.prefix_share is not None:
            share = self.prefix_share(ids, salt)
        try:
            return self.classes.classify(tags.tenant, tags.user, len(ids), share,
                                         tags.workload_class)  # fmt: skip
        except UnknownClassError as e:
            raise InvalidRequestError(str(e), "workload_class") from None

    def blocks_needed(
        self, num_prompt: int, max_tokens: int, retention: RetentionSpec | None
    ) -> int:
        """The most blocks the request holds at once: all of them; under a window the window
        behind a step's first query plus the step's chunk (and a block of slack on each
        side); under SnapKV the whole prompt plus the fresh blocks it is compacted into, or
        the compacted cache grown by the output, whichever is more; under H2O its budget, a
        block and a step's chunk, plus the fresh blocks of a compaction."""
        bs = self.block_size
        total = num_prompt + max_tokens
        full = cdiv(total, bs)
        if retention is not None and retention.observes and total > retention.budget + bs:
            chunk = self.max_chunk or total  # H2O: budget + a block + a step
            peak = min(total, retention.budget + bs + chunk)
            return cdiv(peak, bs) + 1 + cdiv(retention.budget, bs)
        if retention is not None and retention.compacts_prompt(num_prompt):
            kept = retention.num_kept
            return max(cdiv(num_prompt, bs) + cdiv(kept, bs), cdiv(kept + max_tokens, bs) + 1)
        sinks = cdiv(retention.sinks, self.block_size) if retention is not None else 0

        def held(w: int | None) -> int:
            if not w or self.max_chunk is None:
                return full
            return min(full, sinks + cdiv(w + self.max_chunk, self.block_size) + 1)

        w = retention.window if retention is not None else self.native_window
        if self.group_windows:  # each layer group its own table, in model blocks
            per = [held(min(x for x in (g, w) if x) if g or w else 0) for g in self.group_windows]
            return cdiv(sum(per), len(per))
        return held(w)

    def retention(self, params: SamplingParams) -> RetentionSpec | None:
        """The request's own policy ("none" turns the engine's default off), else the
        default; checked against this engine's block size."""
        if params.kv_retention is None:
            return self.default_retention
        try:
            return self.checked_retention(params.kv_retention)
        except ConfigError as e:
            raise InvalidRequestError(str(e), "kv_retention") from None

    def checked_retention(self, text: str) -> RetentionSpec | None:
        """``text`` parsed and checked against this engine (block size, the model's own
        windows, the KV format); raises :class:`ConfigError`."""
        spec = parse_retention(text)
        if spec is not None:
            spec.validate(self.block_size, self.windowed_layers, *self.kv_format)
        return spec
