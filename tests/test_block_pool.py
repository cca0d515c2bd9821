"""Property tests of the block pool and KV cache manager under random operations."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.kv.block_pool import BlockPool
from kvserve.kv.manager import KVCacheManager
from kvserve.sched.request import Request, SamplingParams

BS = 4

op = st.one_of(
    st.tuples(st.just("add"), st.integers(0, 3), st.integers(1, 30)),  # prefix family, length
    st.tuples(st.just("grow"), st.integers(0, 50), st.integers(1, 9)),  # request index, tokens
    st.tuples(st.just("free"), st.integers(0, 50)),
    st.tuples(st.just("fork"), st.integers(0, 50)),
    st.tuples(st.just("reset")),
)


def _request(rid: str, family: int, length: int) -> Request:
    # Requests of one family share a token prefix, so the prefix cache gets hits.
    tokens = [family * 1000 + i for i in range(length)]
    return Request(rid, tokens, SamplingParams(max_tokens=64), max_tokens=64)


@settings(max_examples=150, deadline=None)
@given(st.lists(op, max_size=60), st.booleans(), st.integers(4, 24))
def test_manager_invariants(ops, caching, num_blocks):
    kv = KVCacheManager(num_blocks, BS, enable_caching=caching)
    live: list[Request] = []
    hashes_in_use: dict[int, bytes] = {}
    counter = 0
    for o in ops:
        if o[0] == "add":
            counter += 1
            req = _request(str(counter), o[1], o[2])
            computed, n_cached = kv.get_computed_blocks(req)
            assert n_cached < req.num_tokens, "at least one token must be computed"
            assert n_cached % BS == 0
            if kv.allocate_slots(req, req.num_tokens - n_cached, computed):
                req.num_computed_tokens = req.num_tokens
                kv.cache_computed_blocks(req)
                live.append(req)
        elif o[0] == "grow" and live:
            req = live[o[1] % len(live)]
            new = [7] * o[2]
            if kv.allocate_slots(req, len(new)):
                req.all_token_ids.extend(new)
                req.num_computed_tokens = req.num_tokens
                kv.cache_computed_blocks(req)
        elif o[0] == "free" and live:
            kv.free(live.pop(o[1] % len(live)))
        elif o[0] == "fork" and live:
            parent = live[o[1] % len(live)]
            counter += 1
            child = Request(str(counter), parent.prompt_token_ids, parent.sampling_params, 64)
            child.all_token_ids = list(parent.all_token_ids)
            kv.fork(parent, child)
            child.num_computed_tokens = parent.num_computed_tokens
            live.append(child)
        elif o[0] == "reset":
            assert kv.reset_prefix_cache() == (kv.pool.num_used_blocks == 0)

        kv.check_invariants()
        pool = kv.pool
        assert all(b.ref_cnt >= 0 for b in pool.blocks)
        cached_free = sum(1 for b in pool.free_queue if b.block_hash is not None)
        never_used = pool.num_free_blocks - cached_free
        assert never_used + cached_free + pool.num_used_blocks == num_blocks
        # A block in use keeps its hash: it is never evicted or rehashed while referenced.
        for b in pool.blocks:
            if b.ref_cnt > 0 and b.block_id in hashes_in_use:
                assert b.block_hash == hashes_in_use[b.block_id]
        hashes_in_use = {
            b.block_id: b.block_hash for b in pool.blocks if b.ref_cnt > 0 and b.block_hash
        }
        if not caching:
            assert not pool.cached and pool.num_cached_free == 0
    for req in live:
        kv.free(req)
    kv.check_invariants()
    assert kv.pool.num_used_blocks == 0


def test_lru_order_evicts_tail_first():
    pool = BlockPool(6)
    blocks = pool.get_new_blocks(3)
    for i, b in enumerate(blocks):
        pool.cache_block(b, bytes([i]) * 32)
    pool.free_blocks(reversed(blocks))  # a request's blocks, tail first
    # Never-used blocks go first, then the freed request's tail block, its head last.
    order = [b.block_id for b in pool.free_queue]
    assert order == [3, 4, 5, blocks[2].block_id, blocks[1].block_id, blocks[0].block_id]
    fresh = pool.get_new_blocks(4)
    assert fresh[-1] is blocks[2] and blocks[2].block_hash is None
    assert pool.num_evictions == 1
    assert pool.get_cached_block(bytes([0]) * 32) is blocks[0]


def test_uncached_blocks_are_reused_before_fresh_or_cached_ones():
    # Without prefix caching, request after request gets the same blocks back: the pool
    # never walks on into blocks it has not written yet.
    pool = BlockPool(100, enable_caching=False)
    first = pool.get_new_blocks(5)
    pool.free_blocks(reversed(first))
    again = pool.get_new_blocks(5)
    assert [b.block_id for b in again] == [0, 1, 2, 3, 4]
    # With caching: a freed block that holds no hash is taken before a never-used block and
    # before the cached one, which stays findable by its hash.
    pool = BlockPool(6)
    cached, partial = pool.get_new_blocks(2)
    pool.cache_block(cached, b"\x01" * 32)
    pool.free_blocks([partial, cached])
    assert [b.block_id for b in pool.free_queue] == [partial.block_id, 2, 3, 4, 5,
                                                     cached.block_id]  # fmt: skip
    assert pool.get_new_blocks(1) == [partial]
    assert pool.get_new_blocks(4)[-1].block_id == 5
    assert pool.num_evictions == 0 and pool.get_cached_block(b"\x01" * 32) is cached
    pool.check_invariants()


def test_touch_cached_free_block_is_constant_time_removal():
    pool = BlockPool(1000)
    blocks = pool.get_new_blocks(1000)
    for i, b in enumerate(blocks):
        pool.cache_block(b, i.to_bytes(32, "big"))
    pool.free_blocks(blocks)
    target = pool.get_cached_block((500).to_bytes(32, "big"))
    pool.touch([target])
    assert target.ref_cnt == 1 and pool.num_free_blocks == 999
    pool.check_invariants()


def test_double_free_is_an_error():
    pool = BlockPool(2)
    (b,) = pool.get_new_blocks(1)
    pool.free_blocks([b])
    try:
        pool.free_blocks([b])
    except RuntimeError as e:
        assert "double free" in str(e)
    else:
        raise AssertionError("double free went unnoticed")
