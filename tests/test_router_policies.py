"""Routing policies against hand-computed expectations: the event index's chains and per-tier
credit, Dynamo's cost (overlap-weighted prefill blocks + blocks in flight), SGLang's
imbalance guard, the approximate history, sessions, and tenant isolation (a tenant's prompt
never scores on another tenant's blocks, even with the very same tokens)."""

from __future__ import annotations

import pytest

from kvserve.kv.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvserve.router.index import PrefixIndex
from kvserve.router.policies import (
    NoReplicaError,
    ReplicaLoad,
    RouteRequest,
    make_policy,
)

BS = 4
TOKENS = list(range(100, 114))  # 14 tokens: 3 full blocks


def h(name: str) -> bytes:
    return name.encode().ljust(32, b".")


def stored(hashes, parent, tokens, medium="GPU", salt=None):  # noqa: ANN001, ANN201
    extra = [(salt,)] + [None] * (len(hashes) - 1) if salt and parent is None else None
    return BlockStored(hashes, parent, tokens, BS, None, medium, extra_keys=extra)


def index_two_replicas() -> PrefixIndex:
    """Replica 0 holds tenant A's three blocks on the device; replica 1 holds A's first on
    the device and second in its host tier (hash only, as a tier publishes), and tenant B's
    chain of the very same tokens."""
    idx = PrefixIndex(2)
    a = [h("a1"), h("a2"), h("a3")]
    idx.apply(0, [stored(a, None, TOKENS[:12], salt="A")])
    idx.apply(1, [stored(a[:1], None, TOKENS[:4], salt="A"),
                  BlockStored([a[1]], None, [], BS, None, "CPU_TIER")])  # fmt: skip
    idx.apply(1, [stored([h("b1"), h("b2"), h("b3")], None, TOKENS[:12], salt="B")])
    return idx


def test_index_credits_each_block_by_its_medium():
    idx = index_two_replicas()
    chain = idx.chain(TOKENS, "A")
    assert chain == [h("a1"), h("a2"), h("a3")]
    assert idx.overlap(0, chain) == (3, 3.0)
    assert idx.overlap(1, chain) == (2, pytest.approx(1.8))  # GPU 1.0 + CPU_TIER 0.8


def test_a_tenant_never_scores_on_another_tenants_blocks():
    idx = index_two_replicas()
    b_chain = idx.chain(TOKENS, "B")
    assert b_chain == [h("b1"), h("b2"), h("b3")]
    assert idx.overlap(0, b_chain) == (0, 0.0)  # replica 0 holds only A's
    assert idx.chain(TOKENS, "C") == []  # a tenant with no blocks anywhere
    assert idx.chain(TOKENS, None) == []
    # B's chain on replica 1 is full: still, A's prompt scores there only on A's blocks.
    assert idx.overlap(1, idx.chain(TOKENS, "A"))[0] == 2
    policy = make_policy("prefix", index=idx)
    d = policy.choose(RouteRequest(TOKENS, "C"), [ReplicaLoad(), ReplicaLoad(requests=1)])
    assert d.replica == 0 and d.hit_blocks == 0  # no score anywhere: the load decides


def test_removed_and_cleared_events():
    idx = index_two_replicas()
    chain = idx.chain(TOKENS, "A")
    idx.apply(0, [BlockRemoved([h("a2")], "GPU")])
    assert idx.overlap(0, chain) == (1, 1.0)  # a hole ends the prefix
    idx.apply(1, [BlockRemoved([h("a2")], "GPU")])  # not on that medium: no change
    assert idx.overlap(1, chain)[0] == 2
    idx.apply(1, [AllBlocksCleared()])
    assert idx.overlap(1, chain) == (0, 0.0)
    assert idx.overlap(0, chain) == (1, 1.0)  # only that replica's


def filler(policy, replica: int, blocks: int, seed: int) -> RouteRequest:  # noqa: ANN001
    """A request of ``blocks`` unrelated blocks, in flight on ``replica``."""
    req = RouteRequest(list(range(1000 * seed, 1000 * seed + BS * blocks)), "X")
    policy.routed(req, replica)
    return req


def test_dynamo_cost_weighs_prefill_blocks_against_blocks_held():
    idx = index_two_replicas()
    policy = make_policy("prefix", index=idx, overlap_weight=1.0)
    req = RouteRequest(TOKENS, "A")
    two = [ReplicaLoad(requests=1), ReplicaLoad(requests=1)]
    f0, f1 = filler(policy, 0, 5, 1), filler(policy, 1, 2, 2)
    # cost = 1.0 * (3 - credit) + in flight + (3 - overlap)
    # replica 0: 0 + 5 + 0 = 5; replica 1: (3 - 1.8) + 2 + (3 - 2) = 4.2
    d = policy.choose(req, two)
    assert d.replica == 1 and d.hit_blocks == 2
    assert d.scores == [pytest.approx(5.0), pytest.approx(4.2)]
    policy.finished(f0, 0)
    policy.finished(f1, 1)
    f0 = filler(policy, 0, 1, 3)
    # replica 0: 0 + 1 + 0 = 1; replica 1: 1.2 + 0 + 1 = 2.2
    d = policy.choose(req, two)
    assert d.replica == 0 and d.hit_blocks == 3
    heavy = make_policy("prefix", index=idx, overlap_weight=4.0)
    light = make_policy("prefix", index=idx, overlap_weight=1.0)
    for p in (heavy, light):
        filler(p, 0, 5, 4)
    # weight 4: replica 0: 0 + 5 = 5; replica 1: 4 * 1.2 + 0 + 1 = 5.8 -> 0
    # weight 1: replica 0: 5; replica 1: 1.2 + 1 = 2.2 -> 1
    assert heavy.choose(req, two).replica == 0
    assert light.choose(req, two).replica == 1


def test_a_prompt_in_flight_counts_as_held_before_its_events():
    policy = make_policy("prefix", index=PrefixIndex(2), block_size=BS)
    loads = [ReplicaLoad(), ReplicaLoad()]
    first = RouteRequest(TOKENS, "A")
    policy.routed(first, 1)
    # replica 0: w * 3 + 0 + 3; replica 1: 0 + 3 + 0 = 3 (its blocks are being computed)
    d = policy.choose(RouteRequest(TOKENS, "A"), loads)
    assert d.replica == 1 and d.hit_blocks == 3
    assert policy.choose(RouteRequest(TOKENS, "B"), loads).hit_blocks == 0  # other tenant
    policy.finished(first, 1)
    assert policy.choose(RouteRequest(TOKENS, "A"), loads).hit_blocks == 0


def test_imbalance_guard_overrides_the_cache():
    idx = index_two_replicas()
    policy = make_policy("prefix", index=idx, balance_abs=16, balance_rel=1.5)
    req = RouteRequest(TOKENS, "A")
    # 40 - 2 > 16 and 40 > 1.5 * 2: the least loaded, though replica 0 holds every block
    d = policy.choose(req, [ReplicaLoad(requests=40), ReplicaLoad(requests=2, blocks=50)])
    assert d.replica == 1 and d.balanced
    # 20 - 5 = 15, not > 16: the cost decides (replica 0: 0; replica 1: 1.2 + 1)
    d = policy.choose(req, [ReplicaLoad(requests=20), ReplicaLoad(requests=5)])
    assert d.replica == 0 and not d.balanced


def test_no_imbalance_guard_unless_asked():
    """By default the cost alone decides, however unequal the request counts (the guard at
    16 / 1.5 would send both requests to the replica with 2 in flight)."""
    policy = make_policy("prefix", index=index_two_replicas())
    # Tenant B's chain is on replica 1 alone: replica 0 costs w * 3 + 0 + 3, replica 1 0.
    req = RouteRequest(TOKENS, "B")
    d = policy.choose(req, [ReplicaLoad(requests=2), ReplicaLoad(requests=40)])
    assert d.replica == 1 and d.hit_blocks == 3 and not d.balanced
    # Tenant A: replica 0 holds all 3 (cost 0), replica 1 two, 1.8 credited (w * 1.2 + 1).
    req = RouteRequest(TOKENS, "A")
    d = policy.choose(req, [ReplicaLoad(requests=40), ReplicaLoad(requests=2)])
    assert d.replica == 0 and d.hit_blocks == 3 and not d.balanced


def test_prefix_approx_remembers_what_it_sent_up_to_its_capacity():
    policy = make_policy("prefix_approx", block_size=BS, approx_capacity_blocks=3)
    loads = [ReplicaLoad(), ReplicaLoad()]
    first = RouteRequest(TOKENS, "A")
    policy.routed(first, 1)
    same_prefix = RouteRequest(TOKENS[:8] + [7, 7, 7, 7], "A")  # 2 blocks shared
    d = policy.choose(same_prefix, loads)
    assert d.replica == 1 and d.hit_blocks == 2
    assert policy.choose(RouteRequest(TOKENS, "B"), loads).hit_blocks == 0  # other tenant
    policy.routed(RouteRequest([9] * 8, "A"), 1)  # 2 new blocks: the oldest 2 of 3 go
    assert policy.choose(same_prefix, loads).hit_blocks == 0


def test_prefix_approx_keeps_at_most_each_replicas_pool_once_it_is_known():
    """With no capacity given, each replica's history is bounded by the pool it reported
    (replica 0: 3 blocks), a replica that has not reported keeps everything, and a replica
    that went down forgets its pool with its history."""
    policy = make_policy("prefix_approx", block_size=BS)
    scorer = policy.scorer
    loads = [ReplicaLoad(), ReplicaLoad()]
    old, new = RouteRequest(TOKENS, "A"), RouteRequest([9] * 8, "A")  # 3 and 2 blocks
    for r in (0, 1):
        policy.routed(old, r)
        policy.routed(new, r)
    scorer.learn_pool(0, 3, None)  # 5 blocks sent, 3 kept: the 2 most recent and old's last
    assert scorer.match(RouteRequest(TOKENS, "A"), 2) == [(0, 0.0), (3, 3.0)]
    assert scorer.match(RouteRequest([9] * 8, "A"), 2) == [(2, 2.0), (2, 2.0)]
    assert policy.choose(RouteRequest(TOKENS, "A"), loads).replica == 1
    scorer.forget(0)
    policy.routed(old, 0)
    policy.routed(new, 0)  # no pool known again: nothing forgotten
    assert scorer.match(RouteRequest(TOKENS, "A"), 2)[0] == (3, 3.0)
    fixed = make_policy("prefix_approx", block_size=BS, approx_capacity_blocks=10).scorer
    fixed.learn_pool(0, 3, None)  # the operator's capacity wins over the pool
    assert fixed.capacity(0) == 10


def test_prefix_approx_cuts_its_keys_at_the_block_size_the_replicas_report(caplog):
    """No --block-size: 16 until a replica reports its own, then that one (the history cut
    at 16 is dropped: its keys match nothing at the new size); a replica reporting another
    size gets a warning and changes nothing. An operator's size wins over every report."""
    policy = make_policy("prefix_approx")
    scorer = policy.scorer
    loads = [ReplicaLoad(), ReplicaLoad()]
    assert scorer.block_size == 16 and policy.wants_pool(0)
    policy.routed(RouteRequest(list(range(32)), "A"), 0)  # two blocks of 16
    assert scorer.match(RouteRequest(list(range(32)), "A"), 2) == [(2, 2.0), (0, 0.0)]
    policy.learn_pool(1, None, BS)
    assert scorer.block_size == BS
    assert scorer.match(RouteRequest(list(range(32)), "A"), 2) == [(0, 0.0), (0, 0.0)]
    policy.routed(RouteRequest(TOKENS, "A"), 1)
    d = policy.choose(RouteRequest(TOKENS, "A"), loads)
    assert d.replica == 1 and d.hit_blocks == 3  # 14 tokens: 3 full blocks of 4
    assert policy.wants_pool(1)  # its pool's size is still unknown
    policy.learn_pool(1, 50, BS)
    assert not policy.wants_pool(1)
    with caplog.at_level("WARNING", logger="kvserve.router.policies"):
        policy.learn_pool(0, 100, 8)
    assert scorer.block_size == BS and scorer.pools == {0: 100, 1: 50}
    assert "replica 0 reports block size 8" in caplog.text
    fixed = make_policy("prefix_approx", block_size=8).scorer
    fixed.learn_pool(0, 100, BS)
    assert fixed.block_size == 8


def test_cache_config_of_reads_vllm_cache_config_info():
    from kvserve.router.app import cache_config_of

    page = (
        "# HELP vllm:cache_config_info The KV cache configuration.\n"
        "# TYPE vllm:cache_config_info gauge\n"
        'vllm:cache_config_info{block_size="16",cache_dtype="auto",num_gpu_blocks="823"} 1.0\n'
        "# HELP vllm:num_requests_running Running.\n"
        "# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{model_name="m"} 0.0\n'
    )
    assert cache_config_of(page) == (823, 16)
    # vLLM before profiling; a zero
    assert cache_config_of(page.replace('"823"', '"None"')) == (None, 16)
    assert cache_config_of(page.replace('"823"', '"0"')) == (None, 16)
    assert cache_config_of(page.replace('block_size="16",', "")) == (823, None)
    assert cache_config_of("vllm:num_requests_running 0.0\n") == (None, None)
    assert cache_config_of("not { a page") == (None, None)


def test_the_router_reads_each_pool_for_prefix_approx_once_and_again_after_a_replica_is_down():
    """Against replicas answering through httpx's mock transport: each healthy replica's pool
    is read from its /metrics into prefix_approx's history bounds; a replica that gives no
    pool is asked POOL_READS times and no more; one marked down while its page is on the way
    keeps nothing of it, and is read again once it is back. The block size comes with the
    pool."""
    import asyncio

    import httpx

    from kvserve.router.app import POOL_READS, Replica, RouterState
    from kvserve.router.index import PrefixIndex
    from kvserve.server.tenants import TenantResolver

    pools = {"r0": 7, "r1": None}  # r1 publishes no cache_config_info
    reads = {"r0": 0, "r1": 0}
    state: RouterState

    def handler(request: httpx.Request) -> httpx.Response:
        host = request.url.host
        if request.url.path == "/health":
            return httpx.Response(200)
        reads[host] += 1
        if on_read is not None:
            on_read()
        n = pools[host]
        line = (
            ""
            if n is None
            else f'vllm:cache_config_info{{block_size="4",num_gpu_blocks="{n}"}} 1.0\n'
        )
        return httpx.Response(200, text=line + "vllm:num_requests_running 0.0\n")

    on_read = None
    policy = make_policy("prefix_approx")
    state = RouterState([Replica("r0", "http://r0"), Replica("r1", "http://r1")], policy,
                        PrefixIndex(2), TenantResolver.from_args(None, None))  # fmt: skip

    async def checks(n: int) -> None:
        state.client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
        for _ in range(n):
            await state.check_health()
        await state.client.aclose()

    asyncio.run(checks(POOL_READS + 2))
    assert policy.scorer.pools == {0: 7} and policy.scorer.block_size == 4
    assert reads == {"r0": 1, "r1": POOL_READS}
    state.mark_down(0, "test")
    pools["r0"] = 11

    def down_meanwhile() -> None:  # a failed request marks r0 down while its page comes
        state.mark_down(0, "test")

    on_read = down_meanwhile
    asyncio.run(checks(1))  # r0 is back (health 200), read, and down again before the answer
    assert 0 not in policy.scorer.pools
    on_read = None
    asyncio.run(checks(1))
    assert policy.scorer.pools == {0: 11}


def test_round_robin_least_load_and_session_over_healthy_replicas():
    loads = [ReplicaLoad(), ReplicaLoad(healthy=False), ReplicaLoad()]
    rr = make_policy("round_robin")
    assert [rr.choose(RouteRequest(), loads).replica for _ in range(4)] == [0, 2, 0, 2]
    ll = make_policy("least_load")
    assert ll.choose(RouteRequest(), [ReplicaLoad(3), ReplicaLoad(1), ReplicaLoad(2)]) is not None
    assert ll.choose(RouteRequest(), [ReplicaLoad(requests=3), ReplicaLoad(requests=1),
                                      ReplicaLoad(requests=2)]).replica == 1  # fmt: skip
    assert ll.choose(RouteRequest(), [ReplicaLoad(requests=1, blocks=9),
                                      ReplicaLoad(requests=1, blocks=4),
                                      ReplicaLoad(requests=5)]).replica == 1  # fmt: skip
    session = make_policy("session")
    four = [ReplicaLoad() for _ in range(4)]
    homes = {s: session.choose(RouteRequest(session=s), four).replica for s in "abcdefghij"}
    assert len(set(homes.values())) > 1
    assert all(session.choose(RouteRequest(session=s), four).replica == r
               for s, r in homes.items())  # fmt: skip
    dead = max(set(homes.values()), key=list(homes.values()).count)
    four[dead].healthy = False
    for s, r in homes.items():
        moved = session.choose(RouteRequest(session=s), four).replica
        assert moved != dead and (r == dead or moved == r)  # only the dead one's move
    with pytest.raises(NoReplicaError):
        rr.choose(RouteRequest(), [ReplicaLoad(healthy=False)])
    with pytest.raises(ValueError, match="policy must be one of"):
        make_policy("random")
