"""The parallel linear modules sharded over 2 and 4 ranks in one process: the ranks' results,
combined as the collectives combine them, equal the unsharded layer's formula (``F.linear``
and friends on the whole checkpoint tensors), on the reference backend in float64 and on
the fast backends this CPU selects; and a whole model split over ranks gives transformers'
logits.

Each rank runs in its own thread with a fake communicator: a collective waits for every
rank's tensor, then returns their sum (in rank order) or their concatenation. No process
group is involved."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from kvserve.config import ConfigError, ModelConfig
from kvserve.model.layers import (
    MLP,
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    TensorParallelGroup,
    VocabParallelEmbedding,
    set_linear_ops,
)
from kvserve.model.linear_ops import TorchOps, select_ops
from kvserve.model.llama import RMSNorm


class FakeGroup:
    """``world_size`` ranks' communicators over shared memory and a barrier."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.barrier = threading.Barrier(world_size, timeout=60)
        self.slots: list[Any] = [None] * world_size

    def rank(self, r: int) -> TensorParallelGroup:
        return TensorParallelGroup(r, self.world_size, _FakeCommunicator(self, r))

    def exchange(self, r: int, x: torch.Tensor) -> list[torch.Tensor]:
        self.slots[r] = x
        self.barrier.wait()
        xs = list(self.slots)
        self.barrier.wait()  # every rank has read the slots before any writes them again
        return xs


class _FakeCommunicator:
    def __init__(self, group: FakeGroup, rank: int) -> None:
        self.group, self.r = group, rank

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        xs = self.group.exchange(self.r, x)
        out = xs[0].clone()
        for t in xs[1:]:
            out += t
        return out

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return torch.cat(self.group.exchange(self.r, x), dim)


def run_ranks(world_size: int, fn: Callable[[TensorParallelGroup], Any]) -> list[Any]:
    """``fn(group)`` on every rank at once, each in a thread; the results in rank order."""
    group = FakeGroup(world_size)
    results: list[Any] = [None] * world_size
    errors: list[BaseException] = []

    def run(r: int) -> None:
        try:
            with torch.inference_mode():
                results[r] = fn(group.rank(r))
        except BaseException as e:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(e)
            group.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


# The backends: the reference in float64, so that only the sums' order differs from the
# formula; and what select_ops picks on this CPU for float32 and bfloat16 (oneDNN, kvserve's
# kernels), against the formula in float32 over the same (rounded) values.
BACKENDS = {
    "torch-float64": (lambda: TorchOps(), torch.float64, dict(atol=1e-12, rtol=1e-12)),
    "fast-float32": (
        lambda: select_ops(torch.device("cpu"), torch.float32),
        torch.float32,
        dict(atol=5e-6, rtol=5e-6),
    ),
    "fast-bfloat16": (
        lambda: select_ops(torch.device("cpu"), torch.bfloat16),
        torch.bfloat16,
        dict(atol=3e-2, rtol=2e-2),
    ),
}
H, HEAD_DIM, NUM_HEADS, INTER, VOCAB, T = 64, 16, 8, 128, 90, 11


def _randn(*shape: int, seed: int, dtype: torch.dtype, std: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * std).to(dtype)


def _load(module: torch.nn.Module, *pieces: tuple[str, torch.Tensor, Any]) -> None:
    """Each (parameter name, whole checkpoint tensor, shard id) through its weight loader."""
    params = dict(module.named_parameters())
    for name, t, shard in pieces:
        params[name].weight_loader(params[name], t, shard)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm: normalized in float32, scaled in the input's dtype."""
    xf = x.float()
    return (w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)).double()


def _close(got: torch.Tensor, want: torch.Tensor, tol: dict) -> None:
    torch.testing.assert_close(got.double(), want.double(), **tol)


@pytest.fixture(params=list(BACKENDS))
def backend(request):
    make, dtype, tol = BACKENDS[request.param]
    return make, dtype, tol


def _adopt(make: Callable[[], TorchOps], module: torch.nn.Module) -> torch.nn.Module:
    set_linear_ops(module, make())
    return module


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("gather", [False, True])
def test_column_parallel(backend, world_size, gather):
    make, dtype, tol = backend
    w = _randn(96, H, seed=1, dtype=dtype, std=0.15)
    b = _randn(96, seed=2, dtype=dtype, std=0.1)
    x = _randn(T, H, seed=3, dtype=dtype)
    want = F.linear(x.double(), w.double(), b.double())

    def rank(tp: TensorParallelGroup) -> torch.Tensor:
        lin = ColumnParallelLinear(H, 96, bias=True, gather_output=gather, tp=tp,
                                   params_dtype=dtype)  # fmt: skip
        _load(lin, ("weight", w, None), ("bias", b, None))
        assert lin.weight.shape == (96 // world_size, H)
        return _adopt(make, lin)(x)

    outs = run_ranks(world_size, rank)
    if gather:  # every rank holds the whole output
        for out in outs:
            _close(out, want, tol)
    else:  # rank r the r-th slice of the outputs
        _close(torch.cat(outs, -1), want, tol)


@pytest.mark.parametrize("world_size", [2, 4])
def test_merged_gate_up(backend, world_size):
    """Each rank's product is its slice of the gate features, then its slice of the up ones
    (where the backend keeps them in one matrix; a packing one refuses the plain product),
    and its SwiGLU (what the MLP asks of it) the slice of ``silu(gate) * up``."""
    make, dtype, tol = backend
    wg = _randn(INTER, H, seed=4, dtype=dtype, std=0.15)
    wu = _randn(INTER, H, seed=5, dtype=dtype, std=0.15)
    x = _randn(T, H, seed=6, dtype=dtype)
    gate, up = F.linear(x.double(), wg.double()), F.linear(x.double(), wu.double())

    def rank(tp: TensorParallelGroup) -> tuple[torch.Tensor | None, torch.Tensor]:
        lin = MergedColumnParallelLinear(H, [INTER, INTER], tp=tp, params_dtype=dtype)
        _load(lin, ("weight", wg, 0), ("weight", wu, 1))
        _adopt(make, lin)
        if hasattr(lin, "up_weight"):
            with pytest.raises(RuntimeError, match="keeps the up projection apart"):
                lin(x)
            return None, lin.ops.swiglu(x, lin)
        return lin(x), lin.ops.swiglu(x, lin)

    results = run_ranks(world_size, rank)
    n = INTER // world_size
    outs = [o for o, _ in results]
    if outs[0] is not None:
        _close(torch.cat([o[:, :n] for o in outs], -1), gate, tol)
        _close(torch.cat([o[:, n:] for o in outs], -1), up, tol)
    _close(torch.cat([h for _, h in results], -1), F.silu(gate) * up, tol)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("num_kv_heads", [1, 2, 4, 8])
def test_qkv_split_by_head(backend, world_size, num_kv_heads):
    """Rank r holds query heads [r * n, (r + 1) * n) and the KV heads those read (the same
    heads on several ranks where the ranks outnumber them), each with its bias; the RMSNorm
    before it is applied (fused where the backend fuses it)."""
    make, dtype, tol = backend
    q, kv = NUM_HEADS * HEAD_DIM, num_kv_heads * HEAD_DIM
    wq, wk, wv = (
        _randn(n, H, seed=7 + i, dtype=dtype, std=0.15) for i, n in enumerate((q, kv, kv))
    )
    bq, bk, bv = (_randn(n, seed=10 + i, dtype=dtype, std=0.1) for i, n in enumerate((q, kv, kv)))
    x = _randn(T, H, seed=13, dtype=dtype)
    norm_w = 1 + _randn(H, seed=14, dtype=dtype, std=0.1)
    xn = _rms(x, norm_w, 1e-6)
    full = {s: F.linear(xn, w.double(), b.double()) for s, w, b in
            (("q", wq, bq), ("k", wk, bk), ("v", wv, bv))}  # fmt: skip

    def rank(tp: TensorParallelGroup) -> tuple[torch.Tensor, QKVParallelLinear]:
        lin = QKVParallelLinear(H, HEAD_DIM, NUM_HEADS, num_kv_heads, bias=True, tp=tp,
                                params_dtype=dtype)  # fmt: skip
        _load(lin, *[("weight", w, s) for s, w in (("q", wq), ("k", wk), ("v", wv))],
              *[("bias", b, s) for s, b in (("q", bq), ("k", bk), ("v", bv))])  # fmt: skip
        norm = RMSNorm(H, 1e-6, dtype)
        norm.weight.data.copy_(norm_w)
        return _adopt(make, lin)(x, norm=norm), lin

    results = run_ranks(world_size, rank)
    qs = []
    for r, (out, lin) in enumerate(results):
        assert lin.num_heads == NUM_HEADS // world_size
        assert lin.num_kv_heads == max(1, num_kv_heads // world_size)
        oq, ok, ov = out.split([lin.q_size, lin.kv_size, lin.kv_size], -1)
        qs.append(oq)
        # the KV heads this rank's query heads read: query head j reads KV head j // group
        first_q = r * lin.num_heads
        first_kv = first_q // (NUM_HEADS // num_kv_heads)
        cols = slice(first_kv * HEAD_DIM, (first_kv + lin.num_kv_heads) * HEAD_DIM)
        _close(ok, full["k"][:, cols], tol)
        _close(ov, full["v"][:, cols], tol)
    _close(torch.cat(qs, -1), full["q"], tol)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("with_residual", [False, True])
def test_row_parallel_all_reduces_then_adds(backend, world_size, bias, with_residual):
    """Each rank multiplies its slice of the inputs; the sum over ranks plus the bias (once)
    plus the residual is the whole product's."""
    make, dtype, tol = backend
    w = _randn(H, INTER, seed=15, dtype=dtype, std=0.1)
    b = _randn(H, seed=16, dtype=dtype, std=0.1)
    x = _randn(T, INTER, seed=17, dtype=dtype)
    res = _randn(T, H, seed=18, dtype=dtype) if with_residual else None
    want = F.linear(x.double(), w.double(), b.double() if bias else None)
    if res is not None:
        want = want + res.double()
    n = INTER // world_size

    def rank(tp: TensorParallelGroup) -> torch.Tensor:
        lin = RowParallelLinear(INTER, H, bias=bias, tp=tp, params_dtype=dtype)
        assert not lin.fuse_residual  # an all-reduce stands between product and add
        _load(lin, ("weight", w, None), *([("bias", b, None)] if bias else []))
        return _adopt(make, lin)(x[:, tp.rank * n : (tp.rank + 1) * n], residual=res)

    for out in run_ranks(world_size, rank):
        _close(out, want, tol)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("norm_and_residual", [False, True])
def test_mlp(backend, world_size, norm_and_residual):
    """SwiGLU with gate/up split by columns and down by rows: ``residual +
    down(silu(gate(norm(x))) * up(norm(x)))`` after the all-reduce of down's partial sums."""
    make, dtype, tol = backend
    wg = _randn(INTER, H, seed=19, dtype=dtype, std=0.15)
    wu = _randn(INTER, H, seed=20, dtype=dtype, std=0.15)
    wd = _randn(H, INTER, seed=21, dtype=dtype, std=0.1)
    norm_w = 1 + _randn(H, seed=22, dtype=dtype, std=0.1)
    x = _randn(T, H, seed=23, dtype=dtype)
    xin = _rms(x, norm_w, 1e-5) if norm_and_residual else x.double()
    want = F.linear(F.silu(F.linear(xin, wg.double())) * F.linear(xin, wu.double()), wd.double())
    if norm_and_residual:
        want = want + x.double()

    def rank(tp: TensorParallelGroup) -> torch.Tensor:
        mlp = MLP(H, INTER, tp=tp, params_dtype=dtype)
        assert not mlp.fuse_residual
        _load(mlp, ("gate_up_proj.weight", wg, 0), ("gate_up_proj.weight", wu, 1),
              ("down_proj.weight", wd, None))  # fmt: skip
        _adopt(make, mlp)
        if not norm_and_residual:
            return mlp(x)
        norm = RMSNorm(H, 1e-5, dtype)
        norm.weight.data.copy_(norm_w)
        return mlp(x, norm=norm, residual=x)

    for out in run_ranks(world_size, rank):
        _close(out, want, tol)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("padding_size", [1, 8])
def test_vocab_parallel_embedding_and_head(backend, world_size, padding_size):
    """The table split by vocabulary rows, padded to equal shards (VOCAB = 90 rows does not
    divide by 4, nor by 16 or 32): every token's embedding, the whole vocabulary's float32
    logits with the padding cut off, and the exact logits of chosen tokens from the float32
    head kept beside the model, each gathered or summed over the ranks."""
    make, dtype, tol = backend
    table = _randn(VOCAB, H, seed=24, dtype=torch.float32, std=0.15)
    ids = torch.randint(0, VOCAB, (T,), generator=torch.Generator().manual_seed(25))
    hidden = _randn(T, H, seed=26, dtype=dtype)
    token_ids = torch.randint(0, VOCAB, (T, 3), generator=torch.Generator().manual_seed(27))
    w = table.to(dtype).double()

    def rank(tp: TensorParallelGroup) -> tuple[torch.Tensor, ...]:
        embed = VocabParallelEmbedding(VOCAB, H, tp=tp, params_dtype=dtype,
                                       padding_size=padding_size)  # fmt: skip
        head = ParallelLMHead(VOCAB, H, tp=tp, params_dtype=dtype, padding_size=padding_size)
        assert embed.rows * world_size == embed.num_embeddings_padded >= VOCAB
        assert embed.rows % padding_size == 0
        _load(embed, ("weight", table, None))
        _load(head, ("weight", table, None))
        head.keep_float32(table)
        _adopt(make, head)
        return embed(ids), head(hidden), head.exact_logits(hidden, token_ids)

    for emb, logits, exact in run_ranks(world_size, rank):
        assert emb.dtype == dtype and torch.equal(emb, table.to(dtype)[ids])  # exact rows
        assert logits.shape == (T, VOCAB) and logits.dtype == torch.float32
        # float32 logits: at best the formula rounded to float32
        _close(logits, F.linear(hidden.double(), w), {k: max(v, 2e-6) for k, v in tol.items()})
        want = torch.einsum("nkh,nh->nk", table.double()[token_ids], hidden.double())
        _close(exact, want, dict(atol=1e-5, rtol=1e-5))


def test_world_size_one_fuses_the_residual_and_pads_nothing():
    """With one rank nothing stands between the product and the residual add, so the backend
    fuses it, and the vocabulary keeps the checkpoint's rows."""
    row = RowParallelLinear(INTER, H)
    assert row.fuse_residual and not RowParallelLinear(INTER, H, bias=True).fuse_residual
    assert MLP(H, INTER).fuse_residual
    embed = VocabParallelEmbedding(VOCAB, H)
    assert embed.weight.shape == (VOCAB, H)
    assert not ColumnParallelLinear(H, 96, gather_output=True).gather_output


@pytest.mark.parametrize(
    ("heads", "kv_heads", "world_size", "message"),
    [
        (6, 2, 4, "num_attention_heads: 6 is not divisible by tensor_parallel_size 4"),
        (8, 3, 2, "num_key_value_heads: 3 is not divisible by tensor_parallel_size 2"),
        (12, 4, 6, "tensor_parallel_size: 6 is not a multiple of num_key_value_heads 4"),
    ],
)
def test_heads_that_do_not_split_are_refused_by_name(heads, kv_heads, world_size, message):
    group = FakeGroup(world_size)
    with pytest.raises(ConfigError, match=message):
        QKVParallelLinear(H, HEAD_DIM, heads, kv_heads, tp=group.rank(0))


def test_group_is_checked():
    with pytest.raises(ConfigError, match=r"tensor parallel rank: must be in \[0, 2\), got 2"):
        TensorParallelGroup(2, 2, _FakeCommunicator(FakeGroup(2), 2))
    with pytest.raises(ConfigError, match="tensor_parallel_size 2: the ranks need a communicator"):
        TensorParallelGroup(0, 2)
    with pytest.raises(ConfigError, match="tensor_parallel_size: must be >= 1, got 0"):
        TensorParallelGroup(0, 0)


transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize(
    ("name", "overrides", "world_size"),
    [
        ("llama_gqa", {}, 2),  # 2 KV heads: one per rank
        ("llama_mqa", {}, 2),  # 1 KV head, replicated
        ("qwen2", {}, 2),  # QKV bias
        ("llama_mha", {"vocab_size": 322}, 4),  # tied head, vocabulary padded to 4 equal shards
    ],
)
def test_sharded_model_matches_transformers(checkpoint, name, overrides, world_size):
    """The whole model loaded as ``world_size`` ranks (each with its KV heads' cache), a
    prompt then one decode step: the float32 logits every rank computes match transformers'
    on the checkpoint within the unsharded model's tolerance (tests/test_logits.py)."""
    from kvserve.attention.metadata import AttentionMetadata, PrefillChunk
    from kvserve.kv.storage import DenseKVStorage
    from kvserve.model.loader import load_model

    path = checkpoint(name, **overrides)
    cfg = ModelConfig.from_pretrained(path)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, cfg.vocab_size, (40,), generator=g).tolist()
    n, bs = len(ids) - 1, 16
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0]

    def rank(tp: TensorParallelGroup) -> torch.Tensor:
        model = load_model(path, cfg, torch.float32, torch.device("cpu"), 64, tp=tp)
        layer = model.layers[0]
        assert layer.num_heads * world_size == cfg.num_attention_heads
        storage = DenseKVStorage(len(model.layers), 8, bs, layer.num_kv_heads, cfg.head_dim,
                                 torch.float32)  # fmt: skip
        prefill = AttentionMetadata(slot_mapping=torch.arange(n), block_size=bs,
                                    prefills=[PrefillChunk(0, n, 0, None)])  # fmt: skip
        decode = AttentionMetadata(slot_mapping=torch.tensor([n]), block_size=bs, num_decode=1,
                                   decode_block_tables=torch.arange(8)[None, : n // bs + 1],
                                   decode_seq_lens=torch.tensor([n + 1]))  # fmt: skip
        with torch.inference_mode():
            first = model.logits(model(torch.tensor(ids[:n]), torch.arange(n), storage, prefill))
            last = model.logits(model(torch.tensor(ids[n:]), torch.tensor([n]), storage, decode))
        return torch.cat([first, last])

    for got in run_ranks(world_size, rank):
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", ["llama_gqa", "llama_mha"])  # its own head; tied to the table
def test_bf16_model_keeps_the_float32_head_for_exact_logits(checkpoint, name):
    """Below float32 the LM head keeps the checkpoint's head (or embedding table, when tied)
    in float32, and the exact logits of chosen tokens are the float32 dot products with it."""
    from safetensors.torch import load_file

    from kvserve.model.loader import load_model

    path = checkpoint(name)
    cfg = ModelConfig.from_pretrained(path)
    tensors = load_file(f"{path}/model.safetensors")
    head = tensors["model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"]
    assert load_model(path, cfg, torch.float32, torch.device("cpu"), 64).lm_head_fp32 is None
    model = load_model(path, cfg, torch.bfloat16, torch.device("cpu"), 64)
    assert torch.equal(model.lm_head_fp32, head.float())
    hidden = _randn(5, cfg.hidden_size, seed=28, dtype=torch.bfloat16)
    ids = torch.randint(0, cfg.vocab_size, (5, 4), generator=torch.Generator().manual_seed(29))
    want = torch.einsum("nkh,nh->nk", head.double()[ids], hidden.double())
    torch.testing.assert_close(model.exact_logits(hidden, ids).double(), want, atol=1e-5, rtol=1e-5)
