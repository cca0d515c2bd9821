"""``kvserve quality --quick`` on the bundled reference model, the CI use of the gate.

Unlike a random model, the bundled one retrieves, so a corrupted cache must show up as a recall
drop too, not only in agreement and KL.
"""

from __future__ import annotations

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


def test_quick_exact_baseline_passes():
    report = run_gate(KW, SuiteSpec.quick())
    assert report["passed"], report["metrics"]
    assert metric(report, "top1_agreement")["candidate"] == 1.0
    assert metric(report, "mean_kl")["candidate"] == 0.0
    assert metric(report, "recall_needle")["n"] >= 12
    assert report["answers_identical"] == 1.0
    assert report["suite"]["chat_template"] == "model"


def test_quick_corrupted_cache_fails_with_a_recall_drop():
    if not _committed():  # an untrained model attends almost uniformly: nothing to break
        pytest.skip("bundled weights are a training run's work in progress (not committed)")
    # Zeroing the newest half of each sequence's cache blocks removes the question's context.
    report = run_gate(
        KW, SuiteSpec.quick(), candidate_setup=lambda llm: wrap_kv_storage(llm, ZeroSecondHalf)
    )
    assert not report["passed"]
    needle = metric(report, "recall_needle")
    assert needle["baseline"] >= 0.6, "the bundled model should retrieve with the exact cache"
    assert needle["baseline"] - needle["candidate"] >= 0.5
    assert not needle["passed"]
    assert metric(report, "top1_agreement")["candidate"] < 0.9
    assert metric(report, "mean_kl")["candidate"] > 0.1
