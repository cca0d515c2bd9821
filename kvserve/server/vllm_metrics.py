"""vLLM's metrics (``vllm:*``): the quantities kvserve measures as vLLM does, under vLLM's
names, types, label names and buckets (``vllm/v1/metrics/loggers.py``, ``PrometheusStatLogger``),
so the Grafana dashboards and alerts written for vLLM read a kvserve server unchanged.

Every family carries vLLM's ``model_name`` (the served model name, the first of
``--served-model-name``) and ``engine`` (the engine core's index: a server has one, ``"0"``);
``vllm:request_success`` adds ``finished_reason`` and ``vllm:cache_config_info`` carries the
cache settings as labels, with ``engine``, as vLLM's does.

Where kvserve's observation differs from vLLM's, it is the quantity that is the same, not the
moment: a finished request's latencies and lengths are observed when it finishes (vLLM
observes TTFT and inter-token gaps as tokens stream; the totals agree for every request that
finishes). For ``n > 1`` vLLM runs each sample as a child request, so its per-request
families count samples: kvserve counts samples too for ``request_success``, the token-count
histograms and ``request_params_max_tokens``, but observes the latency histograms once per
request, on its first sample's timeline (the engine keeps no other sample's timeline).

Buckets are vLLM's. The inter-token and request-phase histograms add a few boundaries below
vLLM's first (a small model on a CPU decodes a token in milliseconds) and keep every one of
vLLM's, so a dashboard's SLO threshold, which must be a bucket boundary, is still one.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvserve.sched.request import RequestOutput

LABELS = ("model_name", "engine")
ENGINE = "0"  # one engine core per server
# vLLM's FinishReason values kvserve produces (it has no repetition detection).
FINISH_REASONS = ("stop", "length", "abort", "error")

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
# vLLM's inter-token and per-request TPOT buckets, with 1 ms, 2.5 ms and 5 ms below them.
TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                         0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
# vLLM's request latency buckets (e2e, queue, prefill, decode, inference), with 10 ms, 50 ms
# and 100 ms below them.
REQUEST_LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0,
                           20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0,
                           7680.0)  # fmt: skip
STEP_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
N_BUCKETS = (1, 2, 5, 10, 20)


def buckets_1_2_5(limit: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``limit``: vLLM's buckets for token counts, which it
    bounds by the model's context length."""
    out: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > limit:
                return tuple(out)
            out.append(mantissa * scale)
        scale *= 10


class VllmMetrics:
    """The families kvserve observes itself (per finished request, per engine step), bound to
    this server's ``model_name`` and ``engine`` as vLLM binds them, so every series exists (at
    zero) from the start."""

    def __init__(self, registry: CollectorRegistry, model_name: str, max_model_len: int) -> None:
        self.model_name = model_name
        values = (model_name, ENGINE)
        lengths = buckets_1_2_5(max_model_len)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            h = Histogram("vllm:" + name, doc, LABELS, buckets=buckets, registry=registry)
            return h.labels(*values)

        self.ttft = histogram(
            "time_to_first_token_seconds",
            "Arrival to first output token, per request.",
            TTFT_BUCKETS,
        )
        self.itl = histogram(
            "inter_token_latency_seconds",
            "Time between consecutive output tokens of a request.",
            TOKEN_LATENCY_BUCKETS,
        )
        self.tpot = histogram(
            "request_time_per_output_token_seconds",
            "Decode time over output tokens after the first, per request (0 for one token).",
            TOKEN_LATENCY_BUCKETS,
        )
        self.e2e = histogram(
            "e2e_request_latency_seconds", "Arrival to last output token.", REQUEST_LATENCY_BUCKETS
        )
        self.queue = histogram(
            "request_queue_time_seconds", "Arrival to first scheduled.", REQUEST_LATENCY_BUCKETS
        )
        self.inference = histogram(
            "request_inference_time_seconds",
            "First scheduled to last output token (prefill + decode).",
            REQUEST_LATENCY_BUCKETS,
        )
        self.prefill = histogram(
            "request_prefill_time_seconds",
            "First scheduled to first output token.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.decode = histogram(
            "request_decode_time_seconds", "First to last output token.", REQUEST_LATENCY_BUCKETS
        )
        self.prompt_tokens = histogram(
            "request_prompt_tokens",
            "Prompt tokens of a finished sample, cache hits included.",
            lengths,
        )
        self.generation_tokens = histogram(
            "request_generation_tokens", "Tokens a finished sample generated.", lengths
        )
        self.prefill_computed = histogram(
            "request_prefill_kv_computed_tokens",
            "Prompt tokens a finished sample computed (its "
            "prompt less the tokens it found cached).",
            lengths,
        )
        self.max_generation_tokens = histogram(
            "request_max_num_generation_tokens",
            "The most tokens one sample of a finished request generated.",
            lengths,
        )
        self.params_n = histogram("request_params_n", "The n of a finished request.", N_BUCKETS)
        self.params_max_tokens = histogram(
            "request_params_max_tokens", "The max_tokens of a finished sample.", lengths
        )
        self.step_tokens = histogram("iteration_tokens_total",
                                     "Tokens (prefill and decode) an engine step ran.",
                                     STEP_TOKEN_BUCKETS)  # fmt: skip
        self._success = Counter("vllm:request_success", "Finished samples by finish reason.",
                                [*LABELS, "finished_reason"], registry=registry)  # fmt: skip
        for reason in FINISH_REASONS:
            self._success.labels(*values, reason)
        self._steps_seen = 0

    def count_finished(self, reason: str, n: int = 1) -> None:
        self._success.labels(self.model_name, ENGINE, reason).inc(n)

    def observe_step(self, stats: Any) -> None:
        """The tokens of the engine step ``stats`` follows, once per step that ran."""
        if stats.num_steps > self._steps_seen:
            self._steps_seen = stats.num_steps
            self.step_tokens.observe(stats.step_prefill_tokens + stats.step_decode_tokens)

    def observe_finished(
        self, out: RequestOutput, generated: list[int], max_tokens: int | None
    ) -> None:
        """A finished request: ``generated`` is each sample's output token count."""
        n_prompt = len(out.prompt_token_ids)
        for tokens in generated:
            self.prompt_tokens.observe(n_prompt)
            self.generation_tokens.observe(tokens)
            self.prefill_computed.observe(n_prompt - out.num_cached_tokens)
            if max_tokens is not None:
                self.params_max_tokens.observe(max_tokens)
        if generated:
            self.params_n.observe(len(generated))
            self.max_generation_tokens.observe(max(generated))
        m = out.metrics
        if m is None:
            return
        if m.first_scheduled_time is not None:
            self.queue.observe(max(0.0, m.first_scheduled_time - m.arrival_time))
        times = m.token_times
        if m.first_token_time is not None:
            self.ttft.observe(m.first_token_time - m.arrival_time)
            if m.first_scheduled_time is not None:
                self.prefill.observe(m.first_token_time - m.first_scheduled_time)
        if m.finished_time is not None:
            self.e2e.observe(m.finished_time - m.arrival_time)
        for a, b in zip(times, times[1:], strict=False):
            self.itl.observe(b - a)
        if times and m.first_scheduled_time is not None:
            self.inference.observe(times[-1] - m.first_scheduled_time)
        if times:
            decode = times[-1] - times[0]
            self.decode.observe(decode)
            self.tpot.observe(decode / (len(times) - 1) if len(times) > 1 else 0.0)


def engine_families(s: Any, model_name: str) -> Iterator[Metric]:
    """Gauges and totals of an :class:`~kvserve.engine.stats.EngineStats` snapshot under
    vLLM's names."""
    values = [model_name, ENGINE]
    gauges = {
        "num_requests_running": ("Samples in the running batch.", s.num_running),
        "num_requests_waiting": ("Samples waiting to be scheduled.", s.num_waiting),
        "kv_cache_usage_perc": (
            "Fraction of KV blocks in use (1 = full); cached-but-free blocks count as free.",
            s.kv_usage,
        ),
    }
    for name, (doc, value) in gauges.items():
        g = GaugeMetricFamily("vllm:" + name, doc, labels=LABELS)
        g.add_metric(values, value)
        yield g
    counters = {
        "prefix_cache_queries": ("Prompt tokens looked up in the prefix cache.",
                                 s.prefix_cache_queries),
        "prefix_cache_hits": ("Prompt tokens found in the prefix cache.", s.prefix_cache_hits),
        "num_preemptions": ("Samples preempted (recomputed later).", s.num_preemptions),
        "prompt_tokens": ("Prompt tokens of started samples, cache hits included.",
                          s.prompt_tokens_total),
        "generation_tokens": ("Tokens generated.", s.generation_tokens_total),
    }  # fmt: skip
    if s.kv_offload:  # vLLM's offloading connector's totals: the sum over kvserve's tiers
        tiers = s.kv_offload.values()
        counters |= {
            "kv_offload_load_bytes": ("Bytes loaded from the offload tiers into the KV pool.",
                                      sum(t["bytes_up"] for t in tiers)),
            "kv_offload_load_time": ("Seconds spent loading from the offload tiers.",
                                     sum(t["seconds_up"] for t in tiers)),
            "kv_offload_store_bytes": ("Bytes stored from the KV pool to the offload tiers.",
                                       sum(t["bytes_down"] for t in tiers)),
            "kv_offload_store_time": ("Seconds spent storing to the offload tiers.",
                                      sum(t["seconds_down"] for t in tiers)),
        }  # fmt: skip
    for name, (doc, value) in counters.items():
        c = CounterMetricFamily("vllm:" + name, doc, labels=LABELS)
        c.add_metric(values, value)
        yield c


def cache_config_info(cache_info: dict[str, str]) -> GaugeMetricFamily:
    """vLLM's info-style gauge: 1, the cache settings as labels, and ``engine``."""
    labels = {**cache_info, "engine": ENGINE}
    g = GaugeMetricFamily("vllm:cache_config_info", "The KV cache configuration.",
                          labels=list(labels))  # fmt: skip
    g.add_metric(list(labels.values()), 1.0)
    return g
