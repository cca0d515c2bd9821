"""``kvserve tune``: it finds what a workload needs (prefix caching for RAG, a compressed KV
format for a memory-bound long context only when the quality gate passed it), and every bad
input gets a message that says what is wrong."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from kvserve.bench.runner import LoadSpec
from kvserve.bench.workloads import WorkloadSpec, make_workload
from kvserve.cli import main
from kvserve.engine_args import default_model
from kvserve.plan.gpus import get_gpu
from kvserve.sim.cost import gpu_profile
from kvserve.sim.engine import SimTarget
from kvserve.sim.space import parse_search
from kvserve.sim.tune import QualityGate, tune
from kvserve.sim.workload import token_counter

# The bundled model on a GPU so small that its pool holds about four 1.5k-token documents in
# bfloat16: long-document decoding is then bound by how many sequences fit.
SMALL_GPU = "custom:0.022:2.0:300"


def report(tmp_path: Path, fmt: str, verdict: str, model: str = "kvserve-ref") -> str:
    """A hand-made `kvserve quality --json` report (only the fields the gate reads)."""
    path = tmp_path / f"{fmt}-{verdict}-{model}.json"
    path.write_text(json.dumps({
        "verdict": verdict, "model": f"/models/{model}", "label": fmt,
        "candidate": {"kv_format": fmt, "engine": {"kv_cache_dtype": fmt, "kv_retention": None}},
    }))  # fmt: skip
    return str(path)


@pytest.fixture
def llama8b(tmp_path):
    """The seed's Llama-3-8B shapes as a bare config (no weights, no tokenizer)."""
    from tests.test_simulator import SEED_8B

    (tmp_path / "llama-3-8b").mkdir()
    (tmp_path / "llama-3-8b" / "config.json").write_text(json.dumps(SEED_8B))
    return str(tmp_path / "llama-3-8b")


def run_tune(workload: str, n: int, space: dict, reports: list[str], gpu: str = "h100-sxm",
             slo: str = "ttft=60s,tpot=1s", model: str | None = None, jobs: int = 1,
             accept_inconclusive: bool = False):  # fmt: skip
    from kvserve.bench.metrics import parse_slo

    kw = dict(model=model or default_model(), dtype="bfloat16")
    g = get_gpu(gpu)

    def make_target(e: dict, tp: int, replicas: int, router: str = "round_robin") -> SimTarget:
        return SimTarget(e, gpu_profile(g), g, tp, replicas, router=router)

    base = make_target(kw, 1, 1)
    count, max_len = token_counter(base)
    reqs = make_workload(WorkloadSpec(name=workload, num_prompts=n, seed=0,
                                      max_model_len=max_len), count)  # fmt: skip
    gate = QualityGate.load(reports, kw["model"], accept_inconclusive)
    return tune(kw, make_target, reqs, LoadSpec(), 0, space, parse_slo(slo), 2.0, gate,
                jobs=jobs)  # fmt: skip


def test_rag_picks_prefix_caching_on(llama8b):
    res = run_tune("rag", 48, {"enable_prefix_caching": (False, True)}, [], model=llama8b)
    assert res.baseline == {"enable_prefix_caching": False}  # the search starts with it off
    assert res.best is not None and res.best.settings["enable_prefix_caching"] is True
    off = next(t for t in res.trials if t.settings["enable_prefix_caching"] is False)
    assert off.usd_per_million_useful > 1.2 * res.best.usd_per_million_useful
    assert res.best.summary["cached_prompt_tokens"] > 0


SPACE = {"kv_cache_dtype": ("auto", "fp8_e4m3")}


def test_parallel_trials_find_what_the_sequential_search_finds(llama8b, monkeypatch):
    """Forked simulations (jobs=2) give every trial the sequential search gives, in the same
    order, with the same figures; a gate-excluded value and a value that cannot run too."""
    import kvserve.sim.tune as tune_mod

    forked: list[int] = []
    real = tune_mod.fork_map

    def spy(fn, items, jobs):
        forked.append(len(items))
        return real(fn, items, jobs)

    monkeypatch.setattr(tune_mod, "fork_map", spy)
    space = {"enable_prefix_caching": (False, True), "block_size": (16, 32, 7, 64),
             "kv_cache_dtype": ("auto", "fp8_e4m3"), "max_num_seqs": (256, 8)}  # fmt: skip
    runs = [run_tune("rag", 24, space, [], model=llama8b, jobs=j) for j in (1, 2)]
    assert forked and max(forked) >= 3  # block sizes 32, 7 and 64 at once
    seq, par = ([(t.settings, t.excluded, t.summary, t.cost_usd) for t in r.trials] for r in runs)
    assert par == seq and len(seq) >= 7
    assert runs[1].best.settings == runs[0].best.settings
    excluded = [t.excluded for t in runs[1].trials if t.excluded]
    assert any("no passing quality report" in e for e in excluded)
    assert any("cannot run" in e for e in excluded)  # block size 7
    with pytest.raises(ValueError, match="jobs: must be an integer >= 1"):
        run_tune("rag", 4, space, [], model=llama8b, jobs=0)


@pytest.mark.parametrize("verdict, accept", [("PASS", False), ("INCONCLUSIVE", True)])
def test_memory_bound_long_context_picks_fp8_when_its_gate_passes(tmp_path, verdict, accept):
    """PASS lets fp8 compete; so does INCONCLUSIVE when the operator accepts it."""
    res = run_tune("long-doc", 24, SPACE, [report(tmp_path, "fp8_e4m3", verdict)], SMALL_GPU,
                   accept_inconclusive=accept)  # fmt: skip
    assert res.best is not None and res.best.settings["kv_cache_dtype"] == "fp8_e4m3"
    auto = next(t for t in res.trials if t.settings["kv_cache_dtype"] == "auto")
    assert auto.excluded is None
    assert auto.usd_per_million_useful > 1.2 * res.best.usd_per_million_useful


@pytest.mark.parametrize("verdict", ["FAIL", "INCONCLUSIVE", None])
def test_memory_bound_long_context_keeps_exact_kv_without_a_passing_report(tmp_path, verdict):
    """Only PASS lets a lossy format compete: FAIL, INCONCLUSIVE (the gate could not tell) and
    no report at all keep the exact cache, and each says why."""
    reports = [] if verdict is None else [report(tmp_path, "fp8_e4m3", verdict)]
    res = run_tune("long-doc", 24, SPACE, reports, SMALL_GPU)
    assert res.best is not None and res.best.settings["kv_cache_dtype"] == "auto"
    fp8 = next(t for t in res.trials if t.settings["kv_cache_dtype"] == "fp8_e4m3")
    assert fp8.summary is None  # never simulated: it could not compete
    expected = {
        "FAIL": "quality gate FAILED",
        "INCONCLUSIVE": "quality gate INCONCLUSIVE for kv_cache_dtype=fp8_e4m3",
        None: "no passing quality report",
    }[verdict]
    assert expected in fp8.excluded
    if verdict == "INCONCLUSIVE":
        assert "--quality-accept-inconclusive" in fp8.excluded


def rows_report(tmp_path: Path, name: str, rows: dict[str, tuple[int, str]],
                tasks: list[str] | None = None) -> str:  # fmt: skip
    """A `kvserve quality --json` report for fp8_e4m3 with metric rows {key: (n, verdict)},
    its verdict theirs, over ``tasks`` (None: the whole suite)."""
    from kvserve.quality.stats import overall
    from kvserve.quality.suite import TASKS

    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps({
        "verdict": overall([v for _, v in rows.values()]), "model": "/models/kvserve-ref",
        "candidate": {"engine": {"kv_cache_dtype": "fp8_e4m3", "kv_retention": None}},
        "suite": {"tasks": list(tasks or TASKS)},
        "metrics": [{"key": k, "n": n, "verdict": v} for k, (n, v) in rows.items()],
    }))  # fmt: skip
    return str(path)


WHOLE_ROWS = {"recall_needle": (384, "PASS"), "recall_needle_depth_0_10": (192, "PASS"),
              "recall_multi_needle": (192, "PASS"), "recall_multi_turn": (192, "PASS"),
              "recall_variable_tracking": (192, "PASS"),
              "recall_instruction": (192, "INCONCLUSIVE"), "perplexity": (48, "PASS"),
              "teacher_forced_agreement": (48, "PASS"), "mean_kl": (48, "PASS")}  # fmt: skip


@pytest.mark.parametrize("subset, expected", [
    ((1200, "PASS"), None),  # the larger run decides the whole suite's open task
    ((1200, "FAIL"), "quality gate FAILED"),
    ((1200, "INCONCLUSIVE"), "quality gate INCONCLUSIVE"),
    ((96, "PASS"), "quality gate INCONCLUSIVE"),  # smaller than the whole suite's group
    ((192, "PASS"), "quality gate INCONCLUSIVE"),  # as large: the worse verdict
])  # fmt: skip
def test_reports_combine_task_by_task_the_largest_run_deciding(tmp_path, subset, expected):
    whole = rows_report(tmp_path, "whole", WHOLE_ROWS)
    part = rows_report(tmp_path, "part", {"recall_instruction": subset}, ["instruction"])
    gate = QualityGate.load([whole, part], default_model())
    said = gate.verdict({"kv_cache_dtype": "fp8_e4m3"})
    assert said is None if expected is None else expected in said
    # In either order
    again = QualityGate.load([part, whole], default_model())
    assert again.verdict({"kv_cache_dtype": "fp8_e4m3"}) == said


def test_task_subsets_alone_never_pass(tmp_path):
    """Every --tasks run passing is not the whole suite passing: the tasks not run were never
    judged. A FAIL in a subset is a FAIL."""
    a = rows_report(tmp_path, "a", {"recall_instruction": (1200, "PASS")}, ["instruction"])
    b = rows_report(tmp_path, "b", {"perplexity": (48, "PASS")}, ["passages"])
    said = QualityGate.load([a, b], default_model()).verdict({"kv_cache_dtype": "fp8_e4m3"})
    assert said == (
        "quality reports for kv_cache_dtype=fp8_e4m3 cover only instruction, passages "
        "(kvserve quality --tasks); the whole suite must have run too"
    )
    # Nor does accepting INCONCLUSIVE let a subset stand for the whole suite
    d = rows_report(tmp_path, "d", {"recall_instruction": (64, "INCONCLUSIVE")}, ["instruction"])
    gate = QualityGate.load([d], default_model(), accept_inconclusive=True)
    assert "cover only instruction" in gate.verdict({"kv_cache_dtype": "fp8_e4m3"})
    c = rows_report(tmp_path, "c", {"recall_multi_turn": (400, "FAIL")}, ["multi_turn"])
    said = QualityGate.load([a, c], default_model()).verdict({"kv_cache_dtype": "fp8_e4m3"})
    assert said == "quality gate FAILED for kv_cache_dtype=fp8_e4m3"


def test_report_for_another_model_is_refused(tmp_path):
    with pytest.raises(ValueError, match="is for model 'smollm2'.*tuned model is 'kvserve-ref'"):
        QualityGate.load([report(tmp_path, "fp8_e4m3", "PASS", "smollm2")], default_model())
    bad = tmp_path / "not-a-report.json"
    bad.write_text(json.dumps({"summary": {}}))
    with pytest.raises(ValueError, match="not a `kvserve quality --json` report"):
        QualityGate.load([str(bad)], default_model())
    # A report from before verdicts (a bare "passed") is refused, not read as PASS.
    old = tmp_path / "old.json"
    engine = {"kv_cache_dtype": "fp8_e4m3"}
    old.write_text(
        json.dumps({"passed": True, "model": "/m/kvserve-ref", "candidate": {"engine": engine}})
    )
    with pytest.raises(ValueError, match="with a verdict"):
        QualityGate.load([str(old)], default_model())
    with pytest.raises(ValueError, match="verdict 'MAYBE' is not PASS, FAIL or INCONCLUSIVE"):
        QualityGate.load([report(tmp_path, "fp8_e4m3", "MAYBE")], default_model())


@pytest.mark.parametrize(
    "item, match",
    [
        ("block_size=", "block_size has no values"),
        ("colour=red", "NAME one of"),
        ("kv_cache_dtype=fp9", "unknown \\['fp9'\\]"),
        ("replicas=0", "replicas values must be >= 1"),
        ("enable_prefix_caching=maybe", "expected on/off"),
    ],
)
def test_bad_search_space(item, match):
    with pytest.raises(ValueError, match=match):
        parse_search([item])


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_unmet_slo_names_the_closest_configurations(capsys, tmp_path, llama8b):
    code, out, err = cli(
        capsys, "tune", "--model", llama8b, "--gpu", "h100-sxm", "--workload", "chat",
        "--num-prompts", "12", "--slo", "ttft=1us", "--gpu-hour-cost", "1",
        "--search", "block_size=16,32", "--no-progress", "--no-plots",
        "--output-dir", str(tmp_path),
    )  # fmt: skip
    assert code == 1
    assert "no configuration meets the SLO ttft=1us; the closest:" in err
    assert "0% of requests meet it; p95 ttft" in err and "vs 0 ms" in err


def test_cli_searches_exactly_what_it_is_asked(capsys, tmp_path, llama8b):
    """Two dimensions asked: every configuration tried sets those two and nothing else (no
    tp or replicas), one GPU each; the progress counts configurations against the first
    pass (1 + one more value of each dimension = 3)."""
    code, out, err = cli(
        capsys, "tune", llama8b, "--gpu", "h100-sxm", "--workload", "rag", "--num-prompts",
        "16", "--slo", "ttft=10s", "--gpu-hour-cost", "2", "--search", "block_size=16,32",
        "--search", "max_num_seqs=256,64", "--no-plots", "--output-dir", str(tmp_path),
        "--label", "x",
    )  # fmt: skip
    assert code == 0
    assert "searching block_size=16,32; max_num_seqs=256,64; 3 configurations in the first " \
        "pass" in out and "added by default" not in out  # fmt: skip
    data = json.loads((tmp_path / "x.json").read_text())
    assert data["space"] == {"block_size": [16, 32], "max_num_seqs": [256, 64]}
    assert data["space_added_by_default"] == []
    assert {tuple(sorted(t["settings"])) for t in data["trials"]} == {
        ("block_size", "max_num_seqs")
    }
    assert {t["gpus"] for t in data["trials"]} == {1}
    lines = [x for x in err.splitlines() if x.startswith("tune: configuration ")]
    assert len(lines) == len(data["trials"]) >= 3
    assert [x.split(":")[1] for x in lines[:3]] == [
        " configuration 1/3 (first pass)", " configuration 2/3 (first pass)",
        " configuration 3/3 (first pass)",
    ]  # fmt: skip
    assert all("(a later pass)" in x for x in lines[3:])


def test_default_space_is_named_and_can_be_turned_off(capsys, llama8b):
    """With no --search, the default space (the dimensions the issue lists, written here);
    a flag the user set keeps its value; --search alone adds nothing; --default-space adds
    the rest; --no-default-space with nothing asked is an error."""
    from kvserve.cli import build_parser
    from kvserve.sim.tune_cli import tune_space

    parser, _ = build_parser()
    kw = {
        "block_size": 16,
        "max_num_seqs": 256,
        "max_num_batched_tokens": 2048,
        "enable_prefix_caching": True,
        "kv_cache_dtype": "auto",
        "admission": "greedy",
    }
    everything = {"enable_prefix_caching", "kv_cache_dtype", "block_size", "max_num_seqs",
                  "max_num_batched_tokens", "admission", "replicas", "tp"}  # fmt: skip

    def space(*argv: str, **over: object) -> tuple[dict, list]:
        return tune_space(parser.parse_args(["tune", *argv]), {**kw, **over})

    sp, added = space()
    assert set(sp) == set(added) == everything
    assert sp["tp"] == (1, 2) and sp["block_size"][0] == 16  # from the engine's default
    sp, added = space("--tp", "2", block_size=32)  # flags set: kept, not searched
    assert set(sp) == everything - {"tp", "block_size"}
    sp, added = space("--search", "kv_cache_dtype=auto,fp8_e4m3")
    assert (sp, added) == ({"kv_cache_dtype": ("auto", "fp8_e4m3")}, [])
    sp, added = space("--search", "block_size=8,16", "--default-space")
    assert sp["block_size"] == (8, 16) and set(added) == everything - {"block_size"}
    with pytest.raises(ValueError, match="search: nothing to search"):
        space("--no-default-space")
    code, out, err = cli(capsys, "tune", llama8b, "--gpu", "h100-sxm", "--slo", "ttft=1s",
                         "--gpu-hour-cost", "1", "--no-default-space")  # fmt: skip
    assert code == 2 and "nothing to search" in err


def test_cli_winner_command_line_and_files(capsys, tmp_path, llama8b):
    """A config.json alone has no weights: the winner is a plan that says so, not a command
    that cannot start; replicas=2 costs twice the GPUs."""
    code, out, _ = cli(
        capsys, "tune", "--model", llama8b, "--gpu", "h100-sxm", "--workload", "rag",
        "--num-prompts", "24",
        "--slo", "ttft=10s", "--gpu-hour-cost", "2", "--search", "enable_prefix_caching=off,on",
        "--search", "replicas=1,2", "--no-progress", "--output-dir", str(tmp_path),
        "--label", "t",
    )  # fmt: skip
    assert code == 0
    assert "best: enable_prefix_caching=on" in out
    assert "plan, not a command to run yet:" in out and "run it:" not in out
    assert f"{llama8b} holds no weights" in out
    assert f"kvserve serve {llama8b}" in out and "--no-enable-prefix-caching" not in out
    assert "replicas=2: 2.00x the cost per useful token" in out or "replicas=2" in out
    data = json.loads((tmp_path / "t.json").read_text())
    assert data["best"]["enable_prefix_caching"] is True
    assert len(data["recommendation"]["cannot_start"]) == 1
    assert (tmp_path / "t-pareto.png").stat().st_size > 1000


def test_cli_winner_with_weights_is_a_command(capsys, tmp_path):
    code, out, _ = cli(
        capsys, "tune", "kvserve-ref", "--gpu", "h100-sxm", "--workload", "chat",
        "--num-prompts", "6", "--slo", "ttft=10s", "--gpu-hour-cost", "2",
        "--search", "block_size=16,32", "--no-progress", "--no-plots",
        "--output-dir", str(tmp_path), "--label", "w",
    )  # fmt: skip
    assert code == 0
    assert f"run it:\n  kvserve serve {default_model()}" in out and "plan," not in out
    data = json.loads((tmp_path / "w.json").read_text())
    assert data["recommendation"]["cannot_start"] == []


@pytest.mark.parametrize(
    "argv, match",
    [
        (["tune", "--gpu", "h100-sxm", "--slo", "ttft=1s"], "gpu_hour_cost"),
        (["tune", "--gpu", "h900", "--slo", "ttft=1s", "--gpu-hour-cost", "1"], "gpu: unknown"),
        (["tune", "--gpu", "l4", "--gpu-hour-cost", "1"], "slo: tune needs an SLO"),
        (["simulate", "--workload", "chat"], "profile: give --gpu NAME"),
        (["simulate", "--profile", "/nonexistent.json"], "profile: file not found"),
    ],
)
def test_cli_bad_input_messages(capsys, argv, match):
    code, _, err = cli(capsys, *argv, "--no-progress")
    assert code == 2
    assert match in err


def test_cli_simulate_writes_a_bench_report(capsys, tmp_path, llama8b):
    code, out, _ = cli(
        capsys, "simulate", "--model", llama8b, "--gpu", "a100-80gb", "--workload", "chat",
        "--num-prompts", "16",
        "--request-rate", "4", "--no-progress", "--output-dir", str(tmp_path), "--label", "s",
        "--gpu-hour-cost", "2", "--slo", "ttft=1s",
    )  # fmt: skip
    assert code == 0
    s = json.loads((tmp_path / "s.json").read_text())["summary"]
    assert s["completed"] == 16 and s["num_requests"] == 16
    assert s["simulation"]["gpu"] == "a100-80gb"
    assert s["cost"]["gpus"] == 1 and s["cost"]["usd_per_million_output_tokens"] > 0
    assert "output token throughput" in out
    assert s["simulation"]["notes"] == [
        "no tokenizer.json beside the config: one token per word (hashed ids)"
    ]


def test_cli_simulate_sweep_runs_one_point_per_rate(capsys, tmp_path, llama8b):
    code, out, _ = cli(
        capsys, "simulate", "--model", llama8b, "--gpu", "h100-sxm", "--workload", "chat",
        "--num-prompts", "40", "--sweep", "rate=2,50", "--no-progress", "--output-dir",
        str(tmp_path), "--label", "w",
    )  # fmt: skip
    assert code == 0 and "rate=50 / rate=2" in out
    data = json.loads((tmp_path / "w.json").read_text())
    low, high = data["sweep"]
    assert (low["sweep_value"], high["sweep_value"]) == (2.0, 50.0)
    assert low["completed"] == high["completed"] == 40
    # 40 requests at 2/s take ~20 s; at 50/s under a second, and they queue more
    assert low["duration_s"] > 10 * high["duration_s"]
    assert high["ttft_ms"]["p99"] >= low["ttft_ms"]["p99"]
    assert (tmp_path / "w-sweep.png").exists()


def test_cli_simulate_streamed_equals_in_process(capsys, tmp_path, llama8b):
    """With a spare core (--jobs 2) one run's workload is made in another process while it
    replays, its records are encoded as they finish and its plot drawn beside the summary:
    the JSON file is the one --jobs 1 writes (made in process, encoded at the end) but for
    the wall time, text included; the Markdown too, and the plot is there."""
    texts = []
    out_dir = tmp_path / "out"
    for jobs in ("1", "2"):
        code, out, _ = cli(
            capsys, "simulate", "--model", llama8b, "--gpu", "h100-sxm", "--workload", "mixed",
            "--num-prompts", "80", "--request-rate", "30", "--no-progress",
            "--output-dir", str(out_dir), "--label", "run", "--jobs", jobs,
        )  # fmt: skip
        assert code == 0 and "simulated 80 requests" in out
        text = (out_dir / "run.json").read_text()
        texts.append(re.sub(r'"wall_s": [0-9.e-]+', "", text))
        texts.append((out_dir / "run.md").read_text())
    assert texts[0] == texts[2] and texts[1] == texts[3]
    data = json.loads((out_dir / "run.json").read_text())
    assert [r["index"] for r in data["records"]] == list(range(80))
    assert sorted(p.name for p in out_dir.iterdir()) == ["run-latency.png", "run.json", "run.md"]


def test_cli_simulate_sweep_points_side_by_side_equal_one_at_a_time(capsys, tmp_path, llama8b):
    """--jobs 2 runs the points in forks: every figure but the wall time is as with --jobs 1,
    the records too; a --jobs below 1 is refused naming the flag."""
    runs = []
    for jobs in ("1", "2"):
        code, _, _ = cli(
            capsys, "simulate", "--model", llama8b, "--gpu", "h100-sxm", "--workload", "rag",
            "--num-prompts", "30", "--sweep", "rate=3,20,inf", "--no-progress", "--no-plots",
            "--output-dir", str(tmp_path), "--label", f"j{jobs}", "--jobs", jobs,
        )  # fmt: skip
        assert code == 0
        data = json.loads((tmp_path / f"j{jobs}.json").read_text())
        for s in data["sweep"]:
            s["simulation"].pop("wall_s")
            s.pop("label")
        runs.append(data)
    assert runs[0] == runs[1]
    assert [s["sweep_value"] for s in runs[1]["sweep"]] == [3.0, 20.0, math.inf]
    code, _, err = cli(capsys, "simulate", "--model", llama8b, "--gpu", "h100-sxm", "--jobs", "0")
    assert code == 2 and "jobs: must be an integer >= 1" in err


def test_router_processes_reach_the_candidates_with_a_router(capsys, tmp_path, llama8b,
                                                            monkeypatch):  # fmt: skip
    """``--router-processes`` is every two-replica candidate's; a one-replica candidate has
    no router, so none (it would be refused)."""
    from kvserve.sim import engine

    made: list[tuple[int, int]] = []

    def spy(*a, **kw):  # noqa: ANN002, ANN003, ANN202
        t = SimTarget(*a, **kw)
        made.append((t.replicas, t.router_processes))
        return t

    monkeypatch.setattr(engine, "SimTarget", spy)
    code, out, err = cli(
        capsys, "tune", llama8b, "--gpu", "h100-sxm", "--workload", "rag", "--num-prompts",
        "8", "--slo", "ttft=10s", "--gpu-hour-cost", "2", "--search", "replicas=1,2",
        "--router", "prefix", "--router-processes", "3", "--no-plots", "--output-dir",
        str(tmp_path), "--label", "x",
    )  # fmt: skip
    assert code == 0, err
    assert {(1, 0), (2, 3)} <= set(made), made
    assert all(p == (3 if n > 1 else 0) for n, p in made), made
