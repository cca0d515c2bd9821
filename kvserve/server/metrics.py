"""Prometheus metrics: vLLM's names (``vllm:*``) for what kvserve measures as vLLM does, and
``kvserve:*`` for what vLLM has no metric for.

vLLM users' dashboards and alerts read ``vllm:*`` names with vLLM's types and labels
(:mod:`kvserve.server.vllm_metrics`). A quantity both engines measure is exported once, under
vLLM's name: a ``kvserve:`` twin would double every series and leave two names to keep in
step, and kvserve's own dashboard (``examples/grafana/kvserve.json``) reads the vLLM names as
well. ``kvserve:*`` families are kvserve's own quantities (token occupancy, retention, offload
tiers, admission, workload classes, memory bandwidth); the offload tiers keep their per-tier
families beside vLLM's totals, which have no tier label and are their sums. The process's CPU,
memory and file descriptors are prometheus_client's ``process_*``, as on a vLLM server.

Engine gauges and counters are read at scrape time from the snapshot the engine loop takes
after every step (the engine is single-threaded, so the scrape never touches it directly).
Histograms are observed by the engine loop: per step, and when a request finishes. Every
instance has its own registry, so several servers in one process (tests) do not collide.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvserve.sched.request import RequestOutput
from kvserve.server.vllm_metrics import (
    REQUEST_LATENCY_BUCKETS,
    VllmMetrics,
    cache_config_info,
    engine_families,
)

PREFIX = "kvserve:"


class _EngineCollector(Collector):
    """Gauges and totals straight from the latest :class:`EngineStats` snapshot."""

    def __init__(
        self, snapshot: Callable[[], Any], model_name: str, cache_info: dict[str, str]
    ) -> None:
        self._snapshot = snapshot
        self._model_name = model_name
        self._cache_info = cache_info

    def collect(self) -> Iterator[Metric]:
        yield cache_config_info(self._cache_info)
        s = self._snapshot()
        if s is None:
            return
        yield from engine_families(s, self._model_name)
        yield GaugeMetricFamily(
            PREFIX + "kv_cache_token_occupancy",
            "Token slots holding K/V over slots allocated in used blocks (1 = no waste).",
            value=s.token_occupancy,
        )
        yield CounterMetricFamily(PREFIX + "prefix_cache_evictions",
                                  "Cached blocks evicted for reuse.",
                                  value=s.prefix_cache_evictions)  # fmt: skip
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
        yield from _transfer_metrics(s)
        yield from _admission_metrics(s)


def _transfer_metrics(s: Any) -> Iterator[Metric]:
    """Disaggregated prefill/decode (kvserve.disagg): what moved between engines, as vLLM's
    NixlConnector counts it (its ``nixl_bytes_transferred``, ``nixl_xfer_time_seconds``,
    ``nixl_num_failed_transfers``, ``nixl_num_kv_expired_reqs``), per direction."""
    t = s.kv_transfer
    if not t:
        return
    for name, doc, keys in (
        ("kv_transfer_bytes", "KV bytes sent to or received from another engine.",
         ("bytes_sent", "bytes_received")),
        ("kv_transfer_blocks", "KV blocks sent to or received from another engine.",
         ("blocks_sent", "blocks_received")),
    ):  # fmt: skip
        m = CounterMetricFamily(PREFIX + name, doc, labels=["direction"])
        for key in keys:
            m.add_metric([key.split("_")[1]], float(t.get(key, 0)))
        yield m
    yield CounterMetricFamily(PREFIX + "kv_transfer_tokens",
                              "Prompt tokens a decode engine received from a prefill engine "
                              "instead of computing them (not prefix-cache hits).",
                              value=float(t.get("tokens_received", 0)))  # fmt: skip
    yield CounterMetricFamily(PREFIX + "kv_transfer_seconds",
                              "Seconds decode engines spent pulling KV (request to arrival).",
                              value=float(t.get("transfer_seconds", 0.0)))  # fmt: skip
    yield CounterMetricFamily(PREFIX + "kv_transfers", "Pulls of KV that completed.",
                              value=float(t.get("transfers", 0)))  # fmt: skip
    failures = CounterMetricFamily(
        PREFIX + "kv_transfer_failures",
        "Pulls of KV that failed, by reason (handled by kv_load_failure_policy).",
        labels=["reason"],
    )
    for reason, n in sorted(t.get("failures", {}).items()):
        failures.add_metric([reason], n)
    yield failures
    yield GaugeMetricFamily(PREFIX + "kv_transfer_leases_held",
                            "Finished requests whose blocks a prefill engine holds for a "
                            "decode engine to read.", value=t.get("leases_held", 0))  # fmt: skip
    yield CounterMetricFamily(PREFIX + "kv_transfer_leases_expired",
                              "Holds whose lease ended before a decode engine released them.",
                              value=float(t.get("leases_expired", 0)))  # fmt: skip


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
    """A server's registry. ``model_name`` is the served model name vLLM's families carry;
    ``max_model_len`` bounds their token-count buckets, as vLLM bounds them."""

    def __init__(
        self,
        snapshot: Callable[[], Any],
        cache_info: dict[str, str],
        classes: Any = None,
        *,
        model_name: str,
        max_model_len: int,
    ) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.vllm = VllmMetrics(r, model_name, max_model_len)
        # Output tokens so far of each request in flight, per sample: streamed outputs carry
        # only the new tokens, so the lengths are summed here.
        self._generated: dict[str, dict[int, int]] = {}
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
                                          labels, buckets=REQUEST_LATENCY_BUCKETS,
                                          registry=r)  # fmt: skip
        r.register(_EngineCollector(snapshot, model_name, cache_info))
        ProcessCollector(registry=r)

    def observe_refused(self, out: RequestOutput) -> None:
        """Admission control refused it (the 429 or 503 itself is counted in
        ``request_rejected`` where the response is made)."""
        if out.workload_class is not None:
            self.class_requests.labels(out.workload_class, "refused").inc()

    def observe_step(self, stats: Any) -> None:
        """The engine loop's snapshot after a step."""
        self.vllm.observe_step(stats)

    def observe_output(self, out: RequestOutput, max_tokens: int | None = None) -> None:
        """An engine output of a request that ran: its samples that finished count in
        ``vllm:request_success``; when the request finishes, its latencies and lengths are
        observed (``max_tokens``: its sampling parameter)."""
        tally = self._generated.setdefault(out.request_id, {})
        for c in out.outputs:
            tally[c.index] = tally.get(c.index, 0) + len(c.token_ids)
            if c.finish_reason is not None:
                self.count_finished(c.finish_reason)
        if not out.finished:
            return
        generated = [n for _, n in sorted(self._generated.pop(out.request_id).items())]
        self.vllm.observe_finished(out, generated, max_tokens)
        if out.metrics is not None and out.workload_class is not None and self.classes is not None:
            self._observe_class(out, sum(generated))

    def observe_ended(self, request_id: str, reason: str, n: int) -> None:
        """A request ended without a finished output (aborted, or its step failed): its
        ``n`` samples count under ``reason``."""
        self._generated.pop(request_id, None)
        self.count_finished(reason, n)

    def count_finished(self, reason: str, n: int = 1) -> None:
        self.vllm.count_finished(reason, n)

    def _observe_class(self, out: RequestOutput, tokens: int) -> None:
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
