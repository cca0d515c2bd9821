"""Tensor parallelism across processes: the torch.distributed group the ranks join, the
communicator their parallel modules call, and where each rank's compute threads run."""

from kvserve.distributed.communicator import (
    DistributedInit,
    TorchDistCommunicator,
    free_port,
    init_distributed,
)
from kvserve.distributed.placement import place_local, place_rank, rank_device

__all__ = [
    "DistributedInit",
    "TorchDistCommunicator",
    "free_port",
    "init_distributed",
    "place_local",
    "place_rank",
    "rank_device",
]
