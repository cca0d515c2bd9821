"""CUDA graphs for pure-decode steps: the capture sizes, a step's bucket, its inputs padded
to the bucket, and the capture/replay wrapper.

A decode step launches a few hundred small kernels; on a GPU their launch cost, not the
GPU, sets the step's pace. A CUDA graph replays them with one launch, but only for the shapes
it was captured at, reading fixed addresses. So decode batches are padded up to the next
captured size (vLLM's buckets: 1, 2, 4, then multiples of 8, at most 256), and every input
lives in a static buffer the replay reads:

* padded rows feed token 0 at position 0, write their K/V into the **null block**'s first
  slot, and attend that one entry (length 1, a table of null blocks), so they touch no real
  block and stay finite; the captured graph zeroes the null block again after the forward,
  keeping the storage's promise that it reads as zeros;
* block tables have a fixed width (the blocks of ``max_model_len``, at most
  :data:`MAX_GRAPH_CONTEXT` tokens' worth), padded with the null block; attention masks stop
  at each row's length, so the padding is never attended.

Mixed steps (prefill chunks), sequences past the tables' width, retention that needs more
than the plain paged path, hybrid models' per-group tables and layer-wise connectors run
eagerly. Everything but :class:`CudaGraphRunner` is device-neutral and CI tests it on a CPU
against the runner's eager path; the graph runner is built only on CUDA and without
``enforce_eager``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from kvserve.attention.metadata import AttentionMetadata, PagedGroup
from kvserve.kv.storage import KVStorage
from kvserve.sched.output import ScheduledSeq
from kvserve.worker.step_buffers import StepBuffers

log = logging.getLogger("kvserve.worker")

MAX_CAPTURE_SIZE = 256  # vLLM's largest default capture size
# Cache entries a captured step's block tables reach at most: the torch backend gathers a
# table's whole width, so a width of max_model_len's blocks would make every replay (and the
# capture's memory) that of the longest sequence. Longer sequences' steps run eagerly.
MAX_GRAPH_CONTEXT = 4096


def default_capture_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """vLLM's capture sizes: 1, 2, 4, then multiples of 8 up to 256, those up to the first
    that holds ``max_num_seqs`` (so a full batch has a bucket while it fits under 256)."""
    sizes = [1, 2, 4, *range(8, MAX_CAPTURE_SIZE + 1, 8)]
    cover = next((s for s in sizes if s >= max_num_seqs), MAX_CAPTURE_SIZE)
    return tuple(s for s in sizes if s <= cover)


def capture_sizes(max_num_seqs: int, given: str | None) -> tuple[int, ...]:
    """The sizes to capture: ``cuda_graph_sizes`` as given (canonical text, ascending), else
    :func:`default_capture_sizes`."""
    if given:
        return tuple(int(x) for x in given.split(","))
    return default_capture_sizes(max_num_seqs)


def bucket_for(n: int, sizes: tuple[int, ...]) -> int | None:
    """The smallest captured size that holds ``n`` rows, or None (the step runs eagerly)."""
    for s in sizes:
        if s >= n:
            return s
    return None


def use_cuda_graphs(device: torch.device, enforce_eager: bool) -> bool:
    """Graphs only on CUDA and unless ``enforce_eager``: a CPU always runs eagerly."""
    return device.type == "cuda" and not enforce_eager


def is_pure_decode(items: list[ScheduledSeq], grouped: bool, layer_wise: bool) -> bool:
    """A step the graphs can replay: every sequence one plain decode token that samples
    once, no prompt logits, no hybrid per-group tables, no layer-wise connector."""
    return bool(items) and not grouped and not layer_wise and all(
        s.num_tokens == 1 and not s.per_sequence and len(s.sample_ids) == 1
        and not s.num_prompt_logit_rows
        for s in items
    )  # fmt: skip


@dataclass(slots=True)
class DecodeInputs:
    """One decode batch's inputs, one row per sequence (host arrays)."""

    token_ids: np.ndarray  # [B] int64
    positions: np.ndarray  # [B] int64 RoPE positions
    slot_mapping: np.ndarray  # [B] int64 where each new K/V goes
    block_tables: np.ndarray  # [B, W] int64, padded with the null block
    seq_lens: np.ndarray  # [B] int64 cache entries, the new one included
    windows: np.ndarray  # [B] int32 retention windows (0: none)

    @classmethod
    def from_seqs(cls, items: list[ScheduledSeq], block_size: int, null: int,
                  width: int) -> DecodeInputs:  # fmt: skip
        """The batch of ``items`` (pure decode) with tables ``width`` blocks wide."""
        n = len(items)
        ctx = np.fromiter((s.num_cached for s in items), np.int64, n)
        table = np.full((n, width), null, dtype=np.int64)
        for i, s in enumerate(items):
            if len(s.block_ids) > width:
                raise ValueError(
                    f"block_tables: a sequence holds {len(s.block_ids)} blocks, more than the "
                    f"graphs' width of {width}"
                )
            table[i, : len(s.block_ids)] = s.block_ids
        return cls(
            token_ids=np.fromiter((s.token_ids[0] for s in items), np.int64, n),
            positions=np.fromiter((s.position for s in items), np.int64, n),
            slot_mapping=table[np.arange(n), ctx // block_size] * block_size + ctx % block_size,
            block_tables=table,
            seq_lens=ctx + 1,
            windows=np.fromiter((s.window for s in items), np.int32, n),
        )


def pad_decode_inputs(x: DecodeInputs, bucket: int, null: int, block_size: int) -> DecodeInputs:
    """``x`` padded to ``bucket`` rows: each padded row is token 0 at position 0 whose K/V
    go to the null block's first slot and which attends that one entry."""
    n = len(x.token_ids)
    if n > bucket:
        raise ValueError(f"batch: {n} rows do not fit a bucket of {bucket}")
    pad = bucket - n

    def grow(a: np.ndarray, value: int) -> np.ndarray:
        return np.concatenate([a, np.full((pad, *a.shape[1:]), value, dtype=a.dtype)])

    return DecodeInputs(
        token_ids=grow(x.token_ids, 0),
        positions=grow(x.positions, 0),
        slot_mapping=grow(x.slot_mapping, null * block_size),
        block_tables=grow(x.block_tables, null),
        seq_lens=grow(x.seq_lens, 1),
        windows=grow(x.windows, 0),
    )


def decode_metadata(
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    windows: torch.Tensor | None,
    block_size: int,
) -> AttentionMetadata:
    """The attention metadata of a pure-decode batch over these tensors (the graphs' static
    buffers, or a step's own), as the runner's eager path describes such a batch."""
    b = len(slot_mapping)
    dev = slot_mapping.device
    meta = AttentionMetadata(slot_mapping=slot_mapping, block_size=block_size)
    meta.num_decode = b
    meta.decode_block_tables = block_tables
    meta.decode_seq_lens = seq_lens
    meta.decode_windows = windows
    meta.paged = PagedGroup(
        num_rows=b,
        q_start=torch.arange(b, device=dev),
        q_len=torch.ones(b, dtype=torch.long, device=dev),
        ctx_len=seq_lens - 1,
        block_tables=block_tables,
        windows=windows,
    )
    return meta


def clear_null_block(storage) -> None:  # noqa: ANN001 - a KVStorage
    """Zero the null block's rows again (padded rows wrote into them)."""
    null = storage.null_block
    for tensors in storage.block_tensors().values():
        for t in tensors:
            t[null].zero_()


class StaticDecodeBatch:
    """Static input buffers for decode batches of up to ``max(sizes)`` rows, and the decode
    forward over their first ``b`` rows: what a graph captures and replays. Device-neutral
    (CI runs it on a CPU against the eager path); only :class:`CudaGraphRunner` captures."""

    def __init__(self, model, storage, max_rows: int, width: int,  # noqa: ANN001
                 device: torch.device, windowed: bool) -> None:  # fmt: skip
        self.model, self.storage = model, storage
        self.block_size, self.null = storage.block_size, storage.null_block
        self.buffers = StepBuffers(max_rows, max_rows, width, device)
        d = self.buffers.on_device  # the addresses the graphs read
        self.token_ids, self.positions = d["token_ids"], d["positions"]
        self.slot_mapping, self.seq_lens = d["slot_mapping"], d["seq_lens"]
        self.block_tables = d["block_tables"]
        self.windows = d["windows"] if windowed else None
        # every row a padded one until a batch fills it: capture writes only the null block
        i64 = np.zeros(0, dtype=np.int64)
        empty = DecodeInputs(i64, i64, i64, np.zeros((0, width), dtype=np.int64), i64,
                             np.zeros(0, dtype=np.int32))  # fmt: skip
        self.fill(pad_decode_inputs(empty, max_rows, self.null, self.block_size))

    def fill(self, p: DecodeInputs) -> None:
        """Stage a padded batch into the buffers' first rows (pinned host rows copied
        without blocking on CUDA)."""
        stage = self.buffers.stage
        stage("token_ids", p.token_ids)
        stage("positions", p.positions)
        stage("slot_mapping", p.slot_mapping)
        stage("seq_lens", p.seq_lens)
        stage("block_tables", p.block_tables)
        if self.windows is not None:
            stage("windows", p.windows)

    def forward(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Hidden states and logits of the first ``b`` rows; the null block zeroed after."""
        w = self.windows[:b] if self.windows is not None else None
        meta = decode_metadata(self.slot_mapping[:b], self.block_tables[:b], self.seq_lens[:b],
                               w, self.block_size)  # fmt: skip
        hidden = self.model(self.token_ids[:b], self.positions[:b], self.storage, meta, None)
        logits = self.model.logits(hidden)
        clear_null_block(self.storage)
        return hidden, logits


class CudaGraphRunner:
    """CUDA only: one graph per capture size of :meth:`StaticDecodeBatch.forward`.
    :meth:`run` pads a batch to its bucket, copies it in and replays."""

    def __init__(self, batch: StaticDecodeBatch, sizes: tuple[int, ...]) -> None:
        self.batch, self.sizes = batch, sizes
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.capture_seconds = 0.0

    @torch.inference_mode()
    def capture(self) -> None:
        """Largest size first, sharing one memory pool (vLLM's order)."""
        assert self.batch.token_ids.device.type == "cuda", "CUDA graphs are captured on CUDA"
        t0 = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        for b in reversed(self.sizes):
            self.batch.forward(b)  # warm-up: lazy initialisations stay outside the graph
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                self.outputs[b] = self.batch.forward(b)
            self.graphs[b] = g
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - t0

    def run(self, x: DecodeInputs) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Hidden states and logits of ``x``'s rows, or None where no bucket holds it."""
        n = len(x.token_ids)
        b = bucket_for(n, self.sizes)
        if b is None:
            return None
        self.batch.fill(pad_decode_inputs(x, b, self.batch.null, self.batch.block_size))
        self.graphs[b].replay()
        hidden, logits = self.outputs[b]
        return hidden[:n], logits[:n]

    def describe(self) -> str:
        return (f"{len(self.sizes)} decode batch sizes ({self.sizes[0]}..{self.sizes[-1]}) "
                f"captured in {self.capture_seconds:.2f} s")  # fmt: skip


def build_cuda_graphs(runner, config, max_model_len: int) -> CudaGraphRunner | None:  # noqa: ANN001
    """The runner's decode graphs, captured now; None (eager, with a warning) where its
    storage plans steps on the host (KIVI's ``begin_step``, a wrapped storage), a hybrid
    model's groups need tables of their own, or capture fails."""
    storage = runner.storage
    if type(storage).begin_step is not KVStorage.begin_step or runner.layer_groups is not None:
        log.warning("CUDA graphs: not for %s storage or a hybrid model; decode runs eagerly",
                    storage.format_name)  # fmt: skip
        return None
    sizes = capture_sizes(config.scheduler.max_num_seqs, config.cuda_graph_sizes)
    width = -(-min(max_model_len, MAX_GRAPH_CONTEXT) // storage.block_size)
    windowed = bool(config.cache.kv_retention)
    batch = StaticDecodeBatch(runner.model, storage, sizes[-1], width, runner.device, windowed)
    graphs = CudaGraphRunner(batch, sizes)
    try:
        graphs.capture()
    except RuntimeError as e:  # an op that syncs or allocates on the host: stay eager
        log.warning("CUDA graphs: capture failed (%s); decode runs eagerly", e)
        return None
    return graphs
