"""Running the suite on one engine, and the figures the gate compares.

One run = the generation tasks (greedy, through ``LLM.generate``) and the held-out passages
(full prompt log-softmax through ``LLMEngine.add_request(..., return_prompt_logits=True)``).
Both runs of a gate submit the same requests in the same order to engines with the same
scheduler settings and pool size, so every step batches the same tokens: any difference in
the outputs comes from the KV format (or the test-only hook), not from batch composition.

Perplexity, teacher-forced top-1 agreement and KL are all read from the same prompt logits.
Row ``i`` of a passage's logits predicts token ``i + 1``; every row enters agreement and KL
(the last row predicts the token after the passage, as valid a comparison as any other).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from kvserve.quality.suite import EARLY_DEPTH, Suite, item_hit

LogitsFn = Callable[[int, torch.Tensor], None]


@dataclass(slots=True)
class RunResult:
    """What one engine produced for a suite. ``logits`` is kept only when asked (the baseline);
    the candidate compares each passage as it finishes, so at most one run's logits are held.
    Per-passage sums (not one total) because the gate's intervals resample whole passages."""

    texts: list[str]
    hits: list[bool]
    nll: list[float]  # per passage, summed over its predicted tokens
    ppl_tokens: list[int]  # per passage
    seconds: float
    steps: int
    logits: list[torch.Tensor] = field(default_factory=list)

    @property
    def perplexity(self) -> float:
        n = sum(self.ppl_tokens)
        return math.exp(sum(self.nll) / n) if n else float("nan")


@dataclass(slots=True)
class LogitComparison:
    """Candidate vs baseline over the same passage positions, per passage: teacher-forced
    (both read the same text, so every position is compared on the same history, unlike
    free-running greedy outputs that part ways at their first different token)."""

    positions: dict[int, int] = field(default_factory=dict)
    agree: dict[int, int] = field(default_factory=dict)
    kl_sum: dict[int, float] = field(default_factory=dict)
    kl_max: float = 0.0

    def add(self, n: int, base: torch.Tensor, cand: torch.Tensor) -> None:
        """Passage ``n``'s ``[positions, vocab]`` log-softmax, baseline and candidate."""
        if base.shape != cand.shape:
            raise ValueError(f"logits shape {tuple(cand.shape)} != {tuple(base.shape)}")
        base, cand = base.float(), cand.float()
        self.positions[n] = base.shape[0]
        self.agree[n] = int((base.argmax(-1) == cand.argmax(-1)).sum())
        # KL(P_base || P_cand); 0 * anything = 0 where the baseline puts no mass
        p = base.exp()
        kl = torch.where(p > 0, p * (base - cand), torch.zeros_like(p)).sum(-1)
        self.kl_sum[n] = float(kl.sum())
        self.kl_max = max(self.kl_max, float(kl.max()) if kl.numel() else 0.0)

    @property
    def total_positions(self) -> int:
        return sum(self.positions.values())

    @property
    def agreement(self) -> float:
        n = self.total_positions
        return sum(self.agree.values()) / n if n else float("nan")

    @property
    def mean_kl(self) -> float:
        n = self.total_positions
        return sum(self.kl_sum.values()) / n if n else float("nan")


def passage_nll(logits: torch.Tensor, ids: list[int]) -> tuple[float, int]:
    """Summed negative log-likelihood of tokens 1.. of ``ids`` and how many were predicted."""
    if len(ids) < 2:
        return 0.0, 0
    target = torch.tensor(ids[1:], dtype=torch.long, device=logits.device)
    rows = logits[: len(ids) - 1].float()
    return float(-rows.gather(1, target[:, None]).sum()), len(ids) - 1


class ProgressLog:
    """A progress bar for :meth:`kvserve.LLM.generate`'s ``use_tqdm`` that says, at most once
    every ``every_s``, how many prompts are done and how long the rest should take at the pace
    so far: a large suite runs for an hour, and is otherwise silent all that time."""

    def __init__(
        self,
        total: int,
        desc: str = "",
        *,
        say: Callable[[str], None],
        label: str,
        every_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.total, self.say, self.label = total, say, label
        self.every_s, self.clock = every_s, clock
        self.done = 0
        self.start = self.last = clock()

    def update(self, n: int = 1) -> None:
        self.done += n
        now = self.clock()
        if now - self.last < self.every_s or self.done >= self.total:
            return
        self.last = now
        elapsed = now - self.start
        left = elapsed / self.done * (self.total - self.done)
        self.say(f"{self.label}: {self.done:,}/{self.total:,} prompts in {elapsed / 60:.1f} "
                 f"min, about {left / 60:.1f} min left")  # fmt: skip

    def close(self) -> None:
        pass


def run_suite(
    llm: Any,
    suite: Suite,
    keep_logits: bool = False,
    on_logits: LogitsFn | None = None,
    progress: Callable[[str], None] | None = None,
    label: str = "run",
) -> RunResult:
    """Run the suite on ``llm`` (a :class:`kvserve.LLM`). ``on_logits(i, logits)`` sees each
    passage's prompt log-softmax as soon as its request finishes; ``progress`` gets a line
    now and then on how far the generation prompts are (:class:`ProgressLog`)."""
    from functools import partial

    from kvserve import SamplingParams

    t0 = time.perf_counter()
    steps0 = llm.engine.num_steps
    params = [SamplingParams(temperature=0.0, max_tokens=i.max_tokens) for i in suite.items]
    prompts = [{"prompt_token_ids": i.prompt_ids} for i in suite.items]
    bar = partial(ProgressLog, say=progress, label=label) if progress else False
    outs = llm.generate(prompts, params, use_tqdm=bar) if prompts else []
    texts = [o.outputs[0].text for o in outs]
    hits = [item_hit(t, i) for t, i in zip(texts, suite.items, strict=True)]

    engine = llm.engine
    one = SamplingParams(temperature=0.0, max_tokens=1)
    ids = {}
    for n, p in enumerate(suite.passages):
        rid = engine.add_request(
            f"quality-ppl-{n}", {"prompt_token_ids": p}, one, return_prompt_logits=True
        )
        ids[rid] = n
    nll, ntok, kept = [0.0] * len(suite.passages), [0] * len(suite.passages), {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if not out.finished:
                continue
            n = ids[out.request_id]
            logits = out.prompt_logits
            nll[n], ntok[n] = passage_nll(logits, suite.passages[n])
            if on_logits is not None:
                on_logits(n, logits)
            if keep_logits:
                kept[n] = logits
    return RunResult(
        texts=texts,
        hits=hits,
        nll=nll,
        ppl_tokens=ntok,
        seconds=time.perf_counter() - t0,
        steps=engine.num_steps - steps0,
        logits=[kept[n] for n in sorted(kept)],
    )


def recall_groups(suite: Suite) -> dict[str, list[int]]:
    """Item indices of each recall (or instruction-following) figure the gate judges."""
    groups: dict[str, list[int]] = {
        "needle": [],
        "needle_depth_0_10": [],
        "multi_needle": [],
        "multi_turn": [],
        "variable_tracking": [],
        "instruction": [],
    }
    for n, it in enumerate(suite.items):
        groups[it.kind].append(n)
        if it.kind == "needle" and it.meta["depth_percent"] <= EARLY_DEPTH:
            groups["needle_depth_0_10"].append(n)
    return {k: v for k, v in groups.items() if v}


def recall_grid(suite: Suite, hits: list[bool]) -> dict[str, dict[str, list[int]]]:
    """Needle [hits, prompts] per context length (rows) and depth percent (columns)."""
    cells: dict[tuple[int, float], list[int]] = {}
    for it, hit in zip(suite.items, hits, strict=True):
        if it.kind == "needle":
            key = (it.meta["context_tokens"], it.meta["depth_percent"])
            cell = cells.setdefault(key, [0, 0])
            cell[0] += bool(hit)
            cell[1] += 1
    grid: dict[str, dict[str, list[int]]] = {}
    for (length, depth), cell in sorted(cells.items()):
        grid.setdefault(str(length), {})[f"{depth:g}"] = cell
    return grid


def min_cache_read_share(suite: Suite, chunk: int) -> float:
    """Lower bound on the share of prompt positions whose attention reads the stored cache.

    The first prefill chunk of a sequence attends to its own fresh full-precision K/V; only
    later chunks (and decode) read what the KV format stored. A chunk holds at most ``chunk``
    tokens (the step budget), so at most that many positions per prompt escape the format."""
    lens = [len(i.prompt_ids) for i in suite.items] + [len(p) for p in suite.passages]
    total = sum(lens)
    fresh = sum(min(n, chunk) for n in lens)
    return 1.0 - fresh / total if total else 0.0
