"""The interface every attention backend implements.

A backend attends one layer of one step's flat batch over the paged KV cache: it writes the
step's K/V through the storage, then computes attention for decode rows, prefill chunks and
retention's extras, as :class:`~kvserve.attention.metadata.AttentionMetadata` describes them.
Backends differ only in how they compute (plain PyTorch, C kernels, GPU kernels); the KV
format is the storage's business, and a backend reaches a format's bytes either through
``KVStorage.gather`` (any format) or through the format's tensors where it has a kernel for
them.

The registry (:mod:`kvserve.attention.registry`) maps names to classes; ``auto`` picks, among
the backends that run on the device and are available there, the one with the highest
:attr:`AttentionBackend.auto_priority`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from kvserve.attention.metadata import AttentionMetadata
from kvserve.kv.storage import KVStorage


class AttentionBackend(ABC):
    """One way of computing paged attention; one instance serves every layer of a model."""

    # The registry's name for it (``--attention-backend``).
    name: ClassVar[str]
    # The device types (``torch.device.type``) it runs on; None: every device.
    device_types: ClassVar[frozenset[str] | None] = None
    # ``auto``'s preference among the backends that run on a device and are available there.
    auto_priority: ClassVar[int] = 0

    @classmethod
    def runs_on(cls, device: torch.device) -> bool:
        """Whether it can run on ``device`` at all (choosing it elsewhere is a config error)."""
        return cls.device_types is None or device.type in cls.device_types

    @classmethod
    def available(cls, device: torch.device) -> bool:
        """Whether its kernels can be had on ``device`` now (built, not switched off): what
        ``auto`` asks. A backend chosen by name where it is not available still runs, every
        call falling back to the reference."""
        return cls.runs_on(device)

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: int,
        storage: KVStorage,
        meta: AttentionMetadata,
        window: int | None = None,
    ) -> torch.Tensor:
        """Write this step's K/V into the cache, then attend. q: [T, H, D]; k, v: [T, KVH, D];
        ``window``: the layer's sliding window (None: full attention). Returns [T, H, D]."""

    def serves_retention(self, storage: KVStorage) -> bool:
        """Whether its fused paged kernel serves retention's extras over ``storage``: H2O's
        attention mass as a side output (the group's ``votes``) and StreamingLLM's sink keys
        (its ``sinks``). The runner groups such rows for that kernel only where it does;
        elsewhere they take the per-sequence reference paths."""
        return False
