"""Per-request records and the statistics a benchmark reports.

Definitions follow vLLM's ``benchmark_serving`` so numbers compare across tools:

* TTFT: send to first output token. E2E: send to last token.
* TPOT (per request): (E2E - TTFT) / (output tokens - 1); undefined for one-token outputs.
* ITL: every gap between consecutive streamed chunks, pooled over all requests.
* Percentiles: linear interpolation between closest ranks (numpy's default).
* Throughput: completed requests, output tokens or all tokens over the run's duration
  (first send to last completion).
* Goodput: completed requests per second that meet every given SLO (DistServe / vLLM);
  attainment is the share of all requests, failed ones included, that do.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from kvserve.plan.cost import usd_per_million

PERCENTILES = (50, 90, 95, 99)
SLO_KEYS = ("ttft", "tpot", "e2e")


@dataclass(slots=True)
class RequestRecord:
    """What happened to one request. Times are seconds; ``send_time`` is relative to the
    start of the measured run. A failed request keeps ``reason`` (a short category that is
    counted) and ``detail`` (the server's words)."""

    index: int
    kind: str
    prefix_group: str | None
    input_len: int
    max_tokens: int
    send_time: float = 0.0
    success: bool = False
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int | None = None
    ttft: float | None = None
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    reason: str | None = None
    detail: str | None = None
    output_text: str = ""
    output_token_ids: list[int] | None = None
    # In-process only: arrival to first scheduled (the engine's wait), and the workload class.
    queue_time: float | None = None
    workload_class: str | None = None

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first (vLLM's TPOT); None below 2 tokens."""
        if not self.success or self.output_tokens < 2 or self.ttft is None or self.e2e is None:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    def succeed(self, token_times: list[float]) -> None:
        """Latencies from the times each output token was produced (same clock as
        ``send_time``)."""
        self.ttft = token_times[0] - self.send_time
        self.e2e = token_times[-1] - self.send_time
        self.itl = [b - a for a, b in zip(token_times, token_times[1:], strict=False)]
        self.success = True

    def fail(self, reason: str, detail: str | None = None) -> RequestRecord:
        self.success, self.reason, self.detail = False, reason, detail
        return self

    def to_dict(self) -> dict[str, Any]:
        # Fields are flat (numbers, strings, lists of those): a shallow copy is asdict's
        # result without its per-value deep copy, which dominated writing 100k records.
        d = {name: getattr(self, name) for name in _RECORD_FIELDS}
        d["itl"] = list(self.itl)
        if self.output_token_ids is not None:
            d["output_token_ids"] = list(self.output_token_ids)
        d["tpot"] = self.tpot
        return d


_RECORD_FIELDS = tuple(f.name for f in fields(RequestRecord))


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile with linear interpolation (rank (n-1) q/100), as numpy."""
    if not values:
        raise ValueError("percentile of no values")
    return _ranked(sorted(values), q)


def _ranked(xs: list[float], q: float) -> float:
    """:func:`percentile` of values already sorted (a 100,000-request run's ITLs are ~10 M
    samples: sorting them once per figure, not once per percentile, is most of describe)."""
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def describe(values: list[float], scale: float = 1000.0) -> dict[str, float | int | None]:
    """mean, p50, p90, p95, p99 (scaled, default seconds -> ms) and the sample count."""
    out: dict[str, float | int | None] = {"n": len(values)}
    if not values:
        out.update({"mean": None, **{f"p{q}": None for q in PERCENTILES}})
        return out
    out["mean"] = sum(values) / len(values) * scale
    xs = sorted_floats(values)
    for q in PERCENTILES:
        out[f"p{q}"] = float(_ranked(xs, q)) * scale
    return out


def sorted_floats(values: Iterable[float]) -> Sequence[float]:
    """``sorted(values)``; numpy's sort where there are many (a 100,000-request run's ~10 M
    inter-token latencies sort several times faster there, to the same order)."""
    if isinstance(values, list) and len(values) < 100_000:
        return sorted(values)
    import numpy as np

    xs = np.fromiter(values, dtype=np.float64)
    xs.sort()
    return xs


_UNITS = {"ms": 1e-3, "s": 1.0, "us": 1e-6, "": 1e-3}


def parse_slo(text: str | None) -> dict[str, float]:
    """``ttft=500ms,tpot=50ms,e2e=10s`` -> seconds per key. Bare numbers are milliseconds,
    as in vLLM's ``--goodput``."""
    if not text:
        return {}
    slo: dict[str, float] = {}
    for part in text.split(","):
        m = re.fullmatch(r"\s*(\w+)\s*[=:]\s*([0-9]*\.?[0-9]+)\s*(ms|s|us)?\s*", part)
        if not m or m.group(1) not in SLO_KEYS:
            raise ValueError(
                f"slo: expected KEY=VALUE[ms|s] with KEY in {', '.join(SLO_KEYS)}, got {part!r}"
            )
        value = float(m.group(2)) * _UNITS[m.group(3) or ""]
        if value <= 0:
            raise ValueError(f"slo: {m.group(1)} must be > 0, got {part!r}")
        slo[m.group(1)] = value
    return slo


def meets_slo(r: RequestRecord, slo: dict[str, float]) -> bool:
    """A completed request within every given bound; a missing TPOT (one output token)
    cannot violate the TPOT bound."""
    if not r.success:
        return False
    values = {"ttft": r.ttft, "tpot": r.tpot, "e2e": r.e2e}
    return all(values[k] is None or values[k] <= v for k, v in slo.items())  # type: ignore[operator]


def server_summary(
    before: dict[str, float] | None,
    after: dict[str, float] | None,
    samples: list[dict[str, float]],
) -> dict[str, Any]:
    """KV and prefix-cache figures from /metrics snapshots (or the engine's stats): counters
    as the difference after - before, gauges as before/after and mean/max over the samples
    taken during the run. Missing metrics are None: not every server exports every one."""

    def delta(name: str) -> float | None:
        if not before or not after or name not in before or name not in after:
            return None
        return after[name] - before[name]

    def gauge(name: str) -> dict[str, float | None]:
        vals = [s[name] for s in samples if name in s]
        return {
            "before": (before or {}).get(name),
            "after": (after or {}).get(name),
            "mean": sum(vals) / len(vals) if vals else None,
            "max": max(vals) if vals else None,
        }

    queries, hits = delta("prefix_cache_queries_total"), delta("prefix_cache_hits_total")
    return {
        "available": bool(before and after),
        "kv_cache_usage": gauge("kv_cache_usage_perc"),
        "kv_cache_token_occupancy": gauge("kv_cache_token_occupancy"),
        "num_requests_running": gauge("num_requests_running"),
        "num_requests_waiting": gauge("num_requests_waiting"),
        "num_preemptions": delta("num_preemptions_total"),
        "prefix_cache_queries": queries,
        "prefix_cache_hits": hits,
        "prefix_cache_hit_rate": hits / queries if queries else None,
        "prefix_cache_evictions": delta("prefix_cache_evictions_total"),
        # Prompt tokens loaded from an offload tier (after the device's prefix hits missed),
        # and their share of the tokens the prefix cache was asked for.
        "tier_hit_tokens": (tier := delta("kv_offload_hit_tokens_total")),
        "tier_hit_rate": tier / queries if tier is not None and queries else None,
        "kv_allocation_failures": delta("kv_allocation_failures_total"),
        "requests_refused": delta("requests_refused_total"),
        "queue_time_mean_ms": _ratio(
            delta("request_queue_time_seconds_sum"),
            delta("request_queue_time_seconds_count"),
            1000.0,
        ),
        "memory_bandwidth_utilization": _ratio(
            delta("memory_bytes_read_total"),
            _times(
                delta("engine_step_seconds_total"),
                (after or {}).get("memory_bandwidth_peak_bytes_per_second"),
            ),
        ),
        "num_samples": len(samples),
    }


def _ratio(a: float | None, b: float | None, scale: float = 1.0) -> float | None:
    return a / b * scale if a is not None and b else None


def _times(a: float | None, b: float | None) -> float | None:
    return a * b if a is not None and b is not None else None


def summarize(
    records: list[RequestRecord],
    duration: float,
    slo: dict[str, float] | None = None,
    gpu_hour_cost: float | None = None,
    gpus: int = 1,
) -> dict[str, Any]:
    """The run's headline figures as a JSON-ready dict (latencies in ms)."""
    slo = slo or {}
    ok = [r for r in records if r.success]
    failed = [r for r in records if not r.success]
    reasons = Counter(r.reason or "unknown" for r in failed)
    examples = {}
    for r in failed:
        examples.setdefault(r.reason or "unknown", r.detail)
    out_tok = sum(r.output_tokens for r in ok)
    in_tok = sum(r.prompt_tokens for r in ok)
    dur = max(duration, 1e-9)
    good = sum(1 for r in records if meets_slo(r, slo))
    tput_out, tput_all = out_tok / dur, (in_tok + out_tok) / dur
    cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    summary: dict[str, Any] = {
        "num_requests": len(records),
        "completed": len(ok),
        "failed": len(failed),
        "failures": dict(reasons),
        "failure_examples": examples,
        "duration_s": duration,
        "total_input_tokens": in_tok,
        "total_output_tokens": out_tok,
        "cached_prompt_tokens": sum(cached) if cached else None,
        "request_throughput": len(ok) / dur,
        "output_throughput": tput_out,
        "total_token_throughput": tput_all,
        "ttft_ms": describe([r.ttft for r in ok if r.ttft is not None]),
        "tpot_ms": describe([t for r in ok if (t := r.tpot) is not None]),
        "itl_ms": describe([x for r in ok for x in r.itl]),
        "e2e_ms": describe([r.e2e for r in ok if r.e2e is not None]),
        "goodput": {
            "slo_s": slo,
            "good_requests": good if slo else None,
            "request_goodput": good / dur if slo else None,
            "attainment": good / len(records) if slo and records else None,
        },
        "cost": {
            "gpu_hour_cost": gpu_hour_cost,
            "gpus": gpus,
            "usd_per_million_output_tokens": None,
            "usd_per_million_total_tokens": None,
        },
    }
    if gpu_hour_cost is not None:
        summary["cost"]["usd_per_million_output_tokens"] = usd_per_million(
            tput_out, gpu_hour_cost, gpus
        )
        summary["cost"]["usd_per_million_total_tokens"] = usd_per_million(
            tput_all, gpu_hour_cost, gpus
        )
    by_kind: dict[str, dict[str, Any]] = {}
    for kind in sorted({r.kind for r in records}):
        rs = [r for r in ok if r.kind == kind]
        by_kind[kind] = {
            "completed": len(rs),
            "failed": sum(1 for r in failed if r.kind == kind),
            "ttft_p50_ms": describe([r.ttft for r in rs if r.ttft is not None])["p50"],
            "tpot_p50_ms": describe([t for r in rs if (t := r.tpot) is not None])["p50"],
            "request_goodput": (sum(1 for r in rs if meets_slo(r, slo)) / dur if slo else None),
        }
    summary["by_kind"] = by_kind
    return summary
