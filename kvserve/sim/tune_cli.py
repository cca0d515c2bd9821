"""``kvserve tune``: the command around :func:`kvserve.sim.tune.tune` (the descent) and
:mod:`kvserve.sim.space` (what it searches): the space it was asked for, a progress line per
configuration, the ranking, and the winner as a command or, when it cannot start as it is, a
plan.

Importing this module is cheap (no torch): the CLI builds every parser at start-up.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvserve.bench.cli import add_load_args, add_report_args, add_workload_args, workload_spec
from kvserve.engine_args import add_engine_args, add_model_arg
from kvserve.sim.cli import add_sim_target_args, sim_engine_kwargs, sim_jobs, sim_target


def add_tune_parser(sub: Any) -> Callable[[argparse.Namespace], int]:
    from kvserve.sim.space import DIMENSIONS, default_space, describe_space

    p = sub.add_parser(
        "tune",
        help="the configuration with the lowest $ per useful output token under an SLO",
        description="Simulates the workload under each configuration of a search space and "
        "ranks them by cost per output token of requests that met --slo. It searches the "
        "dimensions --search names, exactly; with no --search (or with --default-space) it "
        f"adds the default space ({describe_space(default_space())}) and names it in its "
        "output. Lossy settings compete only with a passing `kvserve quality --json` report "
        "(--quality-report).",
    )
    add_sim_target_args(p)
    s = p.add_argument_group("search")
    s.add_argument(
        "--search",
        action="append",
        default=None,
        metavar="NAME=V1,V2",
        help="values of one dimension (repeatable; the first value is where the search "
        f"starts): {', '.join(DIMENSIONS)}; kv_offload_cpu takes sizes or off",
    )
    s.add_argument(
        "--default-space",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also search the default space's dimensions that --search does not name, each "
        "from the engine's default; a dimension whose flag you set (--block-size 32, --tp 2) "
        "keeps your value (default: on when no --search is given)",
    )
    s.add_argument(
        "--quality-report",
        action="append",
        default=None,
        metavar="FILE",
        help="a `kvserve quality --json` report for this model (repeatable)",
    )
    s.add_argument(
        "--quality-accept-inconclusive",
        action="store_true",
        help="let a lossy setting whose quality report says INCONCLUSIVE compete (by default "
        "only PASS does)",
    )
    s.add_argument("--top", type=int, default=5, help="configurations to print")
    s.add_argument(
        "--max-passes",
        type=int,
        default=3,
        help="passes of the coordinate descent at most (it stops when one changes nothing)",
    )
    add_workload_args(p)
    add_load_args(p)
    add_report_args(p)
    p.set_defaults(output_dir=str(Path("reports") / "tune"))
    add_model_arg(p, "the model, as --model takes it, or a bare config.json (no weights "
                  "needed); give one or the other")  # fmt: skip
    add_engine_args(p)
    return cmd_tune


def tune_space(
    args: argparse.Namespace, kw: dict[str, Any]
) -> tuple[dict[str, tuple[Any, ...]], list[str]]:
    """The space to search: what --search asks, plus (with no --search, or --default-space)
    the default space's other dimensions but those whose flag the user set; and the names of
    the dimensions added by default."""
    from kvserve.config import EngineConfig
    from kvserve.config_fields import default_of
    from kvserve.sim.space import default_space, parse_search

    space = parse_search(args.search)
    add_defaults = args.default_space if args.default_space is not None else not space
    if not add_defaults:
        if not space:
            raise ValueError("search: nothing to search; give --search NAME=V1,V2 or drop "
                             "--no-default-space")  # fmt: skip
        return space, []
    pinned = {n for n in ("tp", "replicas") if getattr(args, n) != 1}
    pinned |= {n for n in default_space() if n in kw and kw[n] != default_of(EngineConfig, n)}
    added = {k: v for k, v in default_space(pinned).items() if k not in space}
    return {**space, **added}, list(added)


def tune_progress(space: dict[str, tuple[Any, ...]], enabled: bool) -> Callable[[Any], None]:
    """A line on stderr per configuration tried, counted against the first pass's size."""
    from kvserve.sim.space import first_pass_size

    first = first_pass_size(space)
    start = {k: v[0] for k, v in space.items()}
    count = 0

    def on_trial(t: Any) -> None:
        nonlocal count
        count += 1
        if not enabled:
            return
        where = f"{count}/{first} (first pass)" if count <= first else f"{count} (a later pass)"
        if t.excluded:
            result = f"excluded: {t.excluded}"
        elif t.useful_tokens:
            result = (f"${t.usd_per_million_useful:.4g} per million useful tokens, SLO met by "
                      f"{t.attainment:.0%}")  # fmt: skip
        else:
            result = f"no request met the SLO ({t.attainment:.0%})"
        print(f"tune: configuration {where}: {t.label(start)}: {result}", file=sys.stderr,
              flush=True)  # fmt: skip

    return on_trial


def cmd_tune(args: argparse.Namespace) -> int:
    from kvserve.bench.metrics import parse_slo
    from kvserve.bench.runner import LoadSpec
    from kvserve.bench.workloads import make_workload
    from kvserve.sim.engine import SimTarget
    from kvserve.sim.space import describe_space, first_pass_size
    from kvserve.sim.tune import (
        QualityGate,
        plot_pareto,
        recommendation,
        serve_command,
        slo_miss,
        tune,
        why_lost,
        why_not_runnable,
    )
    from kvserve.sim.workload import token_counter

    kw = sim_engine_kwargs(args)
    slo = parse_slo(args.slo)
    if args.gpu_hour_cost is None:
        raise ValueError("gpu_hour_cost: tune ranks by $ per useful token; give --gpu-hour-cost")
    if args.sweep:
        raise ValueError("sweep: tune searches one load; give --request-rate or --concurrency")
    space, added = tune_space(args, kw)
    gate = QualityGate.load(
        args.quality_report or [], kw["model"], args.quality_accept_inconclusive
    )

    def router_processes(replicas: int) -> int:
        # Only two or more replicas have a router in front: a candidate of one has none,
        # whatever --router-processes says.
        return args.router_processes if replicas > 1 else 0

    base = sim_target(
        argparse.Namespace(**{**vars(args), "router_processes": router_processes(args.replicas)}),
        kw,
    )

    def make_target(
        engine: dict[str, Any], tp: int, replicas: int, router: str = "round_robin"
    ) -> SimTarget:
        # A dimension not searched is the flag's: --tp, --replicas and --router.
        tp = tp if "tp" in space else args.tp
        replicas = replicas if "replicas" in space else args.replicas
        router = router if "router" in space else args.router
        return SimTarget(engine, base.profile, base.gpu, tp, replicas,
                         args.gpu_memory_utilization, router=router,
                         overlap_weight=base.overlap_weight,
                         router_processes=router_processes(replicas))  # fmt: skip

    count, max_len = token_counter(base)
    reqs = make_workload(workload_spec(args, args.seed, max_len), count)
    load = LoadSpec(args.request_rate, args.burstiness, args.concurrency)
    asked = {k: v for k, v in space.items() if k not in added}
    print(f"kvserve tune: searching {describe_space(asked) or 'nothing asked'}"
          + (f"; added by default: {describe_space({k: space[k] for k in added})} "
             "(--no-default-space leaves them out)" if added else "")
          + f"; {first_pass_size(space)} configurations in the first pass")  # fmt: skip
    t0 = time.perf_counter()
    jobs = sim_jobs(args)
    res = tune(kw, make_target, reqs, load, args.seed, space, slo, args.gpu_hour_cost, gate,
               args.max_passes, tune_progress(space, not args.no_progress), jobs)  # fmt: skip
    wall = time.perf_counter() - t0
    ranked = res.eligible
    print(
        f"kvserve tune: {Path(kw['model']).name} on {base.profile.device}, {args.workload} "
        f"({len(reqs)} requests, {load.describe()}), SLO {args.slo}, "
        f"${args.gpu_hour_cost:g}/GPU-hour: {len(res.trials)} configurations in {wall:.1f}s"
    )
    rows = []
    for i, t in enumerate(ranked[: args.top], 1):
        s = t.summary or {}
        rows.append(
            f"{i:>2}  {t.usd_per_million_useful:>12.4g}  {t.attainment:>6.1%}  "
            f"{(s.get('ttft_ms') or {}).get('p95') or 0:>9.1f}  "
            f"{(s.get('tpot_ms') or {}).get('p95') or 0:>9.1f}  {t.gpus:>4}  "
            f"{t.label(res.baseline)}"
        )
    print("rank  $/M useful tok  SLO met  TTFT p95  TPOT p95  GPUs  configuration")
    print("\n".join(rows) if rows else "  (none)")
    best = res.best
    others = [t for t in res.trials if t is not best]
    if others:
        print("\nwhy the others lost:")
        for t in sorted(others, key=lambda t: t.usd_per_million_useful):
            reason = why_lost(t, best, slo) if best else (t.excluded or slo_miss(t, slo))
            print(f"  {t.label(res.baseline)}: {reason}")
    out_dir = Path(args.output_dir)
    label = args.label or f"tune-{time.strftime('%Y%m%d-%H%M%S')}"
    payload = {
        "model": kw["model"], "device": base.profile.device, "slo": slo,
        "gpu_hour_cost": args.gpu_hour_cost, "workload": args.workload,
        "load": load.describe(), "seed": args.seed, "space": {k: list(v) for k, v in space.items()},
        "space_added_by_default": added,
        "trials": [
            {"settings": t.settings, "excluded": t.excluded, "gpus": t.gpus,
             "usd_per_million_useful": None if t.usd_per_million_useful == float("inf")
             else t.usd_per_million_useful, "useful_tokens": t.useful_tokens,
             "cost_usd": t.cost_usd, "summary": t.summary}
            for t in res.trials
        ],
        "best": best.settings if best else None,
        "recommendation": None if best is None else {
            "serve": serve_command(kw["model"], best.settings, args.tp),
            "cannot_start": why_not_runnable(kw["model"], best.settings),
        },
    }  # fmt: skip
    from kvserve.bench.report import write_json

    path = write_json(out_dir / f"{label}.json", payload)
    written = [str(path)]
    if not args.no_plots:
        png = plot_pareto(res, out_dir / f"{label}-pareto.png")
        if png:
            written.append(str(png))
    if best is None:
        near = sorted((t for t in res.trials if t.summary), key=lambda t: -t.attainment)[:3]
        print(f"\nkvserve tune: no configuration meets the SLO {args.slo}; the closest:",
              file=sys.stderr)  # fmt: skip
        for t in near:
            print(f"  {t.label(res.baseline)}: {slo_miss(t, slo)}", file=sys.stderr)
        if not near:
            print("  (none ran: every configuration was excluded, see above)", file=sys.stderr)
        print(f"wrote {', '.join(written)}")
        return 1
    print(f"\nbest: {best.label(res.baseline)}: ${best.usd_per_million_useful:.4g} per million "
          f"useful output tokens, {best.attainment:.0%} of requests within the SLO")  # fmt: skip
    print(recommendation(kw["model"], best.settings, args.tp))
    if best.settings.get("kv_retention") and not base.profile.per_solo_seq_s:
        print("note: this profile has no measured cost for a retention policy's per-sequence "
              "attention (calibrate with the policy on: kvserve simulate --calibrate "
              "--kv-retention SPEC); the winner's time may be optimistic")  # fmt: skip
    print(f"wrote {', '.join(written)}")
    if args.json:
        best_json = {"best": best.settings, "usd_per_million_useful": best.usd_per_million_useful}
        print(json.dumps(best_json, default=str))
    return 0
