"""KV quantization codecs as pure tensor functions: quantize, dequantize, and the analytic
error bound each one guarantees.

The storage classes in :mod:`kvserve.kv.quant_storage` decide *when* and *where* to call
these; the functions here only decide *how*. Every codec is vectorized over leading
dimensions, never produces NaN or inf for finite input (and saturates +-inf), and has a bound
that the tests check element by element:

- **fp8** (e4m3 / e5m2): ``x ~= scale * fp8(x / scale)`` with a saturating cast. Round to
  nearest gives a relative error of at most ``2**-(m+1)`` (``m`` mantissa bits) for normal
  numbers and half the smallest subnormal step below them; values beyond ``max * scale``
  saturate to it.
- **int8**, symmetric per row (one scale per token and head): ``|x - x_hat| <= scale / 2``.
  Symmetric because post-rotary keys and values are close to zero-centred per token (rotary
  pairs turn signs over), so a zero point buys little and would double the metadata; it also
  keeps dequantization a single multiply.
- **KIVI** (asymmetric min-max, ``bits`` in {2, 4}): values per token over groups of
  channels, keys per channel over the tokens of a block. ``|x - x_hat| <= scale / 2`` with the
  stored (decoded) scale of the element's group.

Scales are rounded *up* and zero points *down* before quantizing, and quantization uses the
rounded values, so the bound holds for what is stored, not for an idealised float scale.
"""

from __future__ import annotations

import torch

FP8_DTYPES: dict[str, torch.dtype] = {
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
# (mantissa bits, exponent of the smallest normal) per fp8 format.
_FP8_BITS = {torch.float8_e4m3fn: (3, -6), torch.float8_e5m2: (2, -14)}
FP16_MAX = 65504.0
FP16_TINY = 2.0**-24  # smallest positive float16 (subnormal)
KEY_MAX = 2.0**100
KEY_SCALE_STEPS = 8  # log-coded key scales: 8 steps per octave (at most +9 % per channel)


# -- fp8 --------------------------------------------------------------------------------------
def fp8_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


def fp8_quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Codes (as uint8, so any op works on them) of ``x / scale`` in ``dtype``, saturating.

    ``scale`` broadcasts against ``x``. NaN maps to 0 and +-inf to +-max: a poisoned value
    must not spread through attention, and torch's float8 casts return NaN/inf out of range.
    """
    m = fp8_max(dtype)
    y = (x.float() / scale).nan_to_num(nan=0.0, posinf=m, neginf=-m).clamp_(-m, m)
    return y.to(dtype).view(torch.uint8)


def fp8_dequantize(
    codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, out_dtype: torch.dtype
) -> torch.Tensor:
    return (codes.view(dtype).to(torch.float32) * scale).to(out_dtype)


def fp8_error_bound(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Per-element bound on ``|x - dequantize(quantize(x))|`` (round to nearest even)."""
    mant, emin = _FP8_BITS[dtype]
    m = fp8_max(dtype)
    y = (x.float() / scale).abs()
    rounding = torch.maximum(
        y.clamp(max=m) * 2.0 ** -(mant + 1), torch.tensor(2.0 ** (emin - mant - 1))
    )
    saturation = (y - m).clamp(min=0)
    return (rounding + saturation) * scale


def fp8_scale_from_amax(amax: torch.Tensor, dtype: torch.dtype, headroom: float) -> torch.Tensor:
    """Per-head scales that map ``headroom * amax`` to the format's max. Zero amax (a head that
    only saw zeros) borrows the largest scale of the layer, or 1.0 if all are zero."""
    s = amax.float() * headroom / fp8_max(dtype)
    fallback = s.max() if bool(s.max() > 0) else torch.tensor(1.0)
    return torch.where(s > 0, s, fallback)


# -- int8 (symmetric, per row) ------------------------------------------------------------------
def _round_up_fp16(x: torch.Tensor) -> torch.Tensor:
    """Smallest float16 >= x (x finite, >= 0, <= FP16_MAX)."""
    h = x.to(torch.float16)
    return torch.where(h.float() < x, torch.nextafter(h, torch.full_like(h, torch.inf)), h)


def _round_down_fp16(x: torch.Tensor) -> torch.Tensor:
    """Largest float16 <= x (x finite within +-FP16_MAX)."""
    h = x.to(torch.float16)
    return torch.where(h.float() > x, torch.nextafter(h, torch.full_like(h, -torch.inf)), h)


def int8_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric absmax over the last dim: (int8 codes, float16 scale per row)."""
    xf = x.float().nan_to_num(nan=0.0, posinf=FP16_MAX, neginf=-FP16_MAX)
    xf = xf.clamp_(-127 * FP16_MAX, 127 * FP16_MAX)
    amax = xf.abs().amax(-1)
    scale = _round_up_fp16((amax / 127).clamp(FP16_TINY, FP16_MAX))
    codes = torch.round(xf / scale.float()[..., None]).clamp_(-127, 127).to(torch.int8)
    return codes, scale


def int8_dequantize(
    codes: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    return (codes.float() * scale.float()[..., None]).to(out_dtype)


# -- bit packing --------------------------------------------------------------------------------
def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack uint8 codes < 2**bits along the last dim, ``8 // bits`` per byte, lowest first."""
    per = 8 // bits
    c = codes.to(torch.uint8).unflatten(-1, (-1, per))
    out = c[..., 0].clone()
    for i in range(1, per):
        out |= c[..., i] << (bits * i)
    return out


def unpack_bits(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: ``[..., n]`` bytes -> ``[..., n * 8 // bits]`` codes."""
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    return ((packed[..., None] >> shifts) & (2**bits - 1)).flatten(-2)


# -- KIVI: values per token over channel groups --------------------------------------------------
def kivi_quantize_values(
    x: torch.Tensor, bits: int, group: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric min-max over groups of ``group`` channels of each row (the last dim).

    Returns (packed codes ``[..., D * bits // 8]`` uint8, scale and zero ``[..., D // group]``
    float16). The zero point is the group minimum rounded down to float16 and the scale the
    range above it rounded up, so every element stays inside the representable grid."""
    levels = 2**bits - 1
    xf = x.float().nan_to_num(nan=0.0, posinf=FP16_MAX, neginf=-FP16_MAX)
    xg = xf.clamp_(-FP16_MAX, FP16_MAX).unflatten(-1, (-1, group))
    zero = _round_down_fp16(xg.amin(-1))
    span = xg.amax(-1) - zero.float()
    scale = _round_up_fp16((span / levels).clamp(FP16_TINY, FP16_MAX))
    q = torch.round((xg - zero.float()[..., None]) / scale.float()[..., None]).clamp_(0, levels)
    return pack_bits(q.flatten(-2), bits), scale, zero


def kivi_dequantize_values(
    packed: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    bits: int,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    q = unpack_bits(packed, bits).unflatten(-1, (scale.shape[-1], -1)).float()
    x = q * scale.float()[..., None] + zero.float()[..., None]
    return x.flatten(-2).to(out_dtype)


# -- KIVI: keys per channel over the tokens of a block -----------------------------------------
def kivi_quantize_keys(
    x: torch.Tensor, bits: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric min-max per channel over the token axis (``x``: ``[..., T, D]``).

    Keys have outlier *channels* (KIVI), so each channel gets its own range. With one range
    per channel per block, float16 (scale, zero) pairs would cost 32 bits per channel, i.e.
    2 bits per element at block size 16 -- as much as the 2-bit codes. So the per-channel pair
    is coded in 8 + 8 bits against three float32 numbers per (block, head):

    - zero_c = z0 + zc * zstep, ``zc`` uint8, the channel minimum rounded down on a 255-step
      grid spanning the channel minima of the block;
    - scale_c = smax * 2 ** (-sc / 8), ``sc`` uint8, rounded up (at most 9 % above the ideal).

    Returns (packed codes ``[..., T, D * bits // 8]``, per-channel codes ``[..., 2, D]`` uint8
    (zc, sc), base ``[..., 3]`` float32 (z0, zstep, smax))."""
    levels = 2**bits - 1
    # float32 metadata: saturate only far beyond any real key (+-2**100), never at fp16's max.
    xf = x.float().nan_to_num(nan=0.0, posinf=KEY_MAX, neginf=-KEY_MAX).clamp_(-KEY_MAX, KEY_MAX)
    mn, mx = xf.amin(-2), xf.amax(-2)  # [..., D]
    z0 = mn.amin(-1)
    zstep = (mn.amax(-1) - z0) / 255
    safe = torch.where(zstep > 0, zstep, torch.ones_like(zstep))
    zc = torch.floor((mn - z0[..., None]) / safe[..., None]).clamp_(0, 255)
    zc = torch.where(zstep[..., None] > 0, zc, torch.zeros_like(zc))
    zero = z0[..., None] + zc * zstep[..., None]
    zc = torch.where(zero > mn, (zc - 1).clamp_(min=0), zc)  # float rounding: stay below mn
    zero = z0[..., None] + zc * zstep[..., None]
    need = (mx - zero) / levels
    smax = need.amax(-1)
    smax = torch.where(smax > 0, smax, torch.full_like(smax, FP16_TINY))
    sc = torch.ceil(-KEY_SCALE_STEPS * torch.log2(need / smax[..., None])).clamp_(0, 255)
    scale = smax[..., None] * torch.exp2(-sc / KEY_SCALE_STEPS)
    sc = torch.where(scale < need, (sc - 1).clamp_(min=0), sc)  # float rounding: stay above
    scale = smax[..., None] * torch.exp2(-sc / KEY_SCALE_STEPS)
    q = torch.round((xf - zero[..., None, :]) / scale[..., None, :]).clamp_(0, levels)
    meta = torch.stack([zc, sc], dim=-2).to(torch.uint8)
    base = torch.stack([z0, zstep, smax], dim=-1)
    return pack_bits(q, bits), meta, base


def kivi_key_scale_zero(
    meta: torch.Tensor, base: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode per-channel (scale, zero), each ``[..., D]`` float32, from the compact metadata."""
    zc, sc = meta[..., 0, :].float(), meta[..., 1, :].float()
    z0, zstep, smax = base[..., 0:1], base[..., 1:2], base[..., 2:3]
    return smax * torch.exp2(-sc / KEY_SCALE_STEPS), z0 + zc * zstep


def kivi_dequantize_keys(
    packed: torch.Tensor,
    meta: torch.Tensor,
    base: torch.Tensor,
    bits: int,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    scale, zero = kivi_key_scale_zero(meta, base)
    q = unpack_bits(packed, bits).float()
    return (q * scale[..., None, :] + zero[..., None, :]).to(out_dtype)


def kivi_key_error_bound(
    x: torch.Tensor, meta: torch.Tensor, base: torch.Tensor, bits: int
) -> torch.Tensor:
    """Per-element bound for keys: half the channel's decoded scale, plus whatever part of the
    channel's range the scale code could not reach (only when ``sc`` saturated at 255, i.e. a
    range below 2**-31 of the block's largest)."""
    scale, zero = kivi_key_scale_zero(meta, base)
    top = zero + (2**bits - 1) * scale
    over = (x.float() - top[..., None, :]).clamp(min=0)
    return scale[..., None, :] / 2 + over
