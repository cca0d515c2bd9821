"""Structured outputs and tool calling through ``kvserve serve``, with the ``openai`` client
unmodified: ``chat.completions.parse`` with a pydantic model, a tool-calling round trip
(``tool_choice="required"``, streamed and not) on a tiny checkpoint with a Qwen2.5-style
template, and bad input (each a 400 naming the field; the server serves on)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Literal

import httpx
import pytest
from openai import OpenAI
from pydantic import BaseModel
from transformers import AutoTokenizer

import kvserve
from tests.serve_process import ServeProcess
from tests.test_tool_calls import QWEN_STYLE_TEMPLATE

BUNDLED = str(Path(kvserve.__file__).parent / "bundled" / "kvserve-ref")
H, C = "/v1/chat/completions", "/v1/completions"
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
COLOUR = {"type": "object", "properties": {"colour": {"enum": ["red", "blue"]}},
          "required": ["colour"], "additionalProperties": False}  # fmt: skip
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather.",
           "parameters": COLOUR}}  # fmt: skip
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"utc": {"type": "boolean"}}, "required": ["utc"],
    "additionalProperties": False}}}  # fmt: skip
ENV = {**os.environ, "OMP_NUM_THREADS": "2"}


def _serve(model: str, *extra: str) -> ServeProcess:
    return ServeProcess(
        [
            "--model",
            model,
            "--max-model-len",
            "512",
            "--dtype",
            "float32",
            "--served-model-name",
            "m",
            "--disable-access-log",
            *extra,
        ],
        env=ENV,
    )


@pytest.fixture(scope="module")
def bundled():
    with _serve(BUNDLED) as srv:
        yield srv
        srv.stop()


@pytest.fixture(scope="module")
def tool_model(checkpoint, tmp_path_factory):
    """A random qwen2 checkpoint whose template describes tools as Qwen2.5's does."""
    path = tmp_path_factory.mktemp("qwen-tools") / "model"
    shutil.copytree(checkpoint("qwen2"), path)
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    cfg["chat_template"] = QWEN_STYLE_TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    with _serve(str(path), "--enable-auto-tool-choice", "--max-model-len", "2048") as srv:
        srv.model_path = str(path)
        yield srv
        srv.stop()


def _client(srv: ServeProcess) -> OpenAI:
    return OpenAI(base_url=srv.url + "/v1", api_key="none", timeout=120, max_retries=0)


class Paint(BaseModel):
    colour: Literal["red", "blue"]
    glossy: bool


def test_openai_parse_with_a_pydantic_model(bundled):
    """The client sends the model's strict JSON schema and parses the reply into it."""
    out = _client(bundled).chat.completions.parse(
        model="m", messages=USER, response_format=Paint, temperature=1.0, seed=3, max_tokens=64
    )
    msg = out.choices[0].message
    assert out.choices[0].finish_reason == "stop", msg.content
    assert isinstance(msg.parsed, Paint)
    assert Paint.model_validate_json(msg.content) == msg.parsed


def _streamed_calls(client: OpenAI, **kw) -> tuple[str, list[dict], str | None, list[int]]:
    """Deltas joined by index as a client does; also the order the indexes first appear."""
    content, calls, finish, order = "", {}, None, []
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            content += c.delta.content or ""
            for d in c.delta.tool_calls or ():
                if d.index not in calls:
                    assert d.id and d.function.name, "a call's first delta carries id and name"
                    calls[d.index] = {"name": d.function.name, "arguments": ""}
                    order.append(d.index)
                calls[d.index]["arguments"] += d.function.arguments or ""
            finish = c.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish, order


@pytest.mark.parametrize("parallel", [False, True])
def test_tool_round_trip_required_streamed_and_not(tool_model, parallel):
    client = _client(tool_model)
    kw = dict(model="m", messages=USER, tools=[WEATHER, CLOCK], tool_choice="required",
              parallel_tool_calls=parallel, temperature=0, max_tokens=1000)  # fmt: skip
    out = client.chat.completions.create(**kw)
    c = out.choices[0]
    assert c.finish_reason == "tool_calls", c
    calls = [{"name": t.function.name, "arguments": t.function.arguments}
             for t in c.message.tool_calls]  # fmt: skip
    if not parallel:
        assert len(calls) == 1
    for call in calls:  # the grammar held each call to its tool's schema
        args = json.loads(call["arguments"])
        if call["name"] == "get_weather":
            assert args in ({"colour": "red"}, {"colour": "blue"})
        else:
            assert call["name"] == "get_time" and set(args) == {"utc"}
    content, streamed, finish, order = _streamed_calls(client, **kw)
    assert streamed == calls and finish == "tool_calls"
    assert order == list(range(len(calls))) and not content.strip()
    # the result goes back as OpenAI's messages; the template sees the call and the tools,
    # as transformers renders them (arguments as objects: vLLM hands them over so)
    back = [
        *USER,
        c.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": c.message.tool_calls[0].id, "content": "sunny"},
    ]
    r = httpx.post(tool_model.url + H, json={"model": "m", "messages": back, "tools": [WEATHER],
                   "tool_choice": "none", "max_tokens": 4, "return_prompt_text": True},
                   timeout=120)  # fmt: skip
    assert r.status_code == 200, r.text
    prompt = r.json()["prompt_text"]
    as_objects = json.loads(json.dumps(back))
    for t in as_objects[1]["tool_calls"]:
        t["function"]["arguments"] = json.loads(t["function"]["arguments"])
    hf = AutoTokenizer.from_pretrained(tool_model.model_path)
    want = hf.apply_chat_template(as_objects, tools=[WEATHER], tokenize=False,
                                  add_generation_prompt=True)  # fmt: skip
    assert prompt == want
    assert "get_weather" in prompt and calls[0]["name"] in prompt
    tok = httpx.post(tool_model.url + "/tokenize", json={"messages": back, "tools": [WEATHER]},
                     timeout=60)  # fmt: skip
    assert tok.status_code == 200 and tok.json()["count"] == r.json()["usage"]["prompt_tokens"]


def test_named_tool_choice(tool_model):
    out = _client(tool_model).chat.completions.create(
        model="m", messages=USER, tools=[WEATHER, CLOCK], temperature=0, max_tokens=200,
        tool_choice={"type": "function", "function": {"name": "get_time"}})  # fmt: skip
    calls = out.choices[0].message.tool_calls
    assert [t.function.name for t in calls] == ["get_time"]
    assert set(json.loads(calls[0].function.arguments)) == {"utc"}


def test_auto_tool_choice_parses_what_the_model_writes(tool_model):
    """auto: free text, parsed; a random model's text is content, its finish_reason its own."""
    out = _client(tool_model).chat.completions.create(
        model="m", messages=USER, tools=[WEATHER], temperature=0, max_tokens=8
    )
    c = out.choices[0]
    assert c.finish_reason in ("length", "stop") and not c.message.tool_calls


def test_logit_bias_past_the_tokenizer_is_a_400(tool_model):
    """The checkpoint's vocabulary is padded past its tokenizer's: such an id names no token."""
    r = httpx.post(tool_model.url + C, json={"model": "m", "prompt": "Hi", "max_tokens": 2,
                   "logit_bias": {"300": 5}}, timeout=60)  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", r.text
    assert "300" in r.json()["error"]["message"]


def test_auto_needs_the_flag(bundled):
    r = httpx.post(bundled.url + H, json={"model": "m", "messages": USER, "tools": [WEATHER]},
                   timeout=60)  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    assert "--enable-auto-tool-choice" in r.json()["error"]["message"]


BAD = [
    (H, {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "objectx"}}}}, "response_format.json_schema.schema"),
    (H, {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "$ref": "https://example.com/remote.json"}}}}, "response_format.json_schema.schema"),
    (H, {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema"),
    (H, {"response_format": {"type": "yaml"}}, "response_format.type"),
    (C, {"guided_regex": "(unclosed"}, "guided_regex"),
    (C, {"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
    (C, {"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    (C, {"structured_outputs": {"pattern": "a"}}, "structured_outputs.pattern"),
    (C, {"guided_json": {"type": "object"}, "guided_regex": "a+"}, "guided_regex"),
    (H, {"response_format": {"type": "json_object"}, "guided_choice": ["a"]}, "guided_choice"),
    (H, {"tools": [WEATHER], "tool_choice": "required", "guided_choice": ["a"]}, "tool_choice"),
    (C, {"guided_grammar": "start: undefined_rule"}, "guided_grammar"),
    (C, {"logit_bias": {"5": 101}}, "logit_bias"),
    (C, {"logit_bias": {"5": -100.5}}, "logit_bias"),
    (C, {"logit_bias": {"4096": 1}}, "logit_bias"),  # the bundled vocabulary has 4096
    (H, {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    (H, {"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "objectx"}}}], "tool_choice": "required"}, "tools[0].function.parameters"),
    (H, {"tools": [{"type": "function", "function": {"parameters": {}}}]},
     "tools[0].function.name"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "extra", "param"), BAD)
def test_bad_input_is_a_400_naming_the_field(bundled, path, extra, param):
    prompt = {"messages": USER} if path == H else {"prompt": "Hello"}
    r = httpx.post(bundled.url + path, json={"model": "m", **prompt, "max_tokens": 4, **extra},
                   timeout=60)  # fmt: skip
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"].startswith(param), err
    if "combined" in err["message"]:  # two constraints: both fields named
        assert all(k in err["message"] for k in extra if k not in ("tools",)), err


def test_valid_invalid_valid_all_served(bundled):
    """A malformed schema between two good ones: the engine serves both, /health stays 200."""
    good = {"model": "m", "prompt": "Hi", "max_tokens": 48, "guided_json": COLOUR}
    bad = {**good, "guided_json": {"type": "object", "properties": {"a": {"type": "nope"}}}}
    for body, status in ((good, 200), (bad, 400), (good, 200)):
        r = httpx.post(bundled.url + C, json=body, timeout=120)
        assert r.status_code == status, r.text
        if status == 200:
            assert json.loads(r.json()["choices"][0]["text"]) in ({"colour": "red"},
                                                                  {"colour": "blue"})  # fmt: skip
        assert httpx.get(bundled.url + "/health", timeout=10).status_code == 200


def test_a_schema_past_the_compile_limit_is_a_400(checkpoint):
    """Under a compile limit no schema meets, the request is refused naming the client's
    field, and the server serves on."""
    with _serve(checkpoint("llama_gqa"), "--structured-outputs-compile-timeout", "1e-6") as srv:
        schema = {"type": "object", "properties": {f"k{i}": {"type": "integer", "minimum": i}
                                                   for i in range(200)}}  # fmt: skip
        rf = {"type": "json_schema", "json_schema": {"name": "big", "schema": schema}}
        r = httpx.post(srv.url + H, json={"model": "m", "messages": USER, "max_tokens": 4,
                       "response_format": rf}, timeout=60)  # fmt: skip
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "response_format.json_schema.schema" and "compile" in err["message"]
        assert httpx.get(srv.url + "/health", timeout=10).status_code == 200
        r = httpx.post(srv.url + C, json={"model": "m", "prompt": "Hi", "max_tokens": 4},
                       timeout=60)  # fmt: skip
        assert r.status_code == 200, r.text
        srv.stop()
