"""Peak float32 FMA and bf16 dot-product rates of one core of this CPU, from the instructions
themselves (``benchmarks/isa_peak.c``), beside a float32 and a bf16 torch GEMM on one thread.

Without AMX, a bf16 GEMM runs on AVX512-BF16's ``vdpbf16ps``; where that instruction retires
fewer FLOPs per cycle than float32 FMAs do, no bf16 GEMM can beat a float32 one, and bf16
pays off only where bytes bound the step (decode): the reason kvserve's ``UpcastOps`` runs
large steps in float32 on such CPUs, and why a GEMM-bound run's speed is the float32 GEMM's.

    .venv/bin/python -m benchmarks.isa_peak
"""

from __future__ import annotations

import ctypes
import time
from pathlib import Path

import torch

from benchmarks.common import emit, median, table
from kvserve.kernels import build_library

ITERS = 20_000_000  # ~0.1-0.3 s a loop


def gemm_gflops(dtype: torch.dtype, n: int = 1024) -> float:
    """One thread, an n x n x n matmul, median of five."""
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    a @ b
    times = []
    for _ in range(5):
        t = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t)
    return 2 * n**3 / median(times) / 1e9


def main() -> None:
    src = Path(__file__).with_name("isa_peak.c")
    lib = build_library(src, ["-O2", "-march=native", "-std=c11"], "ISA peak probe")
    if lib is None:
        raise SystemExit("isa_peak: the probe did not build (see the warning), nothing measured")
    sink = ctypes.c_float()
    rows = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    probes = [
        ("float32 FMA (vfmadd231ps)", "kvserve_peak_fma_f32", torch.float32),
        ("bf16 dot (vdpbf16ps)", "kvserve_peak_dot_bf16", torch.bfloat16),
    ]
    for name, fn, dtype in probes:
        f = getattr(lib, fn)
        f.restype, f.argtypes = ctypes.c_double, [ctypes.c_int64, ctypes.POINTER(ctypes.c_float)]
        peak = median([f(ITERS, ctypes.byref(sink)) for _ in range(3)])
        rows.append({"instruction": name,
                     "peak GFLOP/s (1 core)": "absent" if peak < 0 else f"{peak:.1f}",
                     "torch GEMM 1024^3 (1 thread)": f"{gemm_gflops(dtype):.1f}"})  # fmt: skip
    torch.set_num_threads(threads)
    print(table(rows, list(rows[0])))
    emit({"benchmark": "isa_peak", "rows": rows})


if __name__ == "__main__":
    main()
