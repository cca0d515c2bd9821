"""Retention's attention paths and compaction in plain PyTorch: the reference every backend
falls back to for retention's extras, and the scoring that chooses which cache entries stay.

- A windowed sequence (sliding window, StreamingLLM's sinks) reads only the blocks it keeps
  (:func:`retained_attention`).
- H2O's sequences are attended with explicit float32 probabilities, whose sum per cache
  entry (its attention mass) grows the request's mass (:func:`observed_attention`,
  :func:`observed_decode`); a compaction keeps each KV head's newest and heaviest entries
  (:func:`h2o_keep`, :func:`compact_heavy`).
- SnapKV scores a prompt's keys with its last queries once the prompt is attended and keeps
  the top ones (:func:`snapkv_keep`, :func:`compact_prompt`).

Compactions copy the kept entries' stored codes bit for bit (``KVStorage.copy_entries``); the
policy's side lives in :mod:`kvserve.sched.retention`.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from kvserve.attention.metadata import (
    AttentionMetadata,
    ObservedDecode,
    PrefillChunk,
    combine_windows,
)
from kvserve.attention.rotary import rotate_back
from kvserve.kernels.host_device import to_device
from kvserve.kv.storage import KVStorage


def retained_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer: int,
    storage: KVStorage,
    meta: AttentionMetadata,
    p: PrefillChunk,
    layer_window: int | None,
) -> torch.Tensor:
    """One chunk of a sequence under a retention policy, reading only the blocks it keeps:
    the sink blocks and those of the oldest query's window, then the chunk's fresh K/V.

    Query at cache entry ``c`` sees entries ``(c - w, c]`` and, with sinks, ``[0, S)``. Cache
    entry = position, so window keys are at their true distance; a sink's in-cache distance
    (StreamingLLM) is ``min(c, S + w - 1) - s``, which the query rotated back by ``max(0, c -
    S - w + 1)`` gives against the stored (rotated at ``s``) sink key (see kvserve.sched.retention).
    """
    c0, n = p.ctx_len, p.q_len
    w = combine_windows(layer_window, p.window) or p.window
    dev = q.device
    kpos_parts, k_parts, v_parts = [], [], []
    kept = meta.kept_blocks(p, w)
    if kept is not None:
        idx, kpos, live = kept
        kc, vc = storage.gather(layer, p.block_table[idx][None])  # [1, KVH, len*bs, D]
        kpos_parts.append(kpos)
        k_parts.append(kc[0].index_select(1, live).transpose(0, 1).to(q.dtype))  # [N, KVH, D]
        v_parts.append(vc[0].index_select(1, live).transpose(0, 1).to(q.dtype))
    kpos_parts.append(np.arange(c0, c0 + n))
    k_parts.append(k)
    v_parts.append(v)
    kpos_host = np.concatenate(kpos_parts)
    kpos = to_device(kpos_host, dev)
    keys, values = torch.cat(k_parts), torch.cat(v_parts)
    group = q.shape[1] // keys.shape[1]
    kr = keys.repeat_interleave(group, dim=1).float()
    vr = values.repeat_interleave(group, dim=1).float()
    qf = q.float()
    scale = q.shape[-1] ** -0.5
    scores = torch.einsum("lhd,shd->hls", qf, kr) * scale
    qpos = torch.arange(c0, c0 + n, device=dev)
    seen = (kpos[None, :] <= qpos[:, None]) & (kpos[None, :] > qpos[:, None] - w)
    if p.sinks:
        seen |= (kpos < p.sinks)[None, :] & (kpos[None, :] <= qpos[:, None])
        sinks = np.flatnonzero(kpos_host < p.sinks)
        # the newest query is the furthest past its window: if it needs no shift, none does
        if c0 + n - p.sinks - w > 0 and len(sinks):
            shift = (qpos - p.sinks - w + 1).clamp(min=0)
            at = to_device(sinks, dev)
            q_back = rotate_back(qf, shift, meta.rotary)  # R(-shift) q
            sink_scores = torch.einsum("lhd,shd->hls", q_back, kr.index_select(0, at)) * scale
            scores.index_copy_(2, at, sink_scores)
    scores = scores.masked_fill(~seen[None], float("-inf"))
    return torch.einsum("hls,shd->lhd", scores.softmax(-1), vr).to(q.dtype)


def observed_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, storage: KVStorage,
    p: PrefillChunk,
) -> torch.Tensor:  # fmt: skip
    """Attention of one H2O sequence's chunk (or decode token) over its cache entries and its
    own fresh K/V, in float32, adding the probabilities each entry receives (summed over the
    chunk's queries and each KV head's query heads) to the request's mass; then, when the
    step compacts, each KV head's kept entries are copied into the fresh blocks and the mass
    follows them. Every cache entry is older than the chunk (entries are any tokens a head
    kept, in order), so the chunk sees all of them and itself causally."""
    c0, n = p.ctx_len, p.q_len
    keys, values = sequence_kv(k, v, layer, storage, p)
    s, num_kv, d = keys.shape
    g = q.shape[1] // num_kv
    kf, vf = keys.float(), values.float()
    out = torch.empty_like(q)
    vote = torch.zeros(num_kv, s, device=q.device)
    kpos = torch.arange(s, device=q.device)
    for start in range(0, n, OBSERVED_QUERY_BLOCK):
        qs = q[start : start + OBSERVED_QUERY_BLOCK].float()
        m = qs.shape[0]
        scores = torch.einsum("mkgd,skd->kgms", qs.view(m, num_kv, g, d), kf) * d**-0.5
        qpos = c0 + start + torch.arange(m, device=q.device)
        scores.masked_fill_((kpos[None, :] > qpos[:, None])[None, None], float("-inf"))
        probs = scores.softmax(-1)
        out[start : start + m] = torch.einsum("kgms,skd->mkgd", probs, vf).reshape(m, -1, d)
        vote += probs.sum(dim=(1, 2))
    assert p.mass is not None
    prev = p.mass[layer]
    if prev is None:
        prev = torch.zeros(num_kv, 0, device=q.device)
    p.mass[layer] = torch.cat([prev, torch.zeros(num_kv, n, device=q.device)], dim=1) + vote
    if p.compact is not None:
        compact_heavy(layer, storage, p)
    return out


def observed_decode(
    q: torch.Tensor, layer: int, storage: KVStorage, g: ObservedDecode, out: torch.Tensor
) -> None:
    """H2O decode tokens in one batch: their blocks gathered (the new token's K/V were written
    first), explicit float32 probabilities, each request's mass grown by what its entries
    received."""
    kc, vc = storage.gather(layer, g.block_tables)  # [B, KVH, S, D]
    b, num_kv, s, d = kc.shape
    qd = q[g.rows].float().view(b, num_kv, -1, d)
    scores = torch.einsum("bkgd,bksd->bkgs", qd, kc.float()) * d**-0.5
    seen = torch.arange(s, device=q.device)[None, :] < g.num_entries[:, None]
    scores.masked_fill_(~seen[:, None, None, :], float("-inf"))
    probs = scores.softmax(-1)
    out[g.rows] = torch.einsum("bkgs,bksd->bkgd", probs, vc.float()).reshape(b, -1, d).to(q.dtype)
    vote = probs.sum(2)  # [B, KVH, S]
    for i, (n, mass) in enumerate(zip(g.entries, g.masses, strict=True)):
        prev = mass[layer]
        assert prev is not None and prev.shape[1] == n - 1
        mass[layer] = torch.cat([prev, vote[i, :, n - 1 : n]], dim=1)
        mass[layer][:, : n - 1] += vote[i, :, : n - 1]


def sequence_kv(
    k: torch.Tensor, v: torch.Tensor, layer: int, storage: KVStorage, p: PrefillChunk
) -> tuple[torch.Tensor, torch.Tensor]:
    """A chunk's whole sequence, ``[ctx_len + q_len, KVH, D]`` keys and values: its cache
    entries (gathered, in the compute dtype) and then its own fresh K/V."""
    if not p.ctx_len:
        return k, v
    assert p.block_table is not None
    kc, vc = storage.gather(layer, p.block_table[None])
    c0 = p.ctx_len
    return (torch.cat([kc[0, :, :c0].transpose(0, 1).to(k.dtype), k]),
            torch.cat([vc[0, :, :c0].transpose(0, 1).to(v.dtype), v]))  # fmt: skip


# Queries per block of H2O's attention: bounds its [heads, queries, keys] probabilities.
OBSERVED_QUERY_BLOCK = 256


def compact_prompt(
    q: torch.Tensor, k: torch.Tensor, layer: int, storage: KVStorage, p: PrefillChunk
) -> None:
    """SnapKV for one layer, after the chunk that ends the prompt attended: score the prompt's
    keys with its last queries and copy each KV head's kept entries (stored codes, bit for
    bit) into the fresh blocks. The chunk holds the whole observation window (the scheduler
    sees to it); the old blocks are left as they are, for the prefix cache."""
    c = p.compact
    assert c is not None
    keys, _ = sequence_kv(k, k, layer, storage, p)
    keep = snapkv_keep(q[-c.window :], keys, c.budget, c.kernel)  # [KVH, kept]
    storage.copy_entries(layer, c.src_slots[keep], c.dst_slots)


def compact_heavy(layer: int, storage: KVStorage, p: PrefillChunk) -> None:
    """H2O's compaction for one layer once the chunk's mass is in: each KV head's kept
    entries (its newest and its heaviest) copied into the fresh blocks; the mass follows."""
    c, mass = p.compact, p.mass[layer] if p.mass is not None else None
    assert c is not None and mass is not None
    keep = h2o_keep(mass, c.budget, c.window)
    storage.copy_entries(layer, c.src_slots[keep], c.dst_slots)
    p.mass[layer] = mass.gather(1, keep)


def snapkv_keep(q_obs: torch.Tensor, keys: torch.Tensor, budget: int, kernel: int) -> torch.Tensor:
    """SnapKV's choice for one layer: ``[KVH, budget + w]`` cache entries (ascending) each KV
    head keeps, for the last ``w`` queries of a prompt ``q_obs`` [w, H, D] over all its keys
    [S, KVH, D] (RoPE applied to both). Each query's causal softmax over the keys is summed
    over the window's queries and the KV head's query heads, averaged over ``kernel``
    neighbouring keys, and the top ``budget`` keys before the window join the window."""
    w, num_heads, d = q_obs.shape
    s, num_kv = keys.shape[0], keys.shape[1]
    g = num_heads // num_kv
    qf = q_obs.float().view(w, num_kv, g, d)
    scores = torch.einsum("wkgd,skd->kgws", qf, keys.float()) * d**-0.5
    qpos = torch.arange(s - w, s, device=keys.device)
    kpos = torch.arange(s, device=keys.device)
    scores.masked_fill_((kpos[None, :] > qpos[:, None])[None, None], float("-inf"))
    vote = scores.softmax(-1).sum(dim=(1, 2))[:, : s - w]  # [KVH, S - w]
    if kernel > 1:
        vote = F.avg_pool1d(vote[:, None], kernel, stride=1, padding=kernel // 2)[:, 0]
    top = vote.topk(budget, dim=-1).indices.sort(dim=-1).values
    return torch.cat([top, qpos.expand(num_kv, w)], dim=-1)


def h2o_keep(mass: torch.Tensor, budget: int, recent: int) -> torch.Tensor:
    """H2O's choice: ``[KVH, budget]`` entries (ascending) per KV head, its ``recent`` newest
    and the ``budget - recent`` others with the most accumulated mass ``[KVH, S]``."""
    num_kv, s = mass.shape
    newest = torch.arange(s - recent, s, device=mass.device).expand(num_kv, recent)
    heavy = mass[:, : s - recent].topk(budget - recent, dim=-1).indices.sort(dim=-1).values
    return torch.cat([heavy, newest], dim=-1)
