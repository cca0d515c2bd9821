"""The router's ``/metrics`` carries its process's own families, as a server's does: its CPU
seconds, read against the process's own clock, are what sizing router processes needs."""

from __future__ import annotations

import time

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvserve.router.metrics import RouterMetrics


def test_the_router_reports_its_own_cpu_seconds():
    m = RouterMetrics(["r0", "r1"])
    end = time.process_time() + 0.2
    while time.process_time() < end:  # CPU time the process has for certain
        sum(range(1000))
    before = time.process_time()
    text = generate_latest(m.registry).decode()
    after = time.process_time()
    cpu = [s.value for f in text_string_to_metric_families(text) for s in f.samples
           if s.name == "process_cpu_seconds_total"]  # fmt: skip
    assert len(cpu) == 1
    # /proc's ticks are 10 ms; the process's own clock is finer.
    assert before - 0.05 <= cpu[0] <= after + 0.05, (cpu, before, after)
