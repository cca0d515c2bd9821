"""Compiling constraints: a thread pool, a cache keyed by (constraint, tokenizer) and a time
limit.

The engine compiles a request's constraint when it takes the request
(:meth:`GrammarCompiler.compile`), so a schema the library rejects, or one that takes longer
than ``--structured-outputs-compile-timeout``, is an
:class:`~kvserve.errors.InvalidRequestError` naming the field (``structured_outputs.json``)
before anything is queued: the engine never sees it. The compile runs on a pool thread and the
caller waits at most the limit; a compile that overruns is left to finish on its thread (the
libraries cannot be interrupted) and its result, if any, is cached. The same cache serves the
worker in the engine's process, so the runner's matchers never compile twice; a worker in
another process has its own (:func:`grammar_compiler`).
"""

from __future__ import annotations

import functools
import json
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any

from kvserve.errors import InvalidRequestError
from kvserve.structured.backend import CompiledGrammar, GrammarBackend, GrammarError
from kvserve.structured.params import StructuredOutputsParams

CACHE_ENTRIES = 256


def make_backend(
    name: str, tokenizer_json: str, vocab_size: int, eos_token_ids: tuple[int, ...]
) -> GrammarBackend:
    """The named library's backend; a missing optional library is a clear error."""
    if name == "llguidance":
        from kvserve.structured.llguidance_backend import LLGuidanceBackend

        return LLGuidanceBackend(tokenizer_json, vocab_size, eos_token_ids)
    if name == "xgrammar":
        try:
            from kvserve.structured.xgrammar_backend import XGrammarBackend
        except ImportError as e:
            raise InvalidRequestError(
                f"structured_outputs: the xgrammar backend needs `pip install "
                f"kvserve[xgrammar]` ({e})", field="structured_outputs",
            ) from None  # fmt: skip
        return XGrammarBackend(tokenizer_json, vocab_size, eos_token_ids)
    raise ValueError(f"structured_outputs_backend: unknown backend {name!r}")


class GrammarCompiler:
    """Constraints compiled for one tokenizer by one backend, cached (LRU, by the constraint's
    :meth:`~StructuredOutputsParams.key`) and bounded in time. The backend (which reads the
    tokenizer, ~0.1-1 s) is built on first use, so an engine that never sees a constrained
    request never loads a grammar library."""

    def __init__(
        self,
        backend: str,
        tokenizer_dir: str | Path | None,
        vocab_size: int,
        eos_token_ids: tuple[int, ...] = (),
        timeout: float = 5.0,
        threads: int = 2,
    ) -> None:
        """``vocab_size``: the model's (its logits' width, past the tokenizer's when the
        embedding is padded); ``eos_token_ids``: the model's, beside the tokenizer's own."""
        self.backend_name = backend
        self.tokenizer_dir = None if tokenizer_dir is None else Path(tokenizer_dir)
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.timeout = timeout
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="kvserve-grammar")
        self._lock = threading.Lock()
        self._backend: GrammarBackend | None = None
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self.tokenizer_vocab_size = 0

    def backend(self) -> GrammarBackend:
        with self._lock:
            if self._backend is None:
                tok = None if self.tokenizer_dir is None else self.tokenizer_dir / "tokenizer.json"
                if tok is None or not tok.exists():
                    raise InvalidRequestError(
                        "structured_outputs: needs the model's tokenizer.json, which this "
                        "model does not have", field="structured_outputs",
                    )  # fmt: skip
                text = tok.read_text()
                vocab, eos = _tokenizer_facts(self.tokenizer_dir, text, self.eos_token_ids)
                self.tokenizer_vocab_size = vocab
                self._backend = make_backend(self.backend_name, text, self.vocab_size, eos)
            return self._backend

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """The compiled constraint, from the cache or the pool within the time limit;
        :class:`InvalidRequestError` naming ``params.field`` when it cannot be had."""
        backend = self.backend()
        key = params.key()
        with self._lock:
            fut = self._cache.get(key)
            if fut is None:
                fut = self._cache[key] = self._pool.submit(backend.compile, params)
                while len(self._cache) > CACHE_ENTRIES:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(key)
        try:
            return fut.result(timeout=self.timeout)
        except FutureTimeout:
            with self._lock:  # not kept: the next request with it tries again
                if self._cache.get(key) is fut:
                    del self._cache[key]
            raise InvalidRequestError(
                f"{params.field}: took longer than {self.timeout:g} s to compile "
                f"(--structured-outputs-compile-timeout); simplify the constraint",
                field=params.field,
            ) from None
        except GrammarError as e:
            raise InvalidRequestError(
                f"{params.field}: {self.backend_name} cannot compile it: {e}", field=params.field
            ) from None


def _tokenizer_facts(
    tok_dir: Path, text: str, model_eos: tuple[int, ...]
) -> tuple[int, tuple[int, ...]]:
    """The tokenizer's vocabulary size (added tokens included) and the EOS ids: the model's
    and the tokenizer config's ``eos_token`` (as the engine's tokenizer reads them)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(text)
    eos = list(model_eos)
    cfg_file = tok_dir / "tokenizer_config.json"
    if cfg_file.exists():
        name = json.loads(cfg_file.read_text()).get("eos_token")
        name = name.get("content") if isinstance(name, dict) else name
        tid = tok.token_to_id(name) if isinstance(name, str) else None
        if tid is not None:
            eos.append(tid)
    return tok.get_vocab_size(with_added_tokens=True), tuple(dict.fromkeys(eos))


@functools.lru_cache(maxsize=8)
def grammar_compiler(
    backend: str,
    tokenizer_dir: str | None,
    vocab_size: int,
    eos_token_ids: tuple[int, ...],
    timeout: float,
) -> GrammarCompiler:
    """One compiler per (backend, tokenizer) in a process: the engine's request checks and the
    runner's matchers share it (and its cache) when the worker runs in the engine's process."""
    return GrammarCompiler(backend, tokenizer_dir, vocab_size, eos_token_ids, timeout)


def engine_grammar_compiler(
    config: Any, model_dir: str | Path, model_config: Any
) -> GrammarCompiler:
    """The compiler an engine (``config``: its :class:`~kvserve.config.EngineConfig`) and its
    in-process worker share: the model's tokenizer, vocabulary size and EOS ids."""
    so = config.structured_outputs
    tok_dir = str(config.tokenizer or model_dir)
    return grammar_compiler(
        so.structured_outputs_backend, tok_dir, model_config.vocab_size,
        tuple(model_config.eos_token_ids), float(so.structured_outputs_compile_timeout),
    )  # fmt: skip
