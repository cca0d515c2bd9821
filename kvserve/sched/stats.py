"""The scheduler's counters."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SchedulerStats:
    """Counters since start (vLLM's meanings)."""

    prompt_tokens_total: int = 0  # every prompt token of requests that produced a token
    prefill_tokens_computed_total: int = 0  # prompt tokens actually computed (hits excluded)
    generation_tokens_total: int = 0
    num_preemptions: int = 0
    # Retention: policy text ("window:512", "sliding_window" for a model's own) -> tokens whose
    # K/V blocks were released before their request finished, and those blocks.
    retention_evicted_tokens: dict[str, int] = field(default_factory=dict)
    retention_reclaimed_blocks: int = 0
    # The tokens a preempted request got back (device or tier hits) versus recomputed when
    # it was admitted again.
    preempted_tokens_restored: int = 0
    preempted_tokens_recomputed: int = 0
    allocation_failures: int = 0  # a request's chunk did not fit the pool (vLLM counts none)
    queue_time_sum: float = 0.0  # arrival to first scheduled, seconds, over requests
    queue_time_count: int = 0
    # Finished requests whose blocks a connector held (delay_free) until it reported them
    # sent, and holds that ran out their lease instead.
    held_for_transfer: int = 0
    held_lease_expired: int = 0
