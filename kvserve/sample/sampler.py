"""Token sampling for a batch of requests, vectorised over rows.

Order of operations: the logits processors that some row uses, in their fixed order
(penalties, ``min_tokens``, ``logit_bias``, token masks: :mod:`kvserve.sample.logits_processors`);
then greedy rows take the argmax, and the other rows are divided by their temperature, go
through the argmax-invariant processors, are cut by top-k, top-p and min-p, and are drawn by
the exponential race (argmax of ``p / E`` with ``E ~ Exp(1)``), which equals sampling from
``p``. A row with its own ``seed`` draws ``E`` from its own generator, so its tokens do not
depend on what else is in the batch. Returned logprobs are those of the raw model distribution
(before processors and temperature), as vLLM returns, except that a grammar's mask
(structured outputs) applies first: only tokens the grammar allows are among them.

Greedy rescoring: with a reduced-precision model, when the runner offers ``rescore``, a greedy
row takes the best of its top ``RESCORE_TOPK`` candidates re-scored in float32 (a bf16 LM head
rounds logits by up to a few hundredths, enough to flip near-ties, and re-scoring four rows of
the float32 head costs nothing next to the full projection). The candidates are the top of the
*processed* logits, and each exact logit gets what the processors added to its token (the
processed minus the raw logit): a masked token (``-inf``) is never chosen, and a bias that
lifted a token above a near-tie is not undone by the rescoring. That holds for additive
processors (biases and masks); a row that a non-additive one changed (repetition penalty
scales logits, so the added term depends on the logit the rescore replaces) keeps its plain
argmax.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import EllipsisType
from typing import Any

import torch

from kvserve.kernels.host_device import to_device, to_host
from kvserve.kernels.pointwise import topk_rows
from kvserve.sample.builtin_processors import build_logits_processors
from kvserve.sample.logits_processors import LogitsProcessors, StepPlan
from kvserve.sched.request import SamplingParams
from kvserve.structured.compiler import GrammarCompiler


class SamplingState:
    """What sampling needs of one request, kept by the runner between steps: its parameters,
    the prompt (repetition penalty), the tokens drawn so far, a seeded request's own generator
    and its logits processors' states (made from ``processors`` when it joins, dropped with
    it)."""

    __slots__ = (
        "sampling_params",
        "prompt_token_ids",
        "output_token_ids",
        "eos_token_ids",
        "generator",
        "logits_states",
    )

    def __init__(
        self,
        sampling_params: SamplingParams,
        prompt_token_ids: list[int],
        output_token_ids: list[int] | None = None,
        eos_token_ids: tuple[int, ...] = (),
        processors: LogitsProcessors | None = None,
    ) -> None:
        self.sampling_params = sampling_params
        self.prompt_token_ids = prompt_token_ids
        self.output_token_ids = [] if output_token_ids is None else output_token_ids
        self.eos_token_ids = () if sampling_params.ignore_eos else tuple(eos_token_ids)
        self.generator: Any = None
        self.logits_states = () if processors is None else processors.new_states(self)

    def append_token(self, token: int) -> None:
        """Record the token this request sampled; its processors' states see it."""
        self.output_token_ids.append(token)
        for _, state in self.logits_states:
            state.accept_token(token)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    # Per row: {token_id: logprob} with the sampled token and the top-n, or None.
    logprobs: list[dict[int, float] | None]
    sampled_logprobs: list[float] | None


RESCORE_TOPK = 4
Rescore = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (rows, token ids [n, k]) -> [n, k]


def _top(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's k best logits and their token ids: the native kernel where it applies (one
    pass over the row; torch.topk took a few milliseconds per decode step over a large
    vocabulary), else torch.topk."""
    top = topk_rows(logits, k)
    return top if top is not None else logits.topk(k, dim=-1)


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax (the lowest index among equal maxima): the native kernel's top-1
    where it applies (one vectorised pass over the row; torch's argmax reduction on a CPU is
    several times slower, once per decode step over the whole vocabulary), else
    torch.argmax (other dtypes, a NaN)."""
    top = topk_rows(logits, 1)
    return top[1][:, 0] if top is not None else logits.argmax(dim=-1)


class Sampler:
    def __init__(
        self,
        vocab_size: int,
        seed: int = 0,
        device: torch.device | str = "cpu",
        logits_processors: LogitsProcessors | None = None,
        grammar_compiler: GrammarCompiler | None = None,
    ) -> None:
        """``logits_processors``: the processors in their order (default: the built-in ones,
        :func:`~kvserve.sample.builtin_processors.build_logits_processors`, with
        ``grammar_compiler`` for structured outputs)."""
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)
        if logits_processors is None:
            logits_processors = build_logits_processors(vocab_size, self.device, grammar_compiler)
        self.logits_processors = logits_processors

    def add_request(
        self,
        sampling_params: SamplingParams,
        prompt_token_ids: list[int],
        output_token_ids: list[int] | None = None,
        eos_token_ids: tuple[int, ...] = (),
    ) -> SamplingState:
        """A joining request's sampling state, with its logits processors' states."""
        return SamplingState(sampling_params, prompt_token_ids, output_token_ids, eos_token_ids,
                             self.logits_processors)  # fmt: skip

    def plan(self, requests: list[SamplingState]) -> StepPlan | None:
        """The step's processors over ``requests``, their work that needs no logits started:
        a runner calls this before the forward pass and hands the plan to :meth:`__call__`."""
        plan = self.logits_processors.plan(requests)
        return None if plan is None else plan.prepare()

    def __call__(
        self,
        logits: torch.Tensor,
        requests: list[SamplingState],
        rescore: Rescore | None = None,
        plan: StepPlan | None | EllipsisType = ...,
    ) -> SamplerOutput:
        """``rescore(rows, token_ids)``: exact (float32) logits of those tokens for those rows,
        used to settle greedy choices among the top candidates (see the module docstring).
        ``plan``: from :meth:`plan` for these requests (default: made here).
        The caller records each sampled token with :meth:`SamplingState.append_token`."""
        raw = logits
        params = [r.sampling_params for r in requests]
        if plan is ...:
            plan = self.logits_processors.plan(requests)
        greedy_raw = None  # the raw logits, when processors changed what greedy rows see
        plain_rows: frozenset[int] = frozenset()
        if plan is not None and plan.changes_argmax:
            logits = plan.apply(logits.clone(), argmax_invariant=False)
            greedy_raw, plain_rows = raw, plan.not_additive_rows

        greedy = self._greedy(logits, params, rescore, greedy_raw, plain_rows)
        if all(p.greedy for p in params):
            token_ids = greedy
        else:
            token_ids = self._sample(logits, requests, greedy, plan)

        want = [p.logprobs for p in params]
        logprobs: list[dict[int, float] | None] = [None] * len(requests)
        if all(n is None for n in want):
            (ids,) = to_host(token_ids)  # the step's one wait for the device
            return SamplerOutput(ids, logprobs, None)
        base = raw if plan is None else plan.logprobs_base(raw)
        lsm = torch.log_softmax(base.float(), dim=-1)
        chosen = lsm.gather(1, token_ids[:, None])[:, 0]
        k = max(n or 0 for n in want)
        if not k:
            ids, sampled_lp = to_host(token_ids, chosen)
            top_idx = top_val = None
        else:
            top_v, top_i = lsm.topk(k, dim=-1)
            ids, sampled_lp, top_val, top_idx = to_host(token_ids, chosen, top_v, top_i)
        for row, n in enumerate(want):
            if n is None:
                continue
            entry = {ids[row]: sampled_lp[row]}
            if n:
                for t, v in zip(top_idx[row][:n], top_val[row][:n], strict=True):
                    if v != float("-inf"):  # a masked token is no candidate
                        entry.setdefault(t, v)
            logprobs[row] = entry
        return SamplerOutput(ids, logprobs, sampled_lp)

    # -- steps ----------------------------------------------------------------------
    @staticmethod
    def _greedy(
        logits: torch.Tensor,
        params: list[SamplingParams],
        rescore: Rescore | None,
        raw: torch.Tensor | None = None,
        plain_rows: frozenset[int] = frozenset(),
    ) -> torch.Tensor:
        """Each row's argmax; with ``rescore``, greedy rows outside ``plain_rows`` re-scored
        among their top candidates. ``raw``: the logits before the processors (None when
        none changed them), whose difference to ``logits`` each exact logit gets."""
        if rescore is None:
            return _argmax(logits)
        rows = [i for i, p in enumerate(params) if p.greedy and i not in plain_rows]
        if not rows:
            return _argmax(logits)
        k = min(RESCORE_TOPK, logits.shape[1])
        if len(rows) == logits.shape[0]:  # the usual batch: no argmax, no row copy
            r = torch.arange(len(rows), device=logits.device)
            top_v, top_i = _top(logits, k)
            exact = _processed(rescore(r, top_i), top_v, top_i, raw)
            return top_i.gather(1, exact.argmax(dim=-1, keepdim=True))[:, 0]
        best = _argmax(logits)
        r = to_device(rows, logits.device, torch.long)
        top_v, top_i = _top(logits.index_select(0, r), k)
        exact = _processed(rescore(r, top_i), top_v, top_i, None if raw is None else raw[r])
        best[r] = top_i.gather(1, exact.argmax(dim=-1, keepdim=True))[:, 0]
        return best

    def _sample(
        self,
        logits: torch.Tensor,
        requests: list[SamplingState],
        greedy_ids: torch.Tensor,
        plan: StepPlan | None,
    ) -> torch.Tensor:
        params = [r.sampling_params for r in requests]
        dev = logits.device
        greedy = to_device([p.greedy for p in params], dev)
        temp = to_device([1.0 if p.greedy else p.temperature for p in params], dev)
        scaled = logits / temp[:, None]
        if plan is not None:
            scaled = plan.apply(scaled, argmax_invariant=True)
        if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
            scaled = _top_k_top_p(scaled, params)
        probs = scaled.softmax(dim=-1)
        if any(p.min_p > 0 for p in params):
            min_p = to_device([p.min_p for p in params], dev)
            cut = probs < min_p[:, None] * probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(cut, 0.0)
        noise = torch.empty_like(probs)
        noise.exponential_(generator=self.generator)
        for row, r in enumerate(requests):
            if r.sampling_params.seed is not None and not r.sampling_params.greedy:
                if r.generator is None:
                    r.generator = torch.Generator(device=dev)
                    r.generator.manual_seed(r.sampling_params.seed)
                noise[row].exponential_(generator=r.generator)
        sampled = (probs / noise).argmax(dim=-1)
        return torch.where(greedy, greedy_ids, sampled)


def _processed(
    exact: torch.Tensor, top_v: torch.Tensor, top_i: torch.Tensor, raw: torch.Tensor | None
) -> torch.Tensor:
    """Exact logits of the candidates ``top_i`` (processed values ``top_v``) with what the
    processors added to each (``top_v - raw``); ``-inf`` where a candidate is masked."""
    if raw is not None:
        exact = exact + (top_v - raw.gather(1, top_i))
    return exact.masked_fill(torch.isneginf(top_v), float("-inf"))


def _top_k_top_p(logits: torch.Tensor, params: list) -> torch.Tensor:
    dev = logits.device
    v = logits.shape[1]
    k = to_device([min(p.top_k, v) if p.top_k > 0 else v for p in params], dev)
    top_p = to_device([p.top_p for p in params], dev)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(v, device=dev)[None, :]
    drop = ranks >= k[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass strictly before each token
    drop = before > top_p[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
