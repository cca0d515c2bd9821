"""The engine core: the scheduler and KV manager driven by an injected executor and clock.

It knows tokens, not text, and needs no model: the executor reaches the workers
(:mod:`kvserve.executor`), and any object with ``execute_model(SchedulerOutput) ->
ModelRunnerOutput`` may stand in for one (a fake that returns tokens from any source, a cost
model); the clock is any ``() -> float`` (``time.monotonic`` by default; a virtual clock for a
simulator). One step is schedule -> execute -> update; nothing else changes request state.
KV bytes a connector moves between its two sides ride the executor's ``collective_rpc``
around the step, never the step's own messages.

A runner or clock that raises fails only the requests of that step: they finish with status
``error`` and free their blocks, and every other request carries on. A worker that died
(:class:`~kvserve.executor.WorkerDiedError`) fails every request instead, with the executor's
message naming the worker, and the core refuses new ones (:attr:`EngineCore.dead`): no step can
run any more. ``step_hooks`` run after every step (the tests check block conservation there).

With async scheduling (``SchedulerConfig.async_scheduling``, vLLM's ``--async-scheduling``) a
step is planned and sent before the one in flight has landed: the workers go from one step to
the next without waiting for the engine's bookkeeping, and the engine plans while they
compute (:meth:`EngineCore._step_async`). The scheduler counts the step in flight as done, its
sampled tokens as pending (:meth:`~kvserve.sched.scheduler.Scheduler.commit`); the runner
fills them in. A token that ends its request costs one wasted position in the next step.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from kvserve.config import ConfigError, SchedulerConfig
from kvserve.connectors.base import KVConnector
from kvserve.engine.inputs import EngineCoreRequest
from kvserve.executor import Executor, RunnerExecutor, WorkerDiedError
from kvserve.executor.abstract import StepHandle
from kvserve.kv.interface import KVManager
from kvserve.kv.rank_payloads import merge_values
from kvserve.sched.output import ModelRunnerOutput, Runner, SchedulerOutput
from kvserve.sched.request import FINISHED_STATUSES, Request, RequestStatus
from kvserve.sched.scheduler import Scheduler

Clock = Callable[[], float]


class EngineDeadError(RuntimeError):
    """The engine can run no more steps (a worker died); the message says why."""


class EngineCore:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        kv: KVManager,
        runner: Executor | Runner,
        max_model_len: int,
        eos_token_ids: tuple[int, ...] = (),
        clock: Clock = time.monotonic,
        native_window: int = 0,
        connector: KVConnector | None = None,
        load_failure_policy: str = "recompute",
    ) -> None:
        self.kv = kv
        self.scheduler = Scheduler(scheduler_config, kv, max_model_len, native_window, connector,
                                   load_failure_policy)  # fmt: skip
        self.executor = runner if isinstance(runner, Executor) else RunnerExecutor(runner)
        self.connector = connector
        self.clock = clock
        self.eos_token_ids = eos_token_ids
        self.families: dict[str, list[Request]] = {}  # request id -> its n samples
        self.num_steps = 0
        self.last_step = SchedulerOutput()
        self.last_step_seconds = 0.0
        self.step_hooks: list[Callable[[EngineCore], None]] = []
        self.dead: str | None = None  # why no step can run any more (a worker died)
        self.async_scheduling = scheduler_config.async_scheduling
        if self.async_scheduling and connector is not None:  # EngineConfig refuses it too
            raise ConfigError("async_scheduling: not with a KV connector")
        # Async scheduling: the step sent and not landed (its output, when it was sent).
        self._in_flight: tuple[SchedulerOutput, StepHandle, float] | None = None

    def add_request(self, req: EngineCoreRequest) -> list[Request]:
        """Queue a request as its ``n`` samples; sample ``i`` of a seeded request uses seed
        ``seed + i`` (as vLLM), so samples differ. Returns the samples."""
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        if req.request_id in self.families:
            raise ValueError(f"request_id: {req.request_id!r} is already running")
        p = req.sampling_params
        children = []
        for i in range(p.n):
            child_id = req.request_id if p.n == 1 else f"{req.request_id}#{i}"
            params = p if p.seed is None or i == 0 else p.clone(seed=p.seed + i)
            child = Request(
                child_id,
                req.prompt_token_ids,
                params,
                req.max_tokens,
                self.eos_token_ids,
                prompt=req.prompt,
                cache_salt=req.cache_salt,
                arrival_time=req.arrival_time,
                parent_id=req.request_id,
                index=i,
                retention=req.retention,
                priority=req.priority,
                workload_class=req.workload_class,
            )
            children.append(child)
        if req.wants_prompt_logits:
            children[0].prompt_logits = []
        children[0].kv_transfer_params = req.kv_transfer_params
        children[0].forks = children[1:]
        self.scheduler.add_request(children[0])
        self.families[req.request_id] = children
        return children

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Finish requests (by the id they were added with) now and free their blocks;
        unknown ids are ignored."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for rid in request_ids:
            children = self.families.pop(rid, None)
            if children:
                live = [c for c in children if not c.is_finished]
                self.scheduler.finish_requests(live, RequestStatus.FINISHED_ABORTED)

    def finish_request(
        self, request: Request, status: RequestStatus, stop_reason: int | str | None = None
    ) -> None:
        """Finish one sample (a stop string matched in the engine's text)."""
        self.scheduler.finish_requests([request], status, stop_reason)
        children = self.families.get(request.parent_id)
        if children and all(c.is_finished for c in children):
            del self.families[request.parent_id]

    def has_unfinished_requests(self) -> bool:
        """Requests still running or waiting, or finished ones whose blocks a connector holds
        (steps go on until the workers report them sent)."""
        return bool(self.families) or self.scheduler.has_held_blocks or bool(self._in_flight)

    def step(self) -> list[Request]:
        """One step; returns the samples that got a token or finished (failed ones too)."""
        if self.async_scheduling:
            return self._step_async()
        sched, refused = self._schedule()
        self.last_step = sched
        if not sched.seqs and sched.kv_connector_metadata is None:
            if not self.scheduler.awaits_workers:
                return refused
        self.num_steps += 1
        return refused + self._land(sched, lambda: self._execute(sched))

    def _step_async(self) -> list[Request]:
        """Plan and send the next step, then land the one in flight: the samples that got a
        token or finished come from the step before this one."""
        landing, self._in_flight = self._in_flight, None
        sched, refused = self._schedule()
        if sched.seqs:
            self.num_steps += 1
            self.scheduler.commit(sched)
            started = self.clock()
            self._in_flight = (sched, self.executor.execute_model_async(sched), started)
        if landing is None:
            return refused
        sched, handle, started = landing
        self.last_step = sched
        return refused + self._land(sched, handle.result, started)

    def _schedule(self) -> tuple[SchedulerOutput, list[Request]]:
        """The next step, and the requests admission refused since the last (finished)."""
        sched = self.scheduler.schedule(self.clock())
        refused = self.scheduler.take_refused()
        for r in refused:  # finished by their refusal
            self._forget_family(r)
        return sched, refused

    def _land(
        self, sched: SchedulerOutput, output: Callable[[], ModelRunnerOutput],
        started: float | None = None,
    ) -> list[Request]:  # fmt: skip
        """Apply the step's ``output()`` (timed from ``started``, else from now), or fail its
        requests if that or the clock raises; the samples that got a token or finished."""
        try:
            if started is None:
                started = self.clock()
            out = output()
            now = self.clock()
            self.last_step_seconds = now - started
        except Exception as e:  # the runner's or the clock's failure fails this step only
            try:
                now = self.clock()
            except Exception:
                now = float("nan")
            if isinstance(e, WorkerDiedError):  # ... unless no step can run any more
                self.dead = str(e)
                self._in_flight = None  # nothing sent lands
                updated = self.scheduler.fail_all(sched, self.dead, now)
            else:
                updated = self.scheduler.fail_step(sched, f"{type(e).__name__}: {e}", now)
        else:
            updated = self.scheduler.update_from_output(sched, out, started, now)
        for r in updated:
            if r.status in FINISHED_STATUSES:
                self._forget_family(r)
        for hook in self.step_hooks:
            hook(self)
        return updated

    def _execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """The step on the workers, with the bytes the connector's two sides exchange around
        it: loaded blocks to the workers first, exported ones back after."""
        connector, executor = self.connector, self.executor
        if connector is not None:
            payloads = connector.take_worker_payloads()
            if payloads is not None:
                executor.collective_rpc("receive_kv_connector_payloads", (payloads,))
        out = executor.execute_model(sched)
        report = out.kv_connector_output
        if report is not None and report.num_payloads:
            complete = executor.remote  # bytes that cross a process boundary must be final
            # a tensor-parallel engine's ranks each saved their heads: one payload per block
            saved = merge_values(executor.collective_rpc("take_kv_connector_payloads", (complete,)))
            connector.receive_scheduler_payloads(saved)
        return out

    def _forget_family(self, r: Request) -> None:
        """``r`` finished: its family goes once every sample of it has."""
        children = self.families.get(r.parent_id)
        if children and all(c.is_finished for c in children):
            del self.families[r.parent_id]
