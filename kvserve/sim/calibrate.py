"""``kvserve simulate --calibrate``: the cost model's factors from the real engine's steps.

The real engine (weights, kernels, tokenizer: what ``kvserve serve`` runs) runs a workload
under ``kvserve bench``'s in-process target, exactly as a measured run does (its thread, the
load generator beside it); every ``LLMEngine.step()`` is timed whole (scheduling, the forward
pass, sampling, output processing) beside the features of the batch it ran, and every
``add_request`` beside its prompt length. The device's peaks are
measured first (a representative GEMM in the compute dtype; a streaming read), so the fitted
factors are efficiencies against this machine's own ceilings, the same fields a CUDA run fills.
"""

from __future__ import annotations

import asyncio
import platform
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvserve.bench.engine_target import EngineTarget
from kvserve.bench.runner import LoadSpec, benchmark
from kvserve.bench.workloads import BenchRequest
from kvserve.engine.bandwidth import measure_peak_bandwidth
from kvserve.plan.capacity import load_arch, load_config
from kvserve.sim.cost import FitReport, ModelShape, Profile, StepFeatures, fit_profile
from kvserve.sim.cost import step_features as features_of


def measure_gemm_peak(dtype: torch.dtype, hidden: int, device: str = "cpu") -> float:
    """FLOP/s of a representative GEMM (2,048 tokens x hidden -> 3 x hidden), best of five."""
    a = torch.randn(2048, hidden, dtype=dtype, device=device)
    w = torch.randn(3 * hidden, hidden, dtype=dtype, device=device)
    torch.nn.functional.linear(a, w)
    best = float("inf")
    for _ in range(5):
        if a.is_cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        torch.nn.functional.linear(a, w)
        if a.is_cuda:
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return 2 * 2048 * hidden * 3 * hidden / best


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


def calibrate(
    target: EngineTarget,
    runs: list[tuple[list[BenchRequest], LoadSpec]],
    seed: int = 0,
    warmup: list[BenchRequest] | None = None,
) -> tuple[Profile, FitReport]:
    """Run the real engine behind ``target`` on each (requests, load) in turn, measure this
    device's peaks, fit the factors to every step. The caller builds the target first, so
    the workloads can be counted with its tokenizer without loading the model twice.
    Several loads of one workload (all at once, and an open loop at a rate the engine
    sustains) show it both large batches and a busy stream of small prefills beside decodes."""
    if not runs:
        raise ValueError("calibration: needs at least one (workload, load) run")
    eng = target.engine
    model = str(eng.config.model)
    cfg, _ = load_config(model)
    spec = load_arch(model)
    dtype = str(eng.dtype).removeprefix("torch.")
    shape = ModelShape.from_arch(
        spec, eng.kv_cache_dtype, dtype, bool(cfg.get("tie_word_embeddings"))
    )
    dev = str(eng.config.device)
    peak_flops = measure_gemm_peak(eng.dtype, spec.hidden_size, dev)
    peak_bw = measure_peak_bandwidth(torch.device(dev))
    base = Profile(
        device=device_name(dev),
        peak_flops=peak_flops,
        peak_bandwidth=peak_bw,
        source="peaks measured on this machine (a 2048 x hidden x 3 hidden GEMM in the compute "
        "dtype; a streaming read); factors fitted to the real engine's step times",
        dtype=dtype,
    )
    steps: list[tuple[StepFeatures, float]] = []
    adds: list[tuple[int, float]] = []
    warm = len(warmup or [])
    step, add = eng.step, eng.add_request

    touched: set[int] = set()  # the real pool's blocks written so far

    def timed_step() -> Any:
        a = time.perf_counter()
        out = step()
        seconds = time.perf_counter() - a
        if eng.core.last_step.seqs:
            f = features_of(eng.core.last_step, shape, touched, eng.block_size)
            if len(adds) > warm:  # warm-up steps only touch blocks
                steps.append((f, seconds))
        return out

    def timed_add(*args: Any, **kwargs: Any) -> Any:
        a = time.perf_counter()
        rid = add(*args, **kwargs)
        req = eng.requests.get(rid)
        adds.append((req.num_prompt_tokens if req else 0, time.perf_counter() - a))
        return rid

    eng.step, eng.add_request = timed_step, timed_add  # type: ignore[method-assign]
    t0 = time.perf_counter()
    workloads, loads = [r for r, _ in runs], [ld for _, ld in runs]
    asyncio.run(benchmark(target, workloads, loads, seed, warmup, progress=False))
    wall = time.perf_counter() - t0
    adds = adds[warm:]
    profile, report = fit_profile(steps, shape, base)
    if adds:
        x = np.array([[1.0, n] for n, _ in adds])
        y = np.array([s for _, s in adds])
        coef = np.linalg.lstsq(x, y, rcond=None)[0]
        if coef[1] < 0:  # no measurable per-token cost: a constant
            coef = np.array([float(y.mean()), 0.0])
        profile.request_overhead_s = max(0.0, float(coef[0]))
        profile.request_overhead_per_token_s = max(0.0, float(coef[1]))
    profile.calibration = {
        "model": model,
        "kv_cache_dtype": eng.kv_cache_dtype,
        "num_requests": sum(len(r) for r in workloads),
        "loads": [ld.describe() for ld in loads],
        "seed": seed,
        "wall_s": wall,
        "steps": report.steps,
        "median_abs_step_error": report.median_abs_error,
        "p90_abs_step_error": report.p90_abs_error,
        "total_time_error": report.total_time_error,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    return profile, report
