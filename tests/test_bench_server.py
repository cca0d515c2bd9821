"""kvserve bench against our own OpenAI-compatible server over real HTTP (acceptance 3)."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("fastapi", reason="the server's dependencies are not installed")

from kvserve.bench.client import HTTPTarget  # noqa: E402
from kvserve.bench.runner import LoadSpec, benchmark  # noqa: E402
from kvserve.bench.workloads import WorkloadSpec, make_workload  # noqa: E402
from kvserve.server.app import BackgroundServer, build_state  # noqa: E402

MAX_LEN = 1024


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_mixed_workload_against_our_server_yields_every_metric(checkpoint, make_llm, endpoint):
    llm = make_llm(checkpoint("llama_gqa"), max_model_len=MAX_LEN, num_gpu_blocks=512)
    tok = llm.engine.tokenizer
    reqs = make_workload(
        WorkloadSpec("mixed", num_prompts=16, seed=0, length_scale=0.1, max_model_len=MAX_LEN - 64),
        lambda s: len(tok.encode(s)),
    )
    with BackgroundServer(build_state(llm.engine, ["tiny"])) as srv:
        target = HTTPTarget(srv.url, endpoint=endpoint, read_timeout=30, request_timeout=120)
        point = asyncio.run(
            benchmark(target, [reqs], [LoadSpec(request_rate=100.0)], slo={"ttft": 30.0},
                      gpu_hour_cost=2.0, progress=False, metrics_interval=0.05)
        )[0]  # fmt: skip
        assert target.model == "tiny"
    s = point.summary
    assert s["failures"] == {} and s["completed"] == 16
    # usage.completion_tokens is exact: ignore_eos makes every request run to max_tokens
    assert s["total_output_tokens"] == sum(r.max_tokens for r in reqs)
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert all(s[key][q] is not None for q in ("mean", "p50", "p90", "p95", "p99")), key
    assert s["request_throughput"] > 0 and s["output_throughput"] > 0
    assert s["goodput"]["request_goodput"] > 0
    assert s["cost"]["usd_per_million_output_tokens"] > 0
    srv_m = s["server"]
    assert srv_m["available"]
    assert srv_m["prefix_cache_queries"] > 0 and srv_m["prefix_cache_hit_rate"] is not None
    assert srv_m["num_preemptions"] is not None and srv_m["prefix_cache_evictions"] is not None
    assert srv_m["kv_cache_usage"]["after"] is not None
    assert srv_m["kv_cache_token_occupancy"]["after"] is not None
    assert srv_m["num_samples"] > 0
    if endpoint == "completions":
        # The server reports cache hits per request, and they add up to its counter.
        assert s["cached_prompt_tokens"] == srv_m["prefix_cache_hits"]
