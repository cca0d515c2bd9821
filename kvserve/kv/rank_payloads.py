"""The KV bytes of a tensor-parallel engine's ranks, moved as one payload.

Each rank's pool holds its KV heads, so a block's bytes are spread over the ranks: an export
takes every rank's part, and an import gives each rank its own. Between the two (an offload
tier, another engine) the parts travel as one :class:`~kvserve.kv.storage.BlockPayload` whose
per-layer tensors hold the ranks' layers one after the other (``[ranks x layers, blocks,
...]``): to every consumer that selects or concatenates blocks (along the block axis) it is a
pool with more layers. Pool-wide state (fp8's per-head scales, per rank) travels as a list of
the ranks' states, and the payload's identity names the rank count, so one engine's blocks are
never imported by an engine split another way.
"""

from __future__ import annotations

from typing import Any

import torch

from kvserve.kv.storage import BlockPayload, KVFormatMismatch

RANKS_KEY = "tensor_parallel_size"


def merge_identity(identity: dict[str, Any], world_size: int) -> dict[str, Any]:
    return {**identity, RANKS_KEY: world_size} if world_size > 1 else identity


def merge_payloads(parts: list[BlockPayload]) -> BlockPayload:
    """The ranks' exports of the same blocks (in rank order) as one payload."""
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    for p in parts:
        p.wait()
    tensors = {k: torch.cat([p.tensors[k] for p in parts]) for k in first.tensors}
    extra: dict[str, Any] = {}
    for k, v in first.extra.items():
        if isinstance(v, torch.Tensor):
            extra[k] = torch.cat([p.extra[k] for p in parts])
        elif all(p.extra[k] == v for p in parts):  # the same on every rank (which blocks)
            extra[k] = v
        else:
            raise KVFormatMismatch(f"payload extra {k!r}: the ranks disagree")
    pool = {"ranks": [p.pool for p in parts]} if first.pool else {}
    return BlockPayload(merge_identity(first.identity, len(parts)), first.num_blocks, tensors,
                        pool, extra)  # fmt: skip


def rank_payload(payload: BlockPayload, rank: int, world_size: int) -> BlockPayload:
    """Rank ``rank``'s part of a payload :func:`merge_payloads` made; raises
    KVFormatMismatch for a payload of another rank count."""
    if world_size == 1:
        return payload
    got = payload.identity.get(RANKS_KEY, 1)
    if got != world_size:
        raise KVFormatMismatch(
            f"KV payload of {got} tensor-parallel rank(s) for an engine of {world_size}"
        )
    payload.wait()

    def part(t: torch.Tensor) -> torch.Tensor:
        n = t.shape[0] // world_size
        return t[rank * n : (rank + 1) * n]

    tensors = {k: part(t) for k, t in payload.tensors.items()}
    extra = {k: part(v) if isinstance(v, torch.Tensor) else v for k, v in payload.extra.items()}
    pool = payload.pool["ranks"][rank] if payload.pool else {}
    identity = {k: v for k, v in payload.identity.items() if k != RANKS_KEY}
    return BlockPayload(identity, payload.num_blocks, tensors, pool, extra)


def merge_values(values: list[Any]) -> Any:
    """The ranks' results of the same call (nested lists, tuples and dicts holding
    payloads, alike in shape on every rank) as one: each payload merged with its peers."""
    first = values[0]
    if len(values) == 1:
        return first
    if isinstance(first, BlockPayload):
        return merge_payloads(values)
    if isinstance(first, list | tuple):
        merged = [merge_values([v[i] for v in values]) for i in range(len(first))]
        return type(first)(merged) if isinstance(first, tuple) else merged
    if isinstance(first, dict):
        return {k: merge_values([v[k] for v in values]) for k in first}
    return first


def rank_value(value: Any, rank: int, world_size: int) -> Any:
    """``value`` with each merged payload in it replaced by rank ``rank``'s part."""
    if world_size == 1:
        return value
    if isinstance(value, BlockPayload):
        return rank_payload(value, rank, world_size)
    if isinstance(value, list | tuple):
        parts = [rank_value(v, rank, world_size) for v in value]
        return type(value)(parts) if isinstance(value, tuple) else parts
    if isinstance(value, dict):
        return {k: rank_value(v, rank, world_size) for k, v in value.items()}
    return value
