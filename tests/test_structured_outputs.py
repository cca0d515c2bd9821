"""Structured outputs in the engine, on the bundled model: outputs checked against independent
references (``jsonschema`` for JSON schemas, Python's ``re`` for regexes, membership for
choices), under random sampling, ``n`` = 3, forced preemption and prefix caching; and what a
constrained request must not change (unconstrained neighbours, the engine after a bad one).

The CI share is small (short outputs, one batch per property); the 500-output run is
``benchmarks/structured.py``.
"""

from __future__ import annotations

import json
import re
import threading

import jsonschema
import pytest

from kvserve import SamplingParams, StructuredOutputsParams
from kvserve.sched.request import InvalidRequestError

# Each bounded, so that random text reaches the end of the grammar within max_tokens.
SCHEMAS: list[dict] = [
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
     "additionalProperties": False},
    {"type": "string", "enum": ["red", "green", "blue"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                      "n": {"type": "integer", "minimum": 1, "maximum": 9}},
     "required": ["color", "n"], "additionalProperties": False},
    {"type": "integer", "minimum": -50, "maximum": 50},
    {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99},
     "minItems": 2, "maxItems": 4},
    {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                      "tags": {"type": "array", "maxItems": 2, "items":
                                               {"type": "string", "maxLength": 4}}},
     "required": ["id", "tags"], "additionalProperties": False},
    {"type": "object", "properties": {"a": {"type": "object", "properties": {
        "b": {"type": "object", "properties": {"c": {"type": "boolean"}},
              "required": ["c"], "additionalProperties": False}},
        "required": ["b"], "additionalProperties": False}},
     "required": ["a"], "additionalProperties": False},
    {"type": "string", "enum": ["東京", "大阪", "北京"]},  # CJK: several bytes per character
    {"type": "string", "enum": ["🙂", "👍🏽", "🚀✨"]},  # emoji split across byte-level tokens
    {"type": "string", "pattern": "^[一-龥]{1,3}$"},
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 3},
                                      "emoji": {"const": "🎉"}},
     "required": ["city", "emoji"], "additionalProperties": False},
    {"type": "array", "items": {"enum": ["x", "y"]}, "minItems": 1, "maxItems": 3},
    {"type": "number", "minimum": 0, "maximum": 1},
    {"type": "boolean"},
    {"type": "null"},
    {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"enum": ["none"]}]},
    {"type": "object", "properties": {"date": {"type": "string",
                                               "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}},
     "required": ["date"], "additionalProperties": False},
    {"type": "array", "prefixItems": [{"type": "integer", "minimum": 0, "maximum": 9},
                                      {"enum": ["a", "b"]}], "items": False, "minItems": 2},
    {"type": "object", "properties": {"p": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": 0, "maximum": 9},
        "y": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["x", "y"], "additionalProperties": False},
        "name": {"type": "string", "maxLength": 5}},
     "required": ["p", "name"], "additionalProperties": False},
]  # fmt: skip

PROMPT = "Answer in JSON:"


def _json(schema: dict, **kw) -> SamplingParams:  # noqa: ANN003
    kw.setdefault("max_tokens", 48)
    kw.setdefault("temperature", 1.0)
    return SamplingParams(structured_outputs=StructuredOutputsParams(json=schema), **kw)


def _check_json(outputs: list, schemas: list[dict]) -> tuple[int, int]:
    """Every finished output parses and validates; returns (finished, total)."""
    finished = total = 0
    for out, schema in zip(outputs, schemas, strict=True):
        for c in out.outputs:
            total += 1
            assert "\ufffd" not in c.text, c.text
            if c.finish_reason == "stop":
                finished += 1
                jsonschema.validate(json.loads(c.text), schema)
    return finished, total


@pytest.fixture(scope="module")
def bundled():
    from kvserve import LLM

    llm = LLM("kvserve-ref", max_model_len=256, dtype="float32", seed=3)
    yield llm
    llm.shutdown()


def test_json_schemas_validate_under_random_sampling(bundled):
    """20 schemas, 3 samples each (``n`` = 3, so three matchers per compiled grammar) at
    temperature 1: every finished output validates with jsonschema, most finish."""
    outs = bundled.generate([PROMPT] * len(SCHEMAS), [_json(s, n=3) for s in SCHEMAS])
    finished, total = _check_json(outs, SCHEMAS)
    assert total == 3 * len(SCHEMAS)
    assert finished >= total * 0.75, (finished, total)


def test_regex_choice_and_grammar_match(bundled):
    regex = r"[a-z]{2,5}-[0-9]{2}"
    choice = ["yes", "no", "東京", "maybe not"]
    lark = 'start: "(" item ("," item)? ("," item)? ")"\nitem: /[0-9]{1,2}/'
    lark_re = r"\([0-9]{1,2}(,[0-9]{1,2}){0,2}\)"
    params = [
        SamplingParams(n=3, temperature=1.0, max_tokens=24,
                       structured_outputs=StructuredOutputsParams(regex=regex)),
        SamplingParams(n=3, temperature=1.0, max_tokens=24,
                       structured_outputs=StructuredOutputsParams(choice=choice)),
        SamplingParams(n=3, temperature=1.0, max_tokens=24,
                       structured_outputs=StructuredOutputsParams(grammar=lark)),
    ]  # fmt: skip
    rx, ch, gr = bundled.generate([PROMPT] * 3, params)
    for c in rx.outputs:
        assert c.finish_reason == "stop" and re.fullmatch(regex, c.text), c.text
    for c in ch.outputs:  # a choice's end is the grammar's end: the request stops there
        assert c.finish_reason == "stop" and c.text in choice, c.text
    for c in gr.outputs:
        assert c.finish_reason == "stop" and re.fullmatch(lark_re, c.text), c.text


def test_top_logprobs_only_name_allowed_tokens(bundled):
    """After the mask, the top logprobs hold only tokens the grammar allows: at the first
    step of a choice, tokens whose text begins one of the alternatives."""
    choice = ["yes", "no"]
    p = SamplingParams(temperature=0.0, max_tokens=4, logprobs=5,
                       structured_outputs=StructuredOutputsParams(choice=choice))  # fmt: skip
    c = bundled.generate([PROMPT], p)[0].outputs[0]
    tok = bundled.get_tokenizer()
    first = c.logprobs[0]
    assert first
    for t, lp in first.items():
        text = tok.decode([t])
        assert any(a.startswith(text) for a in choice), (t, text)
        assert lp > float("-inf")


def test_a_bias_never_revives_a_masked_token(bundled):
    """logit_bias applies before the mask: +100 on a token the grammar forbids changes
    nothing about what may be sampled."""
    tok = bundled.get_tokenizer()
    forbidden = tok.encode("zebra", add_special_tokens=False)[0]
    so = StructuredOutputsParams(choice=["yes", "no"])
    p = SamplingParams(temperature=1.0, n=3, max_tokens=8, logit_bias={forbidden: 100.0},
                       structured_outputs=so)  # fmt: skip
    for c in bundled.generate([PROMPT], p)[0].outputs:
        assert c.text in ("yes", "no") and forbidden not in c.token_ids


def test_unconstrained_neighbours_are_unchanged(bundled):
    """Seeded and greedy unconstrained requests give byte-identical text with or without
    constrained requests in the same batch."""
    plain = [SamplingParams(temperature=1.0, seed=11, max_tokens=20),
             SamplingParams(temperature=0.0, max_tokens=20)]  # fmt: skip
    alone = bundled.generate(["Once upon", "The cat"], plain)
    mixed = bundled.generate(
        ["Once upon", PROMPT, "The cat", PROMPT],
        [plain[0], _json(SCHEMAS[2]), plain[1], _json(SCHEMAS[5], n=2)],
    )
    assert [o.outputs[0].text for o in alone] == [mixed[0].outputs[0].text,
                                                 mixed[2].outputs[0].text]  # fmt: skip


def test_mask_fills_on_the_worker_thread(bundled, monkeypatch):
    """The runner starts the step's mask before the forward pass: it is filled on the
    processor's thread, never on the engine's."""
    from kvserve.sample.structured_outputs import StructuredOutputsLogitsProcessor

    threads = []
    fill = StructuredOutputsLogitsProcessor._fill

    def spy(self, states):  # noqa: ANN001, ANN202
        threads.append(threading.current_thread().name)
        return fill(self, states)

    monkeypatch.setattr(StructuredOutputsLogitsProcessor, "_fill", spy)
    bundled.generate([PROMPT], _json(SCHEMAS[2], max_tokens=8))
    assert threads and all(t.startswith("kvserve-bitmask") for t in threads), threads


def test_greedy_identical_with_and_without_prefix_caching(make_llm):
    shared = "You are a careful assistant that answers in JSON only. " * 4
    prompts = [shared + q for q in ("Colour?", "Numbers?", "Nested?")]
    schemas = [SCHEMAS[2], SCHEMAS[5], SCHEMAS[7]]
    runs = []
    for caching in (False, True):
        llm = make_llm("kvserve-ref", max_model_len=256, dtype="float32",
                       enable_prefix_caching=caching, block_size=8)  # fmt: skip
        first = llm.generate(prompts, [_json(s, temperature=0.0) for s in schemas])
        again = llm.generate(prompts, [_json(s, temperature=0.0) for s in schemas])
        runs.append([o.outputs[0].token_ids for o in first + again])
        _check_json(first, schemas)
    assert runs[0] == runs[1]
    assert runs[1][:3] == runs[1][3:]


def test_preempted_requests_resume_their_grammar(make_llm):
    """A pool too small for the batch: requests are preempted and recomputed, their matchers
    rebuilt from the output so far; every output still validates and greedy output equals
    the run with room."""
    schemas = [SCHEMAS[i % len(SCHEMAS)] for i in (2, 5, 6, 7, 11, 19)] * 2
    params = [_json(s, temperature=0.0, max_tokens=40) for s in schemas]
    prompts = [f"{PROMPT} {i}" for i in range(len(schemas))]
    roomy = make_llm("kvserve-ref", max_model_len=256, dtype="float32", block_size=4)
    want = [o.outputs[0].token_ids for o in roomy.generate(prompts, params)]
    tight = make_llm("kvserve-ref", max_model_len=256, dtype="float32", block_size=4,
                     num_gpu_blocks=40, enable_prefix_caching=False)  # fmt: skip
    outs = tight.generate(prompts, params)
    assert tight.engine.stats().num_preemptions > 0
    _check_json(outs, schemas)
    assert [o.outputs[0].token_ids for o in outs] == want


@pytest.mark.parametrize(
    "so, field",
    [
        (dict(json={"type": "nosuchtype"}), "structured_outputs.json"),
        (dict(json={"type": "string", "pattern": "(?=a)b"}), "structured_outputs.json"),
        (dict(regex="(unclosed"), "structured_outputs.regex"),
        (dict(grammar="start: undefined_rule"), "structured_outputs.grammar"),
    ],
)
def test_bad_constraints_are_refused_and_the_engine_serves_on(bundled, so, field):
    """Invalid schema, an unsupported feature (look-ahead), a bad regex, a bad grammar: each
    an InvalidRequestError naming the field; valid, invalid, valid in a row all served."""
    good = _json(SCHEMAS[1], temperature=0.0)
    assert bundled.generate([PROMPT], good)[0].outputs[0].finish_reason == "stop"
    with pytest.raises(InvalidRequestError) as err:
        bundled.generate([PROMPT], SamplingParams(structured_outputs=StructuredOutputsParams(**so)))
    assert err.value.field == field and str(err.value).startswith(field)
    assert not bundled.engine.has_unfinished_requests()
    out = bundled.generate([PROMPT], good)[0].outputs[0]
    assert out.finish_reason == "stop" and json.loads(out.text) in SCHEMAS[1]["enum"]


def test_compile_time_limit_is_a_request_error(make_llm):
    llm = make_llm("kvserve-ref", max_model_len=128, dtype="float32",
                   structured_outputs_compile_timeout=1e-6)  # fmt: skip
    # many properties: no compile finishes within a microsecond
    schema = {"type": "object", "properties": {f"k{i}": {"type": "integer"} for i in range(200)}}
    with pytest.raises(InvalidRequestError) as err:
        llm.generate([PROMPT], _json(schema))
    assert err.value.field == "structured_outputs.json" and "compile" in str(err.value)
    out = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=4))[0].outputs[0]
    assert len(out.token_ids) == 4


@pytest.mark.parametrize("backend", ["llguidance", "xgrammar"])
def test_both_backends_constrain(make_llm, backend):
    llm = make_llm("kvserve-ref", max_model_len=128, dtype="float32",
                   structured_outputs_backend=backend)  # fmt: skip
    schemas = [SCHEMAS[2], SCHEMAS[5], SCHEMAS[9]]
    outs = llm.generate([PROMPT] * 3, [_json(s, n=2) for s in schemas])
    finished, total = _check_json(outs, schemas)
    assert finished >= total // 2
    rx = SamplingParams(temperature=1.0, n=2, max_tokens=16,
                        structured_outputs=StructuredOutputsParams(regex=r"[0-9]{3}x"))  # fmt: skip
    for c in llm.generate([PROMPT], rx)[0].outputs:
        assert re.fullmatch(r"[0-9]{3}x", c.text), c.text


def test_a_worker_process_compiles_its_own_matchers(make_llm):
    """With the model in a worker process (``mp``), the worker compiles the constraint with
    its own compiler and gives the same greedy output as the in-process runner."""
    params = [_json(SCHEMAS[2], temperature=0.0), _json(SCHEMAS[11], temperature=0.0)]
    outs = {}
    for executor in ("uni", "mp"):
        llm = make_llm("kvserve-ref", max_model_len=128, dtype="float32",
                       distributed_executor_backend=executor)  # fmt: skip
        outs[executor] = [o.outputs[0].token_ids for o in llm.generate([PROMPT] * 2, params)]
        _check_json(llm.generate([PROMPT] * 2, params), [SCHEMAS[2], SCHEMAS[11]])
    assert outs["uni"] == outs["mp"]


def test_streamed_cjk_and_emoji_deltas_hold_no_replacement_character(bundled):
    """Emoji and CJK characters take several byte-level tokens: streamed deltas never show a
    half character (U+FFFD), and they add up to the output, which validates."""
    engine = bundled.engine
    schemas = [SCHEMAS[9], SCHEMAS[10], SCHEMAS[11]]
    ids = [engine.add_request(None, PROMPT, _json(s, n=2), stream=True) for s in schemas]
    text: dict[tuple[str, int], str] = {}
    final: dict[tuple[str, int], str | None] = {}
    for _ in range(500):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            for c in out.outputs:
                assert "\ufffd" not in c.text, repr(c.text)
                key = (out.request_id, c.index)
                text[key] = text.get(key, "") + c.text
                if c.finish_reason is not None:
                    final[key] = c.finish_reason
    assert not engine.has_unfinished_requests()
    assert len(final) == 2 * len(schemas)
    for (rid, _), reason in final.items():
        schema = schemas[ids.index(rid)]
        if reason == "stop":
            jsonschema.validate(json.loads(text[(rid, _)]), schema)
    assert any(any(ord(ch) > 0x2E80 for ch in t) for t in text.values())


def test_prepare_compiles_off_the_engine_thread(bundled):
    """A server compiles on its own thread first; the engine then finds the grammar cached."""
    good = _json(
        {
            "type": "object",
            "properties": {"q": {"enum": [1, 2]}},
            "required": ["q"],
            "additionalProperties": False,
        }
    )
    errors: list[Exception] = []

    def compile_both() -> None:
        bundled.engine.prepare_structured_outputs(good)
        try:
            bundled.engine.prepare_structured_outputs(
                SamplingParams(structured_outputs=StructuredOutputsParams(regex="(x"))
            )
        except InvalidRequestError as e:
            errors.append(e)

    t = threading.Thread(target=compile_both)
    t.start()
    t.join(timeout=60)
    assert not t.is_alive() and [e.field for e in errors] == ["structured_outputs.regex"]
    key = good.structured_outputs.key()
    assert bundled.engine.grammars._cache[key].done()
    out = bundled.generate([PROMPT], good.clone(temperature=0.0))[0].outputs[0]
    assert json.loads(out.text)["q"] in (1, 2)


@pytest.mark.parametrize("backend", ["llguidance", "xgrammar"])
@pytest.mark.parametrize("knob", [{"ignore_eos": True}, {"min_tokens": 6}])
def test_the_grammars_end_stops_the_request(make_llm, backend, knob):
    """The grammar's end stops a request even under ignore_eos, and before a min_tokens the
    grammar cannot reach (min_tokens masks EOS first: the row would otherwise have no token
    left); the library is not asked for a mask it can no longer give (xgrammar raises)."""
    llm = make_llm("kvserve-ref", max_model_len=128, dtype="float32",
                   structured_outputs_backend=backend)  # fmt: skip
    so = StructuredOutputsParams(choice=["yes", "no"])
    p = SamplingParams(temperature=1.0, max_tokens=8, structured_outputs=so, **knob)
    c = llm.generate([PROMPT], p)[0].outputs[0]
    assert c.finish_reason == "stop"
    assert c.token_ids[-1] in set(llm.engine.eos_token_ids)
    assert llm.get_tokenizer().decode(c.token_ids[:-1]) in ("yes", "no")
