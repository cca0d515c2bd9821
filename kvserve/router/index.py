"""What each replica's KV cache holds, from its KV events, and how much of a request's prefix
that is.

A request is matched by its tokens, not by recomputing hashes: the index learns the chain's
shape from ``BlockStored`` events (block ``h`` follows ``parent`` with these tokens), so it
needs neither the replicas' hash root (model fingerprint, KV layout) nor their algorithm. A
chain's first block is keyed by the salt the event names for it (``extra_keys``: the tenant's
cache salt), so a request of tenant A walks only A's chains: B's blocks can never score for
it, whatever their tokens. The edges (parent, tokens) -> hash are shared by the replicas (they
serve one model); what each replica holds, and on which medium, is per replica. Blocks an
offload tier stores are named by hash only; they score once the chain that leads to them is
known (it was on some device first).

The score of a replica is the request's leading blocks it holds, each credited by where it
lies: a block in the device pool saves all its prefill, one in host memory or on disk saves
it less the load (``TIER_CREDIT``); the walk stops at the first block the replica lacks, as a
prefix hit does.

The index holds nothing the garbage collector tracks (hash bytes, token-id bytes, a bit mask
of media per block): it grows to hundreds of thousands of blocks, and tracked objects would
make each full collection, which may fall inside any routing decision, scan them all.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Any

from kvserve.kv.events import AllBlocksCleared, BlockRemoved, BlockStored

# Prefill saved by a block held on each medium (1.0: all of it). A tier's block must be
# loaded first; the figures order the tiers by what a load costs, they are not measured.
TIER_CREDIT = {"GPU": 1.0, "CPU": 1.0, "CPU_TIER": 0.8, "DISK": 0.5, "REDIS": 0.4}
DEFAULT_CREDIT = 0.5
MAX_EDGES = 1 << 21  # chain edges remembered (oldest forgotten first)

EdgeKey = bytes  # the parent's key, then the block's token ids (little-endian int64)


def first_key(salt: str | None) -> bytes:
    """The parent key of a chain's first block: the salt the chain is partitioned by (kept
    apart from any hash by its length and prefix)."""
    return b"\0salt\0" + (b"\1" + str(salt).encode() if salt is not None else b"")


def edge_key(parent: bytes, tokens: Sequence[int] | bytes) -> bytes:
    """The key of the edge ``parent`` -> block: the parent's key (length-prefixed) and the
    block's token ids as little-endian int64 (or those bytes, already packed)."""
    packed = tokens if isinstance(tokens, bytes) else array("q", tokens).tobytes()
    return b"%d:%b%b" % (len(parent), parent, packed)


class PrefixIndex:
    """Chains learned from events, and per replica the blocks it holds by medium."""

    def __init__(self, num_replicas: int = 0, credit: dict[str, float] | None = None) -> None:
        self.credit = dict(TIER_CREDIT if credit is None else credit)
        self.edges: dict[EdgeKey, bytes] = {}
        # Per replica: block hash -> bit mask of the media holding it (bits: self.media).
        self.held: list[dict[bytes, int]] = [{} for _ in range(num_replicas)]
        self.block_size: int | None = None
        self.media: dict[str, int] = {}  # medium -> its bit
        self._mask_credit: dict[int, float] = {0: 0.0}

    def bit(self, medium: str | None) -> int:
        name = medium or "GPU"
        b = self.media.get(name)
        if b is None:
            b = self.media[name] = 1 << len(self.media)
            self._mask_credit = {0: 0.0}
        return b

    def media_of(self, replica: int, block_hash: bytes) -> set[str]:
        """The media on which ``replica`` holds the block (empty: none)."""
        mask = self.held[replica].get(block_hash, 0)
        return {m for m, b in self.media.items() if mask & b}

    def _credit(self, mask: int) -> float:
        c = self._mask_credit.get(mask)
        if c is None:
            c = max(self.credit.get(m, DEFAULT_CREDIT) for m, b in self.media.items() if mask & b)
            self._mask_credit[mask] = c
        return c

    def add_replica(self) -> int:
        self.held.append({})
        return len(self.held) - 1

    # -- events -------------------------------------------------------------------------------
    def apply(self, replica: int, events: Sequence[Any]) -> None:
        """Apply one batch's events (any objects with vLLM's event fields)."""
        held = self.held[replica]
        for ev in events:
            if isinstance(ev, BlockStored):
                self._stored(held, ev)
            elif isinstance(ev, BlockRemoved):
                keep = ~self.bit(ev.medium)
                for h in ev.block_hashes:
                    mask = held.get(h)
                    if mask is not None:
                        mask &= keep
                        if mask:
                            held[h] = mask
                        else:
                            del held[h]
            elif isinstance(ev, AllBlocksCleared):
                held.clear()

    def _stored(self, held: dict[bytes, int], ev: BlockStored) -> None:
        b = self.bit(ev.medium)
        for h in ev.block_hashes:
            held[h] = held.get(h, 0) | b
        if not ev.token_ids:
            return
        bs = ev.block_size
        self.block_size = bs
        parent: Any = ev.parent_block_hash
        extra = ev.extra_keys or []
        edges = self.edges
        for i, h in enumerate(ev.block_hashes):
            if parent is None:
                salt = extra[i][0] if i < len(extra) and extra[i] else None
                parent = first_key(salt)
            edges[edge_key(parent, ev.token_ids[i * bs : (i + 1) * bs])] = h
            parent = h
        while len(edges) > MAX_EDGES:
            del edges[next(iter(edges))]

    def drop_replica(self, replica: int) -> None:
        """Forget what a replica holds (it died, or restarted: its events say again)."""
        self.held[replica].clear()

    # -- matching -----------------------------------------------------------------------------
    def chain(self, token_ids: Sequence[int], salt: str | None) -> list[bytes]:
        """The hashes of the request's leading full blocks whose chain some replica
        published (stops at the first block no event described)."""
        bs = self.block_size
        if bs is None:
            return []
        out: list[bytes] = []
        parent: Any = first_key(salt)
        edges = self.edges
        packed, step = array("q", token_ids).tobytes(), 8 * bs  # packed once, sliced per block
        for lo in range(0, len(packed) - step + 1, step):
            h = edges.get(edge_key(parent, packed[lo : lo + step]))
            if h is None:
                break
            out.append(h)
            parent = h
        return out

    def overlap(self, replica: int, chain: Sequence[bytes]) -> tuple[int, float]:
        """(leading blocks of ``chain`` the replica holds, their credited blocks)."""
        held, credit = self.held[replica], self._credit
        n, total = 0, 0.0
        for h in chain:
            mask = held.get(h)
            if not mask:
                break
            n += 1
            total += credit(mask)
        return n, total

    def num_blocks(self, replica: int) -> int:
        return len(self.held[replica])
