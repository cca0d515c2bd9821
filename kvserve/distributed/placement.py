"""Which CPUs a tensor-parallel rank computes on.

On one machine the ranks share its cores: each rank takes a disjoint share of whole physical
cores (a core's hyperthread siblings stay with it), runs one compute thread per core of its
share, and its :class:`~kvserve.kernels.openmp.ThreadBinding` pins them there. Ranks
that overlapped would each spin their OpenMP team on the other's cores, and every all-reduce
would wait for the slower one. ``KVSERVE_CPU_OMP_THREADS_BIND=0-3|4-7`` names each rank's list
instead (vLLM's ``VLLM_CPU_OMP_THREADS_BIND`` form); ``nobind`` leaves the threads to the OS.
"""

from __future__ import annotations

import os
import sys

import torch

from kvserve import envs
from kvserve.kernels.openmp import BIND_ENV, parse_cpus, physical_cores


def rank_cpus(rank: int, world_size: int, home: set[int]) -> list[int] | None:
    """Rank ``rank``'s share of ``home`` (the CPUs the engine may use), or of the lists
    ``KVSERVE_CPU_OMP_THREADS_BIND`` names per rank; None where there is nothing to place
    (nobind, fewer CPUs than ranks). Raises ValueError naming the variable for a list it
    cannot use."""
    mode = envs.KVSERVE_CPU_OMP_THREADS_BIND
    if mode == "nobind":
        return None
    if "|" in mode:
        parts = mode.split("|")
        if len(parts) != world_size:
            raise ValueError(f"{BIND_ENV}: {len(parts)} CPU list(s) for "
                             f"{world_size} tensor-parallel ranks; give one per rank")  # fmt: skip
        cpus = list(dict.fromkeys(parse_cpus(parts[rank])))
        outside = sorted(set(cpus) - home)
        if outside:
            raise ValueError(f"{BIND_ENV}: CPUs {outside} of rank {rank} are not among those "
                             "this process may use")  # fmt: skip
        return cpus
    if mode != "auto":  # one list for the whole engine: each rank a share of it
        home = set(parse_cpus(mode)) & home
    cores = physical_cores(home)  # whole cores to each rank: siblings never split
    if len(cores) < world_size:  # fewer cores than ranks: the logical CPUs, one each
        cores = [[c] for c in sorted(home)]
    share = len(cores) // world_size
    if share < 1:
        return None
    return sorted(c for core in cores[rank * share : (rank + 1) * share] for c in core)


def rank_device(device: str, local_rank: int, world_size: int) -> str:
    """The device of a rank among ``world_size`` on one machine: ``cuda`` without an index
    means one GPU per rank (``cuda:LOCAL_RANK``); anything else is every rank's as given."""
    d = torch.device(device)
    if d.type == "cuda" and d.index is None and world_size > 1:
        return f"cuda:{local_rank}"
    return device


def place_local(device: str, local_rank: int, local_world: int) -> str:
    """Place this process as rank ``local_rank`` of the ``local_world`` ranks on this machine
    (its share of the CPUs, :func:`place_rank`) and return its device (:func:`rank_device`):
    what every launcher does first in a rank's process. A lone rank is left as it is."""
    device = rank_device(device, local_rank, local_world)
    place_rank(local_rank, local_world, device)
    return device


def place_rank(rank: int, world_size: int, device: str) -> list[int] | None:
    """Confine this process (rank ``rank`` of ``world_size`` on one machine) to its CPUs and
    size its compute team to them; the CPUs, or None where it placed nothing. Call it first
    thing in the rank's process, before any parallel torch op."""
    if (
        world_size == 1
        or torch.device(device).type != "cpu"
        or not sys.platform.startswith("linux")
    ):
        return None
    cpus = rank_cpus(rank, world_size, os.sched_getaffinity(0))
    if not cpus:
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // world_size))
        return None
    os.sched_setaffinity(0, cpus)
    # one compute thread per physical core of the share (the binding's own rule), or per
    # CPU of a list given by name
    explicit = envs.KVSERVE_CPU_OMP_THREADS_BIND != "auto"
    torch.set_num_threads(len(cpus) if explicit else len(physical_cores(set(cpus))))
    # the binding inside the rank reads the variable: give it this rank's list alone
    if envs.KVSERVE_CPU_OMP_THREADS_BIND != "auto":
        envs.set_for_process(BIND_ENV, ",".join(map(str, cpus)))
    return cpus
