"""Executes one step from its plain-data description: batch tensors, the model, sampling.

The runner sees only the :class:`~kvserve.sched.output.SchedulerOutput` (no requests, no KV
manager), so it can live in another process. It keeps what it needs between steps itself:
the sampling state of each request (parameters, tokens drawn so far, a seeded generator),
created from the step's ``new_requests`` and dropped on ``finished_req_ids``.

Per step the runner does O(requests) Python work and a fixed number of tensor ops; nothing
inside the layers loops over requests or tokens. The batch is ordered decode tokens first
(one query each, attended in one fused call), then prefill chunks. Logits are computed only
for the rows that sample (the last row of a sequence that reaches its newest token) and the
prompt rows a request asked logits for.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from kvserve.attention.backend import AttentionBackend
from kvserve.attention.metadata import (
    KERNEL_MAX_QUERY,
    AttentionMetadata,
    Compaction,
    GroupVotes,
    ObservedDecode,
    PagedGroup,
    PrefillChunk,
)
from kvserve.attention.registry import make_backend
from kvserve.config import EngineConfig, ModelConfig
from kvserve.connectors.base import KVConnector, KVConnectorOutput
from kvserve.kernels.allocator import tune_host_allocator
from kvserve.kernels.host_device import to_device
from kvserve.kernels.openmp import ThreadBinding
from kvserve.kv.formats import canonical_kv_format, make_kv_storage
from kvserve.kv.gpu_budget import gpu_num_blocks
from kvserve.kv.layer_groups import LayerGroups, engine_layer_groups
from kvserve.kv.storage import KVStorage
from kvserve.model.dtype import choose_dtype, is_gguf_dir
from kvserve.model.layers import QKVParallelLinear, TensorParallelGroup
from kvserve.model.llama import LlamaForCausalLM
from kvserve.model.loader import load_kv_scales, load_model
from kvserve.model.resolve import resolve_model
from kvserve.sample.sampler import Sampler, SamplingState
from kvserve.sched.output import (
    PENDING_TOKEN_ID,
    ModelRunnerOutput,
    ScheduledSeq,
    SchedulerOutput,
)
from kvserve.structured.compiler import engine_grammar_compiler
from kvserve.worker.cuda_graphs import (
    CudaGraphRunner,
    DecodeInputs,
    build_cuda_graphs,
    is_pure_decode,
    use_cuda_graphs,
)
from kvserve.worker.memory_profile import size_gpu_pool

log = logging.getLogger("kvserve.worker")


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        storage: KVStorage,
        sampler: Sampler,
        device: torch.device,
        layer_groups: LayerGroups | None = None,
        attention: AttentionBackend | None = None,
    ) -> None:
        """``layer_groups``: a hybrid model's per-group block tables (the storage's layers
        alias its slots); each layer attends through its group's tables. ``attention``: the
        attention backend every layer runs (None: the one the model chose for its device)."""
        self.model = model
        if attention is None:
            attention = make_backend(None, device)
        model.set_attention_backend(attention)
        self.attention = attention
        self.layer_groups = layer_groups
        self._group_of = layer_groups.group_of if layer_groups is not None else ()
        self.storage = storage
        self.sampler = sampler
        self.block_size = storage.block_size if storage is not None else 0
        self.num_blocks = 0  # the pool's blocks, set by build_runner
        self.memory_budget = ""  # the GPU pool's arithmetic, where build_runner sized it
        self.cuda_graphs = ""  # the captured decode batch sizes (kvserve.worker.cuda_graphs)
        self.graphs: CudaGraphRunner | None = None  # CUDA graphs of decode steps
        self.device = device
        self.states: dict[str, SamplingState] = {}
        # The compute team's threads each on a core of their own while a step runs
        # (kvserve.kernels.openmp.ThreadBinding; KVSERVE_CPU_OMP_THREADS_BIND).
        self.binding = ThreadBinding.from_env(device)
        # H2O: per request, per layer, the attention mass of each cache entry [KVH, entries]
        self.mass: dict[str, list[torch.Tensor | None]] = {}
        # The worker side of the KV connectors (kvserve.connectors.base; set by the worker)
        self.connector: KVConnector | None = None

    def set_storage(self, storage: KVStorage) -> None:
        """The pool the runner reads and writes (the profiling run's, then the real one)."""
        self.storage = storage
        self.block_size = storage.block_size

    @staticmethod
    def _order(seqs: list[ScheduledSeq]) -> list[ScheduledSeq]:
        """Decode tokens, then short chunks over a cached context, then other prefills: the
        first two groups form one contiguous run of rows for the fused paged kernel."""
        decodes, short, long = [], [], []
        for s in seqs:
            if s.per_sequence:  # sinks + window, a compaction's scoring, H2O's mass
                long.append(s)
            elif s.num_tokens == 1:
                decodes.append(s)
            elif s.num_cached and s.num_tokens <= KERNEL_MAX_QUERY:
                short.append(s)
            else:
                long.append(s)
        return decodes + short + long

    def _apply_kv_ops(self, sched: SchedulerOutput) -> None:
        """The step's KV record, in the order that keeps every byte right: blocks a connector
        saves because this step hands them out again leave before anything overwrites them,
        then frees, copies and the connectors' loads, all before the forward pass."""
        ops, connector = sched.kv_ops, self.connector
        if connector is not None:
            connector.bind_connector_metadata(sched.kv_connector_metadata)
            connector.save_before_step()
        for rid in sched.finished_req_ids:
            self.states.pop(rid, None)
            self.mass.pop(rid, None)
        for rid in sched.preempted_req_ids:
            self.mass.pop(rid, None)  # its cache is recomputed, and its mass with it
        for nr in sched.new_requests:
            self.states[nr.req_id] = self.sampler.add_request(
                nr.sampling_params, nr.prompt_token_ids, list(nr.output_token_ids),
                nr.eos_token_ids,
            )  # fmt: skip
        self.storage.release_blocks(ops.freed)
        self.storage.copy_blocks(ops.copies)
        if connector is not None:
            connector.start_load_kv()
        if sched.pending_token_ids:  # planned before the last step sampled them: ours
            states = self.states
            for s in sched.seqs:
                if s.token_ids[-1] == PENDING_TOKEN_ID:
                    st = states.get(s.req_id)
                    # no sample: the step before failed, and the engine drops this output
                    s.token_ids[-1] = st.output_token_ids[-1] if st and st.output_token_ids else 0

    def _connector_report(self, sched: SchedulerOutput, out: ModelRunnerOutput) -> None:
        """After the forward pass: the connectors' saves of what this step filled, and their
        report of what finished."""
        connector = self.connector
        connector.wait_for_save()
        sent, received = connector.get_finished(set(sched.finished_req_ids))
        report = KVConnectorOutput(sent, received, connector.get_block_ids_with_load_errors(),
                                   connector.num_scheduler_payloads())  # fmt: skip
        report.kv_connector_stats = connector.get_kv_connector_stats() or {}
        out.kv_connector_output = report if report else None
        connector.clear_connector_metadata()

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step: the KV record (exports, frees, copies, loads), the forward pass,
        sampling."""
        binding = self.binding
        if binding is None or not binding.enter():
            return self._execute(sched)
        try:
            return self._execute(sched)
        finally:
            binding.exit()

    @torch.inference_mode()
    def _execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        out = ModelRunnerOutput()
        self._apply_kv_ops(sched)
        if not sched.seqs:  # a step only for the connectors (a finished request's transfer)
            if self.connector is not None:
                self._connector_report(sched, out)
            return out
        items = self._order(sched.seqs)
        rows, spans, sampling = self._output_rows(items)
        ids = [rid for i in sampling for rid in items[i].sample_ids]
        states = [self.states[rid] for rid in ids]
        # the processors' plan before the forward pass: a grammar's mask fills beside it
        plan = self.sampler.plan(states) if states else None
        graphed = self._replay(items)  # a pure-decode step in a CUDA graph, else None
        if graphed is not None:
            hidden, logits = graphed
        else:
            hidden, logits = self._forward(items, rows), None
        if self.connector is not None:
            self._connector_report(sched, out)
        for s in items:  # the forks of an H2O request start from its mass
            if s.observe and len(s.sample_ids) > 1:
                for rid in s.sample_ids[1:]:
                    self.mass[rid] = [m.clone() for m in self.mass[s.req_id]]

        if not rows:
            return out
        if logits is None:
            logits = self.model.logits(hidden)
        for rid, start, n in spans:
            out.prompt_logits[rid] = torch.log_softmax(logits[start : start + n], dim=-1)
        if ids:
            rescore = self._rescore(hidden[: len(ids)])
            sampled = self.sampler(logits[: len(ids)], states, rescore, plan)
            for st, tok in zip(states, sampled.token_ids, strict=True):
                st.append_token(tok)
            out.req_ids = ids
            out.token_ids = sampled.token_ids
            out.logprobs = sampled.logprobs
            out.sampled_logprobs = sampled.sampled_logprobs
        return out

    def _forward(self, items: list[ScheduledSeq], rows: list[int]) -> torch.Tensor:
        """The eager forward pass: hidden states of the ``rows`` the step reads."""
        input_ids, positions, meta = self._prepare(items)
        if self.layer_groups is not None:
            meta.by_layer = self._group_metas(items, meta)
        if self.connector is not None and self.connector.layer_wise:
            for m in meta.by_layer or (meta,):
                m.layer_connector = self.connector
        self.storage.begin_step(meta.slot_mapping_host)
        # only the rows read below leave the last layer (``hidden[i]`` is token ``rows[i]``);
        # a decode step reads every row in order and selects none
        keep = None
        if len(rows) != len(input_ids) or rows != list(range(len(rows))):
            keep = to_device(rows, self.device, torch.long)
        return self.model(input_ids, positions, self.storage, meta, keep)

    def _replay(self, items: list[ScheduledSeq]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Hidden states and logits of a pure-decode step from its CUDA graph, or None: no
        graphs (a CPU, --enforce-eager), a mixed step, a batch past the largest size or a
        sequence past the tables' width."""
        graphs = self.graphs
        if graphs is None or not is_pure_decode(
            items, self.layer_groups is not None,
            self.connector is not None and self.connector.layer_wise,
        ):  # fmt: skip
            return None
        batch = graphs.batch
        if batch.storage is not self.storage:  # a wrapped storage must see every write
            return None
        if batch.windows is None and any(s.window for s in items):
            return None  # captured without retention windows
        width = batch.block_tables.shape[1]
        if any(len(s.block_ids) > width for s in items):
            return None  # a sequence past the captured tables' width
        inputs = DecodeInputs.from_seqs(items, self.block_size, batch.null, width)
        return graphs.run(inputs)

    @staticmethod
    def _output_rows(
        items: list[ScheduledSeq],
    ) -> tuple[list[int], list[tuple[str, int, int]], list[int]]:
        """The token rows whose logits the step reads: each sampling sequence's last row,
        once per sample, then the prompt-logprob rows; the spans (request, first index in
        ``rows``, number of prompt rows) and the indices of the sampling sequences."""
        last, t = [], 0
        for s in items:
            t += s.num_tokens
            last.append(t - 1)
        sampling = [i for i, s in enumerate(items) if s.sample_ids]
        rows = [last[i] for i in sampling for _ in items[i].sample_ids]
        spans = []
        for i, s in enumerate(items):
            n = s.num_prompt_logit_rows
            if n:
                spans.append((s.req_id, len(rows), n))
                first = last[i] - s.num_tokens + 1
                rows.extend(range(first, first + n))
        return rows, spans, sampling

    def _group_metas(
        self, items: list[ScheduledSeq], meta: AttentionMetadata
    ) -> list[AttentionMetadata]:
        """Each layer's metadata: group 0's is ``meta``; the other groups' differ only in
        their block tables (and so in their slots)."""
        metas = [meta]
        for g in range(1, self.layer_groups.num_groups):
            seqs = [replace(s, block_ids=s.group_block_ids[g - 1]) for s in items]
            metas.append(self._prepare(seqs)[2])
        return [metas[g] for g in self._group_of]

    def _rescore(self, hidden: torch.Tensor):  # noqa: ANN202 - a Rescore or None
        """Exact logits for the sampler's greedy candidates, when the model has a float32
        LM head beside its reduced-precision one."""
        if getattr(self.model, "lm_head_fp32", None) is None:
            return None
        return lambda rows, ids: self.model.exact_logits(hidden[rows], ids)

    def _prepare(
        self, items: list[ScheduledSeq]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        bs = self.block_size
        dev = self.device
        null = self.storage.null_block
        nd = 0
        while nd < len(items) and items[nd].num_tokens == 1 and not items[nd].per_sequence:
            nd += 1
        ids: list[int] = []
        pos_chunks: list[np.ndarray] = []
        slot_chunks: list[np.ndarray] = []
        meta = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.long), block_size=bs)

        # q_start, q_len, ctx, retention window, sinks, blocks
        group_rows: list[tuple[int, int, int, int, int, list[int]]] = []
        if nd:
            dec = items[:nd]
            ctx = np.fromiter((s.num_cached for s in dec), np.int64, nd)
            ids.extend(s.token_ids[0] for s in dec)
            table = padded_tables([s.block_ids for s in dec], null)
            pos_chunks.append(np.fromiter((s.position for s in dec), np.int64, nd))
            slot_chunks.append(table[np.arange(nd), ctx // bs] * bs + ctx % bs)
            meta.num_decode = nd
            meta.decode_block_tables = to_device(table, dev)
            meta.decode_seq_lens = to_device(ctx + 1, dev)
            if any(s.window for s in dec):
                wins = np.fromiter((s.window for s in dec), np.int32, nd)
                meta.decode_windows = to_device(wins, dev)
            group_rows += [(i, 1, int(ctx[i]), dec[i].window, 0, dec[i].block_ids)
                           for i in range(nd)]  # fmt: skip

        q_start = nd
        observed: list[tuple[int, int, list[int], list]] = []  # row, entries, table, mass
        voting: list[tuple[int, int, int, list]] = []  # group row, entries, new, mass
        fused_retention = self.attention.serves_retention(self.storage)
        for s in items[nd:]:
            n, c = s.num_tokens, s.num_cached
            ids.extend(s.token_ids)
            pos_chunks.append(np.arange(s.position, s.position + n, dtype=np.int64))
            slot_chunks.append(s.cache_slots(bs))
            bt = np.asarray(s.block_ids, dtype=np.int64)
            table = to_device(bt[: -(-(c + n) // bs)], dev) if c else None
            in_group = bool(c) and n <= KERNEL_MAX_QUERY and not s.per_sequence
            # Retention windows (with StreamingLLM's sinks or without) over a cached context,
            # long chunks too: the kernel reads only the sink and window blocks, where the
            # reference path would gather them and build [heads, queries, keys] scores.
            windowed = s.sinks or (s.window and c)
            in_group |= bool(windowed) and fused_retention and not s.compact and not s.observe
            chunk = PrefillChunk(q_start, n, c, table, in_group, s.window, s.sinks)
            if s.compact:
                chunk.compact = _compaction(s, bs, dev)
            if s.observe:
                layers = self.model.config.num_hidden_layers
                chunk.mass = self.mass.setdefault(s.req_id, [None] * layers)
                if fused_retention:  # every chunk: the kernel adds its mass as it attends
                    chunk.in_group = True
                    voting.append((len(group_rows), c, n, chunk.mass))
                    group_rows.append((q_start, n, c, s.window, 0, s.block_ids))
                elif n == 1 and c and not s.compact:  # attended in one batch with its like
                    chunk.in_group = True
                    observed.append((q_start, c + 1, s.block_ids, chunk.mass))
            meta.prefills.append(chunk)
            if in_group:
                group_rows.append((q_start, n, c, s.window, s.sinks, s.block_ids))
            q_start += n
        if group_rows:
            meta.paged = _paged_group(group_rows, null, dev)
            if voting:
                heads = self.storage.num_kv_heads
                meta.paged.votes = _group_votes(voting, len(group_rows), heads, 2 * bs, dev)
        if observed:
            meta.observed = ObservedDecode(
                to_device([r for r, *_ in observed], dev, torch.long),
                to_device(padded_tables([b for _, _, b, _ in observed], null), dev),
                to_device([e for _, e, _, _ in observed], dev, torch.long),
                [e for _, e, _, _ in observed],
                [m for *_, m in observed],
            )  # fmt: skip

        meta.slot_mapping_host = np.concatenate(slot_chunks)
        meta.slot_mapping = to_device(meta.slot_mapping_host, dev)
        positions = to_device(np.concatenate(pos_chunks), dev)
        input_ids = to_device(ids, dev, torch.long)
        return input_ids, positions, meta


def build_runner(
    config: EngineConfig,
    num_blocks: int | None,
    max_model_len: int,
    tp: TensorParallelGroup | None = None,
) -> ModelRunner:
    """The model, its KV storage of ``num_blocks`` blocks and a sampler, from an engine
    config: what an engine builds in-process, and what a worker in another process builds
    from the same config to execute the engine's steps. ``num_blocks`` None (CUDA): as many
    as the memory left after a profiling forward holds under ``gpu_memory_utilization``.
    With ``tp``, one rank's: its shard of the model and a pool of its KV heads (the sampler is
    the same on every rank, so that every rank draws the same tokens from the same gathered
    logits)."""
    model_dir = Path(resolve_model(config.model, config.revision))
    mc = ModelConfig.from_pretrained(model_dir)
    dtype = choose_dtype(config.dtype, mc, config.device, is_gguf_dir(model_dir)).dtype
    device = torch.device(config.device)
    attention = make_backend(config.attention_backend, device)  # a bad name fails before loading
    if device.type == "cpu":
        tune_host_allocator()
    cc, sc = config.cache, config.scheduler
    kv_name = canonical_kv_format(cc.kv_cache_dtype, str(dtype).removeprefix("torch."))
    model = load_model(model_dir, mc, dtype, device, max_model_len, tp)
    k_scales = v_scales = None
    if kv_name.startswith("fp8") and not cc.calculate_kv_scales:
        k_scales, v_scales = load_kv_scales(model_dir, mc)
        qkv = model.layers[0].qkv_proj
        k_scales, v_scales = _rank_heads(k_scales, qkv), _rank_heads(v_scales, qkv)
    groups = engine_layer_groups(
        mc.layer_windows, kv_name, cc.kv_offload, cc.disable_hybrid_kv_cache_manager
    )

    def make_storage(num_blocks: int) -> KVStorage:
        pool_blocks = num_blocks * groups.num_groups if groups is not None else num_blocks
        return make_kv_storage(
            kv_name, mc.num_hidden_layers, pool_blocks, cc.block_size,
            model.layers[0].num_kv_heads, mc.head_dim, dtype, device,
            max_num_seqs=min(sc.max_num_seqs, num_blocks),
            k_scales=k_scales, v_scales=v_scales,
            layer_slots=groups.slot_of if groups is not None else None,
        )  # fmt: skip

    sampler = Sampler(mc.vocab_size, config.seed, device,
                      grammar_compiler=engine_grammar_compiler(config, model_dir, mc))  # fmt: skip
    log.info("attention backend: %s", attention.name)
    if num_blocks is None:  # CUDA: the pool is what the profiling forward leaves
        runner = ModelRunner(model, None, sampler, device, groups, attention)
        budget = size_gpu_pool(runner, make_storage, config, mc, kv_name, dtype, max_model_len)
        num_blocks = gpu_num_blocks(budget)
        runner.memory_budget = budget.describe()
        runner.set_storage(make_storage(num_blocks))
    else:
        runner = ModelRunner(model, make_storage(num_blocks), sampler, device, groups, attention)
    runner.num_blocks = num_blocks
    if use_cuda_graphs(device, config.enforce_eager):
        runner.graphs = build_cuda_graphs(runner, config, max_model_len)
        runner.cuda_graphs = runner.graphs.describe() if runner.graphs else "none (eager)"
    return runner


def _rank_heads(scales: torch.Tensor | None, qkv: QKVParallelLinear) -> torch.Tensor | None:
    """A checkpoint's per-KV-head scales ``[layers, heads]``: this rank's heads' columns (a
    single scale per layer serves every rank as it is)."""
    if scales is None or scales.shape[1] == 1 or qkv.tp.world_size == 1:
        return scales
    first = (qkv.tp.rank // qkv.num_kv_head_replicas) * qkv.num_kv_heads
    return scales[:, first : first + qkv.num_kv_heads].contiguous()


def padded_tables(tables: list[list[int]], null: int) -> np.ndarray:
    """Block tables as one ``[n, longest]`` array, padded with the null block."""
    out = np.full((len(tables), max(len(b) for b in tables)), null, dtype=np.int64)
    for i, b in enumerate(tables):
        out[i, : len(b)] = b
    return out


def _group_votes(
    voting: list[tuple[int, int, int, list]], num_rows: int, heads: int, spare: int,
    dev: torch.device,
) -> GroupVotes:  # fmt: skip
    """Each H2O row's mass, per layer, grown by zero columns for the chunk's new entries (the
    kernel adds every entry's share in place), with the addresses the kernel writes to; all on
    the device the kernel runs on."""
    layers = len(voting[0][3])
    ptrs = np.zeros((layers, num_rows), dtype=np.int64)
    strides = np.zeros((layers, num_rows), dtype=np.int64)
    keep = []
    for row, c, n, mass in voting:
        for layer in range(layers):
            prev = mass[layer]
            assert (prev is None and c == 0) or (prev is not None and prev.shape[1] == c)
            m = mass[layer] = _grown(prev, c + n, heads, spare, dev)
            ptrs[layer, row], strides[layer, row] = m.data_ptr(), m.stride(0)
            keep.append(m)
    return GroupVotes(to_device(ptrs, dev), to_device(strides, dev), keep)


def _grown(
    prev: torch.Tensor | None, size: int, heads: int, spare: int, dev: torch.device
) -> torch.Tensor:
    """``prev`` [KVH, entries] (None: no entries yet) as a view of ``size`` columns whose new
    ones are zero: a view of the buffer an earlier step grew (its columns past the view were
    zeroed and are written only through such views), else a new buffer with ``spare`` columns
    of room."""
    base = None if prev is None else prev._base
    if (
        prev is not None and base is not None and base.dim() == 2 and base.shape[1] >= size
        and prev.data_ptr() == base.data_ptr() and prev.stride() == base.stride()
    ):  # fmt: skip
        return base[:, :size]
    buf = torch.zeros(heads, size + spare, dtype=torch.float32, device=dev)
    if prev is not None:
        buf[:, : prev.shape[1]] = prev
    return buf[:, :size]


def _compaction(s: ScheduledSeq, bs: int, dev: torch.device) -> Compaction:
    """Slots of the sequence's cache entries (before compaction, this step's included) and of
    the fresh blocks its kept entries go to."""
    kind, budget, a, b = s.compact
    n = s.num_cached + s.num_tokens
    kept = budget if kind == "h2o" else budget + a
    table = np.asarray(s.block_ids, dtype=np.int64)
    fresh = np.asarray(s.compact_block_ids, dtype=np.int64)
    src, dst = np.arange(n), np.arange(kept)
    return Compaction(
        kind, budget, a, b,
        to_device(table[src // bs] * bs + src % bs, dev),
        to_device(fresh[dst // bs] * bs + dst % bs, dev),
    )  # fmt: skip


def _paged_group(
    rows: list[tuple[int, int, int, int, int, list[int]]], null: int, dev: torch.device
) -> PagedGroup:
    """Arrays for the fused kernel over decode tokens, short continuation chunks and
    StreamingLLM's chunks; block tables padded with the null block."""
    table = padded_tables([b for *_, b in rows], null)
    arr = np.array([r[:5] for r in rows], dtype=np.int64)
    num_rows = int(arr[-1, 0] + arr[-1, 1])
    windows = sinks = shift = None
    if arr[:, 3].any():
        windows = to_device(arr[:, 3].astype(np.int32), dev)
    if arr[:, 4].any():  # a query at cache entry c sees its sinks shifted by c - S - w + 1
        sinks = to_device(arr[:, 4].astype(np.int32), dev)
        rot = np.zeros(num_rows, dtype=np.int64)
        for q0, n, c, w, s in arr[arr[:, 4] > 0]:
            rot[q0 : q0 + n] = np.maximum(np.arange(c, c + n) - s - w + 1, 0)
        shift = to_device(rot, dev)
    return PagedGroup(
        num_rows=num_rows,
        q_start=to_device(np.ascontiguousarray(arr[:, 0]), dev),
        q_len=to_device(np.ascontiguousarray(arr[:, 1]), dev),
        ctx_len=to_device(np.ascontiguousarray(arr[:, 2]), dev),
        block_tables=to_device(table, dev),
        windows=windows,
        sinks=sinks,
        sink_shift=shift,
    )
