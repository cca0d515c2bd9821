"""Achieved memory bandwidth: bytes of weights and KV a step reads over its time, against the
device's peak.

Decode is memory-bound: each step reads every weight once and each sequence's whole cache. The
fraction of peak bandwidth an engine reaches says how much a faster kernel could still buy,
independently of how big the batch is. The step's bytes are counted from its description (the
weights, plus every scheduled sequence's cache entries after the step times the format's bytes
per token); the peak is measured once at start by streaming a buffer much larger than the last
level cache (a sum reads every byte once), on the engine's own device.
"""

from __future__ import annotations

import time

import torch

from kvserve.sched.output import SchedulerOutput

PROBE_BYTES = 256 * 2**20
PROBE_REPEATS = 3


def measure_peak_bandwidth(device: torch.device, nbytes: int = PROBE_BYTES) -> float:
    """Bytes per second the device reads, best of a few passes over ``nbytes``."""
    buf = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    buf.sum()  # first touch: page faults, not bandwidth
    best = float("inf")
    for _ in range(PROBE_REPEATS):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        buf.sum()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best


def weight_bytes_read(model: torch.nn.Module) -> int:
    """Bytes of weights one step reads: every matrix except the embedding table (a step
    gathers only its tokens' rows), counting a tied lm_head once."""
    seen, total = set(), 0
    for name, p in model.named_parameters(remove_duplicate=False):
        # id, not data_ptr: a backend's packed matrices have no plain storage to point at
        if name == "embed_tokens.weight" or id(p) in seen:
            continue
        seen.add(id(p))
        total += p.numel() * p.element_size()
    return total


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
