"""/v1/completions and /v1/chat/completions: prompts in, OpenAI-shaped JSON or SSE out.

Both endpoints share one path: tokenize here (so the engine thread never spends a step on
it), submit one engine request per prompt, then either stream deltas as server-sent events
or wait for the final outputs. Either way the request is aborted the moment its client goes
away: a streaming response is cancelled by Starlette on disconnect (the generator's
``finally`` aborts), a plain one races its result against ``http.disconnect``.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from jinja2 import TemplateError

from kvserve.model.tokenizer import ChatTemplateError, Tokenizer
from kvserve.sched.request import (
    CompletionOutput,
    InvalidRequestError,
    RequestOutput,
    RequestTags,
    SamplingParams,
)
from kvserve.server.engine_loop import (
    EngineLoop,
    EngineStepError,
    EngineUnavailableError,
    QueueFullError,
    RequestHandle,
    RequestRefusedError,
)
from kvserve.server.metrics import ServerMetrics
from kvserve.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    api_error_from_invalid,
    bad_request,
)
from kvserve.server.tenants import TenantResolver


@dataclass
class ServerState:
    """Everything a request handler needs; one per app (no module globals)."""

    loop: EngineLoop
    tenants: TenantResolver
    metrics: ServerMetrics
    model_names: list[str]
    tokenizer: Tokenizer | None
    max_model_len: int
    max_body_bytes: int
    retry_after_s: int = 1
    # Whether a request may set its own kv_retention (--no-allow-kv-retention-override: no).
    allow_kv_retention_override: bool = True
    draining: bool = False
    created: int = field(default_factory=lambda: int(time.time()))

    def check_model(self, name: str | None) -> str:
        if name is None:
            return self.model_names[0]
        if name not in self.model_names:
            raise APIError(
                404,
                f"model: the model '{name}' does not exist; this server serves "
                f"{', '.join(repr(n) for n in self.model_names)}",
                param="model",
                code="model_not_found",
            )
        return name


def _usage(
    prompt: int, completion: int, cached: int, finals: list[RequestOutput] | None = None
) -> dict[str, Any]:
    usage: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
    kept = [o for o in finals or () if o is not None and o.num_seen_tokens is not None]
    if kept:  # kvserve extension: what a retention policy kept of what the requests saw
        usage["kv_retention"] = {
            "retained_tokens": sum(o.num_retained_tokens or 0 for o in kept),
            "seen_tokens": sum(o.num_seen_tokens or 0 for o in kept),
        }
    return usage


def _gpt2_byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: byte-level BPE vocab characters -> bytes."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    cs, extra = list(bs), 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


_BYTE_DECODER = _gpt2_byte_decoder()


class _Logprobs:
    """Engine logprobs (``{token_id: logprob}`` per position, sampled token + top-n) in the
    two OpenAI shapes: the legacy completions one and chat's ``content`` list.

    A token is shown by its own bytes, not by decoding it alone: byte-level tokens that are
    part of a multi-byte character would all decode to U+FFFD and collide as dict keys. Bytes
    that are not valid UTF-8 are written ``bytes:\\xNN`` as OpenAI does."""

    def __init__(self, tok: Tokenizer | None, top_n: int) -> None:
        self.tok = tok
        self.top_n = top_n
        self.offset: dict[int, int] = {}
        self._cache: dict[int, tuple[str, bytes]] = {}

    def _token(self, tid: int) -> tuple[str, bytes]:
        if tid not in self._cache:
            raw = self.tok.id_to_token(tid) if self.tok else None
            if raw is None:  # an id the model has but the tokenizer does not
                data = f"token_id:{tid}".encode()
            elif len(raw) == 6 and raw.startswith("<0x") and raw.endswith(">"):
                data = bytes([int(raw[3:5], 16)])  # SentencePiece byte fallback
            elif all(ch in _BYTE_DECODER for ch in raw):
                data = bytes(_BYTE_DECODER[ch] for ch in raw)
            else:
                assert self.tok is not None
                data = self.tok.decode([tid], skip_special_tokens=False).encode()
            try:
                text = data.decode()
            except UnicodeDecodeError:
                text = "bytes:" + "".join(f"\\x{b:02x}" for b in data)
            self._cache[tid] = (text, data)
        return self._cache[tid]

    def _s(self, tid: int) -> str:
        return self._token(tid)[0]

    def completion(self, k: int, c: CompletionOutput) -> dict[str, Any] | None:
        if c.logprobs is None:
            return None
        out: dict[str, list[Any]] = {
            "tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []
        }  # fmt: skip
        for tid, lps in zip(c.token_ids, c.logprobs, strict=False):
            s = self._s(tid)
            out["tokens"].append(s)
            out["token_logprobs"].append(lps.get(tid))
            top: dict[str, float] = {}
            for t, lp in sorted(lps.items(), key=lambda kv: -kv[1]):
                top.setdefault(self._s(t), lp)  # ids that decode alike keep the best logprob
            out["top_logprobs"].append(top)
            out["text_offset"].append(self.offset.get(k, 0))
            self.offset[k] = self.offset.get(k, 0) + (0 if s.startswith("bytes:") else len(s))
        return out

    def chat(self, c: CompletionOutput) -> dict[str, Any] | None:
        if c.logprobs is None:
            return None
        content = []
        for tid, lps in zip(c.token_ids, c.logprobs, strict=False):
            s, data = self._token(tid)
            top = sorted(lps.items(), key=lambda kv: -kv[1])[: self.top_n]
            content.append({
                "token": s, "logprob": lps.get(tid), "bytes": list(data),
                "top_logprobs": [
                    {"token": self._s(i), "logprob": lp, "bytes": list(self._token(i)[1])}
                    for i, lp in top
                ],
            })  # fmt: skip
        return {"content": content}


@dataclass
class _Job:
    """One HTTP request on its way through the engine."""

    kind: str  # "completion" | "chat"
    model: str
    params: SamplingParams
    prompt_ids: list[list[int]]
    stream: bool
    include_usage: bool
    logprobs: _Logprobs
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def object(self) -> str:
        if self.kind == "chat":
            return "chat.completion.chunk" if self.stream else "chat.completion"
        return "text_completion"

    def envelope(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {"id": self.id, "object": self.object, "created": self.created,
                "model": self.model, "choices": choices, **extra}  # fmt: skip

    def choice(self, k: int, c: CompletionOutput, delta: bool) -> dict[str, Any]:
        if self.kind == "completion":
            return {"index": k, "text": c.text, "logprobs": self.logprobs.completion(k, c),
                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}  # fmt: skip
        msg = {"content": c.text} if delta else {"role": "assistant", "content": c.text}
        return {"index": k, ("delta" if delta else "message"): msg,
                "logprobs": self.logprobs.chat(c), "finish_reason": c.finish_reason}  # fmt: skip


def _prompt_ids(state: ServerState, prompts: list[str | list[int]]) -> list[list[int]]:
    out = []
    for p in prompts:
        if isinstance(p, str):
            if not p:
                raise bad_request("prompt", "must not be empty")
            if state.tokenizer is None:
                raise bad_request("prompt", "this model has no tokenizer.json; send token ids")
            p = state.tokenizer.encode(p)
        out.append(p)
    return out


async def create_completion(
    state: ServerState, req: CompletionRequest, tenant: str, raw: Request
) -> Response:
    model = state.check_model(req.model)
    params = req.sampling_params()
    ids = _prompt_ids(state, req.prompts())
    lps = _Logprobs(state.tokenizer, req.logprobs or 0)
    job = _Job("completion", model, params, ids, req.stream, req.include_usage, lps,
               "cmpl-" + uuid.uuid4().hex)  # fmt: skip
    salt = state.tenants.cache_salt(tenant, req.client_salt)
    return await _run(state, job, salt, raw, {"prompt_token_ids": "prompt"}, _tags(req, tenant))


async def create_chat_completion(
    state: ServerState, req: ChatCompletionRequest, tenant: str, raw: Request
) -> Response:
    model = state.check_model(req.model)
    params = req.sampling_params()
    tok = state.tokenizer
    if tok is None:
        raise bad_request("messages", "this model has no tokenizer; use /v1/completions")
    try:
        text = tok.apply_chat_template(req.message_dicts(), req.add_generation_prompt)
    except (ChatTemplateError, TemplateError) as e:
        msg = str(e).removeprefix("messages: ")
        raise bad_request("messages", f"the chat template refused them: {msg}") from None
    ids = tok.encode(text, add_special_tokens=False)
    job = _Job("chat", model, params, [ids], req.stream, req.include_usage,
               _Logprobs(tok, req.top_logprobs or 0), "chatcmpl-" + uuid.uuid4().hex)  # fmt: skip
    salt = state.tenants.cache_salt(tenant, req.client_salt)
    rename = {"prompt": "messages", "prompt_token_ids": "messages"}
    if req.max_completion_tokens is not None:
        rename["max_tokens"] = "max_completion_tokens"
    return await _run(state, job, salt, raw, rename, _tags(req, tenant))


def _tags(req: CompletionRequest | ChatCompletionRequest, tenant: str) -> RequestTags:
    try:
        return RequestTags(req.priority, req.workload_class, tenant, req.user)
    except InvalidRequestError as e:
        raise api_error_from_invalid(e, {}) from None


async def _run(
    state: ServerState,
    job: _Job,
    salt: str,
    raw: Request,
    rename: dict[str, str],
    tags: RequestTags,
) -> Response:
    if state.draining:
        raise APIError(503, "the server is shutting down")
    if job.params.kv_retention is not None and not state.allow_kv_retention_override:
        raise bad_request(
            "kv_retention",
            "per-request retention policies are disabled on this server "
            "(started with --no-allow-kv-retention-override)",
        )
    prompts = [{"prompt_token_ids": ids, "cache_salt": salt} for ids in job.prompt_ids]
    arrival = time.monotonic()
    handle = RequestHandle(job.id, prompts, job.params, job.stream, arrival, tags)
    try:
        await state.loop.submit(handle)
    except InvalidRequestError as e:
        raise api_error_from_invalid(e, rename) from None
    except QueueFullError as e:
        raise APIError(429, f"{e}; retry later", code="rate_limit_exceeded",
                       headers={"Retry-After": str(state.retry_after_s)}) from None  # fmt: skip
    except EngineUnavailableError as e:
        raise APIError(503, str(e)) from None
    if job.stream and state.loop.refuses:
        # Admission control may still refuse it while it waits: hold the response until it
        # runs (or is refused: then a 429/503 with Retry-After, not an error in a 200 stream).
        try:
            if not await _first_output(handle, raw):
                state.loop.abort(handle)  # the client left while it waited
                return Response(status_code=499)
        except RequestRefusedError as e:
            state.loop.abort(handle)  # the handle's other prompts, if any, end with it
            raise refused_error(e) from None
        except BaseException:
            state.loop.abort(handle)
            raise
    if job.stream:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        return StreamingResponse(_sse(state, job, handle), media_type="text/event-stream",
                                 headers=headers)  # fmt: skip
    finals = await _collect(state, handle, raw)
    if finals is None:  # the client went away; the request was aborted
        return Response(status_code=499)
    return JSONResponse(_final_body(job, finals))


def _final_body(job: _Job, finals: list[RequestOutput]) -> dict[str, Any]:
    n = job.params.n
    choices, completion = [], 0
    for i, out in enumerate(finals):
        for c in sorted(out.outputs, key=lambda c: c.index):
            completion += len(c.token_ids)
            choices.append(job.choice(i * n + c.index, c, delta=False))
    prompt = sum(len(p) for p in job.prompt_ids)
    cached = sum(o.num_cached_tokens for o in finals)
    return job.envelope(choices, usage=_usage(prompt, completion, cached, finals))


async def _disconnected(raw: Request) -> None:
    """Returns when the client closes the connection."""
    while (await raw.receive())["type"] != "http.disconnect":
        pass


async def _collect(
    state: ServerState, handle: RequestHandle, raw: Request
) -> list[RequestOutput] | None:
    """The final output of every prompt, or None if the client disconnected first."""
    finals: list[Any] = [None] * len(handle.prompts)

    async def consume() -> None:
        async for sub in handle.outputs():
            if sub.output.finished:
                finals[sub.index] = sub.output

    work, watch = asyncio.ensure_future(consume()), asyncio.ensure_future(_disconnected(raw))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        if work.done():
            if (e := work.exception()) is not None:
                if isinstance(e, EngineStepError):
                    raise APIError(500, f"engine step failed: {e}", code="engine_error")
                if isinstance(e, RequestRefusedError):
                    raise refused_error(e)
                raise APIError(503, str(e)) if isinstance(e, EngineUnavailableError) else e
            return finals
        return None
    finally:
        work.cancel()
        watch.cancel()
        state.loop.abort(handle)


def refused_error(e: RequestRefusedError) -> APIError:
    """429 with Retry-After; 503 when the engine is overloaded for longer than that."""
    status, code = (503, "overloaded") if e.overloaded else (429, "rate_limit_exceeded")
    return APIError(status, f"{e}; retry later", code=code,
                    headers={"Retry-After": str(int(e.retry_after))})  # fmt: skip


async def _first_output(handle: RequestHandle, raw: Request) -> bool:
    """Wait until the request's first output (True) or the client leaving (False: aborted).
    Raises :class:`RequestRefusedError` when admission control refused it meanwhile."""

    first, watch = asyncio.ensure_future(handle.peek()), asyncio.ensure_future(_disconnected(raw))
    try:
        await asyncio.wait({first, watch}, return_when=asyncio.FIRST_COMPLETED)
        if first.done():
            first.result()  # raises the refusal
            return True
        return False
    finally:
        first.cancel()
        watch.cancel()


# One encoder for every event: ``json.dumps`` with a keyword builds a new encoder per call, and
# this runs once per token per stream on the event loop, beside the engine's compute threads.
_JSON = json.JSONEncoder(ensure_ascii=False)


def _sse_event(payload: dict[str, Any] | str) -> str:
    data = payload if isinstance(payload, str) else _JSON.encode(payload)
    return f"data: {data}\n\n"


async def _sse(state: ServerState, job: _Job, handle: RequestHandle) -> AsyncIterator[bytes]:
    """The stream's events, those already here written together: a request with several
    prompts or ``n`` > 1 gets one output per sequence per step, a loop that fell behind finds
    several steps queued, and the last tokens, the usage and ``[DONE]`` are ready at once. One
    socket write each instead of one per event, on the event loop that shares the engine's
    cores."""
    n = job.params.n
    usage_field = {"usage": None} if job.include_usage else {}
    completion, cached = 0, [0] * len(job.prompt_ids)
    finals: list[RequestOutput | None] = [None] * len(job.prompt_ids)
    events: list[str] = []
    try:
        if job.kind == "chat":
            first = [{"index": k, "delta": {"role": "assistant", "content": ""},
                      "logprobs": None, "finish_reason": None}
                     for k in range(n * len(job.prompt_ids))]  # fmt: skip
            yield _sse_event(job.envelope(first, **usage_field)).encode()
        async for sub in handle.outputs():
            o = sub.output
            cached[sub.index] = o.num_cached_tokens
            if o.finished:
                finals[sub.index] = o
            choices = []
            for c in o.outputs:
                completion += len(c.token_ids)
                if c.text or c.token_ids or c.finish_reason is not None:
                    choices.append(job.choice(sub.index * n + c.index, c, delta=True))
            if choices:
                events.append(_sse_event(job.envelope(choices, **usage_field)))
            if events and not handle.ready() and None in finals:  # (the last goes with [DONE])
                yield "".join(events).encode()
                events.clear()
        if job.include_usage:
            prompt = sum(len(p) for p in job.prompt_ids)
            usage = _usage(prompt, completion, sum(cached), finals)  # type: ignore[arg-type]
            events.append(_sse_event(job.envelope([], usage=usage)))
    except EngineUnavailableError as e:
        events.append(_sse_event(APIError(503, str(e)).body()))
    except EngineStepError as e:
        events.append(
            _sse_event(APIError(500, f"engine step failed: {e}", code="engine_error").body())
        )
    finally:
        state.loop.abort(handle)  # a no-op when finished; otherwise the client left
    events.append(_sse_event("[DONE]"))
    yield "".join(events).encode()
