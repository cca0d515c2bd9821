"""One simulated replica's replay of its share of a load.

The load is replayed as ``kvserve bench`` applies it to the in-process engine: open loop at
the bench's seeded arrival times (with an optional in-flight cap), or a closed loop of N
users; requests are accepted between steps. A router (:mod:`kvserve.sim.fleet`) or the
disaggregated replay (:mod:`kvserve.sim.pd`) may instead feed a replica as it runs.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from kvserve.bench.metrics import RequestRecord
from kvserve.bench.report import RecordEncoder
from kvserve.bench.workloads import BenchRequest
from kvserve.engine import LLMEngine
from kvserve.sched.request import FINISHED_STATUSES, SamplingParams
from kvserve.sim.engine import SimEngine
from kvserve.sim.fleet import IDLE
from kvserve.sim.workload import EncodedWorkload


class Replica:
    """Replays a share of the load on one simulated engine."""

    def __init__(
        self,
        sim: SimEngine,
        temperature: float,
        sample_every: float,
        on_done: Callable[[bool], None] | None = None,
    ) -> None:
        self.sim = sim
        self.on_done = on_done
        self.sink: RecordEncoder | None = None  # hears each final record (with t0)
        self._t0 = 0.0
        self.temperature = temperature
        self.sample_every = sample_every
        self.samples: list[dict[str, float]] = []
        self._next_sample = 0.0
        self._params: dict[int, SamplingParams] = {}  # by max_tokens
        self._sent = 0
        self.records: list[RequestRecord] = []
        # Fed by a router (kvserve.sim.fleet): more requests may come while ``open``; each
        # final record is reported to ``on_finish`` (its index in the share); prompts come
        # already tokenized (``routed_ids``, by index).
        self.open = False
        self.on_finish: Callable[[int], None] | None = None
        self.routed_ids: dict[int, list[int]] = {}
        self._sent_at: dict[int, float] = {}  # by index: sent before it reached this replica
        self.on_send: Callable[[str, int], None] | None = None  # (engine's id, share index)
        self._due: list[tuple[float, int]] = []
        # The HTTP front end (the profile's serving request terms): one event loop, so the
        # requests sent to it pass through it one at a time, each joining the engine when
        # the front end is done with it: (ready at, send order, engine id, index, ids).
        self._front: list[tuple[float, int, str, int, list[int] | None]] = []
        self._front_free = -math.inf

    def _add(
        self,
        rid: str,
        req: BenchRequest,
        rec: RequestRecord,
        ids: list[int] | None = None,
        serving: float = 0.0,
    ) -> bool:
        """Hand ``req`` to the engine (``ids``: its prompt already tokenized); ``serving``:
        the front end's seconds for it that the engine's steps lost."""
        eng, clock = self.sim.engine, self.sim.clock
        if ids is None:
            ids = self.sim.encode(req.prompt)
        params = self._params.get(req.max_tokens)
        if params is None:  # requests share them (the engine never changes a request's)
            params = self._params[req.max_tokens] = SamplingParams(
                temperature=self.temperature, max_tokens=req.max_tokens, ignore_eos=True
            )
        runner = self.sim.runner
        if runner.fresh:
            serving += runner.profile.serve_first_request_s
            runner.fresh = False
        clock.advance(runner.profile.request_time(len(ids)) + serving)
        try:
            eng.add_request(rid, {"prompt_token_ids": ids}, params, arrival_time=rec.send_time)
        except Exception as e:  # noqa: BLE001 - refused requests are counted, as bench does
            rec.fail(f"refused ({type(e).__name__})", str(e))
            return False
        return True

    def run(
        self,
        requests: Sequence[BenchRequest],
        sends: list[float] | None,
        concurrency: int | None,
        t0: float,
    ) -> list[RequestRecord]:
        """Send ``requests`` at ``t0 + sends[i]`` (open loop; None: closed loop of
        ``concurrency`` users), at most ``concurrency`` in flight; step until all finish."""
        for _ in self.steps(requests, sends, concurrency, t0):
            pass
        return self.records

    def steps(
        self,
        requests: Sequence[BenchRequest],
        sends: list[float] | None,
        concurrency: int | None,
        t0: float,
    ) -> Iterator[None]:
        """:meth:`run` one iteration at a time (a step, or the clock moved to an arrival):
        it yields before each, so a fleet whose replicas share a tier can always advance the
        replica furthest behind in time. The records are in ``self.records``."""
        eng, clock, offload = self.sim.engine, self.sim.clock, self.sim.offload
        core = eng.core
        runner = self.sim.runner
        loop_gap = runner.profile.loop_gap_s  # the serving loop's time between steps
        self._t0 = t0
        # Each record is made when its request is sent (a streamed workload's requests
        # arrive while the replay runs); every request is sent before this ends.
        self.records = records = [None] * len(requests)  # type: ignore[list-item]
        due: list[tuple[float, int]] = []  # (send time, index) not yet sent
        if sends is None:
            due = [(t0, i) for i in range(min(concurrency or 1, len(requests)))]
            queued = list(range(len(due), len(requests)))[::-1]  # closed loop: next users
        else:
            due = [(t0 + s, i) for i, s in enumerate(sends)]
            queued = []
        heapq.heapify(due)
        self._due = due
        cap = concurrency if concurrency else math.inf
        inflight: dict[str, int] = {}
        backlog: list[int] = []  # arrived, waiting for an in-flight slot
        idle_steps = 0

        def send(i: int, when: float) -> None:
            if not self._send(i, when, requests, records, inflight) and sends is None and queued:
                heapq.heappush(due, (when, queued.pop()))  # refused: the user sends the next

        front = self._front

        def next_arrival() -> float:
            return min(due[0][0] if due else math.inf, front[0][0] if front else math.inf)

        while due or backlog or inflight or front or self.open:
            yield
            while backlog and len(inflight) < cap:  # a slot freed at the last step's end
                send(backlog.pop(0), clock.now)
            while due and due[0][0] <= clock.now:
                # Sent at its time, while the engine was busy: it waits for the step to end,
                # as the bench's request waits in the engine thread's inbox.
                when, i = heapq.heappop(due)
                if len(inflight) < cap:
                    send(i, when)
                else:
                    backlog.append(i)
            while front and front[0][0] <= clock.now:
                # Through the front end: the engine's steps lost its time if any ran.
                _, _, rid, i, ids = heapq.heappop(front)
                busy = core.has_unfinished_requests()
                share = self.sim.runner.profile.serve_request_share
                charge = share * self._serving_cost(requests[i], ids) if busy else 0.0
                if not self._add(rid, requests[i], records[i], ids, charge):
                    inflight.pop(rid, None)
                    self._done(i, records[i])
                    if sends is None and queued:
                        heapq.heappush(due, (clock.now, queued.pop()))
            if not core.has_unfinished_requests():
                # Every finish comes back from a step; a family gone without one is a bug
                # elsewhere, recorded rather than waited for (checked only when idle).
                waiting = {rid for _, _, rid, _, _ in front}
                for fam in [f for f in inflight if f not in waiting]:
                    i = inflight.pop(fam)
                    records[i].fail("lost", "the engine dropped the request without a result")
                    self._done(i, records[i])
                    if sends is None and queued:
                        heapq.heappush(due, (clock.now, queued.pop()))
                if due or front:
                    clock.now = max(clock.now, next_arrival())
                    continue
                if not backlog:
                    if self.open:
                        yield IDLE  # nothing to do until the router sends more
                        continue
                    break
            before = core.num_steps
            ran = runner.steps
            updated = core.step()
            if runner.steps > ran:
                # The front end streams the step's tokens (and the hop relays them) on the
                # engine's cores before its next step: stamped tokens stay as they were.
                clock.advance(runner.profile.serving_step_time(runner.sampled, runner.hop))
            self._sample(eng)
            if core.num_steps == before and not updated:
                idle_steps += 1
                if idle_steps > 1000:
                    raise RuntimeError(
                        "simulator: the scheduler made no progress for 1000 steps with "
                        f"{len(inflight)} requests in flight"
                    )
                # Idle until the next arrival, unless a tier load lands first: the engine
                # waited for it (a little at a time) in the step, so the clock moved.
                if (due or front) and not (offload is not None and offload.num_loading):
                    clock.now = max(clock.now, next_arrival())
                continue
            idle_steps = 0
            if loop_gap and core.has_unfinished_requests():
                clock.advance(loop_gap)  # before the next step of a busy engine
            for r in updated:
                if r.status not in FINISHED_STATUSES:
                    continue
                fam = r.parent_id
                if fam not in inflight or core.families.get(fam):
                    continue
                i = inflight.pop(fam)
                _fill(records[i], r)
                self._done(i, records[i])
                if sends is None and queued:  # the user sends its next request now
                    heapq.heappush(due, (clock.now, queued.pop()))

    def push(self, share: list[BenchRequest], req: BenchRequest, ids: list[int],
             when: float, arrive: float | None = None) -> None:  # fmt: skip
        """A router's request for this replica, sent at ``when`` and reaching it at
        ``arrive`` (the router's time in between; None: at once). It joins ``share``, the
        list :meth:`steps` replays."""
        i = len(share)
        share.append(req)
        self.records.append(None)  # type: ignore[arg-type]
        self.routed_ids[i] = ids
        if arrive is not None and arrive > when:
            self._sent_at[i] = when
            when = arrive
        heapq.heappush(self._due, (when, i))

    def _done(self, i: int, rec: RequestRecord) -> None:
        """Record ``i`` is final (its send time still on the replay's clock)."""
        if self.sink is not None:
            self.sink.add(i, rec, self._t0)
        if self.on_done is not None:
            self.on_done(rec.success)
        if self.on_finish is not None:
            self.on_finish(i)

    def _send(
        self,
        i: int,
        when: float,
        requests: Sequence[BenchRequest],
        records: list[RequestRecord],
        inflight: dict[str, int],
    ) -> bool:
        """Send request ``i``; False when the engine refused it at once (counted as done)."""
        r = requests[i]
        records[i] = rec = RequestRecord(r.index, r.kind, r.prefix_group, r.input_len,
                                         r.max_tokens)  # fmt: skip
        rec.send_time = self._sent_at.pop(i, when)
        self._sent += 1
        rid = f"sim-{self._sent}"
        if self.on_send is not None:
            self.on_send(rid, i)
        ids = self.routed_ids.pop(i, None)
        if ids is None and isinstance(requests, EncodedWorkload):
            ids = requests.token_ids(i)
        cost = self._serving_cost(r, ids)
        if cost:  # through the front end first, one request at a time
            ready = max(when, self._front_free) + cost
            self._front_free = ready
            heapq.heappush(self._front, (ready, self._sent, rid, i, ids))
            inflight[rid] = i
            return True
        if self._add(rid, r, rec, ids):
            inflight[rid] = i
            return True
        self._done(i, rec)
        return False

    def _serving_cost(self, req: BenchRequest, ids: list[int] | None) -> float:
        runner = self.sim.runner
        tokens = len(ids) if ids is not None else req.input_len
        return runner.profile.serving_request_time(runner.hop, tokens)

    def sample_from(self, t: float) -> None:
        """Take the first sample at ``t`` (the replay's start, after the warm-up)."""
        self._next_sample = t

    def _sample(self, eng: LLMEngine) -> None:
        if self.sim.clock.now >= self._next_sample:
            from kvserve.bench.engine_target import engine_snapshot

            self.samples.append(engine_snapshot(eng))
            self._next_sample = self.sim.clock.now + self.sample_every


def _fill(rec: RequestRecord, r: Any) -> None:
    """A finished request's record from the engine's own timestamps (virtual seconds)."""
    m = r.metrics
    rec.prompt_tokens = len(r.prompt_token_ids)
    rec.output_tokens = r.num_output_tokens
    rec.cached_tokens = max(0, r.num_cached_tokens)
    rec.finish_reason = r.status.value
    rec.workload_class = r.workload_class.name if r.workload_class is not None else None
    if m.first_scheduled_time is not None:
        rec.queue_time = m.first_scheduled_time - m.arrival_time
    if r.refusal is not None:
        rec.fail(f"refused ({r.refusal.reason})", "admission control refused it")
        return
    if not m.token_times:
        rec.fail("aborted", f"finished as {r.status.value} without a token")
        return
    rec.succeed(m.token_times)
