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
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
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


@dataclass(slots=True)
class RouterProcesses:
    """``kvserve router`` in ``n`` processes on cores of their own, the requests dealt among
    them round-robin (a load balancer in front). Each process is one event loop: it routes
    and forwards a request (``request_s`` + ``request_token_s`` per prompt token) and relays
    each streamed token (``token_s``, the relays spread evenly over the processes) one piece
    of work at a time, in the order the work comes. A request reaches its replica when its
    process is done with it, so a process busier than its cores can serve holds every
    request behind it, as a real one does. A token's relay is work here, not added to its
    time: a router that keeps up relays in well under a decode step."""

    n: int
    request_s: float
    request_token_s: float
    token_s: float
    free: list[float] = field(default_factory=list)  # when each is next idle (replay time)
    work: list[float] = field(default_factory=list)  # seconds each has worked
    turn: int = 0
    first: float = math.inf  # the first and last requests' send times
    last: float = -math.inf
    # Relays not yet served, (step end, seconds) per process: a replica ahead in time
    # reports its steps before requests sent earlier reach the router, so each process
    # serves its relays in time order as its requests come.
    relays: list[list[tuple[float, float]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"router_processes: must be >= 1 here, got {self.n}")
        self.free = [-math.inf] * self.n
        self.work = [0.0] * self.n
        self.relays = [[] for _ in range(self.n)]

    @classmethod
    def of(cls, n: int, profile: Any) -> RouterProcesses:
        """``n`` processes costing what ``profile``'s hop terms measured."""
        return cls(n, profile.hop_request_s, profile.hop_request_token_s, profile.hop_token_s)

    def admit(self, when: float, prompt_tokens: int) -> float:
        """A request sent at ``when``: when its process has routed and forwarded it."""
        self.first, self.last = min(self.first, when), max(self.last, when)
        p = self.turn
        self.turn = (p + 1) % self.n
        self._serve_relays(p, when)
        self._work(p, when, self.request_s + self.request_token_s * prompt_tokens)
        return self.free[p]

    def relay(self, when: float, tokens: int) -> None:
        """``tokens`` streamed by a step that ended at ``when``."""
        if tokens <= 0 or not self.token_s:
            return
        each = tokens * self.token_s / self.n
        for queue in self.relays:
            heapq.heappush(queue, (when, each))

    def _serve_relays(self, p: int, until: float) -> None:
        queue = self.relays[p]
        while queue and queue[0][0] <= until:
            self._work(p, *heapq.heappop(queue))

    def _work(self, p: int, at: float, seconds: float) -> None:
        """Process ``p`` takes ``seconds`` of work that came at ``at``, after what it has."""
        self.free[p] = max(self.free[p], at) + seconds
        self.work[p] += seconds

    def worked(self) -> list[float]:
        """Each process's seconds of work, every relay reported so far served."""
        for p in range(self.n):
            self._serve_relays(p, math.inf)
        return list(self.work)

    def busy(self) -> list[float]:
        """Each process's seconds of work per second over which the requests were sent:
        the share of a core it needs to keep up. Past 1 it cannot, and its queue grows for
        as long as the load lasts."""
        work = self.worked()
        span = self.last - self.first
        if span <= 0:  # one send time: the router's own span instead
            span = max(self.free) - self.first
        return [w / span if span > 0 else 0.0 for w in work]


def routed_fleet(
    shares: list[Any],
    requests: Sequence[BenchRequest],
    sends: list[float] | None,
    concurrency: int | None,
    policy_name: str,
    encode: Callable[[BenchRequest, int], list[int]],
    overlap_weight: float = DEFAULT_OVERLAP_WEIGHT,
    router: RouterProcesses | None = None,
) -> None:
    """Replay ``requests`` on the replicas of ``shares`` (``kvserve.sim.simulate._Share``,
    each fed by its ``rep.push``), routed by ``policy_name`` (the prefix policies and the
    oracle with ``overlap_weight``). ``sends``: open-loop send offsets from each share's
    ``t0`` (None: a closed loop of ``concurrency`` users). ``router``: the router's own
    processes, which each request passes through (None: its work is the replicas')."""
    n = len(shares)
    engines = [sh.sim.engine for sh in shares]
    bs = engines[0].block_size
    index = PrefixIndex(n)  # every router process reads every replica's events: one index

    def new_policy() -> Any:
        if policy_name == "oracle":
            oracle = make_policy("prefix", scorer=ExactScorer(engines),
                                 overlap_weight=overlap_weight)  # fmt: skip
            oracle.name = "oracle"
            return oracle
        return make_policy(policy_name, index=index, block_size=bs,
                           overlap_weight=overlap_weight)  # fmt: skip

    # Each router process routes from its own view: its policy's state (prefix_approx's
    # history) and the load of the requests it sent.
    views = router.n if router is not None else 1
    policies = [new_policy() for _ in range(views)]
    for policy in policies:
        for k, eng in enumerate(engines):  # each pool, as the real router reads it
            if policy.wants_pool(k):
                policy.learn_pool(k, eng.num_blocks, eng.block_size)
    if policy_name == "prefix":
        for eng in engines:
            eng.kv.enable_events("GPU")
    loads = [[ReplicaLoad() for _ in range(n)] for _ in range(views)]
    # Per replica, by its share index: (the router process that sent it, its blocks, the
    # request as routed).
    routed: list[dict[int, tuple[int, int, RouteRequest]]] = [{} for _ in range(n)]
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
            p, blocks, rr = routed[k].pop(i)
            loads[p][k].requests -= 1
            loads[p][k].blocks -= blocks
            policies[p].finished(rr, k)
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
        p = router.turn if router is not None else 0
        policy, load = policies[p], loads[p]
        k = policy.choose(rr, load).replica
        policy.routed(rr, k)
        sh = shares[k]
        blocks = len(ids) // bs
        routed[k][len(sh.mine)] = (p, blocks, rr)
        sh.mine.append(i)
        load[k].requests += 1
        load[k].blocks += blocks
        clock = sh.sim.clock
        arrive = when if router is None else router.admit(when, len(ids))
        if idle[k]:
            clock.now = max(clock.now, sh.t0 + arrive)
            idle[k] = False
        sh.rep.push(sh.share, req, ids, sh.t0 + when, sh.t0 + arrive)

    def step(k: int) -> None:
        runner = shares[k].sim.runner
        ran = runner.steps
        if next(shares[k].steps) is IDLE:
            idle[k] = True
        if router is not None and runner.steps > ran:
            router.relay(elapsed(k), runner.sampled)
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
