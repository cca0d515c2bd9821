"""Paired statistics for recall on the same prompts: is a drop more than sampling noise?

Baseline and candidate answer the *same* prompts, so what carries information is the
discordant pairs: ``lost`` (the baseline answered, the candidate did not) and ``gained``.
Under "the format changes nothing", each discordant pair is lost or gained with probability
1/2 (McNemar's exact test). With 12 multi-needle prompts one prompt is 8.3 points, more than
a 5-point threshold: losing 2 and gaining 1 is a 8.3-point drop that says nothing, and the
gate must not fail on it. Exact binomial arithmetic (``math.comb``): no SciPy.
"""

from __future__ import annotations

import math


def binom_cdf(k: int, n: int, p: float) -> float:
    """P(X <= k) for X ~ Binomial(n, p)."""
    if k < 0:
        return 0.0
    if k >= n:
        return 1.0
    return sum(math.comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(k + 1))


def mcnemar_p(lost: int, gained: int) -> float:
    """One-sided exact McNemar p-value for "the candidate loses more than it gains":
    P(X >= lost) for X ~ Binomial(lost + gained, 1/2); 1.0 without discordant pairs."""
    n = lost + gained
    if n == 0:
        return 1.0
    # The upper tail summed in exact integers: 1 - cdf cancels to 0 (or below) for large losses.
    return sum(math.comb(n, i) for i in range(lost, n + 1)) / 2**n


def _root_increasing(f, lo: float = 0.0, hi: float = 1.0) -> float:  # noqa: ANN001
    """The root of an increasing function on [lo, hi], by bisection."""
    for _ in range(60):
        mid = (lo + hi) / 2
        if f(mid) < 0:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def clopper_pearson(k: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Exact two-sided interval for a binomial proportion k / n."""
    if n == 0:
        return 0.0, 1.0
    tail = (1 - confidence) / 2
    # Lower: P(X >= k | p) = tail (increasing in p). Upper: P(X <= k | p) = tail (decreasing).
    lower = 0.0 if k == 0 else _root_increasing(lambda p: 1 - binom_cdf(k - 1, n, p) - tail)
    upper = 1.0 if k == n else _root_increasing(lambda p: tail - binom_cdf(k, n, p))
    return lower, upper


def paired_drop_interval(
    lost: int, gained: int, n: int, confidence: float = 0.95
) -> tuple[float, float]:
    """Interval for the recall drop (lost - gained) / n, conditional on the number of
    discordant pairs: (lost + gained) / n x (2 q - 1) over the exact interval of q, the share
    of discordant pairs that are losses."""
    d = lost + gained
    if d == 0 or n == 0:
        return 0.0, 0.0
    lo, hi = clopper_pearson(lost, d, confidence)
    return d / n * (2 * lo - 1), d / n * (2 * hi - 1)
