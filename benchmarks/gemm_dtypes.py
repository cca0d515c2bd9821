"""bf16 against float32 GEMMs on this CPU, by step size, on a model's own matrices: the
measurement behind ``UpcastOps`` (kvserve/model/linear_ops.py), which runs a bf16 model's
large steps on oneDNN (in float32 or in bf16, whichever is faster here), and behind
kvserve's own bf16 kernels (``PackedOps``: AMX tiles, or AVX-512 FMAs without them).

    python -m benchmarks.gemm_dtypes --model smollm2

For each row count (a step's tokens), every layer matrix of the model (each layer's own
copy, so that small steps stream the weights from memory as a decode step does) is
multiplied through oneDNN with packed weights: in bf16, and in float32 with the bf16
activations converted on the way in and the result rounded back (what UpcastOps does), and,
where the CPU runs one (and every matrix's dims are multiples of 32), by kvserve's bf16
kernel on the same matrices in its tile layout. The ratio columns are each time over the
kernel's (or, without one, oneDNN bf16's over float32's): above 1, the kernel (float32) is
faster. The start-up probe that makes the choice (``large_step_gemm``) is printed too.
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.common import bench_model, emit, set_threads, table
from kvserve.config import ModelConfig
from kvserve.kernels import amx
from kvserve.model.linear_ops import OneDNNOps, large_step_gemm

ROWS = (1, 8, 16, 32, 64, 128, 256, 1024)


def layer_shapes(cfg: ModelConfig) -> list[tuple[int, int]]:
    """(out, in) of one layer's matrices as the packing backend keeps them."""
    h, inter = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    return [(q + 2 * kv, h), (h, q), (inter, h), (inter, h), (h, inter)]


def time_pass(mats: list[torch.Tensor], xs: dict[int, torch.Tensor], how: str) -> float:
    """Best of three passes over ``mats``: "bf16" and "float32" through oneDNN, or the name of
    a kernel of ours (the matrices then in its tile layout)."""
    lp = torch.ops.mkldnn._linear_pointwise

    def once() -> None:
        for w in mats:
            if how == "float32":
                x = xs[w.shape[1]]
                lp(x.float(), w, None, "none", [], "").to(torch.bfloat16)
            elif how == "bf16":
                lp(xs[w.shape[1]], w, None, "none", [], "")
            else:
                amx.linear(xs[w.shape[1] * 32], w, kernel=how)

    once()  # oneDNN builds its primitives on the first call
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        once()
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--rows", default=",".join(map(str, ROWS)))
    args = ap.parse_args(argv)
    try:
        row_counts = [int(r) for r in args.rows.split(",")]
    except ValueError:
        row_counts = [0]
    if min(row_counts) < 1:
        ap.error(f"--rows: a comma list of integers >= 1, got {args.rows!r}")
    threads = set_threads()
    cfg = ModelConfig.from_pretrained(bench_model(args.model))
    shapes = layer_shapes(cfg) * cfg.num_hidden_layers
    gen = torch.Generator().manual_seed(0)
    dense = [torch.randn(n, k, generator=gen) * k**-0.5 for n, k in shapes]
    pack = torch.ops.mkldnn._reorder_linear_weight
    mats = {
        how: [pack(w.to(dt), OneDNNOps.PACK_ROWS) for w in dense]
        for how, dt in (("bf16", torch.bfloat16), ("float32", torch.float32))
    }
    kernel = "amx" if amx.available() else "avx512" if amx.avx512_available() else None
    bf16 = [w.to(torch.bfloat16) for w in dense]
    if kernel is not None and all(amx.packable(w) for w in bf16):
        mats[kernel] = [amx.pack(w) for w in bf16]
    else:
        kernel = None
    flops_per_row = 2 * sum(n * k for n, k in shapes)
    rows_out = []
    for m in row_counts:
        xs = {
            k: torch.randn(m, k, generator=gen).to(torch.bfloat16) for k in {k for _, k in shapes}
        }
        t = {how: time_pass(mt, xs, how) for how, mt in mats.items()}
        row = {"rows": m}
        row.update({f"{how} ms": v * 1e3 for how, v in t.items()})
        row.update({f"{how} GFLOP/s": m * flops_per_row / v / 1e9 for how, v in t.items()})
        if kernel is None:
            row["bf16 / float32 time"] = t["bf16"] / t["float32"]
        else:
            row[f"bf16 / {kernel}"] = t["bf16"] / t[kernel]
            row[f"float32 / {kernel}"] = t["float32"] / t[kernel]
        rows_out.append(row)
    probe = large_step_gemm(kernel)
    if probe is None:
        choice = "bf16 throughout"
    else:
        rows, dtype = probe
        path = "float32" if dtype == torch.float32 else "oneDNN's bf16"
        choice = f"{path} from {rows} rows"
    print(f"model {args.model}: {cfg.num_hidden_layers} layers x {len(layer_shapes(cfg))} "
          f"matrices, {threads} threads, bf16 activations; AVX512-BF16 "
          f"{torch.cpu._is_avx512_bf16_supported()}, AMX {torch.cpu._is_amx_tile_supported()}; "
          f"kvserve's bf16 kernel: {kernel or 'none'}; start-up choice: {choice}")  # fmt: skip
    print(table(rows_out, list(rows_out[0])))
    emit({"benchmark": "gemm_dtypes", "model": args.model, "start_up_choice": choice,
          "rows": rows_out})  # fmt: skip


if __name__ == "__main__":
    main()
