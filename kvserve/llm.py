"""The offline API, vLLM-shaped: ``LLM(model=DIR).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvserve.attention.registry import AUTO, resolve_backend
from kvserve.config import CacheConfig, EngineConfig, SchedulerConfig
from kvserve.engine import EngineStats, LLMEngine, PromptType
from kvserve.model.tokenizer import Tokenizer
from kvserve.sched.request import InvalidRequestError, RequestOutput, SamplingParams


def engine_config(
    model: str,
    tokenizer: str | None = None,
    dtype: str = "auto",
    block_size: int = 16,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int = 2048,
    max_model_len: int | None = None,
    num_gpu_blocks: int | None = None,
    kv_cache_memory: int | str | None = None,
    kv_cache_dtype: str = "auto",
    enable_prefix_caching: bool = True,
    enable_chunked_prefill: bool = True,
    scheduling_policy: str = "fcfs",
    admission: str = "greedy",
    admission_watermark: float = 0.01,
    workload_classes: str | None = None,
    seed: int = 0,
    device: str = "cpu",
    calculate_kv_scales: bool = False,
    kv_retention: str | None = None,
    kv_offload_cpu: int | str | None = None,
    kv_offload_disk: str | None = None,
    kv_offload_disk_size: int | str = "10GiB",
    kv_offload_redis: str | None = None,
    kv_offload_redis_size: int | str = "1GiB",
    kv_offload_timeout: float = 0.5,
    kv_offload_write_policy: str = "write_back",
    kv_offload_reuse_threshold: int = 2,
    preemption_mode: str | None = None,
    disable_hybrid_kv_cache_manager: bool = False,
    kv_cache_prefault: bool = False,
    attention_backend: str | None = None,
) -> EngineConfig:
    """The :class:`EngineConfig` of the keyword arguments ``LLM`` takes (the simulator
    builds an engine from the same arguments). A named ``attention_backend`` is checked
    against the registry and the device here, before anything is loaded."""
    if attention_backend is not None and attention_backend != AUTO:
        resolve_backend(attention_backend, torch.device(device))
    return EngineConfig(
        model=str(model),
        tokenizer=tokenizer,
        dtype=dtype,
        device=device,
        seed=seed,
        attention_backend=attention_backend,
        cache=CacheConfig(
            block_size=block_size,
            num_gpu_blocks=num_gpu_blocks,
            kv_cache_memory=kv_cache_memory,
            kv_cache_dtype=kv_cache_dtype,
            enable_prefix_caching=enable_prefix_caching,
            calculate_kv_scales=calculate_kv_scales,
            kv_retention=kv_retention,
            kv_offload_cpu=kv_offload_cpu,
            kv_offload_disk=kv_offload_disk,
            kv_offload_disk_size=kv_offload_disk_size,
            kv_offload_redis=kv_offload_redis,
            kv_offload_redis_size=kv_offload_redis_size,
            kv_offload_timeout=kv_offload_timeout,
            kv_offload_write_policy=kv_offload_write_policy,
            kv_offload_reuse_threshold=kv_offload_reuse_threshold,
            preemption_mode=preemption_mode,
            disable_hybrid_kv_cache_manager=disable_hybrid_kv_cache_manager,
            kv_cache_prefault=kv_cache_prefault,
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            enable_chunked_prefill=enable_chunked_prefill,
            scheduling_policy=scheduling_policy,
            admission=admission,
            admission_watermark=admission_watermark,
            workload_classes=workload_classes,
        ),
    )


class LLM:
    """Offline batched generation, vLLM-style: ``LLM(model=DIR).generate(prompts, params)``."""

    def __init__(self, model: str, **kwargs: Any) -> None:
        """``model`` and the keyword arguments of :func:`engine_config` (vLLM's names)."""
        self.engine = LLMEngine(engine_config(model, **kwargs))

    def get_tokenizer(self) -> Tokenizer | None:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; returns one output per prompt, in order. A prompt that
        fails validation raises before any is queued, so nothing is half-submitted.
        ``priority`` (vLLM's: lower is served first) matters under
        ``scheduling_policy="priority"``."""
        if isinstance(prompts, str | dict) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        if sampling_params is None:
            params = [SamplingParams()] * len(prompts)
        elif isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise InvalidRequestError(
                    f"sampling_params: {len(params)} given for {len(prompts)} prompts",
                    "sampling_params",
                )
        if priority is not None and len(priority) != len(prompts):
            raise InvalidRequestError(
                f"priority: {len(priority)} given for {len(prompts)} prompts", "priority"
            )
        prios = list(priority) if priority is not None else [None] * len(prompts)
        ids: list[str] = []
        try:
            for prompt, p, prio in zip(prompts, params, prios, strict=True):
                ids.append(self.engine.add_request(None, prompt, p, priority=prio))
        except Exception:
            self.engine.abort_request(ids)
            raise
        results: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    results[out.request_id] = out
        return [results[i] for i in ids]

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | None = None,
    ) -> list[RequestOutput]:
        tok = self.engine.tokenizer
        if tok is None:
            raise InvalidRequestError("messages: this model has no tokenizer", "messages")
        convs = messages if messages and isinstance(messages[0], list) else [messages]
        prompts = [{"prompt_token_ids": tok.encode_chat(m)} for m in convs]  # type: ignore[arg-type]
        return self.generate(prompts, sampling_params)

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def reset_prefix_cache(self) -> bool:
        return self.engine.reset_prefix_cache()
