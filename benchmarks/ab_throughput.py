"""kvserve's output tokens/s on the throughput workload, this checkout against another one
(``--before DIR``, e.g. a ``git worktree`` of the last commit before a change), run
alternately in fresh processes so that drift in the machine's speed hits both sides alike.

    git worktree add /tmp/before <commit>
    .venv/bin/python -m benchmarks.ab_throughput --before /tmp/before --dtype bfloat16

Each run is :func:`benchmarks.throughput.run_kvserve` of the tree under test (its own engine
and its own copy of that function) on the same seeded prompts; the table gives the median of
``--rounds`` runs per side and the ratio after / before.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from benchmarks.common import MODELS, REPO, bench_model, emit, median, table, vocab_size
from kvserve.config import EngineConfig
from kvserve.config_fields import default_of

CHILD = """
import json, sys
sys.path.insert(0, {tree!r})
import kvserve
assert kvserve.__file__.startswith({tree!r}), kvserve.__file__
from benchmarks.common import random_prompts, set_threads
from benchmarks.throughput import run_kvserve
set_threads()
prompts = random_prompts({n}, 128, 1024, {vocab}, seed=0)
r = run_kvserve({path!r}, prompts, {max_tokens}, {dtype!r}, {budget})
print(json.dumps({{"tok_s": r["tok_s"]}}))
"""


def run_once(tree: Path, size: str, args: argparse.Namespace) -> float:
    code = CHILD.format(tree=str(tree), n=args.num_prompts, vocab=vocab_size(size),
                        path=bench_model(size), max_tokens=args.max_tokens, dtype=args.dtype,
                        budget=args.budget)  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=tree, timeout=3600)  # fmt: skip
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if out.returncode or not lines:
        raise SystemExit(f"run in {tree} failed: {out.stderr[-2000:]}")
    return float(json.loads(lines[-1])["tok_s"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--before", required=True, type=Path, help="the other checkout")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--sizes", default="5m,50m")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument(
        "--budget",
        type=int,
        default=default_of(EngineConfig, "max_num_batched_tokens"),
        help="max_num_batched_tokens (default: %(default)s, the engine's)",
    )
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error(f"--rounds: must be >= 1, got {args.rounds}")
    before = args.before.resolve()
    if not (before / "kvserve" / "__init__.py").exists():
        ap.error(f"--before: {before} is not a kvserve checkout")
    rows, summary = [], {}
    for size in args.sizes.split(","):
        try:
            bench_model(size)
        except FileNotFoundError as e:
            ap.error(f"--sizes: {e} (random sizes: {', '.join(MODELS)})")
        runs: dict[str, list[float]] = {"before": [], "after": []}
        for _ in range(args.rounds):
            runs["before"].append(run_once(before, size, args))
            runs["after"].append(run_once(REPO, size, args))
        b, a = median(runs["before"]), median(runs["after"])
        rows.append({"model": size, "dtype": args.dtype, "before tok/s": b, "after tok/s": a,
                     "after / before": a / b,
                     "runs (before | after)": " ".join(f"{x:.0f}" for x in runs["before"])
                     + " | " + " ".join(f"{x:.0f}" for x in runs["after"])})  # fmt: skip
        summary[size] = {"before": round(b, 1), "after": round(a, 1), "ratio": round(a / b, 3)}
    print(table(rows, list(rows[0])))
    emit({"by_model": summary, "dtype": args.dtype})


if __name__ == "__main__":
    main()
