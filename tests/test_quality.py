"""The quality gate's mechanics on tiny random checkpoints.

Random models cannot retrieve (their recall is 0 on both sides), so what these tests can see is
agreement, KL and perplexity: the exact baseline must match itself bit for bit, a lossy format
must be visible (the gate really reads the stored cache), and a corrupted cache must fail.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from kvserve.config import ConfigError
from kvserve.kv.storage import KVStorageWrapper
from kvserve.quality.gate import run_gate, wrap_kv_storage
from kvserve.quality.metrics import LogitComparison, passage_nll
from kvserve.quality.stats import INCONCLUSIVE, MIN_PASSAGES
from kvserve.quality.suite import SuiteSpec, answers_match, build_suite

# Ten prompts per group and one passage each: enough passages for the bootstrap to decide
# agreement, KL and perplexity; far too few prompts for recall to decide anything.
TINY = SuiteSpec(
    prompts=MIN_PASSAGES,
    lengths=(256, 512),
    early_depths=(0.0,),
    late_depths=(50.0, 100.0),
    multi_needle_length=384,
    multi_turn_length=768,
    variable_tracking_length=256,
    instruction_length=256,
    instruction_max_tokens=8,
    passage_length=160,
    prompts_per_passage=1,
)


@pytest.fixture(autouse=True)
def one_thread():
    """The gate runs single-threaded (as its CLI does): oversubscribed threads on a shared
    machine cost more than they give on batches this small."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class ZeroFirstHalf(KVStorageWrapper):
    """Test-only corruption: every read of the cache sees the first half of each sequence's
    blocks zeroed (K and V). Attention backends read a wrapper only through ``gather``."""

    second_half = False

    def gather(self, layer, block_tables):  # noqa: ANN001
        k, v = self.inner.gather(layer, block_tables)
        cut = (block_tables.shape[1] // 2) * self.inner.block_size
        half = slice(cut, None) if self.second_half else slice(None, cut)
        k, v = k.clone(), v.clone()
        k[:, :, half] = 0
        v[:, :, half] = 0
        return k, v


class ZeroSecondHalf(ZeroFirstHalf):
    """The same corruption on the newest half of each sequence's blocks."""

    second_half = True


def engine_kwargs(model: str, **over) -> dict:
    return dict(model=model, max_num_batched_tokens=32, max_num_seqs=8, **over)


def metric(report: dict, key: str) -> dict:
    return next(m for m in report["metrics"] if m["key"] == key)


def test_answers_match_is_exact_on_the_answer_word():
    assert answers_match(" 4831907", " 4831907")
    assert answers_match(" 4831907.\nQuestion", " 4831907")
    assert not answers_match(" 48319072", " 4831907")  # ran on: another code
    assert not answers_match(" 483190", " 4831907")
    assert not answers_match("4831907", " 4831907")


@pytest.mark.parametrize(
    "name, arg, followed, broken",
    [
        ("starts_with", "Well", ['Well, it is about X.', '"Well." That is it.', "well then"],
         ["Wellness is the topic.", "It is well known.", ""]),
        ("includes_keyword", "river", ["The river runs.", "A RIVER, and more."],
         ["Rivers run.", "The riverbank."]),
        ("title", "", ["<<Cookie handling>>", "Title: <<A b>> and more"],
         ["<Cookie handling>", "<<>>", "<<two\nlines>>"]),
        ("two_bullets", "", ["* one\n* two", "Intro:\n  * a\n  * b\nEnd."],
         ["* one", "* a\n* b\n* c", "- a\n- b"]),
        ("no_commas", "", ["No commas here."], ["One, two.", "", "   "]),
        ("max_words", "10", ["One two three.", "it's one two three four five six seven eight nine"],
         ["one two three four five six seven eight nine ten eleven", "..."]),
        ("lowercase", "", ["all lower, 123."], ["Not all lower.", "123 !"]),
        ("quoted", "", ['"A quoted answer."', '  "x"  '],
         ['"Half quoted.', 'A "quote" inside', '"']),
    ],
)  # fmt: skip
def test_instruction_checks(name, arg, followed, broken):
    """Each check against responses written by hand, followed and not."""
    from kvserve.quality.instructions import follows

    meta = {"instruction": name, "arg": arg}
    for text in followed:
        assert follows(text, meta), (name, text)
    for text in broken:
        assert not follows(text, meta), (name, text)


def test_instruction_prompts_cycle_through_every_kind_and_fit_their_length():
    from kvserve.quality.instructions import NAMES, instruction_prompt
    from kvserve.quality.tasks import render_chat

    def count(text: str) -> int:
        return len(text.split())

    prompts = [instruction_prompt(7 + i, i, 300, count, render_chat) for i in range(2 * len(NAMES))]
    assert [p.meta["instruction"] for p in prompts] == list(NAMES) * 2
    again = [instruction_prompt(7 + i, i, 300, count, render_chat) for i in range(len(NAMES))]
    assert [p.prompt for p in again] == [p.prompt for p in prompts[: len(NAMES)]]
    for p in prompts:
        assert abs(count(p.prompt) - 300) <= 8 and p.prompt.endswith("<|assistant|>\n")
        assert not p.add_special_tokens and p.answer == ""


def test_logit_comparison_counts_agreement_and_kl():
    base = torch.log_softmax(torch.tensor([[2.0, 0.0, 0.0], [0.0, 3.0, 0.0]]), -1)
    cand = torch.log_softmax(torch.tensor([[2.0, 0.0, 0.0], [0.0, 0.0, 3.0]]), -1)
    cmp = LogitComparison()
    cmp.add(0, base, base)
    assert cmp.agreement == 1.0 and cmp.mean_kl == 0.0
    cmp.add(1, base, cand)
    assert cmp.total_positions == 4 and cmp.agree == {0: 2, 1: 1}
    p = base[1].exp()
    kl = float((p * (base[1] - cand[1])).sum())
    assert cmp.mean_kl == pytest.approx(kl / 4)
    nll, n = passage_nll(base, [0, 1, 2])
    assert n == 2 and nll == pytest.approx(-float(base[0, 1] + base[1, 2]))


def test_suite_is_deterministic_and_fits_the_model(checkpoint):
    from kvserve.model.tokenizer import Tokenizer

    model = checkpoint("llama_gqa")
    tok = Tokenizer(model)
    a, b = build_suite(tok, TINY, 2048), build_suite(tok, TINY, 2048)
    assert [i.prompt_ids for i in a.items] == [i.prompt_ids for i in b.items]
    assert a.passages == b.passages
    needles = [i for i in a.items if i.kind == "needle"]
    assert len(needles) == 2 * TINY.prompts  # depths 0-10 % and deeper, `prompts` each
    early = [i for i in needles if i.meta["depth_percent"] <= 10]
    assert len(early) == TINY.prompts
    cells = {(i.meta["context_tokens"], i.meta["depth_percent"]) for i in needles}
    assert cells == {(n, d) for n in (256, 512) for d in (0.0, 50.0, 100.0)}
    for it in needles:  # fitted to the target length in this tokenizer
        assert abs(len(it.prompt_ids) - it.meta["context_tokens"]) <= 16
    counts = {}
    for it in a.items:
        counts[it.kind] = counts.get(it.kind, 0) + 1
    n = TINY.prompts
    assert counts == {"needle": 2 * n, "multi_needle": n, "multi_turn": n,
                      "variable_tracking": n, "instruction": n}  # fmt: skip
    assert len(a.passages) == n  # one per prompt here (prompts_per_passage=1)
    assert a.chat_template == "model" and not a.skipped
    # A model with a short context skips what does not fit, and says so; the needles that
    # fit still make up the group.
    short = build_suite(tok, TINY, 400)
    assert "needle@512" in short.skipped and "multi_turn@768" in short.skipped
    left = [i for i in short.items if i.kind == "needle"]
    assert {i.meta["context_tokens"] for i in left} == {256} and len(left) == 2 * n


def test_exact_baseline_against_itself_is_refused_unless_a_setup_makes_it_a_candidate(
    checkpoint,
):
    model = checkpoint("llama_gqa")
    with pytest.raises(ConfigError, match="nothing to compare.*--kv-cache-dtype, --kv-retention"):
        run_gate(engine_kwargs(model), TINY)
    # With a setup hook (here one that changes nothing) the comparison is explicit and runs:
    # bit-identical passages pass agreement, KL and perplexity; ten prompts per group cannot
    # show that recall kept within 5 points, so the whole gate is INCONCLUSIVE, not PASS.
    engines = []
    report = run_gate(engine_kwargs(model), TINY, candidate_setup=lambda llm: engines.append(llm))
    assert report["verdict"] == "INCONCLUSIVE" and report["exit_code"] == 3
    for key in ("teacher_forced_agreement", "mean_kl", "perplexity"):
        assert metric(report, key)["verdict"] == "PASS", metric(report, key)
    assert metric(report, "teacher_forced_agreement")["candidate"] == 1.0
    assert metric(report, "mean_kl")["candidate"] == 0.0  # bit-identical, not just close
    ppl = metric(report, "perplexity")
    assert ppl["candidate"] == ppl["baseline"] and ppl["interval"] == [0.0, 0.0]
    needle = metric(report, "recall_needle")
    assert needle["verdict"] == "INCONCLUSIVE" and needle["lost"] == needle["gained"] == 0
    assert needle["needed"] == 52  # an identical group decides at 52 prompts (test_quality_stats)
    assert report["needed_prompts"] == 52  # the early-depth group has `prompts`: 52 needed
    # Each undecided task alone (--tasks): the groups that no prompt passes on either side need
    # 52 as above; instruction following (a random model follows a few instructions on both
    # sides) needs what its own row says, its group being `prompts` large
    tasks = ("needle", "multi_needle", "variable_tracking", "multi_turn")
    instruction = metric(report, "recall_instruction")
    assert instruction["n"] == TINY.prompts and instruction["needed"] is not None
    assert report["needed_by_task"] == {**dict.fromkeys(tasks, 52),
                                        "instruction": instruction["needed"]}  # fmt: skip
    assert report["greedy_answers_identical"] == 1.0
    # Same requests, same pool, same scheduler: the same batches step for step.
    assert report["steps"]["baseline"] == report["steps"]["candidate"]
    assert report["cache_reads"]["min_share_of_prompt_positions"] > 0.7
    engine = engines[0].engine
    engine.kv.check_invariants()
    assert engine.kv.num_used_blocks == 0
    json.dumps(report)  # the whole report is JSON-serialisable


def test_corrupted_cache_fails_the_gate(checkpoint):
    model = checkpoint("llama_gqa")
    report = run_gate(
        engine_kwargs(model), TINY, candidate_setup=lambda llm: wrap_kv_storage(llm, ZeroFirstHalf)
    )
    assert report["verdict"] == "FAIL" and report["needed_prompts"] is None
    agree, kl = metric(report, "teacher_forced_agreement"), metric(report, "mean_kl")
    assert agree["verdict"] == "FAIL" and agree["candidate"] < 0.6
    assert agree["interval"][1] < 0.95  # even the upper bound is below the margin
    assert kl["verdict"] == "FAIL" and kl["interval"][0] > 0.05
    assert report["greedy_answers_identical"] < 0.5


def test_lossy_format_is_seen_through_the_stored_cache(checkpoint):
    """int8 changes the logits only where attention reads the stored cache: KL > 0 shows the
    gate's chunked prefill really exercises the format; the format itself stays close."""
    model = checkpoint("llama_gqa")
    report = run_gate(engine_kwargs(model, kv_cache_dtype="int8"), TINY)
    assert report["candidate"]["kv_format"] == "int8"
    assert report["baseline"]["kv_format"] == "float32"
    kl = metric(report, "mean_kl")
    assert 0.0 < kl["candidate"] < 0.05 and kl["interval"][0] <= kl["candidate"]
    assert metric(report, "teacher_forced_agreement")["candidate"] > 0.9


def test_cli_exit_codes_json_and_files(checkpoint, tmp_path, capsys):
    from kvserve.cli import main

    model = checkpoint("llama_gqa")
    out = tmp_path / "q"
    # No lossy option: refused (exit 2), naming the options that make a candidate.
    assert main(["quality", "--model", model, "--quick"]) == 2
    err = capsys.readouterr().err
    assert "nothing to compare" in err and "--formats, --retentions" in err

    # --quick cannot show non-inferiority: INCONCLUSIVE, exit 3, with the size that would.
    argv = ["quality", "--model", model, "--quick", "--kv-cache-dtype", "int8", "--json",
            "--out", str(out)]  # fmt: skip
    assert main(argv) == 3
    lines = capsys.readouterr().out.strip().splitlines()
    report = json.loads(lines[-1])
    assert report["verdict"] == "INCONCLUSIVE" and report["suite"]["name"] == "quick"
    cpu = next((x.split(":", 1)[1].strip() for x in open("/proc/cpuinfo") if
                x.startswith("model name")), None)  # fmt: skip
    assert cpu is None or report["device"].startswith(cpu)  # where it ran
    assert report["needed_prompts"] > 12
    table = "\n".join(lines[:-1])
    assert "quality gate: INCONCLUSIVE" in table and "PASS" not in table.splitlines()[-3]
    # the advice repeats --quick: its contexts are the quick suite's, not the default's
    assert f"about --quick --prompts {report['needed_prompts']} would decide" in table
    assert "suite: --quick --prompts 12: " in table
    alone = next(x for x in table.splitlines() if "each alone:" in x)
    for task, n in report["needed_by_task"].items():
        assert f"--quick --tasks {task} --prompts {n}" in alone
    assert "teacher-forced next-token agreement" in table and "sequence agreement" in table
    saved = json.loads((out / "int8-quick.json").read_text())
    assert saved["metrics"] == report["metrics"]
    pytest.importorskip("matplotlib")
    assert (out / "int8-quick-recall.png").stat().st_size > 1000

    # A lossy format held to an impossible margin fails with exit code 1 (KL's lower bound
    # is above 0 over enough passages).
    argv = ["quality", "--model", model, "--quick", "--prompts", "40", "--kv-cache-dtype",
            "kivi2", "--max-kl", "0", "--out", str(out)]  # fmt: skip
    assert main(argv) == 1
    verdict = next(x for x in capsys.readouterr().out.splitlines() if "quality gate:" in x)
    assert verdict.startswith("quality gate: FAIL (") and "mean KL" in verdict
    assert (out / "kivi2-quick.json").exists()

    # Several formats against one baseline run: one report each, the baseline once.
    argv = ["quality", "--model", model, "--quick", "--formats", "float16,int8", "--out",
            str(out / "many")]  # fmt: skip
    assert main(argv) == 3
    captured = capsys.readouterr()
    assert captured.err.count("baseline run") == 1 and captured.out.count("quality gate:") == 2
    one = json.loads((out / "many" / "int8-quick.json").read_text())
    assert one["candidate"]["kv_format"] == "int8" and one["baseline"]["kv_format"] == "float32"
    assert main(["quality", "--model", model, "--quick", "--formats", "int3"]) == 2
    assert "formats: int3; choose from" in capsys.readouterr().err
    assert main(["quality", "--model", model, "--quick", "--retentions", "lru:5"]) == 2
    assert "kv_retention: unknown policy 'lru'" in capsys.readouterr().err
    assert main(["quality", "--model", model, "--quick", "--retentions", " ; "]) == 2
    assert "retentions: none given" in capsys.readouterr().err

    # Usage errors exit 2.
    assert main(["quality", "--model", model, "--min-agreement", "2"]) == 2
    assert main(["quality", "--model", model, "--confidence", "1.5"]) == 2
    assert "confidence: must be in [0.5, 1)" in capsys.readouterr().err
    assert main(["quality", "--model", model, "--kv-cache-dtype", "int8", "--prompts", "0"]) == 2
    assert "prompts: must be >= 1" in capsys.readouterr().err
    assert main(["quality", "--model", str(tmp_path / "missing")]) == 2
    for argv in (["quality", "--kv-cache-dtype", "int3"], ["quality", "--quick", "--full"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2


def test_recall_plumbing_counts_hits_per_cell_and_group(checkpoint):
    """Random models never retrieve, so check the hit path with a stand-in engine that answers
    the needles of depth 0 correctly (and runs one on past the answer) and nothing else."""
    from types import SimpleNamespace

    from kvserve.model.tokenizer import Tokenizer
    from kvserve.quality.metrics import recall_grid, recall_groups, run_suite

    suite = build_suite(Tokenizer(checkpoint("llama_gqa")), TINY, 2048)
    suite.passages = []
    suite.items = [i for i in suite.items if i.kind != "instruction"]

    class StandIn:
        engine = SimpleNamespace(num_steps=0, has_unfinished_requests=lambda: False)

        def generate(self, prompts, params, use_tqdm=False):
            assert [p.max_tokens for p in params] == [i.max_tokens for i in suite.items]
            texts = []
            for it in suite.items:
                if it.kind == "needle" and it.meta["depth_percent"] == 0.0:
                    texts.append(it.answer + ".\n")
                else:
                    texts.append(it.answer + "7")  # the right digits, then one more: a miss
            return [SimpleNamespace(outputs=[SimpleNamespace(text=t)]) for t in texts]

    run = run_suite(StandIn(), suite)
    grid = recall_grid(suite, run.hits)
    # [hits, prompts] per cell: 10 early needles over 2 cells, 10 deeper round-robin over 4.
    assert grid == {
        "256": {"0": [5, 5], "50": [0, 3], "100": [0, 3]},
        "512": {"0": [5, 5], "50": [0, 2], "100": [0, 2]},
    }
    groups = recall_groups(suite)
    early = [run.hits[i] for i in groups["needle_depth_0_10"]]
    assert early and all(early)
    assert not any(run.hits[i] for i in groups["multi_turn"] + groups["multi_needle"])


def test_tasks_run_a_subset_with_the_whole_suites_prompts(checkpoint):
    """--tasks builds only the named groups, and each keeps the prompts the whole suite gives
    it (own seeds per prompt), at any --prompts: a larger run of one group extends the
    whole suite's group rather than drawing a new one."""
    from kvserve.model.tokenizer import Tokenizer
    from kvserve.quality.suite import TASKS

    tok = Tokenizer(checkpoint("llama_gqa"))
    whole = build_suite(tok, TINY, 2048)
    some = build_suite(tok, TINY.with_tasks(("instruction", "multi_turn")), 2048)
    assert {i.kind for i in some.items} == {"instruction", "multi_turn"}
    for kind in ("instruction", "multi_turn"):
        assert [i.prompt_ids for i in some.items if i.kind == kind] == [
            i.prompt_ids for i in whole.items if i.kind == kind
        ]
    assert some.passages == [] and TINY.with_tasks(("needle",)).passages == 0
    grown = build_suite(tok, TINY.with_tasks(("instruction",)).with_prompts(15), 2048)
    mine = [i.prompt_ids for i in whole.items if i.kind == "instruction"]
    assert len(grown.items) == 15 and [i.prompt_ids for i in grown.items[:10]] == mine
    only = build_suite(tok, TINY.with_tasks(("passages", "needle")), 2048)
    assert only.passages == whole.passages and {i.kind for i in only.items} == {"needle"}
    assert TINY.with_tasks(("passages", "needle")).tasks == ("needle", "passages")
    assert set(SuiteSpec().tasks) == set(TASKS)
    for bad, named in ((("needle", "ifeval"),), "ifeval"), (((),), "none given"):
        with pytest.raises(ConfigError, match=f"tasks: {named}; choose from needle, multi_needle"):
            TINY.with_tasks(*bad)


def test_weights_grow_some_groups_and_prompts_scales_them_all(checkpoint):
    """A weighted group is the unweighted suite's group extended (the same first prompts), and
    --prompts keeps the weights; the --prompts that decides a row is counted in the weighted
    suite's units, so the advice `--full --tasks T --prompts N` gives the group its size."""
    from kvserve.model.tokenizer import Tokenizer
    from kvserve.quality.gate import needed_by_task, needed_prompts

    tok = Tokenizer(checkpoint("llama_gqa"))
    plain = build_suite(tok, TINY, 2048)
    heavy = replace(TINY, weights=(("multi_turn", 2), ("instruction", 3)))
    suite = build_suite(tok, heavy, 2048)
    n = TINY.prompts
    counts = {k: sum(i.kind == k for i in suite.items) for k in {i.kind for i in suite.items}}
    assert counts == {"needle": 2 * n, "multi_needle": n, "variable_tracking": n,
                      "multi_turn": 2 * n, "instruction": 3 * n}  # fmt: skip
    for kind in ("multi_turn", "instruction", "needle"):
        mine = [i.prompt_ids for i in suite.items if i.kind == kind]
        theirs = [i.prompt_ids for i in plain.items if i.kind == kind]
        assert mine[: len(theirs)] == theirs
    assert heavy.with_prompts(4).prompts_of("instruction") == 12  # scaled, weights kept
    rows = [
        {"key": "recall_instruction", "verdict": INCONCLUSIVE, "needed": 60, "n": 3 * n},
        {"key": "recall_multi_turn", "verdict": INCONCLUSIVE, "needed": 50, "n": 2 * n},
        {"key": "recall_needle", "verdict": INCONCLUSIVE, "needed": 30, "n": 2 * n},
    ]
    # instruction: 60 prompts = 3 x 20; multi-turn: 50 = 2 x 25; needles: 30 = 2 x 15
    assert needed_by_task(rows, heavy) == {"instruction": 20, "multi_turn": 25, "needle": 15}
    assert needed_prompts(rows, heavy) == 25
    full = SuiteSpec.full()  # the group sizes at which fp8_e4m3 decided on SmolLM2
    assert full.name == "full" and full.lengths == SuiteSpec().lengths
    assert full.prompts_of("instruction") >= 1200 and full.prompts_of("multi_turn") >= 400
    assert full.prompts_of("multi_needle") >= 600 and full.passages == full.prompts // 4
    with pytest.raises(ConfigError, match="weights: instructions x2; tasks from needle"):
        replace(TINY, weights=(("instructions", 2),))
    with pytest.raises(ConfigError, match="weights: needle x0"):
        replace(TINY, weights=(("needle", 0),))


def test_each_report_is_handed_over_before_the_next_candidate_runs(checkpoint):
    from kvserve.quality.gate import run_gates

    model = checkpoint("llama_gqa")
    got: list[dict] = []
    seen: list[int] = []  # reports handed over when the second candidate's engine was built
    reports = run_gates(
        engine_kwargs(model),
        [{"kv_cache_dtype": "int8"}, {"kv_cache_dtype": "fp8_e4m3"}],
        TINY.with_tasks(("variable_tracking",)),
        candidate_setup=[None, lambda llm: seen.append(len(got))],
        on_report=got.append,
    )
    assert seen == [1] and got == reports
    assert [r["candidate"]["kv_format"] for r in got] == ["int8", "fp8_e4m3"]


def test_progress_log_says_how_far_and_how_long_at_most_once_a_period():
    from kvserve.quality.metrics import ProgressLog

    t = [0.0]
    said: list[str] = []
    bar = ProgressLog(10, say=said.append, label="baseline", every_s=60, clock=lambda: t[0])
    for _ in range(10):  # one prompt finishes every 30 s
        t[0] += 30
        bar.update(1)
    bar.close()
    # at 60 s: 2 done, 8 left at 30 s each; at 120 s: 4 done; ... none once all are done
    assert said == [
        "baseline: 2/10 prompts in 1.0 min, about 4.0 min left",
        "baseline: 4/10 prompts in 2.0 min, about 3.0 min left",
        "baseline: 6/10 prompts in 3.0 min, about 2.0 min left",
        "baseline: 8/10 prompts in 4.0 min, about 1.0 min left",
    ]


def test_a_subset_gate_judges_only_its_tasks(checkpoint, tmp_path, capsys):
    """Without passages there are no perplexity, agreement or KL rows (not INCONCLUSIVE rows
    of zero passages); the table and the file name say which tasks ran."""
    from kvserve.cli import main

    model = checkpoint("llama_gqa")
    argv = ["quality", "--model", model, "--quick", "--kv-cache-dtype", "int8", "--tasks",
            "variable_tracking, needle", "--json", "--out", str(tmp_path)]  # fmt: skip
    assert main(argv) == 3
    lines = capsys.readouterr().out.strip().splitlines()
    report = json.loads(lines[-1])
    keys = [m["key"] for m in report["metrics"]]
    assert keys == ["recall_needle", "recall_needle_depth_0_10", "recall_variable_tracking"]
    assert report["suite"]["tasks"] == ["needle", "variable_tracking"]
    assert report["suite"]["passages"] == 0 and report["suite"]["generation_prompts"] == 36
    assert "tasks: needle, variable_tracking only (--tasks)" in "\n".join(lines)
    assert "teacher-forced" not in "\n".join(lines)  # no passages: nothing to explain
    saved = tmp_path / "int8-quick-needle-variable_tracking.json"
    # tune reads the real report, its rows by task: a subset alone never lets int8 compete
    from kvserve.sim.tune import QualityGate

    said = QualityGate.load([str(saved)], model).verdict({"kv_cache_dtype": "int8"})
    assert said is not None and "cover only needle, variable_tracking" in said
    assert main(["quality", "--model", model, "--quick", "--kv-cache-dtype", "int8", "--tasks",
                 "needles"]) == 2  # fmt: skip
    assert "tasks: needles; choose from" in capsys.readouterr().err
