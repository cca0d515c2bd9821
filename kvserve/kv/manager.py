"""Per-request block tables on top of the block pool: the scheduler's only view of KV memory.

The scheduler asks three questions: what prefix of this request is already cached
(:meth:`get_computed_blocks`), can these new tokens get slots (:meth:`allocate_slots`, which
says no rather than over-commit), and free this request (:meth:`free`). Blocks are registered
in the prefix cache only after the step that computed them (:meth:`cache_computed_blocks`),
so a request preempted before its forward pass can never publish an unwritten block.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvserve.kv.block_pool import BlockPool, KVCacheBlock
from kvserve.kv.hashing import BlockHash, extend_block_hashes, root_hash
from kvserve.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


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
    ) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.root = root_hash(model_id, kv_format)
        self.req_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}
        self.stats = PrefixCacheStats()
        # (src_block_id, dst_block_id) copies the runner must apply before the next forward.
        self.pending_copies: list[tuple[int, int]] = []

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def block_hashes(self, request: Request) -> list[BlockHash]:
        extend_block_hashes(
            request.block_hashes,
            request.all_token_ids,
            self.block_size,
            self.root,
            request.cache_salt,
        )
        return request.block_hashes

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest chain of cached full blocks that prefixes the request.

        At least one token is always left to compute: the model must produce logits for the
        last token, so a fully cached prompt stops one block short.
        """
        if not self.enable_caching:
            return [], 0
        hashes = self.block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hit: list[KVCacheBlock] = []
        for h in hashes[:max_blocks]:
            block = self.pool.get_cached_block(h)
            if block is None:
                break
            hit.append(block)
        self.stats.requests += 1
        self.stats.queries += request.num_tokens
        self.stats.hits += len(hit) * self.block_size
        return hit, len(hit) * self.block_size

    def _plan(
        self, request: Request, num_new_tokens: int, computed: Sequence[KVCacheBlock]
    ) -> tuple[int, int, int]:
        """(first block index written, new blocks needed, shared blocks to copy)."""
        blocks = self.req_blocks.get(request.request_id, ())
        done = request.num_computed_tokens + len(computed) * self.block_size
        first = done // self.block_size
        need = cdiv(done + num_new_tokens, self.block_size) - len(blocks) - len(computed)
        copies = sum(1 for b in blocks[first:] if b.ref_cnt > 1)
        return first, max(need, 0), copies

    def can_allocate(
        self, request: Request, num_new_tokens: int, computed: Sequence[KVCacheBlock] = ()
    ) -> bool:
        _, need, copies = self._plan(request, num_new_tokens, computed)
        reclaimed = sum(1 for b in computed if b.ref_cnt == 0)
        return need + copies <= self.pool.num_free_blocks - reclaimed

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed: Sequence[KVCacheBlock] = ()
    ) -> bool:
        """Make room for ``num_new_tokens`` after the computed prefix, or return False and
        change nothing. ``computed`` are prefix-cache hits from :meth:`get_computed_blocks`.

        A block shared with another request (after :meth:`fork`) that this request is about
        to write into is first replaced by a private copy (copy-on-write); the copy itself is
        queued in ``pending_copies`` for the runner to apply before the forward pass.
        """
        if not self.can_allocate(request, num_new_tokens, computed):
            return False
        first, need, _ = self._plan(request, num_new_tokens, computed)
        blocks = self.req_blocks.setdefault(request.request_id, [])
        if computed:
            self.pool.touch(computed)
            blocks.extend(computed)
            self.num_cached_blocks[request.request_id] = len(blocks)
        for i in range(first, len(blocks)):
            if blocks[i].ref_cnt > 1:
                (fresh,) = self.pool.get_new_blocks(1)
                self.pool.free_blocks([blocks[i]])
                self.pending_copies.append((blocks[i].block_id, fresh.block_id))
                blocks[i] = fresh
        if need:
            blocks.extend(self.pool.get_new_blocks(need))
        return True

    def fork(self, parent: Request, child: Request) -> None:
        """Share all of the parent's blocks with a child (parallel sampling); shared blocks
        that are still being written are copied on the child's or parent's next write."""
        blocks = self.req_blocks[parent.request_id]
        self.pool.touch(blocks)
        self.req_blocks[child.request_id] = list(blocks)
        self.num_cached_blocks[child.request_id] = self.num_cached_blocks.get(parent.request_id, 0)

    def cache_computed_blocks(self, request: Request) -> None:
        """Publish the request's full blocks whose K/V have been computed."""
        if not self.enable_caching:
            return
        blocks = self.req_blocks.get(request.request_id)
        if not blocks:
            return
        n_full = min(request.num_computed_tokens // self.block_size, len(blocks))
        start = self.num_cached_blocks.get(request.request_id, 0)
        if n_full <= start:
            return
        hashes = self.block_hashes(request)
        for i in range(start, n_full):
            self.pool.cache_block(blocks[i], hashes[i])
        self.num_cached_blocks[request.request_id] = n_full

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first so its tail is evicted first."""
        blocks = self.req_blocks.pop(request.request_id, None)
        self.num_cached_blocks.pop(request.request_id, None)
        if blocks:
            self.pool.free_blocks(reversed(blocks))

    def block_ids(self, request: Request) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request.request_id, ())]

    def num_allocated_slots(self) -> int:
        return self.pool.num_used_blocks * self.block_size

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    def check_invariants(self) -> None:
        self.pool.check_invariants()
        refs: dict[int, int] = {}
        for blocks in self.req_blocks.values():
            for b in blocks:
                refs[b.block_id] = refs.get(b.block_id, 0) + 1
        for b in self.pool.blocks:
            assert b.ref_cnt == refs.get(b.block_id, 0), f"ref count mismatch on {b}"
