"""What a retention policy asks of each step: chunk boundaries, blocks set aside for a
compaction, blocks released behind a window, and the counters of what was evicted.

The :class:`~kvserve.sched.scheduler.Scheduler` (which owns request state) holds one
:class:`RetentionSteps` and calls it inside ``schedule`` and ``update_from_output``; it works
on the KV manager, the model's own window and the scheduler's counters it is given. It is
apart because it is one concept, retention, that the rest of scheduling never needs to read.
"""

from __future__ import annotations

from kvserve.kv.interface import KVManager
from kvserve.kv.manager import cdiv
from kvserve.sched.request import Request
from kvserve.sched.stats import SchedulerStats


class RetentionSteps:
    def __init__(self, kv: KVManager, native_window: int, stats: SchedulerStats) -> None:
        """``native_window``: every layer's own sliding window (0: the model has
        full-attention layers); blocks behind it are released for every request, exactly."""
        self.kv = kv
        self.native_window = native_window
        self.stats = stats

    def chunk(self, req: Request, n: int, hit: int = 0) -> int:
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

    def compact_blocks(self, req: Request, n: int, hit: int = 0) -> int:
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

    def retain(self, req: Request) -> None:
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
            self.evicted(req, key, n * self.kv.block_size, n)

    def evicted(self, req: Request, key: str, tokens: int, blocks: int) -> None:
        """Count tokens a retention policy (``key``) evicted and the blocks it reclaimed."""
        ev = self.stats.retention_evicted_tokens
        ev[key] = ev.get(key, 0) + tokens
        self.stats.retention_reclaimed_blocks += blocks
        req.num_evicted_tokens += tokens

    def compacted(self, req: Request) -> None:
        """The runner copied the kept entries into the set-aside blocks: switch tables."""
        spec = req.retention
        blocks = self.kv.apply_compaction(req)
        dropped = req.num_cache_entries - spec.num_kept
        req.cache_offset += dropped
        self.evicted(req, spec.metric_label, dropped, blocks)
