"""The native RMSNorm and rotary kernels against the PyTorch reference modules in llama.py, the
KV cache write against indexed assignment, the rows' top-k against a stable sort, and the
fast-path benchmark's option checks."""

from __future__ import annotations

import pytest
import torch

from kvserve.config import ModelConfig
from kvserve.kernels import pointwise
from kvserve.model.linear_ops import OneDNNOps, TorchOps
from kvserve.model.llama import RMSNorm, RotaryEmbedding

pytestmark = pytest.mark.skipif(
    not pointwise.native_available(), reason="no C compiler: the reference is in use"
)


def _rotary(head_dim: int, partial: float = 1.0) -> RotaryEmbedding:
    cfg = ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=64,
        hidden_size=4 * head_dim,
        intermediate_size=8,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        rope_theta=10000.0,
        partial_rotary_factor=partial,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
    )
    return RotaryEmbedding(cfg, 4096, torch.device("cpu"))


def _qkv_views(tokens: int, dtype: torch.dtype, head_dim: int):
    """q [T, 4, D] and k [T, 2, D] as strided views of one fused projection, as in the model."""
    qkv = torch.randn(tokens, 8 * head_dim, dtype=torch.float32).to(dtype) * 3
    q, k, v = qkv.split([4 * head_dim, 2 * head_dim, 2 * head_dim], dim=-1)
    return qkv, q.view(tokens, 4, head_dim), k.view(tokens, 2, head_dim), v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 5, 700])  # 700 tokens run on several threads
# (32, 0.5): a half of 8 dims, under the AVX-512 path's 16 lanes (the scalar loop)
@pytest.mark.parametrize("head_dim, partial", [(64, 1.0), (32, 1.0), (64, 0.5), (32, 0.5)])
def test_rotary_kernel_is_bit_identical_to_reference(dtype, tokens, head_dim, partial):
    torch.manual_seed(tokens)
    rot = _rotary(head_dim, partial)
    _, q, k, v = _qkv_views(tokens, dtype, head_dim)
    positions = torch.randint(0, 4096, (tokens,), dtype=torch.int64)
    want_q, want_k = rot(positions, q, k)
    v_before = v.clone()
    assert pointwise.rotary_(positions, q, k, rot.cos, rot.sin)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)
    assert torch.equal(v, v_before)  # the third part of the fused buffer is untouched


def test_rotary_kernel_refuses_positions_outside_the_table():
    rot = _rotary(64)
    _, q, k, _ = _qkv_views(3, torch.float32, 64)
    before = q.clone()
    with pytest.raises(IndexError, match=r"outside \[0, 4096\)"):
        pointwise.rotary_(torch.tensor([0, 4096, 1]), q, k, rot.cos, rot.sin)
    assert torch.equal(q, before)


def test_kernels_decline_what_they_do_not_handle():
    rot = _rotary(64)
    _, q, k, _ = _qkv_views(3, torch.float16, 64)
    assert not pointwise.rotary_(torch.arange(3), q, k, rot.cos, rot.sin)
    assert pointwise.rms_norm(torch.randn(3, 8, dtype=torch.float16), torch.ones(8), 1e-5) is None
    transposed = torch.randn(8, 3, dtype=torch.bfloat16).t()
    assert pointwise.rms_norm(transposed, torch.ones(8, dtype=torch.bfloat16), 1e-5) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 7, 300])
def test_kv_write_equals_indexed_assignment(dtype, tokens):
    """K and V rows (strided views of a fused projection) land in the same places, bit for
    bit, as the reference's indexed assignment puts them, negative slots included; a slot
    outside the pools raises and writes nothing; other layouts are declined."""
    rows, kvh, bs, d = 40, 2, 16, 64
    g = torch.Generator().manual_seed(tokens)
    _, _, k, v = _qkv_views(tokens, dtype, d)
    k = k.reshape(tokens, kvh, d)  # the view of the fused output: rows 8 * d apart
    v = v.view(tokens, kvh, d)
    slots = torch.randperm(rows * bs, generator=g)[:tokens] - rows * bs // 2
    pools = [torch.randn(rows, kvh, bs, d, generator=g).to(dtype) for _ in range(2)]
    want = [p.clone() for p in pools]
    blk, off = slots // bs, slots % bs
    want[0][blk, :, off] = k
    want[1][blk, :, off] = v
    assert pointwise.kv_write(pools[0], pools[1], slots, k, v)
    assert torch.equal(pools[0], want[0]) and torch.equal(pools[1], want[1])
    bad = slots.clone()
    bad[-1] = rows * bs
    with pytest.raises(IndexError, match=rf"outside \[{-rows * bs}, {rows * bs}\)"):
        pointwise.kv_write(pools[0], pools[1], bad, k + 1, v + 1)
    assert torch.equal(pools[0], want[0]) and torch.equal(pools[1], want[1])
    assert not pointwise.kv_write(pools[0], pools[1], slots, k.half(), v.half())
    assert not pointwise.kv_write(pools[0], pools[1], slots.int(), k, v)


@pytest.mark.parametrize("tokens", [1, 9, 600])
@pytest.mark.parametrize("dim", [512, 520])  # 520: not whole 16-lane vectors (the scalar loop)
def test_rms_norm_kernel_matches_reference(tokens, dim):
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        norm = RMSNorm(dim, 1e-5)
        norm.weight.data = (torch.rand(dim) + 0.5).to(dtype)
        x = (torch.randn(tokens, dim) * 4).to(dtype)
        want = norm(x)
        got = pointwise.rms_norm(x, norm.weight, norm.eps)
        assert got is not None and got.dtype == dtype and got.shape == want.shape
        if dtype == torch.float32:  # only the order of the sum of squares differs
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        else:  # bfloat16: equal but for rare one-ulp roundings of the normalised value, which
            # the rounded product with the weight can carry to two ulps of the output (2^-6)
            same = (got == want).float().mean().item()
            assert same > 0.99, same
            torch.testing.assert_close(got.float(), want.float(), rtol=2**-6, atol=1e-6)


def test_fast_ops_norm_and_rotary_equal_reference_ops():
    """OneDNNOps (the CPU fast path) against TorchOps: rotary bit for bit in both dtypes,
    RMSNorm to float32 rounding."""
    torch.manual_seed(1)
    ref, fast = TorchOps(), OneDNNOps()
    rot = _rotary(64)
    for dtype in (torch.float32, torch.bfloat16):
        _, q, k, _ = _qkv_views(50, dtype, 64)
        positions = torch.arange(100, 150)
        want = ref.rotary(rot, positions, q, k)
        got = fast.rotary(rot, positions, q.clone(), k.clone())
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    norm = RMSNorm(256, 1e-6)
    x = torch.randn(40, 256)
    torch.testing.assert_close(fast.rms_norm(norm, x), ref.rms_norm(norm, x), rtol=1e-6, atol=1e-6)


def _stable_top(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The naive reference: a stable descending sort (equal values keep index order)."""
    v, i = torch.sort(x, dim=-1, descending=True, stable=True)
    return v[:, :k], i[:, :k]


@pytest.mark.parametrize("cols", [1, 5, 16, 17, 100, 49152])
def test_topk_rows_matches_a_stable_sort(cols):
    g = torch.Generator().manual_seed(cols)
    for x in (
        torch.randn(9, cols, generator=g),
        # many ties: the lower index must come first, as argmax picks
        torch.randint(0, 4, (9, cols), generator=g).float(),
        # a masked vocabulary: -inf everywhere but a few, and a row of nothing but -inf
        torch.full((3, cols), float("-inf")).index_fill_(1, torch.arange(0, cols, 7), 2.0),
        torch.full((2, cols), float("-inf")),
    ):
        for k in sorted({1, min(4, cols), min(16, cols)}):
            got = pointwise.topk_rows(x, k)
            assert got is not None
            want = _stable_top(x, k)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (cols, k)


def test_topk_rows_strided_rows_and_what_it_declines():
    x = torch.randn(6, 80)
    view = x[::2, 3:70]  # rows 160 apart, 67 wide
    got = pointwise.topk_rows(view, 4)
    assert got is not None
    want = _stable_top(view, 4)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert pointwise.topk_rows(x, 0) is None
    assert pointwise.topk_rows(x, pointwise.TOPK_MAX + 1) is None
    assert pointwise.topk_rows(x[:, :3], 4) is None  # k > cols
    assert pointwise.topk_rows(x.to(torch.bfloat16), 4) is None
    assert pointwise.topk_rows(x.t(), 4) is None
    nan = x.clone()
    nan[4, 50] = float("nan")
    assert pointwise.topk_rows(nan, 4) is None  # torch.topk decides where NaN goes


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--passes", "0"], "--passes must be >= 1, got 0"),
        (["--sizes", "5m,7b"], "--sizes: unknown ['7b']"),
    ],
)
def test_fast_path_benchmark_rejects_bad_options(argv, message, capsys):
    from benchmarks.fast_path import main

    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
