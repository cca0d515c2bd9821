"""All KV blocks, created up front, with reference counts and an O(1) LRU free queue.

A block is *in use* while some request references it (``ref_cnt > 0``). When the last
reference goes it returns to the free queue but keeps its hash, so a later request with the
same prefix can take it back (*cached-free*). It loses its hash only when the queue hands it
out for new content. Conservation: free + cached-free + in-use = total, always.

A freed block that holds nothing cached goes to the head of the queue, not the tail: it is
handed out again before a never-used block and before any cached one. Taking a cached block
instead would throw away a prefix a later request may want, for nothing. Taking a never-used
block means first touching memory the OS has not mapped yet. On a CPU the pool is ordinary
memory that the OS maps on first write (unless ``--kv-cache-prefault`` mapped it all at
start), a 2 MiB huge page at a time, and a virtual machine may compact memory to find one. A
server without prefix caching would otherwise walk through the whole pool, paying those faults
in its steps.

The pool records the two transitions others must hear about, as data: blocks whose last
reference went (``freed``) and cached blocks handed out for new content (``evicted``, with
their hashes). The KV manager drains both into each step's record. With KV events on
(``events`` a list), an eviction is also a ``BlockRemoved`` and a reset ``AllBlocksCleared``
(:mod:`kvserve.kv.events`); the manager adds the ``BlockStored``, which need the tokens.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvserve.kv.events import AllBlocksCleared, KVCacheEvent, removed
from kvserve.kv.hashing import BlockHash


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free", "hits")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.hits = 0  # prefix-cache hits since it was cached (write-through-selective)
        self.block_hash: BlockHash | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        cached = self.block_hash is not None
        return f"KVCacheBlock({self.block_id}, ref={self.ref_cnt}, cached={cached})"


class FreeBlockQueue:
    """Doubly linked list of free blocks: evict from the head, return to either end, and take
    a cached block out of the middle, all in O(1)."""

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.head = KVCacheBlock(-1)
        self.tail = KVCacheBlock(-1)
        self.head.next_free, self.tail.prev_free = self.tail, self.head
        self.num_free = 0
        for b in blocks:
            self.append(b)

    def popleft(self) -> KVCacheBlock:
        block = self.head.next_free
        if block is self.tail or block is None:
            raise IndexError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"{block} is not in the free queue")
        prev.next_free, nxt.prev_free = nxt, prev
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self.tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free, block.next_free = last, self.tail
        self.tail.prev_free = block
        self.num_free += 1

    def appendleft(self, block: KVCacheBlock) -> None:
        first = self.head.next_free
        assert first is not None
        first.prev_free = block
        block.prev_free, block.next_free = self.head, first
        self.head.next_free = block
        self.num_free += 1

    def __iter__(self):
        b = self.head.next_free
        while b is not None and b is not self.tail:
            yield b
            b = b.next_free


class BlockPool:
    """Owns every block; hands out new ones, shares cached ones, and takes them back."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks: must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[BlockHash, KVCacheBlock] = {}
        self.num_cached_free = 0
        self.num_evictions = 0
        self.freed: list[int] = []
        self.evicted: list[tuple[int, BlockHash]] = []
        # KV events since the last take (None: not recorded); ``medium`` names this pool.
        self.events: list[KVCacheEvent] | None = None
        self.medium = "GPU"

    # -- queries ------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (never-used or cached-free)."""
        return self.free_queue.num_free

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.free_queue.num_free

    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached.get(block_hash)

    # -- transitions --------------------------------------------------------------
    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Take ``n`` blocks from the LRU head, evicting any cached content they hold."""
        if n > self.free_queue.num_free:
            raise ValueError(f"cannot allocate {n} blocks, only {self.free_queue.num_free} free")
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Add a reference to each block, taking cached-free ones out of the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
                if block.block_hash is not None:
                    self.num_cached_free -= 1
            block.ref_cnt += 1

    def free_blocks(self, ordered: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block. Cached blocks reaching zero join the LRU tail
        in the given order (callers pass a request's blocks tail first, so its tail is evicted
        first); the others go to the head, to be handed out next (see the module docstring)."""
        for block in ordered:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is not None:
                    self.num_cached_free += 1
                    self.free_queue.append(block)
                else:
                    self.free_queue.appendleft(block)
                self.freed.append(block.block_id)

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash) -> bool:
        """Register a full, computed block under its hash (first writer wins); whether it
        was registered now."""
        if not self.enable_caching or block.block_hash is not None:
            return False
        if block_hash in self.cached:
            return False  # an identical block is already cached; this one stays private
        block.block_hash = block_hash
        self.cached[block_hash] = block
        return True

    def _evict(self, block: KVCacheBlock) -> None:
        """Drop a cached-free block's hash as it is handed out for new content."""
        assert block.block_hash is not None and block.ref_cnt == 0
        if self.cached.get(block.block_hash) is block:
            del self.cached[block.block_hash]
        self.num_cached_free -= 1
        self.num_evictions += 1
        self.evicted.append((block.block_id, block.block_hash))
        if self.events is not None and self.cached.get(block.block_hash) is None:
            removed(self.events, block.block_hash, self.medium)
        block.block_hash = None
        block.hits = 0

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only allowed when no block is in use (as in vLLM)."""
        if self.num_used_blocks:
            return False
        for block in self.cached.values():
            block.block_hash = None
        self.cached.clear()
        self.num_cached_free = 0
        if self.events is not None:
            self.events.append(AllBlocksCleared())
        return True

    def check_invariants(self) -> None:
        """Raise if the pool's bookkeeping is inconsistent (used by tests and debug runs)."""
        in_queue = list(self.free_queue)
        assert len(in_queue) == self.free_queue.num_free
        ids = {b.block_id for b in in_queue}
        assert len(ids) == len(in_queue), "a block is in the free queue twice"
        in_use = [b for b in self.blocks if b.ref_cnt > 0]
        assert all(b.ref_cnt >= 0 for b in self.blocks), "negative ref count"
        assert not ids & {b.block_id for b in in_use}, "an in-use block is in the free queue"
        cached_free = sum(1 for b in in_queue if b.block_hash is not None)
        assert cached_free == self.num_cached_free, (cached_free, self.num_cached_free)
        assert len(in_queue) + len(in_use) == self.num_blocks, "block conservation violated"
        for h, b in self.cached.items():
            assert b.block_hash == h, "hash map disagrees with the block"
