"""The Triton backend's paged attention against the torch backend, under Triton's interpreter
(set by tests/conftest.py where there is no GPU), on tiny shapes.

One step over a paged cache written in an earlier step: decode rows and chunks over cached
context, in one batch, per-sequence windows mixed with none, random block tables drawn from a
shuffled pool. Each backend runs on its own storage fed the same K/V (so both read the same
stored codes): for every format the decode rows go through the kernel, for the dense ones the
chunks too (the paged group). Tolerances as vLLM's kernel tests take them: float32 rounding
for float32 and for the quantized formats against the same decoded values, one bf16 rounding
(1.5e-2 / 1e-2) for bfloat16; fp8 e4m3 is also held against unquantized float32 attention
(1.5e-1). Split-KV (partial results merged by a second kernel) is forced where asked; on a CPU
the backend never splits.
"""

from __future__ import annotations

import pytest
import torch

from kvserve.attention.metadata import AttentionMetadata, PagedGroup, PrefillChunk
from kvserve.attention.torch_backend import TorchBackend
from kvserve.attention.triton_backend import TritonBackend
from kvserve.kernels import triton_attention as ta
from kvserve.kv.formats import make_kv_storage
from tests.conftest import TEST_DEVICE

DEV = torch.device(TEST_DEVICE)  # cpu: the interpreter; cuda: compiled kernels
D, POOL = 64, 48
# (cached entries before the step, new tokens, retention window): two decode rows, then chunks
SEQS = [(37, 1, 0), (20, 1, 9), (50, 13, 0), (9, 6, 7)]


def compute_dtype(fmt: str) -> torch.dtype:
    return torch.bfloat16 if fmt == "bfloat16" else torch.float32


def tables_for(bs: int, seed: int) -> list[list[int]]:
    free = torch.randperm(POOL, generator=torch.Generator().manual_seed(seed)).tolist()
    return [[free.pop() for _ in range(-(-(c + n) // bs))] for c, n, _ in SEQS]


def slots(table: list[int], start: int, n: int, bs: int) -> list[int]:
    return [table[i // bs] * bs + i % bs for i in range(start, start + n)]


def padded(tables: list[list[int]], null: int) -> torch.Tensor:
    width = max(len(t) for t in tables)
    return torch.tensor([t + [null] * (width - len(t)) for t in tables])


def run(backend, fmt: str, bs: int, heads: int, kv_heads: int, layer_window, key_std=2.0):  # noqa: ANN001, ANN201
    """Both steps through ``backend`` on a fresh storage; the second step's output."""
    seed = 0
    dt = compute_dtype(fmt)
    st = make_kv_storage(fmt, 1, POOL, bs, kv_heads, D, dt, DEV)
    tables = tables_for(bs, seed)
    g = torch.Generator().manual_seed(seed + 1)

    def kv(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        k = (torch.randn(n, kv_heads, D, generator=g) * key_std + 0.5).to(DEV, dt)
        return k, torch.randn(n, kv_heads, D, generator=g).to(DEV, dt)

    # step 1: the cached context, written as prefills
    sm = torch.tensor([s for t, (c, _, _) in zip(tables, SEQS, strict=True)
                       for s in slots(t, 0, c, bs)], device=DEV)  # fmt: skip
    k, v = kv(len(sm))
    st.begin_step(sm)
    st.write(0, sm, k, v)

    # step 2: decode rows, then chunks; all of them in the paged group
    nd = sum(1 for _, n, _ in SEQS if n == 1)
    sm = torch.tensor([s for t, (c, n, _) in zip(tables, SEQS, strict=True)
                       for s in slots(t, c, n, bs)], device=DEV)  # fmt: skip
    t = len(sm)
    # q as the model hands it over: a view into a wider projection (rows not contiguous)
    q = torch.randn(t, heads + 2, D, generator=g).to(DEV, dt)[:, 1:-1]
    k, v = kv(t)
    meta = AttentionMetadata(slot_mapping=sm, block_size=bs, num_decode=nd)
    meta.decode_block_tables = padded(tables[:nd], st.null_block).to(DEV)
    meta.decode_seq_lens = torch.tensor([c + 1 for c, _, _ in SEQS[:nd]], device=DEV)
    meta.decode_windows = torch.tensor([w for _, _, w in SEQS[:nd]], dtype=torch.int32,
                                       device=DEV)  # fmt: skip
    starts = torch.tensor([0, *[n for _, n, _ in SEQS]], device=DEV).cumsum(0)[:-1]
    for i in range(nd, len(SEQS)):
        c, n, w = SEQS[i]
        table = torch.tensor(tables[i][: -(-(c + n) // bs)], device=DEV)
        meta.prefills.append(PrefillChunk(int(starts[i]), n, c, table, True, w))
    meta.paged = PagedGroup(
        num_rows=t, q_start=starts, q_len=torch.tensor([n for _, n, _ in SEQS], device=DEV),
        ctx_len=torch.tensor([c for c, _, _ in SEQS], device=DEV),
        block_tables=padded(tables, st.null_block).to(DEV),
        windows=torch.tensor([w for _, _, w in SEQS], dtype=torch.int32, device=DEV),
    )  # fmt: skip
    st.begin_step(sm)
    return backend.forward(q, k, v, 0, st, meta, layer_window)


def launches(monkeypatch, rows: list | None = None) -> list[int]:  # noqa: ANN001
    """The format of each kernel launch, recorded (and in ``rows``, its rows and sequences)."""
    seen: list[int] = []
    real = ta.paged_attention

    def spy(q, cache, out, q_start, q_len, ctx, tables, *args, **kw):  # noqa: ANN001, ANN202
        seen.append(cache.fmt)
        if rows is not None:
            rows.append((args[2], tables.shape[0]))
        return real(q, cache, out, q_start, q_len, ctx, tables, *args, **kw)

    monkeypatch.setattr(ta, "paged_attention", spy)
    return seen


TOL = {"float32": (2e-5, 1e-4), "bfloat16": (1.5e-2, 1e-2)}
QUANT_TOL = (1e-4, 1e-4)  # the same decoded values: float32 rounding
FORMATS = ["float32", "bfloat16", "fp8_e4m3", "fp8_e5m2", "int8", "kivi4", "kivi2"]
CASES = [pytest.param(f, 16, 4, 2, None, 1, id=f"{f}-bs16") for f in FORMATS if f != "fp8_e5m2"] + [
    pytest.param("float32", 8, 6, 2, 24, 1, id="float32-bs8-gqa3-layerwindow"),
    pytest.param("bfloat16", 32, 4, 4, None, 2, id="bfloat16-bs32-mha-split2"),
    pytest.param("int8", 8, 4, 1, None, 1, id="int8-bs8-mqa"),
    pytest.param("kivi4", 8, 4, 2, 24, 2, id="kivi4-bs8-layerwindow-split2"),
    pytest.param("fp8_e5m2", 16, 8, 2, None, 4, id="fp8_e5m2-bs16-gqa4-split4"),
]


@pytest.mark.parametrize("fmt, bs, heads, kv_heads, layer_window, splits", CASES)
def test_triton_matches_the_torch_backend(monkeypatch, fmt, bs, heads, kv_heads, layer_window,
                                          splits):  # fmt: skip
    seen = launches(monkeypatch)
    monkeypatch.setattr(ta, "choose_splits", lambda *a: splits)
    want = run(TorchBackend(), fmt, bs, heads, kv_heads, layer_window)
    got = run(TritonBackend(), fmt, bs, heads, kv_heads, layer_window)
    dense = fmt in ("float32", "bfloat16")
    fmt_code = {"float": ta.DENSE, "bfloa": ta.DENSE, "fp8_e": ta.FP8, "int8": ta.INT8}
    assert seen == [fmt_code.get(fmt[:5], fmt_code.get(fmt, ta.KIVI))]  # one launch: it ran
    nd = sum(1 for _, n, _ in SEQS if n == 1)
    served = slice(None) if dense else slice(0, nd)  # lossy formats: decode rows only
    atol, rtol = TOL.get(fmt, QUANT_TOL)
    assert not got.isnan().any()
    torch.testing.assert_close(got[served].float(), want[served].float(), atol=atol, rtol=rtol)
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)  # the rest took the same path
    if fmt == "fp8_e4m3":  # against attention over the unquantized K/V (unit-scale keys)
        got = run(TritonBackend(), fmt, bs, heads, kv_heads, layer_window, key_std=1.0)
        exact = run(TorchBackend(), "float32", bs, heads, kv_heads, layer_window, key_std=1.0)
        torch.testing.assert_close(got[:nd], exact[:nd], atol=1.5e-1, rtol=0)


@pytest.mark.skipif(TEST_DEVICE != "cpu", reason="the interpreter's switch, on a CPU")
def test_the_backend_runs_on_a_cpu_only_under_the_interpreter(monkeypatch):
    import triton

    from kvserve.attention.registry import resolve_backend
    from kvserve.config import ConfigError

    cpu = torch.device("cpu")
    assert triton.knobs.runtime.interpret  # tests/conftest.py set TRITON_INTERPRET=1
    assert resolve_backend("triton", cpu) == "triton"
    assert resolve_backend(None, cpu) != "triton"  # auto never picks it (not yet on a GPU)
    monkeypatch.setattr(triton.knobs.runtime, "interpret", False)
    with pytest.raises(ConfigError, match="attention_backend: 'triton' does not run on cpu"):
        resolve_backend("triton", cpu)
    assert resolve_backend("triton", torch.device("cuda")) == "triton"


def test_llm_greedy_tokens_through_triton_equal_the_torch_backend(make_llm, monkeypatch):
    """The bundled model in float32 through ``LLM(..., attention_backend="triton")`` under the
    interpreter: chunked prefill (later chunks attend over the cached ones in the kernel's
    paged group), then decode steps; tokens equal the torch backend's."""
    from kvserve import SamplingParams
    from kvserve.model.resolve import resolve_model
    from tests.conftest import prompts_of_lengths

    rows: list[tuple[int, int]] = []
    seen = launches(monkeypatch, rows)
    shared = prompts_of_lengths([14], vocab=4096, seed=3)[0]
    prompts = [shared + p for p in prompts_of_lengths([2, 7], vocab=4096, seed=4)]
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    tokens = {}
    for backend in ("torch", "triton"):
        llm = make_llm(resolve_model(None), dtype="float32",
                       attention_backend=backend, max_num_seqs=2, block_size=16,
                       max_num_batched_tokens=16)  # fmt: skip
        assert llm.engine.executor.driver_worker.runner.attention.name == backend
        tokens[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert tokens["triton"] == tokens["torch"]
    assert all(len(t) == 3 for t in tokens["torch"])
    assert seen and set(seen) == {ta.DENSE}
    assert any(n > b for n, b in rows)  # a chunk of several queries went through the kernel


def test_without_triton_every_call_declines_to_the_reference(monkeypatch):
    """Named on a machine without Triton, the backend still runs: the reference does it all."""
    from kvserve.attention import triton_backend
    from kvserve.kv.formats import make_kv_storage as make

    monkeypatch.setattr(triton_backend, "HAVE_TRITON", False)
    backend = TritonBackend()
    st = make("float32", 1, 4, 16, 2, D, torch.float32)
    q, k = torch.randn(1, 4, D), torch.randn(1, 2, D)
    assert not backend.write_kv(0, st, torch.tensor([0]), k, k)
    assert backend.decode(0, q, st, torch.tensor([[0]]), torch.tensor([1]), None, None) is None
    assert not backend.serves_retention(st)
    assert not TritonBackend.available(torch.device("cuda"))
