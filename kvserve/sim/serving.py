"""``kvserve simulate --calibrate --serving``: what serving over HTTP costs the engine.

The step profile times the engine alone, in-process. A served token also passes through the
HTTP front end (the request parsed, the token detokenized, one SSE event per token per
stream, the event loop's turn between the engine thread's steps), and through a proxy or
router when there is one, all on the same cores as the engine's compute threads and under
the same interpreter lock as its loop. So this measures a real ``kvserve serve`` (the
calibrated engine's own flags, this process's cores) with real streaming clients and sets
the profile's serving terms to what the measured latencies have that the profile's own
replay of the same requests does not:

- ``b`` streams decoding in lockstep, for a few ``b``: each token's gap is one decode step
  of ``b`` sequences plus the front end's work after it. The measured mean gap less the
  simulated one (the engine alone) is fitted to ``serve_step_s + b * serve_token_s``
  (:func:`fit_serving`): a cost per step that streams anything and one per token streamed.
- The fresh server's first request's TTFT less a warm one's: ``serve_first_request_s``.
- A lone request's TTFT less the simulated one: ``serve_request_s``. The front end is one
  event loop: requests pass through it one at a time and join the engine after it. While
  the engine runs, it loses a share of that time (the rest overlaps its steps):
  ``serve_request_share``, the value whose replay (:func:`fit_share`) gives the streams'
  measured mean gap while lone requests are sent one after another beside them.
- The same through ``kvserve router`` (one replica, round-robin: a pure relay, the same hop
  as ``kvserve proxy``'s decode leg): the gaps' excess over the direct ones is fitted to
  ``b * hop_token_s`` (:func:`fit_hop`), the TTFT's to ``hop_request_s``.

The simulator charges them on the engine's clock (:mod:`kvserve.sim.replica`): a request's
share of its terms when it joins a running engine, a step's after it, before the next step.
That is the measured effect where the front end shares the engine's cores (a CPU engine
takes every core), so a profile measured here is for deployments on the same cores, as the
profile itself is.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import random
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from kvserve.distributed import free_port
from kvserve.sim.cost import SERVING_FIELDS, Profile

STREAMS = (1, 2, 4, 8)  # lockstep streams per measurement
PROMPT_TOKENS = 32
DECODE_TOKENS = 48
ROUNDS = 3  # rounds of each stream count (the mean of their gaps)
SOLO = 5  # lone requests for the TTFT (the median)
# The share's run: SHARE_STREAMS streams decoding SHARE_TOKENS while SHARE_INJECT lone
# requests (one token each) are sent one after another from the start.
SHARE_STREAMS, SHARE_TOKENS, SHARE_INJECT = 4, 96, 8
SHARE_GRID = [i / 20 for i in range(21)]
# The hop's per-prompt-token term: the router's CPU time over TEXT_REQUESTS lone requests with
# text prompts of about PROMPT_TOKENS and of LONG_PROMPT_TOKENS tokens (bounded by the model's
# length), which it tokenizes as it does in front of replicas.
LONG_PROMPT_TOKENS = 1024
TEXT_REQUESTS = 16
TEXT_WORDS = ("cache block model server request queue latency market price river stone "
              "cloud paper garden window table light music number letter").split()  # fmt: skip


@dataclass(slots=True)
class ServingPoint:
    """One stream count's mean token gap, measured and simulated (the engine alone)."""

    streams: int
    measured_s: float
    engine_s: float


def fit_serving(points: list[ServingPoint]) -> tuple[float, float]:
    """(``serve_step_s``, ``serve_token_s``): the least-squares line through the gaps'
    excess over the engine's (measured - simulated) against the stream count, neither
    below 0 (a negative slope: a constant; a negative intercept: a line through 0)."""
    if not points:
        raise ValueError("serving fit: needs at least one stream count")
    b = np.array([p.streams for p in points], dtype=float)
    y = np.array([p.measured_s - p.engine_s for p in points])
    if len(set(b.tolist())) > 1:
        slope, icpt = np.polyfit(b, y, 1)
    else:
        slope, icpt = 0.0, float(y.mean())
    if slope < 0:
        return max(float(y.mean()), 0.0), 0.0
    if icpt < 0:
        return 0.0, max(float(b @ y / (b @ b)), 0.0)
    return float(icpt), float(slope)


def fit_per_token(short: tuple[float, float], long: tuple[float, float]) -> float:
    """Seconds per token (of a prompt, or streamed): the slope between two (tokens, seconds
    per request) points, not below 0."""
    (n0, y0), (n1, y1) = short, long
    if n1 <= n0:
        raise ValueError(f"per-token fit: the second count ({n1}) must be larger than {n0}")
    return max((y1 - y0) / (n1 - n0), 0.0)


def fit_hop(points: list[ServingPoint]) -> float:
    """``hop_token_s``: the least-squares slope through 0 of the hop's excess per gap
    (``measured_s`` through the hop, ``engine_s`` here the direct gap) over the stream
    count, not below 0."""
    if not points:
        raise ValueError("hop fit: needs at least one stream count")
    b = np.array([p.streams for p in points], dtype=float)
    y = np.array([p.measured_s - p.engine_s for p in points])
    return max(float(b @ y / (b @ b)), 0.0)


def serve_flags(kw: dict[str, Any]) -> list[str]:
    """``kvserve serve``'s arguments for the engine ``LLM(**kw)`` builds: the model, then
    each setting that differs from its default, as its flag."""
    from kvserve.config_fields import settings_of

    out = [str(kw["model"])]
    for name, s in settings_of().items():
        if name == "model" or name not in kw or s.required:
            continue
        v = kw[name]
        if v is None or v == s.default:
            continue
        flag = s.flag
        if isinstance(v, bool):
            out.append(flag if v else "--no-" + flag.removeprefix("--"))
        elif isinstance(v, dict):
            out += [flag, json.dumps(v)]
        elif isinstance(v, list | tuple):
            out += [flag, *map(str, v)]
        else:
            out += [flag, str(v)]
    return out


def wait_ready(port: int, timeout: float = 120.0, proc: Any = None) -> float:
    """Seconds until the server on ``port`` answers ``/health`` with 200 (kvserve and vLLM
    both serve it); RuntimeError if ``proc`` (its Popen) exits first or time runs out."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return time.perf_counter() - t0
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    raise RuntimeError(f"server on port {port} not ready after {timeout:.0f} s")


def start_kvserve(args: list[str], port: int, cpus: set[int] | None = None,
                  env: dict[str, str] | None = None, cwd: Any = None,
                  timeout: float = 180.0) -> subprocess.Popen:  # fmt: skip
    """``kvserve ARGS --port PORT`` as a child process (on ``cpus``; in ``env``, else this
    process's environment, whose thread binding, KVSERVE_CPU_OMP_THREADS_BIND, it inherits),
    once its /health answers; stopped and RuntimeError if it exits or is not ready in time."""
    pin = None if cpus is None else (lambda: os.sched_setaffinity(0, cpus))
    proc = subprocess.Popen([sys.executable, "-m", "kvserve.cli", *args, "--port", str(port)],
                            env=env, cwd=cwd, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, preexec_fn=pin)  # fmt: skip
    try:
        wait_ready(port, timeout, proc)
    except RuntimeError as e:
        stop_process(proc)
        raise RuntimeError(f"`kvserve {args[0]}`: {e}") from None
    return proc


def stop_process(proc: subprocess.Popen) -> None:
    """Terminate ``proc`` if it runs; kill it if it has not exited 30 s later."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def stream_times(client: Any, url: str, prompt: list[int], max_tokens: int
                       ) -> list[float]:  # fmt: skip
    """A streamed greedy completion's chunk arrival times, the send time first; RuntimeError
    on an HTTP error or an error chunk."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}  # fmt: skip
    times = [time.perf_counter()]
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code} from {url}")
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                if line.startswith('data: {"error"'):  # the error event, not a token's text
                    raise RuntimeError(line)
                times.append(time.perf_counter())
    return times


def _gap(times: list[float]) -> float:
    """A stream's mean gap between its tokens (after the first)."""
    return (times[-1] - times[1]) / max(len(times) - 2, 1)


def _prompt(rng: random.Random, vocab: int) -> list[int]:
    """A random prompt of PROMPT_TOKENS ids (the special tokens' first ids left out)."""
    return [rng.randrange(3, vocab) for _ in range(PROMPT_TOKENS)]


def text_prompt(tok: Any, rng: random.Random, n_tokens: int) -> tuple[str, int]:
    """At least ``n_tokens`` tokens of random words (a few past it at most), each numbered
    at random so that no two prompts share a block; and its token count."""
    words: list[str] = []
    while True:
        words += [f"{rng.choice(TEXT_WORDS)}{rng.randrange(10**6)}" for _ in range(2)]
        text = " ".join(words)
        n = len(tok.encode(text))
        if n >= n_tokens:
            return text, n


def stat_cpu_seconds(pid: int) -> float:
    """A process's user + system CPU seconds, to the clock tick (``/proc/PID/stat``)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """CPU seconds a process's threads have run, to the nanosecond (each thread's
    ``/proc/PID/task/TID/schedstat``), or to the clock tick (``/proc/PID/stat``) where the
    kernel keeps no schedstat."""
    total = 0
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        return total / 1e9
    except (OSError, ValueError, IndexError):
        return stat_cpu_seconds(pid)


async def _cpu_per_request(url: str, prompts: list[Any], pid: int, max_tokens: int = 1) -> float:
    """The CPU seconds process ``pid`` spends per request of ``prompts`` (texts or token
    ids), sent one after another to ``url``, each streaming ``max_tokens`` tokens."""
    import httpx

    async with httpx.AsyncClient(timeout=300) as client:
        await stream_times(client, url, prompts[0], max_tokens)  # the connection, once
        before = cpu_seconds(pid)
        for prompt in prompts[1:]:
            await stream_times(client, url, prompt, max_tokens)
        return (cpu_seconds(pid) - before) / (len(prompts) - 1)


async def _relay_cpu(url: str, vocab: int, seed: int, pid: int) -> tuple[float, float]:
    """Process ``pid``'s CPU seconds per request streaming 1 token and DECODE_TOKENS (token-id
    prompts of PROMPT_TOKENS, TEXT_REQUESTS each)."""
    rng = random.Random(seed)
    prompts = [_prompt(rng, vocab) for _ in range(2 * TEXT_REQUESTS)]
    one = await _cpu_per_request(url, prompts[:TEXT_REQUESTS], pid, 1)
    many = await _cpu_per_request(url, prompts[TEXT_REQUESTS:], pid, DECODE_TOKENS)
    return one, many


async def _measure(url: str, vocab: int, seed: int) -> tuple[dict[int, float], float, float]:
    """(streams -> mean token gap, median lone TTFT, the first request's TTFT) of the
    server at ``url``."""
    import httpx

    prompt = functools.partial(_prompt, random.Random(seed), vocab)

    gaps: dict[int, float] = {}
    async with httpx.AsyncClient(timeout=300) as client:
        t = await stream_times(client, url, prompt(), 2)  # the fresh server's first request
        first = t[1] - t[0]
        await asyncio.gather(*(stream_times(client, url, prompt(), 8) for _ in range(max(STREAMS))))
        ttft = []
        for _ in range(SOLO):
            t = await stream_times(client, url, prompt(), 2)
            ttft.append(t[1] - t[0])
        for b in STREAMS:
            got = []
            for _ in range(ROUNDS):
                outs = await asyncio.gather(*(stream_times(client, url, prompt(), DECODE_TOKENS)
                                              for _ in range(b)))  # fmt: skip
                got += [_gap(t) for t in outs]
            gaps[b] = statistics.fmean(got)
    return gaps, statistics.median(ttft), first


async def _measure_share_run(url: str, vocab: int, seed: int) -> float:
    """The streams' mean token gap in the share's run (:class:`_Injected`), over ROUNDS."""
    import httpx

    prompt = functools.partial(_prompt, random.Random(seed), vocab)

    got: list[float] = []
    async with httpx.AsyncClient(timeout=300) as client:

        async def lone() -> None:
            for _ in range(SHARE_INJECT):
                await stream_times(client, url, prompt(), 1)

        for _ in range(ROUNDS):
            outs = await asyncio.gather(
                *(stream_times(client, url, prompt(), SHARE_TOKENS) for _ in range(SHARE_STREAMS)),
                lone(),
            )
            got += [_gap(t) for t in outs[:SHARE_STREAMS]]
    return statistics.fmean(got)


class _Rounds:
    """A replay's requests in rounds (kvserve.sim.pd.Feed): a round's requests start
    together, and the next round starts when the last of them ends."""

    def __init__(self, vocab: int, seed: int, rounds: int) -> None:
        self.vocab, self.rng = vocab, random.Random(seed)
        self.left = rounds
        self.open = 0

    def _req(self, t: float, kind: str, tokens: int) -> tuple[float, Any, list[int]]:
        from kvserve.bench.workloads import BenchRequest

        return t, BenchRequest(0, kind, "", tokens, PROMPT_TOKENS), _prompt(self.rng, self.vocab)

    def _round(self, t: float) -> list[tuple[float, Any, list[int]]]:
        raise NotImplementedError

    def start(self) -> list[tuple[float, Any, list[int]]]:
        return self._round(0.0)

    def done(self, req: Any, rec: Any, now: float) -> list[tuple[float, Any, list[int]]]:
        self.open -= 1
        return self._round(now) if self.open == 0 and self.left > 0 else []


class _Injected(_Rounds):
    """:func:`_measure_share_run`'s requests for the simulator: ROUNDS rounds of
    SHARE_STREAMS streams, each beside SHARE_INJECT lone one-token requests sent one after
    another from its start."""

    def __init__(self, vocab: int) -> None:
        super().__init__(vocab, 2, ROUNDS)
        self.lone = 0

    def _round(self, t: float) -> list[tuple[float, Any, list[int]]]:
        self.left -= 1
        self.open = SHARE_STREAMS + 1
        self.lone = SHARE_INJECT - 1
        return [self._req(t, "s", SHARE_TOKENS) for _ in range(SHARE_STREAMS)] + [
            self._req(t, "lone", 1)
        ]

    def done(self, req: Any, rec: Any, now: float) -> list[tuple[float, Any, list[int]]]:
        if req.kind == "lone" and self.lone > 0:
            self.lone -= 1
            return [self._req(now, "lone", 1)]
        return super().done(req, rec, now)


def _mean_gap(records: list[Any], kind: str | None = None) -> float:
    """The mean over the successful replayed requests (of ``kind``, if given) of each one's
    mean token gap."""
    return statistics.fmean(statistics.fmean(r.itl) for r in records
                            if r.success and (kind is None or r.kind == kind))  # fmt: skip


def fit_share(measured_gap: float, replay: Any) -> float:
    """``serve_request_share``: the grid value (SHARE_GRID) whose replay's mean stream gap
    (``replay(share)``) is nearest the measured one."""
    return min(SHARE_GRID, key=lambda s: abs(replay(s) - measured_gap))


def share_gap(kw: dict[str, Any], profile: Profile, vocab: int, share: float) -> float:
    """The replay's mean stream gap in the share's run, the front end's request time
    taking ``share`` of the engine's when it runs. The measured run comes after others on
    the same server, so its replay's server is warm: no first-request term."""
    from kvserve.sim.engine import SimTarget
    from kvserve.sim.simulate import simulate_feed

    warm = replace(profile, serve_request_share=share, serve_first_request_s=0.0)
    target = SimTarget(dict(kw), warm, behind_hop=False)
    res, _ = simulate_feed(target, _Injected(vocab))
    return _mean_gap(res.records, "s")


class _Lockstep(_Rounds):
    """:func:`_measure`'s requests for the simulator: ``SOLO`` lone requests, then ``ROUNDS``
    rounds of ``b`` streams started together."""

    def __init__(self, b: int | None, vocab: int) -> None:
        super().__init__(vocab, 1, SOLO if b is None else ROUNDS)
        self.b = b

    def _round(self, t: float) -> list[tuple[float, Any, list[int]]]:
        self.left -= 1
        n, tokens = (1, 2) if self.b is None else (self.b, DECODE_TOKENS)
        self.open = n
        return [self._req(t, "s", tokens) for _ in range(n)]


def simulated(kw: dict[str, Any], profile: Profile, vocab: int) -> tuple[dict[int, float], float]:
    """:func:`_measure`'s figures as the profile's engine alone gives them (no serving term)."""
    from kvserve.sim.engine import SimTarget
    from kvserve.sim.simulate import simulate_feed

    bare = replace(profile, **dict.fromkeys(SERVING_FIELDS, 0.0), serving_measured=False)
    target = SimTarget(dict(kw), bare, behind_hop=False)
    res, _ = simulate_feed(target, _Lockstep(None, vocab))
    ttft = statistics.median(r.ttft for r in res.records if r.success)
    gaps = {}
    for b in STREAMS:
        res, _ = simulate_feed(target, _Lockstep(b, vocab))
        gaps[b] = _mean_gap(res.records)
    return gaps, ttft


def measure_serving(kw: dict[str, Any], profile: Profile, vocab: int, seed: int = 0,
                    hop: bool = True, tokenizer: Any = None, tokenizer_dir: str | None = None,
                    max_model_len: int | None = None) -> dict[str, Any]:  # fmt: skip
    """Measure a real ``kvserve serve`` of ``kw``'s engine (and ``kvserve router`` in front
    of it), set ``profile``'s serving terms, and return what was measured. With the model's
    ``tokenizer`` (and its directory, for the router), the router's CPU time per request of
    text prompts of two lengths gives the hop's term per prompt token (the slope; a lone
    request's TTFT is too noisy to show it); without, that term stays 0."""
    engine_gaps, engine_ttft = simulated(kw, profile, vocab)
    texts = None
    if hop and tokenizer is not None and tokenizer_dir is not None:
        texts = _text_prompts(tokenizer, max_model_len, seed)
    procs: list[subprocess.Popen] = []
    # The server on this process's cores, as the profile's engine ran; the clients and the
    # router on any core, as a benchmark's clients and its proxy or router run beside pinned
    # engines.
    mine = os.sched_getaffinity(0)
    anywhere = set(range(os.cpu_count() or 1))
    router_cpu: list[float] = []
    relay_cpu = (0.0, 0.0)
    try:
        port = free_port()
        procs.append(start_kvserve(["serve", *serve_flags(kw), "--disable-access-log"], port, mine))
        try:
            os.sched_setaffinity(0, anywhere)
        except OSError:
            anywhere = mine
        url = f"http://127.0.0.1:{port}"
        gaps, ttft, first_ttft = asyncio.run(_measure(url, vocab, seed))
        share_measured = asyncio.run(_measure_share_run(url, vocab, seed + 2))
        hop_gaps: dict[int, float] = {}
        hop_ttft = ttft
        if hop:
            rport = free_port()
            tokenizing = ["--tokenizer", str(tokenizer_dir)] if texts is not None else []
            router = start_kvserve(["router", "--replica", url, "--routing-logic", "round_robin",
                                    *tokenizing], rport, anywhere)  # fmt: skip
            procs.append(router)
            rurl = f"http://127.0.0.1:{rport}"
            hop_gaps, hop_ttft, _ = asyncio.run(_measure(rurl, vocab, seed + 1))
            relay_cpu = asyncio.run(_relay_cpu(rurl, vocab, seed + 4, router.pid))
            if texts is not None:
                router_cpu = [asyncio.run(_cpu_per_request(rurl, ts, router.pid))
                              for ts in texts["prompts"]]  # fmt: skip
    finally:
        for p in reversed(procs):
            stop_process(p)
        os.sched_setaffinity(0, mine)
    points = [ServingPoint(b, gaps[b], engine_gaps[b]) for b in STREAMS]
    profile.serve_step_s, profile.serve_token_s = fit_serving(points)
    profile.serve_request_s = max(ttft - engine_ttft, 0.0)
    profile.serve_first_request_s = max(first_ttft - ttft, 0.0)
    profile.serve_request_share = fit_share(
        share_measured, lambda s: share_gap(kw, profile, vocab, s)
    )
    profile.hop_request_token_s = 0.0
    if hop:
        # The relay's time per token: what the streams' gaps show through it, or (where that
        # is less: its spare core hid the work) the CPU it spends per token it relays, which
        # it takes from the engine's cores when it shares them
        by_gaps = fit_hop([ServingPoint(b, hop_gaps[b], gaps[b]) for b in STREAMS])
        by_cpu = fit_per_token((1, relay_cpu[0]), (DECODE_TOKENS, relay_cpu[1]))
        profile.hop_token_s = max(by_gaps, by_cpu)
        profile.hop_request_s = max(hop_ttft - ttft, 0.0)
        if texts is not None:  # the router's work per prompt token, on the request's path
            (n_s, n_l), (cpu_s, cpu_l) = texts["tokens"], router_cpu
            profile.hop_request_token_s = fit_per_token((n_s, cpu_s), (n_l, cpu_l))
    profile.serving_measured = True
    report = {
        "streams": list(STREAMS),
        "gap_s": [gaps[b] for b in STREAMS],
        "engine_gap_s": [engine_gaps[b] for b in STREAMS],
        "hop_gap_s": [hop_gaps[b] for b in STREAMS] if hop else None,
        "ttft_s": ttft,
        "first_ttft_s": first_ttft,
        "engine_ttft_s": engine_ttft,
        "hop_ttft_s": hop_ttft if hop else None,
        "share_run_gap_s": share_measured,
        "prompt_tokens": PROMPT_TOKENS,
        "decode_tokens": DECODE_TOKENS,
        "text_prompt_tokens": list(texts["tokens"]) if texts is not None else None,
        "router_cpu_s_per_request": router_cpu or None,
        "router_relay_cpu_s": list(relay_cpu) if hop else None,
        "cpus": sorted(os.sched_getaffinity(0)),
    }
    profile.calibration["serving"] = report
    return report


def _text_prompts(tok: Any, max_model_len: int | None, seed: int) -> dict[str, Any] | None:
    """TEXT_REQUESTS text prompts of about PROMPT_TOKENS and as many of LONG_PROMPT_TOKENS
    tokens (fewer where the model is shorter), and their mean token counts; None where the
    model is too short for two lengths to tell a per-token cost from noise."""
    long_n = LONG_PROMPT_TOKENS
    if max_model_len is not None:
        long_n = min(long_n, max_model_len - 8)
    if long_n < 4 * PROMPT_TOKENS:
        return None
    rng = random.Random(seed + 3)
    made = [[text_prompt(tok, rng, n) for _ in range(TEXT_REQUESTS)]
            for n in (PROMPT_TOKENS, long_n)]  # fmt: skip
    return {"prompts": [[text for text, _ in ps] for ps in made],
            "tokens": tuple(statistics.fmean(n for _, n in ps) for ps in made)}  # fmt: skip
