"""Automatic prefix caching is lossless, isolates tenants and accounts its hits."""

from __future__ import annotations

from kvserve import SamplingParams, kernels
from tests.conftest import prompts_of_lengths

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def _shared_prefix_prompts():
    (system,) = prompts_of_lengths([70], seed=21)
    tails = prompts_of_lengths([5, 19, 33, 2, 48], seed=22)
    prompts = [system + t for t in tails]
    prompts.append(system[:37])  # an exact prefix of every other prompt
    prompts.append(system)  # exactly the shared prefix (block aligned: 70 = 4*16 + 6)
    return prompts


def test_outputs_identical_with_and_without_caching(checkpoint, make_llm):
    path = checkpoint("llama_gqa")
    prompts = _shared_prefix_prompts()
    off = make_llm(path, dtype="float32", enable_prefix_caching=False)
    expected = _tokens(off.generate(prompts, GREEDY))
    on = make_llm(path, dtype="float32", enable_prefix_caching=True)
    first = on.generate(prompts, GREEDY)
    again = on.generate(prompts, GREEDY)  # now with full and partial hits
    assert _tokens(first) == expected
    assert _tokens(again) == expected
    assert all(o.num_cached_tokens > 0 for o in again)
    assert again[-2].num_cached_tokens == 32  # 37 tokens: two full blocks of 16 cached
    # A prompt that is exactly cached still computes its last token (last block recomputed).
    assert again[-1].num_cached_tokens == 64
    s = on.stats()
    assert s.prefix_cache_hits > 0 and s.prefix_cache_queries >= s.prefix_cache_hits


def test_hits_after_eviction_and_under_preemption(checkpoint, make_llm):
    path = checkpoint("llama_gqa")
    prompts = _shared_prefix_prompts()
    off = make_llm(path, dtype="float32", enable_prefix_caching=False)
    expected = _tokens(off.generate(prompts, GREEDY))
    # A pool this small forces preemption and evicts cached blocks between the rounds.
    on = make_llm(path, dtype="float32", num_gpu_blocks=14, max_num_batched_tokens=48)
    assert _tokens(on.generate(prompts, GREEDY)) == expected
    other = prompts_of_lengths([150], seed=99)
    on.generate(other, GREEDY)  # churns the pool: some cached blocks get evicted
    assert _tokens(on.generate(prompts, GREEDY)) == expected
    s = on.stats()
    assert s.num_preemptions > 0
    assert s.prefix_cache_evictions > 0
    assert s.prefix_cache_hits > 0


def test_salts_isolate_tenants(checkpoint, make_llm):
    llm = make_llm(checkpoint("llama_gqa"), dtype="float32")
    (prompt,) = prompts_of_lengths([80], seed=5)
    a1 = llm.generate([{"prompt_token_ids": prompt, "cache_salt": "tenant-a"}], GREEDY)[0]
    b1 = llm.generate([{"prompt_token_ids": prompt, "cache_salt": "tenant-b"}], GREEDY)[0]
    a2 = llm.generate([{"prompt_token_ids": prompt, "cache_salt": "tenant-a"}], GREEDY)[0]
    none = llm.generate([prompt], GREEDY)[0]
    assert a1.num_cached_tokens == 0
    assert b1.num_cached_tokens == 0, "tenant B hit tenant A's blocks"
    assert a2.num_cached_tokens == 64
    assert none.num_cached_tokens == 0, "an unsalted request hit a salted block"
    assert a1.outputs[0].token_ids == b1.outputs[0].token_ids == a2.outputs[0].token_ids


def test_salted_requests_share_no_block(checkpoint, make_llm):
    llm = make_llm(checkpoint("llama_gqa"), dtype="float32")
    engine = llm.engine
    (prompt,) = prompts_of_lengths([64], seed=6)
    engine.add_request("a", {"prompt_token_ids": prompt, "cache_salt": "A"}, GREEDY)
    engine.step()  # computes and caches A's prompt blocks
    engine.add_request("b", {"prompt_token_ids": prompt, "cache_salt": "B"}, GREEDY)
    engine.add_request("a2", {"prompt_token_ids": prompt, "cache_salt": "A"}, GREEDY)
    engine.step()
    blocks = {rid: set(engine.kv.block_ids(engine.requests[rid])) for rid in ("a", "b", "a2")}
    assert not blocks["a"] & blocks["b"]
    assert len(blocks["a"] & blocks["a2"]) == 3  # 63 of 64 tokens may hit: 3 full blocks
    while engine.has_unfinished_requests():
        engine.step()


def test_reset_prefix_cache(checkpoint, make_llm):
    llm = make_llm(checkpoint("llama_gqa"), dtype="float32")
    (prompt,) = prompts_of_lengths([50], seed=7)
    llm.generate([prompt], GREEDY)
    assert llm.stats().kv_cached_free_blocks > 0
    assert llm.reset_prefix_cache()
    assert llm.stats().kv_cached_free_blocks == 0
    assert llm.generate([prompt], GREEDY)[0].num_cached_tokens == 0


def test_lpm_prefers_cached_prefix_but_never_starves(checkpoint, make_llm):
    path = checkpoint("llama_gqa")
    llm = make_llm(path, dtype="float32", scheduling_policy="lpm", max_num_seqs=1)
    engine = engine_ = llm.engine
    engine_.scheduler.config.lpm_max_skips = 2
    (doc,) = prompts_of_lengths([64], seed=8)
    llm.generate([doc + [1, 2]], GREEDY)  # warm the cache with `doc`
    cold = prompts_of_lengths([40, 41, 42], seed=9)
    order = []
    engine.add_request("cold0", cold[0], GREEDY)
    engine.add_request("cold1", cold[1], GREEDY)
    for i in range(4):
        engine.add_request(f"warm{i}", doc + [3 + i], GREEDY)
    while engine.has_unfinished_requests():
        for req in list(engine.scheduler.running):
            if req.request_id not in order:
                order.append(req.request_id)
        engine.step()
    # Warm requests jump the queue, but cold0 waits at most lpm_max_skips admissions.
    assert order[0].startswith("warm")
    assert order.index("cold0") <= 2
    fcfs = make_llm(path, dtype="float32", max_num_seqs=1)
    assert fcfs.engine.scheduler.config.scheduling_policy == "fcfs"


def test_parallel_sampling_shares_prompt_blocks(checkpoint, make_llm):
    path = checkpoint("llama_gqa")
    (prompt,) = prompts_of_lengths([100], seed=10)
    p = SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=8, ignore_eos=True)
    shared = make_llm(path, dtype="float32", enable_prefix_caching=False)
    engine = shared.engine
    engine.add_request("x", prompt, p)
    peak = 0
    while engine.has_unfinished_requests():
        engine.step()
        peak = max(peak, engine.kv.num_used_blocks)
    # 4 samples of 100 + 8 tokens: 7 blocks each unshared (28); shared: 6 full prompt blocks
    # once, plus each sample's private copy of the partial block (4) -> 10.
    assert peak <= 11, peak
    n1 = SamplingParams(temperature=1.0, seed=3, max_tokens=8, ignore_eos=True)
    alone = make_llm(path, dtype="float32").generate([prompt], n1)[0].outputs[0].token_ids
    out = shared.generate([prompt], p)[0]
    assert out.outputs[0].token_ids == alone  # sample 0 uses the request seed itself


def test_narrow_dense_cache_with_hits_and_reference_path(checkpoint, make_llm, monkeypatch):
    """A bfloat16 cache under a float32 model, through the plain-PyTorch path (no kernel):
    gathered blocks are cast to the compute dtype, and hits give the same tokens."""
    monkeypatch.setattr(kernels, "DISABLED", True)
    (system,) = prompts_of_lengths([40], seed=31)
    prompts = [system + [1, 2, 3], system + [4, 5]]
    llm = make_llm(checkpoint("llama_gqa"), dtype="float32", kv_cache_dtype="bfloat16")
    first = _tokens(llm.generate(prompts, GREEDY))
    again = llm.generate(prompts, GREEDY)
    assert all(o.num_cached_tokens == 32 for o in again)
    assert _tokens(again) == first


def test_block_hash_chain_matches_its_byte_definition():
    """Tier keys outlive a process (disk, Redis): the chain is SHA-256 over the parent hash
    and the block's ids as little-endian int64, the tenant salt after the first block's ids,
    however the tokens arrive (whole, or extended as a request grows)."""
    import hashlib
    import random

    from kvserve.kv.hashing import extend_block_hashes

    def naive(tokens: list[int], bs: int, root: bytes, salt: str | None) -> list[bytes]:
        out, parent = [], root
        for i in range(len(tokens) // bs):
            data = b"".join(t.to_bytes(8, "little", signed=True) for t in tokens[i * bs :][:bs])
            if i == 0 and salt:
                data += b"\0salt\0" + salt.encode()
            parent = hashlib.sha256(parent + data).digest()
            out.append(parent)
        return out

    rng = random.Random(5)
    root = hashlib.sha256(b"root").digest()
    for salt in (None, "tenant-a"):
        tokens = [rng.randrange(-3, 150_000) for _ in range(203)]
        grown: list = []
        for end in (7, 16, 17, 90, 203):  # below one block, exact blocks, partial tails
            extend_block_hashes(grown, tokens[:end], 16, root, salt)
        whole: list = []
        extend_block_hashes(whole, tokens, 16, root, salt)
        assert whole == grown == naive(tokens, 16, root, salt)
        assert len(whole) == 12
    other: list = []
    extend_block_hashes(other, tokens, 16, root, "tenant-b")
    assert other[0] != whole[0]
