"""The CPU fast path's native kernels (RMSNorm, rotary, causal prefill attention) against their
PyTorch references, per op and end to end.

Per op, in ``--dtype`` (bfloat16 by default), at the 50 M model's shape (hidden 512, 8 query
and 4 KV heads of 64): RMSNorm and rotary for a decode step (64 tokens) and a prefill chunk
(2,048 tokens), and the causal attention of one prompt of 256-1,024 tokens against SDPA;
reference and kernel timed alternately in every round. End to end: the throughput workload
(``benchmarks/throughput.py``'s prompts, 128 output tokens, ignore_eos) on one engine whose
backend is switched between the fast path without the native kernels (oneDNN matmuls only),
with RMSNorm and rotary, and with all three, passes alternating so that drift cancels in the
per-pass ratios.

    .venv/bin/python -m benchmarks.fast_path [--quick] [--sizes 5m,50m] [--passes 3] [--dtype D]
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.common import (
    MODELS,
    bench_model,
    emit,
    median,
    random_prompts,
    set_threads,
    table,
    vocab_size,
)
from kvserve.attention.cpu_backend import CpuBackend
from kvserve.attention.torch_backend import TorchBackend
from kvserve.model.linear_ops import OneDNNOps, TorchOps


class MatmulsOnly(OneDNNOps):
    """The CPU fast path with its native RMSNorm and rotary replaced by their references."""

    rms_norm = TorchOps.rms_norm
    rotary = TorchOps.rotary


class SdpaPrefill(CpuBackend):
    """The CPU attention backend with SDPA for chunks that start a sequence."""

    causal_prefill = TorchBackend.causal_prefill


# (linear ops, attention backend) of each variant
VARIANTS = {
    "matmuls only": (MatmulsOnly, SdpaPrefill),
    "+ norm, rotary": (OneDNNOps, SdpaPrefill),
    "+ prefill": (OneDNNOps, CpuBackend),
}


def _time_pair(ref, fast, rounds: int) -> dict:
    t = {"ref": [], "fast": []}
    with torch.inference_mode():
        for _ in range(rounds):
            for side, fn in (("ref", ref), ("fast", fast)):
                t0 = time.perf_counter()
                fn()
                t[side].append(time.perf_counter() - t0)
    ratios = [a / b for a, b in zip(t["ref"], t["fast"], strict=True)]
    return {"reference ms": median(t["ref"]) * 1e3, "kernel ms": median(t["fast"]) * 1e3,
            "speed-up": median(ratios)}  # fmt: skip


def prefill_op(tokens: int, rounds: int, dtype: torch.dtype) -> dict:
    import torch.nn.functional as F

    from kvserve.kernels import prefill

    qkv = torch.randn(tokens, 1024, dtype=dtype)
    q, k, v = (x.view(tokens, -1, 64) for x in qkv.split([512, 256, 256], dim=-1))
    out = torch.empty(tokens, 8, 64, dtype=dtype)
    if not prefill.prefill_attention(q, k, v, out, None):
        raise SystemExit("prefill attention: no native kernel (no C compiler or no AVX-512?)")

    def sdpa():
        qt, kt, vt = (x.transpose(0, 1)[None] for x in (q, k, v))
        F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True)

    row = _time_pair(sdpa, lambda: prefill.prefill_attention(q, k, v, out, None), rounds)
    return {"op": "prefill attention", "tokens": tokens, **row}


def per_op(rounds: int, dtype: torch.dtype) -> list[dict]:
    from kvserve.config import ModelConfig
    from kvserve.model.llama import RMSNorm, RotaryEmbedding

    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=64, hidden_size=512,
                      intermediate_size=8, num_hidden_layers=1, num_attention_heads=8,
                      num_key_value_heads=4, head_dim=64, rms_norm_eps=1e-5,
                      max_position_embeddings=4096)  # fmt: skip
    rot = RotaryEmbedding(cfg, 4096, torch.device("cpu"))
    norm = RMSNorm(512, 1e-5).to(dtype)
    ref, fast = TorchOps(), OneDNNOps()
    rows = []
    for tokens in (64, 2048):
        x = torch.randn(tokens, 512, dtype=dtype)
        qkv = torch.randn(tokens, 1024, dtype=dtype)
        q, k, _ = qkv.split([512, 256, 256], dim=-1)
        q, k = q.view(tokens, 8, 64), k.view(tokens, 4, 64)
        pos = torch.arange(tokens)
        cases = {
            "rms_norm": (lambda o, x=x: o.rms_norm(norm, x)),
            "rotary": (lambda o, pos=pos, q=q, k=k: o.rotary(rot, pos, q, k)),
        }
        for name, fn in cases.items():
            row = _time_pair(lambda fn=fn: fn(ref), lambda fn=fn: fn(fast), rounds)
            rows.append({"op": name, "tokens": tokens, **row})
    rows += [prefill_op(n, max(3, rounds // 10), dtype) for n in (256, 512, 1024)]
    return rows


def end_to_end(size: str, n: int, max_tokens: int, passes: int, dtype: str) -> dict:
    from kvserve import LLM, SamplingParams

    prompts = random_prompts(n, 128, 1024, vocab_size(size), seed=0)
    llm = LLM(bench_model(size), dtype=dtype, max_num_seqs=n, max_num_batched_tokens=2048,
              enable_prefix_caching=False)  # fmt: skip
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4))  # warm-up, builds
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    tok_s: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for _ in range(passes):
        for name, (ops, attention) in VARIANTS.items():
            llm.engine.executor.driver_worker.model.set_ops(ops())
            llm.engine.executor.driver_worker.model.set_attention_backend(attention())
            t0 = time.perf_counter()
            outs = llm.generate(prompts, sp)
            dt = time.perf_counter() - t0
            tok_s[name].append(sum(len(o.outputs[0].token_ids) for o in outs) / dt)
    base = tok_s["matmuls only"]
    row: dict = {"model": size}
    for name, xs in tok_s.items():
        row[f"{name} tok/s"] = median(xs)
        if name != "matmuls only":
            row[f"{name} x"] = median([b / a for a, b in zip(base, xs, strict=True)])
    return row


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sizes", default=None, help="comma list of 5m,50m")
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    args = ap.parse_args(argv)
    if args.passes < 1:
        ap.error(f"--passes must be >= 1, got {args.passes}")
    sizes = (args.sizes or ("5m" if args.quick else "5m,50m")).split(",")
    if unknown := [s for s in sizes if s not in MODELS]:
        ap.error(f"--sizes: unknown {unknown}; allowed: {sorted(MODELS)}")
    threads = set_threads()
    print(f"threads {threads}, {args.dtype}")
    ops = per_op(20 if args.quick else 100, getattr(torch, args.dtype))
    print(table(ops, list(ops[0])))
    n, max_tokens = (16, 32) if args.quick else (64, 128)
    passes = 1 if args.quick else args.passes
    e2e = [end_to_end(s, n, max_tokens, passes, args.dtype) for s in sizes]
    print(f"\n{n} prompts of 128-1,024 tokens, {max_tokens} output tokens, {passes} passes")
    print(table(e2e, list(e2e[0])))
    emit({"ops": {f"{r['op']}@{r['tokens']}": round(r["speed-up"], 3) for r in ops},
          "end_to_end": {r["model"]: round(r["+ prefill x"], 3) for r in e2e},
          "dtype": args.dtype})  # fmt: skip


if __name__ == "__main__":
    main()
