"""A worker: the model, its KV storage and the runner that executes steps on them.

An executor (:mod:`kvserve.executor`) builds one worker per device, in the engine's process or
in a process of its own, from the same :class:`~kvserve.config.EngineConfig` the engine has.
Everything the engine asks of a worker is a method here, called by name through the
executor's ``collective_rpc`` (or ``execute_model`` for a step); arguments and results are
plain picklable data, so the same calls work across a process boundary. The engine never holds
the model or the storage itself.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from kvserve.config import EngineConfig
from kvserve.connectors.factory import worker_connector
from kvserve.distributed import DistributedInit, init_distributed, place_rank
from kvserve.kv.rank_payloads import merge_identity, rank_value
from kvserve.kv.storage import BlockPayload, KVStorage
from kvserve.model.layers import TensorParallelGroup
from kvserve.sched.output import ModelRunnerOutput, SchedulerOutput
from kvserve.worker.bandwidth import measure_peak_bandwidth, weight_bytes_read
from kvserve.worker.model_runner import ModelRunner, build_runner


@dataclass(slots=True)
class WorkerInfo:
    """What the engine needs to know of a worker's model and KV pool, once, at start."""

    kv_layout: str  # the storage's format name: part of every prefix-cache key
    partial_block_capacity: int | None  # blocks that may be partially filled at once (KIVI)
    weight_bytes: int  # weights one step reads (the bandwidth meter's share per step)
    compute: str  # the linear backend, for the start-up log
    device: str
    pins_host_memory: bool  # exports to the host land in pinned memory (a GPU pool)
    # The storage's identity and pool-wide state (fp8 scales): what an offload tier's keys
    # commit to, so another pool's entries are never read as this one's.
    storage_identity: dict[str, Any] = field(default_factory=dict)
    pool_state: dict[str, Any] = field(default_factory=dict)
    num_blocks: int = 0  # the pool's blocks (sized here on CUDA from the profiling forward)
    memory_budget: str = ""  # the GPU pool's arithmetic (GpuMemoryBudget.describe), if sized here
    cuda_graphs: str = ""  # the captured batch sizes and the capture time ("" when eager)

    @staticmethod
    def of_ranks(infos: list[WorkerInfo]) -> WorkerInfo:
        """The engine's view of a tensor-parallel group's workers: rank 0's facts (its
        weights and pool are each rank's share), with the identity and pool state of the
        merged payloads the ranks' blocks travel as, and the fewest blocks any rank's pool
        holds (ranks that size their pools from their own free memory may differ; a block id
        must exist on every rank)."""
        first = infos[0]
        if len(infos) == 1:
            return first
        pool = {"ranks": [i.pool_state for i in infos]} if first.pool_state else {}
        return dataclasses.replace(
            first,
            storage_identity=merge_identity(first.storage_identity, len(infos)),
            pool_state=pool,
            num_blocks=min(i.num_blocks for i in infos),
        )


class Worker:
    """One rank's model shard, KV pool and runner; ``tp``: its tensor-parallel group (None:
    one rank), which the process that hosts the worker joined first
    (:func:`join_tensor_parallel_group`)."""

    def __init__(
        self,
        config: EngineConfig,
        num_blocks: int | None,
        max_model_len: int,
        rank: int = 0,
        tp: TensorParallelGroup | None = None,
        merged_payloads: bool = True,
    ) -> None:
        """``num_blocks``: None on CUDA sizes the pool from the memory the profiling forward
        leaves (:mod:`kvserve.worker.memory_profile`)."""
        self.rank = rank
        self.tp = tp
        # whether the engine hands this rank every rank's KV payloads merged (one engine over
        # the ranks) or its own alone (an engine per rank: external_launcher)
        self.merged_payloads = merged_payloads
        self.runner: ModelRunner = build_runner(config, num_blocks, max_model_len, tp)
        # The worker side of the engine's KV connectors (None: no connector moves KV).
        self.connector = worker_connector(config)
        if self.connector is not None:
            self.connector.register_kv_caches(self.storage)
        self.runner.connector = self.connector

    @property
    def model(self) -> Any:
        return self.runner.model

    @property
    def storage(self) -> KVStorage:
        return self.runner.storage

    def info(self) -> WorkerInfo:
        st = self.storage
        return WorkerInfo(
            kv_layout=st.format_name,
            partial_block_capacity=getattr(st, "partial_block_capacity", None),
            weight_bytes=weight_bytes_read(self.model),
            compute=self.model.ops.describe(),
            device=str(st.device),
            pins_host_memory=st.host_copies.pins,
            storage_identity=st.identity(),
            pool_state=st.pool_state(),
            num_blocks=self.runner.num_blocks,
            memory_budget=self.runner.memory_budget,
            cuda_graphs=self.runner.cuda_graphs,
        )

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """The step's output; every rank samples the same tokens, and only rank 0's whole
        output goes back (another rank's carries its connectors' report alone)."""
        out = self.runner.execute_model(scheduler_output)
        if self.rank:
            return ModelRunnerOutput(kv_connector_output=out.kv_connector_output)
        return out

    def _own(self, value: Any) -> Any:
        """This rank's part of the payloads in ``value`` (every rank's, merged by the engine:
        :mod:`kvserve.kv.rank_payloads`)."""
        if self.tp is None or not self.merged_payloads:
            return value
        return rank_value(value, self.rank, self.tp.world_size)

    def kv_pool_bytes(self) -> int:
        """The bytes of this rank's KV pool."""
        return self.storage.nbytes()

    def prefault(self) -> int:
        """Fault the pool's pages in now; the bytes touched."""
        return self.storage.prefault()

    def measure_peak_bandwidth(self) -> float:
        """The device's peak read bandwidth; under one engine over the ranks, measured by rank
        0 alone (the figure the engine reads), so that the ranks of one machine do not
        measure each other's contention."""
        if self.rank and self.merged_payloads:
            return 0.0
        return measure_peak_bandwidth(self.storage.device)

    def export_blocks(self, block_ids: list[int]) -> BlockPayload:
        """The blocks' stored bytes, complete (a value the caller may send anywhere)."""
        return self.storage.export_blocks(block_ids).wait()

    def import_blocks(self, block_ids: list[int], payload: BlockPayload) -> None:
        self.storage.import_blocks(block_ids, self._own(payload))

    def shutdown(self) -> None:
        """Release the connectors' threads and sockets (a side channel's port)."""
        if self.connector is not None:
            self.connector.shutdown()

    def wrap_storage(self, wrap: Callable[[KVStorage], KVStorage]) -> None:
        """Swap the storage for ``wrap(storage)`` (instrumented or corrupted storages in
        tests and the quality gate); only while no request holds blocks."""
        self.runner.storage = wrap(self.runner.storage)
        if self.connector is not None:
            self.connector.register_kv_caches(self.runner.storage)

    # -- the KV connectors' channel (kvserve.connectors.base) ----------------------------------
    def receive_kv_connector_payloads(self, payloads: Any) -> None:
        """Bytes the connectors' scheduler side sends for the next step (loaded blocks)."""
        self.connector.receive_worker_payloads(self._own(payloads))

    def take_kv_connector_payloads(self, complete: bool) -> Any:
        """Bytes the connectors produced for their scheduler side (exported blocks);
        ``complete``: wait for device-to-host copies (the bytes leave this process)."""
        out = self.connector.take_scheduler_payloads()
        if complete:
            _wait_payloads(out)
        return out


def join_tensor_parallel_group(
    config: EngineConfig, rank: int, dist_init: DistributedInit | None, place: bool = True
) -> TensorParallelGroup | None:
    """Join this process, rank ``rank``, to the group ``dist_init`` describes (None or one
    rank: no group); first, where ``place`` says the ranks share this machine, confine it to
    its share of the CPUs (:func:`~kvserve.distributed.place_rank`)."""
    if dist_init is None or dist_init.world_size == 1:
        return None
    if place:
        place_rank(rank, dist_init.world_size, config.device)
    comm = init_distributed(dist_init, rank, torch.device(config.device),
                            not config.parallel.disable_custom_all_reduce)  # fmt: skip
    return TensorParallelGroup(rank, dist_init.world_size, comm)


def _wait_payloads(obj: Any) -> None:
    """Every BlockPayload in ``obj`` (nested lists, tuples, dicts) completed."""
    if isinstance(obj, BlockPayload):
        obj.wait()
    elif isinstance(obj, list | tuple):
        for x in obj:
            _wait_payloads(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            _wait_payloads(x)
