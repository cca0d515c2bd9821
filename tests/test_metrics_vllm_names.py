"""vLLM's metric names on a live ``kvserve serve``: every metric vLLM's published Grafana
dashboards query that kvserve can measure is on ``/metrics`` under vLLM's name, with vLLM's
type, label names and buckets; the ones kvserve cannot measure are listed with the reason and
are not exported; and the values agree with what the client itself received.

The lists below were written from vLLM's source (github.com/vllm-project/vllm):

- ``examples/observability/prometheus_grafana/grafana.json`` at commit
  4b5c627c23e6690b8987100d1cbf78e34ac14bf9 (the dashboard the Prometheus/Grafana example
  provisions; formerly ``examples/online_serving/prometheus_grafana/grafana.json``),
- ``tools/generate_grafana_dashboards.py`` at commit 0b9faa4138937a56ee61d7e2acb55b06fa12b44c,
  which writes ``examples/observability/dashboards/grafana/vllm_overview.json``,
  ``vllm_instances.json``, ``vllm_kv_cache.json`` and ``vllm_speculative_decoding.json``
  (formerly ``examples/online_serving/dashboards/``),
- types, label names and buckets from ``vllm/v1/metrics/loggers.py`` (``PrometheusStatLogger``)
  of the same period, which defines every ``vllm:*`` name those dashboards query.

Names are the families as vLLM defines them: a counter ``vllm:x`` is queried as ``vllm:x_total``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.serve_process import ServeProcess

REPO = Path(__file__).resolve().parent.parent
SERVED = "vllm-names-test"
MAX_MODEL_LEN = 256
E = ("model_name", "engine")  # the labels of vLLM's engine metrics

C, G, H = "counter", "gauge", "histogram"
GRAFANA = "grafana.json"
OVERVIEW, INSTANCES, KV_CACHE, SPEC = ("vllm_overview", "vllm_instances", "vllm_kv_cache",
                                       "vllm_speculative_decoding")  # fmt: skip

# name -> (type, label names, the dashboards that query it)
DASHBOARD_METRICS: dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]] = {
    "vllm:num_requests_running": (G, E, (GRAFANA, OVERVIEW, INSTANCES, KV_CACHE)),
    "vllm:num_requests_waiting": (G, E, (GRAFANA, OVERVIEW, INSTANCES)),
    "vllm:num_requests_waiting_by_reason": (G, (*E, "reason"), (OVERVIEW, INSTANCES, KV_CACHE)),
    "vllm:kv_cache_usage_perc": (G, E, (GRAFANA, OVERVIEW, INSTANCES, KV_CACHE)),
    "vllm:prefix_cache_queries": (C, E, (OVERVIEW, INSTANCES, KV_CACHE)),
    "vllm:prefix_cache_hits": (C, E, (OVERVIEW, INSTANCES, KV_CACHE)),
    "vllm:external_prefix_cache_queries": (C, E, (OVERVIEW, KV_CACHE)),
    "vllm:external_prefix_cache_hits": (C, E, (OVERVIEW, KV_CACHE)),
    "vllm:mm_cache_queries": (C, E, (OVERVIEW, KV_CACHE)),
    "vllm:mm_cache_hits": (C, E, (OVERVIEW, KV_CACHE)),
    "vllm:num_preemptions": (C, E, (OVERVIEW, INSTANCES, KV_CACHE)),
    "vllm:prompt_tokens": (C, E, (GRAFANA, OVERVIEW, INSTANCES, KV_CACHE)),
    "vllm:prompt_tokens_by_source": (C, (*E, "source"), (OVERVIEW, KV_CACHE)),
    "vllm:prompt_tokens_cached": (C, E, (KV_CACHE,)),
    "vllm:prompt_tokens_cached_by_source": (C, (*E, "source"), (KV_CACHE,)),
    "vllm:generation_tokens": (C, E, (GRAFANA, OVERVIEW, INSTANCES, SPEC)),
    "vllm:request_success": (C, (*E, "finished_reason"), (GRAFANA, OVERVIEW, INSTANCES)),
    "vllm:request_prompt_tokens": (H, E, (GRAFANA, OVERVIEW, KV_CACHE)),
    "vllm:request_generation_tokens": (H, E, (GRAFANA, OVERVIEW)),
    "vllm:request_max_num_generation_tokens": (H, E, (GRAFANA,)),
    "vllm:request_prefill_kv_computed_tokens": (H, E, (KV_CACHE,)),
    "vllm:iteration_tokens_total": (H, E, (OVERVIEW, INSTANCES)),
    "vllm:time_to_first_token_seconds": (H, E, (GRAFANA, OVERVIEW, INSTANCES)),
    "vllm:inter_token_latency_seconds": (H, E, (GRAFANA, OVERVIEW, INSTANCES, SPEC)),
    "vllm:request_time_per_output_token_seconds": (H, E, (OVERVIEW,)),
    "vllm:e2e_request_latency_seconds": (H, E, (GRAFANA, OVERVIEW, INSTANCES)),
    "vllm:request_queue_time_seconds": (H, E, (GRAFANA, OVERVIEW, INSTANCES)),
    "vllm:request_prefill_time_seconds": (H, E, (GRAFANA, OVERVIEW)),
    "vllm:request_decode_time_seconds": (H, E, (GRAFANA, OVERVIEW)),
    # An info-style gauge: CacheConfig's fields as labels, and engine (the labels listed are
    # the ones the Instances dashboard's table shows).
    "vllm:cache_config_info": (
        G,
        (
            "engine",
            "num_gpu_blocks",
            "block_size",
            "cache_dtype",
            "gpu_memory_utilization",
            "enable_prefix_caching",
            "prefix_caching_hash_algo",
            "num_cpu_blocks",
            "kv_offloading_backend",
            "kv_offloading_size",
        ),
        (INSTANCES,),
    ),  # fmt: skip
    "vllm:lora_requests_info": (
        G,
        ("max_lora", "waiting_lora_adapters", "running_lora_adapters"),
        (INSTANCES,),
    ),  # fmt: skip
    "vllm:engine_sleep_state": (G, (*E, "sleep_state"), (INSTANCES,)),
    "vllm:sleep_mode_operation_duration_seconds": (H, ("operation",), (INSTANCES,)),
    "vllm:rl_weight_update_operation_duration_seconds": (H, ("operation",), (INSTANCES,)),
    "vllm:estimated_flops_per_gpu_total": (C, E, (INSTANCES,)),
    "vllm:estimated_read_bytes_per_gpu_total": (C, E, (INSTANCES,)),
    "vllm:estimated_write_bytes_per_gpu_total": (C, E, (INSTANCES,)),
    "vllm:kv_block_lifetime_seconds": (H, E, (KV_CACHE,)),
    "vllm:kv_block_idle_before_evict_seconds": (H, E, (KV_CACHE,)),
    "vllm:kv_block_reuse_gap_seconds": (H, E, (KV_CACHE,)),
    "vllm:num_requests_kv_fetch_by_stage": (G, (*E, "stage"), (KV_CACHE,)),
    "vllm:nixl_xfer_time_seconds": (H, E, (KV_CACHE,)),
    "vllm:nixl_bytes_transferred": (H, E, (KV_CACHE,)),
    "vllm:nixl_post_time_seconds": (H, E, (KV_CACHE,)),
    "vllm:nixl_num_descriptors": (H, E, (KV_CACHE,)),
    "vllm:nixl_num_failed_transfers": (C, E, (KV_CACHE,)),
    "vllm:nixl_num_failed_notifications": (C, E, (KV_CACHE,)),
    "vllm:nixl_num_kv_expired_reqs": (C, E, (KV_CACHE,)),
    "vllm:nixl_num_notifications_after_expiry": (C, E, (KV_CACHE,)),
    "vllm:kv_offload_load_bytes": (C, E, (KV_CACHE,)),
    "vllm:kv_offload_store_bytes": (C, E, (KV_CACHE,)),
    "vllm:kv_offload_load_time": (C, E, (KV_CACHE,)),
    "vllm:kv_offload_store_time": (C, E, (KV_CACHE,)),
    "vllm:kv_offload_load_size": (H, E, (KV_CACHE,)),
    "vllm:kv_offload_store_size": (H, E, (KV_CACHE,)),
    "vllm:kv_offload_lookup_sync_delay_seconds": (H, E, (KV_CACHE,)),
    "vllm:kv_offload_lookup_async_delay_seconds": (H, E, (KV_CACHE,)),
    "vllm:kv_offload_cpu_cache_usage_perc": (G, E, (KV_CACHE,)),
    "vllm:kv_offload_cpu_cache_write_usage_perc": (G, E, (KV_CACHE,)),
    "vllm:kv_offload_cpu_cache_read_usage_perc": (G, E, (KV_CACHE,)),
    "vllm:kv_offload_allocation_failure": (C, E, (KV_CACHE,)),
    "vllm:kv_offload_stores_skipped": (C, E, (KV_CACHE,)),
    "vllm:simple_kv_offload_save_outcomes": (C, (*E, "outcome"), (KV_CACHE,)),
    "vllm:simple_kv_offload_load_blocks": (C, E, (KV_CACHE,)),
    "vllm:simple_kv_offload_used_blocks": (G, E, (KV_CACHE,)),
    "vllm:simple_kv_offload_pending_store_blocks": (G, E, (KV_CACHE,)),
    "vllm:spec_decode_num_drafts": (C, E, (SPEC,)),
    "vllm:spec_decode_num_draft_tokens": (C, E, (SPEC,)),
    "vllm:spec_decode_num_accepted_tokens": (C, E, (SPEC,)),
    "vllm:spec_decode_num_accepted_tokens_per_pos": (C, (*E, "position"), (SPEC,)),
    # The API server's own (prometheus_client's process collector, and
    # prometheus-fastapi-instrumentator's HTTP metrics).
    "process_cpu_seconds": (C, (), (INSTANCES,)),
    "process_resident_memory_bytes": (G, (), (INSTANCES,)),
    "process_open_fds": (G, (), (INSTANCES,)),
    "process_max_fds": (G, (), (INSTANCES,)),
    "process_start_time_seconds": (G, (), (INSTANCES,)),
    "http_requests": (C, ("handler", "method", "status"), (OVERVIEW,)),
    "http_request_duration_seconds": (H, ("handler", "method"), (OVERVIEW,)),
}

# vLLM's metrics kvserve does not export, and why. Each is a quantity kvserve does not measure
# (exporting zeros or a look-alike would make a dashboard lie).
NOT_MEASURED = {
    "vllm:num_requests_waiting_by_reason": "the scheduler does not classify its waiting queue "
    "into vLLM's capacity and deferred reasons",
    "vllm:external_prefix_cache_queries": "kvserve has no cross-instance KV connector; its "
    "offload tiers count lookups in blocks per tier (kvserve:kv_offload_queries_total)",
    "vllm:external_prefix_cache_hits": "as external_prefix_cache_queries "
    "(kvserve:kv_offload_hits_total, kvserve:kv_offload_hit_tokens_total)",
    "vllm:mm_cache_queries": "kvserve serves text-only models: no multimodal cache",
    "vllm:mm_cache_hits": "kvserve serves text-only models: no multimodal cache",
    "vllm:prompt_tokens_by_source": "kvserve does not split each started request's prompt "
    "into computed, cache-hit and transferred tokens when it starts",
    "vllm:prompt_tokens_cached": "as prompt_tokens_by_source (vllm:prefix_cache_hits_total and "
    "kvserve:kv_offload_hit_tokens_total count what the cache and tiers supplied)",
    "vllm:prompt_tokens_cached_by_source": "as prompt_tokens_by_source",
    "vllm:lora_requests_info": "kvserve has no LoRA adapters",
    "vllm:engine_sleep_state": "kvserve has no sleep mode",
    "vllm:sleep_mode_operation_duration_seconds": "kvserve has no sleep mode",
    "vllm:rl_weight_update_operation_duration_seconds": "kvserve has no weight-update API",
    "vllm:estimated_flops_per_gpu_total": "kvserve does not estimate FLOPs",
    "vllm:estimated_read_bytes_per_gpu_total": "kvserve estimates bytes read "
    "(kvserve:memory_bytes_read_total) but not bytes written, and vLLM's panel adds the two",
    "vllm:estimated_write_bytes_per_gpu_total": "kvserve does not estimate bytes written",
    "vllm:kv_block_lifetime_seconds": "kvserve does not sample KV block residency",
    "vllm:kv_block_idle_before_evict_seconds": "kvserve does not sample KV block residency",
    "vllm:kv_block_reuse_gap_seconds": "kvserve does not sample KV block residency",
    "vllm:num_requests_kv_fetch_by_stage": "kvserve has no asynchronous KV-consumer loads",
    "vllm:nixl_xfer_time_seconds": "kvserve has no NIXL connector",
    "vllm:nixl_bytes_transferred": "kvserve has no NIXL connector",
    "vllm:nixl_post_time_seconds": "kvserve has no NIXL connector",
    "vllm:nixl_num_descriptors": "kvserve has no NIXL connector",
    "vllm:nixl_num_failed_transfers": "kvserve has no NIXL connector",
    "vllm:nixl_num_failed_notifications": "kvserve has no NIXL connector",
    "vllm:nixl_num_kv_expired_reqs": "kvserve has no NIXL connector",
    "vllm:nixl_num_notifications_after_expiry": "kvserve has no NIXL connector",
    "vllm:kv_offload_load_size": "the offload tiers count bytes, not each operation's size",
    "vllm:kv_offload_store_size": "the offload tiers count bytes, not each operation's size",
    "vllm:kv_offload_lookup_sync_delay_seconds": "tier lookups are not timed",
    "vllm:kv_offload_lookup_async_delay_seconds": "tier lookups are not timed",
    "vllm:kv_offload_cpu_cache_usage_perc": "the tiers do not pin space for in-flight "
    "transfers (kvserve:kv_offload_used_bytes is what a tier holds)",
    "vllm:kv_offload_cpu_cache_write_usage_perc": "as kv_offload_cpu_cache_usage_perc",
    "vllm:kv_offload_cpu_cache_read_usage_perc": "as kv_offload_cpu_cache_usage_perc",
    "vllm:kv_offload_allocation_failure": "a tier evicts instead of failing a store "
    "(kvserve:kv_offload_evictions_total, kvserve:kv_offload_failures_total)",
    "vllm:kv_offload_stores_skipped": "not counted "
    "(--kv-offload-reuse-threshold's skipped stores have no counter)",
    "vllm:simple_kv_offload_save_outcomes": "kvserve has no SimpleCPUOffloadConnector",
    "vllm:simple_kv_offload_load_blocks": "kvserve has no SimpleCPUOffloadConnector",
    "vllm:simple_kv_offload_used_blocks": "kvserve has no SimpleCPUOffloadConnector",
    "vllm:simple_kv_offload_pending_store_blocks": "kvserve has no SimpleCPUOffloadConnector",
    "vllm:spec_decode_num_drafts": "kvserve has no speculative decoding",
    "vllm:spec_decode_num_draft_tokens": "kvserve has no speculative decoding",
    "vllm:spec_decode_num_accepted_tokens": "kvserve has no speculative decoding",
    "vllm:spec_decode_num_accepted_tokens_per_pos": "kvserve has no speculative decoding",
    "http_requests": "not exported yet: the server has no per-route HTTP instrumentation "
    "(kvserve:request_rejected_total{status} counts refused requests)",
    "http_request_duration_seconds": "not exported yet: no per-route HTTP instrumentation",
}
# Labels of vllm:cache_config_info kvserve has no value for.
NOT_MEASURED_LABELS = {
    "vllm:cache_config_info": {
        "prefix_caching_hash_algo": "kvserve's block hash (SHA-256 over its own encoding) is "
        "none of vLLM's algorithms",
        "num_cpu_blocks": "kvserve's host tier is sized in bytes (--kv-offload-cpu)",
        "kv_offloading_backend": "kvserve's tiers are its own, not vLLM's backends",
        "kv_offloading_size": "kvserve sizes each tier on its own",
    }
}
# In the dashboards' queries but not a server's metric: Prometheus's own scrape health.
PROMETHEUS_OWN = ("up",)

# vLLM's metrics that no dashboard queries and kvserve exports too (loggers.py).
LOGGER_METRICS = {
    "vllm:request_inference_time_seconds": (H, E),
    "vllm:request_params_n": (H, E),
    "vllm:request_params_max_tokens": (H, E),
}

# vLLM's bucket boundaries (loggers.py); kvserve may add finer ones, never drop one of these.
TTFT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
        10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
TOKEN_LATENCY = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
REQUEST_LATENCY = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
# vLLM's 1-2-5 series up to max_model_len (256 here), for token counts: exactly these.
LENGTHS = (1, 2, 5, 10, 20, 50, 100, 200)
VLLM_BUCKETS = {
    "vllm:time_to_first_token_seconds": TTFT,
    "vllm:inter_token_latency_seconds": TOKEN_LATENCY,
    "vllm:request_time_per_output_token_seconds": TOKEN_LATENCY,
    "vllm:e2e_request_latency_seconds": REQUEST_LATENCY,
    "vllm:request_queue_time_seconds": REQUEST_LATENCY,
    "vllm:request_inference_time_seconds": REQUEST_LATENCY,
    "vllm:request_prefill_time_seconds": REQUEST_LATENCY,
    "vllm:request_decode_time_seconds": REQUEST_LATENCY,
    "vllm:iteration_tokens_total": (
        1,
        8,
        16,
        32,
        64,
        128,
        256,
        512,
        1024,
        2048,
        4096,
        8192,
        16384,
    ),  # fmt: skip
    "vllm:request_params_n": (1, 2, 5, 10, 20),
}
EXACT_BUCKETS = ("vllm:request_prompt_tokens", "vllm:request_generation_tokens",
                 "vllm:request_max_num_generation_tokens", "vllm:request_params_max_tokens",
                 "vllm:request_prefill_kv_computed_tokens")  # fmt: skip

MEASURED = {name: spec for name, spec in DASHBOARD_METRICS.items() if name not in NOT_MEASURED}


# -- the server ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server():
    """``kvserve serve`` as a process: the bundled model, one CPU offload tier (so the
    offload families exist), on 127.0.0.1 and a free port."""
    args = ["--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN),
            "--served-model-name", SERVED, "--kv-offload-cpu", "8MiB",
            "--disable-access-log"]  # fmt: skip
    with ServeProcess(args) as srv:
        yield srv.url
        srv.stop()


def scrape(url: str) -> dict:
    """/metrics parsed by prometheus_client: family -> (type, [(sample, labels, value)]),
    without prometheus_client's ``_created`` timestamps beside counters and histograms."""
    text = httpx.get(url + "/metrics", timeout=30).text
    out = {f.name: (f.type, [(s.name, s.labels, s.value) for s in f.samples])
           for f in text_string_to_metric_families(text)}  # fmt: skip
    return {k: v for k, v in out.items()
            if not (k.endswith("_created") and k.removesuffix("_created") in out)}  # fmt: skip


def value(m: dict, sample: str, **labels: str) -> float:
    """The one sample ``sample`` whose labels include ``labels`` (it must exist)."""
    fam = next(f for f in m if sample == f or sample.startswith(f + "_"))
    hits = [v for name, ls, v in m[fam][1]
            if name == sample and labels.items() <= ls.items()]  # fmt: skip
    assert len(hits) == 1, (sample, labels, hits)
    return hits[0]


def wait_idle(url: str, timeout: float = 30.0) -> dict:
    """Scrape until no request runs or waits (the gauges come from the step after the last)."""
    deadline = time.monotonic() + timeout
    while True:
        m = scrape(url)
        busy = value(m, "vllm:num_requests_running") + value(m, "vllm:num_requests_waiting")
        if busy == 0 or time.monotonic() > deadline:
            assert busy == 0, "the server did not go idle"
            return m
        time.sleep(0.05)


def post(http: httpx.Client, path: str, body: dict) -> tuple[dict, float]:
    t0 = time.monotonic()
    r = http.post(path, json={"model": SERVED, **body})
    assert r.status_code == 200, r.text
    return r.json(), time.monotonic() - t0


@pytest.fixture(scope="module")
def traffic(server):
    """A few requests of every shape, and what the client saw: prompt and completion tokens
    per sample, cached tokens, finish reasons, max_tokens, n, and wall time. Returns
    (/metrics before, /metrics after, what the client saw)."""
    seen: dict[str, list] = {
        k: []
        for k in (
            "prompt",
            "completion",
            "cached",
            "reasons",
            "max_tokens",
            "n",
            "max_completion",
            "first",
            "wall",
        )
    }
    greedy = {"temperature": 0, "ignore_eos": True}

    def record(usage: dict, reasons: list[str], counts: list[int], wall: float,
               max_tokens: int) -> None:  # fmt: skip
        n = len(counts)
        assert sum(counts) == usage["completion_tokens"] and len(reasons) == n
        seen["prompt"] += [usage["prompt_tokens"]] * n  # a sample's prompt: counted once
        seen["completion"] += counts
        seen["cached"] += [(usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)] * n
        seen["reasons"] += reasons
        seen["max_tokens"] += [max_tokens] * n
        seen["n"].append(n)
        seen["max_completion"].append(max(counts))
        seen["first"].append(counts[0])
        seen["wall"].append(wall)

    m0 = wait_idle(server)
    with httpx.Client(base_url=server, timeout=120) as http:
        prompt = "The capital of the pass code is twelve and the pass code is"
        for max_tokens in (6, 9, 6):  # the third repeats the first: prefix cache hits
            resp, wall = post(
                http, "/v1/completions", {"prompt": prompt, "max_tokens": max_tokens, **greedy}
            )
            usage = resp["usage"]
            record(usage, ["length"], [usage["completion_tokens"]], wall, max_tokens)
        assert seen["cached"][-1] > 0
        text = resp["choices"][0]["text"]
        # The same greedy request, stopped by a string its output contains: finish "stop".
        stop = text[len(text) // 2 :][:3]
        assert stop.strip(), text
        resp, wall = post(
            http,
            "/v1/completions",
            {"prompt": prompt, "max_tokens": 6, "stop": [stop], "temperature": 0},
        )
        assert resp["choices"][0]["finish_reason"] == "stop", resp
        record(resp["usage"], ["stop"], [resp["usage"]["completion_tokens"]], wall, 6)
        # n = 2, ignore_eos: each sample generates exactly max_tokens.
        resp, wall = post(
            http,
            "/v1/completions",
            {
                "prompt": "Two samples of one prompt",
                "max_tokens": 5,
                "n": 2,
                "seed": 7,
                "temperature": 1.0,
                "ignore_eos": True,
            },
        )
        assert [c["finish_reason"] for c in resp["choices"]] == ["length"] * 2
        record(resp["usage"], ["length"] * 2, [5, 5], wall, 5)
        body = {"model": SERVED, "messages": [{"role": "user", "content": "hello there"}],
                "max_tokens": 7, "stream": True, "stream_options": {"include_usage": True},
                **greedy}  # fmt: skip
        t0, chunks = time.monotonic(), []
        with http.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks.append(json.loads(line[6:]))
        usage = chunks[-1]["usage"]
        reasons = [c["choices"][0]["finish_reason"] for c in chunks
                   if c["choices"] and c["choices"][0].get("finish_reason")]  # fmt: skip
        record(usage, reasons, [usage["completion_tokens"]], time.monotonic() - t0, 7)
    return m0, wait_idle(server), seen


# -- the list ------------------------------------------------------------------------------
def test_the_list_is_whole():
    """Every unmeasured metric is one the dashboards query, with a reason; every metric has a
    Prometheus type; the vLLM names are vLLM's (``vllm:``), the others are the API server's."""
    assert set(NOT_MEASURED) <= set(DASHBOARD_METRICS)
    assert all(reason.strip() for reason in NOT_MEASURED.values())
    for name, (kind, labels, dashboards) in {**DASHBOARD_METRICS, **{
            k: (*v, ("loggers.py",)) for k, v in LOGGER_METRICS.items()}}.items():  # fmt: skip
        assert kind in (C, G, H) and dashboards, name
        assert name.startswith(("vllm:", "process_", "http_")), name
        assert len(set(labels)) == len(labels), name
    for name, labels in NOT_MEASURED_LABELS.items():
        assert name in MEASURED and set(labels) < set(DASHBOARD_METRICS[name][1])
    # What the issue names is on the list as measured.
    for name in ("vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:time_to_first_token_seconds", "vllm:request_success"):  # fmt: skip
        assert name in MEASURED, name


# -- names, types, labels, buckets ---------------------------------------------------------
def labels_of(m: dict, fam: str) -> set[str]:
    return {k for _, ls, _ in m[fam][1] for k in ls} - {"le"}


def test_every_measurable_dashboard_metric_is_exported_as_vllm_exports_it(traffic):
    m = traffic[1]
    for name, (kind, labels, dashboards) in MEASURED.items():
        assert name in m, f"{name} ({', '.join(dashboards)}) is not on /metrics"
        assert m[name][0] == kind, (name, m[name][0], kind)
        want = set(labels) - set(NOT_MEASURED_LABELS.get(name, ()))
        if name == "vllm:cache_config_info":  # vLLM's carries every CacheConfig field
            assert want <= labels_of(m, name), (name, want - labels_of(m, name))
        else:
            assert labels_of(m, name) == want, (name, labels_of(m, name), want)
    for name, (kind, labels) in LOGGER_METRICS.items():
        assert m[name][0] == kind and labels_of(m, name) == set(labels), name


def test_nothing_unmeasured_is_exported_and_every_vllm_family_is_on_the_list(traffic):
    m = traffic[1]
    assert not set(NOT_MEASURED) & set(m), set(NOT_MEASURED) & set(m)
    vllm = {f for f in m if f.startswith("vllm:")}
    assert vllm == {n for n in {*MEASURED, *LOGGER_METRICS} if n.startswith("vllm:")}
    # One name per quantity: no kvserve: twin of a vLLM name.
    twins = {f for f in vllm if "kvserve:" + f.removeprefix("vllm:") in m}
    assert not twins, twins


def test_vllms_labels_carry_the_served_model_name_and_engine_0(traffic):
    m = traffic[1]
    for fam in (f for f in m if f.startswith("vllm:") and f != "vllm:cache_config_info"):
        for sample, ls, _ in m[fam][1]:
            assert ls["model_name"] == SERVED and ls["engine"] == "0", (sample, ls)
    (info,) = [ls for _, ls, _ in m["vllm:cache_config_info"][1]]
    assert info["engine"] == "0" and info["block_size"] == "16"
    assert info["cache_dtype"] == "float32" and info["enable_prefix_caching"] == "True"


def buckets(m: dict, fam: str) -> list[float]:
    return sorted(float(ls["le"]) for name, ls, _ in m[fam][1]
                  if name == fam + "_bucket" and ls["le"] != "+Inf")  # fmt: skip


def test_buckets_keep_every_vllm_boundary(traffic):
    m = traffic[1]
    for fam, want in VLLM_BUCKETS.items():
        have = buckets(m, fam)
        assert set(want) <= set(have), (fam, sorted(set(want) - set(have)))
        # kvserve's own boundaries are finer ones below vLLM's first, at 1 ms or more.
        assert all(0.001 <= b < min(want) for b in set(have) - set(want)), fam
    for fam in EXACT_BUCKETS:
        assert buckets(m, fam) == list(LENGTHS), fam


# -- values against the client's own count -------------------------------------------------
def delta(m0: dict, m1: dict, sample: str, **labels: str) -> float:
    return value(m1, sample, **labels) - value(m0, sample, **labels)


def test_counts_agree_with_what_the_client_received(traffic):
    m0, m1, seen = traffic
    samples, requests = len(seen["completion"]), len(seen["n"])
    assert delta(m0, m1, "vllm:prompt_tokens_total") == sum(seen["prompt"])
    assert delta(m0, m1, "vllm:generation_tokens_total") == sum(seen["completion"])
    for reason in ("stop", "length", "abort", "error"):
        want = seen["reasons"].count(reason)
        assert delta(m0, m1, "vllm:request_success_total", finished_reason=reason) == want
    assert seen["reasons"].count("stop") == 1 and seen["reasons"].count("length") == samples - 1
    per_sample = {
        "vllm:request_prompt_tokens": sum(seen["prompt"]),
        "vllm:request_generation_tokens": sum(seen["completion"]),
        "vllm:request_params_max_tokens": sum(seen["max_tokens"]),
        "vllm:request_prefill_kv_computed_tokens":
            sum(p - c for p, c in zip(seen["prompt"], seen["cached"], strict=True)),
    }  # fmt: skip
    for fam, total in per_sample.items():
        assert delta(m0, m1, fam + "_count") == samples, fam
        assert delta(m0, m1, fam + "_sum") == total, fam
    per_request = {
        "vllm:request_params_n": sum(seen["n"]),
        "vllm:request_max_num_generation_tokens": sum(seen["max_completion"]),
    }
    for fam, total in per_request.items():
        assert delta(m0, m1, fam + "_count") == requests, fam
        assert delta(m0, m1, fam + "_sum") == total, fam
    assert delta(m0, m1, "vllm:prefix_cache_hits_total") >= max(seen["cached"]) > 0
    assert delta(m0, m1, "vllm:num_preemptions_total") == 0
    # After the last request: nothing runs, nothing waits, no block is in use.
    for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                  "vllm:kv_cache_usage_perc"):  # fmt: skip
        assert value(m1, gauge) == 0.0, gauge


def test_latencies_agree_with_the_clients_clock_and_vllms_definitions(traffic):
    """Once per request (on its first sample): e2e = queue + prefill + decode, as vLLM
    defines the phases; every server-side time fits in the client's wall time; one
    inter-token gap per token after the first."""
    m0, m1, seen = traffic
    requests = len(seen["n"])
    s = {h: delta(m0, m1, f"vllm:{h}_seconds_sum") for h in (
        "e2e_request_latency", "request_queue_time", "request_prefill_time",
        "request_decode_time", "request_inference_time", "time_to_first_token",
        "inter_token_latency", "request_time_per_output_token")}  # fmt: skip
    for h in s:
        assert delta(m0, m1, f"vllm:{h}_seconds_count") == (
            requests if h != "inter_token_latency" else sum(n - 1 for n in seen["first"])
        ), h
    assert s["e2e_request_latency"] == pytest.approx(
        s["request_queue_time"] + s["request_prefill_time"] + s["request_decode_time"]
    )
    assert s["request_inference_time"] == pytest.approx(
        s["request_prefill_time"] + s["request_decode_time"]
    )
    assert s["inter_token_latency"] == pytest.approx(s["request_decode_time"])
    assert 0 < s["time_to_first_token"] <= s["e2e_request_latency"] < sum(seen["wall"])


def test_tokens_per_step_add_up_to_the_tokens_computed(server):
    """vllm:iteration_tokens_total: each step's prefill and decode tokens. Over two requests
    of one sample each, the steps ran every prompt token not found cached and every output
    token but the last (which no step feeds back)."""
    m0 = wait_idle(server)
    want = 0
    with httpx.Client(base_url=server, timeout=120) as http:
        for prompt, max_tokens in (("Steps add up, first", 5), ("Steps add up, second", 8)):
            resp, _ = post(
                http,
                "/v1/completions",
                {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True},
            )
            u = resp["usage"]
            cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            want += u["prompt_tokens"] - cached + u["completion_tokens"] - 1
    m1 = wait_idle(server)
    assert delta(m0, m1, "vllm:iteration_tokens_total_sum") == want
    assert delta(m0, m1, "vllm:iteration_tokens_total_count") >= 8  # a step per output token


def test_a_request_in_flight_is_running_and_counts_as_abort_when_the_client_leaves(server):
    m0 = wait_idle(server)
    body = {"model": SERVED, "prompt": "A long answer", "max_tokens": MAX_MODEL_LEN - 16,
            "stream": True, "temperature": 0, "ignore_eos": True}  # fmt: skip
    with httpx.Client(base_url=server, timeout=120) as http:
        with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            during = scrape(server)
        # leaving the block closes the connection mid-stream: the server aborts the request
    m1 = wait_idle(server)
    assert value(during, "vllm:num_requests_running") == 1
    assert value(during, "vllm:num_requests_waiting") == 0
    assert value(during, "vllm:kv_cache_usage_perc") > 0
    assert delta(m0, m1, "vllm:request_success_total", finished_reason="abort") == 1
    assert delta(m0, m1, "vllm:request_success_total", finished_reason="length") == 0
