"""Token sampling for a batch of requests, vectorised over rows.

Order of operations (vLLM's): penalties, then ``min_tokens`` masking of stop tokens, then
greedy rows take the argmax (with a reduced-precision model, the argmax among the top
``RESCORE_TOPK`` candidates re-scored in float32 when the runner offers ``rescore``: a bf16 LM
head rounds logits by up to a few hundredths, enough to flip near-ties, and re-scoring four
rows of the float32 head costs nothing next to the full projection); the other rows are divided
by their temperature, cut by top-k, top-p and min-p, and drawn by the exponential race
(argmax of ``p / E`` with ``E ~ Exp(1)``), which equals sampling from ``p``. A row with its
own ``seed`` draws ``E`` from its own generator, so its tokens do not depend on what else is in
the batch. Returned logprobs are those of the raw model distribution (before penalties and
temperature), as vLLM returns.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvserve.kernels.pointwise import topk_rows
from kvserve.sched.request import SamplingParams


class SamplingState:
    """What sampling needs of one request, kept by the runner between steps: its parameters,
    the prompt (repetition penalty), the tokens drawn so far (penalties, ``min_tokens``) and a
    seeded request's own generator."""

    __slots__ = (
        "sampling_params",
        "prompt_token_ids",
        "output_token_ids",
        "eos_token_ids",
        "generator",
    )

    def __init__(
        self,
        sampling_params: SamplingParams,
        prompt_token_ids: list[int],
        output_token_ids: list[int] | None = None,
        eos_token_ids: tuple[int, ...] = (),
    ) -> None:
        self.sampling_params = sampling_params
        self.prompt_token_ids = prompt_token_ids
        self.output_token_ids = [] if output_token_ids is None else output_token_ids
        self.eos_token_ids = () if sampling_params.ignore_eos else tuple(eos_token_ids)
        self.generator: Any = None

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


class Sampler:
    def __init__(self, vocab_size: int, seed: int = 0, device: torch.device | str = "cpu") -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)

    def __call__(
        self, logits: torch.Tensor, requests: list[SamplingState], rescore: Rescore | None = None
    ) -> SamplerOutput:
        """``rescore(rows, token_ids)``: exact (float32) logits of those tokens for those rows,
        used to settle greedy choices among the top candidates (see the module docstring)."""
        raw = logits
        params = [r.sampling_params for r in requests]
        if any(p.uses_penalties for p in params):
            logits = self._apply_penalties(logits.clone(), requests)
        logits = self._mask_stop_tokens(logits, requests)

        greedy = self._greedy(logits, params, rescore)
        if all(p.greedy for p in params):
            token_ids = greedy
        else:
            token_ids = self._sample(logits, requests, greedy)

        want = [p.logprobs for p in params]
        logprobs: list[dict[int, float] | None] = [None] * len(requests)
        sampled_lp: list[float] | None = None
        if any(n is not None for n in want):
            lsm = torch.log_softmax(raw.float(), dim=-1)
            chosen = lsm.gather(1, token_ids[:, None])[:, 0].tolist()
            k = max(n or 0 for n in want)
            top_val, top_idx = lsm.topk(k, dim=-1) if k else (None, None)
            sampled_lp = chosen
            ids = token_ids.tolist()
            for row, n in enumerate(want):
                if n is None:
                    continue
                entry = {ids[row]: chosen[row]}
                if n and top_idx is not None:
                    for t, v in zip(
                        top_idx[row, :n].tolist(), top_val[row, :n].tolist(), strict=True
                    ):
                        entry.setdefault(t, v)
                logprobs[row] = entry
            return SamplerOutput(ids, logprobs, sampled_lp)
        return SamplerOutput(token_ids.tolist(), logprobs, sampled_lp)

    # -- steps ----------------------------------------------------------------------
    @staticmethod
    def _greedy(logits: torch.Tensor, params: list, rescore: Rescore | None) -> torch.Tensor:
        if rescore is None:
            return logits.argmax(dim=-1)
        # Rows whose logits are the model's own (penalties change them) and that pick greedily.
        rows = [i for i, p in enumerate(params) if p.greedy and not p.uses_penalties]
        if not rows:
            return logits.argmax(dim=-1)
        k = min(RESCORE_TOPK, logits.shape[1])
        if len(rows) == logits.shape[0]:  # the usual batch: no argmax, no row copy
            r = torch.arange(len(rows), device=logits.device)
            top_v, top_i = _top(logits, k)
            exact = rescore(r, top_i).masked_fill(torch.isneginf(top_v), float("-inf"))
            return top_i.gather(1, exact.argmax(dim=-1, keepdim=True))[:, 0]
        best = logits.argmax(dim=-1)
        r = torch.tensor(rows, device=logits.device)
        top_v, top_i = _top(logits[r], k)
        exact = rescore(r, top_i).masked_fill(torch.isneginf(top_v), float("-inf"))
        best[r] = top_i.gather(1, exact.argmax(dim=-1, keepdim=True))[:, 0]
        return best

    def _apply_penalties(self, logits: torch.Tensor, requests: list[SamplingState]) -> torch.Tensor:
        b, v = logits.shape
        out_counts = torch.zeros(b, v, device=logits.device)
        seen = torch.zeros(b, v, dtype=torch.bool, device=logits.device)
        rep = torch.ones(b, 1, device=logits.device)
        freq = torch.zeros(b, 1, device=logits.device)
        pres = torch.zeros(b, 1, device=logits.device)
        for row, r in enumerate(requests):
            p = r.sampling_params
            if not p.uses_penalties:
                continue
            out = torch.tensor(r.output_token_ids, dtype=torch.long, device=logits.device)
            out = out[out < v]
            out_counts[row].index_add_(0, out, torch.ones_like(out, dtype=torch.float))
            if p.repetition_penalty != 1.0:
                prompt = torch.tensor(r.prompt_token_ids, dtype=torch.long, device=logits.device)
                seen[row, prompt[prompt < v]] = True
            rep[row], freq[row], pres[row] = (
                p.repetition_penalty,
                p.frequency_penalty,
                p.presence_penalty,
            )
        seen |= out_counts > 0
        penalised = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen, penalised, logits)
        return logits - freq * out_counts - pres * (out_counts > 0).float()

    def _mask_stop_tokens(
        self, logits: torch.Tensor, requests: list[SamplingState]
    ) -> torch.Tensor:
        rows, cols = [], []
        for row, r in enumerate(requests):
            p = r.sampling_params
            if p.min_tokens and r.num_output_tokens < p.min_tokens:
                stops = set(r.eos_token_ids) | set(p.stop_token_ids or ())
                for t in stops:
                    if t < logits.shape[1]:
                        rows.append(row)
                        cols.append(t)
        if rows:
            logits = logits.clone()
            logits[rows, cols] = float("-inf")
        return logits

    def _sample(
        self, logits: torch.Tensor, requests: list[SamplingState], greedy_ids: torch.Tensor
    ) -> torch.Tensor:
        params = [r.sampling_params for r in requests]
        dev = logits.device
        greedy = torch.tensor([p.greedy for p in params], device=dev)
        temp = torch.tensor([1.0 if p.greedy else p.temperature for p in params], device=dev)
        scaled = logits / temp[:, None]
        if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
            scaled = _top_k_top_p(scaled, params)
        probs = scaled.softmax(dim=-1)
        if any(p.min_p > 0 for p in params):
            min_p = torch.tensor([p.min_p for p in params], device=dev)
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


def _top_k_top_p(logits: torch.Tensor, params: list) -> torch.Tensor:
    dev = logits.device
    v = logits.shape[1]
    k = torch.tensor([p.top_k if p.top_k > 0 else v for p in params], device=dev).clamp(max=v)
    top_p = torch.tensor([p.top_p for p in params], device=dev)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(v, device=dev)[None, :]
    drop = ranks >= k[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass strictly before each token
    drop = before > top_p[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
