"""`kvserve serve` against `vllm serve` under the same `kvserve bench` load, and kvserve over
HTTP against kvserve in-process: TTFT/TPOT p50/p99 and output tokens/s side by side.

Each server is started, waited for, loaded with one `kvserve bench --base-url` run per request
rate (same workload, same seeds, open loop) and stopped before the next starts, so the two never
share the two cores. The in-process rows run `kvserve bench --model` with the same flags.

    python -m benchmarks.serving --model smollm2 --dtype bfloat16 --rates 2,8 --rounds 2 \
        --vllm-python /tmp/vllm-venv/bin/python

vLLM needs its own virtualenv (README, "Against vLLM") and the environment
``VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_KVCACHE_SPACE=4`` (set here when absent).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from benchmarks.common import REPO, bench_model, copy_bandwidth, emit, wait_ready

KVSERVE = [sys.executable, "-m", "kvserve.cli"]


def bench(extra: list[str], args: argparse.Namespace, rate: float, seed: int,
          out: Path) -> dict[str, Any]:  # fmt: skip
    """One `kvserve bench` run; its JSON summary (the last line it prints)."""
    cmd = [*KVSERVE, "bench", *extra, "--workload", args.workload,
           "--num-prompts", str(args.num_prompts), "--length-scale", str(args.length_scale),
           "--request-rate", str(rate), "--seed", str(seed), "--warmup", "2",
           "--no-plots", "--no-progress", "--json", "--output-dir", str(out)]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{res.stderr[-2000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def served(
    cmd: list[str],
    env: dict[str, str],
    port: int,
    args: argparse.Namespace,
    points: list[tuple[float, int]],
    log: Path,
) -> tuple[float, list[dict[str, Any]]]:
    """Start a server, run each (rate, seed) against it, stop it: (startup s, summaries)."""
    with open(log, "w") as logf:
        proc = subprocess.Popen(cmd, env=env, stdout=logf, stderr=subprocess.STDOUT, cwd=REPO,
                                start_new_session=True)  # fmt: skip
        try:
            startup = wait_ready(port, args.startup_timeout, proc)
            url = ["--base-url", f"http://127.0.0.1:{port}", "--tokenizer", args.model_dir]
            return startup, [bench(url, args, r, seed, log.parent) for r, seed in points]
        finally:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


METRICS = ("completed", "failed", "ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99", "out_tok_s")


def row(name: str, rate: float, s: dict[str, Any], rnd: int) -> dict[str, Any]:
    return {
        "engine": name, "rate": rate, "round": rnd, "completed": s["completed"],
        "failed": s["failed"],
        "ttft_p50": s["ttft_ms"]["p50"], "ttft_p99": s["ttft_ms"]["p99"],
        "tpot_p50": s["tpot_ms"]["p50"], "tpot_p99": s["tpot_ms"]["p99"],
        "out_tok_s": s["output_throughput"],
    }  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rates", default="2,8", help="comma list of request rates (req/s)")
    ap.add_argument("--workload", default="mixed")
    ap.add_argument("--num-prompts", type=int, default=48)
    ap.add_argument("--length-scale", type=float, default=0.5)
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--vllm-python", help="interpreter of a virtualenv with vllm-cpu")
    ap.add_argument("--rounds", type=int, default=1, help="interleaved rounds (medians)")
    ap.add_argument("--port", type=int, default=18950)
    ap.add_argument("--startup-timeout", type=float, default=300)
    ap.add_argument("--out", default="/tmp/kvserve-serving-bench")
    args = ap.parse_args(argv)
    try:
        rates = [float(r) for r in args.rates.split(",")]
    except ValueError:
        ap.error(f"--rates: comma list of request rates (req/s), got {args.rates!r}")
    if not all(r > 0 for r in rates):
        ap.error(f"--rates: every rate must be > 0 req/s, got {args.rates!r}")
    if args.rounds < 1:
        ap.error(f"--rounds: must be >= 1, got {args.rounds}")
    if args.vllm_python and not (Path(args.vllm_python).parent / "vllm").is_file():
        ap.error(f"--vllm-python: no `vllm` command beside {args.vllm_python} (a vllm-cpu venv)")
    # Each rate gets its own seed (--seed + i, as `kvserve bench --sweep` does): a server keeps
    # its prefix cache between runs, and the same prompts again would all be hits.
    points = [(r, args.seed + i) for i, r in enumerate(rates)]
    args.model_dir = bench_model(args.model)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    common = ["--dtype", args.dtype, "--max-model-len", str(args.max_model_len)]
    rows: list[dict[str, Any]] = []
    startups: dict[str, float] = {}

    # vLLM zero-fills its KV space at start; kvserve's pool is faulted in there too.
    kv_common = [*common, "--kv-cache-prefault"]
    kv_cmd = [*KVSERVE, "serve", "--model", args.model_dir, *kv_common, "--port", str(args.port)]
    inproc = ["--model", args.model_dir, *kv_common]
    venv_env, vl_cmd = None, None
    if args.vllm_python:
        venv = Path(args.vllm_python).parent
        venv_env = {**env, "VLLM_CPU_OMP_THREADS_BIND": env.get("VLLM_CPU_OMP_THREADS_BIND", "0-1"),
                    "VLLM_CPU_KVCACHE_SPACE": env.get("VLLM_CPU_KVCACHE_SPACE", "4"),
                    "PATH": f"{venv}:{env.get('PATH', '')}"}  # fmt: skip
        vl_cmd = [str(venv / "vllm"), "serve", args.model_dir, *common,
                  "--port", str(args.port + 1), "--seed", "0"]  # fmt: skip
    # Speed here drifts by up to 2x within minutes: the engines take turns within each round
    # and the table gives each figure's median over the rounds.
    for rnd in range(args.rounds):
        print(f"round {rnd + 1}: copy bandwidth {copy_bandwidth() / 1e9:.1f} GB/s", flush=True)
        t, sums = served(kv_cmd, env, args.port, args, points, out / "kvserve.log")
        startups.setdefault("kvserve", t)
        rows += [row("kvserve serve", r, s, rnd) for r, s in zip(rates, sums, strict=True)]
        rows += [row("kvserve in-process", r, bench(inproc, args, r, seed, out), rnd)
                 for r, seed in points]  # fmt: skip
        if vl_cmd is not None:
            t, sums = served(vl_cmd, venv_env, args.port + 1, args, points, out / "vllm.log")
            startups.setdefault("vllm", t)
            rows += [row("vllm serve", r, s, rnd) for r, s in zip(rates, sums, strict=True)]
    for r in rows:
        print(json.dumps(r))
    runs: dict[tuple[str, float], list[dict[str, Any]]] = {}
    for r in rows:
        runs.setdefault((r["engine"], r["rate"]), []).append(r)
    by = {key: {"engine": key[0], "rate": key[1],
                **{k: statistics.median(r[k] for r in rs) for k in METRICS}}
          for key, rs in runs.items()}  # fmt: skip
    rows = list(by.values())
    print(f"\n{args.model} {args.dtype}, {args.workload} x{args.num_prompts}, "
          f"medians of {args.rounds} round(s), "
          f"length scale {args.length_scale}, seeds {args.seed}.. by rate; startup "
          + ", ".join(f"{k} {v:.1f} s" for k, v in startups.items()))  # fmt: skip
    print("| engine | rate | ok/failed | TTFT p50 / p99 ms | TPOT p50 / p99 ms | out tok/s |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['engine']} | {r['rate']:g} | {r['completed']}/{r['failed']} | "
              f"{r['ttft_p50']:.1f} / {r['ttft_p99']:.1f} | {r['tpot_p50']:.1f} / "
              f"{r['tpot_p99']:.1f} | {r['out_tok_s']:.1f} |")  # fmt: skip
    ratios: dict[str, float] = {}
    for rate in rates:
        kv, inp = by[("kvserve serve", rate)], by[("kvserve in-process", rate)]
        for q in ("p50", "p99"):
            ratios[f"http_over_inprocess_tpot_{q}@{rate:g}"] = kv[f"tpot_{q}"] / inp[f"tpot_{q}"]
            if ("vllm serve", rate) in by:
                vl = by[("vllm serve", rate)]
                ratios[f"kvserve_over_vllm_tpot_{q}@{rate:g}"] = kv[f"tpot_{q}"] / vl[f"tpot_{q}"]
                ratios[f"kvserve_over_vllm_ttft_{q}@{rate:g}"] = kv[f"ttft_{q}"] / vl[f"ttft_{q}"]
    print("\n" + "\n".join(f"{k}: {v:.2f}x" for k, v in ratios.items()))
    emit({"rows": rows, "ratios": ratios, "startup_s": startups})


if __name__ == "__main__":
    main()
