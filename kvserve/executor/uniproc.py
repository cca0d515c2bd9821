"""Executors in the engine's own process: one worker called directly, or a custom runner."""

from __future__ import annotations

from typing import Any

from kvserve.config import EngineConfig
from kvserve.executor.abstract import Executor, Method, call_worker
from kvserve.sched.output import ModelRunnerOutput, Runner, SchedulerOutput
from kvserve.worker.worker import Worker


class UniProcExecutor(Executor):
    """The model in the engine's process: a step is a method call (vLLM's ``uni``)."""

    def __init__(self, config: EngineConfig, num_blocks: int, max_model_len: int) -> None:
        self.driver_worker = Worker(config, num_blocks, max_model_len)
        self.info = self.driver_worker.info()

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.driver_worker.execute_model(scheduler_output)

    def collective_rpc(
        self, method: Method, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> list[Any]:
        return [call_worker(self.driver_worker, method, args, kwargs or {})]

    def shutdown(self) -> None:
        self.driver_worker.shutdown()


class RunnerExecutor(Executor):
    """Steps executed by a custom runner (the simulator's cost model, a test's fake): there is
    no worker, model or KV pool to call, but a runner may answer the worker calls it
    implements (the simulator's runner takes a connector's payloads)."""

    def __init__(self, runner: Runner) -> None:
        self.runner = runner

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute_model(scheduler_output)

    def collective_rpc(
        self, method: Method, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> list[Any]:
        if isinstance(method, str) and hasattr(self.runner, method):
            return [getattr(self.runner, method)(*args, **(kwargs or {}))]
        name = method if isinstance(method, str) else getattr(method, "__name__", "call")
        raise RuntimeError(f"{name}: this engine's steps run in a custom runner, which has no "
                           "worker, model or KV pool to ask")  # fmt: skip
