"""A hybrid model (half the layers full attention, half a sliding window) on a long-context,
decode-heavy workload in a fixed ``kv_cache_memory``: per-group block tables (the default)
against one table for every layer (``disable_hybrid_kv_cache_manager``), alternated, with the
greedy tokens of both compared.

The model is the 50 M benchmark shape as a Qwen2 checkpoint whose last ``--window-layers``
layers slide over ``--window`` tokens (``max_window_layers``), random weights. The pool holds
``--full-seqs`` whole sequences at full length, so one table is KV-bound; per-group tables
give the window layers' blocks back behind the window and run more sequences at once. Exact:
in float32 both configurations must produce the same tokens (a mismatch fails the script); in
bfloat16 a different batch composition changes the GEMMs' rounding, so when the two run
different batches the script reports how many tokens agree instead (run with a pool that
holds every sequence, ``--full-seqs 20``, and the batches and tokens are the same). The
planner's window-aware bytes for one sequence are checked against the engine's last
(``kvserve plan --validate``'s check).

    .venv/bin/python -m benchmarks.hybrid_kv [--dtype bfloat16] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import time

from benchmarks.common import MODEL_CACHE, MODELS, emit, median, random_prompts, set_threads, table
from kvserve import LLM
from kvserve.kv.formats import kv_bytes_per_token
from kvserve.model.synthetic import make_random_checkpoint
from kvserve.plan.validate import validate_windows
from kvserve.sched.request import SamplingParams


def hybrid_model(window: int, window_layers: int) -> str:
    shape = MODELS["50m"]
    path = MODEL_CACHE / f"50m-hybrid-w{window}-l{window_layers}"
    if not (path / "model.safetensors").exists():
        make_random_checkpoint(path, arch="qwen2", seed=0, max_position_embeddings=8192,
                               init_std=0.05, sliding_window=window, **shape)  # fmt: skip
        cfg = json.loads((path / "config.json").read_text())
        cfg["max_window_layers"] = shape["num_layers"] - window_layers
        (path / "config.json").write_text(json.dumps(cfg))
    return str(path)


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> dict:
    eng = llm.engine
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, params)
    t0, peak, peak_kv, outs = time.perf_counter(), 0, 0, {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o.outputs[0].token_ids
        s = eng.stats()
        peak = max(peak, s.num_running)
        peak_kv = max(peak_kv, s.kv_blocks_used)
    wall = time.perf_counter() - t0
    n = sum(len(t) for t in outs.values())
    return {"wall s": wall, "out tok/s": n / wall, "peak running": peak,
            "preemptions": eng.stats().num_preemptions, "peak KV blocks": peak_kv,
            "window-freed blocks": eng.stats().window_freed_blocks,
            "tokens": [outs[f"r{i}"] for i in range(len(prompts))]}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--window-layers", type=int, default=5, help="of the 10 layers")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--full-seqs", type=float, default=4.0,
                    help="kv_cache_memory in whole sequences at full length")  # fmt: skip
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    threads = set_threads()
    model = hybrid_model(args.window, args.window_layers)
    shape = MODELS["50m"]
    max_len = args.prompt + args.max_tokens + 16
    kv_dtype = "bfloat16" if args.dtype == "bfloat16" else "float32"
    bpt = kv_bytes_per_token(kv_dtype, shape["num_layers"], shape["num_kv_heads"],
                             shape["hidden_size"] // shape["num_heads"], kv_dtype)  # fmt: skip
    memory = int(args.full_seqs * max_len * bpt)
    prompts = random_prompts(args.requests, args.prompt - args.prompt // 8, args.prompt,
                             shape["vocab_size"], seed=2)  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    configs = {"per-group tables": {}, "one table": {"disable_hybrid_kv_cache_manager": True}}
    results: dict[str, list[dict]] = {name: [] for name in configs}
    for r in range(args.rounds):
        for name, kw in configs.items():
            llm = LLM(model, dtype=args.dtype, kv_cache_memory=memory, max_model_len=max_len,
                      max_num_seqs=args.requests, enable_prefix_caching=False, **kw)  # fmt: skip
            res = run(llm, prompts, params)
            results[name].append(res)
            print(f"[hybrid_kv] round {r + 1} {name}: {res['out tok/s']:.1f} tok/s, peak "
                  f"running {res['peak running']}, preemptions {res['preemptions']}",
                  flush=True)  # fmt: skip
            del llm
    pairs = list(zip(results["per-group tables"], results["one table"], strict=True))
    same = all(a["tokens"] == b["tokens"] for a, b in pairs)
    agree = total = 0  # tokens before each sequence's first divergence
    for a, b in pairs:
        for x, y in zip(a["tokens"], b["tokens"], strict=True):
            n = next((i for i, (p, q) in enumerate(zip(x, y, strict=True)) if p != q), len(x))
            agree, total = agree + n, total + len(x)
    base = median([x["out tok/s"] for x in results["one table"]])
    rows = []
    last = ("peak running", "preemptions", "peak KV blocks", "window-freed blocks")
    for name, runs in results.items():
        tok = median([x["out tok/s"] for x in runs])
        rows.append({"config": name, "out tok/s": tok, "vs one table": tok / base,
                     "rounds tok/s": " ".join(f"{x['out tok/s']:.1f}" for x in runs),
                     **{k: runs[-1][k] for k in last}})  # fmt: skip
    print(
        f"{model}; compute {args.dtype}; {threads} threads; {args.requests} requests, prompt "
        f"<= {args.prompt}, {args.max_tokens} out; window {args.window} on "
        f"{args.window_layers} of {shape['num_layers']} layers; kv_cache_memory "
        f"{memory / 2**20:.1f} MiB ({args.full_seqs:g} full-length sequences)"
    )
    cols = ["config", "out tok/s", "vs one table", "rounds tok/s", "peak running",
            "preemptions", "peak KV blocks", "window-freed blocks"]  # fmt: skip
    print(table(rows, cols))
    print(f"greedy tokens identical in every round: {same} ({agree / total:.4f} of tokens "
          f"before each sequence's first divergence)")  # fmt: skip
    w = validate_windows(model, dtype=args.dtype)
    print(f"one sequence of {w.context} tokens: planner's window-aware KV {w.predicted_bytes:,.0f} "
          f"bytes, engine holds {w.engine_bytes:,} (block rounding allows "
          f"{w.slack_bytes:,.0f} more): {'ok' if w.ok else 'FAIL'}")  # fmt: skip
    emit({r["config"]: r["vs one table"] for r in rows} | {"identical": same, "window ok": w.ok})
    if args.dtype == "float32" and not same:
        raise SystemExit("per-group tables changed the output")


if __name__ == "__main__":
    main()
