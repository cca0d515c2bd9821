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

A helper thread that lives beside the engine (the KV offload worker) must not start a pool of
its own at all: one parallel torch op there (a ``torch.cat`` of loaded blocks) would leave its
pool idle beside the engine's for the rest of the run, with the same throttling.
:func:`serial_thread` makes the calling thread's parallel regions run on that thread alone.
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Callable
from typing import Any

import torch

OMP_PAUSE_SOFT = 1  # OpenMP 5.0's omp_pause_soft: free the calling thread's pool


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return os.cpu_count() or 1


def _libgomp_fn(name: str, restype: type | None) -> Callable[[int], Any] | None:
    """``name`` (taking one int) from the libgomp already loaded in this process (torch's),
    never a new one; None where there is none (another OS, no libgomp, an older OpenMP)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        with open("/proc/self/maps") as f:
            paths = {ln.split()[-1] for ln in f if "libgomp" in ln and "/" in ln}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        except OSError:
            continue
        fn = getattr(lib, name, None)
        if fn is None:
            return None
        fn.argtypes = [ctypes.c_int]
        fn.restype = restype
        return fn
    return None


def release_thread_pool() -> bool:
    """Free the calling thread's OpenMP worker threads; call it on the thread that built an
    engine, before another thread steps it. False where there is nothing to call (no libgomp
    loaded, an OpenMP without OpenMP 5.0's pause, another OS) or the runtime refused."""
    pause = _libgomp_fn("omp_pause_resource_all", ctypes.c_int)
    return pause is not None and pause(OMP_PAUSE_SOFT) == 0


def serial_thread() -> bool:
    """Make the calling thread's OpenMP parallel regions (torch's intra-op parallelism, which
    asks the calling thread's team size) run on that thread alone, so it never starts a pool;
    other threads keep theirs. Call it first thing on a helper thread beside an engine. False
    where there is nothing to call (no libgomp loaded, another OS)."""
    set_threads = _libgomp_fn("omp_set_num_threads", None)
    if set_threads is None:
        return False
    # ATen sets a thread's team size to torch.set_num_threads' value at its first parallel op
    # on that thread (once per thread): have that happen first, then shrink the team.
    torch.get_num_threads()
    set_threads(1)
    return True
