"""Where an engine step's time goes, prefill and decode apart, each part against its bound.

    python -m benchmarks.profile_steps --model 50m --dtype bfloat16
    python -m benchmarks.profile_steps --model smollm2 --dtype bfloat16 --num-prompts 32

The throughput benchmark's workload (prompts of 128-1,024 tokens, ignore_eos) runs through
``LLM`` with timers around each part of the step (the CPU is synchronous, so a wall-clock timer
around a call is that call's time): the model's ops (linear layers, the fused SwiGLU, norms,
rotary), paged attention (the KV write included; its prefill kernel separately), the LM head,
sampling, the runner's batch building and KV record, the scheduler, and the engine's output
processing (detokenization). A step is "prefill" when it computes any prompt token. Bounds:
GEMMs at this CPU's measured GEMM peak for the dtype (a 2,048 x hidden x 3 hidden matmul, best
of several), that of the large steps' dtype for prefill steps when a bf16 model runs its
large GEMMs on another path (``UpcastOps``: oneDNN in float32 or bf16), and never below the
time to read every weight matrix once per step at the measured read bandwidth (what bounds a
decode step's GEMMs); decode attention at the measured read bandwidth; host work
(scheduling, batch building, sampling, output) at zero.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from typing import Any

import torch

from benchmarks.common import bench_model, emit, random_prompts, set_threads, table, vocab_size
from kvserve.config import EngineConfig
from kvserve.config_fields import default_of
from kvserve.model.linear_ops import UpcastOps
from kvserve.sim.calibrate import measure_gemm_peak
from kvserve.worker.bandwidth import measure_peak_bandwidth

# norm_linear / norm_swiglu_add: a projection with the RMSNorm before it, which the packed
# kernels apply as they read the rows; counted with the GEMMs, the norm included.
PARTS = ("linear", "linear_add", "swiglu_add", "norm_linear", "norm_swiglu_add", "rms_norm",
         "rotary")  # fmt: skip


class Timers:
    """Wall-clock timers around methods, summed per (phase, key). An ``exclusive`` timer
    called inside another exclusive one counts nothing of its own: the LM head calls the
    ops' ``linear``, and an ops method may call another, and each second counts once."""

    def __init__(self) -> None:
        self.acc: dict[str, float] = defaultdict(float)
        self.phase = "decode"
        self.busy = False  # an exclusive timer is running

    def wrap(self, obj: Any, name: str, key: str, exclusive: bool = False) -> None:
        fn = getattr(obj, name)
        acc = self.acc

        def timed(*a: Any, **k: Any) -> Any:
            if exclusive and self.busy:
                return fn(*a, **k)
            self.busy = self.busy or exclusive
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                acc[(self.phase, key)] += time.perf_counter() - t0
                if exclusive:
                    self.busy = False

        setattr(obj, name, timed)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="50m")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument(
        "--budget",
        type=int,
        default=default_of(EngineConfig, "max_num_batched_tokens"),
        help="max_num_batched_tokens (default: %(default)s, the engine's)",
    )
    ap.add_argument(
        "--lazy-pool",
        action="store_true",
        help="leave the KV pool unmapped until first written (the engine's default): the KV "
        "write rows then include a page fault per 4 KiB of new KV",
    )
    args = ap.parse_args()
    threads = set_threads()
    from kvserve import LLM, SamplingParams

    path = bench_model(args.model)
    prompts = random_prompts(args.num_prompts, 128, 1024, vocab_size(args.model), seed=0)
    llm = LLM(
        path,
        dtype=args.dtype,
        max_num_seqs=len(prompts),
        enable_prefix_caching=False,
        max_num_batched_tokens=args.budget,
        kv_cache_prefault=not args.lazy_pool,  # as throughput.py runs it
    )
    e = llm.engine
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4))  # warm-up
    model, runner, core = e.executor.driver_worker.model, e.executor.driver_worker.runner, e.core
    t = Timers()
    for name in PARTS:  # every module of the model shares one ops object
        t.wrap(model.ops, name, name, exclusive=True)
    attention = runner.attention  # one backend object serves every layer
    t.wrap(attention, "causal_prefill", "prefill attention kernel")
    t.wrap(attention, "context_prefill", "context attention kernel")
    t.wrap(attention, "forward", "attention (+KV write)")
    for name in ("decode", "fused_group"):
        t.wrap(attention, name, f"attention.{name}")
    storage = e.executor.driver_worker.storage
    for name in ("write", "gather"):
        t.wrap(storage, name, f"storage.{name}")
    t.wrap(model, "forward", "model forward")
    t.wrap(model, "logits", "LM head", exclusive=True)  # its linear is not counted again
    t.wrap(runner, "sampler", "sampling")
    t.wrap(runner, "_prepare", "batch building")
    t.wrap(runner, "_apply_kv_ops", "KV record")
    t.wrap(runner, "execute_model", "runner")
    t.wrap(core.scheduler, "schedule", "schedule")
    t.wrap(core.scheduler, "update_from_output", "update")

    sp = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    for p in prompts:
        e.add_request(None, p, sp)
    steps = {"prefill": 0, "decode": 0}
    wall = defaultdict(float)
    tokens = defaultdict(int)
    head_rows = defaultdict(int)  # rows the LM head computes (sampled positions only)
    kv_entries = 0
    t_all = time.perf_counter()
    while e.has_unfinished_requests():
        prefill = any(r.num_computed_tokens < r.num_prompt_tokens for r in e.scheduler.running)
        prefill = prefill or bool(e.scheduler.waiting)
        t.phase = "prefill" if prefill else "decode"
        if not prefill:
            kv_entries += sum(r.num_computed_tokens + 1 for r in e.scheduler.running)
        t0 = time.perf_counter()
        e.step()
        wall[t.phase] += time.perf_counter() - t0
        s = e.stats()
        tokens[t.phase] += s.step_prefill_tokens + s.step_decode_tokens
        head_rows[t.phase] += sum(len(q.sample_ids) for q in core.last_step.seqs)
        steps[t.phase] += 1
    total = time.perf_counter() - t_all

    cfg = e.model_config
    dt = getattr(torch, args.dtype)
    peak_flops = measure_gemm_peak(dt, cfg.hidden_size)
    # a bf16 model on UpcastOps runs prefill-sized GEMMs on oneDNN in float32 or bf16: their
    # bound is that dtype's
    upcast = isinstance(model.ops, UpcastOps) and model.ops.large_step_rows > 0
    large = model.ops.large_step_dtype if upcast else dt
    prefill_peak = measure_gemm_peak(large, cfg.hidden_size) if large != dt else peak_flops
    bw = measure_peak_bandwidth(torch.device("cpu"))
    # every matrix of the layers (a packing backend keeps the up projection apart)
    layer_params = sum(p.numel() for n, p in model.named_parameters()
                       if n.startswith("layers.") and "proj" in n)  # fmt: skip
    head_params = model.lm_head.weight.numel()
    weight_bytes = (layer_params + head_params) * dt.itemsize  # read by every step's GEMMs
    rows = []
    for phase in ("prefill", "decode"):
        a = {k: v for (ph, k), v in t.acc.items() if ph == phase}
        fused = ("norm_linear", "norm_swiglu_add")
        gemm = sum(a.get(k, 0.0) for k in ("linear", "linear_add", "swiglu_add", *fused, "LM head"))
        attn = a.get("attention (+KV write)", 0.0)
        norms = a.get("rms_norm", 0.0) + a.get("rotary", 0.0)
        fwd = a.get("model forward", 0.0)
        other_model = fwd - (gemm - a.get("LM head", 0.0)) - attn - norms
        runner_t = a.get("runner", 0.0)
        runner_rest = runner_t - fwd - a.get("LM head", 0.0) - a.get("sampling", 0.0)
        sched = a.get("schedule", 0.0) + a.get("update", 0.0)
        output = wall[phase] - runner_t - sched
        gemm_flops = 2 * (tokens[phase] * layer_params + head_rows[phase] * head_params)
        gemm_bound = max(gemm_flops / (prefill_peak if phase == "prefill" else peak_flops),
                         steps[phase] * weight_bytes / bw)  # fmt: skip
        kv_bound = kv_entries * e.bytes_per_token / bw if phase == "decode" else None
        parts = [
            ("GEMMs (linear, SwiGLU, LM head, fused norms)", gemm, gemm_bound),
            ("attention incl. KV write", attn, kv_bound),
            (
                "  of it: prefill kernel (chunks starting a prompt)",
                a.get("prefill attention kernel", 0.0),
                None,
            ),
            (
                "  of it: context kernel (chunks continuing one)",
                a.get("context attention kernel", 0.0),
                None,
            ),
            ("  of it: KV write", a.get("storage.write", 0.0), None),
            (
                "  of it: decode kernel",
                a.get("attention.decode", 0.0) + a.get("attention.fused_group", 0.0),
                None,
            ),
            ("  of it: cache gather (continuing chunks)", a.get("storage.gather", 0.0), None),
            ("norms + rotary", norms, None),
            ("embedding, residual views (rest of forward)", other_model, None),
            ("sampling", a.get("sampling", 0.0), 0.0),
            ("batch building + KV record + rows", runner_rest, 0.0),
            ("scheduler (schedule + update)", sched, 0.0),
            ("output processing (detokenize, stops)", output, 0.0),
        ]
        for name, sec, bound in parts:
            rows.append({
                "phase": phase, "part": name, "s": sec,
                "share": sec / wall[phase] if wall[phase] else 0.0,
                "ms/step": 1000 * sec / max(steps[phase], 1),
                "bound s": "-" if bound is None else f"{bound:.3f}",
            })  # fmt: skip
        rows.append({"phase": phase, "part": "step total", "s": wall[phase], "share": 1.0,
                     "ms/step": 1000 * wall[phase] / max(steps[phase], 1),
                     "bound s": "-"})  # fmt: skip
    n_out = args.num_prompts * args.max_tokens
    print(
        f"model {args.model}, {args.dtype}, {threads} threads; {args.num_prompts} prompts of "
        f"128-1024 tokens, {args.max_tokens} out; {n_out / total:.1f} out tok/s; steps: "
        f"prefill {steps['prefill']} ({tokens['prefill']} tokens), decode {steps['decode']}; "
        f"GEMM peak {peak_flops / 1e9:.0f} GFLOP/s"
        + (
            f" ({str(large).removeprefix('torch.')} in prefill: {prefill_peak / 1e9:.0f})"
            if upcast
            else ""
        )
        + f", read bandwidth {bw / 1e9:.1f} GB/s; KV pool "
        + ("lazily mapped" if args.lazy_pool else "faulted in at start")
    )
    print(table(rows, ["phase", "part", "s", "share", "ms/step", "bound s"]))
    emit({"benchmark": "profile_steps", "model": args.model, "dtype": args.dtype,
          "out_tok_s": n_out / total, "gemm_gflops": peak_flops / 1e9,
          "read_gbps": bw / 1e9, "rows": rows})  # fmt: skip


if __name__ == "__main__":
    main()
