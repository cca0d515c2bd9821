"""bf16 models whose large GEMMs run in float32 (UpcastOps), against float32 arithmetic on
the same bf16 values, and the choice of that backend."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvserve.kernels import amx
from kvserve.model.linear_ops import (
    FLOAT32_KERNEL_MAX_ROWS,
    KERNEL_WEIGHTS,
    UPCAST_MIN_ROWS,
    UPCAST_MIN_ROWS_AVX512,
    AMXOps,
    OneDNNOps,
    PackedOps,
    TorchOps,
    UpcastOps,
    large_step_gemm,
    linear_layers,
    select_ops,
)
from tests.conftest import run_with_prompt_logits
from tests.test_amx_linear import needs_avx512

pytestmark = pytest.mark.skipif(
    not isinstance(select_ops(torch.device("cpu"), torch.float32), OneDNNOps),
    reason="PyTorch build without oneDNN: the reference backend is in use",
)

AMX = torch.cpu._is_amx_tile_supported()


def _load_bf16(checkpoint, monkeypatch, name: str):
    from kvserve.config import ModelConfig
    from kvserve.model.loader import load_model

    path = checkpoint(name)
    cfg = ModelConfig.from_pretrained(path)
    monkeypatch.setenv("KVSERVE_DISABLE_PREPACK", "1")  # loaded with plain weights
    return load_model(path, cfg, torch.bfloat16, torch.device("cpu"), 64), cfg


@pytest.mark.parametrize("kernel", [None, pytest.param("avx512", marks=needs_avx512)])
@pytest.mark.parametrize("rows", [64, 300])
def test_large_steps_compute_bf16_values_in_float32(checkpoint, monkeypatch, rows, kernel):
    """At or above ``min_rows`` tokens each layer op is the float32 result of the bf16
    inputs and weights (bias, residual, SwiGLU's silu-and-product and the down projection
    all in float32) rounded to bf16 once; below it, the packed bf16 backend's result bit for
    bit (oneDNN's, or kvserve's AVX-512 kernel's). Reference: the formula in float32 over the
    dense bf16 weights (qwen2: a qkv bias)."""
    model, cfg = _load_bf16(checkpoint, monkeypatch, "qwen2")
    layer = model.layers[0]
    w = {n: p.detach().float() for n, p in layer.named_parameters()}
    inter = cfg.intermediate_size
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, cfg.hidden_size, generator=g).to(torch.bfloat16)
    res = torch.randn(rows, cfg.hidden_size, generator=g).to(torch.bfloat16)
    xf, rf = x.float(), res.float()
    wg, wu = w["mlp.gate_up_proj.weight"][:inter], w["mlp.gate_up_proj.weight"][inter:]
    want = [
        xf @ w["qkv_proj.weight"].t() + w["qkv_proj.bias"],
        rf + xf @ w["o_proj.weight"].t(),
        rf + (F.silu(xf @ wg.t()) * (xf @ wu.t())) @ w["mlp.down_proj.weight"].t(),
    ]
    ops = UpcastOps(min_rows=100, kernel=kernel)
    model.set_ops(ops)
    got = [ops.linear(x, layer.qkv_proj), ops.linear_add(x, layer.o_proj, res),
           ops.swiglu_add(x, layer.mlp.gate_up_proj, layer.mlp.down_proj, res)]  # fmt: skip
    packed = OneDNNOps(prepack=True) if kernel is None else PackedOps(kernel)
    if rows >= ops.min_rows:
        for o, ref in zip(got, want, strict=True):
            assert o.dtype == torch.bfloat16
            # one bf16 rounding of the float32 value (sums in another order may round the
            # other way: 2 ulps)
            torch.testing.assert_close(o.float(), ref, atol=1e-5, rtol=2**-7)
    else:
        model.set_ops(packed)
        bf16 = [packed.linear(x, layer.qkv_proj), packed.linear_add(x, layer.o_proj, res),
                packed.swiglu_add(x, layer.mlp.gate_up_proj, layer.mlp.down_proj, res)]  # fmt: skip
        for o, b in zip(got, bf16, strict=True):
            assert torch.equal(o, b)


@pytest.mark.parametrize("kernel", [None, pytest.param("avx512", marks=needs_avx512)])
def test_large_steps_on_onednn_bf16_copies(checkpoint, monkeypatch, kernel):
    """With bf16 copies (a CPU whose bf16 dot product outruns its FMAs), a step of
    ``min_rows`` or more tokens computes each layer op as the formula in float32 over the bf16
    values with oneDNN's roundings to bf16 (SwiGLU's gate and product, then the output), the
    LM head included (it has a copy here); a smaller step is the packed bf16 backend's result
    bit for bit. Reference: the formula over the dense bf16 weights (qwen2: a qkv bias), and
    oneDNN's packed bf16 backend for which path ran."""
    model, cfg = _load_bf16(checkpoint, monkeypatch, "qwen2")
    layer = model.layers[0]
    w = {n: p.detach().float() for n, p in layer.named_parameters()}
    head = model.lm_head.weight.detach().float()
    inter = cfg.intermediate_size
    ops = UpcastOps(min_rows=32, kernel=kernel, dtype=torch.bfloat16)
    model.set_ops(ops)
    assert "weight32" in model.lm_head.__dict__
    assert ops.large_step_rows == 32 and "bf16 GEMMs in steps of 32+" in ops.describe()
    packed = OneDNNOps(prepack=True) if kernel is None else PackedOps(kernel)

    def bf(t: torch.Tensor) -> torch.Tensor:
        return t.to(torch.bfloat16).float()

    for rows in (8, 40):
        g = torch.Generator().manual_seed(rows)
        x = torch.randn(rows, cfg.hidden_size, generator=g).to(torch.bfloat16)
        res = torch.randn(rows, cfg.hidden_size, generator=g).to(torch.bfloat16)
        model.set_ops(ops)
        got = [ops.linear(x, layer.qkv_proj), ops.linear_add(x, layer.o_proj, res),
               ops.swiglu_add(x, layer.mlp.gate_up_proj, layer.mlp.down_proj, res),
               ops.linear(x, model.lm_head)]  # fmt: skip
        if rows < ops.min_rows:
            model.set_ops(packed)
            bf16 = [packed.linear(x, layer.qkv_proj), packed.linear_add(x, layer.o_proj, res),
                    packed.swiglu_add(x, layer.mlp.gate_up_proj, layer.mlp.down_proj, res),
                    packed.linear(x, model.lm_head)]  # fmt: skip
            for o, b in zip(got, bf16, strict=True):
                assert torch.equal(o, b)
            continue
        xf, rf = x.float(), res.float()
        wg, wu = w["mlp.gate_up_proj.weight"][:inter], w["mlp.gate_up_proj.weight"][inter:]
        h = bf(bf(F.silu(xf @ wg.t())) * (xf @ wu.t()))
        want = [
            xf @ w["qkv_proj.weight"].t() + w["qkv_proj.bias"],
            rf + xf @ w["o_proj.weight"].t(),
            rf + h @ w["mlp.down_proj.weight"].t(),
            xf @ head.t(),
        ]
        for o, ref in zip(got, want, strict=True):
            assert o.dtype == torch.bfloat16
            torch.testing.assert_close(o.float(), ref, atol=1e-4, rtol=2**-7)
        # and it is oneDNN's packed bf16 GEMM that ran (not the kernel, whatever its sums)
        onednn = OneDNNOps(prepack=True)
        model.set_ops(onednn)
        want = onednn.swiglu_add(x, layer.mlp.gate_up_proj, layer.mlp.down_proj, res)
        assert torch.equal(got[2], want)


def test_float32_copies_are_not_parameters_and_go_with_the_backend(checkpoint, monkeypatch):
    """The copies (of the layers' matrices) hold the bf16 weights' values exactly; the
    model's parameters (and so the weight bytes a decode step is charged) are those of the
    packed bf16 backend; switching to the reference backend drops the copies and restores
    the dense weights bit for bit."""
    from kvserve.worker.bandwidth import weight_bytes_read

    model, _ = _load_bf16(checkpoint, monkeypatch, "llama_gqa")
    dense = {n: p.detach().clone() for n, p in model.named_parameters()}
    plain_bytes = weight_bytes_read(model)
    model.set_ops(UpcastOps(min_rows=128))
    layer = model.layers[0]
    inter = layer.mlp.down_proj.weight.shape[1]
    for lin, name in [(layer.qkv_proj, "qkv_proj"), (layer.o_proj, "o_proj")]:
        assert torch.equal(lin.weight32.to_dense(), dense[f"layers.0.{name}.weight"].float())
    gate_up = dense["layers.0.mlp.gate_up_proj.weight"].float()
    assert torch.equal(layer.mlp.gate_up_proj.weight32.to_dense(), gate_up[:inter])
    assert torch.equal(layer.mlp.gate_up_proj.up_weight32.to_dense(), gate_up[inter:])
    assert not hasattr(model.lm_head, "weight32")  # prefill samples too few rows to gain
    assert layer.qkv_proj.weight.layout == torch._mkldnn  # the bf16 matrices packed
    assert weight_bytes_read(model) == plain_bytes
    assert not any(n.endswith("32") for n, _ in model.named_parameters())
    model.set_ops(TorchOps())
    assert not hasattr(layer.qkv_proj, "weight32")
    assert not hasattr(layer.mlp.gate_up_proj, "up_weight32")
    for n, p in model.named_parameters():
        assert p.layout == torch.strided and torch.equal(p, dense[n]), n


def test_min_rows_from_the_environment(monkeypatch):
    """``KVSERVE_UPCAST_MIN_ROWS`` sets the threshold (0: never) for float32 copies, with
    kvserve's AVX-512 kernel too; AMX, where the CPU has it, comes first; a bad value names
    the variable."""
    monkeypatch.setenv("KVSERVE_UPCAST_MIN_ROWS", "7")
    ops = select_ops(torch.device("cpu"), torch.bfloat16)
    if AMX:
        assert isinstance(ops, AMXOps)
    else:
        assert isinstance(ops, UpcastOps) and ops.min_rows == 7 and ops.forced
        assert ops.dtype == torch.float32
    f32 = select_ops(torch.device("cpu"), torch.float32)  # a float32 model's split is fixed
    assert not isinstance(f32, UpcastOps) or f32.min_rows == FLOAT32_KERNEL_MAX_ROWS != 7
    assert large_step_gemm("avx512") == (7, torch.float32)  # the user's setting wins
    monkeypatch.setenv("KVSERVE_UPCAST_MIN_ROWS", "0")
    assert large_step_gemm() is None and large_step_gemm("avx512") is None
    assert not isinstance(select_ops(torch.device("cpu"), torch.bfloat16), UpcastOps)
    for bad in ("-1", "many"):
        monkeypatch.setenv("KVSERVE_UPCAST_MIN_ROWS", bad)
        with pytest.raises(ValueError, match="KVSERVE_UPCAST_MIN_ROWS: must be an integer >= 0"):
            large_step_gemm()
    with pytest.raises(ValueError, match="UpcastOps dtype: float32 or bfloat16, got torch.float16"):
        UpcastOps(64, dtype=torch.float16)
    with pytest.raises(ValueError, match="a float32 model's large steps stay float32"):
        UpcastOps(64, kernel="avx512", dtype=torch.bfloat16, model_dtype=torch.float32)
    with pytest.raises(ValueError, match="PackedOps: float32 runs on the avx512 kernel, not amx"):
        PackedOps("amx", dtype=torch.float32)


@pytest.mark.parametrize(
    ("onednn_bf16_gain", "kernel_gain", "kernel", "want"),
    [
        # A Xeon without AMX: bf16's dot product at half the FMA rate.
        pytest.param(
            0.7, 1.0, "avx512", (UPCAST_MIN_ROWS_AVX512, torch.float32), marks=needs_avx512
        ),
        (0.7, 1.0, None, (UPCAST_MIN_ROWS, torch.float32)),
        # bf16 about even with float32: no copies.
        pytest.param(
            1.1, 1.0, "avx512", (UPCAST_MIN_ROWS_AVX512, torch.float32), marks=needs_avx512
        ),
        (1.1, 1.0, None, None),
        # A Zen 4 core: oneDNN's bf16 GEMM twice float32's; it overtakes the kernel from
        # the first probed row count where it is as fast.
        (2.0, 1.0, None, None),
        pytest.param(2.0, 1.0, "avx512", (8, torch.bfloat16), marks=needs_avx512),
        pytest.param(2.0, 2.0, "avx512", None, marks=needs_avx512),  # the kernel faster throughout
    ],
)
def test_large_step_gemm_follows_the_timings(
    monkeypatch, onednn_bf16_gain, kernel_gain, kernel, want
):
    """The decision rule over fake timings: oneDNN float32 takes 1 s at the probe; its bf16
    GEMM ``1 / onednn_bf16_gain``; the kernel is faster than oneDNN's bf16 GEMM below 8 rows
    and ``kernel_gain`` times its speed from 8 rows (1: as fast)."""
    from kvserve.model import linear_ops

    def fake_time(fn, x, w, *args, **kwargs):
        rows = x.shape[0]
        if fn is amx.linear:
            onednn = 1.0 / onednn_bf16_gain
            return onednn * 0.5 if rows < 8 else onednn / kernel_gain
        return 1.0 if x.dtype == torch.float32 else 1.0 / onednn_bf16_gain

    monkeypatch.delenv("KVSERVE_UPCAST_MIN_ROWS", raising=False)
    monkeypatch.setattr(linear_ops, "best_time", fake_time)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    linear_ops._measured_split.cache_clear()
    try:
        assert large_step_gemm(kernel) == want
    finally:
        linear_ops._measured_split.cache_clear()


def test_engine_prompt_logits_match_transformers_on_the_bf16_weights(
    checkpoint, make_llm, monkeypatch
):
    """The whole engine in bf16 with its prefill GEMMs in float32 (chunks of 16 tokens,
    threshold 8, AMX turned off so the backend runs on any CPU): prompt log-probabilities
    as close to transformers computing in float32 over the same bf16-rounded weights as
    transformers' own bf16 run is (both round activations to bf16; measured 0.013 vs 0.014
    nats mean, 0.105 vs 0.115 max)."""
    transformers = pytest.importorskip("transformers")
    from kvserve import SamplingParams

    monkeypatch.setenv("KVSERVE_DISABLE_AMX", "1")
    monkeypatch.setenv("KVSERVE_UPCAST_MIN_ROWS", "8")
    path = checkpoint("llama_gqa")
    llm = make_llm(path, dtype="bfloat16", max_num_batched_tokens=16)
    assert isinstance(llm.engine.executor.driver_worker.model.ops, UpcastOps)
    prompt = list(range(40, 90))
    out = run_with_prompt_logits(llm.engine, prompt, SamplingParams(temperature=0, max_tokens=2))
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    with torch.no_grad():
        peer = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), -1)
        ref = torch.log_softmax(hf.float()(torch.tensor([prompt])).logits[0], -1)
    assert out.prompt_logits.shape == ref.shape
    ours, theirs = (out.prompt_logits - ref).abs(), (peer - ref).abs()
    assert ours.mean() <= 1.2 * theirs.mean() and ours.max() <= 1.5 * theirs.max()


@pytest.mark.parametrize("rows", ["8,x", "0", "16,-4"])
def test_gemm_benchmark_refuses_bad_row_counts(capsys, rows):
    from benchmarks.gemm_dtypes import main

    with pytest.raises(SystemExit) as e:
        main(["--rows", rows])
    assert e.value.code == 2
    assert f"--rows: a comma list of integers >= 1, got {rows!r}" in capsys.readouterr().err


@pytest.mark.parametrize("forced", [False, True])
def test_float32_copies_only_where_memory_allows(checkpoint, monkeypatch, forced):
    """The copies take 4 bytes per layer weight; when that is over a quarter of the memory
    available at load time they are not made (every GEMM stays packed bf16, bit for bit the
    packed backend's, and the backend says why), unless the user set the threshold."""
    from kvserve.model import linear_ops

    model, cfg = _load_bf16(checkpoint, monkeypatch, "llama_gqa")
    head = model.lm_head
    need = 4 * sum(p.numel() for n, p in model.named_parameters()
                   if n.startswith("layers.") and n.endswith("proj.weight"))  # fmt: skip
    assert head.weight.numel() * 4 < need  # the LM head is not copied
    # Just too little memory: the copies would be a hair over the share.
    monkeypatch.setattr(linear_ops, "available_memory", lambda: int(need * 4 - 4))
    ops = UpcastOps(min_rows=16, forced=forced)
    model.set_ops(ops)
    layer = model.layers[0]
    assert hasattr(layer.qkv_proj, "weight32") == forced
    x = torch.randn(64, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    x = x.to(torch.bfloat16)
    got = ops.linear(x, layer.qkv_proj)
    # What the simulator's calibration reads: the steps that take the float32 path.
    assert ops.large_step_rows == (16 if forced else 0)
    if forced:
        assert ops.skipped is None and "float32 GEMMs in steps of 16+" in ops.describe()
    else:
        assert ops.skipped == (need, need * 4 - 4)
        assert "would take" in ops.describe() and "bf16 GEMMs" in ops.describe()
        packed = OneDNNOps(prepack=True)
        model.set_ops(packed)
        assert torch.equal(got, packed.linear(x, layer.qkv_proj))
    # Enough memory: the copies are made.
    monkeypatch.setattr(linear_ops, "available_memory", lambda: int(need * 4))
    model.set_ops(UpcastOps(min_rows=16))
    assert hasattr(layer.qkv_proj, "weight32")


@needs_avx512
def test_without_room_for_copies_the_kernel_still_takes_every_packed_layer(checkpoint, monkeypatch):
    """Memory too short for the float32 copies, kvserve's kernel beside oneDNN: the matrices are
    packed for the kernel as the packed backend packs them, each with the record its GEMM calls
    read, and a layer's result is the kernel's own on those matrices."""
    from kvserve.model import linear_ops

    model, cfg = _load_bf16(checkpoint, monkeypatch, "llama_gqa")
    monkeypatch.setattr(linear_ops, "available_memory", lambda: 1)
    ops = UpcastOps(min_rows=16, kernel="avx512")
    model.set_ops(ops)
    assert ops.skipped is not None
    layer = model.layers[0]
    for lin, gate_up in linear_layers(model):
        kw = lin.__dict__.get(KERNEL_WEIGHTS)
        assert (kw is not None) == amx.is_packed(lin.weight)
        if kw is not None:
            assert kw[0] is lin.weight and kw[1] is (lin.up_weight if gate_up else None)
    assert amx.is_packed(layer.qkv_proj.weight)
    x = torch.randn(3, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    x = x.to(torch.bfloat16)
    want = amx.linear(x, layer.qkv_proj.weight, bias=layer.qkv_proj.bias, kernel="avx512")
    assert torch.equal(ops.linear(x, layer.qkv_proj), want)


@needs_avx512
@pytest.mark.parametrize(
    ("onednn_ahead_from", "want"),
    [(64, 64), (16, 16), (None, 512)],  # None: the kernel ahead at every size timed (16-256)
)
def test_split_measured_on_the_models_own_layers(checkpoint, monkeypatch, onednn_ahead_from, want):
    """With ``measure_split`` the step size comes from timing the model's own layers both
    ways (fake timings here: oneDNN 10 % slower than the kernel below ``onednn_ahead_from``
    rows, 10 % faster from it): the first size timed where oneDNN is as fast, or twice the
    largest size timed when it never is. Each timing runs the path the threshold selects
    for that row count, over the layers' packed matrices."""
    from kvserve.model import linear_ops

    model, _ = _load_bf16(checkpoint, monkeypatch, "qwen2")
    ops = UpcastOps(min_rows=8, kernel="avx512", dtype=torch.bfloat16, measure_split=True)
    timed = []

    def fake_time(fn, layers, x, xo, reps):
        rows = x.shape[0]
        onednn = rows >= ops.min_rows
        timed.append((rows, onednn, len(layers)))
        fn(layers, x, xo)  # the real calls run: shapes and paths must hold
        slower = onednn_ahead_from is None or rows < onednn_ahead_from
        return rows * (1.0 if not onednn else 1.1 if slower else 0.9)

    monkeypatch.setattr(linear_ops, "best_time", fake_time)
    model.set_ops(ops)
    assert ops.min_rows == want and f"steps of {want}+" in ops.describe()
    sizes = [r for r, _, _ in timed]
    assert sizes == sorted(sizes) and sizes[0] == 16
    assert all(n == len(model.layers) for _, _, n in timed)  # a small model: every layer
    assert {(r, o) for r, o, _ in timed} == {(r, o) for r in set(sizes) for o in (False, True)}
    # a model without decoder layers keeps the probe's answer
    bare = UpcastOps(min_rows=8, kernel="avx512", dtype=torch.bfloat16, measure_split=True)
    assert bare._split_on(torch.nn.Module()) == 8


@pytest.mark.parametrize("kernel", [None, pytest.param("avx512", marks=needs_avx512)])
def test_which_gemms_build_onednn_state_per_row_count(checkpoint, monkeypatch, kernel):
    """What the simulator's calibration reads (``shape_state_rows``): every GEMM from one row
    where it is oneDNN's at every size (the plain oneDNN backend; the upcasting one without
    kvserve's kernel packs its small steps for oneDNN too), the GEMMs with copies from the
    split where the kernel takes the small calls (the LM head among them only with bf16
    copies), a matrix the kernel cannot take at every size, and none on the packed kernel
    alone or the reference."""
    from kvserve.model import linear_ops

    model, _ = _load_bf16(checkpoint, monkeypatch, "llama_gqa")
    layers = ("qkv", "o", "gate", "up", "down")
    everything = dict.fromkeys((*layers, "head"), 1)
    assert TorchOps().shape_state_rows == {}
    model.set_ops(OneDNNOps(prepack=True))
    assert model.ops.shape_state_rows == everything
    model.set_ops(UpcastOps(min_rows=16, kernel=kernel))
    assert model.ops.shape_state_rows == (everything if kernel is None
                                          else dict.fromkeys(layers, 16))  # fmt: skip
    if kernel is None:
        return
    model.set_ops(UpcastOps(min_rows=16, kernel=kernel, dtype=torch.bfloat16))
    assert model.ops.shape_state_rows == dict.fromkeys((*layers, "head"), 16)
    model.set_ops(PackedOps(kernel))
    assert all(KERNEL_WEIGHTS in lin.__dict__ for lin, _ in linear_layers(model))
    assert model.ops.shape_state_rows == {}
    vocab = model.config.vocab_size
    packable = linear_ops.amx.packable
    monkeypatch.setattr(
        linear_ops.amx,
        "packable",
        lambda w, kernel="amx": w.shape[0] != vocab and packable(w, kernel),
    )
    model.set_ops(PackedOps(kernel))  # the head stays with oneDNN
    assert model.ops.shape_state_rows == {"head": 1}
    model.set_ops(UpcastOps(min_rows=16, kernel=kernel))
    assert model.ops.shape_state_rows == {**dict.fromkeys(layers, 16), "head": 1}
    monkeypatch.setattr(linear_ops.amx, "packable", packable)
    monkeypatch.setattr(linear_ops, "available_memory", lambda: 1)  # no room for copies
    model.set_ops(UpcastOps(min_rows=16, kernel=kernel))
    assert model.ops.skipped is not None and model.ops.shape_state_rows == {}


def test_cache_entries_follow_the_smaller_cache(monkeypatch):
    """GEMM shapes oneDNN's two caches hold at once: the smaller capacity; PyTorch's default
    where a variable is unset or not a number; never none."""
    from kvserve.entrypoint import onednn_cache_entries

    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "64")
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "600")
    assert onednn_cache_entries() == 64
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY")
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "lots")
    assert onednn_cache_entries() == 1024
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "0")
    assert onednn_cache_entries() == 1
