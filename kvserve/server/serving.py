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

from kvserve.disagg.params import BadTransferParams, check_request_params
from kvserve.model.tokenizer import Tokenizer
from kvserve.sched.request import (
    InvalidRequestError,
    RequestOutput,
    RequestTags,
    SamplingParams,
)
from kvserve.server.api_errors import APIError, api_error_from_invalid, bad_request
from kvserve.server.chat_prompt import render_chat
from kvserve.server.engine_loop import (
    EngineLoop,
    EngineStepError,
    EngineUnavailableError,
    QueueFullError,
    RequestHandle,
    RequestRefusedError,
)
from kvserve.server.job import Job
from kvserve.server.logprobs import LogprobFormatter
from kvserve.server.metrics import ServerMetrics
from kvserve.server.protocol import ChatCompletionRequest, CompletionRequest
from kvserve.server.request_fields import IgnoredFields
from kvserve.server.tenants import TenantResolver
from kvserve.server.tools import ToolSettings, plan_tools


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
    # The engine's --scheduling-policy: a request's priority means something only under
    # "priority", so elsewhere a non-zero one is refused (as vLLM does).
    scheduling_policy: str = "fcfs"
    # --tool-call-parser (else the chat template's format) and --enable-auto-tool-choice.
    tool_settings: ToolSettings = field(default_factory=ToolSettings)
    draining: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    ignored: IgnoredFields = field(init=False)

    def __post_init__(self) -> None:
        self.ignored = IgnoredFields(self.metrics.ignored_fields)

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
    moved = sum(o.num_transferred_tokens for o in finals or () if o is not None)
    if moved:  # kvserve extension: prompt tokens a prefill engine computed (not cache hits)
        usage["kv_transfer"] = {"transferred_tokens": moved}
    kept = [o for o in finals or () if o is not None and o.num_seen_tokens is not None]
    if kept:  # kvserve extension: what a retention policy kept of what the requests saw
        usage["kv_retention"] = {
            "retained_tokens": sum(o.num_retained_tokens or 0 for o in kept),
            "seen_tokens": sum(o.num_seen_tokens or 0 for o in kept),
        }
    return usage


def _prompt_ids(
    state: ServerState, req: CompletionRequest, prompts: list[str | list[int]]
) -> list[list[int]]:
    out = []
    for p in prompts:
        if isinstance(p, str):
            if not p:
                raise bad_request("prompt", "must not be empty")
            if state.tokenizer is None:
                raise bad_request("prompt", "this model has no tokenizer.json; send token ids")
            p = state.tokenizer.encode(p, add_special_tokens=req.add_special_tokens)
        out.append(req.truncate(p, state.max_model_len))
    return out


def _ids(req: CompletionRequest | ChatCompletionRequest, prefix: str) -> tuple[str, str]:
    """The response's id and the engine's (unique even when clients reuse a request_id)."""
    engine_id = prefix + uuid.uuid4().hex
    return (prefix + req.request_id if req.request_id else engine_id), engine_id


async def create_completion(
    state: ServerState, req: CompletionRequest, tenant: str, raw: Request
) -> Response:
    model = state.check_model(req.model)
    constraint = req.constraint()
    params = req.sampling_params(constraint)
    _check_vocab(state, params)
    prompts = req.prompts()
    ids = _prompt_ids(state, req, prompts)
    lps = LogprobFormatter(state.tokenizer, req.logprobs or 0, bool(req.return_tokens_as_token_ids))
    job = Job("completion", model, params, ids, req.stream, req.include_usage, lps,
              *_ids(req, "cmpl-"), continuous_usage=req.continuous_usage,
              return_token_ids=bool(req.return_token_ids),
              prompt_logprobs=req.prompt_logprobs)  # fmt: skip
    if req.echo:
        # a text prompt as sent; token ids, or a prompt truncate_prompt_tokens cut, decoded
        job.echo = [
            p
            if isinstance(p, str) and req.truncate_prompt_tokens is None
            else _decode(state, i, params)
            for p, i in zip(prompts, ids, strict=True)
        ]
        job.echo_logprobs = req.logprobs is not None
    salt = state.tenants.cache_salt(tenant, req.client_salt)
    tags = _tags(state, req, tenant)
    rename = {"prompt_token_ids": "prompt", **(constraint.rename if constraint else {})}
    return await _run(state, job, salt, raw, rename, tags)


def _decode(state: ServerState, ids: list[int], params: SamplingParams) -> str:
    if state.tokenizer is None:
        return ""
    return state.tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens)


async def create_chat_completion(
    state: ServerState, req: ChatCompletionRequest, tenant: str, raw: Request
) -> Response:
    model = state.check_model(req.model)
    plan = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls, state.tool_settings)
    constraint = req.output_constraint(plan)
    params = req.sampling_params(constraint)
    _check_vocab(state, params)
    tok = state.tokenizer
    messages = req.message_dicts()
    text = render_chat(tok, messages, req.add_generation_prompt, req.continue_final_message,
                       req.tool_dicts())  # fmt: skip
    assert tok is not None  # render_chat refused a model without one
    ids = req.truncate(tok.encode(text, add_special_tokens=req.add_special_tokens),
                       state.max_model_len)  # fmt: skip
    lps = LogprobFormatter(tok, req.top_logprobs or 0, bool(req.return_tokens_as_token_ids))
    job = Job("chat", model, params, [ids], req.stream, req.include_usage, lps,
              *_ids(req, "chatcmpl-"), continuous_usage=req.continuous_usage,
              return_token_ids=bool(req.return_token_ids), prompt_logprobs=req.prompt_logprobs,
              prompt_text=text if req.return_prompt_text else None,
              tool_parser=plan.parser if plan is not None else None)  # fmt: skip
    # vLLM's echo: the reply's role is the assistant's unless it continues the last message;
    # a last message of that role is repeated before the reply.
    role = "assistant" if req.add_generation_prompt else messages[-1]["role"]
    if req.echo:
        job.echo = [messages[-1]["content"] if messages[-1]["role"] == role else ""]
    salt = state.tenants.cache_salt(tenant, req.client_salt)
    rename = {"prompt": "messages", "prompt_token_ids": "messages"}
    if req.max_completion_tokens is not None:
        rename["max_tokens"] = "max_completion_tokens"
    if constraint is not None:
        rename.update(constraint.rename)
    return await _run(state, job, salt, raw, rename, _tags(state, req, tenant))


def _check_vocab(state: ServerState, params: SamplingParams) -> None:
    """``logit_bias`` names tokens of the tokenizer: a checkpoint's vocabulary is often padded
    past it (to a multiple of 64 or 128), and a bias on those rows would revive ids that name
    nothing (the engine checks the model's vocabulary for every token-id field)."""
    if state.tokenizer is None or not params.logit_bias:
        return
    v = state.tokenizer.vocab_size
    bad = next((t for t in params.logit_bias if t >= v), None)
    if bad is not None:
        raise bad_request("logit_bias", f"token id {bad} is past this model's tokenizer "
                          f"(its ids are 0 to {v - 1})")  # fmt: skip


def _tags(
    state: ServerState, req: CompletionRequest | ChatCompletionRequest, tenant: str
) -> RequestTags:
    if req.priority and state.scheduling_policy != "priority":
        raise bad_request("priority", f"has no effect under --scheduling-policy "
                          f"{state.scheduling_policy}; the server must be started with "
                          "--scheduling-policy priority")  # fmt: skip
    if req.kv_transfer_params is not None and not state.loop.engine.connector:
        raise bad_request("kv_transfer_params", "not supported by this server: it runs no KV "
                          "connector (start it with --kv-transfer-config)")  # fmt: skip
    try:
        check_request_params(req.kv_transfer_params)
    except BadTransferParams as e:
        raise bad_request("kv_transfer_params", str(e)) from None
    try:
        return RequestTags(req.priority, req.workload_class, tenant, req.user,
                           req.kv_transfer_params)  # fmt: skip
    except InvalidRequestError as e:
        raise api_error_from_invalid(e, {}) from None


async def _run(
    state: ServerState,
    job: Job,
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
    handle = RequestHandle(job.engine_id, prompts, job.params, job.stream, arrival, tags)
    try:
        if job.params.structured_outputs is not None:
            # Compile on a worker thread, not the engine's (every running request would wait
            # out the compile) nor the event loop's; add_request then finds it cached.
            await asyncio.to_thread(state.loop.engine.prepare_structured_outputs, job.params)
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
    finals = await _collect(state, job, handle, raw)
    if finals is None:  # the client went away; the request was aborted
        return Response(status_code=499)
    return JSONResponse(_final_body(job, finals))


def _final_body(job: Job, finals: list[RequestOutput]) -> dict[str, Any]:
    n = job.params.n
    choices, completion = [], 0
    for i, out in enumerate(finals):
        for c in sorted(out.outputs, key=lambda c: c.index):
            completion += len(c.token_ids)
            choices.append(job.choice(i * n + c.index, c, delta=False))
    prompt = sum(len(p) for p in job.prompt_ids)
    cached = sum(o.num_cached_tokens for o in finals)
    extra = job.head()
    if finals and finals[0].kv_transfer_params:  # vLLM's place: the response's top level
        extra["kv_transfer_params"] = finals[0].kv_transfer_params
    return job.envelope(choices, usage=_usage(prompt, completion, cached, finals), **extra)


async def _disconnected(raw: Request) -> None:
    """Returns when the client closes the connection."""
    while (await raw.receive())["type"] != "http.disconnect":
        pass


async def _collect(
    state: ServerState, job: Job, handle: RequestHandle, raw: Request
) -> list[RequestOutput] | None:
    """The final output of every prompt, or None if the client disconnected first."""
    finals: list[Any] = [None] * len(handle.prompts)

    async def consume() -> None:
        async for sub in handle.outputs():
            job.seen(sub.index, sub.output)
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


async def _sse(state: ServerState, job: Job, handle: RequestHandle) -> AsyncIterator[bytes]:
    """The stream's events, those already here written together: a request with several
    prompts or ``n`` > 1 gets one output per sequence per step, a loop that fell behind finds
    several steps queued, and the last tokens, the usage and ``[DONE]`` are ready at once. One
    socket write each instead of one per event, on the event loop that shares the engine's
    cores."""
    n = job.params.n
    prompt = sum(len(p) for p in job.prompt_ids)
    completion, cached = 0, [0] * len(job.prompt_ids)
    finals: list[RequestOutput | None] = [None] * len(job.prompt_ids)
    events: list[str] = []

    def usage_field() -> dict[str, Any]:
        if job.continuous_usage:  # vLLM's continuous_usage_stats: the usage so far
            return {"usage": _usage(prompt, completion, sum(cached))}
        return {"usage": None} if job.include_usage else {}

    try:
        if job.kind == "chat":
            first = [{"index": k, "delta": {"role": "assistant", "content": ""},
                      "logprobs": None, "finish_reason": None}
                     for k in range(n * len(job.prompt_ids))]  # fmt: skip
            events.append(_sse_event(job.envelope(first, **usage_field(), **job.head())))
            if job.echo and job.echo[0]:
                echo = [{"index": k, "delta": {"content": job.echo[0]}, "logprobs": None,
                         "finish_reason": None} for k in range(n)]  # fmt: skip
                events.append(_sse_event(job.envelope(echo, **usage_field())))
            yield "".join(events).encode()
            events.clear()
        async for sub in handle.outputs():
            o = sub.output
            job.seen(sub.index, o)
            cached[sub.index] = o.num_cached_tokens
            if o.finished:
                finals[sub.index] = o
            choices = []
            for c in o.outputs:
                completion += len(c.token_ids)
                if c.text or c.token_ids or c.finish_reason is not None:
                    choices.append(job.choice(sub.index * n + c.index, c, delta=True))
            if choices:
                events.append(_sse_event(job.envelope(choices, **usage_field())))
            if events and not handle.ready() and None in finals:  # (the last goes with [DONE])
                yield "".join(events).encode()
                events.clear()
        if job.include_usage:
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
