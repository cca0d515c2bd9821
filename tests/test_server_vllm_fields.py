"""Every top-level request field of vLLM's and OpenAI's chat and completion APIs, sent to a live
``kvserve serve`` on the bundled model: each is honoured (its effect checked against the offline
engine given the same parameter, or against transformers' tokenizer and chat template) or
refused with a 400 naming it; an unknown field is accepted, logged once and counted.

The field lists are written from the sources, not read from kvserve:
- vLLM 0.34.0 (the PyPI sdist, sha256 fcad848b...0113): the annotated fields of
  ``ChatCompletionRequest`` (vllm/entrypoints/openai/chat_completion/protocol.py) and
  ``CompletionRequest`` (vllm/entrypoints/openai/completion/protocol.py), and the guided-decoding
  fields vLLM has removed but still names (``_REMOVED_GUIDED_FIELDS``,
  vllm/entrypoints/serve/engine/protocol.py), which clients still send;
- OpenAI's ``CompletionCreateParams`` of the ``openai`` client (3.63.0), also checked against
  the installed client so that a field a newer client adds fails here until it is decided.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI
from transformers import AutoTokenizer

import kvserve
from kvserve import LLM, SamplingParams
from tests.serve_process import ServeProcess
from tests.test_server import scrape

BUNDLED = str(Path(kvserve.__file__).parent / "bundled" / "kvserve-ref")
MODEL = "ref"
C, H = "/v1/completions", "/v1/chat/completions"
MAX = 8

VLLM_CHAT = """messages model frequency_penalty logit_bias logprobs top_logprobs max_tokens
max_completion_tokens n presence_penalty response_format seed stop stream stream_options
temperature top_p tools tool_choice reasoning_effort thinking_token_budget include_reasoning
parallel_tool_calls user use_beam_search top_k min_p repetition_penalty watermarking
length_penalty stop_token_ids include_stop_str_in_output ignore_eos min_tokens
skip_special_tokens spaces_between_special_tokens truncate_prompt_tokens truncation_side
prompt_logprobs logprob_token_ids allowed_token_ids bad_words echo add_generation_prompt
continue_final_message add_special_tokens documents chat_template chat_template_kwargs
media_io_kwargs mm_processor_kwargs structured_outputs priority request_id session_id
return_tokens_as_token_ids return_token_ids return_weight_versions routed_experts_prompt_start
return_token_offsets return_prompt_text mm_payload return_mm_kwargs cache_salt
kv_transfer_params ec_transfer_params vllm_xargs repetition_detection stream_interval""".split()
VLLM_COMPLETION = """model prompt echo frequency_penalty logit_bias logprobs max_tokens n
presence_penalty seed stop stream stream_options suffix temperature top_p user use_beam_search
top_k min_p repetition_penalty watermarking length_penalty stop_token_ids
include_stop_str_in_output ignore_eos min_tokens skip_special_tokens
spaces_between_special_tokens truncate_prompt_tokens truncation_side allowed_token_ids
prompt_logprobs logprob_token_ids bad_words prompt_embeds add_special_tokens response_format
structured_outputs priority request_id session_id return_tokens_as_token_ids return_token_ids
return_weight_versions routed_experts_prompt_start return_token_offsets mm_payload
return_mm_kwargs cache_salt kv_transfer_params ec_transfer_params vllm_xargs
repetition_detection thinking_token_budget stream_interval""".split()
VLLM_REMOVED_GUIDED = """guided_json guided_regex guided_choice guided_grammar
guided_decoding_backend guided_whitespace_pattern""".split()
OPENAI_CHAT = """audio frequency_penalty function_call functions logit_bias logprobs
max_completion_tokens max_tokens messages metadata modalities model moderation n
parallel_tool_calls prediction presence_penalty prompt_cache_key prompt_cache_options
prompt_cache_retention reasoning_effort response_format safety_identifier seed service_tier
stop store stream stream_options temperature tool_choice tools top_logprobs top_p user
verbosity web_search_options""".split()
OPENAI_COMPLETION = """best_of echo frequency_penalty logit_bias logprobs max_tokens model n
presence_penalty prompt seed stop stream stream_options suffix temperature top_p user""".split()
# kvserve's own extra fields (docs/serving.md).
KVSERVE = ["kv_retention", "workload_class"]

FIELDS = {
    C: sorted({*VLLM_COMPLETION, *VLLM_REMOVED_GUIDED, *OPENAI_COMPLETION, *KVSERVE}),
    H: sorted({*VLLM_CHAT, *VLLM_REMOVED_GUIDED, *OPENAI_CHAT, *KVSERVE}),
}

PROMPT = "The history of the city begins"
REPEAT = "one two one two one two one two"  # greedy repeats it: penalties change the output
USER = [{"role": "user", "content": "Name three colours."}]
CONTINUE = [{"role": "user", "content": "Count."}, {"role": "assistant", "content": REPEAT}]
CLASSES = {"classes": [{"name": "vip", "match": {"users": ["alice"]}}]}
END = 6  # "<|end|>": a special token that is not EOS
EOS = 2


def test_the_openai_client_sends_no_field_left_unlisted():
    """The installed client's parameters are all in the lists this test covers."""
    from openai.types import completion_create_params as comp
    from openai.types.chat import completion_create_params as chat

    assert set(chat.CompletionCreateParamsBase.__annotations__) <= set(OPENAI_CHAT)
    assert set(comp.CompletionCreateParamsBase.__annotations__) <= set(OPENAI_COMPLETION)


# -- the server and the references ---------------------------------------------------------


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    """``kvserve serve`` as a process, with priority scheduling and one workload class (so
    ``priority``, ``user`` and ``workload_class`` have an effect to check)."""
    classes = tmp_path_factory.mktemp("classes") / "classes.json"
    classes.write_text(json.dumps(CLASSES))
    args = ["--model", BUNDLED, "--max-model-len", "256", "--dtype", "float32",
            "--served-model-name", MODEL, "--scheduling-policy", "priority",
            "--workload-classes", str(classes), "--disable-access-log"]  # fmt: skip
    with ServeProcess(args, env={**os.environ, "OMP_NUM_THREADS": "2"}) as srv:
        yield srv
        srv.stop()


@pytest.fixture(scope="module")
def hf():
    return AutoTokenizer.from_pretrained(BUNDLED)


@pytest.fixture(scope="module")
def ref():
    return LLM(BUNDLED, max_model_len=256, dtype="float32")


@dataclass
class Ctx:
    """What a check needs: the server, transformers' tokenizer, the offline engine."""

    url: str
    hf: Any
    llm: LLM
    path: str

    def post(self, body: dict[str, Any], path: str | None = None) -> httpx.Response:
        return httpx.post(self.url + (path or self.path), json=body, timeout=60)

    def ids(self, body: dict[str, Any]) -> list[int]:
        """The prompt ids of ``body`` per transformers (template, special tokens)."""
        if "prompt" in body:
            return self.hf.encode(body["prompt"], add_special_tokens=True)
        return self.hf.apply_chat_template(
            body["messages"], tokenize=True, return_dict=False,
            add_generation_prompt=body.get("add_generation_prompt", True),
            continue_final_message=body.get("continue_final_message", False))  # fmt: skip

    def greedy(self, body: dict[str, Any], **kw: Any) -> list[int]:
        """The offline engine's tokens for the prompt of ``body`` under ``kw``."""
        kw = {"temperature": 0.0, "max_tokens": MAX, "ignore_eos": True, **kw}
        out = self.llm.generate([{"prompt_token_ids": self.ids(body)}], SamplingParams(**kw))
        return out[0].outputs[0].token_ids


def base(path: str, **extra: Any) -> dict[str, Any]:
    prompt = {"prompt": PROMPT} if path == C else {"messages": USER}
    return {"model": MODEL, **prompt, "max_tokens": MAX, "temperature": 0, "ignore_eos": True,
            **extra}  # fmt: skip


def repeat(path: str, **extra: Any) -> dict[str, Any]:
    """A prompt the model continues by repeating it (chat: continuing an assistant message)."""
    if path == C:
        return base(path, prompt=REPEAT, **extra)
    return base(path, messages=CONTINUE, add_generation_prompt=False,
                continue_final_message=True, **extra)  # fmt: skip


def choice(r: dict[str, Any]) -> dict[str, Any]:
    return r["choices"][0]


def text(r: dict[str, Any]) -> str:
    c = choice(r)
    return c["text"] if "text" in c else c["message"]["content"]


def stream(ctx: Ctx, body: dict[str, Any]) -> list[dict[str, Any]]:
    events = []
    with httpx.stream("POST", ctx.url + ctx.path, json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    return events


def streamed_text(events: list[dict[str, Any]]) -> str:
    out = ""
    for e in events:
        for c in e["choices"]:
            out += c.get("text") or (c.get("delta") or {}).get("content") or ""
    return out


# -- what each field does -------------------------------------------------------------------


def _tokens_equal(**kw: Any):
    """The returned token ids are the offline engine's under ``kw``, and ``kw`` changes them
    (so a field that is ignored cannot pass)."""

    def check(ctx: Ctx, body: dict, r: dict) -> None:
        want = ctx.greedy(body, **kw)
        assert choice(r)["token_ids"] == want
        assert want != ctx.greedy(body), "the parameter does not change this reference output"

    return check


def _greedy_despite_temperature_1(ctx: Ctx, body: dict, r: dict) -> None:
    # top_k=1, top_p≈0 and min_p=1 each leave only the most likely token at temperature 1
    assert choice(r)["token_ids"] == ctx.greedy(body)


def _seed(ctx: Ctx, body: dict, r: dict) -> None:
    assert choice(r)["token_ids"] == ctx.greedy(body, temperature=1.0, seed=body["seed"])
    assert choice(ctx.post(body).json())["token_ids"] == choice(r)["token_ids"]


def _stop(ctx: Ctx, body: dict, r: dict) -> None:
    full = ctx.hf.decode(ctx.greedy(body), skip_special_tokens=True)
    cut = full[: full.index(body["stop"][0])]
    keep = body.get("include_stop_str_in_output", False)
    assert text(r) == (cut + body["stop"][0] if keep else cut)
    assert choice(r)["finish_reason"] == "stop"


def _stop_token(ctx: Ctx, body: dict, r: dict) -> None:
    want = ctx.greedy(body)
    stop = body["stop_token_ids"][0]
    assert choice(r)["token_ids"] == want[: want.index(stop) + 1]
    assert choice(r)["finish_reason"] == "stop"


def _ignore_eos(ctx: Ctx, body: dict, r: dict) -> None:
    assert len(choice(r)["token_ids"]) == body["max_tokens"]  # EOS (the only one allowed) ignored
    plain = ctx.post({**body, "ignore_eos": False}).json()
    assert choice(plain)["finish_reason"] == "stop" and len(choice(plain)["token_ids"]) <= 1


def _min_tokens(ctx: Ctx, body: dict, r: dict) -> None:
    assert len(choice(r)["token_ids"]) >= body["min_tokens"]  # EOS held back until then
    plain = ctx.post({k: v for k, v in body.items() if k != "min_tokens"}).json()
    assert len(choice(plain)["token_ids"]) <= 1


def _n(ctx: Ctx, body: dict, r: dict) -> None:
    assert sorted(c["index"] for c in r["choices"]) == list(range(body["n"]))


def _logprobs(ctx: Ctx, body: dict, r: dict) -> None:
    lp = choice(r)["logprobs"]
    if "content" in lp:  # chat
        assert len(lp["content"]) == MAX
        for pos in lp["content"]:
            assert len(pos["top_logprobs"]) == body.get("top_logprobs", 0)
            assert pos["logprob"] <= 0
    else:
        assert len(lp["tokens"]) == MAX
        for top, actual in zip(lp["top_logprobs"], lp["token_logprobs"], strict=True):
            assert body["logprobs"] <= len(top) <= body["logprobs"] + 1
            assert actual == max(top.values())  # greedy: the sampled token is the top one


def _as_token_ids(ctx: Ctx, body: dict, r: dict) -> None:
    lp = choice(r)["logprobs"]
    shown = [p["token"] for p in lp["content"]] if "content" in lp else lp["tokens"]
    assert shown == [f"token_id:{t}" for t in choice(r)["token_ids"]]


def _token_ids(ctx: Ctx, body: dict, r: dict) -> None:
    c = choice(r)
    assert ctx.hf.decode(c["token_ids"], skip_special_tokens=True) == text(r)
    prompt_ids = c["prompt_token_ids"] if "prompt_token_ids" in c else r["prompt_token_ids"]
    assert prompt_ids == ctx.ids(body)


def _prompt_tokens(ctx: Ctx, body: dict, r: dict) -> None:
    """usage.prompt_tokens is transformers' count for the same prompt and options."""
    want = ctx.ids(body)
    if body.get("add_special_tokens") is False and "prompt" in body:
        want = ctx.hf.encode(body["prompt"], add_special_tokens=False)
    if body.get("add_special_tokens") is True and "messages" in body:
        want = [ctx.hf.bos_token_id, *want]
    assert r["usage"]["prompt_tokens"] == len(want)
    assert (
        choice(r)["token_ids"]
        == ctx.llm.generate(
            [{"prompt_token_ids": want}],
            SamplingParams(temperature=0, max_tokens=MAX, ignore_eos=True),
        )[0]
        .outputs[0]
        .token_ids
    )


def _truncated(ctx: Ctx, body: dict, r: dict) -> None:
    k, full = body["truncate_prompt_tokens"], ctx.ids(body)
    want = full[:k] if body.get("truncation_side") == "right" else full[-k:]
    got = choice(r).get("prompt_token_ids") or r.get("prompt_token_ids")
    assert got == want and r["usage"]["prompt_tokens"] == k


def _prompt_logprobs(ctx: Ctx, body: dict, r: dict) -> None:
    lps = choice(r).get("prompt_logprobs") or r.get("prompt_logprobs")
    ids = ctx.ids(body)
    out = ctx.llm.generate([{"prompt_token_ids": ids}], SamplingParams(
        max_tokens=1, prompt_logprobs=body["prompt_logprobs"]))[0].prompt_logprobs  # fmt: skip
    assert len(lps) == len(ids) and lps[0] is None
    for tid, got, want in zip(ids[1:], lps[1:], out[1:], strict=True):
        assert str(tid) in got
        assert {int(t): v["logprob"] for t, v in got.items()} == pytest.approx(want, abs=1e-4)
        ranks = sorted(v["rank"] for v in got.values() if v["rank"] is not None)
        assert ranks == list(range(1, body["prompt_logprobs"] + 1))


def _echo(ctx: Ctx, body: dict, r: dict) -> None:
    if "prompt" in body:
        assert text(r).startswith(body["prompt"]) and len(text(r)) > len(body["prompt"])
    else:
        assert text(r).startswith(body["messages"][-1]["content"])


def _streamed(ctx: Ctx, body: dict, r: dict) -> None:
    events = stream(ctx, body)
    assert len(events) > 2
    assert ctx.hf.decode(ctx.greedy(body), skip_special_tokens=True) == streamed_text(events)
    opts = body.get("stream_options", {})
    if opts.get("include_usage"):
        assert events[-1]["usage"]["completion_tokens"] == MAX
    if opts.get("continuous_usage_stats"):
        assert all(e["usage"] is not None for e in events)


def _request_id(ctx: Ctx, body: dict, r: dict) -> None:
    assert r["id"].endswith("-" + body["request_id"])


def _skip_special(ctx: Ctx, body: dict, r: dict) -> None:
    assert text(r) == "<|end|>" * MAX  # kept when skip_special_tokens is false
    assert text(ctx.post({**body, "skip_special_tokens": True}).json()) == ""


def _class(name: str):
    def check(ctx: Ctx, body: dict, r: dict) -> None:
        key = ("kvserve:class_requests_total", (("outcome", "finished"),
                                                ("workload_class", name)))  # fmt: skip
        before = scrape(ctx.url).get(key, 0.0)
        ctx.post(body)
        assert scrape(ctx.url)[key] - before == 1

    return check


def _salt(name: str):
    """The same prompt again hits the prefix cache under the same salt, and not under another."""

    def check(ctx: Ctx, body: dict, r: dict) -> None:
        again = ctx.post(body).json()
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        other = {**body, name: body[name] + "-other"}
        assert ctx.post(other).json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0

    return check


def _lazy_stop(ctx: Ctx, path: str) -> dict[str, Any]:
    """A stop string from the reference's own output: its third token's text."""
    ids = ctx.greedy(base(path))
    full, head = (
        ctx.hf.decode(ids[:3], skip_special_tokens=True),
        ctx.hf.decode(ids[:2], skip_special_tokens=True),
    )
    assert full[len(head) :].strip(), "pick another token: this one is blank"
    return {"stop": [full[len(head) :]]}


def _lazy_stop_token(ctx: Ctx, path: str) -> dict[str, Any]:
    return {"stop_token_ids": [ctx.greedy(base(path))[2]], **TOKS}


def _retention(ctx: Ctx, body: dict, r: dict) -> None:
    assert r["usage"]["kv_retention"]["seen_tokens"] > 0


def _priority(ctx: Ctx, body: dict, r: dict) -> None:
    err = ctx.post({**body, "priority": 2**40})
    assert err.status_code == 400 and err.json()["error"]["param"] == "priority"


def _ok(ctx: Ctx, body: dict, r: dict) -> None:
    """The response itself is the check (the field is the request's model or prompt)."""
    assert r["model"] == MODEL and text(r)


def _count(ctx: Ctx, body: dict, r: dict) -> None:
    limit = body.get("max_completion_tokens") or body["max_tokens"]
    assert r["usage"]["completion_tokens"] == limit


# -- output constraints and tools (the engine enforces them; these check the mapping) --------

FREE = {"ignore_eos": False, "max_tokens": 48}  # a constraint's end ends the request
COLOUR = {"type": "object", "properties": {"colour": {"enum": ["red", "blue"]}},
          "required": ["colour"], "additionalProperties": False}  # fmt: skip
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": COLOUR}}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
    },
}


def _one_of(*allowed: str):
    def check(ctx: Ctx, body: dict, r: dict) -> None:
        assert text(r) in allowed and choice(r)["finish_reason"] == "stop", text(r)

    return check


def _colour_json(ctx: Ctx, body: dict, r: dict) -> None:
    assert json.loads(text(r)) in ({"colour": "red"}, {"colour": "blue"}), text(r)
    if "guided_whitespace_pattern" in body:  # newlines only between JSON tokens
        assert " " not in text(r), text(r)


def _json_object(ctx: Ctx, body: dict, r: dict) -> None:
    assert choice(r)["finish_reason"] == "stop", text(r)
    assert isinstance(json.loads(text(r)), dict), text(r)


def _called(*names: str):
    """The reply is tool calls (finish_reason tool_calls) to exactly ``names``, in order."""

    def check(ctx: Ctx, body: dict, r: dict) -> None:
        c = choice(r)
        assert c["finish_reason"] == "tool_calls", c
        calls = c["message"]["tool_calls"]
        assert [t["function"]["name"] for t in calls] == list(names)
        for t in calls:
            args = json.loads(t["function"]["arguments"])
            if t["function"]["name"] == "get_weather":
                assert args in ({"colour": "red"}, {"colour": "blue"})
            else:
                assert args == {}

    return check


def _parallel(ctx: Ctx, body: dict, r: dict) -> None:
    calls = choice(r)["message"]["tool_calls"]
    assert len(calls) == 1 and choice(r)["finish_reason"] == "tool_calls"


def _template_text(ctx: Ctx, body: dict, r: dict) -> None:
    assert r["prompt_text"] == ctx.hf.apply_chat_template(
        body["messages"], tokenize=False, add_generation_prompt=True
    )


@dataclass(frozen=True)
class Honoured:
    extra: Any  # the fields to send, or a function (ctx, path) -> them
    check: Any
    body: Any = base  # base or repeat


@dataclass(frozen=True)
class Refused:
    value: Any  # a meaningful non-default value
    off: tuple[Any, ...] = ()  # values accepted as a no-op
    planned: bool = False


T1 = {"temperature": 1.0}
TOKS = {"return_token_ids": True}
HONOURED = {
    "model": Honoured({}, _ok),
    "prompt": Honoured(TOKS, _prompt_tokens),
    "messages": Honoured(TOKS, _prompt_tokens),
    "frequency_penalty": Honoured(
        {"frequency_penalty": 2.0, **TOKS}, _tokens_equal(frequency_penalty=2.0), repeat
    ),
    "presence_penalty": Honoured(
        {"presence_penalty": 2.0, **TOKS}, _tokens_equal(presence_penalty=2.0), repeat
    ),
    "repetition_penalty": Honoured(
        {"repetition_penalty": 1.9, **TOKS}, _tokens_equal(repetition_penalty=1.9), repeat
    ),
    "logit_bias": Honoured(
        {"logit_bias": {"616": 100}, **TOKS}, _tokens_equal(logit_bias={616: 100})
    ),
    "allowed_token_ids": Honoured(
        {"allowed_token_ids": [616, 978, 2586], **TOKS},
        _tokens_equal(allowed_token_ids=[616, 978, 2586]),
    ),
    "temperature": Honoured({"temperature": 0.0, **TOKS}, _greedy_despite_temperature_1),
    "top_p": Honoured({**T1, "top_p": 1e-9, **TOKS}, _greedy_despite_temperature_1),
    "top_k": Honoured({**T1, "top_k": 1, **TOKS}, _greedy_despite_temperature_1),
    "min_p": Honoured({**T1, "min_p": 1.0, **TOKS}, _greedy_despite_temperature_1),
    "seed": Honoured({**T1, "seed": 1234, **TOKS}, _seed),
    "stop": Honoured(_lazy_stop, _stop),
    "include_stop_str_in_output": Honoured(
        lambda ctx, path: {**_lazy_stop(ctx, path), "include_stop_str_in_output": True}, _stop
    ),  # fmt: skip
    "stop_token_ids": Honoured(_lazy_stop_token, _stop_token),
    "ignore_eos": Honoured({"allowed_token_ids": [EOS], "ignore_eos": True, **TOKS}, _ignore_eos),
    "min_tokens": Honoured(
        {"logit_bias": {str(EOS): 100}, "ignore_eos": False, "min_tokens": 3, **TOKS}, _min_tokens
    ),  # fmt: skip
    "max_tokens": Honoured({"max_tokens": 3}, _count),
    "max_completion_tokens": Honoured({"max_completion_tokens": 3}, _count),
    "n": Honoured({"n": 3}, _n),
    "best_of": Honoured({"n": 2, "best_of": 2}, _n),
    "logprobs": Honoured({"logprobs": 2}, _logprobs),
    "top_logprobs": Honoured({"top_logprobs": 2}, _logprobs),
    "return_tokens_as_token_ids": Honoured(
        {"logprobs": 1, "return_tokens_as_token_ids": True, **TOKS}, _as_token_ids
    ),  # fmt: skip
    "return_token_ids": Honoured(TOKS, _token_ids),
    "skip_special_tokens": Honoured(
        {"logit_bias": {str(END): 100}, "skip_special_tokens": False}, _skip_special
    ),
    "stream": Honoured({"stream": True}, _streamed),
    "stream_options": Honoured(
        {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
        _streamed,
    ),  # fmt: skip
    "echo": Honoured({"echo": True}, _echo),
    "add_special_tokens": Honoured(TOKS, _prompt_tokens),  # value per endpoint, below
    "add_generation_prompt": Honoured({"add_generation_prompt": False, **TOKS}, _prompt_tokens),
    "continue_final_message": Honoured(TOKS, _token_ids, repeat),
    "truncate_prompt_tokens": Honoured({"truncate_prompt_tokens": 3, **TOKS}, _truncated),
    "truncation_side": Honoured(
        {"truncate_prompt_tokens": 3, "truncation_side": "right", **TOKS}, _truncated
    ),  # fmt: skip
    "prompt_logprobs": Honoured({"prompt_logprobs": 2}, _prompt_logprobs),
    "request_id": Honoured({"request_id": "my-request-7"}, _request_id),
    "return_prompt_text": Honoured({"return_prompt_text": True}, _template_text),
    "user": Honoured({"user": "alice"}, _class("vip")),
    "workload_class": Honoured({"workload_class": "vip"}, _class("vip")),
    "priority": Honoured({"priority": -3}, _priority),
    "cache_salt": Honoured({"cache_salt": "salt-a"}, _salt("cache_salt")),
    "prompt_cache_key": Honoured({"prompt_cache_key": "key-a"}, _salt("prompt_cache_key")),
    "kv_retention": Honoured({"kv_retention": "window:16"}, _retention),
    "guided_json": Honoured({"guided_json": COLOUR, **FREE}, _colour_json),
    "guided_whitespace_pattern": Honoured(
        {"guided_json": COLOUR, "guided_whitespace_pattern": "[\n]*", **FREE}, _colour_json
    ),
    "guided_regex": Honoured({"guided_regex": "(yes|no)!", **FREE}, _one_of("yes!", "no!")),
    "guided_choice": Honoured({"guided_choice": ["yes", "no"], **FREE}, _one_of("yes", "no")),
    "guided_grammar": Honoured(
        {"guided_grammar": 'start: "hello " ("world" | "there")', **FREE},
        _one_of("hello world", "hello there"),
    ),
    # the backend is the server's: accepted, and the constraint is still applied
    "guided_decoding_backend": Honoured(
        {"guided_decoding_backend": "xgrammar", "guided_choice": ["yes", "no"], **FREE},
        _one_of("yes", "no"),
    ),
    "structured_outputs": Honoured(
        {"structured_outputs": {"choice": ["yes", "no"]}, **FREE}, _one_of("yes", "no")
    ),
    "response_format": Honoured({"response_format": {"type": "json_object"}, **FREE}, _json_object),
    "tools": Honoured(
        {"tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False, **FREE},
        _called("get_weather"),
    ),
    "tool_choice": Honoured(
        {
            "tools": [WEATHER, CLOCK],
            **FREE,
            "tool_choice": {"type": "function", "function": {"name": "get_time"}},
        },
        _called("get_time"),
    ),
    "parallel_tool_calls": Honoured(
        {
            "tools": [WEATHER, CLOCK],
            "tool_choice": "required",
            "parallel_tool_calls": False,
            **FREE,
        },
        _parallel,
    ),
}
REFUSED = {
    "functions": Refused([{"name": "f"}], ([],)),
    "function_call": Refused("auto", ("none",)),
    # Honoured by a server with a KV connector (tests/test_disagg_serve.py); this one has none.
    "kv_transfer_params": Refused({"do_remote_prefill": True}),
    "reasoning_effort": Refused("low"),
    "thinking_token_budget": Refused(64),
    "include_reasoning": Refused(False, (True,)),
    "verbosity": Refused("low", ("medium",)),
    "chat_template": Refused("{{ messages }}"),
    "chat_template_kwargs": Refused({"enable_thinking": False}, ({},)),
    "documents": Refused([{"title": "a", "text": "b"}], ([],)),
    "mm_processor_kwargs": Refused({"num_crops": 4}, ({},)),
    "media_io_kwargs": Refused({"image": {"x": 1}}, ({},)),
    "prompt_embeds": Refused("AAAA"),
    "modalities": Refused(["text", "audio"], (["text"],)),
    "audio": Refused({"voice": "alloy", "format": "wav"}),
    "use_beam_search": Refused(True, (False,)),
    "length_penalty": Refused(0.5, (1.0,)),
    "bad_words": Refused(["the"], ([],)),
    "logprob_token_ids": Refused([1, 2]),
    "watermarking": Refused(True, (False,)),
    "repetition_detection": Refused({"max_pattern_size": 4}),
    "spaces_between_special_tokens": Refused(False, (True,)),
    "stream_interval": Refused(4, (1,)),
    "suffix": Refused("end", ("",)),
    "ec_transfer_params": Refused({"x": 1}),
    "vllm_xargs": Refused({"x": 1}, ({},)),
    "session_id": Refused("conversation-1"),
    "routed_experts_prompt_start": Refused(3, (0,)),
    "return_weight_versions": Refused(True, (False,)),
    "return_token_offsets": Refused(True, (False,)),
    "mm_payload": Refused("none", ("tensors",)),
    "return_mm_kwargs": Refused(True, (False,)),
    "store": Refused(True, (False,)),
    "metadata": Refused({"k": "v"}, ({},)),
    "moderation": Refused({"model": "omni-moderation-latest"}),
    "prediction": Refused({"type": "content", "content": "x"}),
    "web_search_options": Refused({}),
    "service_tier": Refused("flex", ("auto", "default")),
    "prompt_cache_retention": Refused("24h", ("in_memory",)),
    "prompt_cache_options": Refused({"ttl": "24h"}, ({},)),
    "safety_identifier": Refused("user-hash"),
}


def test_every_listed_field_has_a_case():
    assert set(HONOURED).isdisjoint(REFUSED)
    for path, names in FIELDS.items():
        missing = set(names) - set(HONOURED) - set(REFUSED)
        assert not missing, f"{path}: no case for {sorted(missing)}"


# Long prompts of their own (several KV blocks) for the prefix-cache checks.
SALTED = {"cache_salt": "Alpha beta gamma delta epsilon. " * 8,
          "prompt_cache_key": "Lorem ipsum dolor sit amet. " * 8}  # fmt: skip


def _body(ctx: Ctx, path: str, name: str, case: Honoured) -> dict[str, Any]:
    extra = dict(case.extra(ctx, path) if callable(case.extra) else case.extra)
    if name == "add_special_tokens":  # the non-default value differs per endpoint
        extra["add_special_tokens"] = path == H
    if path == H and "logprobs" in extra:  # chat's logprobs is a flag
        extra["logprobs"] = True
    if name == "top_logprobs":
        extra["logprobs"] = True
    if name in SALTED:
        prompt = SALTED[name]
        extra.update({"prompt": prompt} if path == C else
                     {"messages": [{"role": "user", "content": prompt}]})  # fmt: skip
    if name == "echo" and path == H:  # echo repeats a last message of the reply's role
        return repeat(path, **extra)
    return case.body(path, **extra)


@pytest.mark.parametrize("path, name", [(p, n) for p, names in FIELDS.items() for n in names])
def test_each_field_is_honoured_or_refused_by_name(live, hf, ref, path, name):
    ctx = Ctx(live.url, hf, ref, path)
    if name in REFUSED:
        refused = REFUSED[name]
        r = ctx.post(base(path, **{name: refused.value}))
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == name and err["message"].startswith(name + ":")
        assert "not supported" in err["message"]
        assert ("planned" in err["message"]) == refused.planned, err["message"]
        for off in refused.off:
            assert ctx.post(base(path, **{name: off})).status_code == 200, (name, off)
        return
    body = _body(ctx, path, name, HONOURED[name])
    r = ctx.post(body)
    assert r.status_code == 200, r.text
    HONOURED[name].check(ctx, body, None if body.get("stream") else r.json())


@pytest.mark.parametrize(
    "path, name",
    [(C, "messages"), (C, "max_completion_tokens"), (C, "continue_final_message"), (H, "prompt")],
)
def test_a_field_of_the_other_endpoint_is_refused_with_a_pointer(live, path, name):
    r = httpx.post(live.url + path, json=base(path, **{name: 1}), timeout=60)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == name and (H if path == C else C) in err["message"]


def test_an_unknown_field_is_accepted_logged_once_and_counted(live):
    name = "kvserve_test_unknown_field"
    key = ("kvserve:ignored_request_fields_total", (("field", name),))
    assert scrape(live.url).get(key, 0.0) == 0
    for path in (C, H):
        r = httpx.post(live.url + path, json=base(path, **{name: {"x": 1}}), timeout=60)
        assert r.status_code == 200, r.text
    assert scrape(live.url)[key] == 2
    deadline = time.monotonic() + 10
    while not any(name in line for line in live.log) and time.monotonic() < deadline:
        time.sleep(0.05)
    lines = [line for line in live.log if name in line]
    assert len(lines) == 1 and "WARNING" in lines[0], lines


def test_priority_is_refused_where_the_scheduler_ignores_it(checkpoint):
    """Under fcfs a priority would change nothing, so it is refused by name (as vLLM does)."""
    from kvserve.server.app import BackgroundServer, build_state

    llm = LLM(checkpoint("llama_gqa"), max_model_len=128, dtype="float32")
    with BackgroundServer(build_state(llm.engine, ["m"])) as srv:
        body = {"prompt": "hi", "max_tokens": 2}
        r = httpx.post(srv.url + C, json={**body, "priority": 1}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "priority"
        assert "--scheduling-policy priority" in r.json()["error"]["message"]
        assert httpx.post(srv.url + C, json={**body, "priority": 0}, timeout=30).status_code == 200


def test_the_openai_client_works_unmodified(live, hf, ref):
    """Completions, chat and streaming through the official client, against the offline
    engine's greedy tokens."""
    client = OpenAI(base_url=live.url + "/v1", api_key="none", max_retries=0, timeout=60)
    ctx = Ctx(live.url, hf, ref, C)
    want = hf.decode(ctx.greedy(base(C)), skip_special_tokens=True)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX, temperature=0,
                                  extra_body={"ignore_eos": True})  # fmt: skip
    assert r.choices[0].text == want and r.usage.completion_tokens == MAX
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))  # fmt: skip
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    assert chunks[-1].usage.completion_tokens == MAX
    want_chat = hf.decode(Ctx(live.url, hf, ref, H).greedy(base(H)), skip_special_tokens=True)
    r = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=MAX, temperature=0,
                                       extra_body={"ignore_eos": True})  # fmt: skip
    assert r.choices[0].message.content == want_chat
    chunks = list(client.chat.completions.create(model=MODEL, messages=USER, max_tokens=MAX,
                                                 temperature=0, stream=True,
                                                 extra_body={"ignore_eos": True}))  # fmt: skip
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want_chat
