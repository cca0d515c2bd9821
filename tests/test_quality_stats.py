"""The gate's statistics against references computed here independently, and its verdicts on
planted results.

References: the normal quantile by bisection on ``math.erfc``; each Wilson bound by bisection
on the score test it inverts (|k - n p| <= z sqrt(n p (1 - p))), not by the closed form;
Newcombe's square-and-add combination written out from the paper; a published paired interval
(Fagerland, Lydersen and Laake, "Statistical Analysis of Contingency Tables", 2017, chapter 8:
the Cavo et al. table, Newcombe square-and-add 95 % CI -0.1186 to -0.0046); the bootstrap
against the exact bootstrap distribution, enumerated."""

from __future__ import annotations

import itertools
import math
import statistics

import pytest

from kvserve.config import ConfigError
from kvserve.quality.gate import judge_passages, judge_recall, needed_prompts
from kvserve.quality.stats import (
    FAIL,
    INCONCLUSIVE,
    MIN_PASSAGES,
    PASS,
    bootstrap,
    newcombe_loss,
    overall,
    passages_needed,
    prompts_needed,
    quantile,
    wilson,
    z_value,
)
from kvserve.quality.thresholds import Thresholds


def ref_z(confidence: float) -> float:
    """x with P(Z <= x) = confidence, by bisection on the normal CDF written with erfc."""
    lo, hi = -10.0, 10.0
    for _ in range(200):
        mid = (lo + hi) / 2
        if ref_cdf(mid) < confidence:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def ref_cdf(x: float) -> float:
    return 0.5 * math.erfc(-x / math.sqrt(2))


def ref_wilson(k: float, n: float, z: float) -> tuple[float, float]:
    """The set of p the score test does not reject, its ends found by bisection."""

    def inside(p: float) -> bool:
        return (k - n * p) ** 2 <= z * z * n * p * (1 - p)

    def edge(a: float, b: float) -> float:  # inside(a) != inside(b)
        ia = inside(a)
        for _ in range(200):
            m = (a + b) / 2
            if inside(m) == ia:
                a = m
            else:
                b = m
        return (a + b) / 2

    p = k / n
    lo = 0.0 if k == 0 else edge(p, 0.0)
    hi = 1.0 if k == n else edge(p, 1.0)
    return lo, hi


def ref_newcombe(a: int, b: int, c: int, d: int, confidence: float) -> tuple[float, float]:
    """Newcombe (1998) method 10 for p1 - p2 of the paired table [[a, b], [c, d]] (a: both
    successes, b: first only, c: second only), continuity-corrected phi, from the paper."""
    n = a + b + c + d
    z = ref_z(confidence)
    p1, p2 = (a + b) / n, (a + c) / n
    l1, u1 = ref_wilson(a + b, n, z)
    l2, u2 = ref_wilson(a + c, n, z)
    margins = [a + b, c + d, a + c, b + d]
    if min(margins) == 0:
        phi = 0.0
    else:
        num = a * d - b * c
        num = num - n / 2 if num > n / 2 else (0.0 if num >= 0 else num)
        phi = num / math.sqrt(math.prod(margins))
    dl = math.sqrt((p1 - l1) ** 2 - 2 * phi * (p1 - l1) * (u2 - p2) + (u2 - p2) ** 2)
    du = math.sqrt((u1 - p1) ** 2 - 2 * phi * (u1 - p1) * (p2 - l2) + (p2 - l2) ** 2)
    return p1 - p2 - dl, p1 - p2 + du


def hits(both: int, lost: int, gained: int, neither: int) -> list[tuple[bool, bool]]:
    """(baseline hit, candidate hit) per prompt."""
    return (
        [(True, True)] * both
        + [(True, False)] * lost
        + [(False, True)] * gained
        + [(False, False)] * neither
    )


def test_z_and_wilson_match_the_score_test_they_invert():
    for conf in (0.9, 0.95, 0.975, 0.99):
        assert z_value(conf) == pytest.approx(ref_z(conf), abs=1e-9)
    z = ref_z(0.95)
    for k, n in [(0, 12), (3, 12), (12, 12), (1, 7), (50, 112), (1999, 2000), (37, 80)]:
        assert wilson(k, n, z) == pytest.approx(ref_wilson(k, n, z), abs=1e-6)


@pytest.mark.parametrize(
    "table",
    [
        (59, 6, 16, 80),  # Cavo et al. (phi > 0 past the continuity correction)
        (9, 3, 0, 0),  # 3 of 12 lost, every other prompt hit: a zero marginal, phi = 0
        (1500, 500, 0, 0),  # the same loss rate at n = 2,000
        (12, 0, 0, 0),  # identical, all hits
        (0, 0, 0, 12),  # identical, all misses
        (6, 0, 0, 6),  # identical, half hits: phi shrunk by the correction
        (3, 5, 4, 2),  # ad < bc: phi < 0
        (1, 1, 7, 12),  # Bentur et al.
        (40, 2, 1, 3),  # ad - bc > n / 2
        (2, 1, 1, 1),  # 0 <= ad - bc <= n / 2: phi = 0
    ],
)
@pytest.mark.parametrize("confidence", [0.95, 0.975])
def test_newcombe_matches_the_reference(table, confidence):
    assert newcombe_loss(*table, confidence) == pytest.approx(
        ref_newcombe(*table, confidence), abs=1e-6
    )


def test_newcombe_matches_the_published_interval():
    # Two-sided 95 % is a one-sided bound at 97.5 % on each end.
    lo, hi = newcombe_loss(59, 6, 16, 80, confidence=0.975)
    assert (59 + 6) / 161 - (59 + 16) / 161 == pytest.approx(-0.0621, abs=5e-5)
    assert lo == pytest.approx(-0.1186, abs=5e-5) and hi == pytest.approx(-0.0046, abs=5e-5)


def test_three_of_twelve_lost_is_not_pass_and_fails_at_two_thousand():
    th = Thresholds()
    small = judge_recall("recall_needle", "needle recall", hits(9, 3, 0, 0), th)
    assert small["loss"] == pytest.approx(0.25)
    assert small["verdict"] == INCONCLUSIVE  # not PASS: 3 of 12 lost is no evidence of no harm
    assert small["interval"][0] < th.max_recall_drop < small["interval"][1]
    # The power calculation: at 25 % lost, that many prompts make the lower bound clear 5 pt.
    need = small["needed"]
    lo, _ = ref_newcombe(0.75 * need, 0.25 * need, 0, 0, 0.95)  # type: ignore[arg-type]
    assert lo > th.max_recall_drop
    lo, _ = ref_newcombe(0.75 * (need - 1), 0.25 * (need - 1), 0, 0, 0.95)  # type: ignore[arg-type]
    assert lo <= th.max_recall_drop
    big = judge_recall("recall_needle", "needle recall", hits(1500, 500, 0, 0), th)
    assert big["verdict"] == FAIL and big["needed"] is None
    assert big["interval"][0] > th.max_recall_drop


def test_identical_candidate_passes_at_the_size_the_power_calculation_names():
    th = Thresholds()
    z = ref_z(th.confidence)
    # All hits on both sides: the upper bound is z^2 / (n + z^2); the first n within 5 points.
    first = next(n for n in itertools.count(1) if z * z / (n + z * z) <= th.max_recall_drop)
    for base_hit in (True, False):  # every prompt answered, or none: the same bound
        cells = (1, 0, 0, 0) if base_hit else (0, 0, 0, 1)
        row = judge_recall("r", "r", hits(*(12 * x for x in cells)), th)
        assert row["verdict"] == INCONCLUSIVE and row["needed"] == first == 52
        at = judge_recall("r", "r", hits(*(first * x for x in cells)), th)
        below = judge_recall("r", "r", hits(*((first - 1) * x for x in cells)), th)
        assert at["verdict"] == PASS and at["needed"] is None
        assert below["verdict"] == INCONCLUSIVE and below["needed"] == first


def test_power_calculation_with_losses_and_gains():
    # 2 lost and 2 gained of 40: no net loss, but flips widen the interval.
    need = prompts_needed(30, 2, 2, 6, 0.05)
    assert need is not None and need > 52  # flips cost prompts an identical run would not
    scale = [x / 40 * need for x in (30, 2, 2, 6)]
    assert newcombe_loss(*scale)[1] <= 0.05
    scale = [x / 40 * (need - 1) for x in (30, 2, 2, 6)]
    assert newcombe_loss(*scale)[1] > 0.05
    assert prompts_needed(19, 1, 0, 0, 0.05) is None  # a loss of exactly the margin


def test_overall_verdict():
    assert overall([PASS, PASS]) == PASS
    assert overall([PASS, INCONCLUSIVE]) == INCONCLUSIVE
    assert overall([INCONCLUSIVE, FAIL, PASS]) == FAIL
    assert overall([]) == INCONCLUSIVE


def test_quantile_is_numpy_linear():
    xs = [1.0, 2.0, 4.0, 8.0]
    assert quantile(xs, 0.0) == 1.0 and quantile(xs, 1.0) == 8.0
    assert quantile(xs, 0.5) == pytest.approx(3.0)  # between 2 and 4
    assert quantile(xs, 0.9) == pytest.approx(4 + 0.7 * 4)  # h = 2.7


def _mean(sums) -> float:  # noqa: ANN001
    return sums[0] / sums[1]


def test_bootstrap_matches_the_exact_bootstrap_distribution():
    """Five passages: every ordered resample (5^5) is equally likely, so the exact bootstrap
    distribution of a ratio of sums is enumerable; the resampling estimate's bounds must sit
    at its quantiles, within Monte Carlo error."""
    units = [(3.0, 10.0), (1.0, 12.0), (4.0, 9.0), (0.5, 11.0), (2.0, 10.0)]
    exact = sorted(
        sum(units[i][0] for i in pick) / sum(units[i][1] for i in pick)
        for pick in itertools.product(range(5), repeat=5)
    )
    lo, hi = bootstrap(units, _mean, 0.95, resamples=20000)
    assert lo == pytest.approx(quantile(exact, 0.05), abs=0.004)
    assert hi == pytest.approx(quantile(exact, 0.95), abs=0.004)
    # And its spread: the exact bootstrap variance of a mean is sum((x - m)^2) / n^2.
    # One-sided 84.1 % bounds of a near-normal mean are one standard deviation either side.
    xs = [float(i) for i in range(12)]
    lo, hi = bootstrap([(x, 1.0) for x in xs], _mean, ref_cdf(1.0), resamples=4000)
    sd = math.sqrt(sum((x - statistics.fmean(xs)) ** 2 for x in xs) / len(xs) ** 2)
    assert (hi - lo) / 2 == pytest.approx(sd, rel=0.08)


def test_identical_passages_pass_only_with_enough_of_them():
    th = Thresholds()
    same = [(5.0, 5.0, 100, 100, 100, 0.0)] * MIN_PASSAGES

    def ppl(s):  # noqa: ANN001, ANN202
        return math.exp((s[1] - s[0]) / s[2]) - 1

    row = judge_passages("perplexity", "p", "ppl", same, ppl, 0.05, th, (1.0, 1.0, 0.0), "r")
    assert row["verdict"] == PASS and row["interval"] == [0.0, 0.0]
    few = judge_passages("perplexity", "p", "ppl", same[:3], ppl, 0.05, th, (1, 1, 0), "r")
    assert few["verdict"] == INCONCLUSIVE and few["needed"] == MIN_PASSAGES


def test_passages_needed_decides_when_the_passages_are_there():
    """A small perplexity increase with spread: INCONCLUSIVE on 12 passages; the same
    passages repeated up to the size the calculation names (same mean, spread / sqrt(k))
    PASS."""
    th = Thresholds()
    units = [(100.0, 100.0 + d, 50, 0, 1, 0.0) for d in (-2, 5, 1, 4, -1, 3, 6, 0, 2, 4, 1, 3)]

    def ppl(s):  # noqa: ANN001, ANN202
        return math.exp((s[1] - s[0]) / s[2]) - 1

    row = judge_passages("perplexity", "p", "ppl", units, ppl, 0.05, th, (1, 1, 0), "r")
    assert row["verdict"] == INCONCLUSIVE
    need = row["needed"]
    assert need is not None and need > len(units)
    reps = math.ceil(need / len(units) * 1.3)  # percentile noise: a little headroom
    more = judge_passages("perplexity", "p", "ppl", units * reps, ppl, 0.05, th, (1, 1, 0), "r")
    assert more["verdict"] == PASS
    assert passages_needed(0.05, 0.0, 0.1, 20, 0.05) is None  # at the margin: no size decides


def test_needed_prompts_maps_groups_to_the_suite_size():
    from kvserve.quality.suite import SuiteSpec

    spec = SuiteSpec(prompts=12)
    rows = [
        {"verdict": INCONCLUSIVE, "needed": 52, "n": 24},  # needles: twice the prompts
        {"verdict": INCONCLUSIVE, "needed": 10, "n": 3},  # passages: one per 4 prompts
        {"verdict": PASS, "needed": None, "n": 12},
    ]
    assert needed_prompts(rows, spec) == 40  # max(52 * 12 / 24 = 26, 10 * 12 / 3 = 40)
    rows.append({"verdict": INCONCLUSIVE, "needed": None, "n": 12})
    assert needed_prompts(rows, spec) is None


def test_thresholds_are_validated():
    with pytest.raises(ConfigError, match="confidence"):
        Thresholds(confidence=1.0)
    with pytest.raises(ConfigError, match="min_agreement"):
        Thresholds(min_agreement=1.5)
    with pytest.raises(ConfigError, match="max_kl"):
        Thresholds(max_kl=-1.0)


def test_variable_tracking_accepts_a_shorter_walk_of_the_chain():
    from kvserve.quality import tasks as T
    from kvserve.quality.suite import TaskItem, item_hit

    p = T.variable_tracking_prompt(3, 400, lambda s: len(s.split()))
    value = p.answer.rsplit(" ", 1)[1]
    item = TaskItem(p.kind, [], p.answer, 8, p.meta)
    for text in (p.answer + ".", f" {value}.", p.answer.split(" =", 1)[1] + "\n"):
        assert item_hit(text, item), text
    for text in (f" {value}7", " VAR x = 1", f" {int(value) + 1}"):
        assert not item_hit(text, item), text
