"""Continuous batching: which requests run this step and how many tokens each computes.

There are no separate prefill and decode phases. Each request has ``num_tokens`` known tokens
of which ``num_computed_tokens`` have K/V in the cache; a step gives each scheduled request a
slice of the difference, bounded by the token budget (``max_num_batched_tokens``). A request
in prefill therefore advances chunk by chunk, one in decode by one token, and both share the
step. Running requests are served first (oldest first); waiting ones are admitted while the
budget, ``max_num_seqs`` and the KV pool allow. When a running request cannot get a block, the
most recently admitted request is preempted (its blocks freed, to be recomputed later) and put
back at the front of the queue; the oldest request always progresses, so nothing deadlocks.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from kvserve.config import SchedulerConfig
from kvserve.kv.manager import KVCacheManager
from kvserve.request import Request, RequestStatus


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """Whether this step reaches the request's last known token (so it samples one)."""
        r = self.request
        return r.num_computed_tokens + self.num_new_tokens == r.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add_request(self, request: Request) -> None:
        self.waiting.append(request)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        scheduled_ids: set[str] = set()

        # 1. Running requests, oldest first; preempt from the newest end when blocks run out.
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if n <= 0:
                i += 1
                continue
            while not self.kv.allocate_slots(req, n):
                victim = self.running.pop()
                self._preempt(victim, out)
                if victim is req:
                    break
            else:
                out.scheduled.append(ScheduledRequest(req, n))
                scheduled_ids.add(req.request_id)
                budget -= n
                self._count(out, req, n)
                i += 1
                continue
            break  # req itself was preempted: nothing newer remains

        # 2. Admit waiting requests, unless this step had to preempt (memory is tight).
        while (
            self.waiting
            and budget > 0
            and not out.preempted
            and len(self.running) < self.config.max_num_seqs
        ):
            req = self._pick_waiting()
            computed, num_cached = [], 0
            if req.num_computed_tokens == 0 and not req.wants_prompt_logits:
                # Prompt logits need every position computed, so such requests skip hits.
                computed, num_cached = self.kv.get_computed_blocks(req)
            n = req.num_tokens - req.num_computed_tokens - num_cached
            if not self.config.enable_chunked_prefill and n > budget:
                break
            n = min(n, budget)
            if not self.kv.allocate_slots(req, n, computed):
                break
            self._remove_waiting(req)
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_cached
            req.num_computed_tokens += num_cached
            req.status = RequestStatus.RUNNING
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = time.monotonic()
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, n))
            budget -= n
            self._count(out, req, n)
        return out

    def _count(self, out: SchedulerOutput, req: Request, n: int) -> None:
        if req.num_computed_tokens + n <= req.num_prompt_tokens or n > 1:
            out.num_prefill_tokens += n
        else:
            out.num_decode_tokens += n

    def _pick_waiting(self) -> Request:
        """fcfs: the head. lpm: the longest cached prefix, unless the head has waited long."""
        head = self.waiting[0]
        if self.config.scheduling_policy != "lpm" or len(self.waiting) == 1:
            return head
        if head.lpm_skips >= self.config.lpm_max_skips:
            return head
        best, best_hit = head, -1
        for req in self.waiting:
            hit = self._cached_prefix_len(req)
            if hit > best_hit:
                best, best_hit = req, hit
        if best is not head:
            for req in self.waiting:
                if req is best:
                    break
                req.lpm_skips += 1
        return best

    def _cached_prefix_len(self, req: Request) -> int:
        hashes = self.kv.block_hashes(req)
        n = 0
        for h in hashes:
            if self.kv.pool.get_cached_block(h) is None:
                break
            n += 1
        return n

    def _remove_waiting(self, req: Request) -> None:
        if self.waiting[0] is req:
            self.waiting.popleft()
        else:
            self.waiting.remove(req)

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        if req.prompt_logits is not None:
            req.prompt_logits = []  # recomputed from scratch
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        out.preempted.append(req)
        out.scheduled = [s for s in out.scheduled if s.request is not req]

    def finish(self, req: Request, status: RequestStatus) -> None:
        """Remove a request from the queues and free its blocks (finish, abort or error)."""
        req.status = status
        if req in self.running:
            self.running.remove(req)
        else:
            try:
                self.waiting.remove(req)
            except ValueError:
                pass
        self.kv.free(req)
