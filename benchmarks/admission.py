"""Admission control under overload: greedy (admit while the next chunk fits, preempt when
decode runs out) against projected (admit only what fits its whole life; refuse what cannot
meet its SLO), each with and without workload classes.

    python -m benchmarks.admission --model kvserve-ref
    python -m benchmarks.admission --model 50m --num-prompts 200

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
    args = ap.parse_args()
    threads = set_threads()
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
    burst = _run(base, reqs, LoadSpec(), args.seed)
    sustain = sum(r.success for r in burst.records) / burst.duration
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
        refused = sum(1 for r in res.records if (r.reason or "").startswith("refused"))
        good = sum(1 for r in res.records if meets_slo(r, slo[r.kind]))
        row = {
            "config": name,
            "preempt/1k": 1000 * (srv["num_preemptions"] or 0) / len(reqs),
            "goodput req/s": good / res.duration,
            "attainment": good / len(reqs),
            "p99 TTFT ms": 1000 * percentile([r.ttft for r in admitted], 99),
            "refused": refused,
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
    print(table(rows, ["config", "preempt/1k", "goodput req/s", "goodput x", "attainment",
                       "p99 TTFT ms", "refused", "doc p99 wait s", "out tok/s"]))  # fmt: skip
    emit({"benchmark": "admission", "model": args.model, "sustainable_rps": sustain,
          "rate_rps": rate, "slo": slo, "results": out})  # fmt: skip


if __name__ == "__main__":
    main()
