"""KIVI-style 4- and 2-bit paged KV storage with a full-precision residual for partial blocks.

Layout per layer (``P = head_dim * bits // 8`` packed bytes, ``G`` the value group):

- keys:   codes ``[num_blocks, kv_heads, block_size, P]`` uint8, per-channel codes
  ``[num_blocks, kv_heads, 2, head_dim]`` uint8 (zero, scale), base ``[num_blocks, kv_heads,
  3]`` float32 -- keys are quantized per channel over the block's tokens;
- values: codes ``[num_blocks, kv_heads, block_size, P]`` uint8, scale and zero
  ``[num_blocks, kv_heads, block_size, head_dim // G]`` float16 -- per token over groups of
  ``G`` channels;
- residual: ``[num_residual, kv_heads, block_size, head_dim]`` in the compute dtype for K and V.

A block is quantized once, when its last slot (offset ``block_size - 1``) is written; until
then its tokens live in a residual slot. Bookkeeping (which block owns which residual slot)
is done once per step, on the first layer's write, in NumPy over the step's slot mapping; the
per-layer work is a fixed number of tensor ops. Residual slots of blocks freed while partial
are reclaimed by asking the block pool (``attach_pool``) which blocks have no reference left.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from kvserve.kv import codecs
from kvserve.kv.storage import KVStorage

log = logging.getLogger("kvserve.kv")
DEFAULT_VALUE_GROUP = 64


def value_group(head_dim: int, group: int = DEFAULT_VALUE_GROUP) -> int:
    g = min(group, head_dim)
    while head_dim % g:
        g //= 2
    return g


@dataclass(slots=True)
class _WritePlan:
    """Where one step's tokens go; shared by every layer's write in that step."""

    slot_mapping: torch.Tensor  # identity key: layers of one step pass the same tensor
    res_tok: torch.Tensor  # tokens of partial blocks -> residual
    res_slot: torch.Tensor
    res_off: torch.Tensor
    full_blocks: torch.Tensor  # blocks that fill in this write
    src_rows: torch.Tensor  # rows of full_blocks whose earlier tokens are in the residual
    src_slots: torch.Tensor
    full_tok: torch.Tensor  # tokens of full blocks -> quantization buffer
    full_row: torch.Tensor
    full_off: torch.Tensor


class KiviKVStorage(KVStorage):
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
        use_kernels: bool = True,
    ) -> None:
        if bits not in (2, 4):
            raise ValueError(f"bits: must be 2 or 4, got {bits}")
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.num_kv_heads, self.head_dim, self.dtype = num_kv_heads, head_dim, dtype
        self.device = dev = torch.device(device)
        self.use_kernels = use_kernels
        self.bits = bits
        self.group = value_group(head_dim, group)
        self.format_name = f"kivi{bits}-g{self.group}"
        nb, kvh, bs, d = num_blocks, num_kv_heads, block_size, head_dim
        p, ng = d * bits // 8, d // self.group

        def zeros(*shape: int, dt: torch.dtype = torch.uint8) -> list[torch.Tensor]:
            return [torch.zeros(shape, dtype=dt, device=dev) for _ in range(num_layers)]

        self.k_codes, self.v_codes = zeros(nb, kvh, bs, p), zeros(nb, kvh, bs, p)
        self.k_meta = zeros(nb, kvh, 2, d)
        self.k_base = zeros(nb, kvh, 3, dt=torch.float32)
        self.v_scale = zeros(nb, kvh, bs, ng, dt=torch.float16)
        self.v_zero = zeros(nb, kvh, bs, ng, dt=torch.float16)
        num_residual = max(1, num_residual)
        self.res_k = zeros(num_residual, kvh, bs, d, dt=dtype)
        self.res_v = zeros(num_residual, kvh, bs, d, dt=dtype)
        # Host bookkeeping: residual slot of each block (-1: none, the block is quantized).
        self.res_of_block = np.full(num_blocks, -1, dtype=np.int64)
        self.block_of_res = np.full(num_residual, -1, dtype=np.int64)
        self._free_res = list(range(num_residual - 1, -1, -1))
        self._release: list[int] = []
        self._res_t = torch.from_numpy(self.res_of_block).to(dev)
        self._plan: _WritePlan | None = None
        self._pool = None
        # Counters the tests read: each token must be quantized O(1) times.
        self.blocks_quantized = 0
        self.tokens_written = 0

    def attach_pool(self, pool) -> None:  # noqa: ANN001 - a BlockPool; kept duck-typed
        """Let the storage ask which blocks are free, to reclaim their residual slots."""
        self._pool = pool

    @classmethod
    def bytes_per_token(  # type: ignore[override]
        cls,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        bits: int = 2,
        block_size: int = 16,
        group: int = DEFAULT_VALUE_GROUP,
    ) -> float:
        """Codes plus metadata per token: keys carry (2 * head_dim bytes + 12) per block,
        values 4 bytes per group of channels per token."""
        g = value_group(head_dim, group)
        codes = head_dim * bits / 8
        k = codes + (2 * head_dim + 12) / block_size
        v = codes + 4 * head_dim / g
        return num_layers * num_kv_heads * (k + v)

    # -- bookkeeping ------------------------------------------------------------------------------
    def _alloc_res(self, block: int) -> int:
        if not self._free_res:
            self._reclaim()
        if not self._free_res:
            self._grow()
        s = self._free_res.pop()
        self.res_of_block[block] = s
        self.block_of_res[s] = block
        return s

    def _reclaim(self) -> None:
        if self._pool is None:
            return
        for s, b in enumerate(self.block_of_res.tolist()):
            if b >= 0 and self.res_of_block[b] == s and self._pool.blocks[b].ref_cnt == 0:
                self.res_of_block[b] = -1
                self.block_of_res[s] = -1
                self._free_res.append(s)

    def _grow(self) -> None:
        old = self.block_of_res.shape[0]
        extra = max(8, old // 2)
        log.warning("KIVI residual pool full (%d partial blocks): growing by %d", old, extra)
        for lst in (self.res_k, self.res_v):
            for i, t in enumerate(lst):
                lst[i] = torch.cat(
                    [t, torch.zeros((extra, *t.shape[1:]), dtype=t.dtype, device=t.device)]
                )
        self.block_of_res = np.concatenate([self.block_of_res, np.full(extra, -1, np.int64)])
        self._free_res.extend(range(old + extra - 1, old - 1, -1))

    def _make_plan(self, slot_mapping: torch.Tensor) -> _WritePlan:
        bs = self.block_size
        for s in self._release:  # slots of blocks quantized last step: no layer reads them now
            self.block_of_res[s] = -1
            self._free_res.append(s)
        self._release = []
        slots = slot_mapping.cpu().numpy()
        blk, off = slots // bs, slots % bs
        fresh = np.unique(blk[off == 0])
        full = np.unique(blk[off == bs - 1])
        in_full = np.isin(blk, full)
        # Earlier tokens of a filling block are in its residual slot, unless it starts here.
        src = np.where(np.isin(full, fresh), -1, self.res_of_block[full])
        had = self.res_of_block[full]
        self._release = had[had >= 0].tolist()
        self.res_of_block[full] = -1
        part_blk = blk[~in_full]
        for b in np.unique(part_blk).tolist():
            if self.res_of_block[b] < 0:
                self._alloc_res(b)
        row_of = {b: i for i, b in enumerate(full.tolist())}
        rows = np.fromiter((row_of[b] for b in blk[in_full].tolist()), np.int64, int(in_full.sum()))
        self._res_t = torch.from_numpy(self.res_of_block.copy()).to(self.device)
        self.blocks_quantized += len(full)
        self.tokens_written += len(slots)

        def t(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(self.device)

        tok = np.arange(len(slots))
        return _WritePlan(
            slot_mapping=slot_mapping,
            res_tok=t(tok[~in_full]),
            res_slot=t(self.res_of_block[part_blk]),
            res_off=t(off[~in_full]),
            full_blocks=t(full),
            src_rows=t(np.nonzero(src >= 0)[0]),
            src_slots=t(src[src >= 0]),
            full_tok=t(tok[in_full]),
            full_row=t(rows),
            full_off=t(off[in_full]),
        )

    # -- the storage seam ---------------------------------------------------------------------
    def write(
        self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Tokens of partial blocks go to their residual slot; blocks whose last slot is in
        this write are assembled (residual + new tokens) and quantized, once.

        The layers of one step must pass the same ``slot_mapping`` tensor (the model does):
        the step's bookkeeping is made on the first call and reused while it is the same
        object."""
        p = self._plan
        if p is None or p.slot_mapping is not slot_mapping:
            p = self._plan = self._make_plan(slot_mapping)
        rk, rv = self.res_k[layer], self.res_v[layer]
        if p.res_tok.numel():
            rk[p.res_slot, :, p.res_off] = k[p.res_tok].to(self.dtype)
            rv[p.res_slot, :, p.res_off] = v[p.res_tok].to(self.dtype)
        nfull = p.full_blocks.numel()
        if not nfull:
            return
        shape = (nfull, self.num_kv_heads, self.block_size, self.head_dim)
        for x, res, is_key in ((k, rk, True), (v, rv, False)):
            buf = torch.zeros(shape, dtype=torch.float32, device=self.device)
            if p.src_rows.numel():
                buf[p.src_rows] = res[p.src_slots].float()
            buf[p.full_row, :, p.full_off] = x[p.full_tok].float()
            if is_key:
                codes, meta, base = codecs.kivi_quantize_keys(buf, self.bits)
                self.k_codes[layer][p.full_blocks] = codes
                self.k_meta[layer][p.full_blocks] = meta
                self.k_base[layer][p.full_blocks] = base
            else:
                codes, scale, zero = codecs.kivi_quantize_values(buf, self.bits, self.group)
                self.v_codes[layer][p.full_blocks] = codes
                self.v_scale[layer][p.full_blocks] = scale
                self.v_zero[layer][p.full_blocks] = zero

    def dequantize_blocks(
        self, layer: int, blocks: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of the given blocks, ``[n, kv_heads, block_size, head_dim]`` in the compute
        dtype: quantized blocks decoded, partial blocks read from their residual slot."""
        k = codecs.kivi_dequantize_keys(
            self.k_codes[layer][blocks], self.k_meta[layer][blocks], self.k_base[layer][blocks],
            self.bits, self.dtype,
        )  # fmt: skip
        v = codecs.kivi_dequantize_values(
            self.v_codes[layer][blocks], self.v_scale[layer][blocks], self.v_zero[layer][blocks],
            self.bits, self.dtype,
        )  # fmt: skip
        res = self._res_t[blocks]
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

    def decode_attention(self, layer, q, block_tables, seq_lens, window):  # noqa: ANN001
        from kvserve.kernels import quant

        if not self.use_kernels or not quant.supports(self, q):
            return None
        return quant.decode_kivi(self, layer, q, block_tables, seq_lens, window)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: a partial source copies its residual rows into a residual slot of
        the destination; a full one copies codes and metadata."""
        if not pairs:
            return
        for s, d in pairs:
            rs = int(self.res_of_block[s])
            if rs >= 0:
                rd = int(self.res_of_block[d])
                if rd < 0:
                    rd = self._alloc_res(d)
                for lst in (self.res_k, self.res_v):
                    for t in lst:
                        t[rd] = t[rs]
            else:
                rd = int(self.res_of_block[d])
                if rd >= 0:
                    self.res_of_block[d] = -1
                    self.block_of_res[rd] = -1
                    self._free_res.append(rd)
                quantized = self.k_codes + self.k_meta + self.k_base
                quantized += self.v_codes + self.v_scale + self.v_zero
                for t in quantized:
                    t[d] = t[s]
        self._res_t = torch.from_numpy(self.res_of_block.copy()).to(self.device)

    def nbytes(self) -> int:
        ts = self.k_codes + self.k_meta + self.k_base + self.v_codes + self.v_scale + self.v_zero
        return sum(t.numel() * t.element_size() for t in ts)

    def fixed_nbytes(self) -> int:
        """The residual pool: one full-precision block per sequence, outside the per-token
        figure (it scales with the number of sequences, not with context)."""
        return sum(t.numel() * t.element_size() for t in self.res_k + self.res_v)
