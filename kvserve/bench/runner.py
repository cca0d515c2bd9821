"""Applying load to a target: open loop (arrivals on a schedule, whatever the server does) or
closed loop (N users, each sending the next request when the last one ends).

The two answer different questions: an open loop shows what latency a given traffic rate gets,
and is the only honest way to see queueing (a closed loop slows down with the server and hides
it); a closed loop finds the throughput a fixed number of clients can drive. ``--concurrency``
with a finite ``--request-rate`` caps in-flight requests of an open loop, as vLLM's
``--max-concurrency`` does. /metrics is scraped before, after, and every ``metrics_interval``
seconds in between, so KV usage is seen under load and not only at rest.
"""

from __future__ import annotations

import asyncio
import math
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Protocol, TextIO

from kvserve.bench.metrics import RequestRecord
from kvserve.bench.workloads import BenchRequest, arrival_times


class Target(Protocol):
    label: str

    async def start(self) -> None: ...
    async def aclose(self) -> None: ...
    async def scrape(self) -> dict[str, float] | None: ...
    async def generate(self, req: BenchRequest) -> RequestRecord: ...


@dataclass(slots=True)
class LoadSpec:
    request_rate: float = math.inf
    burstiness: float = 1.0
    concurrency: int | None = None

    def __post_init__(self) -> None:
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency: must be >= 1, got {self.concurrency}")
        if not self.request_rate > 0:
            raise ValueError(f"request_rate: must be > 0, got {self.request_rate}")
        if self.burstiness <= 0:
            raise ValueError(f"burstiness: must be > 0, got {self.burstiness}")

    @property
    def closed_loop(self) -> bool:
        return self.concurrency is not None and math.isinf(self.request_rate)

    def describe(self) -> str:
        if self.closed_loop:
            return f"closed loop, concurrency {self.concurrency}"
        rate = "inf" if math.isinf(self.request_rate) else f"{self.request_rate:g}/s"
        shape = "Poisson" if self.burstiness == 1 else f"gamma burstiness {self.burstiness:g}"
        cap = f", at most {self.concurrency} in flight" if self.concurrency else ""
        return f"open loop, rate {rate} ({shape}){cap}"


@dataclass(slots=True)
class RunResult:
    records: list[RequestRecord]
    duration: float
    before: dict[str, float] | None
    after: dict[str, float] | None
    samples: list[dict[str, float]] = field(default_factory=list)


class Progress:
    """A one-line progress bar on stderr; on a non-terminal, a line per 10 %."""

    def __init__(self, total: int, label: str, enabled: bool = True, file: TextIO | None = None):
        self.total, self.label, self.enabled = total, label, enabled
        self.file = file or sys.stderr
        self.done = self.failed = 0
        self.start = time.monotonic()
        self._tty = getattr(self.file, "isatty", lambda: False)()
        self._last_decile = -1

    def update(self, ok: bool) -> None:
        self.done += 1
        self.failed += 0 if ok else 1
        if not self.enabled:
            return
        frac = self.done / max(1, self.total)
        if self._tty:
            bar = "#" * int(frac * 30)
            self.file.write(
                f"\r{self.label} [{bar:<30}] {self.done}/{self.total} "
                f"failed {self.failed} {time.monotonic() - self.start:6.1f}s"
            )
            if self.done == self.total:
                self.file.write("\n")
            self.file.flush()
        elif int(frac * 10) > self._last_decile:
            self._last_decile = int(frac * 10)
            print(
                f"{self.label}: {self.done}/{self.total} done, {self.failed} failed, "
                f"{time.monotonic() - self.start:.1f}s",
                file=self.file,
                flush=True,
            )


async def _poll(target: Target, interval: float, out: list[dict[str, float]]) -> None:
    while True:
        await asyncio.sleep(interval)
        snap = await target.scrape()
        if snap is not None:
            out.append(snap)


async def run_load(
    target: Target,
    requests: list[BenchRequest],
    load: LoadSpec,
    seed: int = 0,
    warmup: list[BenchRequest] | None = None,
    progress: Progress | None = None,
    metrics_interval: float = 0.5,
) -> RunResult:
    """Warm up, then send ``requests`` under ``load`` and collect one record each (failures
    included). Record times are made relative to the start of the measured run."""
    for r in warmup or []:
        await target.generate(r)
    own_samples = getattr(target, "take_samples", None)
    if own_samples is not None:
        own_samples()  # drop the warm-up's
    before = await target.scrape()
    samples: list[dict[str, float]] = []
    poller = None if own_samples else asyncio.create_task(_poll(target, metrics_interval, samples))
    t0 = time.monotonic()
    records: list[RequestRecord | None] = [None] * len(requests)

    async def one(i: int) -> None:
        rec = await target.generate(requests[i])
        records[i] = rec
        if progress is not None:
            progress.update(rec.success)

    try:
        if load.closed_loop:
            assert load.concurrency is not None
            it = iter(range(len(requests)))

            async def user() -> None:
                for i in it:
                    await one(i)

            await asyncio.gather(*(user() for _ in range(min(load.concurrency, len(requests)))))
        else:
            sem = asyncio.Semaphore(load.concurrency) if load.concurrency else None
            offsets = arrival_times(len(requests), load.request_rate, load.burstiness, seed)

            async def capped(i: int) -> None:
                if sem is None:
                    await one(i)
                    return
                async with sem:
                    await one(i)

            tasks = []
            for i, off in enumerate(offsets):
                delay = t0 + off - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(capped(i)))
            await asyncio.gather(*tasks)
    finally:
        if poller is not None:
            poller.cancel()
            try:
                await poller
            except asyncio.CancelledError:
                pass
    end = time.monotonic()  # as vLLM: failures and stalls cost wall time too
    done = [r for r in records if r is not None]
    after = await target.scrape()
    if own_samples is not None:
        samples = own_samples()
    for r in done:
        r.send_time -= t0
    return RunResult(done, max(end - t0, 1e-9), before, after, samples)


@dataclass(slots=True)
class Point:
    """One measured run of a benchmark: its load, summary and per-request records."""

    load: LoadSpec
    summary: dict[str, Any]
    records: list[RequestRecord]


async def benchmark(
    target: Target,
    workloads: list[list[BenchRequest]],
    loads: list[LoadSpec],
    seed: int = 0,
    warmup: list[BenchRequest] | None = None,
    slo: dict[str, float] | None = None,
    gpu_hour_cost: float | None = None,
    gpus: int = 1,
    progress: bool = True,
    metrics_interval: float = 0.5,
) -> list[Point]:
    """Run each (workload, load) point in turn against one started target and summarize it.

    A sweep gives each point its own draw of the workload (seed + point index) so that a
    point cannot ride on prefix-cache hits left by the previous one."""
    from kvserve.bench.metrics import server_summary, summarize

    points = []
    await target.start()
    try:
        for i, (reqs, load) in enumerate(zip(workloads, loads, strict=True)):
            bar = Progress(len(reqs), load.describe(), enabled=progress)
            res = await run_load(
                target, reqs, load, seed + i, warmup if i == 0 else None, bar, metrics_interval
            )
            s = summarize(res.records, res.duration, slo, gpu_hour_cost, gpus)
            s["server"] = server_summary(res.before, res.after, res.samples)
            s["target"] = target.label
            s["load"] = load.describe()
            s["seed"] = seed + i
            points.append(Point(load, s, res.records))
    finally:
        await target.aclose()
    return points
