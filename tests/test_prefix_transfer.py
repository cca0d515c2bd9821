"""Blocks leave one pool and enter another bit for bit, for every KV format; a cached prefix
exported from one engine is a prefix-cache hit in another with the same greedy tokens; a
payload of another model, format or block size is refused. And the runner keeps RoPE
positions and cache indices apart."""

from __future__ import annotations

import pickle
import shutil

import pytest
import torch

from kvserve import SamplingParams
from kvserve.kv.formats import KV_FORMATS, make_kv_storage
from kvserve.kv.storage import KVFormatMismatch
from kvserve.sched.output import NewRequestData, ScheduledSeq, SchedulerOutput
from tests.conftest import prompts_of_lengths

FORMATS = list(KV_FORMATS)


def _fill(st, tables: list[list[int]], lens: list[int], seed: int = 0) -> None:  # noqa: ANN001
    """Write random K/V for sequences of ``lens`` tokens into their blocks, prefill then one
    decode token each (so KIVI holds quantized full blocks and residual partial ones)."""
    g = torch.Generator().manual_seed(seed)
    bs = st.block_size
    for layer_pass in (0, 1):
        for table, n in zip(tables, lens, strict=True):
            t = torch.tensor(table)
            pos = torch.arange(n - 1) if layer_pass == 0 else torch.tensor([n - 1])
            slots = t[pos // bs] * bs + pos % bs
            st.begin_step(slots)
            for layer in range(st.num_layers):
                kv = torch.randn(len(pos), st.num_kv_heads, st.head_dim, generator=g) * 2
                st.write(layer, slots, kv, -kv + 0.5)


@pytest.mark.parametrize("fmt", FORMATS)
def test_export_import_blocks_is_bit_exact(fmt):
    geo = (2, 24, 4, 2, 64)  # layers, blocks, block size, KV heads, head dim
    a = make_kv_storage(fmt, *geo, torch.float32)
    tables, lens = [[3, 7, 1], [10, 2]], [11, 6]  # 2 full + partial, 1 full + partial
    _fill(a, tables, lens)
    ids = [b for t in tables for b in t]
    payload = pickle.loads(pickle.dumps(a.export_blocks(ids)))
    b = make_kv_storage(fmt, *geo, torch.float32)
    dest = [20, 21, 22, 5, 6]
    b.import_blocks(dest, payload)
    src_t = torch.tensor(ids)
    dst_t = torch.tensor(dest)
    for name, ts in a.block_tensors().items():
        for layer, t in enumerate(ts):
            got = b.block_tensors()[name][layer][dst_t]
            want = t[src_t]
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (fmt, name, layer)
    for layer in range(geo[0]):  # and what the blocks decode to, residual rows included
        ka, va = a.gather(layer, src_t[None])
        kb, vb = b.gather(layer, dst_t[None])
        assert torch.equal(ka, kb) and torch.equal(va, vb)


def test_kivi_exports_partial_blocks_from_the_residual():
    a = make_kv_storage("kivi2", 1, 8, 4, 1, 64, torch.float32)
    _fill(a, [[2, 5]], [6])  # block 2 full (quantized), block 5 partial (residual)
    assert a.res_of_block[2] < 0 <= a.res_of_block[5]
    payload = a.export_blocks([2, 5])
    assert payload.extra["residual"] == [1]
    b = make_kv_storage("kivi2", 1, 8, 4, 1, 64, torch.float32)
    b.import_blocks([0, 1], payload)
    assert b.res_of_block[0] < 0 <= b.res_of_block[1]


@pytest.mark.parametrize("fmt", ["float32", "int8"])
def test_import_refuses_another_format_or_geometry(fmt):
    a = make_kv_storage(fmt, 1, 8, 4, 2, 16, torch.float32)
    _fill(a, [[1]], [3])
    payload = a.export_blocks([1])
    other = "int8" if fmt == "float32" else "float32"
    for b in (
        make_kv_storage(other, 1, 8, 4, 2, 16, torch.float32),
        make_kv_storage(fmt, 1, 8, 8, 2, 16, torch.float32),  # block size
        make_kv_storage(fmt, 2, 8, 4, 2, 16, torch.float32),  # layers
    ):
        before = [t.clone() for ts in b.block_tensors().values() for t in ts]
        with pytest.raises(KVFormatMismatch):
            b.import_blocks([0], payload)
        after = [t for ts in b.block_tensors().values() for t in ts]
        assert all(torch.equal(x, y) for x, y in zip(before, after, strict=True))


# -- between engines ---------------------------------------------------------------------------
KW = dict(dtype="float32", block_size=4, num_gpu_blocks=64, max_num_batched_tokens=32)


@pytest.mark.parametrize("fmt", FORMATS)
def test_export_prefix_is_a_hit_in_another_engine(make_llm, checkpoint, fmt):
    ckpt = checkpoint("llama_gqa")
    prefix, tail = prompts_of_lengths([24, 5], seed=9)
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    a = make_llm(ckpt, kv_cache_dtype=fmt, **KW)
    a.generate([{"prompt_token_ids": prefix}], sp)
    payload = pickle.loads(pickle.dumps(a.engine.export_prefix(prefix)))
    assert len(payload.hashes) == 24 // 4
    want = a.generate([{"prompt_token_ids": prefix + tail}], sp)[0]
    assert want.num_cached_tokens == 24

    b = make_llm(ckpt, kv_cache_dtype=fmt, **KW)
    assert b.engine.import_prefix(payload) == 6
    assert b.engine.kv.num_cached_free_blocks == 6 and b.engine.kv.num_used_blocks == 0
    got = b.generate([{"prompt_token_ids": prefix + tail}], sp)[0]
    assert got.num_cached_tokens == 24
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert b.engine.import_prefix(payload) == 0  # already cached: nothing placed twice


def test_import_prefix_refuses_another_model_format_or_block_size(make_llm, checkpoint, tmp_path):
    ckpt = checkpoint("llama_gqa")
    other_model = tmp_path / "other"
    shutil.copytree(checkpoint("llama_gqa", seed=11), other_model)  # same shapes, new weights
    (prefix,) = prompts_of_lengths([16], seed=2)
    a = make_llm(ckpt, **KW)
    a.generate([{"prompt_token_ids": prefix}], SamplingParams(max_tokens=1))
    payload = a.engine.export_prefix(prefix)
    for kwargs, field in (
        (dict(model=str(other_model)), "model"),
        (dict(kv_cache_dtype="int8"), "kv_format"),
        (dict(block_size=8), "block_size"),
    ):
        b = make_llm(**{"model": ckpt, **KW, **kwargs})
        with pytest.raises(ValueError, match=field):
            b.engine.import_prefix(payload)
        assert b.engine.kv.num_cached_free_blocks == 0


def test_fp8_payload_carries_its_scales(make_llm, checkpoint):
    """A fresh fp8 pool adopts the payload's calibrated scales; one calibrated differently
    refuses the payload instead of decoding the codes with the wrong scales."""
    ckpt = checkpoint("llama_gqa")
    kw = dict(KW, kv_cache_dtype="fp8", calculate_kv_scales=True)
    (prefix,) = prompts_of_lengths([16], seed=5)
    a = make_llm(ckpt, **kw)
    a.generate([{"prompt_token_ids": prefix}], SamplingParams(max_tokens=1))
    payload = a.engine.export_prefix(prefix)
    b = make_llm(ckpt, **kw)
    b.engine.import_prefix(payload)
    scales = zip(
        a.engine.executor.driver_worker.storage.k_scale,
        b.engine.executor.driver_worker.storage.k_scale,
        strict=True,
    )
    assert all(torch.equal(x, y) for x, y in scales)
    c = make_llm(ckpt, **kw)
    c.generate([{"prompt_token_ids": [x + 1 for x in prefix]}], SamplingParams(max_tokens=1))
    with pytest.raises(KVFormatMismatch, match="fp8 scales"):
        c.engine.import_prefix(payload)


# -- positions and cache indices are separate --------------------------------------------------
def test_runner_uses_positions_for_rope_and_cache_indices_for_the_cache(make_llm, checkpoint):
    """A step input whose RoPE positions start at 100 while its cache starts at entry 0:
    the prompt log-probs equal transformers' with position_ids 100.., so positions reach the
    rotary embedding and cache indices the slots and the attention, each on its own."""
    transformers = pytest.importorskip("transformers")
    ckpt = checkpoint("llama_gqa")
    llm = make_llm(ckpt, **KW)
    runner = llm.engine.executor.driver_worker.runner
    (ids,) = prompts_of_lengths([10], seed=1)
    hf = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    with torch.no_grad():
        ref = hf(torch.tensor([ids]), position_ids=torch.arange(100, 110)[None]).logits[0]
    ref = torch.log_softmax(ref.float(), dim=-1)
    params = SamplingParams(temperature=0, max_tokens=2)
    blocks = [7, 3, 12]
    steps = [
        ScheduledSeq("x", ids[:6], position=100, num_cached=0, block_ids=blocks,
                     num_prompt_logit_rows=6),
        ScheduledSeq("x", ids[6:9], position=106, num_cached=6, block_ids=blocks,
                     num_prompt_logit_rows=3),
        ScheduledSeq("x", ids[9:], position=109, num_cached=9, block_ids=blocks,
                     sample_ids=("x",), num_prompt_logit_rows=1),
    ]  # fmt: skip
    got = []
    for i, seq in enumerate(steps):
        new = [NewRequestData("x", ids, params, ())] if i == 0 else []
        out = runner.execute_model(SchedulerOutput(seqs=[seq], new_requests=new))
        got.append(out.prompt_logits["x"])
    torch.testing.assert_close(torch.cat(got).cpu(), ref, atol=1e-4, rtol=0)
    assert out.token_ids == [int(ref[-1].argmax())]
