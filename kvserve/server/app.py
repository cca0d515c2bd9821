"""The FastAPI app, its error handling, and the uvicorn runner behind ``kvserve serve``.

Bodies are parsed by hand (bytes -> UTF-8 -> JSON -> pydantic) rather than by FastAPI's
dependency machinery so that every failure, including invalid UTF-8 and malformed JSON, comes
back as a 400 in OpenAI's error shape naming the field, never as FastAPI's 422 format.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import socket
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvserve import __version__
from kvserve.config import ConfigError
from kvserve.engine import LLMEngine
from kvserve.engine_args import engine_kwargs
from kvserve.entrypoint import freeze_startup_heap, setup_process
from kvserve.server.api_errors import APIError, api_error_from_validation, bad_request
from kvserve.server.args import DEFAULT_MAX_BODY_BYTES
from kvserve.server.engine_loop import EngineLoop
from kvserve.server.metrics import ServerMetrics
from kvserve.server.protocol import ChatCompletionRequest, CompletionRequest
from kvserve.server.request_fields import screen
from kvserve.server.serving import ServerState, create_chat_completion, create_completion
from kvserve.server.tenants import TenantResolver
from kvserve.server.tokenize import (
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    detokenize,
    tokenize,
)
from kvserve.server.tool_parsers import TOOL_PARSERS, detect_parser
from kvserve.server.tools import ToolSettings

log = logging.getLogger("kvserve.server")


class _BodyTooLarge(APIError):
    def __init__(self, limit: int) -> None:
        super().__init__(413, f"body: the request body exceeds {limit} bytes", param="body")


# An oversized body is read and discarded up to this many bytes before the 413 goes out:
# closing a socket with unread data makes the kernel send a reset that can destroy the 413
# on its way to the client (the client then sees "connection closed", not the error).
# Beyond this bound the connection is simply closed.
DRAIN_LIMIT_BYTES = 64 * 1024 * 1024


async def _drain(receive: Receive, budget: int) -> None:
    """Read and drop the rest of a request body, at most ``budget`` bytes."""
    while budget > 0:
        msg = await receive()
        if msg["type"] != "http.request":
            return
        budget -= len(msg.get("body", b""))
        if not msg.get("more_body", False):
            return


class BodyLimitMiddleware:
    """413 for bodies over ``max_bytes``: at once from Content-Length, or while reading a
    chunked body, so an oversized upload is never buffered whole (the rest is drained, not
    kept, so the client reliably reads the 413)."""

    def __init__(self, app: ASGIApp, max_bytes: int, on_reject: Any = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.on_reject = on_reject

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            err = _BodyTooLarge(self.max_bytes)
            if self.on_reject is not None:
                self.on_reject(err)
            await _drain(receive, DRAIN_LIMIT_BYTES)
            return await JSONResponse(err.body(), 413, headers={"Connection": "close"})(
                scope, receive, send
            )
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.max_bytes:
                    if msg.get("more_body", False):
                        await _drain(receive, DRAIN_LIMIT_BYTES)
                    raise _BodyTooLarge(self.max_bytes)
            return msg

        await self.app(scope, limited, send)


def _error_response(err: APIError, state: ServerState | None = None) -> JSONResponse:
    """OpenAI's error JSON; counted in ``kvserve:request_rejected_total{status}``."""
    if state is not None:
        state.metrics.rejected.labels(str(err.status)).inc()
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


async def _read_json(request: Request) -> dict[str, Any]:
    raw = await request.body()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad_request("body", f"is not valid UTF-8 (byte {e.start})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise bad_request("body", f"is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise bad_request("body", f"must be a JSON object, got {type(data).__name__}")
    return data


# The request models of the endpoints that generate: a field one honours is refused by the
# other with a pointer to it (kvserve.server.request_fields.screen).
_GENERATE = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest}


async def _parse(request: Request, state: ServerState, model: type[BaseModel] | None = None) -> Any:
    """The body as ``model`` (for /tokenize: the chat form when it has ``messages``), after
    :func:`screen` refused what the server does not implement and set aside unknown fields."""
    data = await _read_json(request)
    path = request.url.path
    if model is None:
        model = TokenizeChatRequest if "messages" in data else TokenizeCompletionRequest
    elsewhere = {p: m for p, m in _GENERATE.items() if p != path and model in _GENERATE.values()}
    data = screen(data, model, path, elsewhere, state.ignored)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise api_error_from_validation(e) from None


def build_app(state: ServerState) -> FastAPI:
    """The app for one engine loop. The loop starts with the app (lifespan) and stops after
    uvicorn has drained connections, aborting whatever is still in flight."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.loop.start()
        yield
        state.draining = True
        await asyncio.to_thread(state.loop.shutdown)

    # /docs is FastAPI's Swagger UI page over /openapi.json; the page loads Swagger UI's
    # script and style from a CDN (cdn.jsdelivr.net), so on a host without internet access it
    # stays blank while /openapi.json itself is served.
    app = FastAPI(title="kvserve", version=__version__, lifespan=lifespan, docs_url="/docs",
                  redoc_url=None)  # fmt: skip
    app.state.kvserve = state
    reject = state.metrics.rejected
    app.add_middleware(BodyLimitMiddleware, max_bytes=state.max_body_bytes,
                       on_reject=lambda e: reject.labels(str(e.status)).inc())  # fmt: skip

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return _error_response(exc, state)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        msg = f"{request.method} {request.url.path}: {exc.detail}"
        return _error_response(APIError(exc.status_code, msg, headers=exc.headers), state)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error in %s", request.url.path)
        return _error_response(APIError(500, f"internal error: {type(exc).__name__}"), state)

    @app.get("/health")
    async def health() -> Response:
        if state.draining or not state.loop.alive:
            reason = state.loop.error or "the server is shutting down"
            return _error_response(APIError(503, reason))
        return JSONResponse({"status": "ok"})

    # vLLM's (SageMaker's) health check, GET or POST: the same answer as /health.
    app.add_api_route("/ping", health, methods=["GET"], name="ping")
    app.add_api_route("/ping", health, methods=["POST"], name="ping_post")

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": __version__})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        state.tenants.authenticate(request.headers.get("authorization"))
        data = [{"id": name, "object": "model", "created": state.created, "owned_by": "kvserve",
                 "max_model_len": state.max_model_len} for name in state.model_names]  # fmt: skip
        return JSONResponse({"object": "list", "data": data})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        tenant = state.tenants.authenticate(request.headers.get("authorization"))
        req = await _parse(request, state, CompletionRequest)
        return await create_completion(state, req, tenant, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        tenant = state.tenants.authenticate(request.headers.get("authorization"))
        req = await _parse(request, state, ChatCompletionRequest)
        return await create_chat_completion(state, req, tenant, request)

    # Open without the API key, as vLLM guards only /v1 (its `bench serve` asks /tokenize
    # without one): tokenizing touches no tenant's cache.
    @app.post("/tokenize")
    async def tokenize_route(request: Request) -> JSONResponse:
        return JSONResponse(tokenize(state, await _parse(request, state)))

    @app.post("/detokenize")
    async def detokenize_route(request: Request) -> JSONResponse:
        return JSONResponse(detokenize(state, await _parse(request, state, DetokenizeRequest)))

    return app


def build_state(
    engine: LLMEngine,
    model_names: list[str],
    tenants: TenantResolver | None = None,
    max_queue: int | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    allow_kv_retention_override: bool = True,
    tool_call_parser: str | None = None,
    enable_auto_tool_choice: bool = False,
) -> ServerState:
    """Wire an engine to a server: metrics, the engine loop (not started yet), tenants."""
    holder: list[EngineLoop] = []
    # vllm:cache_config_info's labels: vLLM's CacheConfig field names first, then kvserve's.
    cache_info = {
        "block_size": str(engine.block_size),
        "cache_dtype": engine.kv_cache_dtype,
        "num_gpu_blocks": str(engine.num_blocks),
        "gpu_memory_utilization": str(engine.config.cache.gpu_memory_utilization),
        "enable_prefix_caching": str(engine.config.cache.enable_prefix_caching),
        "max_model_len": str(engine.max_model_len),
        "kv_retention": engine.retention.text() if engine.retention else "none",
        "kv_layer_groups": str(engine.layer_groups.num_groups if engine.layer_groups else 1),
    }
    metrics = ServerMetrics(lambda: holder[0].stats if holder else None, cache_info,
                            engine.workload_classes, model_name=model_names[0],
                            max_model_len=engine.max_model_len)  # fmt: skip
    loop = EngineLoop(engine, max_queue=max_queue, metrics=metrics)
    holder.append(loop)
    return ServerState(
        loop=loop,
        tenants=tenants or TenantResolver(),
        metrics=metrics,
        model_names=model_names,
        tokenizer=engine.tokenizer,
        max_model_len=engine.max_model_len,
        max_body_bytes=max_body_bytes,
        allow_kv_retention_override=allow_kv_retention_override,
        scheduling_policy=engine.config.scheduler.scheduling_policy,
        tool_settings=tool_settings(engine, tool_call_parser, enable_auto_tool_choice),
    )


def tool_settings(engine: LLMEngine, parser: str | None, enable_auto: bool) -> ToolSettings:
    """--tool-call-parser, else the chat template's own format; auto needs one of them."""
    template = engine.tokenizer.chat_template if engine.tokenizer is not None else None
    parser = parser or detect_parser(template)
    if enable_auto and parser is None:
        raise ConfigError("--enable-auto-tool-choice: the chat template has no tool-call format "
                          "kvserve reads; name one with --tool-call-parser "
                          f"({', '.join(TOOL_PARSERS)})")  # fmt: skip
    return ToolSettings(parser, enable_auto)


class _Server(uvicorn.Server):
    """uvicorn's server, plus: on SIGTERM/SIGINT mark the app draining (503 for new work,
    /health fails so a load balancer stops sending) before uvicorn drains connections."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.kvserve_state = state

    def handle_exit(self, sig: int, frame: Any) -> None:
        self.kvserve_state.draining = True
        super().handle_exit(sig, frame)


class BackgroundServer:
    """uvicorn on 127.0.0.1 and an ephemeral port in a daemon thread (tests, benchmarks)."""

    def __init__(self, state: ServerState, host: str = "127.0.0.1") -> None:
        self.state = state
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        config = uvicorn.Config(build_app(state), log_level="warning", access_log=False,
                                timeout_graceful_shutdown=5, backlog=1024)  # fmt: skip
        self.server = _Server(config, state)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True)  # fmt: skip

    def __enter__(self) -> BackgroundServer:
        setup_process(serve=True)  # a server started in a thread is an entry point too
        self.thread.start()
        for _ in range(1000):
            if self.server.started:
                return self
            if not self.thread.is_alive():
                raise RuntimeError("the server thread exited during startup")
            threading.Event().wait(0.01)
        raise TimeoutError("the server did not start within 10 s")

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def run_server(args: argparse.Namespace) -> int:
    """``kvserve serve``: build the engine, serve until SIGTERM/SIGINT, then exit 0."""
    from kvserve import LLM

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    setup_process(serve=True)
    kwargs = engine_kwargs(args)
    tenants = TenantResolver.from_args(args.api_key, args.tenants)
    engine = LLM(**kwargs).engine
    names = args.served_model_name or [args.model or Path(kwargs["model"]).name]
    state = build_state(engine, names, tenants, args.max_queue, args.max_body_bytes,
                        args.allow_kv_retention_override, args.tool_call_parser,
                        args.enable_auto_tool_choice)  # fmt: skip
    config = uvicorn.Config(
        build_app(state),
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=not args.disable_access_log,
        timeout_graceful_shutdown=args.shutdown_timeout,
        backlog=2048,
    )
    # The KV pool, the dtypes and why: the engine's start-up block, logged as it was built.
    executor = engine.config.parallel.distributed_executor_backend
    log.info("serving %s (max_model_len %d); executor %s", names[0], engine.max_model_len,
             executor)  # fmt: skip
    if engine.layer_groups is not None:
        g = engine.layer_groups
        log.info("hybrid model: %d layer groups of %d layers, windows %s; each group its own "
                 "block table", g.num_groups, g.num_slots,
                 [w or "full" for w in g.windows])  # fmt: skip
    freeze_startup_heap()
    # uvicorn re-raises a captured SIGTERM/SIGINT after its graceful shutdown; by default that
    # kills the process (-15) or raises KeyboardInterrupt after a clean drain. Exit 0 instead.
    signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        _Server(config, state).run()
    except KeyboardInterrupt:
        pass
    return 0
