"""The metrics reference, read from the registry a server builds
(:class:`kvserve.server.metrics.ServerMetrics`): each family's name, type, help and label
names as ``/metrics`` exposes them.

A family's labels are known from its samples, and some families have samples only once
something happened (a request of a workload class finished, a tier exists), so the page is
read from a server in a documentation state: one offload tier, projected admission, a
retention policy's evictions, one finished request of a workload class and one refusal. A
family that still has no sample there is an error naming it, so a new family is documented
with its labels or not at all. The families that only some configurations export are found
by building the registry with and without each condition.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import MISSING, dataclass
from typing import Any

from prometheus_client import CollectorRegistry

from kvserve.docs_reference.markdown import code, table, text
from kvserve.engine.stats import EngineStats
from kvserve.sched.admission import AdmissionStats
from kvserve.sched.request import CompletionOutput, RequestMetrics, RequestOutput
from kvserve.sched.workload_classes import WorkloadClasses
from kvserve.server.metrics import ServerMetrics

# The keys kvserve.server.app.build_state describes the KV cache by (a live server's /metrics
# is compared with this page by tests/test_grafana_dashboard.py).
CACHE_INFO_KEYS = ("block_size", "cache_dtype", "num_gpu_blocks", "gpu_memory_utilization",
                   "enable_prefix_caching", "max_model_len", "kv_retention",
                   "kv_layer_groups")  # fmt: skip

INTRO = """\
# Metrics reference

!!! note "Generated from the code"
    `python -m kvserve.docs_reference` (or `make reference`) writes this page from the
    registry `kvserve serve` builds; a test fails when the committed page differs from it.

`kvserve serve` exports these on `GET /metrics` in Prometheus' text format. What kvserve
measures as vLLM does is exported under vLLM's name (`vllm:*`), type, labels and buckets, so
dashboards and alerts written for vLLM read a kvserve server unchanged; `model_name` is the
served model name and `engine` the engine core's index (`0`). What vLLM has no metric for is
`kvserve:*`; `process_*` are the server process's own, as on a vLLM server. Each quantity has
one name.

Counters are totals since start: take a `rate()` of them, and a ratio of two rates for a hit
rate (the prefix cache's hit rate is
`rate(vllm:prefix_cache_hits_total[5m]) / rate(vllm:prefix_cache_queries_total[5m])`).
`histogram_quantile()` over a histogram's `_bucket` series gives a percentile; the latency
histograms have every one of vLLM's bucket boundaries and a few finer ones below them. A
labelled family has series once something was counted under a label (the `kvserve:class_*`
families once requests run under `--workload-classes`). `examples/grafana/kvserve.json` is a
Grafana dashboard over these metrics, and vLLM's own dashboards work too: import one
(Dashboards, New, Import) and pick the Prometheus data source that scrapes the server.
"""


class _Tier(dict):
    """One offload tier's stats, shaped as :meth:`kvserve.kv.offload.KVOffload.stats` gives
    them: zero for every counter and gauge, and one failure reason."""

    def __missing__(self, key: str) -> Any:
        return {"timeout": 0} if key == "failures" else 0


# A condition's heading and the snapshot fields that turn it on.
CONDITIONS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("With an offload tier (`--kv-offload-cpu`, `--kv-offload-disk` or `--kv-offload-redis`)",
     {"kv_offload": {"cpu": _Tier()}}),
    ("With projected admission (`--admission projected`)", {"admission": AdmissionStats()}),
    ("With disaggregated prefill/decode (`--kv-transfer-config` naming `KVServeConnector`)",
     {"kv_transfer": {"leases_held": 0, "failures": {"timeout": 0}}}),
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class Family:
    name: str
    type: str
    help: str
    labels: tuple[str, ...]
    series: tuple[str, ...]  # the samples' suffixes: _total, _bucket, _sum, ...; "" a gauge's
    has_samples: bool


def documentation_stats(**overrides: Any) -> EngineStats:
    """An engine snapshot with every counter at zero, a retention policy's evictions and the
    given fields."""
    fields = {f.name: 0 for f in dataclasses.fields(EngineStats)
              if f.default is MISSING and f.default_factory is MISSING}  # fmt: skip
    fields["kv_blocks_total"] = 1  # usage is a ratio over it
    fields["retention_evicted_tokens"] = {"window:512": 0}
    return EngineStats(**{**fields, **overrides})


def documentation_registry(stats: EngineStats) -> CollectorRegistry:
    """The registry of a server whose engine reports ``stats``, after one request of the
    ``default`` workload class finished, one was refused with a 429 and one carried a field
    nobody knows (counted where the engine loop and the app count them)."""
    metrics = ServerMetrics(lambda: stats, dict.fromkeys(CACHE_INFO_KEYS, ""), WorkloadClasses([]),
                            model_name="model", max_model_len=256)  # fmt: skip
    done = CompletionOutput(0, "", [1, 2], None, None, finish_reason="length")
    times = RequestMetrics(0.0, first_scheduled_time=0.0, first_token_time=0.1,
                           finished_time=0.2, token_times=[0.1, 0.2])  # fmt: skip
    metrics.observe_output(RequestOutput("doc", None, [0], [done], True, metrics=times,
                                         workload_class="default"), max_tokens=2)  # fmt: skip
    metrics.rejected.labels(status="429").inc()  # as the app counts a refusal
    metrics.ignored_fields.labels(field="x_custom").inc()  # as an unknown request field is
    return metrics.registry


def families(registry: CollectorRegistry) -> dict[str, Family]:
    """Every family the registry exposes, by name, with the label names its samples carry
    and the suffixes of its series (``le`` is a histogram's bucket, not a label of the family;
    ``_created`` series are prometheus_client's, left out where PROMETHEUS_DISABLE_CREATED_SERIES
    is set, so not listed)."""
    out: dict[str, Family] = {}
    for m in registry.collect():
        labels = dict.fromkeys(k for s in m.samples for k in s.labels if k != "le")
        series = dict.fromkeys(s.name.removeprefix(m.name) for s in m.samples)
        series.pop("_created", None)
        out[m.name] = Family(m.name, m.type, m.documentation, tuple(labels), tuple(series),
                             bool(m.samples))  # fmt: skip
    return out


def metrics_page(
    registry: Callable[[EngineStats], CollectorRegistry] = documentation_registry,
) -> str:
    """The page: a table of the families every server exports, then one per condition for
    the families only that condition brings."""
    every = {k: v for _, cond in CONDITIONS for k, v in cond.items()}
    full = families(registry(documentation_stats(**every)))
    # vLLM's families first, then kvserve's, then the process's; registration order within.
    order = ("vllm:", "kvserve:")
    rank = {name: next((i for i, p in enumerate(order) if name.startswith(p)), len(order))
            for name in full}  # fmt: skip
    full = dict(sorted(full.items(), key=lambda item: rank[item[0]]))
    silent = [name for name, f in full.items() if not f.has_samples]
    if silent:
        raise ValueError(f"{', '.join(silent)}: no sample in the documentation registry, so "
                         "its labels are unknown; give it one in kvserve.docs_reference."
                         "metrics")  # fmt: skip
    always = set(families(registry(documentation_stats())))
    sections = [("Always exported", [f for name, f in full.items() if name in always])]
    placed = set(always)
    for heading, cond in CONDITIONS:
        brought = set(families(registry(documentation_stats(**cond)))) - always
        sections.append((heading, [f for name, f in full.items() if name in brought]))
        placed |= brought
    if unplaced := [name for name in full if name not in placed]:
        raise ValueError(f"{', '.join(unplaced)}: exported only when several conditions hold")
    parts = [INTRO]
    header = ("Metric", "Type (series)", "Labels", "Meaning")
    for heading, fams in sections:
        rows = [[code(f.name), _type(f), ", ".join(code(label) for label in f.labels),
                 text(f.help)] for f in fams]  # fmt: skip
        parts += [f"## {heading}", table(header, rows)]
    return "\n\n".join(part.strip("\n") for part in parts) + "\n"


def _type(f: Family) -> str:
    """``counter (_total)``: the type and the suffixes of its series (none for a gauge)."""
    suffixes = ", ".join(code(s) for s in f.series if s)
    return f"{f.type} ({suffixes})" if suffixes else f.type
