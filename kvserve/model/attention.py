"""Paged attention over one flat "varlen" batch, in plain PyTorch.

The runner orders the flat batch as ``[decode tokens | prefill chunk 1 | prefill chunk 2 ...]``.
Decode tokens (one query each) are attended in a single fused call: each sequence's blocks are
gathered by its block table into a padded batch and a length mask hides the padding. GQA needs
no K/V repetition there: the ``G`` query heads that share a KV head become the query-length
axis of that head. Each prefill chunk is attended on its own, against the fresh K/V when it
starts the sequence (the common case: causal, no gather) or against its gathered blocks when it
continues a cached prefix or an earlier chunk; the chunk's own positions then still use its fresh
K/V, so a lossy cache format is read only for the context before the chunk.

Masks depend only on the batch layout, so they are built once per step and shared by layers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from kvserve.kv.storage import KVStorage

# A backend's causal attention of a chunk, written into ``out`` (q [L, H, D], k/v [Lk, KVH, D],
# out [L, H, D], window); False if it does not take the input. The causal kernel serves chunks
# that start their sequence (Lk = L, fresh K/V), the context kernel chunks that continue one
# (keys: the gathered context, then the chunk's own).
CausalKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int | None], bool]

# Chunks over a cached context up to this many queries go to the fused paged kernel; longer
# ones are better served by SDPA's blocked matrix products after a gather.
KERNEL_MAX_QUERY = 64


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rot: int) -> torch.Tensor:
    """RoPE on the first ``rot`` channels of ``x`` (HF's rotate-half layout)."""
    if rot < x.shape[-1]:
        x_rot, x_pass = x[..., :rot], x[..., rot:]
        return torch.cat((apply_rotary(x_rot, cos, sin, rot), x_pass), dim=-1)
    half = rot // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def rotate_back(q: torch.Tensor, shift: torch.Tensor, rotary: Any) -> torch.Tensor:
    """Each row of ``q`` [T, H, D] rotated back by its ``shift`` [T] positions: against a
    sink key stored rotated at its own position, the score of a query at in-cache distance
    (StreamingLLM; RoPE rotations compose, see :func:`retained_attention`)."""
    cos = rotary.cos[shift][:, None, :]
    sin = rotary.sin[shift][:, None, :]
    return apply_rotary(q.float(), cos, -sin, rotary.rot_dim).to(q.dtype)


def combine_windows(layer: int | None, request: int) -> int | None:
    """The tighter of a layer's sliding window and a request's retention window (0: none)."""
    if request and (layer is None or request < layer):
        return request
    return layer


@dataclass(slots=True)
class Compaction:
    """A compaction after the chunk attended (see :mod:`kvserve.sched.retention`): SnapKV in the
    chunk that ends a prompt, or H2O."""

    kind: str  # "snapkv" or "h2o"
    budget: int  # snapkv: prompt keys kept besides the observation window; h2o: entries kept
    window: int  # snapkv: the observation window (last prompt queries); h2o: recent entries
    kernel: int  # snapkv: pooling width over neighbouring keys
    src_slots: torch.Tensor  # [S] flat slot of each cache entry, this chunk's included
    dst_slots: torch.Tensor  # [kept] flat slots of the fresh blocks, in order


@dataclass(slots=True)
class PrefillChunk:
    q_start: int  # offset in the flat batch
    q_len: int
    ctx_len: int  # cache entries of this sequence before the chunk (not a RoPE position)
    block_table: torch.Tensor | None  # [num_blocks] when ctx_len > 0
    in_group: bool = False  # also listed in the PagedGroup
    window: int = 0  # the request's retention window (0: none), beside the layer's
    sinks: int = 0  # with a window: the first cache entries it keeps too (StreamingLLM)
    compact: Compaction | None = None  # score, select and copy after attending
    # H2O: the request's attention mass per layer ([KVH, ctx_len] or None before its first
    # chunk), updated in place with this chunk's queries.
    mass: list[torch.Tensor | None] | None = None


@dataclass(slots=True)
class PagedGroup:
    """Decode tokens and short continuation chunks: rows ``[0, num_rows)`` of the batch,
    attended by one fused kernel call straight from the cache."""

    num_rows: int
    q_start: torch.Tensor  # [B] int64
    q_len: torch.Tensor  # [B]
    ctx_len: torch.Tensor  # [B] keys cached before the chunk
    block_tables: torch.Tensor  # [B, max_blocks]
    windows: torch.Tensor | None = None  # [B] int32 retention windows (0: none), or None
    votes: GroupVotes | None = None  # H2O decode tokens among the rows: where their mass goes
    sinks: torch.Tensor | None = None  # [B] int32 StreamingLLM sink counts (0: none), or None
    sink_shift: torch.Tensor | None = None  # [num_rows] int64: each row's rotate-back for sinks


@dataclass(slots=True)
class GroupVotes:
    """Where the fused kernel adds H2O's attention mass: per layer and group row, the
    address and row stride of a float32 ``[KVH, stride]`` buffer (0: the row has none)."""

    ptrs: torch.Tensor  # [layers, B] int64
    strides: torch.Tensor  # [layers, B] int64
    keep: list[torch.Tensor]  # the buffers, alive while the kernel writes into them

    def of_layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.ptrs[layer], self.strides[layer]


@dataclass(slots=True)
class ObservedDecode:
    """H2O decode tokens that do not compact this step, attended in one batch with explicit
    probabilities (their chunks are marked ``in_group`` and skipped by the chunk loop)."""

    rows: torch.Tensor  # [B] rows of the flat batch
    block_tables: torch.Tensor  # [B, max_blocks], padded with the null block
    num_entries: torch.Tensor  # [B] cache entries, the new token's included
    entries: list[int]  # the same, as ints
    masses: list[list[torch.Tensor | None]]  # each request's mass per layer


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] flat slot index of each new token
    block_size: int
    num_decode: int = 0
    decode_block_tables: torch.Tensor | None = None  # [Bd, max_blocks]
    decode_seq_lens: torch.Tensor | None = None  # [Bd] cache entries incl. the new one
    decode_windows: torch.Tensor | None = None  # [Bd] int32 retention windows (0: none)
    prefills: list[PrefillChunk] = field(default_factory=list)
    paged: PagedGroup | None = None
    observed: ObservedDecode | None = None
    rotary: Any = None  # the model's RotaryEmbedding (cos/sin tables), set by its forward
    # A hybrid model's per-layer metadata (its layer group's block tables), or None: every
    # layer uses this one.
    by_layer: list[AttentionMetadata] | None = None
    _masks: dict = field(default_factory=dict)

    def decode_mask(self, window: int | None) -> torch.Tensor:
        """[Bd, 1, 1, S]: key j is visible iff j < seq_len (and inside the layer's window and
        the row's retention window)."""
        key = ("decode", window)
        mask = self._masks.get(key)
        if mask is None:
            assert self.decode_block_tables is not None and self.decode_seq_lens is not None
            s = self.decode_block_tables.shape[1] * self.block_size
            j = torch.arange(s, device=self.decode_seq_lens.device)
            lens = self.decode_seq_lens[:, None]
            mask = j[None, :] < lens
            if window is not None:
                mask &= j[None, :] >= lens - window
            if self.decode_windows is not None:
                w = self.decode_windows[:, None].to(lens.dtype)
                mask &= (w <= 0) | (j[None, :] >= lens - w)
            mask = mask[:, None, None, :]
            self._masks[key] = mask
        return mask

    def kept_blocks(
        self, p: PrefillChunk, window: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Under retention, the chunk's kept table entries (sink blocks and the oldest query's
        window), the cache entry of each kept row and which rows are written; once per step,
        shared by the layers. None when nothing before the chunk is kept."""
        key = ("kept", p.q_start, window)
        if key not in self._masks:
            bs, c0 = self.block_size, p.ctx_len
            keep = set(range(max(0, c0 - window + 1) // bs, -(-c0 // bs)))
            keep |= set(range(min(-(-p.sinks // bs), -(-c0 // bs))))
            out = None
            if keep and p.block_table is not None:
                dev = self.slot_mapping.device
                idx = torch.tensor(sorted(keep), dtype=torch.long, device=dev)
                rows = (idx[:, None] * bs + torch.arange(bs, device=dev)[None, :]).reshape(-1)
                live = rows < c0  # the last block's unwritten tail
                out = (idx, rows[live], live)
            self._masks[key] = out
        return self._masks[key]

    def prefill_mask(self, i: int, window: int | None, num_keys: int) -> torch.Tensor | None:
        """[q_len, num_keys] causal mask offset by the cached context; None = plain causal."""
        p = self.prefills[i]
        window = combine_windows(window, p.window)
        if p.ctx_len == 0 and (window is None or window >= p.q_len):
            return None
        key = (i, window)
        mask = self._masks.get(key)
        if mask is None:
            dev = self.slot_mapping.device
            qpos = p.ctx_len + torch.arange(p.q_len, device=dev)[:, None]
            kpos = torch.arange(num_keys, device=dev)[None, :]
            mask = kpos <= qpos
            if window is not None:
                mask &= kpos > qpos - window
            self._masks[key] = mask
        return mask


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer: int,
    storage: KVStorage,
    meta: AttentionMetadata,
    window: int | None = None,
    causal_kernel: CausalKernel | None = None,
    context_kernel: CausalKernel | None = None,
) -> torch.Tensor:
    """Write this step's K/V into the cache, then attend. q: [T, H, D]; k, v: [T, KVH, D].
    ``causal_kernel`` and ``context_kernel`` (the backend's, see linear_ops) may serve chunks
    that start a sequence and chunks that continue one; SDPA serves what they decline."""
    storage.write(layer, meta.slot_mapping, k, v)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)

    paged = meta.paged
    q_back = None
    if paged is not None and paged.sink_shift is not None:
        q_back = rotate_back(q[: paged.num_rows], paged.sink_shift, meta.rotary)
    fused = paged is not None and storage.fused_attention(layer, q, paged, window, out, q_back)
    if not fused and paged is not None and (paged.votes is not None or paged.sinks is not None):
        raise RuntimeError("retention rows were grouped for a fused kernel that declined them")
    nd = 0 if fused else meta.num_decode
    if nd:
        assert meta.decode_block_tables is not None and meta.decode_seq_lens is not None
        dec = storage.decode_attention(
            layer, q[:nd], meta.decode_block_tables, meta.decode_seq_lens, window,
            meta.decode_windows,
        )  # fmt: skip
        if dec is not None:
            out[:nd] = dec
        else:
            kc, vc = storage.gather(layer, meta.decode_block_tables)  # [Bd, KVH, S, D]
            kc, vc = kc.to(q.dtype), vc.to(q.dtype)  # the cache may be stored narrower
            qd = q[:nd].view(nd, num_kv_heads, group, head_dim)
            od = F.scaled_dot_product_attention(qd, kc, vc, attn_mask=meta.decode_mask(window))
            out[:nd] = od.reshape(nd, num_heads, head_dim)

    if meta.observed is not None:
        observed_decode(q, layer, storage, meta.observed, out)
    for i, p in enumerate(meta.prefills):
        if (fused or p.mass is not None) and p.in_group:
            continue
        sl = slice(p.q_start, p.q_start + p.q_len)
        if p.mass is not None:
            out[sl] = observed_attention(q[sl], k[sl], v[sl], layer, storage, p)
            continue
        if p.sinks or (p.window and p.ctx_len):
            out[sl] = retained_attention(q[sl], k[sl], v[sl], layer, storage, meta, p, window)
            continue
        if p.ctx_len == 0 and causal_kernel is not None:
            if causal_kernel(q[sl], k[sl], v[sl], out[sl], combine_windows(window, p.window)):
                continue
        qp = q[sl].transpose(0, 1).unsqueeze(0)  # [1, H, L, D]
        if p.ctx_len == 0:
            kp = k[sl].transpose(0, 1).unsqueeze(0)
            vp = v[sl].transpose(0, 1).unsqueeze(0)
            num_keys = p.q_len
        else:
            assert p.block_table is not None
            num_keys = p.ctx_len + p.q_len
            kc, vc = storage.gather(layer, p.block_table[None])
            kp, vp = kc[:, :, :num_keys].to(q.dtype), vc[:, :, :num_keys].to(q.dtype)
            # The chunk attends to its own tokens' fresh K/V, as a whole-prompt prefill would:
            # a lossy cache is read only for the context before the chunk (KIVI's prefill).
            # ``gather`` returns a new tensor, so these writes never touch the cache.
            kp[0, :, p.ctx_len :] = k[sl].transpose(0, 1)
            vp[0, :, p.ctx_len :] = v[sl].transpose(0, 1)
            if context_kernel is not None and context_kernel(
                q[sl], kp[0].transpose(0, 1), vp[0].transpose(0, 1), out[sl],
                combine_windows(window, p.window),
            ):  # fmt: skip
                continue
        mask = meta.prefill_mask(i, window, num_keys)
        op = F.scaled_dot_product_attention(
            qp, kp, vp, attn_mask=mask, is_causal=mask is None, enable_gqa=group > 1
        )
        out[sl] = op[0].transpose(0, 1)
    for p in meta.prefills:
        if p.compact is None:
            continue
        if p.compact.kind == "snapkv":
            sl = slice(p.q_start, p.q_start + p.q_len)
            compact_prompt(q[sl], k[sl], layer, storage, p)
        elif p.in_group:  # H2O, attended by the fused kernel, which added its mass
            compact_heavy(layer, storage, p)
    return out


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


# Queries per block of H2O's attention: bounds its [heads, queries, keys] probabilities.
OBSERVED_QUERY_BLOCK = 256


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


def compact_heavy(layer: int, storage: KVStorage, p: PrefillChunk) -> None:
    """H2O's compaction for one layer once the chunk's mass is in: each KV head's kept
    entries (its newest and its heaviest) copied into the fresh blocks; the mass follows."""
    c, mass = p.compact, p.mass[layer] if p.mass is not None else None
    assert c is not None and mass is not None
    keep = h2o_keep(mass, c.budget, c.window)
    storage.copy_entries(layer, c.src_slots[keep], c.dst_slots)
    p.mass[layer] = mass.gather(1, keep)


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


def h2o_keep(mass: torch.Tensor, budget: int, recent: int) -> torch.Tensor:
    """H2O's choice: ``[KVH, budget]`` entries (ascending) per KV head, its ``recent`` newest
    and the ``budget - recent`` others with the most accumulated mass ``[KVH, S]``."""
    num_kv, s = mass.shape
    newest = torch.arange(s - recent, s, device=mass.device).expand(num_kv, recent)
    heavy = mass[:, : s - recent].topk(budget - recent, dim=-1).indices.sort(dim=-1).values
    return torch.cat([heavy, newest], dim=-1)


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
        k_parts.append(kc[0][:, live].transpose(0, 1).to(q.dtype))  # [N, KVH, D]
        v_parts.append(vc[0][:, live].transpose(0, 1).to(q.dtype))
    kpos_parts.append(torch.arange(c0, c0 + n, device=dev))
    k_parts.append(k)
    v_parts.append(v)
    kpos = torch.cat(kpos_parts)
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
        is_sink = kpos < p.sinks
        seen |= is_sink[None, :] & (kpos[None, :] <= qpos[:, None])
        shift = (qpos - p.sinks - w + 1).clamp(min=0)
        if bool(shift.any()) and bool(is_sink.any()):
            q_back = rotate_back(qf, shift, meta.rotary)  # R(-shift) q
            sink_scores = torch.einsum("lhd,shd->hls", q_back, kr[is_sink]) * scale
            scores[:, :, is_sink] = sink_scores
    scores = scores.masked_fill(~seen[None], float("-inf"))
    return torch.einsum("hls,shd->lhd", scores.softmax(-1), vr).to(q.dtype)


def reference_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    q_positions: torch.Tensor,
    window: int | None = None,
) -> torch.Tensor:
    """Naive causal attention of one sequence for tests: q [L, H, D], keys/values [S, KVH, D]
    holding positions 0..S-1."""
    num_heads, num_kv = q.shape[1], keys.shape[1]
    kr = keys.repeat_interleave(num_heads // num_kv, dim=1)
    vr = values.repeat_interleave(num_heads // num_kv, dim=1)
    scores = torch.einsum("lhd,shd->hls", q.float(), kr.float()) / q.shape[-1] ** 0.5
    kpos = torch.arange(keys.shape[0], device=keys.device)[None, :]
    allowed = kpos <= q_positions[:, None]
    if window is not None:
        allowed &= kpos > q_positions[:, None] - window
    scores = scores.masked_fill(~allowed[None], float("-inf"))
    return torch.einsum("hls,shd->lhd", scores.softmax(-1), vr.float()).to(q.dtype)
