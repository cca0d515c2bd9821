"""The workload-class file: every validation error names the entry and the field, YAML and
JSON read alike, overlaps without an order and shadowed classes are refused, and matching,
overlap and shadowing agree with a brute-force search over concrete requests."""

from __future__ import annotations

import itertools
import json
import math
import pickle
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.config import ConfigError
from kvserve.sched.retention import parse_retention
from kvserve.sched.workload_class_file import load_workload_classes, parse_workload_classes
from kvserve.sched.workload_classes import (
    DEFAULT_CLASS,
    ClassMatch,
    UnknownClassError,
    WorkloadClass,
    WorkloadClasses,
)

GOOD = {
    "classes": [
        {"name": "vip", "match": {"tenants": ["acme"]}, "priority": -1,
         "slo": {"ttft_ms": 500, "tpot_ms": 50}},
        {"name": "chat", "match": {"prompt_tokens": [0, 2048], "prefix_share": [0, 0.5]},
         "output_estimate": "learned", "kv": {"kv_retention": "none", "prefix_caching": False}},
        {"name": "docs", "match": {"prompt_tokens": [2048, None]}, "priority": 2,
         "output_estimate": 64, "kv": {"kv_retention": "window:512", "kv_cache_dtype": "auto"}},
    ]
}  # fmt: skip


def entry(**kw):
    return {"classes": [{"name": "a", **kw}]}


def mapped(**entries):
    return {"classes": entries}


A = r"^workload_classes\[0\] \(a\)"  # the path every single-entry error starts with
TOKENS = A + r"\.match\.prompt_tokens: must be \[lo, hi\] with integers 0 <= lo < hi"
SHARE = A + r"\.match\.prefix_share: must be \[lo, hi\] with 0 <= lo <= hi <= 1"
NAMES = r"\.match\.(tenants|users): must be a non-empty list of strings"
ESTIMATE = A + r"\.output_estimate: must be max_tokens, learned or an integer >= 1"


@pytest.mark.parametrize(
    "data, message",
    [
        # top level
        ({"klasses": []}, r"^workload_classes: unknown key 'klasses'; allowed: classes$"),
        ({}, r"^workload_classes: missing key 'classes'"),
        ({"classes": None}, r"^workload_classes\.classes: null is not a value"),
        ({"classes": []}, r"^workload_classes: the file defines no class"),
        ({"classes": {}}, r"^workload_classes: the file defines no class"),
        ([], r"^workload_classes: the file defines no class"),
        (42, r"^workload_classes: expected a list of classes or a mapping"),
        # list entries and names
        (["chat"], r"^workload_classes\[0\]: must be a mapping, got str"),
        ({"classes": [{"match": {}}]}, r"^workload_classes\[0\]\.name: must be a non-empty "
         "string, got None"),
        ({"classes": [{"name": ""}]}, r"^workload_classes\[0\]\.name: .* got ''"),
        ({"classes": [{"name": 7}]}, r"^workload_classes\[0\]\.name: .* got 7"),
        ({"classes": [{"name": "a"}, {"name": "a", "priority": 1}]},
         r"^workload_classes\[1\] \(a\)\.name: 'a' is defined twice \(also workload_classes\[0\]"),
        (entry(colour=1), A + r": unknown key 'colour'; allowed: name, match, priority, slo"),
        (entry(order=1), A + r"\.order: a list is tried in its own order"),
        (entry(priority=None), A + r"\.priority: null is not a value"),
        # match
        (entry(match="all"), A + r"\.match: must be a mapping, got str"),
        (entry(match={"promt_tokens": [0, 1]}),
         A + r"\.match: unknown key 'promt_tokens'; allowed: tenants, users, prompt_tokens"),
        (entry(match={"prompt_tokens": [5, 5]}), TOKENS + r".*got \[5, 5\]"),
        (entry(match={"prompt_tokens": [10, 2]}), TOKENS),
        (entry(match={"prompt_tokens": [-1, 5]}), TOKENS),
        (entry(match={"prompt_tokens": [0]}), TOKENS),
        (entry(match={"prompt_tokens": [0.0, 5]}), TOKENS),
        (entry(match={"prompt_tokens": [True, 5]}), TOKENS),
        (entry(match={"prompt_tokens": [0, 5.5]}), TOKENS),
        (entry(match={"prompt_tokens": "0-5"}), TOKENS),
        (entry(match={"prompt_tokens": None}), A + r"\.match\.prompt_tokens: null is not a value"),
        (entry(match={"prefix_share": [0.6, 0.2]}), SHARE),
        (entry(match={"prefix_share": [0, 1.5]}), SHARE),
        (entry(match={"prefix_share": [-0.1, 0.5]}), SHARE),
        (entry(match={"prefix_share": [0, math.nan]}), SHARE),
        (entry(match={"prefix_share": [False, 1]}), SHARE),
        (entry(match={"prefix_share": [0.5]}), SHARE),
        (entry(match={"tenants": []}), A + NAMES),
        (entry(match={"tenants": "acme"}), A + NAMES),  # not the set of its letters
        (entry(match={"tenants": ["acme", ""]}), A + NAMES),
        (entry(match={"users": ["x", 3]}), A + NAMES),
        (entry(match={"users": {"x": 1}}), A + NAMES),
        # priority and order
        (entry(priority="high"), A + r"\.priority: must be an integer, got 'high'"),
        (entry(priority=True), A + r"\.priority: must be an integer"),
        (entry(priority=1.0), A + r"\.priority: must be an integer"),
        (mapped(a={"order": "1"}), r"^workload_classes\.a\.order: must be an integer"),
        (mapped(a={"order": False}), r"^workload_classes\.a\.order: must be an integer"),
        # slo
        (entry(slo={"ttft_ms": -5}), A + r"\.slo\.ttft_ms: must be a number > 0, got -5$"),
        (entry(slo={"ttft_ms": 0}), A + r"\.slo\.ttft_ms: must be a number > 0, got 0$"),
        (entry(slo={"tpot_ms": math.inf}), A + r"\.slo\.tpot_ms: must be a number > 0, got inf"),
        (entry(slo={"tpot_ms": math.nan}), A + r"\.slo\.tpot_ms: must be a number > 0, got nan"),
        (entry(slo={"ttft_ms": True}), A + r"\.slo\.ttft_ms: must be a number > 0, got True"),
        (entry(slo={"ttft_ms": "100"}), A + r"\.slo\.ttft_ms: must be a number > 0, got '100'"),
        (entry(slo={"p99_ms": 5}), A + r"\.slo: unknown key 'p99_ms'; allowed: ttft_ms, tpot_ms"),
        (entry(slo=[1000]), A + r"\.slo: must be a mapping, got list"),
        # output_estimate
        (entry(output_estimate="guess"), ESTIMATE + ", got 'guess'"),
        (entry(output_estimate=0), ESTIMATE),
        (entry(output_estimate=-3), ESTIMATE),
        (entry(output_estimate=True), ESTIMATE),
        (entry(output_estimate=1.5), ESTIMATE),
        # kv
        (entry(kv={"kv_retention": "lru:8"}), A + r"\.kv\.kv_retention: unknown policy 'lru'"),
        (entry(kv={"kv_retention": "window"}), A + r"\.kv\.kv_retention: 'window' is not KEY"),
        (entry(kv={"kv_retention": 512}), A + r"\.kv\.kv_retention: must be a retention spec"),
        (entry(kv={"kv_retention": " "}), A + r"\.kv\.kv_retention: must be a retention spec"),
        (entry(kv={"kv_retention": None}), A + r"\.kv\.kv_retention: null is not a value"),
        (entry(kv={"prefix_caching": "yes"}), A + r"\.kv\.prefix_caching: must be true or false"),
        (entry(kv={"prefix_caching": 1}), A + r"\.kv\.prefix_caching: must be true or false"),
        (entry(kv={"kv_cache_dtype": ""}), A + r"\.kv\.kv_cache_dtype: must be a KV format name"),
        (entry(kv={"kv_cache_dtype": 8}), A + r"\.kv\.kv_cache_dtype: must be a KV format name"),
        (entry(kv={"offload": 1}),
         A + r"\.kv: unknown key 'offload'; allowed: kv_retention, prefix_caching, kv_cache_dtype"),
        # unreachable entries
        ({"classes": [{"name": "all"}, {"name": "b", "match": {"users": ["u"]}}]},
         r"^workload_classes\[1\] \(b\): unreachable: workload_classes\[0\] \(all\) before it "
         "matches every request"),
        ({"classes": [{"name": "wide", "match": {"prompt_tokens": [0, 2048]}},
                      {"name": "narrow", "match": {"prompt_tokens": [0, 100], "users": ["u"]}}]},
         r"^workload_classes\[1\] \(narrow\): unreachable: every request it matches goes to "
         r"workload_classes\[0\] \(wide\) first"),
        (mapped(all={"order": 0}, b={"order": 1, "match": {"users": ["u"]}}),
         r"^workload_classes\.b: unreachable: workload_classes\.all before it matches every"),
        # the mapping form
        (mapped(a={"match": {"prompt_tokens": [0, 100]}},
                b={"match": {"prompt_tokens": [50, 200]}}),
         r"^workload_classes\.a and workload_classes\.b: one request can match both; give each "
         "a distinct 'order'"),
        (mapped(a={"order": 1, "match": {"users": ["u"]}}, b={}),
         r"^workload_classes\.a and workload_classes\.b: one request can match both"),
        (mapped(a={"order": 1, "match": {"users": ["u"]}}, b={"order": 1}),
         r"^workload_classes\.a and workload_classes\.b: one request can match both"),
        (mapped(a={"match": {"prefix_share": [0, 0.5]}}, b={"match": {"prefix_share": [0.5, 1]}}),
         r"^workload_classes\.a and workload_classes\.b: one request"),  # closed: 0.5 is in both
        ({"classes": {1: {}}}, r"^workload_classes: a class name must be a non-empty string"),
        (mapped(a={"name": "a"}), r"^workload_classes\.a: unknown key 'name'; allowed: order,"),
        (mapped(a=None), r"^workload_classes\.a: must be a mapping, got NoneType"),
        (mapped(a={"slo": {"ttft_ms": -1}}), r"^workload_classes\.a\.slo\.ttft_ms: must be a"),
    ],
)  # fmt: skip
def test_errors_name_the_entry_and_field(data, message):
    with pytest.raises(ConfigError, match=message):
        parse_workload_classes(data)


def test_valid_values_are_kept_in_engine_units():
    c = parse_workload_classes(GOOD)
    vip, chat, docs = c.get("vip"), c.get("chat"), c.get("docs")
    assert (vip.priority, vip.ttft_slo, vip.tpot_slo) == (-1, 0.5, 0.05)
    assert vip.match == ClassMatch(tenants=frozenset({"acme"}))
    assert chat.match.prefix_share == (0.0, 0.5) and chat.match.prompt_tokens == (0, 2048)
    assert (chat.output_estimate, chat.prefix_caching) == ("learned", False)
    # "none" turns the engine's default retention off: the retention parser reads no policy.
    assert chat.kv_retention == "none" and parse_retention(chat.kv_retention) is None
    assert parse_retention(docs.kv_retention).window == 512
    assert (docs.priority, docs.output_estimate, docs.kv_cache_dtype) == (2, 64, "auto")
    assert docs.match.prompt_tokens == (2048, None) and docs.kv_retention == "window:512"
    d = c.get(DEFAULT_CLASS)
    assert (d.match.is_catch_all, d.priority, d.ttft_slo, d.output_estimate) == (
        True, 0, None, "max_tokens"
    )  # fmt: skip
    assert c.source == "<data>" and c.names == ["vip", "chat", "docs", DEFAULT_CLASS]
    one = parse_workload_classes([{"name": "x", "slo": {"ttft_ms": 0.5}, "output_estimate": 1}])
    assert one.get("x").ttft_slo == 0.0005 and one.get("x").output_estimate == 1  # a bare list


YAML = """\
# the GOOD classes, written by hand
classes:
  - name: vip
    match: {tenants: [acme]}
    priority: -1
    slo: {ttft_ms: 500, tpot_ms: 50}
  - name: chat
    match: {prompt_tokens: [0, 2048], prefix_share: [0, 0.5]}
    output_estimate: learned
    kv: {kv_retention: none, prefix_caching: false}
  - name: docs
    match:
      prompt_tokens: [2048, null]
    priority: 2
    output_estimate: 64
    kv: {kv_retention: "window:512", kv_cache_dtype: auto}
"""


def test_yaml_and_json_files_read_alike(tmp_path):
    j, y, yml = tmp_path / "c.json", tmp_path / "c.yaml", tmp_path / "c.YML"
    j.write_text(json.dumps(GOOD))
    y.write_text(YAML)
    yml.write_text(YAML)
    a, b, c = (load_workload_classes(str(p)) for p in (j, y, yml))
    assert a == b == c == parse_workload_classes(GOOD)
    assert a.source == str(j) and b.source == str(y)
    assert a.names == ["vip", "chat", "docs", DEFAULT_CLASS]
    m = {"classes": {"late": {"order": 2}, "early": {"order": 1, "match": {"users": ["u"]}}}}
    (tmp_path / "m.json").write_text(json.dumps(m))
    (tmp_path / "m.yaml").write_text(
        "classes:\n  late: {order: 2}\n  early:\n    order: 1\n    match: {users: [u]}\n"
    )
    mj, my = (
        load_workload_classes(str(tmp_path / "m.json")),
        load_workload_classes(str(tmp_path / "m.yaml")),
    )
    assert mj == my and mj.names == ["early", "late", DEFAULT_CLASS]


def test_yaml_merge_keys_work_and_repeated_keys_are_refused(tmp_path):
    merged = tmp_path / "merged.yaml"
    merged.write_text(
        "classes:\n"
        "  - &chat {name: chat, match: {prompt_tokens: [0, 100]}, priority: 1}\n"
        "  - <<: *chat\n"
        "    name: chat2\n"
        "    match: {prompt_tokens: [100, null]}\n"
    )
    c = load_workload_classes(str(merged))
    assert c.names == ["chat", "chat2", DEFAULT_CLASS] and c.get("chat2").priority == 1
    # In the mapping form a repeated name would silently drop a class.
    for name, text in (
        ("dup.json", '{"classes": {"a": {"priority": 1}, "a": {"priority": 2}}}'),
        ("dup.yaml", "classes:\n  a: {priority: 1}\n  a: {priority: 2}\n"),
        ("dupkey.yaml", "classes:\n  - {name: a, priority: 1, priority: 2}\n"),
    ):
        (tmp_path / name).write_text(text)
        with pytest.raises(ConfigError, match=rf"^workload_classes: cannot read .*{name}: "
                           ".*duplicate key '(a|priority)'"):  # fmt: skip
            load_workload_classes(str(tmp_path / name))


def test_unreadable_files_are_named(tmp_path):
    with pytest.raises(ConfigError, match=r"^workload_classes: cannot read .*missing\.json: "):
        load_workload_classes(str(tmp_path / "missing.json"))
    for name, text in (("bad.yaml", "classes: [unclosed"), ("bad.json", '{"classes": [')):
        (tmp_path / name).write_text(text)
        with pytest.raises(ConfigError, match=rf"^workload_classes: cannot read .*{name}: "):
            load_workload_classes(str(tmp_path / name))
    with pytest.raises(ConfigError, match=r"^workload_classes: expected 'default' or a \.json"):
        load_workload_classes(str(tmp_path / "classes.txt"))
    (tmp_path / "empty.yaml").write_text("# nothing yet\n")
    with pytest.raises(ConfigError, match=r"^workload_classes: the file defines no class"):
        load_workload_classes(str(tmp_path / "empty.yaml"))


def test_mapping_form_orders_overlapping_entries():
    c = parse_workload_classes(mapped(
        wide={"order": 2, "match": {"prompt_tokens": [0, 1000]}},
        narrow={"order": 1, "match": {"prompt_tokens": [0, 100]}},
        disjoint={"match": {"prompt_tokens": [1000, None]}},
    ))  # fmt: skip
    assert c.names == ["narrow", "wide", "disjoint", DEFAULT_CLASS]
    assert c.classify(prompt_tokens=50).name == "narrow"
    assert c.classify(prompt_tokens=100).name == "wide"
    assert c.classify(prompt_tokens=999).name == "wide"
    assert c.classify(prompt_tokens=1000).name == "disjoint"
    assert c.get("wide").name == "wide" and c.source == "<data>"


@pytest.mark.parametrize(
    "a, b",
    [
        ({"prompt_tokens": [0, 100]}, {"prompt_tokens": [100, 200]}),  # half-open: 100 is b's
        ({"tenants": ["acme"]}, {"tenants": ["beta"]}),
        ({"users": ["u"], "prompt_tokens": [0, 10]}, {"users": ["v"], "prompt_tokens": [5, 20]}),
        ({"prefix_share": [0, 0.5]}, {"prefix_share": [0.6, 1]}),
    ],
)
def test_disjoint_mapping_entries_need_no_order(a, b):
    c = parse_workload_classes(mapped(a={"match": a}, b={"match": b}))
    assert c.names == ["a", "b", DEFAULT_CLASS]


def test_classify_first_match_default_and_explicit():
    c = parse_workload_classes(GOOD)
    assert c.classify("acme", None, 10, 0.0).name == "vip"  # before chat, which also matches
    assert c.classify("other", None, 10, 0.2).name == "chat"
    assert c.classify("other", None, 10, 0.5).name == "chat"  # closed share interval
    assert c.classify("other", None, 10, 0.9).name == DEFAULT_CLASS
    assert c.classify(prompt_tokens=2047).name == "chat"
    assert c.classify(prompt_tokens=2048).name == "docs"  # half-open token interval
    assert c.classify(None, "acme", 10).name == "chat"  # a user is not a tenant
    assert c.classify(prompt_tokens=10, explicit="docs").name == "docs"
    assert c.classify(explicit=DEFAULT_CLASS) is c.get(DEFAULT_CLASS)
    for bad in (lambda: c.classify("acme", explicit="nope"), lambda: c.get("nope")):
        with pytest.raises(UnknownClassError) as e:
            bad()
        assert str(e.value) == (
            "workload_class: unknown class 'nope'; allowed: vip, chat, docs, default"
        )
        assert isinstance(e.value, ValueError) and e.value.field == "workload_class"
    with pytest.raises(UnknownClassError):
        c.get(["not", "hashable"])  # a malformed request body
    assert c.needs_prefix_share
    assert not parse_workload_classes(entry(match={"prompt_tokens": [0, 5]})).needs_prefix_share


def test_a_file_may_define_default():
    c = parse_workload_classes([{"name": "chat", "match": {"prompt_tokens": [0, 10]}},
                                {"name": "default", "priority": 3}])  # fmt: skip
    assert c.names == ["chat", "default"] and c.classify(prompt_tokens=50).priority == 3
    # A "default" that does not match everything is still where unmatched requests go.
    c = parse_workload_classes([{"name": "default", "match": {"users": ["u"]}, "priority": 4},
                                {"name": "b", "match": {"prompt_tokens": [0, 10]}}])  # fmt: skip
    assert c.names == ["default", "b"]
    assert c.classify(user="v", prompt_tokens=50).name == "default"
    assert c.classify(user="v", prompt_tokens=5).name == "b"
    with pytest.raises(ConfigError, match=r"^workload_classes: a class name is used twice"):
        WorkloadClasses([WorkloadClass("a"), WorkloadClass("a")], "x")


def test_check_pool_names_the_entry():
    c = parse_workload_classes(GOOD)
    c.check_pool("auto")
    with pytest.raises(
        ConfigError,
        match=r"^workload_classes\[2\] \(docs\)\.kv\.kv_cache_dtype: "
        "the pool stores 'fp8_e4m3'; a class may only name the pool's format",
    ):
        c.check_pool("fp8_e4m3")  # fmt: skip
    m = parse_workload_classes(mapped(q={"kv": {"kv_cache_dtype": "int8"}}))
    with pytest.raises(ConfigError, match=r"^workload_classes\.q\.kv\.kv_cache_dtype: .*'auto'"):
        m.check_pool("auto")
    parse_workload_classes(entry(priority=1)).check_pool("anything")  # no class names one


@pytest.mark.parametrize(
    "tokens, share, name",
    [
        (300, 0.0, "chat"),
        (1000, 0.9, "agent"),
        (1000, 0.5, "agent"),
        (1000, 0.49, "chat"),
        (511, 1.0, "chat"),  # too short to be an agent turn
        (2048, 0.0, "rag"),
        (3000, 0.1, "rag"),
        (8191, 0.9, "agent"),
        (8192, 0.9, "long-document"),
        (9000, 0.0, "long-document"),
        (0, 0.0, "chat"),
    ],
)
def test_default_classes(tokens, share, name):
    d = load_workload_classes("default")
    assert d.classify(prompt_tokens=tokens, prefix_share=share).name == name


def test_default_class_values():
    d = load_workload_classes("default")
    assert d.source == "default" and d.needs_prefix_share
    assert d.names == ["agent", "long-document", "rag", "chat", DEFAULT_CLASS]
    got = {c.name: (c.priority, c.ttft_slo, c.tpot_slo, c.output_estimate) for c in d.classes}
    assert got == {
        "agent": (0, 1.0, 0.2, "learned"),
        "long-document": (1, 10.0, 0.3, "learned"),
        "rag": (0, 3.0, 0.2, "learned"),
        "chat": (0, 1.0, 0.2, "learned"),
        DEFAULT_CLASS: (0, None, None, "max_tokens"),
    }
    assert all(c.kv_retention is None and c.prefix_caching for c in d.classes)


def test_meets_slo():
    c = WorkloadClass("a", ttft_slo=1.0, tpot_slo=0.1)
    assert c.meets_slo(0.5, 0.05) and c.meets_slo(1.0, 0.1)  # at the SLO is within it
    assert not c.meets_slo(1.5, 0.05) and not c.meets_slo(0.5, 0.2)
    assert not c.meets_slo(None, 0.05) and not c.meets_slo(0.5, None)
    assert WorkloadClass("b").meets_slo(None, None)
    assert WorkloadClass("c", ttft_slo=1.0).meets_slo(0.5, None)  # TPOT not checked


def test_direct_construction_is_validated_too():
    assert ClassMatch(tenants=["a"], prompt_tokens=[1, 2]) == ClassMatch(
        frozenset("a"), None, (1, 2)
    )
    for kw, message in (
        ({"tenants": "acme"}, r"^tenants: must be a non-empty list of strings"),
        ({"prompt_tokens": (3, 3)}, r"^prompt_tokens: must be \[lo, hi\]"),
        ({"prefix_share": (0.5, 0.4)}, r"^prefix_share: must be \[lo, hi\]"),
    ):
        with pytest.raises(ConfigError, match=message):
            ClassMatch(**kw)
    for kw, message in (
        ({"name": ""}, r"^name: must be a non-empty string"),
        ({"match": {}}, r"^match: must be a ClassMatch"),
        ({"output_estimate": 0}, r"^output_estimate: must be max_tokens, learned"),
        ({"ttft_slo": 0.0}, r"^ttft_slo: must be a number of seconds > 0"),
        ({"kv_retention": "lru:8"}, r"^kv_retention: unknown policy 'lru'"),
        ({"prefix_caching": None}, r"^prefix_caching: must be true or false"),
    ):
        with pytest.raises(ConfigError, match=message) as e:
            WorkloadClass(**{"name": "x", **kw})
    assert str(pickle.loads(pickle.dumps(e.value))) == str(e.value)


def test_importing_needs_neither_yaml_nor_torch():
    code = ("import sys, kvserve.sched.workload_class_file as w; "
            "w.load_workload_classes('default'); "
            "print(sorted({'yaml', 'torch'} & set(sys.modules)))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# -- matching, overlap and shadowing against a brute-force reference ---------------------------
ALPHABET = ["x", "y"]
names = st.none() | st.sets(st.sampled_from(ALPHABET), min_size=1).map(frozenset)
SHARES = [0.0, 0.25, 0.5, 0.75, 1.0]


@st.composite
def matches(draw):
    lo = draw(st.integers(0, 20))
    hi = draw(st.none() | st.integers(lo + 1, 30))
    a, b = sorted(draw(st.lists(st.sampled_from(SHARES), min_size=2, max_size=2)))
    return ClassMatch(draw(names), draw(names), (lo, hi), (a, b))


def grid(*ms: ClassMatch):
    """Every request that can tell the matches apart: each name of the alphabet and none,
    lengths at each interval endpoint and beside it (past every finite one for an unbounded
    interval), shares at each endpoint. Every region the intervals cut out starts at an
    endpoint (or just past one), so a search over this grid is exact."""
    lengths, shares = {0, 99}, {0.0, 1.0}
    for m in ms:
        lo, hi = m.prompt_tokens
        lengths |= {lo - 1, lo, lo + 1} | ({hi - 1, hi, hi + 1} if hi is not None else set())
        shares |= set(m.prefix_share)
    lengths = {n for n in lengths if n >= 0}
    return list(
        itertools.product([None, *ALPHABET], [None, *ALPHABET], sorted(lengths), sorted(shares))
    )


def brute_overlaps(a, b, requests):
    return any(a.matches(*r) and b.matches(*r) for r in requests)


def brute_covers(a, b, requests):
    return all(a.matches(*r) for r in requests if b.matches(*r))


def as_dict(m: ClassMatch) -> dict:
    d: dict = {"prompt_tokens": list(m.prompt_tokens), "prefix_share": list(m.prefix_share)}
    if m.tenants is not None:
        d["tenants"] = sorted(m.tenants)
    if m.users is not None:
        d["users"] = sorted(m.users)
    return d


@settings(max_examples=300, deadline=None)
@given(a=matches(), b=matches())
def test_overlaps_and_covers_equal_brute_force(a, b):
    requests = grid(a, b)
    assert a.overlaps(b) == brute_overlaps(a, b, requests) == b.overlaps(a)
    assert a.covers(b) == brute_covers(a, b, requests)
    assert a.covers(a) and a.overlaps(a)


@settings(max_examples=100, deadline=None)
@given(ms=st.lists(matches(), min_size=1, max_size=4))
def test_list_form_classify_equals_a_plain_loop(ms):
    data = [{"name": f"c{i}", "match": as_dict(m)} for i, m in enumerate(ms)]
    requests = grid(*ms)
    shadowed = [j for j, b in enumerate(ms) if any(brute_covers(a, b, requests) for a in ms[:j])]
    if shadowed:
        j = shadowed[0]
        with pytest.raises(ConfigError, match=rf"^workload_classes\[{j}\] \(c{j}\): unreachable"):
            parse_workload_classes(data)
        return
    c = parse_workload_classes(data)
    for r in requests:
        want = next((f"c{i}" for i, m in enumerate(ms) if m.matches(*r)), DEFAULT_CLASS)
        assert c.classify(*r).name == want


@settings(max_examples=100, deadline=None)
@given(
    ms=st.lists(matches(), min_size=1, max_size=4),
    orders=st.lists(st.none() | st.integers(0, 3), min_size=4, max_size=4),
)
def test_mapping_form_classify_equals_lowest_order_match(ms, orders):
    def body(i):
        return {"match": as_dict(ms[i])} | ({} if orders[i] is None else {"order": orders[i]})

    data = {"classes": {f"c{i}": body(i) for i in range(len(ms))}}
    requests = grid(*ms)
    pairs = itertools.combinations(range(len(ms)), 2)
    clash = [(i, k) for i, k in pairs if brute_overlaps(ms[i], ms[k], requests)
             and (orders[i] is None or orders[k] is None or orders[i] == orders[k])]  # fmt: skip
    if clash:
        i, k = clash[0]
        with pytest.raises(
            ConfigError, match=rf"^workload_classes\.c{i} and workload_classes\.c{k}"
        ):
            parse_workload_classes(data)
        return
    # Now every pair that can both match has two distinct orders.
    shadowed = {k for i, k in itertools.permutations(range(len(ms)), 2)
                if brute_covers(ms[i], ms[k], requests) and orders[i] < orders[k]}  # fmt: skip
    if shadowed:
        with pytest.raises(ConfigError, match=r"^workload_classes\.c(\d): unreachable") as e:
            parse_workload_classes(data)
        assert int(e.value.args[0].split(":")[0].removeprefix("workload_classes.c")) in shadowed
        return
    c = parse_workload_classes(data)
    for r in requests:
        hits = [i for i, m in enumerate(ms) if m.matches(*r)]
        want = f"c{min(hits, key=lambda i: orders[i])}" if hits else DEFAULT_CLASS
        assert c.classify(*r).name == want
