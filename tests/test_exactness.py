"""Greedy output equals Hugging Face transformers token for token (float32), with the model in
the engine's process (``uni``) and in a worker process (``mp``)."""

from __future__ import annotations

import pytest
import torch

from kvserve import SamplingParams
from tests.conftest import TEST_DEVICE, prompts_of_lengths

transformers = pytest.importorskip("transformers")

LENGTHS = [5, 17, 31, 40, 64, 3, 90, 128]
NEW_TOKENS = 64


def hf_greedy(path: str, prompts: list[list[int]], n: int, **load: object) -> list[list[int]]:
    """transformers' greedy tokens; ``load`` goes to ``from_pretrained`` (e.g. a config)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **load)
    model.to(TEST_DEVICE)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p], device=TEST_DEVICE)
            g = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                               max_new_tokens=n)  # fmt: skip
            outs.append(g[0, len(p) :].tolist())
    return outs


_hf_cache: dict[str, list[list[int]]] = {}


def reference(checkpoint, name: str) -> tuple[str, list[list[int]], list[list[int]]]:
    path = checkpoint(name)
    prompts = prompts_of_lengths(LENGTHS, seed=11)
    if name not in _hf_cache:
        _hf_cache[name] = hf_greedy(path, prompts, NEW_TOKENS)
    return path, prompts, _hf_cache[name]


# Every test below runs under both executors: the worker process must change nothing.
EXECUTORS = pytest.mark.parametrize("executor", ["uni", "mp"])


def generate(llm, prompts):
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


@EXECUTORS
@pytest.mark.parametrize(
    "name",
    ["llama_gqa", "llama_mha", "llama_mqa", "llama3_rope", "llama_linear_rope", "qwen2",
     "mistral_swa"],
)  # fmt: skip
def test_greedy_matches_transformers(checkpoint, make_llm, name, executor):
    path, prompts, expected = reference(checkpoint, name)
    assert len({tuple(e[:8]) for e in expected}) > 4, "reference outputs are not diverse"
    assert all(len(set(e)) > 8 for e in expected), "a reference output repeats one token"
    llm = make_llm(path, dtype="float32", enable_prefix_caching=False,
                   distributed_executor_backend=executor)  # fmt: skip
    assert generate(llm, prompts) == expected


@EXECUTORS
@pytest.mark.parametrize("name", ["llama_gqa", "mistral_swa", "qwen2"])
def test_chunked_prefill_small_budget(checkpoint, make_llm, name, executor):
    path, prompts, expected = reference(checkpoint, name)
    llm = make_llm(path, dtype="float32", max_num_batched_tokens=32, block_size=8,
                   distributed_executor_backend=executor)  # fmt: skip
    assert generate(llm, prompts) == expected
    assert llm.stats().num_steps > 0


# 8 sequences need ~ (sum(prompt) + 8*64)/16 ~ 55 blocks; 24 forces preemption. Mistral's
# 24-token window frees blocks behind it, so each sequence holds at most ~7: 8 forces it.
@EXECUTORS
@pytest.mark.parametrize("name, blocks", [("llama_gqa", 24), ("mistral_swa", 8)])
def test_preemption_keeps_outputs_exact(checkpoint, make_llm, name, blocks, executor):
    path, prompts, expected = reference(checkpoint, name)
    llm = make_llm(path, dtype="float32", num_gpu_blocks=blocks, max_num_batched_tokens=64,
                   distributed_executor_backend=executor)  # fmt: skip
    assert generate(llm, prompts) == expected
    assert llm.stats().num_preemptions > 0


def test_block_sizes(checkpoint, make_llm):
    path, prompts, expected = reference(checkpoint, "llama_gqa")
    for bs in (1, 4, 64):
        llm = make_llm(path, dtype="float32", block_size=bs)
        assert generate(llm, prompts[:3]) == expected[:3], f"block_size={bs}"
