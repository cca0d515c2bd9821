"""Independent pure-Python work side by side: ``fork_map`` runs a function over items in
forked processes.

Simulations and report writing are pure Python and single-threaded, so a machine's other
cores sit idle while one runs; ``kvserve tune``'s candidates, ``kvserve simulate --sweep``'s
points and the chunks of a long run's per-request records are independent of each other.
Forked children inherit the data and the function's closure instead of receiving them
pickled (a long trace is hundreds of MB of prompts); only the results come back, pickled.
None of this does tensor work, so the children start no thread pools that a fork could leave
in a bad state.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")
R = TypeVar("R")

_WORK: tuple[Callable[[Any], Any], Sequence[Any]] | None = None


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return os.cpu_count() or 1


def _call(i: int) -> Any:
    fn, items = _WORK  # type: ignore[misc]  # set by fork_map before the fork
    return fn(items[i])


def fork_map(fn: Callable[[T], R], items: Sequence[T], jobs: int) -> list[R]:
    """``[fn(x) for x in items]``, in up to ``jobs`` forked processes; in order here when
    ``jobs`` < 2, there is one item, or the platform cannot fork."""
    global _WORK
    if jobs < 2 or len(items) < 2 or "fork" not in mp.get_all_start_methods():
        return [fn(x) for x in items]
    _WORK = (fn, items)
    try:
        with ProcessPoolExecutor(min(jobs, len(items)), mp.get_context("fork")) as pool:
            return list(pool.map(_call, range(len(items))))
    finally:
        _WORK = None
