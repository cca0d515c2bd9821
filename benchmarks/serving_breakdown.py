"""Where a served token's time goes on pd.py's quick shape: the engine's step vs the HTTP front
end vs the proxy hop.

    python -m benchmarks.serving_breakdown [--model 5m] [--seconds 15]

pd.py's steady streams (4 streams of 32-token prompts decoding 128 tokens each, greedy,
bf16, block size 16, prefix caching), without its bursts, on the deployments pd.py runs:

- ``engine``: the engine in this process, stepped in a loop (no server): its mean step;
- ``served``: ``kvserve serve`` on both cores, streamed over HTTP: the clients' mean gap
  between tokens, and CPU seconds per streamed token of the server process and the client;
- ``decode_direct`` / ``via_proxy``: a decode engine on the second core (a prefill engine on
  the first) streamed directly, then through ``kvserve proxy``: the gap, and the proxy's CPU
  seconds per token; ``engine_1cpu``: the engine alone on the second core.

Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

from benchmarks.common import bench_model, emit, random_prompts, vocab_size
from benchmarks.pd import BS, _proxy, _serve, free_port, tc
from kvserve.sim.serving import stop_process, stream_times

STREAMS, PROMPT, TOKENS = 4, 32, 128
TICK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (all its threads)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def engine_alone(model: str, cpus: set[int], seconds: float) -> dict[str, float]:
    """The mean step of the engine decoding STREAMS streams in this process on ``cpus``."""
    code = f"""
import json, os, time, torch
os.sched_setaffinity(0, {cpus!r})
torch.set_num_threads({len(cpus)})
from kvserve import LLM, SamplingParams
from benchmarks.common import random_prompts
llm = LLM({bench_model(model)!r}, dtype="bfloat16", block_size={BS}, enable_prefix_caching=True)
e = llm.engine
p = SamplingParams(temperature=0, max_tokens={TOKENS}, ignore_eos=True)
steps, spent, tokens, n = 0, 0.0, 0, 0
stop = time.perf_counter() + {seconds}
while time.perf_counter() < stop or steps == 0:
    for ids in random_prompts({STREAMS}, {PROMPT}, {PROMPT}, {vocab_size(model)}, seed=n):
        n += 1
        e.add_request(f"r{{n}}", {{"prompt_token_ids": ids}}, p)
    while e.has_unfinished_requests():
        t0 = time.perf_counter()
        outs = e.step()
        if n > {STREAMS}:
            spent += time.perf_counter() - t0
            steps += 1
print(json.dumps({{"step_ms": spent / steps * 1e3}}))
"""
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, "KVSERVE_CPU_OMP_THREADS_BIND": "auto"},
    )
    if out.returncode:
        raise RuntimeError(out.stderr[-2000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


async def streams(url: str, vocab: int, seconds: float) -> tuple[float, int]:
    """(mean gap between tokens, tokens) of STREAMS closed-loop streams for ``seconds``."""
    import httpx

    gaps: list[float] = []
    tokens = 0
    async with httpx.AsyncClient(timeout=300) as client:
        warm = random_prompts(STREAMS, PROMPT, PROMPT, vocab, seed=99)
        await asyncio.gather(*(stream_times(client, url, p, 8) for p in warm))
        stop = time.perf_counter() + seconds

        async def user(i: int) -> None:
            nonlocal tokens
            k = 0
            while time.perf_counter() < stop:
                k += 1
                (ids,) = random_prompts(1, PROMPT, PROMPT, vocab, seed=1000 * i + k)
                t = await stream_times(client, url, ids, TOKENS)
                gaps.extend(b - a for a, b in zip(t[1:], t[2:], strict=False))
                tokens += len(t) - 1

        await asyncio.gather(*(user(i) for i in range(STREAMS)))
    return statistics.fmean(gaps), tokens


def measured(url: str, vocab: int, seconds: float, pids: dict[str, int]) -> dict[str, Any]:
    before = {k: cpu_s(p) for k, p in pids.items()}
    me = time.process_time()
    gap, tokens = asyncio.run(streams(url, vocab, seconds))
    out: dict[str, Any] = {
        "gap_ms": gap * 1e3,
        "tokens": tokens,
        "client_cpu_ms_per_token": (time.process_time() - me) / tokens * 1e3,
    }
    for k, p in pids.items():
        out[f"{k}_cpu_ms_per_token"] = (cpu_s(p) - before[k]) / tokens * 1e3
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="5m")
    ap.add_argument("--seconds", type=float, default=15.0)
    a = ap.parse_args()
    path, vocab = bench_model(a.model), vocab_size(a.model)
    base = ["--dtype", "bfloat16", "--block-size", str(BS), "--max-model-len", "1280",
            "--enable-prefix-caching"]  # fmt: skip
    out: dict[str, Any] = {
        "engine": engine_alone(a.model, {0, 1}, a.seconds),
        "engine_1cpu": engine_alone(a.model, {1}, a.seconds),
    }
    print(out, flush=True)
    procs: list[subprocess.Popen] = []
    try:
        proc, url = _serve(path, {0, 1}, base)
        procs.append(proc)
        out["served"] = measured(url, vocab, a.seconds, {"server": proc.pid})
        print(out["served"], flush=True)
        stop_process(proc)
        pp, purl = _serve(path, {0}, [*base, "--kv-transfer-config",
                                      json.dumps(tc("kv_producer", free_port()))])  # fmt: skip
        procs.append(pp)
        dp, durl = _serve(path, {1}, [*base, "--kv-transfer-config",
                                      json.dumps(tc("kv_consumer", free_port()))])  # fmt: skip
        procs.append(dp)
        out["decode_direct"] = measured(durl, vocab, a.seconds, {"decode": dp.pid})
        print(out["decode_direct"], flush=True)
        xp, xurl = _proxy(purl, durl)
        procs.append(xp)
        out["via_proxy"] = measured(
            xurl, vocab, a.seconds, {"decode": dp.pid, "prefill": pp.pid, "proxy": xp.pid}
        )
        print(out["via_proxy"], flush=True)
    finally:
        for p in procs:
            stop_process(p)
    emit(out)


if __name__ == "__main__":
    main()
