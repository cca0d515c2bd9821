"""Disaggregated prefill/decode against one colocated engine on the same cores.

    python -m benchmarks.pd --quick      # a few minutes
    python -m benchmarks.pd              # the full run

Five parts, each a key of the JSON line the script ends with:

- ``identical``: a prefill engine and a decode engine (in this process) give a colocated
  engine's greedy tokens, token for token, in every KV format;
- ``transfer_gbps``: bytes over seconds of the decode engine's pulls of a long prompt on
  loopback (per format; ``bfloat16`` is the headline);
- the pd-burst workload over HTTP: steady decoding streams (short prompts, long outputs) and
  bursts of long prompts; one ``kvserve serve`` on both cores against a prefill engine pinned
  to the first core and a decode engine pinned to the second behind ``kvserve proxy``.
  ``itl_p99_ratio`` is the colocated ITL p99 over the disaggregated one (above 1: the
  disaggregated deployment's streams stall less); ``ttft`` (the bursts' p50 and p99) and
  output ``throughput`` are reported beside it as measured, and ITL p99.9 (``itl_p999_ms``);
- ``faults``: seeded runs of the faults the tests inject (dropped, delayed reads and
  releases, expired leases, dead peers, aborts on either side), eight at a time on one live
  pair, each run its own fault; ``lost`` counts requests that ended neither with the
  colocated tokens nor with a clear error, ``leaked_blocks`` blocks still in use once both
  engines settled after each eight;
- ``sim``: the simulator's prediction of the same pd-burst run (kvserve.sim.pd) against the
  measured ITL p99 and TTFT p50 of each deployment, with the relative error. Its profiles
  are calibrated here first (``kvserve simulate --calibrate`` on both cores for the
  colocated engine, on the second core alone for the prefill and decode engines; or
  ``--profile``/``--split-profile``), its transfers run at the bandwidth measured here for
  ``--dtype``'s format.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import REPO, bench_model, emit, random_prompts, vocab_size
from kvserve.distributed import free_port
from kvserve.sim.serving import start_kvserve, stop_process, stream_times

FORMATS = ["bfloat16", "float32", "fp8_e4m3", "fp8_e5m2", "int8", "kivi4", "kivi2"]
BS = 16


def tc(role: str, port: int, **extra: Any) -> dict[str, Any]:
    return {"kv_connector": "KVServeConnector", "kv_role": role, "kv_port": port,
            "kv_connector_extra_config": extra}  # fmt: skip


# -- in-process pairs -----------------------------------------------------------------------
def _pair(model: str, kv_dtype: str, dtype: str, blocks: int, **extra: Any) -> tuple[Any, Any]:
    from kvserve import LLM

    common = dict(dtype=dtype, block_size=BS, num_gpu_blocks=blocks, kv_cache_dtype=kv_dtype)
    p = LLM(model, **common, kv_transfer_config=tc("kv_producer", free_port(), **extra))
    d = LLM(model, **common, enable_prefix_caching=True,
            kv_transfer_config=tc("kv_consumer", free_port(), **extra))  # fmt: skip
    return p, d


def _prefill(engine: Any, rid: str, prompt: list[int], params: Any) -> Any:
    from kvserve.sched.request import RequestTags

    engine.add_request(rid, {"prompt_token_ids": prompt}, params.clone(max_tokens=1),
                       tags=RequestTags(kv_transfer_params={"do_remote_decode": True}))  # fmt: skip
    while True:
        for o in engine.step():
            if o.request_id == rid and o.finished:
                return o


def _decode(p: Any, d: Any, rid: str, prompt: list[int], params: Any, kvp: Any) -> Any:
    return _decode_many(p, d, {rid: (prompt, kvp, None)}, params)[rid]


def _settle(*engines: Any, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(e.has_unfinished_requests() for e in engines):
        time.sleep(0.0005)
        for e in engines:
            if e.has_unfinished_requests():
                e.step()


def identical_and_bandwidth(model: str, prompt_len: int, quick: bool) -> tuple[bool, dict]:
    """Tokens through a pair against a colocated engine, and the pulls' bandwidth, per format."""
    from kvserve import LLM, SamplingParams

    g = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    warm, prompt = random_prompts(2, prompt_len, prompt_len, vocab_size(model), seed=3)
    path = bench_model(model)
    blocks = 4 * (prompt_len // BS + 8)
    same, gbps = True, {}
    for fmt in FORMATS[:3] if quick else FORMATS:
        dtype = "bfloat16" if fmt == "bfloat16" else "float32"
        c = LLM(path, dtype=dtype, block_size=BS, num_gpu_blocks=blocks, kv_cache_dtype=fmt)
        c.generate([warm], g)  # as the pair: fp8 pools calibrate their scales on the first
        want = c.generate([prompt], g)[0].outputs[0].token_ids
        c.engine.shutdown()
        p, d = _pair(path, fmt, dtype, blocks)
        kvp = _prefill(p.engine, "w", warm, g).kv_transfer_params  # connect, fault pages in
        _decode(p.engine, d.engine, "w", warm, g, kvp)
        _settle(p.engine, d.engine)
        t0 = dict(d.engine.stats().kv_transfer)
        kvp = _prefill(p.engine, "x", prompt, g).kv_transfer_params
        out = _decode(p.engine, d.engine, "x", prompt, g, kvp)
        same = same and out.outputs[0].token_ids == want
        _settle(p.engine, d.engine)
        t = d.engine.stats().kv_transfer
        nbytes = t["bytes_received"] - t0["bytes_received"]
        secs = t["transfer_seconds"] - t0["transfer_seconds"]
        gbps[fmt] = round(nbytes / secs / 1e9, 3)
        print(f"{fmt:10s} identical={out.outputs[0].token_ids == want} "
              f"{nbytes / 2**20:.1f} MiB in {secs * 1e3:.1f} ms -> {gbps[fmt]} GB/s",
              flush=True)  # fmt: skip
        p.engine.shutdown()
        d.engine.shutdown()
    return same, gbps


FAULTS = ("none", "drop_read", "delay_read", "drop_release", "abort_decode", "expire_lease",
          "kill_peer")  # fmt: skip
FAULT_BATCH = 8  # runs in flight at once on the pair


def _prefill_many(engine: Any, reqs: dict[str, list[int]], params: Any) -> dict[str, Any]:
    """Prefill ``reqs`` (id -> prompt) together; their answers' kv_transfer_params."""
    from kvserve.sched.request import RequestTags

    for rid, prompt in reqs.items():
        tags = RequestTags(kv_transfer_params={"do_remote_decode": True})
        engine.add_request(rid, {"prompt_token_ids": prompt}, params.clone(max_tokens=1),
                           tags=tags)  # fmt: skip
    kvps: dict[str, Any] = {}
    while len(kvps) < len(reqs):
        for o in engine.step():
            if o.finished:
                kvps[o.request_id] = o.kv_transfer_params
    engine.step()  # the step that starts their holds
    return kvps


def _decode_many(p: Any, d: Any, reqs: dict[str, tuple[list[int], Any, int | None]],
                 params: Any, timeout_s: float = 60.0) -> dict[str, Any]:  # fmt: skip
    """Decode ``reqs`` (id -> prompt, kv_transfer_params, abort after this many steps or None)
    together, stepping the prefill engine beside; each one's output, None if aborted."""
    from kvserve.sched.request import RequestTags

    for rid, (prompt, kvp, _) in reqs.items():
        d.add_request(rid, {"prompt_token_ids": prompt}, params,
                      tags=RequestTags(kv_transfer_params=kvp))  # fmt: skip
    outs: dict[str, Any] = {}
    steps, deadline = 0, time.monotonic() + timeout_s
    while len(outs) < len(reqs):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{sorted(set(reqs) - set(outs))}: no answer in {timeout_s} s")
        time.sleep(0.0002)
        if p.has_unfinished_requests():
            p.step()
        steps += 1
        for rid, (_, _, abort_after) in reqs.items():
            if abort_after is not None and steps >= abort_after and rid not in outs:
                d.abort_request(rid)
                outs[rid] = None
        for o in d.step():
            if o.finished and o.request_id not in outs:
                outs[o.request_id] = o
    return outs


def faults(model: str, runs: int, seed: int = 64) -> dict[str, int]:
    """Seeded fault runs on one live pair, :data:`FAULT_BATCH` at a time (each its own fault,
    so both engines serve the others while one fails); every request must end exact or with
    a clear error, and both pools return to idle after each batch."""
    from kvserve import LLM, SamplingParams

    g = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    path, rng = bench_model(model), random.Random(seed)
    prompts = random_prompts(4, 40, 120, vocab_size(model), seed=seed)
    c = LLM(path, dtype="float32", block_size=BS, num_gpu_blocks=64)
    want = [o.outputs[0].token_ids for o in c.generate(prompts, g)]
    c.engine.shutdown()
    blocks = 16 * FAULT_BATCH  # a batch's prompts, held on the prefill side until released
    p, d = _pair(path, "float32", "float32", blocks, lease_s=1.0, read_timeout_s=0.5)
    pe, de = p.engine, d.engine
    connector = pe.executor.driver_worker.connector
    server = connector.server
    lost = leaked = 0
    for first in range(0, runs, FAULT_BATCH):
        plan = {}
        for run in range(first, min(runs, first + FAULT_BATCH)):
            fault, k = rng.choice(FAULTS), rng.randrange(len(prompts))
            abort = rng.randrange(1, 4) if fault == "abort_decode" else None
            plan[f"f{run}"] = (fault, k, abort)
        kvps = _prefill_many(pe, {rid: prompts[k] for rid, (_, k, _) in plan.items()}, g)
        reqs = {}
        for rid, (fault, k, abort) in plan.items():
            kvp = kvps[rid]
            if fault == "expire_lease":
                connector._holds[rid] = (connector._holds[rid][0], 0.0)
            if fault == "kill_peer":
                kvp = dict(kvp, remote_port=free_port())
            reqs[rid] = (prompts[k], kvp, abort)
        inbox = server.inbox
        server.inbox = _Lossy(inbox, {rid: f for rid, (f, _, _) in plan.items()}, rng)
        outs = _decode_many(pe, de, reqs, g)
        server.inbox = inbox
        for rid, out in outs.items():
            want_k = want[plan[rid][1]]
            if out is not None and out.error is None and out.outputs[0].token_ids != want_k:
                lost += 1
            elif out is not None and out.error is not None and "kv load failed" not in out.error:
                lost += 1
        _settle(pe, de)
        leaked += pe.kv.num_used_blocks + de.kv.num_used_blocks
    pe.shutdown()
    de.shutdown()
    return {"runs": runs, "lost": lost, "leaked_blocks": leaked}


class _Lossy:
    """The prefill engine's inbox with each run's fault applied to its own request's
    messages: ``drop_read`` and ``drop_release`` lose them, ``delay_read`` holds the side
    channel's thread up to 50 ms before passing a read on."""

    KIND = {"drop_read": "Read", "delay_read": "Read", "drop_release": "Release"}

    def __init__(self, inner: Any, faults: dict[str, str], rng: random.Random) -> None:
        self.inner, self.faults, self.rng = inner, faults, rng

    def append(self, item: Any) -> None:
        msg = item[1]
        fault = self.faults.get(getattr(msg, "request_id", None), "none")
        if self.KIND.get(fault) == type(msg).__name__:
            if fault != "delay_read":
                return
            time.sleep(self.rng.uniform(0.0, 0.05))
        self.inner.append(item)

    def __bool__(self) -> bool:
        return bool(self.inner)

    def popleft(self) -> Any:
        return self.inner.popleft()

    def extendleft(self, items: Any) -> None:
        self.inner.extendleft(items)


# -- the pd-burst workload over HTTP --------------------------------------------------------
def _serve(model: str, cpus: set[int], args: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "KVSERVE_CPU_OMP_THREADS_BIND": "auto", "PYTHONPATH": str(REPO)}
    proc = start_kvserve(["serve", model, "--disable-access-log", *args], port, cpus, env=env,
                         cwd=REPO, timeout=120)  # fmt: skip
    return proc, f"http://127.0.0.1:{port}"


def _proxy(prefill: str, decode: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = start_kvserve(["proxy", "--prefill", prefill, "--decode", decode], port,
                         env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=REPO,
                         timeout=120)  # fmt: skip
    return proc, f"http://127.0.0.1:{port}"


async def burst_workload(url: str, w: dict[str, Any], vocab: int) -> dict[str, float]:
    import httpx

    rng = random.Random(7)
    itl: list[float] = []
    ttft: list[float] = []
    tokens = 0
    async with httpx.AsyncClient(timeout=600) as client:
        warm = [[rng.randrange(vocab) for _ in range(n)] for n in (w["long_prompt"], 32)]
        await asyncio.gather(*(stream_times(client, url, p, 8) for p in warm))  # compile, fault in
        stop_at = time.perf_counter() + w["seconds"]

        async def steady(i: int) -> None:
            nonlocal tokens
            while time.perf_counter() < stop_at:
                prompt = [rng.randrange(vocab) for _ in range(w["short_prompt"])]
                t = await stream_times(client, url, prompt, w["decode_tokens"])
                itl.extend(b - a for a, b in zip(t[2:], t[3:], strict=False))
                tokens += len(t) - 1

        async def bursts() -> None:
            nonlocal tokens
            await asyncio.sleep(w["period"] / 2)
            while time.perf_counter() < stop_at - w["period"] / 2:
                prompts = [[rng.randrange(vocab) for _ in range(w["long_prompt"])]
                           for _ in range(w["burst"])]  # fmt: skip
                outs = await asyncio.gather(*(stream_times(client, url, p, w["burst_tokens"])
                                              for p in prompts))  # fmt: skip
                for t in outs:
                    ttft.append(t[1] - t[0])
                    tokens += len(t) - 1
                await asyncio.sleep(w["period"])

        t0 = time.perf_counter()
        await asyncio.gather(*(steady(i) for i in range(w["streams"])), bursts())
        wall = time.perf_counter() - t0
    q = statistics.quantiles
    return {"itl_p99_ms": q(itl, n=100)[98] * 1e3, "itl_p999_ms": q(itl, n=1000)[998] * 1e3,
            "itl_p50_ms": statistics.median(itl) * 1e3,
            "ttft_p50_s": statistics.median(ttft), "ttft_p99_s": q(ttft, n=100)[98],
            "throughput_tok_s": tokens / wall}  # fmt: skip


def pd_burst(model: str, w: dict[str, Any], dtype: str) -> dict[str, Any]:
    path, vocab = bench_model(model), vocab_size(model)
    base = ["--dtype", dtype, "--block-size", str(BS), "--max-model-len", str(w["max_len"]),
            "--enable-prefix-caching"]  # fmt: skip
    out: dict[str, Any] = {}
    procs: list[subprocess.Popen] = []
    try:
        proc, url = _serve(path, {0, 1}, base)
        procs.append(proc)
        out["colocated"] = asyncio.run(burst_workload(url, w, vocab))
        stop_process(proc)
        kv_port = free_port()
        pp, purl = _serve(path, {0}, [*base, "--kv-transfer-config",
                                      json.dumps(tc("kv_producer", kv_port))])  # fmt: skip
        procs.append(pp)
        dp, durl = _serve(path, {1}, [*base, "--kv-transfer-config",
                                      json.dumps(tc("kv_consumer", free_port()))])  # fmt: skip
        procs.append(dp)
        xp, xurl = _proxy(purl, durl)
        procs.append(xp)
        out["disaggregated"] = asyncio.run(burst_workload(xurl, w, vocab))
    finally:
        for p in procs:
            stop_process(p)
    for name, r in out.items():
        print(f"{name:14s} " + "  ".join(f"{k} {v:.3f}" for k, v in r.items()), flush=True)
    return out


# -- the simulator's prediction of pd-burst --------------------------------------------------
class BurstFeed:
    """pd-burst as :func:`burst_workload` sends it, for the simulator (kvserve.sim.pd.Feed):
    ``streams`` closed-loop users of short prompts until ``seconds``, and from ``period``/2
    a burst of ``burst`` long prompts, the next one ``period`` after the last one ends."""

    def __init__(self, w: dict[str, Any], vocab: int, seed: int = 7) -> None:
        self.w, self.vocab, self.rng = w, vocab, random.Random(seed)
        self.n = 0
        self.open_burst = 0

    def _req(self, kind: str, prompt_len: int, max_tokens: int) -> tuple[Any, list[int]]:
        from kvserve.bench.workloads import BenchRequest

        self.n += 1
        ids = [self.rng.randrange(3, self.vocab) for _ in range(prompt_len)]
        return BenchRequest(self.n, kind, "", max_tokens, prompt_len), ids

    def _burst(self, t: float) -> list[tuple[float, Any, list[int]]]:
        w = self.w
        if t >= w["seconds"] - w["period"] / 2:
            return []
        self.open_burst = w["burst"]
        return [(t, *self._req("burst", w["long_prompt"], w["burst_tokens"]))
                for _ in range(w["burst"])]  # fmt: skip

    def start(self) -> list[tuple[float, Any, list[int]]]:
        w = self.w
        steady = [(0.0, *self._req("steady", w["short_prompt"], w["decode_tokens"]))
                  for _ in range(w["streams"])]  # fmt: skip
        return steady + self._burst(w["period"] / 2)

    def done(self, req: Any, rec: Any, now: float) -> list[tuple[float, Any, list[int]]]:
        w = self.w
        if req.kind == "steady":
            if now >= w["seconds"]:
                return []
            return [(now, *self._req("steady", w["short_prompt"], w["decode_tokens"]))]
        self.open_burst -= 1
        return self._burst(now + w["period"]) if self.open_burst == 0 else []


def predict(model: str, w: dict[str, Any], dtype: str, profile: str, split_profile: str,
            bandwidth: float) -> dict[str, dict[str, float]]:  # fmt: skip
    """The simulator's ITL p99 (steady streams, as :func:`burst_workload` counts it) and
    TTFT p50 (bursts) of pd-burst: one colocated engine under ``profile`` (calibrated on
    both cores), a prefill and a decode engine under ``split_profile`` (one core each) with
    the decode side pulling at ``bandwidth`` bytes/s."""
    from dataclasses import replace

    from kvserve.sim.cost import Profile
    from kvserve.sim.engine import SimTarget
    from kvserve.sim.simulate import simulate_feed

    kw = {"model": bench_model(model), "dtype": dtype, "block_size": BS,
          "max_model_len": w["max_len"], "enable_prefix_caching": True}  # fmt: skip

    def warm(path: str) -> Any:
        # burst_workload's warm-up requests take the fresh servers' first-request cost
        # before the measured window opens: none of the replayed requests pays it.
        return replace(Profile.load(path), serve_first_request_s=0.0)

    targets = {
        "colocated": SimTarget(kw, warm(profile)),
        "disaggregated": SimTarget(kw, warm(split_profile), prefill_replicas=1,
                                   decode_replicas=1, kv_transfer_bandwidth=bandwidth),
    }  # fmt: skip
    out: dict[str, dict[str, float]] = {}
    for name, target in targets.items():
        res, _ = simulate_feed(target, BurstFeed(w, vocab_size(model)))
        recs = [r for r in res.records if r.success]
        itl = [x for r in recs if r.kind == "steady" for x in r.itl[1:]]
        # A transferred request's first token reaches the client with the outputs of the
        # decode step it landed in, when that step's next token is stamped; the engine (and
        # so the simulator) stamps it when it lands.
        late = name == "disaggregated"
        ttft = [r.ttft + (r.itl[0] if late and r.itl else 0.0) for r in recs if r.kind == "burst"]
        out[name] = {"itl_p99_ms": statistics.quantiles(itl, n=100)[98] * 1e3,
                     "ttft_p50_s": statistics.median(ttft)}  # fmt: skip
        print(f"{name:14s} simulated: itl_p99_ms {out[name]['itl_p99_ms']:.3f}  "
              f"ttft_p50_s {out[name]['ttft_p50_s']:.3f}", flush=True)  # fmt: skip
    return out


def calibrate(model: str, dtype: str, cpus: set[int], out: Path) -> str:
    """``kvserve simulate --calibrate --serving`` (its default workload) pinned to ``cpus``,
    as the served engines are: a profile of this machine's steps on that many cores, with
    what serving them over HTTP (and through a hop) costs there."""
    cmd = [sys.executable, "-m", "kvserve.cli", "simulate", bench_model(model), "--calibrate",
           "--serving", "--dtype", dtype, "--block-size", str(BS), "--enable-prefix-caching",
           "--profile-output", str(out)]  # fmt: skip
    subprocess.run(cmd, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, check=True,
                   preexec_fn=lambda: os.sched_setaffinity(0, cpus))  # fmt: skip
    return str(out)


def against(sim: dict[str, dict[str, float]], measured: dict[str, dict[str, float]]) -> dict:
    """Predicted against measured, per deployment and figure, with the relative error."""
    return {name: {k: {"predicted": round(v, 4), "measured": round(measured[name][k], 4),
                       "error": round(v / measured[name][k] - 1, 3)}
                   for k, v in figures.items()}
            for name, figures in sim.items()}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a few minutes: fewer formats, runs")
    ap.add_argument("--model", default=None, help="benchmark model (default 5m quick, else 50m)")
    ap.add_argument("--dtype", default="bfloat16", help="the served engines' dtype")
    ap.add_argument("--fault-runs", type=int, default=None, help="default 50 quick, else 1000")
    ap.add_argument("--seconds", type=float, default=None, help="pd-burst duration per setup")
    ap.add_argument("--long-prompt", type=int, default=None, help="pd-burst's long prompts")
    ap.add_argument("--period", type=float, default=4.0, help="pd-burst: seconds from a "
                    "burst's end to the next burst (how much of the streams' time the bursts "
                    "take; default 4)")  # fmt: skip
    ap.add_argument("--skip-burst", action="store_true", help="no pd-burst (a smoke run)")
    ap.add_argument(
        "--no-sim",
        action="store_true",
        help="no simulator prediction of pd-burst (and no calibration)",
    )
    ap.add_argument("--profile", default=None,
                    help="a calibrated profile (kvserve simulate --calibrate on both cores) "
                    "for the prediction (default: calibrate here, on both cores and on the "
                    "second core alone)")  # fmt: skip
    ap.add_argument("--split-profile", default=None,
                    help="the profile of an engine on one core, for the disaggregated "
                    "prediction (default: --profile)")  # fmt: skip
    ap.add_argument("--kv-transfer-bandwidth", type=float, default=None,
                    help="bytes/s for the prediction's transfers (default: the measured "
                    "transfer_gbps of --dtype's format)")  # fmt: skip
    a = ap.parse_args(argv)
    if not a.period > 0:
        ap.error(f"--period: must be > 0 seconds, got {a.period}")
    model = a.model or ("5m" if a.quick else "50m")
    w = {"streams": 4, "short_prompt": 32, "decode_tokens": 128, "burst": 4,
         "long_prompt": a.long_prompt or (1024 if a.quick else 2048), "burst_tokens": 4,
         "period": a.period,
         "seconds": a.seconds or (40.0 if a.quick else 180.0)}  # fmt: skip
    w["max_len"] = w["long_prompt"] + 256
    same, gbps = identical_and_bandwidth(model, 2048 if a.quick else 4096, a.quick)
    fr = faults(model, a.fault_runs if a.fault_runs is not None else (50 if a.quick else 1000))
    print(f"faults: {fr}", flush=True)
    summary: dict[str, Any] = {"identical": same, "transfer_gbps": gbps, "faults": fr,
                               "model": model, "period_s": w["period"]}  # fmt: skip
    if not a.skip_burst:
        r = pd_burst(model, w, a.dtype)
        col, dis = r["colocated"], r["disaggregated"]
        summary["itl_p99_ratio"] = round(col["itl_p99_ms"] / dis["itl_p99_ms"], 3)
        summary["ttft"] = {k: {"p50_s": v["ttft_p50_s"], "p99_s": v["ttft_p99_s"]}
                           for k, v in r.items()}  # fmt: skip
        summary["throughput_tok_s"] = {k: v["throughput_tok_s"] for k, v in r.items()}
        summary["itl_p99_ms"] = {k: v["itl_p99_ms"] for k, v in r.items()}
        summary["itl_p999_ms"] = {k: v["itl_p999_ms"] for k, v in r.items()}
    else:
        summary["itl_p99_ratio"] = None
    if not (a.no_sim or a.skip_burst or a.profile):
        out = REPO / "reports" / "sim"
        out.mkdir(parents=True, exist_ok=True)
        a.profile = calibrate(model, a.dtype, {0, 1}, out / f"pd-{model}-2cpu.json")
        a.split_profile = calibrate(model, a.dtype, {1}, out / f"pd-{model}-1cpu.json")
    if a.profile and not (a.no_sim or a.skip_burst):
        bw = a.kv_transfer_bandwidth or gbps.get(a.dtype, 0.0) * 1e9
        sim = predict(model, w, a.dtype, a.profile, a.split_profile or a.profile, bw)
        summary["sim"] = against(sim, r)
        from kvserve.sim.cost import Profile

        summary["sim_serving"] = {
            name: Profile.load(path).serving_terms()
            for name, path in (("colocated", a.profile),
                               ("disaggregated", a.split_profile or a.profile))
        }  # fmt: skip
    emit(summary)


if __name__ == "__main__":
    main()
