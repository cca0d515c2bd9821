"""A load replayed on a target's simulated replicas (:func:`simulate_load`, the simulator's
entry): dealt round-robin to replicas that share nothing, on one timeline for replicas behind
one Redis tier, routed (:mod:`kvserve.sim.fleet`), or disaggregated (:mod:`kvserve.sim.pd`).

Each replica is the real engine over a cost model (:mod:`kvserve.sim.engine`) replaying its
share (:mod:`kvserve.sim.replica`); its warm-up requests run first, one at a time. The records
and snapshots it returns are the bench's own types, so ``summarize`` and the report code are
shared and a simulated report reads like a measured one.
"""

from __future__ import annotations

import gc
import heapq
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from types import SimpleNamespace
from typing import Any

from kvserve.bench.forks import fork_map
from kvserve.bench.metrics import RequestRecord
from kvserve.bench.report import RecordEncoder
from kvserve.bench.runner import LoadSpec, RunResult
from kvserve.bench.workloads import BenchRequest, arrival_times
from kvserve.sim.engine import SimEngine, SimTarget, build_engine
from kvserve.sim.fleet import RouterProcesses, routed_fleet
from kvserve.sim.pd import Feed, TraceFeed, run_pd, transfer_config
from kvserve.sim.replica import Replica
from kvserve.sim.tiers import SERVER_TIERS
from kvserve.sim.workload import EncodedWorkload


def simulate_load(
    target: SimTarget,
    requests: Sequence[BenchRequest],
    load: LoadSpec,
    seed: int = 0,
    warmup: list[BenchRequest] | None = None,
    temperature: float = 0.0,
    sample_every: float = 0.5,
    progress: Callable[[bool], None] | None = None,
    jobs: int = 1,
    records_to: RecordEncoder | None = None,
) -> tuple[RunResult, list[SimEngine] | list[ReplicaInfo]]:
    """Replay ``requests`` under ``load`` on ``target.replicas`` simulated engines (requests
    dealt round-robin, as a load balancer would) and collect one record each.

    Replicas that share nothing run one after another, or with ``jobs`` > 1 side by side in
    forked processes (:mod:`kvserve.bench.forks`) with the same results; each then reports a
    :class:`ReplicaInfo` instead of its engine, and ``progress`` hears of its requests when
    it ends. Replicas behind one Redis tier share it and run on one timeline
    (:func:`_run_fleet`). A lone replica takes ``requests`` as it sends them, so a
    :class:`~kvserve.sim.workload.EncodedWorkload` is made while it runs, and hands each final
    record to ``records_to`` (encoded for the JSON report while it runs)."""
    if records_to is not None and target.replicas != 1:
        raise ValueError(
            f"records_to: only a lone replica's records are encoded as it runs, "
            f"not {target.replicas} replicas'"
        )
    offsets = (
        None
        if load.closed_loop
        else arrival_times(len(requests), load.request_rate, load.burstiness, seed)
    )

    trace = _Trace(requests, load, offsets, warmup, temperature, sample_every, records_to)
    if target.disaggregated:
        if records_to is not None:
            raise ValueError("records_to: a disaggregated run's records are made at its end")
        feed = TraceFeed(requests, offsets, load.concurrency)
        return run_disaggregated(target, trace, feed, progress)

    def one(k: int, report: Callable[[bool], None] | None) -> _ReplicaRun:
        return _run_replica(target, trace, k, report)

    if target.replicas > 1 and (target.router != "round_robin" or target.router_processes):
        runs = _run_routed(target, trace, progress)
    elif target.replicas > 1 and shares_tiers(target):
        runs = _run_fleet(target, trace, progress)
    elif jobs > 1 and target.replicas > 1:
        runs = fork_map(lambda k: one(k, None).detached(), range(target.replicas), jobs)
        if progress is not None:
            for run in runs:
                for _, rec in run.records:
                    progress(rec.success)
    else:
        runs = [one(k, progress) for k in range(target.replicas)]
    records: list[RequestRecord | None] = [None] * len(requests)
    before: dict[str, float] = {}
    after: dict[str, float] = {}
    samples: list[dict[str, float]] = []
    for run in runs:
        _merge(before, run.before, target.replicas)
        _merge(after, run.after, target.replicas)
        for i, r in run.records:
            records[i] = r
        samples += run.samples
    end = max(run.duration for run in runs)
    done = [r for r in records if r is not None]
    return RunResult(done, max(end, 1e-9), before, after, samples), [run.sim for run in runs]


@dataclass(slots=True)
class ReplicaInfo:
    """What a replica simulated in another process reports besides its records: the
    figures a report reads from a :class:`SimEngine` (``runner.steps``, ``runner.busy_s``)."""

    num_blocks: int
    notes: list[str]
    runner: Any


@dataclass(slots=True)
class _ReplicaRun:
    sim: SimEngine | ReplicaInfo
    records: list[tuple[int, RequestRecord]]  # (index in the trace, record)
    before: dict[str, float]
    after: dict[str, float]
    samples: list[dict[str, float]]
    duration: float

    def detached(self) -> _ReplicaRun:
        """The same run without its engine, to cross a process boundary."""
        s = self.sim
        runner = SimpleNamespace(steps=s.runner.steps, busy_s=s.runner.busy_s)
        info = ReplicaInfo(s.num_blocks, list(s.notes), runner)
        return _ReplicaRun(info, self.records, self.before, self.after, self.samples,
                           self.duration)  # fmt: skip


@dataclass(slots=True)
class _Trace:
    """What every replica of a run replays: the requests, the load and its send offsets
    (None: closed loop), the warm-up requests and the sampling settings."""

    requests: Sequence[BenchRequest]
    load: LoadSpec
    offsets: list[float] | None
    warmup: list[BenchRequest] | None
    temperature: float
    sample_every: float
    sink: RecordEncoder | None = None  # a lone replica's final records, as they are made


@dataclass(slots=True)
class _Share:
    """One replica's part of the trace, warmed up and ready to replay step by step."""

    sim: SimEngine
    rep: Replica
    mine: list[int]  # indices in the trace
    t0: float
    before: dict[str, float]
    steps: Iterator[None]
    share: list[BenchRequest] = field(default_factory=list)  # a routed replica's, as fed


def _prepare(
    sim: SimEngine,
    target: SimTarget,
    trace: _Trace,
    k: int,
    progress: Callable[[bool], None] | None,
    routed: bool = False,
) -> _Share:
    """Replica ``k``'s share of the trace (every ``replicas``-th request from ``k``; none
    yet when ``routed``: a router feeds it), after its warm-up requests, one at a time."""
    from kvserve.bench.engine_target import engine_snapshot

    requests, load, offsets = trace.requests, trace.load, trace.offsets
    rep = Replica(sim, trace.temperature, trace.sample_every)
    for w in trace.warmup or []:  # one at a time, as the bench warms up
        rep.run([w], [0.0], None, sim.clock.now)
    rep.on_done = progress
    rep.sink = trace.sink
    t0 = sim.clock.now
    rep.sample_from(t0)
    before = engine_snapshot(sim.engine)
    mine = list(range(k, len(requests), target.replicas))
    share: Sequence[BenchRequest] = requests  # a lone replica's: taken as it is (streamed)
    sends = offsets
    if target.replicas > 1:
        share = [requests[i] for i in mine]
        sends = None if offsets is None else [offsets[i] for i in mine]
    cap = load.concurrency
    if cap is not None and target.replicas > 1:
        cap = max(1, math.ceil(cap / target.replicas))
    if routed:
        fed: list[BenchRequest] = []
        return _Share(sim, rep, [], t0, before, rep.steps(fed, [], cap, t0), fed)
    return _Share(sim, rep, mine, t0, before, rep.steps(share, sends, cap, t0))


def _finish(sh: _Share) -> _ReplicaRun:
    from kvserve.bench.engine_target import engine_snapshot

    recs = sh.rep.records
    for r in recs:
        r.send_time -= sh.t0
    return _ReplicaRun(sh.sim, list(zip(sh.mine, recs, strict=True)), sh.before,
                       engine_snapshot(sh.sim.engine), sh.rep.samples,
                       sh.sim.clock.now - sh.t0)  # fmt: skip


def _run_replica(
    target: SimTarget, trace: _Trace, k: int, progress: Callable[[bool], None] | None
) -> _ReplicaRun:
    """Replica ``k`` of a fleet that shares nothing: its engine, its share, what it measured."""
    sim = build_engine(target)
    with _no_collections():
        sh = _prepare(sim, target, trace, k, progress)
        for _ in sh.steps:
            pass
        return _finish(sh)


SHARED_TIERS = SERVER_TIERS  # a server every replica points at; host memory and disk are local


def shares_tiers(target: SimTarget) -> bool:
    """Whether the replicas of ``target`` share an offload tier (a Redis URL)."""
    return bool(target.engine_kwargs.get("kv_offload_redis"))


def _run_fleet(
    target: SimTarget, trace: _Trace, progress: Callable[[bool], None] | None
) -> list[_ReplicaRun]:
    """Replicas that share a tier (one Redis behind every replica, as ``kvserve serve
    --kv-offload-redis`` on each): one modelled tier object for all, and one timeline, the
    replica furthest behind in virtual time stepping next, so that a block one replica
    stores is a hit for another from the moment it was stored (to a step's resolution), and
    the server answers their loads one at a time, in the order they were asked."""
    sims = _fleet_engines(target)
    with _no_collections():
        shares = [_prepare(sim, target, trace, k, progress) for k, sim in enumerate(sims)]
        _start_shared_tiers(target, shares)
        ready = [(0.0, k) for k in range(len(shares))]
        while ready:
            _, k = heapq.heappop(ready)
            sh = shares[k]
            if next(sh.steps, _DONE) is _DONE:
                continue
            heapq.heappush(ready, (sh.sim.clock.now - sh.t0, k))
        return [_finish(sh) for sh in shares]


def _fleet_engines(target: SimTarget) -> list[SimEngine]:
    """The replicas' engines; those behind one Redis tier share one modelled tier object."""
    sims = [build_engine(target) for _ in range(target.replicas)]
    if not shares_tiers(target):
        return sims
    first = sims[0].offload
    for sim in sims[1:]:
        tiers = sim.offload.tiers  # type: ignore[union-attr]
        for i, tier in enumerate(tiers):
            if tier.name in SHARED_TIERS:
                tiers[i] = first.tiers[i]  # type: ignore[union-attr]
    return sims


def _start_shared_tiers(target: SimTarget, shares: list[_Share]) -> None:
    """The replay's timeline starts at each replica's end of warm-up (the warm-ups, one
    request at a time and not measured, leave a shared server idle)."""
    if not shares_tiers(target):
        return
    for sh in shares:
        sh.sim.offload.epoch = sh.t0  # type: ignore[union-attr]
        for tier in sh.sim.offload.tiers:  # type: ignore[union-attr]
            if tier.free_at is not None:
                tier.free_at = -math.inf


def _run_routed(
    target: SimTarget, trace: _Trace, progress: Callable[[bool], None] | None
) -> list[_ReplicaRun]:
    """Replicas behind ``target.router`` (:mod:`kvserve.sim.fleet`): one timeline, each
    request routed when it is sent, from the replicas' state then."""
    sims = _fleet_engines(target)
    requests = trace.requests

    def encode(req: BenchRequest, i: int) -> list[int]:
        if isinstance(requests, EncodedWorkload):
            return requests.token_ids(i)
        return sims[0].encode(req.prompt)

    with _no_collections():
        shares = [_prepare(sim, target, trace, k, progress, routed=True)
                  for k, sim in enumerate(sims)]  # fmt: skip
        _start_shared_tiers(target, shares)
        router = None
        if target.router_processes:
            router = RouterProcesses.of(target.router_processes, target.profile)
            for sim in sims:
                sim.router = router
        routed_fleet(shares, requests, trace.offsets, trace.load.concurrency, target.router,
                     encode, target.overlap_weight, router)  # fmt: skip
        return [_finish(sh) for sh in shares]


def simulate_feed(
    target: SimTarget, feed: Feed, temperature: float = 0.0, sample_every: float = 0.5
) -> tuple[RunResult, list[SimEngine]]:
    """``feed``'s requests (:class:`kvserve.sim.pd.Feed`: who sends what when, such as a
    benchmark's own workload) on ``target``'s replicas, disaggregated or colocated."""
    trace = _Trace([], LoadSpec(), None, None, temperature, sample_every)
    return run_disaggregated(target, trace, feed)


def run_disaggregated(
    target: SimTarget,
    trace: _Trace,
    feed: Feed,
    progress: Callable[[bool], None] | None = None,
) -> tuple[RunResult, list[SimEngine]]:
    """``feed`` on ``target.prefill_replicas`` prefill and ``target.decode_replicas`` decode
    engines (:mod:`kvserve.sim.pd`), or on ``target.replicas`` colocated ones when
    ``target`` is not disaggregated (the same replay, to compare the two). Returns the
    records and the engines, prefill ones first."""
    if trace.offsets is not None and trace.load.concurrency is not None:
        raise ValueError("concurrency: an in-flight cap on an open loop (--concurrency "
                         "with --request-rate) is not modelled with "
                         "--prefill-replicas/--decode-replicas")  # fmt: skip
    n_pre = target.prefill_replicas
    n_dec = target.decode_replicas if target.disaggregated else target.replicas
    pre = [build_engine(target) for _ in range(n_pre)]
    dtarget = target
    if target.disaggregated:
        kw = {**target.engine_kwargs, "kv_transfer_config": transfer_config()}
        dtarget = replace(target, engine_kwargs=kw, prefill_replicas=0, decode_replicas=0,
                          kv_transfer_bandwidth=None, behind_hop=target.hop)  # fmt: skip
    dec = [build_engine(dtarget) for _ in range(n_dec)]
    for sim in dec if target.disaggregated else ():
        conn = sim.engine.connector
        conn.clock = sim.clock
        conn.bandwidth = float(target.kv_transfer_bandwidth)  # type: ignore[arg-type]
        conn.block_bytes = sim.shape.kv_bytes_per_token * sim.engine.block_size
        conn.import_s_per_byte = target.profile.offload_export_s_per_byte
        conn.touched = sim.runner.touched  # (the same set: a step's writes count too)
        conn.first_touch_s_per_byte = target.profile.first_touch_s_per_byte
    with _no_collections():
        shares = [_prepare(sim, target, trace, k, progress, routed=True)
                  for k, sim in enumerate(pre + dec)]  # fmt: skip
        for sh in shares[:n_pre]:
            sh.rep.on_done = None  # a request is done when its decode is
        records = run_pd(shares[:n_pre], shares[n_pre:], feed)
        runs = [_finish(sh) for sh in shares]
    n = len(runs)
    before: dict[str, float] = {}
    after: dict[str, float] = {}
    samples: list[dict[str, float]] = []
    for run in runs:
        _merge(before, run.before, n)
        _merge(after, run.after, n)
        samples += run.samples
    end = max(run.duration for run in runs)
    return RunResult(records, max(end, 1e-9), before, after, samples), pre + dec


_DONE = object()


@contextmanager
def _no_collections() -> Iterator[None]:
    """The replay allocates a few small objects per sequence per step, nearly all freed at
    once by reference counting, while the workload, the engine and the records stay alive:
    CPython's collector would rescan the survivors every few thousand allocations, seconds
    over a long trace, and find nothing, since the engine makes no reference cycles per step
    (tests/test_simulator.py checks a preempting, prefix-sharing replay leaves none). So the
    collector is off for the replay, what exists before it frozen out of its generations,
    and both restored after."""
    gc.collect()
    gc.freeze()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
        gc.unfreeze()


def _merge(acc: dict[str, float], snap: dict[str, float], replicas: int) -> None:
    """A fleet's snapshot: counters summed over replicas, gauges averaged."""
    for k, v in snap.items():
        counter = k.endswith(("_total", "_sum", "_count"))
        acc[k] = acc.get(k, 0.0) + (v if counter else v / replicas)
