"""The gate's paired statistics against textbook values, and its recall verdicts."""

from __future__ import annotations

import math

import pytest

from kvserve.config import ConfigError
from kvserve.quality.gate import judge_recall
from kvserve.quality.stats import binom_cdf, clopper_pearson, mcnemar_p, paired_drop_interval
from kvserve.quality.thresholds import Thresholds


def test_binomial_cdf_is_the_sum_of_the_pmf():
    n, p = 9, 0.3
    pmf = [math.comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(n + 1)]
    for k in range(-1, n + 2):
        assert binom_cdf(k, n, p) == pytest.approx(sum(pmf[: max(0, min(k, n) + 1)]))


def test_clopper_pearson_matches_published_intervals():
    # Exact 95 % intervals (e.g. R's binom.test): 5/10 -> [0.1871, 0.8129]; 0/10 -> [0, 0.3085]
    assert clopper_pearson(5, 10) == pytest.approx((0.18709, 0.81291), abs=1e-4)
    assert clopper_pearson(0, 10) == pytest.approx((0.0, 0.30850), abs=1e-4)
    assert clopper_pearson(10, 10) == pytest.approx((0.69150, 1.0), abs=1e-4)
    assert clopper_pearson(1, 20) == pytest.approx((0.00127, 0.24873), abs=1e-4)


def test_mcnemar_exact_one_sided():
    assert mcnemar_p(2, 1) == pytest.approx(0.5)  # 2 or 3 losses of 3: 4/8
    assert mcnemar_p(10, 0) == pytest.approx(2**-10)
    assert mcnemar_p(0, 5) == 1.0 and mcnemar_p(0, 0) == 1.0
    assert mcnemar_p(7, 1) == pytest.approx(9 / 256)  # P(X >= 7 | 8, 1/2)
    # Large one-sided losses: 1 - cdf used to cancel to a negative "p"; the tail is 2^-77.
    assert mcnemar_p(77, 0) == 2.0**-77 and mcnemar_p(95, 2) > 0


def test_drop_interval_brackets_the_observed_drop():
    lo, hi = paired_drop_interval(2, 1, 12)
    assert lo < 1 / 12 < hi and lo < 0 < hi  # the data are compatible with no drop at all
    lo, hi = paired_drop_interval(50, 0, 112)
    assert 0 < lo < 50 / 112 <= hi


def _hits(n: int, lost: int, gained: int, both: int) -> list[tuple[bool, bool]]:
    return (
        [(True, False)] * lost
        + [(False, True)] * gained
        + [(True, True)] * both
        + [(False, False)] * (n - lost - gained - both)
    )


def test_recall_verdicts():
    th = Thresholds()
    # A small sample: fp8 loses 2 and gains 1 of 12 multi-needle prompts: 8.3 points, noise.
    row = judge_recall("r", "multi-needle", _hits(12, 2, 1, 9), th)
    assert row["delta"] == pytest.approx(-1 / 12) and row["passed"]
    assert row["p_value"] == pytest.approx(0.5)
    # kivi2 on a real model: 11 of 12 multi-turn answers lost.
    assert not judge_recall("r", "multi-turn", _hits(12, 11, 0, 0), th)["passed"]
    # Significant but within the threshold: passes (4 of 112 lost, 3.6 points).
    assert judge_recall("r", "needle", _hits(112, 4, 0, 100), th)["passed"]
    # Over the threshold and significant: fails.
    assert not judge_recall("r", "needle", _hits(112, 12, 1, 90), th)["passed"]


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


def test_alpha_is_validated():
    with pytest.raises(ConfigError, match="alpha"):
        Thresholds(alpha=0.0)
