"""OpenAI tool calling: ``tools``, ``tool_choice``, ``parallel_tool_calls`` in; ``tool_calls`` out.

The model writes calls in its own format (its chat template's: hermes ``<tool_call>`` blocks,
llama3 JSON); a parser from :mod:`kvserve.server.tool_parsers` reads them back. ``required``
and a named function are forced with a grammar of that format (the tools' ``parameters`` as
JSON schemas inside it), so the reply is a well-formed call to a tool that exists; ``auto``
leaves the model free and parses what it wrote, as vLLM does (constrained to text or
well-formed calls when a tool is ``strict``), and needs ``--enable-auto-tool-choice`` (vLLM's
rule: without it ``auto`` is a 400). Text that is not
well-formed calls stays content.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from kvserve.server.api_errors import bad_request
from kvserve.server.structured import Constraint, tools_constraint
from kvserve.server.tool_parsers import TOOL_PARSERS, ToolCall, ToolParser


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    type: Literal["function"]
    function: FunctionDefinition


@dataclass(frozen=True, slots=True)
class ToolSettings:
    """The server's: the parser (``--tool-call-parser``, else the chat template's format) and
    whether ``auto`` is allowed (``--enable-auto-tool-choice``)."""

    parser: str | None = None
    enable_auto: bool = False


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """How one request's tools are served: the parser of its output, and its constraint."""

    parser: ToolParser
    constraint: Constraint | None


def plan_tools(
    tools: list[ChatTool] | None,
    tool_choice: Any,
    parallel: bool | None,
    settings: ToolSettings,
) -> ToolPlan | None:
    """None when the reply is plain content (no tools, or ``tool_choice`` none)."""
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if tool_choice == "none":
        return None
    if not tools:
        if tool_choice == "required" and tools is not None:
            return None  # OpenAI's: required with an empty list behaves as none
        raise bad_request("tool_choice", "needs tools: the request has none")
    if tool_choice == "auto":
        if not settings.enable_auto or settings.parser is None:
            raise bad_request(
                "tool_choice",
                '"auto" tool choice requires the server to be started with '
                "--enable-auto-tool-choice and --tool-call-parser (or a chat template whose "
                "tool-call format kvserve reads)",
            )
        parser = TOOL_PARSERS[settings.parser]()
        if not any(t.function.strict for t in tools):
            return ToolPlan(parser, None)
        funcs = [t.function.model_dump(exclude_none=True) for t in tools]
        grammar = parser.grammar(funcs, parallel is not False, text=True)
        return ToolPlan(parser, tools_constraint(grammar, _source(list(range(len(tools))))))
    parser = TOOL_PARSERS[settings.parser or "hermes"]()
    if tool_choice == "required":
        chosen = list(range(len(tools)))
        many = parallel is not False
    else:
        name = _named(tool_choice)
        chosen = [i for i, t in enumerate(tools) if t.function.name == name]
        if not chosen:
            names = ", ".join(repr(t.function.name) for t in tools)
            raise bad_request("tool_choice", f"names the function {name!r}, which is not one "
                              f"of the request's tools ({names})")  # fmt: skip
        chosen, many = chosen[:1], False
    funcs = [tools[i].function.model_dump(exclude_none=True) for i in chosen]
    return ToolPlan(parser, tools_constraint(parser.grammar(funcs, many), _source(chosen)))


def _source(chosen: list[int]) -> str:
    """The field a compile error names: the one tool's parameters, else all the tools."""
    return f"tools[{chosen[0]}].function.parameters" if len(chosen) == 1 else "tools"


def _named(choice: Any) -> str:
    ok = (
        isinstance(choice, dict)
        and choice.get("type") == "function"
        and isinstance(choice.get("function"), dict)
        and isinstance(choice["function"].get("name"), str)
    )
    if not ok:
        raise bad_request("tool_choice", 'must be "none", "auto", "required" or '
                          '{"type": "function", "function": {"name": "..."}}')  # fmt: skip
    return choice["function"]["name"]


def tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def call_dict(call: ToolCall, call_id: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}  # fmt: skip


@dataclass
class ToolStream:
    """One streamed choice: the text so far in, content and ``tool_calls`` deltas out.

    Each delta is what the parser's settled view gained since the last one: a call's id and
    name when its name is complete, then fragments of its arguments' text; so the deltas of a
    call concatenate to the call :meth:`ToolParser.extract` finds in the whole text."""

    parser: ToolParser
    text: str = ""
    content_sent: int = 0
    args_sent: list[int] = field(default_factory=list)
    broken: bool = False

    def feed(self, delta: str, final: bool) -> tuple[str, list[dict[str, Any]]]:
        self.text += delta
        try:
            parsed = None if self.broken else self.parser.parse(self.text, final)
        except ValueError:
            parsed, self.broken = None, True
        if final and not self.args_sent and not self.parser.extract(self.text)[1]:
            parsed = None  # the whole text is content (nothing went out as a call)
        if parsed is None:  # not calls after all: content, unless calls already went out
            if self.args_sent:
                return "", []
            out = self.text[self.content_sent :]
            self.content_sent = len(self.text)
            return out, []
        content = parsed.content[self.content_sent :]
        self.content_sent = max(self.content_sent, len(parsed.content))
        calls: list[dict[str, Any]] = []
        for i, view in enumerate(parsed.calls):
            if i == len(self.args_sent):
                if view.name is None or not view.arguments:  # the name, once a call is sure
                    break
                self.args_sent.append(len(view.arguments))
                calls.append({"index": i, "id": tool_call_id(), "type": "function",
                              "function": {"name": view.name,
                                           "arguments": view.arguments}})  # fmt: skip
            elif len(view.arguments) > self.args_sent[i]:
                calls.append({"index": i, "function": {
                    "arguments": view.arguments[self.args_sent[i] :]}})  # fmt: skip
                self.args_sent[i] = len(view.arguments)
        return content, calls

    def called(self) -> bool:
        """Whether the whole text is well-formed calls (the finish reason is tool_calls)."""
        return bool(self.args_sent) and bool(self.parser.extract(self.text)[1])
