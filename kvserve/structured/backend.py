"""The interface a grammar library implements: compile a constraint once, then one matcher per
sample from it.

A :class:`GrammarBackend` is built for one tokenizer (its ``tokenizer.json`` text, the model's
vocabulary size, which may exceed the tokenizer's when the embedding is padded, and the EOS
ids). ``compile`` turns a :class:`~kvserve.structured.params.StructuredOutputsParams` into a
:class:`CompiledGrammar` or raises :class:`GrammarError` with the library's message; the
compiled grammar makes a :class:`Matcher` per sample (a cheap copy of a template, so ``n``
samples and a recompute after preemption never compile again). A matcher fills its row of the
step's int32 bitmask (``kvserve.sample.token_bitmask``'s format, which both libraries write)
and advances on each committed token. When the grammar is complete only the EOS ids remain
allowed, so a request ends with ``finish_reason: stop`` on its own.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from kvserve.structured.params import StructuredOutputsParams


class GrammarError(ValueError):
    """A constraint the library cannot compile (a bad schema or regex, an unsupported
    feature); the message is the library's."""


class Matcher(ABC):
    """One sample's position in a compiled grammar."""

    __slots__ = ()

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into ``bitmask[row]`` (int32, CPU, contiguous)."""

    @abstractmethod
    def accept_token(self, token: int) -> bool:
        """Advance on a committed token; False when the grammar does not allow it."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """The grammar is complete and can take no more tokens (EOS included)."""


class CompiledGrammar(ABC):
    @abstractmethod
    def matcher(self) -> Matcher:
        """A fresh matcher at the grammar's start."""


class GrammarBackend(ABC):
    name: str

    def __init__(
        self, tokenizer_json: str, vocab_size: int, eos_token_ids: tuple[int, ...]
    ) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids

    @abstractmethod
    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """The constraint compiled for this tokenizer; :class:`GrammarError` if it cannot be."""

    def fill_bitmasks(self, matchers: list[Matcher], bitmask: torch.Tensor) -> None:
        """Row ``i`` of ``bitmask`` from ``matchers[i]`` (a library may do this in parallel)."""
        for row, m in enumerate(matchers):
            m.fill_bitmask(bitmask, row)


def choice_literals(choice: list[str]) -> str:
    """The alternatives as grammar string literals (JSON escapes, which both Lark and
    xgrammar's EBNF read)."""
    import json

    return " | ".join(json.dumps(c, ensure_ascii=False) for c in choice)
