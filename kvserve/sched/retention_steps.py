"""What a retention policy asks of each step: chunk boundaries, blocks set aside for a
compaction, blocks released behind a window, and the counters of what was evicted.

A mixin of :class:`~kvserve.sched.scheduler.Scheduler` (which owns request state): these run inside
its ``schedule`` and ``update_from_output`` and use its KV manager, the model's own window
and its stats. They are apart because they are one concept, retention, that the rest of
scheduling never needs to read.
"""

from __future__ import annotations

from typing import Any

from kvserve.kv.manager import KVCacheManager, cdiv
from kvserve.sched.request import Request


class RetentionSteps:
    kv: KVCacheManager
    native_window: int
    stats: Any  # kvserve.sched.scheduler.SchedulerStats

    def _chunk(self, req: Request, n: int, hit: int = 0) -> int:
        """The tokens ``req`` computes this step out of ``n`` offered: a prompt that SnapKV
        compacts ends in a chunk of its own that holds the whole observation window (0: wait
        for a step with more budget)."""
        if not req.compaction_pending:
            return n
        c, p = req.num_computed_tokens + hit, req.num_prompt_tokens
        if c >= p:
            return n
        if c + n >= p:
            return p - c
        return min(n, p - req.retention.obs - c)

    def _compact_blocks(self, req: Request, n: int, hit: int = 0) -> int:
        """Fresh blocks for the entries a compaction keeps, when this step compacts: SnapKV
        in the chunk that ends the prompt, H2O whenever the step would leave more than its
        budget plus a block of entries."""
        spec, bs = req.retention, self.kv.block_size
        if spec is None or not spec.compacts:
            return 0
        if spec.observes:
            compacts = req.num_cache_entries + n > spec.budget + bs
        else:
            compacts = (
                req.compaction_pending
                and req.num_computed_tokens + hit + n == req.num_prompt_tokens
            )
        return cdiv(spec.num_kept, bs) if compacts else 0

    def _retain(self, req: Request) -> None:
        """Release the blocks no query of this step or later can reach (a retention window
        or the model's own): queries start at cache entry ``num_computed_tokens`` and see the
        ``window`` entries up to themselves."""
        spec = req.retention
        w = spec.window if spec is not None else self.native_window
        if not w or req.num_computed_tokens < w:
            return
        sinks = spec.sinks if spec is not None else 0
        n = self.kv.drop_leading_blocks(req, req.num_computed_tokens - w + 1, sinks)
        if n:
            key = spec.metric_label if spec is not None else "sliding_window"
            self._evicted(req, key, n * self.kv.block_size, n)

    def _evicted(self, req: Request, key: str, tokens: int, blocks: int) -> None:
        """Count tokens a retention policy (``key``) evicted and the blocks it reclaimed."""
        ev = self.stats.retention_evicted_tokens
        ev[key] = ev.get(key, 0) + tokens
        self.stats.retention_reclaimed_blocks += blocks
        req.num_evicted_tokens += tokens

    def _compacted(self, req: Request) -> None:
        """The runner copied the kept entries into the set-aside blocks: switch tables."""
        spec = req.retention
        blocks = self.kv.apply_compaction(req)
        dropped = req.num_cache_entries - spec.num_kept
        req.cache_offset += dropped
        self._evicted(req, spec.metric_label, dropped, blocks)
