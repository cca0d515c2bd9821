"""Which shard of a tensor-parallel group a module holds, and how the shards' results meet.

A parallel module is built for one rank of a group (``rank``, ``world_size``) and keeps only
its shard of each checkpoint tensor; where its output is a partial sum (a row-parallel
product, a vocabulary shard's embedding rows) or a slice (a column shard, a vocabulary
shard's logits), it hands the result to the group's :class:`Communicator`, which returns the
sum or the concatenation over every rank. With one rank, the default, there is nothing to
combine and no communicator. The group is passed to each module, never looked up in a
global, so that several ranks' modules can live in one process (the tests do that).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from kvserve.config import ConfigError


class Communicator(Protocol):
    """The collectives a rank's modules call, over every rank of the group, in rank order."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The elementwise sum of every rank's ``x`` (equal shapes)."""
        ...

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's ``x`` concatenated along ``dim``, rank 0's first."""
        ...


@dataclass(frozen=True, slots=True)
class TensorParallelGroup:
    """One rank's place in a tensor-parallel group and the communicator that joins them."""

    rank: int = 0
    world_size: int = 1
    communicator: Communicator | None = None

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ConfigError(f"tensor_parallel_size: must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(
                f"tensor parallel rank: must be in [0, {self.world_size}), got {self.rank}"
            )
        if self.world_size > 1 and self.communicator is None:
            raise ConfigError(
                f"tensor_parallel_size {self.world_size}: the ranks need a communicator"
            )

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.communicator is None:
            return x
        return self.communicator.all_reduce(x)

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        if self.communicator is None:
            return x
        return self.communicator.all_gather(x, dim)


SINGLE_RANK = TensorParallelGroup()


def divide(total: int, world_size: int, field: str) -> int:
    """``total / world_size``, refused with both numbers where it does not divide."""
    if total % world_size:
        raise ConfigError(f"{field}: {total} is not divisible by tensor_parallel_size {world_size}")
    return total // world_size


def kv_head_split(total_kv_heads: int, world_size: int) -> tuple[int, int]:
    """(KV heads each rank holds, ranks that hold each KV head): the heads divided over the
    ranks, or, with more ranks than heads, each head replicated on ``world_size /
    total_kv_heads`` ranks (vLLM's rule). Refused with both numbers where neither divides."""
    if world_size >= total_kv_heads:
        if world_size % total_kv_heads:
            raise ConfigError(
                f"tensor_parallel_size: {world_size} is not a multiple of num_key_value_heads "
                f"{total_kv_heads} (each KV head is replicated on as many ranks)"
            )
        return 1, world_size // total_kv_heads
    return divide(total_kv_heads, world_size, "num_key_value_heads"), 1


def check_tensor_parallel(
    num_attention_heads: int, num_key_value_heads: int, intermediate_size: int, world_size: int
) -> None:
    """Refuse, before any rank starts, a model that ``world_size`` ranks cannot split: its
    attention heads, its KV heads (divided or replicated) and its MLP features must divide."""
    divide(num_attention_heads, world_size, "num_attention_heads")
    kv_head_split(num_key_value_heads, world_size)
    divide(intermediate_size, world_size, "intermediate_size")
