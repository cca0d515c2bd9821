"""KIVI-style 4- and 2-bit paged KV storage with a full-precision residual for partial blocks.

Layout per layer (``P = head_dim * bits // 8`` packed bytes, ``G`` the value group):

- keys:   codes ``[num_blocks, kv_heads, block_size, P]`` uint8, per-channel codes
  ``[num_blocks, kv_heads, 2, head_dim]`` uint8 (zero, scale), base ``[num_blocks, kv_heads,
  3]`` float32 -- keys are quantized per channel over the block's tokens;
- values: codes ``[num_blocks, kv_heads, block_size, P]`` uint8, scale and zero
  ``[num_blocks, kv_heads, block_size, head_dim // G]`` float16 -- per token over groups of
  ``G`` channels;
- residual: ``[num_residual, kv_heads, block_size, head_dim]`` in the compute dtype for K and V.

Keys may be stored rotated (``rotate_keys``, on for the engine's ``kivi4`` / ``kivi2``): each
key row is multiplied by an orthonormal Hadamard matrix ``R`` before its block is quantized, and
the decode kernel multiplies the query by the same ``R`` (q . k = qR . kR), so no un-rotation
happens per token. The rotation spreads a few large channels over all of them, which 2-bit
per-channel ranges quantize much better: on the bundled model it lifted kivi2's needle recall
close to the exact cache's (``benchmarks/kivi_tradeoffs.py``, ``rotate``). The residual (full
precision) stays unrotated; ``gather`` returns keys unrotated.

A block is quantized exactly once: at once when a single write covers it (prefill), else its
tokens collect in a residual slot and, once its last slot (offset ``block_size - 1``) is
written, it waits there -- still read in full precision -- until ``FLUSH_BATCH`` full blocks
are quantized in one vectorized call (or slots run short). Bookkeeping (which block owns which
residual slot) is done once per step in :meth:`KiviKVStorage.begin_step`, in NumPy over the
step's slot mapping; the per-layer work is a fixed number of tensor ops. Residual slots of
blocks freed while partial are reclaimed when the runner passes the step's freed blocks to
:meth:`KiviKVStorage.release_blocks`.

The residual has a fixed number of slots (``num_residual``, sized from ``max_num_seqs`` inside
``kv_cache_memory``) and never grows. The KV manager keeps the number of partially filled
blocks within it (``partial_block_capacity``) and says no to an allocation that would exceed
it, exactly as it does when blocks run out; a full block never needs a slot for long, since
pending blocks can always be flushed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvserve.kernels.host_device import to_device
from kvserve.kv import codecs
from kvserve.kv.storage import BlockPayload, KVStorage

DEFAULT_VALUE_GROUP = 64
# The value group each engine format uses. 2-bit values lose too much over 64 channels on a
# real model (SmolLM2, benchmarks/kivi_tradeoffs.py); 32 cuts the error for 0.016x of bf16's
# bytes, the cheapest knob that helps. 4-bit holds at 64.
FORMAT_VALUE_GROUP = {"kivi4": 64, "kivi2": 32}
# Full blocks wait in the residual until this many can be quantized in one vectorized call:
# quantizing one block costs ~40 small tensor ops per layer, the same as quantizing 16.
FLUSH_BATCH = 16


def hadamard(n: int) -> torch.Tensor | None:
    """The orthonormal Sylvester-Hadamard matrix of size ``n`` (a power of two), else None."""
    if n < 2 or n & (n - 1):
        return None
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return h / math.sqrt(n)


def value_group(head_dim: int, group: int = DEFAULT_VALUE_GROUP) -> int:
    g = min(group, head_dim)
    while head_dim % g:
        g //= 2
    return g


@dataclass(slots=True)
class _WritePlan:
    """Where one step's tokens go; shared by every layer's write in that step. Made on the
    host; each index list is copied to the device the first time a layer's write asks for it
    (:meth:`on_device`): the storage's own write and the Triton kernels read different ones.

    ``host`` holds, as int64 arrays:

    - ``quant_blocks``: blocks quantized in this step, flushed ones then direct ones;
    - ``flush_slots``: residual slots of the flushed blocks (complete before the step);
    - ``direct_tok``, ``direct_row``, ``direct_off``: tokens of blocks that start and fill
      within this write, their block's row among the direct ones and their offset;
    - ``res_tok``, ``res_slot``, ``res_off``: every other token, its block's residual slot
      and offset;
    - for a fused kernel, ``quant_src``: each quantized block's sources by offset (a token of
      the write, or ``-1 - e`` for entry ``e`` of the residual), and ``res_dst``: each
      token's flat residual entry (``slot * block_size + offset``; -1 for a directly
      quantized block's tokens)."""

    num_tokens: int
    device: torch.device
    host: dict[str, np.ndarray]
    copied: dict[str, torch.Tensor] = field(default_factory=dict)

    def on_device(self, name: str) -> torch.Tensor:
        t = self.copied.get(name)
        if t is None:
            t = self.copied[name] = to_device(self.host[name], self.device, torch.long)
        return t


class KiviKVStorage(KVStorage):
    supports_entry_copy = False  # keys are quantized per channel over a whole block

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        bits: int = 2,
        group: int = DEFAULT_VALUE_GROUP,
        num_residual: int = 64,
        flush_batch: int = FLUSH_BATCH,
        rotate_keys: bool = False,
    ) -> None:
        if bits not in (2, 4):
            raise ValueError(f"bits: must be 2 or 4, got {bits}")
        super().__init__(num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype,
                         device)  # fmt: skip
        dev = self.device
        self.bits = bits
        self.group = value_group(head_dim, group)
        rot = hadamard(head_dim) if rotate_keys else None
        self.key_rotation = None if rot is None else rot.to(dev)
        self.format_name = f"kivi{bits}-g{self.group}" + ("-hadamard" if rot is not None else "")
        nb, kvh, bs, d = self.num_rows, num_kv_heads, block_size, head_dim
        p, ng = d * bits // 8, d // self.group
        u8, f16 = torch.uint8, torch.float16
        self.k_codes, self.v_codes = (
            self.per_layer(nb, kvh, bs, p, dtype=u8),
            self.per_layer(nb, kvh, bs, p, dtype=u8),
        )
        self.k_meta = self.per_layer(nb, kvh, 2, d, dtype=u8)
        self.k_base = self.per_layer(nb, kvh, 3, dtype=torch.float32)
        self.v_scale = self.per_layer(nb, kvh, bs, ng, dtype=f16)
        self.v_zero = self.per_layer(nb, kvh, bs, ng, dtype=f16)
        self.num_residual = max(1, num_residual)
        # How a read overlays the residual blocks: picking them (nonzero) reads the choice
        # back to the host, a wait for a GPU every layer; a select over every block reads a
        # residual slot per block, several times the overlay's bytes, which a CPU need not pay.
        self.overlay_by_select = torch.device(device).type != "cpu"
        self.res_k = self.per_layer(self.num_residual, kvh, bs, d, dtype=dtype)
        self.res_v = self.per_layer(self.num_residual, kvh, bs, d, dtype=dtype)
        # Host bookkeeping: residual slot of each block (-1: none, the block is quantized).
        self.res_of_block = np.full(nb, -1, dtype=np.int64)
        self.block_of_res = np.full(self.num_residual, -1, dtype=np.int64)
        self._free_res = list(range(self.num_residual - 1, -1, -1))
        # Full blocks still in the residual, waiting to be quantized together (insertion order).
        self.pending: dict[int, None] = {}
        self.flush_batch = max(1, flush_batch)
        # The same map on the device, for reads and kernels (copied when it changes).
        self.res_of_block_t = torch.from_numpy(self.res_of_block.copy()).to(dev)
        self._plan: _WritePlan | None = None
        # Counters the tests read: each token must be quantized O(1) times.
        self.blocks_quantized = 0
        self.tokens_written = 0

    @classmethod
    def from_format(cls, name: str, num_layers: int, num_blocks: int, block_size: int,
                    num_kv_heads: int, head_dim: int, compute_dtype: torch.dtype,
                    device: torch.device | str = "cpu", **options: Any) -> KVStorage:  # fmt: skip
        """The engine's KIVI: keys in the Hadamard-rotated basis, a residual slot per sequence
        plus a flush batch."""
        return cls(num_layers, num_blocks, block_size, num_kv_heads, head_dim, compute_dtype,
                   device, bits=int(name.removeprefix("kivi")), group=FORMAT_VALUE_GROUP[name],
                   num_residual=cls.residual_slots(options.get("max_num_seqs", 256)),
                   rotate_keys=True)  # fmt: skip

    @property
    def partial_block_capacity(self) -> int:
        """How many partially filled blocks the residual can hold at once."""
        return self.num_residual

    @classmethod
    def format_bytes_per_token(
        cls,
        name: str,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int = 16,
        group: int | None = None,
    ) -> float:
        """Codes plus metadata per token: keys carry (2 * head_dim bytes + 12) per block,
        values 4 bytes per group of channels per token."""
        bits = int(name.removeprefix("kivi"))
        g = value_group(
            head_dim, FORMAT_VALUE_GROUP.get(name, DEFAULT_VALUE_GROUP) if group is None else group
        )
        codes = head_dim * bits / 8
        k = codes + (2 * head_dim + 12) / block_size
        v = codes + 4 * head_dim / g
        return num_layers * num_kv_heads * (k + v)

    @staticmethod
    def residual_slots(max_num_seqs: int) -> int:
        """One partial block per running sequence plus a flush batch of full ones."""
        return max_num_seqs + FLUSH_BATCH

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
        """The null block plus the full-precision residual pool (it scales with sequences, not
        with context)."""
        null = super().format_fixed_bytes(name, num_layers, num_kv_heads, head_dim, block_size,
                                          compute_dtype, max_num_seqs)  # fmt: skip
        itemsize = torch.empty((), dtype=compute_dtype).element_size()
        slots = cls.residual_slots(max_num_seqs)
        return null + 2 * num_layers * slots * num_kv_heads * block_size * head_dim * itemsize

    def block_tensors(self) -> dict[str, list[torch.Tensor]]:
        return {
            "k_codes": self.k_codes,
            "k_meta": self.k_meta,
            "k_base": self.k_base,
            "v_codes": self.v_codes,
            "v_scale": self.v_scale,
            "v_zero": self.v_zero,
        }

    def fixed_tensors(self) -> list[torch.Tensor]:
        return self.res_k + self.res_v

    # -- bookkeeping ------------------------------------------------------------------------------
    def _alloc_res(self, block: int) -> int:
        if not self._free_res:
            self.flush()
        if not self._free_res:
            raise RuntimeError(
                f"KIVI residual: all {self.num_residual} slots hold partial blocks; the KV "
                "manager's partial-block capacity should have refused this allocation"
            )
        s = self._free_res.pop()
        self.res_of_block[block] = s
        self.block_of_res[s] = block
        return s

    def _free_slot(self, block: int) -> None:
        s = int(self.res_of_block[block])
        if s >= 0:
            self.res_of_block[block] = -1
            self.block_of_res[s] = -1
            self._free_res.append(s)

    def _sync_residual_map(self) -> None:
        self.res_of_block_t = to_device(self.res_of_block.copy(), self.device)

    def release_blocks(self, block_ids: list[int]) -> None:
        """Reclaim the residual slots of blocks freed while partial. Pending full blocks keep
        theirs: they may be cached-free, and the prefix cache may hand them out again."""
        for b in block_ids:
            if b not in self.pending:
                self._free_slot(b)
        if block_ids:
            self._sync_residual_map()

    def begin_step(self, slot_mapping: np.ndarray | torch.Tensor) -> None:
        """Decide which blocks are quantized this step and where the other tokens go, from
        the step's slot mapping on the host (the runner's NumPy copy: a device tensor would
        have to be read back, a wait for the device every step).

        Each layer's write then runs in this order: quantize the flushed blocks from their
        residual slots, quantize blocks that start and fill within this write straight from
        the write, and only then write the remaining tokens into residual slots. Reading
        before writing is what lets a slot freed by a flush be reused in the same step."""
        bs = self.block_size
        slots = slot_mapping if isinstance(slot_mapping, np.ndarray) else slot_mapping.cpu().numpy()
        blk, off = slots // bs, slots % bs
        fresh = np.unique(blk[off == 0])
        full = np.unique(blk[off == bs - 1])
        for b in fresh.tolist():  # a block starting over: whatever it held is gone
            self.pending.pop(b, None)
            self._free_slot(b)
        direct = np.intersect1d(full, fresh)  # offsets 0 and bs-1 here: the whole block is
        completing = np.setdiff1d(full, fresh)  # earlier tokens are in the residual
        continued = np.setdiff1d(np.unique(blk), fresh)
        if (self.res_of_block[continued] < 0).any():
            bad = continued[self.res_of_block[continued] < 0].tolist()
            raise ValueError(f"KIVI: blocks {bad[:5]} are quantized and cannot take new tokens")
        in_direct = np.isin(blk, direct)
        res_blk = blk[~in_direct]
        need = sum(1 for b in np.unique(res_blk).tolist() if self.res_of_block[b] < 0)
        flush: list[int] = []
        if len(self.pending) >= self.flush_batch or len(self._free_res) < need:
            flush = list(self.pending)
            self.pending.clear()
        flush_slots = self.res_of_block[flush].copy() if flush else np.zeros(0, np.int64)
        for b in flush:
            self._free_slot(b)
        for b in np.unique(res_blk).tolist():
            if self.res_of_block[b] < 0:
                self._alloc_res(b)
        for b in completing.tolist():
            self.pending[b] = None
        row_of = {b: i for i, b in enumerate(direct.tolist())}
        rows = np.fromiter((row_of[b] for b in blk[in_direct].tolist()), np.int64)
        self._sync_residual_map()
        self.blocks_quantized += len(flush) + len(direct)
        self.tokens_written += len(slots)

        tok = np.arange(len(slots))
        quant_src = np.empty((len(flush) + len(direct), bs), np.int64)
        quant_src[: len(flush)] = -1 - (flush_slots[:, None] * bs + np.arange(bs))
        quant_src[len(flush) + rows, off[in_direct]] = tok[in_direct]
        res_dst = np.full(len(slots), -1, np.int64)
        res_dst[~in_direct] = self.res_of_block[res_blk] * bs + off[~in_direct]
        self._plan = _WritePlan(len(slots), self.device, {
            "quant_blocks": np.concatenate([np.asarray(flush, np.int64), direct]),
            "flush_slots": flush_slots,
            "direct_tok": tok[in_direct],
            "direct_row": rows,
            "direct_off": off[in_direct],
            "res_tok": tok[~in_direct],
            "res_slot": self.res_of_block[res_blk],
            "res_off": off[~in_direct],
            "quant_src": quant_src,
            "res_dst": res_dst,
        })  # fmt: skip

    def _quantize(self, layer: int, blocks: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Quantize whole blocks ``[n, kv_heads, block_size, head_dim]`` into ``blocks``."""
        if self.key_rotation is not None:
            k = k @ self.key_rotation
        codes, meta, base = codecs.kivi_quantize_keys(k, self.bits)
        self.k_codes[layer][blocks] = codes
        self.k_meta[layer][blocks] = meta
        self.k_base[layer][blocks] = base
        codes, scale, zero = codecs.kivi_quantize_values(v, self.bits, self.group)
        self.v_codes[layer][blocks] = codes
        self.v_scale[layer][blocks] = scale
        self.v_zero[layer][blocks] = zero

    def flush(self, blocks: list[int] | None = None) -> None:
        """Quantize pending full blocks now (all layers; all of them, or those of ``blocks``)
        and free their residual slots."""
        todo = list(self.pending) if blocks is None else [b for b in blocks if b in self.pending]
        if not todo:
            return
        for b in todo:
            del self.pending[b]
        slots = to_device(self.res_of_block[todo], self.device)
        idx = to_device(todo, self.device, torch.long)
        for layer in range(self.num_layers):
            self._quantize(layer, idx, self.res_k[layer][slots].float(),
                           self.res_v[layer][slots].float())  # fmt: skip
        for b in todo:
            self._free_slot(b)
        self.blocks_quantized += len(todo)
        self._sync_residual_map()

    def step_plan(self, num_tokens: int) -> _WritePlan:
        """The plan :meth:`begin_step` made for this step, which every layer's write follows
        (the storage's own, or a kernel's)."""
        p = self._plan
        if p is None or p.num_tokens != num_tokens:
            raise RuntimeError(
                "KIVI write: begin_step(slot_mapping) must be called with this step's "
                f"{num_tokens} slots before the layers write"
            )
        return p

    # -- the storage interface ----------------------------------------------------------------
    def write(
        self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Blocks that start and fill within this write are quantized at once; other tokens
        go to their block's residual slot, and a block that fills there waits (full
        precision, still read from the residual) until a batch of them is quantized together.
        Either way each token is quantized exactly once. Every layer of a step follows the
        plan :meth:`begin_step` made for that step's slot mapping."""
        p = self.step_plan(k.shape[0])
        d = p.on_device
        rk, rv = self.res_k[layer], self.res_v[layer]
        if len(p.host["quant_blocks"]):
            nd = len(p.host["quant_blocks"]) - len(p.host["flush_slots"])
            shape = (nd, self.num_kv_heads, self.block_size, self.head_dim)
            bufs = []
            for x, res in ((k, rk), (v, rv)):
                direct = torch.zeros(shape, dtype=torch.float32, device=self.device)
                direct[d("direct_row"), :, d("direct_off")] = x[d("direct_tok")].float()
                bufs.append(torch.cat([res[d("flush_slots")].float(), direct]))
            self._quantize(layer, d("quant_blocks"), bufs[0], bufs[1])
        if len(p.host["res_tok"]):
            rk[d("res_slot"), :, d("res_off")] = k[d("res_tok")].to(self.dtype)
            rv[d("res_slot"), :, d("res_off")] = v[d("res_tok")].to(self.dtype)

    def dequantize_blocks(
        self, layer: int, blocks: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of the given blocks, ``[n, kv_heads, block_size, head_dim]`` in the compute
        dtype: quantized blocks decoded, partial blocks read from their residual slot."""
        k = codecs.kivi_dequantize_keys(
            self.k_codes[layer][blocks], self.k_meta[layer][blocks], self.k_base[layer][blocks],
            self.bits, self.dtype,
        )  # fmt: skip
        if self.key_rotation is not None:  # back from the rotated basis (R is orthonormal)
            k = (k.float() @ self.key_rotation.T).to(self.dtype)
        v = codecs.kivi_dequantize_values(
            self.v_codes[layer][blocks], self.v_scale[layer][blocks], self.v_zero[layer][blocks],
            self.bits, self.dtype,
        )  # fmt: skip
        # Blocks still filling read their residual slot instead.
        res = self.res_of_block_t[blocks]
        if self.overlay_by_select:
            live = (res >= 0)[:, None, None, None]
            slot = res.clamp(min=0)
            k = torch.where(live, self.res_k[layer][slot].to(k.dtype), k)
            v = torch.where(live, self.res_v[layer][slot].to(v.dtype), v)
            return k, v
        idx = (res >= 0).nonzero().squeeze(1)
        if idx.numel():
            k[idx] = self.res_k[layer][res[idx]].to(k.dtype)
            v[idx] = self.res_v[layer][res[idx]].to(v.dtype)
        return k, v

    def gather(self, layer: int, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, n = block_tables.shape
        k, v = self.dequantize_blocks(layer, block_tables.reshape(-1))
        shape = (b, self.num_kv_heads, n * self.block_size, self.head_dim)

        def one(x: torch.Tensor) -> torch.Tensor:
            return x.view(b, n, *x.shape[1:]).transpose(1, 2).reshape(shape)

        return one(k), one(v)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: a partial source copies its residual rows into a residual slot of
        the destination; a full one copies codes and metadata (a pending full source is
        quantized first, so the two blocks hold the same codes)."""
        if not pairs:
            return
        for s, d in pairs:
            self.pending.pop(d, None)
            if s in self.pending:
                self.flush([s])
            rs = int(self.res_of_block[s])
            if rs >= 0:
                rd = int(self.res_of_block[d])
                if rd < 0:
                    rd = self._alloc_res(d)  # a flush to make room never touches s (not pending)
                for lst in (self.res_k, self.res_v):
                    for t in lst:
                        t[rd] = t[rs]
            else:
                self._free_slot(d)
                for ts in self.block_tensors().values():
                    for t in ts:
                        t[d] = t[s]
        self._sync_residual_map()

    # -- moving blocks ----------------------------------------------------------------------------
    def identity(self) -> dict[str, Any]:
        ident = super().identity()
        ident["residual_dtype"] = str(self.res_k[0].dtype).removeprefix("torch.")
        return ident

    def export_blocks(self, block_ids: list[int]) -> BlockPayload:
        """Full blocks leave in their quantized form (pending ones are quantized first, here,
        so both pools hold the same codes); a partial block leaves as its residual rows."""
        self.flush(block_ids)
        payload = super().export_blocks(block_ids)
        res = [i for i, b in enumerate(block_ids) if self.res_of_block[b] >= 0]
        if res:
            slots = torch.from_numpy(self.res_of_block[[block_ids[i] for i in res]]).to(self.device)
            payload.extra = {
                "residual": res,
                "res_k": torch.stack([t.index_select(0, slots) for t in self.res_k]).cpu(),
                "res_v": torch.stack([t.index_select(0, slots) for t in self.res_v]).cpu(),
            }
        return payload

    def import_blocks(self, block_ids: list[int], payload: BlockPayload) -> None:
        res = payload.extra.get("residual", [])
        if len(res) > len(self._free_res) + len(self.pending):
            raise RuntimeError(
                f"import_blocks: {len(res)} partial blocks need residual slots, "
                f"{len(self._free_res) + len(self.pending)} can be freed"
            )
        super().import_blocks(block_ids, payload)
        for b in block_ids:
            self.pending.pop(b, None)
            self._free_slot(b)
        for j, i in enumerate(res):
            slot = self._alloc_res(block_ids[i])
            for layer in range(self.num_layers):
                self.res_k[layer][slot] = payload.extra["res_k"][layer][j].to(self.device)
                self.res_v[layer][slot] = payload.extra["res_v"][layer][j].to(self.device)
        self._sync_residual_map()
