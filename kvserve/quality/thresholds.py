"""The gate's pass/fail thresholds, apart from the gate so that building the CLI parser (which
shows their defaults) imports neither torch nor the task corpus."""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.config import ConfigError


@dataclass(frozen=True, slots=True)
class Thresholds:
    """Defaults: a format that loses more than 5 points of any recall, 5 % perplexity, or
    that changes the top-1 next token at more than 5 % of positions is not fit for purpose.

    A recall drop counts only when it is also more than sampling noise: McNemar's exact test
    on the prompts the candidate lost and gained, one-sided, at level ``alpha`` (see
    :mod:`kvserve.quality.stats`); the report prints the p-value and the drop's interval."""

    max_recall_drop: float = 0.05  # absolute, per recall figure (0.05 = 5 points)
    alpha: float = 0.05  # significance level of the paired test on recall
    max_ppl_increase: float = 0.05  # relative (0.05 = +5 %)
    min_agreement: float = 0.95  # share of positions with the same top-1 token
    max_kl: float = 0.05  # mean KL(baseline || candidate) per position, nats

    def __post_init__(self) -> None:
        if not 0.0 < self.alpha < 1.0:
            raise ConfigError(f"alpha: must be in (0, 1), got {self.alpha}")
        for name in ("max_recall_drop", "min_agreement"):
            v = getattr(self, name)
            if not 0.0 <= v <= 1.0:
                raise ConfigError(f"{name}: must be in [0, 1], got {v}")
        for name in ("max_ppl_increase", "max_kl"):
            v = getattr(self, name)
            if not v >= 0.0:
                raise ConfigError(f"{name}: must be >= 0, got {v}")
