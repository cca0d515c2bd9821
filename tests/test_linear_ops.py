"""The oneDNN fused linear backend against the plain-PyTorch reference."""

from __future__ import annotations

import pytest
import torch
from torch import nn

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
    assert isinstance(fast.engine.model.layers[0].ops, OneDNNOps)
    monkeypatch.setenv("KVSERVE_DISABLE_ONEDNN", "1")
    ref = make_llm(path, dtype="float32")
    assert type(ref.engine.model.layers[0].ops) is TorchOps
    prompts = [[5, 6, 7, 8, 9], list(range(20, 60))]
    assert [o.outputs[0].token_ids for o in fast.generate(prompts, params)] == [
        o.outputs[0].token_ids for o in ref.generate(prompts, params)
    ]
