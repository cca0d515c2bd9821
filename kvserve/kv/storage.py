"""Where K/V bytes live: one interface every KV format implements, and the dense format.

The storage is the seam between the paged cache and its storage format: it owns the layout
and nothing else. Attention (:mod:`kvserve.attention`) writes new K/V through
:meth:`KVStorage.write` and reads whole blocks back, in the compute dtype, through
:meth:`KVStorage.gather` (the reference path, any format); a backend with kernels for a format
reads that format's tensors itself. The runner applies the KV manager's record of the step
around the forward pass: :meth:`release_blocks` for blocks whose last reference went,
:meth:`copy_blocks` for copy-on-write, :meth:`begin_step` with the step's slot mapping.
:meth:`export_blocks` / :meth:`import_blocks` move the exact stored bytes of blocks out of and
into a pool (another engine's, a host tier), bit for bit.

Every per-block tensor has ``num_blocks + 1`` rows: the last row is the **null block**
(``null_block``), which pads block tables and stands for a dropped block. It is never handed
out, never written and never attended (masks and kernels stop at each sequence's length); it
is zero, so a masked read of it stays finite. Its bytes count as the format's fixed bytes.
"""

from __future__ import annotations

import math
import mmap
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvserve.kernels.host_device import to_device
from kvserve.kv.host_copies import HostCopies

TORCH_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


class KVFormatMismatch(ValueError):
    """A payload of blocks was stored by another format, geometry or pool-wide scale."""


@dataclass(slots=True)
class BlockPayload:
    """The stored bytes of some blocks, as a storage exported them.

    ``tensors`` maps each per-block tensor's name to ``[num_layers, n, ...]`` CPU tensors in
    the order of the exported block ids; ``pool`` holds pool-wide state the blocks need to be
    decoded (fp8's per-head scales); ``extra`` is format-specific (KIVI's residual rows).
    ``ready``: the event of an export from a GPU still copying ``tensors`` into pinned host
    memory (:mod:`kvserve.kv.host_copies`); whoever reads their bytes calls :meth:`wait`."""

    identity: dict[str, Any]
    num_blocks: int
    tensors: dict[str, torch.Tensor]
    pool: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    ready: Any = None

    def wait(self) -> BlockPayload:
        """Block until ``tensors`` hold their bytes (a no-op for a payload made on the CPU)."""
        event = self.ready
        if event is not None:
            event.synchronize()
            self.ready = None
        return self

    def pinned(self) -> BlockPayload:
        """This payload with its tensors copied into pinned host memory, from which an import
        to a GPU runs without blocking the engine (the offload worker pins what it loads)."""
        tensors = {name: t.pin_memory() for name, t in self.wait().tensors.items()}
        return BlockPayload(self.identity, self.num_blocks, tensors, self.pool, self.extra)

    @staticmethod
    def concat(payloads: list[BlockPayload]) -> list[BlockPayload]:
        """Consecutive payloads as one (one copy per tensor and layer when imported), or as
        they are when there is one or any carries format side state (KIVI's residual rows)."""
        if len(payloads) <= 1 or any(p.extra for p in payloads):
            return list(payloads)
        for p in payloads:
            p.wait()
        first = payloads[0]
        n = sum(p.num_blocks for p in payloads)
        tensors = {k: torch.cat([p.tensors[k] for p in payloads], dim=1) for k in first.tensors}
        return [BlockPayload(first.identity, n, tensors, first.pool)]

    def select(self, indices: list[int]) -> BlockPayload:
        """The payload of the blocks at ``indices`` (positions in this payload), in order."""
        idx = torch.tensor(indices, dtype=torch.long)
        tensors = {name: t.index_select(1, idx) for name, t in self.wait().tensors.items()}
        extra: dict[str, Any] = {}
        res = self.extra.get("residual", [])
        if res:
            where = {b: j for j, b in enumerate(res)}
            keep = [(i, where[b]) for i, b in enumerate(indices) if b in where]
            if keep:
                rows = torch.tensor([j for _, j in keep], dtype=torch.long)
                extra = {
                    "residual": [i for i, _ in keep],
                    "res_k": self.extra["res_k"].index_select(1, rows),
                    "res_v": self.extra["res_v"].index_select(1, rows),
                }
        return BlockPayload(self.identity, len(indices), tensors, self.pool, extra)


PAGE_BYTES = 4096  # a stride that reaches every page: no kernel kvserve runs on has smaller ones
HUGE_PAGE_BYTES = 2 << 20  # x86-64's transparent huge pages


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor. On the CPU its memory comes from calloc (through NumPy), so the
    operating system hands out zero pages as they are first written instead of the engine
    writing every byte of a pool at start: a 1.5 GB pool costs milliseconds, not seconds, and
    blocks that are never used never take memory.

    On Linux, a tensor of a huge page or more is instead mapped at a huge-page boundary and
    marked for transparent huge pages (``MADV_HUGEPAGE``; the kernel's default mode honours
    only marked memory): decode attention and the KV write read and write every sequence's
    blocks, scattered over the pool, each step, and with 4 KiB pages each block costs its own
    TLB miss, a two-level page walk in a virtual machine. Memory is still taken as it is
    first written, a huge page at a time."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = itemsize * math.prod(shape)
    if nbytes >= HUGE_PAGE_BYTES and hasattr(mmap, "MADV_HUGEPAGE"):
        # anonymous mappings are zero-filled; one huge page of slack for the alignment
        m = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        base = np.frombuffer(m, np.uint8)
        start = -base.ctypes.data % HUGE_PAGE_BYTES
        try:
            m.madvise(mmap.MADV_HUGEPAGE, start, nbytes)
        except OSError:  # a kernel built without transparent huge pages: 4 KiB pages then
            pass
        raw = base[start : start + nbytes]  # keeps the mapping alive
        return torch.from_numpy(raw).view(dtype).reshape(shape)
    raw = np.zeros((*shape[:-1], shape[-1] * itemsize) if shape else (itemsize,), np.uint8)
    return torch.from_numpy(raw).view(dtype).reshape(shape)


class KVStorage(ABC):
    """The interface of a paged KV format; subclasses allocate their tensors in ``__init__``
    after calling this one.

    A format declares its bytes per token and fixed bytes (class methods, so the pool can be
    sized before anything is allocated), names its per-block tensors in
    :meth:`block_tensors` (copy-on-write, export and import use them) and implements
    :meth:`write` and :meth:`gather`; the rest has defaults."""

    # Whether single cache entries can move between slots (SnapKV's compaction): true for
    # formats whose every per-block tensor is ``[rows, kv_heads, block_size, ...]``, each
    # token's codes and metadata its own.
    supports_entry_copy = True

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        layer_slots: tuple[int, ...] | None = None,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks: must be >= 1, got {num_blocks}")
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype  # the compute dtype that gather returns
        self.device = torch.device(device)
        # Per-layer descriptors an attention backend built over this layer's tensors
        # (kvserve.attention.cpu_backend); a format drops a layer's entry whenever it replaces
        # that layer's tensors (fp8's scales), so no kernel reads through a stale pointer.
        self.kernel_views: dict[int, Any] = {}
        # Hybrid models (kvserve.kv.layer_groups): layer l's per-block tensors are those of slot
        # layer_slots[l], shared by the layers of other groups (a block belongs to one group).
        self.layer_slots = layer_slots
        self.host_copies = HostCopies(self.device)
        self.null_block = num_blocks
        self.format_name = ""  # set by subclasses: the layout that goes into prefix-cache keys

    @classmethod
    def from_format(
        cls,
        name: str,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        compute_dtype: torch.dtype,
        device: torch.device | str = "cpu",
        *,
        max_num_seqs: int = 256,
        k_scales: torch.Tensor | None = None,
        v_scales: torch.Tensor | None = None,
        layer_slots: tuple[int, ...] | None = None,
    ) -> KVStorage:
        """The storage for canonical format ``name`` (one of :attr:`formats`). Formats
        ignore the options that do not concern them."""
        return cls(num_layers, num_blocks, block_size, num_kv_heads, head_dim, compute_dtype,
                   device, layer_slots=layer_slots)  # fmt: skip

    @property
    def num_rows(self) -> int:
        """Rows of every per-block tensor: the usable blocks plus the null block."""
        return self.num_blocks + 1

    # -- bytes ---------------------------------------------------------------------------------
    @classmethod
    @abstractmethod
    def format_bytes_per_token(
        cls, name: str, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int
    ) -> float:
        """K and V bytes one token occupies across all layers in format ``name``, metadata
        (scales, zero points) included."""

    @classmethod
    def format_fixed_bytes(
        cls,
        name: str,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        compute_dtype: torch.dtype,
        max_num_seqs: int,
    ) -> int:
        """Bytes besides the per-token figure: the null block, plus what a format keeps per
        pool (fp8's scales) or per sequence (KIVI's full-precision residual)."""
        bpt = cls.format_bytes_per_token(name, num_layers, num_kv_heads, head_dim, block_size)
        return int(round(bpt * block_size))

    @abstractmethod
    def block_tensors(self) -> dict[str, list[torch.Tensor]]:
        """Every tensor indexed by block id (codes and per-block metadata), by name, one per
        layer: what a block copy must copy and an export must carry."""

    def fixed_tensors(self) -> list[torch.Tensor]:
        """Tensors not indexed by block id (pool-wide scales, residual buffers)."""
        return []

    def nbytes(self) -> int:
        """Bytes of the usable blocks (the pool sizing rule's per-token figure times slots)."""
        per_row = sum(
            t[0].numel() * t.element_size()
            for ts in self.distinct_block_tensors().values()
            for t in ts
        )
        return per_row * self.num_blocks

    def fixed_nbytes(self) -> int:
        """Every other byte the storage allocated: the null block and the fixed tensors."""
        tensors = self.distinct_block_tensors().values()
        rows = sum(t.numel() * t.element_size() for ts in tensors for t in ts)
        fixed = sum(t.numel() * t.element_size() for t in self.fixed_tensors())
        return rows - self.nbytes() + fixed

    def prefault(self) -> int:
        """Fault every page of the pool in now instead of at its first write; returns the
        bytes touched. Contents are kept: one byte of each page (and the last byte) is copied
        onto itself.

        :func:`zeros` leaves a CPU pool's pages unmapped until a block is first written, so
        the first pass through the pool pays a page fault per 4 KiB inside engine steps; in a
        virtual machine whose host backs guest memory on demand, such a fault costs many
        times the write itself. vLLM zero-fills its KV space at start; this moves the same
        cost to the same place, for the whole pool rather than the part a run uses, so that
        the first requests run at the steady rate."""
        if self.device.type != "cpu":
            return 0  # device memory is backed when it is allocated
        tensors = [t for ts in self.distinct_block_tensors().values() for t in ts]
        touched = 0
        for t in tensors + self.fixed_tensors():
            if not t.is_contiguous() or t.numel() == 0:
                continue
            raw = t.view(-1).view(torch.uint8)
            raw[::PAGE_BYTES].copy_(raw[::PAGE_BYTES].clone())
            raw[-1:].copy_(raw[-1:].clone())  # a tail that crosses into one more page
            touched += raw.numel()
        return touched

    # -- the step ------------------------------------------------------------------------------
    def begin_step(self, slot_mapping: np.ndarray | torch.Tensor) -> None:  # noqa: B027 - optional hook
        """Called once per step with the step's flat slot mapping on the host (the runner
        passes its NumPy copy), before the first layer's write. Formats that plan a step
        (KIVI) do it here; the default has nothing to plan."""

    def release_blocks(self, block_ids: list[int]) -> None:  # noqa: B027 - optional hook
        """Blocks whose last reference went (they are free or cached-free now). A format that
        keeps per-block side state (KIVI's residual slots) may reclaim it; cached-free blocks
        can be handed out again by the prefix cache, so their content must stay readable."""

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks ``(src, dst)`` (copy-on-write of a shared partial block)."""
        if not pairs:
            return
        src, dst = to_device(pairs, self.device, torch.long).T
        for ts in self.distinct_block_tensors().values():
            for t in ts:
                t[dst] = t[src]

    def copy_entries(self, layer: int, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy cache entries of one layer, per KV head: head ``h``'s entry at flat slot
        ``src[h, i]`` goes to slot ``dst[i]`` (``src`` [kv_heads, n], ``dst`` [n]), codes and
        per-token metadata bit for bit. ``dst`` must not overlap ``src``."""
        bs = self.block_size
        heads = torch.arange(self.num_kv_heads, device=src.device)[:, None]
        sb, so = src // bs, src % bs
        db, do = (dst // bs).expand_as(src), (dst % bs).expand_as(src)
        for ts in self.block_tensors().values():
            t = ts[layer]
            t[db, heads, do] = t[sb, heads, so]

    @abstractmethod
    def write(
        self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Store new tokens' K/V (``[T, kv_heads, head_dim]``) at flat slot indices."""

    @abstractmethod
    def gather(self, layer: int, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of whole blocks, ``[B, kv_heads, n * block_size, head_dim]`` for
        ``block_tables`` of shape ``[B, n]`` (the reference path)."""

    # -- moving blocks -------------------------------------------------------------------------
    def identity(self) -> dict[str, Any]:
        """What must match for another pool's blocks to be readable here."""
        return {
            "format": self.format_name,
            "num_layers": self.num_layers,
            "block_size": self.block_size,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "dtypes": {
                name: str(ts[0].dtype).removeprefix("torch.")
                for name, ts in self.block_tensors().items()
            },
        }

    def export_blocks(self, block_ids: list[int]) -> BlockPayload:
        """The exact stored bytes of ``block_ids`` (CPU tensors), with whatever pool-wide state
        decoding them needs. From a GPU pool the copy to (pinned) host memory is still under
        way when this returns: read the payload after :meth:`BlockPayload.wait`."""
        self._check_ids(block_ids, "export_blocks")
        idx = to_device(block_ids, self.device, torch.long)
        tensors = {}
        for name, ts in self.block_tensors().items():
            if ts[0].device.type == "cpu":  # one copy, straight into the payload
                out = torch.empty((len(ts), len(block_ids), *ts[0].shape[1:]), dtype=ts[0].dtype)
                for layer, t in enumerate(ts):
                    torch.index_select(t, 0, idx, out=out[layer])
                tensors[name] = out
            else:  # one gather on the device, one transfer to the host off the step's path
                gathered = torch.stack([t.index_select(0, idx) for t in ts])
                tensors[name] = self.host_copies.to_host(gathered)
        ready = self.host_copies.done()
        return BlockPayload(self.identity(), len(block_ids), tensors, self._export_pool(),
                            ready=ready)  # fmt: skip

    def import_blocks(self, block_ids: list[int], payload: BlockPayload) -> None:
        """Write a payload's blocks into ``block_ids`` (bit-exact); raises
        :class:`KVFormatMismatch` when the payload's format, geometry or pool-wide state
        cannot be read by this storage (nothing is written then)."""
        self._check_ids(block_ids, "import_blocks")
        if payload.identity != self.identity():
            raise KVFormatMismatch(
                f"kv payload: stored as {payload.identity}, this pool is {self.identity()}"
            )
        if payload.num_blocks != len(block_ids):
            raise ValueError(
                f"import_blocks: payload holds {payload.num_blocks} blocks, "
                f"{len(block_ids)} ids given"
            )
        self._import_pool(payload.pool)
        idx = to_device(block_ids, self.device, torch.long)
        payload.wait()
        for name, ts in self.block_tensors().items():
            src = payload.tensors[name]
            if src.device != ts[0].device:  # every layer in one transfer
                src = self.host_copies.to_device(src)
            for layer, t in enumerate(ts):
                t.index_copy_(0, idx, src[layer])

    def pool_state(self) -> dict[str, Any]:
        """Pool-wide state the blocks need to be decoded (fp8's per-head scales): part of
        what an offload tier key commits to."""
        return self._export_pool()

    def _export_pool(self) -> dict[str, Any]:
        return {}

    def _import_pool(self, pool: dict[str, Any]) -> None:  # noqa: B027 - optional hook
        """Adopt or check pool-wide state; raise KVFormatMismatch before anything changes."""

    def _check_ids(self, block_ids: list[int], what: str) -> None:
        bad = [b for b in block_ids if not 0 <= b < self.num_blocks]
        if bad:
            raise ValueError(f"{what}: block ids {bad[:5]} outside [0, {self.num_blocks})")

    # -- helpers for subclasses ----------------------------------------------------------------
    def per_layer(self, *shape: int, dtype: torch.dtype) -> list[torch.Tensor]:
        """One zero tensor per layer of shape ``shape`` (per slot, with ``layer_slots``: the
        layers that share a slot share its tensor)."""
        if self.layer_slots is None:
            return [zeros(shape, dtype, self.device) for _ in range(self.num_layers)]
        slots = [zeros(shape, dtype, self.device) for _ in range(max(self.layer_slots) + 1)]
        return [slots[s] for s in self.layer_slots]

    def distinct_block_tensors(self) -> dict[str, list[torch.Tensor]]:
        """:meth:`block_tensors` with each shared slot tensor once (what holds bytes, and
        what a whole-block copy must touch)."""
        if self.layer_slots is None:
            return self.block_tensors()
        first = {s: layer for layer, s in reversed(list(enumerate(self.layer_slots)))}
        keep = sorted(first.values())
        return {name: [ts[i] for i in keep] for name, ts in self.block_tensors().items()}

    def gather_blocks(
        self, block_tables: torch.Tensor, decode: Any, *per_layer: torch.Tensor
    ) -> torch.Tensor:
        """``[B, kv_heads, n * block_size, head_dim]`` from per-block tensors: the blocks of
        ``block_tables`` are selected from each tensor in ``per_layer`` and ``decode(*selected)``
        turns them into values ``[B * n, kv_heads, block_size, head_dim]``."""
        b, n = block_tables.shape
        flat = block_tables.reshape(-1)
        x = decode(*(t.index_select(0, flat) for t in per_layer))
        shape = (b, self.num_kv_heads, n * self.block_size, self.head_dim)
        return x.view(b, n, *x.shape[1:]).transpose(1, 2).reshape(shape)


class DenseKVStorage(KVStorage):
    """Full-precision paged K/V: ``[num_blocks + 1, kv_heads, block_size, head_dim]`` per layer.

    Blocks are head-major so that one KV head's rows of a block are contiguous: the decode
    kernel streams them, and a gather yields ``[B, kv_heads, tokens, head_dim]`` with each
    (sequence, head) matrix contiguous, which is what SDPA wants. ``dtype`` is both the
    storage and the compute dtype here.
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        layer_slots: tuple[int, ...] | None = None,
    ) -> None:
        super().__init__(num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype,
                         device, layer_slots)  # fmt: skip
        self.format_name = str(dtype).removeprefix("torch.")
        shape = (self.num_rows, num_kv_heads, block_size, head_dim)
        self.k = self.per_layer(*shape, dtype=dtype)
        self.v = self.per_layer(*shape, dtype=dtype)

    @classmethod
    def from_format(cls, name: str, num_layers: int, num_blocks: int, block_size: int,
                    num_kv_heads: int, head_dim: int, compute_dtype: torch.dtype,
                    device: torch.device | str = "cpu", **options: Any) -> KVStorage:  # fmt: skip
        """The storage dtype is the format's own (``auto`` resolved to the model dtype)."""
        return cls(num_layers, num_blocks, block_size, num_kv_heads, head_dim,
                   TORCH_DTYPES[name], device, layer_slots=options.get("layer_slots"))  # fmt: skip

    @classmethod
    def format_bytes_per_token(
        cls, name: str, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int = 16
    ) -> float:
        itemsize = torch.empty((), dtype=TORCH_DTYPES[name]).element_size()
        return 2 * num_layers * num_kv_heads * head_dim * itemsize

    def block_tensors(self) -> dict[str, list[torch.Tensor]]:
        return {"k": self.k, "v": self.v}

    def write(
        self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """The reference write; the ``cpu`` attention backend writes with its kernel."""
        blk = slot_mapping // self.block_size
        off = slot_mapping % self.block_size
        self.k[layer][blk, :, off] = k.to(self.dtype)
        self.v[layer][blk, :, off] = v.to(self.dtype)

    def gather(self, layer: int, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """In the storage dtype (the caller casts to its compute dtype)."""
        return (
            self.gather_blocks(block_tables, lambda x: x, self.k[layer]),
            self.gather_blocks(block_tables, lambda x: x, self.v[layer]),
        )


class KVStorageWrapper(KVStorage):
    """A storage that forwards every call to ``inner``: subclass it to instrument or corrupt
    a storage (the quality gate's tests do) and override only what changes."""

    def __init__(self, inner: KVStorage) -> None:
        super().__init__(inner.num_layers, inner.num_blocks, inner.block_size, inner.num_kv_heads,
                         inner.head_dim, inner.dtype, inner.device,
                         inner.layer_slots)  # fmt: skip
        self.inner = inner
        self.format_name = inner.format_name

    @classmethod
    def format_bytes_per_token(cls, name, num_layers, num_kv_heads, head_dim, block_size=16):  # noqa: ANN001, ANN206
        raise TypeError("a wrapper has no format of its own; ask the wrapped storage's class")

    def block_tensors(self) -> dict[str, list[torch.Tensor]]:
        return self.inner.block_tensors()

    def fixed_tensors(self) -> list[torch.Tensor]:
        return self.inner.fixed_tensors()

    def begin_step(self, slot_mapping: np.ndarray | torch.Tensor) -> None:
        self.inner.begin_step(slot_mapping)

    def release_blocks(self, block_ids: list[int]) -> None:
        self.inner.release_blocks(block_ids)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        self.inner.copy_blocks(pairs)

    def copy_entries(self, layer: int, src: torch.Tensor, dst: torch.Tensor) -> None:
        self.inner.copy_entries(layer, src, dst)

    def write(
        self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        self.inner.write(layer, slot_mapping, k, v)

    def gather(self, layer: int, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inner.gather(layer, block_tables)

    def identity(self) -> dict[str, Any]:
        return self.inner.identity()

    def pool_state(self) -> dict[str, Any]:
        return self.inner.pool_state()

    def export_blocks(self, block_ids: list[int]) -> BlockPayload:
        return self.inner.export_blocks(block_ids)

    def import_blocks(self, block_ids: list[int], payload: BlockPayload) -> None:
        self.inner.import_blocks(block_ids, payload)
