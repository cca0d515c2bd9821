"""The simulator: its cost model against hand-computed figures and a naive sum, its fit against
the profile that generated the data, its decisions against the real engine's, and its GPU
figures against the planner's."""

from __future__ import annotations

import gc
import hashlib
import json
import math
import random
import re
from dataclasses import replace

import numpy as np
import pytest

from benchmarks.simulate_speed import LLAMA_8B
from kvserve.bench.runner import LoadSpec
from kvserve.bench.workloads import BenchRequest
from kvserve.engine_args import default_model
from kvserve.model.linear_ops import GEMM_NAMES
from kvserve.plan.capacity import PlanError, arch_from_config, bytes_per_token, capacity
from kvserve.plan.cost import decode_roofline
from kvserve.plan.gpus import get_gpu
from kvserve.sched.output import ScheduledSeq, SchedulerOutput
from kvserve.sched.request import SamplingParams
from kvserve.sim.cost import (
    EFFICIENCY_FIELDS,
    UNSEEN,
    ModelShape,
    Profile,
    ShapeCache,
    StepFeatures,
    _attended,
    _nnls,
    fit_profile,
    gpu_profile,
    step_features,
)
from kvserve.sim.engine import SimTarget, build_engine
from kvserve.sim.simulate import simulate_load
from kvserve.sim.tokenizer import HashTokenizer

SEED_8B = LLAMA_8B  # the seed's example shapes, as the speed benchmark simulates them


def shape_of(cfg: dict, fmt: str = "bfloat16", dtype: str = "bfloat16", tp: int = 1):
    spec = arch_from_config(cfg)
    return ModelShape.from_arch(spec, fmt, dtype, bool(cfg.get("tie_word_embeddings")), tp)


def cpu_profile(**kw) -> Profile:
    base = dict(device="test cpu", peak_flops=1e11, peak_bandwidth=2e10, source="test",
                dtype="float32", step_overhead_s=2e-3, per_seq_s=5e-5)  # fmt: skip
    return Profile(**{**base, **kw})


# -- the cost model -------------------------------------------------------------------------
@pytest.mark.parametrize("window", [None, 1, 7, 40, 1000])
def test_attended_equals_the_naive_sum(window):
    rng = random.Random(0)
    for _ in range(200):
        cached, n = rng.randrange(0, 60), rng.randrange(0, 40)
        naive = sum(min(cached + i + 1, window) if window else cached + i + 1 for i in range(n))
        assert _attended(cached, n, window) == pytest.approx(naive)


def test_step_features_hand_computed():
    cfg = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
           "vocab_size": 100, "intermediate_size": 128, "torch_dtype": "float32"}  # fmt: skip
    shape = shape_of(cfg, "float32", "float32")
    # layers: 2 x (2*64*64 + 2*64*32 + 3*64*128 + 2*64 norms) + final norm 64
    assert shape.layer_params == 2 * (8192 + 4096 + 24576 + 128) + 64
    assert shape.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4  # K+V x layers x heads x dim x 4 B
    out = SchedulerOutput(
        seqs=[
            ScheduledSeq("a", list(range(10)), 5, 5, [0, 1], sample_ids=("a",)),
            ScheduledSeq("b", [1], 20, 20, [2, 3], sample_ids=("b",)),
            ScheduledSeq("c", [1], 40, 40, [4, 5, 6], sample_ids=("c",), window=8),
        ]
    )
    f = step_features(out, shape)
    assert (f.seqs, f.prefill_seqs, f.tokens, f.sampled_rows) == (3, 1, 12, 3)
    assert f.linear_flops == 2 * (shape.layer_params * 12 + 100 * 64 * 3)
    # a: tokens 0..9 see 6..15 entries, per layer; 4 FLOPs x heads x dim per entry
    assert f.prefill_attention_flops == 2 * sum(range(6, 16)) * 4 * 4 * 16
    # b reads 21 entries, c its window of 8, in each of 2 layers, 256 bytes per layer-entry
    assert f.decode_kv_bytes == (21 + 8) * 2 * 256
    touched: set[int] = set()
    g = step_features(out, shape, touched, block_size=16)
    # a writes entries 5..14 (block 0), b entry 20 (its block 3), c entry 40 (its block 6)
    assert touched == {0, 3, 6}
    assert g.first_touch_bytes == 3 * 16 * shape.kv_bytes_per_token
    assert step_features(out, shape, touched, 16).first_touch_bytes == 0
    assert f.compact_bytes == 0
    # A SnapKV compaction at the prompt's end keeping 24 entries: each layer reads and writes
    # 24 entries of 256 bytes (K+V x 2 heads x 16 x 4 B), counted with the KV traffic.
    snap = ScheduledSeq("d", list(range(40)), 0, 0, [7, 8, 9], sample_ids=("d",),
                        compact=("snapkv", 24, 8, 7), compact_block_ids=[10, 11])  # fmt: skip
    h = step_features(SchedulerOutput(seqs=[snap]), shape)
    assert h.compact_bytes == 2 * 24 * 2 * 256
    prof = cpu_profile()
    plain = step_features(SchedulerOutput(seqs=[replace(snap, compact=(), compact_block_ids=())]),
                          shape)  # fmt: skip
    extra = prof.step_time(h, shape) - prof.step_time(plain, shape)
    copy_s = h.compact_bytes / (prof.peak_bandwidth * prof.decode_kv_efficiency)
    assert extra == pytest.approx(copy_s + prof.per_solo_seq_s)


def test_context_attention_is_the_naive_sum_over_cached_entries():
    """The part of a chunk's attention over entries cached before it, against a naive sum
    per token (windows honoured): token i of a chunk after ``c`` cached entries attends
    min(c + i + 1, w) entries, min(i + 1, w) of them its chunk's own."""
    cfg = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
           "vocab_size": 100, "intermediate_size": 128, "torch_dtype": "float32"}  # fmt: skip
    shape = shape_of(cfg, "float32", "float32")
    per_entry = 2 * 4 * 4 * 16  # layers x 4 FLOPs x heads x dim
    rng = random.Random(1)
    for _ in range(100):
        c, n = rng.randrange(0, 90), rng.randrange(2, 40)
        w = rng.choice([None, 4, 16, 64])
        seq = ScheduledSeq("a", [1] * n, c, c, list(range((c + n) // 16 + 1)), ("a",),
                           window=w or 0)  # fmt: skip
        f = step_features(SchedulerOutput(seqs=[seq]), shape)
        cap = w or 10**9
        every = sum(min(c + i + 1, cap) for i in range(n))
        own = sum(min(i + 1, cap) for i in range(n))
        assert f.prefill_attention_flops == pytest.approx(every * per_entry)
        assert f.context_attention_flops == pytest.approx((every - own) * per_entry)


def test_fit_gives_attention_over_cached_context_its_own_efficiency():
    """Steps whose prompt chunks follow cached context (prefix hits, earlier chunks), made by
    a profile whose attention over that context runs at a third of the rate of attention
    within a chunk: the fit recovers both; a profile file without the term reads the
    within-chunk rate for both; without context in the steps the two are the same."""
    cfg = json.loads((default_model_dir() / "config.json").read_text())
    shape = shape_of(cfg, "float32", "float32")
    truth = cpu_profile(step_overhead_s=3e-3, per_seq_s=4e-5, prefill_step_s=5e-4,
                        gemm_efficiency=0.6, prefill_attention_efficiency=0.6,
                        context_attention_efficiency=0.2, decode_kv_efficiency=0.4)  # fmt: skip
    rng = random.Random(2)
    steps = []
    for _ in range(500):
        seqs = [ScheduledSeq(f"d{i}", [1], 300, 300, list(range(20)), ("x",))
                for i in range(rng.randrange(1, 16))]  # fmt: skip
        if rng.random() < 0.6:
            c, n = rng.choice([0, 0, 16, 512, 2048]), rng.randrange(16, 512)
            seqs.append(ScheduledSeq("p", [1] * n, c, c, list(range((c + n) // 16 + 1)), ("p",)))
        f = step_features(SchedulerOutput(seqs=seqs), shape)
        steps.append((f, truth.step_time(f, shape)))
    assert sum(f.context_attention_flops > 0 for f, _ in steps) > 50
    fitted, _ = fit_profile(steps, shape, cpu_profile())
    assert fitted.prefill_attention_efficiency == pytest.approx(0.6, rel=0.05)
    assert fitted.context_attention_efficiency == pytest.approx(0.2, rel=0.05)
    data = fitted.to_json()
    del data["context_attention_efficiency"]
    old = Profile.from_json(data)
    assert old.context_attention_efficiency == old.prefill_attention_efficiency
    no_context = [(f, t) for f, t in steps if not f.context_attention_flops]
    alone, _ = fit_profile(no_context, shape, cpu_profile())
    assert alone.context_attention_efficiency == alone.prefill_attention_efficiency


def test_tensor_parallel_splits_work_and_adds_allreduce():
    one, two = shape_of(SEED_8B), shape_of(SEED_8B, tp=2)
    out = SchedulerOutput(seqs=[ScheduledSeq("a", [1] * 64, 0, 0, list(range(4)))])
    f1, f2 = step_features(out, one), step_features(out, two)
    assert f2.linear_flops == pytest.approx(f1.linear_flops / 2)
    assert two.weight_bytes == pytest.approx(one.weight_bytes / 2)
    assert f1.allreduce_bytes == 0
    # two all-reduces per layer of 64 tokens x 4096 x 2 bytes, ring factor 2 (tp-1)/tp = 1
    assert f2.allreduce_bytes == 2 * 32 * 64 * 4096 * 2


def test_nnls_meets_the_kkt_conditions():
    rng = np.random.default_rng(0)
    for _ in range(20):
        a = rng.normal(size=(30, 6))
        b = rng.normal(size=30)
        x = _nnls(a, b)
        grad = a.T @ (b - a @ x)
        assert (x >= 0).all()
        assert np.all(grad[x == 0] <= 1e-8)  # no zero variable could lower the residual
        assert np.allclose(grad[x > 0], 0, atol=1e-8)  # the free ones are at a minimum


def synthetic_steps(truth: Profile, shape: ModelShape, n: int, noise: float, seed: int = 0):
    """Steps shaped like a CPU engine's: decode batches of 1-64 at contexts up to 2k, and
    prefill chunks of up to 512 tokens beside them; times from ``truth`` times log-normal noise."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        seqs = [
            ScheduledSeq(f"d{i}", [1], ctx, ctx, list(range(ctx // 16 + 1)), sample_ids=("x",))
            for i in range(rng.randrange(1, 65))
            for ctx in [rng.randrange(16, 2048)]
        ]
        if rng.random() < 0.3:
            m = rng.randrange(16, 512)
            seqs.append(ScheduledSeq("p", [1] * m, 0, 0, list(range(m // 16 + 1)), ("p",)))
        f = step_features(SchedulerOutput(seqs=seqs), shape)
        out.append((f, truth.step_time(f, shape) * math.exp(rng.gauss(0, noise))))
    return out


def test_fit_recovers_the_profile_that_made_the_steps():
    cfg = json.loads((default_model_dir() / "config.json").read_text())
    shape = shape_of(cfg, "float32", "float32")
    truth = cpu_profile(
        step_overhead_s=3e-3, per_seq_s=4e-5, prefill_step_s=5e-4, gemm_efficiency=0.6,
        weight_read_efficiency=0.5, prefill_attention_efficiency=0.3, decode_kv_efficiency=0.4,
    )  # fmt: skip
    train = synthetic_steps(truth, shape, 600, noise=0.05)
    fitted, report = fit_profile(train, shape, cpu_profile())
    assert report.total_time_error == pytest.approx(0.0, abs=1e-9)  # scaled to the sum
    assert report.median_abs_error < 0.06
    test = synthetic_steps(truth, shape, 300, noise=0.0, seed=1)
    pred = np.array([fitted.step_time(f, shape) for f, _ in test])
    real = np.array([t for _, t in test])
    assert np.median(np.abs(pred / real - 1)) < 0.05
    assert abs(pred.sum() / real.sum() - 1) < 0.05
    assert fitted.step_overhead_s == pytest.approx(3e-3, rel=0.25)
    assert fitted.decode_kv_efficiency == pytest.approx(0.4, rel=0.25)


def test_fit_gives_large_steps_their_own_gemm_efficiency():
    """An engine whose steps of 128+ tokens take another GEMM path (UpcastOps: a bf16 model's
    float32 GEMMs on a CPU without AMX) runs them at another efficiency. Steps made by such a
    profile: the fit recovers both efficiencies and predicts held-out steps; a one-path fit
    of the same steps misses the large ones."""
    cfg = json.loads((default_model_dir() / "config.json").read_text())
    shape = shape_of(cfg, "float32", "float32")
    truth = cpu_profile(
        step_overhead_s=3e-3, per_seq_s=4e-5, prefill_step_s=5e-4, gemm_efficiency=0.3,
        weight_read_efficiency=0.5, prefill_attention_efficiency=0.3, decode_kv_efficiency=0.4,
        large_step_tokens=128, gemm_efficiency_large=0.9,
    )  # fmt: skip
    train = synthetic_steps(truth, shape, 600, noise=0.05)
    assert sum(f.tokens >= 128 for f, _ in train) > 100
    fitted, _ = fit_profile(train, shape, cpu_profile(large_step_tokens=128), 1e11)
    assert fitted.large_step_tokens == 128
    assert fitted.gemm_efficiency_large == pytest.approx(0.9, rel=0.2)
    assert fitted.gemm_efficiency == pytest.approx(0.3, rel=0.2)
    one_path, _ = fit_profile(train, shape, cpu_profile())
    test = [(f, t) for f, t in synthetic_steps(truth, shape, 300, noise=0.0, seed=1)
            if f.tokens >= 128]  # fmt: skip
    real = np.array([t for _, t in test])
    two = np.array([fitted.step_time(f, shape) for f, _ in test])
    one = np.array([one_path.step_time(f, shape) for f, _ in test])
    assert np.median(np.abs(two / real - 1)) < 0.05
    assert np.median(np.abs(one / real - 1)) > 2 * np.median(np.abs(two / real - 1))
    # The other path's own peak bounds its efficiency (here: no faster than peak_flops / 2,
    # but for the few percent of the summed-time correction applied to every term).
    capped, _ = fit_profile(train, shape, cpu_profile(large_step_tokens=128), 0.5e11)
    assert capped.gemm_efficiency_large < 0.55


def default_model_dir():
    from pathlib import Path

    return Path(default_model())


def test_fit_refuses_too_few_or_bad_steps():
    shape = shape_of(SEED_8B)
    f = StepFeatures(seqs=1, tokens=1, sampled_rows=1, linear_flops=1e9)
    with pytest.raises(ValueError, match="at least 8"):
        fit_profile([(f, 0.01)] * 3, shape, cpu_profile())
    with pytest.raises(ValueError, match="> 0"):
        fit_profile([(f, 0.01)] * 8 + [(f, 0.0)], shape, cpu_profile())


def test_profile_file_round_trip_and_errors(tmp_path):
    p = gpu_profile(get_gpu("h100-sxm"))
    path = p.save(tmp_path / "h100.json")
    assert Profile.load(path) == p
    data = p.to_json()
    for bad, match in (
        ({**data, "speed": 2}, "unknown fields \\['speed'\\]"),
        ({k: v for k, v in data.items() if k != "peak_flops"}, "missing field 'peak_flops'"),
        ({**data, "gemm_efficiency": 0}, "gemm_efficiency must be > 0"),
        ({**data, "per_seq_s": -1}, "per_seq_s must be >= 0"),
        ({**data, "large_step_tokens": -1}, "large_step_tokens must be an integer >= 0"),
        ({**data, "large_step_tokens": 64.5}, "large_step_tokens must be an integer >= 0"),
        ({**data, "shape_cache_entries": -2}, "shape_cache_entries must be an integer >= 0"),
        ({**data, "shape_state_rows": {"qkv": 0}}, "shape_state_rows must map GEMM names"),
        ({**data, "shape_state_rows": {"attn": 1}}, "shape_state_rows must map GEMM names"),
        ({**data, "shape_state_rows": [1]}, "shape_state_rows must map GEMM names"),
        ({**data, "inline_host_loads": "yes"}, "inline_host_loads must be true or false"),
        ({**data, "new_shape_s": -1e-3}, "new_shape_s must be >= 0"),
        ({**data, "gemm_efficiency_large": 0}, "gemm_efficiency_large must be > 0"),
        ({**data, "loop_gap_s": -1e-4}, "loop_gap_s must be >= 0 seconds"),
        ({**data, "request_overhead_s": "fast"}, "request_overhead_s must be >= 0 seconds"),
        ({**data, "version": 99}, "version 99"),
    ):
        (tmp_path / "bad.json").write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=match):
            Profile.load(tmp_path / "bad.json")
    # a profile without the loop term: read, the loop charged nothing
    older = {k: v for k, v in data.items() if k != "loop_gap_s"}
    assert Profile.from_json({**older, "loop_gap_s": 2e-4}).loop_gap_s == 2e-4
    assert Profile.from_json(older).loop_gap_s == 0.0
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="invalid JSON"):
        Profile.load(tmp_path / "bad.json")
    with pytest.raises(FileNotFoundError, match="profile: file not found"):
        Profile.load(tmp_path / "missing.json")


def test_a_saved_gpu_profile_sizes_the_pool_as_its_gpu(tmp_path, llama8b):
    """A shipped profile saved and edited (a what-if) and given without --gpu: the pool is
    the planner's for that GPU, not the engine's default CPU pool; a CPU profile names no
    GPU and sizes nothing."""
    from argparse import Namespace

    from kvserve.sim.cli import sim_target

    gpu = get_gpu("h100-sxm")
    edited = replace(gpu_profile(gpu), tier_bandwidth={"redis": 1e10})
    args = Namespace(gpu=None, profile=str(edited.save(tmp_path / "what-if.json")), tp=1,
                     replicas=1, gpu_memory_utilization=0.9, router="round_robin")  # fmt: skip
    target = sim_target(args, {"model": llama8b})
    assert target.gpu == gpu
    plan = capacity(arch_from_config(SEED_8B), "bfloat16", gpu.memory_bytes, 32768)
    assert build_engine(target).num_blocks == plan.num_blocks
    args.profile = str(cpu_profile().save(tmp_path / "cpu.json"))
    assert sim_target(args, {"model": llama8b}).gpu is None


def test_hash_tokenizer_keeps_shared_prefixes():
    tok = HashTokenizer(1000)
    a, b = tok.encode("The cache block, the model."), tok.encode("The cache block, the end")
    assert a[:4] == b[:4] and len(a) == 7 and all(3 <= t < 1000 for t in a)
    assert HashTokenizer(1000).encode("The cache block") == a[:3]  # stable across instances
    digest = hashlib.blake2b(b"cache", digest_size=8).digest()  # the documented id formula
    assert tok.encode("cache cache") == [3 + int.from_bytes(digest, "little") % 997] * 2
    for text in ("", "a, b; c.", "The cache block, the model.\nUser: hi", "x" * 50 + " y"):
        assert tok.count(text) == len(tok.encode(text))


# -- the real scheduler ----------------------------------------------------------------------
def decisions(core_step, engine, prompts, max_tokens):
    """Every step's (request, tokens computed) and preemptions, for prompts sent at once."""
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, SamplingParams(
            max_tokens=max_tokens, ignore_eos=True), arrival_time=0.0)  # fmt: skip
    seen = []
    while engine.has_unfinished_requests():
        core_step()
        last = engine.core.last_step
        seen.append(([(s.req_id, s.num_tokens) for s in last.seqs], list(last.preempted_req_ids)))
    return seen


def run_both(make_llm, prompts):
    kw = dict(model=default_model(), num_gpu_blocks=24, max_num_seqs=6,
              max_num_batched_tokens=64)  # fmt: skip
    real = make_llm(**kw).engine
    sim = build_engine(SimTarget(kw, cpu_profile())).engine
    return decisions(real.step, real, prompts, 24), decisions(sim.core.step, sim, prompts, 24)


def test_simulator_makes_the_real_engines_decisions_and_follows_a_scheduling_change(
    make_llm, monkeypatch
):
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 4000) for _ in range(rng.randrange(20, 90))] for _ in range(10)]
    prompts[5] = prompts[0][:40] + prompts[5]  # a prefix hit
    real, sim = run_both(make_llm, prompts)
    assert any(pre for _, pre in real), "the trace should preempt"
    assert sim == real
    # Serve the waiting queue newest first: the real engine changes, and the simulator with it.
    from kvserve.sched.waiting import WaitingQueue

    order = WaitingQueue.order
    monkeypatch.setattr(WaitingQueue, "order", lambda self, kv: order(self, kv)[::-1])
    real_lifo, sim_lifo = run_both(make_llm, prompts)
    assert real_lifo != real
    assert sim_lifo == real_lifo


def test_simulated_open_loop_times_follow_the_profile():
    """One request on an idle engine: TTFT is the accept cost plus one prefill step, E2E adds
    one decode step per further token, all from the profile's own formula."""
    kw = dict(model=default_model(), num_gpu_blocks=64)
    prof = cpu_profile(request_overhead_s=1e-3)
    sim = build_engine(SimTarget(kw, prof))
    prompt = "The cache block model server request queue latency"
    ids = sim.encode(prompt)
    req = BenchRequest(0, "chat", prompt, 5, len(ids))
    res, (eng,) = simulate_load(SimTarget(kw, prof), [req], LoadSpec(1.0), seed=0)
    (rec,) = res.records
    shape = eng.shape
    pre = step_features(
        SchedulerOutput(seqs=[ScheduledSeq("a", ids, 0, 0, [0, 1, 2, 3], ("a",))]), shape
    )
    first = prof.step_time(pre, shape)
    assert rec.success and rec.output_tokens == 5
    assert rec.ttft == pytest.approx(1e-3 + first)
    decode = [
        prof.step_time(step_features(SchedulerOutput(seqs=[ScheduledSeq(
            "a", [1], len(ids) + k, len(ids) + k, [0, 1, 2, 3], ("a",))]), shape), shape)
        for k in range(4)
    ]  # fmt: skip
    assert rec.e2e == pytest.approx(1e-3 + first + sum(decode))


@pytest.mark.parametrize("prefault", [False, True])
def test_a_prefaulted_pool_pays_no_first_touch(prefault):
    """A CPU profile charges a pool block's first write; an engine started with
    kv_cache_prefault faulted every page in at start, so its first prefill pays nothing."""
    kw = dict(model=default_model(), num_gpu_blocks=64, kv_cache_prefault=prefault)
    prof = cpu_profile(request_overhead_s=1e-3, first_touch_s_per_byte=1e-8)
    sim = build_engine(SimTarget(kw, prof))
    prompt = "The cache block model server request queue latency"
    ids = sim.encode(prompt)
    req = BenchRequest(0, "chat", prompt, 1, len(ids))
    res, (eng,) = simulate_load(SimTarget(kw, prof), [req], LoadSpec(1.0), seed=0)
    shape = eng.shape
    pre = step_features(
        SchedulerOutput(seqs=[ScheduledSeq("a", ids, 0, 0, [0, 1, 2, 3], ("a",))]), shape
    )
    assert pre.first_touch_bytes == 0  # no touched set given: nothing charged
    blocks = -(-len(ids) // 16)
    touch = 0.0 if prefault else blocks * 16 * shape.kv_bytes_per_token * 1e-8
    assert res.records[0].ttft == pytest.approx(1e-3 + prof.step_time(pre, shape) + touch)


# -- GPU scale -------------------------------------------------------------------------------
@pytest.fixture
def llama8b(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(SEED_8B))
    return str(tmp_path)


def test_h100_pool_and_concurrency_ceiling_match_the_planner(llama8b):
    gpu = get_gpu("h100-sxm")
    spec = arch_from_config(SEED_8B)
    plan = capacity(spec, "bfloat16", gpu.memory_bytes, 32768)
    target = SimTarget(dict(model=llama8b, admission="projected", admission_watermark=0.0,
                            max_num_batched_tokens=8192), gpu_profile(gpu), gpu)  # fmt: skip
    sim = build_engine(target)
    assert sim.num_blocks == plan.num_blocks
    eng = sim.engine
    for i in range(plan.max_concurrent_sequences + 4):
        prompt = {"prompt_token_ids": [5 + i] + [7] * (32768 - 257)}
        eng.add_request(f"r{i}", prompt, SamplingParams(max_tokens=256, ignore_eos=True), 0.0)
    most = 0
    eng.core.step_hooks.clear()  # 29k-block pool: skip the per-step invariant walk here
    while eng.has_unfinished_requests():
        eng.core.step()
        most = max(most, len(eng.core.scheduler.running))
    assert most == plan.max_concurrent_sequences == 14


def test_h100_decode_stays_under_the_roofline(llama8b):
    gpu = get_gpu("h100-sxm")
    spec = arch_from_config(SEED_8B)
    target = SimTarget(dict(model=llama8b, max_num_batched_tokens=8192), gpu_profile(gpu), gpu)
    sim = build_engine(target)
    eng = sim.engine
    eng.core.step_hooks.clear()
    for i in range(8):
        prompt = {"prompt_token_ids": [5 + i] + [7] * (32768 - 257)}
        eng.add_request(f"r{i}", prompt, SamplingParams(max_tokens=256, ignore_eos=True), 0.0)
    rates = []
    while eng.has_unfinished_requests():
        before = sim.clock.now
        eng.core.step()
        last = eng.core.last_step
        if last.num_decode_tokens == 8 and not last.num_prefill_tokens:
            rates.append(8 / (sim.clock.now - before))
    roof = decode_roofline(spec, gpu, bytes_per_token(spec, "bfloat16"),
                           spec.weight_bytes(), 8, 32768)  # fmt: skip
    assert len(rates) > 200
    assert max(rates) <= roof.tokens_per_s
    assert min(rates) >= 0.5 * roof.tokens_per_s  # typical engines reach 50-80 % of it


def test_bad_config_gpu_and_target_flags(tmp_path, llama8b):
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(PlanError, match="num_hidden_layers"):
        build_engine(SimTarget(dict(model=str(tmp_path / "bad")), gpu_profile(get_gpu("l4"))))
    with pytest.raises(ValueError, match="gpu: unknown 'h900'"):
        get_gpu("h900")
    with pytest.raises(ValueError, match="tp: tensor parallelism is simulated on a --gpu"):
        SimTarget(dict(model=llama8b), cpu_profile(), tp=2)
    with pytest.raises(ValueError, match="replicas: must be an integer >= 1"):
        SimTarget(dict(model=llama8b), cpu_profile(), replicas=0)
    l4 = get_gpu("l4")  # 24 GB: 16 GB of weights fit; at tp=1 on a 16 GB part they would not
    small = get_gpu("custom:12:0.3:100")
    with pytest.raises(PlanError, match="leave no KV room"):
        build_engine(SimTarget(dict(model=llama8b), gpu_profile(l4), small))


def test_cli_calibrate_then_simulate_the_same_workload(tmp_path, capsys):
    """A calibration on the real engine writes a profile with every probe it promises, and
    the simulator runs the same workload (and its tiers) on it."""
    from kvserve.cli import main

    prof = tmp_path / "cpu.json"
    common = ["--workload", "chat", "--num-prompts", "16", "--length-scale", "0.25",
              "--kv-cache-memory", "16MiB", "--no-progress"]  # fmt: skip
    assert main(["simulate", "--calibrate", "--profile-output", str(prof), *common]) == 0
    printed = capsys.readouterr().out
    assert "calibrated on" in printed
    p = Profile.load(prof)
    assert p.calibration["steps"] >= 8 and p.peak_flops > 0 and p.peak_bandwidth > 0
    solo = p.calibration["solo_prefills"]  # prefilled alone before the workload
    assert len(solo) == 3 and solo == sorted(solo) and solo[-1] <= 2048  # the default budget
    # Each solo prompt continued by 64 and 256 new tokens after its cached blocks, where the
    # context allows (the bundled model's 4,096 positions take all six).
    assert [tuple(c) for c in p.calibration["context_chunks"]] == [
        (n, extra) for n in solo for extra in (64, 256)
    ]
    # Then decodes of four sequences over a long context and over 64 tokens, one over the
    # long one (16 MiB of the bundled model's 64 KiB blocks: 255 of 16 tokens and the null
    # block; half is 2,040 tokens, 510 a sequence, 494 to prompt, 480 block-aligned).
    assert [tuple(c) for c in p.calibration["decode_probes"]] == [(4, 480), (4, 64), (1, 480)]
    # A term the runs never exercised keeps the marker itself (not the marker rescaled by
    # the summed-time fit), and the CLI names it.
    for f in EFFICIENCY_FIELDS:
        v = getattr(p, f)
        assert v == UNSEEN or 0 < v < 1e3, (f, v)
        assert (f in printed) == (v == UNSEEN)
    assert p.calibration["total_time_error"] == pytest.approx(0.0, abs=1e-6)
    out = tmp_path / "out"
    args = ["simulate", "--profile", str(prof), *common, "--output-dir", str(out), "--label", "s"]
    assert main(args) == 0
    s = json.loads((out / "s.json").read_text())["summary"]
    assert s["completed"] == 16
    # How close the simulated duration lands to the real one is a speed figure, measured by
    # benchmarks/simulator.py on a quiet machine; here only that the run was simulated.
    assert s["duration_s"] > 0
    # The calibration measured the host and disk tier paths, so tiers simulate on it.
    for tier in ("cpu", "disk"):
        assert 0 < p.tier_bandwidth[tier] < math.inf and 0 <= p.tier_latency_s[tier] < 1
    capsys.readouterr()
    assert main([*args, "--kv-offload-cpu", "64MiB", "--label", "t"]) == 0
    assert "offload tier hits" in capsys.readouterr().out
    assert json.loads((out / "t.json").read_text())["summary"]["completed"] == 16


def test_decode_probes():
    """Four sequences over the longest block-aligned context that four fit in half the pool
    (16 tokens each left to decode) and over 64 tokens, and one over the long context; none
    where the long context would be under twice the short one."""
    from kvserve.sim.calibrate import decode_probes

    # 1,000 blocks of 16: half the pool 8,000 tokens, 2,000 a sequence, 1,984 to prompt
    assert decode_probes(4096, 1000, 16) == [(4, 1984), (4, 64), (1, 1984)]
    assert decode_probes(1000, 1000, 16) == [(4, 976), (4, 64), (1, 976)]  # the context
    assert decode_probes(4096, 40, 16) == []  # 80 tokens a sequence: 64, not over 128


def test_solo_prefill_lengths():
    """Quarter, half and whole of the smallest of the step budget, the context less the
    sampled token and half the pool; lengths under 16 tokens are left out."""
    from kvserve.sim.calibrate import solo_prefill_lengths

    assert solo_prefill_lengths(2048, 4096, 255, 16) == [510, 1020, 2040]  # half the pool
    assert solo_prefill_lengths(2048, 4096, 1000, 16) == [512, 1024, 2048]  # the budget
    assert solo_prefill_lengths(8192, 301, 1000, 16) == [75, 150, 300]  # the context
    assert solo_prefill_lengths(2048, 4096, 4, 16) == [16, 32]  # 32 tokens of room: no 8


def test_closed_loop_keeps_its_users_busy_and_counts_a_refused_request():
    """Two users: never more than two requests in flight, each user's next request sent
    when its last one ended; a prompt longer than the context is refused and its user
    moves on."""
    kw = dict(model=default_model(), num_gpu_blocks=64, max_model_len=256)
    words = "the cache block model server request queue latency ".split()
    reqs = [BenchRequest(i, "chat", " ".join(words[: 2 + i % 6]), 4 + i % 3, 8) for i in range(9)]
    reqs[4] = BenchRequest(4, "chat", "token " * 400, 4, 400)  # over max_model_len
    res, _ = simulate_load(SimTarget(kw, cpu_profile()), reqs, LoadSpec(concurrency=2), 0)
    recs = sorted(res.records, key=lambda r: r.index)
    assert [r.success for r in recs] == [i != 4 for i in range(9)]
    assert recs[4].reason == "refused (InvalidRequestError)" and "max_model_len" in recs[4].detail
    ok = [r for r in recs if r.success]
    for r in ok:  # at each send, at most one other request is still running
        running = [o for o in ok if o is not r and o.send_time <= r.send_time < o.send_time + o.e2e]
        assert len(running) <= 1
    ends = sorted(r.send_time + r.e2e for r in ok)
    sends = sorted(r.send_time for r in ok)
    assert sends[:2] == [0.0, 0.0]
    assert all(any(abs(s - e) < 1e-9 for e in ends) for s in sends[2:])


def test_gpu_pool_follows_the_compute_dtype_as_the_engine_does():
    """A float32 checkpoint run in bfloat16 stores bfloat16 KV ("auto"): the pool is what
    `kvserve plan --dtype bfloat16 --kv-cache-dtype bfloat16` counts, twice the float32 one."""
    from kvserve.plan.capacity import load_arch

    gpu = get_gpu("custom:2:1:100")
    spec = load_arch(default_model())
    assert spec.torch_dtype == "float32"
    sim = build_engine(SimTarget(dict(model=default_model(), dtype="bfloat16"),
                                 gpu_profile(gpu), gpu))  # fmt: skip
    want = capacity(spec, "bfloat16", gpu.memory_bytes, 4096, weight_dtype="bfloat16")
    assert sim.engine.kv_cache_dtype == "bfloat16"
    assert sim.num_blocks == want.num_blocks
    f32 = capacity(spec, "float32", gpu.memory_bytes, 4096, weight_dtype="float32")
    assert sim.num_blocks > 1.9 * f32.num_blocks


def test_replicas_split_the_load_and_tp_splits_the_step(llama8b):
    """Two replicas behind round-robin take half the requests each, so a prefill-bound trace
    sent at once takes about half as long (a weight-bound decode would not: a bigger batch
    costs a GPU almost nothing); tp=2 makes a decode step faster than tp=1 but not twice as
    fast (the all-reduces and the step's fixed cost stay)."""
    gpu = get_gpu("h100-sxm")
    words = "the cache block model server request queue latency market price".split()
    reqs = [BenchRequest(i, "doc", f"{i} " + " ".join(words) * 400, 2, 4000) for i in range(32)]
    one, (e1,) = simulate_load(SimTarget(dict(model=llama8b), gpu_profile(gpu), gpu),
                               reqs, LoadSpec(), 0)  # fmt: skip
    two, sims = simulate_load(SimTarget(dict(model=llama8b), gpu_profile(gpu), gpu,
                                        replicas=2), reqs, LoadSpec(), 0)  # fmt: skip
    assert [len(s.engine.core.scheduler.requests) for s in sims] == [0, 0]
    assert sum(s.runner.steps for s in sims) > e1.runner.steps
    assert all(r.success for r in two.records) and len(two.records) == 32
    assert 0.4 < two.duration / one.duration < 0.65
    q = "prefix_cache_queries_total"
    assert two.after[q] - two.before[q] == one.after[q] - one.before[q]  # fleet totals
    decode = SchedulerOutput(seqs=[ScheduledSeq(f"r{i}", [1], 4096, 4096, list(range(257)),
                                                (f"r{i}",)) for i in range(16)])  # fmt: skip
    prof = gpu_profile(gpu)
    t1 = prof.step_time(step_features(decode, shape_of(SEED_8B)), shape_of(SEED_8B))
    s2 = shape_of(SEED_8B, tp=2)
    t2 = prof.step_time(step_features(decode, s2), s2)
    assert 0.5 * t1 < t2 < 0.8 * t1


def test_replay_leaves_no_cyclic_garbage_and_restores_the_collector():
    """The replay turns the collector off on the premise that a step makes no reference
    cycles: a preempting, prefix-sharing run leaves none to collect, and the collector's
    settings are back as they were afterwards (off here, on after a run that began on)."""
    kw = dict(model=default_model(), num_gpu_blocks=24, max_model_len=256)
    words = "the cache block model server request queue latency ".split()
    reqs = [BenchRequest(i, "chat", " ".join(words * 4) + f" {i}", 40, 40) for i in range(12)]
    threshold = gc.get_threshold()
    gc.collect()
    gc.disable()
    try:
        res, (sim,) = simulate_load(SimTarget(kw, cpu_profile()), reqs, LoadSpec(), 0)
        still_off = not gc.isenabled()
        leaked = gc.collect()
    finally:
        gc.enable()
    assert still_off
    simulate_load(SimTarget(kw, cpu_profile()), reqs[:2], LoadSpec(), 0)
    assert gc.isenabled()
    assert all(r.success for r in res.records)
    assert sim.engine.core.scheduler.stats.num_preemptions > 0  # the pool is too small
    assert leaked == 0
    assert gc.get_threshold() == threshold and gc.get_freeze_count() == 0


def test_hash_tokenizer_count_and_ids_follow_the_pattern_on_any_text():
    """The ASCII count and the word-wise ids match the pattern's pieces and the documented id
    formula: every ASCII character (controls, punctuation, underscores, digits, odd
    whitespace) and some non-ASCII, at random."""
    tok = HashTokenizer(1000)
    alphabet = [chr(i) for i in range(128)] + list("é€ü—\u00a0\u3000字")
    rng = random.Random(4)
    for k in range(400):
        chars = alphabet[:128] if k % 2 else alphabet
        text = "".join(rng.choice(chars) for _ in range(rng.randrange(0, 60)))
        pieces = re.findall(r"\w+|[^\w\s]", text)
        assert tok.count(text) == max(1, len(pieces)), repr(text)
        ids = [3 + int.from_bytes(hashlib.blake2b(p.encode(), digest_size=8).digest(), "little")
               % 997 for p in pieces]  # fmt: skip
        assert tok.encode(text) == (ids or [3]), repr(text)


def test_speed_benchmark_times_every_phase_of_a_real_run(llama8b, tmp_path):
    from benchmarks.simulate_speed import PHASES, one_run

    t = one_run(str(llama8b), "chat", 6, 40.0, str(tmp_path))
    assert set(t) == set(PHASES) and all(v >= 0 for v in t.values())
    assert t["total"] >= sum(t[p] for p in PHASES if p != "total") * 0.999
    saved = json.loads((tmp_path / "run.json").read_text())
    assert saved["summary"]["completed"] == 6 and len(saved["records"]) == 6


@pytest.mark.parametrize("flag", ["--num-prompts", "--rounds"])
def test_speed_benchmark_refuses_counts_below_one(monkeypatch, flag):
    from benchmarks import simulate_speed

    monkeypatch.setattr("sys.argv", ["simulate_speed", flag, "0"])
    with pytest.raises(SystemExit, match=f"{flag}: must be >= 1, got 0"):
        simulate_speed.main()


def test_fit_marks_a_term_it_never_saw_with_the_marker_itself():
    """Steps whose weight read never binds (the GEMMs always take longer): the fit has no
    time to give that term, and its efficiency is the UNSEEN marker exactly, not the marker
    divided by the summed-time correction (a finite-looking 800,000-odd)."""
    cfg = json.loads((default_model_dir() / "config.json").read_text())
    shape = shape_of(cfg, "float32", "float32")
    truth = cpu_profile(step_overhead_s=3e-3, per_seq_s=4e-5, gemm_efficiency=0.6,
                        weight_read_efficiency=1e9, decode_kv_efficiency=0.4)  # fmt: skip
    fitted, report = fit_profile(synthetic_steps(truth, shape, 200, noise=0.01), shape,
                                 cpu_profile())  # fmt: skip
    assert report.total_time_error == pytest.approx(0.0, abs=1e-9)
    assert fitted.weight_read_efficiency == UNSEEN
    assert fitted.gemm_efficiency < 1e3


def test_replicas_side_by_side_equal_one_at_a_time(llama8b):
    """Replicas share nothing: run in forked processes (jobs=2) they give the same records,
    fleet counters and samples as in turn, report their steps and blocks without their
    engines, and the progress callback hears of every request."""
    gpu = get_gpu("h100-sxm")
    words = "the cache block model server request queue latency market price".split()
    reqs = [BenchRequest(i, "chat", f"{i} " + " ".join(words) * (5 + i % 7), 8, 500)
            for i in range(24)]  # fmt: skip
    target = SimTarget(dict(model=llama8b), gpu_profile(gpu), gpu, replicas=3)
    heard: list[bool] = []
    seq, sims = simulate_load(target, reqs, LoadSpec(20.0), 3)
    par, infos = simulate_load(target, reqs, LoadSpec(20.0), 3, progress=heard.append, jobs=2)
    assert par.records == seq.records and par.duration == seq.duration
    assert par.before == seq.before and par.after == seq.after and par.samples == seq.samples
    assert len(heard) == 24 and all(heard)
    assert [i.runner.steps for i in infos] == [s.runner.steps for s in sims]
    assert [i.num_blocks for i in infos] == [s.num_blocks for s in sims]
    assert all(not hasattr(i, "engine") for i in infos)


def test_a_measured_first_touch_cost_is_kept_not_fitted():
    """Given the first-touch cost (measured by the calibration), the fit keeps it and fits the
    rest around it: held-out steps of a profile with that cost are predicted, and the other
    factors are recovered."""
    cfg = json.loads((default_model_dir() / "config.json").read_text())
    shape = shape_of(cfg, "float32", "float32")
    truth = cpu_profile(step_overhead_s=3e-3, per_seq_s=4e-5, gemm_efficiency=0.6,
                        decode_kv_efficiency=0.4, first_touch_s_per_byte=2e-9)  # fmt: skip

    def with_touch(steps):  # each step's first writes: its prompt chunk's blocks
        out = []
        for f, _ in steps:
            f.first_touch_bytes = 0.0 if f.prefill_seqs == 0 else f.tokens * 1e4
            out.append((f, truth.step_time(f, shape)))
        return out

    train = with_touch(synthetic_steps(truth, shape, 400, noise=0.0))
    fitted, _ = fit_profile(train, shape, cpu_profile(), None, 2e-9)
    assert fitted.first_touch_s_per_byte == pytest.approx(2e-9, rel=1e-6)
    assert fitted.step_overhead_s == pytest.approx(3e-3, rel=0.05)
    test = with_touch(synthetic_steps(truth, shape, 200, noise=0.0, seed=1))
    pred = np.array([fitted.step_time(f, shape) for f, _ in test])
    real = np.array([t for _, t in test])
    assert np.max(np.abs(pred / real - 1)) < 0.02


def test_a_streamed_workload_replays_as_the_made_one(llama8b):
    """A workload made and tokenized in a forked process while the replay runs gives the
    records, counters and samples the in-process workload gives (a mixed workload with
    prefixes and multi-turn histories), and hands each request's ids over once."""
    from kvserve.bench.workloads import WorkloadSpec, make_workload
    from kvserve.sim.workload import EncodedWorkload, stream_workload, token_counter

    gpu = get_gpu("h100-sxm")
    target = SimTarget(dict(model=llama8b), gpu_profile(gpu), gpu)
    count, max_len = token_counter(target)
    spec = WorkloadSpec("mixed", 60, 4, length_scale=0.5, max_model_len=max_len)
    made = make_workload(spec, count)
    streamed = stream_workload(target, spec)
    assert isinstance(streamed, EncodedWorkload) and len(streamed) == 60
    ref, _ = simulate_load(target, made, LoadSpec(30.0), 4)
    got, _ = simulate_load(target, streamed, LoadSpec(30.0), 4)
    assert got.records == ref.records and got.duration == ref.duration
    assert got.before == ref.before and got.after == ref.after and got.samples == ref.samples
    assert [streamed[i] for i in range(60)] == made
    assert any(r.cached_tokens for r in got.records)  # the ids carry the shared prefixes
    with pytest.raises(RuntimeError, match="already taken"):
        streamed.token_ids(0)


def test_a_streamed_workload_raises_the_producers_errors(llama8b):
    """A bad spec is refused before anything is forked; a prompt too long for the context,
    found by the producer mid-trace, is raised in the replay with the generator's message."""
    from kvserve.bench.workloads import WorkloadSpec
    from kvserve.sim.workload import stream_workload

    gpu = get_gpu("h100-sxm")
    target = SimTarget(dict(model=llama8b), gpu_profile(gpu), gpu)
    with pytest.raises(ValueError, match="workload: unknown 'nope'"):
        stream_workload(target, WorkloadSpec("nope", 4))
    with pytest.raises(ValueError, match="num_prompts: must be >= 1"):
        stream_workload(target, WorkloadSpec("chat", 0))
    long = stream_workload(target, WorkloadSpec("long-doc", 3, max_model_len=600))
    with pytest.raises(ValueError, match="max_model_len: a long-doc prompt of"):
        simulate_load(target, long, LoadSpec(10.0), 0)


# -- GEMM shapes a per-shape backend builds state for ---------------------------------------
ALL_GEMMS = dict.fromkeys(GEMM_NAMES, 1)


def test_shape_cache_names_the_gemms_the_real_model_calls(monkeypatch):
    """Against the real engine on the bundled model (float32 with kvserve's AVX-512 kernel
    off: every GEMM is oneDNN's), each
    step's distinct (GEMM, rows) calls, recorded at the backend's oneDNN entry point, are
    what :meth:`ShapeCache.calls` says for that step's features: decode steps, whole and
    chunked prompts, a chunk that finishes no prompt, and prompts beside decodes."""
    from kvserve.llm import LLM
    from kvserve.model.linear_ops import OneDNNOps

    monkeypatch.setenv("KVSERVE_DISABLE_AVX512_GEMM", "1")
    llm = LLM(model=str(default_model_dir()), dtype="float32", num_gpu_blocks=64,
              max_num_batched_tokens=48)  # fmt: skip
    eng = llm.engine
    model = eng.executor.driver_worker.model
    assert isinstance(model.ops, OneDNNOps)
    cfg = model.config
    q = cfg.num_attention_heads * (cfg.hidden_size // cfg.num_attention_heads)
    assert cfg.intermediate_size != q  # the output and down projections differ in shape
    seen: set[tuple[str, int]] = set()

    def name_of(attr: str, w) -> str:
        out, inp = w.shape
        if attr == "none":
            return "head" if out == cfg.vocab_size else "qkv"
        if attr == "swish":
            return "gate"
        if attr == "mul":
            return "up"
        return "down" if inp == cfg.intermediate_size else "o"

    class Spy:
        def __init__(self, lp):
            self.lp = lp

        def __call__(self, x, w, b, attr, *rest):
            seen.add((name_of(attr, w), x.shape[0]))
            return self.lp(x, w, b, attr, *rest)

        def binary(self, x, other, w, b, attr):
            seen.add((name_of(attr, w), x.shape[0]))
            return self.lp.binary(x, other, w, b, attr)

    model.ops._lp = Spy(model.ops._lp)
    shape = shape_of(json.loads((default_model_dir() / "config.json").read_text()),
                     "float32", "float32")  # fmt: skip
    rng = random.Random(0)
    kinds: set[str] = set()
    arrivals = {0: [120], 3: [5, 30], 6: [9], 9: [70, 3], 14: [40], 18: [100]}
    for k in range(40):
        for n in arrivals.get(k, []):
            ids = [rng.randrange(10, 200) for _ in range(n)]
            eng.add_request(None, ids, SamplingParams(temperature=0.0, max_tokens=12))
        seen.clear()
        eng.step()
        out = eng.core.last_step
        if not out.seqs:
            continue
        f = step_features(out, shape)
        assert seen == set(ShapeCache.calls(f)), (k, f.tokens, f.sampled_rows)
        kinds.add("decode" if not f.prefill_seqs else
                  "no sample" if not f.sampled_rows else
                  "mixed" if f.seqs > f.prefill_seqs else "prompt")  # fmt: skip
    assert kinds == {"decode", "no sample", "mixed", "prompt"}


def test_shape_cache_is_an_lru_of_gemm_shapes():
    """Against a naive list over each step's calls: a call builds state when its (GEMM,
    rows) is not among the last ``entries`` distinct ones used; calls under their GEMM's
    fewest rows, or of a GEMM that keeps no state, neither count nor change the list."""
    rng = random.Random(3)
    for entries, rows in ((1, ALL_GEMMS), (6, ALL_GEMMS), (64, ALL_GEMMS),
                          (12, {"qkv": 64, "o": 64, "gate": 64, "up": 64, "down": 64}),
                          (20, {"head": 1})):  # fmt: skip
        cache, used, got, want = ShapeCache(entries, rows), [], [], []
        for _ in range(1500):
            t = rng.choice([rng.randrange(1, 12), rng.randrange(1, 400)])
            prefill = rng.random() < 0.4
            s = rng.randrange(0, min(t, 8) + 1) if prefill else t
            f = StepFeatures(tokens=t, sampled_rows=s, prefill_seqs=int(prefill))
            got.append(cache.mark(f).new_shape)
            new = 0
            for key in ShapeCache.calls(f):
                if key[0] not in rows or key[1] < rows[key[0]]:
                    continue
                if key in used:
                    used.remove(key)
                else:
                    new += 1
                used = [*used, key][-entries:]  # most recent last
            want.append(new)
        assert got == want
        assert sum(got) > 0
        assert got.count(0) > 0 or entries == 1  # one entry holds no step's shapes


def test_new_gemm_shapes_cost_the_profiles_seconds_in_the_simulator():
    """The cost-model runner charges ``new_shape_s`` per GEMM shape the modelled cache does
    not hold: decode steps of batch 5, 5, 6, 5, 5, 9, 9, 6 build six shapes (five layer
    GEMMs and the head) at each batch size first seen, and again at each change when the
    cache holds one batch size's six; nothing without the term or under a GEMM's fewest
    rows."""
    from kvserve.sim.runner import CostModelRunner, VirtualClock

    cfg = json.loads((default_model_dir() / "config.json").read_text())
    shape = shape_of(cfg, "float32", "float32")
    counts = [5, 5, 6, 5, 5, 9, 9, 6]
    changes = sum(a != b for a, b in zip([None, *counts], counts, strict=False))  # 5

    def busy(profile):
        runner = CostModelRunner(profile, VirtualClock(), token_id=0)
        runner.shape = shape
        for n in counts:
            seqs = [ScheduledSeq(f"r{i}", [1], 40, 40, [0, 1, 2], ("x",)) for i in range(n)]
            runner.execute_model(SchedulerOutput(seqs=seqs))
        return runner.busy_s

    plain = busy(cpu_profile())

    def charged(rows, entries):
        p = cpu_profile(new_shape_s=1e-3, shape_state_rows=rows, shape_cache_entries=entries)
        return busy(p) - plain

    assert charged(ALL_GEMMS, 64) == pytest.approx(3 * 6 * 1e-3, rel=1e-9)  # 5, 6, 9
    assert charged(ALL_GEMMS, 6) == pytest.approx(changes * 6 * 1e-3, rel=1e-9)
    assert charged(dict.fromkeys(GEMM_NAMES, 8), 64) == pytest.approx(6e-3, rel=1e-9)  # 9
    assert charged({"head": 1}, 64) == pytest.approx(3e-3, rel=1e-9)


def test_fit_recovers_the_cost_of_a_new_gemm_shape():
    """Steps made by a profile that charges each new GEMM shape (counted by the calibration's
    replay of the cache): the fit finds that cost beside the others, and predicts held-out
    steps; without the count the same steps fit worse."""
    cfg = json.loads((default_model_dir() / "config.json").read_text())
    shape = shape_of(cfg, "float32", "float32")
    truth = cpu_profile(step_overhead_s=3e-3, per_seq_s=4e-5, prefill_step_s=5e-4,
                        gemm_efficiency=0.6, decode_kv_efficiency=0.4,
                        new_shape_s=4e-4)  # fmt: skip

    def with_shapes(steps):
        cache, out = ShapeCache(48, ALL_GEMMS), []
        for f, _ in steps:
            cache.mark(f)
            out.append((f, truth.step_time(f, shape)))
        return out

    train = with_shapes(synthetic_steps(truth, shape, 400, noise=0.0))
    marked = [f.new_shape for f, _ in train]
    assert 0 < sum(f.new_shape for f, _ in train if not f.prefill_seqs) < sum(marked)
    assert len(set(marked)) > 2  # steps build different numbers of shapes
    fitted, report = fit_profile(train, shape, cpu_profile())
    assert fitted.new_shape_s == pytest.approx(4e-4, rel=0.05)
    assert fitted.step_overhead_s == pytest.approx(3e-3, rel=0.05)
    test = with_shapes(synthetic_steps(truth, shape, 200, noise=0.0, seed=1))
    pred = np.array([fitted.step_time(f, shape) for f, _ in test])
    real = np.array([t for _, t in test])
    assert np.max(np.abs(pred / real - 1)) < 0.02
    for f, _ in train:
        f.new_shape = 0
    _, unmarked = fit_profile(train, shape, cpu_profile())
    assert unmarked.median_abs_error > 5 * max(report.median_abs_error, 1e-4)


def test_calibration_chooses_the_cache_size_that_made_the_steps():
    """Steps timed by a profile whose cache holds 24 GEMM shapes, handed to the calibration's
    fit as a backend with a nominal 64: it replays the cache at each candidate size over
    every step (warm-up steps included, not fitted) and keeps the size that explains the
    steps, with its cost per shape."""
    from kvserve.sim.calibrate import fit_shape_cache

    cfg = json.loads((default_model_dir() / "config.json").read_text())
    shape = shape_of(cfg, "float32", "float32")
    truth = cpu_profile(step_overhead_s=3e-3, per_seq_s=4e-5, prefill_step_s=5e-4,
                        gemm_efficiency=0.6, decode_kv_efficiency=0.4,
                        new_shape_s=4e-4)  # fmt: skip
    rng = random.Random(5)
    steps = [f for f, _ in synthetic_steps(truth, shape, 500, noise=0.0)]
    # Fewer distinct batch sizes, so that a larger cache would hold them.
    for f in steps:
        if not f.prefill_seqs:
            f.tokens = f.sampled_rows = rng.choice(range(1, 65, 3))
    cache, trace = ShapeCache(24, ALL_GEMMS), []
    for i, f in enumerate(steps):
        cache.mark(f)
        trace.append((f, truth.step_time(f, shape), i >= 20))  # the first 20: warm-up
    base = cpu_profile(shape_state_rows=ALL_GEMMS, shape_cache_entries=64)
    fitted, report = fit_shape_cache(trace, shape, base, None, 0.0)
    assert fitted.shape_cache_entries == 24
    replayed = ShapeCache(24, ALL_GEMMS)  # the trace's counts are the chosen size's
    assert all(f.new_shape == replayed.mark(replace(f)).new_shape for f, _, _ in trace)
    assert fitted.new_shape_s == pytest.approx(4e-4, rel=0.05)
    assert report.steps == 480 and report.median_abs_error < 0.01
    # A backend without per-shape state: one fit, the term off.
    plain, _ = fit_shape_cache(trace, shape, cpu_profile(), None, 0.0)
    assert plain.shape_cache_entries == 0 and ShapeCache.of(plain) is None


def test_a_profile_without_gemm_shape_terms_charges_nothing(tmp_path):
    """Profile files without the GEMM-shape terms load with the term off, and their steps
    cost what the other terms say: one without the fields, and one whose ``new_shape_s`` is
    charged per step row count (with ``new_shape_min_tokens`` and ``shape_cache_rows``), a
    unit the cost model does not use."""
    data = cpu_profile(new_shape_s=1e-3, shape_state_rows=ALL_GEMMS,
                       shape_cache_entries=64).to_json()  # fmt: skip
    assert ShapeCache.of(Profile.from_json(data)) is not None
    base = {k: v for k, v in data.items()
            if k not in ("new_shape_s", "shape_state_rows", "shape_cache_entries")}  # fmt: skip
    rows_era = {**base, "new_shape_s": 2e-3, "new_shape_min_tokens": 1, "shape_cache_rows": 10}
    shape = shape_of(json.loads((default_model_dir() / "config.json").read_text()))
    f = StepFeatures(seqs=1, tokens=1, sampled_rows=1, linear_flops=1e9, new_shape=6)
    g = StepFeatures(seqs=1, tokens=1, sampled_rows=1, linear_flops=1e9)
    for i, old_data in enumerate((base, rows_era)):
        (tmp_path / f"old{i}.json").write_text(json.dumps(old_data))
        old = Profile.load(tmp_path / f"old{i}.json")
        assert ShapeCache.of(old) is None and old.new_shape_s == 0.0
        assert old.step_time(f, shape) == old.step_time(g, shape)


def test_validation_benchmark_compares_with_the_median_real_run(monkeypatch, capsys):
    """``benchmarks.simulator`` takes each figure's median over its real runs (a figure one
    run lacks has none) and shows their range; fewer than one real run is refused."""
    from benchmarks import simulator

    runs = [{"ttft_p50": 12.0, "tier_hit_rate": None}, {"ttft_p50": 30.0, "tier_hit_rate": 0.5},
            {"ttft_p50": 10.0, "tier_hit_rate": 0.4}]  # fmt: skip
    assert simulator.median_figures(runs) == {"ttft_p50": 12.0, "tier_hit_rate": None}
    assert simulator.median_figures(runs[1:]) == {"ttft_p50": 20.0, "tier_hit_rate": 0.45}
    assert simulator.spread(runs, "ttft_p50", "{:.1f}") == "10.0-30.0"
    assert simulator.spread(runs, "tier_hit_rate", "{:.3f}") == "-"
    assert simulator.spread(runs[:1], "ttft_p50", "{:.1f}") == "-"
    monkeypatch.setattr("sys.argv", ["simulator", "--real-runs", "0"])
    with pytest.raises(SystemExit):
        simulator.main()
    assert "--real-runs: must be >= 1, got 0" in capsys.readouterr().err


def test_validation_benchmark_scores_each_real_run_against_the_others():
    """The real engine's own repeatability: each real run's figures against the median of the
    same case's other runs, under the same limits, counted by hand here."""
    from benchmarks import simulator

    def run(**changed: float | None) -> dict[str, float | None]:
        figures: dict[str, float | None] = dict.fromkeys(simulator.LIMITS, 100.0)
        figures["tier_hit_rate"] = None  # no tier: equal on every run
        figures["preemptions"] = 0.0
        return {**figures, **changed}

    # Case A, TTFT p50 10, 10.5, 12: run 0 against 11.25 (-11 %, out of 10 %), run 1 against
    # 11 (-5 %), run 2 against 10.25 (+17 %, out). Case B, TPOT p99 10, 10, 13: runs 0 and 1
    # against 11.5 (-13 %, within 20 %), run 2 against 10 (+30 %, out); run 1's preemption is
    # within two counts of none. (With each run in its own median: 16, 16, 14.)
    case_a = [run(ttft_p50=10.0), run(ttft_p50=10.5), run(ttft_p50=12.0)]
    case_b = [run(tpot_p99=10.0), run(tpot_p99=10.0, preemptions=1.0), run(tpot_p99=13.0)]
    assert simulator.repeatability([case_a, case_b]) == [15, 16, 14]
    assert simulator.repeatability([case_a[:1], case_b[:1]]) == []  # one run: no others


def test_calibration_charges_the_serving_loops_time_between_steps(monkeypatch):
    """The serving loop's own work between two steps of a busy engine (publishing its state;
    here made 20 ms longer per step) is measured as the profile's loop time, and the
    simulated engine waits that long before each next step: the same run simulated with that
    loop time lasts longer by about the added time, not by nothing (the steps alone did not
    change). The two simulations share one calibration's step costs, which a busy host moves
    between calibrations by more than the added time."""
    import time

    from kvserve.bench.engine_target import EngineTarget
    from kvserve.sim.calibrate import calibrate

    kw = dict(model=default_model(), kv_cache_memory="16MiB")
    words = "the cache block model server request queue latency ".split()
    reqs = [BenchRequest(i, "chat", " ".join(words[i % 5 :] * 3), 24, 20) for i in range(12)]
    extra = 20e-3
    slept: list[float] = []
    publish = EngineTarget._publish

    def calibrated() -> Profile:
        target = EngineTarget.from_kwargs(kw, temperature=0.0, ignore_eos=True)
        return calibrate(target, [(reqs, LoadSpec())], 0)[0]

    def simulated(profile: Profile) -> tuple[float, int]:
        res, sims = simulate_load(SimTarget(kw, profile), reqs, LoadSpec(), 0)
        return res.duration, sims[0].engine.core.num_steps

    base = calibrated()

    def slow_publish(self, engine, sample):  # type: ignore[no-untyped-def]
        if sample and engine.has_unfinished_requests():
            t0 = time.perf_counter()
            time.sleep(extra)
            slept.append(time.perf_counter() - t0)
        publish(self, engine, sample)

    monkeypatch.setattr(EngineTarget, "_publish", slow_publish)
    slow_gap = calibrated().loop_gap_s
    # what the sleep really took (on a busy host it can return a few ms late)
    added = sum(slept) / len(slept)
    assert 0.8 * added < slow_gap - base.loop_gap_s < 1.2 * added
    before, steps = simulated(base)
    after, _ = simulated(replace(base, loop_gap_s=slow_gap))
    # every simulated step but the last few (the engine goes idle after them) pays it
    assert 0.8 * steps * added < after - before < 1.05 * steps * added
