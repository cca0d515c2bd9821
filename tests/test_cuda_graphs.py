"""CUDA graphs' CPU-testable parts: capture sizes against vLLM's list, the bucket of a batch,
a decode batch padded with the null block (its real rows' logits equal to the runner's eager
path, on a CPU in float32; padded rows write only the null block), and eager on a CPU."""

from __future__ import annotations

import argparse

import numpy as np
import pytest
import torch

from kvserve.config import ConfigError, EngineConfig
from kvserve.engine_args import add_engine_args
from kvserve.llm import engine_config
from kvserve.sched.output import ScheduledSeq
from kvserve.worker.cuda_graphs import (
    DecodeInputs,
    StaticDecodeBatch,
    bucket_for,
    capture_sizes,
    clear_null_block,
    decode_metadata,
    default_capture_sizes,
    is_pure_decode,
    pad_decode_inputs,
    use_cuda_graphs,
)
from kvserve.worker.memory_profile import profile_forward
from kvserve.worker.model_runner import build_runner

# vLLM's capture sizes (vllm/worker/model_runner.py: _BATCH_SIZES_TO_CAPTURE =
# [1, 2, 4] + [_BATCH_SIZE_ALIGNMENT * i for i in range(1, 33)], alignment 8)
VLLM_SIZES = [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 72, 80, 88, 96, 104, 112, 120, 128,
              136, 144, 152, 160, 168, 176, 184, 192, 200, 208, 216, 224, 232, 240, 248,
              256]  # fmt: skip


def test_capture_sizes_follow_vllms_list_up_to_the_batch():
    assert list(default_capture_sizes(256)) == VLLM_SIZES
    assert list(default_capture_sizes(1000)) == VLLM_SIZES  # at most 256
    assert default_capture_sizes(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    assert default_capture_sizes(5) == (1, 2, 4, 8)  # a full batch of 5 has a bucket
    assert default_capture_sizes(1) == (1,)
    assert capture_sizes(64, "1,3,5") == (1, 3, 5)
    assert capture_sizes(64, None) == default_capture_sizes(64)


def test_cuda_graph_sizes_setting_is_canonical_and_checked():
    assert EngineConfig(model="m", cuda_graph_sizes="8, 2,2,1").cuda_graph_sizes == "1,2,8"
    assert EngineConfig(model="m", cuda_graph_sizes=[4, 1]).cuda_graph_sizes == "1,4"
    for bad in ("0", "1,x", "2000", "", [True]):
        with pytest.raises(ConfigError, match=r"cuda_graph_sizes: "):
            EngineConfig(model="m", cuda_graph_sizes=bad)


def test_cuda_graph_sizes_flag_takes_vllms_space_separated_list():
    p = argparse.ArgumentParser()
    add_engine_args(p)
    for argv, want in ((["--cuda-graph-sizes", "8", "2", "1"], "1,2,8"),
                       (["--cuda-graph-sizes", "4,1"], "1,4")):  # fmt: skip
        args = p.parse_args(argv)
        assert (
            EngineConfig(model="m", cuda_graph_sizes=args.cuda_graph_sizes).cuda_graph_sizes == want
        )
    assert p.parse_args([]).cuda_graph_sizes is None
    with pytest.raises(ConfigError, match=r"cuda_graph_sizes: .*\[1, 1024\]"):
        EngineConfig(
            model="m",
            cuda_graph_sizes=p.parse_args(["--cuda-graph-sizes", "2", "0"]).cuda_graph_sizes,
        )


def test_bucket_is_the_smallest_size_that_holds_the_batch():
    sizes = default_capture_sizes(64)
    assert [bucket_for(n, sizes) for n in (1, 2, 3, 4, 5, 8, 9, 17, 63, 64)] == [
        1, 2, 4, 4, 8, 8, 16, 24, 64, 64]  # fmt: skip
    assert bucket_for(65, sizes) is None  # past the largest: eager


def test_a_cpu_and_enforce_eager_run_eagerly(checkpoint):
    assert not use_cuda_graphs(torch.device("cpu"), False)
    assert not use_cuda_graphs(torch.device("cuda"), True)
    assert use_cuda_graphs(torch.device("cuda"), False)
    runner = build_runner(engine_config(checkpoint("llama_gqa")), 8, 64)
    assert runner.graphs is None and runner.cuda_graphs == ""


def test_padding_by_hand():
    x = DecodeInputs(np.array([7, 9]), np.array([5, 12]), np.array([21, 50]),
                     np.array([[5, 3, 8, 8], [12, 8, 8, 8]]), np.array([6, 3]),
                     np.array([0, 4], dtype=np.int32))  # fmt: skip
    p = pad_decode_inputs(x, 4, null=8, block_size=4)
    assert p.token_ids.tolist() == [7, 9, 0, 0] and p.positions.tolist() == [5, 12, 0, 0]
    assert p.slot_mapping.tolist() == [21, 50, 32, 32]  # the null block's first slot: 8 x 4
    assert p.block_tables.tolist() == [[5, 3, 8, 8], [12, 8, 8, 8]] + [[8] * 4] * 2
    assert p.seq_lens.tolist() == [6, 3, 1, 1] and p.windows.tolist() == [0, 4, 0, 0]
    with pytest.raises(ValueError, match="batch: 2 rows do not fit a bucket of 1"):
        pad_decode_inputs(x, 1, 8, 4)


BS, WIDTH = 4, 16  # tokens per block; blocks of a 64-token max_model_len


def _prefilled(checkpoint, backend):
    """A runner whose pool holds three prompts (5, 9 and 2 tokens), and their decode step."""
    cfg = engine_config(checkpoint("llama_gqa"), dtype="float32", block_size=BS,
                        attention_backend=backend)  # fmt: skip
    runner = build_runner(cfg, 24, 64)
    g = torch.Generator().manual_seed(0)
    lens, seqs, decode, nxt = (5, 9, 2), [], [], 0
    for i, n in enumerate(lens):
        blocks = list(range(nxt, nxt + -(-(n + 1) // BS)))
        nxt += len(blocks)
        toks = torch.randint(3, 300, (n + 1,), generator=g).tolist()
        seqs.append(ScheduledSeq(f"r{i}", toks[:n], 0, 0, blocks, (f"r{i}",)))
        decode.append(ScheduledSeq(f"r{i}", toks[n:], n, n, blocks, (f"r{i}",)))
    profile_forward(runner, seqs)  # the prefill: one forward, no sampling
    return runner, decode


def _pool(storage):
    return {k: [t.clone() for t in ts] for k, ts in storage.block_tensors().items()}


@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_padded_decode_keeps_real_rows_and_writes_only_the_null_block(checkpoint, backend):
    runner, decode = _prefilled(checkpoint, backend)
    assert is_pure_decode(decode, False, False)
    before = _pool(runner.storage)
    # the reference: the runner's eager path over the unpadded batch
    with torch.inference_mode():
        ids, pos, meta = runner._prepare(runner._order(decode))
        ref = runner.model.logits(runner.model(ids, pos, runner.storage, meta, None))
    after_ref = _pool(runner.storage)
    # restore the pool, then the padded batch (3 rows in a bucket of 8) through static buffers
    for k, ts in before.items():
        for t, saved in zip(runner.storage.block_tensors()[k], ts, strict=True):
            t.copy_(saved)
    null = runner.storage.null_block
    x = DecodeInputs.from_seqs(decode, BS, null, WIDTH)
    p = pad_decode_inputs(x, 8, null, BS)
    with torch.inference_mode():
        meta = decode_metadata(torch.from_numpy(p.slot_mapping), torch.from_numpy(p.block_tables),
                               torch.from_numpy(p.seq_lens), None, BS)  # fmt: skip
        hidden = runner.model(torch.from_numpy(p.token_ids), torch.from_numpy(p.positions),
                              runner.storage, meta, None)  # fmt: skip
        out = runner.model.logits(hidden)
    assert out.shape[0] == 8 and torch.isfinite(out).all()
    torch.testing.assert_close(out[:3], ref, rtol=1e-5, atol=1e-5)
    padded_wrote_null = False
    for k, ts in runner.storage.block_tensors().items():
        for layer, (t, r) in enumerate(zip(ts, after_ref[k], strict=True)):
            # every real block as the eager step left it: layer 0's K/V bit for bit (they
            # depend on the tokens alone), later layers' to float32 rounding
            if layer == 0:
                assert torch.equal(t[:null], r[:null])
            torch.testing.assert_close(t[:null], r[:null], rtol=1e-5, atol=1e-5)
            padded_wrote_null |= bool(t[null].abs().sum() > 0)
    assert padded_wrote_null  # ... and the padded rows' K/V went to the null block
    clear_null_block(runner.storage)
    assert all(t[null].abs().sum() == 0 for ts in runner.storage.block_tensors().values()
               for t in ts)  # fmt: skip


def test_static_buffers_replay_any_batch_size_like_the_eager_path(checkpoint):
    """What a graph replays (the static buffers' forward over a bucket), run eagerly on a
    CPU twice over one buffer set: two then three rows, each equal to the eager path."""
    runner, decode = _prefilled(checkpoint, "torch")
    null = runner.storage.null_block
    batch = StaticDecodeBatch(runner.model, runner.storage, 8, WIDTH, torch.device("cpu"), False)
    for n, bucket in ((2, 2), (3, 4)):
        before = _pool(runner.storage)
        with torch.inference_mode():
            ids, pos, meta = runner._prepare(runner._order(decode[:n]))
            ref = runner.model.logits(runner.model(ids, pos, runner.storage, meta, None))
        for k, ts in before.items():
            for t, saved in zip(runner.storage.block_tensors()[k], ts, strict=True):
                t.copy_(saved)
        x = DecodeInputs.from_seqs(decode[:n], BS, null, WIDTH)
        batch.fill(pad_decode_inputs(x, bucket, null, BS))
        with torch.inference_mode():
            _, logits = batch.forward(bucket)
        torch.testing.assert_close(logits[:n], ref, rtol=1e-5, atol=1e-5)
        assert all(t[null].abs().sum() == 0 for ts in runner.storage.block_tensors().values()
                   for t in ts)  # fmt: skip


def test_mixed_and_special_steps_stay_eager():
    d = ScheduledSeq("a", [1], 4, 4, [0, 1], ("a",))
    assert is_pure_decode([d, d], False, False)
    assert not is_pure_decode([], False, False)
    assert not is_pure_decode([d, ScheduledSeq("b", [1, 2], 0, 0, [2], ("b",))], False, False)
    assert not is_pure_decode([d], True, False)  # a hybrid model's groups
    assert not is_pure_decode([d], False, True)  # a layer-wise connector
    assert not is_pure_decode([ScheduledSeq("c", [1], 4, 4, [0, 1], ("c", "c2"))], False, False)
    assert not is_pure_decode([ScheduledSeq("s", [1], 9, 9, [0, 1, 2], ("s",), sinks=4,
                                            window=4)], False, False)  # fmt: skip
    with pytest.raises(ValueError, match="block_tables: a sequence holds 3 blocks"):
        DecodeInputs.from_seqs([ScheduledSeq("w", [1], 9, 9, [0, 1, 2], ("w",))], 4, 9, 2)


def test_the_runner_replays_decode_steps_and_matches_eager_generation(checkpoint, make_llm):
    """The runner's replay path end to end. On a CPU each "graph" replays by running the
    static buffers' forward, so the padding, staging, bucket choice and the runner's sampling
    from the replayed logits are exercised; with KVSERVE_TEST_DEVICE=cuda the engine captures
    real graphs. Either way greedy output equals the eager engine's (float32)."""
    from types import SimpleNamespace

    from kvserve import SamplingParams
    from kvserve.worker.cuda_graphs import CudaGraphRunner

    model = checkpoint("llama_gqa")
    prompts = [[5, 6, 7, 8, 9], [11, 12, 13], [40, 41, 42, 43, 44, 45, 46]]
    sps = [SamplingParams(temperature=0, max_tokens=n) for n in (9, 3, 6)]  # batches shrink
    eager = make_llm(model, dtype="float32", enforce_eager=True, max_num_seqs=4)
    ref = [o.outputs[0].token_ids for o in eager.generate(prompts, sps)]
    llm = make_llm(model, dtype="float32", max_num_seqs=4)
    runner = llm.engine.executor.driver_worker.runner
    if runner.device.type == "cuda":  # real capture: sizes 1, 2, 4 for max_num_seqs 4
        assert runner.graphs is not None and runner.graphs.sizes == (1, 2, 4)
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, sps)] == ref
        return
    batch = StaticDecodeBatch(runner.model, runner.storage, 4, WIDTH, torch.device("cpu"), False)
    graphs = CudaGraphRunner(batch, (1, 2, 4))
    replayed = []

    def replay(b):
        replayed.append(b)
        with torch.inference_mode():
            graphs.outputs[b] = batch.forward(b)

    graphs.graphs = {b: SimpleNamespace(replay=lambda b=b: replay(b)) for b in graphs.sizes}
    runner.graphs = graphs
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, sps)] == ref
    assert 4 in replayed and 2 in replayed and 1 in replayed  # 3 rows -> 4, then 2, then 1
