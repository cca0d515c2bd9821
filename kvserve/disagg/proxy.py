"""``kvserve proxy``: one OpenAI-compatible endpoint in front of prefill and decode engines,
speaking vLLM's ``kv_transfer_params`` protocol (the same two calls as vLLM's toy proxy).

Each request goes first to a prefill engine, unstreamed, with ``max_tokens`` 1, ``n`` 1 and
``kv_transfer_params: {"do_remote_decode": true}``; its answer's ``kv_transfer_params`` go with
the client's own body to a decode engine, whose reply (streamed or not, ``n``, stop strings and
usage as the client asked) goes back unchanged. A prefill engine that answers without
``kv_transfer_params`` is an error, not a silent recompute on the decode side; a decode engine
that fails or cannot be reached is a clear error to the client (a 502 in OpenAI's shape, or an
error event at the end of a stream that already began).

Engines are picked ``round_robin`` or ``least_loaded`` (fewest requests this proxy has in
flight there). The HTTP forwarding is this module alone, so a router can share it.
"""

from __future__ import annotations

import itertools
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvserve.disagg import PROXY_POLICIES as POLICIES

log = logging.getLogger("kvserve.proxy")


@dataclass
class Backend:
    url: str
    inflight: int = 0


class Pool:
    """Engines of one role and how the next one is chosen."""

    def __init__(self, urls: list[str], policy: str) -> None:
        if not urls:
            raise ValueError("a proxy needs at least one engine of each role")
        if policy not in POLICIES:
            raise ValueError(f"policy: must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.backends = [Backend(u.rstrip("/")) for u in urls]
        self.policy = policy
        self._next = itertools.cycle(range(len(self.backends)))

    def pick(self) -> Backend:
        if self.policy == "least_loaded":
            return min(self.backends, key=lambda b: b.inflight)
        return self.backends[next(self._next)]


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse(error_body(status, message), status_code=status)


class Proxy:
    def __init__(self, prefill: list[str], decode: list[str], policy: str = "round_robin",
                 timeout_s: float = 600.0) -> None:  # fmt: skip
        self.prefill = Pool(prefill, policy)
        self.decode = Pool(decode, policy)
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=5.0))

    async def close(self) -> None:
        await self.client.aclose()

    async def _prefill(self, path: str, body: dict[str, Any]) -> dict[str, Any] | JSONResponse:
        """The prefill call: its kv_transfer_params, or the response to give the client."""
        pbody = {**body, "max_tokens": 1, "n": 1, "stream": False,
                 "kv_transfer_params": {"do_remote_decode": True}}  # fmt: skip
        pbody.pop("stream_options", None)
        if "max_completion_tokens" in pbody:
            pbody["max_completion_tokens"] = 1
        b = self.prefill.pick()
        b.inflight += 1
        try:
            r = await self.client.post(b.url + path, json=pbody)
        except httpx.HTTPError as e:
            return _error(502, f"prefill engine {b.url} failed: {type(e).__name__}: {e}")
        finally:
            b.inflight -= 1
        if r.status_code != 200:  # the client's own error (a bad field), as the engine said it
            return JSONResponse(r.json(), status_code=r.status_code)
        params = r.json().get("kv_transfer_params")
        if not params:
            return _error(502, f"prefill engine {b.url} answered without kv_transfer_params "
                               "(is it started with --kv-transfer-config and kv_role "
                               "kv_producer or kv_both?)")  # fmt: skip
        return params

    async def handle(self, path: str, body: dict[str, Any]) -> Response:
        params = await self._prefill(path, body)
        if isinstance(params, Response):
            return params
        dbody = {**body, "kv_transfer_params": params}
        b = self.decode.pick()
        if not body.get("stream"):
            b.inflight += 1
            try:
                r = await self.client.post(b.url + path, json=dbody)
            except httpx.HTTPError as e:
                return _error(502, f"decode engine {b.url} failed: {type(e).__name__}: {e}")
            finally:
                b.inflight -= 1
            return Response(r.content, status_code=r.status_code,
                            media_type=r.headers.get("content-type"))  # fmt: skip
        b.inflight += 1
        try:
            req = self.client.build_request("POST", b.url + path, json=dbody)
            r = await self.client.send(req, stream=True)
        except httpx.HTTPError as e:
            b.inflight -= 1
            return _error(502, f"decode engine {b.url} failed: {type(e).__name__}: {e}")
        if r.status_code != 200:
            content = await r.aread()
            await r.aclose()
            b.inflight -= 1
            return Response(content, status_code=r.status_code,
                            media_type=r.headers.get("content-type"))  # fmt: skip
        return StreamingResponse(self._relay(r, b), media_type="text/event-stream")

    async def _relay(self, r: httpx.Response, b: Backend) -> AsyncIterator[bytes]:
        done = False
        try:
            async for chunk in r.aiter_raw():
                done = done or b"data: [DONE]" in chunk
                yield chunk
        except httpx.HTTPError as e:
            if not done:
                err = error_body(502, f"decode engine {b.url} failed mid-stream: "
                                      f"{type(e).__name__}: {e}")  # fmt: skip
                yield f"data: {json.dumps(err)}\n\ndata: [DONE]\n\n".encode()
        finally:
            b.inflight -= 1
            await r.aclose()


def build_app(proxy: Proxy) -> FastAPI:
    app = FastAPI(title="kvserve proxy")

    async def forward(path: str, request: Request) -> Response:
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "the body is not JSON")
        if not isinstance(body, dict):
            return _error(400, "the body must be a JSON object")
        return await proxy.handle(path, body)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await forward("/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await forward("/v1/chat/completions", request)

    @app.get("/v1/models")
    async def models() -> Response:
        r = await proxy.client.get(proxy.decode.backends[0].url + "/v1/models")
        return Response(r.content, status_code=r.status_code,
                        media_type=r.headers.get("content-type"))  # fmt: skip

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    return app


def serve_proxy(prefill: list[str], decode: list[str], policy: str, host: str, port: int,
                timeout_s: float) -> None:  # fmt: skip
    import uvicorn

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    proxy = Proxy(prefill, decode, policy, timeout_s)
    uvicorn.run(build_app(proxy), host=host, port=port, log_level="info", access_log=False)
