"""A tiny OpenAI-compatible server that misbehaves on request, for testing the bench client.

Why raw asyncio instead of a web framework: the failures worth testing live below a
framework's API — a stream cut mid-chunk, headers sent and then silence, a connection closed
before any response — and a framework exists precisely to prevent those. It speaks just enough
HTTP/1.1 (one request per connection, chunked SSE) for httpx and curl, and serves
``/v1/completions``, ``/v1/chat/completions``, ``/v1/models`` and a ``/metrics`` in our
server's names so the whole bench pipeline can run against it.

Behaviours, chosen per request by ``script(n, body)`` (n counts requests from 0):
``ok``, ``error`` (HTTP 500), ``overloaded`` (503), ``stall`` (no response at all),
``stall_mid`` (two tokens, then silence), ``drop`` (two tokens, then the socket is cut),
``drop_early`` (closed before any response), ``garbage`` (a stream of invalid JSON),
``no_done`` (tokens, then a clean close without ``[DONE]``).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable
from typing import Any

Script = Callable[[int, dict[str, Any]], str]
BEHAVIOURS = (
    "ok", "error", "overloaded", "stall", "stall_mid", "drop", "drop_early", "garbage", "no_done",
)  # fmt: skip


class FakeServer:
    """Run with ``with FakeServer(script) as url: ...``; everything stops on exit."""

    def __init__(
        self, script: Script | str = "ok", token_delay: float = 0.002, stall_for: float = 3600
    ) -> None:
        self.script: Script = (lambda n, body: script) if isinstance(script, str) else script
        self.token_delay = token_delay
        self.stall_for = stall_for
        self.count = 0
        self.running = 0
        self.counters = {"queries": 0.0, "hits": 0.0, "requests": 0.0}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.base_events.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._thread: threading.Thread | None = None
        self.url = ""

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> str:
        ready = threading.Event()

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            self._server = loop.run_until_complete(
                asyncio.start_server(self._handle, "127.0.0.1", 0)
            )
            port = self._server.sockets[0].getsockname()[1]
            self.url = f"http://127.0.0.1:{port}"
            ready.set()
            loop.run_forever()
            loop.close()

        self._thread = threading.Thread(target=run, name="fake-openai", daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("fake server did not start")
        return self.url

    def stop(self) -> None:
        loop = self._loop
        if loop is None or self._thread is None:
            return

        async def shutdown() -> None:
            assert self._server is not None
            self._server.close()
            for t in list(self._tasks):
                t.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            loop.stop()

        asyncio.run_coroutine_threadsafe(shutdown(), loop)
        self._thread.join(10)
        self._thread = None

    # -- HTTP -------------------------------------------------------------------------------
    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode().split("\r\n")
            method, path, _ = lines[0].split(" ", 2)
            headers = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
            body_bytes = await reader.readexactly(int(headers.get("content-length", 0) or 0))
            await self._route(method, path, body_bytes, writer)
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass
        finally:
            self._tasks.discard(task)
            writer.close()

    async def _respond(
        self, writer: asyncio.StreamWriter, status: str, body: bytes, ctype: str
    ) -> None:
        writer.write(
            f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n".encode()
            + body
        )
        await writer.drain()

    async def _route(
        self, method: str, path: str, raw: bytes, writer: asyncio.StreamWriter
    ) -> None:
        if method == "GET" and path == "/metrics":
            await self._respond(writer, "200 OK", self.metrics_text().encode(), "text/plain")
        elif method == "GET" and path == "/v1/models":
            data = {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}
            await self._respond(writer, "200 OK", json.dumps(data).encode(), "application/json")
        elif method == "POST" and path in ("/v1/completions", "/v1/chat/completions"):
            body = json.loads(raw or b"{}")
            n = self.count
            self.count += 1
            self.running += 1
            try:
                await self._complete(self.script(n, body), body, path.endswith("chat/completions"),
                                     writer)  # fmt: skip
            finally:
                self.running -= 1
        else:
            await self._respond(writer, "404 Not Found", b'{"error": "not found"}', "text/plain")

    async def _complete(
        self, behaviour: str, body: dict[str, Any], chat: bool, writer: asyncio.StreamWriter
    ) -> None:
        if behaviour == "error":
            msg = {"error": {"message": "fake server error", "type": "InternalServerError"}}
            await self._respond(writer, "500 Internal Server Error", json.dumps(msg).encode(),
                                "application/json")  # fmt: skip
            return
        if behaviour == "overloaded":
            msg = {"error": {"message": "server overloaded, retry later"}}
            await self._respond(writer, "503 Service Unavailable", json.dumps(msg).encode(),
                                "application/json")  # fmt: skip
            return
        if behaviour == "drop_early":
            writer.transport.abort()
            return
        if behaviour == "stall":
            await asyncio.sleep(self.stall_for)
            return
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
        )

        async def send(data: str) -> None:
            payload = f"data: {data}\n\n".encode()
            writer.write(f"{len(payload):x}\r\n".encode() + payload + b"\r\n")
            await writer.drain()

        if behaviour == "garbage":
            await send("{this is not json")
            writer.write(b"0\r\n\r\n")
            await writer.drain()
            return
        prompt = body.get("prompt") or " ".join(
            m.get("content", "") for m in body.get("messages") or []
        )
        n_prompt = max(1, len(str(prompt)) // 4)
        self.counters["queries"] += n_prompt
        self.counters["hits"] += n_prompt // 2
        self.counters["requests"] += 1
        n_out = int(body.get("max_tokens") or 16)
        created = int(time.time())
        for i in range(n_out):
            if i == 2 and behaviour in ("stall_mid", "drop"):
                if behaviour == "drop":
                    writer.transport.abort()
                    return
                await asyncio.sleep(self.stall_for)
                return
            await asyncio.sleep(self.token_delay)
            choice: dict[str, Any] = {"index": 0, "finish_reason": None}
            if chat:
                choice["delta"] = {"content": f" t{i}"}
            else:
                choice["text"] = f" t{i}"
            if i == n_out - 1:
                choice["finish_reason"] = "length"
            await send(json.dumps({"id": "cmpl-fake", "created": created, "choices": [choice]}))
        if body.get("stream_options", {}).get("include_usage"):
            usage = {"prompt_tokens": n_prompt, "completion_tokens": n_out,
                     "total_tokens": n_prompt + n_out,
                     "prompt_tokens_details": {"cached_tokens": n_prompt // 2}}  # fmt: skip
            await send(json.dumps({"id": "cmpl-fake", "choices": [], "usage": usage}))
        if behaviour != "no_done":
            await send("[DONE]")
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    def metrics_text(self) -> str:
        """Prometheus text in the names our server exports: vLLM's (``vllm:``, with its
        ``model_name`` and ``engine`` labels) where vLLM has the metric, else ``kvserve:``."""
        c = self.counters
        rows = [
            ("vllm:num_requests_running", "gauge", self.running),
            ("vllm:num_requests_waiting", "gauge", 0),
            ("vllm:kv_cache_usage_perc", "gauge", min(1.0, 0.1 * self.running)),
            ("kvserve:kv_cache_token_occupancy", "gauge", 0.9),
            ("vllm:prefix_cache_queries_total", "counter", c["queries"]),
            ("vllm:prefix_cache_hits_total", "counter", c["hits"]),
            ("kvserve:prefix_cache_evictions_total", "counter", 0),
            ("vllm:num_preemptions_total", "counter", 0),
        ]
        out = []
        for name, kind, value in rows:
            labels = '{model_name="fake",engine="0"}' if name.startswith("vllm:") else ""
            out += [f"# TYPE {name} {kind}", f"{name}{labels} {value}"]
        return "\n".join(out) + "\n"
