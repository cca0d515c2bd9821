"""The engine's observable state after a step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class EngineStats:
    """A snapshot after a step. Counters are totals since start; gauges are current."""

    num_running: int
    num_waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    kv_cached_free_blocks: int
    token_slots_held: int
    token_slots_allocated: int
    num_preemptions: int
    step_prefill_tokens: int
    step_decode_tokens: int
    prompt_tokens_total: int  # every prompt token of requests that started (vLLM's meaning)
    prefill_tokens_computed_total: int  # prompt tokens actually computed (hits excluded)
    generation_tokens_total: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    prefix_cache_evictions: int
    num_steps: int
    # Retention: policy -> tokens whose blocks went back to the pool early; those blocks.
    retention_evicted_tokens: dict[str, int] = field(default_factory=dict)
    retention_reclaimed_blocks: int = 0
    # Hybrid models: blocks of sliding-window layer groups given back behind their windows
    # (pool blocks of one layer group each; kvserve.kv.layer_groups).
    window_freed_blocks: int = 0
    # Offload tiers: name -> counters and gauges (kvserve.kv.offload.KVOffload.stats), the
    # prompt tokens loaded from tiers, loads given up to free blocks, and what preempted
    # requests got back (device or tier hits) or recomputed when admitted again.
    kv_offload: dict[str, dict[str, Any]] = field(default_factory=dict)
    tier_hit_tokens: int = 0
    # Disaggregated prefill/decode (kvserve.disagg): the connector's counters, failures by
    # reason and leases held; empty without one.
    kv_transfer: dict[str, Any] = field(default_factory=dict)
    tier_loads_abandoned: int = 0
    tier_loads_skipped: int = 0  # tier hits computed instead: loading was estimated slower
    preempted_tokens_restored: int = 0
    preempted_tokens_recomputed: int = 0
    allocation_failures: int = 0
    queue_time_sum: float = 0.0  # arrival to first scheduled, over every request that ran
    queue_time_count: int = 0
    # Projected admission's counters (kvserve.sched.admission.AdmissionStats; None: greedy).
    admission: Any = None
    # Achieved memory bandwidth (kvserve.engine.bandwidth): bytes of weights and KV the
    # steps read, the seconds they took, and the device's peak measured at start (bytes/s;
    # 0 with a custom runner).
    memory_bytes_read: int = 0
    step_seconds: float = 0.0
    memory_bandwidth_peak: float = 0.0

    @property
    def memory_bandwidth_utilization(self) -> float:
        """Achieved bytes/s over the peak, across every step so far."""
        if not self.step_seconds or not self.memory_bandwidth_peak:
            return 0.0
        return self.memory_bytes_read / self.step_seconds / self.memory_bandwidth_peak

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total

    @property
    def token_occupancy(self) -> float:
        if not self.token_slots_allocated:
            return 1.0
        return self.token_slots_held / self.token_slots_allocated
