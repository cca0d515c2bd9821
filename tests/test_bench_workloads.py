"""Workloads: same seed, same prompts and arrivals; the shapes each named workload promises."""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import replace

import pytest

from kvserve.bench.workloads import (
    KINDS,
    WORKLOADS,
    WorkloadSpec,
    arrival_times,
    iter_workload,
    make_workload,
)


def byte_count(text: str) -> int:
    """A byte-level tokenizer (like the test checkpoints'): one token per UTF-8 byte."""
    return len(text.encode())


@pytest.mark.parametrize("name", WORKLOADS)
def test_same_seed_same_prompts(name):
    spec = WorkloadSpec(name, num_prompts=12, seed=5, length_scale=0.2)
    a, b = make_workload(spec, byte_count), make_workload(spec, byte_count)
    assert a == b
    assert [r.index for r in a] == list(range(12))
    c = make_workload(WorkloadSpec(name, num_prompts=12, seed=6, length_scale=0.2), byte_count)
    assert [r.prompt for r in a] != [r.prompt for r in c]


def test_same_seed_same_arrivals_and_rate():
    a = arrival_times(2000, request_rate=4.0, seed=1)
    assert a == arrival_times(2000, request_rate=4.0, seed=1)
    assert a != arrival_times(2000, request_rate=4.0, seed=2)
    assert a[0] == 0.0 and all(x < y for x, y in zip(a, a[1:], strict=False))
    gaps = [y - x for x, y in zip(a, a[1:], strict=False)]
    assert statistics.fmean(gaps) == pytest.approx(0.25, rel=0.06)
    cv = statistics.pstdev(gaps) / statistics.fmean(gaps)
    assert cv == pytest.approx(1.0, abs=0.1)  # exponential gaps: Poisson arrivals
    bursty = arrival_times(2000, request_rate=4.0, burstiness=0.25, seed=1)
    bgaps = [y - x for x, y in zip(bursty, bursty[1:], strict=False)]
    assert statistics.fmean(bgaps) == pytest.approx(0.25, rel=0.15)  # same mean rate
    bcv = statistics.pstdev(bgaps) / statistics.fmean(bgaps)
    assert bcv == pytest.approx(2.0, rel=0.2)  # gamma shape k: CV = 1 / sqrt(k)
    assert arrival_times(3, math.inf) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="burstiness"):
        arrival_times(3, 1.0, burstiness=0)


def test_lengths_follow_the_token_counter():
    reqs = make_workload(
        WorkloadSpec("prefill-heavy", num_prompts=20, seed=0, input_len=400, output_len=8,
                     range_ratio=0.0),
        byte_count,
    )  # fmt: skip
    for r in reqs:
        assert r.input_len == byte_count(r.prompt)
        assert abs(r.input_len - 400) <= 0.05 * 400
        assert r.max_tokens == 8
    scaled = make_workload(
        WorkloadSpec("decode-heavy", num_prompts=50, seed=0, length_scale=0.5), byte_count
    )
    mean_out = statistics.fmean(r.max_tokens for r in scaled)
    assert mean_out == pytest.approx(KINDS["decode-heavy"]["output_len"] * 0.5, rel=0.1)


def test_rag_shares_documents():
    reqs = make_workload(
        WorkloadSpec("rag", num_prompts=40, seed=0, num_prefixes=3, prefix_share=1.0), byte_count
    )
    groups = {r.prefix_group for r in reqs}
    assert groups <= {"rag/0", "rag/1", "rag/2"} and len(groups) == 3
    for g in groups:
        members = [r for r in reqs if r.prefix_group == g]
        doc = members[0].prompt[: members[0].prefix_len]
        assert all(m.prompt.startswith(doc) for m in members)
        assert members[0].prefix_len >= 300
    unique = make_workload(WorkloadSpec("rag", num_prompts=20, prefix_share=0.0), byte_count)
    assert all(r.prefix_group is None for r in unique)
    assert len({r.prompt[:100] for r in unique}) == 20


def test_multi_turn_resends_history():
    reqs = make_workload(WorkloadSpec("multi-turn", num_prompts=8, seed=0, turns=4), byte_count)
    for conv in (reqs[:4], reqs[4:]):
        for prev, nxt in zip(conv, conv[1:], strict=False):
            assert nxt.prompt.startswith(prev.prompt)
            assert nxt.input_len > prev.input_len
    assert reqs[1].prefix_group == "multi-turn/0" and reqs[5].prefix_group == "multi-turn/1"


def test_active_conversations_take_turns_together():
    """Five 3-turn conversations, three active at a time: the first three send turn t before
    any sends t + 1, then the last two; the texts are those of one-at-a-time."""
    spec = WorkloadSpec("multi-turn", num_prompts=14, seed=2, turns=3, length_scale=0.3)
    alone = make_workload(spec, byte_count)
    convs = [alone[i : i + 3] for i in range(0, 14, 3)]  # the last one has 2 turns
    together = make_workload(replace(spec, max_active_conversations=3), byte_count)
    expected = [convs[c][t].prompt for t in range(3) for c in range(3)]
    expected += [convs[c][t].prompt for t in range(3) for c in (3, 4) if t < len(convs[c])]
    assert [r.prompt for r in together] == expected
    assert [r.index for r in together] == list(range(14))
    # Each history is still resent, and a later turn still extends its own conversation.
    by_prompt = {r.prompt: r for r in together}
    for conv in convs:
        for prev, nxt in zip(conv, conv[1:], strict=False):
            assert by_prompt[nxt.prompt].prefix_group == f"multi-turn/{convs.index(conv)}"
            assert nxt.prompt.startswith(prev.prompt)
    with pytest.raises(ValueError, match="max_active_conversations: must be >= 1, got 0"):
        make_workload(replace(spec, max_active_conversations=0), byte_count)


def test_mixed_has_every_kind_and_keeps_turn_order():
    reqs = make_workload(WorkloadSpec("mixed", num_prompts=60, seed=0), byte_count)
    assert len(reqs) == 60
    assert {r.kind for r in reqs} == set(KINDS)
    turns = [r for r in reqs if r.kind == "multi-turn"]
    # Within a conversation, later turns (which resend the earlier ones) come later.
    first_conv = [r for r in turns if r.prompt.startswith(turns[0].prompt)]
    assert len(first_conv) > 1
    assert [r.index for r in first_conv] == sorted(r.index for r in first_conv)


def test_max_model_len_caps_outputs_not_prompts():
    reqs = make_workload(
        WorkloadSpec("decode-heavy", num_prompts=10, seed=0, max_model_len=100), byte_count
    )
    assert all(r.input_len + r.max_tokens <= 99 for r in reqs)
    with pytest.raises(ValueError, match="max_model_len"):
        make_workload(WorkloadSpec("long-doc", num_prompts=2, max_model_len=100), byte_count)


def test_jsonl_prompts_and_lengths(tmp_path):
    path = tmp_path / "trace.jsonl"
    rows = [{"prompt": "hello there", "max_tokens": 5},
            {"input_len": 50, "output_len": 7, "prefix_group": "g"}]  # fmt: skip
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    reqs = make_workload(WorkloadSpec(str(path), num_prompts=5, seed=0), byte_count)
    assert [r.max_tokens for r in reqs] == [5, 7, 5, 7, 5]  # the trace cycles
    assert reqs[0].prompt == "hello there" and reqs[1].prefix_group == "g"
    assert abs(reqs[1].input_len - 50) <= 3
    path.write_text('{"prompt": "x"}\n{not json}\n')
    with pytest.raises(ValueError, match=r"trace.jsonl:2"):
        make_workload(WorkloadSpec(str(path), num_prompts=2), byte_count)


def test_unknown_workload_names_the_choices():
    with pytest.raises(ValueError, match="workload: unknown 'nope'"):
        make_workload(WorkloadSpec("nope", num_prompts=1))


def test_filler_words_are_the_seeded_choice_and_period_draws():
    """TextMaker.words draws exactly ``rng.choice`` then ``rng.random`` per word (a seed's
    text must not change with how fast it is made): against the plain loop."""
    import random

    from kvserve.bench.workloads import _WORDS, TextMaker

    def plain(rng: random.Random, n: int) -> str:
        out: list[str] = []
        for i in range(max(1, n)):
            w = rng.choice(_WORDS)
            out.append(w.capitalize() if i == 0 or out[-1].endswith(".") else w)
            if rng.random() < 0.08:
                out[-1] += "."
        return " ".join(out)

    tm = TextMaker()
    for seed, n in [(0, 1), (1, 0), (2, 37), (3, 1000), (4, 5000)]:
        a, b = random.Random(seed), random.Random(seed)
        assert tm.words(a, n) == plain(b, n)
        assert a.random() == b.random()  # the generators end in the same state

    class OwnRandom(random.Random):  # choice() then draws indices through random()
        def random(self) -> float:
            return super().random()

    a, b = OwnRandom(5), OwnRandom(5)
    assert type(a)._randbelow is not random.Random._randbelow
    assert tm.words(a, 300) == plain(b, 300)


@pytest.mark.parametrize(
    "count",
    [
        lambda t: len(t.split()) + 3 * t.count("."),  # the probe (no periods) undercounts
        lambda t: max(1, len(t.split()) - t.count(".")),  # ... overcounts
        None,  # the default estimate
    ],
)
def test_text_is_words_of_the_corrected_count_from_the_same_state(count):
    """TextMaker.text keeps its first pass's words when it corrects the length: the result
    and the generator's state must be those of the plain procedure (words of the estimate,
    count, rewind, words of the corrected count), whichever way the correction goes."""
    import random

    from kvserve.bench.workloads import TextMaker

    tm = TextMaker(count)

    def plain(rng: random.Random, n_tokens: int) -> str:
        n = max(1, round(n_tokens / tm.tokens_per_word))
        state = rng.getstate()
        text = tm.words(rng, n)
        err = n_tokens - tm.count(text)
        if abs(err) > max(2, 0.03 * n_tokens):
            rng.setstate(state)
            text = tm.words(rng, max(1, n + round(err / tm.tokens_per_word)))
        return text

    for seed, n_tokens in [(0, 1), (1, 5), (2, 40), (3, 160), (4, 1536), (5, 3000)]:
        a, b = random.Random(seed), random.Random(seed)
        assert tm.text(a, n_tokens) == plain(b, n_tokens)
        assert a.random() == b.random()


@pytest.mark.parametrize("name", ["chat", "multi-turn", "mixed"])
def test_iter_workload_makes_each_request_when_taken(name):
    """The lazy generator yields make_workload's requests, and its first request costs a
    few token counts, not the whole trace's."""
    calls = 0

    def counting(text: str) -> int:
        nonlocal calls
        calls += 1
        return byte_count(text)

    spec = WorkloadSpec(name, num_prompts=2000, seed=9, length_scale=0.2)
    it = iter_workload(spec, counting)
    first = next(it)
    assert calls < 40
    assert [first, *it] == make_workload(spec, byte_count)
