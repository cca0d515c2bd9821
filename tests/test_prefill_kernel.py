"""The causal prefill kernel against naive attention, and its place in the CPU attention
backend."""

from __future__ import annotations

import pytest
import torch

from kvserve.attention.cpu_backend import CpuBackend
from kvserve.attention.metadata import AttentionMetadata, PrefillChunk
from kvserve.attention.torch_backend import TorchBackend, reference_attention
from kvserve.kernels import prefill
from kvserve.kv.storage import DenseKVStorage

pytestmark = pytest.mark.skipif(
    not prefill.native_available(), reason="no C compiler: SDPA serves every prefill"
)
needs_bf16_dot = pytest.mark.skipif(
    not prefill.bf16_dot_built(), reason="no AVX512-BF16: no dot-product path"
)
# float32; bf16 on float32 FMAs; bf16 on bf16 dot products (the probabilities rounded to bf16
# for the value product: one more rounding, still within the output's bf16 rounding)
DTYPES = [
    pytest.param(torch.float32, "0", 2e-6, id="float32"),
    pytest.param(torch.bfloat16, "0", 1.6e-2, id="bf16-fma"),
    pytest.param(torch.bfloat16, "1", 1.6e-2, id="bf16-dot", marks=needs_bf16_dot),
]


def _qkv(tokens: int, heads: int, kv_heads: int, d: int, seed: int = 0, dtype=torch.bfloat16):
    """q/k/v as strided views of one fused projection, as the model produces them."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=g).to(dtype)
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    return q.view(tokens, heads, d), k.view(tokens, kv_heads, d), v.view(tokens, kv_heads, d)


@pytest.mark.parametrize(
    "tokens, heads, kv_heads, d, window",
    [
        (1, 4, 2, 64, None),  # one query
        (31, 4, 2, 64, None),  # under one 32-key block
        (33, 8, 4, 64, None),  # a block and one key
        (300, 4, 1, 32, None),  # MQA, many tiles on several threads
        (130, 2, 2, 128, 20),  # MHA, sliding window shorter than the chunk
        (70, 16, 2, 64, None),  # 8 query heads per KV head
        (50, 6, 3, 48, 7),  # head size 48, window inside a block
    ],
)
@pytest.mark.parametrize("dtype, dot, tol", DTYPES)
def test_prefill_kernel_matches_naive_attention(
    monkeypatch, tokens, heads, kv_heads, d, window, dtype, dot, tol
):
    monkeypatch.setenv("KVSERVE_PREFILL_BF16_DOT", dot)
    q, k, v = _qkv(tokens, heads, kv_heads, d, dtype=dtype)
    out = torch.full((tokens, heads, d), float("nan"), dtype=dtype)
    assert prefill.prefill_attention(q, k, v, out, window)
    want = reference_attention(q, k, v, torch.arange(tokens), window)  # float32 math
    # bf16: both round at the end; float32 accumulation differs from the reference in order only.
    torch.testing.assert_close(out.float(), want.float(), atol=tol, rtol=tol)


def test_prefill_kernel_declines_what_it_does_not_handle():
    q, k, v = _qkv(8, 4, 2, 64)
    out = torch.zeros(8, 4, 64, dtype=torch.bfloat16)
    assert not prefill.prefill_attention(q.half(), k.half(), v.half(), out.half(), None)
    assert not prefill.prefill_attention(q, k.float(), v.float(), out, None)  # mixed dtypes
    q40, k40, v40 = _qkv(8, 4, 2, 40)  # head size not a multiple of 16
    assert not prefill.prefill_attention(q40, k40, v40, torch.zeros(8, 4, 40).bfloat16(), None)
    assert not prefill.prefill_attention(q, k, v, out.transpose(0, 1), None)  # strided out
    assert torch.equal(out, torch.zeros_like(out))  # nothing written


class CausalOnly(TorchBackend):
    """The reference backend with the CPU backend's causal prefill kernel alone."""

    causal_prefill = CpuBackend.causal_prefill


def test_paged_attention_routes_fresh_chunks_to_the_kernel_only():
    """One step with a decode row, a chunk that starts its sequence (kernel) and a chunk that
    continues a cached context (SDPA after a gather): the causal kernel's result equals the
    reference backend's within bf16 rounding, and rows outside fresh chunks are identical."""
    torch.manual_seed(3)
    bs, h, kvh, d = 16, 4, 2, 64
    ref_store = DenseKVStorage(1, 32, bs, kvh, d, torch.bfloat16)
    ref_store.k[0].normal_()
    ref_store.v[0].normal_()
    fast_store = DenseKVStorage(1, 32, bs, kvh, d, torch.bfloat16)
    fast_store.k[0].copy_(ref_store.k[0])
    fast_store.v[0].copy_(ref_store.v[0])
    # rows: decode (seq A at position 20), fresh chunk B (40 tokens), chunk C (30 after 16)
    q, k, v = _qkv(1 + 40 + 30, h, kvh, d, seed=4)
    slots = torch.cat(
        [torch.tensor([1 * bs + 4]), 4 * bs + torch.arange(40), 8 * bs + 16 + torch.arange(30)]
    )
    meta = AttentionMetadata(
        slot_mapping=slots,
        block_size=bs,
        num_decode=1,
        decode_block_tables=torch.tensor([[0, 1]]),
        decode_seq_lens=torch.tensor([21]),
        prefills=[
            PrefillChunk(1, 40, 0, None),
            PrefillChunk(41, 30, 16, torch.tensor([7, 8, 9])),
        ],
    )
    # chunk C's slots: block 8 holds positions 16-31 after its context block 7
    meta.slot_mapping[41:] = torch.cat([8 * bs + torch.arange(16), 9 * bs + torch.arange(14)])
    want = TorchBackend().forward(q, k, v, 0, ref_store, meta)
    got = CausalOnly().forward(q, k, v, 0, fast_store, meta)
    fresh = slice(1, 41)
    torch.testing.assert_close(got[fresh].float(), want[fresh].float(), atol=1.6e-2, rtol=1.6e-2)
    assert not torch.equal(got[fresh], torch.zeros_like(got[fresh]))
    assert torch.equal(got[:1], want[:1]) and torch.equal(got[41:], want[41:])


AMX = torch.cpu._is_amx_tile_supported()


@pytest.mark.parametrize("dtype, dot, tol", DTYPES)
@pytest.mark.parametrize(
    "ctx, tokens, heads, kv_heads, d, window",
    [
        (16, 30, 4, 2, 64, None),  # a chunk after one cached block
        (100, 1, 8, 4, 64, None),  # one query after a long context (AMX only)
        (37, 70, 9, 3, 64, 25),  # SmolLM2's grouping, a window reaching into the context
        (200, 45, 8, 2, 128, None),  # head size 128, a context longer than the chunk
        (1800, 180, 8, 4, 64, None),  # a turn after a cached conversation (50 M heads)
        (300, 16, 9, 3, 64, 40),  # the fewest queries the dot products take, a window
        (300, 15, 9, 3, 64, None),  # one fewer: SDPA's
        (45, 200, 8, 2, 128, None),  # head size 128
        (33, 64, 4, 4, 32, 50),  # MHA, head size 32
        (700, 700, 8, 8, 64, None),  # the 50 M benchmark model's heads, a long context
        (5, 300, 4, 1, 32, 100),  # MQA, many tiles, a window shorter than the chunk
    ],
)
def test_context_kernel_matches_naive_attention(monkeypatch, ctx, tokens, heads, kv_heads, d,
                                                window, dtype, dot, tol):  # fmt: skip
    """A chunk continuing its sequence over the gathered context and its own keys, read as a
    strided view of the gathered [KVH, S, D] layout, against naive float32 attention: within
    bf16 rounding, or float32's summation order. The AMX tile kernel (bf16, where the CPU has
    it) takes every case; the FMA kernel takes chunks whose context is no longer than the
    chunk, on bf16 dot products also chunks of 16 queries or more after a longer context,
    and declines the rest with nothing written (SDPA is faster there)."""
    monkeypatch.setenv("KVSERVE_PREFILL_BF16_DOT", dot)
    g = torch.Generator().manual_seed(ctx + tokens)
    n = ctx + tokens
    kv = torch.randn(2, kv_heads, n + 5, d, generator=g).to(dtype)  # gathered, padded
    keys, vals = kv[0, :, :n].transpose(0, 1), kv[1, :, :n].transpose(0, 1)  # [n, KVH, D]
    q = torch.randn(tokens, heads, d, generator=g).to(dtype)
    out = torch.full((tokens, heads, d), float("nan"), dtype=dtype)
    took = prefill.context_attention(q, keys, vals, out, window)
    dot_takes = dot == "1" and tokens >= prefill.DOT_CONTEXT_MIN_QUERIES
    assert took == (ctx <= tokens or (dtype == torch.bfloat16 and (AMX or dot_takes)))
    if not took:
        assert torch.isnan(out).all()
        return
    want = reference_attention(q, keys, vals, torch.arange(ctx, n), window)
    torch.testing.assert_close(out.float(), want.float(), atol=tol, rtol=tol)


def test_bf16_dot_setting_is_checked(monkeypatch):
    """``KVSERVE_PREFILL_BF16_DOT`` takes 0 or 1 (1 only where the path was built); anything
    else names the variable."""
    monkeypatch.setenv("KVSERVE_PREFILL_BF16_DOT", "0")
    assert not prefill.bf16_dot_products()
    monkeypatch.setenv("KVSERVE_PREFILL_BF16_DOT", "1")
    assert prefill.bf16_dot_products() == prefill.bf16_dot_built()
    monkeypatch.setenv("KVSERVE_PREFILL_BF16_DOT", "yes")
    with pytest.raises(ValueError, match="KVSERVE_PREFILL_BF16_DOT: must be 0 or 1"):
        prefill.bf16_dot_products()


def test_context_kernel_declines_what_it_does_not_handle():
    """Values laid out unlike the keys, head size 40, fewer keys than queries and mixed
    dtypes go to SDPA, with nothing written."""
    q = torch.randn(8, 4, 64)
    kv = torch.randn(2, 20, 2, 64)
    out = torch.full((8, 4, 64), float("nan"))
    v_heads_first = torch.randn(2, 20, 64).transpose(0, 1)  # [20, 2, 64], other strides
    assert not prefill.context_attention(q, kv[0], v_heads_first, out, None)
    assert not prefill.context_attention(q, kv[0, :5], kv[1, :5], out, None)
    assert not prefill.context_attention(q.bfloat16(), kv[0], kv[1], out.bfloat16(), None)
    k40 = torch.randn(20, 2, 40)
    assert not prefill.context_attention(q[..., :40].contiguous(), k40, k40, out[..., :40], None)
    assert torch.isnan(out).all()


def test_paged_attention_routes_continuing_chunks_to_the_context_kernel():
    """The routing test's step through the CPU backend, its context kernel too: chunk C (30
    tokens after a cached block) runs in the kernel, and every row still equals the
    reference backend's within bf16 rounding."""
    torch.manual_seed(3)
    bs, h, kvh, d = 16, 4, 2, 64
    ref_store = DenseKVStorage(1, 32, bs, kvh, d, torch.bfloat16)
    ref_store.k[0].normal_()
    ref_store.v[0].normal_()
    fast_store = DenseKVStorage(1, 32, bs, kvh, d, torch.bfloat16)
    fast_store.k[0].copy_(ref_store.k[0])
    fast_store.v[0].copy_(ref_store.v[0])
    q, k, v = _qkv(40 + 30, h, kvh, d, seed=5)
    meta = AttentionMetadata(
        slot_mapping=torch.cat([4 * bs + torch.arange(40), 8 * bs + torch.arange(16),
                                9 * bs + torch.arange(14)]),
        block_size=bs,
        prefills=[PrefillChunk(0, 40, 0, None), PrefillChunk(40, 30, 16, torch.tensor([7, 8, 9]))],
    )  # fmt: skip
    want = TorchBackend().forward(q, k, v, 0, ref_store, meta)
    calls = []
    fast = CpuBackend()

    def context(*args):
        calls.append(CpuBackend.context_prefill(fast, *args))
        return calls[-1]

    fast.context_prefill = context
    got = fast.forward(q, k, v, 0, fast_store, meta)
    assert calls == [True]  # chunk C only: the fresh chunk goes to the causal kernel
    torch.testing.assert_close(got.float(), want.float(), atol=1.6e-2, rtol=1.6e-2)
