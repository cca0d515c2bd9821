"""Tool-call formats: parsers of a model's calls, and grammars that force them.

Which format a model writes is its chat template's choice: :func:`detect_parser` reads it from
the template (``--tool-call-parser`` overrides it, vLLM's flag and names).
"""

from __future__ import annotations

from kvserve.server.tool_parsers.base import CallView, Parsed, ToolCall, ToolParser
from kvserve.server.tool_parsers.hermes import HermesToolParser
from kvserve.server.tool_parsers.llama3_json import Llama3JsonToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
}


def detect_parser(chat_template: str | None) -> str | None:
    """The format a chat template teaches its model, when it has one of ours."""
    if not chat_template:
        return None
    if "<tool_call>" in chat_template:
        return "hermes"
    if "<|python_tag|>" in chat_template or (
        '"parameters"' in chat_template and "ipython" in chat_template
    ):
        return "llama3_json"
    return None


__all__ = ["TOOL_PARSERS", "CallView", "Parsed", "ToolCall", "ToolParser", "detect_parser"]
