"""How many 4,096-token sequences one fixed ``kv_cache_memory`` holds at once, per retention
policy and KV format: the memory a retention policy gives back, counted by the engine's own
scheduler and pool.

The model never runs: the engine is built for the model's real KV geometry (bytes per token,
so the same pool size in blocks as a real run) with a runner that returns a fixed token per
sampled sequence. What is measured is admission and preemption, which depend only on block
accounting (SnapKV's compaction is the scheduler's and the pool's too: only which entries it
keeps is the runner's). Every request has a 4,096-token prompt and decodes 256 tokens (so every held
sequence is 4,096-4,352 tokens long), prefilled in one 4,096-token chunk per step, so that the
pool, not the arrival of new prompts, bounds concurrency.

    .venv/bin/python -m benchmarks.retention_memory [--model smollm2] [--kv-cache-memory 2GiB]
"""

from __future__ import annotations

import argparse
import random

from benchmarks.common import bench_model, emit, table, vocab_size
from kvserve.config import CacheConfig, ConfigError, EngineConfig, SchedulerConfig
from kvserve.engine.llm_engine import LLMEngine
from kvserve.sched.output import ModelRunnerOutput, SchedulerOutput
from kvserve.sched.request import SamplingParams


class ConstantRunner:
    """Samples token 1 for every sequence that samples: block accounting without a model."""

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        ids = [rid for s in sched.seqs for rid in s.sample_ids]
        return ModelRunnerOutput(req_ids=ids, token_ids=[1] * len(ids), logprobs=[None] * len(ids))


def run(model: str, fmt: str, retention: str | None, args: argparse.Namespace) -> dict:
    config = EngineConfig(
        model=model,
        dtype="bfloat16",
        cache=CacheConfig(
            kv_cache_memory=args.kv_cache_memory,
            kv_cache_dtype=fmt,
            kv_retention=retention,
            enable_prefix_caching=False,
        ),  # fmt: skip
        scheduler=SchedulerConfig(
            max_num_seqs=args.requests,
            max_num_batched_tokens=args.chunk,
            max_model_len=args.prompt + args.max_tokens,
        ),  # fmt: skip
    )
    engine = LLMEngine(config, runner=ConstantRunner())
    rng = random.Random(0)
    vocab = vocab_size(args.model)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    for i in range(args.requests):
        prompt = [rng.randrange(vocab) for _ in range(args.prompt)]
        engine.add_request(str(i), prompt, params)
    peak_running = peak_decoding = steps = 0
    sched = engine.core.scheduler
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        peak_running = max(peak_running, len(sched.running))
        decoding = sum(1 for r in sched.running if r.num_computed_tokens >= r.num_prompt_tokens)
        peak_decoding = max(peak_decoding, decoding)
        engine.kv.check_invariants()
    s = engine.stats()
    return {"format": fmt, "policy": retention or "full cache", "blocks": engine.num_blocks,
            "peak running": peak_running, "peak decoding": peak_decoding,
            "preemptions": s.num_preemptions, "steps": steps,
            "blocks reclaimed": s.retention_reclaimed_blocks}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--kv-cache-memory", default="2GiB")
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--prompt", type=int, default=4096)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--chunk", type=int, default=4096, help="max_num_batched_tokens")
    ap.add_argument("--formats", default="auto,fp8_e4m3,kivi4")
    ap.add_argument("--policies", default="none;window:512;sinks:4,window:508;snapkv:512")
    args = ap.parse_args()
    model = bench_model(args.model)
    rows = []
    for fmt in args.formats.split(","):
        base = None
        for pol in args.policies.split(";"):
            try:
                row = run(model, fmt, None if pol == "none" else pol, args)
            except ConfigError as e:  # a policy the format cannot do (SnapKV on KIVI)
                print(f"[retention_memory] {fmt} {pol}: refused: {e}", flush=True)
                continue
            base = base or row["peak running"]
            row["vs full cache"] = row["peak running"] / base
            rows.append(row)
            print(f"[retention_memory] {fmt} {row['policy']}: {row['peak running']} running",
                  flush=True)  # fmt: skip
    print(
        f"{model}; kv_cache_memory {args.kv_cache_memory}; {args.requests} requests of "
        f"{args.prompt} prompt + {args.max_tokens} output tokens; chunk {args.chunk}"
    )
    cols = ["format", "policy", "blocks", "peak running", "vs full cache", "peak decoding",
            "preemptions", "steps", "blocks reclaimed"]  # fmt: skip
    print(table(rows, cols))
    emit({f"{r['format']} {r['policy']}": r["vs full cache"] for r in rows})


if __name__ == "__main__":
    main()
