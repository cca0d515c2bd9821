"""Every attention backend against the torch backend, per KV format and retention policy, with
the tolerance of each pair in one table (:data:`TOLERANCES`); the torch backend itself against
naive float64 attention of the same stored K/V; greedy tokens of the bundled model through
each backend; the registry, the config field and the flag.

Attention level: one layer's q/k/v through :class:`~kvserve.attention.layer.Attention` over a
paged storage, two steps as the runner builds them (its ``_prepare``, which asks the backend
which rows its fused kernel serves): first the prompts of four sequences of different lengths,
then, in one batch, two decode rows, a short chunk and a long chunk over cached context and a
fresh prompt. Each backend runs on its own storage fed the same K/V, so both read the same
stored codes. Retention: none, a sliding window of the layer, a request's window, StreamingLLM
(sinks + window), SnapKV (compactions in both steps, a decode over compacted blocks) and H2O
(mass from every row, a compaction in the second step); KIVI, which cannot move single cache
entries, has no SnapKV or H2O.

End to end the float32 greedy tokens must be identical (the same formula summed in another
order moves logits by float32 rounding, far below the bundled model's top-two gaps). Lossy
formats are not required to give identical tokens through both backends: each backend's
rounding of the decoded values is within the format's own error, and a near tie may go
either way; their attention-level outputs are held to the table.
"""

from __future__ import annotations

import argparse
import math
from types import SimpleNamespace
from typing import NamedTuple

import pytest
import torch

from kvserve import kernels
from kvserve.attention.layer import Attention
from kvserve.attention.registry import (
    ATTENTION_BACKEND_CHOICES,
    ATTENTION_BACKENDS,
    make_backend,
    resolve_backend,
)
from kvserve.config import ConfigError, EngineConfig, ModelConfig
from kvserve.engine_args import add_engine_args, engine_kwargs
from kvserve.kv.formats import make_kv_storage
from kvserve.llm import engine_config
from kvserve.model.llama import RotaryEmbedding
from kvserve.model.resolve import resolve_model
from kvserve.sched.output import ScheduledSeq
from kvserve.worker.model_runner import ModelRunner

CPU = torch.device("cpu")


class Tol(NamedTuple):
    out: tuple[float, float]  # (atol, rtol) of the attention output
    mass: tuple[float, float]  # (atol, rtol) of H2O's attention mass per cache entry


_F32 = Tol((1e-5, 1e-5), (1e-5, 1e-5))
# (backend, KV format) -> tolerance. "torch" is held to naive float64 attention of the same
# decoded K/V; every other backend to the torch backend.
TOLERANCES: dict[tuple[str, str], Tol] = {
    # SDPA / einsum in float32 over at most ~100 keys: float32 rounding of the sums.
    ("torch", "float32"): _F32,
    # Float32 math, the output rounded once to bf16 (2^-8 relative, ~1e-2 on values ~2).
    ("torch", "bfloat16"): Tol((1.6e-2, 1.6e-2), (1e-5, 1e-5)),
    # The decoded values (a format's own error is the storage's business) in float32.
    ("torch", "fp8_e4m3"): _F32,
    ("torch", "fp8_e5m2"): _F32,
    ("torch", "int8"): _F32,
    ("torch", "kivi4"): _F32,
    ("torch", "kivi2"): _F32,
    # Same formula, the kernels' own summation order and vectorised exp: float32 rounding;
    # H2O's mass sums probabilities over queries and heads in the kernel's order.
    ("cpu", "float32"): Tol((2e-5, 1e-4), (3e-4, 3e-3)),
    # Both round the output to bf16, from float32 sums in different orders (and the CPU's
    # bf16 dot products where it has them): up to about one bf16 rounding apart.
    ("cpu", "bfloat16"): Tol((1.6e-2, 1.6e-2), (3e-4, 3e-3)),
    # The same decoded values (codes x scale in float32, a lookup table in the kernel), the
    # kernel's summation order: float32 rounding.
    ("cpu", "fp8_e4m3"): Tol((1e-4, 1e-4), (1e-5, 1e-5)),
    ("cpu", "fp8_e5m2"): Tol((1e-4, 1e-4), (1e-5, 1e-5)),
    ("cpu", "int8"): Tol((1e-4, 1e-4), (1e-5, 1e-5)),
    # Also: the kernel rotates the query into the keys' Hadamard basis where the reference
    # rotates the decoded keys back, a 64-term product each way.
    ("cpu", "kivi4"): Tol((1e-4, 1e-4), (1e-5, 1e-5)),
    ("cpu", "kivi2"): Tol((1e-4, 1e-4), (1e-5, 1e-5)),
    # Triton (under the interpreter on a CPU: float32 products throughout): the same decoded
    # values in another summation order, KIVI's query rotated into the keys' basis. bfloat16:
    # vLLM's kernel tests' tolerance, one bf16 rounding of the output. H2O's mass (dense
    # formats) sums probabilities over queries and heads in the kernel's order.
    ("triton", "float32"): Tol((2e-5, 1e-4), (3e-4, 3e-3)),
    ("triton", "bfloat16"): Tol((1.5e-2, 1e-2), (3e-4, 3e-3)),
    ("triton", "fp8_e4m3"): Tol((1e-4, 1e-4), (1e-5, 1e-5)),
    ("triton", "fp8_e5m2"): Tol((1e-4, 1e-4), (1e-5, 1e-5)),
    ("triton", "int8"): Tol((1e-4, 1e-4), (1e-5, 1e-5)),
    ("triton", "kivi4"): Tol((1e-4, 1e-4), (1e-5, 1e-5)),
    ("triton", "kivi2"): Tol((1e-4, 1e-4), (1e-5, 1e-5)),
}
FORMATS = ["float32", "bfloat16", "fp8_e4m3", "fp8_e5m2", "int8", "kivi4", "kivi2"]
RETENTION = ["none", "layer_window", "window", "sinks", "snapkv", "h2o"]
BS, HEADS, KV_HEADS, D, POOL = 8, 4, 2, 64, 64
ROPE_THETA = 10000.0


def compute_dtype(fmt: str) -> torch.dtype:
    return torch.bfloat16 if fmt == "bfloat16" else torch.float32


# -- the two steps -------------------------------------------------------------------------------
def plan(mode: str) -> list[list[ScheduledSeq]]:
    """Two steps of ScheduledSeqs (block tables drawn from a shuffled pool): A, B, C, D
    prefill 13, 29, 20 and 9 tokens; then A and B decode, C continues with 7 tokens, D with
    70 and E prefills 33. ``mode`` adds the retention fields (SnapKV: A compacts at the end
    of its prompt and decodes from its compacted blocks, C compacts with its last chunk;
    H2O: every sequence keeps its mass and B compacts as it decodes)."""
    free = torch.randperm(POOL, generator=torch.Generator().manual_seed(11)).tolist()

    def take(n: int) -> list[int]:
        return [free.pop() for _ in range(-(-n // BS))]

    prompt = {"A": 13, "B": 29, "C": 20, "D": 9}
    more = {"A": 1, "B": 1, "C": 7, "D": 70, "E": 33}
    tables = {r: take(prompt.get(r, 0) + n) for r, n in more.items()}
    extra: dict[str, object] = {}
    if mode == "window":
        extra = {"window": 12}
    elif mode == "sinks":
        extra = {"window": 12, "sinks": 4}
    elif mode == "h2o":
        extra = {"observe": True}

    def seq(rid: str, start: int, n: int, table: list[int], **kw: object) -> ScheduledSeq:
        return ScheduledSeq(rid, [0] * n, start, start, table, **{**extra, **kw})

    step1 = [seq(r, 0, n, tables[r]) for r, n in prompt.items()]
    step2 = [seq(r, prompt.get(r, 0), n, tables[r]) for r, n in more.items()]
    if mode == "snapkv":  # budget 4 + observation window 4, pooled over 3 keys: 8 entries
        step1[0] = seq("A", 0, 13, tables["A"], compact=("snapkv", 4, 4, 3),
                       compact_block_ids=take(8))  # fmt: skip
        step2[0] = seq("A", 8, 1, [*step1[0].compact_block_ids, *take(1)])
        step2[2] = seq("C", 20, 7, tables["C"], compact=("snapkv", 4, 4, 3),
                       compact_block_ids=take(8))  # fmt: skip
    if mode == "h2o":  # B keeps 16 of its 30 entries, the 4 newest among them
        step2[1] = seq("B", 29, 1, tables["B"], compact=("h2o", 16, 4, 0),
                       compact_block_ids=take(16))  # fmt: skip
    return [step1, step2]


class NoModel:
    """What the runner's batch building reads of a model."""

    config = SimpleNamespace(num_hidden_layers=1)

    def set_attention_backend(self, backend: object) -> None:
        pass


def rotary() -> RotaryEmbedding:
    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=8, hidden_size=HEADS * D,
                      intermediate_size=8, num_hidden_layers=1, num_attention_heads=HEADS,
                      num_key_value_heads=KV_HEADS, head_dim=D, rms_norm_eps=1e-5,
                      max_position_embeddings=256, rope_theta=ROPE_THETA)  # fmt: skip
    return RotaryEmbedding(cfg, 256, CPU)


def run(backend: str, fmt: str, mode: str) -> SimpleNamespace:
    """Both steps through ``backend``: per step the runner's metadata, the items in batch
    order, the inputs and the output; the storage and the runner (its H2O mass) after."""
    storage = make_kv_storage(fmt, 1, POOL, BS, KV_HEADS, D, compute_dtype(fmt))
    attention = make_backend(backend, CPU)
    runner = ModelRunner(NoModel(), storage, None, CPU, attention=attention)  # type: ignore[arg-type]
    layer = Attention(attention, 10 if mode == "layer_window" else None)
    rot, steps = rotary(), []
    g = torch.Generator().manual_seed(5)
    for seqs in plan(mode):
        items = runner._order(seqs)
        _, _, meta = runner._prepare(items)
        meta.rotary = rot
        t = sum(s.num_tokens for s in items)
        dt = compute_dtype(fmt)
        q = torch.randn(t, HEADS, D, generator=g).to(dt)
        k = (torch.randn(t, KV_HEADS, D, generator=g) * 2 + 0.5).to(dt)
        v = torch.randn(t, KV_HEADS, D, generator=g).to(dt)
        storage.begin_step(meta.slot_mapping)
        out = layer(q, k, v, 0, storage, meta)
        steps.append(SimpleNamespace(items=items, meta=meta, q=q, k=k, v=v, out=out))
    return SimpleNamespace(steps=steps, storage=storage, runner=runner)


def cases() -> list:
    return [pytest.param(f, m, id=f"{f}-{m}") for f in FORMATS for m in RETENTION
            if not (f.startswith("kivi") and m in ("snapkv", "h2o"))]  # fmt: skip


def rows_of(step: SimpleNamespace) -> dict[str, slice]:
    out, at = {}, 0
    for s in step.items:
        out[s.req_id] = slice(at, at + s.num_tokens)
        at += s.num_tokens
    return out


def compacted(r: SimpleNamespace) -> list[torch.Tensor]:
    """The K/V each compaction copied into its fresh blocks (as the storage decodes them)."""
    got = []
    for step in r.steps:
        for s in step.items:
            if s.compact:
                k, v = r.storage.gather(0, torch.tensor([s.compact_block_ids]))
                got += [k.float(), v.float()]
    return got


# -- every backend against the torch backend -------------------------------------------------
# Triton's kernels run in its interpreter here (slow): one format of each kind without
# retention, windows, StreamingLLM's sinks and H2O's mass in the dense group;
# tests/test_triton_attention.py covers every format, block sizes, head groupings, split-KV.
TRITON_CASES = {(f, "none") for f in ("float32", "bfloat16", "fp8_e4m3", "int8", "kivi4")} | {
    ("float32", "window"), ("kivi2", "window"), ("float32", "sinks"), ("float32", "h2o"),
    ("bfloat16", "sinks"),
}  # fmt: skip


def backend_cases() -> list:
    return [pytest.param(b, *c.values, id=f"{b}-{c.id}")
            for b in ATTENTION_BACKENDS if b != "torch"
            for c in cases() if b != "triton" or tuple(c.values) in TRITON_CASES]  # fmt: skip


@pytest.mark.parametrize("backend, fmt, mode", backend_cases())
def test_backend_matches_the_torch_backend(backend, fmt, mode):
    """Outputs of every row of both steps within the pair's tolerance; SnapKV's and H2O's
    compacted blocks equal (the same entries chosen, their codes copied bit for bit); H2O's
    mass within the pair's tolerance."""
    want, got = run("torch", fmt, mode), run(backend, fmt, mode)
    tol = TOLERANCES[(backend, fmt)]
    for w, o in zip(want.steps, got.steps, strict=True):
        assert not o.out.isnan().any()
        torch.testing.assert_close(o.out.float(), w.out.float(), atol=tol.out[0],
                                   rtol=tol.out[1])  # fmt: skip
    for a, b in zip(compacted(want), compacted(got), strict=True):
        assert torch.equal(a, b)
    assert want.runner.mass.keys() == got.runner.mass.keys()
    for rid, mass in want.runner.mass.items():
        torch.testing.assert_close(got.runner.mass[rid][0], mass[0], atol=tol.mass[0],
                                   rtol=tol.mass[1])  # fmt: skip


def test_the_cpu_backend_serves_what_the_reference_would_otherwise():
    """Where it matters that the comparison above runs kernels: where they build, the CPU
    backend takes decode rows of every format and the fused group (with retention) of the
    dense ones; it declines a storage wrapper, which only ``gather`` reads, and everything
    where the kernels are off."""
    from kvserve.attention.cpu_backend import CpuBackend
    from kvserve.kv.storage import KVStorageWrapper

    cpu, built = CpuBackend(), kernels.native_available()
    for fmt in FORMATS:
        st = make_kv_storage(fmt, 1, POOL, BS, KV_HEADS, D, compute_dtype(fmt))
        q = torch.randn(2, HEADS, D).to(compute_dtype(fmt))
        tables, lens = torch.tensor([[0, 1], [2, 3]]), torch.tensor([9, 16])
        slots = torch.cat([torch.arange(9), 16 + torch.arange(16)])
        st.begin_step(slots)
        st.write(0, slots, torch.randn(25, KV_HEADS, D), torch.randn(25, KV_HEADS, D))
        assert (cpu.decode(0, q, st, tables, lens, None, None) is not None) == built, fmt
        assert cpu.serves_retention(st) == (built and fmt in ("float32", "bfloat16")), fmt
        wrapped = KVStorageWrapper(st)
        assert cpu.decode(0, q, wrapped, tables, lens, None, None) is None
        assert not cpu.serves_retention(wrapped)


# -- the torch backend against naive attention -------------------------------------------------
def naive_rotate_back(q: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """RoPE (rotate-half pairs (i, i + D/2) as complex numbers) by -shift positions."""
    half = D // 2
    freq = ROPE_THETA ** (-torch.arange(half, dtype=torch.float64) * 2 / D)
    turn = torch.polar(torch.ones(len(shift), half, dtype=torch.float64),
                       -shift.double()[:, None] * freq[None])  # fmt: skip
    z = torch.complex(q[..., :half], q[..., half:]) * turn[:, None, :]
    return torch.cat([z.real, z.imag], dim=-1)


def naive(q, keys, vals, c0: int, window: int, sinks: int):  # noqa: ANN001, ANN201
    """float64 attention of queries at cache entries c0, c0+1, ... over entries [S, KVH, D]:
    each sees (c - w, c] (w = 0: [0, c]) and, with sinks, the first ``sinks`` entries before
    its window, scored with the query rotated back by max(0, c - sinks - w + 1). Returns the
    output [n, H, D] and each entry's probability summed over queries and each KV head's
    query heads [KVH, S]."""
    n, s, g = q.shape[0], keys.shape[0], HEADS // KV_HEADS
    c = torch.arange(c0, c0 + n)[:, None]
    t = torch.arange(s)[None, :]
    window_keys = (t <= c) & ((t > c - window) if window else True)
    sink_keys = (t < sinks) & (t <= c - window) if sinks else torch.zeros_like(window_keys)
    kr = keys.double().repeat_interleave(g, 1)
    qd = q.double()
    scores = torch.einsum("nhd,shd->hns", qd, kr) / math.sqrt(D)
    if sinks:
        back = naive_rotate_back(qd, (c[:, 0] - sinks - window + 1).clamp(min=0))
        sink_scores = torch.einsum("nhd,shd->hns", back, kr) / math.sqrt(D)
        scores = torch.where(sink_keys[None], sink_scores, scores)
    probs = scores.masked_fill(~(window_keys | sink_keys)[None], -math.inf).softmax(-1)
    out = torch.einsum("hns,shd->nhd", probs, vals.double().repeat_interleave(g, 1))
    return out, probs.view(KV_HEADS, g, n, s).sum(dim=(1, 2))


@pytest.mark.parametrize("fmt, mode", cases())
def test_torch_backend_matches_naive_attention(fmt, mode):
    """Each sequence's rows of both steps against :func:`naive` over its cache entries as the
    storage decodes them, the chunk's own entries from its fresh K/V (decode rows read their
    new token back from the cache); H2O's mass of the sequences that do not compact, and the
    entries SnapKV and H2O keep against the naive scores."""
    r = run("torch", fmt, mode)
    tol = TOLERANCES[("torch", fmt)]
    layer_window = 10 if mode == "layer_window" else 0
    mass: dict[str, torch.Tensor] = {}
    for step in r.steps:
        rows, meta = rows_of(step), step.meta
        observed = set() if meta.observed is None else set(meta.observed.rows.tolist())
        for s in step.items:
            sl, c, n = rows[s.req_id], s.num_cached, s.num_tokens
            kc, vc = r.storage.gather(0, torch.tensor([s.block_ids]))
            cached = kc[0, :, : c + n].transpose(0, 1)
            keys, vals = cached, vc[0, :, : c + n].transpose(0, 1)
            from_cache = sl.start < meta.num_decode or sl.start in observed
            if not from_cache:  # a chunk attends to its own fresh K/V
                keys, vals = keys.clone(), vals.clone()
                keys[c:], vals[c:] = step.k[sl], step.v[sl]
            window = (
                min(w for w in (layer_window, s.window) if w) if layer_window or s.window else 0
            )
            out, probs = naive(step.q[sl], keys, vals, c, window, s.sinks)
            torch.testing.assert_close(step.out[sl].double(), out, atol=tol.out[0],
                                       rtol=tol.out[1], check_dtype=False)  # fmt: skip
            if s.observe:
                prev = mass.get(s.req_id, torch.zeros(KV_HEADS, 0, dtype=torch.float64))
                mass[s.req_id] = torch.cat([prev, torch.zeros(KV_HEADS, n, dtype=torch.float64)], 1)
                mass[s.req_id] += probs
            if s.compact:
                check_compaction(r, s, step.q[sl], keys, cached, mass.get(s.req_id))
    for rid, m in mass.items():
        if not any(s.compact for st in r.steps for s in st.items if s.req_id == rid):
            torch.testing.assert_close(r.runner.mass[rid][0].double(), m, atol=tol.mass[0],
                                       rtol=tol.mass[1])  # fmt: skip


def check_compaction(r, s: ScheduledSeq, q, keys, cached, mass) -> None:  # noqa: ANN001
    """The entries each KV head kept, read from the fresh blocks, are the stored entries the
    naive scores choose (``keys`` as attended, ``cached`` as stored): SnapKV's pooled votes
    of the last queries (top ``budget`` before the observation window, then the window),
    H2O's heaviest then its newest."""
    kind, budget, a, b = s.compact
    n_ent = s.num_cached + s.num_tokens
    if kind == "snapkv":
        w, pool = a, b
        obs = q[-w:]
        ent = torch.arange(n_ent)
        qpos = torch.arange(n_ent - w, n_ent)
        g = HEADS // KV_HEADS
        scores = torch.einsum("whd,shd->hws", obs.double(),
                              keys.double().repeat_interleave(g, 1)) / math.sqrt(D)  # fmt: skip
        scores = scores.masked_fill((ent[None, :] > qpos[:, None])[None], -math.inf)
        vote = scores.softmax(-1).view(KV_HEADS, g, w, n_ent).sum(dim=(1, 2))[:, : n_ent - w]
        vote = torch.nn.functional.avg_pool1d(vote[:, None], pool, 1, pool // 2)[:, 0]
        top = vote.topk(budget, -1).indices.sort(-1).values
        keep = torch.cat([top, qpos.expand(KV_HEADS, w)], -1)
    else:
        recent = a
        heavy = mass[:, : n_ent - recent].topk(budget - recent, -1).indices.sort(-1).values
        keep = torch.cat([heavy, torch.arange(n_ent - recent, n_ent).expand(KV_HEADS, recent)], -1)
    kc, _ = r.storage.gather(0, torch.tensor([s.compact_block_ids]))
    kept = kc[0, :, : keep.shape[1]]  # [KVH, kept, D]
    for h in range(KV_HEADS):
        torch.testing.assert_close(kept[h].float(), cached[keep[h], h].float(), atol=0, rtol=0)


# -- end to end ------------------------------------------------------------------------------------
@pytest.mark.parametrize("retention", [None, "sinks:4,window:32"])
def test_float32_greedy_tokens_are_identical_through_both_backends(make_llm, retention):
    """The bundled model in float32 through the torch and the cpu backend: prompts sharing
    a prefix (prefix-cache hits), chunked prefill (chunks over cached context, short ones in
    the fused group, longer ones in the context kernel), decode; with StreamingLLM too."""
    from kvserve import SamplingParams
    from tests.conftest import prompts_of_lengths

    shared = prompts_of_lengths([40], vocab=4096, seed=3)[0]
    prompts = [shared + p for p in prompts_of_lengths([5, 80], vocab=4096, seed=4)]
    prompts += prompts_of_lengths([100], vocab=4096, seed=5)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    tokens = {}
    for backend in ("torch", "cpu"):
        llm = make_llm(resolve_model(None), device="cpu", dtype="float32",
                       attention_backend=backend, max_num_batched_tokens=96, max_num_seqs=4,
                       kv_retention=retention)  # fmt: skip
        assert llm.engine.executor.driver_worker.runner.attention.name == backend
        tokens[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert tokens["cpu"] == tokens["torch"]
    assert all(len(t) == 12 for t in tokens["torch"])


# -- the registry, the config field, the flag -----------------------------------------------------
def test_unknown_or_misplaced_backend_is_a_config_error_naming_the_field(tmp_path):
    from kvserve import LLM
    from kvserve.worker.model_runner import build_runner

    with pytest.raises(ConfigError, match=r"attention_backend: must be one of auto, torch, "
                                          r"cpu, triton, got 'nope'"):  # fmt: skip
        LLM(resolve_model(None), attention_backend="nope")
    # a backend that does not run on the device is refused before anything is loaded
    refused = r"attention_backend: 'cpu' does not run on cuda devices; there, choose one of"
    with pytest.raises(ConfigError, match=refused + " auto, torch"):
        engine_config(str(tmp_path / "not-loaded"), device="cuda", attention_backend="cpu")
    with pytest.raises(ConfigError, match="attention_backend: must be a backend name or None"):
        EngineConfig(model="m", attention_backend=3)  # type: ignore[arg-type]
    # an EngineConfig built without engine_config: its runner refuses the name
    with pytest.raises(ConfigError, match="attention_backend: must be one of"):
        build_runner(EngineConfig(model=resolve_model(None), attention_backend="nope"), 8, 64)


def test_auto_picks_the_kernels_on_a_cpu_where_they_build_else_torch(monkeypatch):
    assert resolve_backend(None, CPU) == ("cpu" if kernels.native_available() else "torch")
    assert resolve_backend("auto", torch.device("cuda")) == "torch"
    assert resolve_backend("torch", torch.device("cuda")) == "torch"
    monkeypatch.setattr(kernels, "DISABLED", True)  # KVSERVE_DISABLE_KERNELS=1
    assert resolve_backend(None, CPU) == "torch"
    assert resolve_backend("cpu", CPU) == "cpu"  # named: runs, every call falling back


def test_the_flag_parses_into_the_llm_keyword(capsys):
    p = argparse.ArgumentParser()
    add_engine_args(p)
    args = p.parse_args(["--model", "kvserve-ref", "--attention-backend", "torch"])
    assert engine_kwargs(args)["attention_backend"] == "torch"
    assert p.parse_args([]).attention_backend is None  # auto
    with pytest.raises(SystemExit):
        p.parse_args(["--attention-backend", "nope"])
    err = capsys.readouterr().err
    assert "--attention-backend: invalid choice: 'nope'" in err
    assert all(name in err for name in ATTENTION_BACKEND_CHOICES)
