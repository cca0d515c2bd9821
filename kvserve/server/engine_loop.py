"""The engine loop: one thread owns the :class:`LLMEngine`; coroutines talk to it by queues.

The engine is not thread-safe and ``step()`` is CPU-bound PyTorch work, so it can neither be
shared nor run on the event loop (that would stall every connection for a whole step). One
dedicated thread runs ``apply commands -> step -> deliver outputs`` forever:

- HTTP handlers put commands (add, abort, call) on a thread-safe queue and wake the thread;
  commands are applied *between* steps, so an abort takes effect before the next step and the
  request's blocks are freed at once.
- Outputs of a step go back to each request's ``asyncio.Queue`` in one
  ``call_soon_threadsafe`` per step, not one per token.
- Admission is decided in this thread too, against the exact count of sequences in flight.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from kvserve.engine import EngineStats, LLMEngine
from kvserve.kernels.openmp import release_thread_pool
from kvserve.sched.request import InvalidRequestError, RequestOutput, RequestTags, SamplingParams

log = logging.getLogger("kvserve.server")


class QueueFullError(Exception):
    """More sequences in flight than ``max_num_seqs + max_queue``: answer 429."""


class RequestRefusedError(Exception):
    """Admission control refused the request before it ran: answer 429 (503 when the engine
    is overloaded), with Retry-After."""

    def __init__(self, reason: str, retry_after: float, overloaded: bool) -> None:
        super().__init__(f"refused by admission control ({reason}): the request cannot meet "
                         f"its workload class's TTFT SLO now")  # fmt: skip
        self.reason = reason
        self.retry_after = retry_after
        self.overloaded = overloaded


class EngineUnavailableError(Exception):
    """The loop is stopping or has died: answer 503."""


class EngineStepError(Exception):
    """The engine step that computed this request failed (the engine itself carries on, and
    so do the requests outside that step): answer 500."""


class _Admitted:
    pass


ADMITTED = _Admitted()


@dataclass(slots=True)
class SubOutput:
    """An engine output for prompt ``index`` of a (possibly multi-prompt) HTTP request."""

    index: int
    output: RequestOutput


class RequestHandle:
    """One HTTP request's engine requests (one per prompt) and the queue their outputs come on."""

    def __init__(
        self,
        request_id: str,
        prompts: list[dict[str, Any]],
        params: SamplingParams,
        stream: bool,
        arrival_time: float,
        tags: RequestTags | None = None,
    ) -> None:
        self.request_id = request_id
        self.tags = tags
        self.prompts = prompts
        self.params = params
        self.stream = stream
        self.arrival_time = arrival_time
        self.engine_ids = [f"{request_id}-{i}" for i in range(len(prompts))]
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.event_loop = asyncio.get_running_loop()
        self.finished = False  # set by the consumer when every prompt's last output arrived
        self._peeked: list[Any] = []

    async def peek(self) -> None:
        """Wait for the first output (or error) without consuming it; raises a refusal."""
        item = await self.queue.get()
        if isinstance(item, RequestRefusedError):
            raise item
        self._peeked.append(item)

    def ready(self) -> bool:
        """Whether an output (or error) is already here, so that reading it will not wait."""
        return bool(self._peeked) or not self.queue.empty()

    @property
    def num_seqs(self) -> int:
        return self.params.n * len(self.prompts)

    async def outputs(self) -> AsyncIterator[SubOutput]:
        """Every output until each prompt has finished; raises what the engine thread sent."""
        remaining = len(self.prompts)
        while remaining:
            item = self._peeked.pop() if self._peeked else await self.queue.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            if item.output.finished:
                remaining -= 1
        self.finished = True


class EngineLoop:
    """Runs the engine in a background thread. ``max_queue`` bounds the sequences admitted
    beyond ``max_num_seqs`` (None: unbounded)."""

    def __init__(self, engine: LLMEngine, max_queue: int | None = None, metrics: Any = None):
        self.engine = engine
        self.metrics = metrics
        max_seqs = engine.config.scheduler.max_num_seqs
        self.capacity = None if max_queue is None else max_seqs + max_queue
        self.admitted_seqs = 0
        self.peak_admitted_seqs = 0
        self.stats: EngineStats = engine.stats()
        self.error: str | None = None
        self._commands: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._wake = threading.Event()
        # Closing and sending share a lock so no command can slip in after the last drain
        # (an add nobody answers would hang its HTTP handler forever).
        self._lock = threading.Lock()
        self._closed = False
        self._running: dict[str, tuple[RequestHandle, int]] = {}
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="kvserve-engine", daemon=True)

    # -- called from the event loop -------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread (idempotent: an app may be started after a test did)."""
        if not self._thread.is_alive() and not self._stopping:
            release_thread_pool()  # this thread built the engine; the engine thread steps it
            self._thread.start()

    @property
    def refuses(self) -> bool:
        """Whether admission control may refuse a request after it was queued."""
        e = self.engine
        return e.config.scheduler.admission == "projected" and e.workload_classes is not None

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping and self.error is None

    async def submit(self, handle: RequestHandle) -> None:
        """Queue a request and wait for the engine thread to admit it. Raises
        :class:`InvalidRequestError` (400), :class:`QueueFullError` (429) or
        :class:`EngineUnavailableError` (503); on success outputs follow on ``handle.queue``."""
        if not self.alive or not self._send("add", handle):
            raise EngineUnavailableError(self.error or "the engine is shutting down")
        try:
            first = await handle.queue.get()
        except asyncio.CancelledError:
            self.abort(handle)  # FIFO: applied after the add, so nothing is left behind
            raise
        if isinstance(first, BaseException):
            raise first

    def abort(self, handle: RequestHandle) -> None:
        """Abort whatever of the request is still running, before the next engine step."""
        if not handle.finished:
            self._send("abort", handle)

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run ``fn(engine)`` on the engine thread between steps (tests, admin)."""
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        if not self._send("call", fn, fut):
            raise EngineUnavailableError("the engine loop has stopped")
        return await fut

    def shutdown(self, timeout: float = 30.0) -> None:
        """Abort what is still in flight and stop the thread."""
        self._send("stop")
        self._thread.join(timeout)

    def _send(self, *cmd: Any) -> bool:
        with self._lock:
            if self._closed:
                return False
            self._commands.put(cmd)
        self._wake.set()
        return True

    # -- the engine thread ----------------------------------------------------------------
    def _run(self) -> None:
        out: list[tuple[RequestHandle, Any]] = []
        try:
            while not (self._stopping or self.error is not None):
                self._deliver(out)
                out = []
                self._apply_commands(out)
                busy = self.engine.has_unfinished_requests() and not self._stopping
                if busy:
                    try:
                        self._dispatch(self.engine.step(), out)
                    except Exception as e:  # an engine bug: fail the batch, serve on if we can
                        log.exception("engine step failed")
                        self._fail_all(out, f"engine step failed: {type(e).__name__}: {e}")
                    if self.engine.dead is not None:  # a worker died: no step can run
                        self.error = f"engine stopped: {self.engine.dead}"
                        break
                self.stats = s = self.engine.stats()
                if self.metrics is not None:
                    self.metrics.observe_step(s)
                if not busy and not self._stopping:
                    self._deliver(out)
                    out = []
                    self._wake.wait(0.5)
                    self._wake.clear()
                    self.engine.check_health()  # a worker that died while idle: stop now
                    # What the offload tiers stored after the last step (a write-through
                    # finishes later): published now, not at the next request's step.
                    self.engine.publish_kv_events()
                elif s.step_prefill_tokens + s.step_decode_tokens == 0:
                    time.sleep(0.001)  # nothing schedulable this step: do not spin
        except Exception as e:
            log.exception("engine loop failed")
            self.error = f"engine loop failed: {type(e).__name__}: {e}"
        finally:
            # Whatever happened, every waiting handler gets an answer: nothing may hang.
            with self._lock:
                self._closed = True
            self._stopping = True
            try:
                self._apply_commands(out)  # late adds get EngineUnavailableError
                self._fail_all(out, self.error or "the server is shutting down")
                self.stats = self.engine.stats()
            finally:
                self._deliver(out)
                self.engine.shutdown()  # the offload worker: queued stores written first

    def _apply_commands(self, out: list[tuple[RequestHandle, Any]]) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            kind = cmd[0]
            if kind == "add":
                out.append((cmd[1], self._add(cmd[1])))
            elif kind == "abort":
                self._abort(cmd[1])
            elif kind == "call":
                fn, fut = cmd[1], cmd[2]
                try:
                    result: Any = fn(self.engine)
                    setter = fut.set_result
                except Exception as e:
                    result, setter = e, fut.set_exception
                _threadsafe(fut.get_loop(), lambda s=setter, r=result, f=fut: f.done() or s(r))
            elif kind == "stop":
                self._stopping = True

    def _add(self, h: RequestHandle) -> Any:
        if self._stopping or self.error is not None:
            return EngineUnavailableError(self.error or "the engine is shutting down")
        if self.capacity is not None and self.admitted_seqs + h.num_seqs > self.capacity:
            if h.num_seqs > self.capacity:
                return InvalidRequestError(
                    f"n: {h.num_seqs} sequences exceed this server's capacity "
                    f"({self.capacity}: max_num_seqs + max_queue)",
                    "n",
                )
            return QueueFullError(f"{self.admitted_seqs} sequences in flight; the queue is full")
        added: list[str] = []
        try:
            for prompt, rid in zip(h.prompts, h.engine_ids, strict=True):
                self.engine.add_request(rid, prompt, h.params, h.arrival_time, stream=h.stream,
                                        tags=h.tags)  # fmt: skip
                added.append(rid)
        except Exception as e:
            self.engine.abort_request(added)
            if isinstance(e, InvalidRequestError):
                return e
            log.exception("add_request failed")
            return RuntimeError(f"add_request failed: {type(e).__name__}: {e}")
        for i, rid in enumerate(added):
            self._running[rid] = (h, i)
        self.admitted_seqs += h.num_seqs
        self.peak_admitted_seqs = max(self.peak_admitted_seqs, self.admitted_seqs)
        return ADMITTED

    def _abort(self, h: RequestHandle) -> None:
        for rid in h.engine_ids:
            if self._running.pop(rid, None) is not None:
                self.engine.abort_request(rid)
                self.admitted_seqs -= h.params.n
                if self.metrics is not None:
                    self.metrics.observe_ended(rid, "abort", h.params.n)

    def _dispatch(self, outputs: list[RequestOutput], out: list[tuple[RequestHandle, Any]]):
        for o in outputs:
            entry = self._running.get(o.request_id)
            if entry is None:
                continue
            h, i = entry
            if o.refusal is not None:
                del self._running[o.request_id]
                self.admitted_seqs -= h.params.n
                r = o.refusal
                if self.metrics is not None:
                    self.metrics.observe_refused(o)
                out.append((h, RequestRefusedError(r.reason, r.retry_after, r.overloaded)))
                continue
            if o.error is not None:
                del self._running[o.request_id]
                self.admitted_seqs -= h.params.n
                if self.metrics is not None:
                    self.metrics.observe_ended(o.request_id, "error", h.params.n)
                out.append((h, EngineStepError(o.error)))
                continue
            out.append((h, SubOutput(i, o)))
            if self.metrics is not None:
                self.metrics.observe_output(o, h.params.max_tokens)
            if o.finished:
                del self._running[o.request_id]
                self.admitted_seqs -= h.params.n

    def _fail_all(self, out: list[tuple[RequestHandle, Any]], message: str) -> None:
        handles = {h.request_id: h for h, _ in self._running.values()}
        for h in handles.values():
            try:
                self._abort(h)
            except Exception:
                log.exception("abort failed; the engine is unusable")
                self.error = message
            out.append((h, EngineUnavailableError(message)))
        self._running.clear()

    def _deliver(self, out: list[tuple[RequestHandle, Any]]) -> None:
        """Hand a step's outputs to their event loops in one callback per loop."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestHandle, Any]]] = {}
        for h, item in out:
            by_loop.setdefault(h.event_loop, []).append((h, item))
        for loop, items in by_loop.items():
            _threadsafe(loop, lambda items=items: [h.queue.put_nowait(x) for h, x in items])


def _threadsafe(loop: asyncio.AbstractEventLoop, fn: Callable[[], Any]) -> None:
    try:
        loop.call_soon_threadsafe(fn)
    except RuntimeError:  # the event loop has closed: nobody is listening any more
        pass
