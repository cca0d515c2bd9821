"""Logits processors: per-request changes to a step's logits, batched over the rows that use
them and applied in one fixed order.

The shape is vLLM v1's. A processor is one object per kind, held by the sampler. When a request
joins the batch (the runner creates its :class:`~kvserve.sample.sampler.SamplingState` from the
step's ``NewRequestData``), each processor makes the request's state from its sampling
parameters, or None when the request does not use it; the state lives on the request's
``SamplingState`` and is dropped with it when the request leaves. Each step a processor that
some row uses is applied once, to all of its rows (``apply(logits, rows, states)``: a few
tensor ops for the batch, no loop over tokens); one that no row uses costs nothing, so a batch
of plain greedy or temperature requests does the sampler's work and nothing more. After the
step each state sees the token its request sampled (``accept_token``), which is how a grammar's
matcher advances.

The order (vLLM's processors; this order is the engine's contract):

1. penalties: repetition (over the prompt and the output), frequency, presence
   (:class:`~kvserve.sample.builtin_processors.PenaltiesLogitsProcessor`);
2. ``min_tokens``: the request's stop and EOS tokens masked until it has that many tokens;
3. ``logit_bias``: added to the named tokens' logits;
4. token masks: ``allowed_token_ids``, then (the structured-outputs hook) a grammar's bitmask
   (:mod:`kvserve.sample.token_bitmask`). Masks set ``-inf``, which no later addition revives,
   and come last among the processors that can move the argmax, so a bias or a penalty never
   brings a masked token back;
5. then the sampler: greedy rows take the argmax (see its near-tie rescoring); the other rows
   are divided by their temperature, the argmax-invariant processors apply, then top-k, top-p
   and min-p cut and one token is drawn.

A processor declares whether it can change a row's argmax (vLLM's ``is_argmax_invariant``): one
that cannot is applied only to sampled rows and never to an all-greedy batch. It also declares
whether it is *additive*: it changes a row only by adding, per token, a term that does not
depend on the logit (a bias; ``-inf`` for a masked token). The greedy rescoring adds the same
term to its candidates' exact logits; a row that a non-additive processor changed (repetition
penalty divides positive logits and multiplies negative ones) keeps its plain argmax.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Generic, Protocol, TypeVar

import torch

from kvserve.kernels.host_device import to_device
from kvserve.sched.request import SamplingParams


class RequestView(Protocol):
    """What a processor may read of a request when it joins: its parameters, prompt and
    output so far (``output_token_ids`` is the request's live list, which grows after each
    step) and its EOS ids (empty under ``ignore_eos``)."""

    @property
    def sampling_params(self) -> SamplingParams: ...

    @property
    def prompt_token_ids(self) -> list[int]: ...

    @property
    def output_token_ids(self) -> list[int]: ...

    @property
    def eos_token_ids(self) -> tuple[int, ...]: ...


class RequestLogitsState:
    """One request's state for one processor, made when the request joins the batch."""

    __slots__ = ()

    def active(self) -> bool:
        """Whether it changes the request's logits at the coming step (``min_tokens`` stops
        once the request has them)."""
        return True

    def accept_token(self, token: int) -> None:
        """The token the request sampled at the step just run (a grammar advances on it)."""


S = TypeVar("S", bound=RequestLogitsState)


class LogitsProcessor(ABC, Generic[S]):
    """One kind of change to the logits, applied to the rows of the requests that use it;
    ``S`` is the type of its per-request state."""

    #: True when it cannot change which token a row's highest logit belongs to (vLLM's
    #: ``is_argmax_invariant``): it then applies only to sampled rows, after temperature.
    argmax_invariant: ClassVar[bool] = False
    #: True when it changes a row only by adding a per-token term independent of the logit
    #: (``-inf`` masks included): greedy rescoring carries the term over to exact logits.
    additive: ClassVar[bool] = True
    #: True when it has work to start before the forward pass (:meth:`prepare`).
    prepares: ClassVar[bool] = False
    #: True when the returned logprobs are taken after it (vLLM applies the grammar's mask
    #: before its logprobs: only tokens the grammar allows appear among ``top_logprobs``).
    masks_logprobs: ClassVar[bool] = False

    def __init__(self, vocab_size: int, device: torch.device | str = "cpu") -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)

    @abstractmethod
    def new_state(self, request: RequestView) -> S | None:
        """The request's state, or None when this processor leaves its rows alone. Called
        once, when the request joins; tensors it needs every step are built here."""

    @abstractmethod
    def apply(self, logits: torch.Tensor, rows: list[int], states: list[S]) -> torch.Tensor:
        """Change ``rows`` (ascending row indices of ``logits`` [batch, vocab], float32) for
        the requests whose ``states`` are given in the same order; may work in place, and
        returns the logits."""

    def prepare(self, rows: list[int], states: list[S]) -> None:
        """Called (when ``prepares``) with the step's rows and states before the forward
        pass, so work that needs no logits (a grammar's mask) overlaps it."""


@dataclass(slots=True)
class StepPlan:
    """The processors one step applies: each with its rows and their states, in order."""

    groups: list[tuple[LogitsProcessor, list[int], list[RequestLogitsState]]]
    # Rows a non-additive processor changes: greedy rescoring leaves them their argmax.
    not_additive_rows: frozenset[int]

    @property
    def changes_argmax(self) -> bool:
        return any(not p.argmax_invariant for p, _, _ in self.groups)

    def prepare(self) -> StepPlan:
        """Start the processors' work that can run beside the forward pass."""
        for proc, rows, states in self.groups:
            if proc.prepares:
                proc.prepare(rows, states)
        return self

    def logprobs_base(self, raw: torch.Tensor) -> torch.Tensor:
        """The logits the returned logprobs come from: ``raw`` with the masks of the
        processors that declare ``masks_logprobs`` (a copy; ``raw`` itself when none)."""
        out = raw
        for proc, rows, states in self.groups:
            if proc.masks_logprobs:
                out = proc.apply(out.clone() if out is raw else out, rows, states)
        return out

    def apply(self, logits: torch.Tensor, argmax_invariant: bool) -> torch.Tensor:
        """The processors of one kind (argmax-invariant or not), in order."""
        for proc, rows, states in self.groups:
            if proc.argmax_invariant == argmax_invariant:
                logits = proc.apply(logits, rows, states)
        return logits


class LogitsProcessors:
    """The sampler's processors in their fixed order: the per-request states they make and
    the plan of each step."""

    def __init__(self, processors: Sequence[LogitsProcessor]) -> None:
        self.processors = tuple(processors)

    def new_states(
        self, request: RequestView
    ) -> tuple[tuple[LogitsProcessor, RequestLogitsState], ...]:
        """The joining request's state for each processor it uses, in order."""
        out = []
        for proc in self.processors:
            state = proc.new_state(request)
            if state is not None:
                out.append((proc, state))
        return tuple(out)

    def plan(self, requests: Sequence) -> StepPlan | None:
        """The step's processors over the batch (``requests[i]`` samples from row i and holds
        ``logits_states`` from :meth:`new_states`); None when no row uses one."""
        groups: dict[LogitsProcessor, tuple[list[int], list[RequestLogitsState]]] = {}
        for row, r in enumerate(requests):
            for proc, state in r.logits_states:
                if state.active():
                    g = groups.get(proc)
                    if g is None:
                        g = groups[proc] = ([], [])
                    g[0].append(row)
                    g[1].append(state)
        if not groups:
            return None
        ordered = [(p, *groups[p]) for p in self.processors if p in groups]
        plain = frozenset(row for p, rows, _ in ordered if not p.additive for row in rows)
        return StepPlan(ordered, plain)


def select_rows(logits: torch.Tensor, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``rows`` of ``logits`` and their index tensor; the logits themselves (no copy, index
    None) when the rows are the whole batch, as in a batch whose every request uses the
    processor. Pair with :func:`put_rows`."""
    if len(rows) == logits.shape[0]:
        return logits, None
    index = to_device(rows, logits.device, torch.long)
    return logits.index_select(0, index), index


def put_rows(
    logits: torch.Tensor, index: torch.Tensor | None, values: torch.Tensor
) -> torch.Tensor:
    """Write rows taken by :func:`select_rows` back; returns the logits."""
    if index is None:
        if values is not logits:
            logits.copy_(values)
        return logits
    return logits.index_copy_(0, index, values)
