"""``kvserve simulate`` (and what ``kvserve tune``, :mod:`kvserve.sim.tune_cli`, shares with it).

Importing this module is cheap (no torch): the CLI builds every parser at start-up.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvserve.bench.cli import (
    add_load_args,
    add_report_args,
    add_workload_args,
    load_points,
    workload_spec,
)
from kvserve.bench.forks import can_fork, fork_call, fork_map
from kvserve.engine_args import (
    add_engine_args,
    add_model_arg,
    default_model,
    engine_kwargs,
    model_arg,
)
from kvserve.kernels.openmp import usable_cpus
from kvserve.router.policies import DEFAULT_OVERLAP_WEIGHT
from kvserve.sim.fleet import SIM_POLICIES

DEFAULT_SIM_DIR = Path("reports") / "sim"
ROLE_FLAGS = ("prefill_replicas", "decode_replicas", "kv_transfer_bandwidth")
# A router process with more than this share of a core's work is noted: its queue grows.
ROUTER_BUSY_NOTE = 0.9


def add_sim_target_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("simulated device")
    g.add_argument(
        "--gpu",
        default=None,
        help="accelerator from the planner's table (kvserve plan --list-gpus) or "
        "custom:MEM_GIB:BW_TBS:BF16_TFLOPS: its memory sizes the pool and, without "
        "--profile, its shipped profile times the steps",
    )
    g.add_argument(
        "--profile",
        default=None,
        help="cost-model profile JSON (from --calibrate, or a shipped GPU's)",
    )
    g.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel GPUs per replica (as --tensor-parallel-size)")  # fmt: skip
    g.add_argument("--replicas", type=int, default=1, help="engine replicas behind a balancer")
    g.add_argument("--router", default="round_robin", choices=SIM_POLICIES,
                   help="how requests are dealt to the replicas: a kvserve router policy, or "
                   "oracle (each replica's cache asked directly)")  # fmt: skip
    g.add_argument("--overlap-weight", type=float, default=DEFAULT_OVERLAP_WEIGHT,
                   help="the prefix policies' and the oracle's weight of the prompt blocks a "
                   "replica must compute, as kvserve router's (default: %(default)s)")  # fmt: skip
    g.add_argument("--router-processes", type=int, default=0, metavar="N",
                   help="kvserve router's own processes on cores of their own, the requests "
                   "dealt among them: each request waits for its process, which costs the "
                   "profile's hop terms (default: 0, the router's work charged to the "
                   "replicas' cores, as on one host)")  # fmt: skip
    g.add_argument(
        "--jobs",
        type=int,
        default=None,
        help="simulations run at once, each in its own process: tune's candidates, "
        "simulate's --sweep points, or else its --replicas; also the processes that encode a "
        "long run's JSON records (default: the CPUs this process may use); the results do "
        "not depend on it",
    )


def add_simulate_parser(sub: Any) -> Callable[[argparse.Namespace], int]:
    p = sub.add_parser(
        "simulate",
        help="the engine's scheduler and KV manager on a cost model: bench's report, no GPU",
        description="Replays a kvserve bench workload (same flags, same seeds) through the real "
        "scheduler and KV manager with a cost model for each step and a virtual clock. "
        "--calibrate runs the real engine on this machine and fits the model's factors.",
    )
    add_sim_target_args(p)
    d = p.add_argument_group("disaggregated prefill/decode (kvserve proxy over prefill and "
                             "decode engines)")  # fmt: skip
    d.add_argument("--prefill-replicas", type=int, default=0,
                   help="prefill engines: each request's prompt runs on one (its first token "
                   "too), then decodes on a decode engine; 0 (default): colocated replicas "
                   "(--replicas)")  # fmt: skip
    d.add_argument("--decode-replicas", type=int, default=0,
                   help="decode engines, which pull each prompt's KV blocks their prefix "
                   "cache lacks; give with --prefill-replicas")  # fmt: skip
    d.add_argument("--kv-transfer-bandwidth", type=float, default=None,
                   help="bytes/s of a decode engine's pulls (one at a time), in the pool's KV "
                   "format; measure it with benchmarks/pd.py (transfer_gbps)")  # fmt: skip
    c = p.add_argument_group("calibration")
    c.add_argument(
        "--calibrate",
        action="store_true",
        help="run the real engine on the workload, fit the cost model, write --profile-output",
    )
    c.add_argument(
        "--serving",
        action="store_true",
        help="with --calibrate: also measure what serving over HTTP costs (a real kvserve "
        "serve of the same engine and streaming clients, then kvserve router in front of it) "
        "and write it into the profile as its serving-overhead terms",
    )
    c.add_argument(
        "--profile-output",
        default=None,
        help=f"where --calibrate writes (JSON; default: {DEFAULT_SIM_DIR / 'profile.json'})",
    )
    add_workload_args(p)
    add_load_args(p)
    add_report_args(p)
    p.set_defaults(output_dir=str(DEFAULT_SIM_DIR))
    add_model_arg(p, "the model, as --model takes it, or a bare config.json (no weights "
                  "needed); give one or the other")  # fmt: skip
    add_engine_args(p)
    return cmd_simulate


def sim_engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """Engine flags as ``LLM`` keyword arguments; a bare ``config.json`` is a model here."""
    from kvserve.sim.engine import model_dir_of

    model = model_arg(args)
    if not model:
        return {**engine_kwargs(args), "model": default_model()}
    # A bare config.json is no model name the resolver knows: resolve its directory.
    given = {**vars(args), "model": model_dir_of(model), "model_tag": None}
    return engine_kwargs(argparse.Namespace(**given))


def model_name(given: str | None, resolved: str) -> str:
    """The model as the user named it: a name, a directory's name, a config's directory."""
    p = Path(given or resolved)
    return p.parent.name if p.suffix == ".json" else p.name


def sim_target(args: argparse.Namespace, kw: dict[str, Any]) -> Any:
    from kvserve.plan.gpus import GPUS, get_gpu
    from kvserve.sim.cost import Profile, gpu_profile
    from kvserve.sim.engine import SimTarget

    gpu = get_gpu(args.gpu) if args.gpu else None
    if args.profile:
        profile = Profile.load(args.profile)
        if gpu is None:
            # A shipped GPU profile saved and edited (a what-if): its device sizes the pool as
            # --gpu would, instead of the engine's default CPU pool.
            gpu = next((g for g in GPUS.values() if g.name == profile.device), None)
    elif gpu is not None:
        profile = gpu_profile(gpu)
    else:
        raise ValueError(
            "profile: give --gpu NAME (its shipped profile) or --profile FILE (written by "
            "kvserve simulate --calibrate on the machine to model)"
        )
    tp, given = args.tp, kw.get("tensor_parallel_size", 1)
    if tp > 1 and given > 1 and tp != given:
        raise ValueError(f"tp: --tp {tp} and --tensor-parallel-size {given} disagree")
    tp = max(tp, given)
    kw["tensor_parallel_size"] = tp  # the engine checks the model splits over tp ranks
    roles = {k: getattr(args, k) for k in ROLE_FLAGS if hasattr(args, k)}  # simulate's own
    return SimTarget(kw, profile, gpu, tp, args.replicas, args.gpu_memory_utilization,
                     router=args.router,
                     overlap_weight=getattr(args, "overlap_weight", DEFAULT_OVERLAP_WEIGHT),
                     router_processes=getattr(args, "router_processes", 0),
                     **roles)  # fmt: skip


def _calibrate(args: argparse.Namespace, kw: dict[str, Any]) -> int:
    from kvserve.bench.engine_target import EngineTarget
    from kvserve.bench.workloads import make_workload
    from kvserve.sim.calibrate import calibrate
    from kvserve.sim.cost import EFFICIENCY_FIELDS, UNSEEN

    target = EngineTarget.from_kwargs(kw, temperature=0.0, ignore_eos=True)
    tok = target.engine.tokenizer  # the real run's tokenizer and context count the workload
    count = (lambda s: len(tok.encode(s))) if tok else None
    max_len = target.engine.max_model_len
    loads, _ = load_points(args)  # --sweep rate=inf,8: one calibration run per load
    runs = [
        (make_workload(workload_spec(args, args.seed + i, max_len), count), load)
        for i, load in enumerate(loads)
    ]
    warm = make_workload(
        replace(workload_spec(args, args.seed + 7919, max_len), num_prompts=2), count
    )
    profile, report = calibrate(target, runs, args.seed, warm)
    if args.serving:
        from kvserve.sim.serving import measure_serving

        vocab = target.engine.model_config.vocab_size
        config = target.engine.config
        tok_dir = config.tokenizer or config.model
        target.engine.shutdown()  # its threads and pool off the cores the server takes
        measure_serving(kw, profile, vocab, args.seed, tokenizer=tok, tokenizer_dir=tok_dir,
                        max_model_len=max_len)  # fmt: skip
        print(
            f"serving over HTTP: {profile.serve_request_s * 1e3:.2f} ms per request, "
            f"{profile.serve_step_s * 1e3:.2f} ms per step + {profile.serve_token_s * 1e3:.3f} "
            f"ms per streamed token; a router/proxy hop {profile.hop_request_s * 1e3:.2f} ms "
            f"per request + {profile.hop_request_token_s * 1e6:.2f} us per prompt token + "
            f"{profile.hop_token_s * 1e3:.3f} ms per token"
        )
    out = Path(args.profile_output or DEFAULT_SIM_DIR / "profile.json")
    profile.save(out)
    print(
        f"calibrated on {report.steps} steps of {Path(kw['model']).name} ({profile.dtype}) on "
        f"{profile.device}: per-step error median {report.median_abs_error:.1%}, p90 "
        f"{report.p90_abs_error:.1%}, summed time {report.total_time_error:+.1%}"
    )
    unseen = [f for f in EFFICIENCY_FIELDS if getattr(profile, f) == UNSEEN]
    if unseen:
        print(f"too cheap to measure in these runs (their time is taken as zero): "
              f"{', '.join(unseen)} = {UNSEEN:g}")  # fmt: skip
    print(f"wrote {out}")
    return 0


def sim_jobs(args: argparse.Namespace) -> int:
    """--jobs, or the CPUs this process may use."""
    if args.jobs is None:
        return usable_cpus()
    if args.jobs < 1:
        raise ValueError(f"jobs: must be an integer >= 1, got {args.jobs}")
    return int(args.jobs)


def cmd_simulate(args: argparse.Namespace) -> int:
    """One simulated run (or one per --sweep value, each its own draw of the workload as in
    bench); prints bench's table, writes JSON, Markdown and plots under --output-dir."""
    from kvserve.bench.metrics import parse_slo, server_summary, summarize
    from kvserve.bench.report import (
        RecordEncoder,
        compare_table,
        console_table,
        markdown,
        plot_latency_cdf,
        plot_sweep,
        write_json,
    )
    from kvserve.bench.runner import Progress
    from kvserve.bench.workloads import make_workload
    from kvserve.sim.simulate import simulate_load
    from kvserve.sim.workload import stream_workload, token_counter

    kw = sim_engine_kwargs(args)
    if args.calibrate:
        return _calibrate(args, kw)
    if args.serving:
        raise ValueError("serving: measures the serving-overhead terms during --calibrate; "
                         "give it with --calibrate")  # fmt: skip
    slo = parse_slo(args.slo)
    target = sim_target(args, kw)
    count, max_len = token_counter(target)
    loads, sweep_label = load_points(args)
    warm = (
        make_workload(
            replace(workload_spec(args, args.seed + 7919, max_len), num_prompts=args.warmup),
            count,
        )
        if args.warmup > 0
        else None
    )
    gpus = target.gpus if target.gpu is not None else args.gpus
    label = args.label or f"{Path(args.workload).stem}-sim-{time.strftime('%Y%m%d-%H%M%S')}"
    jobs = sim_jobs(args)
    out_dir = Path(args.output_dir)
    side_by_side = jobs > 1 and len(loads) > 1  # progress bars would interleave

    def point(item: tuple[int, Any]) -> tuple[dict[str, Any], list[Any], float]:
        i, load = item
        spec = workload_spec(args, args.seed + i, max_len)
        # A spare core makes (and tokenizes) a lone replica's requests while it replays,
        # and encodes its records for the JSON file as they finish.
        streamed = (jobs > 1 and not side_by_side and target.replicas == 1
                    and not target.disaggregated and can_fork())  # fmt: skip
        reqs = stream_workload(target, spec) if streamed else make_workload(spec, count)
        if streamed and sweep_label is None:
            encoders.append(RecordEncoder(out_dir))
        bar = Progress(len(reqs), f"simulate {load.describe()}",
                       enabled=not args.no_progress and not side_by_side)  # fmt: skip
        t0 = time.perf_counter()
        res, sims = simulate_load(
            target, reqs, load, args.seed + i, warm if i == 0 else None, args.temperature,
            0.5, progress=lambda ok, bar=bar: bar.update(ok),
            jobs=1 if side_by_side else jobs,  # replicas side by side unless points are
            records_to=encoders[0] if encoders else None,
        )  # fmt: skip
        wall = time.perf_counter() - t0
        # The replay's records and engine outlive the summary: the collector, back on, would
        # walk their millions of objects while the summary allocates.
        gc.freeze()
        if encoders and not args.no_plots:  # drawn beside the summary, on the spare core
            plotting.append(fork_call(
                lambda: plot_latency_cdf({label: res.records}, out_dir / f"{label}-latency.png")
            ))  # fmt: skip
        s = summarize(res.records, res.duration, slo, args.gpu_hour_cost, gpus)
        s["server"] = server_summary(res.before, res.after, res.samples)
        sim = sims[0]
        s["target"] = (
            f"simulated {model_name(model_arg(args), kw['model'])} on {target.profile.device}"
            + (f" (pool of {target.gpu.name})" if target.gpu else "")
            + f", tp {target.tp}, "
            + (
                f"{target.prefill_replicas} prefill + {target.decode_replicas} decode replica(s) "
                f"pulling at {target.kv_transfer_bandwidth / 1e9:g} GB/s"
                if target.disaggregated
                else f"{target.replicas} replica(s)"
            )
            + f", {sim.num_blocks} blocks each"
            + (f", routed by {target.router}" if target.replicas > 1 else "")
        )
        s["load"] = load.describe()
        s["seed"] = args.seed + i
        busy = sim.router.busy() if sim.router else None
        if busy and max(busy) >= ROUTER_BUSY_NOTE:
            sim.notes.append(
                f"a router process had {max(busy):.0%} of a core's work while the requests "
                "were sent: requests queue in front of it; give --router-processes more"
            )
        s["simulation"] = {
            "profile": target.profile.to_json(),
            "gpu": target.gpu.key if target.gpu else None,
            "tp": target.tp,
            "replicas": target.replicas,
            "router": target.router,
            "overlap_weight": target.overlap_weight,
            "router_processes": target.router_processes,
            "router_busy": busy,
            "prefill_replicas": target.prefill_replicas,
            "decode_replicas": target.decode_replicas,
            "kv_transfer_bandwidth": target.kv_transfer_bandwidth,
            "num_blocks": sim.num_blocks,
            "steps": sum(x.runner.steps for x in sims),
            "busy_s": sum(x.runner.busy_s for x in sims),
            "wall_s": wall,
            "notes": sim.notes,
        }
        s.update(label=label, workload=args.workload, num_prompts=args.num_prompts)
        if sweep_label is not None:
            s["sweep_value"] = load.concurrency if sweep_label == "concurrency" else (
                load.request_rate
            )  # fmt: skip
        return s, res.records, wall

    if side_by_side and not args.no_progress:
        print(f"simulating {len(loads)} sweep points, {min(jobs, len(loads))} at a time",
              file=sys.stderr)  # fmt: skip
    encoders: list[RecordEncoder] = []  # a lone run's, streamed
    plotting: list[Callable[[], Path | None]] = []  # its latency plot, being drawn
    started = time.perf_counter()
    try:
        points = fork_map(point, list(enumerate(loads)), jobs)
    except BaseException:
        for enc in encoders:
            enc.close()
        raise
    took = time.perf_counter() - started  # points side by side: not the sum of their walls
    # What exists now outlives the reports: keep the collector from rescanning it while they
    # allocate (a long trace's records are millions of objects).
    gc.freeze()
    try:
        notes = points[0][0]["simulation"]["notes"]
        plots: list[str] = []
        if sweep_label is None:
            s, records, wall = points[0]
            print(console_table(s))
            rows = encoders[0].finish() if encoders else [r.to_dict() for r in records]
            payload: dict[str, Any] = {"summary": s, "records": rows}
            if not args.no_plots:
                png = (
                    plotting[0]()
                    if plotting
                    else plot_latency_cdf({label: records}, out_dir / f"{label}-latency.png")
                )
                plots += [str(png)] if png else []
            final: dict[str, Any] = s
        else:
            sums = [p[0] for p in points]
            short = "rate" if sweep_label.startswith("request rate") else "concurrency"
            print(compare_table([(f"{short}={x['sweep_value']:g}", x) for x in sums]))
            payload = {"sweep": sums, "sweep_by": sweep_label,
                       "records": [[r.to_dict() for r in p[1]] for p in points]}  # fmt: skip
            if not args.no_plots:
                png = plot_sweep(sums, sweep_label, out_dir / f"{label}-sweep.png")
                plots += [str(png)] if png else []
            final = {"label": label, "sweep_by": sweep_label, "sweep": sums}
        for note in notes:
            print(f"note: {note}", file=sys.stderr)
        json_path = write_json(out_dir / f"{label}.json", payload, jobs)
        md_path = out_dir / f"{label}.md"
        md_path.write_text("\n\n".join(markdown(p[0], plots if i == 0 else None)
                                        for i, p in enumerate(points)))  # fmt: skip
        n = sum(len(p[1]) for p in points)
        print(f"simulated {n} requests in {took:.1f}s; wrote {json_path}, {md_path}"
              + "".join(f", {x}" for x in plots))  # fmt: skip
        if args.json:
            print(json.dumps(final, default=str))
        return 0
    finally:
        gc.unfreeze()
        for enc in encoders:
            enc.close()
