"""SnapKV (``--kv-retention snapkv:B``): the prompt's K/V are compacted into fresh blocks at the
end of prefill and the prompt's blocks go back to the pool; outputs equal an independent
reference built on transformers' own attention probabilities and cache; prefix caching stays
lossless for everyone else; bad combinations are refused by name."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvserve import SamplingParams
from kvserve.config import ConfigError
from kvserve.request import InvalidRequestError
from kvserve.retention import RetentionSpec, parse_retention
from tests.conftest import prompts_of_lengths

transformers = pytest.importorskip("transformers")

BUDGET, OBS, KERNEL = 16, 8, 7
SPEC = f"snapkv:{BUDGET},obs:{OBS},kernel:{KERNEL}"
NEW = 24
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
LENGTHS = [20, 40, 90, 128]  # 20 <= budget + obs: nothing to compact


def snapkv_reference(path: str, prompt: list[int], n_new: int) -> list[int]:
    """Greedy tokens of transformers' eager Llama whose cache, after the prompt, holds per
    layer and KV head only the entries SnapKV picks from transformers' own attention
    probabilities; decoding then continues at RoPE positions past the prompt."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    )
    p = len(prompt)
    with torch.no_grad():
        out = hf(torch.tensor([prompt]), output_attentions=True, use_cache=True)
    if p <= BUDGET + OBS:
        cache, kept = out.past_key_values, p
    else:
        cache, kept = transformers.DynamicCache(), BUDGET + OBS
        for i, att in enumerate(out.attentions):  # att [1, heads, p, p]
            keys, values = _layer_kv(out.past_key_values, i)
            kvh, heads = keys.shape[1], att.shape[1]
            vote = att[0, :, p - OBS :, : p - OBS].sum(1).view(kvh, heads // kvh, -1).sum(1)
            vote = F.avg_pool1d(vote[:, None], KERNEL, stride=1, padding=KERNEL // 2)[:, 0]
            top = vote.topk(BUDGET, dim=-1).indices.sort(-1).values
            idx = torch.cat([top, torch.arange(p - OBS, p).expand(kvh, OBS)], -1)
            g = idx[None, :, :, None].expand(1, kvh, kept, keys.shape[-1])
            cache.update(keys.gather(2, g), values.gather(2, g), i)
    tok = int(out.logits[0, -1].argmax())
    toks = [tok]
    for t in range(n_new - 1):
        with torch.no_grad():
            o = hf(torch.tensor([[tok]]), position_ids=torch.tensor([[p + t]]),
                   cache_position=torch.tensor([kept + t]), past_key_values=cache)  # fmt: skip
        tok = int(o.logits[0, -1].argmax())
        toks.append(tok)
    return toks


def _layer_kv(cache, i: int) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ANN001
    """Layer ``i``'s [1, KVH, S, D] keys and values of a transformers cache (either API)."""
    if hasattr(cache, "layers"):
        return cache.layers[i].keys, cache.layers[i].values
    return cache.key_cache[i], cache.value_cache[i]


@pytest.fixture(scope="module")
def llama(checkpoint):
    return checkpoint("llama_gqa")


@pytest.fixture(scope="module")
def reference(llama):
    prompts = prompts_of_lengths(LENGTHS, seed=11)
    return prompts, [snapkv_reference(llama, p, NEW) for p in prompts]


def tokens(llm, prompts, params=GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


# -- exactness --------------------------------------------------------------------------------
@pytest.mark.parametrize("budget", [2048, 36])  # one chunk; chunks that split the prompt
def test_snapkv_equals_a_transformers_reference(llama, make_llm, reference, budget):
    prompts, expected = reference
    full = tokens(make_llm(llama, dtype="float32", block_size=8), prompts)
    assert full[1:] != expected[1:], "the compaction must change the output, or this proves nothing"
    assert full[0] == expected[0]  # a prompt within the budget keeps everything
    llm = make_llm(llama, dtype="float32", block_size=8, kv_retention=SPEC,
                   max_num_batched_tokens=budget)  # fmt: skip
    assert tokens(llm, prompts) == expected
    dropped = sum(n - BUDGET - OBS for n in LENGTHS if n > BUDGET + OBS)
    assert llm.engine.stats().retention_evicted_tokens == {SPEC: dropped}


def test_snapkv_under_preemption_and_per_request(llama, make_llm, reference):
    prompts, expected = reference
    # 24 blocks of 8 and chunks of 36 tokens: one request's prefill takes the blocks another
    # needs to decode, so requests are preempted and recomputed (compacted again at their
    # prompt's end, then their outputs recomputed over the compacted cache).
    llm = make_llm(llama, dtype="float32", block_size=8, num_gpu_blocks=24,
                   max_num_batched_tokens=36, enable_prefix_caching=False)  # fmt: skip
    assert tokens(llm, prompts, GREEDY.clone(kv_retention=SPEC)) == expected
    assert llm.engine.scheduler.num_preemptions > 0


# -- memory -----------------------------------------------------------------------------------
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3", "int8"])
def test_prompt_blocks_return_to_the_pool(llama, make_llm, kv_cache_dtype):
    prompt = prompts_of_lengths([200], seed=3)[0]
    llm = make_llm(llama, dtype="float32", block_size=8, kv_retention=SPEC,
                   kv_cache_dtype=kv_cache_dtype, enable_prefix_caching=False)  # fmt: skip
    eng = llm.engine
    eng.add_request("r", prompt, GREEDY.clone(max_tokens=40))
    used, outs = [], []
    while eng.has_unfinished_requests():
        outs += eng.step()
        used.append(eng.kv.num_used_blocks)
    # The first step prefills 200 tokens and compacts them to 24 entries (3 blocks); each
    # decode step j adds one entry: after it, 24 + j entries in ceil((24 + j) / 8) blocks.
    assert used[0] == 3
    assert used[1:-1] == [-(-(24 + j) // 8) for j in range(1, 39)]
    assert used[-1] == 0
    last = [o for o in outs if o.finished][0]
    assert (last.num_retained_tokens, last.num_seen_tokens) == (24 + 39, 200 + 39)


def test_kivi_is_refused_by_name(llama, make_llm):
    with pytest.raises(ConfigError, match="kv_retention: snapkv with kv_cache_dtype kivi4"):
        make_llm(llama, dtype="float32", kv_cache_dtype="kivi4", kv_retention=SPEC)
    llm = make_llm(llama, dtype="float32", kv_cache_dtype="kivi2")
    with pytest.raises(InvalidRequestError, match="kivi2") as e:
        llm.generate([[1, 2, 3]], GREEDY.clone(kv_retention=SPEC))
    assert e.value.field == "kv_retention"
    llm.generate([[1, 2, 3]], GREEDY.clone(kv_retention="window:32"))  # dropping blocks works


# -- prefix caching ---------------------------------------------------------------------------
def test_prefix_caching_stays_lossless_and_shares_the_exact_prompt(llama, make_llm, reference):
    prompts, expected = reference
    shared = prompts[3]
    others = [shared[:64] + p for p in prompts_of_lengths([9, 33], seed=6)]
    alone = tokens(make_llm(llama, dtype="float32", block_size=8), others)
    llm = make_llm(llama, dtype="float32", block_size=8)
    snap = GREEDY.clone(kv_retention=SPEC)
    first = llm.generate([shared], snap)[0]
    assert first.outputs[0].token_ids == expected[3]
    # Its prompt blocks were computed with full attention: an exact request may read them.
    mixed = llm.generate([shared, *others], [snap, GREEDY, GREEDY])
    assert [o.outputs[0].token_ids for o in mixed[1:]] == alone
    assert all(o.num_cached_tokens >= 64 for o in mixed[1:])
    # The second SnapKV request hits its prompt but recomputes the observation window.
    assert mixed[0].outputs[0].token_ids == expected[3]
    assert 0 < mixed[0].num_cached_tokens <= len(shared) - OBS


def test_parallel_samples_share_the_compacted_cache(llama, make_llm):
    prompt = prompts_of_lengths([100], seed=2)[0]
    llm = make_llm(llama, dtype="float32", block_size=8, kv_retention=SPEC)
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=16, ignore_eos=True)
    out = llm.generate([prompt], params)[0]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    # Sample 0 alone, with its seed, draws the same tokens from the same compacted cache.
    one = llm.generate([prompt], params.clone(n=1))[0]
    assert one.outputs[0].token_ids == out.outputs[0].token_ids


# -- bad input --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "spec, words",
    [
        ("snapkv:8", "at least the block size (16)"),
        ("snapkv:64,obs:0", "obs: the observation window must be in [1, 1024]"),
        ("snapkv:64,kernel:4", "kernel: the pooling width must be odd"),
        ("snapkv:64,window:8", "snapkv takes kernel, obs, snapkv, not window"),
        ("snapkv:150%", "[1%, 100%]"),
    ],
)
def test_bad_snapkv_specs_are_refused_by_name(llama, make_llm, spec, words):
    with pytest.raises(ConfigError, match="kv_retention") as e:
        make_llm(llama, dtype="float32", kv_retention=spec)
    assert words in str(e.value)
    llm = make_llm(llama, dtype="float32")
    with pytest.raises(InvalidRequestError) as e:
        llm.generate([[1, 2, 3]], GREEDY.clone(kv_retention=spec))
    assert e.value.field == "kv_retention" and words in str(e.value)
    assert llm.engine.kv.num_used_blocks == 0 and not llm.engine.has_unfinished_requests()


def test_refused_combinations(checkpoint, llama, make_llm):
    with pytest.raises(ConfigError, match="snapkv on a model with its own sliding window"):
        make_llm(checkpoint("mistral_swa"), dtype="float32", kv_retention=SPEC)
    llm = make_llm(llama, dtype="float32", kv_retention=SPEC)
    with pytest.raises(InvalidRequestError, match="prompt_logprobs: not available") as e:
        llm.generate([[1, 2, 3]], GREEDY.clone(prompt_logprobs=1))
    assert e.value.field == "prompt_logprobs"
    assert llm.engine.kv.num_used_blocks == 0


def test_percent_budget():
    spec = parse_retention("snapkv:25%")
    assert spec.text() == "snapkv:25%"
    # A quarter of 400 tokens is 100 kept: the observation window (32) and 68 chosen.
    assert spec.for_prompt(400, 16) == RetentionSpec(
        "snapkv", budget=68, obs=32, kernel=7, label="snapkv:25%"
    )
    assert spec.for_prompt(40, 16).budget == 16  # at least a block
    assert not spec.for_prompt(40, 16).compacts_prompt(40)
