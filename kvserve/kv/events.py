"""KV cache events: what a cache holds, as vLLM publishes it, so a router written for vLLM
reads ours.

The shapes are vLLM's (``vllm/distributed/kv_events.py``): msgspec structs encoded as msgpack
*arrays* (``array_like``), each event tagged with its class name as the array's first item;
a batch is ``[ts, [event, ...], data_parallel_rank]``. Fields are in vLLM's order, so a
decoder written to vLLM's schema reads every field it knows and ignores the ones after it.

- ``BlockStored``: consecutive blocks of one chain (``block_hashes``), the hash of the block
  before the first (``parent_block_hash``, None for a chain's first block), their tokens
  (``len(block_hashes) * block_size`` of them), ``lora_id`` (None: kvserve serves no LoRA),
  the ``medium``, ``lora_name`` (None) and ``extra_keys``: one entry per block, the tenant's
  cache salt on a chain's first block (the only block whose hash folds it in) and None
  elsewhere, as vLLM puts ``cache_salt`` there.
- ``BlockRemoved``: hashes that left one medium.
- ``AllBlocksCleared``: the medium's whole cache is gone (a prefix-cache reset, and the first
  batch an engine publishes, so a subscriber drops what a previous run of it held).

Block hashes are the pool's own keys (:mod:`kvserve.kv.hashing`): 32-byte SHA-256 digests,
deterministic across processes and restarts (no seed; the chain's root commits to the model's
weights fingerprint, the KV layout and the block size; a tenant's salt is folded into its
first block). Offload tiers know entries by hash only: their ``BlockStored`` carry no tokens
and no parent, as vLLM's offloading connector publishes them.
"""

from __future__ import annotations

from typing import Any

import msgspec

# The device pool's medium, as vLLM names it ("GPU"; "CPU" for a pool in host memory), and
# the offload tiers' (kvserve.kv.tiers: cpu, disk, redis).
MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
TIER_MEDIUM = {"cpu": "CPU_TIER", "disk": "DISK", "redis": "REDIS"}


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """A change to what a cache holds."""


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None = None
    extra_keys: list[tuple[Any, ...] | None] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def device_medium(device: str) -> str:
    """The pool's medium: GPU for an accelerator's pool, CPU for one in host memory."""
    return MEDIUM_CPU if device.split(":")[0] == "cpu" else MEDIUM_GPU


def removed(events: list[KVCacheEvent], block_hash: bytes, medium: str) -> None:
    """Append a removal, merged into the previous event when that is a removal from the same
    medium (an eviction burst is one event, not hundreds)."""
    last = events[-1] if events else None
    if isinstance(last, BlockRemoved) and last.medium == medium:
        last.block_hashes.append(block_hash)
    else:
        events.append(BlockRemoved([block_hash], medium))
