"""The gate's margins and confidence, apart from the gate so that building the CLI parser
(which shows their defaults) imports neither torch nor the task corpus."""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.config import ConfigError


@dataclass(frozen=True, slots=True)
class Thresholds:
    """Non-inferiority margins, stated before any run: a configuration may lose at most 5
    points of any recall or instruction-following share, 5 % perplexity, 5 % of teacher-forced
    next-token agreement (the lower bound must stay >= 95 %) and 0.05 nats of mean KL; each
    judged on a one-sided bound at ``confidence`` (see :mod:`kvserve.quality.stats`)."""

    max_recall_drop: float = 0.05  # absolute, per recall figure (0.05 = 5 points)
    max_ppl_increase: float = 0.05  # relative (0.05 = +5 %)
    min_agreement: float = 0.95  # teacher-forced share of positions with the same top-1 token
    max_kl: float = 0.05  # mean KL(baseline || candidate) per position, nats
    confidence: float = 0.95  # of each one-sided bound

    def __post_init__(self) -> None:
        if not 0.5 <= self.confidence < 1.0:
            raise ConfigError(f"confidence: must be in [0.5, 1), got {self.confidence}")
        for name in ("max_recall_drop", "min_agreement"):
            v = getattr(self, name)
            if not 0.0 <= v <= 1.0:
                raise ConfigError(f"{name}: must be in [0, 1], got {v}")
        for name in ("max_ppl_increase", "max_kl"):
            v = getattr(self, name)
            if not v >= 0.0:
                raise ConfigError(f"{name}: must be >= 0, got {v}")
