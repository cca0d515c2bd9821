"""The offline API, vLLM-shaped: ``LLM(model=DIR).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvserve.attention.registry import AUTO, resolve_backend
from kvserve.config import EngineConfig
from kvserve.config_fields import build_config
from kvserve.engine import EngineStats, LLMEngine, PromptType
from kvserve.entrypoint import setup_process
from kvserve.model.tokenizer import Tokenizer
from kvserve.sched.request import InvalidRequestError, RequestOutput, SamplingParams


def engine_config(model: str, **kwargs: Any) -> EngineConfig:
    """The :class:`EngineConfig` of ``model`` and the keyword arguments ``LLM`` takes: every
    field of :class:`EngineConfig` and of the configs nested in it (``CacheConfig``,
    ``SchedulerConfig``: ``block_size=``, ``max_num_seqs=``, ...), by its field name, with
    its field's default (:mod:`kvserve.config_fields`). The simulator builds an engine from
    the same arguments. Raises :class:`~kvserve.config_fields.UnknownSettingError` (a
    ``ConfigError`` and a ``TypeError``) naming a keyword that is no setting."""
    config = build_config(EngineConfig, model=str(model), **kwargs)
    name = config.attention_backend
    if name is not None and name != AUTO:  # refused now, before anything is loaded
        resolve_backend(name, torch.device(config.device))
    return config


class LLM:
    """Offline batched generation, vLLM-style: ``LLM(model=DIR).generate(prompts, params)``."""

    def __init__(self, model: str, **kwargs: Any) -> None:
        """``model`` and the keyword arguments of :func:`engine_config` (vLLM's names). A
        program that builds an ``LLM`` is an entry point: the process is set up first
        (:func:`kvserve.entrypoint.setup_process`)."""
        config = engine_config(model, **kwargs)
        setup_process()
        self.engine = LLMEngine(config)

    def shutdown(self) -> None:
        """Stop the engine's workers and offload threads (also done at exit)."""
        self.engine.shutdown()

    def get_tokenizer(self) -> Tokenizer | None:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        priority: Sequence[int] | None = None,
        use_tqdm: bool | Callable[..., Any] = False,
    ) -> list[RequestOutput]:
        """Generate for every prompt; returns one output per prompt, in order. A prompt that
        fails validation raises before any is queued, so nothing is half-submitted.
        ``priority`` (vLLM's: lower is served first) matters under
        ``scheduling_policy="priority"``. ``use_tqdm`` (vLLM's): True shows a tqdm bar of
        the finished prompts on stderr; a callable makes the bar, as ``tqdm`` is called
        (``use_tqdm(total=N, desc=...)``, anything with ``update(n)`` and ``close()``). Off
        by default, unlike vLLM's: a library call should not write to the terminal."""
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
        bar = _progress_bar(use_tqdm, len(ids))
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        finally:
            if bar is not None:
                bar.close()
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


def _progress_bar(use_tqdm: bool | Callable[..., Any], total: int) -> Any:
    if not use_tqdm:
        return None
    if callable(use_tqdm):
        return use_tqdm(total=total, desc="Processed prompts")
    from tqdm import tqdm  # huggingface_hub's dependency, so always installed with kvserve

    return tqdm(total=total, desc="Processed prompts", unit="prompt")
