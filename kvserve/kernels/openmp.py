"""The OpenMP worker threads of the thread that built an engine, let go before another thread
steps it.

torch and kvserve's kernels share one OpenMP runtime (GNU libgomp, shipped with torch). Each
thread that runs a parallel region owns a pool of worker threads that outlives the region. An
engine built on one thread (loading, packing weights, warming up) and stepped on another (the
server's engine loop, ``kvserve bench``'s in-process target) leaves the first pool idle beside
the second. libgomp then counts more threads than CPUs and switches every pool to "throttled"
waiting: after each parallel region the workers sleep almost at once, and the next region
pays a futex wake-up per worker. A decode step runs hundreds of regions, so the same step
runs much slower on the engine thread than on the thread that built the engine
(``BENCHMARKS.md``, session 41). Freeing the builder's pool (``omp_pause_resource_all``,
OpenMP 5.0) restores the fast path; the pool is recreated by the next parallel region on that
thread, if there ever is one.
"""

from __future__ import annotations

import ctypes
import os
import sys

OMP_PAUSE_SOFT = 1  # OpenMP 5.0's omp_pause_soft: free the calling thread's pool


def _libgomp() -> ctypes.CDLL | None:
    """The libgomp already loaded in this process (torch's), never a new one."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        with open("/proc/self/maps") as f:
            paths = {ln.split()[-1] for ln in f if "libgomp" in ln and "/" in ln}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            return ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        except OSError:
            continue
    return None


def release_thread_pool() -> bool:
    """Free the calling thread's OpenMP worker threads; call it on the thread that built an
    engine, before another thread steps it. False where there is nothing to call (no libgomp
    loaded, an OpenMP without OpenMP 5.0's pause, another OS) or the runtime refused."""
    lib = _libgomp()
    pause = getattr(lib, "omp_pause_resource_all", None) if lib is not None else None
    if pause is None:
        return False
    pause.argtypes = [ctypes.c_int]
    pause.restype = ctypes.c_int
    return pause(OMP_PAUSE_SOFT) == 0
