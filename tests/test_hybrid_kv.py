"""Hybrid models (full-attention and sliding-window layers): a block table per layer group over
one pool. The window groups' blocks go back to the pool as sequences advance, outputs stay
equal to transformers token for token, and the bytes are the ones a single table would use."""

from __future__ import annotations

import json
import math
from pathlib import Path

import httpx
import pytest

from kvserve import SamplingParams
from kvserve.kv.hashing import extend_block_hashes
from kvserve.kv.layer_groups import LayerGroups
from kvserve.plan.validate import owned_tensor_bytes
from kvserve.server.app import BackgroundServer, build_state
from tests.conftest import prompts_of_lengths
from tests.test_exactness import hf_greedy
from tests.test_server import scrape

transformers = pytest.importorskip("transformers")

NEW = 48
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
PROMPTS = prompts_of_lengths([5, 40, 90, 128], seed=11)
WINDOW = 24


def tokens(llm, prompts, params=GREEDY):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


@pytest.fixture(scope="module")
def hybrid(checkpoint, tmp_path_factory):
    """hybrid(layers, full) -> a Qwen2 checkpoint whose first ``full`` layers attend
    everything and the others a 24-token window (``max_window_layers``)."""
    made: dict[tuple[int, int], str] = {}

    def get(layers: int, full: int) -> str:
        if (layers, full) not in made:
            src = Path(checkpoint("qwen2", sliding_window=WINDOW, num_layers=layers))
            dst = tmp_path_factory.mktemp(f"hybrid{layers}_{full}")
            for f in src.iterdir():
                (dst / f.name).write_bytes(f.read_bytes())
            cfg = json.loads((dst / "config.json").read_text())
            cfg["max_window_layers"] = full
            (dst / "config.json").write_text(json.dumps(cfg))
            made[layers, full] = str(dst)
        return made[layers, full]

    return get


_refs: dict[str, list[list[int]]] = {}


def reference(path: str) -> list[list[int]]:
    if path not in _refs:
        _refs[path] = hf_greedy(path, PROMPTS, NEW)
    return _refs[path]


# -- grouping -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "windows",
    [
        (None, None, 24, 24),
        (None, 24, 24),
        (24, None) * 3,
        (24, 24, 24, 24, 24, None) * 2,  # Gemma-3's 5:1
        (None, 64, 64, 32, 32, None),  # two windows
    ],
)
def test_groups_partition_the_layers(windows):
    groups = LayerGroups.of(windows)
    assert groups is not None
    counts = {w: windows.count(w) for w in set(windows)}
    n = math.gcd(*counts.values())
    assert groups.num_slots == n
    assert sorted(x for g in groups.layers for x in g) == list(range(len(windows)))
    for w, members in zip(groups.windows, groups.layers, strict=True):
        assert len(members) == n and all(windows[x] == w for x in members)
    assert groups.num_groups == len(windows) // n
    if None in windows:
        assert groups.windows[0] is None, "group 0 attends everything when any layer does"
    for layer, (g, s) in enumerate(zip(groups.group_of, groups.slot_of, strict=True)):
        assert groups.layers[g][s] == layer


@pytest.mark.parametrize("windows", [(None, None), (24, 24, 24), ()])
def test_one_table_when_every_layer_is_alike(windows):
    assert LayerGroups.of(windows) is None


# -- exactness ----------------------------------------------------------------------------------
@pytest.mark.parametrize("layers, full", [(4, 2), (3, 1)])
@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"max_num_batched_tokens": 32, "block_size": 8},  # chunked prefill past the window
        {"num_gpu_blocks": 17, "block_size": 8, "max_num_batched_tokens": 64},  # preempts
    ],
)
def test_greedy_matches_transformers_while_freeing(hybrid, make_llm, layers, full, kw):
    path = hybrid(layers, full)
    expected = reference(path)
    llm = make_llm(path, dtype="float32", **kw)
    groups = llm.engine.layer_groups
    assert groups is not None and groups.windows[0] is None
    assert tokens(llm, PROMPTS) == expected
    s = llm.engine.stats()
    assert s.window_freed_blocks > 0
    if "num_gpu_blocks" in kw:
        # The longest request alone needs 22 blocks of 8 with one table for every layer.
        assert s.num_preemptions > 0


def test_the_window_matters(hybrid):
    """Without its windows the checkpoint answers otherwise: the exactness above checks
    that the window layers really read only their window."""
    path = hybrid(4, 2)
    raw = json.loads((Path(path) / "config.json").read_text())
    raw = {k: v for k, v in raw.items() if k not in ("architectures", "model_type")}
    cfg = transformers.Qwen2Config(**{**raw, "max_window_layers": 4})
    assert set(cfg.layer_types) == {"full_attention"}
    assert hf_greedy(path, PROMPTS, NEW, config=cfg) != reference(path)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "int8"])
def test_quantized_formats_match_one_table(hybrid, make_llm, kv_cache_dtype):
    path = hybrid(4, 2)
    kw = dict(dtype="float32", block_size=8, kv_cache_dtype=kv_cache_dtype)
    grouped = make_llm(path, **kw)
    single = make_llm(path, disable_hybrid_kv_cache_manager=True, **kw)
    assert grouped.engine.layer_groups is not None and single.engine.layer_groups is None
    assert tokens(grouped, PROMPTS) == tokens(single, PROMPTS)
    assert grouped.engine.stats().window_freed_blocks > 0


def test_parallel_samples_share_every_group(hybrid, make_llm):
    path = hybrid(4, 2)
    llm = make_llm(path, dtype="float32", block_size=8)
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, n=3)
    out = llm.generate(PROMPTS[1:3], params)
    for o, want in zip(out, reference(path)[1:3], strict=True):
        assert [c.token_ids for c in o.outputs] == [want] * 3


# -- memory -------------------------------------------------------------------------------------
def watch(llm, prompt, max_tokens):
    eng = llm.engine
    eng.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                ignore_eos=True))  # fmt: skip
    used = []
    while eng.has_unfinished_requests():
        eng.step()
        used.append((eng.requests["r"].num_computed_tokens if "r" in eng.requests else None,
                     eng.kv.pool.num_used_blocks))  # fmt: skip
    return used


def test_window_groups_give_blocks_back(hybrid, make_llm):
    path = hybrid(4, 2)
    prompt = prompts_of_lengths([40], seed=3)[0]
    kw = dict(dtype="float32", block_size=8, enable_prefix_caching=False, num_gpu_blocks=40)
    rows = watch(make_llm(path, **kw), prompt, 160)
    assert rows[-1] == (None, 0)
    for c, used in rows[:-1]:
        # Group 0 (full) holds a block per 8 entries; group 1 (window 24) at most the
        # window's 3 blocks, the block a query starts in and the one being filled.
        assert used <= -(-c // 8) + 24 // 8 + 2, (c, used)
    c, used = rows[-2]
    assert c == 40 + 158 and used >= -(-c // 8) + 24 // 8  # the window's blocks are held
    single = make_llm(path, disable_hybrid_kv_cache_manager=True, **kw)
    _, peak = watch(single, prompt, 160)[-2]
    assert peak == -(-(40 + 159) // 8), "one table: a block per 8 entries, all kept"
    # In layer-blocks (bytes): a grouped block holds 2 layers, a single-table block all 4.
    assert used * 2 <= 0.6 * peak * 4
    assert single.engine.stats().window_freed_blocks == 0


def test_same_bytes_as_one_table(hybrid, make_llm):
    """The pool of a grouped engine owns the bytes of the same number of whole-model blocks;
    its layers of different groups share slot tensors, its layers of one group never do."""
    path = hybrid(4, 2)
    kw = dict(dtype="float32", block_size=8, num_gpu_blocks=64)
    grouped, single = make_llm(path, **kw), make_llm(path, disable_hybrid_kv_cache_manager=True,
                                                     **kw)  # fmt: skip
    g, s = (
        grouped.engine.executor.driver_worker.storage,
        single.engine.executor.driver_worker.storage,
    )
    layer_bytes = 2 * 2 * 8 * 16 * 4  # K and V, 2 KV heads, 8 entries, head dim 16, float32
    assert owned_tensor_bytes(s) == 4 * layer_bytes * (64 + 1)
    # Two groups of two layers: 128 blocks of two layers, plus the null block.
    assert owned_tensor_bytes(g) == 2 * layer_bytes * (2 * 64 + 1)
    assert grouped.engine.kv.num_blocks == single.engine.kv.num_blocks == 64
    ptr = [t.data_ptr() for t in g.k]
    assert ptr[0] == ptr[2] and ptr[1] == ptr[3] and ptr[0] != ptr[1]


def test_longer_requests_fit_than_with_one_table(hybrid, make_llm):
    """A request whose full-length table would not fit is accepted when the window group's
    share is bounded, and refused (naming max_tokens) with one table."""
    path = hybrid(4, 2)
    prompt = prompts_of_lengths([40], seed=3)[0]
    kw = dict(dtype="float32", block_size=8, num_gpu_blocks=16, max_num_batched_tokens=32)
    params = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)  # 20 blocks
    single = make_llm(path, disable_hybrid_kv_cache_manager=True, **kw)
    with pytest.raises(ValueError, match="max_tokens"):
        single.generate([prompt], params)
    out = make_llm(path, **kw).generate([prompt], params)[0]
    assert len(out.outputs[0].token_ids) == 120


# -- prefix caching -----------------------------------------------------------------------------
def test_prefix_hits_in_every_group(hybrid, make_llm):
    path = hybrid(4, 2)
    shared = prompts_of_lengths([64], seed=5)[0]
    prompts = [shared + p for p in prompts_of_lengths([9, 20, 33], seed=6)]
    alone = tokens(make_llm(path, dtype="float32", block_size=8, enable_prefix_caching=False),
                   prompts)  # fmt: skip
    llm = make_llm(path, dtype="float32", block_size=8)
    first = llm.generate(prompts[:1], GREEDY)[0]
    rest = llm.generate(prompts[1:], GREEDY)
    assert [first.outputs[0].token_ids] + [o.outputs[0].token_ids for o in rest] == alone
    assert all(o.num_cached_tokens == 64 for o in rest)


# -- what stays on one table --------------------------------------------------------------------
def test_one_table_where_groups_do_not_apply(hybrid, make_llm, tmp_path):
    path = hybrid(4, 2)
    kivi = make_llm(path, dtype="float32", kv_cache_dtype="kivi4")
    assert kivi.engine.layer_groups is None  # KIVI bounds its partial blocks
    tiered = make_llm(path, dtype="float32", kv_offload_cpu="64MiB")
    assert tiered.engine.layer_groups is None
    grouped = make_llm(path, dtype="float32")
    grouped.generate(PROMPTS[:1], GREEDY)
    with pytest.raises(RuntimeError, match="disable_hybrid_kv_cache_manager"):
        grouped.engine.export_prefix(PROMPTS[0])


def test_window_groups_hit_without_their_evicted_early_blocks(hybrid, make_llm):
    """A window group's blocks behind its window go back to the pool first, so they are the
    first evicted; a later request with the same prefix still hits it whole, since the window
    group needs only the blocks its next query reaches (the rest of its table is null)."""
    path = hybrid(4, 2)
    a = prompts_of_lengths([96], seed=21)[0]
    b = a + prompts_of_lengths([10], seed=22)[0]
    kw = dict(dtype="float32", block_size=8, num_gpu_blocks=20)
    llm = make_llm(path, **kw)
    llm.generate([a], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    kv = llm.engine.kv
    never_used = kv.pool.num_free_blocks - kv.pool.num_cached_free
    # A prefill-only request that takes every never-used block and 4 more: the 4 blocks
    # freed first, the window group's blocks 0-3 of the prefix.
    other = prompts_of_lengths([(never_used + 4) // 2 * 8 - 1], seed=23)[0]
    llm.generate([other], SamplingParams(temperature=0, max_tokens=1))
    hashes: list = []
    extend_block_hashes(hashes, a, 8, kv.root)
    assert kv.subs[1].pool.get_cached_block(hashes[0]) is None, "window block 0 evicted"
    assert all(kv.subs[0].pool.get_cached_block(h) is not None for h in hashes[:12])
    out = llm.generate([b], GREEDY)[0]
    assert out.num_cached_tokens == 96
    plain = make_llm(path, enable_prefix_caching=False, **kw)
    assert out.outputs[0].token_ids == tokens(plain, [b])[0]


def test_served_over_http_with_the_freed_blocks_in_metrics(hybrid, make_llm):
    """`kvserve serve` on a hybrid model: the same tokens as transformers over HTTP, the
    layer groups in the cache config and the freed blocks counted in /metrics."""
    path = hybrid(4, 2)
    llm = make_llm(path, dtype="float32", block_size=8)
    state = build_state(llm.engine, ["m"])
    body = {"model": "m", "prompt": PROMPTS[3], "max_tokens": NEW, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    with BackgroundServer(state) as srv:
        r = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)
        metrics = scrape(srv.url)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == llm.engine.tokenizer.decode(reference(path)[3])
    info = dict(next(k for k in metrics if k[0] == "vllm:cache_config_info")[1])
    assert info["kv_layer_groups"] == "2"
    assert metrics[("kvserve:kv_window_freed_blocks_total", ())] > 0
