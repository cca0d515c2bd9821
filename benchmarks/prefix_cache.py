"""What automatic prefix caching buys, measured on the ~50 M parameter random Llama.

1. TTFT of a request whose 2,048-token prefix is cached vs the same request cold.
2. RAG: 8 documents of 1-2k tokens, 64 questions over them; hit rate and throughput with
   caching on vs off.
3. Multi-turn chat: each turn resends the whole history; throughput on vs off.
4. n=4 parallel sampling: peak KV blocks with prompt sharing vs 4 independent requests.
5. Allocation and hit cost per block with 1k vs 100k blocks in the pool (O(1) structures).

    .venv/bin/python -m benchmarks.prefix_cache [--quick]
"""

from __future__ import annotations

import argparse
import random
import time

from benchmarks.common import bench_model, emit, median, set_threads, table, vocab_size


def make_llm(path: str, caching: bool, **kw):
    from kvserve import LLM

    return LLM(path, dtype="float32", enable_prefix_caching=caching, max_num_seqs=64,
               max_model_len=4096, **kw)  # fmt: skip


def ttft(path: str, vocab: int, prefix_len: int, reps: int) -> tuple[float, float]:
    from kvserve import SamplingParams

    rng = random.Random(1)
    prefix = [rng.randrange(vocab) for _ in range(prefix_len)]
    one = SamplingParams(temperature=0, max_tokens=1)
    llm = make_llm(path, True, max_num_batched_tokens=4096)
    llm.generate([prefix[:64]], one)  # warm-up
    cold, warm = [], []
    for _ in range(reps):
        question = [rng.randrange(vocab) for _ in range(16)]
        llm.reset_prefix_cache()
        t0 = time.perf_counter()
        llm.generate([prefix + question], one)
        cold.append(time.perf_counter() - t0)
        question = [rng.randrange(vocab) for _ in range(16)]
        t0 = time.perf_counter()
        out = llm.generate([prefix + question], one)[0]
        warm.append(time.perf_counter() - t0)
        assert out.num_cached_tokens == (prefix_len // 16) * 16, out.num_cached_tokens
    return median(cold), median(warm)


def rag_workload(
    vocab: int, n_docs: int, n_questions: int, doc_len: tuple[int, int], seed: int = 2
):
    rng = random.Random(seed)
    docs = [[rng.randrange(vocab) for _ in range(rng.randint(*doc_len))] for _ in range(n_docs)]
    return [docs[rng.randrange(n_docs)] + [rng.randrange(vocab) for _ in range(rng.randint(16, 48))]
            for _ in range(n_questions)]  # fmt: skip


def run_batch(path: str, caching: bool, prompts, max_tokens: int, policy: str = "fcfs"):
    from kvserve import SamplingParams

    llm = make_llm(path, caching, scheduling_policy=policy)
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate([prompts[0][:32]], SamplingParams(temperature=0, max_tokens=2))
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp)
    wall = time.perf_counter() - t0
    s = llm.stats()
    hit_rate = s.prefix_cache_hits / max(1, s.prefix_cache_queries)
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    return n_out / wall, hit_rate, [o.outputs[0].token_ids for o in outs]


def multiturn(path: str, vocab: int, caching: bool, convs: int, turns: int, max_tokens: int):
    """Each turn: history (all earlier user turns and answers) + a new user message."""
    from kvserve import SamplingParams

    rng = random.Random(3)
    llm = make_llm(path, caching)
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    system = [rng.randrange(vocab) for _ in range(300)]
    histories = [list(system) for _ in range(convs)]
    n_out, t0 = 0, time.perf_counter()
    for _ in range(turns):
        for h in histories:
            h.extend(rng.randrange(vocab) for _ in range(rng.randint(40, 120)))
        outs = llm.generate([list(h) for h in histories], sp)
        for h, o in zip(histories, outs, strict=True):
            h.extend(o.outputs[0].token_ids)
            n_out += len(o.outputs[0].token_ids)
    s = llm.stats()
    return n_out / (time.perf_counter() - t0), s.prefix_cache_hits / max(1, s.prefix_cache_queries)


def parallel_sampling_blocks(path: str, vocab: int) -> tuple[int, int]:
    from kvserve import SamplingParams

    rng = random.Random(4)
    prompt = [rng.randrange(vocab) for _ in range(1000)]
    peaks = []
    for shared in (True, False):
        llm = make_llm(path, caching=shared)
        engine = llm.engine
        if shared:
            engine.add_request(
                "n4",
                prompt,
                SamplingParams(n=4, temperature=1.0, seed=0, max_tokens=32, ignore_eos=True),
            )
        else:
            for i in range(4):
                engine.add_request(
                    f"s{i}",
                    prompt,
                    SamplingParams(temperature=1.0, seed=i, max_tokens=32, ignore_eos=True),
                )
        peak = 0
        while engine.has_unfinished_requests():
            engine.step()
            peak = max(peak, engine.kv.num_used_blocks)
        peaks.append(peak)
    return peaks[0], peaks[1]  # fmt: skip


def alloc_cost(num_blocks: int, rounds: int = 2000) -> float:
    """Seconds per block for allocate + cache + free + hit-lookup cycles in a pool of
    ``num_blocks``, with the pool mostly full of cached-free blocks (the worst case)."""
    from kvserve.kv.manager import KVCacheManager
    from kvserve.sched.request import Request, SamplingParams

    bs = 16
    kv = KVCacheManager(num_blocks, bs)
    sp = SamplingParams(max_tokens=1)
    filler = Request("fill", list(range(bs * (num_blocks - 64))), sp, 1)
    kv.allocate_slots(filler, filler.num_tokens)
    filler.num_computed_tokens = filler.num_tokens
    kv.cache_computed_blocks(filler)
    kv.free(filler)  # every block now cached-free: allocation must evict from the LRU head
    rng = random.Random(5)
    t0 = time.perf_counter()
    blocks = 0
    for i in range(rounds):
        toks = [rng.randrange(50_000) for _ in range(bs * 8)]
        req = Request(str(i), toks, sp, 1)
        computed, n = kv.get_computed_blocks(req)
        kv.allocate_slots(req, req.num_tokens - n, computed)
        req.num_computed_tokens = req.num_tokens
        kv.cache_computed_blocks(req)
        kv.free(req)
        again = Request(f"{i}b", toks, sp, 1)
        computed, n = kv.get_computed_blocks(again)  # a hit on 7 cached blocks
        kv.allocate_slots(again, again.num_tokens - n, computed)
        kv.free(again)
        blocks += 16
    return (time.perf_counter() - t0) / blocks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    set_threads()
    # The full run uses the ~50 M model; --quick the ~5 M one with smaller workloads.
    size = "5m" if args.quick else "50m"
    path, vocab, q = bench_model(size), vocab_size(size), args.quick

    cold, warm = ttft(path, vocab, 2048, reps=1 if q else 3)
    docs, questions = (4, 16) if q else (8, 64)
    prompts = rag_workload(vocab, docs, questions, (500, 1000) if q else (1000, 2000))
    max_tok = 8 if q else 16
    on_tps, hit_rate, on_tokens = run_batch(path, True, prompts, max_tok)
    off_tps, _, off_tokens = run_batch(path, False, prompts, max_tok)
    assert on_tokens == off_tokens, "prefix caching changed greedy outputs"
    convs, turns = (4, 2) if q else (8, 4)
    mt_on, mt_hit = multiturn(path, vocab, True, convs, turns, max_tok * 2)
    mt_off, _ = multiturn(path, vocab, False, convs, turns, max_tok * 2)
    shared, unshared = parallel_sampling_blocks(path, vocab)
    small, large = alloc_cost(1_000, 500 if q else 2000), alloc_cost(100_000, 500 if q else 2000)

    rows = [
        {"measure": "TTFT, 2048-token prefix", "cache off": cold, "cache on": warm,
         "ratio": cold / warm},
        {"measure": f"RAG tok/s ({docs} docs, {questions} q)", "cache off": off_tps,
         "cache on": on_tps, "ratio": on_tps / off_tps},
        {"measure": "multi-turn tok/s", "cache off": mt_off, "cache on": mt_on,
         "ratio": mt_on / mt_off},
        {"measure": "n=4 peak KV blocks", "cache off": unshared, "cache on": shared,
         "ratio": shared / unshared},
        {"measure": "alloc+hit us/block 1k vs 100k", "cache off": small * 1e6,
         "cache on": large * 1e6, "ratio": large / small},
    ]  # fmt: skip
    print(table(rows, ["measure", "cache off", "cache on", "ratio"]))
    print(f"RAG hit rate {hit_rate:.3f}; multi-turn hit rate {mt_hit:.3f}")
    emit({
        "model": size,
        "ttft_speedup": round(cold / warm, 2),
        "rag_speedup": round(on_tps / off_tps, 3),
        "rag_hit_rate": round(hit_rate, 4),
        "multiturn_speedup": round(mt_on / mt_off, 3),
        "n4_block_ratio": round(shared / unshared, 3),
        "alloc_cost_ratio_100k_vs_1k": round(large / small, 3),
    })  # fmt: skip


if __name__ == "__main__":
    main()
