"""Hermes-style calls (Qwen2.5, Hermes 2/3): ``<tool_call>\\n{"name": ..., "arguments": {...}}
\\n</tool_call>``, one block per call, after any content."""

from __future__ import annotations

import json
from typing import Any

from kvserve.server.tool_parsers.base import Parsed, ToolParser, call_schema, call_view, hold_prefix
from kvserve.server.tool_parsers.json_scan import skip_ws

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"

    def parse(self, text: str, final: bool) -> Parsed:
        at = text.find(OPEN)
        if at < 0:
            return Parsed(text if final else hold_prefix(text, OPEN))
        out = Parsed(text[:at])
        pos = at
        while 0 <= pos < len(text):
            start = pos + len(OPEN)
            close = text.find(CLOSE, start)
            body = text[: close if close >= 0 else len(text)]
            j = skip_ws(body, start)
            if j < len(body):
                if body[j] != "{":
                    raise ValueError("a <tool_call> block must hold a JSON object")
                out.calls.append(call_view(body, j, ("arguments",)))
            if close < 0:
                break
            pos = text.find(OPEN, close + len(CLOSE))
        return out

    def grammar(self, tools: list[dict[str, Any]], parallel: bool, text: bool = False) -> str:
        schema = json.dumps(call_schema(tools, "arguments"))
        call = 'call: "<tool_call>\\n" %json ' + schema + ' "\\n</tool_call>"'
        calls = 'calls: call ("\\n" call)*' if parallel else "calls: call"
        if text:
            return f"start: TEXT | calls\n{calls}\n{call}\nTEXT: /[^<](.|\\n)*/\n"
        return f"start: calls\n{calls}\n{call}\n"
