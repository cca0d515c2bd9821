"""The OpenMP worker threads of the thread that built an engine, let go before another thread
steps it.

torch and kvserve's kernels share one OpenMP runtime (GNU libgomp, shipped with torch). Each
thread that runs a parallel region owns a pool of worker threads that outlives the region. An
engine built on one thread (loading, packing weights, warming up) and stepped on another (the
server's engine loop, ``kvserve bench``'s in-process target) leaves the first pool idle beside
the second. libgomp then counts more threads than CPUs and switches every pool to "throttled"
waiting: after each parallel region the workers sleep almost at once, and the next region
pays a futex wake-up per worker. A decode step runs hundreds of regions, so the same step
runs much slower on the engine thread than on the thread that built the engine. Freeing the
builder's pool (``omp_pause_resource_all``, OpenMP 5.0) restores the fast path; the pool is
recreated by the next parallel region on that thread, if there ever is one.

A helper thread that lives beside the engine (the KV offload worker) must not start a pool of
its own at all: one parallel torch op there (a ``torch.cat`` of loaded blocks) would leave its
pool idle beside the engine's for the rest of the run, with the same throttling.
:func:`serial_thread` makes the calling thread's parallel regions run on that thread alone.

A parallel region ends when its last thread does, and an idle worker spins for a while before
it sleeps. With every core in the team and a third busy thread beside it (another process, the
server's event loop, a benchmark client), the OS may run two of the team's threads on one core:
one spins while the other waits for that core, and every region (hundreds per step) waits for
a time slice. :class:`ThreadBinding` gives each team thread a core of its own, as vLLM's CPU
backend does (``VLLM_CPU_OMP_THREADS_BIND``): the busy thread then takes its share of one core
instead of stalling every region (``benchmarks/contention.py`` times both).
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kvserve import envs
from kvserve.kernels import NativeLibrary

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
    _bound.team = None  # the next pool is new: its workers are pinned again
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


BIND_ENV = "KVSERVE_CPU_OMP_THREADS_BIND"
_bound = threading.local()  # per thread: its home CPUs, and the CPUs its pool is pinned to


def parse_cpus(text: str) -> list[int]:
    """A CPU list as Linux writes it ("0-3,8,10-11")."""
    cpus: list[int] = []
    for part in text.split(","):
        lo, dash, hi = part.strip().partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()):
            raise ValueError(f"{BIND_ENV}: {text!r} is not auto, nobind or a CPU list like 0-3,8")
        cpus.extend(range(int(lo), int(hi) + 1) if dash else [int(lo)])
    return cpus


def physical_cores(cpus: set[int]) -> list[list[int]]:
    """``cpus`` grouped by physical core (by package and core id), each core's siblings in
    order, the cores in the order of their lowest CPU; one CPU a core where the topology is
    not readable."""
    top = Path("/sys/devices/system/cpu")
    cores: dict[tuple[int, int], list[int]] = {}
    try:
        for c in sorted(cpus):
            t = top / f"cpu{c}" / "topology"
            pkg = int((t / "physical_package_id").read_text())
            cores.setdefault((pkg, int((t / "core_id").read_text())), []).append(c)
    except (OSError, ValueError):
        return [[c] for c in sorted(cpus)]
    return sorted(cores.values())


def one_per_core(cpus: set[int]) -> list[int]:
    """``cpus`` with one logical CPU per physical core first (the lowest of each core's
    siblings), then the other siblings; sorted where the topology is not readable."""
    cores = physical_cores(cpus)
    return sorted(c[0] for c in cores) + [s for c in cores for s in c[1:]]


class ThreadBinding:
    """Each thread of the compute team on a CPU of its own while a step runs.

    The workers of the stepping thread's pool are pinned once (:func:`pin_team`, again after
    :func:`release_thread_pool`); the stepping thread itself only from :meth:`enter` to
    :meth:`exit`, so that what it starts between steps (threads, subprocesses, which inherit
    its CPUs) keeps the CPUs it had.
    """

    def __init__(self, cpus: list[int]) -> None:
        self.cpus = cpus

    @classmethod
    def from_env(cls, device: Any, threads: int | None = None) -> ThreadBinding | None:
        """The binding ``KVSERVE_CPU_OMP_THREADS_BIND`` asks for (``auto``, the default: one
        CPU per physical core of those this thread may use; ``nobind``; or a CPU list such as
        ``0-3``) for a team of ``threads`` (torch's), or None where there is nothing to bind:
        not a CPU device, one thread, more threads than CPUs, not Linux. Raises ValueError,
        naming the variable, for a list it cannot use."""
        # one list per tensor-parallel rank (0-3|4-7): a rank is given its own list alone
        # (kvserve.distributed.placement); an engine of one rank takes the first
        mode = envs.KVSERVE_CPU_OMP_THREADS_BIND.split("|")[0]
        n = torch.get_num_threads() if threads is None else threads
        linux = sys.platform.startswith("linux")
        if mode == "nobind" or str(device) != "cpu" or n < 2 or not linux:
            if mode not in ("auto", "nobind"):
                parse_cpus(mode)  # still refuse a malformed value
            return None
        home = os.sched_getaffinity(0)
        if mode == "auto":
            cpus = one_per_core(home)
            return cls(cpus[:n]) if len(cpus) >= n else None
        cpus = list(dict.fromkeys(parse_cpus(mode)))  # in the list's order, once each
        outside = sorted(set(cpus) - home)
        if outside:
            raise ValueError(f"{BIND_ENV}: CPUs {outside} are not among those this process may "
                             f"use ({','.join(map(str, sorted(home)))})")  # fmt: skip
        if len(cpus) < n:
            raise ValueError(
                f"{BIND_ENV}: {len(cpus)} CPU(s) for {n} compute threads; list at least "
                f"{n}, or set OMP_NUM_THREADS={len(cpus)}"
            )
        return cls(cpus[:n])

    def enter(self) -> bool:
        """Pin the calling thread for a step (and, the first time, its pool's workers); False,
        pinning nothing, where the workers could not be pinned: the calling thread pinned
        beside floating workers could end up sharing its core with one."""
        b = _bound
        if getattr(b, "team", None) != self.cpus:
            b.home = os.sched_getaffinity(0)
            b.pinned = pin_team(self.cpus)
            b.team = self.cpus
        if b.pinned:
            os.sched_setaffinity(0, (self.cpus[0],))
        return b.pinned

    def exit(self) -> None:
        """Give the calling thread back the CPUs it had before :meth:`enter` pinned it."""
        os.sched_setaffinity(0, _bound.home)


def _declare_pin(lib: ctypes.CDLL) -> None:
    lib.kvserve_pin_team.restype = ctypes.c_int
    lib.kvserve_pin_team.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int]


_PIN_LIB = NativeLibrary(Path(__file__).with_name("affinity.c"), ["-O2", "-fopenmp", "-std=gnu11"],
                         "OpenMP thread binding", _declare_pin)  # fmt: skip


def pin_team(cpus: list[int]) -> bool:
    """Pin workers 1..n-1 of the calling thread's pool to ``cpus[1:]`` (n = len(cpus));
    False where that could not be done (no compiler, a smaller team, the OS refused)."""
    lib = _PIN_LIB.get()
    if lib is None:
        return False
    arr = (ctypes.c_int * len(cpus))(*cpus)
    return lib.kvserve_pin_team(arr, len(cpus)) == len(cpus) - 1
