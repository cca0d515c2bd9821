"""Disaggregated prefill and decode on the simulator: prefill replicas and decode replicas on
one virtual timeline, as ``kvserve proxy`` drives a prefill engine and a decode engine.

Each request is sent to a prefill replica with ``max_tokens`` 1 (the proxy's first leg); its
first token comes out of that engine's real scheduler over the cost model. At that moment it
is handed to a decode replica, whose scheduler asks :class:`SimTransferConnector` (the
scheduler side of a connector, as the engine runs :class:`~kvserve.disagg.connector.
KVServeConnector`'s) for the prompt's blocks: those its own prefix cache lacks are pulled over
a modelled link at ``kv_transfer_bandwidth`` bytes/s in the pool's own format (one pull at a
time per decode replica, in the order asked), land at the start of the first step after they
arrived, and the request goes on decoding from the prefill's first token. So the decode
replica computes no prompt token, its steps hold decode work only, and its prefix cache holds
the landed blocks for the requests after. TTFT is prefill queue + prefill + transfer (+ the
decode step under way when the blocks arrive); ITL comes from the decode replicas' steps,
the step that imports landed blocks into the pool longer by the copy (the profile's
``offload_export_s_per_byte``: the same copy as an export, the other way) and, for blocks
the pool never wrote before, by their page faults (``first_touch_s_per_byte``). The bandwidth is
the decode side's measured pull rate, which includes the prefill side's export.

The HTTP front ends and the proxy's hop are the profile's serving terms, charged by the
replay on each engine's clock (:mod:`kvserve.sim.serving`; every engine here is behind the
proxy). Not modelled: the prefill side's lease (its blocks are freed when its first token is
out, not when the decode side has read them) and the control messages.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from kvserve.bench.metrics import RequestRecord
from kvserve.bench.workloads import BenchRequest
from kvserve.connectors.base import KVConnector, Role
from kvserve.sim.fleet import IDLE, replay_in_time

CONNECTOR = "SimTransferConnector"


class SimTransferConnector(KVConnector):
    """The decode side's pulls, modelled on the engine's virtual clock (set by the
    simulator after the engine is built, with the link's bandwidth and a block's bytes)."""

    loads_finish_on_workers = False  # the link is modelled here, not in a worker

    def __init__(self, role: Role, config: Any) -> None:
        super().__init__(role)
        self.block_size = config.cache.block_size
        self.clock: Any = None
        self.bandwidth = math.inf  # bytes/s
        self.block_bytes = 0.0
        # The import into the pool, on the engine's thread as the blocks land (the real
        # connector's worker does it between steps): seconds per byte.
        self.import_s_per_byte = 0.0
        # A CPU pool's pages are faulted in on first write (KVStorage.prefault): an import
        # into blocks never written before pays that too. The runner's set of written blocks
        # (None: the pool was faulted in at start) and the profile's cost per byte.
        self.touched: set[int] | None = None
        self.first_touch_s_per_byte = 0.0
        self.link_free_at = 0.0
        self._remote: dict[str, tuple[int, float]] = {}  # rid -> (first token, prefilled at)
        self._asked: set[str] = set()
        self._loads: list[tuple[float, str, list[int]]] = []  # (arrives at, rid, block ids)
        self._cancelled: set[str] = set()
        self._inject: dict[str, int] = {}
        self.counters = {"transfers": 0, "blocks": 0, "bytes": 0.0, "seconds": 0.0}

    def expect(self, rid: str, first_token: int, prefilled_at: float) -> None:
        """``rid`` was prefilled on a peer whose first token came out at ``prefilled_at``
        (this engine's clock)."""
        self._remote[rid] = (first_token, prefilled_at)

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        rid = request.request_id
        if rid not in self._remote or rid in self._asked:
            return 0, False
        self._asked.add(rid)
        end = request.num_prompt_tokens  # the whole prompt: the peer's first token follows
        if num_computed_tokens >= end:
            return 0, False
        return end - num_computed_tokens, True

    def update_state_after_alloc(
        self, request: Any, block_ids: list[int], num_external_tokens: int
    ) -> None:
        rid = request.request_id
        first, ready = self._remote[rid]
        n = len(block_ids)
        nbytes = n * self.block_bytes
        start = max(self.clock.now, self.link_free_at, ready)
        seconds = nbytes / self.bandwidth
        self.link_free_at = start + seconds
        heapq.heappush(self._loads, (start + seconds, rid, list(block_ids)))
        self._inject[rid] = first
        c = self.counters
        c["transfers"] += 1
        c["blocks"] += n
        c["bytes"] += nbytes
        c["seconds"] += seconds

    def take_finished_loads(self, wait: bool = False) -> dict[str, int]:
        loads = self._loads
        while loads and loads[0][1] in self._cancelled:
            self._cancelled.discard(heapq.heappop(loads)[1])
        if wait and loads and loads[0][0] > self.clock.now:
            # Nothing else can run: the engine waits for the next arrival, which lands in
            # the next step (whose schedule reads the clock after the wait).
            self.clock.now = loads[0][0]
            return {}
        out: dict[str, int] = {}
        fresh = 0
        while loads and loads[0][0] <= self.clock.now:
            _, rid, ids = heapq.heappop(loads)
            if rid in self._cancelled:
                self._cancelled.discard(rid)
                continue
            out[rid] = len(ids)
            if self.touched is not None:
                fresh += sum(1 for b in ids if b not in self.touched)
                self.touched.update(ids)
        if out:
            copy = sum(out.values()) * self.block_bytes * self.import_s_per_byte
            self.clock.advance(copy + fresh * self.block_bytes * self.first_touch_s_per_byte)
        return out

    def cancel_load(self, request: Any) -> None:
        rid = request.request_id
        if any(r == rid for _, r, _ in self._loads):
            self._cancelled.add(rid)
        self._inject.pop(rid, None)

    def load_is_cache_hit(self, request: Any) -> bool:
        return False  # reported as transferred, as the real connector's

    def landed_output_tokens(self, request: Any) -> list[int]:
        t = self._inject.pop(request.request_id, None)
        return [] if t is None else [t]

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict | None]:
        rid = request.request_id
        self._remote.pop(rid, None)
        self._asked.discard(rid)
        self._inject.pop(rid, None)
        return False, None

    def stats(self) -> dict[str, Any]:
        return {"kv_transfer": dict(self.counters)}


def transfer_config() -> dict[str, Any]:
    """The decode replicas' ``kv_transfer_config``: this module's connector."""
    return {"kv_connector": CONNECTOR, "kv_connector_module_path": __name__,
            "kv_role": "kv_consumer"}  # fmt: skip


def check_roles(target: Any) -> None:
    """A :class:`~kvserve.sim.engine.SimTarget`'s disaggregation settings, refused with
    a message naming the flag."""
    p, d = target.prefill_replicas, target.decode_replicas
    for name, v in (("prefill_replicas", p), ("decode_replicas", d)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"{name}: must be an integer >= 1, got {v!r}")
    if p == 0 and d == 0:
        if target.kv_transfer_bandwidth is not None:
            raise ValueError(
                "kv_transfer_bandwidth: models the disaggregated deployment's pulls; give "
                "--prefill-replicas and --decode-replicas with it"
            )
        return
    for name, v in (("prefill_replicas", p), ("decode_replicas", d)):
        if v == 0:
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"{name}: a disaggregated deployment needs >= 1 replica of each "
                             f"role; give {flag} too")  # fmt: skip
    if target.replicas != 1:
        raise ValueError("replicas: counts colocated engines; with --prefill-replicas and "
                         "--decode-replicas leave it out")  # fmt: skip
    if target.router != "round_robin":
        raise ValueError("router: the disaggregated deployment sends each request to the "
                         "least-loaded replica of each role (kvserve proxy's least_loaded); "
                         "leave --router out")  # fmt: skip
    kw = target.engine_kwargs
    if kw.get("kv_transfer_config"):
        raise ValueError(
            "kv_transfer_config: the simulator sets the replicas' connector itself with "
            "--prefill-replicas/--decode-replicas; leave it out"
        )
    offload = [k for k in ("kv_offload_cpu", "kv_offload_disk", "kv_offload_redis") if kw.get(k)]
    if offload:
        raise ValueError(f"{offload[0]}: offload tiers are not modelled with "
                         "--prefill-replicas/--decode-replicas")  # fmt: skip
    check_bandwidth(target.kv_transfer_bandwidth)


def check_bandwidth(value: Any) -> float:
    if value is None:
        raise ValueError(
            "kv_transfer_bandwidth: give --kv-transfer-bandwidth BYTES_PER_S (the decode "
            "side's measured pull rate, e.g. benchmarks/pd.py's transfer_gbps x 1e9) with "
            "--prefill-replicas/--decode-replicas"
        )
    bw = float(value)
    if not bw > 0 or math.isinf(bw):
        raise ValueError(
            f"kv_transfer_bandwidth: must be a finite number > 0 (bytes/s), got {value!r}"
        )
    return bw


class Feed(Protocol):
    """Who sends what when: ``start`` the first sends, ``done`` those a finished request
    sets off (a closed loop's next request). Times are seconds on the fleet's timeline."""

    def start(self) -> list[tuple[float, BenchRequest, list[int] | None]]: ...

    def done(
        self, req: BenchRequest, rec: RequestRecord, now: float
    ) -> list[tuple[float, BenchRequest, list[int] | None]]: ...


@dataclass(slots=True)
class TraceFeed:
    """A bench trace: open loop at ``sends`` offsets, or (None) a closed loop of
    ``concurrency`` users."""

    requests: Sequence[BenchRequest]
    sends: list[float] | None
    concurrency: int | None
    _next: int = 0

    def start(self) -> list[tuple[float, BenchRequest, list[int] | None]]:
        if self.sends is not None:
            return [(t, self.requests[i], None) for i, t in enumerate(self.sends)]
        self._next = min(self.concurrency or 1, len(self.requests))
        return [(0.0, self.requests[i], None) for i in range(self._next)]

    def done(self, req: BenchRequest, rec: RequestRecord,
             now: float) -> list[tuple[float, BenchRequest, list[int] | None]]:  # fmt: skip
        if self.sends is not None or self._next >= len(self.requests):
            return []
        self._next += 1
        return [(now, self.requests[self._next - 1], None)]


@dataclass(slots=True)
class _Leg:
    """One replica of the deployment and what is routed to it."""

    share: Any  # kvserve.sim.simulate._Share
    idle: bool = False
    load: int = 0
    origin: dict[int, int] = field(default_factory=dict)  # share index -> request number
    prefilled: dict[int, float] = field(default_factory=dict)  # share index -> first token

    def elapsed(self) -> float:
        return self.share.sim.clock.now - self.share.t0


def run_pd(
    prefill: list[Any],
    decode: list[Any],
    feed: Feed,
) -> list[RequestRecord]:
    """Replay ``feed`` on ``prefill`` and ``decode`` replicas (``_Share`` objects, routed,
    from ``kvserve.sim.simulate``); with no ``prefill`` replicas, the ``decode`` ones are
    colocated engines that do both. Requests go to the replica with the fewest in flight
    (the first such: round-robin among idle ones). Returns one record per request sent, in
    send order, with times on the timeline (the send time first)."""
    pre = [_Leg(sh) for sh in prefill]
    dec = [_Leg(sh) for sh in decode]
    legs = pre + dec
    records: list[RequestRecord] = []
    sent: list[tuple[BenchRequest, list[int] | None, float]] = []
    pending: list[tuple[float, int]] = []
    ids_of: dict[int, list[int]] = {}

    def queue(items: list[tuple[float, BenchRequest, list[int] | None]]) -> None:
        for t, req, ids in items:
            sent.append((req, ids, t))
            heapq.heappush(pending, (t, len(sent) - 1))

    def pick(group: list[_Leg]) -> _Leg:
        return min(group, key=lambda g: g.load)

    def push(leg: _Leg, n: int, req: BenchRequest, ids: list[int], when: float) -> int:
        sh = leg.share
        i = len(sh.share)
        leg.origin[i] = n
        sh.mine.append(n)
        leg.load += 1
        clock = sh.sim.clock
        if leg.idle:
            clock.now = max(clock.now, sh.t0 + when)
            leg.idle = False
        sh.rep.push(sh.share, req, ids, sh.t0 + when)
        return i

    def send(t: float, n: int) -> None:
        req, ids, _ = sent[n]
        leg = pick(pre or dec)
        if ids is None:
            ids = leg.share.sim.encode(req.prompt)
        if pre:
            ids_of[n] = ids  # for the decode leg
            push(leg, n, replace(req, max_tokens=1), ids, t)
        else:
            push(leg, n, req, ids, t)

    def final(n: int, rec: RequestRecord, send_t: float, now: float) -> None:
        rec.send_time = send_t
        while len(records) <= n:
            records.append(None)  # type: ignore[arg-type]
        records[n] = rec
        queue(feed.done(sent[n][0], rec, now))

    def prefilled(leg: _Leg) -> Callable[[int], None]:
        def hook(i: int) -> None:
            leg.load -= 1
            n = leg.origin.pop(i)
            req, _, send_t = sent[n]
            sh = leg.share
            rec = sh.rep.records[i]
            ids = ids_of.pop(n)
            if not rec.success or req.max_tokens <= 1:  # its answer is the prefill's
                rel = _relative(rec, sh.t0)
                rel.max_tokens = req.max_tokens
                final(n, rel, send_t, leg.elapsed())
                return
            done = rec.send_time + rec.ttft - sh.t0  # its first token, on the timeline
            d = pick(dec)
            d.prefilled[len(d.share.share)] = done
            push(d, n, req, ids, done)

        return hook

    def expect(leg: _Leg) -> Callable[[str, int], None]:
        sim = leg.share.sim
        conn = sim.engine.connector

        def hook(rid: str, i: int) -> None:
            conn.expect(rid, sim.runner.token_id, leg.share.t0 + leg.prefilled.pop(i))

        return hook

    def decoded(leg: _Leg) -> Callable[[int], None]:
        def hook(i: int) -> None:
            leg.load -= 1
            n = leg.origin.pop(i)
            rec = leg.share.rep.records[i]
            send_t = sent[n][2]
            rel = _relative(rec, leg.share.t0)
            if rel.success:
                times = _token_times(rel)
                rel.send_time = send_t
                rel.succeed(times)
            final(n, rel, send_t, leg.elapsed())

        return hook

    for leg in pre:
        _open(leg.share, prefilled(leg))
    for leg in dec:
        _open(leg.share, decoded(leg))
        if pre:
            leg.share.rep.on_send = expect(leg)
    queue(feed.start())

    def step(g: _Leg) -> None:
        if next(g.share.steps) is IDLE:
            g.idle = True

    replay_in_time(pending, lambda: [g for g in legs if not g.idle], _Leg.elapsed, send, step)
    for g in legs:
        g.share.rep.open = False
        for _ in g.share.steps:
            pass
    return [r for r in records if r is not None]


def _open(sh: Any, hook: Callable[[int], None]) -> None:
    sh.rep.open = True
    sh.rep.on_finish = hook
    next(sh.steps)  # primed: pushes land in the replay it runs


def _token_times(rec: RequestRecord) -> list[float]:
    """A successful record's token times (absolute), from its send time, TTFT and gaps."""
    t = [rec.send_time + rec.ttft]  # type: ignore[operator]
    for gap in rec.itl:
        t.append(t[-1] + gap)
    return t


def _relative(rec: RequestRecord, t0: float) -> RequestRecord:
    out = replace(rec)
    out.send_time = rec.send_time - t0
    return out
