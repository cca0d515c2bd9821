"""The in-process engine behind the same interface as the HTTP target.

The engine is not thread-safe, so exactly one thread owns it: the benchmark's event loop posts
requests into an inbox, the engine thread adds them, steps, and hands finished records back with
``call_soon_threadsafe``. The load generator is therefore the same code for both targets, and the
engine's own timestamps (taken at the end of the step that produced each token) give TTFT, ITL
and E2E without any HTTP or streaming overhead. ``scrape`` returns the engine's stats in the
names of the server's /metrics, so reports read the same.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
from typing import Any

from kvserve.bench.metrics import RequestRecord
from kvserve.bench.workloads import BenchRequest
from kvserve.kernels.openmp import release_thread_pool

_STOP = object()


def engine_snapshot(engine: Any) -> dict[str, float]:
    """EngineStats under the metric names the server exports (without ``kvserve:``)."""
    s = engine.stats()
    return {
        "num_requests_running": float(s.num_running),
        "num_requests_waiting": float(s.num_waiting),
        "kv_cache_usage_perc": s.kv_usage,
        "kv_cache_token_occupancy": s.token_occupancy,
        "prefix_cache_queries_total": float(s.prefix_cache_queries),
        "prefix_cache_hits_total": float(s.prefix_cache_hits),
        "prefix_cache_evictions_total": float(s.prefix_cache_evictions),
        "kv_offload_hit_tokens_total": float(s.tier_hit_tokens),
        "num_preemptions_total": float(s.num_preemptions),
        "prompt_tokens_total": float(s.prompt_tokens_total),
        "generation_tokens_total": float(s.generation_tokens_total),
        "kv_allocation_failures_total": float(s.allocation_failures),
        "request_queue_time_seconds_sum": s.queue_time_sum,
        "request_queue_time_seconds_count": float(s.queue_time_count),
        "memory_bytes_read_total": float(s.memory_bytes_read),
        "engine_step_seconds_total": s.step_seconds,
        "memory_bandwidth_peak_bytes_per_second": s.memory_bandwidth_peak,
        **(
            {
                "requests_admitted_total": float(s.admission.admitted),
                "requests_refused_total": float(sum(s.admission.refused.values())),
            }
            if s.admission is not None
            else {}
        ),
    }


class EngineTarget:
    """Benchmark target running an :class:`~kvserve.engine.LLMEngine` in a private thread."""

    def __init__(
        self,
        engine: Any,
        temperature: float = 0.0,
        ignore_eos: bool = True,
        request_timeout: float = 600.0,
        label: str = "in-process engine",
        structured: dict[str, Any] | None = None,
    ) -> None:
        self.engine = engine
        self.structured = structured  # kvserve bench --structured, as structured_outputs
        self.temperature = temperature
        self.ignore_eos = ignore_eos
        self.request_timeout = request_timeout
        self.label = label
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._snapshot = engine_snapshot(engine)
        self._samples: list[dict[str, float]] = []
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @classmethod
    def from_kwargs(cls, engine_kwargs: dict[str, Any], **kwargs: Any) -> EngineTarget:
        """Build the engine as ``kvserve generate`` would (the keyword args of ``LLM``)."""
        from kvserve.llm import LLM

        return cls(LLM(**engine_kwargs).engine, **kwargs)

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        release_thread_pool()  # this thread built the engine; the bench-engine thread steps it
        self._thread = threading.Thread(target=self._run, name="bench-engine", daemon=True)
        self._thread.start()

    async def aclose(self) -> None:
        if self._thread is not None:
            self._inbox.put(_STOP)
            await asyncio.to_thread(self._thread.join, 30)
            self._thread = None

    async def scrape(self) -> dict[str, float] | None:
        with self._lock:
            return dict(self._snapshot)

    async def generate(self, req: BenchRequest) -> RequestRecord:
        assert self._loop is not None, "start() first"
        rec = RequestRecord(req.index, req.kind, req.prefix_group, req.input_len, req.max_tokens)
        rid = f"bench-{next(self._ids)}"
        done = self._loop.create_future()
        rec.send_time = time.monotonic()
        self._inbox.put(("add", rid, req, rec, done))
        try:
            async with asyncio.timeout(self.request_timeout):
                await done
        except TimeoutError:
            self._inbox.put(("abort", rid))
            rec.fail("timeout (request)", f"no answer within {self.request_timeout:g}s")
        return rec

    # -- engine thread ----------------------------------------------------------------------
    def _resolve(self, fut: asyncio.Future[None]) -> None:
        def set_done() -> None:
            if not fut.done():
                fut.set_result(None)

        assert self._loop is not None
        self._loop.call_soon_threadsafe(set_done)

    def _run(self) -> None:
        from kvserve.sched.request import SamplingParams
        from kvserve.structured.params import StructuredOutputsParams

        engine = self.engine
        pending: dict[str, tuple[RequestRecord, asyncio.Future[None]]] = {}
        while True:
            idle = not engine.has_unfinished_requests()
            try:
                item = self._inbox.get(timeout=0.05) if idle else self._inbox.get_nowait()
            except queue.Empty:
                item = None
            while item is not None:
                if item is _STOP:
                    engine.abort_request(list(pending))
                    for rec, fut in pending.values():
                        rec.fail("benchmark stopped", "the target closed with the request open")
                        self._resolve(fut)
                    return
                if item[0] == "abort":
                    engine.abort_request(item[1])
                    pending.pop(item[1], None)
                else:
                    _, rid, req, rec, fut = item
                    try:
                        params = SamplingParams(
                            temperature=self.temperature,
                            max_tokens=req.max_tokens,
                            ignore_eos=self.ignore_eos,
                            structured_outputs=StructuredOutputsParams(**self.structured)
                            if self.structured
                            else None,
                        )
                        engine.add_request(rid, req.prompt, params, arrival_time=rec.send_time)
                        pending[rid] = (rec, fut)
                    except Exception as e:  # noqa: BLE001 - refused requests are counted
                        rec.fail(f"refused ({type(e).__name__})", str(e))
                        self._resolve(fut)
                try:
                    item = self._inbox.get_nowait()
                except queue.Empty:
                    item = None
            if not engine.has_unfinished_requests():
                self._publish(engine, sample=False)
                continue
            try:
                outputs = engine.step()
            except Exception as e:  # noqa: BLE001 - an engine crash fails its requests, not the run
                engine.abort_request(list(pending))
                for rec, fut in pending.values():
                    rec.fail("engine error", f"{type(e).__name__}: {e}")
                    self._resolve(fut)
                pending.clear()
                continue
            # Publish before waking the waiters, so a scrape right after the last request
            # ends already sees the engine idle.
            self._publish(engine, sample=True)
            for out in outputs:
                if out.finished and out.request_id in pending:
                    rec, fut = pending.pop(out.request_id)
                    _fill(rec, out)
                    self._resolve(fut)

    def _publish(self, engine: Any, sample: bool) -> None:
        """Refresh what ``scrape`` returns; a step's snapshot is also a sample of the run,
        taken exactly at each step rather than at a polling interval."""
        snap = engine_snapshot(engine)
        with self._lock:
            self._snapshot = snap
            if sample:
                self._samples.append(snap)

    def take_samples(self) -> list[dict[str, float]]:
        """Per-step snapshots since the last call (the runner uses them instead of polling)."""
        with self._lock:
            out, self._samples = self._samples, []
        return out


def _fill(rec: RequestRecord, out: Any) -> None:
    """Copy a finished RequestOutput into the record; times relative to the send."""
    co = out.outputs[0]
    m = out.metrics
    rec.prompt_tokens = len(out.prompt_token_ids)
    rec.output_tokens = len(co.token_ids)
    rec.output_token_ids = list(co.token_ids)
    rec.output_text = co.text
    rec.cached_tokens = out.num_cached_tokens
    rec.finish_reason = co.finish_reason
    rec.workload_class = out.workload_class
    if m.first_scheduled_time is not None:
        rec.queue_time = m.first_scheduled_time - m.arrival_time
    if out.refusal is not None:
        rec.fail(f"refused ({out.refusal.reason})", "admission control refused it")
        return
    if co.finish_reason == "abort" or not m.token_times:
        rec.fail("aborted", "the engine aborted the request")
        return
    rec.succeed(m.token_times)
