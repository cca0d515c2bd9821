"""Prometheus metrics, named like vLLM's ``vllm:*`` with the ``kvserve:`` prefix.

Engine gauges and counters are read at scrape time from the snapshot the engine loop takes
after every step (the engine is single-threaded, so the scrape never touches it directly).
Latency histograms are observed by the engine loop when a request finishes. Every instance
has its own registry, so several servers in one process (tests) do not collide.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, Info, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvserve.sched.request import RequestOutput

PREFIX = "kvserve:"
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)  # fmt: skip
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
               0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0)  # fmt: skip
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
               30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0)  # fmt: skip


class _EngineCollector(Collector):
    """Gauges and totals straight from the latest :class:`EngineStats` snapshot."""

    def __init__(self, snapshot: Callable[[], Any]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        s = self._snapshot()
        if s is None:
            return
        gauges = {
            "num_requests_running": ("Sequences in the running batch.", s.num_running),
            "num_requests_waiting": ("Sequences waiting to be scheduled.", s.num_waiting),
            "kv_cache_usage_perc": (
                "Fraction of KV blocks in use (1 = full); cached-but-free blocks count as free.",
                s.kv_usage,
            ),
            "kv_cache_token_occupancy": (
                "Token slots holding K/V over slots allocated in used blocks (1 = no waste).",
                s.token_occupancy,
            ),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(PREFIX + name, doc, value=value)
        counters = {
            "prefix_cache_queries": ("Prompt tokens looked up in the prefix cache.",
                                     s.prefix_cache_queries),
            "prefix_cache_hits": ("Prompt tokens found in the prefix cache.", s.prefix_cache_hits),
            "prefix_cache_evictions": ("Cached blocks evicted for reuse.",
                                       s.prefix_cache_evictions),
            "num_preemptions": ("Sequences preempted (recomputed later).", s.num_preemptions),
            "prompt_tokens": ("Prompt tokens of started requests, cache hits included (as vLLM).",
                              s.prompt_tokens_total),
            "generation_tokens": ("Tokens generated.", s.generation_tokens_total),
            "engine_steps": ("Engine steps that ran the model.", s.num_steps),
        }  # fmt: skip
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(PREFIX + name, doc, value=value)
        evicted = CounterMetricFamily(
            PREFIX + "kv_retention_evicted_tokens",
            "Tokens whose K/V blocks a retention policy returned to the pool before their "
            "request finished ('sliding_window': the model's own window).",
            labels=["policy"],
        )
        for policy, tokens in sorted(s.retention_evicted_tokens.items()):
            evicted.add_metric([policy], tokens)
        yield evicted
        yield CounterMetricFamily(
            PREFIX + "kv_retention_reclaimed_blocks",
            "KV blocks a retention policy returned to the pool before their request finished.",
            value=s.retention_reclaimed_blocks,
        )
        yield CounterMetricFamily(
            PREFIX + "kv_window_freed_blocks",
            "Blocks of a hybrid model's sliding-window layer groups returned to the pool "
            "behind their windows (each holds one layer group's K/V).",
            value=s.window_freed_blocks,
        )
        yield from _offload_metrics(s)
        yield from _admission_metrics(s)


def _admission_metrics(s: Any) -> Iterator[Metric]:
    """Allocation failures, admission decisions and achieved memory bandwidth."""
    yield CounterMetricFamily(
        PREFIX + "kv_allocation_failures",
        "Times a request's next chunk did not fit the KV pool (each one a preemption, a "
        "released tier load or a deferred admission).",
        value=s.allocation_failures,
    )
    yield CounterMetricFamily(PREFIX + "memory_bytes_read",
                              "Bytes of weights and KV the engine steps read.",
                              value=s.memory_bytes_read)  # fmt: skip
    yield CounterMetricFamily(PREFIX + "engine_step_seconds",
                              "Seconds the engine steps took (the forward pass and sampling).",
                              value=s.step_seconds)  # fmt: skip
    yield GaugeMetricFamily(PREFIX + "memory_bandwidth_peak_bytes_per_second",
                            "The device's read bandwidth, measured at start.",
                            value=s.memory_bandwidth_peak)  # fmt: skip
    yield GaugeMetricFamily(
        PREFIX + "memory_bandwidth_utilization",
        "memory_bytes_read / engine_step_seconds over the peak, since start (rate() the "
        "counters for a window).",
        value=s.memory_bandwidth_utilization,
    )
    a = s.admission
    if a is None:
        return
    yield CounterMetricFamily(PREFIX + "requests_admitted", "Requests admitted to run.",
                              value=a.admitted)  # fmt: skip
    refused = CounterMetricFamily(PREFIX + "requests_refused",
                                  "Requests admission control refused, by reason.",
                                  labels=["reason"])  # fmt: skip
    for reason in ("projected_wait", "deadline"):
        refused.add_metric([reason], a.refused.get(reason, 0))
    yield refused
    yield CounterMetricFamily(
        PREFIX + "admission_deferred",
        "Admissions put off because a request's projected KV demand did not fit.",
        value=a.deferred,
    )
    yield CounterMetricFamily(
        PREFIX + "prefix_followers_held",
        "Requests held one step to hit a prefix block another request computed in it.",
        value=a.held_for_prefix,
    )


def _offload_metrics(s: Any) -> Iterator[Metric]:
    """The offload tiers, shaped like vLLM's ``kv_offload_*``: per tier and direction."""
    tiers = s.kv_offload
    if not tiers:
        return
    moved = {
        "kv_offload_bytes": ("Bytes moved between the pool and a tier.", "bytes"),
        "kv_offload_seconds": ("Seconds spent moving bytes to and from a tier.", "seconds"),
    }
    for name, (doc, what) in moved.items():
        m = CounterMetricFamily(PREFIX + name, doc, labels=["tier", "direction"])
        for tier, t in tiers.items():
            m.add_metric([tier, "store"], t[f"{what}_down"])
            m.add_metric([tier, "load"], t[f"{what}_up"])
        yield m
    per_tier = {
        "kv_offload_queries": ("Blocks looked up in a tier.", "queries", CounterMetricFamily),
        "kv_offload_hits": ("Blocks loaded from a tier and verified.", "hits", CounterMetricFamily),
        "kv_offload_stores": ("Entries written to a tier.", "stored", CounterMetricFamily),
        "kv_offload_evictions": ("Entries a tier evicted (LRU).", "evictions",
                                 CounterMetricFamily),
        "kv_offload_entries": ("Entries held by a tier.", "entries", GaugeMetricFamily),
        "kv_offload_used_bytes": ("Bytes held by a tier.", "used_bytes", GaugeMetricFamily),
        "kv_offload_backed_off": ("1 while a failing tier is skipped for a back-off period.",
                                  "backed_off", GaugeMetricFamily),
    }  # fmt: skip
    for name, (doc, key, family) in per_tier.items():
        m = family(PREFIX + name, doc, labels=["tier"])
        for tier, t in tiers.items():
            m.add_metric([tier], float(t[key]))
        yield m
    failures = CounterMetricFamily(
        PREFIX + "kv_offload_failures",
        "Tier operations that failed, by reason (each one a miss: the block is recomputed).",
        labels=["tier", "reason"],
    )
    for tier, t in tiers.items():
        for reason, n in sorted(t["failures"].items()):
            failures.add_metric([tier, reason], n)
    yield failures
    for name, doc, value in (
        ("kv_offload_hit_tokens", "Prompt tokens loaded from a tier instead of computed.",
         s.tier_hit_tokens),
        ("kv_offload_loads_abandoned", "Tier loads given up to free blocks for running requests.",
         s.tier_loads_abandoned),
        ("kv_offload_loads_skipped", "Tier hits computed instead of loaded: the load was "
         "estimated slower than the prefill it would save.", s.tier_loads_skipped),
        ("preempted_tokens_restored", "Tokens a preempted request got back from the prefix "
         "cache or a tier when admitted again.", s.preempted_tokens_restored),
        ("preempted_tokens_recomputed", "Tokens a preempted request computed again.",
         s.preempted_tokens_recomputed),
    ):  # fmt: skip
        yield CounterMetricFamily(PREFIX + name, doc, value=value)


class ServerMetrics:
    def __init__(
        self, snapshot: Callable[[], Any], cache_info: dict[str, str], classes: Any = None
    ) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "Arrival to first output token.",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            PREFIX + "inter_token_latency_seconds",
            "Time between consecutive output tokens of a sequence.",
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds",
            "Arrival to last output token.",
            buckets=E2E_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            PREFIX + "request_queue_time_seconds",
            "Arrival to first scheduled.",
            buckets=E2E_BUCKETS,
            registry=r,
        )
        self.success = Counter(
            PREFIX + "request_success",
            "Finished sequences by reason (stop, length, abort).",
            ["finished_reason"],
            registry=r,
        )
        self.rejected = Counter(PREFIX + "request_rejected",
                                "Requests refused before reaching the engine or by its "
                                "admission control, by HTTP status.",
                                ["status"], registry=r)  # fmt: skip
        self.ignored_fields = Counter(PREFIX + "ignored_request_fields",
                                      "Request fields neither OpenAI's nor vLLM's API defines, "
                                      "accepted and ignored (each name is logged once).",
                                      ["field"], registry=r)  # fmt: skip
        self.classes = classes
        labels = ["workload_class"]
        self.class_requests = Counter(PREFIX + "class_requests",
                                      "Requests per workload class and outcome (finished, "
                                      "refused, aborted, error).", [*labels, "outcome"],
                                      registry=r)  # fmt: skip
        self.class_good = Counter(PREFIX + "class_goodput_requests",
                                  "Finished requests that met their class's TTFT and TPOT SLO.",
                                  labels, registry=r)  # fmt: skip
        self.class_tokens = Counter(PREFIX + "class_output_tokens",
                                    "Output tokens of finished requests per class.", labels,
                                    registry=r)  # fmt: skip
        self.class_good_tokens = Counter(PREFIX + "class_goodput_output_tokens",
                                         "Output tokens of requests that met their class's SLO.",
                                         labels, registry=r)  # fmt: skip
        self.class_queue_time = Histogram(PREFIX + "class_queue_time_seconds",
                                          "Arrival to first scheduled, per workload class.",
                                          labels, buckets=E2E_BUCKETS, registry=r)  # fmt: skip
        Info(PREFIX + "cache_config", "KV cache configuration.", registry=r).info(cache_info)
        r.register(_EngineCollector(snapshot))

    def observe_refused(self, out: RequestOutput) -> None:
        """Admission control refused it (the 429 or 503 itself is counted in
        ``request_rejected`` where the response is made)."""
        if out.workload_class is not None:
            self.class_requests.labels(out.workload_class, "refused").inc()

    def observe_finished(self, out: RequestOutput) -> None:
        """Latencies of a finished request (its first sequence's timeline)."""
        m = out.metrics
        if m is None:
            return
        if m.first_token_time is not None:
            self.ttft.observe(m.first_token_time - m.arrival_time)
        if m.first_scheduled_time is not None:
            self.queue_time.observe(max(0.0, m.first_scheduled_time - m.arrival_time))
        if m.finished_time is not None:
            self.e2e.observe(m.finished_time - m.arrival_time)
        times = m.token_times
        for a, b in zip(times, times[1:], strict=False):
            self.itl.observe(b - a)
        if out.workload_class is not None and self.classes is not None:
            self._observe_class(out)

    def _observe_class(self, out: RequestOutput) -> None:
        name, m = out.workload_class, out.metrics
        reasons = {c.finish_reason for c in out.outputs}
        outcome = "finished" if reasons <= {"stop", "length"} else sorted(reasons)[0]
        self.class_requests.labels(name, outcome).inc()
        if m.first_scheduled_time is not None:
            self.class_queue_time.labels(name).observe(
                max(0.0, m.first_scheduled_time - m.arrival_time)
            )
        if outcome != "finished":
            return
        tokens = sum(len(c.token_ids) for c in out.outputs)
        self.class_tokens.labels(name).inc(tokens)
        ttft = m.first_token_time - m.arrival_time if m.first_token_time is not None else None
        tpot = None
        if m.finished_time is not None and m.first_token_time is not None and tokens > 1:
            tpot = (m.finished_time - m.first_token_time) / (len(m.token_times) - 1 or 1)
        if self.classes.get(name).meets_slo(ttft, tpot):
            self.class_good.labels(name).inc()
            self.class_good_tokens.labels(name).inc(tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
