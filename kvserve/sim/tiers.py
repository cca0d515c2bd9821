"""Offload tiers on the simulator's clock: ``--kv-offload-*`` without bytes or a worker thread.

The scheduler and the KV manager are the real ones, and they ask these tiers exactly what they
ask the real :class:`~kvserve.kv.offload.KVOffload` (the
:class:`~kvserve.kv.offload.OffloadTiers` questions). :class:`SimOffload` answers from a model
of each tier: the block keys it holds, in LRU order, within its byte budget counted in blocks
(what the real tier holds, without the bytes), and the time of a load from the profile's
figures for that tier (``tier_bandwidth``, ``tier_latency_s``). The real worker thread becomes
a queue on the virtual clock: loads run one after another, each taking the latency of every
batch of blocks asked of a tier plus its bytes over that tier's bandwidth (with the profile's
``inline_host_loads``, a CPU engine's, a load the host tier holds whole is the engine
thread's instead: its time passes on the engine's clock when it is asked for), and
:meth:`SimOffload.poll_loads` hands over the loads that have landed by now, waiting when the
engine is idle as the real one does (at most ``POLL_WAIT_S`` at a time, so arrivals are not
held up). A load that would outlast its timeout ends empty at its deadline (the request
recomputes). A probe costs the engine thread each asked tier's latency, as the real probe
does. Stores are visible at once: the real worker writes them within milliseconds, off the
step path; the export they need is charged to the step by the cost-model runner.

A Redis server answers one load at a time (redis-server runs commands on one thread): a
load's Redis part starts when the server is done with the loads asked before it, and
replicas behind one Redis share its :class:`ModelledTier`, so they queue for it together
(``kvserve.sim.simulate``'s fleet runs them on one timeline). Not modelled: tier failures
and back-off (a modelled tier never fails), entry headers (an entry is its block's bytes),
and stores competing with loads (for the worker or the server's link).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvserve.config import CacheConfig, ConfigError
from kvserve.engine.offload import check_tier_size, tier_sizes
from kvserve.kv.hashing import BlockHash
from kvserve.kv.offload import LOAD_BATCH, POLL_WAIT_S, LoadResult, TierCounters
from kvserve.sim.cost import Profile

SERVER_TIERS = ("redis",)  # a server behind a network link, which replicas can share


@dataclass(slots=True)
class ModelledBlocks:
    """What a modelled load hands the runner in place of a payload: only a block count."""

    num_blocks: int


@dataclass(slots=True)
class ModelledTier:
    """A tier's keys in LRU order within its capacity, and its link to the device."""

    name: str
    flag: str  # the CLI flag that sizes it, for error messages
    capacity_bytes: int
    bandwidth: float  # bytes/s into one GPU's pool
    latency_s: float  # per batch of blocks asked
    block_bytes: float = 1.0  # one block, every GPU of the replica (set with the geometry)
    entries: OrderedDict[bytes, None] = field(default_factory=OrderedDict)
    num_evictions: int = 0
    # A server (Redis) answers one load at a time, whichever replica asked: when it is next
    # free, on the fleet's timeline. None: the tier is the replica's own (host, disk), whose
    # loads only its own worker queues.
    free_at: float | None = None

    @property
    def capacity_blocks(self) -> int:
        return int(self.capacity_bytes // self.block_bytes)

    def put(self, key: bytes) -> bool:
        """Hold ``key``, evicting the least recently used to make room; False if present."""
        if key in self.entries:
            return False
        while len(self.entries) >= self.capacity_blocks:
            self.entries.popitem(last=False)
            self.num_evictions += 1
        self.entries[key] = None
        return True

    def count_present(self, keys: Sequence[bytes]) -> int:
        n = 0
        for key in keys:
            if key not in self.entries:
                break
            n += 1
        return n


def modelled_tiers(cc: CacheConfig, profile: Profile) -> list[ModelledTier]:
    """The tiers ``cc`` names, fastest first (as the engine orders them), with the profile's
    link figures. Raises ConfigError naming the profile field a tier lacks."""
    tiers = []
    for name, flag, size in tier_sizes(cc):
        bw, lat = profile.tier_bandwidth.get(name), profile.tier_latency_s.get(name)
        if bw is None or lat is None:
            raise ConfigError(
                f"profile {profile.device!r}: no figures for the {name} tier; add "
                f"tier_bandwidth[{name!r}] (bytes/s) and tier_latency_s[{name!r}] (seconds) "
                "to the profile, or calibrate with --calibrate"
            )
        tier = ModelledTier(name, flag, size, float(bw), float(lat))
        if name in SERVER_TIERS:
            tier.free_at = -math.inf
        tiers.append(tier)
    return tiers


@dataclass(slots=True)
class _Load:
    start_at: float
    end_at: float  # when the queue is done with it
    ready_at: float  # when the engine sees it (end_at, or the deadline)
    num_blocks: int
    servers: list[tuple[ModelledTier, float, float]]  # servers booked: free_at before, after


class SimOffload:
    """Modelled tiers behind a simulated engine's pool (see the module's docstring)."""

    def __init__(
        self,
        tiers: list[ModelledTier],
        clock: Any,
        load_timeout_s: float,
        inline_host_loads: bool = False,
    ) -> None:
        if not tiers:
            raise ValueError("SimOffload: at least one tier")
        self.tiers = tiers
        self.clock = clock  # a VirtualClock: now() and advance(seconds)
        self.load_timeout_s = load_timeout_s
        # As the real KVOffload on a CPU engine that takes every core: a load the host tier
        # holds whole is done by the engine thread at once, from that tier alone.
        self.inline_host_loads = inline_host_loads and tiers[0].name == "cpu"
        self.inline_loaded: set[str] = set()  # such loads not yet imported (the runner's)
        self.counters = {t.name: TierCounters() for t in tiers}
        self.write_through_hits: int | None = None  # set by the engine from its config
        self.swap_preempted = True
        self.gpu_block_bytes = 1.0  # one GPU's share of a block: what one link moves
        self._loads: dict[str, _Load] = {}
        self._queue_free_at = 0.0
        self._probe_tier: ModelledTier | None = None
        # This engine's clock minus the fleet's timeline, on which a shared server's free_at
        # is kept (replicas' clocks differ by their warm-up; the fleet sets it).
        self.epoch = 0.0

    def set_geometry(self, gpu_block_bytes: float, tp: int) -> None:
        """A block's bytes on one GPU, and the GPUs of a replica (a tier holds every GPU's
        share; each GPU loads its own over its own link, in parallel). Raises ConfigError
        for a tier smaller than one block, naming its flag."""
        self.gpu_block_bytes = gpu_block_bytes
        for tier in self.tiers:
            tier.block_bytes = gpu_block_bytes * tp
            check_tier_size(tier.flag, tier.capacity_bytes, math.ceil(tier.block_bytes))

    # -- what the scheduler asks ----------------------------------------------------------
    @property
    def num_loading(self) -> int:
        return len(self._loads)

    def wants(self, block_hash: BlockHash) -> bool:
        return not any(block_hash in t.entries for t in self.tiers)

    def probe(self, hashes: Sequence[BlockHash]) -> int:
        if not hashes:
            return 0
        best = 0
        self._probe_tier = None
        for tier in self.tiers:
            self.clock.advance(tier.latency_s)  # the engine thread asks each tier in turn
            n = tier.count_present(hashes)
            if n > best:
                best, self._probe_tier = n, tier
            if best == len(hashes):
                break
        return best

    def load_seconds(self, num_blocks: int) -> float | None:
        """The probed tier's latency and bytes over its bandwidth (the profile's figures are
        known from the start, as a real tier's rate is once measured), plus, for a server,
        the wait for the loads it still has to answer (which the real worker's measured
        rate takes in)."""
        tier = self._probe_tier
        if tier is None:
            return None
        start = max(self.clock(), self._queue_free_at)
        return self._server_wait(tier, start) + self._transfer_s(tier, num_blocks)

    def backlog_seconds(self) -> float:
        return max(self._queue_free_at - self.clock(), 0.0)

    def _server_wait(self, tier: ModelledTier, at: float) -> float:
        """Seconds from ``at`` (this engine's clock) until the tier's server is free: 0 for a
        tier that is no server, or a server idle by then."""
        if tier.free_at is None:
            return 0.0
        return max(tier.free_at + self.epoch - at, 0.0)

    def _transfer_s(self, tier: ModelledTier, n: int) -> float:
        return (
            math.ceil(n / LOAD_BATCH) * tier.latency_s + n * self.gpu_block_bytes / tier.bandwidth
        )

    def start_load(self, req_id: str, hashes: Sequence[BlockHash]) -> None:
        if self.inline_host_loads and self.tiers[0].count_present(hashes) == len(hashes):
            self._load_inline(req_id, hashes)
            return
        now = self.clock()
        per_tier = dict.fromkeys((t.name for t in self.tiers), 0)
        got = 0
        for key in hashes:
            found = None
            for i, tier in enumerate(self.tiers):
                c = self.counters[tier.name]
                c.queries += 1
                if key in tier.entries:
                    found = tier
                    tier.entries.move_to_end(key)
                    for faster in self.tiers[:i]:  # a slower tier's block goes up too
                        faster.put(key)
                    break
                c.fail("missing")
            if found is None:
                break
            per_tier[found.name] += 1
            got += 1
        start = t = max(now, self._queue_free_at)
        servers: list[tuple[ModelledTier, float, float]] = []  # (server, free_at before, after)
        for tier in self.tiers:
            n = per_tier[tier.name]
            if not n:
                continue
            took = self._transfer_s(tier, n)
            if tier.free_at is not None:
                # The server answers this part once it is done with every load asked before
                # (by any replica); the worker waits for it, and times the wait as part of
                # the load, as the real worker's clock does.
                before = tier.free_at
                took += self._server_wait(tier, t)
                tier.free_at = t + took - self.epoch
                servers.append((tier, before, tier.free_at))
            c = self.counters[tier.name]
            c.hits += n
            c.bytes_up += int(n * tier.block_bytes)
            c.seconds_up += took
            t += took
        end = t
        self._queue_free_at = end
        ready = end
        if end - now > self.load_timeout_s:  # the engine gives up at the deadline
            ready, got = now + self.load_timeout_s, 0
            self.counters[self.tiers[0].name].fail("load_timeout")
        self._loads[req_id] = _Load(start, end, ready, got, servers)

    def _load_inline(self, req_id: str, hashes: Sequence[BlockHash]) -> None:
        """The host tier's blocks of ``hashes`` (it holds them all), on the engine's clock:
        the step that asked waits for them."""
        tier, c = self.tiers[0], self.counters[self.tiers[0].name]
        for key in hashes:
            tier.entries.move_to_end(key)
        got = len(hashes)
        c.queries += got
        took = self._transfer_s(tier, got) if got else 0.0
        self.clock.advance(took)
        c.hits += got
        c.bytes_up += int(got * tier.block_bytes)
        c.seconds_up += took
        now = self.clock()
        self._loads[req_id] = _Load(now, now, now, got, [])
        self.inline_loaded.add(req_id)

    def cancel(self, req_id: str) -> None:
        self.inline_loaded.discard(req_id)
        load = self._loads.pop(req_id, None)
        # Not started and last in the queue: the worker would skip it, its time is free, and
        # so is the servers' time it had booked, where nothing was booked after it.
        if (
            load is not None
            and load.start_at >= self.clock()
            and load.end_at == self._queue_free_at
        ):
            self._queue_free_at = load.start_at
            for tier, before, after in reversed(load.servers):
                if tier.free_at == after:
                    tier.free_at = before

    def poll_loads(self, wait: bool = False) -> dict[str, LoadResult]:
        now = self.clock()
        if wait and self._loads:
            first = min(load.ready_at for load in self._loads.values())
            if first > now:  # the idle engine waits, at most POLL_WAIT_S at a time
                self.clock.advance(min(first, now + POLL_WAIT_S) - now)
                now = self.clock()
        done: dict[str, LoadResult] = {}
        for rid, load in list(self._loads.items()):
            if load.ready_at <= now:
                blocks = [ModelledBlocks(load.num_blocks)] if load.num_blocks else []
                done[rid] = LoadResult(blocks)  # type: ignore[arg-type]
                del self._loads[rid]
        return done

    def store(self, hashes: Sequence[BlockHash], payload: Any) -> None:
        for key in hashes:
            for tier in self.tiers:
                if tier.put(key):
                    c = self.counters[tier.name]
                    c.stored += 1
                    c.bytes_down += int(tier.block_bytes)

    def stats(self) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for tier in self.tiers:
            c = self.counters[tier.name]
            out[tier.name] = dict(
                queries=c.queries, hits=c.hits, stored=c.stored,
                bytes_down=c.bytes_down, seconds_down=c.seconds_down,
                bytes_up=c.bytes_up, seconds_up=c.seconds_up,
                failures=dict(c.failures), entries=len(tier.entries),
                used_bytes=int(len(tier.entries) * tier.block_bytes),
                capacity_bytes=tier.capacity_bytes, evictions=tier.num_evictions,
                backed_off=False,
            )  # fmt: skip
        return out

    def flush(self, timeout_s: float = 10.0) -> bool:
        return True  # stores are visible at once

    def enable_events(self, block_size: int) -> None:
        """Modelled tiers publish no KV events (the simulator has no subscriber)."""

    def take_events(self) -> list[Any]:
        return []

    def close(self) -> None:
        pass
