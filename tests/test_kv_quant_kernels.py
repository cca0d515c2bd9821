"""The quantized decode kernel against the reference path (dequantizing gather + SDPA)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvserve.attention.cpu_backend import CpuBackend
from kvserve.kernels import quant
from kvserve.kv.formats import make_kv_storage

pytestmark = pytest.mark.skipif(
    not quant.native_available(), reason="no C compiler: the reference path is in use"
)


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2", "int8", "kivi4", "kivi2"])
@pytest.mark.parametrize("kv_heads, heads", [(2, 4), (1, 4), (4, 4)])
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# d 64: the SIMD unpack / F16C paths; 40: their tails; 48, 64: the AVX-512 row path (D % 16
# == 0; KIVI needs 64); block size 16: full 16-row score reductions.
@pytest.mark.parametrize("block_size, d", [(4, 40), (4, 64), (16, 48), (16, 64)])
@pytest.mark.parametrize("portable", [False, True], ids=["simd", "portable"])
def test_quant_kernel_matches_reference(fmt, kv_heads, heads, window, dtype, d, portable,
                                        block_size, monkeypatch):  # fmt: skip
    """``KVSERVE_QUANT_SCALAR`` makes the kernel skip its AVX-512 path, so both are checked
    on a machine that has AVX-512."""
    if portable:
        monkeypatch.setenv("KVSERVE_QUANT_SCALAR", "1")
    torch.manual_seed(0)
    bs, nblocks = block_size, 96
    st = make_kv_storage(fmt, 1, nblocks, bs, kv_heads, d, dtype)
    lens = torch.tensor([1, 5, 13, 38, 70])
    nb = int(lens.max() + bs - 1) // bs
    tables = torch.randperm(nblocks)[: len(lens) * nb].view(len(lens), nb)
    for i, n in enumerate(lens.tolist()):  # a prefill then decode writes: full + partial blocks
        pos = torch.arange(n)
        slots = tables[i, pos // bs] * bs + pos % bs
        kv = torch.randn(n, kv_heads, d) * 3 + 1
        st.begin_step(slots[:-1])
        st.write(0, slots[:-1], kv[:-1], -kv[:-1])
        st.begin_step(slots[-1:])
        st.write(0, slots[-1:], kv[-1:], -kv[-1:])
    q = torch.randn(len(lens), heads, d)
    fused = CpuBackend().decode(0, q, st, tables, lens, window, None)
    assert fused is not None
    st.dtype = torch.float32  # reference: the same stored codes, decoded exactly in float32
    kc, vc = st.gather(0, tables)
    s = nb * bs
    j = torch.arange(s)
    mask = j[None] < lens[:, None]
    if window is not None:
        mask &= j[None] >= lens[:, None] - window
    qd = q.view(len(lens), kv_heads, heads // kv_heads, d)
    ref = F.scaled_dot_product_attention(qd, kc, vc, attn_mask=mask[:, None, None])
    torch.testing.assert_close(fused, ref.reshape(q.shape), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("mode", [[], ["--bandwidth"]])
@pytest.mark.parametrize("flag", ["--batch", "--context"])
def test_attention_kernels_benchmark_rejects_non_positive_sizes(flag, mode, capsys):
    from benchmarks.attention_kernels import main

    with pytest.raises(SystemExit) as e:
        main([*mode, flag, "0"])
    assert e.value.code == 2
    assert f"{flag} must be >= 1, got 0" in capsys.readouterr().err


@pytest.mark.parametrize("fmt", ["int8", "kivi4"])
def test_a_table_narrower_than_a_sequence_is_refused(fmt):
    """A length past the block table would read past the table's row: refused, naming it."""
    st = make_kv_storage(fmt, 1, 8, 4, 2, 64, torch.float32)
    q = torch.randn(1, 4, 64)
    tables = torch.tensor([[1, 2]])
    with pytest.raises(RuntimeError, match="passes its block table's 2 blocks of 4"):
        CpuBackend().decode(0, q, st, tables, torch.tensor([9]), None, None)
    assert CpuBackend().decode(0, q, st, tables, torch.tensor([8]), None, None) is not None
