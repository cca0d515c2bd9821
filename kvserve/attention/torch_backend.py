"""The reference backend: gather + SDPA (and explicit einsum softmax for retention), in plain
PyTorch on any device and every KV format. Every other backend and every test compares
against it.

Decode tokens (one query each) are attended in a single call: each sequence's blocks are
gathered by its block table into a padded batch (``KVStorage.gather`` decodes any format to
the compute dtype) and a length mask hides the padding. GQA needs no K/V repetition there: the
``G`` query heads that share a KV head become the query-length axis of that head. Each prefill
chunk is attended on its own, against the fresh K/V when it starts the sequence (the common
case: causal, no gather) or against its gathered blocks when it continues a cached prefix or
an earlier chunk; the chunk's own positions then still use its fresh K/V, so a lossy cache
format is read only for the context before the chunk. Retention's sequences take the paths of
:mod:`kvserve.attention.retention`.

A backend with kernels subclasses this one and overrides the hooks it serves
(:meth:`TorchBackend.fused_group`, :meth:`~TorchBackend.decode`,
:meth:`~TorchBackend.causal_prefill`, :meth:`~TorchBackend.context_prefill`); whatever a hook
declines runs here, call by call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvserve.attention.backend import AttentionBackend
from kvserve.attention.metadata import AttentionMetadata, PagedGroup, combine_windows
from kvserve.attention.retention import (
    compact_heavy,
    compact_prompt,
    observed_attention,
    observed_decode,
    retained_attention,
)
from kvserve.attention.rotary import rotate_back
from kvserve.kv.storage import KVStorage


class TorchBackend(AttentionBackend):
    name = "torch"

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: int,
        storage: KVStorage,
        meta: AttentionMetadata,
        window: int | None = None,
    ) -> torch.Tensor:
        if not self.write_kv(layer, storage, meta.slot_mapping, k, v):
            storage.write(layer, meta.slot_mapping, k, v)
        num_tokens, num_heads, head_dim = q.shape
        num_kv_heads = k.shape[1]
        group = num_heads // num_kv_heads
        out = torch.empty_like(q)

        paged = meta.paged
        q_back = None
        if paged is not None and paged.sink_shift is not None:
            q_back = rotate_back(q[: paged.num_rows], paged.sink_shift, meta.rotary)
        fused = paged is not None and self.fused_group(layer, q, storage, paged, window, out,
                                                       q_back)  # fmt: skip
        if not fused and paged is not None and (paged.votes is not None or paged.sinks is not None):
            raise RuntimeError("retention rows were grouped for a fused kernel that declined them")
        nd = 0 if fused else meta.num_decode
        if nd:
            assert meta.decode_block_tables is not None and meta.decode_seq_lens is not None
            dec = self.decode(
                layer, q[:nd], storage, meta.decode_block_tables, meta.decode_seq_lens, window,
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
            if p.ctx_len == 0 and self.causal_prefill(
                q[sl], k[sl], v[sl], out[sl], combine_windows(window, p.window)
            ):
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
                # The chunk attends to its own tokens' fresh K/V, as a whole-prompt prefill
                # would: a lossy cache is read only for the context before the chunk (KIVI's
                # prefill). ``gather`` returns a new tensor, so these writes never touch the
                # cache.
                kp[0, :, p.ctx_len :] = k[sl].transpose(0, 1)
                vp[0, :, p.ctx_len :] = v[sl].transpose(0, 1)
                if self.context_prefill(
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

    # -- hooks a backend with kernels overrides; here each one declines ------------------------
    def write_kv(
        self, layer: int, storage: KVStorage, slot_mapping: torch.Tensor, k: torch.Tensor,
        v: torch.Tensor,
    ) -> bool:  # fmt: skip
        """Write the step's K/V (``[T, KVH, D]`` at flat slots) with a kernel of the backend's;
        False to decline (the storage's own ``write`` runs)."""
        return False

    def fused_group(
        self,
        layer: int,
        q: torch.Tensor,
        storage: KVStorage,
        group: PagedGroup,
        window: int | None,
        out: torch.Tensor,
        q_back: torch.Tensor | None,
    ) -> bool:
        """Attend the group's rows (decode tokens, short continuation chunks and, where
        :meth:`serves_retention`, retention's rows) straight from the blocks into ``out``;
        False to decline. ``q_back``: the queries rotated back for the group's sink keys."""
        return False

    def decode(
        self,
        layer: int,
        q: torch.Tensor,
        storage: KVStorage,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        window: int | None,
        seq_windows: torch.Tensor | None,
    ) -> torch.Tensor | None:
        """Decode attention of one query per sequence (q [B, H, D]) straight from the blocks;
        None to decline. ``seq_lens`` [B]: keys including the new one; ``seq_windows`` [B]:
        each sequence's retention window (0: none) beside the layer's ``window``."""
        return None

    def causal_prefill(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
        window: int | None,
    ) -> bool:  # fmt: skip
        """Causal attention of a chunk that starts its sequence (q [L, H, D] over its own
        k/v [L, KVH, D]) into ``out``; False to decline, with nothing written."""
        return False

    def context_prefill(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
        window: int | None,
    ) -> bool:  # fmt: skip
        """Causal attention of a chunk that continues its sequence, over the whole sequence's
        keys (k/v [context + chunk, KVH, D]: the gathered context, then its own) into ``out``;
        False to decline, with nothing written."""
        return False


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
