"""Streaming client for any OpenAI-compatible server (ours, vLLM, SGLang) and its /metrics.

Every way a request can go wrong ends as a :class:`RequestRecord` with a short ``reason``
that the report counts, never as an exception out of the benchmark: HTTP errors, a server that
stalls before or during the stream (``read_timeout`` bounds each wait for bytes), one that
drops the connection, a malformed stream, and an overall ``request_timeout`` per request so a
server that trickles bytes forever cannot hang the run either.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from typing import Any

import httpx

from kvserve.bench.metrics import RequestRecord
from kvserve.bench.workloads import BenchRequest

# Aliases older servers use for the metrics we read (vLLM v0 named KV usage after the GPU).
_ALIASES = {
    "gpu_cache_usage_perc": "kv_cache_usage_perc",
    "gpu_prefix_cache_queries_total": "prefix_cache_queries_total",
    "gpu_prefix_cache_hits_total": "prefix_cache_hits_total",
}
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def parse_prometheus(text: str) -> dict[str, float]:
    """Prometheus text exposition -> {name without ``prefix:``: value summed over labels}.

    The prefix (``kvserve:``, ``vllm:``, ``sglang:``) is dropped so one report reads any of
    them; ``_bucket``/``_sum``/``_count`` series are kept under their own names."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m:
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        name = m.group(1).rsplit(":", 1)[-1]
        name = _ALIASES.get(name, name)
        if name.endswith("_bucket"):
            continue
        out[name] = out.get(name, 0.0) + value
    return out


def _error_text(body: bytes) -> str:
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return body[:200].decode(errors="replace").strip()
    if isinstance(data, dict):
        err = data.get("error", data)
        if isinstance(err, dict):
            return str(err.get("message") or err)[:200]
        return str(err)[:200]
    return str(data)[:200]


class HTTPTarget:
    """One benchmark target behind ``base_url``; ``endpoint`` is ``completions`` or ``chat``."""

    def __init__(
        self,
        base_url: str,
        model: str | None = None,
        endpoint: str = "completions",
        connect_timeout: float = 10.0,
        read_timeout: float = 60.0,
        request_timeout: float = 600.0,
        temperature: float = 0.0,
        ignore_eos: bool = True,
        api_key: str | None = None,
        extra_body: dict[str, Any] | None = None,
    ) -> None:
        if endpoint not in ("completions", "chat"):
            raise ValueError(f"endpoint: must be completions or chat, got {endpoint!r}")
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.endpoint = endpoint
        self.request_timeout = request_timeout
        self.temperature = temperature
        self.ignore_eos = ignore_eos
        self.extra_body = extra_body or {}
        self.label = f"{self.base_url} ({endpoint})"
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(read_timeout, connect=connect_timeout, pool=request_timeout),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
            headers=headers,
        )
        self._metrics_timeout = min(5.0, read_timeout)

    async def start(self) -> None:
        """Learn the served model's name from /v1/models when none was given."""
        if self.model is not None:
            return
        try:
            r = await self._client.get(f"{self.base_url}/v1/models", timeout=self._metrics_timeout)
            data = r.json().get("data") or []
            if r.status_code == 200 and data:
                self.model = data[0].get("id")
        except Exception:  # noqa: BLE001 - the name is optional; requests will tell
            self.model = None

    async def aclose(self) -> None:
        await self._client.aclose()

    async def scrape(self) -> dict[str, float] | None:
        """The server's /metrics, or None when it has none or does not answer in time."""
        try:
            r = await self._client.get(f"{self.base_url}/metrics", timeout=self._metrics_timeout)
        except Exception:  # noqa: BLE001 - a metrics failure must not fail the run
            return None
        if r.status_code != 200:
            return None
        return parse_prometheus(r.text)

    def _payload(self, req: BenchRequest) -> tuple[str, dict[str, Any]]:
        body: dict[str, Any] = {
            "max_tokens": req.max_tokens,
            "temperature": self.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.model:
            body["model"] = self.model
        if self.ignore_eos:
            body["ignore_eos"] = True
        body.update(self.extra_body)
        if self.endpoint == "chat":
            body["messages"] = [{"role": "user", "content": req.prompt}]
            return "/v1/chat/completions", body
        body["prompt"] = req.prompt
        return "/v1/completions", body

    async def generate(self, req: BenchRequest) -> RequestRecord:
        """Send one streamed request; the record's times are absolute ``time.monotonic()``
        until the runner rebases them. Never raises (except on cancellation)."""
        rec = RequestRecord(req.index, req.kind, req.prefix_group, req.input_len, req.max_tokens)
        start = time.monotonic()
        rec.send_time = start
        try:
            async with asyncio.timeout(self.request_timeout):
                await self._stream(req, rec, start)
        except TimeoutError:
            rec.fail("timeout (request)", f"no complete answer within {self.request_timeout:g}s")
        except httpx.ConnectTimeout as e:
            rec.fail("timeout (connect)", str(e) or type(e).__name__)
        except httpx.ReadTimeout as e:
            rec.fail("timeout (server stalled)", str(e) or "no bytes within read_timeout")
        except httpx.TimeoutException as e:
            rec.fail("timeout", str(e) or type(e).__name__)
        except httpx.ConnectError as e:
            rec.fail("connection failed", str(e) or type(e).__name__)
        except (httpx.RemoteProtocolError, httpx.ReadError) as e:
            rec.fail("connection dropped", str(e) or type(e).__name__)
        except httpx.HTTPError as e:
            rec.fail(f"http error ({type(e).__name__})", str(e))
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError) as e:
            rec.fail("bad response", f"{type(e).__name__}: {e}")
        return rec

    async def _stream(self, req: BenchRequest, rec: RequestRecord, start: float) -> None:
        path, body = self._payload(req)
        async with self._client.stream("POST", self.base_url + path, json=body) as resp:
            if resp.status_code != 200:
                raw = await resp.aread()
                rec.fail(f"HTTP {resp.status_code}", _error_text(raw))
                return
            last = start
            chunks = 0
            done = False
            texts: list[str] = []
            usage: dict[str, Any] | None = None
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    err = event["error"]
                    msg = err.get("message") if isinstance(err, dict) else str(err)
                    rec.fail("error in stream", str(msg)[:200])
                    return
                if event.get("usage"):
                    usage = event["usage"]
                for choice in event.get("choices") or []:
                    if self.endpoint == "chat":
                        text = (choice.get("delta") or {}).get("content") or ""
                    else:
                        text = choice.get("text") or ""
                    if choice.get("finish_reason"):
                        rec.finish_reason = choice["finish_reason"]
                    if not text:
                        continue
                    now = time.monotonic()
                    if chunks == 0:
                        rec.ttft = now - start
                    else:
                        rec.itl.append(now - last)
                    last = now
                    chunks += 1
                    texts.append(text)
            if not done:
                rec.fail("incomplete stream", "the connection closed before data: [DONE]")
                return
            rec.output_text = "".join(texts)
            rec.e2e = last - start if chunks else time.monotonic() - start
            rec.output_tokens = int((usage or {}).get("completion_tokens") or chunks)
            rec.prompt_tokens = int((usage or {}).get("prompt_tokens") or req.input_len)
            details = (usage or {}).get("prompt_tokens_details") or {}
            if details.get("cached_tokens") is not None:
                rec.cached_tokens = int(details["cached_tokens"])
            if rec.output_tokens == 0:
                rec.fail("empty output", "the stream finished without any token")
                return
            rec.success = True
