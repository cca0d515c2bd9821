"""Sharing repeated costly subschemas (kvserve.structured.shared_subschemas): the rewritten
schema accepts exactly what the schema as written accepts (checked with ``jsonschema`` on
instances, and with llguidance's own compile of the schema as written, token mask by token
mask), it is left whole where a reference could move, and an error still names the schema the
client wrote."""

from __future__ import annotations

import copy
import random
from pathlib import Path

import jsonschema
import pytest

from kvserve.structured.shared_subschemas import PREFIX, share_repeated_subschemas

URI = {"type": "string", "format": "uri"}
LOGIN = {"type": "string", "pattern": "^[a-z][a-z0-9-]{1,8}$"}
USER = {"type": "object", "properties": {"login": LOGIN, "url": URI},
        "required": ["login"], "additionalProperties": False}  # fmt: skip

# An API-object shape: the same URL, login and user fields again and again (with differing
# annotations), inside properties, items, anyOf and an existing $defs entry that is $ref'd.
API = {
    "$defs": {"team": {"type": "object", "properties": {"lead": USER, "members": {
        "type": "array", "items": USER, "maxItems": 3}}, "required": ["lead"],
        "additionalProperties": False}},
    "type": "object",
    "properties": {
        "html_url": {**URI, "description": "page"},
        "api_url": {**URI, "title": "API"},
        "owner": USER,
        "sender": {**USER, "description": "who sent it"},
        "assignee": {"anyOf": [USER, {"type": "null"}]},
        "reviewers": {"type": "array", "items": USER, "maxItems": 2},
        "team": {"$ref": "#/$defs/team"},
        "code": LOGIN,
        "n": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["owner", "code", "team"],
    "additionalProperties": False,
}  # fmt: skip

_U = {"login": "ann", "url": "https://x.org/a"}
INSTANCES = [
    {"owner": _U, "code": "ab", "team": {"lead": _U}},
    {"owner": _U, "code": "ab", "team": {"lead": _U, "members": [_U, {"login": "b0"}]},
     "sender": {"login": "zed"}, "assignee": None, "reviewers": [_U], "n": 3},
    {"owner": _U, "code": "ab", "team": {"lead": _U, "members": [_U, _U, _U]}},
    {"owner": {"login": "Ann"}, "code": "ab", "team": {"lead": _U}},  # login pattern
    {"owner": _U, "code": "ab", "team": {"lead": {"login": "x"}}},  # too short in $defs
    {"owner": _U, "code": "ab", "team": {"lead": _U}, "reviewers": [_U, _U, _U]},  # maxItems
    {"owner": _U, "code": "ab", "team": {"lead": _U}, "assignee": {"login": "9x"}},  # anyOf
    {"owner": _U, "code": "ab", "team": {"lead": _U}, "sender": {"url": "u"}},  # required
    {"owner": {**_U, "extra": 1}, "code": "ab", "team": {"lead": _U}},  # additionalProperties
    {"owner": _U, "team": {"lead": _U}},  # code missing
]  # fmt: skip


def test_repeated_costly_subschemas_become_one_definition_each():
    before = copy.deepcopy(API)
    out = share_repeated_subschemas(API)
    assert API == before  # the input is not modified
    shared = {k: v for k, v in out["$defs"].items() if k.startswith(PREFIX)}
    ref = {name: {"$ref": f"#/$defs/{name}"} for name in shared}
    by_body = {next(iter(v.get("properties", {})), v.get("format", v.get("pattern"))): n
               for n, v in shared.items()}  # fmt: skip
    # URL fields (annotations aside) share one definition, users another (outermost first)
    uri, user = ref[by_body["uri"]], ref[by_body["login"]]
    props = out["properties"]
    assert props["html_url"] == props["api_url"] == uri
    assert props["owner"] == props["sender"] == props["reviewers"]["items"] == user
    assert props["assignee"]["anyOf"] == [user, {"type": "null"}]
    assert out["$defs"]["team"]["properties"]["lead"] == user
    assert out["$defs"]["team"]["properties"]["members"]["items"] == user
    assert out["properties"]["team"] == {"$ref": "#/$defs/team"}
    assert props["n"] is API["properties"]["n"]  # nothing costly below: left as it was


def test_the_rewritten_schema_accepts_the_same_instances():
    out = share_repeated_subschemas(API)
    assert out is not API
    verdicts = []
    for inst in INSTANCES:
        same = [jsonschema.Draft202012Validator(s).is_valid(inst) for s in (API, out)]
        assert same[0] == same[1], inst
        verdicts.append(same[0])
    assert verdicts == [True] * 3 + [False] * 7  # the instances do test something


@pytest.mark.parametrize(
    "schema",
    [
        {"$id": "https://example.com/s", **API},  # a base URI: relative refs could move
        {**API, "properties": {**API["properties"], "x": {"$ref": "#/properties/owner"}}},
        {**API, "properties": {**API["properties"], "y": {"id": "legacy", **URI}}},
        {"type": "object", "properties": {"a": URI, "b": {"type": "string"}}},  # one costly
        {"type": "object", "properties": {"a": URI, "b": {**URI, "format": "email"}}},
    ],
    ids=["$id", "deep-ref", "draft4-id", "single", "distinct"],
)
def test_left_whole_when_nothing_is_shared_or_a_reference_could_move(schema):
    assert share_repeated_subschemas(schema) is schema


@pytest.fixture(scope="module")
def backend():
    from kvserve.structured.llguidance_backend import LLGuidanceBackend
    from kvserve.structured.params import StructuredOutputsParams

    tok = Path(__file__).parents[1] / "kvserve/bundled/kvserve-ref/tokenizer.json"
    b = LLGuidanceBackend(tok.read_text(), 4096, (2,))
    return b, StructuredOutputsParams


def test_llguidance_masks_equal_those_of_the_schema_as_written(backend):
    """Random walks through the shared schema's grammar: at every step the token mask equals
    the one llguidance computes for the schema as written."""
    import torch

    from kvserve.sample.token_bitmask import bitmask_words, unpack_bitmask

    b, Params = backend
    p = Params(json=API)
    shared = share_repeated_subschemas(API)
    rng = random.Random(0)
    masks = torch.zeros((2, bitmask_words(4096)), dtype=torch.int32)
    steps = 0
    for _ in range(3):
        ms = [b._compile(p, s).matcher() for s in (API, shared)]
        while not ms[0].is_terminated() and steps < 400:
            for row, m in enumerate(ms):
                m.fill_bitmask(masks, row)
            assert torch.equal(masks[0], masks[1]), steps
            allowed = unpack_bitmask(masks[:1], 4096)[0].nonzero()[:, 0].tolist()
            tok = rng.choice([t for t in allowed if t != 2] or allowed)
            assert all(m.accept_token(tok) for m in ms)
            steps += 1
        assert ms[1].is_terminated() == ms[0].is_terminated()
    assert steps > 50


def test_an_error_names_the_schema_as_written(backend):
    b, Params = backend
    from kvserve.structured.backend import GrammarError

    bad = {"type": "string", "pattern": "(unclosed"}
    schema = {"type": "object", "properties": {"a": bad, "b": bad}}
    assert share_repeated_subschemas(schema) is not schema
    with pytest.raises(GrammarError) as e:
        b.compile(Params(json=schema))
    assert PREFIX not in str(e.value)
    assert "unclosed" in str(e.value)


def test_a_draft7_root_reference_still_resolves(backend):
    """pydantic v1's shape: a root ``$ref`` into ``definitions``; the shared definitions go to
    a new ``$defs`` beside it, which llguidance and jsonschema both resolve."""
    b, Params = backend
    v1 = {"$schema": "http://json-schema.org/draft-07/schema#", "$ref": "#/definitions/M",
          "definitions": {"M": {"type": "object", "properties": {"x": LOGIN, "y": LOGIN},
                                "required": ["x"]}}}  # fmt: skip
    out = share_repeated_subschemas(v1)
    assert out["definitions"]["M"]["properties"]["x"]["$ref"].startswith(f"#/$defs/{PREFIX}")
    for inst, ok in (({"x": "ab"}, True), ({"x": "Ab"}, False), ({"y": "ab"}, False)):
        assert jsonschema.Draft7Validator(v1).is_valid(inst) is ok
        assert jsonschema.Draft7Validator(out).is_valid(inst) is ok
    assert b._compile(Params(json=v1), out).matcher() is not None


def test_a_schema_nested_past_the_stack_is_left_to_the_library():
    deep: dict = {"type": "string", "format": "uri"}
    for _ in range(5000):
        deep = {"type": "array", "items": deep}
    assert share_repeated_subschemas(deep) is deep
