"""The offload tiers (host memory, local disk, Redis) as a KV connector.

Scheduler side (the engine's process): the tiers themselves
(:class:`~kvserve.kv.offload.KVOffload`, its worker thread and keys, or the simulator's
modelled tiers) and the decisions: which evicted or freshly computed blocks go down, whether a
waiting request's chain of block hashes continues in a tier past its device hits and whether
loading it pays. Worker side: the bytes. Before the step's copies, loads and writes it exports
the evicted blocks bound for a tier (nothing has overwritten them yet); it imports the loaded
payloads into their fresh blocks before the forward pass; after it, it exports the blocks a
write-through policy stores as soon as they are computed. Exported payloads reach the tiers
on the executor's channel (``take_scheduler_payloads``), loaded ones reach the worker the
same way (``take_worker_payloads``): the step's own messages carry block ids and hashes only.

A tier hit is loaded only when that is expected to be faster than computing it (SGLang #26305:
a hit from a slow remote tier can take longer than the prefill it saves): the load's estimate
comes from the tiers' measured transfer rate, the computation's from the engine's recent
prefill steps. Until both have been measured, every hit is loaded. A load expected to land
after its timeout, behind the loads already queued on the tier worker, is not started: its
request would wait out the deadline and then compute.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvserve.connectors.base import KVConnector, Role, StepBlocks
from kvserve.kv.hashing import BlockHash
from kvserve.kv.manager import KVCacheManager
from kvserve.kv.offload import OffloadTiers
from kvserve.kv.storage import BlockPayload, KVStorage

# A step computing at least this many prompt tokens times the engine's prefill (seconds per
# token), which a tier load is weighed against.
PREFILL_TIMING_MIN_TOKENS = 256


@dataclass(slots=True)
class OffloadMeta:
    """One step's instructions for the worker side."""

    saves_before: list[tuple[int, BlockHash]] = field(default_factory=list)  # evicted blocks
    saves_after: list[tuple[int, BlockHash]] = field(default_factory=list)  # write-through
    loads: dict[str, list[int]] = field(default_factory=dict)  # request -> blocks to fill


class OffloadConnector(KVConnector):
    loads_finish_on_workers = False  # the tiers live beside the scheduler

    def __init__(
        self, role: Role, kv: KVCacheManager | None = None, tiers: OffloadTiers | None = None
    ) -> None:
        """Scheduler side: the engine's KV manager and tiers; worker side: neither."""
        super().__init__(role)
        self.kv = kv
        self.tiers = tiers
        # scheduler side
        self.skipped = 0  # tier hits computed instead: the load was estimated slower
        self.compute_s_per_token: float | None = None  # recent prefill steps, smoothed
        self._probed: dict[str, tuple[int, int]] = {}  # request -> (preemptions, hit end)
        self._asked: dict[str, list[BlockHash]] = {}  # request -> hashes a load would fetch
        self._loading: dict[str, list[int]] = {}  # request -> blocks its load fills
        self._ready: dict[str, tuple[list[int], list[Any]]] = {}  # landed: blocks, payloads
        self._meta = OffloadMeta()
        self._sent: tuple[OffloadMeta, dict[str, list[Any]]] | None = None
        # worker side
        self.storage: KVStorage | None = None
        self._bound: OffloadMeta | None = None
        self._payloads: dict[str, list[BlockPayload]] = {}
        self._outbox: list[tuple[list[BlockHash], BlockPayload]] = []

    # -- scheduler side: loads ---------------------------------------------------------------
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Blocks a tier holds past the device hits: probed once per admission of a request
        (a request the pool has no room for yet keeps the answer and asks again when next
        considered), weighed right after the probe, whose tier the estimate is for."""
        tiers, kv = self.tiers, self.kv
        assert tiers is not None and kv is not None
        if request.num_preemptions and not tiers.swap_preempted:
            return 0, False
        rid, bs = request.request_id, kv.block_size
        hits = num_computed_tokens // bs
        candidates = kv.tier_candidates(request, hits)
        probed = self._probed.get(rid)
        if probed is None or probed[0] != request.num_preemptions:
            end = hits + tiers.probe(candidates)
            n = min(end - hits, len(candidates))
            if n > 0 and not self._pays(n):
                end = hits
                self.skipped += 1
            self._probed[rid] = (request.num_preemptions, end)
        n = min(self._probed[rid][1] - hits, len(candidates))
        if n <= 0:
            return 0, False
        self._asked[rid] = candidates[:n]
        return n * bs, True

    def update_state_after_alloc(
        self, request: Any, block_ids: list[int], num_external_tokens: int
    ) -> None:
        rid = request.request_id
        self._loading[rid] = list(block_ids)
        self.tiers.start_load(rid, self._asked.pop(rid))

    def take_finished_loads(self, wait: bool = False) -> dict[str, int]:
        """Loads the tier worker finished (or gave up on), their payloads kept for the next
        step's worker side. ``wait``: nothing else can run, so wait a little for one."""
        if not self.tiers.num_loading:
            return {}
        out = {}
        for rid, result in self.tiers.poll_loads(wait=wait).items():
            blocks = self._loading.pop(rid, None)
            if blocks is None:
                continue
            j = result.num_blocks
            if j:
                self._ready[rid] = (blocks[:j], result.payloads)
            out[rid] = j
            # the tiers' answer is used up: no second load for this admission
            self._probed[rid] = (self._probed.get(rid, (0, 0))[0], 0)
        return out

    def cancel_load(self, request: Any) -> None:
        rid = request.request_id
        if self._loading.pop(rid, None) is not None:
            self.tiers.cancel(rid)
        self._ready.pop(rid, None)
        self._asked.pop(rid, None)
        self._probed.pop(rid, None)

    def on_step_done(self, scheduler_output: Any, seconds: float) -> None:
        """A prefill step's seconds per token (an exponential average of recent ones)."""
        pre = scheduler_output.num_prefill_tokens
        if pre < PREFILL_TIMING_MIN_TOKENS:
            return
        per_token = seconds / (pre + scheduler_output.num_decode_tokens)
        old = self.compute_s_per_token
        self.compute_s_per_token = per_token if old is None else old + 0.2 * (per_token - old)

    def _pays(self, n: int) -> bool:
        """Whether loading ``n`` blocks is expected to beat computing their tokens, and to
        land before its deadline (the loads queued before it included)."""
        tiers = self.tiers
        load_s = tiers.load_seconds(n)
        if load_s is None:
            return True
        if tiers.backlog_seconds() + load_s > tiers.load_timeout_s:
            return False  # the request would wait out the deadline, then compute anyway
        if self.compute_s_per_token is None:
            return True
        return load_s <= n * self.kv.block_size * self.compute_s_per_token

    # -- scheduler side: saves ---------------------------------------------------------------
    def on_blocks(self, blocks: StepBlocks) -> None:
        """Evicted blocks (not a failed step's: it may have written them) and blocks that
        reached the write-through-selective hit count go down, unless a tier has them."""
        wants, seen = self.tiers.wants, set()
        for b, h in (*blocks.evicted[blocks.num_restored :], *blocks.hot):
            if b not in seen and wants(h):
                self._meta.saves_before.append((b, h))
                seen.add(b)

    def on_scheduled(self, request: Any, num_new_tokens: int) -> None:
        """Write-through: the blocks this step fills go down after its forward pass, so a
        prefix is below before anything evicts it."""
        if self.tiers.write_through_hits != 0:
            return
        wants = self.tiers.wants
        done = self.kv.blocks_completed_by(request, num_new_tokens)
        self._meta.saves_after += [(b, h) for b, h in done if wants(h)]

    def build_connector_meta(self) -> OffloadMeta | None:
        meta, self._meta = self._meta, OffloadMeta()
        payloads = {}
        for rid, (blocks, loaded) in self._ready.items():
            meta.loads[rid] = blocks
            payloads[rid] = loaded
        self._ready = {}
        self._sent = (meta, payloads)
        if not (meta.saves_before or meta.saves_after or meta.loads):
            return None
        return meta

    def take_worker_payloads(self) -> dict[str, list[Any]] | None:
        return (self._sent[1] or None) if self._sent is not None else None

    def receive_scheduler_payloads(self, payloads: list[tuple[list[BlockHash], Any]]) -> None:
        for hashes, payload in payloads:
            self.tiers.store(hashes, payload)

    def step_failed(self, metadata: Any) -> None:
        """The step's loads are delivered again with the next one (their requests still hold
        their blocks unless they finish: then :meth:`request_finished` drops them); its saves
        are not: the step may have written those blocks."""
        if self._sent is None:
            return
        meta, payloads = self._sent
        for rid, blocks in meta.loads.items():
            self._ready.setdefault(rid, (blocks, payloads[rid]))
        self._sent = None

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict | None]:
        self.cancel_load(request)
        return False, None

    def stats(self) -> dict[str, Any]:
        return {"skipped": self.skipped}

    def shutdown(self) -> None:
        if self.tiers is not None:
            self.tiers.flush(timeout_s=10.0)
            self.tiers.close()

    # -- worker side -------------------------------------------------------------------------
    def register_kv_caches(self, storage: Any) -> None:
        self.storage = storage

    def bind_connector_metadata(self, metadata: Any) -> None:
        self._bound = metadata

    def receive_worker_payloads(self, payloads: Any) -> None:
        self._payloads.update(payloads)

    def save_before_step(self) -> None:
        if self._bound is not None and self._bound.saves_before:
            self._export(self._bound.saves_before)

    def start_load_kv(self) -> None:
        if self._bound is None:
            return
        for rid, ids in self._bound.loads.items():
            at = 0
            for payload in self._payloads.pop(rid):
                self.storage.import_blocks(ids[at : at + payload.num_blocks], payload)
                at += payload.num_blocks

    def wait_for_save(self) -> None:
        if self._bound is not None and self._bound.saves_after:
            self._export(self._bound.saves_after)

    def _export(self, blocks: list[tuple[int, BlockHash]]) -> None:
        ids = [b for b, _ in blocks]
        self._outbox.append(([h for _, h in blocks], self.storage.export_blocks(ids)))

    def num_scheduler_payloads(self) -> int:
        return len(self._outbox)

    def take_scheduler_payloads(self) -> list[tuple[list[BlockHash], BlockPayload]]:
        out, self._outbox = self._outbox, []
        return out

    def clear_connector_metadata(self) -> None:
        self._bound = None
