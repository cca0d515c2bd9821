"""The router's HTTP front: OpenAI's ``/v1/completions`` and ``/v1/chat/completions`` relayed
to the replica a policy chooses, with health checks and failover.

Per request: authenticate (the replicas' keys and tenant secret, so the router computes the
same cache salt they will), tokenize the prompt as the replicas do, ask the policy, send.
A replica that refuses the connection or answers 503 before starting the request is marked
down (its index entries dropped) and the request goes to the next choice; once a replica has
started a request, a failure is the client's: a 502 in OpenAI's error shape, or for a stream
an ``error`` event then ``[DONE]``. A background task checks every replica's ``/health``;
one that passes again is routed to again and its events re-learned (from its replay socket).

Everything that reads or changes the routing state (the policy, the event index, the loads)
runs on the event loop, in one thread, so none of it takes a lock or waits for the GIL: the
event subscriber reads its sockets on the loop too, and applies batches in short slices
between requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import re
import resource
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import generate_latest

from kvserve.model.tokenizer import Tokenizer
from kvserve.router.events import EventSubscriber
from kvserve.router.index import PrefixIndex
from kvserve.router.metrics import RouterMetrics
from kvserve.router.policies import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_CAPACITY_BLOCKS,
    NoReplicaError,
    ReplicaLoad,
    RouteRequest,
    RoutingPolicy,
)
from kvserve.server.api_errors import APIError
from kvserve.server.chat_prompt import render_chat
from kvserve.server.tenants import TenantResolver

log = logging.getLogger("kvserve.router")

# /metrics pages read per replica for its pool's size before the router stops asking.
POOL_READS = 3
_RUSAGE_THREAD: int | None = getattr(resource, "RUSAGE_THREAD", None)  # Linux

HOP_HEADERS = {"host", "content-length", "connection", "transfer-encoding", "accept-encoding"}


@dataclass
class Replica:
    name: str
    url: str
    events: str | None = None
    replay: str | None = None
    load: ReplicaLoad = field(default_factory=ReplicaLoad)
    pool_reads: int = 0  # /metrics pages read without the pool's size in them


def parse_replica(spec: str) -> tuple[str, str | None, str | None]:
    """``URL[,EVENTS_ENDPOINT[,REPLAY_ENDPOINT]]``."""
    parts = [p.strip() for p in spec.split(",")]
    if not parts[0].startswith(("http://", "https://")) or len(parts) > 3:
        raise ValueError(f"replica: expected URL[,EVENTS_ENDPOINT[,REPLAY_ENDPOINT]] with an "
                         f"http(s) URL, got {spec!r}")  # fmt: skip
    for p in parts[1:]:
        if "://" not in p:
            raise ValueError(f"replica: {p!r} is not a ZMQ endpoint (e.g. tcp://host:5557)")
    url = parts[0].rstrip("/")
    return url, (parts[1] if len(parts) > 1 else None), (parts[2] if len(parts) > 2 else None)


class RouterState:
    def __init__(
        self,
        replicas: list[Replica],
        policy: RoutingPolicy,
        index: PrefixIndex,
        tenants: TenantResolver,
        tokenizer: Tokenizer | None = None,
        session_header: str = "x-session-id",
        health_interval_s: float = 1.0,
        request_timeout_s: float = 600.0,
        topic: str = "",
        settle_s: float = 0.0,
    ) -> None:
        """``settle_s`` > 0: before each decision, wait until no event batch has come for
        that long (at most 20 times it), so the index is as fresh as it can be (the routing
        benchmark's oracle; a real router does not wait)."""
        self.replicas = replicas
        self.policy = policy
        self.index = index
        self.tenants = tenants
        self.tokenizer = tokenizer
        self.session_header = session_header.lower()
        self.health_interval_s = health_interval_s
        self.request_timeout_s = request_timeout_s
        self.metrics = RouterMetrics([r.name for r in replicas])
        self.topic = topic
        self.subscriber: EventSubscriber | None = None  # started on the loop (start())
        self.client: httpx.AsyncClient | None = None
        self.settle_s = settle_s
        self.decision_times: deque[float] = deque(maxlen=100_000)  # seconds, most recent
        # The same decisions' CPU time: the wall time less any wait for a core.
        self.decision_cpu_times: deque[float] = deque(maxlen=100_000)
        # Whether the router's thread left its core during each: the OS took it (an
        # involuntary context switch) or the thread waited (a voluntary one: the GIL, a
        # page from disk). Such a wall time is partly a wait, not routing work.
        self.decision_preempted: deque[bool] = deque(maxlen=100_000)
        self.decision_waited: deque[bool] = deque(maxlen=100_000)

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Subscribe to the replicas' events, applied on ``loop`` (the one serving requests).

        Everything loaded so far (the web framework, the tokenizer) lives as long as the
        router: frozen out of the garbage collector's reach, a full collection, which may
        fall inside a routing decision, scans only what came after."""
        gc.collect()
        gc.freeze()
        ends = [(i, r.events, r.replay) for i, r in enumerate(self.replicas) if r.events]
        if ends and self.subscriber is None:
            self.subscriber = EventSubscriber(self.index, ends, loop, self.topic)

    async def settle(self) -> None:
        sub = self.subscriber
        if sub is None or self.settle_s <= 0:
            return
        deadline = time.monotonic() + 20 * self.settle_s
        while time.monotonic() < deadline and (
            not sub.idle or time.monotonic() - sub.last_batch_at < self.settle_s
        ):
            await asyncio.sleep(self.settle_s / 4)

    # -- a request's routing key ---------------------------------------------------------------
    def route_request(self, body: dict[str, Any], chat: bool, tenant: str,
                      headers: Any) -> RouteRequest:  # fmt: skip
        client_salt = body.get("cache_salt", body.get("prompt_cache_key"))
        salt = self.tenants.cache_salt(tenant, client_salt if isinstance(client_salt, str)
                                       else None)  # fmt: skip
        session = headers.get(self.session_header) or body.get("user")
        return RouteRequest(self._tokens(body, chat), salt,
                            session if isinstance(session, str) else None)  # fmt: skip

    def _tokens(self, body: dict[str, Any], chat: bool) -> list[int]:
        """The prompt's token ids as the replica will see them ([] when unknown: the policy
        then has no prefix to score, and the replica refuses a bad body itself)."""
        tok = self.tokenizer
        try:
            if chat:
                if tok is None or not isinstance(body.get("messages"), list):
                    return []
                text = render_chat(tok, body["messages"], body.get("add_generation_prompt", True),
                                   body.get("continue_final_message", False),
                                   body.get("tools"))  # fmt: skip
                return tok.encode(text, add_special_tokens=body.get("add_special_tokens", False))
            prompt = body.get("prompt")
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], list | str):
                prompt = prompt[0]  # a batch: routed by its first prompt
            if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
                return prompt
            if isinstance(prompt, str) and tok is not None:
                return tok.encode(prompt, add_special_tokens=body.get("add_special_tokens", True))
        except (APIError, ValueError, TypeError, KeyError):
            return []
        return []

    # -- replicas up and down --------------------------------------------------------------------
    def mark_down(self, i: int, why: str) -> None:
        r = self.replicas[i]
        if r.load.healthy:
            log.warning("replica %s (%s) is down: %s", r.name, r.url, why)
        r.load.healthy = False
        self.metrics.healthy.labels(r.name).set(0)
        if self.subscriber is not None:
            self.subscriber.reset(i)
        r.pool_reads = 0  # it may come back with another pool, or a newer server
        self.policy.replica_down(i)

    def mark_up(self, i: int) -> None:
        r = self.replicas[i]
        if not r.load.healthy:
            log.info("replica %s (%s) is back", r.name, r.url)
            if self.subscriber is not None:
                self.subscriber.resync(i)
        r.load.healthy = True
        self.metrics.healthy.labels(r.name).set(1)

    async def check_health(self) -> None:
        assert self.client is not None

        async def one(i: int, r: Replica) -> None:
            # Twice on a transport error: a kept-alive connection the replica closed as it
            # was reused fails once, and a replica marked down loses its index.
            for _ in range(2):
                try:
                    resp = await self.client.get(r.url + "/health", timeout=2.0)
                    ok, why = resp.status_code == 200, f"/health answered {resp.status_code}"
                    break
                except httpx.HTTPError as e:
                    ok, why = False, f"{type(e).__name__}"
            self.mark_up(i) if ok else self.mark_down(i, why)
            if ok and r.pool_reads < POOL_READS and self.policy.wants_pool(i):
                await self.read_pool(i, r)

        await asyncio.gather(*(one(i, r) for i, r in enumerate(self.replicas)))

    async def read_pool(self, i: int, r: Replica) -> None:
        """The replica's KV pool, from ``vllm:cache_config_info``'s ``num_gpu_blocks`` and
        ``block_size`` labels on its ``/metrics`` (kvserve and vLLM both publish them), for
        the approximate policy's capacity and block keys. A replica that gives no pool size
        is asked at the next health checks, POOL_READS times in all; one marked down
        meanwhile keeps nothing of this read (it may come back with another pool)."""
        assert self.client is not None
        blocks = block_size = None
        try:
            resp = await self.client.get(r.url + "/metrics", timeout=2.0)
            if resp.status_code == 200:
                blocks, block_size = cache_config_of(resp.text)
        except httpx.HTTPError:
            pass
        if not r.load.healthy:
            return
        if blocks is not None or block_size is not None:
            self.policy.learn_pool(i, blocks, block_size)
        if not self.policy.wants_pool(i):
            return
        r.pool_reads += 1
        if r.pool_reads == POOL_READS:
            log.warning("replica %s (%s) gives no num_gpu_blocks or block_size in "
                        "vllm:cache_config_info on its /metrics: prefix_approx assumes %d "
                        "blocks of %d tokens where it does not say (set "
                        "--approx-capacity-blocks, --block-size)", r.name, r.url,
                        DEFAULT_CAPACITY_BLOCKS, DEFAULT_BLOCK_SIZE)  # fmt: skip

    async def health_loop(self) -> None:
        while True:
            await self.check_health()
            await asyncio.sleep(self.health_interval_s)

    async def aclose(self) -> None:
        if self.subscriber is not None:
            await self.subscriber.aclose()


_CACHE_CONFIG = re.compile(r"^vllm:cache_config_info\{([^}\n]*)\}", re.M)
_LABEL = re.compile(r'\b(\w+)="([^"]*)"')


def cache_config_of(metrics_text: str) -> tuple[int | None, int | None]:
    """``num_gpu_blocks`` and ``block_size`` of the ``vllm:cache_config_info`` sample in a
    Prometheus text page (None where there is none or it is not a positive integer). One
    search of the page, not a parse of every family: it runs on the loop that routes."""
    m = _CACHE_CONFIG.search(metrics_text)
    labels = dict(_LABEL.findall(m.group(1))) if m else {}

    def positive(name: str) -> int | None:
        v = labels.get(name, "")
        return int(v) or None if v.isdigit() else None

    return positive("num_gpu_blocks"), positive("block_size")


def _error(status: int, message: str, code: str | None = None) -> JSONResponse:
    return JSONResponse(APIError(status, message, code=code).body(), status_code=status)


def _usage_of(data: Any) -> tuple[int, int] | None:
    usage = data.get("usage") if isinstance(data, dict) else None
    if not isinstance(usage, dict):
        return None
    details = usage.get("prompt_tokens_details") or {}
    return int(usage.get("prompt_tokens") or 0), int(details.get("cached_tokens") or 0)


async def relay(state: RouterState, raw: Request, path: str, chat: bool) -> Response:
    """Route one completion request and relay the replica's answer."""
    tenant = state.tenants.authenticate(raw.headers.get("authorization"))
    content = await raw.body()
    try:
        body = json.loads(content)
    except ValueError:
        return _error(400, "body: not valid JSON", "invalid_json")
    if not isinstance(body, dict):
        return _error(400, "body: expected a JSON object")
    req = state.route_request(body, chat, tenant, raw.headers)
    headers = {k: v for k, v in raw.headers.items() if k.lower() not in HOP_HEADERS}
    stream = bool(body.get("stream"))
    m = state.metrics
    bs = state.index.block_size or DEFAULT_BLOCK_SIZE
    n_blocks = len(req.token_ids) // bs
    loads = [r.load for r in state.replicas]
    tried: set[int] = set()
    assert state.client is not None
    await state.settle()
    while True:
        view = [ReplicaLoad(ld.healthy and i not in tried, ld.requests, ld.blocks)
                for i, ld in enumerate(loads)]  # fmt: skip
        v0, i0 = _switches()  # first: its own system call stays out of the timed window
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            d = state.policy.choose(req, view)
            # At once, not when the answer starts (a non-streamed one starts when done):
            # the prompt's blocks count as the replica's while it computes them.
            state.policy.routed(req, d.replica)
        except NoReplicaError:
            return _error(503, "no healthy replica to serve the request")
        took = time.perf_counter() - t0
        m.decision_seconds.observe(took)
        state.decision_times.append(took)
        state.decision_cpu_times.append(time.thread_time() - c0)
        v1, i1 = _switches()
        state.decision_preempted.append(i1 > i0)
        state.decision_waited.append(v1 > v0)
        rep = state.replicas[d.replica]
        rep.load.requests += 1
        rep.load.blocks += n_blocks
        m.in_flight.labels(rep.name).inc()
        m.blocks_in_flight.labels(rep.name).set(rep.load.blocks)

        def release(rep: Replica = rep, k: int = d.replica) -> None:
            state.policy.finished(req, k)
            rep.load.requests -= 1
            rep.load.blocks -= n_blocks
            m.in_flight.labels(rep.name).dec()
            m.blocks_in_flight.labels(rep.name).set(rep.load.blocks)

        try:
            sent = state.client.build_request("POST", rep.url + path, content=content,
                                              headers=headers)  # fmt: skip
            resp = await state.client.send(sent, stream=True)
        except (httpx.ConnectError, httpx.ConnectTimeout) as e:
            release()
            state.mark_down(d.replica, type(e).__name__)
            m.failovers.labels(rep.name).inc()
            tried.add(d.replica)
            continue
        except httpx.HTTPError as e:
            release()
            m.failed.labels(rep.name).inc()
            return _error(502, f"replica {rep.name} failed before answering: "
                          f"{type(e).__name__}", "replica_failed")  # fmt: skip
        if resp.status_code == 503:  # draining or its engine is dead: not started there
            await resp.aclose()
            release()
            state.mark_down(d.replica, "answered 503")
            m.failovers.labels(rep.name).inc()
            tried.add(d.replica)
            continue
        m.decisions.labels(d.policy, rep.name, str(d.balanced).lower()).inc()
        m.expected_hit.labels(rep.name).inc(d.hit_blocks * bs)
        if stream and resp.status_code == 200:
            return StreamingResponse(_stream(state, rep, resp, release),
                                     media_type="text/event-stream")  # fmt: skip
        try:
            data = await resp.aread()
        except httpx.HTTPError as e:
            m.failed.labels(rep.name).inc()
            return _error(502, f"replica {rep.name} failed while serving the request: "
                          f"{type(e).__name__}", "replica_failed")  # fmt: skip
        finally:
            await resp.aclose()
            release()
        with contextlib.suppress(ValueError):
            _count_usage(m, rep.name, _usage_of(json.loads(data)))
        ctype = resp.headers.get("content-type", "application/json")
        return Response(data, status_code=resp.status_code, media_type=ctype)


def _count_usage(m: RouterMetrics, name: str, usage: tuple[int, int] | None) -> None:
    if usage is not None:
        m.prompt_tokens.labels(name).inc(usage[0])
        m.reported_hit.labels(name).inc(usage[1])


async def _stream(state: RouterState, rep: Replica, resp: httpx.Response,
                  release: Any) -> AsyncIterator[bytes]:  # fmt: skip
    """The replica's events as they come; if it fails mid-stream, an error event naming it
    and ``[DONE]``, so the client sees a clear end rather than a cut connection."""
    m = state.metrics
    tail = b""
    try:
        async for chunk in resp.aiter_raw():
            tail = (tail + chunk)[-8192:]
            yield chunk
    except httpx.HTTPError as e:
        m.failed.labels(rep.name).inc()
        err = APIError(502, f"replica {rep.name} failed mid-stream ({type(e).__name__}); "
                       "the response is incomplete", code="replica_failed")  # fmt: skip
        yield f"data: {json.dumps(err.body())}\n\ndata: [DONE]\n\n".encode()
    finally:
        await resp.aclose()
        release()
    for line in tail.split(b"\n"):
        if line.startswith(b"data: {") and b'"usage"' in line:
            with contextlib.suppress(ValueError):
                _count_usage(m, rep.name, _usage_of(json.loads(line[6:])))


def build_app(state: RouterState) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256)
        timeout = httpx.Timeout(state.request_timeout_s, connect=2.0)
        state.client = httpx.AsyncClient(limits=limits, timeout=timeout)
        state.start(asyncio.get_running_loop())
        task = asyncio.create_task(state.health_loop())
        try:
            yield
        finally:
            task.cancel()
            await state.client.aclose()
            await state.aclose()

    app = FastAPI(title="kvserve router", lifespan=lifespan)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.post("/v1/completions")
    async def completions(raw: Request) -> Response:
        return await relay(state, raw, "/v1/completions", chat=False)

    @app.post("/v1/chat/completions")
    async def chat(raw: Request) -> Response:
        return await relay(state, raw, "/v1/chat/completions", chat=True)

    @app.get("/v1/models")
    async def models(raw: Request) -> Response:
        state.tenants.authenticate(raw.headers.get("authorization"))
        assert state.client is not None
        for r in state.replicas:
            if r.load.healthy:
                with contextlib.suppress(httpx.HTTPError):
                    resp = await state.client.get(
                        r.url + "/v1/models",
                        headers={
                            k: v for k, v in raw.headers.items() if k.lower() == "authorization"
                        },
                    )
                    return Response(resp.content, resp.status_code,
                                    media_type="application/json")  # fmt: skip
        return _error(503, "no healthy replica")

    @app.get("/health")
    async def health() -> Response:
        if any(r.load.healthy for r in state.replicas):
            return JSONResponse({"status": "ok"})
        return _error(503, "no healthy replica")

    @app.get("/metrics")
    async def metrics() -> Response:
        for i, r in enumerate(state.replicas):
            state.metrics.index_blocks.labels(r.name).set(state.index.num_blocks(i))
        return Response(generate_latest(state.metrics.registry),
                        media_type="text/plain; version=0.0.4")  # fmt: skip

    return app


def _switches() -> tuple[int, int]:
    """(voluntary, involuntary) context switches of this thread so far (zeros where the OS
    does not say)."""
    if _RUSAGE_THREAD is None:
        return 0, 0
    r = resource.getrusage(_RUSAGE_THREAD)
    return r.ru_nvcsw, r.ru_nivcsw
