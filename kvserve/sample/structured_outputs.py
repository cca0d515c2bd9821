"""The structured-outputs mask: each constrained request's grammar matcher limits its next
token, through the token-bitmask hook (:mod:`kvserve.sample.token_bitmask`).

A request's matcher is made when it joins the batch, from the constraint compiled once per
(constraint, tokenizer) (:mod:`kvserve.structured.compiler`); each of ``n`` samples has its
own, and a request recomputed after preemption rejoins with its output so far, which its new
matcher consumes first, so the grammar is exactly where the committed tokens left it. The
matcher advances only on committed tokens (``accept_token``, called by the runner after the
step's tokens are chosen).

The step's bitmask is filled on a worker thread while the forward pass runs: the runner asks
for the step's plan before the forward (:meth:`StepPlan.prepare`), which starts the fill, and
:meth:`bitmask` waits for it when the sampler applies the mask. Ids the tokenizer does not
have (a padded embedding's rows) are always masked. A batch with no constrained request does
none of this: the processor has no rows, so the plan never names it.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from kvserve.errors import InvalidRequestError
from kvserve.kernels.host_device import to_device
from kvserve.sample.logits_processors import RequestView
from kvserve.sample.token_bitmask import (
    TokenBitmaskLogitsProcessor,
    TokenBitmaskState,
    bitmask_words,
    token_ids_to_bitmask,
)
from kvserve.structured.backend import Matcher
from kvserve.structured.compiler import GrammarCompiler

log = logging.getLogger("kvserve.structured")


class GrammarState(TokenBitmaskState):
    """One sample's matcher. ``failed``: a committed token the grammar refused (only a token
    the mask did not decide can be one); the row then allows only EOS, ending the request."""

    __slots__ = ("matcher", "failed")

    def __init__(self, matcher: Matcher) -> None:
        self.matcher = matcher
        self.failed = False

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_bitmask(bitmask, row)

    def accept_token(self, token: int) -> None:
        if self.failed or self.matcher.is_terminated():
            return  # the EOS that ends a finished or failed grammar: nothing to advance
        if not self.matcher.accept_token(token):
            self.failed = True
            log.warning("structured outputs: the grammar refused committed token %d", token)


class StructuredOutputsLogitsProcessor(TokenBitmaskLogitsProcessor[GrammarState]):
    """Masks each constrained row to the tokens its grammar allows next."""

    prepares = True
    masks_logprobs = True

    def __init__(
        self,
        vocab_size: int,
        device: torch.device | str = "cpu",
        compiler: GrammarCompiler | None = None,
    ) -> None:
        super().__init__(vocab_size, device)
        self.compiler = compiler
        self._pool: ThreadPoolExecutor | None = None
        self._pending: tuple[list[GrammarState], Future] | None = None
        self._last: tuple[list[GrammarState], torch.Tensor] | None = None
        self._vocab_bits: torch.Tensor | None = None
        self._eos_bits: torch.Tensor | None = None

    def new_state(self, request: RequestView) -> GrammarState | None:
        so = request.sampling_params.structured_outputs
        if so is None:
            return None
        if self.compiler is None:
            raise InvalidRequestError(
                "structured_outputs: this engine has no grammar compiler", "structured_outputs"
            )
        matcher = self.compiler.compile(so).matcher()
        state = GrammarState(matcher)
        for t in request.output_token_ids:  # a recompute: back to where the output left it
            state.accept_token(t)
        if self._vocab_bits is None:
            known = min(self.compiler.tokenizer_vocab_size or self.vocab_size, self.vocab_size)
            self._vocab_bits = token_ids_to_bitmask(list(range(known)), self.vocab_size)
            eos = self.compiler.backend().eos_token_ids
            self._eos_bits = token_ids_to_bitmask(list(eos), self.vocab_size)
        return state

    def _fill(self, states: list[GrammarState]) -> torch.Tensor:
        mask = torch.full((len(states), bitmask_words(self.vocab_size)), -1, dtype=torch.int32)
        # A finished or failed grammar allows only EOS (which ends the request); the libraries
        # are asked only about the others.
        done = [row for row, s in enumerate(states) if s.failed or s.matcher.is_terminated()]
        if done:
            finished = set(done)
            live = [row for row in range(len(states)) if row not in finished]
            part = mask[live] if live else None
            if live:
                self.compiler.backend().fill_bitmasks([states[r].matcher for r in live], part)
                mask[live] = part
            mask[done] = self._eos_bits
        else:
            self.compiler.backend().fill_bitmasks([s.matcher for s in states], mask)
        mask &= self._vocab_bits
        return mask

    def apply(
        self, logits: torch.Tensor, rows: list[int], states: list[GrammarState]
    ) -> torch.Tensor:
        """The grammar's mask, then EOS forced on the rows whose grammar ended (or failed):
        the grammar's end stops the request, so it wins over ``min_tokens``, which masked EOS
        earlier in the chain and would otherwise leave such a row no token at all."""
        logits = super().apply(logits, rows, states)
        ended = [rows[i] for i, s in enumerate(states) if s.failed or s.matcher.is_terminated()]
        if ended:
            eos = list(self.compiler.backend().eos_token_ids)
            forced = torch.full((len(ended), logits.shape[1]), float("-inf"),
                                dtype=logits.dtype, device=logits.device)  # fmt: skip
            forced.index_fill_(1, to_device(eos, logits.device, torch.long), 0.0)
            logits.index_copy_(0, to_device(ended, logits.device, torch.long), forced)
        return logits

    def prepare(self, rows: list[int], states: list[GrammarState]) -> None:
        """Start filling the step's mask on the worker thread (the forward pass runs
        meanwhile)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvserve-bitmask")
        self._pending = (states, self._pool.submit(self._fill, states))

    def bitmask(self, states: list[GrammarState]) -> torch.Tensor:
        """The step's mask: the one the worker thread filled for these states, else (a plan
        made without :meth:`prepare`) filled now. Kept for the step's logprobs pass."""
        last = self._last
        if last is not None and last[0] is states:
            return last[1]
        pending, self._pending = self._pending, None
        if pending is not None and pending[0] is states:
            mask = pending[1].result()
        else:
            mask = self._fill(states)
        mask = to_device(mask, self.device)
        self._last = (states, mask)
        return mask
