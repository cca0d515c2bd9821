"""The KV pool a GPU gives under ``--gpu-memory-utilization``: pure arithmetic that the
worker (after its profiling forward, :mod:`kvserve.worker.memory_profile`), ``kvserve plan``
and ``kvserve simulate`` share, so the three cannot drift apart."""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.config import ConfigError


@dataclass(frozen=True, slots=True)
class GpuMemoryBudget:
    """The KV pool a GPU gives under ``--gpu-memory-utilization`` (vLLM's rule): of the
    fraction of the card's memory the engine may use, what the weights, the activation peak
    of one profiling forward at ``max_num_batched_tokens`` and the memory outside torch's
    allocator (the CUDA context, NCCL, cuBLAS workspaces) leave, in whole blocks.

    Pure arithmetic, so the engine, ``kvserve plan`` and ``kvserve simulate`` apply one rule
    (the planner, which runs no forward, passes zero for the activations and the rest)."""

    total_bytes: float  # the card's memory (torch.cuda.mem_get_info's second figure)
    gpu_memory_utilization: float
    weight_bytes: float
    activation_peak_bytes: float
    non_torch_bytes: float
    block_bytes: float  # one block's bytes, every layer's K and V with the format's metadata
    fixed_bytes: float = 0.0  # what the format keeps besides its blocks (KIVI's residuals)

    @property
    def usable_bytes(self) -> float:
        return self.total_bytes * self.gpu_memory_utilization

    @property
    def kv_budget_bytes(self) -> float:
        return (
            self.usable_bytes - self.weight_bytes - self.activation_peak_bytes
            - self.non_torch_bytes - self.fixed_bytes
        )  # fmt: skip

    @property
    def num_blocks(self) -> int:
        """Whole blocks in the budget (0 when nothing is left)."""
        budget = self.kv_budget_bytes
        return int(budget // self.block_bytes) if budget > 0 else 0

    def describe(self) -> str:
        """The arithmetic, as the start-up log prints it."""
        g = 2**30
        fixed = f" - {self.fixed_bytes / g:.2f} fixed" if self.fixed_bytes else ""
        return (
            f"{self.total_bytes / g:.2f} GiB x {self.gpu_memory_utilization:g} "
            f"(gpu_memory_utilization) - {self.weight_bytes / g:.2f} weights - "
            f"{self.activation_peak_bytes / g:.2f} activation peak - "
            f"{self.non_torch_bytes / g:.2f} non-torch{fixed} = "
            f"{self.kv_budget_bytes / g:.2f} GiB for KV = {self.num_blocks:,} blocks of "
            f"{int(self.block_bytes):,} bytes"
        )


def gpu_num_blocks(budget: GpuMemoryBudget) -> int:
    """``budget.num_blocks``, or a ConfigError naming the numbers when no block fits."""
    n = budget.num_blocks
    if n < 1:
        raise ConfigError(
            f"gpu_memory_utilization: no room for a KV block of {int(budget.block_bytes):,} "
            f"bytes: {budget.describe()}; raise gpu_memory_utilization (at most 1), lower "
            "max_num_batched_tokens (the activation peak) or use a smaller model"
        )
    return n
