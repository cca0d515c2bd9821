"""The Triton KV write kernels against the storages' own writes (:mod:`kvserve.kv.codecs`),
bit for bit, under Triton's interpreter (tests/conftest.py sets it where there is no GPU):
dense, fp8 e4m3 / e5m2 and int8, with NaN, infinities, negative zero, values past the fp8
range and padding slots; and the kernels' float8 rounding against torch's cast over every
code, every midpoint between neighbouring codes and the floats either side of it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from kvserve.attention.triton_backend import TritonBackend, paged_cache
from kvserve.kernels.triton_kv_write import _fp8_code, kv_write
from kvserve.kv import codecs
from kvserve.kv.formats import make_kv_storage
from kvserve.kv.kivi_storage import FORMAT_VALUE_GROUP, KiviKVStorage
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


def test_kivi_below_block_size_16_is_written_by_the_storage():
    """The quantizing kernel's tiles are a block's tokens: 16 at least (a matrix product's
    smallest side)."""
    k = torch.randn(4, KVH, D).to(DEV)
    kivi = make_kv_storage("kivi4", 1, POOL, 8, KVH, D, torch.float32, DEV)
    kivi.begin_step(np.arange(4))
    assert not TritonBackend().write_kv(0, kivi, torch.arange(4, device=DEV), k, k)
    kivi = make_kv_storage("kivi4", 1, POOL, 16, KVH, D, torch.float32, DEV)
    kivi.begin_step(np.arange(4))
    assert TritonBackend().write_kv(0, kivi, torch.arange(4, device=DEV), k, k)
    assert torch.equal(kivi.res_k[0][0, :, :4], k.transpose(0, 1))  # the residual took them


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


# -- KIVI ---------------------------------------------------------------------------------------
def kivi_pair(bits: int, rotate: bool, bs: int = BS) -> tuple[KiviKVStorage, KiviKVStorage]:
    """Two equal KIVI pools (the storage writes one, the kernels the other); a flush batch of
    two, so that steps quantize blocks from the residual as well as from the write."""
    group = FORMAT_VALUE_GROUP[f"kivi{bits}"]
    return tuple(KiviKVStorage(1, POOL * 2, bs, KVH, D, torch.float32, DEV, bits=bits,
                               group=group, num_residual=6, flush_batch=2, rotate_keys=rotate)
                 for _ in range(2))  # type: ignore[return-value]  # fmt: skip


def kivi_steps(bs: int = BS) -> list[list[int]]:
    """Each step's slots: two prefills (whole blocks, and a partial one into the residual),
    then decode steps that fill and complete residual blocks, until full blocks wait in the
    residual and a flush quantizes them while new tokens take freed slots."""
    a, b = [3, 5, 1, 9, 2], [6, 11, 4, 13]
    steps = [[a[0] * bs + i for i in range(bs)] + [a[1] * bs + i for i in range(bs)]
             + [a[2] * bs + i for i in range(bs - 4)],
             [b[0] * bs + i for i in range(bs - 2)]]  # fmt: skip
    na, nb = 2 * bs + bs - 4, bs - 2  # tokens so far
    for _ in range(2 * bs + 3):
        steps.append([a[na // bs] * bs + na % bs, b[nb // bs] * bs + nb % bs])
        na, nb = na + 1, nb + 1
    return steps


def kv_of(n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys with outlier channels (KIVI's premise) and a few poisoned values."""
    k = torch.randn(n, KVH, D, generator=g) * (1 + 8 * (torch.arange(D) % 7 == 0))
    v = torch.randn(n, KVH, D, generator=g) * 2
    return k.to(DEV), v.to(DEV)


def run_kivi(pair: tuple[KiviKVStorage, KiviKVStorage], steps: list[list[int]],
             poison: bool = False) -> int:  # fmt: skip
    """Every step through the storage's write (``pair[0]``) and the backend's kernels
    (``pair[1]``); how many blocks the kernels quantized."""
    want, got = pair
    backend = TritonBackend()
    g = torch.Generator().manual_seed(5)
    for i, slots in enumerate(steps):
        k, v = kv_of(len(slots), g)
        if poison and i == 0:
            k[0, 0, :3] = torch.tensor([float("nan"), float("inf"), -float("inf")])
            k[1, 1, :] = -0.0
            v[3, 1, 5] = float("nan")
            v[4, 0, :2] = torch.tensor([1e6, -1e6])  # past float16's range: saturate
            v[5, 1, :] = 0.0  # a zero span
        s = torch.tensor(slots, device=DEV)
        for st in pair:
            st.begin_step(np.asarray(slots))
        want.write(0, s, k, v)
        assert backend.write_kv(0, got, s, k, v)
    assert got.blocks_quantized == want.blocks_quantized
    return got.blocks_quantized


@pytest.mark.parametrize("bits", [4, 2])
def test_the_kivi_kernels_store_the_storages_codes(bits):
    """Unrotated keys: every code, scale, zero and residual entry equal to the storage's own
    write, bit for bit, over prefills, decode steps, completed blocks and flushes, with NaN,
    infinities, values past float16's range and zero spans."""
    pair = kivi_pair(bits, rotate=False)
    assert run_kivi(pair, kivi_steps(), poison=True) >= 6
    want, got = pair
    for name, ts in want.block_tensors().items():
        assert torch.equal(raw(got.block_tensors()[name][0]), raw(ts[0])), name
    for w, o in zip(want.fixed_tensors(), got.fixed_tensors(), strict=True):
        assert torch.equal(raw(o), raw(w))


@pytest.mark.parametrize("bits", [4, 2])
def test_the_kivi_kernels_keep_the_codecs_bound_with_rotated_keys(bits):
    """The engine's KIVI (keys Hadamard-rotated before they are quantized): the rotation is a
    matrix product whose float32 rounding need not match torch's, so codes may differ where
    a value sits on a rounding boundary. Values (not rotated) and the residual stay bit for
    bit; every decoded key is within the codec's bound of the rotated input, measured with
    the kernel's own metadata, and nearly every key code equals the storage's."""
    pair = kivi_pair(bits, rotate=True)
    steps = kivi_steps()
    run_kivi(pair, steps)
    want, got = pair
    for name in ("v_codes", "v_scale", "v_zero"):
        assert torch.equal(raw(got.block_tensors()[name][0]), raw(want.block_tensors()[name][0]))
    for w, o in zip(want.fixed_tensors(), got.fixed_tensors(), strict=True):
        assert torch.equal(raw(o), raw(w))
    # The keys as written, rotated by the reference's own product, per quantized block.
    g = torch.Generator().manual_seed(5)
    keys = torch.zeros(POOL * 2, KVH, BS, D, device=DEV)
    for slots in steps:
        k, _ = kv_of(len(slots), g)
        s = torch.tensor(slots, device=DEV)
        keys[s // BS, :, s % BS] = k.float()
    blocks = torch.tensor(sorted(b for b in range(POOL * 2) if got.res_of_block[b] < 0
                                 and got.k_base[0][b].abs().sum() > 0), device=DEV)  # fmt: skip
    assert len(blocks) >= 6
    rotated = keys[blocks] @ got.key_rotation
    meta, base = got.k_meta[0][blocks], got.k_base[0][blocks]
    decoded = codecs.kivi_dequantize_keys(got.k_codes[0][blocks], meta, base, bits)
    bound = codecs.kivi_key_error_bound(rotated, meta, base, bits)
    assert ((decoded - rotated).abs() <= bound * (1 + 1e-5) + 1e-6).all()
    same = (got.k_codes[0][blocks] == want.k_codes[0][blocks]).float().mean()
    assert same > 0.99
    torch.testing.assert_close(base, want.k_base[0][blocks], rtol=1e-5, atol=1e-6)
