"""Block hashes for automatic prefix caching.

A block's hash commits to everything that determines its K/V: the hash of the block before it
(so a hash names a whole prefix, not just 16 tokens), the block's token ids, and extra keys.
The chain's root commits to the model and the KV storage format, so a cache is never reused
across them; the tenant salt is folded into the first block, so two tenants never share one.

SHA-256 over a canonical byte encoding keeps the keys stable across processes and machines
(Python's ``hash()`` is salted per process), which a disk tier or a second engine needs.
"""

from __future__ import annotations

import hashlib
from array import array
from typing import NewType

BlockHash = NewType("BlockHash", bytes)


def root_hash(model_id: str, kv_format: str) -> BlockHash:
    """The parent of every first block: commits to the model and the KV storage format."""
    return BlockHash(hashlib.sha256(f"kvserve-root\0{model_id}\0{kv_format}".encode()).digest())


def hash_block_tokens(
    parent: BlockHash, token_ids: list[int] | tuple[int, ...], extra: str | None = None
) -> BlockHash:
    """H(parent hash, token ids, extra keys) for one full block."""
    h = hashlib.sha256(parent)
    h.update(array("q", token_ids).tobytes())
    if extra:
        h.update(b"\0salt\0" + extra.encode())
    return BlockHash(h.digest())


def extend_block_hashes(
    hashes: list[BlockHash],
    token_ids: list[int],
    block_size: int,
    root: BlockHash,
    salt: str | None = None,
) -> None:
    """Append the hashes of the full blocks of ``token_ids`` not yet hashed (in place).

    The same digests as :func:`hash_block_tokens` block by block, with the new blocks'
    tokens packed once: a prompt's blocks are hashed when it is admitted, so a long
    prompt is thousands of them."""
    start, n_full = len(hashes), len(token_ids) // block_size
    if start >= n_full:
        return
    if start == 0:
        hashes.append(hash_block_tokens(root, token_ids[:block_size], salt))
        start = 1
    width = 8 * block_size  # bytes of one block's int64 ids
    data = array("q", token_ids[start * block_size : n_full * block_size]).tobytes()
    parent = hashes[-1]
    sha256 = hashlib.sha256
    for lo in range(0, len(data), width):
        parent = BlockHash(sha256(parent + data[lo : lo + width]).digest())
        hashes.append(parent)
