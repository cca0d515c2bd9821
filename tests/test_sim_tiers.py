"""The simulator's offload tiers (kvserve.sim.tiers): the real scheduler's tier decisions, load
times from the profile's figures, and clear errors."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from kvserve.config import ConfigError
from kvserve.connectors.offload import OffloadConnector
from kvserve.engine_args import default_model
from kvserve.sched.request import SamplingParams
from kvserve.sim.cost import Profile, gpu_profile
from kvserve.sim.engine import SimTarget, build_engine
from kvserve.sim.space import parse_search
from kvserve.sim.tiers import ModelledTier
from kvserve.sim.tune import serve_command
from tests.test_simulator import SEED_8B, cpu_profile
from tests.test_tune import run_tune

TIER = dict(tier_bandwidth={"cpu": 4e9, "disk": 1e9}, tier_latency_s={"cpu": 1e-4, "disk": 1e-3})


def prompts_that_evict(seed: int = 5) -> list[list[int]]:
    """Three distinct prompts that together overflow a 16-block pool, then the first two
    again with new endings: their prefixes were pushed out of the device pool meanwhile."""
    rng = random.Random(seed)
    a, b, c = ([rng.randrange(3, 4000) for _ in range(100)] for _ in range(3))
    return [a, b, c, a[:96] + [7, 8, 9], b[:80] + [11, 12]]


def one_at_a_time(engine, step, prompts, max_tokens=4):
    """Each prompt alone, to the end, and the stores its steps queued written before the next
    arrives: the scheduler's decisions (per step, which request computes how many tokens)
    then cannot depend on how long a tier load takes, nor on whether the real tier's worker
    thread wrote a store before the next prompt's lookup (under a loaded CI machine it did
    not always, and the real engine found fewer blocks below than the model)."""
    seen = []
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, SamplingParams(
            max_tokens=max_tokens, ignore_eos=True), arrival_time=0.0)  # fmt: skip
        while engine.has_unfinished_requests():
            step()
            last = engine.core.last_step
            if last.seqs:
                seen.append([(s.req_id, s.num_tokens) for s in last.seqs])
        if engine.offload is not None:
            assert engine.offload.flush()
    return seen


def test_modelled_tier_makes_the_real_tiers_decisions(make_llm):
    """The bundled model with a real host tier and the simulator with a modelled one, on the
    same requests: the same steps, the same tier hits and stores."""
    kw = dict(model=default_model(), num_gpu_blocks=16, kv_offload_cpu="64MiB")
    prompts = prompts_that_evict()
    real = make_llm(**kw).engine
    sim = build_engine(SimTarget(kw, cpu_profile(**TIER))).engine
    real_steps = one_at_a_time(real, real.step, prompts)
    sim_steps = one_at_a_time(sim, sim.core.step, prompts)
    r, s = real.stats(), sim.stats()
    assert r.tier_hit_tokens > 0, "the trace should load from the tier"
    assert s.tier_hit_tokens == r.tier_hit_tokens
    assert s.prefix_cache_hits == r.prefix_cache_hits
    assert sim_steps == real_steps
    for key in ("stored", "hits", "queries"):
        assert s.kv_offload["cpu"][key] == r.kv_offload["cpu"][key], key
    # Without a tier the reloaded prompts compute their prefixes: more tokens computed.
    plain = build_engine(SimTarget({**kw, "kv_offload_cpu": None}, cpu_profile())).engine
    plain_steps = one_at_a_time(plain, plain.core.step, prompts)
    assert sum(n for st in plain_steps for _, n in st) > sum(n for st in sim_steps for _, n in st)


def ttft_of_last(kw, profile, flood: list[int] | None = None):
    """Simulated seconds from the last prompt's arrival to its first token (``flood``: the
    prompt that pushes the first two out, in place of the third)."""
    sim = build_engine(SimTarget(kw, profile))
    eng = sim.engine
    prompts = prompts_that_evict()
    if flood is not None:
        prompts[2] = flood
    one_at_a_time(eng, eng.core.step, prompts[:-1])
    before = eng.stats().tier_hit_tokens
    sent = sim.clock.now
    eng.add_request("last", {"prompt_token_ids": prompts[-1]},
                    SamplingParams(max_tokens=1, ignore_eos=True), arrival_time=sent)  # fmt: skip
    while eng.has_unfinished_requests():
        eng.core.step()
    return sim.clock.now - sent, eng.stats().tier_hit_tokens - before, sim


def test_a_load_takes_the_tiers_latency_and_bytes_over_its_bandwidth():
    kw = dict(model=default_model(), num_gpu_blocks=16, kv_offload_cpu="64MiB")
    fast, hit_fast, sim = ttft_of_last(kw, cpu_profile(**TIER))
    slow_tier = {**TIER, "tier_bandwidth": {"cpu": 1e8}, "tier_latency_s": {"cpu": 3e-3}}
    slow, hit_slow, _ = ttft_of_last(kw, cpu_profile(**slow_tier))
    assert hit_fast == hit_slow > 0
    blocks = hit_fast // 16
    # Same steps, only the tier differs: the probe's and the load's latency, and the load's
    # bytes over the bandwidth.
    block = sim.shape.kv_bytes_per_token * 16
    expected = 2 * (3e-3 - 1e-4) + blocks * block * (1 / 1e8 - 1 / 4e9)
    assert slow - fast == pytest.approx(expected, rel=1e-6)


def test_a_load_past_its_timeout_is_a_miss_and_the_prompt_is_computed(monkeypatch):
    # A load this slow is not started (computing is faster); forced, it times out.
    monkeypatch.setattr(OffloadConnector, "_pays", lambda self, n: True)
    kw = dict(model=default_model(), num_gpu_blocks=16, kv_offload_cpu="64MiB",
              kv_offload_timeout=0.001)  # fmt: skip
    glacial = {**TIER, "tier_bandwidth": {"cpu": 1e3}}
    t, hit, sim = ttft_of_last(kw, cpu_profile(**glacial))
    assert hit == 0
    assert sim.engine.stats().kv_offload["cpu"]["failures"].get("load_timeout", 0) >= 1
    assert t >= 10 * 0.001  # it waited out the deadline (10 timeouts) before computing


def test_slower_tier_blocks_go_up_to_the_faster_one():
    t_cpu = ModelledTier("cpu", "kv_offload_cpu", 10, 1.0, 0.0)
    t_disk = ModelledTier("disk", "kv_offload_disk_size", 100, 1.0, 0.0)
    from kvserve.sim.runner import VirtualClock
    from kvserve.sim.tiers import SimOffload

    clock = VirtualClock()
    off = SimOffload([t_cpu, t_disk], clock, load_timeout_s=1e9)
    off.set_geometry(1.0, 1)
    keys = [bytes([i]) for i in range(12)]
    off.store(keys, None)
    # LRU within 10 blocks: the first two went from the cpu tier, all 12 are on disk.
    assert list(t_cpu.entries) == keys[2:] and t_cpu.num_evictions == 2
    assert off.probe(keys) == 12 and t_cpu.count_present(keys) == 0
    off.start_load("r", keys[:3])
    # 0 came from disk into the cpu tier and pushed out its oldest, 2; so 1 and 2 came from
    # disk too (pushing out 3 and 4): all three are the cpu tier's most recent now.
    assert list(t_cpu.entries) == keys[5:] + keys[:3] and t_cpu.num_evictions == 5
    assert off.counters["disk"].hits == 3 and off.counters["cpu"].hits == 0
    # Three 1-byte blocks at 1 byte/s: an idle engine waits 10 ms at a time, as the real one.
    assert off.poll_loads(wait=True) == {} and clock.now == pytest.approx(0.01)
    clock.advance(2.99 - clock.now)
    assert off.poll_loads() == {}
    assert off.poll_loads(wait=True)["r"].num_blocks == 3 and clock.now == pytest.approx(3.0)


def test_tier_errors_name_the_field(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(SEED_8B))
    kw = dict(model=str(tmp_path), kv_offload_redis="redis://h:6379/0",
              kv_offload_redis_size="64GiB", num_gpu_blocks=64)  # fmt: skip
    with pytest.raises(ConfigError, match=r"no figures for the redis tier.*tier_bandwidth"):
        build_engine(SimTarget(kw, cpu_profile(**TIER)))
    tiny = dict(model=str(tmp_path), kv_offload_cpu=4096, num_gpu_blocks=64)
    with pytest.raises(ConfigError, match="kv_offload_cpu: 4096 bytes is smaller than one KV"):
        build_engine(SimTarget(tiny, cpu_profile(**TIER)))
    good = cpu_profile(**TIER).to_json()
    for bad, msg in (
        ({"tier_bandwidth": {"ssd": 1e9}}, "unknown tier 'ssd'"),
        ({"tier_bandwidth": {"cpu": 0}}, r"tier_bandwidth\['cpu'\] must be > 0"),
        ({"tier_latency_s": {"cpu": -1}}, r"tier_latency_s\['cpu'\] must be >= 0"),
        ({"offload_export_s_per_byte": -1}, "offload_export_s_per_byte must be >= 0"),
        ({"offload_store_s_per_block": -1e-6}, "offload_store_s_per_block must be >= 0"),
        ({"offload_load_s_per_block": "1us"}, "offload_load_s_per_block must be >= 0"),
        ({"offload_worker_share": 1.5}, r"offload_worker_share must be in \[0, 1\]"),
    ):
        with pytest.raises(ValueError, match=msg):
            Profile.from_json({**good, **bad})


def test_gpu_profiles_carry_every_tier_and_pcie_generation():
    from kvserve.plan.gpus import get_gpu

    h100, a100 = gpu_profile(get_gpu("h100-sxm")), gpu_profile(get_gpu("a100-80gb"))
    assert set(h100.tier_bandwidth) == set(h100.tier_latency_s) == {"cpu", "disk", "redis"}
    # PCIe Gen5 x16 against Gen4 x16: twice the host link.
    assert h100.tier_bandwidth["cpu"] == pytest.approx(2 * a100.tier_bandwidth["cpu"])


def test_tune_takes_a_host_tier_when_rag_documents_do_not_fit(tmp_path):
    """Llama-3-8B on a GPU whose pool holds a fraction of a RAG workload's documents and
    requests: evicted documents come back from the host tier instead of being computed
    again, so the tier's configuration computes fewer prompt tokens and costs less."""
    (tmp_path / "config.json").write_text(json.dumps(SEED_8B))
    res = run_tune("rag", 96, {"kv_offload_cpu": (None, "64GiB")}, [],
                   gpu="custom:17:3.35:989.5", model=str(tmp_path))  # fmt: skip
    off, on = res.trials
    assert (off.settings, on.settings) == ({"kv_offload_cpu": None}, {"kv_offload_cpu": "64GiB"})
    assert on.summary["cached_prompt_tokens"] > off.summary["cached_prompt_tokens"]
    assert on.usd_per_million_useful < off.usd_per_million_useful
    assert res.best is on
    assert "--kv-offload-cpu 64GiB" in serve_command("m", on.settings)
    with pytest.raises(ValueError, match="kv_offload_cpu: expected a size"):
        parse_search(["kv_offload_cpu=off,lots"])


def test_a_load_slower_than_recomputing_is_skipped(monkeypatch):
    """The scheduler weighs each tier hit: loaded over a fast link, computed over a slow one,
    and in each case the choice gives the lower TTFT of the two (forcing the load by
    patching the rule, or running without the tier, is never faster but for the probe)."""
    kw = dict(model=default_model(), num_gpu_blocks=20, kv_offload_cpu="64MiB")
    # A long flood: its prefill step times the engine's prefill per token.
    flood = [random.Random(1).randrange(3, 4000) for _ in range(300)]
    slow = {**TIER, "tier_bandwidth": {"cpu": 2e6}}
    ttft = {}
    for name, prof in (("fast", TIER), ("slow", slow)):
        chosen, hit, sim = ttft_of_last(kw, cpu_profile(**prof), flood)
        skipped = sim.engine.stats().tier_loads_skipped
        with monkeypatch.context() as m:
            m.setattr(OffloadConnector, "_pays", lambda self, n: True)
            loaded, hit_forced, _ = ttft_of_last(kw, cpu_profile(**prof), flood)
        plain, _, _ = ttft_of_last({**kw, "kv_offload_cpu": None}, cpu_profile(), flood)
        ttft[name] = (chosen, loaded, plain, hit, hit_forced, skipped)
        probe = prof["tier_latency_s"]["cpu"]  # asking the tier costs its latency either way
        assert chosen <= min(loaded, plain + probe) + 1e-9, (name, ttft[name])
    assert ttft["fast"][3] > 0 and ttft["fast"][5] == 0  # loaded
    assert ttft["slow"][3] == 0 and ttft["slow"][4] > 0 and ttft["slow"][5] >= 1  # computed


def test_replicas_behind_one_redis_share_it_as_real_engines_do(make_llm, redis_url, monkeypatch):
    """Two replicas on one Redis, written through: a document one replica computed is a tier
    hit on the other. The simulated fleet (requests dealt round-robin, arriving far apart)
    and two real engines on a real Redis (the bundled model, each request to its end before
    the next) find the same cached tokens per request; simulated replicas that do not share
    the tier find fewer."""
    from kvserve.bench.runner import LoadSpec
    from kvserve.bench.workloads import WorkloadSpec, make_workload
    from kvserve.sim import simulate

    kw = dict(model=default_model(), num_gpu_blocks=64, kv_offload_redis=redis_url,
              kv_offload_write_policy="write_through")  # fmt: skip
    a, b = make_llm(**kw), make_llm(**kw)
    encode = a.engine.tokenizer.encode
    reqs = make_workload(
        WorkloadSpec("rag", num_prompts=6, seed=3, num_prefixes=1, prefix_share=1.0,
                     length_scale=0.5),
        lambda text: len(encode(text)),
    )  # fmt: skip
    real = []
    for i, r in enumerate(reqs):
        llm = (a, b)[i % 2]
        params = SamplingParams(max_tokens=r.max_tokens, ignore_eos=True)
        (out,) = llm.generate([{"prompt_token_ids": encode(r.prompt)}], params)
        assert llm.engine.offload.flush()  # written through before the next request
        real.append(out.num_cached_tokens)
    assert b.stats().tier_hit_tokens > 0, "the second replica should hit the first's blocks"

    profile = cpu_profile(tier_bandwidth={"redis": 1e9}, tier_latency_s={"redis": 2e-4})
    target = SimTarget(kw, profile, replicas=2)
    load = LoadSpec(request_rate=0.001)  # each request ends long before the next arrives

    def cached() -> list[int]:
        res, _ = simulate.simulate_load(target, reqs, load)
        return [rec.cached_tokens for rec in sorted(res.records, key=lambda r: r.index)]

    assert cached() == real, real
    monkeypatch.setattr(simulate, "SHARED_TIERS", ())
    alone = cached()
    assert sum(alone) < sum(real), (alone, real)


def test_a_redis_server_answers_one_load_at_a_time_for_every_replica():
    """Two replicas' loads asked of one modelled Redis at the same moment: the second starts
    when the server is done with the first (latency + bytes / bandwidth each), and its
    estimate says so; a host tier (each replica's own) makes no one wait. A cancelled load
    that had not started gives its server time back."""
    from kvserve.sim.runner import VirtualClock
    from kvserve.sim.tiers import SimOffload, modelled_tiers

    prof = cpu_profile(tier_bandwidth={"redis": 1e6, "cpu": 1e6},
                       tier_latency_s={"redis": 1e-3, "cpu": 1e-3})  # fmt: skip
    cc = build_engine(
        SimTarget(
            dict(model=default_model(), kv_offload_redis="redis://h:1/0", kv_offload_cpu="1GiB"),
            prof,
        )
    ).engine.config.cache
    redis = next(t for t in modelled_tiers(cc, prof) if t.name == "redis")
    keys = [bytes([i]) for i in range(70)]
    replicas = []
    for _ in range(2):
        clock = VirtualClock()
        off = SimOffload([redis], clock, load_timeout_s=1e9)
        off.set_geometry(1000.0, 1)  # 1 kB blocks
        replicas.append((clock, off))
    replicas[0][1].store(keys, None)
    one = 2 * 1e-3 + 70 * 1000.0 / 1e6  # two batches of <= 64 blocks, and the bytes
    (ca, a), (cb, b) = replicas
    assert a.probe(keys) == 70 and b.probe(keys) == 70  # each probe costs the latency
    assert b.load_seconds(70) == pytest.approx(one)
    a.start_load("x", keys)  # both clocks are at 1 ms (the probe)
    # b's estimate now includes the wait for a's load, which holds the server until 1 ms +
    # one load: b would wait one load's time, then take its own.
    assert b.load_seconds(70) == pytest.approx(2 * one)
    b.start_load("y", keys)
    assert a._loads["x"].end_at == pytest.approx(1e-3 + one)
    assert b._loads["y"].end_at == pytest.approx(1e-3 + 2 * one)
    assert b.counters["redis"].seconds_up == pytest.approx(2 * one)  # the wait is timed
    # Cancelled before it started (a's clock at 1 ms, b's load starts at 1 + one ms):
    # the server is free again once a's load ends.
    b.cancel("y")
    assert redis.free_at == pytest.approx(1e-3 + one)
    # Each replica's own host tier: no queue across replicas.
    hosts = []
    for _ in range(2):
        cpu = next(t for t in modelled_tiers(cc, prof) if t.name == "cpu")
        off = SimOffload([cpu], VirtualClock(), load_timeout_s=1e9)
        off.set_geometry(1000.0, 1)
        off.store(keys, None)
        off.start_load("z", keys)
        hosts.append(off._loads["z"].end_at)
    assert hosts[0] == hosts[1] == pytest.approx(one)


def test_a_load_that_would_land_after_its_deadline_is_not_started(monkeypatch):
    """Two requests whose prefixes the tier holds arrive together; one load takes 0.6 of the
    timeout, so the second, queued behind the first, would land after its deadline: it is
    computed at once (a skipped load) instead of waiting out the timeout and computing then,
    which is what starting it does (the rule without the deadline check, patched in)."""
    kw = dict(model=default_model(), num_gpu_blocks=16, kv_offload_cpu="64MiB",
              kv_offload_timeout=0.01)  # fmt: skip
    prompts = prompts_that_evict()
    prompts[2] = [random.Random(2).randrange(3, 4000) for _ in range(250)]  # fills the pool

    def run():
        probe = build_engine(SimTarget(kw, cpu_profile(**TIER)))
        timeout = probe.offload.load_timeout_s
        block = probe.shape.kv_bytes_per_token * 16
        lat = 1e-4
        bw = 6 * block / (0.6 * timeout - lat)  # the first request's 6 blocks: 0.6 timeout
        prof = {**TIER, "tier_bandwidth": {"cpu": bw}, "tier_latency_s": {"cpu": lat}}
        sim = build_engine(SimTarget(kw, cpu_profile(**prof)))
        eng = sim.engine
        one_at_a_time(eng, eng.core.step, prompts[:3])
        sent = sim.clock.now
        params = SamplingParams(max_tokens=1, ignore_eos=True)
        for rid, p in (("a", prompts[3]), ("b", prompts[4])):
            eng.add_request(rid, {"prompt_token_ids": p}, params, arrival_time=sent)
        first = {}
        while eng.has_unfinished_requests():
            for r in eng.core.step():
                if r.request_id in ("a", "b") and r.request_id not in first:
                    first[r.request_id] = sim.clock.now - sent
        return first, eng.stats(), timeout

    first, st, timeout = run()
    assert st.tier_hit_tokens == 96  # a's six blocks; b's five were computed
    assert st.tier_loads_skipped == 1
    assert st.kv_offload["cpu"]["failures"].get("load_timeout", 0) == 0
    assert first["b"] < timeout

    def without_deadline_check(self, n):
        return True

    monkeypatch.setattr(OffloadConnector, "_pays", without_deadline_check)
    forced, st_forced, _ = run()
    assert st_forced.kv_offload["cpu"]["failures"].get("load_timeout", 0) == 1
    assert st_forced.tier_hit_tokens == 96
    assert forced["b"] > timeout > first["b"]  # it waited out the deadline, then computed


def test_a_step_loses_the_workers_time_beside_it_by_its_share():
    """The cost-model runner adds, to a step that exports blocks for the tiers or imports
    loaded ones, the worker's measured time for those blocks times its share of the cores:
    exactly that over the same step without them, and nothing at share 0 (a GPU's worker)."""
    from kvserve.connectors.offload import OffloadMeta
    from kvserve.plan.gpus import get_gpu
    from kvserve.sched.output import ScheduledSeq, SchedulerOutput
    from kvserve.sim.cost import ModelShape
    from kvserve.sim.runner import CostModelRunner, VirtualClock
    from tests.test_simulator import shape_of

    shape: ModelShape = shape_of(json.loads((Path(default_model()) / "config.json").read_text()))

    def step_time(profile, exported=0, loaded=0):
        runner = CostModelRunner(profile, VirtualClock(), token_id=0)
        runner.shape = shape
        out = SchedulerOutput(seqs=[ScheduledSeq("r", [1] * 40, 0, 0, [0, 1, 2], ("r",))])
        meta = OffloadMeta(saves_before=[(i, bytes([i])) for i in range(exported)])
        if loaded:
            meta.loads = {"x": list(range(3, 3 + loaded))}
        out.kv_connector_metadata = meta
        runner.execute_model(out)
        return runner.busy_s

    worker = dict(offload_store_s_per_block=3e-5, offload_load_s_per_block=2e-5)
    p = cpu_profile(**TIER, **worker, offload_worker_share=1.0)
    base = step_time(p)
    export_bytes = 4 * shape.kv_bytes_per_token * 16 * p.offload_export_s_per_byte
    assert step_time(p, exported=4) - base == pytest.approx(4 * 3e-5 + export_bytes, rel=1e-9)
    assert step_time(p, loaded=5) - base == pytest.approx(5 * 2e-5, rel=1e-9)
    idle = cpu_profile(**TIER, **worker, offload_worker_share=0.0)
    assert step_time(idle, exported=4, loaded=5) == pytest.approx(step_time(idle) + export_bytes)
    assert gpu_profile(get_gpu("h100-sxm")).offload_worker_share == 0.0


def test_the_workers_time_per_block_is_measured_on_the_engines_own_pool(make_llm):
    """The calibration times the worker's store and load paths on the engine's own KV
    format: a positive time per block each, and the pool's blocks are left as they were."""
    from kvserve.sim.calibrate import measure_tier_path

    storage = make_llm(default_model(), num_gpu_blocks=16).engine.executor.driver_worker.storage
    before = storage.export_blocks(list(range(16)))
    path = measure_tier_path(storage, 1.0, blocks=8, rounds=2)
    store, load = path.store_s_per_block, path.load_s_per_block
    assert 0 < store < 1 and 0 < load < 1
    after = storage.export_blocks(list(range(16)))
    assert all(torch.equal(before.tensors[k], after.tensors[k]) for k in before.tensors)


def test_host_tier_loads_inline_cost_the_step_that_asks_not_the_worker(tmp_path):
    """A profile whose CPU engine loads host-tier hits on the engine thread (as the real one
    does when its compute threads take every core): the same hits, the load's time on the
    engine's clock at once, and no worker time charged for those blocks when they are
    imported, so the last prompt's TTFT is shorter by exactly the worker's time for them.
    A disk tier's loads stay on the worker either way."""
    kw = dict(model=default_model(), num_gpu_blocks=16, kv_offload_cpu="64MiB")
    worker = dict(offload_load_s_per_block=2e-3, offload_worker_share=1.0)
    queued, hit_q, sim_q = ttft_of_last(kw, cpu_profile(**TIER, **worker))
    inline, hit_i, sim = ttft_of_last(kw, cpu_profile(**TIER, **worker, inline_host_loads=True))
    assert hit_q == hit_i > 0
    assert sim.offload is not None and sim.offload.inline_host_loads
    assert not sim_q.offload.inline_host_loads
    assert queued - inline == pytest.approx(hit_i // 16 * 2e-3, rel=1e-6)
    stats_q, stats_i = (s.engine.stats().kv_offload["cpu"] for s in (sim_q, sim))
    assert stats_i["hits"] == stats_q["hits"] > 0
    assert stats_i["seconds_up"] == pytest.approx(stats_q["seconds_up"], rel=1e-9)
    disk = {**kw, "kv_offload_cpu": None, "kv_offload_disk": str(tmp_path),
            "kv_offload_disk_size": "64MiB"}  # fmt: skip
    profile = cpu_profile(**TIER, **worker, inline_host_loads=True)
    assert not build_engine(SimTarget(disk, profile)).offload.inline_host_loads
