"""Tensor parallelism on one CPU: kvserve at -tp 2 against vLLM's CPU build at -tp 2 on the
same cores (its shared-memory all-reduce, ``VLLM_CPU_OMP_THREADS_BIND`` one list per rank)
and against kvserve at -tp 1, per model; and the share of a decode step kvserve's ranks
spend in their collectives.

    PYTHONPATH=/work/shared/tools/vllm-shim python -m benchmarks.tp \
        --models kvserve-ref,smollm2 --vllm-python /tmp/vllm-venv/bin/python

Every engine runs in a fresh process per round, greedy, ``ignore_eos``, and times the
prompts ``--repeats`` times in it (its median: one pass is a fraction of a second, which a
busy moment of a shared machine can halve); the table gives medians over the rounds.
kvserve's ranks each take half of the CPUs this process may use
(``KVSERVE_CPU_OMP_THREADS_BIND=auto``), vLLM's ranks the same halves by list. The collective
share is rank 0's time inside all-reduce and all-gather over its time in steps, waits for
the other rank included (that is what a step pays). ``identical``: kvserve -tp 2 gave the
-tp 1 tokens for every model (in float32 they must; in bfloat16 the sums of partial products
round differently and may flip a near-tie; null where -tp 2 could not run, as for a model
whose attention heads do not divide by 2). With ``--async-scheduling`` each round also runs
kvserve -tp 2 with async scheduling: ``async_tok_s``, and ``async_identical``, whether its
tokens are the default -tp 2 run's (in any dtype: the ranks' arithmetic is the same).
``memory_gb_s``: one core's read bandwidth over a buffer larger than the cache, measured
before each model's rounds: on a memory-bound decode both engines stream the same weight
bytes per step, so a shared host's bandwidth of the moment moves both figures (and their
ratio towards 1 when it is low). The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
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


def _time_collectives(worker: Any) -> None:
    """In a rank: wrap its communicator's collectives and its step in timers."""
    totals = worker.collective_seconds = {"collectives": 0.0, "steps": 0.0, "calls": 0}

    def timed(fn: Any, key: str) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                totals[key] += time.perf_counter() - t0
                totals["calls"] += key == "collectives"

        return wrapper

    comm = worker.tp.communicator if worker.tp is not None else None
    if comm is not None:
        comm.all_reduce = timed(comm.all_reduce, "collectives")
        comm.all_gather = timed(comm.all_gather, "collectives")
    worker.runner.execute_model = timed(worker.runner.execute_model, "steps")


def _collective_seconds(worker: Any) -> dict[str, float]:
    return dict(worker.collective_seconds)


ASYNC = "kvserve -tp 2 async"


def child(model: str, prompt_file: str, max_tokens: int, dtype: str, tp: int,
          repeats: int, async_scheduling: bool) -> None:  # fmt: skip
    """In the engine's own process: output tok/s, the tokens, the collectives' share."""
    from kvserve import LLM, SamplingParams

    with open(prompt_file) as f:
        prompts = json.load(f)
    llm = LLM(model, dtype=dtype, tensor_parallel_size=tp, max_num_seqs=len(prompts),
              enable_prefix_caching=False, max_model_len=4096,
              async_scheduling=async_scheduling)  # fmt: skip
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4))  # warm-up
    ex = llm.engine.executor
    ex.collective_rpc(_time_collectives)
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    walls = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        res = llm.generate(prompts, sp)
        walls.append(time.perf_counter() - t0)
    wall = median(walls)
    spent = ex.collective_rpc(_collective_seconds)[0]
    tokens = [r.outputs[0].token_ids for r in res]
    out = {
        "tok_s": sum(len(t) for t in tokens) / wall,
        "tokens": tokens,
        "collective_share": spent["collectives"] / spent["steps"] if spent["steps"] else 0.0,
        "collective_calls": spent["calls"],
    }
    llm.shutdown()
    print(json.dumps(out))


def _same_tokens(one: list[dict[str, Any]], runs: list[dict[str, Any]]) -> bool | None:
    """Whether every run gave the -tp 1 tokens; None: the runs did not happen (a model whose
    heads do not divide by 2 is refused at -tp 2)."""
    if not runs:
        return None
    return bool(one) and all(r["tokens"] == one[0]["tokens"] for r in runs)


def one_core_bandwidth() -> float:
    """GB/s one thread reads from memory now (the best of a few passes over 256 MiB)."""
    import torch

    from kvserve.worker.bandwidth import measure_peak_bandwidth

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return measure_peak_bandwidth(torch.device("cpu")) / 1e9
    finally:
        torch.set_num_threads(threads)


def rank_lists(world_size: int) -> str:
    """The CPUs this process may use split into one list per rank, vLLM's ``0|1`` form."""
    cpus = sorted(os.sched_getaffinity(0))
    share = max(1, len(cpus) // world_size)
    parts = [cpus[r * share : (r + 1) * share] for r in range(world_size)]
    return "|".join(",".join(map(str, p)) for p in parts)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="kvserve-ref,smollm2",
                    help="comma-separated: a benchmark size (5m, 50m, 135m) or a model name "
                    "or path (kvserve download smollm2 first)")  # fmt: skip
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3,
                    help="timed passes per engine process (their median)")  # fmt: skip
    ap.add_argument("--vllm-python", help="interpreter of a virtualenv with vllm-cpu")
    ap.add_argument("--async-scheduling", action="store_true",
                    help="also run kvserve -tp 2 with --async-scheduling in each round "
                    "(async_tok_s)")  # fmt: skip
    ap.add_argument("--child", nargs=7,
                    metavar=("MODEL", "PROMPTS", "MAX_TOKENS", "DTYPE", "TP", "REPEATS", "ASYNC"),
                    help=argparse.SUPPRESS)  # fmt: skip
    args = ap.parse_args(argv)
    if args.child:
        model, prompt_file, max_tokens, dtype, tp, repeats, overlap = args.child
        child(model, prompt_file, int(max_tokens), dtype, int(tp), int(repeats), overlap == "1")
        return
    for name in ("prompts", "input_len", "max_tokens", "rounds", "repeats"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')}: must be >= 1, got {getattr(args, name)}")
    if args.vllm_python and not Path(args.vllm_python).is_file():
        ap.error(f"--vllm-python: no such interpreter: {args.vllm_python}")
    env = {**os.environ, "KVSERVE_CPU_OMP_THREADS_BIND": "auto"}
    vl_env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": rank_lists(2)}
    vl_env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    by_model: dict[str, dict[str, Any]] = {}
    rows = []
    identical: bool | None = None
    for model in [m.strip() for m in args.models.split(",") if m.strip()]:
        path = bench_model(model)
        prompts = random_prompts(args.prompts, args.input_len, args.input_len,
                                 vocab_size(model), seed=0)  # fmt: skip
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump(prompts, f)
        work = [path, f.name, str(args.max_tokens), args.dtype]
        kv = [sys.executable, "-m", "benchmarks.tp", "--child", *work]
        engines: dict[str, tuple[list[str], dict[str, str]]] = {
            "kvserve -tp 2": ([*kv, "2", str(args.repeats), "0"], env),
            "kvserve -tp 1": ([*kv, "1", str(args.repeats), "0"], env),
        }
        if args.async_scheduling:
            engines[ASYNC] = ([*kv, "2", str(args.repeats), "1"], env)
        if args.vllm_python:
            runner = str(Path(__file__).with_name("vllm_runner.py"))
            vl = [args.vllm_python, runner, *work, "", "--tp=2", f"--repeats={args.repeats}"]
            engines["vLLM -tp 2"] = (vl, vl_env)
        got: dict[str, list[dict[str, Any]]] = {name: [] for name in engines}
        bandwidth = one_core_bandwidth()
        try:
            for rnd in range(args.rounds):
                for name, (cmd, cenv) in engines.items():
                    res = run_json_child(cmd, cenv, timeout=3600)
                    if res is not None:
                        got[name].append(res)
                        brief = {k: v for k, v in res.items() if k != "tokens"}
                        print(f"{model} round {rnd + 1} {name}: {brief}", flush=True)
        finally:
            os.unlink(f.name)
        two, one, vl = got["kvserve -tp 2"], got["kvserve -tp 1"], got.get("vLLM -tp 2", [])
        same = _same_tokens(one, two)
        if same is not None:
            identical = same if identical is None else identical and same
        figures = {
            "kvserve_tok_s": median([r["tok_s"] for r in two]) if two else None,
            "tp1_tok_s": median([r["tok_s"] for r in one]) if one else None,
            "vllm_tok_s": median([r["vllm_tok_s"] for r in vl]) if vl else None,
            "collective_share": median([r["collective_share"] for r in two]) if two else None,
            "identical": same,
            "memory_gb_s": round(bandwidth, 1),
        }
        if args.async_scheduling:
            over = got[ASYNC]
            figures["async_tok_s"] = median([r["tok_s"] for r in over]) if over else None
            figures["async_identical"] = _same_tokens(two, over)  # same arithmetic: any dtype
        if figures["kvserve_tok_s"] and figures["vllm_tok_s"]:
            figures["kvserve_over_vllm"] = figures["kvserve_tok_s"] / figures["vllm_tok_s"]
        by_model[model] = figures
        rows.append({"model": model, **{k: v for k, v in figures.items() if v is not None}})
    print(f"\n{args.dtype}, {args.prompts} prompts x {args.input_len} tokens, "
          f"{args.max_tokens} out, medians of {args.rounds} round(s) of "
          f"{args.repeats} pass(es)")  # fmt: skip
    cols = ["model", "kvserve_tok_s", "async_tok_s", "vllm_tok_s", "tp1_tok_s",
            "collective_share", "kvserve_over_vllm", "identical", "memory_gb_s"]  # fmt: skip
    print(table(rows, [c for c in cols if any(c in r for r in rows)]))
    emit({"bench": "tp", "dtype": args.dtype, "identical": identical, "by_model": by_model})


if __name__ == "__main__":
    main()
