"""The native decode kernel against the plain-PyTorch reference (gather + SDPA) and a naive
per-sequence attention; the kernels' on/off switch and the layout check their wrappers share."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from kvserve import kernels
from kvserve.attention.cpu_backend import CpuBackend
from kvserve.attention.metadata import AttentionMetadata
from kvserve.attention.torch_backend import TorchBackend, reference_attention
from kvserve.kernels import amx, pointwise, prefill, quant
from kvserve.kv.storage import DenseKVStorage

pytestmark = pytest.mark.skipif(
    not kernels.native_available(), reason="no C compiler: the reference path is in use"
)


def scattered_group(nblocks: int, bs: int, seqs: list[tuple], **extra: object) -> SimpleNamespace:
    """A kernel group for ``seqs`` of (q_len, ctx_len, retention window, ...): each sequence's
    blocks drawn at random from the pool (tables padded with the null block), its rows one
    after another; ``extra`` adds fields (sinks)."""
    perm = torch.randperm(nblocks).tolist()
    tables, starts, row = [], [], 0
    for q_len, ctx, *_ in seqs:
        nb = -(-(ctx + q_len) // bs)
        tables.append(perm[:nb])
        perm = perm[nb:]
        starts.append(row)
        row += q_len
    width = max(map(len, tables))
    return SimpleNamespace(
        num_rows=row, starts=starts, q_start=torch.tensor(starts),
        q_len=torch.tensor([s[0] for s in seqs]), ctx_len=torch.tensor([s[1] for s in seqs]),
        block_tables=torch.tensor([t + [nblocks] * (width - len(t)) for t in tables]),
        windows=torch.tensor([s[2] for s in seqs], dtype=torch.int32), **extra,
    )  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kv_heads, heads", [(2, 4), (1, 4), (4, 4)])
@pytest.mark.parametrize("window", [None, 7])
# (16, 64) and (32, 128): the AVX-512 path with 16-row score reductions, (8, 64): with blocks
# shorter than its 16-lane softmax; (4, 16): portable.
@pytest.mark.parametrize("bs, d", [(4, 16), (8, 64), (16, 64), (32, 128)])
def test_decode_kernel_matches_reference(dtype, kv_heads, heads, window, bs, d):
    torch.manual_seed(0)
    nblocks = 128
    lens = torch.tensor([1, 5, 13, 37, 70])
    b = len(lens)
    storage = DenseKVStorage(1, nblocks, bs, kv_heads, d, dtype)
    storage.k[0].normal_()
    storage.v[0].normal_()
    perm = torch.randperm(nblocks)
    nb = int(lens.max() + bs - 1) // bs
    tables = perm[: b * nb].view(b, nb)
    q = torch.randn(b, heads, d)

    fused = kernels.paged_decode_attention(q, storage.k[0], storage.v[0], tables, lens, window)
    for i in range(b):
        keys, vals = storage.gather(0, tables[i : i + 1])
        n = int(lens[i])
        keys = keys[0, :, :n].transpose(0, 1).float()
        vals = vals[0, :, :n].transpose(0, 1).float()
        ref = reference_attention(q[i : i + 1], keys, vals, torch.tensor([n - 1]), window)
        torch.testing.assert_close(fused[i : i + 1], ref, atol=2e-5, rtol=1e-4)


def test_cpu_backend_uses_same_math_as_the_reference_backend():
    torch.manual_seed(1)
    bs, d, kvh, h = 4, 8, 2, 4
    storage = DenseKVStorage(1, 16, bs, kvh, d, torch.float32)
    storage.k[0].normal_()
    storage.v[0].normal_()
    tables = torch.tensor([[3, 7, 1], [2, 9, 0]])
    lens = torch.tensor([10, 6])
    q = torch.randn(2, h, d)
    k_new, v_new = torch.randn(2, kvh, d), torch.randn(2, kvh, d)
    slots = torch.tensor([1 * bs + 1, 9 * bs + 1])  # position 9 of seq 0, 5 of seq 1
    meta = AttentionMetadata(slot_mapping=slots, block_size=bs, num_decode=2,
                             decode_block_tables=tables, decode_seq_lens=lens)  # fmt: skip
    fast = CpuBackend().forward(q, k_new, v_new, 0, storage, meta)
    slow = TorchBackend().forward(q, k_new, v_new, 0, storage, meta)
    torch.testing.assert_close(fast, slow, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bs, d", [(4, 16), (16, 64)])
def test_chunk_kernel_matches_naive_attention(window, dtype, bs, d):
    """Short chunks continuing a cached context (and decode rows) in one fused call."""
    torch.manual_seed(2)
    kvh, h, nblocks = 2, 6, 64
    storage = DenseKVStorage(1, nblocks, bs, kvh, d, dtype)
    storage.k[0].normal_()
    storage.v[0].normal_()
    # (q_len, ctx_len, -): a decode row, a chunk crossing blocks, a 20-query chunk (two tiles).
    seqs = [(1, 9, 0), (7, 13, 0), (20, 3, 0)]  # no retention windows
    group = scattered_group(nblocks, bs, seqs)
    row, starts, bt = group.num_rows, group.starts, group.block_tables
    q = torch.randn(row, h, d)
    out = torch.full((row, h, d), float("nan"))
    kernels.paged_attention(q, storage.k[0], storage.v[0], group, window, out)
    for i, ((ql, ctx, _), st) in enumerate(zip(seqs, starts, strict=True)):
        keys, vals = storage.gather(0, bt[i : i + 1])
        keys = keys[0, :, : ctx + ql].transpose(0, 1).float()
        vals = vals[0, :, : ctx + ql].transpose(0, 1).float()
        ref = reference_attention(q[st : st + ql], keys, vals, ctx + torch.arange(ql), window)
        torch.testing.assert_close(out[st : st + ql], ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_per_sequence_retention_windows_match_naive_attention(dtype):
    """Each sequence attends its own recent window (a retention policy's), combined with the
    layer's: decode rows and a short chunk, fused kernel against naive attention."""
    torch.manual_seed(3)
    bs, d, kvh, h, nblocks = 4, 16, 2, 4, 64
    storage = DenseKVStorage(1, nblocks, bs, kvh, d, dtype)
    storage.k[0].normal_()
    storage.v[0].normal_()
    seqs = [(1, 17, 5), (1, 9, 0), (6, 11, 8)]  # (q_len, ctx_len, retention window; 0 none)
    group = scattered_group(nblocks, bs, seqs)
    row, starts, bt = group.num_rows, group.starts, group.block_tables
    q = torch.randn(row, h, d)
    for layer_window in (None, 6):
        out = torch.empty(row, h, d)
        kernels.paged_attention(q, storage.k[0], storage.v[0], group, layer_window, out)
        for i, (q_len, ctx, w) in enumerate(seqs):
            keys, vals = storage.gather(0, bt[i : i + 1])
            n = ctx + q_len
            keys = keys[0, :, :n].transpose(0, 1).float()
            vals = vals[0, :, :n].transpose(0, 1).float()
            eff = min(x for x in (layer_window, w or None) if x) if (layer_window or w) else None
            sl = slice(starts[i], starts[i] + q_len)
            ref = reference_attention(q[sl], keys, vals, torch.arange(ctx, n), eff)
            torch.testing.assert_close(out[sl], ref.to(out.dtype), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("kv_heads, heads", [(2, 4), (4, 8), (3, 9)])
@pytest.mark.parametrize("bs, d", [(16, 64), (32, 128)])
@pytest.mark.parametrize("num_seqs", [3, 40])  # few tasks (heads split) and many (grouped)
def test_bf16_queries_over_bf16_cache_match_naive_attention(kv_heads, heads, bs, d, num_seqs):
    """A bf16 model's path: bf16 queries and cache, bf16 output written by the kernel (its
    CPU bf16 dot products where the CPU has them). Decode rows, chunks that cross blocks and
    tiles, layer and retention windows, against naive float32 attention of the same values."""
    torch.manual_seed(4)
    nblocks = 512
    storage = DenseKVStorage(1, nblocks, bs, kv_heads, d, torch.bfloat16)
    storage.k[0].normal_()
    storage.v[0].normal_()
    g = torch.Generator().manual_seed(5)
    seqs = []  # (q_len, ctx_len, retention window)
    for i in range(num_seqs):
        q_len = 1 if i % 3 else int(torch.randint(2, 21, (1,), generator=g))
        ctx = int(torch.randint(0, 150, (1,), generator=g))
        seqs.append((q_len, ctx, 0 if i % 4 else int(torch.randint(1, 40, (1,), generator=g))))
    group = scattered_group(nblocks, bs, seqs)
    row, starts, bt = group.num_rows, group.starts, group.block_tables
    q = torch.randn(row, heads, d).to(torch.bfloat16)
    for layer_window in (None, 23):
        out = torch.full((row, heads, d), float("nan"), dtype=torch.bfloat16)
        kernels.paged_attention(q, storage.k[0], storage.v[0], group, layer_window, out)
        for i, (q_len, ctx, w) in enumerate(seqs):
            keys, vals = storage.gather(0, bt[i : i + 1])
            n = ctx + q_len
            keys = keys[0, :, :n].transpose(0, 1).float()
            vals = vals[0, :, :n].transpose(0, 1).float()
            eff = min(x for x in (layer_window, w or None) if x) if (layer_window or w) else None
            sl = slice(starts[i], starts[i] + q_len)
            ref = reference_attention(q[sl].float(), keys, vals, torch.arange(ctx, n), eff)
            # bf16 output: within its rounding (2^-8 relative) of the float32 reference
            torch.testing.assert_close(out[sl].float(), ref, atol=1e-2, rtol=8e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kv_heads, heads", [(3, 9), (2, 2)])
@pytest.mark.parametrize("bs, d", [(4, 16), (16, 64)])
def test_votes_are_the_attention_probabilities_each_key_receives(dtype, kv_heads, heads, bs, d):
    """H2O's side output: for the sequences that ask, each visible key's probability summed
    over the sequence's queries and each KV head's query heads is added to their buffer,
    against naive float32 softmax of the same values; other columns and sequences untouched,
    and the attention output the same as without votes."""
    torch.manual_seed(6)
    nblocks = 256
    storage = DenseKVStorage(1, nblocks, bs, kv_heads, d, dtype)
    storage.k[0].normal_()
    storage.v[0].normal_()
    # (q_len, ctx_len, retention window, votes?)
    # (several query tiles of one sequence add to the same keys: 40 and 33 queries)
    seqs = [(1, 40, 0, True), (3, 0, 0, False), (1, 0, 0, True), (16, 21, 0, True),
            (1, 70, 9, True), (5, 33, 0, False), (1, 17, 0, False), (40, 10, 0, True),
            (33, 0, 0, True)]  # fmt: skip
    group = scattered_group(nblocks, bs, seqs)
    row, starts, bt = group.num_rows, group.starts, group.block_tables
    q = torch.randn(row, heads, d).to(dtype if dtype == torch.bfloat16 else torch.float32)
    bufs = [torch.rand(kv_heads, ctx + q_len + 5) for q_len, ctx, *_ in seqs]
    before = [b.clone() for b in bufs]
    ptrs = torch.tensor([b.data_ptr() if s[3] else 0 for b, s in zip(bufs, seqs, strict=True)])
    strides = torch.tensor([b.stride(0) for b in bufs])
    out = torch.empty(row, heads, d, dtype=q.dtype)
    kernels.paged_attention(q, storage.k[0], storage.v[0], group, None, out, (ptrs, strides))
    plain = torch.empty_like(out)
    kernels.paged_attention(q, storage.k[0], storage.v[0], group, None, plain)
    assert torch.equal(out, plain)
    g = heads // kv_heads
    for i, (q_len, ctx, w, votes) in enumerate(seqs):
        added = bufs[i] - before[i]
        if not votes:
            assert torch.equal(added, torch.zeros_like(added))
            continue
        n = ctx + q_len
        keys = storage.gather(0, bt[i : i + 1])[0][0, :, :n].float()  # [KVH, n, D]
        qs = q[starts[i] : starts[i] + q_len].float().view(q_len, kv_heads, g, d)
        scores = torch.einsum("qkgd,ksd->kgqs", qs, keys) * d**-0.5
        qpos = torch.arange(ctx, n)[:, None]
        kpos = torch.arange(n)[None, :]
        hidden = (kpos > qpos) | ((kpos <= qpos - w) if w else torch.zeros_like(kpos > qpos))
        probs = scores.masked_fill(hidden, float("-inf")).softmax(-1)
        ref = probs.sum(dim=(1, 2))  # [KVH, n]
        torch.testing.assert_close(added[:, :n], ref, atol=3e-4, rtol=3e-3)
        assert torch.equal(added[:, n:], torch.zeros_like(added[:, n:]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bs, d", [(4, 16), (16, 64)])
def test_sink_keys_are_scored_with_each_rows_rotated_back_query(dtype, bs, d):
    """StreamingLLM in the fused kernel: a row at cache entry c sees the keys of its window
    (c - w, c] with its query and the sink keys before that window, [0, min(S, c - w + 1)),
    with its row of ``q_back``; one softmax over both. Decode rows and chunks (long ones too,
    several query tiles) against naive float32 attention of the same values."""
    torch.manual_seed(7)
    kv_heads, heads, nblocks = 2, 6, 256
    storage = DenseKVStorage(1, nblocks, bs, kv_heads, d, dtype)
    storage.k[0].normal_()
    storage.v[0].normal_()
    # (q_len, ctx_len, window, sinks): past the window, inside it, a chunk straddling it
    seqs = [(1, 60, 16, 4), (1, 10, 16, 4), (40, 0, 16, 3), (7, 30, 12, 5), (1, 45, 0, 0),
            (20, 100, 32, 1)]  # fmt: skip
    sinks = torch.tensor([s[3] for s in seqs], dtype=torch.int32)
    group = scattered_group(nblocks, bs, seqs, sinks=sinks)
    row, starts, bt = group.num_rows, group.starts, group.block_tables
    qdt = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
    q, q_back = torch.randn(row, heads, d).to(qdt), torch.randn(row, heads, d).to(qdt)
    out = torch.full((row, heads, d), float("nan"), dtype=qdt)
    kernels.paged_attention(q, storage.k[0], storage.v[0], group, None, out, q_back=q_back)
    g = heads // kv_heads
    for i, (q_len, ctx, w, s) in enumerate(seqs):
        n = ctx + q_len
        kc, vc = storage.gather(0, bt[i : i + 1])
        keys = kc[0, :, :n].float().repeat_interleave(g, 0)  # [H, n, D]
        vals = vc[0, :, :n].float().repeat_interleave(g, 0)
        for j in range(q_len):
            c, r = ctx + j, starts[i] + j
            t = torch.arange(n)
            in_window = (t <= c) & ((t > c - w) if w else True)
            sink = (t < s) & (t <= c - w) if s else torch.zeros(n, dtype=torch.bool)
            qq = torch.where(sink[None, :, None], q_back[r].float()[:, None], q[r].float()[:, None])
            scores = (qq * keys).sum(-1) * d**-0.5  # [H, n]
            scores = scores.masked_fill(~(in_window | sink)[None], float("-inf"))
            ref = torch.einsum("hn,hnd->hd", scores.softmax(-1), vals)
            bf16 = qdt == torch.bfloat16
            tol = {"atol": 2e-2, "rtol": 2e-2} if bf16 else {"atol": 2e-5, "rtol": 1e-4}
            torch.testing.assert_close(out[r].float(), ref, **tol)


def test_the_environment_switches_every_kernel_off_at_start():
    """``KVSERVE_DISABLE_KERNELS=1`` in a new process: every native library reports none (the
    engine then runs the references); without it they load as they do here."""
    probe = (
        "from kvserve import kernels\n"
        "from kvserve.kernels import amx, pointwise, prefill, quant\n"
        "libs = [kernels._LIB, amx._LIB512, pointwise._LIB, prefill._LIB, quant._LIB]\n"
        "print(kernels.DISABLED, [lib.get() is not None for lib in libs])\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "KVSERVE_DISABLE_KERNELS"}
    outs = []
    for extra in ({"KVSERVE_DISABLE_KERNELS": "1"}, {}):
        run = subprocess.run([sys.executable, "-c", probe], env={**env, **extra},
                             capture_output=True, text=True, check=True)  # fmt: skip
        outs.append(run.stdout.strip())
    here = [lib.get() is not None for lib in (kernels._LIB, amx._LIB512, pointwise._LIB,
                                               prefill._LIB, quant._LIB)]  # fmt: skip
    assert here[0], "this file runs only where the kernels build"
    assert outs == [f"True {[False] * 5}", f"False {here}"]


def test_switching_kernels_off_in_process_makes_the_wrappers_decline(monkeypatch):
    """``kernels.DISABLED`` set in a running process: the next call of each wrapper declines
    (its caller then runs the reference), and setting it back restores the kernels."""
    x = torch.randn(3, 64)
    w = torch.randn(64)
    assert pointwise.rms_norm(x, w, 1e-6) is not None
    monkeypatch.setattr(kernels, "DISABLED", True)
    assert not kernels.native_available()
    assert pointwise.rms_norm(x, w, 1e-6) is None
    q, k = torch.randn(2, 4, 16), torch.randn(2, 2, 16)
    cos, sin = torch.ones(8, 16), torch.zeros(8, 16)
    assert not pointwise.rotary_(torch.tensor([0, 1]), q, k, cos, sin)
    monkeypatch.setattr(kernels, "DISABLED", False)
    assert kernels.native_available()


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.randn(4, 8),
        lambda: torch.randn(4, 8).t(),
        lambda: torch.randn(8, 6)[:, :4],  # rows apart, values packed
        lambda: torch.randn(1, 8)[:, ::2],
        lambda: torch.randn(4, 3, 8),
        lambda: torch.randn(4, 3, 8).transpose(0, 1),
        lambda: torch.randn(4, 3, 8)[:, :, :4],
        lambda: torch.randn(4, 3, 8)[::2],
        lambda: torch.randn(4, 40)[:, 8:32].view(4, 3, 8),  # a fused QKV output's K
        lambda: torch.randn(3, 1, 8).expand(3, 2, 8),
        lambda: torch.randn(5),
        lambda: torch.randn(2, 2, 2, 2),
        lambda: torch.randn(4, 8).half(),
    ],
)
def test_packed_rows_against_a_naive_definition(make):
    """Rows of the flat batch may sit anywhere (not overlapping); inside a row, the values are
    one run: checked here by the addresses themselves."""
    x = make()
    dtypes = {torch.float32: 0, torch.bfloat16: 1}
    if x.dtype not in dtypes or x.dim() not in (2, 3):
        expected = False
    else:
        inner = x[0].numel()
        e = x.element_size()
        offsets = sorted(
            (x[(0, *idx)].data_ptr() - x.data_ptr()) // e
            for idx in torch.cartesian_prod(*[torch.arange(n) for n in x.shape[1:]])
            .view(-1, x.dim() - 1)
            .tolist()
        )
        expected = offsets == list(range(inner)) and x.stride(0) >= inner
    assert kernels.packed_rows(x, dtypes) == expected


@pytest.mark.parametrize("q_len", [1, 3])
def test_a_table_narrower_than_the_context_is_refused_before_any_read(q_len):
    """A sequence whose keys run past its block table would read past the table's row (a
    neighbour's blocks, or past the tensor): the kernel refuses the call, naming the table."""
    bs, d = 4, 16
    storage = DenseKVStorage(1, 8, bs, 2, d, torch.float32)
    group = SimpleNamespace(
        num_rows=q_len, q_start=torch.tensor([0]), q_len=torch.tensor([q_len]),
        ctx_len=torch.tensor([2 * bs - q_len + 1]),  # one key past the table's two blocks
        block_tables=torch.tensor([[1, 2]]), windows=None,
    )  # fmt: skip
    q = torch.randn(q_len, 4, d)
    with pytest.raises(RuntimeError, match="passes its block table's 2 blocks of 4"):
        kernels.paged_attention(q, storage.k[0], storage.v[0], group, None, torch.empty_like(q))
    group.ctx_len = torch.tensor([2 * bs - q_len])  # exactly full: fine
    kernels.paged_attention(q, storage.k[0], storage.v[0], group, None, torch.empty_like(q))
