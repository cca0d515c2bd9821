"""The quality gate's mechanics on tiny random checkpoints.

Random models cannot retrieve (their recall is 0 on both sides), so what these tests can see is
agreement, KL and perplexity: the exact baseline must match itself bit for bit, a lossy format
must be visible (the gate really reads the stored cache), and a corrupted cache must fail.
"""

from __future__ import annotations

import json

import pytest
import torch

from kvserve.kv.storage import KVStorageWrapper
from kvserve.quality.gate import Thresholds, run_gate, wrap_kv_storage
from kvserve.quality.metrics import LogitComparison, passage_nll
from kvserve.quality.suite import SuiteSpec, answers_match, build_suite

TINY = SuiteSpec(
    lengths=(256, 512),
    depths=(0.0, 50.0, 100.0),
    tokens_per_cell=512,
    min_per_cell=1,
    multi_needle=1,
    multi_needle_length=384,
    multi_turn=1,
    multi_turn_length=768,
    variable_tracking=1,
    variable_tracking_length=256,
    ppl_passages=2,
    ppl_length=384,
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


def test_logit_comparison_counts_agreement_and_kl():
    base = torch.log_softmax(torch.tensor([[2.0, 0.0, 0.0], [0.0, 3.0, 0.0]]), -1)
    cand = torch.log_softmax(torch.tensor([[2.0, 0.0, 0.0], [0.0, 0.0, 3.0]]), -1)
    cmp = LogitComparison()
    cmp.add(base, base)
    assert cmp.agreement == 1.0 and cmp.mean_kl == 0.0
    cmp.add(base, cand)
    assert cmp.positions == 4 and cmp.agree == 3
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
    assert len(needles) == 3 * 2 + 3 * 1  # per_cell: 512 // 256 = 2, 512 // 512 = 1
    for it in needles:  # fitted to the target length in this tokenizer
        assert abs(len(it.prompt_ids) - it.meta["context_tokens"]) <= 16
    kinds = {i.kind for i in a.items}
    assert kinds == {"needle", "multi_needle", "multi_turn", "variable_tracking"}
    assert a.chat_template == "model" and not a.skipped
    # A model with a short context skips what does not fit, and says so.
    short = build_suite(tok, TINY, 400)
    assert "needle@512" in short.skipped and "multi_turn@768" in short.skipped
    assert {i.meta.get("context_tokens") for i in short.items if i.kind == "needle"} == {256}


def test_exact_baseline_passes_against_itself(checkpoint):
    model = checkpoint("llama_gqa")
    engines = []
    report = run_gate(engine_kwargs(model), TINY, candidate_setup=lambda llm: engines.append(llm))
    assert report["passed"], report["metrics"]
    assert metric(report, "top1_agreement")["candidate"] == 1.0
    assert metric(report, "mean_kl")["candidate"] == 0.0  # bit-identical, not just close
    ppl = metric(report, "perplexity")
    assert ppl["candidate"] == ppl["baseline"] and ppl["n"] > 500
    assert report["answers_identical"] == 1.0
    # Same requests, same pool, same scheduler: the same batches step for step.
    assert report["steps"]["baseline"] == report["steps"]["candidate"]
    assert report["cache_reads"]["min_share_of_prompt_positions"] > 0.85
    engine = engines[0].engine
    engine.kv.check_invariants()
    assert engine.kv.num_used_blocks == 0
    json.dumps(report)  # the whole report is JSON-serialisable


def test_corrupted_cache_fails_the_gate(checkpoint):
    model = checkpoint("llama_gqa")
    report = run_gate(
        engine_kwargs(model), TINY, candidate_setup=lambda llm: wrap_kv_storage(llm, ZeroFirstHalf)
    )
    assert not report["passed"]
    agree, kl = metric(report, "top1_agreement"), metric(report, "mean_kl")
    assert not agree["passed"] and agree["candidate"] < 0.6
    assert not kl["passed"] and kl["candidate"] > 0.1
    assert report["answers_identical"] < 0.5


def test_lossy_format_is_seen_through_the_stored_cache(checkpoint):
    """int8 changes the logits only where attention reads the stored cache: KL > 0 shows the
    gate's chunked prefill really exercises the format; the format itself stays close."""
    model = checkpoint("llama_gqa")
    report = run_gate(engine_kwargs(model, kv_cache_dtype="int8"), TINY)
    assert report["candidate"]["kv_format"] == "int8"
    assert report["baseline"]["kv_format"] == "float32"
    kl = metric(report, "mean_kl")["candidate"]
    assert 0.0 < kl < 0.05
    assert metric(report, "top1_agreement")["candidate"] > 0.9


def test_thresholds_are_validated():
    with pytest.raises(ValueError, match="min_agreement"):
        Thresholds(min_agreement=1.5)
    with pytest.raises(ValueError, match="max_kl"):
        Thresholds(max_kl=-1.0)


def test_cli_quick_exit_codes_json_and_files(checkpoint, tmp_path, capsys):
    from kvserve.cli import main

    model = checkpoint("llama_gqa")
    out = tmp_path / "q"
    assert main(["quality", "--model", model, "--quick", "--json", "--out", str(out)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    report = json.loads(lines[-1])
    assert report["passed"] and report["quick"]
    table = "\n".join(lines[:-1])
    assert "quality gate: PASS" in table and "next-token top-1 agreement" in table
    saved = json.loads((out / "auto-quick.json").read_text())
    assert saved["metrics"] == report["metrics"]
    pytest.importorskip("matplotlib")
    assert (out / "auto-quick-recall.png").stat().st_size > 1000

    # A lossy format held to impossible thresholds fails with exit code 1.
    argv = ["quality", "--model", model, "--quick", "--kv-cache-dtype", "kivi2", "--max-kl", "0",
            "--out", str(out)]  # fmt: skip
    assert main(argv) == 1
    assert "quality gate: FAIL" in capsys.readouterr().out
    assert (out / "kivi2-quick.json").exists()

    # Several formats against one baseline run: one report each, the baseline once.
    argv = ["quality", "--model", model, "--quick", "--formats", "float16,int8", "--out",
            str(out / "many")]  # fmt: skip
    assert main(argv) == 0
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
    assert main(["quality", "--model", model, "--alpha", "1.5"]) == 2
    assert "alpha: must be in (0, 1)" in capsys.readouterr().err
    assert main(["quality", "--model", str(tmp_path / "missing")]) == 2
    with pytest.raises(SystemExit) as e:
        main(["quality", "--kv-cache-dtype", "int3"])
    assert e.value.code == 2


def test_recall_plumbing_counts_hits_per_cell_and_group(checkpoint):
    """Random models never retrieve, so check the hit path with a stand-in engine that answers
    the needles of depth 0 correctly (and runs one on past the answer) and nothing else."""
    from types import SimpleNamespace

    from kvserve.model.tokenizer import Tokenizer
    from kvserve.quality.metrics import recall_grid, recall_groups, run_suite

    suite = build_suite(Tokenizer(checkpoint("llama_gqa")), TINY, 2048)
    suite.passages = []

    class StandIn:
        engine = SimpleNamespace(num_steps=0, has_unfinished_requests=lambda: False)

        def generate(self, prompts, params):
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
    assert grid == {
        "256": {"0": 1.0, "50": 0.0, "100": 0.0},
        "512": {"0": 1.0, "50": 0.0, "100": 0.0},
    }
    groups = recall_groups(suite)
    early = [run.hits[i] for i in groups["needle_depth_0_10"]]
    assert early and all(early)
    assert not any(run.hits[i] for i in groups["multi_turn"] + groups["multi_needle"])
