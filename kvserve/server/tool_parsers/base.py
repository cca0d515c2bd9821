"""What a tool-call parser answers: the content and the calls in a model's text so far.

A parser reads the whole text each time (outputs are short next to the cost of a step), and
answers only what is settled: content that cannot turn out to be the start of a call, a call's
name once its string is complete, its arguments as the raw slice of the model's text written
so far. So what it answers grows by appending as the text grows, and a stream of the
differences concatenates to the final answer (the non-streamed call): vLLM's streaming
parsers re-serialise partial JSON instead, which is where its deltas and its final calls
parted ways.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from kvserve.server.tool_parsers.json_scan import scan_object


@dataclass(frozen=True, slots=True)
class CallView:
    name: str | None  # None until the name's string is complete
    arguments: str  # the arguments' JSON text so far, as the model wrote it
    end: int | None  # past the call's object in the text; None while it is incomplete


@dataclass(slots=True)
class Parsed:
    content: str
    calls: list[CallView] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object's text


def call_view(s: str, i: int, args_keys: tuple[str, ...]) -> CallView:
    """The call object starting at ``s[i]`` (``{"name": ..., "arguments": {...}}``)."""
    scan = scan_object(s, i)
    name, arguments = None, ""
    for m in scan.members:
        if m.key == "name" and m.end is not None:
            value = json.loads(s[m.start : m.end])
            if not isinstance(value, str):
                raise ValueError("a tool call's name must be a string")
            name = value
        elif m.key in args_keys:
            if s[m.start] != "{":
                raise ValueError("a tool call's arguments must be an object")
            if m.end is not None:
                arguments = s[m.start : m.end]
            else:  # inside the object: every character so far is its own
                arguments = s[m.start :]
    return CallView(name, arguments, scan.end)


def finished_calls(calls: list[CallView]) -> list[ToolCall] | None:
    """The calls, when every one is complete and well formed; None otherwise."""
    out = []
    for c in calls:
        if c.end is None or c.name is None or not c.arguments:
            return None
        try:
            if not isinstance(json.loads(c.arguments), dict):
                return None
        except ValueError:
            return None
        out.append(ToolCall(c.name, c.arguments))
    return out or None


def hold_prefix(text: str, marker: str) -> str:
    """``text`` less a tail that may be the start of ``marker`` (not yet content)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return text[:-k]
    return text


def call_schema(tools: list[dict[str, Any]], args_key: str) -> dict[str, Any]:
    """JSON schema of one call to any of ``tools`` (OpenAI ``function`` objects)."""
    options = [
        {
            "type": "object",
            "properties": {
                "name": {"const": t["name"]},
                args_key: t.get("parameters") or {"type": "object"},
            },
            "required": ["name", args_key],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema = dict(options[0]) if len(options) == 1 else {"anyOf": options}
    # llguidance's options: the separators chat templates write (json.dumps'), and no free
    # whitespace for a model to pad a call with until max_tokens.
    schema["x-guidance"] = {"whitespace_flexible": False, "item_separator": ", ",
                            "key_separator": ": "}  # fmt: skip
    return schema


class ToolParser(ABC):
    """One model family's tool-call format: parse it, and a grammar that forces it."""

    name: str

    @abstractmethod
    def parse(self, text: str, final: bool) -> Parsed:
        """What is settled in ``text``; raises ValueError on text that cannot be a call."""

    @abstractmethod
    def grammar(self, tools: list[dict[str, Any]], parallel: bool, text: bool = False) -> str:
        """A Lark grammar (llguidance's, with ``%json``) of one call, or of one or more; with
        ``text``, of either calls or plain text that does not start like one (``auto`` with a
        ``strict`` tool: the model may answer, but a call it writes matches its schema)."""

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The final content and calls; text that is not well-formed calls is all content."""
        try:
            parsed = self.parse(text, final=True)
        except ValueError:
            return text, []
        if not parsed.calls:
            return text, []
        calls = finished_calls(parsed.calls)
        if calls is None:
            return text, []
        return (parsed.content if parsed.content.strip() else None), calls
