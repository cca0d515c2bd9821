"""Bench statistics against hand-computed fixtures: percentiles, TPOT, throughput, goodput,
cost, failure counts and the /metrics deltas."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from kvserve.bench.client import parse_prometheus
from kvserve.bench.metrics import (
    RequestRecord,
    describe,
    meets_slo,
    parse_slo,
    percentile,
    server_summary,
    summarize,
)


def test_percentile_hand_values():
    xs = [4.0, 1.0, 3.0, 2.0]  # unsorted on purpose
    assert percentile(xs, 50) == 2.5  # rank 1.5 between 2 and 3
    assert percentile(xs, 90) == pytest.approx(3.7)  # rank 2.7: 3 + 0.7 x (4 - 3)
    assert percentile(xs, 99) == pytest.approx(3.97)
    assert percentile(xs, 0) == 1.0 and percentile(xs, 100) == 4.0
    assert percentile([7.0], 99) == 7.0
    with pytest.raises(ValueError):
        percentile([], 50)


def test_percentile_matches_numpy_default():
    rng = random.Random(3)
    for n in (2, 5, 17, 100):
        xs = [rng.expovariate(1.0) for _ in range(n)]
        for q in (50, 90, 95, 99):
            assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))


def test_describe_scales_to_ms_and_handles_empty():
    d = describe([0.1, 0.2, 0.3, 0.4])
    assert d["n"] == 4
    assert d["mean"] == pytest.approx(250.0)
    assert d["p50"] == pytest.approx(250.0)
    assert d["p90"] == pytest.approx(370.0)
    empty = describe([])
    assert empty["n"] == 0 and empty["mean"] is None and empty["p99"] is None


@pytest.mark.parametrize("n", [1001, 150_001])  # the second is sorted by numpy, not sorted()
def test_describe_matches_numpy(n):
    rng = random.Random(5)
    xs = [rng.expovariate(1.0) for _ in range(n)]
    d = describe(xs, scale=1.0)
    for q in (50, 90, 95, 99):
        assert d[f"p{q}"] == pytest.approx(float(np.percentile(xs, q)), rel=1e-12)
        assert type(d[f"p{q}"]) is float  # JSON-ready, not a numpy scalar
    assert d["mean"] == pytest.approx(float(np.mean(xs)))


def _rec(i, ttft, e2e, out, itl=(), ok=True, prompt=100, reason=None, detail=None):
    r = RequestRecord(i, "chat", None, prompt, out)
    r.success, r.ttft, r.e2e, r.output_tokens, r.prompt_tokens = ok, ttft, e2e, out, prompt
    r.itl = list(itl)
    if not ok:
        r.fail(reason, detail)
    return r


@pytest.fixture
def records():
    return [
        _rec(0, 0.1, 1.0, 10, itl=[0.1] * 9),  # TPOT (1.0 - 0.1) / 9 = 0.1
        _rec(1, 0.2, 0.6, 5, itl=[0.1] * 4),  # TPOT 0.4 / 4 = 0.1
        _rec(2, 0.5, 4.5, 21, itl=[0.2] * 20),  # TPOT 4.0 / 20 = 0.2
        _rec(3, None, None, 0, ok=False, reason="HTTP 500", detail="boom"),
        _rec(4, 0.05, 0.05, 1),  # one token: no TPOT, no ITL
        _rec(5, None, None, 0, ok=False, reason="HTTP 500", detail="boom again"),
        _rec(6, None, None, 0, ok=False, reason="timeout (server stalled)"),
    ]


def test_tpot_per_request(records):
    assert records[0].tpot == pytest.approx(0.1)
    assert records[1].tpot == pytest.approx(0.1)
    assert records[2].tpot == pytest.approx(0.2)
    assert records[3].tpot is None and records[4].tpot is None


def test_summary_hand_computed(records):
    s = summarize(records, duration=5.0, slo=parse_slo("ttft=300ms,tpot=150ms"),
                  gpu_hour_cost=3.6, gpus=2)  # fmt: skip
    assert (s["num_requests"], s["completed"], s["failed"]) == (7, 4, 3)
    assert s["failures"] == {"HTTP 500": 2, "timeout (server stalled)": 1}
    assert s["failure_examples"]["HTTP 500"] == "boom"
    assert s["request_throughput"] == pytest.approx(4 / 5)
    assert s["total_output_tokens"] == 10 + 5 + 21 + 1
    assert s["output_throughput"] == pytest.approx(37 / 5)
    assert s["total_token_throughput"] == pytest.approx((400 + 37) / 5)
    # TTFTs 100, 200, 500, 50 ms -> sorted 50, 100, 200, 500
    t = s["ttft_ms"]
    assert t["mean"] == pytest.approx(212.5)
    assert t["p50"] == pytest.approx(150.0)
    assert t["p90"] == pytest.approx(410.0)  # rank 2.7: 200 + 0.7 x 300
    assert t["p99"] == pytest.approx(491.0)
    # TPOTs 100, 100, 200 ms
    assert s["tpot_ms"]["n"] == 3
    assert s["tpot_ms"]["mean"] == pytest.approx(400 / 3)
    assert s["tpot_ms"]["p50"] == pytest.approx(100.0)
    # ITL pools 33 gaps: 13 of 100 ms and 20 of 200 ms
    assert s["itl_ms"]["n"] == 33
    assert s["itl_ms"]["mean"] == pytest.approx((13 * 100 + 20 * 200) / 33)
    assert s["itl_ms"]["p50"] == pytest.approx(200.0)
    assert s["e2e_ms"]["p50"] == pytest.approx(800.0)  # 50, 600, 1000, 4500
    # Goodput: 0 (ttft 100, tpot 100), 1 (200, 100) and 4 (50, none) meet both; 2 misses TTFT.
    g = s["goodput"]
    assert g["good_requests"] == 3
    assert g["request_goodput"] == pytest.approx(3 / 5)
    assert g["attainment"] == pytest.approx(3 / 7)
    # $3.6/h x 2 GPUs = $0.002/s; at 7.4 output tok/s that is $270.27 per million.
    assert s["cost"]["usd_per_million_output_tokens"] == pytest.approx(0.002 / 7.4 * 1e6)
    assert s["cost"]["usd_per_million_total_tokens"] == pytest.approx(0.002 / 87.4 * 1e6)


def test_goodput_absent_without_slo(records):
    s = summarize(records, duration=5.0)
    assert s["goodput"]["request_goodput"] is None
    assert s["cost"]["usd_per_million_output_tokens"] is None


def test_e2e_slo_and_failed_requests_never_meet_it(records):
    slo = parse_slo("e2e=1s")
    assert [meets_slo(r, slo) for r in records] == [True, True, False, False, True, False, False]


def test_parse_slo_units_and_errors():
    assert parse_slo("ttft=500ms,tpot=50,e2e=2.5s") == {
        "ttft": pytest.approx(0.5), "tpot": pytest.approx(0.05), "e2e": 2.5
    }  # fmt: skip
    assert parse_slo(None) == {}
    with pytest.raises(ValueError, match="slo"):
        parse_slo("latency=5")
    with pytest.raises(ValueError, match="slo"):
        parse_slo("ttft=fast")


def test_server_summary_deltas_and_gauges():
    before = {"prefix_cache_queries_total": 100, "prefix_cache_hits_total": 40,
              "num_preemptions_total": 2, "kv_cache_usage_perc": 0.0,
              "prefix_cache_evictions_total": 5}  # fmt: skip
    after = {"prefix_cache_queries_total": 300, "prefix_cache_hits_total": 190,
             "num_preemptions_total": 5, "kv_cache_usage_perc": 0.1,
             "prefix_cache_evictions_total": 5}  # fmt: skip
    samples = [{"kv_cache_usage_perc": 0.2}, {"kv_cache_usage_perc": 0.6}, {"other": 1.0}]
    s = server_summary(before, after, samples)
    assert s["available"]
    assert s["prefix_cache_queries"] == 200 and s["prefix_cache_hits"] == 150
    assert s["prefix_cache_hit_rate"] == pytest.approx(0.75)
    assert s["num_preemptions"] == 3 and s["prefix_cache_evictions"] == 0
    assert s["kv_cache_usage"] == {"before": 0.0, "after": 0.1, "mean": 0.4, "max": 0.6}
    assert s["kv_cache_token_occupancy"]["mean"] is None  # not exported: None, not 0
    none = server_summary(None, None, [])
    assert not none["available"] and none["prefix_cache_hit_rate"] is None


def test_parse_prometheus_prefixes_labels_and_aliases():
    text = "\n".join([
        "# HELP kvserve:num_requests_running Sequences running.",
        "# TYPE kvserve:num_requests_running gauge",
        'kvserve:num_requests_running{model_name="a"} 3',
        'kvserve:num_requests_running{model_name="b"} 2',
        "kvserve:prefix_cache_hits_total 1.5e3",
        'vllm:gpu_cache_usage_perc{model_name="m"} 0.25',
        'vllm:time_to_first_token_seconds_bucket{le="0.1"} 7',
        "vllm:time_to_first_token_seconds_count 9",
        "garbage line without value",
    ])  # fmt: skip
    m = parse_prometheus(text)
    assert m["num_requests_running"] == 5
    assert m["prefix_cache_hits_total"] == 1500
    assert m["kv_cache_usage_perc"] == 0.25
    assert m["time_to_first_token_seconds_count"] == 9
    assert not any(k.endswith("_bucket") for k in m)


def test_record_to_dict_is_asdict_plus_tpot():
    from dataclasses import asdict

    from kvserve.bench.metrics import RequestRecord

    r = RequestRecord(3, "chat", "chat/0", 10, 4, send_time=0.5, prompt_tokens=10)
    r.output_tokens, r.output_token_ids = 3, [5, 6, 7]
    r.succeed([1.0, 1.25, 1.75])
    d = r.to_dict()
    assert d == {**asdict(r), "tpot": 0.375}
    d["itl"].append(9.0)
    assert r.itl == [0.25, 0.5]  # a copy, as asdict gives


def test_json_report_parses_back_with_one_line_per_record(tmp_path):
    from kvserve.bench.report import write_json

    recs = [_rec(i, 0.01 * i, 0.5, 3, itl=(0.1, 0.25)).to_dict() for i in range(3)]
    payload = {"summary": {"ttft_ms": {"p50": 1.5, "n": 3}, "note": "a\nb"}, "records": recs}
    text = write_json(tmp_path / "r.json", payload).read_text()
    assert json.loads(text) == payload  # the stdlib parser is the reference
    rows = [ln for ln in text.splitlines() if '"index"' in ln]
    assert len(rows) == 3 and all(ln.count('"itl"') == 1 for ln in rows)
    sweep = {"summary": [], "records": [recs[:2], [], recs[2:]]}
    assert json.loads(write_json(tmp_path / "s.json", sweep).read_text()) == sweep


def test_json_report_encoded_in_forked_parts_parses_back_the_same(tmp_path, monkeypatch):
    """A long run's records are encoded in forked processes, one file each, copied in order:
    the file must parse back to the records (the stdlib parser is the reference), in order,
    one line each, and leave no part files behind."""
    import kvserve.bench.report as report

    monkeypatch.setattr(report, "PARALLEL_MIN_ROWS", 4)
    recs = [_rec(i, 0.01 * i, 0.5, 3, itl=(0.1 * i, 0.25)).to_dict() for i in range(13)]
    payload = {"summary": {"n": 13}, "records": recs, "after": [1, 2]}
    text = report.write_json(tmp_path / "r.json", payload, jobs=3).read_text()
    assert json.loads(text) == payload
    rows = [ln for ln in text.splitlines() if '"index"' in ln]
    assert [json.loads(ln.strip().rstrip(","))["index"] for ln in rows] == list(range(13))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]


def test_latency_cdf_is_thinned_to_exact_points_of_the_full_cdf():
    from bisect import bisect_right

    from kvserve.bench.report import _cdf_points

    rng = random.Random(9)
    xs = sorted(rng.random() for _ in range(50_001))
    px, py = _cdf_points(xs, most=500)
    assert len(px) <= 500 and px[0] == xs[0] and px[-1] == xs[-1] and py[-1] == 1.0
    for x, y in zip(px, py, strict=True):  # each kept point is on the full empirical CDF
        assert y == bisect_right(xs, x) / len(xs)
    small = [1.0, 2.0, 3.0]
    assert _cdf_points(small) == (small, [1 / 3, 2 / 3, 1.0])


def test_records_encoded_while_made_write_the_same_file(tmp_path):
    """Records handed to the forked encoder out of order, each with the shift the run
    subtracts from its send time at the end, make the file write_json makes from the
    shifted records (the stdlib parser reads it back too); none and the encoder's own
    file cleaned up on close."""
    from copy import deepcopy

    from kvserve.bench.report import EncodedRecords, RecordEncoder, write_json

    recs = [_rec(i, 0.01 * i, 0.5, 3, itl=(0.1 * i, 0.25)) for i in range(600)]
    for i, r in enumerate(recs):
        r.send_time = 10.0 + i / 7  # the run's clock
    shifted = deepcopy(recs)
    for r in shifted:
        r.send_time -= 10.0
    ref = {"summary": {"n": 600}, "records": [r.to_dict() for r in shifted], "after": [1]}
    with RecordEncoder(tmp_path / "out") as enc:
        for i in [*range(1, 600, 2), *range(0, 600, 2)]:
            enc.add(i, recs[i], 10.0)
        rows = enc.finish()
        assert isinstance(rows, EncodedRecords) and rows.count == 600
        got = write_json(tmp_path / "got.json", {**ref, "records": rows})
        assert got.read_text() == write_json(tmp_path / "ref.json", ref).read_text()
        assert json.loads(got.read_text()) == ref
    assert list((tmp_path / "out").iterdir()) == []
    with RecordEncoder(tmp_path / "out") as enc:  # a gap at index 0: the rest in order
        for i in (3, 1, 2):
            enc.add(i, recs[i], 10.0)
        some = json.loads(write_json(tmp_path / "g.json", {"records": enc.finish()}).read_text())
        assert some == {"records": ref["records"][1:4]}
    with RecordEncoder(tmp_path / "out") as enc:
        empty = {"records": enc.finish()}
        assert json.loads(write_json(tmp_path / "e.json", empty).read_text()) == {"records": []}


def test_a_record_encoder_that_dies_is_reported(tmp_path):
    from kvserve.bench.report import RecordEncoder

    with RecordEncoder(tmp_path) as enc:
        enc._proc.kill()
        enc._proc.join()
        with pytest.raises(RuntimeError, match="record encoder: its process ended early"):
            for i in range(3 * RecordEncoder.BATCH):
                enc.add(i, _rec(i, 0.0, 0.5, 3))
            enc.finish()
