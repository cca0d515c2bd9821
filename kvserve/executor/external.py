"""Every process of a torchrun launch is one rank running the whole engine (vLLM's
``external_launcher``): no process of kvserve's own starts another.

    torchrun --nnodes 2 --node-rank 0 --nproc-per-node 4 --master-addr HOST --master-port 29500 \\
        my_program.py        # LLM(model, tensor_parallel_size=8,
                             #     distributed_executor_backend="external_launcher")

Each process builds the same engine and is given the same requests; its scheduler makes the
same decisions as every other's (scheduling is deterministic in its inputs), its worker holds
its rank's shard and joins the group torchrun's environment names (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``; ``LOCAL_RANK`` picks its GPU or its share of the CPUs), and
every rank samples the same tokens, so every process returns the same outputs. This is the
launch for a program of one's own on clusters without Ray (``--nnodes`` and the rest are
torchrun's flags here); ``kvserve serve --nnodes`` runs the ``mp`` backend's ranks across
machines instead (:mod:`kvserve.executor.headless`).

A peer that is lost (its process or its machine) fails a collective: at once where its socket
closed, else after the group's timeout. The engine then stops with
:class:`~kvserve.executor.abstract.WorkerDiedError` naming this rank and the error: it cannot
know which peer went, and never waits for one that will not answer.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from kvserve import envs
from kvserve.config import ConfigError, EngineConfig
from kvserve.distributed import DistributedInit, place_local
from kvserve.distributed.communicator import backend_for
from kvserve.executor.abstract import Executor, Method, WorkerDiedError, call_worker
from kvserve.sched.output import ModelRunnerOutput, SchedulerOutput
from kvserve.worker.worker import Worker, join_tensor_parallel_group


def torchrun_init(config: EngineConfig) -> tuple[int, int, DistributedInit]:
    """(rank, local rank, how to join the group) from torchrun's environment; refused with
    the variable's name where it is missing or disagrees with the config."""
    rank, world = envs.RANK, envs.WORLD_SIZE
    tp = config.parallel.tensor_parallel_size
    if rank is None or world is None or envs.MASTER_PORT is None:
        raise ConfigError("distributed_executor_backend: 'external_launcher' runs under "
                          "torchrun, which sets RANK, WORLD_SIZE and MASTER_PORT; they are "
                          "not set")  # fmt: skip
    if world != tp:
        raise ConfigError(f"tensor_parallel_size: {tp}, but torchrun launched WORLD_SIZE "
                          f"{world} processes; give one rank per process")  # fmt: skip
    local = envs.LOCAL_RANK if envs.LOCAL_RANK is not None else rank
    init = DistributedInit(world, envs.MASTER_ADDR, envs.MASTER_PORT,
                           backend_for(config.device))  # fmt: skip
    return rank, local, init


class ExternalLauncherExecutor(Executor):
    def __init__(self, config: EngineConfig, num_blocks: int, max_model_len: int) -> None:
        rank, local, init = torchrun_init(config)
        local_world = envs.LOCAL_WORLD_SIZE or init.world_size
        # placed among this machine's ranks, as the mp executor places its workers
        config = dataclasses.replace(config, device=place_local(config.device, local, local_world))
        tp = join_tensor_parallel_group(config, rank, init, place=False)
        self.rank = rank
        # this process's engine moves this rank's KV bytes alone
        self.driver_worker = Worker(config, num_blocks, max_model_len, rank, tp,
                                    merged_payloads=False)  # fmt: skip
        self.info = self.driver_worker.info()
        self._dead: str | None = None

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        if self._dead is not None:
            raise WorkerDiedError(self._dead)
        try:
            return self.driver_worker.runner.execute_model(scheduler_output)
        except RuntimeError as e:  # a collective that lost its peer
            if not _is_collective_failure(e):
                raise
            first = str(e).splitlines()[0] if str(e) else ""
            self._dead = (f"rank {self.rank}: a peer rank is gone ({type(e).__name__}: "
                          f"{first}); the engine cannot run more steps")  # fmt: skip
            raise WorkerDiedError(self._dead) from None

    def collective_rpc(
        self, method: Method, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> list[Any]:
        # Every rank's process runs this call itself: this process answers for its rank.
        return [call_worker(self.driver_worker, method, args, kwargs or {})]

    def check_health(self) -> None:
        if self._dead is not None:
            raise WorkerDiedError(self._dead)


def _is_collective_failure(e: BaseException) -> bool:
    text = str(e).lower()
    return any(k in text for k in ("gloo", "nccl", "connection", "timed out", "timeout",
                                   "peer"))  # fmt: skip
