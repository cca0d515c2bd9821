"""Offload tiers through the whole engine: a prefix evicted from the pool comes back from host
memory, disk or a real Redis with the same greedy tokens as a run without tiers; every fault
(a flipped byte, a truncated or deleted file, a full disk, a dead or slow Redis) is a miss that
recomputes, never wrong output or a stalled engine; entries never cross models, formats or
tenants; a bad flag fails at start naming it."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvserve import SamplingParams
from kvserve.config import ConfigError
from kvserve.connectors.offload import OffloadConnector
from kvserve.kv.tiers import DiskTier, TierError
from tests.conftest import prompts_of_lengths

GREEDY = SamplingParams(max_tokens=6, temperature=0)
POOL = dict(num_gpu_blocks=24, block_size=16)  # 384 token slots: one 200-token prompt at a time


def _tokens(llm, prompts, params=GREEDY, **kw):  # noqa: ANN001
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, **kw)]


def push_out(llm, prompt, flood):  # noqa: ANN001
    """Serve ``prompt``, push it out of the pool with ``flood`` and wait for the tier writes;
    returns the tokens of the first run."""
    first = _tokens(llm, [prompt])[0]
    for f in flood:
        _tokens(llm, [f])
    if llm.engine.offload is not None:
        assert llm.engine.offload.flush()
    return first


def evict_and_return(llm, prompt, flood):  # noqa: ANN001
    """:func:`push_out`, then serve the prompt again. Returns (first tokens, second tokens,
    cached tokens of the second run)."""
    first = push_out(llm, prompt, flood)
    (again,) = llm.generate([prompt], GREEDY)
    return first, again.outputs[0].token_ids, again.num_cached_tokens


@pytest.fixture
def workload():
    prompt, *flood = prompts_of_lengths([200, 200, 200, 200], vocab=320, seed=5)
    return prompt, flood


@pytest.fixture
def reference(checkpoint, make_llm, workload):
    """The same requests on the same engine geometry with no tier: what every run must give."""
    llm = make_llm(checkpoint("llama_gqa"), **POOL)
    prompt, flood = workload
    first, second, cached = evict_and_return(llm, prompt, flood)
    assert cached == 0, "the flood must evict the prompt from the pool"
    assert first == second
    return first


HIT_TOKENS = (200 - 1) // 16 * 16  # a hit stops a block short of the last token


def test_host_tier_brings_an_evicted_prefix_back(checkpoint, make_llm, workload, reference):
    llm = make_llm(checkpoint("llama_gqa"), kv_offload_cpu="4MiB", **POOL)
    first, second, cached = evict_and_return(llm, *workload)
    assert first == second == reference
    assert cached == HIT_TOKENS
    st = llm.stats()
    assert st.tier_hit_tokens == HIT_TOKENS
    assert st.kv_offload["cpu"]["hits"] == HIT_TOKENS // 16
    assert st.kv_offload["cpu"]["failures"] == {}


def test_disk_tier_survives_a_restart(checkpoint, make_llm, workload, reference, tmp_path):
    prompt, flood = workload
    a = make_llm(checkpoint("llama_gqa"), kv_offload_disk=str(tmp_path), **POOL)
    evict_and_return(a, prompt, flood)
    a.engine.shutdown()
    files = list(tmp_path.iterdir())
    assert files and not [f for f in files if ".tmp" in f.name]
    b = make_llm(checkpoint("llama_gqa"), kv_offload_disk=str(tmp_path), **POOL)
    (out,) = b.generate([prompt], GREEDY)  # a fresh engine: its pool is empty
    assert out.outputs[0].token_ids == reference
    assert out.num_cached_tokens == HIT_TOKENS
    assert b.stats().kv_offload["disk"]["hits"] == HIT_TOKENS // 16


def test_redis_tier_is_shared_by_two_engines(checkpoint, make_llm, workload, reference, redis_url):
    prompt, flood = workload
    a = make_llm(checkpoint("llama_gqa"), kv_offload_redis=redis_url, **POOL)
    first, second, cached = evict_and_return(a, prompt, flood)
    assert first == second == reference and cached == HIT_TOKENS
    b = make_llm(checkpoint("llama_gqa"), kv_offload_redis=redis_url, **POOL)
    (out,) = b.generate([prompt], GREEDY)
    assert out.outputs[0].token_ids == reference
    assert out.num_cached_tokens == HIT_TOKENS
    assert b.stats().kv_offload["redis"]["hits"] == HIT_TOKENS // 16


def _entry_files(d: Path) -> list[Path]:
    return sorted(f for f in d.iterdir() if f.is_file())


@pytest.mark.parametrize("fault", ["flip", "truncate", "delete"])
def test_a_damaged_disk_entry_is_a_miss(checkpoint, make_llm, workload, reference, tmp_path, fault):
    prompt, flood = workload
    llm = make_llm(checkpoint("llama_gqa"), kv_offload_disk=str(tmp_path), **POOL)
    push_out(llm, prompt, flood)
    # The prompt's chain: its first block's entry is the one whose key the first hash makes.
    req_hashes = []
    from kvserve.kv.hashing import extend_block_hashes

    extend_block_hashes(req_hashes, prompt, 16, llm.engine.kv.root)
    key = llm.engine.offload.key(req_hashes[3])  # the 4th block: 3 blocks still load
    victim = next(f for f in _entry_files(tmp_path) if f.name.startswith(key.hex()))
    data = victim.read_bytes()
    if fault == "flip":
        i = len(data) - 7
        victim.write_bytes(data[:i] + bytes([data[i] ^ 0x40]) + data[i + 1 :])
    elif fault == "truncate":
        victim.write_bytes(data[: len(data) // 2])
    else:
        victim.unlink()
    (out,) = llm.generate([prompt], GREEDY)
    assert out.outputs[0].token_ids == reference
    assert out.num_cached_tokens == 3 * 16  # the blocks before the damaged one came back
    failures = llm.stats().kv_offload["disk"]["failures"]
    reason = {"flip": "checksum", "truncate": "truncated", "delete": "missing"}[fault]
    assert failures.get(reason) == 1, failures
    if fault != "delete":
        assert not victim.exists(), "a damaged entry must be dropped"


def test_a_full_disk_is_a_failed_store_not_an_error(
    checkpoint, make_llm, workload, reference, tmp_path, monkeypatch
):
    def no_space(self, key, data):  # noqa: ANN001
        raise TierError("full", "no space left on device")

    monkeypatch.setattr(DiskTier, "put", no_space)
    llm = make_llm(checkpoint("llama_gqa"), kv_offload_disk=str(tmp_path), **POOL)
    first, second, cached = evict_and_return(llm, *workload)
    assert first == second == reference and cached == 0
    st = llm.stats().kv_offload["disk"]
    assert st["failures"].get("full", 0) >= 1 and st["entries"] == 0


def test_redis_killed_and_restarted(checkpoint, make_llm, workload, reference, redis_server,
                                    redis_url, monkeypatch):  # fmt: skip
    import kvserve.kv.offload as offload_mod

    monkeypatch.setattr(offload_mod, "BACKOFF_START_S", 0.2)
    prompt, flood = workload
    llm = make_llm(checkpoint("llama_gqa"), kv_offload_redis=redis_url, kv_offload_timeout=0.2,
                   **POOL)  # fmt: skip
    llm.engine.offload._backoff["redis"] = 0.2
    _tokens(llm, [prompt])
    redis_server.stop()
    t0 = time.perf_counter()
    for f in flood:  # evictions now fail to store
        assert _tokens(llm, [f])
    (out,) = llm.generate([prompt], GREEDY)
    elapsed = time.perf_counter() - t0
    assert out.outputs[0].token_ids == reference
    assert out.num_cached_tokens == 0
    st = llm.stats().kv_offload["redis"]
    assert sum(st["failures"].values()) >= 1, st
    assert elapsed < 10, f"a dead Redis stalled the engine for {elapsed:.1f} s"
    redis_server.start()
    time.sleep(0.5)  # the back-off runs out
    first, second, cached = evict_and_return(llm, prompt, flood)
    assert first == second == reference
    assert cached == HIT_TOKENS, "the tier must work again once Redis is back"


def test_a_slow_tier_times_out_and_recomputes(checkpoint, make_llm, workload, reference, tmp_path):
    """A disk tier slower than the timeout (the worker fetches from it; host-tier hits on
    this CPU engine are memory copies on the engine thread, see the inline-load test)."""
    prompt, flood = workload
    llm = make_llm(checkpoint("llama_gqa"), kv_offload_disk=str(tmp_path),
                   kv_offload_timeout=0.02, **POOL)  # fmt: skip
    push_out(llm, prompt, flood)
    tier = llm.engine.offload.tiers[0]
    assert tier.name == "disk"
    real_get = tier.get

    def slow_get(key):  # noqa: ANN001
        time.sleep(0.5)
        return real_get(key)

    tier.get = slow_get
    t0 = time.perf_counter()
    (out,) = llm.generate([prompt], GREEDY)
    assert time.perf_counter() - t0 < 1.0, "the request waited for the slow tier"
    tier.get = real_get
    assert out.outputs[0].token_ids == reference
    assert out.num_cached_tokens == 0
    assert llm.stats().kv_offload["disk"]["failures"].get("load_timeout") == 1


def test_abort_while_loading_frees_everything(checkpoint, make_llm, workload):
    prompt, flood = workload
    llm = make_llm(checkpoint("llama_gqa"), kv_offload_cpu="4MiB", **POOL)
    push_out(llm, prompt, flood)
    llm.engine.offload.inline_host_loads = False  # the worker's load, landing after the abort
    tier = llm.engine.offload.tiers[0]
    real_get = tier.get
    tier.get = lambda key: (time.sleep(0.05), real_get(key))[1]
    engine = llm.engine
    engine.add_request("r", prompt, GREEDY)
    engine.step()
    (req,) = engine.requests.values()
    assert req.loading and engine.kv.num_used_blocks > 0
    engine.abort_request("r")
    assert engine.kv.num_used_blocks == 0
    time.sleep(0.2)  # the load finishes after the abort: its payloads go nowhere
    assert not engine.has_unfinished_requests()
    engine.step()
    engine.kv.check_invariants()
    assert engine.kv.num_used_blocks == 0


SMALL_POOL_PROMPTS = prompts_of_lengths([120] * 6, vocab=320, seed=9)


def _small_pool_pushed_out(checkpoint, make_llm, params, tier: bool):  # noqa: ANN001, ANN202
    """An engine of 28 blocks that served six 120-token prompts and then a flood that pushed
    them out of the pool (into the host tier, if ``tier``)."""
    kw = {"kv_offload_cpu": "4MiB"} if tier else {}
    llm = make_llm(checkpoint("llama_gqa"), num_gpu_blocks=28, block_size=16, **kw)
    for p in SMALL_POOL_PROMPTS + prompts_of_lengths([300, 300], vocab=320, seed=10):
        _tokens(llm, [p], params)
    if tier:
        assert llm.engine.offload.flush()
    return llm


def test_many_loads_in_a_small_pool_all_finish(checkpoint, make_llm):
    """More tier hits than the pool can hold at once: loads that hold blocks are released for
    running requests, nothing deadlocks, and every output equals the run without tiers."""
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    out = []
    for tier in (False, True):
        llm = _small_pool_pushed_out(checkpoint, make_llm, params, tier)
        out.append(_tokens(llm, SMALL_POOL_PROMPTS, params))
    assert out[0] == out[1]
    assert llm.stats().tier_hit_tokens > 0


def test_a_request_that_does_not_fit_waits_for_loads_in_flight(checkpoint, make_llm, monkeypatch):
    """Tier loads hold most of an idle pool: the next request waits for them to land and run
    (then hits the tier itself) instead of taking a loading request's blocks and recomputing
    one of the two prompts from scratch."""
    # The tier is slowed only to keep loads in flight: load its hits even so (the rule that
    # computes hits whose load would be slower is tested on its own).
    monkeypatch.setattr(OffloadConnector, "_pays", lambda self, n: True)
    prompts = SMALL_POOL_PROMPTS
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    got = []
    for tier in (False, True):
        llm = _small_pool_pushed_out(checkpoint, make_llm, params, tier)
        if tier:
            llm.engine.offload.inline_host_loads = False  # the worker's loads, in flight
            host = llm.engine.offload.tiers[0]
            real_get = host.get
            host.get = lambda key, get=real_get: (time.sleep(0.002), get(key))[1]  # in flight
        outs = llm.generate(prompts, params)
        got.append([o.outputs[0].token_ids for o in outs])
    assert got[0] == got[1]
    hit = (120 - 1) // 16 * 16
    assert [o.num_cached_tokens for o in outs] == [hit] * len(prompts)
    assert llm.stats().tier_hit_tokens == hit * len(prompts)  # a released load counts once
    llm.engine.kv.check_invariants()


def test_preempted_requests_come_back_from_the_tier(checkpoint, make_llm):
    prompts = prompts_of_lengths([100] * 4, vocab=320, seed=11)
    params = SamplingParams(max_tokens=120, temperature=0, ignore_eos=True)
    got = []
    for kw in ({}, {"kv_offload_cpu": "8MiB"}):
        llm = make_llm(checkpoint("llama_gqa"), num_gpu_blocks=30, block_size=16, **kw)
        got.append(_tokens(llm, prompts, params))
        st = llm.stats()
        assert st.num_preemptions > 0
    assert got[0] == got[1]
    assert st.preempted_tokens_restored > 0


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption_mode_decides_whether_preempted_requests_load(checkpoint, make_llm, mode):
    """With a tier, swap brings a preempted request's blocks back from it; recompute never
    loads them, so it schedules exactly as an engine without tiers (same preemptions, same
    tokens restored from the pool and recomputed), while evicted blocks still go down."""
    prompts = prompts_of_lengths([100] * 4, vocab=320, seed=11)
    params = SamplingParams(max_tokens=120, temperature=0, ignore_eos=True)
    runs = []
    for kw in ({}, {"kv_offload_cpu": "8MiB", "preemption_mode": mode}):
        llm = make_llm(checkpoint("llama_gqa"), num_gpu_blocks=30, block_size=16, **kw)
        runs.append((_tokens(llm, prompts, params), llm.stats()))
    (plain, base), (tokens, st) = runs
    assert tokens == plain and st.num_preemptions > 0
    sched = (st.num_preemptions, st.preempted_tokens_restored, st.preempted_tokens_recomputed)
    if mode == "swap":
        assert st.tier_hit_tokens > 0
        assert st.preempted_tokens_recomputed < base.preempted_tokens_recomputed
    else:
        assert st.tier_hit_tokens == 0 and st.kv_offload["cpu"]["stored"] > 0
        assert sched == (base.num_preemptions, base.preempted_tokens_restored,
                         base.preempted_tokens_recomputed)  # fmt: skip


@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3", "kivi4"])
def test_quantized_formats_round_trip_through_a_tier(checkpoint, make_llm, workload, fmt):
    """A lossy format's hit attends to quantized K/V where a recompute attends to exact K/V
    within its chunk, so the reference is a device hit in a pool big enough to keep it."""
    prompt, flood = workload
    big = make_llm(checkpoint("llama_gqa"), kv_cache_dtype=fmt, num_gpu_blocks=200, block_size=16)
    cold = _tokens(big, [prompt])[0]
    (hit,) = big.generate([prompt], GREEDY)
    assert hit.num_cached_tokens == HIT_TOKENS
    llm = make_llm(checkpoint("llama_gqa"), kv_cache_dtype=fmt, kv_offload_cpu="4MiB", **POOL)
    first, second, cached = evict_and_return(llm, prompt, flood)
    assert first == cold
    assert second == hit.outputs[0].token_ids
    assert cached == HIT_TOKENS


def test_entries_never_cross_models_formats_or_tenants(checkpoint, make_llm, workload, redis_url):
    prompt, flood = workload
    base = make_llm(checkpoint("llama_gqa"), kv_offload_redis=redis_url, **POOL)
    evict_and_return(base, prompt, flood)
    others = {
        "other weights, same shapes": (checkpoint("llama_gqa", seed=99), {}, prompt),
        "another KV format": (checkpoint("llama_gqa"), {"kv_cache_dtype": "int8"}, prompt),
        "another tenant": (
            checkpoint("llama_gqa"),
            {},
            {"prompt_token_ids": prompt, "cache_salt": "tenant-b"},
        ),
    }
    for what, (model, kw, p) in others.items():
        llm = make_llm(model, kv_offload_redis=redis_url, **POOL, **kw)
        (out,) = llm.generate([p], GREEDY)
        assert out.num_cached_tokens == 0, what
        assert llm.stats().kv_offload["redis"]["hits"] == 0, what
    same = make_llm(checkpoint("llama_gqa"), kv_offload_redis=redis_url, **POOL)
    (out,) = same.generate([prompt], GREEDY)
    assert out.num_cached_tokens == HIT_TOKENS  # and the same config does share


def test_tier_sizes_are_respected(checkpoint, make_llm, tmp_path):
    prompts = prompts_of_lengths([200] * 8, vocab=320, seed=12)
    llm = make_llm(checkpoint("llama_gqa"), kv_offload_cpu="40KiB", kv_offload_disk=str(tmp_path),
                   kv_offload_disk_size="60KiB", **POOL)  # fmt: skip
    for p in prompts:
        _tokens(llm, [p])
    assert llm.engine.offload.flush()
    st = llm.stats().kv_offload
    assert 0 < st["cpu"]["used_bytes"] <= 40 * 1024 and st["cpu"]["evictions"] > 0
    on_disk = sum(f.stat().st_size for f in _entry_files(tmp_path))
    assert 0 < on_disk <= 60 * 1024 and st["disk"]["evictions"] > 0
    assert on_disk == st["disk"]["used_bytes"]


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"kv_offload_redis": "redis://localhost:99999/0"}, "kv_offload_redis"),
        ({"kv_offload_redis": "http://localhost:6379"}, "kv_offload_redis"),
        ({"kv_offload_redis": "redis://localhost:6379/db"}, "kv_offload_redis"),
        ({"kv_offload_cpu": "lots"}, "kv_offload_cpu"),
        ({"kv_offload_cpu": "1KiB"}, "kv_offload_cpu"),  # smaller than one 4 KiB block
        ({"kv_offload_disk": "/tmp", "kv_offload_disk_size": "-5GB"}, "kv_offload_disk_size"),
        ({"kv_offload_redis": "redis://h:1/0", "kv_offload_redis_size": "x"},
         "kv_offload_redis_size"),
        ({"kv_offload_cpu": "1GiB", "kv_offload_timeout": 0}, "kv_offload_timeout"),
        ({"kv_offload_cpu": "1GiB", "enable_prefix_caching": False}, "kv_offload_"),
        ({"kv_offload_cpu": "1GiB", "kv_offload_write_policy": "always"},
         "kv_offload_write_policy"),
        ({"kv_offload_cpu": "1GiB", "kv_offload_reuse_threshold": 0},
         "kv_offload_reuse_threshold"),
        ({"kv_offload_cpu": "1GiB", "calculate_kv_scales": True, "kv_cache_dtype": "fp8_e4m3"},
         "calculate_kv_scales"),
        ({"kv_offload_cpu": "1GiB", "preemption_mode": "swapp"}, "preemption_mode"),
        ({"preemption_mode": "swap"}, "preemption_mode: swap needs an offload tier"),
    ],
)  # fmt: skip
def test_bad_offload_flags_fail_at_start_naming_the_field(checkpoint, make_llm, kwargs, field):
    with pytest.raises(ConfigError, match=field.replace("_", "[-_]")):
        make_llm(checkpoint("llama_gqa"), **POOL, **kwargs)


def test_an_unusable_disk_directory_names_the_flag(checkpoint, make_llm, tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    for bad in (a_file, a_file / "below"):
        with pytest.raises(ConfigError, match="kv-offload-disk|kv_offload_disk"):
            make_llm(checkpoint("llama_gqa"), kv_offload_disk=str(bad), **POOL)


def test_cli_refuses_both_cpu_size_flags():
    import argparse

    from kvserve.engine_args import add_engine_args, engine_kwargs

    p = argparse.ArgumentParser()
    add_engine_args(p)
    args = p.parse_args(["--kv-offload-cpu", "1GiB", "--kv-offloading-size", "2"])
    with pytest.raises(ConfigError, match="kv_offloading_size"):
        engine_kwargs(args)
    args = p.parse_args(["--kv-offloading-size", "1.5"])
    assert engine_kwargs(args)["kv_offload_cpu"] == "1.5GiB"
    args = p.parse_args(["--kv-offloading-size", "0"])
    with pytest.raises(ConfigError, match="kv_offloading_size"):
        engine_kwargs(args)
    args = p.parse_args(["--kv-offload-cpu", "1GiB", "--preemption-mode", "recompute"])
    assert engine_kwargs(args)["preemption_mode"] == "recompute"
    assert engine_kwargs(p.parse_args([]))["preemption_mode"] is None  # swap iff a tier


def test_replicas_share_tenant_partitions_only_through_the_shared_secret(monkeypatch):
    from kvserve.server.tenants import TenantResolver

    SECRET_ENV = "KVSERVE_TENANT_SECRET"

    keys = '{"k1": "alice", "k2": "bob"}'

    def resolver(tmp: Path) -> TenantResolver:
        f = tmp / "tenants.json"
        f.write_text(keys)
        return TenantResolver.from_args(None, str(f))

    import tempfile

    with tempfile.TemporaryDirectory() as d:
        monkeypatch.delenv(SECRET_ENV, raising=False)
        a, b = resolver(Path(d)), resolver(Path(d))
        assert a.cache_salt("alice", None) != b.cache_salt("alice", None)  # per process
        monkeypatch.setenv(SECRET_ENV, "s" * 32)
        a, b = resolver(Path(d)), resolver(Path(d))
        assert a.cache_salt("alice", None) == b.cache_salt("alice", None)
        assert a.cache_salt("alice", None) != b.cache_salt("bob", None)
        monkeypatch.setenv(SECRET_ENV, "short")
        with pytest.raises(ValueError, match=SECRET_ENV):
            resolver(Path(d))
    monkeypatch.delenv(SECRET_ENV)
    open_a, open_b = TenantResolver.from_args(None, None), TenantResolver.from_args(None, None)
    assert open_a.cache_salt("default", None) == open_b.cache_salt("default", None)


@pytest.mark.parametrize("policy, hits_before_store", [("write_through", 0),
                                                       ("write_through_selective", 2)])  # fmt: skip
def test_write_through_shares_a_prefix_before_any_eviction(
    checkpoint, make_llm, workload, reference, redis_url, policy, hits_before_store
):
    prompt, _ = workload
    kw = dict(kv_offload_redis=redis_url, kv_offload_write_policy=policy,
              kv_offload_reuse_threshold=2, num_gpu_blocks=200, block_size=16)  # fmt: skip
    a = make_llm(checkpoint("llama_gqa"), **kw)
    for i in range(hits_before_store + 1):  # the first run computes; each later one is a hit
        assert _tokens(a, [prompt])[0] == reference
        assert a.engine.offload.flush()
        stored = a.stats().kv_offload["redis"]["stored"]
        want = HIT_TOKENS // 16 if i == hits_before_store else 0
        assert stored >= want and (stored == 0) == (want == 0), (i, stored)
    assert a.stats().prefix_cache_evictions == 0  # nothing left the pool: written through
    b = make_llm(checkpoint("llama_gqa"), **kw)
    (out,) = b.generate([prompt], GREEDY)
    assert out.outputs[0].token_ids == reference
    assert out.num_cached_tokens == HIT_TOKENS


def test_two_servers_share_a_prefix_through_redis_over_http(checkpoint, redis_url, workload):
    """Replica A computes a prompt; replica B, another engine on the same Redis, serves it as a
    hit (the usage's cached_tokens), with the same tokens; /metrics shows the tier's work."""
    from openai import OpenAI

    from kvserve import LLM
    from kvserve.server.app import BackgroundServer, build_state
    from kvserve.server.tenants import TenantResolver
    from tests.test_server import scrape

    prompt, _ = workload
    kw = dict(kv_offload_redis=redis_url, kv_offload_write_policy="write_through", **POOL)
    engines = [LLM(checkpoint("llama_gqa"), **kw).engine for _ in range(2)]
    resolver = TenantResolver.from_args(None, None)  # open servers: one tenant, a fixed secret
    outs = []
    with BackgroundServer(build_state(engines[0], ["m"], resolver, max_queue=8)) as a:
        with BackgroundServer(build_state(engines[1], ["m"], resolver, max_queue=8)) as b:
            for srv in (a, b):
                client = OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
                r = client.completions.create(model="m", prompt=prompt, max_tokens=6,
                                              temperature=0)  # fmt: skip
                outs.append(r)
                if srv is a:  # the write-through lands off the step path
                    deadline = time.monotonic() + 10
                    while engines[0].offload.stats()["redis"]["stored"] < HIT_TOKENS // 16:
                        assert time.monotonic() < deadline, "A never stored its prefix"
                        time.sleep(0.05)
                        engines[0].offload.flush()
            metrics = scrape(b.url)
    assert outs[0].choices[0].text == outs[1].choices[0].text
    assert outs[0].usage.prompt_tokens_details.cached_tokens == 0
    assert outs[1].usage.prompt_tokens_details.cached_tokens == HIT_TOKENS
    hits = metrics[("kvserve:kv_offload_hits_total", (("tier", "redis"),))]
    assert hits == HIT_TOKENS // 16
    loaded = metrics[("kvserve:kv_offload_bytes_total", (("direction", "load"), ("tier", "redis")))]
    assert loaded > 0
    assert metrics[("kvserve:kv_offload_hit_tokens_total", ())] == HIT_TOKENS


def test_a_failed_steps_evictions_are_never_stored():
    """A step that failed may have written the blocks it evicted: the record gives them back
    for freeing, never for a tier, also when an import takes evictions out in between."""
    from kvserve.connectors.base import Role, StepBlocks
    from kvserve.connectors.offload import OffloadConnector
    from kvserve.kv.manager import KVCacheManager
    from kvserve.kv.ops import KVOps

    kv = KVCacheManager(num_blocks=8, block_size=2)
    h = [bytes([i]) * 32 for i in range(4)]
    kv.restore_ops(KVOps(evicted=[(1, h[1]), (2, h[2])]))
    kv.pool.evicted.append((3, h[3]))  # evicted after the failure: its bytes are intact
    assert kv.take_evictions([1]) == []  # an import reuses block 1: nothing to store
    ops = kv.take_ops()
    assert sorted(ops.evicted) == [(2, h[2]), (3, h[3])]
    tiers = SimpleNamespace(wants=lambda h: True, write_through_hits=None)
    connector = OffloadConnector(Role.SCHEDULER, kv, tiers)
    connector.on_blocks(StepBlocks(ops.evicted, ops.num_restored_evictions, ops.hot))
    assert connector.build_connector_meta().saves_before == [(3, h[3])]


def test_a_store_backlog_drops_blocks_instead_of_blocking():
    import torch

    from kvserve.kv.offload import KVOffload
    from kvserve.kv.storage import BlockPayload
    from kvserve.kv.tiers import HostTier

    off = KVOffload([HostTier(1 << 20)], b"n" * 16, {"format": "x"}, max_pending_bytes=1000)
    try:
        big = BlockPayload({"format": "x"}, 1, {"k": torch.zeros(1, 1, 400)})  # 1,600 bytes
        off.store([b"h" * 32], big)
        assert off.flush()
        assert off.dropped_stores == 1
        assert off.stats()["cpu"]["failures"] == {"store_backlog": 1}
        assert off.stats()["cpu"]["entries"] == 0
        small = BlockPayload({"format": "x"}, 1, {"k": torch.zeros(1, 1, 100)})  # 400 bytes
        off.store([b"i" * 32], small)
        assert off.flush() and off.stats()["cpu"]["entries"] == 1
    finally:
        off.close()


def hold_gets(tier):  # noqa: ANN001, ANN201
    """Make the tier's gets wait until ``go`` is set; ``fetching`` is set once one waits (the
    worker is inside a load)."""
    import threading

    fetching, go = threading.Event(), threading.Event()
    real_get = tier.get

    def held_get(key):  # noqa: ANN001, ANN202
        fetching.set()
        go.wait(5)
        return real_get(key)

    tier.get = held_get
    return fetching, go


def test_a_load_asked_again_gets_its_own_blocks_not_the_cancelled_ones():
    """A request whose load is released and asked again under the same id, while the worker
    still fetches the first: the first fetch's blocks (other keys, for other pool blocks)
    must never be handed to the second load."""

    import torch

    from kvserve.kv.offload import KVOffload
    from kvserve.kv.storage import BlockPayload
    from kvserve.kv.tiers import HostTier

    ident = {"format": "x"}
    off = KVOffload([HostTier(1 << 20)], b"n" * 16, ident)
    tier = off.tiers[0]
    try:
        a, b = [b"a" * 32, b"c" * 32], [b"b" * 32]
        for i, h in enumerate([*a, *b]):
            off.store([h], BlockPayload(ident, 1, {"k": torch.full((1, 4), float(i))}))
        assert off.flush()
        fetching, go = hold_gets(tier)
        off.start_load("r", a)
        assert fetching.wait(5)  # the worker is inside the first load
        off.cancel("r")
        off.start_load("r", b)
        go.set()
        deadline, got = time.monotonic() + 5, {}
        while "r" not in got and time.monotonic() < deadline:
            got = off.poll_loads(wait=True)
        (payload,) = got["r"].payloads
        assert payload.num_blocks == 1
        assert payload.tensors["k"].eq(2.0).all()  # b's block, not a's two
    finally:
        off.close()


def test_host_tier_hits_load_on_the_engine_thread(tmp_path):
    """With ``inline_host_loads`` (a CPU engine whose compute threads take every core), a
    load the host tier holds whole is fetched by the caller's thread inside ``start_load``
    and is ready at the next poll without waiting. A load the host tier holds only part of
    (a block evicted from it since the probe) goes to the worker, which takes the rest from
    the disk tier behind it."""
    import threading

    import torch

    from kvserve.kv.offload import KVOffload
    from kvserve.kv.storage import BlockPayload
    from kvserve.kv.tiers import HostTier

    ident = {"format": "x"}
    off = KVOffload([HostTier(1 << 20), DiskTier(str(tmp_path), 1 << 20)], b"n" * 16, ident,
                    inline_host_loads=True)  # fmt: skip
    host, disk = off.tiers
    try:
        hashes = [bytes([i]) * 32 for i in range(4)]
        for i, h in enumerate(hashes):
            off.store([h], BlockPayload(ident, 1, {"k": torch.full((1, 4), float(i))}))
        assert off.flush()
        threads = []
        real_many = host.get_many
        host.get_many = lambda keys: (threads.append(threading.get_ident()), real_many(keys))[1]
        me = threading.get_ident()
        assert off.probe(hashes) == 4
        off.start_load("r", hashes)
        assert threads == [me]  # fetched here, not on the worker
        (payload,) = off.poll_loads(wait=False)["r"].payloads
        assert payload.num_blocks == 4
        assert payload.tensors["k"][0, ::4].tolist() == [0.0, 1.0, 2.0, 3.0]  # blocks on dim 1
        assert off.counters["disk"].queries == 0
        # One block gone from host memory since the probe: the worker loads the chain.
        assert off.probe(hashes) == 4
        host.delete(off.key(hashes[2]))
        off.start_load("s", hashes)
        deadline, got = time.monotonic() + 5, {}
        while "s" not in got and time.monotonic() < deadline:
            got = off.poll_loads(wait=True)
        (payload,) = got["s"].payloads
        assert payload.tensors["k"][0, ::4].tolist() == [0.0, 1.0, 2.0, 3.0]
        assert len(threads) == 2 and threads[1] != me  # the worker asked the host tier
        assert off.counters["disk"].hits == 1  # the evicted block, from disk
    finally:
        off.close()


def test_a_cpu_engine_that_takes_every_core_loads_host_hits_inline(monkeypatch):
    """The engine's rule (``compute_takes_every_core``): on a CPU whose every core the
    compute threads take, and not where cores are left over for the worker, nor on a GPU."""
    import os

    import torch

    from kvserve.engine import offload

    threads = torch.get_num_threads()
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(threads)))
    assert offload.compute_takes_every_core("cpu")
    assert not offload.compute_takes_every_core("cuda")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(threads + 2)))
    assert not offload.compute_takes_every_core("cpu")


def test_a_tier_slower_than_the_prefill_is_not_loaded(checkpoint, make_llm):
    """Once the tier's loads are measured slower than computing the same tokens (here 20 ms
    a block against well under a millisecond of prefill each), its hits are computed instead:
    counted as skipped, no tier tokens, outputs equal to the run without tiers."""
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    plain = _small_pool_pushed_out(checkpoint, make_llm, params, tier=False)
    reference = _tokens(plain, SMALL_POOL_PROMPTS, params)
    llm = _small_pool_pushed_out(checkpoint, make_llm, params, tier=True)
    host = llm.engine.offload.tiers[0]
    real_get = host.get
    host.get = lambda key, get=real_get: (time.sleep(0.02), get(key))[1]
    got, cached = [], []
    for p in SMALL_POOL_PROMPTS:  # one at a time: the first loads measure the tier
        (out,) = llm.generate([p], params)
        got.append(out.outputs[0].token_ids)
        cached.append(out.num_cached_tokens)
    assert got == reference
    st = llm.stats()
    assert cached[:2] == [112, 112], "before the tier is measured, hits are loaded"
    assert st.tier_loads_skipped >= 1 and cached[-1] == 0
    assert st.tier_hit_tokens == sum(cached)


def test_backlog_is_the_queued_loads_blocks_at_the_measured_rate():
    """What the load rule adds before a new load lands: 0 until the tiers' rate is measured,
    then the blocks of every load not yet fetched times the mean seconds per block the worker
    timed."""

    import torch

    from kvserve.kv.offload import RATE_MIN_HITS, KVOffload
    from kvserve.kv.storage import BlockPayload
    from kvserve.kv.tiers import HostTier

    ident = {"format": "x"}
    off = KVOffload([HostTier(1 << 20)], b"n" * 16, ident)
    tier = off.tiers[0]
    try:
        keys = [bytes([i]) * 32 for i in range(RATE_MIN_HITS + 5)]
        for i, h in enumerate(keys):
            off.store([h], BlockPayload(ident, 1, {"k": torch.full((1, 4), float(i))}))
        assert off.flush()
        off.start_load("warm", keys[: RATE_MIN_HITS - 1])
        while not off.poll_loads(wait=True):
            pass
        assert off.backlog_seconds() == 0.0  # 7 blocks timed: not trusted yet
        off.start_load("warm2", keys[RATE_MIN_HITS - 1 : RATE_MIN_HITS])
        while not off.poll_loads(wait=True):
            pass
        c = off.counters["cpu"]
        assert c.hits == RATE_MIN_HITS
        per_block = c.seconds_up / c.hits
        fetching, go = hold_gets(tier)
        off.start_load("a", keys[RATE_MIN_HITS : RATE_MIN_HITS + 3])
        assert fetching.wait(5)  # the worker is inside a's load
        off.start_load("b", keys[RATE_MIN_HITS + 3 :])
        assert off.backlog_seconds() == pytest.approx(5 * per_block)
        go.set()
        done: dict = {}
        deadline = time.monotonic() + 5
        while len(done) < 2 and time.monotonic() < deadline:
            done |= off.poll_loads(wait=True)
        assert set(done) == {"a", "b"}
        assert off.backlog_seconds() == 0.0  # nothing left to fetch
    finally:
        off.close()


def test_the_offload_worker_runs_torch_on_itself_alone():
    """The worker's torch ops (joining loaded blocks, selecting a store's) run on a team of
    one, while the thread that made the offload keeps its team: a worker pool of its own
    would throttle the engine's compute threads (kernels/openmp.py)."""
    import torch

    from kvserve.kv.offload import KVOffload
    from kvserve.kv.storage import BlockPayload
    from kvserve.kv.tiers import HostTier

    teams: list[int] = []

    class Recording(HostTier):
        def put(self, key: bytes, data: bytes) -> bool:
            teams.append(torch.get_num_threads())  # on the worker thread
            return super().put(key, data)

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    ident = {"format": "x"}
    off = KVOffload([Recording(1 << 20)], b"n" * 16, ident)
    try:
        off.store([b"a" * 32, b"b" * 32], BlockPayload(ident, 2, {"k": torch.ones(1, 2, 4)}))
        assert off.flush()
        assert teams == [1, 1]
        assert torch.get_num_threads() == 2
    finally:
        off.close()
        torch.set_num_threads(before)
