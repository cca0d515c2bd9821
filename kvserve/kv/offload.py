"""Tiers behind the device pool: which prefix blocks go down, which come back, never a wrong one.

What goes down: a cached-free block the pool hands out for new content (write-back on
eviction). The runner exports its bytes before anything in that step overwrites them, and
hands them back in its output; a worker thread encodes each block as one self-checking entry
(:mod:`kvserve.kv.tier_entry`) and puts it in every tier. What comes up: a waiting request's
chain of block hashes continues past the device's hits into the tiers (:meth:`KVOffload.probe`);
the scheduler gives the request fresh blocks for the tier hits and :meth:`KVOffload.start_load`
fetches them on the worker thread; the request waits (it is not running) until
:meth:`KVOffload.poll_loads` hands over the verified payloads, which the runner imports before
the request's first forward pass. Nothing on the engine's step path waits for a tier, except
the probe, which is bounded by the tier's timeout, and, on a CPU engine whose compute threads
take every core, a load from host memory, which the engine thread does itself (see
:meth:`KVOffload.start_load`).

Keys cannot collide: a tier key is a namespace (the prefix-cache root, which commits to the
model's weight content and the KV format with its block size, plus the storage's identity and
pool-wide state such as fp8 scales, and a key version) followed by the block hash, which commits
to the whole token prefix and the tenant salt. Every entry echoes its key and carries a
checksum; a mismatch, a truncated or missing entry, a timeout or a dead backend is a miss: the
entry is dropped, a counter moves, and the block is recomputed. A backend that fails is skipped
for a back-off period that doubles up to a minute, then tried again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from kvserve.kernels.openmp import serial_thread
from kvserve.kv.events import TIER_MEDIUM, BlockStored, KVCacheEvent, removed
from kvserve.kv.hashing import BlockHash
from kvserve.kv.storage import BlockPayload
from kvserve.kv.tier_entry import EntryError, decode_entry, encode_entry
from kvserve.kv.tiers import HostTier, Tier, TierError

log = logging.getLogger("kvserve.offload")

TIER_KEY_VERSION = 1
BACKOFF_START_S = 1.0
BACKOFF_MAX_S = 60.0
POLL_WAIT_S = 0.01
GAUGE_REFRESH_S = 1.0
WORKER_NICE = 10
LOAD_BATCH = 64  # blocks asked of a tier at once
RATE_MIN_HITS = 8  # blocks a tier must have loaded before its measured rate is trusted


def tier_namespace(root: BlockHash, identity: dict[str, Any], pool: dict[str, Any]) -> bytes:
    """16 bytes that every tier key of this engine starts with: two engines share entries
    exactly when they agree on the model's weights, the KV format and its geometry, pool-wide
    state (fp8 scales) and this key version."""
    h = hashlib.sha256(f"kvserve-tier\0{TIER_KEY_VERSION}\0".encode())
    h.update(root)
    h.update(_canonical(identity).encode())
    for name in sorted(pool):
        value = pool[name]
        h.update(name.encode())
        if isinstance(value, torch.Tensor):
            h.update(value.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        else:
            h.update(repr(value).encode())
    return h.digest()[:16]


def _canonical(identity: dict[str, Any]) -> str:
    return json.dumps(identity, sort_keys=True, default=str)


@dataclass(slots=True)
class TierCounters:
    """Per tier, since start (counters, never ratios)."""

    queries: int = 0  # blocks looked up in this tier
    hits: int = 0  # blocks loaded from it and verified
    stored: int = 0  # entries written
    bytes_down: int = 0
    seconds_down: float = 0.0
    bytes_up: int = 0
    seconds_up: float = 0.0
    failures: dict[str, int] = field(default_factory=dict)

    def fail(self, reason: str) -> None:
        self.failures[reason] = self.failures.get(reason, 0) + 1


@dataclass(slots=True)
class LoadResult:
    """The leading blocks of a load that arrived intact, in chain order (possibly none), as
    few payloads as possible (joined on the worker, off the step path)."""

    payloads: list[BlockPayload]

    @property
    def num_blocks(self) -> int:
        return sum(p.num_blocks for p in self.payloads)


@dataclass(slots=True)
class _Load:
    keys: list[bytes]
    deadline: float
    result: LoadResult | None = None


class OffloadTiers(Protocol):
    """What the scheduler and the engine ask of the tiers: :class:`KVOffload` here, the
    simulator's modelled tiers (:mod:`kvserve.sim.tiers`) on a virtual clock."""

    # Prefix-cache hits after which a block is stored before it is evicted (0: once
    # computed; None: only on eviction); the KV manager applies it.
    write_through_hits: int | None
    # Whether a preempted request loads its blocks from the tiers (preemption_mode swap)
    # or computes them again (recompute); the scheduler applies it.
    swap_preempted: bool
    load_timeout_s: float  # a load not landed by then is a miss (the request computes)

    @property
    def num_loading(self) -> int: ...

    def probe(self, hashes: Sequence[BlockHash]) -> int: ...

    def load_seconds(self, num_blocks: int) -> float | None:
        """Expected seconds to load ``num_blocks`` of the last probe's hit (None: not known
        yet); the scheduler weighs it against computing them."""
        ...

    def backlog_seconds(self) -> float:
        """Expected seconds before the worker starts a load asked now (the loads queued
        before it); with :meth:`load_seconds`, when the load would land."""
        ...

    def start_load(self, req_id: str, hashes: Sequence[BlockHash]) -> None: ...

    def cancel(self, req_id: str) -> None: ...

    def poll_loads(self, wait: bool = False) -> dict[str, LoadResult]: ...

    def store(self, hashes: Sequence[BlockHash], payload: Any) -> None: ...

    def wants(self, block_hash: BlockHash) -> bool: ...

    def stats(self) -> dict[str, dict[str, Any]]: ...

    def flush(self, timeout_s: float = 10.0) -> bool: ...

    def close(self) -> None: ...

    def enable_events(self, block_size: int) -> None: ...

    def take_events(self) -> list[KVCacheEvent]: ...


class KVOffload:
    """The tiers, their worker thread, and the counters; one per engine."""

    def __init__(
        self,
        tiers: Sequence[Tier],
        namespace: bytes,
        identity: dict[str, Any],
        load_timeout_s: float = 5.0,
        max_pending_bytes: int = 1 << 30,
        clock: Callable[[], float] = time.monotonic,
        pin_memory: bool = False,
        inline_host_loads: bool = False,
    ) -> None:
        if not tiers:
            raise ValueError("KVOffload: at least one tier")
        self.tiers = list(tiers)  # fastest first: loads try them in this order
        self.namespace = namespace
        self.identity = identity
        self._identity_json = _canonical(identity)
        self.load_timeout_s = load_timeout_s
        self.max_pending_bytes = max_pending_bytes
        self.clock = clock
        # A GPU pool: loaded payloads are copied into pinned memory here, on the worker, so
        # that importing them is an asynchronous copy, not a host copy on the step's path.
        self.pin_memory = pin_memory
        # A CPU engine whose compute threads take every core: a load that the host tier (the
        # first) holds is done on the engine thread when asked (see start_load).
        self.inline_host_loads = inline_host_loads and isinstance(self.tiers[0], HostTier)
        self.counters = {t.name: TierCounters() for t in self.tiers}
        self.write_through_hits: int | None = None  # see OffloadTiers
        self.swap_preempted = True
        self.dropped_stores = 0  # blocks not stored because the store backlog was full
        self._down_until = {t.name: 0.0 for t in self.tiers}
        self._backoff = {t.name: BACKOFF_START_S for t in self.tiers}
        # Keys this engine stored or loaded lately: an evicted block that is one of them is
        # already below, so it is not exported again.
        self._known: OrderedDict[bytes, None] = OrderedDict()
        self._lock = threading.Condition()
        self._stores: deque[tuple[list[bytes], BlockPayload]] = deque()
        self._pending_bytes = 0
        self._loads: dict[str, _Load] = {}
        # Loads in the order they were asked for. A request whose load was cancelled may ask
        # again under the same id before the worker is done with the first: a result goes to
        # the very load it was fetched for, never to its successor (other keys, other blocks).
        self._load_queue: deque[tuple[str, _Load]] = deque()
        self._closed = False
        self._probe_tier: Tier | None = None  # the tier that held the last probe's hit
        self._gauges: dict[str, tuple[int, int]] = {}
        self._gauges_at = float("-inf")
        self._events: list[KVCacheEvent] | None = None  # see enable_events
        self._event_block_size = 0
        self._thread = threading.Thread(target=self._work, name="kvserve-offload", daemon=True)
        self._thread.start()

    # -- KV events --------------------------------------------------------------------------
    def enable_events(self, block_size: int) -> None:
        """Record what each tier stores and evicts as KV events (kvserve.kv.events), medium
        CPU_TIER, DISK or REDIS, for :meth:`take_events`. Entries are known by hash only."""
        with self._lock:
            self._events, self._event_block_size = [], block_size
            for t in self.tiers:
                t.evicted_keys = []

    def take_events(self) -> list[KVCacheEvent]:
        with self._lock:
            events = self._events
            if not events:
                return []
            self._events = []
            return events

    def _record(self, tier: Tier, stored_key: bytes | None) -> None:
        """After a put or delete on ``tier``: its evictions, then the stored entry."""
        if self._events is None:
            return
        n = len(self.namespace)
        medium = TIER_MEDIUM.get(tier.name, tier.name.upper())
        with self._lock:
            events = self._events
            gone, tier.evicted_keys = tier.evicted_keys or [], []
            for key in gone:
                removed(events, key[n:], medium)
            if stored_key is None:
                return
            last = events[-1] if events else None
            if isinstance(last, BlockStored) and last.medium == medium and not last.token_ids:
                last.block_hashes.append(stored_key[n:])
            else:
                bs = self._event_block_size
                events.append(BlockStored([stored_key[n:]], None, [], bs, None, medium))

    # -- keys -------------------------------------------------------------------------------
    def key(self, block_hash: BlockHash) -> bytes:
        return self.namespace + block_hash

    def wants(self, block_hash: BlockHash) -> bool:
        """Whether an evicted block should be exported (it is not known to be below)."""
        return self.key(block_hash) not in self._known

    def _remember(self, key: bytes) -> None:
        with self._lock:
            self._known[key] = None
            self._known.move_to_end(key)
            while len(self._known) > 1 << 16:
                self._known.popitem(last=False)

    # -- the engine thread ------------------------------------------------------------------
    def probe(self, hashes: Sequence[BlockHash]) -> int:
        """How many leading ``hashes`` some tier holds (each tier asked once; a failing tier
        counts as holding none and is backed off)."""
        if not hashes:
            return 0
        keys = [self.key(h) for h in hashes]
        best = 0
        self._probe_tier = None
        for tier in self._enabled():
            try:
                n = tier.count_present(keys)
            except TierError as e:
                self._failed(tier, e.reason)
                continue
            if n > best:
                best, self._probe_tier = n, tier
            if best == len(keys):
                break
        return best

    def load_seconds(self, num_blocks: int) -> float | None:
        """From the probed tier's loads so far (fetch and verification, as the worker timed
        them): their mean seconds per block, once it has loaded ``RATE_MIN_HITS`` blocks."""
        tier = self._probe_tier
        if tier is None:
            return None
        c = self.counters[tier.name]
        if c.hits < RATE_MIN_HITS:
            return None
        return num_blocks * c.seconds_up / c.hits

    def backlog_seconds(self) -> float:
        """The blocks of the loads still to be fetched, at the tiers' mean measured seconds
        per block (0 until ``RATE_MIN_HITS`` blocks have been loaded: not known yet)."""
        hits = sum(c.hits for c in self.counters.values())
        if hits < RATE_MIN_HITS:
            return 0.0
        per_block = sum(c.seconds_up for c in self.counters.values()) / hits
        with self._lock:
            blocks = sum(len(load.keys) for load in self._loads.values() if load.result is None)
        return blocks * per_block

    def start_load(self, req_id: str, hashes: Sequence[BlockHash]) -> None:
        """Fetch the blocks of ``hashes`` for ``req_id`` on the worker thread (the result
        comes through :meth:`poll_loads`). With ``inline_host_loads``, a load the host tier
        holds whole is done here and now, from that tier alone: on a CPU engine whose compute
        threads take every core, the worker, which runs below them, gets the cores only while
        the engine waits, and its loads held their fresh pool blocks for many steps; a memory
        copy, a checksum and a decode are cheaper on the engine thread. (A request may start
        its load steps after its probe, when the pool has room: the host tier is asked again
        here.)"""
        load = _Load([self.key(h) for h in hashes], self.clock() + self.load_timeout_s)
        if self.inline_host_loads and self._host_holds(load.keys):
            try:
                load.result = LoadResult(
                    BlockPayload.concat(self._load(load.keys, [self.tiers[0]]))
                )
            except Exception as e:  # noqa: BLE001 - a bad entry is a miss, never a crash
                self.counters[self.tiers[0].name].fail(f"internal:{type(e).__name__}")
                load.result = LoadResult([])
            with self._lock:
                self._loads[req_id] = load
            return
        with self._lock:
            self._loads[req_id] = load
            self._load_queue.append((req_id, load))
            self._lock.notify_all()

    def _host_holds(self, keys: list[bytes]) -> bool:
        host = self.tiers[0]
        if self.clock() < self._down_until[host.name]:
            return False
        try:
            return host.count_present(keys) == len(keys)
        except TierError:  # not a host tier's failure mode; the worker path handles it
            return False

    def cancel(self, req_id: str) -> None:
        with self._lock:
            self._loads.pop(req_id, None)

    @property
    def num_loading(self) -> int:
        return len(self._loads)

    def poll_loads(self, wait: bool = False) -> dict[str, LoadResult]:
        """Loads that finished, and those past their deadline (as empty results: the request
        recomputes). With ``wait`` (the engine has nothing else to do), wait for one at most
        ``POLL_WAIT_S``: the caller comes back, so new requests and aborts are not held up."""
        until = self.clock() + POLL_WAIT_S
        with self._lock:
            while True:
                now = self.clock()
                done: dict[str, LoadResult] = {}
                for rid, load in list(self._loads.items()):
                    if load.result is not None:
                        done[rid] = load.result
                    elif now >= load.deadline:
                        done[rid] = LoadResult([])
                        self.counters[self.tiers[0].name].fail("load_timeout")
                    else:
                        continue
                    del self._loads[rid]
                if done or not wait or not self._loads or now >= until:
                    return done
                due = min(min(load.deadline for load in self._loads.values()), until)
                self._lock.wait(timeout=max(due - now, 0.0005))

    def store(self, hashes: Sequence[BlockHash], payload: BlockPayload) -> None:
        """Queue the blocks of an export (one payload, blocks in ``hashes`` order) for every
        tier. Never blocks: beyond ``max_pending_bytes`` of backlog, blocks are dropped (and
        counted); a dropped block is only a future miss."""
        nbytes = sum(t.nbytes for t in payload.tensors.values())
        with self._lock:
            if self._pending_bytes + nbytes > self.max_pending_bytes:
                self.dropped_stores += len(hashes)
                self.counters[self.tiers[0].name].fail("store_backlog")
                return
            self._stores.append(([self.key(h) for h in hashes], payload))
            self._pending_bytes += nbytes
            self._lock.notify_all()

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every queued store is written (tests, shutdown); False on timeout. The
        next :meth:`stats` reads fresh gauges."""
        self._gauges_at = float("-inf")
        end = time.monotonic() + timeout_s
        with self._lock:
            while self._stores or self._pending_bytes:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._lock.wait(timeout=left)
        return True

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        self._thread.join(timeout=5.0)
        for tier in self.tiers:
            try:
                tier.close()
            except Exception:  # noqa: BLE001 - closing a dead backend is no error
                pass

    def stats(self) -> dict[str, dict[str, Any]]:
        """Per tier: counters, entries, bytes held and capacity, evictions, and whether it is
        backed off now."""
        now = self.clock()
        if now - self._gauges_at >= GAUGE_REFRESH_S:  # a remote tier's gauges cost a round trip
            self._gauges_at = now
            for tier in self._enabled():
                try:
                    self._gauges[tier.name] = (tier.num_entries, tier.used_bytes)
                except TierError as e:
                    self._failed(tier, e.reason)
        out: dict[str, dict[str, Any]] = {}
        for tier in self.tiers:
            c = self.counters[tier.name]
            entries, used = self._gauges.get(tier.name, (0, 0))
            out[tier.name] = dict(
                queries=c.queries, hits=c.hits, stored=c.stored,
                bytes_down=c.bytes_down, seconds_down=c.seconds_down,
                bytes_up=c.bytes_up, seconds_up=c.seconds_up,
                failures=dict(c.failures), entries=entries, used_bytes=used,
                capacity_bytes=tier.capacity_bytes, evictions=tier.num_evictions,
                backed_off=now < self._down_until[tier.name],
            )  # fmt: skip
        return out

    # -- back-off ---------------------------------------------------------------------------
    def _enabled(self) -> list[Tier]:
        now = self.clock()
        return [t for t in self.tiers if now >= self._down_until[t.name]]

    def _failed(self, tier: Tier, reason: str) -> None:
        """Count the failure and skip the tier for a while. What this engine knew to be
        stored may be gone (a restarted Redis keeps nothing): forget it."""
        self.counters[tier.name].fail(reason)
        with self._lock:
            self._known.clear()
        wait = self._backoff[tier.name]
        self._down_until[tier.name] = self.clock() + wait
        self._backoff[tier.name] = min(wait * 2, BACKOFF_MAX_S)

    def _ok(self, tier: Tier) -> None:
        self._backoff[tier.name] = BACKOFF_START_S

    # -- the worker thread ------------------------------------------------------------------
    def _work(self) -> None:
        # Torch work here (joining loaded blocks, selecting a store's) runs on this thread
        # alone: a worker pool of its own would throttle the engine's (kernels/openmp.py).
        serial_thread()
        # Below the engine's compute threads: on a machine with as many cores as those
        # threads, an equal-priority worker would stall every step's parallel regions.
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WORKER_NICE)
        except (AttributeError, OSError):
            pass
        while True:
            with self._lock:
                while not (self._closed or self._load_queue or self._stores):
                    self._lock.wait()
                if self._closed:
                    return
                job: tuple[str, Any]
                if self._load_queue:  # loads first: a request waits on them
                    rid, load = self._load_queue.popleft()
                    if self._loads.get(rid) is not load:
                        continue  # cancelled (perhaps asked again: that one is queued too)
                    job = ("load", (rid, load))
                else:
                    job = ("store", self._stores.popleft())
            try:
                if job[0] == "load":
                    rid, load = job[1]
                    result = LoadResult(BlockPayload.concat(self._load(load.keys)))
                    with self._lock:
                        if self._loads.get(rid) is load:
                            load.result = result
                        self._lock.notify_all()
                else:
                    keys, payload = job[1]
                    self._store(keys, payload)
            except Exception as e:  # noqa: BLE001 - the worker never dies of one bad entry
                self.counters[self.tiers[0].name].fail(f"internal:{type(e).__name__}")
            finally:
                if job[0] == "store":
                    with self._lock:
                        nbytes = sum(t.nbytes for t in job[1][1].tensors.values())
                        self._pending_bytes = max(self._pending_bytes - nbytes, 0)
                        self._lock.notify_all()

    def _store(self, keys: list[bytes], payload: BlockPayload) -> None:
        for i, key in enumerate(keys):
            data = None
            block = payload.select([i]) if len(keys) > 1 else payload
            for tier in self._enabled():
                data = data if data is not None else encode_entry(key, block)
                t0 = time.perf_counter()
                try:
                    stored = tier.put(key, data)
                except TierError as e:
                    self._failed(tier, e.reason)
                    continue
                self._ok(tier)
                self._remember(key)
                self._record(tier, key if stored else None)
                if stored:
                    c = self.counters[tier.name]
                    c.stored += 1
                    c.bytes_down += len(data)
                    c.seconds_down += time.perf_counter() - t0

    def _load(self, keys: list[bytes], tiers: list[Tier] | None = None) -> list[BlockPayload]:
        """Fetch ``keys`` in chain order from the fastest tier that has each one intact; stop
        at the first block no tier can give. A tier is asked for the rest of a batch at once
        (one Redis round trip), and only from the first block the faster tiers lacked. A
        block from a slower tier is also put in the faster ones (it is likely asked again).
        ``tiers``: only those (an inline load's host tier, checked not backed off), instead
        of every tier not backed off."""
        out: list[BlockPayload] = []
        for start in range(0, len(keys), LOAD_BATCH):
            batch = keys[start : start + LOAD_BATCH]
            fetched: dict[str, tuple[int, list[bytes | None]]] = {}
            for j, key in enumerate(batch):
                payload = self._load_one(key, j, batch, fetched, tiers)
                if payload is None:
                    return out
                self._remember(key)
                out.append(payload)
        return out

    def _load_one(
        self,
        key: bytes,
        j: int,
        batch: list[bytes],
        fetched: dict[str, tuple[int, list[bytes | None]]],
        tiers: list[Tier] | None = None,
    ) -> BlockPayload | None:
        missed_in: list[Tier] = []
        for tier in self._enabled() if tiers is None else tiers:
            c = self.counters[tier.name]
            c.queries += 1
            t0 = time.perf_counter()
            if tier.name not in fetched:
                try:
                    fetched[tier.name] = (j, tier.get_many(batch[j:]))
                except TierError as e:
                    self._failed(tier, e.reason)
                    continue
                self._ok(tier)
            first, datas = fetched[tier.name]
            data = datas[j - first]
            if data is None:
                c.fail("missing")
                missed_in.append(tier)
                continue
            try:
                payload = decode_entry(key, data, copy=False)  # joined or imported: a copy
                if _canonical(payload.identity) != self._identity_json:
                    raise EntryError("format", "the entry was stored by another format")
                payload.identity = self.identity  # JSON turned its tuples into lists
                if self.pin_memory:
                    try:
                        payload = payload.pinned()
                    except RuntimeError:  # no pinned memory to be had: a pageable copy will do
                        log.warning("kv offload: pinning a loaded entry failed", exc_info=True)
            except EntryError as e:
                c.fail(e.reason)
                self._drop(tier, key)
                missed_in.append(tier)
                continue
            c.hits += 1
            c.bytes_up += len(data)
            c.seconds_up += time.perf_counter() - t0
            for faster in missed_in:
                try:
                    stored = faster.put(key, bytes(data))
                except TierError as e:
                    self._failed(faster, e.reason)
                else:
                    self._record(faster, key if stored else None)
            return payload
        return None

    def _drop(self, tier: Tier, key: bytes) -> None:
        try:
            tier.delete(key)
        except TierError as e:
            self._failed(tier, e.reason)
        else:
            if tier.evicted_keys is not None:
                tier.evicted_keys.append(key)  # a corrupt entry dropped: gone as an eviction
            self._record(tier, None)
