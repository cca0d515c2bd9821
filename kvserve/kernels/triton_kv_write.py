"""The KV write in Triton, quantizing on the way: one kernel per layer writes a step's K and V
(``[T, KVH, D]``) into their blocks at the slot mapping's flat slots, in the format's codes.

The arithmetic is the codecs' own (:mod:`kvserve.kv.codecs`), step for step, so the stored codes
equal the storage's reference write bit for bit: IEEE division (``div_rn``, not the GPU's fast
approximate division), round-half-to-even, NaN to zero and infinities saturated, int8's
float16 scale rounded up. Formats:

- ``DENSE``: a cast to the cache dtype;
- ``FP8``: ``x / scale`` of the KV head, saturated at the format's largest finite value, cast
  (round to nearest even) and stored as its byte;
- ``INT8``: symmetric absmax per (token, head): scale ``amax / 127`` rounded up to a float16,
  codes ``round(x / scale)`` clamped to ``[-127, 127]``.

Slots below zero are skipped (padding). Graph-safe: the grid is ``[T / BLOCK_T, KVH]`` from
shapes, no host synchronisation, no allocation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve.kernels.triton_attention import DENSE, FP8, INT8, NUM_WARPS, PagedCache
from kvserve.kernels.triton_attention_kernels import _DENSE, _FP8

FP16_MAX = tl.constexpr(65504.0)
FP16_TINY = tl.constexpr(2.0**-24)


@triton.jit
def _round_half_even(y):
    r = tl.floor(y)
    frac = y - r  # exact below 2**23
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    up = (frac > 0.5) | ((frac == 0.5) & odd)
    return tl.where(up, r + 1.0, r)


@triton.jit
def _fp8_code(y, E5M2: tl.constexpr):
    """The e4m3fn / e5m2 byte of ``y`` (finite, within the format's range), rounded to
    nearest even, built from its bits: Triton's own float8 cast rounds differently in the
    interpreter and is emulated on sm_80, and the codes must match torch's cast everywhere."""
    M: tl.constexpr = 2 if E5M2 else 3
    BIAS: tl.constexpr = 15 if E5M2 else 7
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = tl.abs(y)
    e = tl.maximum(((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, 1 - BIAS)
    inv_quantum = ((127 - (e - M)) << 23).to(tl.float32, bitcast=True)  # 2 ** (M - e), exact
    n = _round_half_even(a * inv_quantum).to(tl.int32)  # quanta of 2 ** (e - M)
    carry = n >= (2 << M)  # rounded up into the next binade
    e = tl.where(carry, e + 1, e)
    n = tl.where(carry, n >> 1, n)
    code = tl.where(n >= (1 << M), ((e + BIAS) << M) | (n - (1 << M)), n)  # else subnormal
    return (code | sign).to(tl.uint8)


@triton.jit
def _fp8_row(x, scale, E5M2: tl.constexpr):
    """fp8 codes of one row ``x`` (float32): ``x / scale``, NaN to 0, saturated."""
    fmax: tl.constexpr = 57344.0 if E5M2 else 448.0
    y = tl.math.div_rn(tl.where(x != x, 0.0, x), scale)
    y = tl.minimum(tl.maximum(tl.where(y != y, 0.0, y), -fmax), fmax)
    return _fp8_code(y, E5M2)


@triton.jit
def _int8_row(x):
    """int8 codes and the float16 scale of each row of ``x`` ``[rows, D]`` (float32)."""
    x = tl.where(x != x, 0.0, x)
    x = tl.where(tl.abs(x) == float("inf"), tl.where(x > 0, FP16_MAX, -FP16_MAX), x)
    x = tl.minimum(tl.maximum(x, -127.0 * FP16_MAX), 127.0 * FP16_MAX)
    amax = tl.max(tl.abs(x), 1)
    s = tl.minimum(tl.maximum(tl.math.div_rn(amax, 127.0), FP16_TINY), FP16_MAX)
    h = s.to(tl.float16)
    bits = h.to(tl.int16, bitcast=True)
    h = tl.where(h.to(tl.float32) < s, (bits + 1).to(tl.float16, bitcast=True), h)
    y = _round_half_even(tl.math.div_rn(x, h.to(tl.float32)[:, None]))
    return tl.minimum(tl.maximum(y, -127.0), 127.0).to(tl.int8), h


@triton.jit
def kv_write_kernel(
    slot_ptr, k_ptr, v_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr,
    num_tokens, block_size, s_kt, s_kh, s_vt, s_vh, s_cb, s_ch, s_ct, s_sb, s_sh, s_st,
    FMT: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_T: tl.constexpr, E5M2: tl.constexpr,
):  # fmt: skip
    """``BLOCK_T`` tokens of one KV head: their K and V rows into their blocks, in the
    format's codes."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + t, mask=t < num_tokens, other=-1)
    ok = (slot >= 0)[:, None]
    blk = slot // block_size
    off = slot % block_size
    d = tl.arange(0, HEAD_DIM)[None, :]
    k = tl.load(k_ptr + t[:, None] * s_kt + h * s_kh + d, mask=ok, other=0.0)
    v = tl.load(v_ptr + t[:, None] * s_vt + h * s_vh + d, mask=ok, other=0.0)
    dst = blk[:, None] * s_cb + h * s_ch + off[:, None] * s_ct + d
    if FMT == _DENSE:
        tl.store(kc_ptr + dst, k.to(kc_ptr.dtype.element_ty), mask=ok)
        tl.store(vc_ptr + dst, v.to(vc_ptr.dtype.element_ty), mask=ok)
    elif FMT == _FP8:
        kq = _fp8_row(k.to(tl.float32), tl.load(ks_ptr + h), E5M2)
        vq = _fp8_row(v.to(tl.float32), tl.load(vs_ptr + h), E5M2)
        tl.store(kc_ptr + dst, kq, mask=ok)
        tl.store(vc_ptr + dst, vq, mask=ok)
    else:
        kq, k_s = _int8_row(k.to(tl.float32))
        vq, v_s = _int8_row(v.to(tl.float32))
        sdst = blk * s_sb + h * s_sh + off * s_st
        tl.store(kc_ptr + dst, kq, mask=ok)
        tl.store(vc_ptr + dst, vq, mask=ok)
        tl.store(ks_ptr + sdst, k_s, mask=slot >= 0)
        tl.store(vs_ptr + sdst, v_s, mask=slot >= 0)


BLOCK_T = 16  # tokens per program


def write_launches(
    cache: PagedCache, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> list[tuple]:
    """The launch of :func:`kv_write_kernel` for a step's ``k``/``v`` ``[T, KVH, D]`` at
    ``slots`` ``[T]`` (as data: the ahead-of-time compile test compiles it)."""
    if cache.fmt not in (DENSE, FP8, INT8):
        raise ValueError(f"kv write: no Triton kernel for format {cache.fmt}")
    ks = cache.ks if cache.ks is not None else cache.k
    vs = cache.vs if cache.vs is not None else cache.v
    s_s = list(cache.ks.stride()[:3]) if cache.fmt == INT8 else [0, 0, 0]
    args = [slots, k, v, cache.k, cache.v, ks, vs, k.shape[0], cache.block_size,
            k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            *cache.k.stride()[:3], *s_s]  # fmt: skip
    meta = dict(FMT=cache.fmt, HEAD_DIM=k.shape[2], BLOCK_T=BLOCK_T, E5M2=cache.e5m2)
    return [(kv_write_kernel, (triton.cdiv(k.shape[0], BLOCK_T), k.shape[1]), args, meta)]


def kv_write(cache: PagedCache, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Write a step's K/V into ``cache`` at ``slots`` (see :func:`write_launches`)."""
    if k.shape[0] == 0:
        return
    for kernel, grid, args, meta in write_launches(cache, slots, k, v):
        kernel[grid](*args, **meta, num_warps=NUM_WARPS)
