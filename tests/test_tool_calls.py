"""Tool-call parsers against hand-written model outputs (hermes, llama3_json), the streamed
deltas they give against the whole text, and tool_choice planning."""

from __future__ import annotations

import json

import pytest

from kvserve.server.api_errors import APIError
from kvserve.server.tool_parsers import TOOL_PARSERS, detect_parser
from kvserve.server.tool_parsers.base import ToolCall
from kvserve.server.tools import ChatTool, ToolSettings, ToolStream, plan_tools

HERMES = TOOL_PARSERS["hermes"]()
LLAMA = TOOL_PARSERS["llama3_json"]()

WEATHER = '{"city": "Paris", "unit": "c"}'
TIME = '{"tz": "Europe/Paris"}'

# (model output, expected content, expected calls) written by hand from the formats'
# documentation (Qwen2.5's template, Llama 3.1's JSON tool calling).
HERMES_CASES = [
    ("It is sunny.", "It is sunny.", []),
    (f'<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n</tool_call>',
     None, [ToolCall("get_weather", WEATHER)]),
    (f'Let me check.\n<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n'
     f'</tool_call>\n<tool_call>\n{{"arguments": {TIME}, "name": "get_time"}}\n</tool_call>',
     "Let me check.\n", [ToolCall("get_weather", WEATHER), ToolCall("get_time", TIME)]),
    # unicode and escapes inside the arguments are kept as the model wrote them
    ('<tool_call>{"name": "say", "arguments": {"text": "é \\"q\\" 雪 🙂 }"}}</tool_call>',
     None, [ToolCall("say", '{"text": "é \\"q\\" 雪 🙂 }"}')]),
    # an unclosed block at the end still counts when its JSON is whole (vLLM's rule)
    (f'<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}', None,
     [ToolCall("get_weather", WEATHER)]),
]  # fmt: skip
MALFORMED_HERMES = [
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',  # cut off
    "<tool_call>\nnot json\n</tool_call>",
    '<tool_call>\n{"name": 3, "arguments": {}}\n</tool_call>',  # name not a string
    '<tool_call>\n{"name": "f", "arguments": [1]}\n</tool_call>',  # arguments not an object
    '<tool_call>\n{"name": "f"}\n</tool_call>',  # no arguments
]
LLAMA_CASES = [
    ("The answer is 4.", "The answer is 4.", []),
    (f'{{"name": "get_weather", "parameters": {WEATHER}}}', None,
     [ToolCall("get_weather", WEATHER)]),
    (f'<|python_tag|>{{"name": "get_weather", "parameters": {WEATHER}}}; '
     f'{{"name": "get_time", "arguments": {TIME}}}', None,
     [ToolCall("get_weather", WEATHER), ToolCall("get_time", TIME)]),
]  # fmt: skip
MALFORMED_LLAMA = [
    '{"name": "get_weather", "parameters": {"city"',
    '{"name": "get_weather", "parameters": {}} and then text',
    '{"answer": 4}',  # JSON, but not a call
]


@pytest.mark.parametrize(("text", "content", "calls"), HERMES_CASES)
def test_hermes_extract(text, content, calls):
    assert HERMES.extract(text) == (content, calls)


@pytest.mark.parametrize(("text", "content", "calls"), LLAMA_CASES)
def test_llama3_json_extract(text, content, calls):
    assert LLAMA.extract(text) == (content, calls)


@pytest.mark.parametrize(
    ("parser", "text"),
    [*((HERMES, t) for t in MALFORMED_HERMES), *((LLAMA, t) for t in MALFORMED_LLAMA)],
)
def test_malformed_calls_are_content(parser, text):
    assert parser.extract(text) == (text, [])


def _stream(parser, text: str, sizes: list[int]) -> tuple[str, dict[int, dict]]:
    """Feed ``text`` in pieces of ``sizes`` (cycled); join the deltas as a client does."""
    s, content, calls, i, k = ToolStream(parser), "", {}, 0, 0
    while i < len(text):
        piece = text[i : i + sizes[k % len(sizes)]]
        i, k = i + len(piece), k + 1
        c, deltas = s.feed(piece, final=i >= len(text))
        content += c
        for d in deltas:
            if d["index"] not in calls:
                assert "id" in d and d["function"]["name"], "a call's first delta names it"
                assert d["index"] == len(calls), "calls start in order, indexes from 0"
                calls[d["index"]] = {"name": d["function"]["name"], "arguments": ""}
            else:
                assert "name" not in d["function"], "the name is sent once"
            calls[d["index"]]["arguments"] += d["function"]["arguments"]
    return content, calls


@pytest.mark.parametrize("sizes", [[1], [2, 5], [7, 1, 3], [1000]])
@pytest.mark.parametrize(
    ("parser", "case"),
    [*((HERMES, c) for c in HERMES_CASES), *((LLAMA, c) for c in LLAMA_CASES)],
)
def test_streamed_deltas_add_up_to_the_calls(parser, case, sizes):
    """Whatever the pieces (one character at a time, parallel calls arriving in one
    piece), the deltas concatenate to the calls and content the whole text gives."""
    text, content, calls = case
    got_content, got_calls = _stream(parser, text, sizes)
    assert [ToolCall(c["name"], c["arguments"]) for c in got_calls.values()] == calls
    assert got_content.strip() == (content or "").strip()


@pytest.mark.parametrize("text", MALFORMED_HERMES[1:])
def test_streamed_malformed_call_is_content(text):
    content, calls = _stream(HERMES, text, [3])
    assert calls == {} and content == text


def test_grammar_text_is_never_streamed_as_content():
    """``<tool_call>`` split across pieces is held back, not sent as content."""
    s = ToolStream(HERMES)
    assert s.feed("Hi <tool", False) == ("Hi ", [])
    content, deltas = s.feed('_call>{"name": "f", "arguments": {}}</tool_call>', True)
    assert content == "" and deltas[0]["function"] == {"name": "f", "arguments": "{}"}
    assert s.called()


def test_detect_parser_from_templates():
    assert detect_parser(QWEN_STYLE_TEMPLATE) == "hermes"
    assert detect_parser("{{ '<|python_tag|>' }}{{ messages }}") == "llama3_json"
    assert detect_parser("{% for m in messages %}{{ m.content }}{% endfor %}") is None
    assert detect_parser(None) is None


# Qwen2.5's tool section, shortened (tests/test_server_structured.py serves it).
QWEN_STYLE_TEMPLATE = """{%- if tools %}<|im_start|>system
You may call functions.<tools>{%- for tool in tools %}
{{ tool | tojson }}{%- endfor %}</tools>
For each call return <tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% endif %}{%- for m in messages %}<|im_start|>{{ m.role }}
{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>
{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}
</tool_call>{% endfor %}{% else %}{{ m.content }}{% endif %}<|im_end|>
{% endfor %}{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

TOOLS = [
    ChatTool.model_validate({"type": "function", "function": {"name": "get_weather",
                             "parameters": json.loads('{"type": "object"}')}}),
    ChatTool.model_validate({"type": "function", "function": {"name": "get_time"}}),
]  # fmt: skip


@pytest.mark.parametrize(
    ("tools", "choice", "settings", "message"),
    [
        (TOOLS, {"type": "function", "function": {"name": "nope"}}, ToolSettings(), "nope"),
        (TOOLS, {"type": "function"}, ToolSettings(), "must be"),
        (TOOLS, "sometimes", ToolSettings(), "must be"),
        (None, "required", ToolSettings(), "needs tools"),
        (TOOLS, "auto", ToolSettings("hermes", False), "--enable-auto-tool-choice"),
        (TOOLS, None, ToolSettings("hermes", False), "--enable-auto-tool-choice"),
    ],
)
def test_bad_tool_choice_is_a_400_naming_it(tools, choice, settings, message):
    with pytest.raises(APIError) as e:
        plan_tools(tools, choice, None, settings)
    assert e.value.status == 400 and e.value.param == "tool_choice"
    assert message in e.value.message


def test_tool_choice_plans():
    assert plan_tools(TOOLS, "none", None, ToolSettings()) is None
    assert plan_tools(None, None, None, ToolSettings()) is None
    assert plan_tools([], "required", None, ToolSettings()) is None  # OpenAI: as none
    auto = plan_tools(TOOLS, None, None, ToolSettings("hermes", True))
    assert auto is not None and auto.constraint is None
    named = plan_tools(TOOLS, {"type": "function", "function": {"name": "get_time"}}, False,
                       ToolSettings("llama3_json"))  # fmt: skip
    assert named is not None and named.parser.name == "llama3_json"
    assert named.constraint.source == "tools[1].function.parameters"
    grammar = named.constraint.kwargs["grammar"]
    assert "get_time" in grammar and "get_weather" not in grammar
    req = plan_tools(TOOLS, "required", None, ToolSettings())
    assert req.parser.name == "hermes" and req.constraint.source == "tools"
