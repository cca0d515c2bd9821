"""Waiting requests whose prefix blocks load from an offload tier: the scheduler's side of the
tiers, kept beside the KV manager so the scheduler only asks three questions (start a load for
this request? which loads finished? release a holder's blocks?).

A load holds fresh pool blocks while its request waits (it is not running). Such holders are
released when a running request needs blocks, or when nothing runs, no load is in flight and
a waiting request does not fit: a waiting request must never stall the pool. While a load is
in flight nothing is released for a waiting request: the load lands within its timeout, its
request runs and frees blocks as it finishes, and taking its blocks instead would recompute a
prompt the tier holds. The newest holder goes first. A released request asks the tiers again
when it is next considered, but not in the step that released it (two holders would otherwise
take each other's blocks forever).

A tier hit is loaded only when that is expected to be faster than computing it (SGLang #26305:
a hit from a slow remote tier can take longer than the prefill it saves): the load's
estimate comes from the tiers' measured transfer rate, the computation's from the engine's
recent prefill steps. Until both have been measured, every hit is loaded. A load expected to
land after its timeout, behind the loads already queued on the worker, is not started: its
request would wait out the deadline and then compute. The queue is not weighed against
computing otherwise: the engine's time is what every request shares, and a load that lands
in time saves it.
"""

from __future__ import annotations

from kvserve.kv.block_pool import KVCacheBlock
from kvserve.kv.manager import KVCacheManager
from kvserve.kv.offload import OffloadTiers
from kvserve.sched.request import Request


class TierLoads:
    def __init__(self, kv: KVCacheManager, offload: OffloadTiers) -> None:
        self.kv = kv
        self.offload = offload
        self.holders: list[Request] = []  # oldest first
        self._released: list[Request] = []  # ... this step
        self.hit_tokens = 0  # prompt tokens loaded instead of computed (by admitted requests)
        self.abandoned = 0  # loads given up to free their blocks
        self.skipped = 0  # tier hits computed instead: the load was estimated slower
        self.compute_s_per_token: float | None = None  # recent prefill steps, smoothed
        self._landed: dict[str, int] = {}  # request id -> tokens its finished load gave it

    def begin_step(self) -> None:
        self._released = []

    def start(self, req: Request, computed: list[KVCacheBlock]) -> bool:
        """If tiers hold blocks that continue the request's device hits, give it fresh blocks
        for them and start loading; it stays waiting until the load is done. Each admission
        of a request asks the tiers once (a request the pool has no room for yet keeps the
        answer and tries again when next considered)."""
        if req in self._released or (req.num_preemptions and not self.offload.swap_preempted):
            return False
        kv = self.kv
        candidates = kv.tier_candidates(req, len(computed))
        probed_now = not req.tier_probed
        if probed_now:
            req.tier_probed = True
            req.tier_hit_end = len(computed) + self.offload.probe(candidates)
        n = min(req.tier_hit_end - len(computed), len(candidates))
        # Weighed right after the probe, whose tier the estimate is for; the answer holds
        # until the request is preempted (then it is asked again).
        if probed_now and n > 0 and not self._pays(n):
            req.tier_hit_end = len(computed)
            self.skipped += 1
            return False
        if n <= 0 or not kv.allocate_slots(req, n * kv.block_size, computed):
            return False
        req.num_computed_tokens = len(computed) * kv.block_size
        req.load_block_ids = kv.block_ids(req)[len(computed) :]
        req.loading = True
        self.holders.append(req)
        self.offload.start_load(req.request_id, candidates[:n])
        return True

    def observe_compute(self, seconds_per_token: float) -> None:
        """A prefill step's seconds per token (an exponential average of recent ones)."""
        old = self.compute_s_per_token
        self.compute_s_per_token = (
            seconds_per_token if old is None else old + 0.2 * (seconds_per_token - old)
        )

    def _pays(self, n: int) -> bool:
        """Whether loading ``n`` blocks is expected to beat computing their tokens, and to
        land before its deadline (the loads queued before it included)."""
        offload = self.offload
        load_s = offload.load_seconds(n)
        if load_s is None:
            return True
        if offload.backlog_seconds() + load_s > offload.load_timeout_s:
            return False  # the request would wait out the deadline, then compute anyway
        if self.compute_s_per_token is None:
            return True
        return load_s <= n * self.kv.block_size * self.compute_s_per_token

    def finish(self, requests: dict[str, Request], idle: bool) -> None:
        """Hand the finished loads' payloads to the runner (next record) and count their
        blocks as computed; blocks a load could not fill stay in the table and are computed
        like any other. ``idle``: nothing else can run, so wait a little for a load."""
        bs = self.kv.block_size
        for rid, result in self.offload.poll_loads(wait=idle).items():
            req = requests.get(rid)
            if req is None or not req.loading:
                continue
            j = result.num_blocks
            self.kv.record_load(req, req.load_block_ids[:j], result.payloads)
            req.num_computed_tokens += j * bs
            req.loading = False
            req.tier_hit_end = 0  # the tiers' answer is used up: no second load
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = req.num_computed_tokens
            self._landed[rid] = j * bs  # counted once the request runs (a release undoes it)

    def stalled(self, req: Request) -> bool:
        """Nothing runs and ``req`` does not fit: free a holder's blocks for it, unless a load
        is still in flight (its request runs once it lands, and frees blocks as it finishes;
        recomputing ``req`` from scratch instead would throw away the tier's hit)."""
        return not self.offload.num_loading and self.release_one(keep=req)

    def release_one(self, keep: Request | None = None) -> bool:
        """Free the blocks of the newest holder (not ``keep``); False if there is none."""
        for req in reversed(self.holders):
            if req is keep:
                continue
            self.holders.remove(req)
            self._released.append(req)
            if req.loading:
                self.offload.cancel(req.request_id)
            self._landed.pop(req.request_id, None)
            self.kv.free(req)
            req.loading = False
            req.tier_probed = False
            req.num_computed_tokens = 0
            req.num_cached_tokens = -1
            self.abandoned += 1
            return True
        return False

    def forget(self, req: Request, admitted: bool = False) -> None:
        """The request was admitted (its loaded tokens count as tier hits) or finished: it
        holds nothing for a load any more."""
        landed = self._landed.pop(req.request_id, 0)
        if admitted:
            self.hit_tokens += landed
        if req in self.holders:
            self.holders.remove(req)
            if req.loading:
                self.offload.cancel(req.request_id)
                req.loading = False
