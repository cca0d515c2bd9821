"""``kvserve bench`` and ``kvserve bench compare``.

Importing this module is cheap (no torch, no httpx): the CLI builds every parser at start-up.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvserve.bench.structured_spec import FORMS, parse_structured
from kvserve.bench.workloads import WORKLOADS, WorkloadSpec
from kvserve.engine_args import add_engine_args, engine_kwargs, model_arg, token_count
from kvserve.model.resolve import resolve_model

DEFAULT_OUTPUT_DIR = Path("reports") / "bench"


class _AnyWord(Mapping):
    """The subcommands' parsers by name, as argparse's choices, whose check lets any word
    through: one that names no subcommand is the model."""

    def __init__(self, parsers: dict[str, Any]) -> None:
        self.parsers = parsers

    def __getitem__(self, name: str) -> Any:
        return self.parsers[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.parsers)

    def __len__(self) -> int:
        return len(self.parsers)

    def __contains__(self, key: object) -> bool:
        return True


class ModelOrSubcommand(argparse._SubParsersAction):
    """bench's one positional: a subcommand (``compare``), or else the model, as ``--model``
    takes it (``kvserve bench smollm2``, the grammar of every command). argparse gives a
    subparsers action every word from the first positional on, so the words after the model
    are parsed again by bench's own parser."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.choices = _AnyWord(self._name_parser_map)

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: Any = None):
        if values[0] in self._name_parser_map:
            return super().__call__(parser, namespace, values, option_string)
        if getattr(namespace, "model_tag", None) is not None:
            raise argparse.ArgumentError(
                self, f"one model at most: {namespace.model_tag!r}, then {values[0]!r}"
            )
        namespace.model_tag = values[0]
        _, extra = parser.parse_known_args(values[1:], namespace)
        if extra:  # kept for the caller to refuse, as argparse keeps a subcommand's
            vars(namespace).setdefault(argparse._UNRECOGNIZED_ARGS_ATTR, []).extend(extra)


def add_bench_parser(sub: Any) -> Callable[[argparse.Namespace], int]:
    """Register ``bench`` (and ``bench compare``) on the CLI's subparsers; returns the handler."""
    p = sub.add_parser(
        "bench",
        help="benchmark an OpenAI-compatible server (--base-url) or the in-process engine",
        description="Seeded workloads under open- or closed-loop load; latency percentiles, "
        "throughput, goodput, KV metrics and cost. `kvserve bench compare A.json B.json` "
        "prints saved runs side by side.",
    )
    t = p.add_argument_group("target")
    t.add_argument(
        "--base-url",
        default=None,
        help="OpenAI-compatible server, e.g. http://127.0.0.1:8000 (default: "
        "run the engine in-process with the engine flags below)",
    )
    t.add_argument(
        "--endpoint",
        default="completions",
        choices=("completions", "chat"),
        help="/v1/completions or /v1/chat/completions",
    )
    t.add_argument(
        "--served-model-name",
        default=None,
        help="the API's model field (default: first of /v1/models)",
    )
    t.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    t.add_argument(
        "--connect-timeout", type=float, default=10.0, help="seconds to open a connection"
    )
    t.add_argument(
        "--read-timeout",
        type=float,
        default=60.0,
        help="longest wait for the next bytes of a response (a stalled server)",
    )
    t.add_argument(
        "--request-timeout",
        type=float,
        default=600.0,
        help="longest time one request may take in all",
    )
    t.add_argument(
        "--metrics-interval",
        type=float,
        default=0.5,
        help="seconds between /metrics scrapes during the run",
    )
    add_workload_args(p)
    p.add_argument_group("workload").add_argument(
        "--structured",
        type=parse_structured,
        default=None,
        metavar="SPEC",
        help=f"constrain every request's output (structured_outputs): {FORMS}; the "
        "constraint's end ends a request (ignore_eos is not sent)",
    )
    add_load_args(p)
    add_report_args(p)
    add_engine_args(p)
    p.set_defaults(model_tag=None)
    bsub = p.add_subparsers(
        dest="bench_command",
        metavar="MODEL | compare",
        action=ModelOrSubcommand,
        help="the model (as --model; for --base-url, the tokenizer's), or compare FILE...",
    )
    c = bsub.add_parser("compare", help="print saved runs side by side with ratios")
    c.add_argument("files", nargs="+", help="JSON files written by kvserve bench")
    c.add_argument("--markdown", action="store_true", help="a Markdown table")
    return cmd_bench  # fmt: skip


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """The seeded workload's flags (shared with ``kvserve simulate`` and ``tune``)."""
    w = p.add_argument_group("workload")
    w.add_argument(
        "--workload",
        default="mixed",
        help=f"one of {', '.join(WORKLOADS)}, or a .jsonl file of prompts or lengths",
    )
    w.add_argument("--num-prompts", type=int, default=64, help="requests measured")
    w.add_argument("--warmup", type=int, default=2, help="requests sent first, not measured")
    for name, kind, h in (
        ("--input-len", token_count, "unique prompt tokens (mean)"),
        ("--output-len", token_count, "output tokens (mean)"),
        ("--range-ratio", float, "lengths uniform in mean x [1-r, 1+r]"),
        ("--prefix-len", token_count, "shared prefix tokens"),
        ("--num-prefixes", int, "distinct shared prefixes (documents, system prompts)"),
        ("--prefix-share", float, "probability a request reuses a shared prefix"),
        ("--turns", int, "turns per conversation (multi-turn)"),
    ):
        w.add_argument(name, type=kind, default=None, help=f"{h} (default: per workload)")
    w.add_argument(
        "--max-active-conversations",
        type=int,
        default=1,
        help="multi-turn: conversations that take turns together (each sends turn t before "
        "any sends t+1), so their histories compete for the KV pool; 1: one at a time",
    )
    w.add_argument("--length-scale", type=float, default=1.0, help="multiply every length")
    w.add_argument("--temperature", type=float, default=0.0, help="sampling temperature")
    w.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="generate exactly the requested lengths (sent as ignore_eos)",
    )


def add_load_args(p: argparse.ArgumentParser) -> None:
    """Open- or closed-loop load flags (shared with ``kvserve simulate``)."""
    ld = p.add_argument_group("load")
    ld.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="open loop: mean requests/s (inf: all at once)",
    )
    ld.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of the gaps: 1 Poisson, <1 burstier",
    )
    ld.add_argument(
        "--concurrency",
        type=int,
        default=None,
        help="closed loop with this many users (or the in-flight cap of an open loop)",
    )
    ld.add_argument(
        "--sweep", default=None, help="rate=1,2,4 or concurrency=1,4,16: one run per value"
    )


def add_report_args(p: argparse.ArgumentParser) -> None:
    """Report flags: SLO, cost, where outputs go (shared with ``kvserve simulate``)."""
    o = p.add_argument_group("report")
    o.add_argument("--slo", default=None, help="goodput SLO, e.g. ttft=500ms,tpot=50ms,e2e=10s")
    o.add_argument("--gpu-hour-cost", type=float, default=None, help="$ per GPU-hour")
    o.add_argument("--gpus", type=int, default=1, help="GPUs the target uses (for cost)")
    o.add_argument(
        "--output-dir", default=str(DEFAULT_OUTPUT_DIR), help="where JSON, Markdown and PNGs go"
    )
    o.add_argument("--label", default=None, help="file stem of the outputs")
    o.add_argument("--no-plots", action="store_true", help="write no PNG plots")
    o.add_argument("--no-progress", action="store_true", help="print no progress on stderr")
    o.add_argument("--json", action="store_true", help="print the summary as JSON, last line")


def parse_sweep(text: str | None) -> tuple[str, list[float]] | None:
    """``rate=1,2,inf`` or ``concurrency=1,4`` -> (kind, values)."""
    if not text:
        return None
    kind, _, values = text.partition("=")
    kind = {"request-rate": "rate", "request_rate": "rate"}.get(kind.strip(), kind.strip())
    if kind not in ("rate", "concurrency") or not values:
        raise ValueError(f"sweep: expected rate=V1,V2,... or concurrency=N1,N2,..., got {text!r}")
    try:
        vals = [float(v) for v in values.split(",")]
    except ValueError:
        raise ValueError(f"sweep: values must be numbers, got {values!r}") from None
    if kind == "concurrency" and any(v < 1 or v != int(v) or math.isinf(v) for v in vals):
        raise ValueError(f"sweep: concurrencies must be integers >= 1, got {values!r}")
    return kind, vals


def load_points(args: argparse.Namespace) -> tuple[list[Any], str | None]:
    """The load of each run: one, or one per --sweep value (and the sweep's axis label)."""
    from kvserve.bench.runner import LoadSpec

    base = LoadSpec(args.request_rate, args.burstiness, args.concurrency)
    sweep = parse_sweep(args.sweep)
    if sweep is None:
        return [base], None
    kind, vals = sweep
    if kind == "rate":
        return [replace(base, request_rate=v) for v in vals], "request rate (req/s)"
    return [replace(base, concurrency=int(v)) for v in vals], "concurrency"


def workload_spec(args: argparse.Namespace, seed: int, max_model_len: int | None) -> WorkloadSpec:
    """The workload the flags describe; unset length flags keep each workload's defaults."""
    return WorkloadSpec(
        name=args.workload,
        num_prompts=args.num_prompts,
        seed=seed,
        input_len=args.input_len,
        output_len=args.output_len,
        range_ratio=args.range_ratio,
        prefix_len=args.prefix_len,
        num_prefixes=args.num_prefixes,
        prefix_share=args.prefix_share,
        turns=args.turns,
        max_active_conversations=args.max_active_conversations,
        length_scale=args.length_scale,
        max_model_len=max_model_len,
    )


def _ignore_eos(args: argparse.Namespace) -> bool:
    """A constrained request ends where its grammar does (the engine stops it there even under
    ignore_eos); the flag is not sent, so the request reads as the user's would."""
    return args.ignore_eos and not args.structured


def _target(args: argparse.Namespace) -> tuple[Any, Callable[[str], int] | None, int | None]:
    """(target, token counter, max model length) for --base-url or the in-process engine."""
    if args.base_url:
        from kvserve.bench.client import HTTPTarget

        count = None
        model = model_arg(args)
        tok_dir = args.tokenizer or (resolve_model(model) if model else None)
        if tok_dir and (Path(tok_dir) / "tokenizer.json").exists():
            from kvserve.model.tokenizer import Tokenizer

            tok = Tokenizer(tok_dir)
            count = lambda s: len(tok.encode(s))  # noqa: E731
        target = HTTPTarget(
            args.base_url, args.served_model_name, args.endpoint, args.connect_timeout,
            args.read_timeout, args.request_timeout, args.temperature, _ignore_eos(args),
            args.api_key, {"structured_outputs": args.structured} if args.structured else None,
        )  # fmt: skip
        return target, count, args.max_model_len
    from kvserve.bench.engine_target import EngineTarget

    target = EngineTarget.from_kwargs(
        engine_kwargs(args), temperature=args.temperature, ignore_eos=_ignore_eos(args),
        request_timeout=args.request_timeout, structured=args.structured,
    )  # fmt: skip
    eng = target.engine
    target.label = (
        f"in-process {Path(eng.config.model).name} (kv {eng.kv_cache_dtype}, prefix caching "
        f"{'on' if eng.config.cache.enable_prefix_caching else 'off'}, {eng.num_blocks} blocks"
        + (f", kv retention {eng.retention.text()} (lossy)" if eng.retention else "")
        + ")"
    )
    count = (lambda s: len(eng.tokenizer.encode(s))) if eng.tokenizer else None
    return target, count, eng.max_model_len


def cmd_compare(args: argparse.Namespace) -> int:
    from kvserve.bench.report import compare_table, load_summary

    named = [pair for f in args.files for pair in load_summary(f)]
    print(compare_table(named, markdown=args.markdown))
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    """Run the benchmark (one point, or one per sweep value), print the table, write JSON,
    Markdown and plots under --output-dir; exit 1 only when no request succeeded at all."""
    if args.bench_command == "compare":
        return cmd_compare(args)
    from kvserve.bench.metrics import parse_slo
    from kvserve.bench.report import (
        PLOTS_MISSING,
        compare_table,
        console_table,
        markdown,
        plot_latency_cdf,
        plot_sweep,
        write_json,
    )
    from kvserve.bench.runner import benchmark
    from kvserve.bench.workloads import make_workload

    slo = parse_slo(args.slo)
    loads, sweep_label = load_points(args)
    target, count, max_len = _target(args)
    workloads = [
        make_workload(workload_spec(args, args.seed + i, max_len), count) for i in range(len(loads))
    ]
    warm = make_workload(
        replace(workload_spec(args, args.seed + 7919, max_len), num_prompts=args.warmup), count
    ) if args.warmup > 0 else None  # fmt: skip
    points = asyncio.run(
        benchmark(target, workloads, loads, args.seed, warm, slo, args.gpu_hour_cost, args.gpus,
                  not args.no_progress, args.metrics_interval)
    )  # fmt: skip
    kind = "http" if args.base_url else "engine"
    label = args.label or f"{Path(args.workload).stem}-{kind}-{time.strftime('%Y%m%d-%H%M%S')}"
    out_dir = Path(args.output_dir)
    for p in points:
        p.summary.update(
            label=label,
            workload=args.workload,
            num_prompts=args.num_prompts,
            structured=next(iter(args.structured)) if args.structured else None,
        )
    plots: list[str] = []
    if sweep_label is None:
        s = points[0].summary
        payload = {"summary": s, "records": [r.to_dict() for r in points[0].records]}
        print(console_table(s))
        if not args.no_plots:
            path = plot_latency_cdf({label: points[0].records}, out_dir / f"{label}-latency.png")
            plots += [str(path)] if path else []
        final: dict[str, Any] = s
    else:
        for p in points:
            p.summary["sweep_value"] = (
                p.load.concurrency if sweep_label == "concurrency" else p.load.request_rate
            )
        sums = [p.summary for p in points]
        payload = {"sweep": sums, "sweep_by": sweep_label,
                   "records": [[r.to_dict() for r in p.records] for p in points]}  # fmt: skip
        short = "rate" if sweep_label.startswith("request rate") else "concurrency"
        print(compare_table([(f"{short}={p.summary['sweep_value']:g}", p.summary)
                             for p in points]))  # fmt: skip
        if not args.no_plots:
            path = plot_sweep(sums, sweep_label, out_dir / f"{label}-sweep.png")
            plots += [str(path)] if path else []
            path = plot_latency_cdf(
                {f"{p.summary['sweep_value']:g}": p.records for p in points},
                out_dir / f"{label}-latency.png",
            )
            plots += [str(path)] if path else []
        final = {"label": label, "sweep_by": sweep_label, "sweep": sums}
    json_path = write_json(out_dir / f"{label}.json", payload)
    md = "\n\n".join(markdown(p.summary, plots if i == 0 else None) for i, p in enumerate(points))
    md_path = out_dir / f"{label}.md"
    md_path.write_text(md)
    if not args.no_plots and not plots:
        print(PLOTS_MISSING, file=sys.stderr)
    print(f"wrote {json_path}, {md_path}" + "".join(f", {p}" for p in plots))
    if args.json:
        print(json.dumps(final, default=str))
    # Failures are results, reported above; only a run where nothing succeeded is an error.
    return 1 if all(p.summary["completed"] == 0 for p in points) else 0
