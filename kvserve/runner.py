"""Builds one flat batch per step, runs the model and samples.

Per step the runner does O(requests) Python work and a fixed number of tensor ops; nothing
inside the layers loops over requests or tokens. The batch is ordered decode tokens first
(one query each, attended in one fused call), then prefill chunks. Logits are computed only
for the rows that sample: the last token of each request that reaches its newest token.
"""

from __future__ import annotations

import numpy as np
import torch

from kvserve.kv.manager import KVCacheManager
from kvserve.kv.storage import KVStorage
from kvserve.model.attention import KERNEL_MAX_QUERY, AttentionMetadata, PagedGroup, PrefillChunk
from kvserve.model.llama import LlamaForCausalLM
from kvserve.model.sampler import Sampler, SamplerOutput
from kvserve.scheduler import ScheduledRequest, SchedulerOutput


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        storage: KVStorage,
        sampler: Sampler,
        kv: KVCacheManager,
        device: torch.device,
    ) -> None:
        self.model = model
        self.storage = storage
        self.sampler = sampler
        self.kv = kv
        self.block_size = kv.block_size
        self.device = device

    def _order(self, sched: SchedulerOutput) -> list[ScheduledRequest]:
        """Decode tokens, then short chunks over a cached context, then other prefills: the
        first two groups form one contiguous run of rows for the fused paged kernel."""
        decodes, short, long = [], [], []
        for s in sched.scheduled:
            if s.num_new_tokens == 1:
                decodes.append(s)
            elif s.request.num_computed_tokens and s.num_new_tokens <= KERNEL_MAX_QUERY:
                short.append(s)
            else:
                long.append(s)
        return decodes + short + long

    @torch.inference_mode()
    def execute(
        self, sched: SchedulerOutput
    ) -> tuple[list[ScheduledRequest], SamplerOutput | None]:
        """Run one step; returns the scheduled requests that sampled and their tokens.

        Requests that asked for prompt logits also get the log-softmax of every prompt
        position of this chunk appended to ``request.prompt_logits``.
        """
        if self.kv.pending_copies:
            self.storage.copy_blocks(self.kv.pending_copies)
            self.kv.pending_copies.clear()
        items = self._order(sched)
        input_ids, positions, meta, sample_rows = self._prepare(items)
        hidden = self.model(input_ids, positions, self.storage, meta)
        last = self._last_token_index(items)
        sampling = [items[i] for i in sample_rows]
        rows = [last[i] for i in sample_rows]
        spans = []  # (request, first row in `rows`, number of prompt rows)
        for i, s in enumerate(items):
            r = s.request
            if r.wants_prompt_logits and r.num_computed_tokens < r.num_prompt_tokens:
                n = min(s.num_new_tokens, r.num_prompt_tokens - r.num_computed_tokens)
                spans.append((r, len(rows), n))
                rows.extend(
                    range(last[i] - s.num_new_tokens + 1, last[i] - s.num_new_tokens + 1 + n)
                )
        if not rows:
            return [], None
        logits = self.model.logits(hidden[torch.tensor(rows, device=self.device)])
        for r, start, n in spans:
            r.prompt_logits.append(torch.log_softmax(logits[start : start + n], dim=-1))
        if not sampling:
            return [], None
        out = self.sampler(logits[: len(sampling)], [s.request for s in sampling])
        return sampling, out

    @staticmethod
    def _last_token_index(items: list[ScheduledRequest]) -> list[int]:
        ends, t = [], 0
        for s in items:
            t += s.num_new_tokens
            ends.append(t - 1)
        return ends

    def _prepare(
        self, items: list[ScheduledRequest]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        bs = self.block_size
        dev = self.device
        nd = 0
        while nd < len(items) and items[nd].num_new_tokens == 1:
            nd += 1
        ids: list[int] = []
        pos_chunks: list[np.ndarray] = []
        slot_chunks: list[np.ndarray] = []
        sample_rows: list[int] = []

        block_ids = [self.kv.block_ids(s.request) for s in items]
        meta = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.long), block_size=bs)

        if nd:
            ctx = np.fromiter((s.request.num_computed_tokens for s in items[:nd]), np.int64, nd)
            ids.extend(s.request.all_token_ids[s.request.num_computed_tokens] for s in items[:nd])
            max_blocks = max(len(b) for b in block_ids[:nd])
            table = np.zeros((nd, max_blocks), dtype=np.int64)
            for row, b in enumerate(block_ids[:nd]):
                table[row, : len(b)] = b
            pos_chunks.append(ctx)
            slot_chunks.append(table[np.arange(nd), ctx // bs] * bs + ctx % bs)
            meta.num_decode = nd
            meta.decode_block_tables = torch.from_numpy(table).to(dev)
            meta.decode_seq_lens = torch.from_numpy(ctx + 1).to(dev)

        q_start = nd
        group_rows: list[tuple[int, int, int, list[int]]] = []  # q_start, q_len, ctx, blocks
        if nd:
            group_rows += [(i, 1, int(ctx[i]), block_ids[i]) for i in range(nd)]
        for s, b in zip(items[nd:], block_ids[nd:], strict=True):
            r, n = s.request, s.num_new_tokens
            c = r.num_computed_tokens
            ids.extend(r.all_token_ids[c : c + n])
            pos = np.arange(c, c + n, dtype=np.int64)
            bt = np.asarray(b, dtype=np.int64)
            pos_chunks.append(pos)
            slot_chunks.append(bt[pos // bs] * bs + pos % bs)
            table = torch.from_numpy(bt[: -(-(c + n) // bs)]).to(dev) if c else None
            in_group = bool(c) and n <= KERNEL_MAX_QUERY
            meta.prefills.append(PrefillChunk(q_start, n, c, table, in_group))
            if in_group:
                group_rows.append((q_start, n, c, b))
            q_start += n
        if group_rows:
            meta.paged = _paged_group(group_rows, dev)

        for i, s in enumerate(items):
            if s.samples:
                sample_rows.append(i)
        meta.slot_mapping = torch.from_numpy(np.concatenate(slot_chunks)).to(dev)
        positions = torch.from_numpy(np.concatenate(pos_chunks)).to(dev)
        input_ids = torch.tensor(ids, dtype=torch.long, device=dev)
        return input_ids, positions, meta, sample_rows


def _paged_group(rows: list[tuple[int, int, int, list[int]]], dev: torch.device) -> PagedGroup:
    """Arrays for the fused kernel over decode tokens and short continuation chunks."""
    n = len(rows)
    width = max(len(b) for *_, b in rows)
    table = np.zeros((n, width), dtype=np.int64)
    for i, (*_, b) in enumerate(rows):
        table[i, : len(b)] = b
    arr = np.array([r[:3] for r in rows], dtype=np.int64)
    return PagedGroup(
        num_rows=int(arr[-1, 0] + arr[-1, 1]),
        q_start=torch.from_numpy(np.ascontiguousarray(arr[:, 0])).to(dev),
        q_len=torch.from_numpy(np.ascontiguousarray(arr[:, 1])).to(dev),
        ctx_len=torch.from_numpy(np.ascontiguousarray(arr[:, 2])).to(dev),
        block_tables=torch.from_numpy(table).to(dev),
    )
