"""What a worker measures for the engine's bandwidth meter (:mod:`kvserve.engine.bandwidth`): the
device's peak read bandwidth, and the bytes of weights one step reads; and the device's name,
which the reports that carry such measurements (a calibrated profile, a quality report) give."""

from __future__ import annotations

import platform
import time
from pathlib import Path

import torch

PROBE_BYTES = 256 * 2**20
PROBE_REPEATS = 3


def device_name(device: str = "cpu") -> str:
    """The CPU's model name (lscpu's), or the CUDA device's."""
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip() + f" ({torch.get_num_threads()} threads)"
    except OSError:
        pass
    return platform.processor() or "cpu"


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
