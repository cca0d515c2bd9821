"""The Triton KV write kernels against the storages' own writes (:mod:`kvserve.kv.codecs`),
bit for bit, under Triton's interpreter (tests/conftest.py sets it where there is no GPU):
dense, fp8 e4m3 / e5m2 and int8, with NaN, infinities, negative zero, values past the fp8
range and padding slots; and the kernels' float8 rounding against torch's cast over every
code, every midpoint between neighbouring codes and the floats either side of it."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from kvserve.attention.triton_backend import TritonBackend, paged_cache
from kvserve.kernels.triton_kv_write import _fp8_code, kv_write
from kvserve.kv.formats import make_kv_storage
from tests.conftest import TEST_DEVICE

DEV = torch.device(TEST_DEVICE)  # cpu: the interpreter; cuda: compiled kernels
BS, KVH, D, POOL = 16, 2, 64, 8


def raw(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a tensor (so NaN compares equal to NaN)."""
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "fp8_e4m3", "fp8_e5m2", "int8"])
def test_the_write_kernel_stores_the_storages_codes(fmt):
    dt = torch.bfloat16 if fmt == "bfloat16" else torch.float32
    want = make_kv_storage(fmt, 1, POOL, BS, KVH, D, dt, DEV)
    got = make_kv_storage(fmt, 1, POOL, BS, KVH, D, dt, DEV)
    g = torch.Generator().manual_seed(3)
    n = 24
    slots = torch.randperm(POOL * BS, generator=g)[:n].to(DEV)
    k = (torch.randn(n, KVH, D, generator=g) * 3).to(DEV, dt)
    v = torch.randn(n, KVH, D, generator=g).to(DEV, dt)
    first = (k[:2].float() * 0.01).to(dt), (v[:2].float() * 0.01).to(dt)
    for st in (want, got):  # fp8: both calibrate on the same first write
        st.write(0, slots[:2], *first)
    k[0, 0, :3] = torch.tensor([float("nan"), float("inf"), -float("inf")]).to(dt)
    k[1, 1, :] = -0.0
    k[2, 0, :4] = 1e6  # far past fp8's range once scaled: saturates
    v[3, 1, 5] = float("nan")
    want.write(0, slots, k, v)
    backend = TritonBackend()
    assert backend.write_kv(0, got, slots, k, v)
    for name, ts in want.block_tensors().items():
        assert torch.equal(raw(got.block_tensors()[name][0]), raw(ts[0])), name
    # padding slots (-1) are skipped
    before = [raw(t[0]).clone() for t in got.block_tensors().values()]
    kv_write(paged_cache(got, 0), torch.full((n,), -1, device=DEV), k * 2, v * 2)
    for b, t in zip(before, got.block_tensors().values(), strict=True):
        assert torch.equal(b, raw(t[0]))


def test_fp8_is_written_by_the_storage_until_its_scales_are_calibrated():
    st = make_kv_storage("fp8_e4m3", 1, POOL, BS, KVH, D, torch.float32)
    k = torch.randn(4, KVH, D)
    assert not TritonBackend().write_kv(0, st, torch.arange(4), k, k)
    st.write(0, torch.arange(4), k, k)  # calibrates
    assert TritonBackend().write_kv(0, st, torch.arange(4, 8), k, k)
    kivi = make_kv_storage("kivi4", 1, POOL, BS, KVH, D, torch.float32)
    assert not TritonBackend().write_kv(0, kivi, torch.arange(4), k, k)


@triton.jit
def _codes(x_ptr, o_ptr, n, E5M2: tl.constexpr):
    i = tl.program_id(0) * 4096 + tl.arange(0, 4096)
    x = tl.load(x_ptr + i, mask=i < n)
    tl.store(o_ptr + i, _fp8_code(x, E5M2), mask=i < n)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_rounding_equals_torchs_cast(dtype):
    """Round to nearest even at every tie, subnormals, the carry into the next binade, the
    largest finite value and the sign of zero."""
    top = torch.finfo(dtype).max
    codes = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    vals = codes[codes.isfinite()].abs().unique().sort().values
    mids = (vals[1:] + vals[:-1]) / 2
    up, down = torch.tensor(1e30), torch.tensor(0.0)
    x = torch.cat([vals, mids, mids.nextafter(up), mids.nextafter(down),
                   torch.rand(2000, generator=torch.Generator().manual_seed(0)) * top])  # fmt: skip
    x = torch.cat([x, -x, torch.tensor([0.0, -0.0])]).clamp(-top, top).to(DEV)
    out = torch.empty(len(x), dtype=torch.uint8, device=DEV)
    _codes[(triton.cdiv(len(x), 4096),)](x, out, len(x), dtype == torch.float8_e5m2)
    assert torch.equal(out, x.to(dtype).view(torch.uint8))
