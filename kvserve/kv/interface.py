"""The scheduler's view of KV memory: one protocol that every KV manager implements.

:class:`~kvserve.kv.manager.KVCacheManager` keeps one block table per request;
:class:`~kvserve.kv.grouped.GroupedKVCacheManager` coordinates one such manager per layer
group of a hybrid model (full and sliding-window layers) over one pool, and reports counts in
model blocks. The scheduler, its policies and the connectors ask only what is listed here, so
either serves them, and a test's fake can stand in for both (``tests/test_scheduler.py``).
Blocks are opaque handles to the caller (``get_computed_blocks`` gives them,
``allocate_slots`` takes them back); block ids in tables are what the workers see.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from kvserve.kv.hashing import BlockHash
from kvserve.kv.ops import KVOps
from kvserve.kv.request_view import KVRequest


@runtime_checkable
class KVManager(Protocol):
    block_size: int
    root: BlockHash  # the prefix-cache namespace: model weights, KV format, block size
    # Write-through-selective: a cached block is reported (KVOps.hot) once it has been hit
    # this many times (0: as soon as it is computed); None: never.
    write_through_hits: int | None

    # -- counts (model blocks) -----------------------------------------------------------------
    @property
    def num_blocks(self) -> int: ...

    @property
    def num_free_blocks(self) -> int: ...

    @property
    def num_used_blocks(self) -> int: ...

    @property
    def num_cached_free_blocks(self) -> int: ...

    @property
    def num_evictions(self) -> int: ...

    @property
    def num_groups(self) -> int:
        """Block tables per request: 1, or a hybrid model's layer groups."""
        ...

    @property
    def stats(self) -> Any: ...  # kvserve.kv.manager.PrefixCacheStats

    def num_held_slots(self, request: KVRequest) -> int: ...

    # -- prefix lookups ------------------------------------------------------------------------
    def block_hashes(self, request: KVRequest) -> list[BlockHash]: ...

    def get_computed_blocks(
        self, request: KVRequest, count: bool = True
    ) -> tuple[Sequence[Any], int]: ...

    def count_hits(self, request: KVRequest, hit: Sequence[Any]) -> None: ...

    def num_cached_prefix_blocks(self, request: KVRequest) -> int: ...

    def cached_share(self, token_ids: Sequence[int], cache_salt: str | None = None) -> float: ...

    def cached_prefix(self, hashes: Sequence[BlockHash]) -> list[int]: ...

    # -- allocation and tables -----------------------------------------------------------------
    def allocate_slots(
        self,
        request: KVRequest,
        num_new_tokens: int,
        computed: Sequence[Any] = (),
        compact_blocks: int = 0,
    ) -> bool: ...

    def block_ids(self, request: KVRequest) -> list[int]: ...

    def group_block_ids(self, request: KVRequest) -> tuple[list[int], ...]:
        """The tables of the layer groups after the first (``()`` with one table)."""
        ...

    def compact_block_ids(self, request: KVRequest) -> list[int]: ...

    def apply_compaction(self, request: KVRequest) -> int: ...

    def fork(self, parent: KVRequest, child: KVRequest) -> None: ...

    def cache_computed_blocks(self, request: KVRequest, num_tokens: int | None = None) -> None: ...

    def free(self, request: KVRequest) -> None: ...

    def drop_leading_blocks(self, request: KVRequest, first_kept: int, head: int = 0) -> int: ...

    def num_dropped_blocks(self, request: KVRequest) -> int: ...

    # -- the step's record ---------------------------------------------------------------------
    def take_ops(self) -> KVOps: ...

    def restore_ops(self, ops: KVOps) -> None: ...

    # -- KV events (kvserve.kv.events) -----------------------------------------------------------
    def enable_events(self, medium: str) -> None: ...

    def take_events(self) -> list[Any]: ...

    # -- connectors ----------------------------------------------------------------------------
    def tier_candidates(self, request: KVRequest, num_hit_blocks: int) -> list[BlockHash]: ...

    def blocks_completed_by(
        self, request: KVRequest, num_new_tokens: int
    ) -> list[tuple[int, BlockHash]]: ...

    # -- bookkeeping ---------------------------------------------------------------------------
    def reset_prefix_cache(self) -> bool: ...

    def check_invariants(self) -> None: ...
