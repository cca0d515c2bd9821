"""`make run`'s main job: the agreement figure by hand, the configurations it picks, and a
small end-to-end run that writes the report."""

from __future__ import annotations

import json

import pytest

import kvserve.engine_args
from kvserve import main_job
from kvserve.plan.capacity import format_table, load_arch


def test_agreement_hand_computed():
    base = [[1, 2, 3, 4], [5, 6], [7, 8, 9], None]
    other = [[1, 2, 9, 4], [5, 6], None, [1]]
    a = main_job.sequence_agreement(base, other)
    # Requests 2 and 3 failed on one side and are skipped; request 0 matches 2 of 4 tokens
    # before diverging (the later match does not count), request 1 matches fully.
    assert a == {"sequence_agreement": pytest.approx((2 / 4 + 1) / 2), "identical_outputs": 0.5,
                 "compared": 2}  # fmt: skip
    assert main_job.sequence_agreement([None], [[1]]) == {
        "sequence_agreement": None, "identical_outputs": None, "compared": 0
    }  # fmt: skip


def test_configs_are_baseline_lossless_and_every_smaller_implemented_format(checkpoint):
    ckpt = checkpoint("llama_gqa")  # a float32 checkpoint
    names = [n for n, _ in main_job.configs(ckpt)]
    assert names[:2] == ["baseline", "prefix-caching"]
    ok, _ = format_table(load_arch(ckpt))
    expected = [f"kv-{f}" for f in main_job.LOSSY if f in ok and ok[f] < ok["float32"]]
    assert names[2:] == expected
    assert dict(main_job.configs(ckpt))["baseline"] == {"enable_prefix_caching": False}


def test_main_job_end_to_end_small(checkpoint, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(kvserve.engine_args, "default_model", lambda: checkpoint("llama_gqa"))
    monkeypatch.setattr(main_job, "REPORT_DIR", tmp_path)
    monkeypatch.setattr(main_job, "LOSSY", ())  # the lossless pair is what is checked here
    monkeypatch.setattr(main_job, "CONCURRENCY", 2)
    monkeypatch.setattr(
        main_job, "WORKLOAD", dict(name="rag", num_prompts=6, seed=0, length_scale=0.15,
                                   num_prefixes=1)
    )  # fmt: skip
    assert main_job.main() == 0
    out = capsys.readouterr().out
    assert "prefix caching vs baseline outputs: identical" in out
    assert "ok/sent" in out and "(1.00x)" not in out.split("prefix-caching")[0]
    report = json.loads((tmp_path / "report.json").read_text())
    assert set(report["summaries"]) == {"baseline", "prefix-caching"}
    pc = report["summaries"]["prefix-caching"]
    assert pc["quality"]["identical_outputs"] == 1.0 and pc["quality"]["compared"] == 6
    assert pc["server"]["prefix_cache_hits"] > 0
    assert not report["summaries"]["baseline"]["server"]["prefix_cache_hits"]
    assert "| seq agreement |" in (tmp_path / "report.md").read_text()
