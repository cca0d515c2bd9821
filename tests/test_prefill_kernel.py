"""The causal prefill kernel against naive attention, and its place in paged_attention."""

from __future__ import annotations

import pytest
import torch

from kvserve.kernels import prefill
from kvserve.kv.storage import DenseKVStorage
from kvserve.model.attention import (
    AttentionMetadata,
    PrefillChunk,
    paged_attention,
    reference_attention,
)
from kvserve.model.linear_ops import OneDNNOps, TorchOps

pytestmark = pytest.mark.skipif(
    not prefill.native_available(), reason="no C compiler: SDPA serves every prefill"
)


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
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-6), (torch.bfloat16, 1.6e-2)])
def test_prefill_kernel_matches_naive_attention(tokens, heads, kv_heads, d, window, dtype, tol):
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


def test_paged_attention_routes_fresh_chunks_to_the_kernel_only():
    """One step with a decode row, a chunk that starts its sequence (kernel) and a chunk that
    continues a cached context (SDPA after a gather): the fast backend's result equals the
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
    want = paged_attention(q, k, v, 0, ref_store, meta, None, TorchOps().causal_attention)
    got = paged_attention(q, k, v, 0, fast_store, meta, None, OneDNNOps().causal_attention)
    fresh = slice(1, 41)
    torch.testing.assert_close(got[fresh].float(), want[fresh].float(), atol=1.6e-2, rtol=1.6e-2)
    assert not torch.equal(got[fresh], torch.zeros_like(got[fresh]))
    assert torch.equal(got[:1], want[:1]) and torch.equal(got[41:], want[41:])
