"""The simulator routing through the router's policy objects: fed by the round-robin policy,
the routed fleet gives exactly the records of the static round-robin deal (an independent
implementation: each replica replays every N-th request on its own); on a trace of shared
contexts larger than one replica's pool, the prefix policies keep each context on one
replica, so their hit rates beat round robin's and the event-fed ``prefix`` is within 5 % of
the oracle's; and ``--router`` / ``--search router=...`` are accepted and checked."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from kvserve.bench.runner import LoadSpec
from kvserve.bench.workloads import BenchRequest
from kvserve.engine_args import default_model
from kvserve.sim.cost import Profile
from kvserve.sim.engine import SimTarget
from kvserve.sim.simulate import _run_routed, _Trace, simulate_load
from kvserve.sim.space import parse_search


def cpu_profile() -> Profile:
    return Profile(device="test cpu", peak_flops=1e11, peak_bandwidth=2e10, source="test",
                   dtype="float32", step_overhead_s=2e-3, per_seq_s=5e-5)  # fmt: skip


WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima".split()


def trace(groups: int = 5, per_group: int = 8, context_words: int = 40) -> list[BenchRequest]:
    """``groups`` customers, each a long shared context, asked by ``per_group`` users in
    turn (interleaved: each group's requests are spread over the trace)."""
    out = []
    for j in range(per_group):
        for g in range(groups):
            ctx = " ".join(f"{WORDS[(g * 7 + k) % 12]}{g}" for k in range(context_words))
            i = len(out)
            out.append(BenchRequest(i, "chat", f"{ctx} question {j} from user {i}", 4,
                                    context_words + 6, f"g{g}", context_words))  # fmt: skip
    return out


KW = dict(model=default_model(), num_gpu_blocks=48, block_size=16, max_model_len=512)


def hit_rate(res) -> float:  # noqa: ANN001
    recs = res.records
    assert all(r.success for r in recs), [r.reason for r in recs if not r.success]
    return sum(r.cached_tokens for r in recs) / sum(r.prompt_tokens for r in recs)


def test_the_routed_fleet_under_round_robin_equals_the_static_deal():
    reqs = trace(groups=3, per_group=4, context_words=20)
    target = SimTarget(dict(KW), cpu_profile(), replicas=2)
    static, _ = simulate_load(target, reqs, LoadSpec(8.0), 1)
    load = LoadSpec(8.0)
    from kvserve.bench.runner import arrival_times

    offsets = arrival_times(len(reqs), load.request_rate, load.burstiness, 1)
    runs = _run_routed(target, _Trace(reqs, load, offsets, None, 0.0, 0.5), None)
    routed = {i: r for run in runs for i, r in run.records}
    assert [routed[i] for i in range(len(reqs))] == static.records


def test_prefix_routing_keeps_contexts_together_and_tracks_the_oracle():
    reqs = trace()
    rates = {}
    for policy in ("round_robin", "prefix", "prefix_approx", "oracle", "least_load"):
        target = SimTarget(dict(KW), cpu_profile(), replicas=2, router=policy)
        res, sims = simulate_load(target, reqs, LoadSpec(4.0), 0)
        assert len(res.records) == len(reqs)
        rates[policy] = hit_rate(res)
        assert all(not s.engine.core.has_unfinished_requests() for s in sims)
    # Five contexts of ~10 blocks (+ tails) in pools of 48: five do not fit one replica,
    # and round robin (five groups in turn over two replicas) sends each to both.
    assert rates["prefix"] > rates["round_robin"] + 0.15, rates
    assert rates["prefix_approx"] > rates["round_robin"] + 0.15, rates
    assert rates["prefix"] >= 0.95 * rates["oracle"], rates


def test_router_is_checked_where_it_is_given():
    with pytest.raises(ValueError, match="router: must be one of"):
        SimTarget(dict(KW), cpu_profile(), replicas=2, router="random")
    assert parse_search(["router=round_robin,prefix"]) == {"router": ("round_robin", "prefix")}
    with pytest.raises(ValueError, match="router: unknown"):
        parse_search(["router=nearest"])
    t = SimTarget(dict(KW), cpu_profile(), replicas=2, router="oracle")
    assert dataclasses.replace(t, router="prefix").router == "prefix"


def test_a_fleet_whose_replicas_all_wait_routes_each_request_when_it_is_sent(monkeypatch):
    """Requests two seconds apart, each done long before the next is sent: every replica
    waits between them, so every decision must see nothing in flight. (Routing the rest of
    the trace at once the first time both replicas went idle saw the loads grow by one per
    decision instead.)"""
    from kvserve.sim import fleet

    seen: list[list[int]] = []
    make = fleet.make_policy

    def recording(name, **kw):  # noqa: ANN001, ANN003, ANN202
        policy = make(name, **kw)
        choose = policy.choose

        def spy(req, loads):  # noqa: ANN001, ANN202
            seen.append([ld.requests for ld in loads])
            return choose(req, loads)

        policy.choose = spy
        return policy

    monkeypatch.setattr(fleet, "make_policy", recording)
    reqs = trace(groups=3, per_group=4, context_words=20)
    target = SimTarget(dict(KW), cpu_profile(), replicas=2, router="least_load")
    res, _ = simulate_load(target, reqs, LoadSpec(0.5), 0)
    recs = sorted(res.records, key=lambda r: r.send_time)
    for a, b in itertools.pairwise(recs):  # the premise: each ends before the next is sent
        assert a.send_time + a.ttft + sum(a.itl) < b.send_time
    assert len(seen) == len(reqs) and all(loads == [0, 0] for loads in seen), seen


def test_the_overlap_weight_reaches_the_simulated_router(monkeypatch):
    """``--overlap-weight`` (SimTarget.overlap_weight) is the weight the simulated prefix
    policies and the oracle route with, as kvserve router's flag is; load-only policies take
    none; a weight that is not positive is refused, naming the field."""
    from kvserve.router import policies
    from kvserve.sim import fleet

    made: list[tuple[str, float | None]] = []

    def spy(name, **kw):  # noqa: ANN001, ANN202
        policy = policies.make_policy(name, **kw)
        made.append((name, getattr(policy, "overlap_weight", None)))
        return policy

    monkeypatch.setattr(fleet, "make_policy", spy)
    reqs = trace(groups=2, per_group=2, context_words=20)
    for router in ("prefix", "prefix_approx", "oracle", "least_load"):
        target = SimTarget(dict(KW), cpu_profile(), replicas=2, router=router, overlap_weight=3.5)
        simulate_load(target, reqs, LoadSpec(8.0), 1)
    assert made == [("prefix", 3.5), ("prefix_approx", 3.5), ("prefix", 3.5), ("least_load", None)]
    with pytest.raises(ValueError, match="overlap_weight: must be > 0, got 0"):
        SimTarget(dict(KW), cpu_profile(), replicas=2, router="prefix", overlap_weight=0)
