"""Per-request block tables on top of the block pool: the scheduler's only view of KV memory.

The scheduler asks a few questions: what prefix of this request is already cached
(:meth:`get_computed_blocks`, :meth:`num_cached_prefix_blocks`), can these new tokens get
slots (:meth:`allocate_slots`, which says no rather than over-commit), and free this request
(:meth:`free`). Blocks are registered in the prefix cache only after the step that computed
them (:meth:`cache_computed_blocks`), so a request preempted before its forward pass can never
publish an unwritten block. What the manager did to blocks is recorded as data
(:meth:`take_ops`) for the runner and anyone else who needs it; nothing outside this package
touches the pool.

A retention policy drops blocks from the front of a table, or after its first sink blocks
(:meth:`drop_leading_blocks`): the dropped entries become the storage's null block, so cache
entry ``j`` still lives in table entry ``j // block_size``, and the blocks are released like any
other (cached-free if they hold a prefix). A compacting policy (SnapKV) instead asks for fresh
blocks beside the chunk that ends the prompt (``allocate_slots(..., compact_blocks=n)``); the
runner copies the kept entries into them during that step and :meth:`apply_compaction` then
makes them the request's table and releases the old one. Block math follows the request's
cache entries (``num_cache_entries``), not its computed tokens.

A storage format may bound how many blocks can be *partially filled* at once (KIVI keeps them
in a fixed full-precision residual): ``max_partial_blocks``. The manager counts such blocks
and refuses an allocation that would exceed the bound, as it refuses one that needs more
blocks than are free. The count is conservative within a step: a block that fills this step
(or a copy-on-write copy) still holds its slot until the step's writes, so it is released from
the count only when the step's record is taken.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvserve.kv.block_pool import BlockPool, KVCacheBlock
from kvserve.kv.events import BlockStored, KVCacheEvent
from kvserve.kv.hashing import BlockHash, extend_block_hashes, root_hash
from kvserve.kv.ops import KVOps
from kvserve.kv.request_view import KVRequest


def chain_salt(request: KVRequest) -> str | None:
    """What a request's first block hash folds in: its cache salt (the tenant's), and its
    retention policy's, whose K/V differ from the exact ones (a chain of its own)."""
    salt = request.cache_salt
    policy = request.retention.salt if request.retention is not None else None
    if policy is not None:
        salt = f"{salt or ''}\0{policy}"
    return salt


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(slots=True)
class PrefixImport:
    """Blocks reserved for a prefix import: fresh ones to fill (block, hash, index in the
    chain) and cached ones held until the import is published."""

    new: list[tuple[KVCacheBlock, BlockHash, int]] = field(default_factory=list)
    held: list[KVCacheBlock] = field(default_factory=list)

    @property
    def block_ids(self) -> list[int]:
        return [b.block_id for b, _, _ in self.new]

    @property
    def indices(self) -> list[int]:
        return [i for _, _, i in self.new]


@dataclass(slots=True)
class PrefixCacheStats:
    """Counters (never ratios): tokens looked up and tokens found, per request admission."""

    queries: int = 0
    hits: int = 0
    requests: int = 0


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        model_id: str = "",
        kv_format: str = "",
        max_partial_blocks: int | None = None,
        pool: BlockPool | None = None,
    ) -> None:
        """``pool``: blocks shared with other managers (a hybrid model's layer groups,
        :mod:`kvserve.kv.grouped`); by default a pool of ``num_blocks`` of its own."""
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = pool if pool is not None else BlockPool(num_blocks, enable_caching)
        self.root = root_hash(model_id, kv_format)
        # The storage's reserved padding block: one past the last real block, never handed out.
        # Its handle stands in a table for the blocks a retention policy dropped.
        self.null_block = num_blocks
        self._null = KVCacheBlock(num_blocks)
        # request id -> the table entries [lo, hi) a retention policy dropped
        self._dropped: dict[str, tuple[int, int]] = {}
        self.max_partial_blocks = max_partial_blocks
        self.req_blocks: dict[str, list[KVCacheBlock]] = {}
        self._block_ids: dict[str, list[int]] = {}  # the same tables as ints, for the runner
        self.num_cached_blocks: dict[str, int] = {}
        self.stats = PrefixCacheStats()
        self._ops = KVOps()
        self._partial: set[int] = set()  # referenced blocks filled in (0, block_size)
        self._filling: set[int] = set()  # blocks that fill (or were copied) this step
        self._compact: dict[str, list[KVCacheBlock]] = {}  # fresh blocks a compaction fills
        self._restored_evictions = 0  # leading evictions of the record a failed step's
        # Write-through-selective (SGLang's policy): a cached block is reported in the
        # record's ``hot`` once it has been hit this many times; None or 0: never (0, write
        # through, stores blocks as they are computed: see blocks_completed_by).
        self.write_through_hits: int | None = None
        self._write_through: list[tuple[int, BlockHash]] = []

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_used_blocks

    @property
    def num_cached_free_blocks(self) -> int:
        return self.pool.num_cached_free

    @property
    def num_evictions(self) -> int:
        return self.pool.num_evictions

    @property
    def num_partial_blocks(self) -> int:
        return len(self._partial) + len(self._filling)

    @property
    def num_groups(self) -> int:
        return 1

    # -- prefix lookups ----------------------------------------------------------------------
    def block_hashes(self, request: KVRequest) -> list[BlockHash]:
        extend_block_hashes(
            request.block_hashes,
            request.all_token_ids,
            self.block_size,
            self.root,
            chain_salt(request),
        )
        return request.block_hashes

    def get_computed_blocks(
        self, request: KVRequest, count: bool = True
    ) -> tuple[list[KVCacheBlock], int]:
        """The longest chain of cached full blocks that prefixes the request (opaque handles
        to pass back to :meth:`allocate_slots`), and its length in tokens. ``count=False``
        only looks (an admission that may not happen this step): :meth:`count_hits` then
        counts the lookup once the request is admitted.

        At least one token is always left to compute: the model must produce logits for the
        last token, so a fully cached prompt stops one block short.
        """
        if not self.enable_caching:
            return [], 0
        hit: list[KVCacheBlock] = []
        for h in self.block_hashes(request)[: self.max_hit_blocks(request)]:
            block = self.pool.get_cached_block(h)
            if block is None:
                break
            hit.append(block)
        if count:
            self.count_hits(request, hit)
        return hit, len(hit) * self.block_size

    def max_hit_blocks(self, request: KVRequest) -> int:
        """The most leading blocks a prefix hit may cover: one token is always left to
        compute, and SnapKV computes its observation window itself."""
        limit = request.num_tokens - 1
        if request.compaction_pending:
            limit = min(limit, request.num_prompt_tokens - request.retention.obs)
        return limit // self.block_size

    def count_hits(self, request: KVRequest, hit: Sequence[KVCacheBlock]) -> None:
        """Count one admission's prefix lookup (and the hits write-through-selective counts)."""
        if self.write_through_hits:
            for block in hit:
                block.hits += 1
                if block.hits == self.write_through_hits:
                    self._write_through.append((block.block_id, block.block_hash))
        self.stats.requests += 1
        self.stats.queries += request.num_tokens
        self.stats.hits += len(hit) * self.block_size

    def num_cached_prefix_blocks(self, request: KVRequest) -> int:
        """How many leading full blocks of the request are cached now (no stats counted)."""
        return len(self.cached_prefix(self.block_hashes(request)))

    def cached_share(self, token_ids: Sequence[int], cache_salt: str | None = None) -> float:
        """The fraction of ``token_ids`` whose full blocks are cached now, in the request's
        plain chain (no retention salt): what a workload class's ``prefix_share`` matches."""
        if not self.enable_caching or not token_ids:
            return 0.0
        hashes: list[BlockHash] = []
        extend_block_hashes(hashes, list(token_ids), self.block_size, self.root, cache_salt)
        return len(self.cached_prefix(hashes)) * self.block_size / len(token_ids)

    def cached_prefix(self, hashes: Sequence[BlockHash]) -> list[int]:
        """Block ids of the longest cached chain along ``hashes``."""
        out = []
        for h in hashes:
            block = self.pool.get_cached_block(h)
            if block is None:
                break
            out.append(block.block_id)
        return out

    # -- allocation --------------------------------------------------------------------------
    def _plan(
        self, request: KVRequest, num_new_tokens: int, computed: Sequence[KVCacheBlock]
    ) -> tuple[int, int, int, int]:
        """(first block index written, new blocks needed, shared blocks to copy, growth of
        the partial-block count)."""
        blocks = self.req_blocks.get(request.request_id, ())
        bs = self.block_size
        done = request.num_cache_entries + len(computed) * bs
        end = done + num_new_tokens
        first = done // bs
        have = len(blocks) + len(computed)
        need = max(cdiv(end, bs) - have, 0)
        copies = sum(1 for b in blocks[first:] if b.ref_cnt > 1)
        # A copy holds a partial slot this step; so does a new block the write leaves partial.
        partial = copies + (1 if need and end % bs else 0)
        return first, need, copies, partial

    def can_allocate(
        self,
        request: KVRequest,
        num_new_tokens: int,
        computed: Sequence[KVCacheBlock] = (),
        compact_blocks: int = 0,
    ) -> bool:
        _, need, copies, partial = self._plan(request, num_new_tokens, computed)
        free = self.pool.num_free_blocks - self.num_reclaimed(computed)
        if need + copies + compact_blocks > free:
            return False
        cap = self.max_partial_blocks
        return cap is None or self.num_partial_blocks + partial <= cap

    def num_reclaimed(self, computed: Sequence[KVCacheBlock]) -> int:
        """Prefix hits that sit in the free queue now (cached-free): taking them leaves fewer
        blocks free (null entries of a window group's hit are no blocks)."""
        return sum(1 for b in computed if b.ref_cnt == 0 and b is not self._null)

    def allocate_slots(
        self,
        request: KVRequest,
        num_new_tokens: int,
        computed: Sequence[KVCacheBlock] = (),
        compact_blocks: int = 0,
    ) -> bool:
        """Make room for ``num_new_tokens`` after the computed prefix, or return False and
        change nothing. ``computed`` are prefix-cache hits from :meth:`get_computed_blocks`;
        ``compact_blocks`` fresh blocks more are set aside for a compaction this step
        (:meth:`compact_block_ids`).

        A block shared with another request (after :meth:`fork`) that this request is about
        to write into is first replaced by a private copy (copy-on-write); the copy itself is
        recorded for the runner to apply before the forward pass.
        """
        if num_new_tokens == 1 and not computed and not compact_blocks:
            # Most steps of a decode: one token into the private, partial last block leaves
            # every count as it is (checked inline: this runs per request per step).
            blocks = self.req_blocks.get(request.request_id)
            done = request.num_computed_tokens - request.cache_offset
            bs = self.block_size
            if (
                blocks
                and done % bs
                and (done + 1) % bs
                and len(blocks) == done // bs + 1
                and blocks[-1].ref_cnt == 1
            ):
                return True
        if not computed and not compact_blocks and self.fits_in_place(request, num_new_tokens):
            # The common decode step: the tokens fit the table's last, private block.
            self.grow_in_place(request, num_new_tokens)
            return True
        rid = request.request_id
        done = request.num_cache_entries
        if not self.can_allocate(request, num_new_tokens, computed, compact_blocks):
            return False
        first, need, _, _ = self._plan(request, num_new_tokens, computed)
        blocks = self.req_blocks.setdefault(rid, [])
        ids = self._block_ids.setdefault(rid, [])
        new = self._ops.new_blocks.setdefault(rid, [])
        if computed:
            # A window layer group's hit may start with null entries: blocks no query of the
            # request reaches (kvserve.kv.grouped); they count as dropped from the start.
            skip = 0
            while skip < len(computed) and computed[skip] is self._null:
                skip += 1
            if skip:
                assert not blocks, f"{rid}: null hits only start a table"
                self._dropped[rid] = (0, skip)
            self.pool.touch(computed[skip:])
            blocks.extend(computed)
            ids.extend(b.block_id for b in computed)
            self.num_cached_blocks[rid] = len(blocks)
        copied: set[int] = set()
        for i in range(first, len(blocks)):
            if blocks[i].ref_cnt > 1:
                (fresh,) = self.pool.get_new_blocks(1)
                self.pool.free_blocks([blocks[i]])
                self._ops.copies.append((blocks[i].block_id, fresh.block_id))
                blocks[i], ids[i] = fresh, fresh.block_id
                new.append(fresh.block_id)
                copied.add(fresh.block_id)
        if need:
            fresh_blocks = self.pool.get_new_blocks(need)
            blocks.extend(fresh_blocks)
            ids.extend(b.block_id for b in fresh_blocks)
            new.extend(b.block_id for b in fresh_blocks)
        self._track_partial(ids, done + len(computed) * self.block_size, num_new_tokens, copied)
        if compact_blocks:
            assert rid not in self._compact, f"{rid}: a compaction is already set aside"
            staged = self.pool.get_new_blocks(compact_blocks)
            self._compact[rid] = staged
            new.extend(b.block_id for b in staged)
        return True

    def fits_in_place(self, request: KVRequest, num_new_tokens: int) -> bool:
        """Whether the tokens fit the blocks the request already holds, none of them shared
        (no new block, no copy): then an allocation only counts partial blocks."""
        blocks = self.req_blocks.get(request.request_id)
        done = request.num_cache_entries
        if not blocks or done + num_new_tokens > len(blocks) * self.block_size:
            return False
        first, last = done // self.block_size, len(blocks) - 1
        return blocks[last].ref_cnt == 1 and (
            first == last or all(b.ref_cnt == 1 for b in blocks[first:last])
        )

    def grow_in_place(self, request: KVRequest, num_new_tokens: int) -> None:
        """Allocate tokens that :meth:`fits_in_place` said fit: only partial blocks change."""
        ids = self._block_ids[request.request_id]
        self._track_partial(ids, request.num_cache_entries, num_new_tokens, ())

    def compact_block_ids(self, request: KVRequest) -> list[int]:
        """The fresh blocks set aside for the request's compaction this step ([] if none)."""
        return [b.block_id for b in self._compact.get(request.request_id, ())]

    def apply_compaction(self, request: KVRequest) -> int:
        """After the step that filled them: the set-aside blocks become the request's table
        and its old blocks are released (cached-free where they hold a published prefix);
        nothing of the request is published after this. Returns the blocks released net."""
        rid = request.request_id
        staged = self._compact.pop(rid)
        old = self.req_blocks[rid]
        self.req_blocks[rid] = staged
        self._block_ids[rid] = [b.block_id for b in staged]
        self._dropped.pop(rid, None)
        self.num_cached_blocks[rid] = len(staged)
        self._release([b for b in reversed(old) if b is not self._null])
        return len(old) - len(staged)

    def _track_partial(
        self, ids: list[int], done: int, n: int, copied: set[int] | tuple[()]
    ) -> None:
        """Blocks the write leaves partial join the count; blocks it fills leave it when the
        step's record is taken (they, and copies, hold a slot until the step's writes)."""
        bs = self.block_size
        end = done + n
        if n == 1 and (end % bs) and done % bs:  # one more token in a partial block
            return
        for i in range(done // bs, cdiv(end, bs)):
            b = ids[i]
            if (i + 1) * bs > end:
                self._partial.add(b)
            elif b in self._partial or b in copied:
                self._partial.discard(b)
                self._filling.add(b)

    def fork(self, parent: KVRequest, child: KVRequest) -> None:
        """Share all of the parent's blocks with a child (parallel sampling); shared blocks
        that are still being written are copied on the child's or parent's next write."""
        blocks = self.req_blocks[parent.request_id]
        self.pool.touch(b for b in blocks if b is not self._null)
        self.req_blocks[child.request_id] = list(blocks)
        if parent.request_id in self._dropped:
            self._dropped[child.request_id] = self._dropped[parent.request_id]
        self._block_ids[child.request_id] = list(self._block_ids[parent.request_id])
        self.num_cached_blocks[child.request_id] = self.num_cached_blocks.get(parent.request_id, 0)

    def cache_computed_blocks(self, request: KVRequest, num_tokens: int | None = None) -> None:
        """Publish the request's full blocks whose K/V have been computed: those of its
        first ``num_tokens`` tokens (None: ``num_computed_tokens``; under async scheduling
        that count includes a step still in flight, whose blocks are not written yet)."""
        done = request.num_computed_tokens if num_tokens is None else num_tokens
        full = done // self.block_size
        if full <= self.num_cached_blocks.get(request.request_id, 0):
            return  # the common decode step: no block filled since the last call
        n_full, unpublished = self._unpublished(request, done)
        if self.pool.events is None:
            for _, block, h in unpublished:
                self.pool.cache_block(block, h)
        else:
            self._cache_and_record(request, unpublished)
        if n_full > self.num_cached_blocks.get(request.request_id, 0):
            self.num_cached_blocks[request.request_id] = n_full

    def _cache_and_record(
        self, request: KVRequest, unpublished: list[tuple[int, KVCacheBlock, BlockHash]]
    ) -> None:
        """Cache the blocks and record a ``BlockStored`` per run of consecutive chain blocks
        that were registered now (a block whose twin is already cached stays private)."""
        events = self.pool.events
        assert events is not None
        run: list[int] = []
        for i, block, h in unpublished:
            if self.pool.cache_block(block, h):
                if run and run[-1] != i - 1:
                    events.append(self._stored(request, run))
                    run = []
                run.append(i)
        if run:
            events.append(self._stored(request, run))

    def _stored(self, request: KVRequest, run: list[int]) -> BlockStored:
        hashes, bs, lo = request.block_hashes, self.block_size, run[0]
        extra: list[tuple | None] | None = None
        salt = chain_salt(request)
        if lo == 0 and salt is not None:
            extra = [(salt,)] + [None] * (len(run) - 1)
        return BlockStored(
            block_hashes=[hashes[i] for i in run],
            parent_block_hash=hashes[lo - 1] if lo else None,
            token_ids=list(request.all_token_ids[lo * bs : (run[-1] + 1) * bs]),
            block_size=bs,
            lora_id=None,
            medium=self.pool.medium,
            extra_keys=extra,
        )

    def enable_events(self, medium: str) -> None:
        """Record KV events (:mod:`kvserve.kv.events`) for :meth:`take_events`."""
        self.pool.events, self.pool.medium = [], medium

    def take_events(self) -> list[KVCacheEvent]:
        """The events since the last call ([] when not recording)."""
        events = self.pool.events
        if not events:
            return []
        self.pool.events = []
        return events

    def _unpublished(
        self, request: KVRequest, num_tokens: int
    ) -> tuple[int, list[tuple[int, KVCacheBlock, BlockHash]]]:
        """The full blocks the request's first ``num_tokens`` tokens fill and that it has not
        published yet (index in the chain, block, hash), and how many full blocks that is in
        all. A compacted cache is nobody's prefix; a dropped block was published before it
        went."""
        blocks = self.req_blocks.get(request.request_id)
        if not self.enable_caching or not blocks or request.cache_offset:
            return 0, []
        n_full = min(num_tokens // self.block_size, len(blocks))
        start = self.num_cached_blocks.get(request.request_id, 0)
        if n_full <= start:
            return n_full, []
        hashes = self.block_hashes(request)
        return n_full, [(i, blocks[i], hashes[i]) for i in range(start, n_full)
                        if blocks[i] is not self._null]  # fmt: skip

    def free(self, request: KVRequest) -> None:
        """Release the request's blocks, tail first so its tail is evicted first."""
        rid = request.request_id
        blocks = self.req_blocks.pop(rid, None)
        self._block_ids.pop(rid, None)
        self.num_cached_blocks.pop(rid, None)
        self._dropped.pop(rid, None)
        self._release(self._compact.pop(rid, []))
        if blocks:
            self._release([b for b in reversed(blocks) if b is not self._null])

    def _release(self, blocks: list[KVCacheBlock]) -> None:
        self.pool.free_blocks(blocks)
        for b in blocks:
            if b.ref_cnt == 0:
                self._partial.discard(b.block_id)
                self._filling.discard(b.block_id)

    def drop_leading_blocks(self, request: KVRequest, first_kept: int, head: int = 0) -> int:
        """Release the request's blocks that hold only cache entries in ``[head, first_kept)``
        (a retention window that no future query reaches back past, after ``head`` sink
        entries that stay); their table entries become the null block. Returns how many
        blocks were dropped."""
        rid = request.request_id
        blocks = self.req_blocks.get(rid)
        if not blocks:
            return 0
        bs = self.block_size
        lo = cdiv(head, bs)
        start = max(self._dropped.get(rid, (lo, lo))[1], lo)
        end = min(first_kept // bs, len(blocks))
        if end <= start:
            return 0
        gone = blocks[start:end]
        ids = self._block_ids[rid]
        for i in range(start, end):
            blocks[i], ids[i] = self._null, self.null_block
        self._dropped[rid] = (self._dropped.get(rid, (start, start))[0], end)
        # Oldest first to the LRU tail: the oldest of them is the first evicted.
        self._release(gone)
        return end - start

    def num_dropped_blocks(self, request: KVRequest) -> int:
        lo, hi = self._dropped.get(request.request_id, (0, 0))
        return hi - lo

    def block_ids(self, request: KVRequest) -> list[int]:
        """The request's block table (the manager's own list: read it, do not change it)."""
        return self._block_ids.get(request.request_id, [])

    def group_block_ids(self, request: KVRequest) -> tuple[list[int], ...]:
        return ()

    def num_held_slots(self, request: KVRequest) -> int:
        held = len(self.req_blocks.get(request.request_id, ())) - self.num_dropped_blocks(request)
        return held * self.block_size

    def take_ops(self) -> KVOps:
        """The block operations since the last call; starts a new record. Called once per
        scheduling step: blocks that filled during it stop counting as partial now."""
        ops, self._ops = self._ops, KVOps()
        ops.freed, self.pool.freed = self.pool.freed, []
        ops.evicted, self.pool.evicted = self.pool.evicted, []
        ops.num_restored_evictions = self._restored_evictions
        if self._write_through:
            # A block still holding the hash it was queued with has its bytes unchanged (a
            # block is written only after it is handed out again, which drops the hash).
            blocks = self.pool.blocks
            ops.hot = [(b, h) for b, h in self._write_through if blocks[b].block_hash == h]
        self._write_through = []
        self._restored_evictions = 0
        ops.new_blocks = {rid: b for rid, b in ops.new_blocks.items() if b}
        self._filling.clear()
        return ops

    def restore_ops(self, ops: KVOps) -> None:
        """Put back the frees and evictions of a record the runner may not have applied (its
        step failed): they are delivered again, first, with the next record. Releasing a freed
        block twice is harmless; the copies of a failed step concern only its own requests.
        The evictions come back marked as restored: a connector must not store them."""
        self.pool.freed[:0] = ops.freed
        self.pool.evicted[:0] = ops.evicted
        self._restored_evictions += len(ops.evicted)

    # -- tier loads --------------------------------------------------------------------------
    def tier_candidates(self, request: KVRequest, num_hit_blocks: int) -> list[BlockHash]:
        """The request's block hashes after its ``num_hit_blocks`` device hits, up to the same
        limit as a device hit (one token always left to compute): what a tier may hold."""
        return self.block_hashes(request)[num_hit_blocks : self.max_hit_blocks(request)]

    def blocks_completed_by(
        self, request: KVRequest, num_new_tokens: int
    ) -> list[tuple[int, BlockHash]]:
        """The blocks (id, hash) that the step computing ``num_new_tokens`` more of the
        request fills and that it will publish (write-through stores them after the step's
        forward pass, so a prefix is below before anything evicts it)."""
        _, blocks = self._unpublished(request, request.num_computed_tokens + num_new_tokens)
        return [(b.block_id, h) for _, b, h in blocks]

    # -- moving cached prefixes between pools ------------------------------------------------
    def reserve_for_import(self, hashes: Sequence[BlockHash]) -> PrefixImport:
        """Fresh blocks for the ``hashes`` this cache lacks, in chain order, stopping when no
        block is free; the blocks of the chain it already has are held meanwhile, so making
        room never evicts them. The caller writes the fresh blocks' bytes, then calls
        :meth:`publish_import` (or :meth:`cancel_import` on failure)."""
        imp = PrefixImport()
        for i, h in enumerate(hashes):
            block = self.pool.get_cached_block(h)
            if block is not None:
                self.pool.touch([block])
                imp.held.append(block)
                continue
            if self.pool.num_free_blocks == 0:
                break
            (block,) = self.pool.get_new_blocks(1)
            imp.new.append((block, h, i))
        return imp

    def take_evictions(self, block_ids: Sequence[int]) -> list[tuple[int, BlockHash]]:
        """Take the recorded evictions of ``block_ids`` out of the next record (an import is
        about to overwrite them now, not in a step: the caller stores them first)."""
        ids = set(block_ids)
        restored = self.pool.evicted[: self._restored_evictions]
        self._restored_evictions -= sum(1 for e in restored if e[0] in ids)
        mine = [e for e in self.pool.evicted[len(restored) :] if e[0] in ids]
        self.pool.evicted = [e for e in self.pool.evicted if e[0] not in ids]
        return mine  # a failed step's evictions are never stored: it may have written them

    def publish_import(self, imp: PrefixImport) -> None:
        """Register imported blocks under their hashes and leave every block cached-free."""
        stored = [h for block, h, _ in imp.new if self.pool.cache_block(block, h)]
        if stored and self.pool.events is not None:  # known by hash only, as a tier's
            self.pool.events.append(
                BlockStored(stored, None, [], self.block_size, None, self.pool.medium)
            )
        self.cancel_import(imp)

    def cancel_import(self, imp: PrefixImport) -> None:
        self.pool.free_blocks(reversed([*imp.held, *(b for b, _, _ in imp.new)]))

    # -- bookkeeping ----------------------------------------------------------------------------
    def num_allocated_slots(self) -> int:
        return self.pool.num_used_blocks * self.block_size

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    def check_invariants(self) -> None:
        """Raise if the pool or the tables are inconsistent (free + cached-free + in-use =
        total, reference counts equal table entries, int tables mirror block tables)."""
        self.pool.check_invariants()
        refs = self.table_refs()
        for b in self.pool.blocks:
            assert b.ref_cnt == refs.get(b.block_id, 0), f"ref count mismatch on {b}"
        for b in self._partial | self._filling:
            assert self.pool.blocks[b].ref_cnt > 0, f"freed block {b} counted as partial"
        if self.max_partial_blocks is not None:
            assert self.num_partial_blocks <= self.max_partial_blocks, "partial blocks"

    def table_refs(self) -> dict[int, int]:
        """References to each block from this manager's tables and set-aside compaction
        blocks, after checking that the tables are well formed."""
        refs: dict[int, int] = {}
        for rid, blocks in self.req_blocks.items():
            assert self._block_ids[rid] == [b.block_id for b in blocks], f"table of {rid}"
            lo, hi = self._dropped.get(rid, (0, 0))
            for i, b in enumerate(blocks):
                assert (b is self._null) == (lo <= i < hi), f"dropped entries of {rid}"
                if b is not self._null:
                    refs[b.block_id] = refs.get(b.block_id, 0) + 1
        for staged in self._compact.values():
            for b in staged:
                refs[b.block_id] = refs.get(b.block_id, 0) + 1
        return refs
