"""A decoder layer's projections through its backend's plan (LayerPlan): the float32 formula
over the dense weights to rounding, and the module path's bits, for every packing backend;
and the steps the plan leaves to the modules."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvserve.config import ModelConfig
from kvserve.model.linear_ops import AMXOps, LayerPlan, OneDNNOps, PackedOps, UpcastOps
from kvserve.model.loader import load_model
from tests.test_amx_linear import needs_amx, needs_avx512


def _load(checkpoint, monkeypatch, name: str, dtype: torch.dtype):
    path = checkpoint(name)
    cfg = ModelConfig.from_pretrained(path)
    monkeypatch.setenv("KVSERVE_DISABLE_PREPACK", "1")  # plain weights; set_ops packs them
    return load_model(path, cfg, dtype, torch.device("cpu"), 64), cfg


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


BACKENDS = [
    pytest.param(
        lambda: PackedOps("avx512", dtype=torch.float32),
        torch.float32,
        marks=needs_avx512,
        id="avx512-f32",
    ),
    pytest.param(lambda: PackedOps("avx512"), torch.bfloat16, marks=needs_avx512, id="avx512"),
    pytest.param(lambda: AMXOps(), torch.bfloat16, marks=needs_amx, id="amx"),
    pytest.param(
        lambda: UpcastOps(min_rows=32, kernel="avx512"),
        torch.bfloat16,
        marks=needs_avx512,
        id="upcast",
    ),
]


@pytest.mark.parametrize("name", ["llama_gqa", "qwen2"])
@pytest.mark.parametrize("make_ops, dtype", BACKENDS)
def test_plan_computes_the_layer_formula_with_the_module_paths_bits(
    checkpoint, monkeypatch, make_ops, dtype, name
):
    """QKV (qwen2: with its bias) after the input norm, the output projection plus the
    residual, and the MLP after its norm plus its residual: within rounding of the formula
    in float32 over the dense weights, and bit for bit the module path's result (the -tp 2
    = -tp 1 token tests and the cached outputs of other paths rest on that)."""
    model, cfg = _load(checkpoint, monkeypatch, name, dtype)
    layer = model.layers[0]
    w = {n: p.detach().float() for n, p in layer.named_parameters()}
    ops = make_ops()
    model.set_ops(ops)
    plan = layer.plan
    assert isinstance(plan, LayerPlan)
    inter, eps = cfg.intermediate_size, cfg.rms_norm_eps
    g = torch.Generator().manual_seed(3)
    rows = 5
    x = torch.randn(rows, cfg.hidden_size, generator=g).to(dtype)
    a = torch.randn(rows, layer.q_size, generator=g).to(dtype)
    xf, af = x.float(), a.float()
    xn = _rms(xf, w["input_layernorm.weight"], eps)
    qkv_want = xn @ w["qkv_proj.weight"].t()
    if "qkv_proj.bias" in w:
        qkv_want = qkv_want + w["qkv_proj.bias"]
    h_want = xf + af @ w["o_proj.weight"].t()
    hn = _rms(xf, w["post_attention_layernorm.weight"], eps)
    wg, wu = w["mlp.gate_up_proj.weight"][:inter], w["mlp.gate_up_proj.weight"][inter:]
    mlp_want = xf + (F.silu(hn @ wg.t()) * (hn @ wu.t())) @ w["mlp.down_proj.weight"].t()

    got = [plan.qkv_rows(x), plan.attention_out(a, x), plan.mlp(x)]
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=0.05, rtol=0.05)
    for out, want in zip(got, [qkv_want, h_want, mlp_want], strict=True):
        assert out.dtype == dtype
        torch.testing.assert_close(out.float(), want, **tol)
    modules = [
        layer.qkv_proj(x, norm=layer.input_layernorm),
        layer.o_proj(a, residual=x),
        layer.mlp(x, norm=layer.post_attention_layernorm, residual=x),
    ]
    for out, ref in zip(got, modules, strict=True):
        assert torch.equal(out, ref)


def test_plan_covers_only_the_steps_its_kernel_takes(checkpoint, monkeypatch):
    """UpcastOps runs steps of ``min_rows`` tokens and more on oneDNN: its plan stops below
    them. A backend with no kernel of its own (oneDNN) has no plan: the modules run."""
    if not torch.backends.mkldnn.is_available():
        pytest.skip("PyTorch build without oneDNN")
    model, _ = _load(checkpoint, monkeypatch, "llama_gqa", torch.bfloat16)
    model.set_ops(OneDNNOps(prepack=True))
    assert all(layer.plan is None for layer in model.layers)
    from kvserve.kernels import amx

    if not amx.avx512_available():
        return
    model.set_ops(UpcastOps(min_rows=32, kernel="avx512"))
    assert all(layer.plan.max_rows == 31 for layer in model.layers)
    model.set_ops(PackedOps("avx512"))
    assert all(layer.plan.max_rows == LayerPlan.ANY_ROWS for layer in model.layers)
