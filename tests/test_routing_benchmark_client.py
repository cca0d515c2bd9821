"""The routing benchmark's load generator against a server that fails: a request whose
connection drops mid-stream, or that gets an error status, is recorded as failed with what
happened, and the run goes on (a transport error used to abort the whole benchmark)."""

from __future__ import annotations

import asyncio

from benchmarks import routing

CHUNK = b'data: {"choices": [{"text": "x"}]}\n\n'


async def _serve_badly(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """The first request: a stream cut after one event; every later one: 503."""
    await reader.readuntil(b"\r\n\r\n")
    _serve_badly.calls += 1  # type: ignore[attr-defined]
    if _serve_badly.calls == 1:  # type: ignore[attr-defined]
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                     b"transfer-encoding: chunked\r\n\r\n"
                     + f"{len(CHUNK):x}\r\n".encode() + CHUNK + b"\r\n")  # fmt: skip
    else:
        body = b'{"error": "draining"}'
        writer.write(b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
                     + f"content-length: {len(body)}\r\n\r\n".encode() + body)  # fmt: skip
    await writer.drain()
    writer.close()


async def _run() -> list[dict]:
    _serve_badly.calls = 0  # type: ignore[attr-defined]
    server = await asyncio.start_server(_serve_badly, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        trace = [(0, "first"), (0, "second")]
        recs, _ = await asyncio.wait_for(
            routing.drive(f"http://127.0.0.1:{port}", trace, 0.0, 4, 0), timeout=30
        )
    finally:
        server.close()
        await server.wait_closed()
    return recs


def test_a_dropped_stream_and_an_error_status_are_failed_requests_not_a_crash():
    cut, refused = asyncio.run(_run())
    assert not cut["ok"] and "ttft" in cut  # the first event came, then the connection went
    assert cut["error"].split(":")[0] in ("RemoteProtocolError", "ReadError")
    assert not refused["ok"] and refused["error"].startswith("503: ")
    assert "draining" in refused["error"]
    figures = routing.figures([cut, refused])
    assert figures["failed"] == 2 and len(figures["errors"]) == 2
