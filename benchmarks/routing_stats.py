"""What the routing benchmark measures beside the trace's figures: percentiles and a run's
figures from its records, the CPU each process kept busy, the machine's steal, and the
router's decisions that ran on their core."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from kvserve.bench.metrics import percentile
from kvserve.sim.serving import stat_cpu_seconds


def pct(xs: list[float], q: float) -> float | None:
    """The ``q`` quantile (0-1) as the simulator's figures take it (interpolated, as numpy's
    default), so that a real and a simulated percentile differ only in what they measure;
    None for no values."""
    return percentile(xs, q * 100) if xs else None


def trace_span(recs: list[dict[str, Any]]) -> float:
    """Seconds from the first successful request's send to the last one's end (0: none)."""
    ok = [r for r in recs if r["ok"]]
    return max(r["end"] for r in ok) - min(r["send"] for r in ok) if ok else 0.0


def figures(recs: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in recs if r["ok"]]
    span = trace_span(recs)
    out = {
        "hit_rate": sum(r["cached"] for r in ok) / max(1, sum(r["prompt"] for r in ok)),
        "ttft_p90_s": pct([r["ttft"] for r in ok if "ttft" in r], 0.9),
        "output_tok_s": sum(r["out"] for r in ok) / span if span else 0.0,
        # Each request's mean time between its output tokens: what a replica that takes more
        # than its share of the load costs the requests decoding on it.
        "tpot_p90_s": pct(
            [
                (r["end"] - r["send"] - r["ttft"]) / (r["out"] - 1)
                for r in ok
                if "ttft" in r and r["out"] > 1
            ],
            0.9,
        ),
        "failed": len(recs) - len(ok),
    }
    if out["failed"]:  # what the failed requests were told, most common first
        told = Counter(r.get("error", "unknown") for r in recs if not r["ok"])
        out["errors"] = [f"{n}x {e}" for e, n in told.most_common(3)]
    return out


def dump_decisions(state: Any, path: Path) -> None:
    """Every decision's wall and CPU seconds and whether the OS preempted it or it waited."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({
        "wall_s": list(state.decision_times), "cpu_s": list(state.decision_cpu_times),
        "preempted": list(state.decision_preempted), "waited": list(state.decision_waited),
    }))  # fmt: skip


def cpu_ticks() -> list[int]:
    """The machine's CPU time by kind (/proc/stat's first line; empty where there is none)."""
    try:
        with open("/proc/stat") as f:
            return [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return []


def proc_cpu_s(pid: int) -> float:
    """A process's user + system CPU seconds so far (/proc/PID/stat; 0 where there is none)."""
    try:
        return stat_cpu_seconds(pid)
    except OSError:
        return 0.0


def cores_busy(recs: list[dict[str, Any]], replicas: list[float], router: float,
               client: float) -> dict[str, Any]:  # fmt: skip
    """Cores each part kept busy on average over the trace's span (CPU seconds / span): the
    router and the client share the replicas' cores on a small machine."""
    span = trace_span(recs)
    if not span:
        return {}
    return {"replicas": [c / span for c in replicas], "router": router / span,
            "client": client / span}  # fmt: skip


def steal_share(before: list[int], after: list[int]) -> float | None:
    """Of the CPU time between two readings, the share the hypervisor gave to other guests
    (steal: a wait no thread of this machine sees as a context switch)."""
    if len(before) < 8 or len(after) < 8:
        return None
    d = [b - a for a, b in zip(before, after, strict=False)]
    return d[7] / max(1, sum(d[:8]))


def on_core(state: Any) -> dict[str, float]:
    """The decisions' wall p99 over those that ran to the end on their core (no context
    switch of the router's thread), and the shares the OS preempted and that waited (the GIL,
    a page): where the replicas keep every core busy, the wall p99 is the wait for a core."""
    walls = list(state.decision_times)
    cut, waited = list(state.decision_preempted), list(state.decision_waited)
    kept = [w for w, c, v in zip(walls, cut, waited, strict=True) if not (c or v)]
    n = max(1, len(walls))
    return {"decision_on_core_p99_ms": (pct(kept, 0.99) or 0.0) * 1000,
            "decision_preempted_share": sum(cut) / n,
            "decision_waited_share": sum(waited) / n}  # fmt: skip
