"""What the KV manager reads of a request: a protocol, so that the block bookkeeping depends on
no scheduler type (the scheduler's :class:`~kvserve.sched.request.Request` satisfies it)."""

from __future__ import annotations

from typing import Any, Protocol

from kvserve.kv.hashing import BlockHash


class KVRequest(Protocol):
    request_id: str
    cache_salt: str | None
    # A retention policy (kvserve.sched.retention.RetentionSpec) or None: its ``salt`` keys
    # a chain of its own, its observation window bounds prefix hits.
    retention: Any
    block_hashes: list[BlockHash]  # the manager extends it as full blocks appear
    all_token_ids: list[int]
    num_computed_tokens: int
    cache_offset: int  # cache entries a compaction dropped before the table's first

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def num_cache_entries(self) -> int: ...

    @property
    def compaction_pending(self) -> bool: ...
