"""The gate's outputs: a console table, a JSON report and a PNG heatmap of needle recall
(each cell shows its hits and prompts).

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

from kvserve.quality.suite import TASKS

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


def _fmt_delta(m: dict[str, Any]) -> str:
    d, kind = m["delta"], m["kind"]
    if d is None or d != d:
        return "-" if d is None else "nan"
    if kind == "recall":
        return f"{d * 100:+.1f} pt (-{m['lost']}/+{m['gained']})"
    if kind == "kl":
        return "-"
    return f"{d:+.2%}"


def _fmt_bounds(m: dict[str, Any]) -> str:
    """The metric's bounds: of the loss in points (recall), of the relative increase
    (perplexity), of the agreement itself, of the mean KL."""
    lo, hi = m["interval"]
    if lo != lo or hi != hi:
        return "nan"
    if m["kind"] == "recall":
        return f"loss {lo * 100:+.1f}..{hi * 100:+.1f} pt"
    if m["kind"] == "ppl":
        return f"{lo:+.2%}..{hi:+.2%}"
    if m["kind"] == "share":
        return f"{lo:.1%}..{hi:.1%}"
    return f"{_fmt('kl', lo)}..{_fmt('kl', hi)}"


def _fmt_needed(m: dict[str, Any]) -> str:
    if m["verdict"] != "INCONCLUSIVE":
        return ""
    if m["needed"] is None:
        return "no size decides"
    return f"needs n >= {m['needed']}"


def format_table(report: dict[str, Any]) -> str:
    """The human-readable report: settings, one row per metric, the recall grids, verdict."""
    b, c = report["baseline"], report["candidate"]
    cr = report["cache_reads"]
    lines = [
        f"kvserve quality: {report['model']}",
        f"baseline : kv_cache_dtype=auto ({b['kv_format']}), exact",
        f"candidate: {report['label']} ({c['kv_format']})",
    ]
    if report.get("device"):
        lines.append(f"device: {report['device']}")
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
    size = _size_flag(report)
    weights = "".join(f", {task} x{w}" for task, w in s.get("weights", ()))
    lines.append(
        f"suite: {size}--prompts {s['prompts']}{weights}: {s['generation_prompts']} greedy "
        f"prompts + {s['passages']} held-out passages, {s['prompt_tokens_per_run']} prompt "
        f"tokens per run; chat template: {s['chat_template']}{skip}"
    )
    tasks = s.get("tasks")
    if tasks is not None and set(tasks) != set(TASKS):
        lines.append(
            f"tasks: {', '.join(tasks)} only (--tasks); the verdict covers these, not the "
            f"whole suite"
        )
    head = ("metric", "n", "baseline", "candidate", "change", "bounds", "rule", "verdict", "")
    rows = [head]
    for m in report["metrics"]:
        rows.append(
            (
                m["label"],
                f"{m['n']} {m['unit']}",
                _fmt(m["kind"], m["baseline"]),
                _fmt(m["kind"], m["candidate"]),
                _fmt_delta(m),
                _fmt_bounds(m),
                m["rule"],
                m["verdict"],
                _fmt_needed(m),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines.append("")
    for r in rows:
        right = [x.rjust(w) for x, w in zip(r[1:6], widths[1:6], strict=True)]
        left = [x.ljust(w) for x, w in zip(r[6:8], widths[6:8], strict=True)]
        lines.append("  ".join([r[0].ljust(widths[0]), *right, *left, r[8]]).rstrip())
    conf = report["thresholds"]["confidence"]
    lines += [
        "",
        f"bounds: one-sided {conf:.0%} confidence bounds (a two-sided {2 * conf - 1:.0%} "
        "interval). Recall: Newcombe's paired interval of the loss (baseline minus candidate) "
        "over the same prompts, (-lost/+gained) prompts. Perplexity, agreement, KL: bootstrap "
        "over passages. PASS: the whole interval is within the margin; FAIL: wholly beyond "
        "it; INCONCLUSIVE: the suite is too small to tell (n: what would decide at the "
        "observed rates).",
    ]
    if any(m["unit"] == "passages" for m in report["metrics"]):
        lines.append(
            "teacher-forced next-token agreement: both runs score the same passages and the "
            "top-1 next token is compared at every position (not `make run`'s sequence "
            "agreement, which compares free-running greedy outputs up to their first different "
            "token)."
        )
    if report.get("greedy_answers_identical") is not None:
        lines.append(
            "(info) greedy answers identical to the baseline: "
            f"{report['greedy_answers_identical']:.1%}"
        )
    for side in ("baseline", "candidate"):
        grid = report["grid"][side]
        if not grid:
            continue
        depths = sorted({d for row in grid.values() for d in row}, key=float)
        lines += ["", f"needle hits/prompts, {side} (rows: context tokens, columns: depth %)"]
        lines.append("  len " + "".join(f"{d:>8}" for d in depths))
        for length, row in grid.items():
            cells = (f"{row[d][0]}/{row[d][1]}" if d in row else "-" for d in depths)
            lines.append(f"{length:>5} " + "".join(f"{x:>8}" for x in cells))
    verdict = report["verdict"]
    sec = report["seconds"]
    tail = f"  [baseline {sec['baseline']:.1f}s, candidate {sec['candidate']:.1f}s]"
    lines.append("")
    if verdict == "PASS":
        lines.append(f"quality gate: PASS{tail}")
    elif verdict == "FAIL":
        failed = [m["label"] for m in report["metrics"] if m["verdict"] == "FAIL"]
        lines.append(f"quality gate: FAIL ({', '.join(failed)}){tail}")
    else:
        open_ = [m["label"] for m in report["metrics"] if m["verdict"] == "INCONCLUSIVE"]
        need = report.get("needed_prompts")
        more = (
            f"about {size}--prompts {need} would decide at the observed rates"
            if need
            else "no suite size decides at the observed rates"
        )
        lines.append(f"quality gate: INCONCLUSIVE ({', '.join(open_)}): {more}{tail}")
        by_task = report.get("needed_by_task") or {}
        alone = [f"{size}--tasks {t} --prompts {n}" for t, n in by_task.items() if n is not None]
        if alone:
            lines.append("  or only the undecided tasks, each alone: " + "; ".join(alone))
    return "\n".join(lines)


def _size_flag(report: dict[str, Any]) -> str:
    """The suite-size flag a larger run must repeat to extend this report's groups: the
    contexts (``--quick``) and group weights (``--full``) are the size's, not ``--prompts``'."""
    name = report["suite"].get("name", "default")
    return "" if name == "default" else f"--{name} "


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
        depths = sorted({d for row in grid.values() for d in row}, key=float)
        data = [[grid[n][d][0] / grid[n][d][1] if d in grid[n] else float("nan")
                 for d in depths] for n in lengths]  # fmt: skip
        image = ax.imshow(data, vmin=0.0, vmax=1.0, cmap="RdYlGn", aspect="auto")
        ax.set_xticks(range(len(depths)), depths)
        ax.set_yticks(range(len(lengths)), lengths)
        ax.set_xlabel("needle depth (%)")
        if side == "baseline":
            ax.set_ylabel("context (tokens)")
        fmt = report["baseline"]["kv_format"] if side == "baseline" else report["label"]
        ax.set_title(f"{side}: {fmt}")
        for i, n in enumerate(lengths):
            for j, d in enumerate(depths):
                if d in grid[n]:
                    hits, total = grid[n][d]
                    ax.text(j, i, f"{hits}/{total}", ha="center", va="center", fontsize=8)
    fig.colorbar(image, ax=list(axes), label="recall (exact match)")
    fig.suptitle(f"needle recall: {Path(report['model']).name}")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path
