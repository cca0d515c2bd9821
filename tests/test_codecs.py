"""KV codecs against their analytic error bounds, edge inputs and independent references."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.kv import codecs

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
# Dequantization runs in float32: a few ulps of |x| on top of the codec bound.
F32_SLACK = 2.0**-21
# K/V activations never reach subnormal magnitudes, so the float strategies exclude them.


def edge_rows(d: int = 64) -> torch.Tensor:
    """Rows that break naive codecs: zeros, constants, one outlier, tiny, huge, mixed sign."""
    g = torch.Generator().manual_seed(0)
    rows = [
        torch.zeros(d),
        torch.full((d,), 3.25),
        torch.full((d,), -1e-7),
        torch.randn(d, generator=g),
        torch.randn(d, generator=g) * 1e-6,
        torch.randn(d, generator=g) * 1e4,
        torch.cat([torch.randn(d - 1, generator=g), torch.tensor([500.0])]),
        torch.linspace(-2, 7, d),
    ]
    return torch.stack(rows)


# -- fp8 -----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", FP8)
def test_fp8_round_trip_within_bound(dtype):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 8, 64, generator=g) * torch.logspace(-3, 2, 64)  # many magnitudes
    scale = torch.tensor([0.01, 0.1, 1.0, 3.0])[:, None, None]
    codes = codecs.fp8_quantize(x, scale, dtype)
    assert codes.dtype == torch.uint8
    back = codecs.fp8_dequantize(codes, scale, dtype, torch.float32)
    bound = codecs.fp8_error_bound(x, scale, dtype)
    assert torch.all((back - x).abs() <= bound * (1 + 1e-6))
    # The bound is not vacuous: relative error of normal numbers is at most 2**-(m+1).
    mant = 3 if dtype == torch.float8_e4m3fn else 2
    normal = (x / scale).abs().clamp(max=codecs.fp8_max(dtype)) > 1.0
    rel = ((back - x).abs() / x.abs())[normal & (x.abs() <= scale * codecs.fp8_max(dtype))]
    assert rel.max() <= 2.0 ** -(mant + 1) + 1e-7


@pytest.mark.parametrize("dtype", FP8)
def test_fp8_saturates_and_never_nan(dtype):
    m = codecs.fp8_max(dtype)
    x = torch.tensor([0.0, 1e30, -1e30, float("inf"), -float("inf"), float("nan"), 2 * m, -3 * m])
    back = codecs.fp8_dequantize(codecs.fp8_quantize(x, torch.tensor(1.0), dtype), 1.0, dtype,
                                 torch.float32)  # fmt: skip
    assert torch.isfinite(back).all()
    assert back.tolist() == [0.0, m, -m, m, -m, 0.0, m, -m]


def test_fp8_scale_from_amax_zero_heads_borrow():
    amax = torch.tensor([0.0, 2.0, 8.0])
    s = codecs.fp8_scale_from_amax(amax, torch.float8_e4m3fn, headroom=4.0)
    assert s.tolist() == pytest.approx([32 / 448, 8 / 448, 32 / 448])
    assert codecs.fp8_scale_from_amax(torch.zeros(2), torch.float8_e5m2, 4.0).tolist() == [1, 1]


# -- int8 -------------------------------------------------------------------------------------
def test_int8_bound_half_scale_on_edge_rows():
    x = edge_rows()
    codes, scale = codecs.int8_quantize(x)
    assert codes.dtype == torch.int8 and scale.dtype == torch.float16
    back = codecs.int8_dequantize(codes, scale)
    err = (back - x).abs()
    assert torch.all(err <= scale.float()[:, None] / 2 * (1 + 1e-6))
    assert torch.all(back[0] == 0) and torch.all(scale > 0)
    # Constant rows reconstruct to within half a step; the scale is the row's absmax / 127
    # rounded up to float16 (never down, or the max element would clip).
    assert torch.all(scale.float() * 127 >= x.abs().amax(-1))
    assert torch.all(scale.float() * 127 <= x.abs().amax(-1) * (1 + 2**-10) + 2**-24 * 127)


def test_int8_saturates_inf_and_nan():
    x = torch.tensor([[1.0, float("inf"), -float("inf"), float("nan")]])
    back = codecs.int8_dequantize(*codecs.int8_quantize(x))
    assert torch.isfinite(back).all()
    assert back[0, 3] == 0 and back[0, 1] > 0 > back[0, 2]


# -- bit packing --------------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(bits=st.sampled_from([2, 4]), data=st.data())
def test_pack_unpack_matches_python_reference(bits, data):
    n = data.draw(st.integers(1, 6)) * (8 // bits)
    vals = data.draw(st.lists(st.integers(0, 2**bits - 1), min_size=n, max_size=n))
    packed = codecs.pack_bits(torch.tensor(vals, dtype=torch.uint8), bits)
    per = 8 // bits
    expect = [
        sum(v << (bits * j) for j, v in enumerate(vals[i : i + per])) for i in range(0, n, per)
    ]
    assert packed.tolist() == expect
    assert codecs.unpack_bits(packed, bits).tolist() == vals


# -- KIVI values --------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("group", [16, 32, 64])
def test_kivi_values_bound_and_reference(bits, group):
    x = edge_rows(64)
    packed, scale, zero = codecs.kivi_quantize_values(x, bits, group)
    assert packed.shape == (x.shape[0], 64 * bits // 8) and scale.shape == (x.shape[0], 64 // group)
    assert scale.dtype == zero.dtype == torch.float16
    back = codecs.kivi_dequantize_values(packed, scale, zero, bits)
    # Independent reference: unpack with Python ints, then code * scale + zero per group.
    per = 8 // bits
    ref = torch.empty_like(x)
    for r in range(x.shape[0]):
        for c in range(64):
            byte = int(packed[r, c // per])
            code = (byte >> (bits * (c % per))) & (2**bits - 1)
            ref[r, c] = code * float(scale[r, c // group]) + float(zero[r, c // group])
    torch.testing.assert_close(back, ref, rtol=1e-6, atol=0)
    step = scale.float().repeat_interleave(group, dim=-1)
    assert torch.all((back - x).abs() <= step / 2 * (1 + 1e-5))
    assert torch.all(back[0] == 0)  # all-zero row is exact
    assert torch.isfinite(back).all()


def test_kivi_values_never_nan_on_inf():
    x = torch.tensor([[float("inf"), -float("inf"), float("nan"), 1.0] * 8])
    back = codecs.kivi_dequantize_values(*codecs.kivi_quantize_values(x, 2, 32), bits=2)
    assert torch.isfinite(back).all()


@settings(max_examples=40, deadline=None)
@given(
    bits=st.sampled_from([2, 4]),
    log_mag=st.floats(-6, 4, allow_subnormal=False),
    offset=st.floats(-50, 50, allow_subnormal=False),
    seed=st.integers(0, 2**16),
)
def test_kivi_values_property(bits, log_mag, offset, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 32, generator=g) * 10**log_mag + offset
    packed, scale, zero = codecs.kivi_quantize_values(x, bits, 16)
    back = codecs.kivi_dequantize_values(packed, scale, zero, bits)
    step = scale.float().repeat_interleave(16, dim=-1)
    assert torch.all((back - x).abs() <= step / 2 * (1 + 1e-5) + x.abs() * F32_SLACK)


# -- KIVI keys ----------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [2, 4])
def test_kivi_keys_bound_on_edge_channels(bits):
    g = torch.Generator().manual_seed(3)
    t, d = 16, 64
    x = torch.randn(2, t, d, generator=g)
    x[0, :, 0] = 0.0  # all-zero channel
    x[0, :, 1] = 5.5  # constant channel far from zero
    x[0, :, 2] = 80.0 + torch.randn(t, generator=g) * 30  # outlier channel
    x[1] *= 1e-5  # a tiny head
    packed, meta, base = codecs.kivi_quantize_keys(x, bits)
    assert packed.shape == (2, t, d * bits // 8) and meta.shape == (2, 2, d)
    assert meta.dtype == torch.uint8 and base.shape == (2, 3)
    back = codecs.kivi_dequantize_keys(packed, meta, base, bits)
    bound = codecs.kivi_key_error_bound(x, meta, base, bits)
    assert torch.isfinite(back).all()
    assert torch.all((back - x).abs() <= bound * (1 + 1e-5) + 1e-12)
    # Per-channel ranges: the outlier channel does not coarsen its neighbours. Their step
    # stays close to their own range / levels (the 8-bit codes add at most one zero step
    # and 9 % on the scale), far below the outlier's.
    scale, zero = codecs.kivi_key_scale_zero(meta, base)
    levels = 2**bits - 1
    own = (x[0, :, 3:].amax(0) - x[0, :, 3:].amin(0)) / levels
    zstep = base[0, 1]
    assert torch.all(scale[0, 3:] <= (own + zstep / levels) * 1.1 + 1e-6)
    assert scale[0, 3:].max() < scale[0, 2] / 4
    # Zero and constant channels: error bounded by the zero grid, not the block's range.
    assert (back[0, :, 0] - x[0, :, 0]).abs().max() <= zstep + 1e-6
    assert (back[0, :, 1] - x[0, :, 1]).abs().max() <= zstep + 1e-6


@settings(max_examples=40, deadline=None)
@given(
    bits=st.sampled_from([2, 4]),
    log_mag=st.floats(-5, 4, allow_subnormal=False),
    seed=st.integers(0, 2**16),
    tokens=st.sampled_from([1, 4, 16]),
)
def test_kivi_keys_property(bits, log_mag, seed, tokens):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, 32, generator=g) * 10**log_mag
    x += torch.randn(32, generator=g) * 10 ** (log_mag + 1)  # channel offsets, as keys have
    packed, meta, base = codecs.kivi_quantize_keys(x, bits)
    back = codecs.kivi_dequantize_keys(packed, meta, base, bits)
    bound = codecs.kivi_key_error_bound(x, meta, base, bits)
    assert torch.all((back - x).abs() <= bound * (1 + 1e-5) + x.abs() * F32_SLACK)
