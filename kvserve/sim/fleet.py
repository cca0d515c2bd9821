"""Simulated replicas behind a router: the same policy objects as ``kvserve router``
(:mod:`kvserve.router.policies`) choose each request's replica when it arrives, from the
replicas' state at that moment on one virtual timeline.

The replica furthest behind in virtual time steps next (as replicas that share a Redis tier
do); a request is routed once every busy replica's clock has reached its send time, so the
policy sees each cache and each load as they are then, to a step's resolution. ``prefix``
reads a :class:`~kvserve.router.index.PrefixIndex` fed with each engine's own KV events after
each of its steps (the real router's index, with no network delay); ``prefix_approx`` its own
history; ``oracle`` asks each engine's pool directly. A closed loop's users are the fleet's:
a user's next request is routed when its last one finishes, wherever that was.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from kvserve.bench.workloads import BenchRequest
from kvserve.kv.hashing import extend_block_hashes
from kvserve.router.index import PrefixIndex
from kvserve.router.policies import (
    DEFAULT_OVERLAP_WEIGHT,
    POLICIES,
    ReplicaLoad,
    RouteRequest,
    make_policy,
)

SIM_POLICIES = (*POLICIES, "oracle")
_P = TypeVar("_P")  # a replayed engine, as replay_in_time knows it
IDLE = "idle"  # what a router-fed replica's steps yield while it waits for requests


class ExactScorer:
    """The oracle: how much of the prompt each engine's pool holds now (no staleness)."""

    def __init__(self, engines: Sequence[Any]) -> None:
        self.engines = engines
        self.block_size: int | None = engines[0].block_size

    def match(self, req: RouteRequest, num_replicas: int) -> list[tuple[int, float]]:
        kv = self.engines[0].kv
        hashes: list = []
        extend_block_hashes(hashes, list(req.token_ids), kv.block_size, kv.root, req.salt)
        out = []
        for eng in self.engines:
            n = len(eng.kv.cached_prefix(hashes))
            out.append((n, float(n)))
        return out


def routed_fleet(
    shares: list[Any],
    requests: Sequence[BenchRequest],
    sends: list[float] | None,
    concurrency: int | None,
    policy_name: str,
    encode: Callable[[BenchRequest, int], list[int]],
    overlap_weight: float = DEFAULT_OVERLAP_WEIGHT,
) -> None:
    """Replay ``requests`` on the replicas of ``shares`` (``kvserve.sim.simulate._Share``,
    each fed by its ``rep.push``), routed by ``policy_name`` (the prefix policies and the
    oracle with ``overlap_weight``). ``sends``: open-loop send offsets from each share's
    ``t0`` (None: a closed loop of ``concurrency`` users)."""
    n = len(shares)
    engines = [sh.sim.engine for sh in shares]
    bs = engines[0].block_size
    index = PrefixIndex(n)
    if policy_name == "oracle":
        policy = make_policy("prefix", scorer=ExactScorer(engines), overlap_weight=overlap_weight)
        policy.name = "oracle"
    else:
        policy = make_policy(policy_name, index=index, block_size=bs,
                             overlap_weight=overlap_weight)  # fmt: skip
    for k, eng in enumerate(engines):  # each pool, as the real router reads it
        if policy.wants_pool(k):
            policy.learn_pool(k, eng.num_blocks, eng.block_size)
    if policy_name == "prefix":
        for eng in engines:
            eng.kv.enable_events("GPU")
    loads = [ReplicaLoad() for _ in range(n)]
    blocks_of: list[dict[int, int]] = [{} for _ in range(n)]
    routed: list[dict[int, RouteRequest]] = [{} for _ in range(n)]
    # Times are seconds since each replica's t0 (the end of its warm-up).
    pending: list[tuple[float, int]] = []  # (send time, trace index), routed in time order
    if sends is not None:
        pending = list(zip(sends, range(len(requests)), strict=True))
    else:
        pending = [(0.0, i) for i in range(min(concurrency or 1, len(requests)))]
    heapq.heapify(pending)
    next_user = len(pending)
    idle = [False] * n

    def elapsed(k: int) -> float:
        return shares[k].sim.clock.now - shares[k].t0

    def finished(k: int) -> Callable[[int], None]:
        def hook(i: int) -> None:
            nonlocal next_user
            loads[k].requests -= 1
            loads[k].blocks -= blocks_of[k].pop(i, 0)
            policy.finished(routed[k].pop(i), k)
            if sends is None and next_user < len(requests):
                heapq.heappush(pending, (elapsed(k), next_user))
                next_user += 1

        return hook

    for k, sh in enumerate(shares):
        sh.rep.open = True
        sh.rep.on_finish = finished(k)
        next(sh.steps)  # primed: pushes land in the replay it runs

    def route(when: float, i: int) -> None:
        req = requests[i]
        ids = encode(req, i)
        rr = RouteRequest(ids, None, req.prefix_group)
        k = policy.choose(rr, loads).replica
        policy.routed(rr, k)
        sh = shares[k]
        blocks_of[k][len(sh.mine)] = len(ids) // bs
        routed[k][len(sh.mine)] = rr
        sh.mine.append(i)
        loads[k].requests += 1
        loads[k].blocks += len(ids) // bs
        clock = sh.sim.clock
        if idle[k]:
            clock.now = max(clock.now, sh.t0 + when)
            idle[k] = False
        sh.rep.push(sh.share, req, ids, sh.t0 + when)

    def step(k: int) -> None:
        if next(shares[k].steps) is IDLE:
            idle[k] = True
        if policy_name == "prefix":
            index.apply(k, engines[k].kv.take_events())

    replay_in_time(pending, lambda: [k for k in range(n) if not idle[k]], elapsed, route, step)
    for sh in shares:
        sh.rep.open = False
        for _ in sh.steps:
            pass


def replay_in_time(
    pending: list[tuple[float, int]],
    busy: Callable[[], list[_P]],
    elapsed: Callable[[_P], float],
    send: Callable[[float, int], None],
    step: Callable[[_P], None],
) -> None:
    """Run replayed engines (``busy()``: those not waiting for a request) on one timeline:
    step the one furthest behind in time; each ``pending`` (send time, index) heap entry is
    sent once that engine's clock has reached its time; when every engine waits, the next
    one alone is sent (at its time, seen as things are then). Ends when nothing is pending
    and every engine waits."""
    while True:
        running = busy()
        if running:
            now = min(map(elapsed, running))
            while pending and pending[0][0] <= now:
                send(*heapq.heappop(pending))
            running = busy()
        if not running:
            if not pending:
                return
            send(*heapq.heappop(pending))
            continue
        step(min(running, key=elapsed))


def check_policy(name: str) -> str:
    if name not in SIM_POLICIES:
        raise ValueError(f"router: must be one of {', '.join(SIM_POLICIES)}, got {name!r}")
    return name
