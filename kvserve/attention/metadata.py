"""What attention needs to know about one step's flat batch, built once per step by the runner.

The runner orders the flat batch as ``[decode tokens | prefill chunk 1 | prefill chunk 2 ...]``
and describes it here: the slot of each new token, the decode rows' block tables and lengths,
each prefill chunk's place and cached context, the rows one fused kernel call may serve
(:class:`PagedGroup`), and retention's extras (windows, StreamingLLM sinks, SnapKV/H2O
compactions, H2O's attention mass). Every backend reads the same metadata; none of it says
which backend runs. Masks depend only on the batch layout, so they are built once per step
and shared by layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvserve.kernels.host_device import to_device

# Chunks over a cached context up to this many queries join the decode rows in the paged
# group (one fused kernel call where a backend has one); longer ones are better served by
# SDPA's blocked matrix products after a gather.
KERNEL_MAX_QUERY = 64


def combine_windows(layer: int | None, request: int) -> int | None:
    """The tighter of a layer's sliding window and a request's retention window (0: none)."""
    if request and (layer is None or request < layer):
        return request
    return layer


@dataclass(slots=True)
class Compaction:
    """A compaction after the chunk attended (see :mod:`kvserve.sched.retention`): SnapKV in the
    chunk that ends a prompt, or H2O."""

    kind: str  # "snapkv" or "h2o"
    budget: int  # snapkv: prompt keys kept besides the observation window; h2o: entries kept
    window: int  # snapkv: the observation window (last prompt queries); h2o: recent entries
    kernel: int  # snapkv: pooling width over neighbouring keys
    src_slots: torch.Tensor  # [S] flat slot of each cache entry, this chunk's included
    dst_slots: torch.Tensor  # [kept] flat slots of the fresh blocks, in order


@dataclass(slots=True)
class PrefillChunk:
    q_start: int  # offset in the flat batch
    q_len: int
    ctx_len: int  # cache entries of this sequence before the chunk (not a RoPE position)
    block_table: torch.Tensor | None  # [num_blocks] when ctx_len > 0
    in_group: bool = False  # also listed in the PagedGroup
    window: int = 0  # the request's retention window (0: none), beside the layer's
    sinks: int = 0  # with a window: the first cache entries it keeps too (StreamingLLM)
    compact: Compaction | None = None  # score, select and copy after attending
    # H2O: the request's attention mass per layer ([KVH, ctx_len] or None before its first
    # chunk), updated in place with this chunk's queries.
    mass: list[torch.Tensor | None] | None = None


@dataclass(slots=True)
class PagedGroup:
    """Decode tokens and short continuation chunks: rows ``[0, num_rows)`` of the batch,
    attended by one fused kernel call straight from the cache."""

    num_rows: int
    q_start: torch.Tensor  # [B] int64
    q_len: torch.Tensor  # [B]
    ctx_len: torch.Tensor  # [B] keys cached before the chunk
    block_tables: torch.Tensor  # [B, max_blocks]
    windows: torch.Tensor | None = None  # [B] int32 retention windows (0: none), or None
    votes: GroupVotes | None = None  # H2O decode tokens among the rows: where their mass goes
    sinks: torch.Tensor | None = None  # [B] int32 StreamingLLM sink counts (0: none), or None
    sink_shift: torch.Tensor | None = None  # [num_rows] int64: each row's rotate-back for sinks


@dataclass(slots=True)
class GroupVotes:
    """Where the fused kernel adds H2O's attention mass: per layer and group row, the
    address and row stride of a float32 ``[KVH, stride]`` buffer (0: the row has none)."""

    ptrs: torch.Tensor  # [layers, B] int64
    strides: torch.Tensor  # [layers, B] int64
    keep: list[torch.Tensor]  # the buffers, alive while the kernel writes into them

    def of_layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.ptrs[layer], self.strides[layer]


@dataclass(slots=True)
class ObservedDecode:
    """H2O decode tokens that do not compact this step, attended in one batch with explicit
    probabilities (their chunks are marked ``in_group`` and skipped by the chunk loop)."""

    rows: torch.Tensor  # [B] rows of the flat batch
    block_tables: torch.Tensor  # [B, max_blocks], padded with the null block
    num_entries: torch.Tensor  # [B] cache entries, the new token's included
    entries: list[int]  # the same, as ints
    masses: list[list[torch.Tensor | None]]  # each request's mass per layer


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] flat slot index of each new token
    block_size: int
    # The same on the host, where a format that plans its step reads it (KVStorage.begin_step)
    slot_mapping_host: np.ndarray | None = None
    num_decode: int = 0
    decode_block_tables: torch.Tensor | None = None  # [Bd, max_blocks]
    decode_seq_lens: torch.Tensor | None = None  # [Bd] cache entries incl. the new one
    decode_windows: torch.Tensor | None = None  # [Bd] int32 retention windows (0: none)
    prefills: list[PrefillChunk] = field(default_factory=list)
    paged: PagedGroup | None = None
    observed: ObservedDecode | None = None
    rotary: Any = None  # the model's RotaryEmbedding (cos/sin tables), set by its forward
    # A hybrid model's per-layer metadata (its layer group's block tables), or None: every
    # layer uses this one.
    by_layer: list[AttentionMetadata] | None = None
    # A KV connector that moves KV layer by layer (its ``wait_for_layer_load`` before a
    # layer's attention, its ``save_kv_layer`` after), or None: most move it around the
    # whole forward pass, and the layers then pay nothing for it.
    layer_connector: Any = None
    _masks: dict = field(default_factory=dict)

    def decode_mask(self, window: int | None) -> torch.Tensor:
        """[Bd, 1, 1, S]: key j is visible iff j < seq_len (and inside the layer's window and
        the row's retention window)."""
        key = ("decode", window)
        mask = self._masks.get(key)
        if mask is None:
            assert self.decode_block_tables is not None and self.decode_seq_lens is not None
            s = self.decode_block_tables.shape[1] * self.block_size
            j = torch.arange(s, device=self.decode_seq_lens.device)
            lens = self.decode_seq_lens[:, None]
            mask = j[None, :] < lens
            if window is not None:
                mask &= j[None, :] >= lens - window
            if self.decode_windows is not None:
                w = self.decode_windows[:, None].to(lens.dtype)
                mask &= (w <= 0) | (j[None, :] >= lens - w)
            mask = mask[:, None, None, :]
            self._masks[key] = mask
        return mask

    def kept_blocks(
        self, p: PrefillChunk, window: int
    ) -> tuple[torch.Tensor, np.ndarray, torch.Tensor] | None:
        """Under retention, the chunk's kept table entries (sink blocks and the oldest query's
        window), the cache entry of each written row of theirs (on the host) and those rows'
        indices among the gathered ones; once per step, shared by the layers. None when
        nothing before the chunk is kept. Built on the host from the chunk's plain numbers,
        so that no layer picks rows by a mask (a read back from a GPU)."""
        key = ("kept", p.q_start, window)
        if key not in self._masks:
            bs, c0 = self.block_size, p.ctx_len
            keep = set(range(max(0, c0 - window + 1) // bs, -(-c0 // bs)))
            keep |= set(range(min(-(-p.sinks // bs), -(-c0 // bs))))
            out = None
            if keep and p.block_table is not None:
                dev = self.slot_mapping.device
                idx = np.array(sorted(keep), dtype=np.int64)
                rows = (idx[:, None] * bs + np.arange(bs)[None, :]).reshape(-1)
                live = np.flatnonzero(rows < c0)  # not the last block's unwritten tail
                out = (to_device(idx, dev), rows[live], to_device(live, dev))
            self._masks[key] = out
        return self._masks[key]

    def prefill_mask(self, i: int, window: int | None, num_keys: int) -> torch.Tensor | None:
        """[q_len, num_keys] causal mask offset by the cached context; None = plain causal."""
        p = self.prefills[i]
        window = combine_windows(window, p.window)
        if p.ctx_len == 0 and (window is None or window >= p.q_len):
            return None
        key = (i, window)
        mask = self._masks.get(key)
        if mask is None:
            dev = self.slot_mapping.device
            qpos = p.ctx_len + torch.arange(p.q_len, device=dev)[:, None]
            kpos = torch.arange(num_keys, device=dev)[None, :]
            mask = kpos <= qpos
            if window is not None:
                mask &= kpos > qpos - window
            self._masks[key] = mask
        return mask
