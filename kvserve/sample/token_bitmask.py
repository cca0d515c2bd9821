"""Token masks: which tokens a row may take next, as a bitmask over the vocabulary.

The format is the one grammar libraries fill (xgrammar's ``fill_next_token_bitmask``,
llguidance's ``fill_next_token_bitmask``): int32 ``[rows, ceil(vocab / 32)]``, token ``t``
allowed when bit ``t % 32`` of word ``t // 32`` is set. A forbidden token is a cleared bit, so
one mask expresses both an allow list and a deny list.

:class:`TokenBitmaskLogitsProcessor` is the hook for structured outputs: a grammar's
per-request state implements :class:`TokenBitmaskState` (fill its row from the matcher, advance
the matcher on each sampled token) and a subclass of the processor owns those states; the
processor applies the step's whole bitmask in one pass. ``allowed_token_ids`` is the first
such mask, a fixed one.
"""

from __future__ import annotations

from typing import TypeVar

import torch

from kvserve.kernels.host_device import to_device
from kvserve.sample.logits_processors import (
    LogitsProcessor,
    RequestLogitsState,
    RequestView,
    put_rows,
    select_rows,
)


def bitmask_words(vocab_size: int) -> int:
    return -(-vocab_size // 32)


def token_ids_to_bitmask(token_ids: list[int], vocab_size: int) -> torch.Tensor:
    """An int32 ``[ceil(vocab / 32)]`` row with the bits of ``token_ids`` set (ids outside the
    vocabulary are left out: they cannot be sampled anyway)."""
    ids = torch.tensor(sorted({t for t in token_ids if 0 <= t < vocab_size}), dtype=torch.long)
    flags = torch.zeros(bitmask_words(vocab_size) * 32, dtype=torch.int64)
    flags[ids] = 1
    words = (flags.view(-1, 32) << torch.arange(32)).sum(dim=1)  # the low 32 bits of each word
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Bool ``[rows, vocab]``: True where the token is allowed."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_token_bitmask_(
    logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor
) -> torch.Tensor:
    """Set ``-inf`` where ``bitmask`` ([len(rows), words]) forbids a token in ``rows``."""
    x, index = select_rows(logits, rows)
    allowed = unpack_bitmask(bitmask, logits.shape[1])
    return put_rows(logits, index, x.masked_fill_(~allowed, float("-inf")))


class TokenBitmaskState(RequestLogitsState):
    """A request whose next token is limited to a set that may change each step (a grammar's
    matcher). ``fill_bitmask`` writes the set for the coming step into its row (the row starts
    with every bit set); ``accept_token`` (inherited) advances it on each sampled token."""

    __slots__ = ()

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        raise NotImplementedError


T = TypeVar("T", bound=TokenBitmaskState)


class TokenBitmaskLogitsProcessor(LogitsProcessor[T]):
    """Restricts each of its rows to the tokens its state's bitmask allows: the mask stage's
    base. A subclass makes :class:`TokenBitmaskState` states in ``new_state``; this class
    builds the step's bitmask (:meth:`bitmask`) and applies it in one pass."""

    def bitmask(self, states: list[T]) -> torch.Tensor:
        """The step's int32 ``[len(states), words]`` mask, each row filled by its state."""
        mask = torch.full(
            (len(states), bitmask_words(self.vocab_size)), -1, dtype=torch.int32,
            device=self.device,
        )  # fmt: skip
        for row, state in enumerate(states):
            state.fill_bitmask(mask, row)
        return mask

    def apply(self, logits: torch.Tensor, rows: list[int], states: list[T]) -> torch.Tensor:
        return apply_token_bitmask_(logits, rows, self.bitmask(states))


class AllowedTokens(TokenBitmaskState):
    """``allowed_token_ids``: the same bitmask row every step, built when the request joins."""

    __slots__ = ("bits",)

    def __init__(self, bits: torch.Tensor) -> None:
        self.bits = bits

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row] &= self.bits


class AllowedTokenIdsLogitsProcessor(TokenBitmaskLogitsProcessor[AllowedTokens]):
    """vLLM's ``allowed_token_ids``: every other token is masked."""

    def new_state(self, request: RequestView) -> AllowedTokens | None:
        ids = request.sampling_params.allowed_token_ids
        if ids is None:
            return None
        return AllowedTokens(to_device(token_ids_to_bitmask(ids, self.vocab_size), self.device))

    def bitmask(self, states: list[AllowedTokens]) -> torch.Tensor:
        """Fixed rows: stacked in one op rather than filled row by row."""
        return torch.stack([s.bits for s in states])
