"""The gate's outputs: a console table, a JSON report and a PNG heatmap of needle recall.

The heatmap needs matplotlib, an optional extra (``pip install 'kvserve[plots]'``, included in
``[test]``), as for ``kvserve bench``'s plots: a serving install should not pull in a plotting
stack. Without it the gate still prints and writes everything else and says the heatmap was
skipped and how to get it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

HEATMAP_MISSING = "heatmap skipped: matplotlib is not installed (pip install 'kvserve[plots]')"


def _fmt(kind: str, v: float | None) -> str:
    if v is None:
        return "-"
    if v != v:  # NaN
        return "nan"
    if kind in ("recall", "share"):
        return f"{v:.1%}"
    if kind == "ppl":
        return f"{v:.3f}"
    return f"{v:.2e}" if 0 < abs(v) < 1e-3 else f"{v:.4f}"


def _fmt_delta(kind: str, d: float | None) -> str:
    if d is None or d != d:
        return "-" if d is None else "nan"
    if kind == "recall":
        return f"{d * 100:+.1f} pt"
    return f"{d:+.2%}"


def _paired(m: dict[str, Any]) -> str:
    """Lost/gained prompts, McNemar's p and the drop's interval, for a recall row."""
    if not (m.get("lost") or m.get("gained")):
        return ""
    text = f" (-{m['lost']}/+{m['gained']}"
    if "p_value" in m:
        lo, hi = m["drop_interval"]
        text += f", p {m['p_value']:.2g}, drop {lo * 100:+.0f}..{hi * 100:+.0f} pt"
    return text + ")"


def format_table(report: dict[str, Any]) -> str:
    """The human-readable report: settings, one row per metric, the recall grids, verdict."""
    b, c = report["baseline"], report["candidate"]
    cr = report["cache_reads"]
    lines = [
        f"kvserve quality: {report['model']}",
        f"baseline : kv_cache_dtype=auto ({b['kv_format']}), exact",
        f"candidate: {report['label']} ({c['kv_format']})",
    ]
    if cr["chunked_prefill"]:
        lines.append(
            f"chunked prefill, {cr['prefill_chunk_tokens']} tokens per step in both runs: "
            f">= {cr['min_share_of_prompt_positions']:.1%} of prompt positions attend through "
            f"the stored KV cache (only each prompt's first chunk sees fresh K/V)"
        )
    else:
        lines.append(
            "WARNING: chunked prefill is off, so prompts attend to fresh K/V and only decode "
            "reads the stored cache; the gate is blind to most of the format's error"
        )
    s = report["suite"]
    skip = "".join(f"\n  skipped {task}: {why}" for task, why in s["skipped"].items())
    lines.append(
        f"suite: {s['generation_prompts']} greedy prompts + {s['ppl_passages']} held-out "
        f"passages, {s['prompt_tokens_per_run']} prompt tokens per run; chat template: "
        f"{s['chat_template']}{skip}"
    )
    head = ("metric", "n", "baseline", "candidate", "change", "threshold", "result")
    rows = [head]
    for m in report["metrics"]:
        rows.append(
            (
                m["label"],
                str(m["n"]),
                _fmt(m["kind"], m["baseline"]),
                _fmt(m["kind"], m["candidate"]),
                _fmt_delta(m["kind"], m["delta"]) + _paired(m),
                m["threshold"],
                "PASS" if m["passed"] else "FAIL",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines.append("")
    for r in rows:
        right = [x.rjust(w) for x, w in zip(r[1:6], widths[1:6], strict=True)]
        cells = [r[0].ljust(widths[0]), *right]
        lines.append("  ".join(cells + [r[6]]))
    if report.get("answers_identical") is not None:
        lines.append(
            f"(info) greedy answers identical to the baseline: {report['answers_identical']:.1%}"
        )
    for side in ("baseline", "candidate"):
        grid = report["grid"][side]
        if not grid:
            continue
        depths = list(next(iter(grid.values())).keys())
        lines += ["", f"needle recall, {side} (rows: context tokens, columns: depth %)"]
        lines.append("  len " + "".join(f"{d:>7}" for d in depths))
        for length, row in grid.items():
            lines.append(f"{length:>5} " + "".join(f"{row[d]:>7.0%}" for d in depths))
    verdict = "PASS" if report["passed"] else "FAIL"
    failed = [m["label"] for m in report["metrics"] if not m["passed"]]
    sec = report["seconds"]
    lines += [
        "",
        f"quality gate: {verdict}" + (f" ({', '.join(failed)})" if failed else "")
        + f"  [baseline {sec['baseline']:.1f}s, candidate {sec['candidate']:.1f}s]",
    ]  # fmt: skip
    return "\n".join(lines)


def slug(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.+-]+", "-", label).strip("-") or "candidate"


def write_json(report: dict[str, Any], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1, default=str) + "\n")
    return path


def plot_recall_heatmap(report: dict[str, Any], path: Path) -> Path | None:
    """Baseline and candidate needle recall side by side (length x depth); None without
    matplotlib or without a grid."""
    grids = report["grid"]
    if not grids["baseline"]:
        return None
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 0.6 * len(grids["baseline"]) + 2.2))
    image = None
    for ax, side in zip(axes, ("baseline", "candidate"), strict=True):
        grid = grids[side]
        lengths = list(grid.keys())
        depths = list(next(iter(grid.values())).keys())
        data = [[grid[n][d] for d in depths] for n in lengths]
        image = ax.imshow(data, vmin=0.0, vmax=1.0, cmap="RdYlGn", aspect="auto")
        ax.set_xticks(range(len(depths)), depths)
        ax.set_yticks(range(len(lengths)), lengths)
        ax.set_xlabel("needle depth (%)")
        if side == "baseline":
            ax.set_ylabel("context (tokens)")
        fmt = report["baseline"]["kv_format"] if side == "baseline" else report["label"]
        ax.set_title(f"{side}: {fmt}")
        for i, row in enumerate(data):
            for j, v in enumerate(row):
                ax.text(j, i, f"{v:.0%}", ha="center", va="center", fontsize=8)
    fig.colorbar(image, ax=list(axes), label="recall (exact match)")
    fig.suptitle(f"needle recall: {Path(report['model']).name}")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path
