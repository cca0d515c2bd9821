"""Routing policies: which replica serves a request. One object per policy, the same objects
for ``kvserve router`` (real replicas) and ``kvserve simulate --router`` (modelled ones).

A policy sees the request (its prompt tokens, the salt that partitions the prefix cache, a
session key) and the router's view of each replica's load (requests and prompt blocks in
flight, whether it is healthy) and returns a :class:`Decision`. The prefix policies also ask a
:class:`PrefixScorer` how much of the prompt each replica holds:

- ``prefix`` (precise): the :class:`~kvserve.router.index.PrefixIndex` built from the
  replicas' KV events, each block credited by its medium.
- ``prefix_approx``: the router's own routing history (SGLang's approximate tree): a
  replica is assumed to hold the prompts it was sent, up to its pool's size (read from its
  metrics) or a capacity the operator sets, least recently sent forgotten first. For
  replicas that publish no events.

Both use NVIDIA Dynamo's cost: ``overlap_weight * (prompt blocks the replica must compute)
+ (the blocks it would hold: the distinct prompt blocks in flight on it, and this prompt's
that it lacks)``, the lowest wins (a block of a prompt in flight counts as held by its
replica: it will be, before its event comes). The default weight is
:data:`DEFAULT_OVERLAP_WEIGHT`, not Dynamo's 1: counting *distinct* blocks, a replica that
serves many contexts at once looks loaded however few requests it runs, and at weight 1 that
sent a context's requests to a replica lacking it whenever the other held a couple more
contexts in flight, computing the context there again (the routing benchmark's sweep over
the weight, in BENCHMARKS.md).

SGLang's imbalance guard is there on request (``balance_abs``): when the busiest replica has
more than ``balance_abs`` requests more than the idlest *and* more than ``balance_rel`` times
as many, the request goes to the least loaded one whatever the cache. It is off by default
because Dynamo's cost already weighs load, and a guard that counts requests treats a request
that must compute its whole context like one that finds it cached. Under saturation it sends
the busy replica's overflow, context and all, to the other: that replica recomputes contexts
it does not hold, both pools fill with copies, hits fall, queues grow, and the guard fires
more (the collapse the routing benchmark measured past capacity). SGLang needs the guard
because its approximate tree scores the cache alone.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvserve.kv.hashing import BlockHash, extend_block_hashes
from kvserve.router.index import PrefixIndex

log = logging.getLogger(__name__)

# The weight of the prompt blocks a replica must compute, against the blocks in flight on it.
DEFAULT_OVERLAP_WEIGHT = 5.0


@dataclass(slots=True)
class RouteRequest:
    """What a policy knows of a request."""

    token_ids: Sequence[int] = ()
    salt: str | None = None  # the prefix-cache partition (the tenant's cache salt)
    session: str | None = None  # a session header, or the request's ``user``
    chain: list[BlockHash] | None = None  # the router's own block keys, made once (chain_of)


@dataclass(slots=True)
class ReplicaLoad:
    """The router's view of one replica."""

    healthy: bool = True
    requests: int = 0  # in flight from this router
    blocks: int = 0  # prompt blocks of those requests (Dynamo's decode blocks)


@dataclass(slots=True)
class Decision:
    replica: int
    policy: str
    hit_blocks: int = 0  # prompt blocks the policy expects the replica to hold
    balanced: bool = False  # the imbalance guard overrode the cache score
    scores: list[float] = field(default_factory=list)  # cost per replica (prefix policies)


class NoReplicaError(RuntimeError):
    """No healthy replica to route to."""


def _healthy(loads: Sequence[ReplicaLoad]) -> list[int]:
    out = [i for i, ld in enumerate(loads) if ld.healthy]
    if not out:
        raise NoReplicaError("no healthy replica")
    return out


class RoutingPolicy(ABC):
    name: str = ""

    @abstractmethod
    def choose(self, req: RouteRequest, loads: Sequence[ReplicaLoad]) -> Decision: ...

    def routed(self, req: RouteRequest, replica: int) -> None:  # noqa: B027 - optional hook
        """The request went to ``replica`` (the prefix policies remember it)."""

    def finished(self, req: RouteRequest, replica: int) -> None:  # noqa: B027 - optional hook
        """The request ended on ``replica`` (served, failed or cut)."""

    def wants_pool(self, replica: int) -> bool:
        """Whether the policy still needs ``replica``'s KV pool: its size or block size
        (:meth:`learn_pool`)."""
        return False

    def learn_pool(self, replica: int, blocks: int | None,  # noqa: B027 - optional hook
                   block_size: int | None) -> None:  # fmt: skip
        """``replica``'s KV pool holds ``blocks`` blocks of ``block_size`` tokens (None: it
        did not say)."""

    def replica_down(self, replica: int) -> None:  # noqa: B027 - optional hook
        """``replica`` went down: whatever the policy believed it held is gone."""


class RoundRobin(RoutingPolicy):
    name = "round_robin"

    def __init__(self) -> None:
        self._next = itertools.count()

    def choose(self, req: RouteRequest, loads: Sequence[ReplicaLoad]) -> Decision:
        healthy = _healthy(loads)
        return Decision(healthy[next(self._next) % len(healthy)], self.name)


def least_loaded(loads: Sequence[ReplicaLoad], turn: int = 0) -> int:
    """Fewest requests in flight, then fewest blocks; ties rotate with ``turn``."""
    healthy = _healthy(loads)
    k = len(healthy)
    order = [healthy[(turn + j) % k] for j in range(k)]
    return min(order, key=lambda i: (loads[i].requests, loads[i].blocks))


class LeastLoad(RoutingPolicy):
    name = "least_load"

    def __init__(self) -> None:
        self._turn = itertools.count()

    def choose(self, req: RouteRequest, loads: Sequence[ReplicaLoad]) -> Decision:
        return Decision(least_loaded(loads, next(self._turn)), self.name)


class Session(RoutingPolicy):
    """A session sticks to one replica (rendezvous hashing over the healthy ones, so a dead
    replica moves only its own sessions); a request with no session goes to the least loaded."""

    name = "session"

    def __init__(self) -> None:
        self._turn = itertools.count()

    def choose(self, req: RouteRequest, loads: Sequence[ReplicaLoad]) -> Decision:
        if req.session is None:
            return Decision(least_loaded(loads, next(self._turn)), self.name)
        key = req.session.encode()

        def weight(i: int) -> bytes:
            return hashlib.sha256(key + b"\0" + str(i).encode()).digest()

        return Decision(max(_healthy(loads), key=weight), self.name)


class PrefixScorer(Protocol):
    """Per replica: (leading prompt blocks it holds, their credited blocks)."""

    block_size: int | None

    def match(self, req: RouteRequest, num_replicas: int) -> list[tuple[int, float]]: ...


class EventScorer:
    """The precise scorer: the index of the replicas' KV events."""

    def __init__(self, index: PrefixIndex) -> None:
        self.index = index

    @property
    def block_size(self) -> int | None:
        return self.index.block_size

    def match(self, req: RouteRequest, num_replicas: int) -> list[tuple[int, float]]:
        chain = self.index.chain(req.token_ids, req.salt)
        if not chain:
            return [(0, 0.0)] * num_replicas
        return [self.index.overlap(r, chain) for r in range(num_replicas)]


ROUTER_ROOT = BlockHash(hashlib.sha256(b"kvserve-router-history").digest())


def chain_of(req: RouteRequest, block_size: int) -> list[BlockHash]:
    """The router's own keys for the request's full blocks (salted as the replicas salt them,
    rooted apart from theirs), made once per request."""
    if req.chain is None:
        req.chain = []
        extend_block_hashes(req.chain, list(req.token_ids), block_size, ROUTER_ROOT, req.salt)
    return req.chain


class InFlight:
    """The blocks of the prompts in flight on each replica: they will be cached there once
    computed, before any event says so. A burst of requests sharing a new prefix would else
    look cold everywhere and be spread; Dynamo counts its active sequences' blocks the same
    way."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.held: list[dict[bytes, int]] = []

    def blocks(self, r: int) -> dict[bytes, int]:
        while len(self.held) <= r:
            self.held.append({})
        return self.held[r]

    def add(self, req: RouteRequest, r: int) -> None:
        held = self.blocks(r)
        for h in chain_of(req, self.block_size):
            held[h] = held.get(h, 0) + 1

    def remove(self, req: RouteRequest, r: int) -> None:
        held = self.blocks(r)
        for h in chain_of(req, self.block_size):
            n = held.get(h, 0) - 1
            if n > 0:
                held[h] = n
            else:
                held.pop(h, None)

    def overlap(self, req: RouteRequest, r: int) -> int:
        held, n = self.blocks(r), 0
        for h in chain_of(req, self.block_size):
            if h not in held:
                break
            n += 1
        return n


# Blocks a replica is assumed to keep, and their size, where neither the operator nor the
# replica says.
DEFAULT_CAPACITY_BLOCKS = 1 << 16
DEFAULT_BLOCK_SIZE = 16


class HistoryScorer:
    """The approximate scorer: each replica is assumed to hold the blocks of the prompts it
    was sent, at most its capacity of them (least recently sent forgotten first).

    The capacity is ``capacity_blocks`` where the operator gives one, else the replica's own
    pool once the router has read it (:meth:`learn_pool`). A history larger than the pool
    believes every replica still holds every context it was ever sent; once the load term has
    spread a context to two replicas, both score alike for it forever, and the policy routes
    on load alone while the pools evict what it thinks they hold.

    The history's keys are the prompts' full blocks, so they must be cut at the replicas'
    block size: ``block_size`` where the operator gives one, else the first size a replica
    reports (:meth:`learn_pool`), else 16. Cut at another size, a prompt sharing only part of
    a replica's block would score it as held."""

    def __init__(self, block_size: int | None = None, capacity_blocks: int | None = None) -> None:
        self.fixed_block_size = block_size
        self.learned_block_size: int | None = None
        self.capacity_blocks = capacity_blocks
        self.pools: dict[int, int] = {}  # replica -> its pool's blocks, as it reported them
        self.sent: list[OrderedDict[bytes, None]] = []

    @property
    def block_size(self) -> int:
        return self.fixed_block_size or self.learned_block_size or DEFAULT_BLOCK_SIZE

    def wants_pool(self, replica: int) -> bool:
        size_unknown = self.fixed_block_size is None and self.learned_block_size is None
        return size_unknown or (self.capacity_blocks is None and replica not in self.pools)

    def capacity(self, replica: int) -> int:
        if self.capacity_blocks is not None:
            return self.capacity_blocks
        return self.pools.get(replica, DEFAULT_CAPACITY_BLOCKS)

    def learn_pool(self, replica: int, blocks: int | None, block_size: int | None) -> None:
        """The replica's pool holds ``blocks`` blocks: keep at most that many of its history
        (unless the operator fixed the capacity). Its ``block_size`` cuts the history's keys
        from now on, unless the operator gave one or another replica spoke first (a fleet
        whose replicas differ gets a warning: no one size scores them all)."""
        if block_size is not None:
            ours = self.fixed_block_size or self.learned_block_size
            if ours is None:
                self.learned_block_size = block_size
                if block_size != DEFAULT_BLOCK_SIZE:  # keys cut at 16 match nothing now
                    for sent in self.sent:
                        sent.clear()
            elif block_size != ours:
                whose = "--block-size" if self.fixed_block_size else "another replica's"
                log.warning("replica %d reports block size %d; prefix_approx cuts prompts at "
                            "%d (%s)", replica, block_size, ours, whose)  # fmt: skip
        if blocks is not None:
            self.pools[replica] = blocks
            if replica < len(self.sent):
                self._trim(replica)

    def _trim(self, replica: int) -> None:
        sent, cap = self.sent[replica], self.capacity(replica)
        while len(sent) > cap:
            sent.popitem(last=False)

    def _chain(self, req: RouteRequest) -> list[BlockHash]:
        return chain_of(req, self.block_size)

    def match(self, req: RouteRequest, num_replicas: int) -> list[tuple[int, float]]:
        while len(self.sent) < num_replicas:
            self.sent.append(OrderedDict())
        chain = self._chain(req)
        out = []
        for r in range(num_replicas):
            sent, n = self.sent[r], 0
            for h in chain:
                if h not in sent:
                    break
                n += 1
            out.append((n, float(n)))
        return out

    def remember(self, req: RouteRequest, replica: int) -> None:
        while len(self.sent) <= replica:
            self.sent.append(OrderedDict())
        sent = self.sent[replica]
        for h in self._chain(req):
            sent[h] = None
            sent.move_to_end(h)
        self._trim(replica)

    def forget(self, replica: int) -> None:
        """The replica went down: its history, and its pool's size (it may come back with
        another)."""
        self.pools.pop(replica, None)
        if replica < len(self.sent):
            self.sent[replica].clear()


class PrefixPolicy(RoutingPolicy):
    """Dynamo's cost over a scorer, optionally behind SGLang's imbalance guard."""

    name = "prefix"

    def __init__(
        self,
        scorer: PrefixScorer,
        name: str = "prefix",
        overlap_weight: float = DEFAULT_OVERLAP_WEIGHT,
        balance_abs: int | None = None,
        balance_rel: float = 1.5,
        block_size: int = DEFAULT_BLOCK_SIZE,
    ) -> None:
        """``block_size``: the replicas', until the scorer has learned it; ``balance_abs``:
        the imbalance guard's threshold (None: no guard)."""
        self.scorer = scorer
        self.block_size = block_size
        self.name = name
        self.overlap_weight = overlap_weight
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel
        self._turn = itertools.count()
        # Blocks of the prompts in flight per replica: the load term (distinct blocks, as
        # Dynamo counts its active blocks), and for the precise scorers, which learn a block
        # only once it is computed, blocks about to be cached.
        self.inflight = InFlight(block_size)
        # The approximate scorer, which keeps the routing history (None: a precise one).
        self._history = scorer if isinstance(scorer, HistoryScorer) else None

    @property
    def _prompt_block_size(self) -> int:
        """The size prompts are cut at: the scorer's once it knows the replicas', else ours."""
        return self.scorer.block_size or self.block_size

    def choose(self, req: RouteRequest, loads: Sequence[ReplicaLoad]) -> Decision:
        healthy = _healthy(loads)
        turn = next(self._turn)
        if self.balance_abs is not None:
            busiest = max(loads[i].requests for i in healthy)
            idlest = min(loads[i].requests for i in healthy)
            if busiest - idlest > self.balance_abs and busiest > self.balance_rel * idlest:
                return Decision(least_loaded(loads, turn), self.name, balanced=True)
        bs = self.inflight.block_size = self._prompt_block_size
        n_blocks = len(req.token_ids) // bs
        matches = self.scorer.match(req, len(loads))
        inflight = self.inflight
        if self._history is None:
            for i in healthy:
                pending = inflight.overlap(req, i)
                if pending > matches[i][0]:
                    matches[i] = (pending, max(matches[i][1], float(pending)))
        costs = [float("inf")] * len(loads)
        for i in healthy:
            # Dynamo: prefill blocks weighted, plus the decode blocks the replica would hold
            # (those in flight, and this prompt's that it lacks).
            decode = len(inflight.blocks(i)) + n_blocks - matches[i][0]
            costs[i] = self.overlap_weight * (n_blocks - matches[i][1]) + decode
        k = len(healthy)
        order = [healthy[(turn + j) % k] for j in range(k)]  # ties rotate
        best = min(order, key=lambda i: (costs[i], loads[i].requests))
        return Decision(best, self.name, hit_blocks=matches[best][0], scores=costs)

    def routed(self, req: RouteRequest, replica: int) -> None:
        if self._history is not None:
            self._history.remember(req, replica)
        self.inflight.block_size = self._prompt_block_size
        self.inflight.add(req, replica)

    def finished(self, req: RouteRequest, replica: int) -> None:
        self.inflight.remove(req, replica)

    def wants_pool(self, replica: int) -> bool:
        return self._history is not None and self._history.wants_pool(replica)

    def learn_pool(self, replica: int, blocks: int | None, block_size: int | None) -> None:
        if self._history is not None:
            self._history.learn_pool(replica, blocks, block_size)

    def replica_down(self, replica: int) -> None:
        if self._history is not None:
            self._history.forget(replica)


POLICIES = ("round_robin", "least_load", "session", "prefix", "prefix_approx")


def make_policy(
    name: str,
    index: PrefixIndex | None = None,
    block_size: int | None = None,
    approx_capacity_blocks: int | None = None,
    scorer: PrefixScorer | None = None,
    **prefix_kw: float | None,
) -> RoutingPolicy:
    """The policy named ``name``; ``prefix`` reads ``index`` (or ``scorer``: an oracle's).
    ``block_size``: the replicas' (None: ``prefix`` learns it from the events,
    ``prefix_approx`` from the replicas' metrics). ``prefix_kw`` (the overlap weight, the
    imbalance guard) sets the prefix policies; the others take none and ignore it."""
    simple: dict[str, Callable[[], RoutingPolicy]] = {
        "round_robin": RoundRobin, "least_load": LeastLoad, "session": Session,
    }  # fmt: skip
    if name in simple:
        return simple[name]()
    if name == "prefix":
        if scorer is None:
            if index is None:
                raise ValueError("router: the prefix policy needs the replicas' KV events")
            scorer = EventScorer(index)
        return PrefixPolicy(scorer, "prefix", block_size=block_size or DEFAULT_BLOCK_SIZE,
                            **prefix_kw)  # type: ignore[arg-type]  # fmt: skip
    if name == "prefix_approx":
        history = HistoryScorer(block_size, approx_capacity_blocks)
        return PrefixPolicy(history, "prefix_approx", block_size=history.block_size,
                            **prefix_kw)  # type: ignore[arg-type]  # fmt: skip
    raise ValueError(f"router: policy must be one of {', '.join(POLICIES)}, got {name!r}")
