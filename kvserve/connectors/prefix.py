"""Moving a cached prefix from one engine's pool into another's, as a connector that works
between steps: the engine asks it to export the longest cached prefix of some tokens, or to
place an exported prefix in its own cache.

The payload names what it holds by the same block hashes the prefix cache uses, so an import
can only ever be found by a request with the same tokens, salt, model and format; the identity
fields are checked first anyway, to refuse a mismatched payload with a clear message instead of
silently never hitting. The bytes move through the worker calls the connector is given
(the executor's ``collective_rpc``), never through a step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvserve.connectors.base import KVConnector, Role
from kvserve.kv.hashing import BlockHash, extend_block_hashes
from kvserve.kv.manager import KVCacheManager
from kvserve.kv.storage import BlockPayload, KVFormatMismatch

PAYLOAD_VERSION = 1


@dataclass(slots=True)
class PrefixPayload:
    """A cached prefix: block hashes in chain order and the blocks' stored bytes."""

    version: int
    model_id: str
    kv_format: str  # the storage layout and block size, as in the prefix-cache root
    block_size: int
    root: BlockHash
    hashes: list[BlockHash]
    blocks: BlockPayload

    @property
    def num_tokens(self) -> int:
        return len(self.hashes) * self.block_size


def export_prefix(
    kv: KVCacheManager,
    export_blocks: Callable[[list[int]], BlockPayload],
    kv_layout: str,
    model_id: str,
    token_ids: list[int],
    cache_salt: str | None = None,
) -> PrefixPayload:
    """The longest cached full-block prefix of ``token_ids`` in ``kv``'s cache."""
    hashes: list[BlockHash] = []
    extend_block_hashes(hashes, list(token_ids), kv.block_size, kv.root, cache_salt)
    ids = kv.cached_prefix(hashes)
    return PrefixPayload(
        version=PAYLOAD_VERSION,
        model_id=model_id,
        kv_format=kv_layout,
        block_size=kv.block_size,
        root=kv.root,
        hashes=hashes[: len(ids)],
        blocks=export_blocks(ids),  # complete: a value the caller may send anywhere
    )


def import_prefix(
    kv: KVCacheManager,
    import_blocks: Callable[[list[int], BlockPayload], None],
    kv_layout: str,
    model_id: str,
    payload: PrefixPayload,
    store_evicted: Callable[[list[tuple[int, BlockHash]]], None] | None = None,
) -> int:
    """Place the payload's blocks this cache lacks (as many as there are free blocks) in the
    prefix cache, cached-free; returns how many were placed. ``store_evicted`` gets the
    cached blocks that making room evicted, before they are overwritten (offload tiers)."""
    if not isinstance(payload, PrefixPayload) or payload.version != PAYLOAD_VERSION:
        raise ValueError("import_prefix: not a kvserve prefix payload of this version")
    for field, theirs, ours in (
        ("model", payload.model_id, model_id),
        ("kv_format", payload.kv_format, kv_layout),
        ("block_size", payload.block_size, kv.block_size),
    ):
        if theirs != ours:
            raise KVFormatMismatch(
                f"import_prefix: the payload's {field} is {theirs!r}, this engine's is {ours!r}"
            )
    if payload.root != kv.root:
        raise KVFormatMismatch("import_prefix: the payload's cache namespace differs")
    imp = kv.reserve_for_import(payload.hashes)
    if store_evicted is not None:
        evicted = kv.take_evictions(imp.block_ids)
        if evicted:
            store_evicted(evicted)
    try:
        if imp.new:
            import_blocks(imp.block_ids, payload.blocks.select(imp.indices))
    except Exception:
        kv.cancel_import(imp)
        raise
    kv.publish_import(imp)
    return len(imp.new)


ExportBlocks = Callable[[list[int]], BlockPayload]
ImportBlocks = Callable[[list[int], BlockPayload], None]
StoreEvicted = Callable[[list[tuple[int, BlockHash]]], None]


class PrefixTransferConnector(KVConnector):
    """Scheduler side only: the KV manager's blocks and the workers' bytes, between steps.
    ``store_evicted`` gets cached blocks that making room for an import evicted, before they
    are overwritten (the offload tiers take them)."""

    def __init__(
        self,
        kv: KVCacheManager,
        model_id: str,
        kv_layout: str,
        export_blocks: ExportBlocks,
        import_blocks: ImportBlocks,
        store_evicted: StoreEvicted | None = None,
    ) -> None:
        super().__init__(Role.SCHEDULER)
        self.kv = kv
        self.model_id = model_id
        self.kv_layout = kv_layout
        self._export = export_blocks
        self._import = import_blocks
        self._store_evicted = store_evicted

    def export_prefix(self, token_ids: list[int], cache_salt: str | None = None) -> PrefixPayload:
        return export_prefix(self.kv, self._export, self.kv_layout, self.model_id, token_ids,
                             cache_salt)  # fmt: skip

    def import_prefix(self, payload: PrefixPayload) -> int:
        return import_prefix(self.kv, self._import, self.kv_layout, self.model_id, payload,
                             self._store_evicted)  # fmt: skip
