"""The Grafana dashboard in ``examples/grafana/kvserve.json`` against a live server: the
dashboard has Grafana's fields, and every series its PromQL queries select is on a real
server's ``/metrics`` (uvicorn on loopback, real requests, the exposition parsed by
prometheus_client's parser), with the type its query needs (``rate()`` of a counter,
``histogram_quantile()`` of a histogram's buckets) and the labels it groups and filters by.
The metrics reference page is checked against the same live ``/metrics``: every family the
server exports is on the page with its type and labels, and nothing else is."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvserve import LLM
from kvserve.distributed import free_port
from kvserve.server.app import BackgroundServer, build_state
from kvserve.server.tenants import TenantResolver
from tests.disagg_helpers import transfer_config
from tests.test_server import wait_idle

REPO = Path(__file__).resolve().parent.parent
DASHBOARD = REPO / "examples" / "grafana" / "kvserve.json"
METRICS_PAGE = REPO / "docs" / "reference" / "metrics.md"
MODEL = "tiny-llama"
# One class matching every request, with an SLO any request meets: its goodput counters count.
CLASSES = {"classes": [{"name": "chat", "slo": {"ttft_ms": 600000, "tpot_ms": 600000}}]}
# Labels Prometheus adds to every series it scrapes.
TARGET_LABELS = {"instance", "job"}
KEYWORDS = {"and", "or", "unless", "bool", "offset", "inf", "nan"}
GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
NAME = r"[A-Za-z_:][A-Za-z0-9_:]*"


def series_names(expr: str) -> set[str]:
    """The series names a PromQL expression selects: string literals, label matchers, range
    brackets and grouping label lists removed; a name before ``(`` is a function or an
    aggregation, a name right after a digit is a duration's unit."""
    s = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    s = re.sub(r"\{[^}]*\}", " ", s)
    s = re.sub(r"\[[^\]]*\]", " ", s)
    s = GROUPING.sub(" ", s)
    out = set()
    for m in re.finditer(rf"(?<![0-9.A-Za-z_:]){NAME}", s):
        if s[m.end() :].lstrip().startswith("(") or m.group().lower() in KEYWORDS:
            continue
        out.add(m.group())
    return out


def test_series_names_reads_promql():
    expr = ('histogram_quantile(0.95, sum by (le, tier) (rate(a:b_bucket{x="y", z=~"$v"}'
            '[$__rate_interval]))) / ignoring(q) c_total offset 5m and on (i) d')  # fmt: skip
    assert series_names(expr) == {"a:b_bucket", "c_total", "d"}
    assert series_names('sum(rate(e_total{l="sum(f)"}[5m]))') == {"e_total"}


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text(encoding="utf-8"))


def queries(dash: dict) -> list[tuple[str, str]]:
    """(panel title, expr) for every query of every panel, rows' nested panels included."""
    out = []
    for panel in dash["panels"]:
        for p in [panel, *panel.get("panels", [])]:
            out += [(p["title"], t["expr"]) for t in p.get("targets", [])]
    return out


def test_dashboard_has_grafanas_fields():
    dash = dashboard()
    assert isinstance(dash["title"], str) and dash["title"]
    assert isinstance(dash["uid"], str) and re.fullmatch(r"[A-Za-z0-9_-]{1,40}", dash["uid"])
    assert isinstance(dash["schemaVersion"], int) and dash["schemaVersion"] >= 30
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert isinstance(dash["panels"], list) and dash["panels"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for p in dash["panels"]:
        assert isinstance(p["type"], str) and isinstance(p["title"], str) and p["title"]
        pos = p["gridPos"]
        assert set(pos) == {"h", "w", "x", "y"} and all(isinstance(v, int) for v in pos.values())
        assert 0 <= pos["x"] and pos["x"] + pos["w"] <= 24 and pos["h"] > 0
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert isinstance(p["targets"], list) and p["targets"], p["title"]
        for t in p["targets"]:
            assert isinstance(t["expr"], str) and t["expr"].strip(), p["title"]
            assert isinstance(t["refId"], str) and t["refId"]
            assert t.get("datasource", p["datasource"]) == p["datasource"]
    # No two panels overlap on the grid.
    cells = set()
    for p in dash["panels"]:
        g = p["gridPos"]
        xs, ys = range(g["x"], g["x"] + g["w"]), range(g["y"], g["y"] + g["h"])
        here = {(x, y) for x in xs for y in ys}
        assert not cells & here, p["title"]
        cells |= here


def test_dashboard_covers_what_the_issue_asks_for():
    names = set().union(*(series_names(e) for _, e in queries(dashboard())))
    for wanted in ("vllm:kv_cache_usage_perc", "vllm:prefix_cache_hits_total",
                   "vllm:prefix_cache_queries_total", "vllm:num_preemptions_total",
                   "vllm:time_to_first_token_seconds_bucket",
                   "vllm:inter_token_latency_seconds_bucket",
                   "kvserve:class_goodput_requests_total", "kvserve:kv_offload_hits_total",
                   "kvserve:memory_bytes_read_total"):  # fmt: skip
        assert wanted in names, wanted
    # Each quantity under one name: no kvserve: twin of a vLLM name the dashboard reads.
    for name in names:
        if name.startswith("vllm:"):
            assert "kvserve:" + name.removeprefix("vllm:") not in names, name


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    """A server with every optional family on: an offload tier, projected admission, a
    workload class file and a disaggregation connector."""
    path = tmp_path_factory.mktemp("classes") / "classes.json"
    path.write_text(json.dumps(CLASSES))
    llm = LLM(checkpoint("llama_gqa"), max_model_len=256, dtype="float32", max_num_seqs=8,
              kv_offload_cpu="8MiB", admission="projected", workload_classes=str(path),
              kv_transfer_config=transfer_config("kv_both", free_port()))  # fmt: skip
    state = build_state(llm.engine, [MODEL], TenantResolver({}), max_queue=16)
    with BackgroundServer(state) as srv:
        yield srv


@pytest.fixture(scope="module")
def exposition(server):
    """/metrics after a few finished requests and one refused one, parsed: family name ->
    (type, {sample name: label names})."""
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for prompt in ("The pass code for", "A long time ago", "The pass code for"):
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0,
                    "ignore_eos": True}  # fmt: skip
            r = http.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
        assert http.post("/v1/completions", content=b"{not json").status_code == 400
        wait_idle(server.state)
        text = http.get("/metrics").text
    out: dict[str, tuple[str, dict[str, set[str]]]] = {}
    for fam in text_string_to_metric_families(text):
        samples: dict[str, set[str]] = {}
        for s in fam.samples:
            samples.setdefault(s.name, set()).update(s.labels)
        out[fam.name] = (fam.type, samples)
    return out


def test_every_series_the_dashboard_queries_is_exported(exposition):
    by_series = {name: (fam, kind) for fam, (kind, samples) in exposition.items()
                 for name in samples}  # fmt: skip
    assert "kvserve:kv_offload_hits_total" in by_series  # the tier is on: the check has teeth
    for title, expr in queries(dashboard()):
        names = series_names(expr)
        assert names, (title, expr)
        labels = set(TARGET_LABELS)
        for name in names:
            assert name in by_series, f"{title}: {name} is not on /metrics ({expr})"
            fam, kind = by_series[name]
            own = exposition[fam][1][name]
            labels |= own
            if name.endswith("_bucket"):
                assert kind == "histogram", (title, name)
            for matcher in re.findall(rf"{re.escape(name)}\{{([^}}]*)\}}", expr):
                used = set(re.findall(r"(\w+)\s*(?:=~|!=|!~|=)", matcher))
                assert used <= own | TARGET_LABELS, (title, name, used - own)
        for fn, arg in re.findall(rf"\b(rate|increase|irate)\(\s*({NAME})", expr):
            assert by_series[arg][1] in ("counter", "histogram"), f"{title}: {fn}({arg}) of a gauge"
        for arg in re.findall(rf"histogram_quantile\([^,]+,.*?({NAME}_bucket)", expr):
            assert by_series[arg][1] == "histogram", (title, arg)
        for _, grouped in GROUPING.findall(expr):
            wanted = {g.strip() for g in grouped.split(",") if g.strip()}
            assert wanted <= labels, f"{title}: groups by {wanted - labels}, no label of {names}"


def test_template_variable_queries_an_exported_metric(exposition):
    series = {name for _, samples in exposition.values() for name in samples}
    for v in dashboard()["templating"]["list"]:
        if v["type"] == "query":
            (metric,) = re.findall(rf"label_values\(\s*({NAME})\s*,", v["definition"])
            assert metric in series, v["name"]


def page_rows() -> dict[str, tuple[str, set[str]]]:
    """The metrics page's rows: name -> (type, labels)."""
    out = {}
    for line in METRICS_PAGE.read_text(encoding="utf-8").splitlines():
        if line.startswith("| `"):
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
            labels = set(re.findall(r"`([^`]+)`", cells[2]))
            out[cells[0].strip("`")] = (cells[1].split()[0], labels)
    return out


def test_metrics_page_matches_a_live_server(exposition):
    """The page is generated from a registry in a documentation state; the live server, with
    every optional family on, exports the same families, types and labels."""
    live: dict[str, tuple[str, set[str] | None]] = {}
    for fam, (kind, samples) in exposition.items():
        if fam.endswith("_created") and fam.removesuffix("_created") in exposition:
            continue  # prometheus_client's creation time beside a counter or histogram
        # None: a labelled family nothing was counted under yet (its labels are unseen).
        labels = set().union(*samples.values()) - {"le"} if samples else None
        live[fam] = (kind, labels)
    page = page_rows()
    assert set(live) == set(page), set(live) ^ set(page)
    assert sum(labels is not None for _, labels in live.values()) > 40  # the check has teeth
    for fam, (kind, labels) in live.items():
        assert page[fam][0] == kind, fam
        if labels is not None:
            assert page[fam][1] == labels, fam
