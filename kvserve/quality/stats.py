"""The gate's statistics: is the candidate no worse than the baseline, by more than a margin,
with evidence to say so?

Non-inferiority, per metric. The loss (baseline minus candidate recall, the relative
perplexity increase, the share of positions whose top-1 next token changed, the mean KL) gets
a confidence interval whose two ends are each a one-sided bound at ``confidence`` (95 % by
default, so the printed interval is a two-sided 90 % one). PASS when the upper bound is within
the margin: the data rule out a loss larger than the margin. FAIL when the lower bound is
beyond it: the data rule out a loss within the margin. Otherwise INCONCLUSIVE: the suite was
too small to tell, and :func:`prompts_needed` / :func:`passages_needed` say how large it
would have to be at the observed rates. A gate that passed whenever a test found no
significant drop would pass every loss on a small suite; this one cannot.

Recall (and instruction following) is paired: the same prompts under both, each prompt hit or
missed on each side. The interval is Newcombe's square-and-add interval for paired proportions
(Newcombe 1998, "method 10": Wilson score intervals of both marginal shares, combined with
their estimated correlation, continuity-corrected). Why this one: it is among those
Fagerland, Lydersen and Laake (2014) recommend for paired proportions (coverage close to
nominal at small n), it is closed-form (the power calculation evaluates it thousands of times),
and it does not collapse when no prompt changes: with no lost or gained prompt it still
narrows only as n grows (all hits on both sides: upper bound z^2 / (n + z^2)). The
conditional exact interval on the discordant prompts alone is [0, 0] whenever nothing changed,
at any n: the absence of evidence read as evidence.

Perplexity, agreement and KL are read over passages: positions within one passage are not
independent, so their intervals are percentile bootstraps over passages (resampling whole
passages, seeded, so a report is reproducible), and need at least ``MIN_PASSAGES`` passages.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from statistics import NormalDist

PASS, FAIL, INCONCLUSIVE = "PASS", "FAIL", "INCONCLUSIVE"
EXIT_CODES = {PASS: 0, FAIL: 1, INCONCLUSIVE: 3}
MIN_PASSAGES = 10  # fewer resampled units than this and a percentile bootstrap is no interval
BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_SEED = 0
MAX_NEEDED = 1_000_000  # beyond this a power calculation answers None ("cannot decide")
EPS = 1e-12  # a bound equal to the margin, up to rounding, is within it


def z_value(confidence: float) -> float:
    """The standard normal quantile of a one-sided bound at ``confidence``."""
    return NormalDist().inv_cdf(confidence)


def overall(verdicts: Sequence[str]) -> str:
    """PASS only if every metric passes; FAIL if any fails; else INCONCLUSIVE."""
    if any(v == FAIL for v in verdicts):
        return FAIL
    return PASS if verdicts and all(v == PASS for v in verdicts) else INCONCLUSIVE


def decide(lo: float, hi: float, margin: float) -> str:
    """Verdict for a loss (larger is worse) with bounds ``lo`` / ``hi`` against ``margin``.
    A NaN bound (a broken candidate's output) fails."""
    if math.isnan(lo) or math.isnan(hi):
        return FAIL
    if hi <= margin + EPS:
        return PASS
    if lo > margin + EPS:
        return FAIL
    return INCONCLUSIVE


# ---- paired proportions ----
def wilson(k: float, n: float, z: float) -> tuple[float, float]:
    """Wilson score interval of a proportion ``k / n`` (``k`` may be fractional: the power
    calculation scales observed counts)."""
    if n <= 0:
        return 0.0, 1.0
    p = k / n
    z2 = z * z
    denom = 1.0 + z2 / n
    centre = (p + z2 / (2 * n)) / denom
    half = z * math.sqrt(max(p * (1 - p), 0.0) / n + z2 / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def newcombe_loss(
    both: float, lost: float, gained: float, neither: float, confidence: float = 0.95
) -> tuple[float, float]:
    """Bounds of the loss ``p_base - p_cand`` from the paired table: ``both`` prompts hit on
    both sides, ``lost`` by the baseline only, ``gained`` by the candidate only, ``neither``.
    Newcombe's method 10, each end a one-sided bound at ``confidence``."""
    n = both + lost + gained + neither
    if n <= 0:
        return -1.0, 1.0
    z = z_value(confidence)
    b_hits, c_hits = both + lost, both + gained
    p1, p2 = b_hits / n, c_hits / n
    l1, u1 = wilson(b_hits, n, z)
    l2, u2 = wilson(c_hits, n, z)
    marginals = b_hits * (n - b_hits) * c_hits * (n - c_hits)
    phi = 0.0
    if marginals > 0:
        a = both * neither - lost * gained
        if a > n / 2:
            phi = (a - n / 2) / math.sqrt(marginals)
        elif a < 0:
            phi = a / math.sqrt(marginals)
    d = p1 - p2
    lo = d - math.sqrt(max((p1 - l1) ** 2 + (u2 - p2) ** 2 - 2 * phi * (p1 - l1) * (u2 - p2), 0))
    hi = d + math.sqrt(max((p2 - l2) ** 2 + (u1 - p1) ** 2 - 2 * phi * (p2 - l2) * (u1 - p1), 0))
    return max(-1.0, lo), min(1.0, hi)


def _smallest(decided: Callable[[int], bool], start: int) -> int | None:
    """The smallest n >= ``start`` with ``decided(n)``, assuming that once decided a larger n
    stays decided (bounds narrow as n grows); None beyond ``MAX_NEEDED``."""
    if decided(start):
        return start
    lo, hi = start, start * 2
    while not decided(hi):
        if hi > MAX_NEEDED:
            return None
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if decided(mid):
            hi = mid
        else:
            lo = mid
    return hi


def prompts_needed(
    both: int, lost: int, gained: int, neither: int, margin: float, confidence: float = 0.95
) -> int | None:
    """Prompts a paired recall figure needs for a verdict at the observed rates: the four
    cells scaled to n, the smallest n whose interval lies within the margin (when the observed
    loss is below it) or beyond it (when above). None when the observed loss is the margin
    itself (no size decides) or the answer exceeds ``MAX_NEEDED``."""
    n = both + lost + gained + neither
    if n == 0:
        return None
    loss = (lost - gained) / n
    if abs(loss - margin) <= EPS:
        return None
    rates = [x / n for x in (both, lost, gained, neither)]
    want = PASS if loss < margin else FAIL

    def decided(m: int) -> bool:
        lo, hi = newcombe_loss(*(r * m for r in rates), confidence=confidence)
        return decide(lo, hi, margin) == want

    return _smallest(decided, 1)


# ---- bootstrap over passages ----
Stat = Callable[[Sequence[float]], float]


def quantile(sorted_values: Sequence[float], q: float) -> float:
    """Linear interpolation between order statistics (Hyndman and Fan's type 7, numpy's
    default)."""
    h = (len(sorted_values) - 1) * q
    i = math.floor(h)
    j = min(i + 1, len(sorted_values) - 1)
    return sorted_values[i] + (h - i) * (sorted_values[j] - sorted_values[i])


def bootstrap(
    units: Sequence[Sequence[float]],
    stat: Stat,
    confidence: float = 0.95,
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = BOOTSTRAP_SEED,
) -> tuple[float, float]:
    """Percentile bootstrap bounds of ``stat(column sums)`` over ``units`` (one tuple of
    per-passage sums each, e.g. (nll baseline, nll candidate, tokens)): each resample draws
    len(units) units with replacement. Each end is a one-sided bound at ``confidence``."""
    n = len(units)
    if n == 0:
        return math.nan, math.nan
    rng = random.Random(seed)
    width = len(units[0])
    values = []
    for _ in range(resamples):
        sums = [0.0] * width
        for _ in range(n):
            u = units[rng.randrange(n)]
            for k in range(width):
                sums[k] += u[k]
        values.append(stat(sums))
    if any(math.isnan(v) for v in values):
        return math.nan, math.nan
    values.sort()
    return quantile(values, 1 - confidence), quantile(values, confidence)


def passages_needed(estimate: float, lo: float, hi: float, n: int, margin: float) -> int | None:
    """Passages a bootstrapped loss needs for a verdict at the observed spread: the interval's
    half-width on the side facing the margin shrinks as 1 / sqrt(n). At least
    ``MIN_PASSAGES``; None when the estimate is the margin itself or no size within
    ``MAX_NEEDED`` decides."""
    if any(math.isnan(x) for x in (estimate, lo, hi)) or abs(estimate - margin) <= EPS:
        return None
    half = hi - estimate if estimate < margin else estimate - lo
    gap = abs(margin - estimate)
    need = n * (half / gap) ** 2
    if need > MAX_NEEDED:
        return None
    return max(MIN_PASSAGES, math.ceil(need - 1e-9))
