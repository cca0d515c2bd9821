"""Admission, step by step: which waiting requests start running this step, and which are
refused.

The :class:`~kvserve.sched.scheduler.Scheduler` (which owns request state) holds one
:class:`Admitter` and calls :meth:`Admitter.admit` inside its ``schedule`` after the running
requests have their blocks. It works on the scheduler's own collections (the waiting queue,
the running list, the request table), which it is given at construction and which both
change in place. The order comes from the waiting queue (:mod:`kvserve.sched.waiting`), the
arithmetic of projected demand from :mod:`kvserve.sched.admission`, retention's chunk
boundaries from :mod:`kvserve.sched.retention_steps`; a KV connector's loads start here too
(:mod:`kvserve.sched.kv_loads`), because a request whose prefix a connector holds waits for
it instead of running.

Same-step prefix sharing: a request admitted in the step that first computes a prefix would
compute it again beside the first (a block is published only after its step), so a waiting
request whose next block another request of this step completes is held one step, and hits.
"""

from __future__ import annotations

from kvserve.config import SchedulerConfig
from kvserve.kv.interface import KVManager
from kvserve.sched.admission import Admission, Refusal
from kvserve.sched.kv_loads import ConnectorLoads
from kvserve.sched.request import Request, RequestStatus
from kvserve.sched.retention_steps import RetentionSteps
from kvserve.sched.stats import SchedulerStats
from kvserve.sched.waiting import WaitingQueue


class Admitter:
    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVManager,
        waiting: WaitingQueue,
        running: list[Request],
        requests: dict[str, Request],
        admission: Admission | None,
        retention: RetentionSteps,
        loads: ConnectorLoads | None,
        stats: SchedulerStats,
    ) -> None:
        """``admission``: projected admission, or None for greedy (vLLM's)."""
        self.config = config
        self.kv = kv
        self.waiting = waiting
        self.running = running
        self.requests = requests
        self.admission = admission
        self.retention = retention
        self.loads = loads
        self.stats = stats
        self._refused: list[Request] = []  # refused since the last step (finished, no blocks)

    def projected_wait(self, req: Request, now: float) -> float | None:
        """Seconds until the blocks ``req`` and everything queued before it (not after it in
        priority) will hold are free, at the recent release rate; None: no rate yet."""
        adm, kv = self.admission, self.kv
        ahead = [
            w
            for w in self.waiting
            if self.config.scheduling_policy != "priority" or w.priority <= req.priority
        ]
        need = adm.remaining(req) - kv.num_cached_prefix_blocks(req)
        need += adm.reserved([*ahead, *self.running])
        return adm.projected_wait(need + adm.watermark_blocks - kv.num_free_blocks, now)

    def refuse(self, req: Request, refusal: Refusal, now: float) -> None:
        req.refusal = refusal
        req.status = RequestStatus.FINISHED_REFUSED
        req.metrics.finished_time = now
        self._refused.append(req)

    def take_refused(self) -> list[Request]:
        """Requests refused since the last call (finished; they hold no blocks)."""
        out, self._refused = self._refused, []
        return out

    def admit(self, picked: list[tuple[Request, int]], budget: int) -> int:
        """Admit waiting requests in the queue's order while the token budget, max_num_seqs
        and the pool allow; returns the budget left. Greedy stops at the first request whose
        chunk does not fit; projected passes over a request whose whole projection does not
        fit (until it has been passed over too often) and tries the next."""
        adm, loads, kv = self.admission, self.loads, self.kv
        holders = loads.holders if loads is not None else []
        reserved = adm.reserved([*self.running, *holders]) if adm is not None else 0
        held: list[Request] = []
        pending: set | None = None  # hashes of the full blocks this step computes
        for req in self.waiting.order(kv):
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                break
            if req.loading:
                continue  # a load started for it this step
            computed, num_cached = [], 0
            fresh = req.num_computed_tokens == 0 and not kv.block_ids(req)
            looks_up = fresh and self._hits_allowed(req)  # prefix hits and tier loads
            if looks_up:
                computed, num_cached = kv.get_computed_blocks(req, count=False)
                if self.config.hold_prefix_followers and picked:
                    if pending is None:
                        pending = self._pending_hashes(picked)
                    hashes = req.block_hashes
                    if len(computed) < len(hashes) and hashes[len(computed)] in pending:
                        held.append(req)  # next step that block is a hit
                        if adm is not None:
                            adm.stats.held_for_prefix += 1
                        continue
            if adm is not None:
                own = adm.remaining(req) if req in holders else 0
                if (self.running or picked) and not adm.fits(
                    adm.demand(req, computed), reserved - own
                ):
                    adm.stats.deferred += 1
                    if req.skips >= self.config.lpm_max_skips:
                        break  # it is next once its blocks free; nothing jumps it again
                    continue
            if looks_up and loads is not None:
                started = loads.start(req, computed)
                if started is None:
                    continue  # the connector does not know yet: asked again next step
                if started:
                    kv.count_hits(req, computed)
                    if adm is not None:
                        reserved += adm.remaining(req)
                    continue  # waits for its blocks; others may be admitted meanwhile
            n = req.num_tokens - req.num_computed_tokens - num_cached
            if not self.config.enable_chunked_prefill and n > budget:
                break
            n = self.retention.chunk(req, min(n, budget), num_cached)
            if n <= 0:
                break
            extra = self.retention.compact_blocks(req, n, num_cached)
            while not kv.allocate_slots(req, n, computed, extra):
                self.stats.allocation_failures += 1
                if not self.running and not picked and loads and loads.stalled(req):
                    continue  # nothing runs: blocks held for loads must not stall it
                break
            else:
                if looks_up:
                    kv.count_hits(req, computed)
                self._start_running(req, num_cached, held)
                picked.append((req, n))
                budget -= n
                if adm is not None:
                    reserved += adm.remaining(req) - own
                continue
            if adm is None:
                break
            continue  # projected: a smaller request behind it may still fit
        return budget

    def _hits_allowed(self, req: Request) -> bool:
        """Prompt logits need every position computed, and H2O the attention mass of every
        prompt query, so such requests skip hits; so does a class without prefix caching."""
        observes = req.retention is not None and req.retention.observes
        wc = req.workload_class
        return not (
            req.wants_prompt_logits or observes or (wc is not None and not wc.prefix_caching)
        )

    def _pending_hashes(self, picked: list[tuple[Request, int]]) -> set:
        """Hashes of the full prompt blocks this step's prefill chunks complete: published
        after the step, so a waiting request whose chain continues into them hits them next
        step instead of computing them again in this one."""
        bs, out = self.kv.block_size, set()
        for r, n in picked:
            c = r.num_computed_tokens
            if c >= r.num_prompt_tokens or r.retention is not None:
                continue
            hashes = self.kv.block_hashes(r)
            out.update(hashes[c // bs : min(c + n, r.num_prompt_tokens) // bs])
        return out

    def _start_running(self, req: Request, num_cached: int, held: list[Request]) -> None:
        self.waiting.passed_over(req, held)
        self.waiting.remove(req)
        req.skips = 0
        if self.loads is not None:
            self.loads.forget(req, admitted=True)
        if req.num_preemptions and req.num_cached_tokens >= 0:
            restored = req.num_computed_tokens + num_cached
            self.stats.preempted_tokens_restored += restored
            self.stats.preempted_tokens_recomputed += req.num_tokens - restored
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = num_cached
        req.num_computed_tokens += num_cached
        self.retention.retain(req)
        req.status = RequestStatus.RUNNING
        if self.admission is not None:
            self.admission.stats.admitted += 1
        if self.config.scheduling_policy == "priority":
            key = (req.priority, req.seq_no)
            i = len(self.running)
            while i and (self.running[i - 1].priority, self.running[i - 1].seq_no) > key:
                i -= 1
            self.running.insert(i, req)  # the newest, least urgent last: preempted first
        else:
            self.running.append(req)

    def refuse_late(self, now: float) -> None:
        """Refuse waiting requests that never ran and whose TTFT SLO has passed."""
        late = []
        for r in self.waiting:
            if r.num_computed_tokens or r.metrics.first_scheduled_time is not None:
                continue
            refusal = self.admission.refusal(r, None, now)
            if refusal is not None:
                late.append((r, refusal))
        for r, refusal in late:
            if self.loads is not None:
                self.loads.forget(r)
            self.kv.free(r)
            self.waiting.remove(r)
            for x in (r, *r.forks):
                self.requests.pop(x.request_id, None)
                self.refuse(x, refusal, now)
            r.forks = []
