"""How long ``kvserve simulate`` takes, phase by phase, against a baseline commit in the same run.

    python -m benchmarks.simulate_speed --num-prompts 10000 --baseline HEAD~3 --rounds 3

Each round runs every tree once, alternating (this tree, then the baseline checked out in a
temporary git worktree), each in a fresh process that times the phases of one simulation the
way ``kvserve simulate`` runs them: making the workload (text and token counts), the replay
(the real scheduler and KV manager on the cost model), the summary, the JSON file and the
latency plot. Where the tree can, and the machine has a spare core, the workload is made and
the records are encoded in other processes while the replay runs, as the command does: the
workload's phase then only starts them, and the JSON's copies the encoded records in. The
table gives each phase's median over rounds and this tree's ratio to the baseline. The
default case is the seed's: Llama-3-8B shapes on an H100, chat at 40 requests/s.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from inspect import signature
from pathlib import Path

from benchmarks.common import emit, median, table

ROOT = Path(__file__).resolve().parent.parent
PHASES = ("workload", "replay", "summary", "json", "plot", "total")
LLAMA_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "vocab_size": 128256, "intermediate_size": 14336,
    "max_position_embeddings": 131072, "torch_dtype": "bfloat16", "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0, "tie_word_embeddings": False, "eos_token_id": 128001,
}  # fmt: skip


def one_run(model: str, workload: str, n: int, rate: float, out_dir: str) -> dict[str, float]:
    """Phase times of one simulation in this process (imports not counted)."""
    from kvserve.bench.metrics import summarize
    from kvserve.bench.report import plot_latency_cdf, write_json
    from kvserve.bench.runner import LoadSpec
    from kvserve.bench.workloads import WorkloadSpec, make_workload
    from kvserve.plan.gpus import get_gpu
    from kvserve.sim.cost import gpu_profile
    from kvserve.sim.engine import SimTarget
    from kvserve.sim.simulate import simulate_load
    from kvserve.sim.workload import token_counter

    gpu = get_gpu("h100-sxm")
    target = SimTarget({"model": model}, gpu_profile(gpu), gpu)
    t: dict[str, float] = {}
    start = clock = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        t[name], clock = now - clock, now

    jobs = len(os.sched_getaffinity(0))
    count, max_len = token_counter(target)
    spec = WorkloadSpec(workload, n, 0, max_model_len=max_len)
    # As the command does with a spare core, where this tree can: the workload made, and the
    # records encoded, in other processes while the replay runs.
    streams = jobs > 1 and "records_to" in signature(simulate_load).parameters
    if streams:
        from kvserve.bench.report import RecordEncoder
        from kvserve.sim.workload import stream_workload

        reqs, encoder = stream_workload(target, spec), RecordEncoder(Path(out_dir))
    else:
        reqs, encoder = make_workload(spec, count), None
    lap("workload")
    res, _ = simulate_load(
        target, reqs, LoadSpec(rate), 0, **({"records_to": encoder} if streams else {})
    )
    lap("replay")
    gc.freeze()  # as the command does before its reports
    s = summarize(res.records, res.duration, {}, None, 1)
    lap("summary")
    # As the command writes it: in forked encoders where this tree's write_json has them.
    kw = {"jobs": jobs} if "jobs" in signature(write_json).parameters else {}
    rows = encoder.finish() if encoder else [r.to_dict() for r in res.records]
    write_json(Path(out_dir) / "run.json", {"summary": s, "records": rows}, **kw)
    if encoder:
        encoder.close()
    lap("json")
    plot_latency_cdf({"run": res.records}, Path(out_dir) / "run.png")
    lap("plot")
    t["total"] = time.perf_counter() - start
    return t


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--num-prompts", type=int, default=10_000)
    p.add_argument("--workload", default="chat")
    p.add_argument("--request-rate", type=float, default=40.0)
    p.add_argument("--baseline", default=None, help="git ref to compare with (default: none)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    for flag, v in (("--num-prompts", args.num_prompts), ("--rounds", args.rounds)):
        if v < 1:
            raise SystemExit(f"{flag}: must be >= 1, got {v}")
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "llama-3-8b"
        model.mkdir()
        (model / "config.json").write_text(json.dumps(LLAMA_8B))
        if args.child:
            t = one_run(str(model), args.workload, args.num_prompts, args.request_rate, tmp)
            print(json.dumps(t))
            return
        trees = {"this tree": ROOT}
        if args.baseline:
            base = Path(tmp) / "baseline"
            subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(base),
                            args.baseline], check=True, capture_output=True)  # fmt: skip
            trees[f"baseline {args.baseline}"] = base
        try:
            times: dict[str, list[dict[str, float]]] = {k: [] for k in trees}
            for r in range(args.rounds):
                for name, tree in trees.items():
                    env = dict(os.environ, PYTHONPATH=str(tree))
                    cmd = [sys.executable, str(Path(__file__).resolve()), "--child",
                           "--num-prompts", str(args.num_prompts), "--workload", args.workload,
                           "--request-rate", str(args.request_rate)]  # fmt: skip
                    done = subprocess.run(
                        cmd, env=env, cwd=tree, check=True, capture_output=True, text=True
                    )
                    times[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
                    print(
                        f"round {r + 1} {name}: {times[name][-1]['total']:.1f} s", file=sys.stderr
                    )
        finally:
            if args.baseline:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)],
                               check=False, capture_output=True)  # fmt: skip
    med = {k: {ph: median([t[ph] for t in v]) for ph in PHASES} for k, v in times.items()}
    names = list(trees)
    cols = ["phase (s, median)", *names] + (["this / baseline"] if len(names) > 1 else [])
    rows = []
    for ph in PHASES:
        row = {cols[0]: ph, **{k: med[k][ph] for k in names}}
        if len(names) > 1:
            row[cols[-1]] = f"{med[names[0]][ph] / max(med[names[1]][ph], 1e-9):.2f}x"
        rows.append(row)
    print(f"kvserve simulate, {args.num_prompts} {args.workload} requests at "
          f"{args.request_rate:g}/s, Llama-3-8B shapes on an H100 (shipped profile), "
          f"{args.rounds} round(s), imports not counted")  # fmt: skip
    print(table(rows, cols))
    emit({"median_s": med})


if __name__ == "__main__":
    main()
