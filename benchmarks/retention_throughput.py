"""Retention on a long-context, decode-heavy workload in a fixed ``kv_cache_memory``: output
tokens/s and preemptions per policy, alone and with fp8 and kivi4, against the full cache in
the same format, in one run.

The pool holds ``--full-seqs`` whole sequences in bfloat16, so the full cache is KV-bound (it
cannot run every request at once) while a policy that keeps ~544 tokens per sequence can. The
workload is ``kv_quant.py``'s long-context table with retention added. Compute is float32
unless ``--dtype`` says otherwise; one thread unless KVSERVE_BENCH_THREADS says otherwise.
Lossy: the quality each policy costs is the gate's (``kvserve quality --retentions``).

    .venv/bin/python -m benchmarks.retention_throughput [--model 50m] [--prompt 2048]
"""

from __future__ import annotations

import argparse

from benchmarks.common import bench_model, drain, emit, random_prompts, set_threads, table
from kvserve import LLM
from kvserve.config import ConfigError, ModelConfig
from kvserve.kv.formats import kv_bytes_per_token
from kvserve.sched.request import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="50m")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--full-seqs", type=float, default=4.0,
                    help="kv_cache_memory in whole bfloat16 sequences")  # fmt: skip
    ap.add_argument("--formats", default="bfloat16,fp8_e4m3,kivi4")
    ap.add_argument("--policies", default="none;window:512;sinks:4,window:508;snapkv:512")
    args = ap.parse_args()
    threads = set_threads()
    model = bench_model(args.model)
    mc = ModelConfig.from_pretrained(model)
    max_len = args.prompt + args.max_tokens + 16
    bpt = kv_bytes_per_token("bfloat16", mc.num_hidden_layers, mc.num_key_value_heads,
                             mc.head_dim, "bfloat16")  # fmt: skip
    memory = int(args.full_seqs * max_len * bpt)
    prompts = random_prompts(args.requests, args.prompt - args.prompt // 8, args.prompt,
                             mc.vocab_size, seed=2)  # fmt: skip
    rows = []
    for fmt in args.formats.split(","):
        base = None
        for pol in args.policies.split(";"):
            retention = None if pol == "none" else pol
            try:
                llm = LLM(model, dtype=args.dtype, kv_cache_dtype=fmt, kv_retention=retention,
                          kv_cache_memory=memory, max_num_seqs=args.requests,
                          max_model_len=max_len, enable_prefix_caching=False)  # fmt: skip
            except ConfigError as e:  # SnapKV on KIVI
                print(f"[retention_throughput] {fmt} {pol}: refused: {e}", flush=True)
                continue
            eng = llm.engine
            sp = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
            run = drain(eng, prompts, sp)
            tok_s = args.requests * args.max_tokens / run["wall s"]
            base = base or tok_s
            rows.append({"format": eng.kv_cache_dtype, "policy": pol if retention else "full",
                         "blocks": eng.num_blocks, **run, "out tok/s": tok_s,
                         "vs full cache": tok_s / base})  # fmt: skip
            print(f"[retention_throughput] {fmt} {pol}: {tok_s:.1f} tok/s", flush=True)
    print(
        f"{model}; compute {args.dtype}; {threads} threads; {args.requests} requests, prompt "
        f"<= {args.prompt}, {args.max_tokens} out; kv_cache_memory {memory / 2**20:.1f} MiB "
        f"({args.full_seqs:g} bf16 sequences)"
    )
    cols = ["format", "policy", "blocks", "peak running", "preemptions", "wall s", "out tok/s",
            "vs full cache"]  # fmt: skip
    print(table(rows, cols))
    emit({f"{r['format']} {r['policy']}": r["vs full cache"] for r in rows})


if __name__ == "__main__":
    main()
