"""Launching the Triton paged-attention kernels (:mod:`kvserve.kernels.triton_attention_kernels`):
one layer's tensors of a KV format as the kernels read them (:class:`PagedCache`), the grid,
the query tile and the key splits, from host-known shapes only (no synchronisation with the
device), the split workspace given by the caller.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton

from kvserve.kernels.triton_attention_kernels import (
    DENSE,
    FP8,
    INT8,
    KIVI,
    LOG2E,
    merge_splits_kernel,
    paged_attention_kernel,
)

# The format codes of PagedCache.fmt are part of this module's interface.
__all__ = ["DENSE", "FP8", "INT8", "KIVI", "PagedCache", "attention_launches", "paged_attention"]

TILE_N = 32  # keys per step of the loop (a tile may span blocks of any size)
NUM_WARPS = 4


@dataclass(slots=True)
class PagedCache:
    """One layer's tensors of a KV format, as the kernel reads them (see
    :func:`paged_attention_kernel` for their shapes); the attention backend builds it from a
    storage, so this module knows no storage class."""

    fmt: int
    k: torch.Tensor
    v: torch.Tensor
    ks: torch.Tensor | None = None
    vs: torch.Tensor | None = None
    kz: torch.Tensor | None = None
    vz: torch.Tensor | None = None
    res_map: torch.Tensor | None = None
    rk: torch.Tensor | None = None
    rv: torch.Tensor | None = None
    rotation: torch.Tensor | None = None  # KIVI: keys stored as k @ R; scores take q @ R
    bits: int = 0
    vgroup: int = 1
    e5m2: bool = False

    @property
    def block_size(self) -> int:
        return self.k.shape[2]


def _strides(t: torch.Tensor | None, n: int) -> list[int]:
    return [0] * n if t is None else list(t.stride()[:n])


def block_m(group: int) -> int:
    """Rows of one program's matrix products: a query tile times the group's query heads."""
    return max(16, triton.next_power_of_2(group))


def choose_splits(programs: int, max_keys: int, device: torch.device) -> int:
    """Key splits per program (a power of two): enough programs to fill the GPU twice over,
    never splits shorter than 256 keys. One on a CPU (the interpreter runs programs one by
    one)."""
    if device.type != "cuda":
        return 1
    sms = _num_sms(device.index)
    want = min(-(-2 * sms // max(programs, 1)), max(1, max_keys // 256), 16)
    return 1 << (want.bit_length() - 1)


@functools.cache
def _num_sms(index: int | None) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def paged_attention(
    q: torch.Tensor,
    cache: PagedCache,
    out: torch.Tensor,
    q_start: torch.Tensor,
    q_len: torch.Tensor,
    ctx: torch.Tensor,
    tables: torch.Tensor,
    windows: torch.Tensor | None,
    layer_window: int | None,
    num_rows: int,
    block_q: int,
    num_splits: int | None = None,
    workspace: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    q_back: torch.Tensor | None = None,
    votes: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Attention of rows ``[0, num_rows)`` of ``q`` ``[T, H, D]`` into ``out``: sequence ``i``
    owns rows ``q_start[i] .. + q_len[i]`` (contiguous, ascending), at cache entries
    ``ctx[i] ..``, over its blocks ``tables[i]``; ``windows`` ``[B]`` (0: none) beside the
    layer's window. ``block_q``: queries per program (1 for decode rows). ``workspace``: float32
    of at least :func:`workspace_numel` elements when splitting."""
    launches = attention_launches(
        q, cache, out, q_start, q_len, ctx, tables, windows, layer_window, num_rows, block_q,
        num_splits, workspace, None, sinks, q_back, votes,
    )  # fmt: skip
    for kernel, grid, args, meta in launches:
        kernel[grid](*args, **meta, num_warps=NUM_WARPS)


Launch = tuple  # (kernel, grid, positional args, constexprs)


def attention_launches(
    q: torch.Tensor,
    cache: PagedCache,
    out: torch.Tensor,
    q_start: torch.Tensor,
    q_len: torch.Tensor,
    ctx: torch.Tensor,
    tables: torch.Tensor,
    windows: torch.Tensor | None,
    layer_window: int | None,
    num_rows: int,
    block_q: int,
    num_splits: int | None = None,
    workspace: torch.Tensor | None = None,
    dot_f32: bool | None = None,
    sinks: torch.Tensor | None = None,
    q_back: torch.Tensor | None = None,
    votes: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> list[Launch]:
    """The kernel launches of :func:`paged_attention`, as data: what it runs, and what the
    ahead-of-time compile test compiles (``dot_f32``: float32 products; by default for a
    float32 query or under the interpreter). ``sinks`` with ``q_back`` (StreamingLLM) and
    ``votes`` (H2O's mass buffers: addresses and row strides per sequence) are for the dense
    formats; with votes the keys are not split."""
    b = tables.shape[0]
    heads, dim = q.shape[1], q.shape[2]
    kvh = cache.k.shape[1]
    g = heads // kvh
    bm = block_m(g)
    block_q = max(1, min(block_q, bm // g))
    tiles = num_rows // block_q + b
    if num_splits is None:
        num_splits = choose_splits(tiles * kvh, tables.shape[1] * cache.block_size, q.device)
    if votes is not None:
        num_splits = 1
    if (sinks is not None or votes is not None) and cache.fmt != DENSE:
        raise ValueError("paged attention: sinks and votes are served for dense formats only")
    if dot_f32 is None:
        dot_f32 = q.dtype == torch.float32 or _interpreting()
    qr = q
    if cache.rotation is not None:
        qr = q[:num_rows].float() @ cache.rotation  # float32: rounded once, in the kernel
    acc = ml = q
    if num_splits > 1:
        assert workspace is not None and workspace.numel() >= workspace_numel(q, num_splits)
        n = num_rows * heads * num_splits
        acc, ml = workspace[: n * dim], workspace[n * dim : n * (dim + 2)]
    dummy = cache.k
    ks = cache.ks if cache.ks is not None else dummy
    vs = cache.vs if cache.vs is not None else dummy
    kz = cache.kz if cache.kz is not None else dummy
    vz = cache.vz if cache.vz is not None else dummy
    res_map = cache.res_map if cache.res_map is not None else tables
    rk = cache.rk if cache.rk is not None else dummy
    rv = cache.rv if cache.rv is not None else dummy
    ks_strides = _strides(cache.ks, 3) if cache.fmt in (INT8, KIVI) else [0, 0, 0]
    vs_strides = _strides(cache.vs, 3) if cache.fmt in (INT8, KIVI) else [0, 0, 0]
    args = [
        out, q, qr, cache.k, cache.v, ks, vs, kz, vz, res_map, rk, rv,
        tables, q_start, q_len, ctx, windows if windows is not None else q_len,
        sinks if sinks is not None else q_len, q_back if q_back is not None else q,
        *(votes if votes is not None else (q_len, q_len)),
        acc, ml,
        b, layer_window or 0, dim**-0.5 * LOG2E, cache.block_size,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        *_strides(q_back, 2), *_strides(qr, 2),
        *_strides(cache.k, 3), *_strides(cache.v, 3), *ks_strides, *vs_strides,
        *_strides(cache.kz if cache.fmt == KIVI else None, 2), *_strides(cache.rk, 3),
        tables.stride(0),
    ]  # fmt: skip
    meta = dict(FMT=cache.fmt, HEAD_DIM=dim, G=g, BLOCK_M=bm, BLOCK_Q=block_q, TILE_N=TILE_N,
                NUM_SPLITS=num_splits, HAS_WINDOWS=windows is not None, BITS=cache.bits,
                VGROUP=cache.vgroup, E5M2=cache.e5m2, DOT_F32=dot_f32,
                HAS_SINKS=sinks is not None, HAS_VOTES=votes is not None)  # fmt: skip
    launches: list[Launch] = [(paged_attention_kernel, (tiles, kvh, num_splits), args, meta)]
    if num_splits > 1:
        merge = [out, acc, ml, heads, out.stride(0), out.stride(1)]
        launches.append((merge_splits_kernel, (num_rows, heads), merge,
                         dict(HEAD_DIM=dim, NUM_SPLITS=num_splits)))  # fmt: skip
    return launches


def workspace_numel(q: torch.Tensor, num_splits: int) -> int:
    """float32 elements of the split workspace for ``q``'s rows: partial outputs and their
    (max, sum) pairs."""
    return q.shape[0] * q.shape[1] * num_splits * (q.shape[2] + 2)


def _interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter (``TRITON_INTERPRET=1``): no 16-bit
    arithmetic there, so every product is taken in float32."""
    return bool(triton.knobs.runtime.interpret)
