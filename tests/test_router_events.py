"""The router applies KV events on its event loop in slices: a routing decision that becomes
ready while a large batch is being applied runs after at most a slice or two of it, not after
the whole batch; a batch applied in slices leaves the index as the whole batch applied at once
does; and a replica reset drops its batches still waiting."""

from __future__ import annotations

import asyncio
import socket

from kvserve.config import KVEventsConfig
from kvserve.engine.kv_events import ZmqEventPublisher
from kvserve.kv.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvserve.router.events import EventSubscriber
from kvserve.router.index import PrefixIndex
from kvserve.router.policies import ReplicaLoad, RouteRequest, make_policy

BS = 4


def chain_event(n: int, salt: str = "A", tag: str = "x") -> tuple[BlockStored, list[int]]:
    """One BlockStored of an ``n``-block chain (hash i names block i), and its tokens."""
    hashes = [f"{tag}{i}".encode().ljust(16, b".") for i in range(n)]
    tokens = list(range(n * BS))
    extra = [(salt,)] + [None] * (n - 1)
    return BlockStored(hashes, None, tokens, BS, None, "GPU", extra_keys=extra), tokens


class CountingIndex(PrefixIndex):
    """Counts the blocks applied, and calls ``on_count`` once the count passes ``at``."""

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.applied = 0
        self.at: int | None = None
        self.on_count = lambda: None

    def apply(self, replica, events) -> None:  # noqa: ANN001
        super().apply(replica, events)
        before = self.applied
        self.applied += sum(len(getattr(ev, "block_hashes", ())) for ev in events)
        if self.at is not None and before < self.at <= self.applied:
            self.on_count()


def test_a_decision_waits_for_a_slice_not_for_the_whole_batch():
    """A request whose socket becomes readable while a 5,000-block batch is being applied is
    routed after at most two more slices, by the policy reading the partly applied index."""
    total, ready_at, slice_blocks = 5000, 1000, 64
    loop = asyncio.new_event_loop()
    index = CountingIndex(2)
    sub = EventSubscriber(index, [(0, "", None), (1, "", None)], loop,
                          slice_blocks=slice_blocks, start=False)  # fmt: skip
    policy = make_policy("prefix", index=index, block_size=BS)
    ev, tokens = chain_event(total)
    a, b = socket.socketpair()
    seen: dict[str, int] = {}
    index.at = ready_at
    index.on_count = lambda: a.send(b"r")  # the request's bytes arrive mid-batch

    def decide() -> None:
        loop.remove_reader(b.fileno())
        b.recv(1)
        seen["applied"] = index.applied
        d = policy.choose(RouteRequest(tokens, "A"), [ReplicaLoad(), ReplicaLoad()])
        seen["replica"], seen["hit"] = d.replica, d.hit_blocks

    async def main() -> None:
        loop.add_reader(b.fileno(), decide)
        sub.submit(0, [ev])
        while not sub.idle:
            await asyncio.sleep(0.001)

    try:
        loop.run_until_complete(asyncio.wait_for(main(), 30))
    finally:
        loop.close()
        a.close()
        b.close()
    assert ready_at <= seen["applied"] <= ready_at + 2 * 64 < total, seen
    # The decision used what was applied then: replica 0's leading blocks.
    assert seen["replica"] == 0 and seen["hit"] == seen["applied"]
    assert index.applied == total and sub.num_batches == 1
    assert len(sub.slice_seconds) >= total // slice_blocks


def test_a_batch_applied_in_slices_equals_it_applied_whole():
    ev, tokens = chain_event(300)
    tier = BlockStored([b"t" * 16 for _ in range(1)], None, [], BS, None, "CPU_TIER")
    removed = BlockRemoved(ev.block_hashes[100:250], "GPU")
    batches = [[ev, tier], [removed], [AllBlocksCleared()], [ev]]
    whole = PrefixIndex(1)
    loop = asyncio.new_event_loop()
    sliced = PrefixIndex(1)
    sub = EventSubscriber(sliced, [(0, "", None)], loop, slice_blocks=7, start=False)

    async def main() -> None:
        for batch in batches[:2]:
            sub.submit(0, batch)
        while not sub.idle:
            await asyncio.sleep(0.001)

    loop.run_until_complete(asyncio.wait_for(main(), 30))
    for batch in batches[:2]:
        whole.apply(0, batch)
    assert sliced.edges == whole.edges and sliced.held == whole.held
    # After the removal the chain is held up to block 100 (a prefix hit stops at the gap).
    chain = sliced.chain(tokens, "A")
    assert len(chain) == 300 and sliced.overlap(0, chain) == (100, 100.0)
    assert b"t" * 16 in sliced.held[0]
    loop.close()


def test_a_reset_drops_the_replicas_batches_not_yet_applied():
    loop = asyncio.new_event_loop()
    index = PrefixIndex(2)
    sub = EventSubscriber(index, [(0, "", None), (1, "", None)], loop, slice_blocks=16,
                          start=False)  # fmt: skip
    ev0, tokens = chain_event(200, tag="p")
    ev1, _ = chain_event(200, tag="q")

    async def main() -> None:
        sub.submit(0, [ev0])
        sub.submit(1, [ev1])
        await asyncio.sleep(0)  # a slice or so of replica 0's batch is in
        sub.reset(0)
        while not sub.idle:
            await asyncio.sleep(0.001)

    loop.run_until_complete(asyncio.wait_for(main(), 30))
    loop.close()
    assert index.num_blocks(0) == 0 and index.num_blocks(1) == 200


def test_a_batch_published_before_the_subscriber_joined_is_caught_up(tmp_path):
    """A batch no later batch reveals (published before the SUB socket joined, as a restarted
    replica's first batches are) is fetched from the replay socket once the streams go quiet,
    instead of staying unknown until the replica publishes again."""
    pub = ZmqEventPublisher(KVEventsConfig(
        enable_kv_cache_events=True, endpoint=f"ipc://{tmp_path}/ev",
        replay_endpoint=f"ipc://{tmp_path}/rp"))  # fmt: skip
    ev, tokens = chain_event(5)
    pub.publish([ev])
    assert pub.flush(5.0)
    loop = asyncio.new_event_loop()
    index = PrefixIndex(1)
    sub = EventSubscriber(index, [(0, pub.endpoint, pub.replay_endpoint)], loop)

    async def learned() -> bool:
        deadline = loop.time() + 5.0
        while loop.time() < deadline:
            if index.overlap(0, index.chain(tokens, "A"))[0] == 5:
                return True
            await asyncio.sleep(0.05)
        return False

    try:
        assert loop.run_until_complete(learned())
        assert sub.num_replayed == 1
    finally:
        loop.run_until_complete(sub.aclose())
        loop.close()
        pub.shutdown()
