"""Llama 3.1/3.2 JSON calls: ``{"name": ..., "parameters": {...}}``, several joined by ``; ``,
optionally after ``<|python_tag|>``; the reply is a call only when it starts with one."""

from __future__ import annotations

import json
from typing import Any

from kvserve.server.tool_parsers.base import Parsed, ToolParser, call_schema, call_view
from kvserve.server.tool_parsers.json_scan import skip_ws

TAG = "<|python_tag|>"
ARGS = ("parameters", "arguments")


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def parse(self, text: str, final: bool) -> Parsed:
        j = skip_ws(text, 0)
        if text.startswith(TAG, j):
            j = skip_ws(text, j + len(TAG))
        elif not final and j < len(text) and TAG.startswith(text[j:]):
            return Parsed("")  # may still become the tag
        if j >= len(text):
            return Parsed(text if final else "")
        if text[j] != "{":
            return Parsed(text)
        out = Parsed("")
        while True:
            view = call_view(text, j, ARGS)
            out.calls.append(view)
            if view.end is None:
                break
            k = skip_ws(text, view.end)
            if k >= len(text):
                break
            if text[k] != ";":
                raise ValueError("calls must be separated by ';'")
            j = skip_ws(text, k + 1)
            if j >= len(text):
                break
            if text[j] != "{":
                raise ValueError("a call must be a JSON object")
        return out

    def grammar(self, tools: list[dict[str, Any]], parallel: bool, text: bool = False) -> str:
        call = "call: %json " + json.dumps(call_schema(tools, "parameters"))
        calls = 'calls: call ("; " call)*' if parallel else "calls: call"
        if text:
            return f"start: TEXT | calls\n{calls}\n{call}\nTEXT: /[^{{<](.|\\n)*/\n"
        return f"start: calls\n{calls}\n{call}\n"
