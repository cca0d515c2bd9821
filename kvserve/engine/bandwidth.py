"""Achieved memory bandwidth: bytes of weights and KV a step reads over its time, against the
device's peak.

Decode is memory-bound: each step reads every weight once and each sequence's whole cache. The
fraction of peak bandwidth an engine reaches says how much a faster kernel could still buy,
independently of how big the batch is. The step's bytes are counted from its description (the
weights, plus every scheduled sequence's cache entries after the step times the format's bytes
per token); the peak is measured once at start by streaming a buffer much larger than the last
level cache (a sum reads every byte once), on the engine's own device, by the worker that
computes there (:mod:`kvserve.worker.bandwidth`).
"""

from __future__ import annotations

from kvserve.sched.output import SchedulerOutput


def step_bytes_read(out: SchedulerOutput, weight_bytes: int, kv_bytes_per_token: float) -> int:
    """Bytes a step reads: every weight once, and each sequence's cache entries up to its
    newest token that its queries attend to (a retention window's, when it has one)."""
    entries = 0
    for s in out.seqs:
        n = s.num_cached + len(s.token_ids)
        entries += min(n, s.window + s.sinks) if s.window else n
    return weight_bytes + int(entries * kv_bytes_per_token)


class BandwidthMeter:
    """Totals of bytes read and step seconds (counters), and the peak they are judged by."""

    def __init__(self, weight_bytes: int, kv_bytes_per_token: float, peak: float) -> None:
        self.weight_bytes = weight_bytes
        self.kv_bytes_per_token = kv_bytes_per_token
        self.peak = peak  # bytes/s
        self.bytes_read = 0
        self.seconds = 0.0

    def record(self, out: SchedulerOutput, seconds: float) -> None:
        if out.seqs and seconds > 0:
            self.bytes_read += step_bytes_read(out, self.weight_bytes, self.kv_bytes_per_token)
            self.seconds += seconds

    @property
    def achieved(self) -> float:
        """Mean bytes/s over every step so far (0 before the first)."""
        return self.bytes_read / self.seconds if self.seconds else 0.0
