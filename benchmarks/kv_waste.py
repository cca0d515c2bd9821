"""How much allocated KV memory holds no token: paged blocks vs max-length reservation.

A mixed trace (varied prompt and output lengths) runs through the engine at block size 16.
After every step we read the pool: slots allocated (blocks in use x block size) and slots
holding a computed token. Waste = 1 - held / allocated, averaged over steps. Beside it, the
same steps under Orca-style reservation, where each running request reserves max_model_len
slots up front. Prefix caching is off so that sharing does not flatter the paged figure.

    .venv/bin/python benchmarks/kv_waste.py [--quick]
"""

from __future__ import annotations

import argparse
import random

from benchmarks.common import bench_model, emit, median, set_threads, table
from kvserve.config import EngineConfig
from kvserve.config_fields import default_of


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=default_of(EngineConfig, "block_size"))
    ap.add_argument("--max-model-len", type=int, default=2048)
    args = ap.parse_args()
    set_threads()
    from kvserve import LLM, SamplingParams

    n = 64 if args.quick else args.requests
    rng = random.Random(0)
    prompts, params = [], []
    for _ in range(n):
        plen = rng.choice([rng.randint(8, 64), rng.randint(64, 512), rng.randint(512, 1500)])
        olen = rng.choice([rng.randint(4, 32), rng.randint(32, 200), rng.randint(200, 500)])
        olen = min(olen // 3 if args.quick else olen, args.max_model_len - plen)
        prompts.append([rng.randrange(4096) for _ in range(plen)])
        params.append(SamplingParams(temperature=0, max_tokens=olen, ignore_eos=True))

    llm = LLM(bench_model("5m"), dtype="float32", block_size=args.block_size,
              max_num_seqs=64, max_model_len=args.max_model_len,
              enable_prefix_caching=False)  # fmt: skip
    engine = llm.engine
    for p, sp in zip(prompts, params, strict=True):
        engine.add_request(None, p, sp)
    paged, reserved = [], []
    while engine.has_unfinished_requests():
        engine.step()
        s = engine.stats()
        if not s.token_slots_allocated:
            continue
        paged.append(1 - s.token_slots_held / s.token_slots_allocated)
        running = engine.scheduler.running
        held = sum(r.num_computed_tokens for r in running)
        reserved.append(1 - held / (len(running) * args.max_model_len) if running else 0.0)

    waste, res = sum(paged) / len(paged), sum(reserved) / len(reserved)
    rows = [
        {"scheme": f"paged, block {args.block_size}", "mean waste": waste,
         "median": median(paged), "max": max(paged)},
        {"scheme": f"reserve max_model_len ({args.max_model_len})", "mean waste": res,
         "median": median(reserved), "max": max(reserved)},
    ]  # fmt: skip
    print(f"{n} requests, {len(paged)} steps, block size {args.block_size}")
    print(table(rows, ["scheme", "mean waste", "median", "max"]))
    emit({"waste": round(waste, 5), "reservation_waste": round(res, 5), "steps": len(paged),
          "requests": n, "block_size": args.block_size})  # fmt: skip


if __name__ == "__main__":
    main()
