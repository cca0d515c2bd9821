"""The executor: how the engine reaches the workers that hold the model and the KV pool.

The engine core asks for two things. ``execute_model(SchedulerOutput) -> ModelRunnerOutput``
runs a step on every worker (the step is plain data, so it can be sent anywhere) and returns
the first worker's output. ``collective_rpc(method, *args)`` calls a
:class:`~kvserve.worker.worker.Worker` method on every worker and returns their results in
rank order: everything else the engine needs of a worker goes through it (prefault, block
export and import, the bandwidth probe). ``method`` is a method name, or a picklable function
that takes the worker first.

An executor whose worker process dies raises :class:`WorkerDiedError` from the call it was in
(or from :meth:`Executor.check_health` between steps), naming the worker, within the time the
operating system takes to report a dead process: never a hang. A worker that raises stays
alive: its error comes back as :class:`WorkerError` and only that call fails, unless it left
tensor-parallel peers waiting for it in a collective (the ranks are then out of step, and the
executor fails with :class:`WorkerDiedError` naming it).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from kvserve.sched.output import ModelRunnerOutput, SchedulerOutput
from kvserve.worker.worker import WorkerInfo

Method = str | Callable[..., Any]


class WorkerDiedError(RuntimeError):
    """A worker process is gone; the engine cannot run another step."""


class WorkerError(RuntimeError):
    """A worker raised while serving a call; the worker itself carries on."""


class StepHandle:
    """A step sent to the workers (:meth:`Executor.execute_model_async`): ``result()`` waits
    for its output, or raises what the step raised."""

    __slots__ = ("_value", "_error", "_wait")

    def __init__(self, wait: Callable[[], None] | None = None) -> None:
        self._value: ModelRunnerOutput | None = None
        self._error: BaseException | None = None
        self._wait = wait  # lands this step (and any sent before it); None: landed

    def land(self, value: ModelRunnerOutput | None, error: BaseException | None) -> None:
        self._value, self._error, self._wait = value, error, None

    def result(self) -> ModelRunnerOutput:
        if self._wait is not None:
            self._wait()
        if self._error is not None:
            raise self._error
        assert self._value is not None
        return self._value


class Executor(ABC):
    # The workers' model and pool facts, or None for an executor with no worker (a custom
    # runner: the simulator's cost model, a test's fake).
    info: WorkerInfo | None = None
    # Whether calls cross a process boundary (their arguments and results are pickled).
    remote: bool = False

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> StepHandle:
        """Send a step and return before its output (async scheduling: the engine plans the
        next step meanwhile). Workers in this process run it now; an executor whose workers
        run elsewhere returns at once. Steps land in the order they were sent."""
        handle = StepHandle()
        try:
            handle.land(self.execute_model(scheduler_output), None)
        except Exception as e:  # noqa: BLE001 - raised where the engine takes the output
            handle.land(None, e)
        return handle

    @abstractmethod
    def collective_rpc(
        self, method: Method, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> list[Any]: ...

    def check_health(self) -> None:  # noqa: B027 - no worker process by default
        """Raise :class:`WorkerDiedError` if a worker is gone."""

    def shutdown(self) -> None:  # noqa: B027 - nothing to release by default
        """Stop the workers (idempotent)."""


def call_worker(worker: Any, method: Method, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """One worker's share of a ``collective_rpc``."""
    if isinstance(method, str):
        return getattr(worker, method)(*args, **kwargs)
    return method(worker, *args, **kwargs)
