"""The ranks' process group (torch.distributed) and the :class:`Communicator` over it.

Every rank of a tensor-parallel engine joins one process group at start: gloo on a CPU,
NCCL on CUDA, rendezvous at ``tcp://master_addr:master_port`` (a free loopback port that the
engine picks for workers on its own machine; the Ray executor's rank 0 picks one on its node;
a torchrun launch names its own). Its parallel modules call a communicator, in the same order
on every rank (the model's forward pass is the same code on each, so the order holds by
construction): :class:`TorchDistCommunicator`, the group's own collectives, or, where every
rank of a CPU group shares one host, the shared-memory
:class:`~kvserve.distributed.shm_communicator.ShmCommunicator`.

A collective whose peer is gone fails rather than waits: gloo reports a closed connection at
once, and every collective is bounded by ``timeout_s`` besides (a peer on another machine that
stops answering without closing its socket).
"""

from __future__ import annotations

import datetime
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from kvserve import envs
from kvserve.config import ConfigError
from kvserve.distributed.shm_communicator import ShmCommunicator, host_identity, shm_supported

COLLECTIVE_TIMEOUT_S = 120.0


@dataclass(frozen=True, slots=True)
class DistributedInit:
    """How a rank joins its group: plain data an executor sends to each worker."""

    world_size: int
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    backend: str = "gloo"
    timeout_s: float = COLLECTIVE_TIMEOUT_S

    @property
    def init_method(self) -> str:
        return f"tcp://{self.master_addr}:{self.master_port}"


def backend_for(device: str) -> str:
    """vLLM's choice: NCCL between CUDA devices, gloo on a CPU."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (the OS picks it; the group binds it moments later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class TorchDistCommunicator:
    """All-reduce and all-gather over a torch.distributed process group (the default one)."""

    def __init__(self, rank: int, world_size: int, device: torch.device) -> None:
        self.rank, self.world_size, self.device = rank, world_size, device

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        dist.all_reduce(x)
        return x

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x)
        return torch.cat(parts, dim)


def init_distributed(
    init: DistributedInit, rank: int, device: torch.device, custom_all_reduce: bool = True
) -> TorchDistCommunicator | ShmCommunicator:
    """Join rank ``rank`` to the group ``init`` describes (once per process) and return the
    communicator over it: on a CPU where every rank shares this host and ``custom_all_reduce``
    (vLLM's ``--disable-custom-all-reduce`` turns it off), the shared-memory one
    (:mod:`kvserve.distributed.shm_communicator`), else torch.distributed's collectives. A
    rank that cannot reach the others within ``timeout_s`` raises."""
    if not 0 <= rank < init.world_size:
        raise ConfigError(f"rank: must be in [0, {init.world_size}), got {rank}")
    if dist.is_initialized():
        raise RuntimeError("this process already belongs to a torch.distributed group")
    if init.backend == "gloo" and init.master_addr in ("127.0.0.1", "localhost"):
        # gloo binds the interface its host name resolves to; on one machine that is loopback
        envs.set_for_process("GLOO_SOCKET_IFNAME", "lo", only_if_unset=True)
    if init.backend == "nccl":
        torch.cuda.set_device(device)
    dist.init_process_group(
        init.backend,
        init_method=init.init_method,
        rank=rank,
        world_size=init.world_size,
        timeout=datetime.timedelta(seconds=init.timeout_s),
    )
    if custom_all_reduce and init.world_size > 1 and shm_supported(device):
        hosts: list[str] = [""] * init.world_size
        dist.all_gather_object(hosts, host_identity())
        if len(set(hosts)) == 1:
            return ShmCommunicator.create(rank, init.world_size, device, init.timeout_s)
    return TorchDistCommunicator(rank, init.world_size, device)


def destroy_distributed() -> None:
    """Leave the group (a worker that stops)."""
    if dist.is_initialized():
        dist.destroy_process_group()
