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

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvserve.kernels.triton_attention import DENSE, FP8, INT8, KIVI, NUM_WARPS, PagedCache
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


# -- KIVI: whole blocks quantized at once, the other tokens into their residual slots ------------
KEY_MAX = tl.constexpr(2.0**100)


@triton.jit
def _fp16_up(x):
    """The smallest float16 >= ``x`` (``x`` > 0, at most FP16_MAX)."""
    h = x.to(tl.float16)
    bits = h.to(tl.int16, bitcast=True)
    return tl.where(h.to(tl.float32) < x, (bits + 1).to(tl.float16, bitcast=True), h)


@triton.jit
def _fp16_down(x):
    """The largest float16 <= ``x`` (``x`` within +-FP16_MAX): one step towards -inf where
    the cast rounded up (a positive code down, a negative one or a zero away from zero)."""
    h = x.to(tl.float16)
    bits = h.to(tl.int16, bitcast=True).to(tl.int32)
    pos = h.to(tl.float32) > 0.0
    stepped = tl.where(pos, bits - 1, tl.where(bits == 0, -32767, bits + 1))  # -32767: -tiny
    lower = stepped.to(tl.int16).to(tl.float16, bitcast=True)
    return tl.where(h.to(tl.float32) > x, lower, h)


@triton.jit
def _pack(q, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, BITS: tl.constexpr):
    """Codes ``q`` ``[ROWS, HEAD_DIM]`` (int32 < 2**BITS) packed ``8 // BITS`` to a byte,
    lowest first (:func:`kvserve.kv.codecs.pack_bits`)."""
    PER: tl.constexpr = 8 // BITS
    shifts = tl.arange(0, PER) * BITS
    q3 = tl.reshape(q, (ROWS, HEAD_DIM // PER, PER))
    return tl.sum(q3 << shifts[None, None, :], axis=2).to(tl.uint8)


@triton.jit
def _block_rows(res_ptrs, write_ptrs, from_res):
    """A block's rows in float32: from the residual where ``from_res``, else from the
    write."""
    res = tl.load(res_ptrs, mask=from_res, other=0.0).to(tl.float32)
    return tl.where(from_res, res, tl.load(write_ptrs, mask=~from_res, other=0.0).to(tl.float32))


@triton.jit
def kivi_quantize_kernel(
    blocks_ptr, src_ptr, k_ptr, v_ptr, rk_ptr, rv_ptr, rot_ptr, exp2_ptr,
    kc_ptr, vc_ptr, km_ptr, kb_ptr, vs_ptr, vz_ptr,
    s_kt, s_kh, s_vt, s_vh, s_rb, s_rh, s_rt, s_cb, s_ch, s_ct, s_mb, s_mh, s_mr, s_bb, s_bh,
    s_sb, s_sh, s_st,
    BS: tl.constexpr, HEAD_DIM: tl.constexpr, BITS: tl.constexpr, VGROUP: tl.constexpr,
    ROTATE: tl.constexpr,
):  # fmt: skip
    """One whole block of one KV head, quantized into its codes
    (:func:`~kvserve.kv.codecs.kivi_quantize_keys` and ``kivi_quantize_values``, step for
    step). Its tokens come from ``src_ptr[i, :]``: a token of the step's K/V (>= 0), or a
    residual entry ``e`` coded ``-1 - e`` (a full block flushed from the residual)."""
    i = tl.program_id(0)
    h = tl.program_id(1)
    blk = tl.load(blocks_ptr + i)
    t = tl.arange(0, BS)
    d = tl.arange(0, HEAD_DIM)
    src = tl.load(src_ptr + i * BS + t)
    entry = tl.where(src < 0, -1 - src, 0)
    tok = tl.where(src < 0, 0, src)
    from_res = (src < 0)[:, None] & (d[None, :] >= 0)
    res_off = (entry // BS)[:, None] * s_rb + h * s_rh + (entry % BS)[:, None] * s_rt + d[None, :]
    k = _block_rows(rk_ptr + res_off, k_ptr + tok[:, None] * s_kt + h * s_kh + d[None, :],
                    from_res)  # fmt: skip
    v = _block_rows(rv_ptr + res_off, v_ptr + tok[:, None] * s_vt + h * s_vh + d[None, :],
                    from_res)  # fmt: skip
    LEVELS: tl.constexpr = (1 << BITS) - 1
    # Keys: rotated, then per channel over the block's tokens; each channel's (zero, scale)
    # coded against the block's base (z0, zstep, smax).
    if ROTATE:
        rot = tl.load(rot_ptr + d[:, None] * HEAD_DIM + d[None, :])
        k = tl.dot(k, rot, input_precision="ieee")
    x = tl.where(k != k, 0.0, k)
    x = tl.minimum(tl.maximum(x, -KEY_MAX), KEY_MAX)
    mn = tl.min(x, 0)
    mx = tl.max(x, 0)
    z0 = tl.min(mn, 0)
    zstep = tl.math.div_rn(tl.max(mn, 0) - z0, 255.0)
    safe = tl.where(zstep > 0.0, zstep, 1.0)
    zc = tl.minimum(tl.maximum(tl.floor(tl.math.div_rn(mn - z0, safe)), 0.0), 255.0)
    zc = tl.where(zstep > 0.0, zc, 0.0)
    zero = z0 + zc * zstep
    zc = tl.where(zero > mn, tl.maximum(zc - 1.0, 0.0), zc)  # float rounding: stay below mn
    zero = z0 + zc * zstep
    need = tl.math.div_rn(mx - zero, LEVELS * 1.0)
    smax = tl.max(need, 0)
    smax = tl.where(smax > 0.0, smax, FP16_TINY)
    sc = tl.ceil(-8.0 * tl.log2(tl.math.div_rn(need, smax)))
    sc = tl.minimum(tl.maximum(sc, 0.0), 255.0)
    scale = smax * tl.load(exp2_ptr + sc.to(tl.int32))  # 2 ** (-sc / 8), as torch has it
    sc = tl.where(scale < need, tl.maximum(sc - 1.0, 0.0), sc)  # float rounding: stay above
    scale = smax * tl.load(exp2_ptr + sc.to(tl.int32))
    q = _round_half_even(tl.math.div_rn(x - zero[None, :], scale[None, :]))
    q = tl.minimum(tl.maximum(q, 0.0), LEVELS * 1.0).to(tl.int32)
    P: tl.constexpr = HEAD_DIM * BITS // 8
    p = tl.arange(0, P)
    codes_off = blk * s_cb + h * s_ch + t[:, None] * s_ct + p[None, :]
    tl.store(kc_ptr + codes_off, _pack(q, BS, HEAD_DIM, BITS))
    tl.store(km_ptr + blk * s_mb + h * s_mh + d, zc.to(tl.uint8))
    tl.store(km_ptr + blk * s_mb + h * s_mh + s_mr + d, sc.to(tl.uint8))
    base = kb_ptr + blk * s_bb + h * s_bh
    tl.store(base, z0)
    tl.store(base + 1, zstep)
    tl.store(base + 2, smax)
    # Values: per token over groups of VGROUP channels, float16 (scale, zero) per group.
    NG: tl.constexpr = HEAD_DIM // VGROUP
    y = tl.where(v != v, 0.0, v)
    y = tl.reshape(tl.minimum(tl.maximum(y, -FP16_MAX), FP16_MAX), (BS, NG, VGROUP))
    vzero = _fp16_down(tl.min(y, 2))
    span = tl.max(y, 2) - vzero.to(tl.float32)
    vscale = _fp16_up(tl.minimum(tl.maximum(tl.math.div_rn(span, LEVELS * 1.0), FP16_TINY),
                                 FP16_MAX))  # fmt: skip
    vq = _round_half_even(tl.math.div_rn(y - vzero.to(tl.float32)[:, :, None],
                                         vscale.to(tl.float32)[:, :, None]))  # fmt: skip
    vq = tl.reshape(tl.minimum(tl.maximum(vq, 0.0), LEVELS * 1.0).to(tl.int32), (BS, HEAD_DIM))
    tl.store(vc_ptr + codes_off, _pack(vq, BS, HEAD_DIM, BITS))
    g = tl.arange(0, NG)
    meta_off = blk * s_sb + h * s_sh + t[:, None] * s_st + g[None, :]
    tl.store(vs_ptr + meta_off, vscale)
    tl.store(vz_ptr + meta_off, vzero)


@dataclass(slots=True)
class KiviStep:
    """Where one step's tokens go in a KIVI pool (the storage's plan, on the device):
    ``quant_blocks`` ``[n]`` quantized this step, each from its ``quant_src`` ``[n,
    block_size]`` (a token of the write, or ``-1 - e`` for entry ``e`` of the residual: a full
    block flushed from there); every other token to its residual entry ``res_dst`` ``[T]``
    (flat ``slot * block_size + offset``; -1 for the quantized blocks' tokens)."""

    quant_blocks: torch.Tensor
    quant_src: torch.Tensor
    res_dst: torch.Tensor


# Launch options beside the constexprs: KIVI's metadata arithmetic (z0 + zc * zstep) must
# round as the storage's does, so no multiply-add is fused into one rounding.
LAUNCH_OPTIONS: dict[str, dict[str, bool]] = {"kivi_quantize_kernel": {"enable_fp_fusion": False}}


def kivi_launches(
    cache: PagedCache, step: KiviStep, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor
) -> list[tuple]:
    """The launches of a KIVI layer's write: the blocks quantized this step (first: a flushed
    block's residual slot may take a token of this very step), then the residual entries of
    every other token (:func:`kv_write_kernel` over the residual, a dense pool)."""
    if cache.fmt != KIVI or cache.rk is None or cache.rv is None:
        raise ValueError("kv write: the KIVI write needs a KIVI cache with its residual")
    bs, d = cache.block_size, k.shape[2]
    if bs < 16 or bs & (bs - 1):
        raise ValueError(f"kv write: KIVI's kernel takes block sizes 16, 32, 64...; got {bs}")
    out: list[tuple] = []
    n = step.quant_blocks.shape[0]
    if n:
        assert cache.ks is not None and cache.vs is not None and cache.kz is not None
        assert cache.vz is not None
        rot = cache.rotation if cache.rotation is not None else table
        args = [step.quant_blocks, step.quant_src, k, v, cache.rk, cache.rv, rot, table,
                cache.k, cache.v, cache.ks, cache.kz, cache.vs, cache.vz,
                k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                *cache.rk.stride()[:3], *cache.k.stride()[:3], *cache.ks.stride()[:3],
                *cache.kz.stride()[:2], *cache.vs.stride()[:3]]  # fmt: skip
        meta = dict(BS=bs, HEAD_DIM=d, BITS=cache.bits, VGROUP=cache.vgroup,
                    ROTATE=cache.rotation is not None)  # fmt: skip
        out.append((kivi_quantize_kernel, (n, k.shape[1]), args, meta))
    residual = PagedCache(DENSE, cache.rk, cache.rv)
    out += write_launches(residual, step.res_dst, k, v)
    return out


def kivi_write(
    cache: PagedCache, step: KiviStep, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor
) -> None:
    """Write a step's K/V into a KIVI layer (see :func:`kivi_launches`); ``table``: ``2 **
    (-s / 8)`` for the 256 key-scale codes, as the storage computes them (its scales are
    then the storage's, bit for bit)."""
    if k.shape[0] == 0:
        return
    for kernel, grid, args, meta in kivi_launches(cache, step, k, v, table):
        opts = LAUNCH_OPTIONS.get(kernel.fn.__name__, {})
        kernel[grid](*args, **meta, **opts, num_warps=NUM_WARPS)
