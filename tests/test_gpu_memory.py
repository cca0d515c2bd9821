"""The GPU pool's size under --gpu-memory-utilization: the arithmetic against hand-computed
numbers, the setting's range, the profiling batches and forward on a CPU, and the worker's
wiring from the profile to the pool (CUDA's counters replaced by known figures)."""

from __future__ import annotations

import pytest
import torch

from kvserve.config import CacheConfig, ConfigError, ModelConfig, SchedulerConfig
from kvserve.engine.sizing import DEFAULT_KV_CACHE_MEMORY, num_kv_blocks
from kvserve.kv.gpu_budget import GpuMemoryBudget, gpu_num_blocks
from kvserve.plan.capacity import capacity, load_arch
from kvserve.worker import memory_profile
from kvserve.worker.memory_profile import profile_batches, profile_forward

GIB = 2**30
# Llama-3.2-1B in bfloat16, 16-token blocks: 2 (K, V) x 16 layers x 8 KV heads x 64 x 2 bytes
# = 32,768 bytes a token, 524,288 a block.
BLOCK_1B = 2 * 16 * 8 * 64 * 2 * 16


def test_budget_on_an_80_gib_card_by_hand():
    b = GpuMemoryBudget(80 * GIB, 0.9, 2.5 * GIB, 1.25 * GIB, 0.5 * GIB, BLOCK_1B)
    # 72 GiB usable - 4.25 GiB = 67.75 GiB = 67.75 x 2048 blocks of 512 KiB
    assert b.kv_budget_bytes == 67.75 * GIB
    assert b.num_blocks == gpu_num_blocks(b) == 138_752
    text = b.describe()
    for part in ("80.00 GiB x 0.9", "2.50 weights", "1.25 activation peak", "0.50 non-torch",
                 "67.75 GiB for KV", "138,752 blocks of 524,288 bytes"):  # fmt: skip
        assert part in text
    # a format's fixed bytes come off the budget too; a partial block does not count
    fixed = GpuMemoryBudget(80 * GIB, 0.9, 2.5 * GIB, 1.25 * GIB, 0.5 * GIB, BLOCK_1B,
                            fixed_bytes=BLOCK_1B + 1)  # fmt: skip
    assert fixed.num_blocks == 138_750
    # utilization 1.0: the whole card
    assert GpuMemoryBudget(10 * GIB, 1.0, 0, 0, 0, GIB).num_blocks == 10


def test_nothing_left_is_an_error_naming_the_numbers():
    b = GpuMemoryBudget(16 * GIB, 0.5, 7 * GIB, 0.75 * GIB, 0.5 * GIB, BLOCK_1B)
    assert b.num_blocks == 0 and b.kv_budget_bytes == -0.25 * GIB
    with pytest.raises(
        ConfigError,
        match=r"gpu_memory_utilization: no room for a KV block of "
        r"524,288 bytes: 16.00 GiB x 0.5 .* 7.00 weights .* = -0.25 GiB",
    ):
        gpu_num_blocks(b)


@pytest.mark.parametrize("bad", [0, 0.0, -0.1, 1.01, 2, True, "0.9", float("nan")])
def test_utilization_outside_zero_one_is_refused_naming_the_field(bad):
    with pytest.raises(ConfigError, match=r"gpu_memory_utilization: must be in \(0, 1\]"):
        CacheConfig(gpu_memory_utilization=bad)


def test_cuda_leaves_the_pool_to_the_worker_and_a_cpu_keeps_its_rule():
    mc = ModelConfig(architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=2048,
                     intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=64, rms_norm_eps=1e-5,
                     max_position_embeddings=131072)  # fmt: skip
    cc, sc = CacheConfig(), SchedulerConfig()
    bpt = 32768.0
    args = (cc, sc, mc, "bfloat16", torch.bfloat16, 131072, bpt)
    assert num_kv_blocks(*args, torch.device("cuda")) is None
    # a CPU: 256 sequences of 131,072 tokens want more than 4 GiB: the cap, 8,192 blocks
    assert num_kv_blocks(*args, torch.device("cpu")) == DEFAULT_KV_CACHE_MEMORY // BLOCK_1B
    # a given size wins on either device
    assert num_kv_blocks(CacheConfig(num_gpu_blocks=7), *args[1:], torch.device("cuda")) == 7


def test_the_planner_applies_the_same_rule(tmp_path, checkpoint):
    spec = load_arch(checkpoint("llama_gqa"))
    bpt = capacity(spec, "float32", 1, 16).kv_bytes_per_token_per_gpu
    cap = capacity(spec, "float32", 8 * GIB, 64, gpu_memory_utilization=0.5, block_size=16)
    w = spec.weight_bytes(None)
    assert cap.num_blocks == GpuMemoryBudget(8 * GIB, 0.5, w, 0, 0, bpt * 16).num_blocks
    assert cap.num_blocks == int((4 * GIB - w) // (bpt * 16))  # by hand


def test_profile_batches_by_hand():
    # 2,048 tokens, 256 sequences, 128k context: one 2,048-token chunk, then 256 x 8
    (long,), split = profile_batches(2048, 256, 131072, 16)[0]
    assert long.num_tokens == 2048 and long.block_ids == list(range(128))
    assert [s.num_tokens for s in split] == [8] * 256
    assert split[0].block_ids == [0] and split[-1].block_ids == [255]
    assert profile_batches(2048, 256, 131072, 16)[1] == 256
    # 100 tokens, 3 sequences, 40-token context: 3 chunks either way, 34 + 33 + 33
    batches, used = profile_batches(100, 3, 40, 16)
    assert len(batches) == 1 and [s.num_tokens for s in batches[0]] == [34, 33, 33]
    assert [s.block_ids for s in batches[0]] == [[0, 1, 2], [3, 4, 5], [6, 7, 8]] and used == 9
    # every sequence samples (a logits row each) and starts a prompt
    assert all(s.sample_ids == (s.req_id,) and s.num_cached == 0 for s in batches[0])


def _runner(checkpoint, num_blocks, **kw):
    from kvserve.llm import engine_config
    from kvserve.worker.model_runner import build_runner

    cfg = engine_config(checkpoint("llama_gqa"), dtype="float32", **kw)
    return build_runner(cfg, num_blocks, 64)


def test_profile_forward_runs_on_a_cpu_and_writes_only_its_blocks(checkpoint):
    batches, used = profile_batches(40, 4, 64, 4)
    runner = _runner(checkpoint, used, block_size=4)
    for seqs in batches:
        profile_forward(runner, seqs)
    k = runner.storage.block_tensors()
    first = next(iter(k.values()))[0]  # layer 0, [blocks + 1, ...]
    assert first[:used].abs().sum() > 0  # the prompts' K/V were written
    assert first[runner.storage.null_block].abs().sum() == 0  # the null block never


def test_worker_sizes_its_pool_from_the_profile(checkpoint, monkeypatch):
    seen = {}

    def fake_measure(device, utilization, block_bytes, fixed_bytes, run_profile):
        seen["pool"] = run_profile()  # the profiling forward on its temporary pool
        seen["block_bytes"] = block_bytes
        return GpuMemoryBudget(GIB, utilization, 0.5 * GIB, 0.25 * GIB, 0, block_bytes,
                               fixed_bytes)  # fmt: skip

    monkeypatch.setattr(memory_profile, "measure_gpu_budget", fake_measure)
    runner = _runner(checkpoint, None, gpu_memory_utilization=0.8, max_num_batched_tokens=64,
                     max_num_seqs=4)  # fmt: skip
    mc = ModelConfig.from_pretrained(checkpoint("llama_gqa"))
    block = 2 * mc.num_hidden_layers * mc.num_key_value_heads * mc.head_dim * 4 * 16
    assert seen["block_bytes"] == block and seen["pool"] > 0
    fixed = runner.storage.fixed_nbytes()  # the null block
    want = int((0.8 * GIB - 0.75 * GIB - fixed) // block)
    assert runner.num_blocks == runner.storage.num_blocks == want
    assert "0.8 (gpu_memory_utilization)" in runner.memory_budget


def test_an_engine_takes_the_pool_its_worker_sized(checkpoint, monkeypatch, make_llm, caplog):
    """The engine's side on a CPU: where the sizing leaves the pool to the worker (as on
    CUDA), the KV manager gets the worker's count, the log the arithmetic, and greedy output
    is the same as with a pool sized up front."""
    from kvserve import SamplingParams
    from kvserve.engine import llm_engine

    def fake_measure(device, utilization, block_bytes, fixed_bytes, run_profile):
        run_profile()
        return GpuMemoryBudget(40 * block_bytes, 1.0, 0, 0, 0, block_bytes)

    model = checkpoint("llama_gqa")
    prompts = [[5, 6, 7, 8, 9], [11, 12, 13]]
    sp = SamplingParams(temperature=0, max_tokens=6)
    ref = [o.outputs[0].token_ids for o in make_llm(model, num_gpu_blocks=40).generate(prompts, sp)]
    monkeypatch.setattr(llm_engine, "num_kv_blocks", lambda *a, **k: None)
    monkeypatch.setattr(memory_profile, "measure_gpu_budget", fake_measure)
    with caplog.at_level("INFO", logger="kvserve"):
        llm = make_llm(model, max_num_batched_tokens=64)
    assert llm.engine.num_blocks == llm.engine.kv.num_blocks == 40
    assert "KV pool on cpu: 0.00 GiB x 1 (gpu_memory_utilization)" in caplog.text
    assert "= 40 blocks of" in caplog.text
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, sp)] == ref
