"""Continuous batching: which requests run this step, and every change of request state after.

There are no separate prefill and decode phases. Each request has ``num_tokens`` known tokens
of which ``num_computed_tokens`` have K/V in the cache; a step gives each scheduled request a
slice of the difference, bounded by the token budget (``max_num_batched_tokens``). A request
in prefill therefore advances chunk by chunk, one in decode by one token, and both share the
step. Running requests are served first (oldest first); waiting ones are admitted while the
budget, ``max_num_seqs`` and the KV pool allow. When a running request cannot get a block, the
most recently admitted request is preempted (its blocks freed, to be recomputed later) and put
back at the front of the queue; the oldest request always progresses, so nothing deadlocks.
A waiting request whose prefix a KV connector holds (an offload tier, another engine) waits,
not running, while its blocks load (:mod:`kvserve.sched.kv_loads`); others are admitted
meanwhile. The scheduler holds its policies as objects and calls them: the waiting queue's
order (:mod:`kvserve.sched.waiting`), admission (:mod:`kvserve.sched.admission_steps`, with
projected demand from :mod:`kvserve.sched.admission`), retention
(:mod:`kvserve.sched.retention_steps`), and the connector (:mod:`kvserve.connectors.base`),
which sees block ids and hashes and may hold a finished request's blocks (``delay_free``)
until it reports them sent.

:meth:`Scheduler.schedule` describes the step as plain data (:class:`SchedulerOutput`);
:meth:`Scheduler.update_from_output` owns what happens after the forward pass: computed-token
counts, appended tokens and logprobs, publishing full blocks to the prefix cache, forking the
other samples of an ``n > 1`` request, stop checks and freeing. Request state changes here and
nowhere else (the engine asks for a stop-string finish through :meth:`finish_requests`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from kvserve.config import SchedulerConfig
from kvserve.connectors.base import KVConnector, StepBlocks
from kvserve.kv.interface import KVManager
from kvserve.sched.admission import Admission
from kvserve.sched.admission_steps import Admitter
from kvserve.sched.kv_loads import ConnectorLoads
from kvserve.sched.output import (
    PENDING_TOKEN_ID,
    ModelRunnerOutput,
    NewRequestData,
    ScheduledSeq,
    SchedulerOutput,
)
from kvserve.sched.request import Request, RequestStatus
from kvserve.sched.retention_steps import RetentionSteps
from kvserve.sched.stats import SchedulerStats
from kvserve.sched.waiting import WaitingQueue


def check_stop(r: Request, token: int, max_model_len: int) -> bool:
    """Stop tokens, EOS and length limits after ``token`` was appended; sets the request's
    status and returns True when it finished. (Stop strings need text: the engine's output
    processor checks those.)"""
    p = r.sampling_params
    n_all = len(r.all_token_ids)
    n_out = n_all - len(r.prompt_token_ids)
    # EOS in a constrained request is the grammar's end (the mask allows it nowhere else, and
    # forces it there even before min_tokens): it stops.
    if token in r.eos_token_ids and (n_out >= p.min_tokens or p.structured_outputs is not None):
        r.status = RequestStatus.FINISHED_STOPPED
        return True
    if n_out >= p.min_tokens and p.stop_token_ids and token in p.stop_token_ids:
        r.stop_reason = token
        r.status = RequestStatus.FINISHED_STOPPED
        return True
    if n_out >= r.max_tokens or n_all >= max_model_len:
        r.status = RequestStatus.FINISHED_LENGTH
        return True
    return False


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVManager,
        max_model_len: int,
        native_window: int = 0,
        connector: KVConnector | None = None,
        load_failure_policy: str = "recompute",
    ) -> None:
        """``native_window``: every layer's own sliding window (0: the model has
        full-attention layers); ``connector``: the scheduler side of the engine's KV
        connectors (None: none moves KV)."""
        self.config = config
        self.kv = kv
        self.max_model_len = max_model_len
        self.connector = connector
        self.requests: dict[str, Request] = {}  # every unfinished request, forks included
        self.running: list[Request] = []
        self.waiting = WaitingQueue(config)
        self.stats = SchedulerStats()
        # Projected admission (None: greedy)
        self.admission = (
            Admission(kv, max_model_len, config.admission_watermark)
            if config.admission == "projected"
            else None
        )
        self.retention = RetentionSteps(kv, native_window, self.stats)
        # Waiting requests whose blocks a connector loads (None: no connector)
        self.loads = (
            ConnectorLoads(kv, connector, load_failure_policy) if connector is not None else None
        )
        self.admitter = Admitter(config, kv, self.waiting, self.running, self.requests,
                                 self.admission, self.retention, self.loads,
                                 self.stats)  # fmt: skip
        self._multi_table = kv.num_groups > 1  # a hybrid model: a table per layer group
        self._seq = 0
        self._in_runner: set[str] = set()  # requests whose sampling state the runner holds
        self._finished_ids: list[str] = []  # ... that finished since the last step
        # Finished requests whose blocks a connector holds (delay_free): id -> (request, the
        # clock time its lease ends); their blocks go when the workers report them sent.
        self.held: dict[str, tuple[Request, float]] = {}
        # Failed by kv_load_failure_policy: fail, or given a peer's tokens: out next step.
        self._failed_loads: list[Request] = []
        self._invalid_blocks: set[int] = set()  # reported failed, their request not landed
        self._now = 0.0
        # Async scheduling: the requests of each step committed and not yet landed, oldest
        # first (a step's output applies to the objects it ran for, never to a later request
        # that reuses an id).
        self._steps: deque[list[Request]] = deque()

    @property
    def num_preemptions(self) -> int:
        return self.stats.num_preemptions

    def add_request(self, request: Request) -> None:
        """Queue a request; its ``forks`` wait until its first token. Under projected
        admission a request whose class's TTFT SLO its projected wait already exceeds is
        refused instead (it comes out of the next step, finished, with its refusal)."""
        for r in (request, *request.forks):
            if r.request_id in self.requests:
                raise ValueError(f"request_id: {r.request_id!r} is already scheduled")
        self._seq += 1
        request.seq_no = self._seq
        if self.admission is not None and request.workload_class is not None:
            now = request.arrival_time
            wait = self.admitter.projected_wait(request, now)
            refusal = self.admission.refusal(request, wait, now)
            if refusal is not None:
                for r in (request, *request.forks):
                    self.admitter.refuse(r, refusal, now)
                return
        self.requests[request.request_id] = request
        for f in request.forks:
            self.requests[f.request_id] = f
        self.waiting.append(request)

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    def take_refused(self) -> list[Request]:
        """Requests that finished without a step since the last call: refused by admission,
        or failed by their load (``kv_load_failure_policy: fail``). They hold no blocks."""
        out = self.admitter.take_refused()
        if self._failed_loads:
            out += self._failed_loads
            self._failed_loads = []
        return out

    @property
    def awaits_workers(self) -> bool:
        """Whether a step must reach the workers though no request runs: a finished request's
        held blocks wait to be reported sent, or a load only the workers can report done."""
        if self.held:
            return True
        loads = self.loads
        return (
            loads is not None and self.connector.loads_finish_on_workers and loads.num_loading > 0
        )

    @property
    def has_held_blocks(self) -> bool:
        """Whether a connector still holds a finished request's blocks (the engine keeps
        stepping, so the workers can report them sent)."""
        return bool(self.held)

    # -- scheduling ---------------------------------------------------------------------------
    def schedule(self, now: float = 0.0) -> SchedulerOutput:
        """The next step as plain data; ``now`` (the engine's clock) dates deadline
        refusals."""
        self._now = now
        if self.admission is not None:
            self.admitter.refuse_late(now)
        if self.held:
            self._expire_holds(now)
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        picked: list[tuple[Request, int]] = []
        loads = self.loads
        if loads is not None:
            loads.begin_step()
            if loads.holders:
                idle = not self.running  # only loads can make progress now
                landed = self.connector.take_finished_loads(idle)
                if landed:
                    whole = loads.land(self.requests, landed, set(), self._fail_load)
                    self._take_peer_tokens(whole, now)

        # 1. Running requests, oldest first; preempt from the newest end when blocks run out.
        # Without a retention policy or a model window (most requests) the retention steps
        # change nothing: skipped, since this loop runs per running request per step.
        retention = self.retention
        native = retention.native_window
        running, allocate = self.running, self.kv.allocate_slots
        i = 0
        # A step in flight (async scheduling) holds blocks its requests may still write:
        # nothing is preempted under it; a request that cannot grow waits for it to land.
        inflight = bool(self._steps)
        stalled = False
        while i < len(running) and budget > 0:
            req = running[i]
            n = len(req.all_token_ids) + req.num_pending - req.num_computed_tokens
            if req.num_pending and not self._overlaps(req):
                i += 1  # it goes on once the token in flight lands
                continue
            if n > budget:
                n = budget
            retains = req.retention is not None
            if retains:
                n = retention.chunk(req, n)
            if n <= 0:
                i += 1
                continue
            if retains or native:
                retention.retain(req)
            extra = retention.compact_blocks(req, n) if retains else 0
            while not allocate(req, n, (), extra):
                self.stats.allocation_failures += 1
                if loads is not None and loads.release_one():
                    continue
                if inflight:
                    stalled = True
                    break
                victim = running.pop()
                self._preempt(victim, out)
                picked = [(r, k) for r, k in picked if r is not victim]
                if victim is req:
                    break
            else:
                picked.append((req, n))
                budget -= n
                i += 1
                continue
            break  # req itself was preempted: nothing newer remains

        # 2. Admit waiting requests, unless this step had to preempt (memory is tight).
        if not out.preempted_req_ids and not stalled and self.waiting:
            budget = self.admitter.admit(picked, budget)
        if not picked:
            if self.connector is not None and self.awaits_workers:  # a step for the connectors
                out.kv_connector_metadata = self.connector.build_connector_meta()
            return out  # the KV record and finished ids wait for a step that runs
        describe, seqs = self._describe, out.seqs
        decode = tokens = 0
        for req, n in picked:
            seqs.append(describe(req, n, out))
            tokens += n
            if n == 1 and req.num_computed_tokens >= len(req.prompt_token_ids):
                decode += 1
        out.num_decode_tokens = decode
        out.num_prefill_tokens = tokens - decode
        out.kv_ops = ops = self.kv.take_ops()
        connector = self.connector
        if connector is not None:
            if ops.evicted or ops.hot:
                connector.on_blocks(StepBlocks(ops.evicted, ops.num_restored_evictions, ops.hot))
            for req, n in picked:
                connector.on_scheduled(req, n)
            out.kv_connector_metadata = connector.build_connector_meta()
        out.finished_req_ids, self._finished_ids = self._finished_ids, []
        return out

    def _describe(self, req: Request, n: int, out: SchedulerOutput) -> ScheduledSeq:
        """The plain-data view of ``req``'s share of the step (see :mod:`kvserve.sched.output`)."""
        c = req.num_computed_tokens
        rid = req.request_id
        known = len(req.all_token_ids)
        if c + n > known:  # the token a step in flight samples: the runner fills it in
            out.pending_token_ids = True
            ids = req.all_token_ids[c:] + [PENDING_TOKEN_ID] * (c + n - known)
            return ScheduledSeq(rid, ids, c, c - req.cache_offset, self.kv.block_ids(req)[:],
                                (rid,))  # fmt: skip
        if (
            c + n == known
            and not req.forks
            and req.retention is None
            and not self._multi_table
            and req.prompt_logits is None
            and rid in self._in_runner
        ):  # a decode step (or a last chunk) of a plain request the runner already has
            ids, block_ids = req.all_token_ids[c:], self.kv.block_ids(req)[:]
            return ScheduledSeq(rid, ids, c, c - req.cache_offset, block_ids, (rid,))
        sample_ids: tuple[str, ...] = ()
        if c + n == len(req.all_token_ids):  # the step reaches the newest token: it samples
            sample_ids = (rid, *(f.request_id for f in req.forks)) if req.forks else (rid,)
            new = (req, *req.forks) if req.forks or rid not in self._in_runner else ()
            for r in new:
                if r.request_id not in self._in_runner:
                    self._in_runner.add(r.request_id)
                    out.new_requests.append(
                        NewRequestData(
                            r.request_id,
                            r.prompt_token_ids,
                            r.sampling_params,
                            r.eos_token_ids,
                            r.output_token_ids,
                        )  # fmt: skip
                    )
        prompt_rows = 0
        if req.prompt_logits is not None and c < req.num_prompt_tokens:
            prompt_rows = min(n, req.num_prompt_tokens - c)
        spec = req.retention
        window, sinks = (spec.window, spec.sinks) if spec is not None else (0, 0)
        seq = ScheduledSeq(rid, req.all_token_ids[c : c + n], c, req.num_cache_entries,
                           self.kv.block_ids(req)[:], sample_ids, prompt_rows, window,
                           sinks)  # fmt: skip
        if self._multi_table:
            seq.group_block_ids = self.kv.group_block_ids(req)
        if spec is not None and spec.observes:
            seq.observe = True
        compact = self.kv.compact_block_ids(req) if spec is not None else None
        if compact:
            if spec.observes:
                seq.compact = ("h2o", spec.budget, spec.num_recent, 0)
            else:
                seq.compact = ("snapkv", spec.budget, spec.obs, spec.kernel)
            seq.compact_block_ids = compact
        return seq

    def _overlaps(self, req: Request) -> bool:
        """Whether ``req``, whose last token a step in flight samples, may be scheduled now
        with that token pending. Not when it ends for sure with that token (its length), nor
        when the token changes more than the next position: an ``n > 1`` request's samples
        fork on it, a retention policy compacts or observes, a hybrid model's layer groups
        drop blocks. Those wait one step for it to land."""
        n_all = len(req.all_token_ids) + req.num_pending
        return not (
            n_all - len(req.prompt_token_ids) >= req.max_tokens
            or n_all >= self.max_model_len
            or req.forks
            or req.retention is not None
            or self._multi_table
        )

    def commit(self, scheduler_output: SchedulerOutput) -> None:
        """Async scheduling: the step is on its way to the runner, so the next one is planned
        as if it had run: its tokens count as computed, and each sampling sequence has one
        token pending until :meth:`update_from_output` lands it."""
        requests = self.requests
        reqs = []
        for seq in scheduler_output.seqs:
            req = requests[seq.req_id]
            req.num_computed_tokens += len(seq.token_ids)
            if seq.sample_ids:
                req.num_pending += 1
            reqs.append(req)
        self._steps.append(reqs)

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_evicted_tokens = 0  # its cache is rebuilt from nothing
        req.cache_offset = 0
        if req.prompt_logits is not None:
            req.prompt_logits = []  # recomputed from scratch
        req.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.appendleft(req)
        out.preempted_req_ids.append(req.request_id)

    # -- after the forward pass -----------------------------------------------------------------
    def update_from_output(
        self,
        scheduler_output: SchedulerOutput,
        runner_output: ModelRunnerOutput,
        scheduled_at: float,
        now: float,
    ) -> list[Request]:
        """Apply a step's results; returns the requests that got a token or finished, in
        step order (finished ones have a finished status and hold no blocks)."""
        touched: dict[str, Request] = {}
        finished: list[Request] = []
        st = self.stats
        if self.connector is not None:
            self._connector_output(scheduler_output, runner_output, now - scheduled_at)
        for rid, rows in runner_output.prompt_logits.items():
            self.requests[rid].prompt_logits.append(rows)
        row = {rid: i for i, rid in enumerate(runner_output.req_ids)}
        tokens, lps, sampled_lps = (runner_output.token_ids, runner_output.logprobs,
                                    runner_output.sampled_logprobs)  # fmt: skip
        requests, publish = self.requests, self.kv.cache_computed_blocks
        max_len = self.max_model_len
        generated = 0
        committed = self._steps.popleft() if self._steps else None
        for k, seq in enumerate(scheduler_output.seqs):
            n = len(seq.token_ids)
            if committed is None:
                first = requests[seq.req_id]
                c = first.num_computed_tokens
                first.num_computed_tokens = c + n
            else:  # counted when committed; finished or aborted since: nothing to land
                first, c = committed[k], seq.position
                if seq.sample_ids:
                    first.num_pending -= 1
                if first.is_finished:
                    continue
            p = len(first.prompt_token_ids)
            if c < p:
                st.prefill_tokens_computed_total += min(n, p - c)
            if first.metrics.first_scheduled_time is None:
                first.metrics.first_scheduled_time = scheduled_at
                st.queue_time_sum += max(0.0, scheduled_at - first.arrival_time)
                st.queue_time_count += 1
            publish(first, c + n)
            if seq.compact:
                self.retention.compacted(first)
            if not seq.sample_ids:
                continue
            if first.forks:
                forks, first.forks = first.forks, []
                for f in forks:
                    self._fork(first, f)
                self.waiting.extendleft(reversed(forks))
            for rid in seq.sample_ids:
                r = first if rid == first.request_id else requests[rid]
                i = row[rid]
                token = tokens[i]
                r.all_token_ids.append(token)
                generated += 1
                if r.output_logprobs is not None and lps and lps[i] is not None:
                    r.output_logprobs.append(lps[i])
                if sampled_lps is not None:
                    r.cumulative_logprob += sampled_lps[i]
                m = r.metrics
                if m.first_token_time is None:
                    m.first_token_time = now
                    st.prompt_tokens_total += r.num_prompt_tokens
                m.token_times.append(now)
                if check_stop(r, token, max_len):
                    finished.append(r)
                touched[rid] = r
        st.generation_tokens_total += generated
        for r in finished:
            r.metrics.finished_time = now
            self._finish(r, r.status)
        out = list(touched.values())
        if self._failed_loads:
            out += self._failed_loads
            self._failed_loads = []
        return out

    def _fork(self, first: Request, sib: Request) -> None:
        """Give a waiting sibling ``first``'s blocks; it samples its own first token from the
        same logits this step, then decodes on its own (copy-on-write of the shared tail)."""
        self.kv.fork(first, sib)
        sib.num_computed_tokens = first.num_computed_tokens
        sib.num_cached_tokens = first.num_cached_tokens
        sib.cache_offset = first.cache_offset
        sib.num_evicted_tokens = first.num_evicted_tokens
        sib.metrics.first_scheduled_time = first.metrics.first_scheduled_time

    def fail_step(self, scheduler_output: SchedulerOutput, error: str, now: float) -> list[Request]:
        """The runner (or the clock) raised: finish every request of the step with an error,
        free their blocks, and keep the step's record of frees for the next step (the runner
        may not have applied it). Requests outside the step carry on."""
        self.kv.restore_ops(scheduler_output.kv_ops)
        if self.connector is not None:
            self.connector.step_failed(scheduler_output.kv_connector_metadata)
        self._finished_ids = scheduler_output.finished_req_ids + self._finished_ids
        committed = self._steps.popleft() if self._steps else None
        failed = []
        for k, seq in enumerate(scheduler_output.seqs):
            r = self.requests.get(seq.req_id) if committed is None else committed[k]
            if r is None or r.is_finished:
                continue
            for x in (r, *r.forks):
                x.error = error
                x.metrics.finished_time = now
                failed.append(x)
            r.forks = []
        self.finish_requests(failed, RequestStatus.FINISHED_ERROR)
        return failed

    def fail_all(self, scheduler_output: SchedulerOutput, error: str, now: float) -> list[Request]:
        """No step can run any more (a worker died): fail the step's requests as
        :meth:`fail_step` does, then every other unfinished request, waiting ones included."""
        failed = self.fail_step(scheduler_output, error, now)
        self._steps.clear()  # no step in flight will land
        rest = list(self.requests.values())
        for r in rest:
            r.error = error
            r.metrics.finished_time = now
        self.finish_requests(rest, RequestStatus.FINISHED_ERROR)
        return failed + rest

    # -- finishing ------------------------------------------------------------------------------
    def finish_requests(
        self,
        requests: Iterable[Request],
        status: RequestStatus,
        stop_reason: int | str | None = None,
    ) -> None:
        """Finish requests (stop string, abort, error) and free their blocks; a request that
        already finished this step only takes the new status and stop reason."""
        for r in requests:
            if stop_reason is not None:
                r.stop_reason = stop_reason
            if r.is_finished:
                r.status = status
                continue
            self._finish(r, status)

    def _finish(self, req: Request, status: RequestStatus) -> None:
        if self.admission is not None:
            held = len(self.kv.block_ids(req)) - self.kv.num_dropped_blocks(req)
            natural = status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH)
            self.admission.finished(req, held, natural, req.metrics.finished_time)
        req.status = status
        if self.loads is not None:
            self.loads.forget(req)
        if req in self.running:
            self.running.remove(req)
        else:
            try:
                self.waiting.remove(req)
            except ValueError:
                pass  # a fork that never started
        delay = False
        if self.connector is not None:
            delay, req.kv_transfer_params = self.connector.request_finished(
                req, self.kv.block_ids(req)
            )
        else:
            req.kv_transfer_params = None  # what it came with is not an answer
        if delay:
            self.held[req.request_id] = (req, self._now + self.connector.lease_s)
            self.stats.held_for_transfer += 1
        else:
            self.kv.free(req)
        self.requests.pop(req.request_id, None)
        if req.request_id in self._in_runner:
            self._in_runner.discard(req.request_id)
            self._finished_ids.append(req.request_id)

    # -- connectors -------------------------------------------------------------------------------
    def _connector_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput, seconds: float
    ) -> None:
        """The workers' report of the step: sent requests release their held blocks, received
        ones land (the blocks before the first failed one count as computed)."""
        connector = self.connector
        connector.on_step_done(scheduler_output, seconds)
        report = runner_output.kv_connector_output
        if report is None:
            return
        connector.update_connector_output(report)
        for rid in report.finished_sending:
            held = self.held.pop(rid, None)
            if held is not None:
                self.kv.free(held[0])
        self._invalid_blocks |= report.invalid_block_ids
        if report.finished_recving and self.loads is not None:
            arrived, judged = {}, []
            for rid in report.finished_recving:
                r = self.requests.get(rid)
                if r is not None and r.loading:
                    arrived[rid] = len(r.load_block_ids)
                    judged += r.load_block_ids
            whole = self.loads.land(self.requests, arrived, self._invalid_blocks, self._fail_load)
            self._take_peer_tokens(whole, self._now)
            self._invalid_blocks.difference_update(judged)  # a later load may reuse them

    def _fail_load(self, req: Request, error: str) -> None:
        """``kv_load_failure_policy: fail``: the request's load failed, so does the request
        (it comes out of the step, finished with the error)."""
        failed = [req, *req.forks]
        for x in failed:
            x.error = error
            x.metrics.finished_time = self._now
        self.finish_requests(failed, RequestStatus.FINISHED_ERROR)
        req.forks = []
        self._failed_loads += failed

    def _take_peer_tokens(self, landed: list[Request], now: float) -> None:
        """Requests whose whole load landed take the output tokens the peer sampled (a
        disaggregated prefill's first token): they come out of the next step with them."""
        for req in landed:
            tokens = self.connector.landed_output_tokens(req)
            if not tokens or req.num_computed_tokens != req.num_tokens or req.num_output_tokens:
                continue
            m = req.metrics
            m.first_token_time = now
            self.stats.prompt_tokens_total += req.num_prompt_tokens
            for t in tokens:
                req.all_token_ids.append(t)
                m.token_times.append(now)
                self.stats.generation_tokens_total += 1
                if check_stop(req, t, self.max_model_len):
                    m.finished_time = now
                    self._finish(req, req.status)
                    break
            self._failed_loads.append(req)  # out with the next step's outputs

    def _expire_holds(self, now: float) -> None:
        """Holds whose lease ran out: the peer never reported them sent; free the blocks."""
        for rid, (req, until) in list(self.held.items()):
            if now >= until:
                del self.held[rid]
                self.kv.free(req)
                self.stats.held_lease_expired += 1
