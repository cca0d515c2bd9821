"""The engine on a GPU against its roofline and against ``transformers``: a random model of
Llama-3.2-1B's shape, a batch of prompts decoded to a fixed length (EOS ignored), with bf16
and fp8 KV, eagerly and with CUDA graphs, and ``transformers``' ``generate`` on the same card.

    python -m benchmarks.gpu_engine                       # on a GPU: the issue's settings
    python -m benchmarks.gpu_engine --device cpu --shape tiny --batch 2 --prompt 16 \\
        --output 4 --modes eager                          # the CPU smoke run

Per run: output tokens/s, the median decode step (every request decoding one token), its
roofline (weight bytes + the KV bytes the step reads, over the measured copy bandwidth) and
the share of it reached, host time per decode step (the step's wall time less the device's
kernel time in a profiled window), how often a decode step waits for the device (once is
the design: the sampled tokens), the pool's size (sized by --gpu-memory-utilization on CUDA)
and the graphs' capture report. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import gc
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import MODEL_CACHE, copy_bandwidth, emit, median, random_prompts, sync

# Llama-3.2-1B's config.json (meta-llama/Llama-3.2-1B), weights random; "tiny" for smoke runs
SHAPES: dict[str, dict[str, Any]] = {
    "1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16,
               num_heads=32, num_kv_heads=8, head_dim=64, tie_word_embeddings=True,
               rope_theta=500000.0, max_position_embeddings=131072),
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                 num_heads=4, num_kv_heads=2, max_position_embeddings=2048),
}  # fmt: skip
MODES = ("eager", "graphs")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="cuda (the measurement) or cpu (a smoke run)")
    p.add_argument("--shape", default="1b", choices=sorted(SHAPES))
    p.add_argument("--dtype", default=None, help="compute dtype (default: bfloat16 on CUDA, "
                   "float32 on a CPU)")  # fmt: skip
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt", type=int, default=512, help="tokens per prompt")
    p.add_argument("--output", type=int, default=256, help="tokens generated per request")
    p.add_argument("--kv", default="auto,fp8", help="KV formats, comma-separated")
    p.add_argument("--modes", default="eager,graphs", help="eager, graphs or both")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--profile-steps", type=int, default=5,
                   help="decode steps profiled for the device's kernel time")  # fmt: skip
    p.add_argument("--bandwidth-mib", type=int, default=256,
                   help="bytes the copy-bandwidth probe copies")  # fmt: skip
    p.add_argument("--no-hf", action="store_true", help="skip transformers' generate")
    args = p.parse_args(argv)
    for name in ("batch", "prompt", "output"):
        if getattr(args, name) < 1:
            p.error(f"--{name}: must be >= 1, got {getattr(args, name)}")
    if not 0 < args.gpu_memory_utilization <= 1:
        p.error(f"--gpu-memory-utilization: must be in (0, 1], got {args.gpu_memory_utilization}")
    args.kv = [k for k in args.kv.split(",") if k]
    args.modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in args.modes if m not in MODES]
    if bad or not args.modes:
        p.error(f"--modes: each one of {', '.join(MODES)}, got {bad or args.modes}")
    if "graphs" in args.modes and args.device != "cuda":
        p.error("--modes graphs: CUDA graphs run only with --device cuda")
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    return args


def model_dir(shape: str, dtype: str) -> str:
    """The random checkpoint of ``shape`` (built once, then cached)."""
    from kvserve.model.synthetic import make_random_checkpoint

    path = Path(MODEL_CACHE) / f"gpu-{shape}-{dtype}"
    if not (path / "model.safetensors").exists():
        make_random_checkpoint(path, seed=0, init_std=0.02, dtype=dtype, **SHAPES[shape])
    return str(path)


def device_kernel_seconds(fn: Any, steps: int) -> float:
    """The device's kernel time per call of ``fn`` over ``steps`` calls (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
    us = sum(e.self_device_time_total for e in prof.key_averages())
    return us / 1e6 / steps


def syncs_per_call(fn: Any, calls: int) -> float:
    """How often per call of ``fn`` the host waited for the device: torch's sync debug mode
    warns at every synchronizing CUDA operation (a value read, a blocking copy)."""
    import warnings

    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(calls):
                fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught) / calls


def run_engine(args: argparse.Namespace, path: str, kv: str, mode: str,
               prompts: list[list[int]], bandwidth: float) -> dict[str, Any]:  # fmt: skip
    from kvserve import LLM, SamplingParams

    llm = LLM(path, device=args.device, dtype=args.dtype, kv_cache_dtype=kv,
              enforce_eager=mode == "eager", max_num_seqs=args.batch,
              max_model_len=args.prompt + args.output, enable_prefix_caching=False,
              gpu_memory_utilization=args.gpu_memory_utilization)  # fmt: skip
    engine = llm.engine
    sp = SamplingParams(temperature=0, max_tokens=args.output, ignore_eos=True)
    llm.generate([prompts[0][:8]], SamplingParams(temperature=0, max_tokens=4))  # warm-up
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, sp)
    decode, t0 = [], time.perf_counter()
    profiled = syncs = None
    while engine.has_unfinished_requests():
        last = engine.core.last_step
        in_decode = last is not None and last.num_prefill_tokens == 0 and decode
        if in_decode and profiled is None and args.device == "cuda" and args.profile_steps:
            profiled = device_kernel_seconds(engine.step, args.profile_steps)
            syncs = syncs_per_call(engine.step, args.profile_steps)
            continue
        ts = time.perf_counter()
        engine.step()
        sync(args.device)
        dt = time.perf_counter() - ts
        last = engine.core.last_step
        if last.num_prefill_tokens == 0 and last.num_decode_tokens:
            decode.append(dt)
    wall = time.perf_counter() - t0
    step = median(decode)
    info = engine.worker_info
    kv_read = args.batch * (args.prompt + args.output / 2) * engine.bytes_per_token
    roofline = (info.weight_bytes + kv_read) / bandwidth
    row = {
        "kv": engine.kv_cache_dtype, "mode": mode,
        "output_tok_s": args.batch * args.output / wall,
        "decode_step_ms": step * 1e3, "roofline_ms": roofline * 1e3,
        "roofline_share": roofline / step if step == step else None,
        "pool_gib": engine.num_blocks * engine.block_size * engine.bytes_per_token / 2**30,
        "num_blocks": engine.num_blocks, "memory_budget": info.memory_budget,
        "cuda_graphs": info.cuda_graphs,
    }  # fmt: skip
    if profiled is not None:
        row["device_ms_per_step"] = profiled * 1e3
        row["host_ms_per_step"] = max(0.0, step - profiled) * 1e3
        row["host_syncs_per_decode_step"] = syncs
    engine.shutdown()  # the next run sizes its pool from what this one leaves: nothing
    del llm, engine
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return row


def run_hf(args: argparse.Namespace, path: str, prompts: list[list[int]]) -> dict[str, Any]:
    """``transformers``' ``generate`` on the same batch (greedy, a fixed length)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=getattr(torch, args.dtype))
    model = model.to(args.device).eval()
    ids = torch.tensor(prompts, device=args.device)
    kw = dict(max_new_tokens=args.output, min_new_tokens=args.output, do_sample=False,
              attention_mask=torch.ones_like(ids), pad_token_id=0)  # fmt: skip
    with torch.inference_mode():
        model.generate(ids[:, :8], **{**kw, "max_new_tokens": 4, "min_new_tokens": 4})
        sync(args.device)
        t0 = time.perf_counter()
        model.generate(ids, **kw)
        sync(args.device)
    wall = time.perf_counter() - t0
    del model
    return {"output_tok_s": args.batch * args.output / wall}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.manual_seed(0)
    path = model_dir(args.shape, args.dtype)
    vocab = SHAPES[args.shape]["vocab_size"]
    prompts = random_prompts(args.batch, args.prompt, args.prompt, vocab, seed=0)
    bandwidth = copy_bandwidth(args.bandwidth_mib * 2**20, device=args.device)
    rows = [run_engine(args, path, kv, mode, prompts, bandwidth)
            for kv in args.kv for mode in args.modes]  # fmt: skip
    summary: dict[str, Any] = {
        "bench": "gpu_engine", "device": args.device, "shape": args.shape, "dtype": args.dtype,
        "batch": args.batch, "prompt": args.prompt, "output": args.output,
        "copy_bandwidth_gbs": bandwidth / 1e9, "runs": rows,
    }  # fmt: skip
    if args.device == "cuda":
        summary["card"] = torch.cuda.get_device_name()
    if not args.no_hf:
        hf = run_hf(args, path, prompts)
        summary["transformers_tok_s"] = hf["output_tok_s"]
        summary["best_vs_transformers"] = max(r["output_tok_s"] for r in rows) / hf["output_tok_s"]
    for r in rows:
        print({k: v for k, v in r.items() if k not in ("memory_budget",)})
    emit(summary)
    return summary


if __name__ == "__main__":
    main()
