"""The HTTP client against a fake OpenAI-compatible server: every misbehaviour becomes a
counted failure with a reason, within bounded time, and a healthy server yields every metric."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest

from kvserve.bench.client import HTTPTarget
from kvserve.bench.fakeserver import FakeServer
from kvserve.bench.runner import LoadSpec, benchmark
from kvserve.bench.workloads import BenchRequest, WorkloadSpec, make_workload

EXPECTED_REASON = {
    "error": "HTTP 500",
    "overloaded": "HTTP 503",
    "stall": "timeout (server stalled)",
    "stall_mid": "timeout (server stalled)",
    "drop": "connection dropped",
    "drop_early": "connection dropped",
    "garbage": "bad response",
    "no_done": "incomplete stream",
}


def run(target, reqs, load=None, slo=None):
    return asyncio.run(
        benchmark(target, [reqs], [load or LoadSpec()], slo=slo, progress=False,
                  metrics_interval=0.05)
    )[0]  # fmt: skip


def test_misbehaving_server_counts_failures_with_reasons():
    script = ["ok", *EXPECTED_REASON]  # request n gets script[n % 9]
    reqs = [BenchRequest(i, "chat", f"prompt {i}", 4, 3) for i in range(2 * len(script))]
    with FakeServer(lambda n, body: script[n % len(script)]) as url:
        target = HTTPTarget(url, connect_timeout=1, read_timeout=0.5, request_timeout=5)
        t0 = time.monotonic()
        point = run(target, reqs, LoadSpec(concurrency=1))  # in order, so n == index
        elapsed = time.monotonic() - t0
    s = point.summary
    assert elapsed < 8, "stalls must be bounded by read_timeout"
    assert s["completed"] == 2 and s["failed"] == 16
    want: dict[str, int] = {}
    for b in EXPECTED_REASON.values():
        want[b] = want.get(b, 0) + 2
    assert s["failures"] == want
    assert s["failure_examples"]["HTTP 500"] == "fake server error"
    assert "retry later" in s["failure_examples"]["HTTP 503"]
    for r in point.records:
        behaviour = script[r.index % len(script)]
        assert r.success == (behaviour == "ok")
        if not r.success:
            assert r.reason == EXPECTED_REASON[behaviour] and r.detail
    assert s["ttft_ms"]["n"] == 2  # failed requests never enter the latency figures


def test_trickling_server_hits_the_request_deadline():
    reqs = [BenchRequest(0, "chat", "p", 50, 1)]
    with FakeServer("ok", token_delay=0.1) as url:
        target = HTTPTarget(url, read_timeout=5, request_timeout=0.6)
        t0 = time.monotonic()
        s = run(target, reqs).summary
        assert time.monotonic() - t0 < 4
    assert s["failures"] == {"timeout (request)": 1}


def test_nothing_listening_is_a_counted_failure():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, not listening: connections are refused
        target = HTTPTarget(f"http://127.0.0.1:{port}", connect_timeout=1, request_timeout=3)
        s = run(target, [BenchRequest(i, "chat", "p", 4, 1) for i in range(3)]).summary
    assert s["failures"] == {"connection failed": 3}
    assert s["server"]["available"] is False  # /metrics unreachable: reported, not fatal


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_mixed_workload_over_http_yields_every_metric(endpoint):
    reqs = make_workload(WorkloadSpec("mixed", num_prompts=12, seed=0, length_scale=0.05))
    with FakeServer("ok", token_delay=0.001) as url:
        target = HTTPTarget(url, endpoint=endpoint, read_timeout=5)
        s = run(target, reqs, LoadSpec(request_rate=200.0), slo={"ttft": 5.0}).summary
        assert target.model == "fake-model"  # discovered from /v1/models
    assert s["completed"] == 12 and s["failed"] == 0
    assert s["total_output_tokens"] == sum(r.max_tokens for r in reqs)  # from usage
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert all(s[key][q] is not None for q in ("mean", "p50", "p90", "p95", "p99")), key
    assert s["request_throughput"] > 0 and s["output_throughput"] > 0
    assert s["goodput"]["request_goodput"] > 0
    assert s["cached_prompt_tokens"] > 0  # usage.prompt_tokens_details.cached_tokens
    srv = s["server"]
    assert srv["available"]
    assert srv["prefix_cache_queries"] > 0 and srv["prefix_cache_hit_rate"] is not None
    assert srv["num_preemptions"] == 0 and srv["prefix_cache_evictions"] == 0
    assert srv["kv_cache_token_occupancy"]["after"] == pytest.approx(0.9)
    assert srv["num_samples"] >= 1
