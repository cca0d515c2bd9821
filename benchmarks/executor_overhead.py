"""What the worker-process executor (``--distributed-executor-backend mp``) costs per step
against the in-process one (``uni``): the same seeded workload through both, alternately in
fresh processes so that drift in the machine's speed hits both alike.

    .venv/bin/python -m benchmarks.executor_overhead [--sizes 5m,smollm2] [--rounds 3]

Per model: output tokens/s, the median time of a decode step (every request decoding one
token; the step the pipe and the pickling add to), and the difference per step. Ends with one
JSON line.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from benchmarks.common import MODELS, REPO, bench_model, emit, median, table, vocab_size

CHILD = """
import json, statistics, sys, time
sys.path.insert(0, {repo!r})
from benchmarks.common import random_prompts, set_threads
from kvserve import LLM, SamplingParams
set_threads()
llm = LLM({path!r}, dtype={dtype!r}, max_num_seqs={n}, enable_prefix_caching=False,
          distributed_executor_backend={executor!r})
engine = llm.engine
llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4))  # warm-up
sp = SamplingParams(temperature=0, max_tokens={max_tokens}, ignore_eos=True)
for i, p in enumerate(random_prompts({n}, 64, 256, {vocab}, seed=0)):
    engine.add_request(str(i), p, sp)
decode, out, t0 = [], 0, time.perf_counter()
while engine.has_unfinished_requests():
    ts = time.perf_counter()
    done = engine.step()
    dt = time.perf_counter() - ts
    last = engine.core.last_step
    if last.num_prefill_tokens == 0 and last.num_decode_tokens:
        decode.append(dt)
    out += sum(len(o.outputs[0].token_ids) for o in done if o.finished)
tok_s = out / (time.perf_counter() - t0)
llm.shutdown()
print(json.dumps({{"tok_s": tok_s, "decode_ms": 1e3 * statistics.median(decode)}}))
"""


def run_once(size: str, executor: str, args: argparse.Namespace) -> dict[str, float]:
    code = CHILD.format(repo=str(REPO), path=bench_model(size), dtype=args.dtype,
                        n=args.num_prompts, max_tokens=args.max_tokens, vocab=vocab_size(size),
                        executor=executor)  # fmt: skip
    # The child is a script file: the mp executor's worker (spawn) imports the main module.
    script = REPO / ".cache" / "executor_overhead_child.py"
    script.parent.mkdir(exist_ok=True)
    script.write_text("if __name__ == '__main__':\n" + _indent(code))
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         cwd=REPO, timeout=3600)  # fmt: skip
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("{")]
    if res.returncode or not lines:
        raise SystemExit(f"{size} {executor} failed: {res.stderr[-2000:]}")
    return json.loads(lines[-1])


def _indent(code: str) -> str:
    return "".join("    " + line + "\n" for line in code.strip().splitlines())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sizes", default="5m,smollm2")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error(f"--rounds: must be >= 1, got {args.rounds}")
    rows, summary = [], {}
    for size in args.sizes.split(","):
        try:
            bench_model(size)
        except FileNotFoundError as e:
            ap.error(f"--sizes: {e} (random sizes: {', '.join(MODELS)})")
        runs: dict[str, list[dict[str, float]]] = {"uni": [], "mp": []}
        for _ in range(args.rounds):
            for executor in ("uni", "mp"):
                runs[executor].append(run_once(size, executor, args))
        med = {e: {k: median([r[k] for r in rs]) for k in ("tok_s", "decode_ms")}
               for e, rs in runs.items()}  # fmt: skip
        extra = med["mp"]["decode_ms"] - med["uni"]["decode_ms"]
        rows.append({"model": size, "dtype": args.dtype,
                     "uni tok/s": med["uni"]["tok_s"], "mp tok/s": med["mp"]["tok_s"],
                     "mp / uni": med["mp"]["tok_s"] / med["uni"]["tok_s"],
                     "uni decode step ms": med["uni"]["decode_ms"],
                     "mp decode step ms": med["mp"]["decode_ms"],
                     "mp extra ms/step": extra})  # fmt: skip
        summary[size] = {"uni_tok_s": round(med["uni"]["tok_s"], 1),
                         "mp_tok_s": round(med["mp"]["tok_s"], 1),
                         "ratio": round(med["mp"]["tok_s"] / med["uni"]["tok_s"], 3),
                         "mp_extra_ms_per_step": round(extra, 3)}  # fmt: skip
    print(table(rows, list(rows[0])))
    emit({"benchmark": "executor_overhead", "dtype": args.dtype, "rounds": args.rounds,
          "models": summary})  # fmt: skip


if __name__ == "__main__":
    main()
