"""``kvserve quality``: gate a KV configuration against the exact baseline of the same model.

  kvserve quality MODEL --kv-cache-dtype kivi2 [--quick | --full] [--prompts N]

Runs the suite twice (baseline: kv_cache_dtype auto; candidate: the given lossy options) and
judges each metric by non-inferiority: PASS when the candidate's loss is, with 95 % confidence,
within the margin; FAIL when it is, with 95 % confidence, beyond it; INCONCLUSIVE when the
suite is too small to tell (the table says how many prompts would decide). Exit code: 0 PASS,
1 FAIL, 3 INCONCLUSIVE (the worst over several candidates), 2 usage error (including no lossy
option: the baseline against itself proves nothing). Writes a JSON report and a PNG recall
heatmap under --out. Prefill is chunked (--max-num-batched-tokens,
default 64 here) in both runs, so most prompt attention reads the stored, possibly quantized,
cache rather than the fresh K/V of the current chunk.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvserve.engine_args import add_engine_args, add_model_arg, engine_kwargs

DEFAULT_OUT = Path("reports") / "quality"
GATE_CHUNK_TOKENS = 64
GATE_MAX_NUM_SEQS = 16


def add_quality_parser(sub: Any) -> Callable[[argparse.Namespace], int]:
    """Register ``quality`` on the CLI's subparsers; returns its handler."""
    from kvserve.quality.suite import TASKS
    from kvserve.quality.thresholds import Thresholds

    th = Thresholds()
    p = sub.add_parser(
        "quality",
        help="compare a KV configuration with the exact baseline: recall, perplexity, agreement",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_arg(p)
    add_engine_args(p)
    # Small chunks so that prompts are read back from the cache; a modest batch keeps the pool
    # small. Both can be overridden, and apply to both runs alike.
    p.set_defaults(max_num_batched_tokens=GATE_CHUNK_TOKENS, max_num_seqs=GATE_MAX_NUM_SEQS)
    g = p.add_argument_group("quality gate")
    size = g.add_mutually_exclusive_group()
    size.add_argument(
        "--quick",
        action="store_true",
        help="12 prompts per group: fails a gross loss, else INCONCLUSIVE (CI)",
    )
    size.add_argument(
        "--full",
        action="store_true",
        help="200 prompts per group (default: 64), and 3x for multi-needle, 2x for multi-turn, "
        "6x for instruction following, whose answers flip both ways; contexts as the default",
    )
    g.add_argument("--prompts", type=int, default=None, metavar="N",
                   help="prompts per judged group (scales the chosen suite; one held-out "
                   "passage per 4 prompts)")  # fmt: skip
    g.add_argument("--tasks", default=None, metavar="TASK[,TASK...]",
                   help="run only these of the suite's tasks (" + ", ".join(TASKS) + "), e.g. "
                   "to grow a group the whole suite left INCONCLUSIVE with --prompts; the "
                   "verdict covers them only (default: all)")  # fmt: skip
    g.add_argument("--json", action="store_true", help="print the report as JSON on the last line")
    g.add_argument(
        "--max-recall-drop",
        type=float,
        default=th.max_recall_drop,
        help="margin: largest allowed loss of any recall or instruction-following share, "
        "absolute (0.05 = 5 points)",
    )
    g.add_argument(
        "--confidence",
        type=float,
        default=th.confidence,
        help="confidence of each one-sided bound a verdict rests on",
    )
    g.add_argument(
        "--max-ppl-increase",
        type=float,
        default=th.max_ppl_increase,
        help="margin: largest allowed relative perplexity increase (0.05 = +5%%)",
    )
    g.add_argument(
        "--min-agreement",
        type=float,
        default=th.min_agreement,
        help="margin: smallest allowed teacher-forced next-token agreement with the baseline "
        "(its lower bound must reach it)",
    )
    g.add_argument(
        "--max-kl",
        type=float,
        default=th.max_kl,
        help="margin: largest allowed mean KL(baseline || candidate) per position, nats",
    )
    g.add_argument(
        "--formats",
        default=None,
        metavar="FMT[,FMT...]",
        help="gate each of these KV cache dtypes against one shared baseline run "
        "(instead of --kv-cache-dtype)",
    )
    g.add_argument(
        "--retentions",
        default=None,
        metavar="SPEC[;SPEC...]",
        help="gate each of these KV retention policies (e.g. 'window:50%%;window:25%%') "
        "against one shared baseline run (instead of --kv-retention)",
    )
    g.add_argument("--out", type=Path, default=DEFAULT_OUT, help="directory for JSON and PNG")
    g.add_argument("--label", default=None, help="name of the candidate in tables and files")
    g.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (on a small machine shared with other work, more "
                        "threads oversubscribe the cores)")  # fmt: skip
    return cmd_quality


def cmd_quality(args: argparse.Namespace) -> int:
    from kvserve.config import ConfigError
    from kvserve.quality.gate import run_gates
    from kvserve.quality.stats import EXIT_CODES, overall
    from kvserve.quality.suite import SuiteSpec
    from kvserve.quality.thresholds import Thresholds

    if args.threads < 1:
        raise ConfigError(f"threads: must be >= 1, got {args.threads}")
    thresholds = Thresholds(
        max_recall_drop=args.max_recall_drop,
        confidence=args.confidence,
        max_ppl_increase=args.max_ppl_increase,
        min_agreement=args.min_agreement,
        max_kl=args.max_kl,
    )
    import torch

    torch.set_num_threads(args.threads)
    spec = SuiteSpec.quick() if args.quick else SuiteSpec.full() if args.full else SuiteSpec()
    if args.prompts is not None:
        spec = spec.with_prompts(args.prompts)
    if args.tasks is not None:
        spec = spec.with_tasks(tuple(t.strip() for t in args.tasks.split(",") if t.strip()))
    t0 = time.perf_counter()
    kwargs = engine_kwargs(args)
    candidates: list[dict] = [{}]
    if args.formats:
        from kvserve.kv.formats import KV_CACHE_DTYPES

        names = [f.strip() for f in args.formats.split(",") if f.strip()]
        bad = [f for f in names if f not in KV_CACHE_DTYPES]
        if bad or not names:
            allowed = ", ".join(KV_CACHE_DTYPES)
            raise ConfigError(f"formats: {', '.join(bad) or 'none given'}; choose from {allowed}")
        candidates = [{"kv_cache_dtype": f} for f in names]
    if args.retentions:
        from kvserve.sched.retention import parse_retention

        specs = [x.strip() for x in args.retentions.split(";") if x.strip()]
        if not specs:
            raise ConfigError("retentions: none given; e.g. 'window:50%;window:25%'")
        for x in specs:
            parse_retention(x)  # a clear error before the baseline runs
        candidates = [{**c, "kv_retention": x} for c in candidates for x in specs]
    reports = run_gates(
        kwargs,
        candidates,
        spec,
        thresholds,
        labels=[args.label if len(candidates) == 1 else None] * len(candidates),
        log=lambda m: print(f"[quality] {m}", file=sys.stderr, flush=True),
        on_report=lambda report: _emit(report, args, time.perf_counter() - t0),
    )
    return EXIT_CODES[overall([r["verdict"] for r in reports])]


def _emit(report: dict, args: argparse.Namespace, seconds: float) -> None:
    from kvserve.quality.report import HEATMAP_MISSING, format_table, plot_recall_heatmap, slug
    from kvserve.quality.report import write_json as write_report

    report["seconds"]["total"] = round(seconds, 2)
    report["threads"] = args.threads
    # Greedy answers differ between CPUs (their kernels sum in other orders), so reports meant
    # to be read together (kvserve tune) should come from one machine: each says which.
    from kvserve.worker.bandwidth import device_name

    report["device"] = device_name(str(args.device or "cpu"))
    name = slug(report["label"]) + ("-quick" if args.quick else "-full" if args.full else "")
    if args.tasks is not None:  # beside the whole suite's report, not over it
        name += "-" + "-".join(report["suite"]["tasks"])
    png = plot_recall_heatmap(report, args.out / f"{name}-recall.png")
    report["files"] = {"json": str(args.out / f"{name}.json"), "heatmap": png and str(png)}
    write_report(report, args.out / f"{name}.json")
    print(format_table(report))
    print(f"report: {report['files']['json']}")
    if png:
        print(f"heatmap: {png}")
    else:
        print(HEATMAP_MISSING if report["grid"]["baseline"] else "heatmap skipped: no needle grid")
    if args.json:
        print(json.dumps(report, default=str))
    sys.stdout.flush()  # each candidate's result is out before the next one's run
