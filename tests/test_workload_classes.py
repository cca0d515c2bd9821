"""The workload-class file: every validation error names the entry and the field, YAML and
JSON read alike, overlaps without an order are refused, and matching agrees with a brute-force
reference."""

from __future__ import annotations

import itertools
import json

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.config import ConfigError
from kvserve.workload_classes import (
    DEFAULT_CLASS,
    ClassMatch,
    UnknownClassError,
    WorkloadClass,
    load_workload_classes,
    parse_workload_classes,
)

GOOD = {
    "classes": [
        {"name": "vip", "match": {"tenants": ["acme"]}, "priority": -1,
         "slo": {"ttft_ms": 500, "tpot_ms": 50}},
        {"name": "chat", "match": {"prompt_tokens": [0, 2048], "prefix_share": [0, 0.5]},
         "output_estimate": "learned", "kv": {"kv_retention": "none", "prefix_caching": True}},
        {"name": "docs", "match": {"prompt_tokens": [2048, None]}, "priority": 2,
         "output_estimate": 64, "kv": {"kv_retention": "window:512", "kv_cache_dtype": "auto"}},
    ]
}  # fmt: skip


def entry(**kw):
    return {"classes": [{"name": "a", **kw}]}


@pytest.mark.parametrize(
    "data, message",
    [
        ({"klasses": []}, "workload_classes: unknown key 'klasses'"),
        ({"classes": []}, "workload_classes: the file defines no class"),
        ({"classes": [{"match": {}}]}, r"workload_classes\[0\].name: must be a non-empty"),
        (entry(colour=1), r"workload_classes\[0\] \(a\): unknown key 'colour'"),
        (entry(match={"promt_tokens": [0, 1]}), r"\(a\).match: unknown key 'promt_tokens'"),
        (entry(match={"prompt_tokens": [5, 5]}), r"\(a\).match.prompt_tokens: must be"),
        (entry(match={"prompt_tokens": [-1, 5]}), r"\(a\).match.prompt_tokens: must be"),
        (entry(match={"prefix_share": [0.6, 0.2]}), r"\(a\).match.prefix_share: must be"),
        (entry(match={"prefix_share": [0, 1.5]}), r"\(a\).match.prefix_share: must be"),
        (entry(match={"tenants": []}), r"\(a\).match.tenants: must be a non-empty list"),
        (entry(match={"users": ["x", 3]}), r"\(a\).match.users: must be a non-empty list"),
        (entry(priority="high"), r"\(a\).priority: must be an integer"),
        (entry(priority=True), r"\(a\).priority: must be an integer"),
        (entry(slo={"ttft_ms": -5}), r"\(a\).slo.ttft_ms: must be a number > 0, got -5"),
        (entry(slo={"tpot_ms": float("inf")}), r"\(a\).slo.tpot_ms: must be a number > 0"),
        (entry(slo={"ttft_ms": True}), r"\(a\).slo.ttft_ms: must be a number > 0"),
        (entry(slo={"p99_ms": 5}), r"\(a\).slo: unknown key 'p99_ms'"),
        (entry(output_estimate="guess"), r"\(a\).output_estimate: must be max_tokens, learned"),
        (entry(output_estimate=0), r"\(a\).output_estimate: must be max_tokens, learned"),
        (entry(kv={"kv_retention": "snapkv"}), r"\(a\).kv.kv_retention: "),
        (entry(kv={"prefix_caching": "yes"}), r"\(a\).kv.prefix_caching: must be true or false"),
        (entry(kv={"kv_cache_dtype": ""}), r"\(a\).kv.kv_cache_dtype: must be a KV format"),
        (entry(kv={"offload": 1}), r"\(a\).kv: unknown key 'offload'"),
        ({"classes": [{"name": "a"}, {"name": "a", "priority": 1}]},
         r"workload_classes\[1\] \(a\).name: 'a' is defined twice"),
        ({"classes": [{"name": "all"}, {"name": "b", "match": {"users": ["u"]}}]},
         r"workload_classes\[1\] \(b\): unreachable: workload_classes\[0\] \(all\)"),
        ({"classes": {"a": {"match": {"prompt_tokens": [0, 100]}},
                      "b": {"match": {"prompt_tokens": [50, 200]}}}},
         r"workload_classes.a and workload_classes.b: one request can match both"),
        ({"classes": {"a": {"order": 1, "match": {"users": ["u"]}},
                      "b": {"order": 1}}},
         r"workload_classes.a and workload_classes.b: one request can match both"),
        (42, "workload_classes: expected a list of classes"),
    ],
)  # fmt: skip
def test_errors_name_the_entry_and_field(data, message):
    with pytest.raises(ConfigError, match=message):
        parse_workload_classes(data)


def test_yaml_and_json_files_read_alike(tmp_path):
    j, y = tmp_path / "c.json", tmp_path / "c.yaml"
    j.write_text(json.dumps(GOOD))
    y.write_text(yaml.safe_dump(GOOD))
    a, b = load_workload_classes(str(j)), load_workload_classes(str(y))
    assert a == b and a.names == ["vip", "chat", "docs", DEFAULT_CLASS]
    docs = a.get("docs")
    assert (docs.priority, docs.output_estimate, docs.kv_retention) == (2, 64, "window:512")
    assert a.get("vip").ttft_slo == 0.5 and a.get("vip").tpot_slo == 0.05


def test_unreadable_files_are_named(tmp_path):
    with pytest.raises(ConfigError, match="workload_classes: cannot read .*missing.json"):
        load_workload_classes(str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("classes: [unclosed")
    with pytest.raises(ConfigError, match="workload_classes: cannot read .*bad.yaml"):
        load_workload_classes(str(bad))
    with pytest.raises(ConfigError, match="expected 'default' or a .json, .yaml or .yml"):
        load_workload_classes(str(tmp_path / "classes.txt"))


def test_mapping_form_orders_overlapping_entries():
    c = parse_workload_classes({"classes": {
        "wide": {"order": 2, "match": {"prompt_tokens": [0, 1000]}},
        "narrow": {"order": 1, "match": {"prompt_tokens": [0, 100]}},
        "disjoint": {"match": {"prompt_tokens": [1000, None]}},
    }})  # fmt: skip
    assert c.classify(prompt_tokens=50).name == "narrow"
    assert c.classify(prompt_tokens=500).name == "wide"
    assert c.classify(prompt_tokens=5000).name == "disjoint"


def test_classify_first_match_default_and_explicit():
    c = parse_workload_classes(GOOD)
    assert c.classify("acme", None, 10, 0.0).name == "vip"  # before chat, which also matches
    assert c.classify("other", None, 10, 0.2).name == "chat"
    assert c.classify("other", None, 10, 0.9).name == DEFAULT_CLASS
    assert c.classify(prompt_tokens=4096).name == "docs"
    assert c.classify(prompt_tokens=10, explicit="docs").name == "docs"
    with pytest.raises(UnknownClassError, match="unknown class 'nope'; .* vip, chat, docs"):
        c.classify(explicit="nope")
    assert c.needs_prefix_share
    assert not parse_workload_classes(entry(priority=1)).needs_prefix_share


def test_check_pool_names_the_entry():
    c = parse_workload_classes(GOOD)
    c.check_pool("auto")
    with pytest.raises(ConfigError, match=r"workload_classes\[2\] \(docs\).kv.kv_cache_dtype: "
                       "the pool stores 'fp8_e4m3'"):  # fmt: skip
        c.check_pool("fp8_e4m3")


def test_default_classes():
    d = load_workload_classes("default")
    assert d.classify(prompt_tokens=300).name == "chat"
    assert d.classify(prompt_tokens=1000, prefix_share=0.9).name == "agent"
    assert d.classify(prompt_tokens=3000, prefix_share=0.1).name == "rag"
    assert d.classify(prompt_tokens=9000).name == "long-document"
    assert d.get("long-document").priority > d.get("chat").priority


def test_meets_slo():
    c = WorkloadClass("a", ttft_slo=1.0, tpot_slo=0.1)
    assert c.meets_slo(0.5, 0.05) and not c.meets_slo(1.5, 0.05)
    assert not c.meets_slo(0.5, 0.2) and not c.meets_slo(0.5, None)
    assert WorkloadClass("b").meets_slo(None, None)


# -- matching against a brute-force reference ---------------------------------------------------
NAMES = ["x", "y", "z"]
names = st.none() | st.sets(st.sampled_from(NAMES), min_size=1).map(frozenset)


@st.composite
def matches(draw):
    lo = draw(st.integers(0, 20))
    hi = draw(st.none() | st.integers(lo + 1, 30))
    a, b = sorted(draw(st.lists(st.sampled_from([0.0, 0.25, 0.5, 0.75, 1.0]), min_size=2,
                                max_size=2)))  # fmt: skip
    return ClassMatch(draw(names), draw(names), (lo, hi), (a, b))


def grid(*ms: ClassMatch):
    """Every request that can tell the matches apart: names from the alphabet (and none),
    lengths at each interval endpoint and beside it, shares at each endpoint."""
    lengths = {0}
    shares = {0.0, 1.0}
    for m in ms:
        lo, hi = m.prompt_tokens
        lengths |= {lo - 1, lo, lo + 1} | ({hi - 1, hi, hi + 1} if hi is not None else {99})
        shares |= set(m.prefix_share)
    lengths = {n for n in lengths if n >= 0}
    return itertools.product([None, *NAMES], [None, *NAMES], sorted(lengths), sorted(shares))


@settings(max_examples=300, deadline=None)
@given(a=matches(), b=matches())
def test_overlaps_equals_brute_force(a, b):
    both = any(a.matches(*r) and b.matches(*r) for r in grid(a, b))
    assert a.overlaps(b) == both == b.overlaps(a)


@settings(max_examples=100, deadline=None)
@given(ms=st.lists(matches(), min_size=1, max_size=4))
def test_classify_equals_a_plain_loop(ms):
    first_all = next((i for i, m in enumerate(ms) if m.is_catch_all), None)
    if first_all is not None:
        ms = ms[: first_all + 1]  # entries after a catch-all are refused as unreachable
    c = parse_workload_classes([{"name": f"c{i}", "match": _as_dict(m)} for i, m in enumerate(ms)])
    for r in grid(*ms):
        want = next((f"c{i}" for i, m in enumerate(ms) if m.matches(*r)), DEFAULT_CLASS)
        assert c.classify(*r).name == want


def _as_dict(m: ClassMatch) -> dict:
    d: dict = {"prompt_tokens": list(m.prompt_tokens), "prefix_share": list(m.prefix_share)}
    if m.tenants is not None:
        d["tenants"] = sorted(m.tenants)
    if m.users is not None:
        d["users"] = sorted(m.users)
    return d
