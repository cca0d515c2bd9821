"""The oneDNN fused linear backend against the plain-PyTorch reference."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from kvserve.kernels import amx
from kvserve.model.linear_ops import OneDNNOps, TorchOps, select_ops

pytestmark = pytest.mark.skipif(
    not isinstance(select_ops(torch.device("cpu"), torch.float32), OneDNNOps),
    reason="PyTorch build without oneDNN: the reference backend is in use",
)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("tokens", [1, 7, 300])
def test_fused_ops_match_reference(dtype, tol, tokens):
    torch.manual_seed(0)
    h, inter = 48, 80
    qkv = nn.Linear(h, 96, bias=True).to(dtype)  # Qwen2-style bias
    o = nn.Linear(h, h, bias=False).to(dtype)
    gate_up = nn.Linear(h, 2 * inter, bias=False).to(dtype)
    down = nn.Linear(inter, h, bias=False).to(dtype)
    x = torch.randn(tokens, h, dtype=dtype)
    res = torch.randn(tokens, h, dtype=dtype)
    ref, fast = TorchOps(), OneDNNOps()
    with torch.inference_mode():
        pairs = [
            (ref.linear(x, qkv), fast.linear(x, qkv)),
            (ref.linear_add(x, o, res), fast.linear_add(x, o, res)),
            (ref.swiglu_add(x, gate_up, down, res), fast.swiglu_add(x, gate_up, down, res)),
        ]
    for want, got in pairs:
        assert got.dtype == want.dtype and got.shape == want.shape
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_engine_outputs_same_with_either_backend(checkpoint, make_llm, monkeypatch):
    from kvserve import SamplingParams

    path = checkpoint("qwen2")
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    fast = make_llm(path, dtype="float32")
    assert isinstance(fast.engine.executor.driver_worker.model.layers[0].qkv_proj.ops, OneDNNOps)
    monkeypatch.setenv("KVSERVE_DISABLE_ONEDNN", "1")
    ref = make_llm(path, dtype="float32")
    assert type(ref.engine.executor.driver_worker.model.layers[0].qkv_proj.ops) is TorchOps
    prompts = [[5, 6, 7, 8, 9], list(range(20, 60))]
    assert [o.outputs[0].token_ids for o in fast.generate(prompts, params)] == [
        o.outputs[0].token_ids for o in ref.generate(prompts, params)
    ]


def test_prepacked_weights_give_the_plain_results_and_unpack_exactly(checkpoint, monkeypatch):
    """A bf16 model adopted by the packing backend: every matrix is in oneDNN's layout (the
    dense weight replaced, not copied), a forward pass through it equals the same model with
    plain weights, weight bytes are counted as for plain weights, and switching back to the
    reference backend restores the dense matrices bit for bit."""
    from kvserve.config import ModelConfig
    from kvserve.model.loader import load_model
    from kvserve.worker.bandwidth import weight_bytes_read

    path = checkpoint("llama_gqa")
    cfg = ModelConfig.from_pretrained(path)
    monkeypatch.setenv("KVSERVE_DISABLE_PREPACK", "1")  # loaded with plain weights
    model = load_model(path, cfg, torch.bfloat16, torch.device("cpu"), 64)
    assert model.layers[0].qkv_proj.weight.layout == torch.strided
    dense = {n: p.detach().clone() for n, p in model.named_parameters()}
    plain_bytes = weight_bytes_read(model)
    torch.manual_seed(0)
    x = torch.randn(37, cfg.hidden_size, dtype=torch.bfloat16)
    res = torch.randn(37, cfg.hidden_size, dtype=torch.bfloat16)
    layer = model.layers[0]
    plain = OneDNNOps(prepack=False)
    model.set_ops(plain)
    want = [plain.linear(x, layer.qkv_proj), plain.linear_add(x, layer.o_proj, res),
            plain.swiglu_add(x, layer.mlp.gate_up_proj, layer.mlp.down_proj, res),
            model.logits(x)]  # fmt: skip
    packed = OneDNNOps(prepack=True)
    model.set_ops(packed)
    mlp = layer.mlp
    for lin in (layer.qkv_proj, layer.o_proj, mlp.gate_up_proj, mlp.down_proj, model.lm_head):
        assert lin.weight.layout == torch._mkldnn
    assert layer.mlp.gate_up_proj.weight.shape[0] == cfg.intermediate_size  # the gate rows alone
    got = [packed.linear(x, layer.qkv_proj), packed.linear_add(x, layer.o_proj, res),
           packed.swiglu_add(x, layer.mlp.gate_up_proj, layer.mlp.down_proj, res),
           model.logits(x)]  # fmt: skip
    for w, g in zip(want, got, strict=True):
        torch.testing.assert_close(g, w, atol=0, rtol=0)
    assert weight_bytes_read(model) == plain_bytes
    model.set_ops(TorchOps())
    back = dict(model.named_parameters())
    assert back.keys() == dense.keys()
    for n, p in dense.items():
        assert back[n].layout == torch.strided and torch.equal(back[n], p), n


def test_engines_pack_their_weights(checkpoint, make_llm, monkeypatch):
    llm = make_llm(checkpoint("llama_gqa"), dtype="bfloat16")
    model = llm.engine.executor.driver_worker.model
    assert isinstance(model.ops, OneDNNOps) and model.ops.prepack
    w = model.layers[0].qkv_proj.weight  # in the tile layout where a kernel of ours reads it
    ours = amx.available() or amx.avx512_available()
    assert amx.is_packed(w) if ours else w.layout == torch._mkldnn
    fp32 = make_llm(checkpoint("llama_gqa"), dtype="float32")
    w32 = fp32.engine.executor.driver_worker.model.layers[0].qkv_proj.weight
    ours = amx.avx512_available()  # the AVX-512 kernel's float32 layout, else oneDNN's
    assert amx.is_packed(w32) if ours else w32.layout == torch._mkldnn
    monkeypatch.setenv("KVSERVE_DISABLE_PREPACK", "1")  # the A/B switch: plain weights
    plain = make_llm(checkpoint("llama_gqa"), dtype="float32")
    assert (
        plain.engine.executor.driver_worker.model.layers[0].qkv_proj.weight.layout == torch.strided
    )


_GROWTH = """
import sys, torch
from kvserve.entrypoint import setup_process
if sys.argv[1] == "engine":
    setup_process()  # what an entry point does before it loads a model
def rss_mb():
    return int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0]) // 1024
w, lp = torch.randn(256, 128), torch.ops.mkldnn._linear_pointwise
lp(torch.randn(1, 128), w, None, "none", [], "")
before = rss_mb()
for rows in range(2, 300):  # a serving engine's step token counts
    lp(torch.randn(rows, 128), w, None, "none", [], "")
print(rss_mb() - before)
"""


def test_onednn_state_per_row_count_is_bounded():
    """oneDNN and ideep keep state for every GEMM shape they have seen, ~0.6 MB each;
    once an entry point set the process up, 300 row counts cost at most about the bounded
    caches' worth, where PyTorch's defaults keep all of them (measured in a fresh process
    each, the caches' capacity being read at the first oneDNN call)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")}  # fmt: skip
    grew = {
        mode: int(subprocess.run([sys.executable, "-c", _GROWTH, mode], env=env, check=True,
                                 capture_output=True, text=True).stdout.split()[-1])
        for mode in ("torch-defaults", "engine")
    }  # fmt: skip
    assert grew["torch-defaults"] > 120, grew  # the unbounded growth this guards against
    assert grew["engine"] < 0.5 * grew["torch-defaults"], grew
