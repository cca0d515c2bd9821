"""kvserve bench against the in-process engine, and the command line end to end."""

from __future__ import annotations

import asyncio
import json

import pytest

from kvserve.bench.engine_target import EngineTarget
from kvserve.bench.runner import LoadSpec, benchmark
from kvserve.bench.workloads import BenchRequest, WorkloadSpec, make_workload
from kvserve.cli import main

MAX_LEN = 1024


def counter(llm):
    tok = llm.engine.tokenizer
    return lambda s: len(tok.encode(s))


def run(llm, reqs, load=None, slo=None, cost=None):
    target = EngineTarget(llm.engine, request_timeout=60)
    return asyncio.run(
        benchmark(target, [reqs], [load or LoadSpec()], slo=slo, gpu_hour_cost=cost,
                  progress=False)
    )[0]  # fmt: skip


def test_mixed_workload_in_process_yields_every_metric(checkpoint, make_llm):
    llm = make_llm(checkpoint("llama_gqa"), max_model_len=MAX_LEN, num_gpu_blocks=512)
    spec = WorkloadSpec("mixed", num_prompts=16, seed=0, length_scale=0.1, max_model_len=MAX_LEN)
    reqs = make_workload(spec, counter(llm))
    point = run(llm, reqs, LoadSpec(request_rate=200.0), slo={"ttft": 30.0, "tpot": 5.0}, cost=2.0)
    s = point.summary
    assert s["completed"] == 16 and s["failed"] == 0 and s["failures"] == {}
    assert s["total_output_tokens"] == sum(r.max_tokens for r in reqs)  # ignore_eos: exact
    assert s["total_input_tokens"] == sum(r.input_len for r in reqs)  # the counter is exact
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        for q in ("mean", "p50", "p90", "p95", "p99"):
            assert s[key][q] is not None and s[key][q] >= 0, (key, q)
    assert s["ttft_ms"]["p50"] <= s["ttft_ms"]["p99"] <= s["e2e_ms"]["p99"]
    for key in ("request_throughput", "output_throughput", "total_token_throughput"):
        assert s[key] > 0
    assert s["goodput"]["request_goodput"] > 0
    assert s["cost"]["usd_per_million_output_tokens"] > s["cost"]["usd_per_million_total_tokens"]
    srv = s["server"]
    assert srv["available"] and srv["num_samples"] > 0
    assert 0 < srv["kv_cache_usage"]["max"] <= 1
    assert 0 < srv["kv_cache_token_occupancy"]["mean"] <= 1
    assert srv["num_preemptions"] == 0 and srv["prefix_cache_evictions"] is not None
    assert srv["prefix_cache_queries"] > 0 and srv["prefix_cache_hit_rate"] is not None
    assert set(s["by_kind"]) == {r.kind for r in reqs}
    for r in point.records:
        assert len(r.itl) == r.output_tokens - 1
        assert r.e2e == pytest.approx(r.ttft + sum(r.itl))


def test_prefix_caching_is_lossless_and_hits(checkpoint, make_llm):
    ckpt = checkpoint("llama_gqa")
    outs = {}
    for on in (True, False):
        llm = make_llm(ckpt, max_model_len=MAX_LEN, enable_prefix_caching=on, num_gpu_blocks=256)
        reqs = make_workload(
            WorkloadSpec("rag", num_prompts=8, seed=1, length_scale=0.25, max_model_len=MAX_LEN),
            counter(llm),
        )
        point = run(llm, reqs, LoadSpec(concurrency=2))
        outs[on] = [r.output_token_ids for r in sorted(point.records, key=lambda r: r.index)]
        hits = point.summary["server"]["prefix_cache_hits"]
        assert (hits > 0) if on else not hits
        if on:
            assert point.summary["cached_prompt_tokens"] == hits
    assert outs[True] == outs[False]


def test_closed_loop_caps_concurrency_and_preemptions_are_counted(checkpoint, make_llm):
    llm = make_llm(checkpoint("llama_gqa"), max_model_len=MAX_LEN, num_gpu_blocks=24)
    reqs = make_workload(
        WorkloadSpec("decode-heavy", num_prompts=6, seed=0, length_scale=0.25), counter(llm)
    )
    closed = run(llm, reqs, LoadSpec(concurrency=2)).summary
    assert closed["completed"] == 6
    assert closed["server"]["num_requests_running"]["max"] <= 2
    burst = run(llm, reqs, LoadSpec()).summary  # all at once into 24 blocks: must preempt
    assert burst["completed"] == 6
    assert burst["server"]["num_preemptions"] > 0
    assert burst["server"]["kv_cache_usage"]["max"] > 0.5


def test_refused_request_is_a_counted_failure(checkpoint, make_llm):
    llm = make_llm(checkpoint("llama_gqa"), max_model_len=64)
    reqs = [BenchRequest(0, "chat", "x" * 200, 8, 200), BenchRequest(1, "chat", "hi", 4, 3)]
    s = run(llm, reqs).summary
    assert s["completed"] == 1
    assert s["failures"] == {"refused (InvalidRequestError)": 1}
    assert "max_model_len" in s["failure_examples"]["refused (InvalidRequestError)"]


def _last_json(capsys):
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_cli_outputs_and_compare(checkpoint, tmp_path, capsys):
    ckpt = checkpoint("llama_gqa")
    common = ["bench", "--model", ckpt, "--workload", "chat", "--num-prompts", "6",
              "--length-scale", "0.1", "--max-model-len", "512", "--output-dir", str(tmp_path),
              "--slo", "ttft=30s", "--gpu-hour-cost", "1.5", "--warmup", "1", "--no-progress",
              "--json", "--concurrency", "2"]  # fmt: skip
    assert main([*common, "--label", "on"]) == 0
    on = _last_json(capsys)
    assert on["completed"] == 6 and on["label"] == "on" and on["workload"] == "chat"
    assert main([*common, "--label", "off", "--no-enable-prefix-caching"]) == 0
    off = _last_json(capsys)
    assert "prefix caching off" in off["target"]
    saved = json.loads((tmp_path / "on.json").read_text())
    assert saved["summary"]["completed"] == 6 and len(saved["records"]) == 6
    assert {"ttft", "tpot", "itl", "e2e", "reason"} <= set(saved["records"][0])
    md = (tmp_path / "on.md").read_text()
    assert "| TTFT |" in md and "on-latency.png" in md
    assert (tmp_path / "on-latency.png").stat().st_size > 1000
    assert main(["bench", "compare", str(tmp_path / "on.json"), str(tmp_path / "off.json")]) == 0
    table = capsys.readouterr().out
    assert "off / on" in table and "requests/s" in table and "x" in table


def test_cli_sweep(checkpoint, tmp_path, capsys):
    rc = main(["bench", "--model", checkpoint("llama_gqa"), "--workload", "decode-heavy",
               "--num-prompts", "4", "--length-scale", "0.05", "--output-dir", str(tmp_path),
               "--label", "sw", "--sweep", "concurrency=1,4", "--no-progress", "--warmup", "0",
               "--json"])  # fmt: skip
    assert rc == 0
    out = _last_json(capsys)
    assert [p["sweep_value"] for p in out["sweep"]] == [1, 4]
    assert (tmp_path / "sw-sweep.png").exists()
    saved = json.loads((tmp_path / "sw.json").read_text())
    assert len(saved["records"]) == 2 and saved["sweep_by"] == "concurrency"


def test_cli_without_matplotlib_skips_plots_clearly(checkpoint, tmp_path, capsys, monkeypatch):
    import kvserve.bench.report as report

    monkeypatch.setattr(report, "_pyplot", lambda: None)
    rc = main(["bench", "--model", checkpoint("llama_gqa"), "--workload", "chat",
               "--num-prompts", "2", "--length-scale", "0.05", "--output-dir", str(tmp_path),
               "--label", "np", "--no-progress", "--warmup", "0"])  # fmt: skip
    assert rc == 0
    err = capsys.readouterr().err
    assert "plots skipped: matplotlib is not installed" in err
    assert (tmp_path / "np.json").exists() and not list(tmp_path.glob("*.png"))


def test_scrape_after_the_run_sees_the_engine_idle(checkpoint, make_llm):
    llm = make_llm(checkpoint("llama_gqa"), max_model_len=MAX_LEN)
    reqs = [BenchRequest(i, "chat", f"question {i}", 3, 4) for i in range(3)]
    s = run(llm, reqs, LoadSpec(concurrency=1)).summary["server"]
    assert s["num_requests_running"]["after"] == 0
    assert s["kv_cache_usage"]["after"] == 0
    assert s["prefix_cache_queries"] == sum(
        len(llm.engine.tokenizer.encode(r.prompt)) for r in reqs
    )
