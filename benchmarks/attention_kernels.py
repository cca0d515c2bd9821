"""Decode-attention kernel time per KV format against the dense bfloat16 kernel.

One layer's storage per format, filled with the same random K/V; every round times one
``decode_attention`` call per format, so drift between rounds cancels in the per-round ratios.
Blocks are laid out in order ("contiguous") or shuffled as in a pool after churn ("scattered").

    .venv/bin/python -m benchmarks.attention_kernels [--quick]
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from benchmarks.common import emit, median, set_threads, table

FORMATS = ["bfloat16", "fp8_e4m3", "fp8_e5m2", "int8", "kivi4", "kivi2"]


def run(batch: int, context: int, rounds: int, scattered: bool) -> dict[str, dict[str, float]]:
    from kvserve.kv.formats import make_kv_storage

    kvh, heads, d, bs = 2, 4, 64, 16
    nb = context // bs + 1
    g = torch.Generator().manual_seed(0)
    order = torch.randperm(batch * nb, generator=g) if scattered else torch.arange(batch * nb)
    tables = order.view(batch, nb)
    lens = torch.full((batch,), context)
    kv = [torch.randn(context, kvh, d, generator=g) for _ in range(batch)]
    stores = {}
    for f in FORMATS:
        st = make_kv_storage(f, 1, batch * nb, bs, kvh, d, torch.float32)
        for i in range(batch):
            pos = torch.arange(context)
            st.begin_step(tables[i, pos // bs] * bs + pos % bs)
            st.write(0, tables[i, pos // bs] * bs + pos % bs, kv[i], -kv[i])
        stores[f] = st
    q = torch.randn(batch, heads, d, generator=g)
    times: dict[str, list[float]] = {f: [] for f in FORMATS}
    for _ in range(rounds):
        for f, st in stores.items():
            t0 = time.perf_counter()
            out = st.decode_attention(0, q, tables, lens, None)
            times[f].append(time.perf_counter() - t0)
            if out is None:
                raise SystemExit(f"{f}: no native kernel (no C compiler?)")
    base = times["bfloat16"]
    return {
        f: {
            "ms": median(t) * 1e3,
            "ratio": median([a / b for a, b in zip(t, base, strict=True)]),
        }
        for f, t in times.items()
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=3072)
    args = ap.parse_args(argv)
    for name, value in (("--batch", args.batch), ("--context", args.context)):
        if value < 1:
            ap.error(f"{name} must be >= 1, got {value}")
    os.environ.setdefault("KVSERVE_BENCH_THREADS", "1")
    threads = set_threads()
    rounds = 10 if args.quick else 60
    summary = {}
    for layout in ("contiguous", "scattered"):
        res = run(args.batch, args.context, rounds, layout == "scattered")
        rows = [{"format": f, "kernel ms": r["ms"], "x bf16 (median of ratios)": r["ratio"]}
                for f, r in res.items()]  # fmt: skip
        print(f"\n## {layout} blocks: batch {args.batch}, context {args.context}, head dim 64, "
              f"GQA 4/2, {rounds} rounds, {threads} thread(s)")  # fmt: skip
        print(table(rows, ["format", "kernel ms", "x bf16 (median of ratios)"]))
        summary[layout] = {f: round(r["ratio"], 4) for f, r in res.items()}
    emit(summary)


if __name__ == "__main__":
    main()
