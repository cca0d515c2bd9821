"""One HTTP completion or chat request on its way through the engine, and the JSON it answers
with: envelopes, choices (whole or as stream deltas), and vLLM's extra response fields.

What a request asked for beyond the sampled text lives here, applied where a choice is built:
``echo`` (the prompt's text, and with logprobs its tokens' log-probs, before a completion's
first text; the last assistant message before a chat reply), ``return_token_ids``
(``token_ids`` per choice, ``prompt_token_ids`` once), ``prompt_logprobs`` and chat's
``prompt_text``. A streamed choice carries the one-time parts in its first chunk.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from kvserve.sched.request import CompletionOutput, RequestOutput, SamplingParams
from kvserve.server.logprobs import LogprobFormatter, Position
from kvserve.server.tool_parsers import ToolParser
from kvserve.server.tools import ToolStream, call_dict, tool_call_id


@dataclass
class Job:
    """A request's prompts (token ids, one engine request each), its sampling, its shape."""

    kind: str  # "completion" | "chat"
    model: str
    params: SamplingParams
    prompt_ids: list[list[int]]
    stream: bool
    include_usage: bool
    logprobs: LogprobFormatter
    id: str = ""  # the response's id (the client's request_id, if it sent one)
    engine_id: str = ""  # unique per HTTP request: the engine requests' ids start with it
    created: int = field(default_factory=lambda: int(time.time()))
    continuous_usage: bool = False  # vLLM's stream_options.continuous_usage_stats
    echo: list[str] | None = None  # per prompt: text before its choices' own
    echo_logprobs: bool = False  # completions: echoed prompt tokens in the logprobs too
    return_token_ids: bool = False
    prompt_logprobs: int | None = None  # vLLM's field, as asked (not echo's internal use)
    prompt_text: str | None = None  # chat's return_prompt_text: the rendered template
    # Per prompt, from the engine's output that carried them.
    prompt_lps: list[list[dict[int, float] | None] | None] = field(default_factory=list)
    started: set[int] = field(default_factory=set)  # streamed choices already begun
    # Chat with tools: the reply's calls are parsed out of its text (per streamed choice, the
    # parser's state).
    tool_parser: ToolParser | None = None
    tool_streams: dict[int, ToolStream] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.prompt_lps = [None] * len(self.prompt_ids)

    @property
    def object(self) -> str:
        if self.kind == "chat":
            return "chat.completion.chunk" if self.stream else "chat.completion"
        return "text_completion"

    def seen(self, index: int, out: RequestOutput) -> None:
        """Keep what arrives once per prompt (its prompt log-probs)."""
        if out.prompt_logprobs is not None:
            self.prompt_lps[index] = out.prompt_logprobs

    def envelope(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {"id": self.id, "object": self.object, "created": self.created,
                "model": self.model, "choices": choices, **extra}  # fmt: skip

    def head(self) -> dict[str, Any]:
        """Response-level extras of a chat reply (the first chunk's, when streaming)."""
        extra: dict[str, Any] = {}
        if self.kind != "chat":
            return extra
        if self.return_token_ids:
            extra["prompt_token_ids"] = self.prompt_ids[0]
        if self.prompt_text is not None:
            extra["prompt_text"] = self.prompt_text
        if self.prompt_logprobs is not None and not self.stream:
            extra["prompt_logprobs"] = self._prompt_logprobs(0)
        return extra

    def choice(self, k: int, c: CompletionOutput, delta: bool) -> dict[str, Any]:
        """Choice ``k`` (prompt ``k // n``); its first chunk when not yet ``started``."""
        p = k // self.params.n
        first = k not in self.started
        self.started.add(k)
        if self.kind == "completion":
            return self._completion_choice(k, p, c, first)
        text = c.text
        if self.echo is not None and not delta:
            text = self.echo[0] + text
        msg: dict[str, Any] = {"content": text} if delta else {"role": "assistant", "content": text}
        finish = c.finish_reason
        if self.tool_parser is not None:
            msg, called = self._tool_message(k, c, msg, delta)
            if called and finish == "stop":
                finish = "tool_calls"
        out = {"index": k, ("delta" if delta else "message"): msg,
               "logprobs": self.logprobs.chat(c), "finish_reason": finish}  # fmt: skip
        if self.return_token_ids:
            out["token_ids"] = c.token_ids
        return out

    def _tool_message(
        self, k: int, c: CompletionOutput, msg: dict[str, Any], delta: bool
    ) -> tuple[dict[str, Any], bool]:
        """The message with its calls parsed out; whether it ended as calls."""
        assert self.tool_parser is not None
        final = c.finish_reason is not None
        if not delta:
            content, calls = self.tool_parser.extract(msg["content"])
            msg = {"role": "assistant", "content": content}
            if calls:
                msg["tool_calls"] = [call_dict(call, tool_call_id()) for call in calls]
            return msg, bool(calls)
        stream = self.tool_streams.setdefault(k, ToolStream(self.tool_parser))
        content, deltas = stream.feed(msg["content"], final)
        msg = {"content": content} if content or not deltas else {}
        if deltas:
            msg["tool_calls"] = deltas
        return msg, final and stream.called()

    def _completion_choice(self, k: int, p: int, c: CompletionOutput, first: bool) -> dict:
        text, before = c.text, None
        if first and self.echo is not None:
            text = self.echo[p] + text
            if self.echo_logprobs:
                before = self._prompt_positions(p)
        out = {"index": k, "text": text, "logprobs": self.logprobs.completion(k, c, before),
               "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}  # fmt: skip
        if self.return_token_ids:
            out["token_ids"] = c.token_ids
            if first:
                out["prompt_token_ids"] = self.prompt_ids[p]
        if first and self.prompt_logprobs is not None and not self.stream:
            out["prompt_logprobs"] = self._prompt_logprobs(p)
        return out

    def _prompt_positions(self, p: int) -> list[Position]:
        lps = self.prompt_lps[p] or [None] * len(self.prompt_ids[p])
        return list(zip(self.prompt_ids[p], lps, strict=True))

    def _prompt_logprobs(self, p: int) -> list[Any] | None:
        lps = self.prompt_lps[p]
        return None if lps is None else self.logprobs.prompt(lps, self.prompt_logprobs or 0)
