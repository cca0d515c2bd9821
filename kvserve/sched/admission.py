"""Admission by projected KV demand, and early refusal of requests that cannot meet their SLO.

Greedy admission (vLLM's) admits a waiting request when its next chunk fits and preempts the
newest request when decode runs out of blocks: under a burst of long requests it admits work
it later throws away and recomputes. Projected admission admits a request only when every
block it will ever hold fits: its prompt after device prefix hits plus its expected output,
beside what each running request (and each waiting one that holds blocks for a tier load)
will still grow by, under a watermark. A tier hit still needs device blocks, so it is cheap
in time but not in memory: it is counted like computed tokens here. If every request's
output stays within its estimate, a running request never fails to get a block and nothing
is preempted (``tests/test_admission.py`` checks it under random traffic).

The expected output is ``max_tokens``, or, for a workload class with ``output_estimate:
learned``, the 90th percentile of that class's recent finished outputs (never above
``max_tokens``; ``max_tokens`` until enough have finished). A learned estimate can be
exceeded; such a request grows past its reservation and may then be preempted.

Refusals (projected only, for classes with a TTFT SLO): at arrival, a request whose wait for
blocks, projected from the rate at which finishing requests release them, already exceeds its
SLO is refused at once ("projected_wait"); a request still waiting when its SLO has passed is
refused then ("deadline"): serving either would spend capacity on a request that missed.
Each refusal carries a retry-after; a projected wait beyond :data:`OVERLOAD_S` marks the
engine overloaded (the server answers 503 instead of 429).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from kvserve.kv.manager import KVCacheManager, cdiv
from kvserve.sched.request import Request
from kvserve.sched.workload_classes import DEFAULT_CLASS

# A projected wait longer than this is an overload, not a momentary queue: 503, not 429.
OVERLOAD_S = 30.0
# Learned output estimates: the quantile of the last LEARN_WINDOW finished outputs of a class,
# used once LEARN_MIN of them have finished.
LEARN_QUANTILE = 0.9
LEARN_WINDOW = 256
LEARN_MIN = 16
# Block release rate: finishes within the last RATE_WINDOW_S seconds, at least RATE_MIN.
RATE_WINDOW_S = 30.0
RATE_MIN = 4


@dataclass(slots=True)
class Refusal:
    """Why a request was refused and when a retry may succeed."""

    reason: str  # "projected_wait" | "deadline"
    retry_after: float  # seconds
    overloaded: bool = False


@dataclass(slots=True)
class AdmissionStats:
    """Counters since start (never ratios)."""

    admitted: int = 0
    refused: dict[str, int] = field(default_factory=dict)  # reason -> requests
    deferred: int = 0  # admissions put off because the projection did not fit
    held_for_prefix: int = 0  # followers held a step to hit a block computed beside them


class OutputEstimator:
    """Per-class output lengths of finished requests, and the estimate learned from them."""

    def __init__(self) -> None:
        self._seen: dict[str, deque[int]] = {}

    def observe(self, class_name: str, num_output_tokens: int) -> None:
        self._seen.setdefault(class_name, deque(maxlen=LEARN_WINDOW)).append(num_output_tokens)

    def estimate(self, class_name: str, max_tokens: int) -> int:
        seen = self._seen.get(class_name)
        if seen is None or len(seen) < LEARN_MIN:
            return max_tokens
        ordered = sorted(seen)
        q = ordered[min(len(ordered) - 1, int(LEARN_QUANTILE * len(ordered)))]
        return max(1, min(max_tokens, q))


class BlockDrain:
    """The rate at which finishing requests give blocks back, over a sliding window."""

    def __init__(self) -> None:
        self._events: deque[tuple[float, int]] = deque()
        self._blocks = 0

    def record(self, now: float, blocks: int) -> None:
        self._events.append((now, blocks))
        self._blocks += blocks
        self._trim(now)

    def _trim(self, now: float) -> None:
        while self._events and self._events[0][0] < now - RATE_WINDOW_S:
            self._blocks -= self._events.popleft()[1]

    def rate(self, now: float) -> float | None:
        """Blocks per second, or None before enough requests have finished."""
        self._trim(now)
        if len(self._events) < RATE_MIN:
            return None
        span = max(now - self._events[0][0], 1.0)
        return self._blocks / span


class Admission:
    """The projected-demand arithmetic; the scheduler asks, this never changes the pool."""

    def __init__(self, kv: KVCacheManager, max_model_len: int, watermark: float) -> None:
        self.kv = kv
        self.max_model_len = max_model_len
        self.watermark_blocks = math.ceil(watermark * kv.num_blocks)
        self.estimator = OutputEstimator()
        self.drain = BlockDrain()
        self.stats = AdmissionStats()

    # -- projections ----------------------------------------------------------------------------
    def expected_output(self, req: Request) -> int:
        """Fixed when first asked, so a request's reservation does not move under it."""
        if req.expected_output_tokens is None:
            est = req.max_tokens
            wc = req.workload_class
            if wc is not None and wc.output_estimate == "learned":
                est = self.estimator.estimate(wc.name, req.max_tokens)
            elif wc is not None and isinstance(wc.output_estimate, int):
                est = min(req.max_tokens, wc.output_estimate)
            req.expected_output_tokens = est
        return req.expected_output_tokens

    def total_blocks(self, req: Request) -> int:
        """Table entries the request will have at its expected end: a block per block_size
        tokens of prompt and expected output (a retention policy only lowers what it holds,
        so this stays an upper bound)."""
        end = min(req.num_prompt_tokens + self.expected_output(req), self.max_model_len)
        end = max(end, req.num_tokens) - req.cache_offset
        return cdiv(end, self.kv.block_size)

    def remaining(self, req: Request) -> int:
        """Blocks the request will still allocate to reach its expected end."""
        return max(self.total_blocks(req) - len(self.kv.block_ids(req)), 0)

    def demand(self, req: Request, computed: list) -> int:
        """Free blocks admitting ``req`` takes over its life: what it will still allocate
        beyond its device hits, plus the hits that sit in the free list (cached but held by
        nobody: taking them takes them from the free count)."""
        reclaimed = sum(1 for b in computed if b.ref_cnt == 0)
        return max(self.remaining(req) - len(computed), 0) + reclaimed

    def reserved(self, holders: list[Request]) -> int:
        """What requests holding blocks will still allocate: running ones and waiting ones
        with blocks (tier loads)."""
        return sum(self.remaining(r) for r in holders)

    def fits(self, demand: int, reserved: int) -> bool:
        return demand + reserved + self.watermark_blocks <= self.kv.num_free_blocks

    # -- refusals -------------------------------------------------------------------------------
    def projected_wait(self, shortfall: int, now: float) -> float | None:
        """Seconds until ``shortfall`` blocks are released at the recent rate (None: no rate
        measured yet, so no projection)."""
        if shortfall <= 0:
            return 0.0
        rate = self.drain.rate(now)
        if rate is None:
            return None
        return shortfall / rate if rate > 0 else math.inf

    def refusal(self, req: Request, wait: float | None, now: float) -> Refusal | None:
        """A refusal if ``req`` cannot meet its class's TTFT SLO: its projected wait (at
        arrival) or the time it has already waited exceeds it."""
        wc = req.workload_class
        if wc is None or wc.ttft_slo is None:
            return None
        if wait is not None and wait > wc.ttft_slo:
            return self._refused("projected_wait", wait)
        if now - req.arrival_time > wc.ttft_slo:
            return self._refused("deadline", wait if wait is not None else wc.ttft_slo)
        return None

    def _refused(self, reason: str, wait: float) -> Refusal:
        self.stats.refused[reason] = self.stats.refused.get(reason, 0) + 1
        retry = min(wait, 3600.0) if math.isfinite(wait) else 3600.0
        return Refusal(reason, max(1.0, math.ceil(retry)), wait > OVERLOAD_S)

    def finished(self, req: Request, blocks: int, natural: bool, now: float | None) -> None:
        """A request ended, giving back ``blocks``; one that ended by itself (stop or length,
        not an abort) also teaches its class's output estimate."""
        if natural:
            wc = req.workload_class
            self.estimator.observe(wc.name if wc is not None else DEFAULT_CLASS,
                                   req.num_output_tokens)  # fmt: skip
        if now is not None and blocks > 0:
            self.drain.record(now, blocks)
