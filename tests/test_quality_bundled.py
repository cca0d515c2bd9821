"""``kvserve quality --quick`` on the bundled reference model, the CI use of the gate.

Unlike a random model, the bundled one retrieves, so a corrupted cache must show up as a recall
drop too, not only in agreement and KL.
"""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
import torch

from kvserve.model.resolve import bundled_model_dir
from kvserve.quality.gate import run_gate, wrap_kv_storage
from kvserve.quality.suite import SuiteSpec
from tests.test_quality import ZeroSecondHalf, metric

MODEL_DIR = bundled_model_dir()

pytestmark = pytest.mark.skipif(
    not (MODEL_DIR / "config.json").exists(), reason=f"no bundled model in {MODEL_DIR}"
)


def _committed() -> bool:
    """Whether the weights are the committed ones (not a training run's work in progress);
    True outside a git checkout (an installed package holds only released weights)."""
    if shutil.which("git") is None:
        return True
    inside = subprocess.run(
        ["git", "rev-parse", "--is-inside-work-tree"], cwd=MODEL_DIR, capture_output=True
    )
    if inside.returncode != 0:
        return True
    out = subprocess.run(
        ["git", "ls-files", "--error-unmatch", "model.safetensors"],
        cwd=MODEL_DIR,
        capture_output=True,
    )
    return out.returncode == 0


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


KW = dict(model=str(MODEL_DIR), max_num_batched_tokens=64, max_num_seqs=16)


def test_quick_snapkv_is_not_passed_on_a_suite_that_cannot_show_it(tmp_path, capsys):
    """The case that started the three verdicts: SnapKV with a 512-token budget on the quick
    suite once printed PASS while losing answers. Twelve prompts per group cannot show a loss
    within 5 points, whatever the candidate does: never PASS."""
    from kvserve.cli import main

    argv = ["quality", "--kv-retention", "snapkv:512", "--quick", "--json", "--out",
            str(tmp_path)]  # fmt: skip
    code = main(argv)
    out = capsys.readouterr().out
    report = json.loads(out.strip().splitlines()[-1])
    assert code in (1, 3) and report["verdict"] in ("FAIL", "INCONCLUSIVE")
    assert "quality gate: PASS" not in out and "| PASS" not in out
    needle = metric(report, "recall_needle")
    assert needle["n"] == 24 and needle["verdict"] != "PASS"


def test_quick_identical_candidate_is_inconclusive_not_pass():
    """With a do-nothing setup hook the candidate is the baseline: every answer identical,
    agreement 100 %, KL 0 exactly; still only INCONCLUSIVE on the quick suite."""
    report = run_gate(KW, SuiteSpec.quick(), candidate_setup=lambda llm: None)
    assert report["verdict"] == "INCONCLUSIVE", report["metrics"]
    assert metric(report, "teacher_forced_agreement")["candidate"] == 1.0
    assert metric(report, "mean_kl")["candidate"] == 0.0
    assert metric(report, "recall_needle")["n"] == 24
    assert report["greedy_answers_identical"] == 1.0
    assert report["suite"]["chat_template"] == "model"
    assert all(m["verdict"] != "FAIL" for m in report["metrics"])


def test_quick_corrupted_cache_fails_with_a_recall_drop():
    if not _committed():  # an untrained model attends almost uniformly: nothing to break
        pytest.skip("bundled weights are a training run's work in progress (not committed)")
    # Zeroing the newest half of each sequence's cache blocks removes the question's context.
    report = run_gate(
        KW, SuiteSpec.quick(), candidate_setup=lambda llm: wrap_kv_storage(llm, ZeroSecondHalf)
    )
    assert report["verdict"] == "FAIL"
    needle = metric(report, "recall_needle")
    assert needle["baseline"] >= 0.6, "the bundled model should retrieve with the exact cache"
    assert needle["baseline"] - needle["candidate"] >= 0.5
    assert needle["verdict"] == "FAIL" and needle["interval"][0] > 0.05
    assert metric(report, "teacher_forced_agreement")["candidate"] < 0.95
    assert metric(report, "mean_kl")["candidate"] > 0.1
