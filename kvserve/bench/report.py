"""Console table, Markdown summary, JSON files, PNG plots and side-by-side comparisons.

Plots need matplotlib, which is an optional extra (``pip install 'kvserve[plots]'``; the
``test`` extra includes it): it pulls in Pillow, fonttools and friends, too much for a serving
runtime that never draws. Without it the run still writes every other output and says, once,
that the plots were skipped and how to get them.
"""

from __future__ import annotations

import json
import math
import pickle
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from kvserve.bench.forks import ended_early, fork_map, receive, start_forked
from kvserve.bench.metrics import RequestRecord, sorted_floats

LATENCIES = (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"), ("E2E", "e2e_ms"))
STATS = ("mean", "p50", "p90", "p95", "p99")
PLOTS_MISSING = "plots skipped: matplotlib is not installed (pip install 'kvserve[plots]')"

# (label, dotted key, format, higher is better)
COMPARE_ROWS: tuple[tuple[str, str, str, bool], ...] = (
    ("completed", "completed", "{:.0f}", True),
    ("failed", "failed", "{:.0f}", False),
    ("duration s", "duration_s", "{:.2f}", False),
    ("requests/s", "request_throughput", "{:.3f}", True),
    ("output tok/s", "output_throughput", "{:.1f}", True),
    ("total tok/s", "total_token_throughput", "{:.1f}", True),
    ("goodput req/s", "goodput.request_goodput", "{:.3f}", True),
    ("TTFT mean ms", "ttft_ms.mean", "{:.1f}", False),
    ("TTFT p50 ms", "ttft_ms.p50", "{:.1f}", False),
    ("TTFT p99 ms", "ttft_ms.p99", "{:.1f}", False),
    ("TPOT mean ms", "tpot_ms.mean", "{:.2f}", False),
    ("TPOT p99 ms", "tpot_ms.p99", "{:.2f}", False),
    ("ITL p50 ms", "itl_ms.p50", "{:.2f}", False),
    ("ITL p99 ms", "itl_ms.p99", "{:.2f}", False),
    ("E2E mean ms", "e2e_ms.mean", "{:.1f}", False),
    ("E2E p99 ms", "e2e_ms.p99", "{:.1f}", False),
    ("prefix hit rate", "server.prefix_cache_hit_rate", "{:.1%}", True),
    ("KV usage max", "server.kv_cache_usage.max", "{:.1%}", False),
    ("token occupancy", "server.kv_cache_token_occupancy.mean", "{:.1%}", True),
    ("preemptions", "server.num_preemptions", "{:.0f}", False),
    ("KV bytes/token", "kv_bytes_per_token", "{:.0f}", False),
    ("KV blocks", "kv_blocks_total", "{:.0f}", True),
    ("$/M output tok", "cost.usd_per_million_output_tokens", "{:.4g}", False),
    ("seq agreement", "quality.sequence_agreement", "{:.1%}", True),
    ("identical outputs", "quality.identical_outputs", "{:.1%}", True),
    ("outputs compared", "quality.compared", "{:.0f}", True),
)


def get(d: dict[str, Any], dotted: str) -> Any:
    """``d["a"]["b"]`` for ``"a.b"``, or None where a level is missing (older JSON files)."""
    for part in dotted.split("."):
        if not isinstance(d, dict) or part not in d:
            return None
        d = d[part]
    return d


def _f(v: Any, fmt: str = "{:.2f}") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return fmt.format(v)


def _table(
    header: list[str], rows: list[list[str]], markdown: bool = False, left: bool = False
) -> str:
    """A plain-text (or Markdown) table; numbers right-aligned unless ``left``."""
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        return "\n".join(lines)
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=True)]
    fmt = "  ".join(f"{{:<{w}}}" if i == 0 or left else f"{{:>{w}}}" for i, w in enumerate(widths))
    lines = [fmt.format(*header), "-" * (sum(widths) + 2 * len(widths) - 2)]
    lines += [fmt.format(*r) for r in rows]
    return "\n".join(line.rstrip() for line in lines)


def _headline(s: dict[str, Any]) -> list[list[str]]:
    gp, cost, srv = s["goodput"], s["cost"], s.get("server") or {}
    slo = ", ".join(f"{k}<={v * 1000:g}ms" for k, v in (gp.get("slo_s") or {}).items())
    rows = [
        ["target", str(s.get("target", "-"))],
        ["workload", f"{s.get('workload', '-')} (seed {s.get('seed', '-')})"],
        ["load", str(s.get("load", "-"))],
        ["completed / failed", f"{s['completed']} / {s['failed']}"],
        ["duration", f"{s['duration_s']:.2f} s"],
        ["input / output tokens", f"{s['total_input_tokens']} / {s['total_output_tokens']}"],
        ["request throughput", f"{s['request_throughput']:.3f} req/s"],
        ["output token throughput", f"{s['output_throughput']:.1f} tok/s"],
        ["total token throughput", f"{s['total_token_throughput']:.1f} tok/s"],
    ]
    if slo:
        rows.append(
            [f"goodput ({slo})",
             f"{gp['request_goodput']:.3f} req/s, attainment {gp['attainment']:.1%}"]
        )  # fmt: skip
    if cost.get("gpu_hour_cost") is not None:
        rows.append(
            [f"cost (${cost['gpu_hour_cost']:g}/h x {cost['gpus']})",
             f"${_f(cost['usd_per_million_output_tokens'], '{:.4g}')} per M output tokens, "
             f"${_f(cost['usd_per_million_total_tokens'], '{:.4g}')} per M total"]
        )  # fmt: skip
    if srv.get("available"):
        kv, occ = srv["kv_cache_usage"], srv["kv_cache_token_occupancy"]
        rows += [
            ["KV usage mean / max", f"{_f(kv['mean'], '{:.1%}')} / {_f(kv['max'], '{:.1%}')}"],
            ["token occupancy mean", _f(occ["mean"], "{:.1%}")],
            ["preemptions", _f(srv["num_preemptions"], "{:.0f}")],
            ["prefix cache hits", f"{_f(srv['prefix_cache_hit_rate'], '{:.1%}')} "
             f"({_f(srv['prefix_cache_hits'], '{:.0f}')} / "
             f"{_f(srv['prefix_cache_queries'], '{:.0f}')} tokens)"],
            ["prefix cache evictions", _f(srv["prefix_cache_evictions"], "{:.0f}")],
            ["offload tier hits", f"{_f(srv.get('tier_hit_rate'), '{:.1%}')} "
             f"({_f(srv.get('tier_hit_tokens'), '{:.0f}')} tokens)"],
            ["KV allocation failures", _f(srv.get("kv_allocation_failures"), "{:.0f}")],
            ["refused by admission", _f(srv.get("requests_refused"), "{:.0f}")],
            ["queue time mean ms", _f(srv.get("queue_time_mean_ms"), "{:.1f}")],
            ["memory bandwidth of peak", _f(srv.get("memory_bandwidth_utilization"),
                                            "{:.1%}")],
        ]  # fmt: skip
    else:
        rows.append(["server metrics", "unavailable (no /metrics)"])
    for reason, n in s["failures"].items():
        example = s["failure_examples"].get(reason) or ""
        rows.append([f"failed: {reason}", f"{n}  {example[:80]}"])
    return rows


def _latency_rows(s: dict[str, Any]) -> list[list[str]]:
    return [[name] + [_f(s[key][st]) for st in STATS] for name, key in LATENCIES]


def console_table(s: dict[str, Any]) -> str:
    """The summary as the console shows it."""
    title = f"kvserve bench: {s.get('label', '')}"
    return "\n".join([
        f"== {title} " + "=" * max(0, 60 - len(title)),
        _table(["figure", "value"], _headline(s), left=True),
        "",
        _table(["latency (ms)", *STATS], _latency_rows(s)),
    ])  # fmt: skip


def markdown(s: dict[str, Any], plots: list[str] | None = None) -> str:
    """The summary as a Markdown report (headline, latency table, per-kind split, plots)."""
    parts = [
        f"# kvserve bench: {s.get('label', '')}",
        "",
        _table(["figure", "value"], _headline(s), markdown=True),
        "",
        "## Latency (ms)",
        "",
        _table(["metric", *STATS], _latency_rows(s), markdown=True),
    ]
    if s.get("by_kind"):
        rows = [[k, str(v["completed"]), str(v["failed"]), _f(v["ttft_p50_ms"]),
                 _f(v["tpot_p50_ms"])] for k, v in s["by_kind"].items()]  # fmt: skip
        parts += ["", "## By request kind", "", _table(
            ["kind", "completed", "failed", "TTFT p50 ms", "TPOT p50 ms"], rows, markdown=True
        )]  # fmt: skip
    for p in plots or []:
        parts += ["", f"![{Path(p).stem}]({Path(p).name})"]
    return "\n".join(parts) + "\n"


def compare_table(named: list[tuple[str, dict[str, Any]]], markdown: bool = False) -> str:
    """Side by side, with each run's ratio to the first (rows where every run is empty are
    dropped, so a table of runs without an SLO has no goodput row)."""
    header = ["metric"] + [n for n, _ in named]
    header += [f"{n} / {named[0][0]}" for n, _ in named[1:]]
    rows = []
    for label, key, fmt, _ in COMPARE_ROWS:
        vals = [get(s, key) for _, s in named]
        if all(v is None for v in vals):
            continue
        row = [label] + [_f(v, fmt) for v in vals]
        base = vals[0]
        for v in vals[1:]:
            ok = isinstance(base, int | float) and isinstance(v, int | float) and base
            row.append(f"{v / base:.2f}x" if ok else "-")
        rows.append(row)
    return _table(header, rows, markdown)


# Columns of the one-row-per-configuration table (header, dotted key, format, ratio to row 1).
CONFIG_COLUMNS: tuple[tuple[str, str, str, bool], ...] = (
    ("req/s", "request_throughput", "{:.2f}", True),
    ("out tok/s", "output_throughput", "{:.0f}", True),
    ("TTFT p50", "ttft_ms.p50", "{:.0f}", True),
    ("TTFT p99", "ttft_ms.p99", "{:.0f}", True),
    ("TPOT mean", "tpot_ms.mean", "{:.1f}", True),
    ("ITL p99", "itl_ms.p99", "{:.0f}", False),
    ("prefix hits", "server.prefix_cache_hit_rate", "{:.0%}", False),
    ("KV B/token", "kv_bytes_per_token", "{:.0f}", False),
    ("KV blocks", "kv_blocks_total", "{:.0f}", True),
    ("seq agreement", "quality.sequence_agreement", "{:.1%}", False),
    ("$/M out", "cost.usd_per_million_output_tokens", "{:.3g}", False),
)


def config_table(named: list[tuple[str, dict[str, Any]]], markdown: bool = False) -> str:
    """One row per configuration (latencies in ms), ratios to the first row in parentheses:
    the shape that stays readable with many configurations, where ``compare_table`` (one
    column each) does not."""
    header = ["config", "ok/sent", *(c[0] for c in CONFIG_COLUMNS)]
    base = named[0][1]
    rows = []
    for name, s in named:
        row = [name, f"{s['completed']}/{s['num_requests']}"]
        for _, key, fmt, ratio in CONFIG_COLUMNS:
            v, b = get(s, key), get(base, key)
            cell = _f(v, fmt)
            numbers = isinstance(v, int | float) and isinstance(b, int | float)
            if ratio and s is not base and numbers and b:
                cell += f" ({v / b:.2f}x)"
            row.append(cell)
        rows.append(row)
    return _table(header, rows, markdown)


def load_summary(path: str | Path) -> list[tuple[str, dict[str, Any]]]:
    """(label, summary) pairs from a bench JSON file: one for a run, one per sweep point."""
    data = json.loads(Path(path).read_text())
    stem = Path(path).stem
    if "sweep" in data:
        return [(f"{stem}@{p['sweep_value']}", p) for p in data["sweep"]]
    return [(stem, data["summary"])]


def write_json(path: Path, payload: dict[str, Any], jobs: int = 1) -> Path:
    """``payload`` as JSON: indented, except that each of its ``records`` (per-request rows,
    or a sweep's lists of them) is one compact line. Indenting forces the json module's pure
    Python encoder; a 100,000-request run has ~10 M inter-token latencies, a number per line.
    With ``jobs`` > 1 a long flat list of records is encoded in that many forked processes,
    each writing its slice's lines to a file of its own that is then copied in (the same
    text; returning it through a pipe would cost as much as encoding it). ``records`` may
    also be :class:`EncodedRecords`, encoded while the run made them."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as out:
        out.write("{\n")
        for k, (key, value) in enumerate(payload.items()):
            out.write(",\n" * (k > 0) + f" {json.dumps(key)}: ")
            if isinstance(value, EncodedRecords):
                if not value.count:
                    out.write("[]")
                    continue
                out.write("[\n")
                out.flush()
                with value.path.open("rb") as f:
                    shutil.copyfileobj(f, out.buffer, 1 << 20)
                out.write("\n ]")
            elif key != "records" or not isinstance(value, list):
                out.write(json.dumps(value, indent=1, default=str).replace("\n", "\n "))
            elif jobs > 1 and len(value) >= 2 * PARALLEL_MIN_ROWS and _flat(value):
                out.write("[\n")
                with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
                    out.flush()
                    for part in _encode_in_parts(value, RECORD_INDENT, jobs, Path(tmp)):
                        with part.open("rb") as f:  # ASCII (json escapes the rest): bytes
                            shutil.copyfileobj(f, out.buffer, 1 << 20)
                out.write("\n ]")
            else:
                out.write(_rows(value, " "))
        out.write("\n}\n")
    return path


# Rows per forked encoder at least: below this a fork costs more than it saves.
PARALLEL_MIN_ROWS = 20_000


def _flat(rows: list[Any]) -> bool:
    return not any(isinstance(r, list) for r in rows)


def _encode_in_parts(rows: list[Any], indent: str, jobs: int, where: Path) -> list[Path]:
    """``rows``' lines (as :func:`_rows` joins them) in ``jobs`` files written side by side;
    the last line of each part but the last ends with the separator."""
    jobs = min(jobs, len(rows) // PARALLEL_MIN_ROWS)
    step = -(-len(rows) // jobs)

    def write_part(lo: int) -> Path:
        part = where / f"{lo}.part"
        with part.open("w") as f:
            f.write(_lines(rows[lo : lo + step], indent))
            if lo + step < len(rows):
                f.write(",\n")
        return part

    return fork_map(write_part, range(0, len(rows), step), jobs)


def _rows(rows: list[Any], indent: str) -> str:
    """A list of records, one compact record per line (lists of records nest)."""
    if not rows:
        return "[]"
    return "[\n" + _lines(rows, indent + " ") + "\n" + indent + "]"


def _lines(rows: list[Any], indent: str) -> str:
    items = [_rows(r, indent) if isinstance(r, list) else json.dumps(r, default=str) for r in rows]
    return ",\n".join(indent + t for t in items)


# The indent of a top-level list's records in write_json's layout.
RECORD_INDENT = "  "


@dataclass(frozen=True, slots=True)
class EncodedRecords:
    """``count`` records already encoded as :func:`write_json` lays out a payload's
    ``records`` (its lines, without the brackets), in a file it copies in."""

    path: Path
    count: int


class RecordEncoder:
    """Encodes records for :func:`write_json` as a run makes them, in a forked process.

    A long simulated run makes its records over most of a minute while one core replays;
    encoding them afterwards (millions of inter-token latencies) is the largest part of its
    report. Here each finished record is handed over pickled (a small fraction of encoding
    it) and the other process encodes it meanwhile; :meth:`finish` returns the lines, in
    index order, as :class:`EncodedRecords`. ``add``'s ``shift`` is subtracted from the
    record's ``send_time`` first, as the run will do to its own copy when it ends. Use as a
    context manager (or :meth:`close`): it owns the process and its file."""

    BATCH = 256

    def __init__(self, where: Path) -> None:
        where.mkdir(parents=True, exist_ok=True)
        self._tmp = tempfile.TemporaryDirectory(dir=where, prefix=".records-")
        self._buf: list[bytes] = []
        self._result: EncodedRecords | None = None
        self._conn, self._proc = start_forked(_encode_records, Path(self._tmp.name), duplex=True)

    def add(self, index: int, record: RequestRecord, shift: float = 0.0) -> None:
        """Record ``index`` is final (but for ``send_time - shift``): encode it as it is now
        (pickled here: the caller may change its own copy after)."""
        self._buf.append(pickle.dumps((index, record, shift), pickle.HIGHEST_PROTOCOL))
        if len(self._buf) >= self.BATCH:
            self._send(self._buf)
            self._buf = []

    def finish(self) -> EncodedRecords:
        """Every record added, encoded in index order."""
        if self._result is None:
            self._send(self._buf)
            self._buf = []
            self._send(None)
            path, count = receive(self._conn, self._proc, "record encoder")
            if isinstance(path, BaseException):
                raise path
            self._result = EncodedRecords(Path(path), count)
            self._proc.join()
        return self._result

    def close(self) -> None:
        """Stop the process if it still runs and remove its file."""
        self._conn.close()
        if self._proc.is_alive():
            self._proc.terminate()
        self._proc.join()
        self._tmp.cleanup()

    def __enter__(self) -> RecordEncoder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _send(self, msg: Any) -> None:
        try:
            self._conn.send(msg)
        except (BrokenPipeError, ConnectionResetError):
            raise ended_early(self._proc, "record encoder", wait=5) from None


def _encode_records(where: Path, conn: Connection) -> None:
    """:class:`RecordEncoder`'s process: encode batches until the end mark, writing each
    line as soon as every lower index is written (requests finish roughly in index order,
    so little waits), the rest in index order at the end; answer with the file and the
    count (or the exception)."""
    try:
        path = where / "records.part"
        waiting: dict[int, str] = {}
        nxt = count = 0
        with path.open("w") as f:

            def put(text: str) -> None:
                nonlocal count
                f.write(",\n" * (count > 0) + RECORD_INDENT + text)
                count += 1

            while (batch := conn.recv()) is not None:
                for item in batch:
                    index, rec, shift = pickle.loads(item)
                    rec.send_time -= shift
                    waiting[index] = json.dumps(rec.to_dict(), default=str)
                while nxt in waiting:
                    put(waiting.pop(nxt))
                    nxt += 1
            for index in sorted(waiting):
                put(waiting[index])
        conn.send((str(path), count))
    except Exception as e:  # noqa: BLE001 - handed to the parent to raise
        conn.send((RuntimeError(f"record encoder: {type(e).__name__}: {e}"), 0))
    finally:
        conn.close()


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_latency_cdf(runs: dict[str, list[RequestRecord]], path: Path) -> Path | None:
    """CDFs of TTFT, ITL and E2E, one line per run; None when matplotlib is absent."""
    plt = _pyplot()
    if plt is None:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, (title, fn) in zip(
        axes,
        (
            ("TTFT", lambda r: [r.ttft]),
            ("inter-token latency", lambda r: r.itl),
            ("end-to-end latency", lambda r: [r.e2e]),
        ),
        strict=True,
    ):
        for label, recs in runs.items():
            xs = sorted_floats(x for r in recs if r.success for x in fn(r) if x is not None)
            if len(xs):
                ax.plot(*_cdf_points(xs, scale=1000.0), label=label)
        ax.set_title(title)
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of samples")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _cdf_points(
    xs: Sequence[float], most: int = 2000, scale: float = 1.0
) -> tuple[list[float], list[float]]:
    """The empirical CDF of sorted ``xs`` (times ``scale``) at no more than ``most`` evenly
    spaced ranks (both ends kept): a plot is no finer than that, and a long run has millions
    of samples."""
    n = len(xs)
    ranks = (
        range(n) if n <= most else sorted({round(k * (n - 1) / (most - 1)) for k in range(most)})
    )
    return [float(xs[i]) * scale for i in ranks], [(i + 1) / n for i in ranks]


def plot_sweep(points: list[dict[str, Any]], xlabel: str, path: Path) -> Path | None:
    """Throughput (and goodput) and p99 latencies against the swept load."""
    plt = _pyplot()
    if plt is None:
        return None
    xs = [p["sweep_value"] for p in points]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.8))
    a.plot(xs, [p["output_throughput"] for p in points], marker="o", label="output tok/s")
    a.plot(xs, [p["total_token_throughput"] for p in points], marker="o", label="total tok/s")
    a.set_ylabel("tokens/s")
    if any(get(p, "goodput.request_goodput") is not None for p in points):
        a2 = a.twinx()
        a2.plot(xs, [get(p, "goodput.request_goodput") for p in points], "k--", marker="x",
                label="goodput req/s")  # fmt: skip
        a2.set_ylabel("goodput req/s")
        a2.legend(loc="center right", fontsize=8)
    for key, name in (("ttft_ms", "TTFT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E")):
        b.plot(xs, [p[key]["p99"] for p in points], marker="o", label=f"{name} p99")
    b.set_yscale("log")
    b.set_ylabel("ms")
    for ax in (a, b):
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
        ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
