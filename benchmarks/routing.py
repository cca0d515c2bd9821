"""Cache-aware routing over real replicas: every policy of ``kvserve router`` and an oracle on
one llm-d-shaped trace, with the simulator's prediction beside.

N ``kvserve serve`` replicas of the bundled model on loopback, each pinned to one core and
publishing KV events; the router in this process in front of them. The trace is llm-d's shape
scaled to the machine: ``customers`` long shared contexts, each asked by ``users`` users (a
context plus a short question of their own), in a seeded random order at a Poisson rate; each
replica's pool is sized so the contexts are ``--kv-demand`` (0.7) of the replicas' pools
together: they fit when each context lives on one replica, not when every replica needs them
all. Each policy gets fresh replicas (cold caches), each first warmed up with ``--warmup``
requests that share no block with the trace. The oracle is the precise policy reading
an index that has caught up (it waits for the event streams to go quiet before deciding).

Per policy: prefix-cache hit rate (cached / prompt tokens the replicas reported), TTFT p90,
output tokens/s, and the routing decision's p99. With ``--sim-profile`` (a profile from
``kvserve simulate --calibrate --serving`` on this machine, one core), the simulator replays
the same trace on the same pools through the same policy objects, at N and at
``--sim-replicas`` (the trace scaled with them), each replica paying the profile's serving
terms for its front end and the router's hop.

    .venv/bin/python -m benchmarks.routing [--quick] [--replicas N] [--sim-profile FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import math
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.common import emit, table, wait_ready
from benchmarks.routing_stats import (
    cores_busy,
    cpu_ticks,
    dump_decisions,
    figures,
    on_core,
    pct,
    proc_cpu_s,
    steal_share,
)
from kvserve.distributed import free_port
from kvserve.router.policies import DEFAULT_OVERLAP_WEIGHT
from kvserve.sim.serving import stop_process

REPO = Path(__file__).resolve().parent.parent
POLICIES = ("oracle", "prefix", "prefix_approx", "round_robin", "least_load")
WORDS = ("cache block model server request queue latency market price river stone cloud "
         "paper garden window table light music number letter").split()  # fmt: skip


def words(tok: Any, rng: random.Random, n_tokens: int, tag: str) -> str:
    """About ``n_tokens`` tokens of words that carry ``tag``: texts with different tags share
    no block."""
    out: list[str] = []
    while len(tok.encode(" ".join(out))) < n_tokens:
        out += [f"{rng.choice(WORDS)}{tag}" for _ in range(8)]
    return " ".join(out)


def customer_requests(customers: int, users: int, skew: float) -> list[int]:
    """Requests per customer, ``customers * users`` in all: equal with ``skew`` 0, else in
    proportion to ``1 / rank ** skew`` (Zipf), at least one each."""
    total = customers * users
    w = [1 / (c + 1) ** skew for c in range(customers)]
    n = [max(1, int(total * x / sum(w))) for x in w]
    while sum(n) > total:  # the ones raised to one came from the most popular
        n[n.index(max(n))] -= 1
    for c in range(total - sum(n)):  # the remainder to the most popular, in turn
        n[c % customers] += 1
    return n


def make_trace(tok: Any, customers: int, context: int, users: int, question: int,
               seed: int, skew: float = 0.0) -> list[tuple[int, str]]:  # fmt: skip
    """(customer, prompt) per request: a customer's context (about ``context`` tokens) and a
    user's question (about ``question``), in a seeded random order; ``users`` requests per
    customer on average, spread by :func:`customer_requests`."""
    rng = random.Random(seed)
    contexts = [words(tok, rng, context, f"c{c}") for c in range(customers)]
    counts = customer_requests(customers, users, skew)
    out = [(c, contexts[c] + " question: " + words(tok, rng, question, f"u{c}x{u}"))
           for c in range(customers) for u in range(counts[c])]  # fmt: skip
    rng.shuffle(out)
    return out


def warmup_prompts(tok: Any, n: int, tokens: int, seed: int) -> list[str]:
    """``n`` prompts of about a trace request's length that share no block with the trace
    (nor with each other): a replica's first requests pay for lazy set-up (the allocator's
    first pages, the kernels' first shapes), which a served replica paid long ago."""
    rng = random.Random(seed + 1)
    return [words(tok, rng, tokens, f"w{i}") for i in range(n)]


def warm_up(urls: list[str], prompts: list[str], max_tokens: int) -> None:
    """Each prompt on each replica, one at a time, before the router sees any request."""
    for url in urls:
        recs, _ = asyncio.run(drive(url, [(0, p) for p in prompts], 0.0, max_tokens, 0))
        if not all(r["ok"] for r in recs):
            raise RuntimeError(f"the warm-up of the replica at {url} failed")


class Replicas:
    """N ``kvserve serve`` processes, replica i pinned to core i % cpus, events on ipc."""

    def __init__(self, n: int, serve_args: list[str], tmp: str, nice: int = 0) -> None:
        self.procs: list[subprocess.Popen] = []
        self.specs: list[str] = []
        cores = sorted(os.sched_getaffinity(0))
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        for i in range(n):
            port = free_port()
            ev, rp = f"ipc://{tmp}/ev{i}", f"ipc://{tmp}/rp{i}"
            cfg = json.dumps({"enable_kv_cache_events": True, "endpoint": ev,
                              "replay_endpoint": rp})  # fmt: skip
            cmd = [
                sys.executable,
                "-m",
                "kvserve.cli",
                "serve",
                *serve_args,
                "--port",
                str(port),
                "--kv-events-config",
                cfg,
                "--disable-access-log",
                "--log-level",
                "warning",
            ]
            core = cores[i % len(cores)]
            self.procs.append(subprocess.Popen(
                cmd, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                preexec_fn=lambda c=core: (os.sched_setaffinity(0, {c}),
                                           os.nice(nice))))  # fmt: skip
            self.specs.append(f"http://127.0.0.1:{port},{ev},{rp}")
        for p, spec in zip(self.procs, self.specs, strict=True):
            wait_ready(int(spec.split(",")[0].rsplit(":", 1)[1]), 300, p)

    def close(self) -> None:
        for p in self.procs:  # all at once, then each waited for (killed past 30 s)
            p.terminate()
        for p in self.procs:
            stop_process(p)


class Router:
    """The router's app under uvicorn in a thread of this process."""

    def __init__(self, specs: list[str], policy: str, tokenizer: str,
                 balance_abs: int | None = None,
                 overlap_weight: float = DEFAULT_OVERLAP_WEIGHT) -> None:  # fmt: skip
        import uvicorn

        from kvserve.model.tokenizer import Tokenizer
        from kvserve.router.app import Replica, RouterState, build_app, parse_replica
        from kvserve.router.index import PrefixIndex
        from kvserve.router.policies import make_policy
        from kvserve.server.tenants import TenantResolver

        reps = [Replica(f"r{i}", *parse_replica(s)) for i, s in enumerate(specs)]
        index = PrefixIndex(len(reps))
        name = "prefix" if policy == "oracle" else policy
        routing = make_policy(name, index=index, balance_abs=balance_abs,
                              overlap_weight=overlap_weight)  # fmt: skip
        self.state = RouterState(reps, routing, index,
                                 TenantResolver.from_args(None, None),
                                 Tokenizer(Path(tokenizer), ()),
                                 settle_s=0.02 if policy == "oracle" else 0.0)  # fmt: skip
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(build_app(self.state), log_level="warning",
                                                    access_log=False))  # fmt: skip
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True)  # fmt: skip
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("the router did not start")
            time.sleep(0.05)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


async def _stream_into(client: Any, url: str, body: dict[str, Any], rec: dict[str, Any],
                       t0: float) -> None:  # fmt: skip
    """One streamed completion into ``rec``: its TTFT, token counts and cached tokens once its
    usage chunk comes (``ok``), or what it was told instead (``error``)."""
    async with client.stream("POST", url + "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            rec["error"] = f"{resp.status_code}: {(await resp.aread())[:300]!r}"
        async for line in resp.aiter_lines():
            if not line.startswith("data: {"):
                continue
            data = json.loads(line[6:])
            if "error" in data:
                rec["error"] = str(data["error"])[:300]
            if "ttft" not in rec and data.get("choices"):
                rec["ttft"] = time.perf_counter() - t0
            if data.get("usage"):
                u = data["usage"]
                rec.update(ok=True, prompt=u["prompt_tokens"], out=u["completion_tokens"],
                           cached=u["prompt_tokens_details"]["cached_tokens"])  # fmt: skip


async def drive(url: str, trace: list[tuple[int, str]], rate: float, max_tokens: int,
                seed: int) -> tuple[list[dict[str, Any]], float]:  # fmt: skip
    """Open loop: each request at its arrival (the schedule ``kvserve bench`` and the
    simulator draw for this rate and seed), streamed; TTFT, tokens and hits; and the client's
    CPU seconds over the trace. With a rate <= 0 (a warm-up), the requests go one after
    another."""
    import httpx

    from kvserve.bench.workloads import arrival_times

    out: list[dict[str, Any]] = []
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:

        async def one(delay: float, prompt: str) -> None:
            await asyncio.sleep(delay)
            body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                    "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}  # fmt: skip
            t0 = time.perf_counter()
            rec: dict[str, Any] = {"send": t0, "ok": False}
            try:
                await _stream_into(client, url, body, rec, t0)
            except httpx.HTTPError as e:  # the connection failed: this request, not the run
                rec.update(ok=False, error=f"{type(e).__name__}: {str(e)[:200]}")
            rec["end"] = time.perf_counter()
            if not rec["ok"]:
                rec.setdefault("error", "the stream ended without its usage chunk")
            out.append(rec)

        cpu0 = time.process_time()
        if rate <= 0:
            for _, prompt in trace:
                await one(0.0, prompt)
            return out, time.process_time() - cpu0
        sends = arrival_times(len(trace), rate, 1.0, seed)
        pairs = zip(trace, sends, strict=True)
        await asyncio.gather(*(one(at, prompt) for (_, prompt), at in pairs))
    return out, time.process_time() - cpu0


def drive_elsewhere(url: str, trace: list[tuple[int, str]], rate: float, max_tokens: int,
                    seed: int, warm: list[str],
                    at_start: Callable[[], None], nice: int = 0,
                    ) -> tuple[list[dict[str, Any]], float]:  # fmt: skip
    """:func:`drive` in a process of its own: sharing the router's process, the client's
    thread would hold the GIL while the router decides (a real router has its process to
    itself), and the decision times would measure the benchmark's client. The ``warm``
    prompts go first, one at a time, from the same process through the same router: a fresh
    client's and router's first requests pay for imports, connections and lazy set-up, which
    a router that has served a while paid long ago. ``at_start`` runs between the two."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(1, mp_context=spawn, initializer=os.nice, initargs=(nice,)) as pool:
        pool.submit(_drive_sync, url, [(0, p) for p in warm], 0.0, max_tokens, seed).result()
        at_start()
        return pool.submit(_drive_sync, url, trace, rate, max_tokens, seed).result()


def _drive_sync(url: str, trace: list[tuple[int, str]], rate: float, max_tokens: int,
                seed: int) -> tuple[list[dict[str, Any]], float]:  # fmt: skip
    return asyncio.run(drive(url, trace, rate, max_tokens, seed))


def simulate(profile_file: str, replicas: int, serve_kw: dict[str, Any], trace: list,
             rate: float, max_tokens: int, seed: int, tok: Any, warm: list[str],
             overlap_weight: float = DEFAULT_OVERLAP_WEIGHT,
             policies: tuple[str, ...] = POLICIES,
             router_processes: int = 0) -> dict[str, dict]:  # fmt: skip
    """Every policy of ``policies`` on the simulator; ``router_processes``: the router on
    processes of its own (then each policy's ``router_busy``), else on the replicas' cores."""
    from kvserve.bench.metrics import percentile
    from kvserve.bench.runner import LoadSpec
    from kvserve.bench.workloads import BenchRequest
    from kvserve.sim.cost import Profile
    from kvserve.sim.engine import SimTarget
    from kvserve.sim.simulate import simulate_load

    reqs = [BenchRequest(i, "chat", p, max_tokens, len(tok.encode(p)), f"c{c}")
            for i, (c, p) in enumerate(trace)]  # fmt: skip
    warmup = [
        BenchRequest(i, "chat", p, max_tokens, len(tok.encode(p))) for i, p in enumerate(warm)
    ]
    out = {}
    for policy in policies:
        target = SimTarget(dict(serve_kw), Profile.load(profile_file), replicas=replicas,
                           router=policy, overlap_weight=overlap_weight,
                           router_processes=router_processes)  # fmt: skip
        res, sims = simulate_load(target, reqs, LoadSpec(rate), seed, warmup)
        ok = [r for r in res.records if r.success]
        out[policy] = {
            "hit_rate": sum(r.cached_tokens for r in ok) / max(1, sum(r.prompt_tokens for r in ok)),
            "ttft_p90_s": percentile([r.ttft for r in ok if r.ttft is not None], 90)
            if ok
            else None,
            "output_tok_s": sum(r.output_tokens for r in ok) / res.duration,
        }
        if sims[0].router is not None:
            out[policy]["router_busy"] = max(sims[0].router.busy())
    return out


ROUTER_BUSY_TARGET = 0.7  # the share of a core a router process may need, with room for bursts


def router_sizes(profile_file: str, replicas: int, serve_kw: dict[str, Any], trace: list,
                 rate: float, max_tokens: int, seed: int, tok: Any, warm: list[str],
                 overlap_weight: float) -> dict[str, dict]:  # fmt: skip
    """``prefix`` behind one router process on a core of its own, and, where that one needs
    more than :data:`ROUTER_BUSY_TARGET` of its core, behind as many as bring each under it."""
    run = functools.partial(simulate, profile_file, replicas, serve_kw, trace, rate,
                            max_tokens, seed, tok, warm, overlap_weight, ("prefix",))  # fmt: skip
    out = {"1": run(router_processes=1)}
    need = math.ceil(out["1"]["prefix"]["router_busy"] / ROUTER_BUSY_TARGET)
    if need > 1:
        out[str(need)] = run(router_processes=need)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a small trace (a smoke run)")
    p.add_argument("--replicas", type=int, default=min(2, len(os.sched_getaffinity(0))))
    p.add_argument("--customers", type=int, default=None)
    p.add_argument("--context-tokens", type=int, default=None)
    p.add_argument("--users", type=int, default=None)
    p.add_argument("--question-tokens", type=int, default=32)
    p.add_argument("--customer-skew", type=float, default=0.0, metavar="S",
                   help="customers' shares of the requests in proportion to 1 / rank ** S "
                   "(Zipf; default 0: equal)")  # fmt: skip
    p.add_argument("--overlap-weight", type=float, default=DEFAULT_OVERLAP_WEIGHT,
                   help="the prefix policies' --overlap-weight (default: %(default)s, "
                   "kvserve router's)")  # fmt: skip
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--rate", type=float, default=None, help="requests per second (the JSON "
                   "line's policies, and the simulator's trace)")  # fmt: skip
    p.add_argument("--rates", default="", help="more rates, comma-separated: every policy at "
                   "each too, in the JSON line's curve")  # fmt: skip
    p.add_argument("--kv-demand", type=float, default=0.7)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--sim-profile", default=None, help="a calibrated profile: the simulator's "
                   "prediction beside the real figures")  # fmt: skip
    p.add_argument("--sim-replicas", default="8,32")
    p.add_argument("--replica-nice", type=int, default=0, help="the replicas' niceness: > 0 "
                   "serves the router first when they keep every core busy, as a core of its "
                   "own would")  # fmt: skip
    p.add_argument("--client-nice", type=int, default=0, help="the load generator's "
                   "niceness: with --replica-nice, the router (this process) alone is served "
                   "first, as on a host of its own")  # fmt: skip
    p.add_argument("--balance-abs-threshold", type=int, default=None, metavar="N",
                   help="the router's imbalance guard for the prefix policies and the oracle, "
                   "as `kvserve router` takes it (default: none); the simulator keeps the "
                   "default")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=2, help="requests each replica serves before "
                   "the trace (prompts that share no block with it), one at a time, here and "
                   "in the simulator")  # fmt: skip
    p.add_argument("--decisions-out", default=None, help="a directory: every routing "
                   "decision's wall and CPU time per policy and rate, as JSON")  # fmt: skip
    a = p.parse_args(argv)
    bad = [x for x in a.policies.split(",") if x not in POLICIES]
    if bad:
        p.error(f"--policies: unknown {bad}; known: {', '.join(POLICIES)}")
    if a.warmup < 0:
        p.error(f"--warmup: must be >= 0, got {a.warmup}")
    if a.balance_abs_threshold is not None and a.balance_abs_threshold < 0:
        p.error(f"--balance-abs-threshold: must be >= 0, got {a.balance_abs_threshold}")
    if a.replicas < 1:
        p.error(f"--replicas: must be >= 1, got {a.replicas}")
    if a.customer_skew < 0:
        p.error(f"--customer-skew: must be >= 0, got {a.customer_skew}")
    if not a.overlap_weight > 0:
        p.error(f"--overlap-weight: must be > 0, got {a.overlap_weight}")
    for flag, nice in (("--replica-nice", a.replica_nice), ("--client-nice", a.client_nice)):
        if not 0 <= nice <= 19:
            p.error(f"{flag}: must be in [0, 19] (a niceness this process may set), got {nice}")
    if not 0 < a.kv_demand <= 1:
        p.error(f"--kv-demand: must be in (0, 1], got {a.kv_demand}")
    quick = a.quick
    customers = a.customers or (4 if quick else 12) * a.replicas // 2
    context = a.context_tokens or (256 if quick else 1536)
    users = a.users or (4 if quick else 8)
    max_tokens = a.max_tokens or (8 if quick else 32)
    rate = a.rate or (2.0 if quick else 3.0)
    try:
        extra = [float(x) for x in a.rates.split(",") if x.strip()]
    except ValueError:
        p.error(f"--rates: expected comma-separated numbers, got {a.rates!r}")
    if any(not x > 0 for x in [rate, *extra]):
        p.error("--rate, --rates: every rate must be > 0")
    rates = [rate, *[x for x in extra if x != rate]]

    from kvserve.engine_args import default_model
    from kvserve.model.tokenizer import Tokenizer

    model = default_model()
    tok = Tokenizer(Path(model), ())
    trace = make_trace(tok, customers, context, users, a.question_tokens, a.seed,
                       a.customer_skew)  # fmt: skip
    warm = warmup_prompts(tok, a.warmup, context + a.question_tokens, a.seed)
    bs = a.block_size
    ctx_blocks = customers * math.ceil(context / bs)
    one_request = math.ceil((context + a.question_tokens + max_tokens + 64) / bs)
    pool = max(math.ceil(ctx_blocks / (a.kv_demand * a.replicas)), 4 * one_request)
    max_len = 2 * (context + a.question_tokens + max_tokens + 64)
    serve_kw = dict(model=model, dtype="float32", block_size=bs, num_gpu_blocks=pool,
                    max_model_len=max_len)  # fmt: skip
    serve_args = ["--model", model, "--dtype", "float32", "--block-size", str(bs),
                  "--num-gpu-blocks", str(pool), "--max-model-len", str(max_len),
                  "--served-model-name", "m"]  # fmt: skip
    print(
        f"# {a.replicas} replicas x {pool} blocks of {bs}; {customers} customers x "
        f"{context}-token contexts x {users} users = {len(trace)} requests at "
        f"{', '.join(f'{r:g}' for r in rates)}/s; "
        f"contexts are {ctx_blocks / (pool * a.replicas):.0%} of the pools",
        flush=True,
    )
    curve: dict[str, dict[str, dict[str, Any]]] = {}
    for r in rates:
        curve[f"{r:g}"] = run_rate(a, r, trace, serve_args, model, max_tokens, warm)
    real = curve[f"{rate:g}"]
    sim: dict[str, Any] | None = None
    if a.sim_profile:
        ow = a.overlap_weight
        sim = {str(a.replicas): simulate(a.sim_profile, a.replicas, serve_kw, trace, rate,
                                         max_tokens, a.seed, tok, warm, ow)}  # fmt: skip
        routers: dict[str, dict[str, dict]] = {}
        for n in [int(x) for x in a.sim_replicas.split(",") if x]:
            scale = max(1, n // a.replicas)
            big = make_trace(tok, customers * scale, context, users, a.question_tokens, a.seed,
                             a.customer_skew)  # fmt: skip
            sim[str(n)] = simulate(a.sim_profile, n, serve_kw, big, rate * scale, max_tokens,
                                   a.seed, tok, warm, ow)  # fmt: skip
            routers[str(n)] = router_sizes(a.sim_profile, n, serve_kw, big, rate * scale,
                                           max_tokens, a.seed, tok, warm, ow)  # fmt: skip
        sim["error"] = sim_error(sim[str(a.replicas)], real)
        # The curve's other rates at N replicas, and the simulator's error at each.
        sim["curve"] = {}
        for r in rates[1:]:
            at = simulate(
                a.sim_profile, a.replicas, serve_kw, trace, r, max_tokens, a.seed, tok, warm, ow
            )
            sim["curve"][f"{r:g}"] = {"sim": at, "error": sim_error(at, curve[f"{r:g}"])}
        from kvserve.sim.cost import Profile

        sim["serving"] = Profile.load(a.sim_profile).serving_terms()
        print(table([{"replicas": n, "policy": k, **v} for n, res in sim.items()
                     if n not in ("error", "curve", "serving") for k, v in res.items()],
                    ["replicas", "policy", "hit_rate", "ttft_p90_s", "output_tok_s"]))  # fmt: skip
        sim["router_processes"] = routers
        if routers:
            print(table([{"replicas": n, "router_processes": k, **v["prefix"]}
                         for n, by in routers.items() for k, v in by.items()],
                        ["replicas", "router_processes", "router_busy", "ttft_p90_s",
                         "output_tok_s"]))  # fmt: skip
    emit({
        "benchmark": "routing", "replicas": a.replicas, "requests": len(trace), "rate": rate,
        "replica_nice": a.replica_nice,
        "client_nice": a.client_nice,
        "policies": {k: {f: v[f] for f in FIGURES} for k, v in real.items()},
        "decision_p99_ms": real.get("prefix", {}).get("decision_p99_ms"),
        "decision_p99_ms_by_policy": {k: v["decision_p99_ms"] for k, v in real.items()},
        "decision_cpu_p99_ms": real.get("prefix", {}).get("decision_cpu_p99_ms"),
        "decision_on_core_p99_ms": real.get("prefix", {}).get("decision_on_core_p99_ms"),
        "index_slice_p99_ms": real.get("prefix", {}).get("index_slice_p99_ms"),
        "curve": curve,
        "sim": sim,
    })  # fmt: skip


FIGURES = ("hit_rate", "ttft_p90_s", "tpot_p90_s", "output_tok_s", "failed", "router_cpu_ms")


def run_rate(a: argparse.Namespace, rate: float, trace: list, serve_args: list[str],
             model: str, max_tokens: int,
             warm: list[str]) -> dict[str, dict[str, Any]]:  # fmt: skip
    """Every policy at one rate, each on fresh replicas warmed up with ``warm``; the targets'
    ratios beside."""
    out: dict[str, dict[str, Any]] = {}
    for policy in a.policies.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            reps = Replicas(a.replicas, serve_args, tmp, a.replica_nice)
            router = None
            try:
                warm_up([s.split(",")[0] for s in reps.specs], warm, max_tokens)
                router = Router(reps.specs, policy, model, a.balance_abs_threshold,
                                a.overlap_weight)  # fmt: skip
                start: dict[str, Any] = {}

                def at_start(state: Any = router.state, procs: list = reps.procs,
                             start: dict[str, Any] = start) -> None:  # fmt: skip
                    # The trace's decisions only, and every CPU reading from its start.
                    for d in (state.decision_times, state.decision_cpu_times,
                              state.decision_preempted, state.decision_waited):  # fmt: skip
                        d.clear()
                    start.update(ticks=cpu_ticks(), router=time.process_time(),
                                 replicas=[proc_cpu_s(p.pid) for p in procs])  # fmt: skip

                recs, client_cpu = drive_elsewhere(router.url, trace, rate, max_tokens, a.seed,
                                                   warm, at_start, a.client_nice)  # fmt: skip
                router_cpu = time.process_time() - start["router"]
                reps0 = start["replicas"]
                reps_cpu = [proc_cpu_s(p.pid) - c for p, c in zip(reps.procs, reps0, strict=True)]
                res = figures(recs)
                res["steal_share"] = steal_share(start["ticks"], cpu_ticks())
                res["cores_busy"] = cores_busy(recs, reps_cpu, router_cpu, client_cpu)
                # The router process's CPU per request (routing, forwarding, relaying the
                # stream, reading events): what one router process can take per core.
                res["router_cpu_ms"] = router_cpu / max(1, len(recs)) * 1000
                res["decision_p99_ms"] = (pct(list(router.state.decision_times), 0.99)
                                          or 0.0) * 1000  # fmt: skip
                res["decision_cpu_p99_ms"] = (pct(list(router.state.decision_cpu_times), 0.99)
                                              or 0.0) * 1000  # fmt: skip
                res.update(on_core(router.state))
                if a.decisions_out:
                    dump_decisions(router.state, Path(a.decisions_out) / f"{policy}-{rate:g}.json")
                sub = router.state.subscriber
                if sub is not None:
                    res["index_slice_p99_ms"] = (pct(list(sub.slice_seconds), 0.99)
                                                 or 0.0) * 1000  # fmt: skip
                out[policy] = res
            finally:
                if router is not None:
                    router.close()
                reps.close()
        print(f"# rate {rate:g}/s {policy}: {out[policy]}", flush=True)
    rows = [{"rate": rate, "policy": k, **v} for k, v in out.items()]
    print(table(rows, ["rate", "policy", "hit_rate", "ttft_p90_s", "tpot_p90_s", "output_tok_s",
                       "failed", "router_cpu_ms", "decision_p99_ms", "decision_cpu_p99_ms",
                       "decision_on_core_p99_ms", "decision_preempted_share",
                       "decision_waited_share", "steal_share", "index_slice_p99_ms"]),
          flush=True)  # fmt: skip
    pre, rr, ll = out.get("prefix"), out.get("round_robin"), out.get("least_load")
    if pre and rr and pre["ttft_p90_s"] and rr["ttft_p90_s"]:
        pre["ttft_p90_vs_round_robin"] = rr["ttft_p90_s"] / pre["ttft_p90_s"]
    if pre and ll and ll["output_tok_s"]:
        pre["output_tok_s_vs_least_load"] = pre["output_tok_s"] / ll["output_tok_s"]
    return out


def sim_error(sim: dict[str, dict], real: dict[str, dict]) -> dict[str, dict[str, float]]:
    """Per policy and figure: (simulated - real) / real (hit rate: the difference in points)."""
    out: dict[str, dict[str, float]] = {}
    for k, r in real.items():
        s = sim.get(k)
        if s is None:
            continue
        e: dict[str, float] = {"hit_rate_points": s["hit_rate"] - r["hit_rate"]}
        for f in ("ttft_p90_s", "output_tok_s"):
            if s.get(f) and r.get(f):
                e[f] = s[f] / r[f] - 1
        out[k] = e
    return out


if __name__ == "__main__":
    main()
