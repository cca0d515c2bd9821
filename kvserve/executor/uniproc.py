"""Executors in the engine's own process: one worker called directly, or a custom runner."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvserve.config import EngineConfig
from kvserve.executor.abstract import Executor, Method, StepHandle, call_worker
from kvserve.sched.output import ModelRunnerOutput, Runner, SchedulerOutput
from kvserve.worker.worker import Worker


class UniProcExecutor(Executor):
    """The model in the engine's process: a step is a method call (vLLM's ``uni``).

    With async scheduling on a GPU the worker runs on a thread of its own: a step sent
    returns at once, and while that thread waits for the device's sampled tokens (without
    the interpreter lock), the engine's thread plans the next step. On a CPU the compute
    threads take every core and the two threads would share one lock and those cores, so a
    step runs when sent (``step_thread`` forces either way). Every call to the worker goes
    through the one thread, in the order sent: a call made while a step is in flight runs
    after it."""

    step_thread: bool | None = None  # None: on a GPU only

    def __init__(self, config: EngineConfig, num_blocks: int, max_model_len: int) -> None:
        self.driver_worker = Worker(config, num_blocks, max_model_len)
        self.info = self.driver_worker.info()
        self._thread: ThreadPoolExecutor | None = None
        threaded = self.step_thread
        if threaded is None:
            threaded = not config.device.startswith("cpu")
        if config.scheduler.async_scheduling and threaded:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="kvserve-step")

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        if self._thread is not None:  # after the steps in flight
            return self._thread.submit(self.driver_worker.execute_model, scheduler_output).result()
        return self.driver_worker.execute_model(scheduler_output)

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> StepHandle:
        if self._thread is None:
            return super().execute_model_async(scheduler_output)
        future = self._thread.submit(self.driver_worker.execute_model, scheduler_output)

        def land() -> None:
            try:
                handle.land(future.result(), None)
            except Exception as e:  # noqa: BLE001 - raised where the engine takes the output
                handle.land(None, e)

        handle = StepHandle(land)
        return handle

    def collective_rpc(
        self, method: Method, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> list[Any]:
        if self._thread is not None:  # after the steps in flight
            call = self._thread.submit(call_worker, self.driver_worker, method, args, kwargs or {})
            return [call.result()]
        return [call_worker(self.driver_worker, method, args, kwargs or {})]

    def shutdown(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=True)
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
