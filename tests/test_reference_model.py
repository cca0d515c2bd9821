"""The bundled reference model loads in transformers and the shared task generators behave.

The generators are what the quality gate and the trainer agree on, so determinism, length
targeting and needle placement are tested against the bundled tokenizer itself.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvserve.model.resolve import bundled_model_dir
from kvserve.quality import tasks as T

MODEL_DIR = bundled_model_dir()


@pytest.fixture(scope="module")
def hf_tok():
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(MODEL_DIR))


@pytest.fixture(scope="module")
def count(hf_tok):
    def count(text: str) -> int:
        return len(hf_tok(text, add_special_tokens=not text.startswith(T.BOS)).input_ids)

    return count


def test_tokenizer_and_chat_template(hf_tok):
    ids = hf_tok("The pass code for silver falcon is 1234567.").input_ids
    assert ids[0] == hf_tok.bos_token_id
    toks = hf_tok.convert_ids_to_tokens(ids)
    assert toks[-8:] == list("1234567.")  # digits one per token
    msgs = [{"role": "user", "content": "Hi there."}, {"role": "assistant", "content": "Noted."}]
    rendered = hf_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert rendered == T.render_chat(msgs, True)
    assert rendered.startswith(T.BOS) and rendered.endswith("<|assistant|>\n")
    assert len(hf_tok) <= 8192


def test_generators_are_deterministic(count):
    for make in (
        lambda s: T.needle_prompt(s, 400, 30, count),
        lambda s: T.multi_needle_prompt(s, 400, count),
        lambda s: T.variable_tracking_prompt(s, 400, count),
        lambda s: T.multi_turn_prompt(s, 400, count),
    ):
        a, b, c = make(5), make(5), make(6)
        assert (a.prompt, a.answer) == (b.prompt, b.answer)
        assert a.prompt != c.prompt


@pytest.mark.parametrize("target", [128, 512, 2048])
def test_generators_hit_requested_length(count, target):
    for i, p in enumerate(
        [T.needle_prompt(i, target, d, count) for i, d in enumerate((0, 5, 50, 100))]
        + [
            T.multi_needle_prompt(1, target, count),
            T.variable_tracking_prompt(2, target, count),
            T.multi_turn_prompt(3, max(target, 256), count),
        ]
    ):
        want = max(target, 256) if p.kind == "multi_turn" else target
        assert abs(count(p.prompt) - want) <= T.length_tolerance(want), (i, p.kind, count(p.prompt))
    with pytest.raises(ValueError, match="context_tokens"):
        T.multi_turn_prompt(3, 64, count)


def test_needle_depth_and_answer_boundary(hf_tok):
    def count(text: str) -> int:
        return len(hf_tok(text).input_ids)

    first = T.needle_prompt(11, 1024, 0, count)
    key = first.meta["key"]
    assert first.prompt.startswith(T.needle_sentence(key, first.answer.strip()))
    last = T.needle_prompt(11, 1024, 100, count)
    assert last.prompt.split("\nQuestion:")[0].endswith(T.needle_sentence(key, last.answer.strip()))
    mid = T.needle_prompt(12, 1024, 50, count)
    pos = mid.prompt.index(T.needle_sentence(mid.meta["key"], mid.answer.strip()))
    assert 0.4 < pos / len(mid.prompt) < 0.6
    ids = hf_tok(first.prompt).input_ids
    assert hf_tok(first.prompt + first.answer).input_ids[: len(ids)] == ids


def test_heldout_split_is_disjoint():
    train, held = set(T.haystack_sentences("train")), set(T.haystack_sentences("heldout"))
    assert len(held) > 1000 and len(train) > 5 * len(held)
    assert not train & held
    names = [n for n, _ in T.corpus_documents()]
    assert names == sorted(names) and any(T.is_heldout(n) for n in names)


@pytest.fixture(scope="module")
def hf_model():
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(MODEL_DIR), dtype=torch.float32
    ).eval()


def test_files_config_and_size():
    names = {p.name for p in MODEL_DIR.iterdir()}
    for need in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "generation_config.json",
        "README.md",
    ):
        assert need in names, need
    assert sum(p.stat().st_size for p in MODEL_DIR.iterdir()) <= 25 * 1024 * 1024
    cfg = json.loads((MODEL_DIR / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    assert cfg["num_key_value_heads"] < cfg["num_attention_heads"]  # GQA
    assert cfg["max_position_embeddings"] >= 4096
    assert cfg["torch_dtype"] == "float32"


def test_safetensors_names_are_hf_llama():
    from safetensors import safe_open

    cfg = json.loads((MODEL_DIR / "config.json").read_text())
    with safe_open(str(MODEL_DIR / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    want = {"model.embed_tokens.weight", "model.norm.weight"}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        want |= {p + f"self_attn.{x}_proj.weight" for x in "qkvo"}
        want |= {p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")}
        want |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
    if not cfg["tie_word_embeddings"]:
        want.add("lm_head.weight")
    assert keys == want


def test_model_recalls_needles_at_every_depth(hf_tok, hf_model, count):
    """Teacher-forced greedy check in transformers (independent of our engine) on eight 512-token
    prompts with the needle at depths 0-100 %: a random, untrained or broken export scores 0."""
    ok = 0
    for i, depth in enumerate((0, 5, 10, 25, 50, 75, 90, 100)):
        p = T.needle_prompt(100 + i, 512, depth, count)
        ids = hf_tok(p.prompt).input_ids
        full = hf_tok(p.prompt + p.answer).input_ids
        with torch.inference_mode():
            logits = hf_model(torch.tensor([full])).logits[0]
        ok += logits[len(ids) - 1 : -1].argmax(-1).tolist() == full[len(ids) :]
    assert ok >= 7, ok


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--mix", "needles:1"], "unknown document kind 'needles'"),
        (["--mix", "kv_doc:x"], "weight of kv_doc must be a number > 0"),
        (["--mix", "kv_doc:0"], "weight of kv_doc must be > 0"),
        (["--curriculum", "64-1"], "--curriculum: expected LEN:SHARE"),
        (["--curriculum", "64:0"], "shares > 0"),
        (["--steps", "100", "--stop-after", "200"], "--stop-after must be in [1, --steps=100]"),
        (["--stop-when", "needles:0.5"], "--stop-when: unknown document kind 'needles'"),
        (["--stop-when", "repeat_doc:high"], "accuracy must be a number in (0, 1]"),
        (["--stop-when", "repeat_doc:1.5"], "accuracy must be in (0, 1], got 1.5"),
        (["--flush-denormal=yes"], "argument --flush-denormal/--no-flush-denormal"),
        (
            ["--init-from", "/nonexistent/ckpt.pt"],
            "--init-from: no ckpt.pt file or model directory",
        ),
    ],
)
def test_trainer_rejects_bad_options_naming_them(argv, message, capsys, monkeypatch):
    trainer = _load_script("train_reference_model", monkeypatch)
    with pytest.raises(SystemExit) as exc:
        trainer.main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def _load_script(name: str, monkeypatch):
    import importlib.util
    import sys

    path = Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_recipe_chains_phases_and_every_phase_parses(tmp_path, monkeypatch, capsys):
    """Each phase starts from the previous phase's export, only the last one writes --out, and
    every phase's options pass the trainer's own validation (parsed, not trained)."""
    recipe = _load_script("train_reference_recipe", monkeypatch)
    trainer = _load_script("train_reference_model", monkeypatch)
    work, out = tmp_path / "w", tmp_path / "final"
    argvs = [
        recipe.phase_argv(i, name, extra, work, out, 2)
        for i, (name, extra) in enumerate(recipe.PHASES)
    ]

    def value(argv, flag):
        return argv[argv.index(flag) + 1] if flag in argv else None

    assert value(argvs[0], "--init-from") is None
    for prev, cur in zip(argvs, argvs[1:], strict=False):
        assert value(cur, "--init-from") == value(prev, "--out")
    assert value(argvs[-1], "--out") == str(out)
    assert all(value(a, "--out") != str(out) for a in argvs[:-1])
    assert len({value(a, "--work-dir") for a in argvs}) == len(argvs)
    for argv in argvs:  # --stop-after 0 is refused after the other checks, so nothing trains
        with pytest.raises(SystemExit):
            trainer.main(argv + ["--stop-after", "0"])
        assert "--stop-after must be in [1" in capsys.readouterr().err


def test_recipe_rejects_bad_threads(capsys, monkeypatch):
    recipe = _load_script("train_reference_recipe", monkeypatch)
    with pytest.raises(SystemExit) as exc:
        recipe.main(["--threads", "0"])
    assert exc.value.code == 2
    assert "--threads must be >= 1, got 0" in capsys.readouterr().err


def test_recipe_report_sums_minutes_and_samples_the_curve(tmp_path, monkeypatch):
    recipe = _load_script("train_reference_recipe", monkeypatch)
    hist = [
        {"step": s, "seq_len": 64, "tokens": s * 512, "min": s / 100, "text": 3.0, "kv_doc": 0.5}
        for s in range(100, 1100, 100)
    ]
    for i in (0, 2):  # phases 1 and 3 have run, phase 2 has not
        name = recipe.PHASES[i][0]
        (tmp_path / f"{i + 1}-{name}").mkdir()
        (tmp_path / f"{i + 1}-{name}" / "history.json").write_text(json.dumps(hist))
    text = recipe.report(tmp_path, points=2)
    assert f"| 1 {recipe.PHASES[0][0]} | 1,000 | 0.5 M | 10.0 |" in text
    assert f"| 2 {recipe.PHASES[1][0]} |" not in text
    assert "| all | | | 20.0 |" in text
    rows = [ln for ln in text.splitlines() if ln.startswith("| 3 | ")]
    assert [r.split(" | ")[1] for r in rows] == ["500", "1,000"]  # the middle line and the last
    assert rows[-1].endswith("| 3.00 | - | 0.50 | - | - | - | - | - |")
