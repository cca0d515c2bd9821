"""Per-layer-group block tables for hybrid models, over one pool (see
:mod:`kvserve.kv.layer_groups`).

:class:`GroupedKVCacheManager` answers the scheduler's questions the way
:class:`~kvserve.kv.manager.KVCacheManager` does, with one ``KVCacheManager`` per layer group
underneath, all drawing on one :class:`~kvserve.kv.block_pool.BlockPool`. Each group keeps its
own table per request, its own copy-on-write and its own prefix-cache entries (the pool's
cache is keyed by the block hash tagged with the group, so one request's chain of hashes
serves every group and two groups never share a block). An allocation is all or nothing
across groups. Before each allocation a window group releases the blocks that no query of
this step or later reaches (entries before ``num_computed_tokens - window + 1``), exactly as
a model whose every layer slides does; the full-attention groups keep their tables, so every
output stays exact.

Block counts it reports are *model blocks* (``block_size`` tokens across every layer: the
pool's group blocks divided by the number of groups), the unit of ``num_gpu_blocks``, of
admission projections and of ``kvserve plan``. Group 0's table stands for the request where
one table is asked for (its prefix hits, its length): it is a full-attention group whenever
the model has full-attention layers.

Not served here (the engine keeps one table for every layer instead): formats
that bound their partially filled blocks (KIVI's residual), offload tiers and prefix export
and import, whose payloads name blocks by one hash chain.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvserve.config import ConfigError
from kvserve.kv.block_pool import BlockPool, KVCacheBlock
from kvserve.kv.hashing import BlockHash
from kvserve.kv.layer_groups import LayerGroups
from kvserve.kv.manager import KVCacheManager
from kvserve.kv.ops import KVOps
from kvserve.kv.request_view import KVRequest


def _one_table() -> RuntimeError:
    return RuntimeError("KV connectors need one block table; start the engine with "
                        "disable_hybrid_kv_cache_manager")  # fmt: skip


class _GroupPool:
    """A group's view of the shared pool: prefix-cache keys carry the group's tag."""

    def __init__(self, pool: BlockPool, group: int) -> None:
        self._pool = pool
        self._tag = b"\0group" + str(group).encode()

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self._pool.get_cached_block(BlockHash(block_hash + self._tag))

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash) -> None:
        self._pool.cache_block(block, BlockHash(block_hash + self._tag))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pool, name)


class GroupHits(list):
    """Group 0's prefix hits (what callers count and measure), with every group's."""

    groups: list[list[KVCacheBlock]]


class GroupedKVCacheManager:
    def __init__(
        self,
        groups: LayerGroups,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        model_id: str = "",
        kv_format: str = "",
    ) -> None:
        """``num_blocks`` model blocks: the pool holds ``num_blocks x num_groups`` group
        blocks, the same bytes."""
        self.groups = groups
        g = groups.num_groups
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks * g, enable_caching)
        self.subs = [
            KVCacheManager(num_blocks * g, block_size, enable_caching, model_id, kv_format,
                           pool=self.pool if i == 0 else _GroupPool(self.pool, i))  # type: ignore[arg-type]
            for i in range(g)
        ]  # fmt: skip
        self.root = self.subs[0].root
        self.null_block = self.subs[0].null_block
        self.max_partial_blocks = None
        self.write_through_hits: int | None = None  # no tiers here (the engine checks)
        self.window_freed_blocks = 0  # group blocks given back behind the windows

    # -- counts, in model blocks ----------------------------------------------------------------
    @property
    def num_groups(self) -> int:
        return len(self.subs)

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks // self.num_groups

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks // self.num_groups

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_free_blocks(self) -> int:
        return self.pool.num_cached_free // self.num_groups

    @property
    def num_evictions(self) -> int:
        return self.pool.num_evictions

    @property
    def num_partial_blocks(self) -> int:
        return 0

    @property
    def stats(self) -> Any:
        return self.subs[0].stats

    def num_allocated_slots(self) -> int:
        return self.num_used_blocks * self.block_size

    def num_held_slots(self, request: KVRequest) -> int:
        return max(sub.num_held_slots(request) for sub in self.subs)

    # -- prefix lookups ---------------------------------------------------------------------------
    def block_hashes(self, request: KVRequest) -> list[BlockHash]:
        return self.subs[0].block_hashes(request)

    def get_computed_blocks(self, request: KVRequest, count: bool = True) -> tuple[GroupHits, int]:
        """The longest prefix every group can serve: a full-attention group needs each of its
        blocks cached, a window group only those the first query after the hit reaches
        (its older entries become null, as if dropped); see ``KVCacheManager``."""
        if not self.enable_caching:
            out = GroupHits()
            out.groups = [[] for _ in self.subs]
            return out, 0
        bs = self.block_size
        hashes = self.block_hashes(request)[: self.subs[0].max_hit_blocks(request)]
        cached = [[sub.pool.get_cached_block(h) for h in hashes] for sub in self.subs]
        k = len(hashes)
        for found, w in zip(cached, self.groups.windows, strict=True):
            if not w:  # every block, from the first
                k = min(k, next((i for i, b in enumerate(found) if b is None), k))
        # run[g][i]: cached blocks of group g in a row ending at block i
        runs = []
        for found in cached:
            run, n = [], 0
            for b in found:
                n = n + 1 if b is not None else 0
                run.append(n)
            runs.append(run)
        while k and not all(
            runs[g][k - 1] >= k - self._first_needed(k, w)
            for g, w in enumerate(self.groups.windows)
        ):
            k -= 1
        groups = []
        for sub, found, w in zip(self.subs, cached, self.groups.windows, strict=True):
            first = self._first_needed(k, w)
            groups.append([sub._null] * first + found[first:k])
        out = GroupHits(groups[0])
        out.groups = groups
        if count:
            self.count_hits(request, out)
        return out, k * bs

    def _first_needed(self, k: int, window: int | None) -> int:
        """The first of ``k`` hit blocks that a window group's next query reaches (0 for a
        full-attention group): the query at entry ``k * block_size`` sees ``window``
        entries up to itself."""
        if not window:
            return 0
        return max(0, k * self.block_size - window + 1) // self.block_size

    def count_hits(self, request: KVRequest, hit: Sequence[KVCacheBlock]) -> None:
        self.subs[0].count_hits(request, hit)

    def num_cached_prefix_blocks(self, request: KVRequest) -> int:
        return len(self.get_computed_blocks(request, count=False)[0])

    def cached_share(self, token_ids: Sequence[int], cache_salt: str | None = None) -> float:
        """Group 0's share (its layers attend every token)."""
        return self.subs[0].cached_share(token_ids, cache_salt)

    def cached_prefix(self, hashes: Sequence[BlockHash]) -> list[int]:
        return self.subs[0].cached_prefix(hashes)

    # -- allocation -------------------------------------------------------------------------------
    @staticmethod
    def _of(computed: Sequence[KVCacheBlock], g: int) -> Sequence[KVCacheBlock]:
        """Group ``g``'s share of hits from :meth:`get_computed_blocks` (blocks of one group
        are never another's)."""
        if isinstance(computed, GroupHits):
            return computed.groups[g]
        assert not computed, "prefix hits must come from get_computed_blocks (one per group)"
        return ()

    def can_allocate(
        self,
        request: KVRequest,
        num_new_tokens: int,
        computed: Sequence[KVCacheBlock] = (),
        compact_blocks: int = 0,
    ) -> bool:
        need, reclaimed = compact_blocks, 0
        for g, sub in enumerate(self.subs):
            hit = self._of(computed, g)
            _, fresh, copies, _ = sub._plan(request, num_new_tokens, hit)
            need += fresh + copies
            reclaimed += sub.num_reclaimed(hit)
        return need <= self.pool.num_free_blocks - reclaimed

    def allocate_slots(
        self,
        request: KVRequest,
        num_new_tokens: int,
        computed: Sequence[KVCacheBlock] = (),
        compact_blocks: int = 0,
    ) -> bool:
        """Every group's slots for ``num_new_tokens``, or False and no table grows; the
        window groups first give back what their windows left behind."""
        self._drop_behind_windows(request)
        if not computed and not compact_blocks:
            if all(sub.fits_in_place(request, num_new_tokens) for sub in self.subs):
                for sub in self.subs:  # the common decode step
                    sub.grow_in_place(request, num_new_tokens)
                return True
        if not self.can_allocate(request, num_new_tokens, computed, compact_blocks):
            return False
        for g, sub in enumerate(self.subs):
            ok = sub.allocate_slots(
                request, num_new_tokens, self._of(computed, g), compact_blocks if g == 0 else 0
            )
            assert ok, f"group {g} could not allocate after the pool said it could"
        return True

    def _drop_behind_windows(self, request: KVRequest) -> None:
        c = request.num_computed_tokens
        for sub, w in zip(self.subs, self.groups.windows, strict=True):
            if w and c >= w:
                self.window_freed_blocks += sub.drop_leading_blocks(request, c - w + 1)

    def compact_block_ids(self, request: KVRequest) -> list[int]:
        return self.subs[0].compact_block_ids(request)

    def apply_compaction(self, request: KVRequest) -> int:
        raise RuntimeError("kv_retention: compaction is refused on models with sliding layers")

    def fork(self, parent: KVRequest, child: KVRequest) -> None:
        for sub in self.subs:
            sub.fork(parent, child)

    def cache_computed_blocks(self, request: KVRequest, num_tokens: int | None = None) -> None:
        for sub in self.subs:
            sub.cache_computed_blocks(request, num_tokens)

    def free(self, request: KVRequest) -> None:
        for sub in self.subs:
            sub.free(request)

    def drop_leading_blocks(self, request: KVRequest, first_kept: int, head: int = 0) -> int:
        """A retention window over every layer (each group drops what it still holds);
        returns group 0's count, the request's view."""
        dropped = [sub.drop_leading_blocks(request, first_kept, head) for sub in self.subs]
        return dropped[0]

    def num_dropped_blocks(self, request: KVRequest) -> int:
        return self.subs[0].num_dropped_blocks(request)

    def block_ids(self, request: KVRequest) -> list[int]:
        """Group 0's table (the manager's own list: read it, do not change it)."""
        return self.subs[0].block_ids(request)

    def group_block_ids(self, request: KVRequest) -> tuple[list[int], ...]:
        """Copies of the tables of groups 1 and on."""
        return tuple(sub.block_ids(request)[:] for sub in self.subs[1:])

    # -- the step's record ------------------------------------------------------------------------
    def take_ops(self) -> KVOps:
        """One record for the step: group 0's (which takes the shared pool's frees and
        evictions) with every other group's copies and fresh blocks added."""
        ops = self.subs[0].take_ops()
        for sub in self.subs[1:]:
            mine, sub._ops = sub._ops, KVOps()
            sub._filling.clear()
            ops.copies += mine.copies
            for rid, ids in mine.new_blocks.items():
                if ids:
                    ops.new_blocks.setdefault(rid, []).extend(ids)
        return ops

    def restore_ops(self, ops: KVOps) -> None:
        self.subs[0].restore_ops(ops)

    def enable_events(self, medium: str) -> None:
        raise ConfigError(
            "kv_events_config: not with per-group block tables (a hybrid sliding-window "
            "model); start the engine with disable_hybrid_kv_cache_manager"
        )

    def take_events(self) -> list[Any]:
        return []

    # -- connectors (not served: a load or store would have to cover every group) ------------------
    def tier_candidates(self, request: KVRequest, num_hit_blocks: int) -> list[BlockHash]:
        raise _one_table()

    def blocks_completed_by(
        self, request: KVRequest, num_new_tokens: int
    ) -> list[tuple[int, BlockHash]]:
        raise _one_table()

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    def check_invariants(self) -> None:
        """Raise if the pool or any group's tables are inconsistent: every block's
        reference count equals its entries across all groups' tables."""
        self.pool.check_invariants()
        refs: dict[int, int] = {}
        for sub in self.subs:
            for b, n in sub.table_refs().items():
                refs[b] = refs.get(b, 0) + n
        for b in self.pool.blocks:
            assert b.ref_cnt == refs.get(b.block_id, 0), f"ref count mismatch on {b}"
