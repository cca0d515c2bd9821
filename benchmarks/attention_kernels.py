"""Decode-attention kernel time per KV format against the dense bfloat16 kernel.

One layer's storage per format, filled with the same random K/V; every round times one decode
call of the CPU attention backend per format, so drift between rounds cancels in the per-round
ratios.
Blocks are laid out in order ("contiguous") or shuffled as in a pool after churn ("scattered").

    .venv/bin/python -m benchmarks.attention_kernels [--quick]

``--bandwidth`` asks another question: how near the memory's read bandwidth the dense kernel
runs one decode step of a whole model, each layer's cache its own pool (SmolLM2-135M's
attention: 30 layers, 9 query heads over 3 KV heads of 64; 64 sequences of 640 tokens;
scattered blocks), with float32 and bfloat16 caches, the queries in the cache's dtype:

    .venv/bin/python -m benchmarks.attention_kernels --bandwidth
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from benchmarks.common import emit, median, set_threads, table

FORMATS = ["bfloat16", "fp8_e4m3", "fp8_e5m2", "int8", "kivi4", "kivi2"]
# SmolLM2-135M's attention for --bandwidth: layers, query heads, KV heads, head size
MODEL_LAYERS, MODEL_HEADS, MODEL_KV_HEADS, MODEL_HEAD_DIM = 30, 9, 3, 64


def run(batch: int, context: int, rounds: int, scattered: bool) -> dict[str, dict[str, float]]:
    from kvserve.attention.cpu_backend import CpuBackend
    from kvserve.kv.formats import make_kv_storage

    backend = CpuBackend()
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
            out = backend.decode(0, q, st, tables, lens, None, None)
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


def model_step(dtype: torch.dtype, batch: int, context: int, rounds: int) -> float:
    """Median seconds of one decode step over every layer of the SmolLM2 shape."""
    from kvserve.kernels import paged_decode_attention

    layers, heads, kvh, d, bs = MODEL_LAYERS, MODEL_HEADS, MODEL_KV_HEADS, MODEL_HEAD_DIM, 16
    nb = context // bs + 1
    g = torch.Generator().manual_seed(0)
    pools = [
        tuple(torch.randn(batch * nb, kvh, bs, d, generator=g).to(dtype) for _ in "kv")
        for _ in range(layers)
    ]
    tables = torch.randperm(batch * nb, generator=g).view(batch, nb)
    lens = torch.full((batch,), context)
    q = torch.randn(batch, heads, d, generator=g).to(dtype)
    times = []
    for _ in range(rounds + 1):  # the first round builds the kernel and warms up
        t0 = time.perf_counter()
        for k, v in pools:
            paged_decode_attention(q, k, v, tables, lens, None)
        times.append(time.perf_counter() - t0)
    return median(times[1:])


def bandwidth(batch: int, context: int, rounds: int) -> None:
    from kvserve.worker.bandwidth import measure_peak_bandwidth

    threads = set_threads()
    peak = measure_peak_bandwidth(torch.device("cpu"))
    rows, summary = [], {}
    for dtype in (torch.float32, torch.bfloat16):
        sec = model_step(dtype, batch, context, rounds)
        per_token = MODEL_LAYERS * MODEL_KV_HEADS * MODEL_HEAD_DIM * 2 * dtype.itemsize  # K and V
        nbytes = batch * context * per_token
        gbs = nbytes / sec / 1e9
        name = str(dtype).removeprefix("torch.")
        rows.append({"cache": name, "ms/step": sec * 1e3, "GB/s": gbs, "of peak": gbs * 1e9 / peak})
        summary[name] = {"ms": round(sec * 1e3, 2), "gbps": round(gbs, 2)}
    print(f"\n## one decode step of SmolLM2's attention: batch {batch}, context {context}, "
          f"scattered blocks, {rounds} rounds, {threads} thread(s); read bandwidth "
          f"{peak / 1e9:.1f} GB/s")  # fmt: skip
    print(table(rows, ["cache", "ms/step", "GB/s", "of peak"]))
    summary["read_gbps"] = round(peak / 1e9, 2)
    emit(summary)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--batch", type=int, default=None, help="default 8 (--bandwidth: 64)")
    ap.add_argument("--context", type=int, default=None, help="default 3072 (--bandwidth: 640)")
    ap.add_argument("--bandwidth", action="store_true",
                    help="one decode step of a whole model against the read bandwidth "
                    "(batch 64 and context 640 unless given; the engine's threads)")  # fmt: skip
    args = ap.parse_args(argv)
    if args.batch is None:
        args.batch = 64 if args.bandwidth else 8
    if args.context is None:
        args.context = 640 if args.bandwidth else 3072
    for name, value in (("--batch", args.batch), ("--context", args.context)):
        if value < 1:
            ap.error(f"{name} must be >= 1, got {value}")
    if args.bandwidth:
        bandwidth(args.batch, args.context, 5 if args.quick else 15)
        return
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
