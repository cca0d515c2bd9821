"""Executors: how the engine reaches the workers that hold the model and the KV pool
(:mod:`kvserve.executor.abstract` says what an executor promises)."""

from __future__ import annotations

from kvserve.config import EngineConfig
from kvserve.executor.abstract import Executor, WorkerDiedError, WorkerError
from kvserve.executor.uniproc import RunnerExecutor, UniProcExecutor

__all__ = [
    "Executor",
    "RunnerExecutor",
    "UniProcExecutor",
    "WorkerDiedError",
    "WorkerError",
    "make_executor",
]


def make_executor(config: EngineConfig, num_blocks: int, max_model_len: int) -> Executor:
    """The executor ``config.parallel.distributed_executor_backend`` names."""
    backend = config.parallel.distributed_executor_backend
    if backend == "mp":
        from kvserve.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor(config, num_blocks, max_model_len)
    if backend == "external_launcher":
        from kvserve.executor.external import ExternalLauncherExecutor

        return ExternalLauncherExecutor(config, num_blocks, max_model_len)
    if backend == "ray":
        from kvserve.executor.ray import RayExecutor

        return RayExecutor(config, num_blocks, max_model_len)
    return UniProcExecutor(config, num_blocks, max_model_len)
