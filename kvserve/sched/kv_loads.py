"""Waiting requests whose blocks a KV connector loads: the scheduler's side of a connector's
asynchronous loads (an offload tier, another engine), so the admission loop asks few
questions (start a load for this request? which loads finished? release a holder?).

A load holds fresh pool blocks while its request waits (``loading``; it is not running). Such
holders are released when a running request needs blocks, or when nothing runs, no load is
in flight and a waiting request does not fit: a waiting request must never stall the pool.
While a load is in flight nothing is released for a waiting request: the load lands within
its timeout, its request runs and frees blocks as it finishes, and taking its blocks instead
would recompute what the connector holds. The newest holder goes first. A released request
asks the connector again when it is next considered, but not in the step that released it
(two holders would otherwise take each other's blocks forever).

When a load completes, the blocks before the first one that failed count as computed (a load
that ends at the prompt's end may end in a partial block: then its tokens, not its blocks,
count). The rest follow ``kv_load_failure_policy``: ``recompute`` leaves them in the table to
be computed like any other; ``fail`` finishes the request with an error (vLLM's two policies).
"""

from __future__ import annotations

from collections.abc import Callable

from kvserve.connectors.base import KVConnector
from kvserve.kv.block_pool import KVCacheBlock
from kvserve.kv.manager import KVCacheManager
from kvserve.sched.request import Request

LOAD_FAILURE_POLICIES = ("recompute", "fail")


class ConnectorLoads:
    def __init__(
        self, kv: KVCacheManager, connector: KVConnector, failure_policy: str = "recompute"
    ) -> None:
        self.kv = kv
        self.connector = connector
        self.failure_policy = failure_policy
        self.holders: list[Request] = []  # oldest first
        self._released: list[Request] = []  # ... this step
        self.hit_tokens = 0  # prompt tokens loaded instead of computed (by admitted requests)
        # prompt tokens a peer engine prefilled and sent (P/D): loaded, but not cache hits
        self.transferred_tokens = 0
        self.abandoned = 0  # loads given up to free their blocks
        self.failed_blocks = 0  # blocks whose load failed (recomputed or failing their request)
        # request id -> (tokens its finished load gave it, whether they are cache hits)
        self._landed: dict[str, tuple[int, bool]] = {}

    @property
    def num_loading(self) -> int:
        return sum(1 for r in self.holders if r.loading)

    def begin_step(self) -> None:
        self._released = []

    def start(self, req: Request, computed: list[KVCacheBlock]) -> bool | None:
        """Ask the connector whether it holds blocks that continue the request's device hits;
        if so, give the request fresh blocks for them and let the load start: the request
        waits until it lands. False: nothing to load (or no room yet); None: the connector
        does not know yet (the request waits a step)."""
        if req in self._released:
            return False
        kv = self.kv
        num, load_async = self.connector.get_num_new_matched_tokens(
            req, len(computed) * kv.block_size
        )
        if num is None:
            return None
        if num <= 0 or not kv.allocate_slots(req, num, computed):
            return False
        if not load_async:
            raise RuntimeError(
                "a KV connector's loads are asynchronous here: the request waits for them"
            )
        req.num_computed_tokens = len(computed) * kv.block_size
        req.load_block_ids = kv.block_ids(req)[len(computed) :]
        req.load_num_tokens = num
        req.loading = True
        self.holders.append(req)
        self.connector.update_state_after_alloc(req, req.load_block_ids, num)
        return True

    def land(
        self,
        requests: dict[str, Request],
        arrived: dict[str, int],
        invalid: set[int],
        fail: Callable[[Request, str], None],
    ) -> list[Request]:
        """Loads that completed (request id -> blocks that arrived, the rest failed; blocks in
        ``invalid`` failed too): their blocks count as computed up to the first failed one.
        ``fail(request, message)`` finishes a request under the ``fail`` policy. Returns the
        requests whose whole load arrived."""
        bs = self.kv.block_size
        whole: list[Request] = []
        for rid, n in arrived.items():
            req = requests.get(rid)
            if req is None or not req.loading:
                continue
            ids = req.load_block_ids
            j = min(n, len(ids))
            bad = next((i for i, b in enumerate(ids[:j]) if b in invalid), None)
            if bad is not None:
                j = bad
            req.loading = False
            if j < len(ids):
                self.failed_blocks += len(ids) - j
                if self.failure_policy == "fail":
                    why = self.connector.load_failure_reason(req)
                    fail(req, f"kv load failed: {len(ids) - j} of {len(ids)} blocks did not "
                              f"arrive{f' ({why})' if why else ''} "
                              "(kv_load_failure_policy: fail)")  # fmt: skip
                    continue
            tokens = req.load_num_tokens if j == len(ids) else j * bs
            # A peer's prefill is transferred, not a cache hit (usage reports it apart).
            hits = self.connector.load_is_cache_hit(req)
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = req.num_computed_tokens + (tokens if hits else 0)
            if not hits:
                req.num_transferred_tokens = tokens
            req.num_computed_tokens += tokens
            self._landed[rid] = (tokens, hits)  # counted once it runs (a release undoes it)
            if j == len(ids):
                whole.append(req)
        return whole

    def stalled(self, req: Request) -> bool:
        """Nothing runs and ``req`` does not fit: free a holder's blocks for it, unless a load
        is still in flight (its request runs once it lands, and frees blocks as it finishes;
        recomputing ``req`` from scratch instead would throw away the connector's hit)."""
        return not self.num_loading and self.release_one(keep=req)

    def release_one(self, keep: Request | None = None) -> bool:
        """Free the blocks of the newest holder (not ``keep``); False if there is none."""
        for req in reversed(self.holders):
            if req is keep:
                continue
            self.holders.remove(req)
            self._released.append(req)
            self.connector.cancel_load(req)
            self._landed.pop(req.request_id, None)
            self.kv.free(req)
            req.loading = False
            req.num_computed_tokens = 0
            req.num_cached_tokens = -1
            self.abandoned += 1
            return True
        return False

    def forget(self, req: Request, admitted: bool = False) -> None:
        """The request was admitted (its loaded tokens count as hits) or finished: it holds
        nothing for a load any more."""
        landed, hits = self._landed.pop(req.request_id, (0, True))
        if admitted and hits:
            self.hit_tokens += landed
        elif admitted:
            self.transferred_tokens += landed
        if req in self.holders:
            self.holders.remove(req)
            if req.loading:
                self.connector.cancel_load(req)
                req.loading = False
