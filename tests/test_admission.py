"""Admission control through the real Scheduler and KVCacheManager, driven by the fake runner:
projected admission never preempts while outputs stay within their estimates (and greedy does
on the same traffic), refusals lose no request and leak no block, priorities order admission
and preemption with starvation bounded, and a burst on one prefix computes it once."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve import SamplingParams
from kvserve.config import ConfigError, SchedulerConfig
from kvserve.engine import EngineCore, EngineCoreRequest
from kvserve.kv.manager import KVCacheManager, cdiv
from kvserve.sched.request import InvalidRequestError, RequestStatus, RequestTags
from kvserve.sched.workload_classes import WorkloadClass
from tests.conftest import check_blocks
from tests.test_engine_core import VOCAB, FakeRunner, VirtualClock, expected_tokens

BS = 4


def make_core(num_blocks: int, **sched) -> tuple[EngineCore, VirtualClock]:
    kv = KVCacheManager(num_blocks, BS, enable_caching=True)
    clock = VirtualClock()
    cfg = SchedulerConfig(**{"max_num_seqs": 16, "max_num_batched_tokens": 64, **sched})
    core = EngineCore(cfg, kv, FakeRunner(num_blocks, BS), max_model_len=256, clock=clock)
    return core, clock


def add(core, clock, rid, prompt, max_tokens, priority=0, wclass=None, **params):
    p = SamplingParams(max_tokens=max_tokens, **params)
    req = EngineCoreRequest(rid, None, prompt, p, max_tokens, clock(), priority=priority,
                            workload_class=wclass)  # fmt: skip
    return core.add_request(req)[0]


def drain(core, limit: int = 20_000) -> int:
    steps = 0
    while core.has_unfinished_requests():
        core.step()
        check_blocks(core)
        steps += 1
        assert steps < limit, "the workload does not finish"
    assert core.kv.num_used_blocks == 0
    return steps


def random_traffic(core, clock, rng: random.Random, n: int, eos: bool) -> dict:
    """Requests arrive a few per step with random prompt and output lengths; with ``eos``
    they may stop early (outputs stay within max_tokens either way). Returns id -> request."""
    reqs, added = {}, 0
    while added < n or core.has_unfinished_requests():
        for _ in range(min(rng.choice([0, 1, 1, 2, 4]), n - added)):
            prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 40))]
            stop = {"stop_token_ids": [3]} if eos and rng.random() < 0.5 else {}
            rid = f"r{added}"
            reqs[rid] = add(core, clock, rid, prompt, rng.randrange(1, 40), **stop)
            added += 1
        core.step()
        check_blocks(core)
    return reqs


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), eos=st.booleans())
def test_projected_never_preempts_within_estimates(seed, eos):
    """With every output at most its estimate (max_tokens), projected admission reserves
    enough: no running request ever fails to get a block. Every request still finishes with
    exactly the tokens the fake runner gives it."""
    core, clock = make_core(40, admission="projected", admission_watermark=0.0)
    reqs = random_traffic(core, clock, random.Random(seed), 60, eos)
    assert core.scheduler.num_preemptions == 0
    assert core.scheduler.stats.allocation_failures == 0
    for rid, r in reqs.items():
        assert r.status in (RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_STOPPED)
        p = r.sampling_params
        assert r.output_token_ids == expected_tokens(rid, p, r.max_tokens)


def test_greedy_preempts_on_the_same_traffic():
    """The property above is not vacuous: greedy admission on such traffic preempts."""
    preempted = 0
    for seed in range(5):
        core, clock = make_core(40)
        random_traffic(core, clock, random.Random(seed), 60, eos=False)
        preempted += core.scheduler.num_preemptions
    assert preempted > 0


def test_projected_admits_only_what_fits_its_whole_life():
    """Two requests of 8 prompt + 24 output tokens need 8 blocks each; a pool of 12 blocks
    runs one at a time under projected admission (no preemption), both at once (then one is
    preempted) under greedy."""
    for policy, together, preempts in (("projected", False, 0), ("greedy", True, 1)):
        core, clock = make_core(12, admission=policy, admission_watermark=0.0)
        a = add(core, clock, "a", list(range(8)), 24, ignore_eos=True)
        b = add(core, clock, "b", list(range(10, 18)), 24, ignore_eos=True)
        core.step()
        assert (b.status == RequestStatus.RUNNING) is together, policy
        assert cdiv(8 + 24, BS) == 8
        drain(core)
        assert core.scheduler.num_preemptions >= preempts, policy
        if policy == "projected":
            assert core.scheduler.num_preemptions == 0
        assert a.num_output_tokens == b.num_output_tokens == 24


def test_projected_counts_prefix_hits_and_running_growth():
    """A follower that shares a cached 16-token prefix needs only its own blocks: it fits
    beside the leader where an unrelated request of the same length does not."""
    core, clock = make_core(14, admission="projected", admission_watermark=0.0)
    prefix = list(range(16))
    lead = add(core, clock, "lead", prefix + [20], 8, ignore_eos=True)
    core.step()  # the leader's prefill publishes 4 full blocks; it grows to 7 blocks
    follow = add(core, clock, "follow", prefix + [21], 8, ignore_eos=True)
    other = add(core, clock, "other", list(range(30, 47)), 8, ignore_eos=True)
    core.step()
    # leader 7 + follower 3 of its own = 10 <= 14; the other would need 7 more
    assert follow.status == RequestStatus.RUNNING and follow.num_cached_tokens == 16
    assert other.status == RequestStatus.WAITING
    drain(core)
    assert lead.is_finished and other.num_output_tokens == 8
    assert core.scheduler.num_preemptions == 0


def test_a_request_larger_than_the_projection_room_still_runs_alone():
    """Nothing running: the head is admitted even if its projection exceeds the free pool
    minus the watermark (it fits the pool: the input processor checks that), so nothing
    stalls."""
    core, clock = make_core(9, admission="projected", admission_watermark=0.5)
    r = add(core, clock, "big", list(range(12)), 20, ignore_eos=True)
    drain(core)
    assert r.num_output_tokens == 20


CHAT = WorkloadClass("chat", ttft_slo=0.005)


def test_deadline_refusal_loses_nothing():
    """Requests whose TTFT SLO passes while they wait are refused with a reason and hold no
    block; the rest finish normally and nothing is lost."""
    core, clock = make_core(12, admission="projected", admission_watermark=0.0)
    long = add(core, clock, "long", list(range(8)), 24, ignore_eos=True)
    late = [add(core, clock, f"c{i}", list(range(40 + i, 48 + i)), 24, ignore_eos=True,
                wclass=CHAT) for i in range(3)]  # fmt: skip
    finished = []
    while core.has_unfinished_requests():
        finished += core.step()
        check_blocks(core)
    assert long.num_output_tokens == 24
    for r in late:
        assert r.status == RequestStatus.FINISHED_REFUSED
        assert r.refusal.reason == "deadline" and r.refusal.retry_after >= 1
        assert r.num_output_tokens == 0 and not core.kv.block_ids(r)
        assert r in finished  # reported once, as an output
    assert core.scheduler.admission.stats.refused == {"deadline": 3}
    assert core.kv.num_used_blocks == 0


def test_projected_wait_refuses_at_arrival():
    """Once the engine has measured how fast blocks free, a request whose projected wait
    exceeds its SLO is refused as it arrives, before it waits at all."""
    core, clock = make_core(10, admission="projected", admission_watermark=0.0)
    for i in range(6):  # teach the block release rate
        add(core, clock, f"w{i}", list(range(i, i + 8)), 4, ignore_eos=True)
    drain(core)
    add(core, clock, "hog", list(range(8)), 30, ignore_eos=True)
    core.step()
    queued = [add(core, clock, f"q{i}", list(range(50 + i, 58 + i)), 30, ignore_eos=True)
              for i in range(3)]  # fmt: skip
    strict = WorkloadClass("strict", ttft_slo=1e-6)
    r = add(core, clock, "x", list(range(90, 98)), 30, ignore_eos=True, wclass=strict)
    assert r.status == RequestStatus.FINISHED_REFUSED and r.refusal.reason == "projected_wait"
    out = core.step()
    assert r in out
    drain(core)
    assert all(q.num_output_tokens == 30 for q in queued)


def test_priority_orders_admission_and_preemption():
    """Under scheduling_policy=priority the lower value runs first and a running request of
    a higher value is preempted first when blocks run out."""
    core, clock = make_core(12, scheduling_policy="priority", max_num_seqs=1)
    low = add(core, clock, "low", list(range(8)), 4, priority=5, ignore_eos=True)
    high = add(core, clock, "high", list(range(20, 28)), 4, priority=-1, ignore_eos=True)
    core.step()
    assert high.status == RequestStatus.RUNNING and low.status == RequestStatus.WAITING
    drain(core)
    assert high.metrics.first_token_time < low.metrics.first_token_time

    core, clock = make_core(12, scheduling_policy="priority")
    a = add(core, clock, "a", list(range(8)), 24, priority=1, ignore_eos=True)
    b = add(core, clock, "b", list(range(20, 28)), 24, priority=0, ignore_eos=True)
    drain(core)
    assert a.num_preemptions >= 1 and b.num_preemptions == 0


def test_priority_starvation_is_bounded():
    """A low-priority request under a stream of high-priority ones is admitted after at most
    lpm_max_skips others jumped it."""
    core, clock = make_core(64, scheduling_policy="priority", max_num_seqs=1, lpm_max_skips=3)
    low = add(core, clock, "low", list(range(4)), 2, priority=9, ignore_eos=True)
    highs = []
    while low.status == RequestStatus.WAITING:
        rid = f"h{len(highs)}"
        highs.append(add(core, clock, rid, list(range(10, 14)), 2, priority=0, ignore_eos=True))
        core.step()
        assert len(highs) < 40
    began = low.metrics.first_scheduled_time or float("inf")
    jumped = [h for h in highs if (h.metrics.first_scheduled_time or float("inf")) < began]
    assert len(jumped) == 3 and len(highs) > 4  # others still wait behind it
    drain(core)


def test_same_step_prefix_followers_hit():
    """32 requests on one 64-token prefix arrive at once: the leader computes the prefix
    and the 31 followers are held one step and hit it (without holding, the ones admitted
    in the leader's step compute it again)."""
    for hold in (True, False):
        core, clock = make_core(200, max_num_seqs=32, max_num_batched_tokens=256,
                                hold_prefix_followers=hold)  # fmt: skip
        prefix = list(range(64))
        reqs = [add(core, clock, f"r{i}", prefix + [i % VOCAB, 7], 2, ignore_eos=True)
                for i in range(32)]  # fmt: skip
        drain(core)
        hits = sum(1 for r in reqs if r.num_cached_tokens == 64)
        if hold:
            assert hits == 31
        else:
            assert hits < 31  # the budget admits several alongside the leader
        assert all(r.num_output_tokens == 2 for r in reqs)


# -- the engine: flags, bad input, achieved memory bandwidth ------------------------------------
def test_bad_admission_settings_name_the_field():
    with pytest.raises(ConfigError, match="admission: must be one of greedy, projected"):
        SchedulerConfig(admission="eager")
    with pytest.raises(ConfigError, match=r"admission_watermark: must be in \[0, 1\)"):
        SchedulerConfig(admission_watermark=1.5)
    with pytest.raises(ConfigError, match="scheduling_policy: must be one of fcfs, lpm, priority"):
        SchedulerConfig(scheduling_policy="sjf")


def test_bad_priority_is_refused_naming_it(checkpoint, make_llm):
    llm = make_llm(checkpoint("llama_gqa"), dtype="float32", scheduling_policy="priority")
    for bad in ("high", True, 2**40, 1.5):
        with pytest.raises(InvalidRequestError, match="priority: must be an integer") as e:
            llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), priority=[bad])
        assert e.value.field == "priority"
    with pytest.raises(InvalidRequestError, match="priority: 1 given for 2 prompts"):
        llm.generate([[1, 2], [3, 4]], SamplingParams(max_tokens=2), priority=[0])
    with pytest.raises(InvalidRequestError, match="workload_class: this engine has no"):
        tags = RequestTags(workload_class="chat")
        llm.engine.add_request(None, [1, 2], SamplingParams(max_tokens=2), tags=tags)
    out = llm.generate([[1, 2, 3], [4, 5, 6]], SamplingParams(max_tokens=3, temperature=0),
                       priority=[3, -1])  # fmt: skip
    assert [len(o.outputs[0].token_ids) for o in out] == [3, 3]


def test_memory_bytes_read_follow_the_formula(checkpoint, make_llm):
    """One request of P prompt tokens and T outputs: T steps, each reading every weight once,
    the prefill P cache entries and decode step k P + k of them."""
    llm = make_llm(checkpoint("llama_gqa"), dtype="float32", enable_prefix_caching=False)
    e = llm.engine
    P, T = 20, 6
    llm.generate([list(range(1, P + 1))], SamplingParams(max_tokens=T, ignore_eos=True))
    s = llm.stats()
    # Every matrix once, except the embedding table (a step reads only its tokens' rows).
    params = dict(e.executor.driver_worker.model.named_parameters())
    assert "lm_head.weight" in params  # untied here: the head is a matrix of its own
    weights = sum(p.numel() * p.element_size() for n, p in params.items()
                  if n != "embed_tokens.weight")  # fmt: skip
    entries = P + sum(P + k for k in range(1, T))  # the last token is sampled, not read
    assert abs(s.memory_bytes_read - (T * weights + entries * e.bytes_per_token)) <= T
    assert s.step_seconds > 0 and s.memory_bandwidth_peak > 1e8  # > 0.1 GB/s on any machine
    assert 0 < s.memory_bandwidth_utilization < 5


@pytest.mark.parametrize("admission", ["greedy", "projected"])
@pytest.mark.parametrize("policy", ["fcfs", "priority", "lpm"])
def test_no_request_is_lost_under_any_policy(admission, policy):
    """Random arrivals, priorities, shared prefixes, n > 1, aborts and classes with tight SLOs:
    after every step the pool is conserved (the fixture checks it), and in the end every
    request is finished with exactly its tokens, refused with a reason and no tokens, or
    aborted with a prefix of its tokens."""
    rng = random.Random(f"{admission}-{policy}")
    core, clock = make_core(30, admission=admission, scheduling_policy=policy, max_num_seqs=6)
    classes = [None, WorkloadClass("tight", ttft_slo=0.004), WorkloadClass("loose", ttft_slo=1.0,
               output_estimate="learned")]  # fmt: skip
    prefixes = [[rng.randrange(VOCAB) for _ in range(12)] for _ in range(3)]
    reqs, aborted = {}, set()
    for step in range(400):
        for _ in range(rng.choice([0, 0, 1, 2]) if step < 300 else 0):
            rid = f"r{len(reqs)}"
            prompt = rng.choice(prefixes)[: rng.randrange(1, 13)] + [rng.randrange(VOCAB)]
            p = SamplingParams(max_tokens=rng.randrange(1, 20), n=rng.choice([1, 1, 2]),
                               stop_token_ids=[3] if rng.random() < 0.5 else None)  # fmt: skip
            req = EngineCoreRequest(rid, None, prompt, p, p.max_tokens, clock(),
                                    priority=rng.randrange(3),
                                    workload_class=rng.choice(classes))  # fmt: skip
            reqs[rid] = (p, core.add_request(req))
        if core.families and rng.random() < 0.03:
            victim = rng.choice(list(core.families))
            core.abort_request(victim)
            aborted.add(victim)
        core.step()
        check_blocks(core)
    drain(core)
    statuses = set()
    for rid, (p, children) in reqs.items():
        for c in children:
            want = expected_tokens(c.request_id, p, c.max_tokens)
            statuses.add(c.status)
            if c.status == RequestStatus.FINISHED_REFUSED:
                assert c.refusal.reason in ("deadline", "projected_wait") and not c.output_token_ids
            elif c.status == RequestStatus.FINISHED_ABORTED:
                assert rid in aborted and c.output_token_ids == want[: c.num_output_tokens]
            else:
                assert c.status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH)
                assert c.output_token_ids == want
    assert RequestStatus.FINISHED_LENGTH in statuses
    if admission == "projected":
        assert RequestStatus.FINISHED_REFUSED in statuses


def test_learned_estimate_covers_nine_in_ten(tmp_path):
    """The learned output estimate is at least 90 % of the class's recent outputs (and never
    above max_tokens); before enough have finished it is max_tokens."""
    from kvserve.sched.admission import LEARN_MIN, OutputEstimator

    est = OutputEstimator()
    rng = random.Random(5)
    seen = []
    for i in range(200):
        if i < LEARN_MIN:
            assert est.estimate("c", 500) == 500
        n = rng.randrange(1, 300)
        seen.append(n)
        est.observe("c", n)
    e = est.estimate("c", 500)
    assert sum(1 for n in seen if n <= e) >= 0.9 * len(seen)
    assert sum(1 for n in seen if n <= e - 1) < 0.95 * len(seen)  # not far above the quantile
    assert est.estimate("c", 10) == 10 and est.estimate("other", 77) == 77


def test_class_kv_policies_apply(checkpoint, make_llm, tmp_path):
    """A class without prefix caching never hits; a class's retention spec applies to its
    requests (and a request's own spec wins); a class naming another KV format than the
    pool's fails at start, naming the entry."""
    classes = tmp_path / "c.yaml"
    classes.write_text(
        "classes:\n"
        "  - {name: nohits, match: {users: [u]}, kv: {prefix_caching: false}}\n"
        "  - {name: win, match: {prompt_tokens: [100, null]}, kv: {kv_retention: 'window:32'}}\n"
    )
    llm = make_llm(checkpoint("llama_gqa"), dtype="float32", workload_classes=str(classes))
    e, params = llm.engine, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    prompt = list(range(1, 50))
    outs = {}
    for tag, user in (("warm", None), ("hit", None), ("nohits", "u")):
        rid = e.add_request(None, prompt, params, tags=RequestTags(user=user))
        while e.has_unfinished_requests():
            for o in e.step():
                if o.finished and o.request_id == rid:
                    outs[tag] = o
    assert outs["hit"].num_cached_tokens == 48 and outs["hit"].workload_class == "default"
    assert outs["nohits"].num_cached_tokens == 0 and outs["nohits"].workload_class == "nohits"
    assert outs["nohits"].outputs[0].token_ids == outs["hit"].outputs[0].token_ids
    (long,) = llm.generate([list(range(1, 130))], params)
    assert long.workload_class == "win" and long.num_retained_tokens < long.num_seen_tokens
    (own,) = llm.generate([list(range(1, 130))], params.clone(kv_retention="none"))
    assert own.num_retained_tokens is None
    bad = tmp_path / "bad.json"
    bad.write_text('{"classes": [{"name": "q", "kv": {"kv_cache_dtype": "fp8_e4m3"}}]}')
    with pytest.raises(ConfigError, match=r"workload_classes\[0\] \(q\).kv.kv_cache_dtype"):
        make_llm(checkpoint("llama_gqa"), dtype="float32", workload_classes=str(bad))
    small = tmp_path / "small.json"  # a window below the block size: refused at start
    small.write_text('{"classes": [{"name": "w", "kv": {"kv_retention": "window:8"}}]}')
    with pytest.raises(ConfigError, match="workload class 'w': .*at least the block size"):
        make_llm(checkpoint("llama_gqa"), dtype="float32", workload_classes=str(small))
