"""Admission control under overload: greedy (admit while the next chunk fits, preempt when
decode runs out) against projected (admit only what fits its whole life; refuse what cannot
meet its SLO), each with and without workload classes.

    python -m benchmarks.admission --model kvserve-ref
    python -m benchmarks.admission --model 50m --num-prompts 200
    python -m benchmarks.admission --model kvserve-ref --burst    # same-step prefix sharing

The trace: short chats and long documents, bursty open-loop arrivals (gamma, burstiness 0.5)
at ``--overload`` times the rate the engine sustains on this machine (measured first, in this
run, as completed requests per second of the same trace sent all at once), into a KV pool that
holds ``--pool-long`` long requests. The SLO of each kind (chat, document) is set from the
unloaded latencies measured here too (``--slo-scale`` times the p50 TTFT of that kind and the
p50 TPOT of a light run), so the same command means the same thing on any CPU. With classes,
chats (priority 0) go before documents (priority 1), each class with its kind's SLO; every
request is kept in the report: finished, refused with a reason, or failed.

Columns: preemptions per 1,000 requests, goodput (requests per second that met the SLO),
attainment, p99 TTFT of the admitted, requests refused, and the document class's p99 queue
wait (its starvation bound).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.common import bench_model, emit, set_threads, table
from kvserve.bench.engine_target import EngineTarget
from kvserve.bench.metrics import meets_slo, percentile, server_summary, summarize
from kvserve.bench.runner import LoadSpec, run_load
from kvserve.bench.workloads import WorkloadSpec, make_workload
from kvserve.llm import LLM

BS = 16


def _classes(slo: dict[str, dict[str, float]], doc_min_tokens: int) -> dict[str, Any]:
    def ms(kind: str) -> dict[str, float]:
        return {"ttft_ms": 1000 * slo[kind]["ttft"], "tpot_ms": 1000 * slo[kind]["tpot"]}

    return {
        "classes": [
            {"name": "long-doc", "match": {"prompt_tokens": [doc_min_tokens, None]},
             "priority": 1, "slo": ms("long-doc"), "output_estimate": "learned"},
            {"name": "chat", "priority": 0, "slo": ms("chat"), "output_estimate": "learned"},
        ]
    }  # fmt: skip


def _run(kwargs: dict[str, Any], reqs: list, load: LoadSpec, seed: int) -> Any:
    target = EngineTarget(LLM(**kwargs).engine, temperature=0.0, ignore_eos=True)

    async def go() -> Any:
        await target.start()
        try:
            return await run_load(target, reqs, load, seed)
        finally:
            await target.aclose()

    return asyncio.run(go())


def burst(args: argparse.Namespace) -> None:
    """32 requests on one 512-token prefix, all at once: how many hit it, with followers
    held a step (the default) and without."""
    import random
    import time

    from benchmarks.common import vocab_size
    from kvserve import SamplingParams

    model, vocab = bench_model(args.model), vocab_size(args.model)
    rng = random.Random(args.seed)
    prefix = [rng.randrange(5, vocab) for _ in range(512)]
    prompts = [prefix + [rng.randrange(5, vocab) for _ in range(16)] for _ in range(32)]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    rows, outs = [], {}
    for hold in (False, True, False, True):  # twice each, back to back
        llm = LLM(model, dtype=args.dtype, num_gpu_blocks=2048)
        llm.engine.scheduler.config.hold_prefix_followers = hold
        llm.generate([prompts[0][:64]], SamplingParams(max_tokens=2))  # warm up, no overlap
        llm.reset_prefix_cache()
        t0 = time.perf_counter()
        res = llm.generate(prompts, params)
        wall = time.perf_counter() - t0
        ttfts = [o.metrics.first_token_time - o.metrics.arrival_time for o in res]
        s = llm.stats()
        outs.setdefault(hold, []).append([o.outputs[0].token_ids for o in res])
        rows.append({
            "followers": "held a step" if hold else "computed beside",
            "hits": sum(1 for o in res if o.num_cached_tokens >= 512),
            "prefill tokens computed": s.prefill_tokens_computed_total - 64,
            "wall s": wall,
            "TTFT p50 ms": 1000 * percentile(ttfts, 50),
            "TTFT p99 ms": 1000 * percentile(ttfts, 99),
        })  # fmt: skip
    assert outs[True][0] == outs[False][0], "holding followers changed outputs"
    print(f"model {args.model}, {args.dtype}: 32 requests, 512-token shared prefix + 16 "
          "unique, 16 output tokens, all at once, max_num_batched_tokens 2048")  # fmt: skip
    print(table(rows, ["followers", "hits", "prefill tokens computed", "wall s",
                       "TTFT p50 ms", "TTFT p99 ms"]))  # fmt: skip
    emit({"benchmark": "admission-burst", "model": args.model, "rows": rows})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="kvserve-ref")
    ap.add_argument("--num-prompts", type=int, default=160)
    ap.add_argument("--doc-share", type=float, default=0.25, help="share of long documents")
    ap.add_argument("--length-scale", type=float, default=0.5)
    ap.add_argument("--pool-long", type=float, default=3.0,
                    help="the KV pool holds this many long requests")  # fmt: skip
    ap.add_argument("--overload", type=float, default=2.0, help="x the sustainable rate")
    ap.add_argument("--burstiness", type=float, default=0.5)
    ap.add_argument("--slo-scale", type=float, default=4.0)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--burst", action="store_true", help="only the same-step prefix burst")
    args = ap.parse_args()
    threads = set_threads()
    if args.burst:
        burst(args)
        return
    model = bench_model(args.model)
    spec = WorkloadSpec(name="mixed", num_prompts=args.num_prompts, seed=args.seed,
                        length_scale=args.length_scale,
                        mix={"chat": 1 - args.doc_share, "long-doc": args.doc_share})  # fmt: skip
    probe = LLM(model, dtype=args.dtype, num_gpu_blocks=64)
    tok = probe.get_tokenizer()
    count = (lambda t: len(tok.encode(t))) if tok is not None else None
    reqs = make_workload(spec, count)
    del probe
    docs = [r for r in reqs if r.kind == "long-doc"]
    long_tokens = max(r.input_len + r.max_tokens for r in docs)
    num_blocks = math.ceil(args.pool_long * long_tokens / BS)
    base = dict(model=model, dtype=args.dtype, num_gpu_blocks=num_blocks, block_size=BS,
                max_num_seqs=64, seed=args.seed)  # fmt: skip

    # 1. The sustainable rate (everything at once, greedy) and the unloaded latencies.
    at_once = _run(base, reqs, LoadSpec(), args.seed)
    sustain = sum(r.success for r in at_once.records) / at_once.duration
    light = _run(base, reqs[:24], LoadSpec(request_rate=sustain / 4), args.seed)
    ok = [r for r in light.records if r.success]
    tpot0 = percentile([r.tpot for r in ok if r.tpot is not None], 50)
    slo = {
        kind: {"ttft": args.slo_scale * percentile([r.ttft for r in ok if r.kind == kind], 50),
               "tpot": args.slo_scale * tpot0}
        for kind in ("chat", "long-doc")
    }  # fmt: skip
    doc_min = min(r.input_len for r in docs)
    classes = Path(tempfile.mkdtemp()) / "classes.json"
    classes.write_text(json.dumps(_classes(slo, doc_min)))

    rate = args.overload * sustain
    load = LoadSpec(request_rate=rate, burstiness=args.burstiness)
    configs = {
        "greedy": {},
        "greedy+classes": dict(scheduling_policy="priority", workload_classes=str(classes)),
        "projected": dict(admission="projected"),
        "projected+classes": dict(admission="projected", scheduling_policy="priority",
                                  workload_classes=str(classes)),
    }  # fmt: skip
    rows, out = [], {}
    for name, extra in configs.items():
        res = _run({**base, **extra}, reqs, load, args.seed)
        s = summarize(res.records, res.duration)
        srv = server_summary(res.before, res.after, res.samples)
        admitted = [r for r in res.records if r.ttft is not None]
        doc_waits = [r.queue_time for r in res.records
                     if r.kind == "long-doc" and r.queue_time is not None]  # fmt: skip
        refused = [r for r in res.records if (r.reason or "").startswith("refused")]
        good = sum(1 for r in res.records if meets_slo(r, slo[r.kind]))
        row = {
            "config": name,
            "preempt/1k": 1000 * (srv["num_preemptions"] or 0) / len(reqs),
            "goodput req/s": good / res.duration,
            "attainment": good / len(reqs),
            "p99 TTFT ms": 1000 * percentile([r.ttft for r in admitted], 99),
            "refused chat/doc": f"{sum(r.kind == 'chat' for r in refused)}/"
            f"{sum(r.kind == 'long-doc' for r in refused)}",
            "doc p99 wait s": percentile(doc_waits, 99) if doc_waits else float("nan"),
            "out tok/s": s["output_throughput"],
        }
        rows.append(row)
        out[name] = row
    g = out["greedy"]
    for r in rows:
        r["goodput x"] = r["goodput req/s"] / g["goodput req/s"] if g["goodput req/s"] else 0
    print(f"model {args.model}, {args.dtype}, {threads} threads; {len(reqs)} requests "
          f"({len(docs)} long documents up to {long_tokens} tokens), pool {num_blocks} blocks "
          f"of {BS}; sustainable {sustain:.2f} req/s, sent at {rate:.2f} req/s "
          f"(burstiness {args.burstiness}); SLO TTFT chat {1000 * slo['chat']['ttft']:.0f} ms, "
          f"documents {1000 * slo['long-doc']['ttft']:.0f} ms, TPOT "
          f"{1000 * slo['chat']['tpot']:.1f} ms")  # fmt: skip
    cols = ["config", "preempt/1k", "goodput req/s", "goodput x", "attainment", "p99 TTFT ms",
            "refused chat/doc", "doc p99 wait s", "out tok/s"]  # fmt: skip
    print(table(rows, cols))
    emit({"benchmark": "admission", "model": args.model, "sustainable_rps": sustain,
          "rate_rps": rate, "slo": slo, "results": out})  # fmt: skip


if __name__ == "__main__":
    main()
