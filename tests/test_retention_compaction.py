"""Retention that compacts the cache: SnapKV (``snapkv:B``: the prompt's kept K/V are copied
into fresh blocks at the end of prefill) and H2O (``h2o:B``: heavy hitters by accumulated
attention mass plus recent entries, compacted whenever a block's worth is over budget). The
prompt's or old blocks go back to the pool; outputs equal independent references built on
transformers' own attention probabilities and cache; prefix caching stays lossless for
everyone else; bad combinations are refused by name."""

from __future__ import annotations

import httpx
import pytest
import torch
import torch.nn.functional as F

from kvserve import LLM, SamplingParams, kernels
from kvserve.config import ConfigError
from kvserve.sched.request import InvalidRequestError
from kvserve.sched.retention import RetentionSpec, parse_retention
from kvserve.server.app import BackgroundServer, build_state
from tests.conftest import prompts_of_lengths
from tests.test_retention import decode_and_watch

transformers = pytest.importorskip("transformers")

BUDGET, OBS, KERNEL = 16, 8, 7
SPEC = f"snapkv:{BUDGET},obs:{OBS},kernel:{KERNEL}"
H2O_BUDGET, RECENT, BS = 24, 8, 8
H2O = f"h2o:{H2O_BUDGET},recent:{RECENT}"
NEW = 24
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
LENGTHS = [20, 40, 90, 128]  # 20 <= budget + obs: nothing to compact


def snapkv_reference(path: str, prompt: list[int], n_new: int) -> list[int]:
    """Greedy tokens of transformers' eager Llama whose cache, after the prompt, holds per
    layer and KV head only the entries SnapKV picks from transformers' own attention
    probabilities; decoding then continues at RoPE positions past the prompt."""
    hf = _model_kv(path)
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


def _model_kv(path: str):  # noqa: ANN202 - a transformers model
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    )


def h2o_reference(path: str, prompt: list[int], n_new: int, chunk: int) -> list[int]:
    """Greedy tokens of transformers' eager Llama fed ``chunk`` prompt tokens at a time, then
    one token at a time, over a cache rebuilt per step from per-head K/V lists: every entry
    accumulates the attention probabilities transformers returns (summed over queries and
    each KV head's query heads), and whenever more than budget + a block entries remain, each
    head keeps its RECENT newest entries and the heaviest others."""
    hf = _model_kv(path)
    layers = hf.config.num_hidden_layers
    keys: list[torch.Tensor | None] = [None] * layers
    values: list[torch.Tensor | None] = [None] * layers
    mass: list[torch.Tensor | None] = [None] * layers
    tokens, pos, entries, out = list(prompt), 0, 0, []
    while len(out) < n_new:
        m = min(chunk, len(prompt) - pos) if pos < len(prompt) else 1
        cache = None
        if entries:
            cache = transformers.DynamicCache()
            for i in range(layers):
                cache.update(keys[i], values[i], i)
        with torch.no_grad():
            o = hf(torch.tensor([tokens[pos : pos + m]]),
                   position_ids=torch.arange(pos, pos + m)[None],
                   cache_position=torch.arange(entries, entries + m), past_key_values=cache,
                   output_attentions=True, use_cache=True)  # fmt: skip
        for i in range(layers):
            keys[i], values[i] = _layer_kv(o.past_key_values, i)
            att = o.attentions[i][0]  # [heads, m, entries + m]
            kvh = keys[i].shape[1]
            vote = att.sum(1).view(kvh, att.shape[0] // kvh, -1).sum(1)
            old = mass[i] if mass[i] is not None else torch.zeros(kvh, 0)
            mass[i] = torch.cat([old, torch.zeros(kvh, m)], 1) + vote
        pos, entries = pos + m, entries + m
        if entries > H2O_BUDGET + BS:
            for i in range(layers):
                kvh = keys[i].shape[1]
                heavy = mass[i][:, : entries - RECENT].topk(H2O_BUDGET - RECENT, -1).indices
                recent = torch.arange(entries - RECENT, entries).expand(kvh, RECENT)
                idx = torch.cat([heavy.sort(-1).values, recent], -1)
                g = idx[None, :, :, None].expand(1, kvh, H2O_BUDGET, keys[i].shape[-1])
                keys[i], values[i] = keys[i].gather(2, g), values[i].gather(2, g)
                mass[i] = mass[i].gather(1, idx)
            entries = H2O_BUDGET
        if pos >= len(prompt):
            tok = int(o.logits[0, -1].argmax())
            tokens.append(tok)
            out.append(tok)
    return out


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
    used, last = decode_and_watch(llm, prompt, 40)
    # The first step prefills 200 tokens and compacts them to 24 entries (3 blocks); each
    # decode step j adds one entry: after it, 24 + j entries in ceil((24 + j) / 8) blocks.
    assert used[0] == 3
    assert used[1:-1] == [-(-(24 + j) // 8) for j in range(1, 39)]
    assert used[-1] == 0
    assert (last.num_retained_tokens, last.num_seen_tokens) == (24 + 39, 200 + 39)


@pytest.mark.parametrize("spec", [SPEC, H2O])
def test_kivi_is_refused_by_name(llama, make_llm, spec):
    kind = spec.split(":")[0]
    with pytest.raises(ConfigError, match=f"kv_retention: {kind} with kv_cache_dtype kivi4"):
        make_llm(llama, dtype="float32", kv_cache_dtype="kivi4", kv_retention=spec)
    llm = make_llm(llama, dtype="float32", kv_cache_dtype="kivi2")
    with pytest.raises(InvalidRequestError, match="kivi2") as e:
        llm.generate([[1, 2, 3]], GREEDY.clone(kv_retention=spec))
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
def test_refused_combinations(checkpoint, llama, make_llm):
    with pytest.raises(ConfigError, match="snapkv on a model with its own sliding window"):
        make_llm(checkpoint("mistral_swa"), dtype="float32", kv_retention=SPEC)
    with pytest.raises(ConfigError, match="h2o on a model with its own sliding window"):
        make_llm(checkpoint("mistral_swa"), dtype="float32", kv_retention=H2O)
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
    h2o = parse_retention("h2o:50%")
    assert h2o.text() == "h2o:50%"
    assert h2o.for_prompt(400, 16) == RetentionSpec("h2o", budget=200, label="h2o:50%")
    assert h2o.for_prompt(400, 16).num_recent == 50  # a quarter of the budget by default


# -- H2O --------------------------------------------------------------------------------------
# Whole prompts, and chunks that compact mid-prompt; decode mass from the fused kernel's side
# output, and from the reference path's explicit probabilities (no kernels).
@pytest.mark.parametrize("chunk, fused", [(2048, True), (36, True), (2048, False)])
def test_h2o_equals_a_transformers_reference(llama, make_llm, chunk, fused, monkeypatch):
    if not fused:
        monkeypatch.setattr(kernels, "DISABLED", True)
    prompts = prompts_of_lengths([20, 90, 128], seed=11)
    expected = [h2o_reference(llama, p, 40, chunk) for p in prompts]
    full = tokens(
        make_llm(llama, dtype="float32", block_size=BS), prompts, GREEDY.clone(max_tokens=40)
    )
    assert all(f != e for f, e in zip(full, expected, strict=True)), "eviction must matter"
    llm = make_llm(llama, dtype="float32", block_size=BS, kv_retention=H2O,
                   max_num_batched_tokens=chunk)  # fmt: skip
    # One request at a time, so that each one's chunks are exactly ``chunk`` tokens.
    got = [tokens(llm, [p], GREEDY.clone(max_tokens=40))[0] for p in prompts]
    assert got == expected
    assert llm.engine.stats().retention_reclaimed_blocks > 0


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3", "int8"])
def test_h2o_holds_its_budget_while_decoding(llama, make_llm, kv_cache_dtype):
    prompt = prompts_of_lengths([60], seed=3)[0]
    llm = make_llm(llama, dtype="float32", block_size=BS, kv_retention=H2O,
                   kv_cache_dtype=kv_cache_dtype, enable_prefix_caching=False)  # fmt: skip
    used, last = decode_and_watch(llm, prompt, 120)
    # Between compactions a sequence holds budget (24) + up to a block (8) + the new entry:
    # at most ceil(33 / 8) = 5 blocks, and never fewer than the budget's 3.
    assert max(used[:-1]) <= 5 and min(used[:-1]) >= 3
    assert used[-1] == 0
    assert last.num_seen_tokens == 60 + 119
    assert H2O_BUDGET <= last.num_retained_tokens <= H2O_BUDGET + BS


def test_h2o_under_preemption_parallel_samples_and_prefix_cache(llama, make_llm):
    prompts = prompts_of_lengths([90, 128, 100, 70], seed=11)
    llm = make_llm(llama, dtype="float32", block_size=BS, num_gpu_blocks=20,
                   max_num_batched_tokens=36)  # fmt: skip
    outs = llm.generate(prompts, GREEDY.clone(kv_retention=H2O))
    assert [len(o.outputs[0].token_ids) for o in outs] == [NEW] * 4
    assert llm.engine.scheduler.num_preemptions > 0
    # The prompts are in the prefix cache now, but H2O needs every prompt query's mass.
    again = llm.generate(prompts[:1], GREEDY.clone(kv_retention=H2O))[0]
    assert again.num_cached_tokens == 0
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=40, ignore_eos=True,
                            kv_retention=H2O)  # fmt: skip
    out = llm.generate(prompts[:1], params)[0]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    one = llm.generate(prompts[:1], params.clone(n=1))[0]  # sample 0 keeps its mass
    assert one.outputs[0].token_ids == out.outputs[0].token_ids


# -- HTTP -------------------------------------------------------------------------------------
def test_http_usage_and_metrics(llama):
    llm = LLM(llama, dtype="float32", block_size=BS, max_model_len=256)
    state = build_state(llm.engine, ["m"])
    body = {"model": "m", "prompt": prompts_of_lengths([60], seed=2)[0], "max_tokens": 20,
            "temperature": 0, "ignore_eos": True}  # fmt: skip
    with BackgroundServer(state) as srv:
        snap = httpx.post(srv.url + "/v1/completions", json={**body, "kv_retention": SPEC},
                          timeout=60)  # fmt: skip
        h2o = httpx.post(srv.url + "/v1/completions", json={**body, "kv_retention": H2O},
                         timeout=60)  # fmt: skip
        bad = httpx.post(srv.url + "/v1/completions",
                         json={**body, "kv_retention": "h2o:64,recent:64"}, timeout=60)  # fmt: skip
        metrics = httpx.get(srv.url + "/metrics").text
    assert snap.status_code == 200 and h2o.status_code == 200, (snap.text, h2o.text)
    # SnapKV keeps budget + window of the 60 prompt tokens, then every output but the last.
    assert snap.json()["usage"]["kv_retention"] == {"retained_tokens": 24 + 19, "seen_tokens": 79}
    kept = h2o.json()["usage"]["kv_retention"]
    assert kept["seen_tokens"] == 79 and H2O_BUDGET <= kept["retained_tokens"] <= H2O_BUDGET + BS
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "kv_retention"
    assert "recent: must be below the budget" in bad.json()["error"]["message"]
    for policy in (SPEC, H2O):
        assert f'kvserve:kv_retention_evicted_tokens_total{{policy="{policy}"}}' in metrics
