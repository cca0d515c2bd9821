"""What a retention policy's selection costs in compute, against the full cache on the same
engine build, in one run: prefill time (SnapKV's scoring and compaction, H2O's attention with
probabilities) and decode step time (H2O's mass accumulation and compactions).

Each pass runs the same seeded prompts once per policy, in alternating order, twice: with
``max_tokens=1`` (the prefill, timed whole) and with ``1 + --decode`` tokens, stepping the
engine and timing every step after the last prompt's prefill (the decode step is their mean,
so H2O's compactions, one step in a block's worth, are in it; a difference of two whole runs
was too noisy once prefill dominates them). The table gives medians over the passes and
ratios to the full cache. The targets: SnapKV's selection at most 10 % of prefill,
H2O's scoring at most 15 % of a decode step. A policy's decode step also attends to fewer
entries than the full cache, so the SnapKV row (same kept size, the fused kernel) is the fair
baseline for H2O's scoring.

    .venv/bin/python -m benchmarks.retention_cost [--model smollm2] [--prompt 4096]
"""

from __future__ import annotations

import argparse
import itertools

from benchmarks.common import bench_model, emit, median, random_prompts, set_threads, table, timed
from kvserve import LLM, SamplingParams
from kvserve.config import EngineConfig
from kvserve.config_fields import default_of

_IDS = itertools.count()


def decode_step(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> float:
    """Mean seconds of the engine's steps once every prompt has its first token."""
    engine = llm.engine
    ids = [f"cost-{next(_IDS)}" for _ in prompts]
    for rid, prompt in zip(ids, prompts, strict=True):
        engine.add_request(rid, prompt, params)
    live = engine.core.scheduler.requests
    times: list[float] = []
    while engine.has_unfinished_requests():
        decoding = all(live[r].num_output_tokens > 0 for r in ids if r in live)
        t, _ = timed(engine.step)
        if decoding:
            times.append(t)
    return sum(times) / len(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prompt", type=int, default=4096, help="tokens per prompt")
    ap.add_argument("--num-prompts", type=int, default=2)
    ap.add_argument("--passes", type=int, default=5)
    ap.add_argument("--chunk", type=int, default=default_of(EngineConfig, "max_num_batched_tokens"),
                    help="max_num_batched_tokens (default: %(default)s, the engine's)")  # fmt: skip
    ap.add_argument("--decode", type=int, default=32, help="decode steps timed per pass")
    ap.add_argument("--policies", default="none;snapkv:512;h2o:544;snapkv:25%")
    args = ap.parse_args()
    threads = set_threads()
    model = bench_model(args.model)
    llm = LLM(model, dtype=args.dtype, max_model_len=args.prompt + args.decode + 8,
              max_num_batched_tokens=args.chunk, enable_prefix_caching=False)  # fmt: skip
    vocab = llm.engine.model_config.vocab_size
    prompts = random_prompts(args.num_prompts, args.prompt, args.prompt, vocab, seed=1)
    policies = args.policies.split(";")

    def params(p: str, n: int) -> SamplingParams:
        return SamplingParams(max_tokens=n, ignore_eos=True, kv_retention=p)

    llm.generate(prompts[:1], params(policies[0], 2))  # warm-up
    prefill: dict[str, list[float]] = {p: [] for p in policies}
    step: dict[str, list[float]] = {p: [] for p in policies}
    for i in range(args.passes):
        order = policies if i % 2 == 0 else policies[::-1]
        for p in order:
            t1, _ = timed(lambda p=p: llm.generate(prompts, params(p, 1)))
            prefill[p].append(t1)
            step[p].append(decode_step(llm, prompts, params(p, 1 + args.decode)))
    base_p, base_d = median(prefill[policies[0]]), median(step[policies[0]])
    rows = []
    for p in policies:
        mp, md = median(prefill[p]), median(step[p])
        rows.append({"policy": p if p != "none" else "full cache", "prefill s": mp,
                     "prefill vs full": mp / base_p, "decode step ms": 1000 * md,
                     "step vs full": md / base_d})  # fmt: skip
    print(
        f"{model}; {args.dtype}; {threads} threads; {args.num_prompts} prompts of "
        f"{args.prompt} tokens, chunk {args.chunk}; {args.decode} decode steps; {args.passes} "
        f"passes (medians)"
    )
    print(table(rows, ["policy", "prefill s", "prefill vs full", "decode step ms",
                       "step vs full"]))  # fmt: skip
    emit({r["policy"]: [r["prefill vs full"], r["step vs full"]] for r in rows})


if __name__ == "__main__":
    main()
