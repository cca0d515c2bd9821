"""A step waits for the device once: when it reads the sampled tokens.

On a GPU every other read of a value on the host, every op whose output size depends on
values and every blocking upload stalls the host until the queued kernels have run (issue:
the engine on a GPU, one sync per step). None of them costs anything on a CPU, so this is
checked by recording them (tests/sync_audit.py) while real steps run: every KV format and
the attention backends that run on a GPU (``torch``, ``triton`` in Triton's interpreter; the
CPU kernels' backend too), a batch that mixes every sampling feature (greedy with logprobs,
top-k/top-p, min-p, seeds, the three penalties, ``logit_bias``, ``min_tokens``,
``allowed_token_ids``, ``n`` > 1, a grammar), chunked prefill and prefix hits, and each
retention policy. The first step is left out: an fp8 pool sets its scales from the first
batch's range once.
"""

from __future__ import annotations

import pytest
import torch

from kvserve import SamplingParams
from kvserve.kernels import host_device
from kvserve.kv.kivi_storage import KiviKVStorage
from kvserve.structured.params import StructuredOutputsParams
from tests.sync_audit import SyncAudit

PREFIX = [(5 * i) % 200 + 3 for i in range(24)]
PROMPTS = [PREFIX + [(7 * i + j) % 250 + 3 for i in range(6 + 5 * j)] for j in range(5)]
MIXED = [
    SamplingParams(temperature=0, max_tokens=10, logprobs=2),
    SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=3, max_tokens=10),
    SamplingParams(temperature=0.7, min_p=0.1, max_tokens=10, repetition_penalty=1.2,
                   presence_penalty=0.3, frequency_penalty=0.2),
    SamplingParams(temperature=0, max_tokens=10, logit_bias={5: 3.0}, min_tokens=4,
                   allowed_token_ids=list(range(3, 200)), logprobs=0),
    SamplingParams(temperature=1.0, max_tokens=10, seed=9, n=2),
]  # fmt: skip


def _audit_steps(llm) -> list[tuple[list, int, bool]]:  # noqa: ANN001
    """Run the engine's steps under the audit from its second step on: per step, what would
    wait for the device, the number of sanctioned downloads, and whether it sampled."""
    runner = llm.engine.executor.driver_worker.runner
    step, steps, count = runner.execute_model, [], [0]

    def audited(sched):  # noqa: ANN001, ANN202
        count[0] += 1
        if count[0] == 1:
            return step(sched)
        with SyncAudit() as audit:
            out = step(sched)
        steps.append((list(audit.syncs), audit.downloads, bool(out.req_ids)))
        return out

    runner.execute_model = audited
    return steps


def _check(steps: list[tuple[list, int, bool]]) -> None:
    assert len(steps) > 5
    for syncs, downloads, sampled in steps:
        assert syncs == []
        assert downloads == (1 if sampled else 0)


# Every format on the torch and CPU backends; Triton (in its slow interpreter here) on a
# dense and a KIVI pool, whose kernels differ the most; bf16 models, whose greedy rows are
# re-scored by the float32 LM head.
COMBOS = [
    (b, f, "float32") for b in ("torch", "cpu") for f in ("auto", "fp8_e4m3", "int8", "kivi4")
]
COMBOS += [("triton", "auto", "float32"), ("triton", "kivi4", "float32")]
COMBOS += [("torch", "auto", "bfloat16"), ("cpu", "auto", "bfloat16")]


@pytest.mark.parametrize(("backend", "fmt", "dtype"), COMBOS)
def test_a_step_reads_the_device_once(checkpoint, make_llm, backend, fmt, dtype):
    llm = make_llm(checkpoint("llama_gqa"), dtype=dtype, attention_backend=backend,
                   kv_cache_dtype=fmt, num_gpu_blocks=64, block_size=8,
                   max_num_batched_tokens=32, enable_prefix_caching=True)  # fmt: skip
    runner = llm.engine.executor.driver_worker.runner
    assert (runner._rescore(None) is not None) == (dtype == "bfloat16")
    steps = _audit_steps(llm)
    storage = runner.storage
    if fmt == "kivi4":  # the GPU's overlay of residual blocks (see the test below)
        storage.overlay_by_select = True
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], MIXED)
    assert all(len(c.token_ids) == 10 for o in outs for c in o.outputs)
    assert llm.engine.kv.stats.hits > 0
    _check(steps)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("spec", ["window:16", "sinks:4,window:16", "snapkv:24", "h2o:24"])
def test_retention_steps_read_the_device_once(checkpoint, make_llm, backend, spec):
    llm = make_llm(checkpoint("llama_gqa"), dtype="float32", attention_backend=backend,
                   num_gpu_blocks=64, block_size=8, kv_retention=spec)  # fmt: skip
    steps = _audit_steps(llm)
    prompts = [[(7 * i + j) % 250 + 3 for i in range(40 + j)] for j in range(3)]
    llm.generate([{"prompt_token_ids": p} for p in prompts],
                 SamplingParams(temperature=0, max_tokens=30))  # fmt: skip
    _check(steps)


def test_a_grammar_step_reads_the_device_once(make_llm):
    llm = make_llm("kvserve-ref", max_model_len=128, dtype="float32", attention_backend="torch")
    steps = _audit_steps(llm)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    params = [
        SamplingParams(temperature=0, max_tokens=24,
                       structured_outputs=StructuredOutputsParams(json=schema)),
        SamplingParams(temperature=0.8, seed=1, max_tokens=24, logprobs=1,
                       structured_outputs=StructuredOutputsParams(regex=r"[a-z]{4,12}")),
        SamplingParams(temperature=0, max_tokens=24),
    ]  # fmt: skip
    outs = llm.generate(["A JSON object:", "A word:", "Hello"], params)
    assert outs[0].outputs[0].text.startswith("{")
    _check(steps)


def test_kivi_overlays_residual_blocks_alike_by_select_and_by_picking():
    """A GPU's KIVI read overlays the blocks still filling (in their residual slots) by a
    select over every block, a CPU's by picking them: the same values, equal to the slot."""
    st = KiviKVStorage(2, 16, 4, 2, 8, torch.float32, bits=4, num_residual=4)
    torch.manual_seed(0)
    for layer in range(2):
        st.k_codes[layer].random_(0, 255)
        st.v_codes[layer].random_(0, 255)
        st.res_k[layer].normal_()
        st.res_v[layer].normal_()
    st.res_of_block[[5, 9]] = [2, 0]  # blocks 5 and 9 are filling, in slots 2 and 0
    st._sync_residual_map()
    blocks = torch.tensor([3, 5, 9, 5, 0, 12])  # a block twice, as shared tables give it
    for layer in range(2):
        st.overlay_by_select = False
        picked = st.dequantize_blocks(layer, blocks)
        st.overlay_by_select = True
        selected = st.dequantize_blocks(layer, blocks)
        for a, b in zip(picked, selected, strict=True):
            assert torch.equal(a, b)
        assert torch.equal(selected[0][1], st.res_k[layer][2])
        assert torch.equal(selected[0][3], st.res_k[layer][2])
        assert torch.equal(selected[1][2], st.res_v[layer][0])
        assert not torch.equal(selected[0][0], st.res_k[layer][2])


def test_the_audit_sees_each_kind_of_wait():
    """The audit itself: each kind of wait it is meant to catch, caught (so an empty record
    above means none happened)."""
    x = torch.randn(4, 8)
    cases = {
        "Tensor.tolist()": lambda: x.argmax(-1).tolist(),
        "aten._local_scalar_dense.default": lambda: bool(x.sum() > 0),
        "aten.nonzero.default": lambda: (x > 0).nonzero(),
        "aten.index.Tensor with a boolean mask": lambda: x[x > 0],
        "without output_size": lambda: torch.repeat_interleave(torch.tensor([1, 2])),
        "torch.tensor(data, device=...)": lambda: torch.tensor([1, 2], device="cpu"),
        "Tensor.to(device) without non_blocking": lambda: x.to("cpu"),
    }
    for what, run in cases.items():
        with SyncAudit() as audit:
            run()
        assert any(what in w for w, _ in audit.syncs), what
    with SyncAudit() as audit:
        host_device.to_host(x.argmax(-1), x[:, :2])
        host_device.to_device([1, 2], torch.device("cpu"))
        x.to("cpu", non_blocking=True)
    assert audit.syncs == [] and audit.downloads == 1


def test_one_packed_copy_gives_each_tensors_values():
    """The device path of to_host (every tensor in one float64 copy, cast back), run on CPU
    tensors against each tensor's own ``tolist``."""
    ids = torch.tensor([0, 3, 49_151, 2**40 + 7])
    lp = torch.tensor([-0.25, float("-inf"), -13.371, 0.0], dtype=torch.float32)
    top = torch.randn(4, 3).log_softmax(-1)
    idx = torch.randint(0, 50_000, (4, 3))
    mask = torch.tensor([[True, False], [False, True]])
    scalar = torch.tensor(5)
    tensors = (ids, lp, top, idx, mask, scalar)
    got = host_device._packed(tensors)
    assert got == [t.tolist() for t in tensors]
    assert [type(v[0]) for v in got[:4]] == [int, float, list, list]
