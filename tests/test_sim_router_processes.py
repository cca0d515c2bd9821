"""``kvserve simulate --router-processes N``: the router's work (the profile's hop terms) on
processes of its own, which each request waits for. Checked against a FIFO queue worked by
hand and against Lindley's recursion over the run's own send times; a router that costs
nothing gives exactly the static round-robin deal; the work it is charged is the hop terms
summed over the records; a bad value is refused, naming the field."""

from __future__ import annotations

import dataclasses
import json

import pytest

from kvserve.bench.runner import LoadSpec, arrival_times
from kvserve.sim.engine import SimTarget
from kvserve.sim.fleet import RouterProcesses
from kvserve.sim.simulate import simulate_load
from tests.test_sim_routing import KW, cpu_profile, trace


def test_one_process_serves_requests_and_relays_in_time_order():
    r = RouterProcesses(1, request_s=0.010, request_token_s=0.001, token_s=0.002)
    assert r.admit(0.0, 10) == pytest.approx(0.020)  # 10 ms + 10 tokens x 1 ms
    assert r.admit(0.005, 0) == pytest.approx(0.030)  # behind the first
    r.relay(0.040, 5)  # a step that streamed 5 tokens ended at 40 ms: 10 ms of relays
    assert r.admit(0.035, 0) == pytest.approx(0.045)  # sent before that step ended
    # The relays (from 45 ms to 55 ms) come before a request sent at 50 ms.
    assert r.admit(0.050, 0) == pytest.approx(0.065)
    assert r.busy() == [pytest.approx(0.060 / 0.050)]  # 60 ms of work over 50 ms of sends


def test_processes_take_requests_in_turn_and_share_the_relays():
    r = RouterProcesses(2, request_s=0.010, request_token_s=0.0, token_s=0.004)
    assert r.admit(0.0, 0) == pytest.approx(0.010)
    assert r.admit(0.0, 0) == pytest.approx(0.010)  # the second process, idle
    assert r.admit(0.0, 0) == pytest.approx(0.020)  # the first again, behind its request
    r.relay(0.0, 5)  # 20 ms of relays, 10 ms each
    assert r.admit(0.001, 0) == pytest.approx(0.030)  # second: 10 + 10 of relays + 10
    # 30 ms of work each (20 of requests and 10 of relays) over 1 ms of sends.
    assert r.busy() == [pytest.approx(30.0), pytest.approx(30.0)]


def saturating_profile(request_s: float, token_s: float = 0.0):  # noqa: ANN201
    return dataclasses.replace(cpu_profile(), hop_request_s=request_s, hop_token_s=token_s,
                               serving_measured=True)  # fmt: skip


def lindley_departures(sends: list[float], cost: float, processes: int) -> list[float]:
    """When each request leaves a router of ``processes`` FIFO servers dealt in turn, each
    request costing ``cost``: departure = max(send, the server's last departure) + cost."""
    free = [float("-inf")] * processes
    out = []
    for i, s in enumerate(sends):
        p = i % processes
        free[p] = max(free[p], s) + cost
        out.append(free[p])
    return out


@pytest.mark.parametrize("processes", [1, 2])
def test_requests_wait_for_a_busy_router(processes):
    """Requests 1/8 s apart on average, each costing the router 0.2 s: one process falls
    behind (each request waits for all before it), two nearly keep up. Each TTFT holds the
    wait the recursion gives, and the send times are the trace's own."""
    reqs = trace(groups=3, per_group=4, context_words=20)
    cost = 0.2
    target = SimTarget(dict(KW), saturating_profile(cost), replicas=2, router="least_load",
                       router_processes=processes)  # fmt: skip
    res, sims = simulate_load(target, reqs, LoadSpec(8.0), 1)
    sends = arrival_times(len(reqs), 8.0, 1.0, 1)
    by_index = {r.index: r for r in res.records}
    assert all(r.success for r in res.records)
    assert [by_index[i].send_time for i in range(len(reqs))] == pytest.approx(sends)
    leave = lindley_departures(sends, cost, processes)
    for i, s in enumerate(sends):
        assert by_index[i].ttft >= leave[i] - s - 1e-9, i
        assert by_index[i].ttft < leave[i] - s + 0.5, i  # then a short prefill on a CPU
    waits = [leave[i] - s for i, s in enumerate(sends)]
    if processes == 1:
        assert waits[-1] > 0.9  # the queue grew: 2.4 s of work sent over 1.4 s
    assert sims[0].router is sims[1].router


def test_a_router_that_costs_nothing_deals_as_the_static_round_robin():
    reqs = trace(groups=3, per_group=4, context_words=20)
    static, _ = simulate_load(SimTarget(dict(KW), cpu_profile(), replicas=2), reqs,
                              LoadSpec(8.0), 1)  # fmt: skip
    target = SimTarget(dict(KW), cpu_profile(), replicas=2, router_processes=1)
    routed, sims = simulate_load(target, reqs, LoadSpec(8.0), 1)
    assert sorted(routed.records, key=lambda r: r.index) == sorted(
        static.records, key=lambda r: r.index
    )
    assert sims[0].router is not None and sims[0].router.busy() == [0.0]


def test_the_router_is_charged_the_hop_terms_of_every_request_and_token():
    p = dataclasses.replace(cpu_profile(), hop_request_s=1e-3, hop_request_token_s=2e-6,
                            hop_token_s=5e-5, serving_measured=True)  # fmt: skip
    reqs = trace(groups=3, per_group=4, context_words=20)
    target = SimTarget(dict(KW), p, replicas=2, router="prefix", router_processes=3)
    res, sims = simulate_load(target, reqs, LoadSpec(8.0), 1)
    work = sum(sims[0].router.worked())
    want = sum(1e-3 + 2e-6 * r.prompt_tokens + 5e-5 * r.output_tokens for r in res.records)
    assert work == pytest.approx(want)
    # The replicas are no longer charged the hop: the router has cores of its own.
    assert not target.hop and SimTarget(dict(KW), p, replicas=2, router="prefix").hop


def test_router_processes_is_checked():
    with pytest.raises(ValueError, match="router_processes: must be an integer >= 0, got -1"):
        SimTarget(dict(KW), cpu_profile(), replicas=2, router_processes=-1)
    with pytest.raises(ValueError, match="router_processes: .* two or more replicas, not 1"):
        SimTarget(dict(KW), cpu_profile(), replicas=1, router_processes=1)
    with pytest.raises(ValueError, match="router_processes: .*disaggregated"):
        SimTarget(dict(KW), cpu_profile(), router_processes=1, prefill_replicas=1,
                  decode_replicas=1, kv_transfer_bandwidth=1e9)  # fmt: skip


def test_the_cli_reports_how_busy_the_router_was(tmp_path, capsys):
    from kvserve.cli import main

    prof = tmp_path / "p.json"
    saturating_profile(1.0).save(prof)
    base = ["simulate", "--profile", str(prof), "--model", KW["model"], "--num-prompts", "8",
            "--request-rate", "8", "--no-plots", "--output-dir", str(tmp_path), "--json",
            "--replicas", "2", "--router", "least_load"]  # fmt: skip
    assert main([*base, "--router-processes", "2"]) == 0
    out, err = capsys.readouterr()
    sim = json.loads(out.strip().splitlines()[-1])["simulation"]
    assert sim["router_processes"] == 2
    # Four requests each, 1 s apiece, against about a second of sends: the queue grows.
    assert len(sim["router_busy"]) == 2 and min(sim["router_busy"]) > 0.0
    assert "a router process had" in err
    assert main([*base, "--router-processes", "-1"]) == 2
    assert "router_processes: must be an integer >= 0, got -1" in capsys.readouterr().err
