"""The router's KV-event subscriber: one SUB socket per replica, read by a task on the
router's event loop, and the batches applied to the
:class:`~kvserve.router.index.PrefixIndex` on that loop in slices of at most
``SLICE_BLOCKS`` blocks.

Why no thread: the policies read the index on the loop. A thread applying batches under a
shared lock makes a decision wait for a whole batch; a thread that only decodes still shares
the GIL, and on a machine whose cores the replicas keep busy, a thread preempted while it holds
the GIL stalls the loop for a scheduler's time slice (milliseconds) in the middle of a decision.
On the loop, the sockets are read between requests, the index needs no lock, and a decision
waits at most for the slice in progress: after each slice the drain goes to the back of the
loop's queue, behind every request that became ready meanwhile.

Gaps are filled from the replica's replay socket (a DEALER speaking REQ's envelope: a REQ
socket takes only the first of the many replies a replay sends). A sequence number lower than
expected means the replica restarted (its numbers begin again at 0, its first batch is
``AllBlocksCleared``): what it held is forgotten and its stream is replayed from 0.
:meth:`EventSubscriber.reset` does the same when a health check finds a replica gone; batches
of the replica still waiting to be applied then are dropped with it (each carries the
replica's generation at decoding).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from kvserve.kv.events import BlockRemoved, BlockStored, KVEventBatch
from kvserve.router.index import PrefixIndex

log = logging.getLogger("kvserve.router")

REPLAY_TIMEOUT_MS = 2000
# With no event for this long, each replica is asked for what came after its last batch: a
# batch lost on the way (published before the SUB socket had joined, or dropped at the
# high-water mark) that no later batch reveals is learned within about this long.
CATCH_UP_S = 1.0
CATCH_UP_TIMEOUT_MS = 200
# Blocks applied per turn of the event loop: a decision waits at most for this many.
SLICE_BLOCKS = 128


@dataclass(slots=True)
class _Pending:
    replica: int
    generation: int
    events: deque[Any] | None  # None: forget what the replica holds (it restarted)


def _blocks(ev: Any) -> int:
    return len(ev.block_hashes) if isinstance(ev, BlockStored | BlockRemoved) else 1


def _split(ev: Any, k: int) -> tuple[Any, Any]:
    """``ev``'s first ``k`` blocks, and the rest (a stored chain's rest follows its head)."""
    if isinstance(ev, BlockRemoved):
        return (BlockRemoved(ev.block_hashes[:k], ev.medium),
                BlockRemoved(ev.block_hashes[k:], ev.medium))  # fmt: skip
    bs, hashes, toks, extra = ev.block_size, ev.block_hashes, ev.token_ids, ev.extra_keys

    def part(lo: int, hi: int | None, parent: bytes | None) -> BlockStored:
        return BlockStored(hashes[lo:hi], parent, toks[lo * bs : None if hi is None else hi * bs],
                           bs, ev.lora_id, ev.medium, ev.lora_name,
                           None if extra is None else extra[lo:hi])  # fmt: skip

    return part(0, k, ev.parent_block_hash), part(k, None, hashes[k - 1])


def take_slice(events: deque[Any], budget: int) -> tuple[list[Any], int]:
    """Pop events from the front of ``events`` worth at most ``budget`` blocks (splitting the
    one that would exceed it); returns them and the blocks they hold."""
    out: list[Any] = []
    used = 0
    while events and used < budget:
        n = _blocks(events[0])
        if used + n <= budget:
            out.append(events.popleft())
            used += n
        else:
            head, events[0] = _split(events[0], budget - used)
            out.append(head)
            used = budget
    return out, used


class _Stream:
    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str, replay: str | None,
                 topic: str) -> None:  # fmt: skip
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.RECONNECT_IVL, 100)
        self.sub.setsockopt_string(zmq.SUBSCRIBE, topic)
        self.sub.connect(endpoint)
        self.replay_endpoint = replay
        self.last_seq = -1
        self.reset = False
        self.resync = False  # ask the replay socket for what came since, without a new batch


class EventSubscriber:
    """Reads every replica's events and applies them to ``index`` on ``loop``, until
    :meth:`aclose`. Made, and every method called, on ``loop``."""

    def __init__(
        self,
        index: PrefixIndex,
        endpoints: Sequence[tuple[int, str, str | None]],
        loop: asyncio.AbstractEventLoop,
        topic: str = "",
        slice_blocks: int = SLICE_BLOCKS,
        start: bool = True,
    ) -> None:
        """``endpoints``: (replica, PUB endpoint, replay endpoint or None) per replica.
        ``start=False``: no sockets or reader (batches come from :meth:`submit` only)."""
        self.index, self.loop = index, loop
        self.slice_blocks = slice_blocks
        self.decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.pending: deque[_Pending] = deque()
        self.generation: dict[int, int] = {r: 0 for r, _, _ in endpoints}
        self._draining = False
        self.num_batches = 0  # applied
        self.num_replayed = 0  # fetched from a replay socket
        self.last_batch_at = 0.0  # time.monotonic() of the last batch applied
        self.slice_seconds: deque[float] = deque(maxlen=100_000)  # each slice's apply time
        self.ctx = zmq.asyncio.Context() if start else None
        self.streams = ({r: _Stream(self.ctx, ep, rp, topic) for r, ep, rp in endpoints}
                        if self.ctx is not None else {})  # fmt: skip
        self._wake = asyncio.Event()  # a resync was asked for
        self._task = loop.create_task(self._run()) if start else None

    @property
    def idle(self) -> bool:
        """Every batch received has been applied."""
        return not self.pending

    def reset(self, replica: int) -> None:
        """The replica went away: forget its blocks now, and any of its batches not yet
        applied; replay its stream from 0 later."""
        self.generation[replica] = self.generation.get(replica, 0) + 1
        self.index.drop_replica(replica)
        s = self.streams.get(replica)
        if s is not None:
            s.reset = True

    def resync(self, replica: int) -> None:
        """The replica is back: ask its replay socket now for every batch since the last one
        applied (from 0 after :meth:`reset`). Without this a restarted replica's first
        batches, published before this socket reconnected, would stay unknown until its next
        batch revealed the gap."""
        s = self.streams.get(replica)
        if s is not None:
            s.resync = True
            self._wake.set()

    # -- applying ------------------------------------------------------------------------------
    def submit(self, replica: int, events: Sequence[Any] | None) -> None:
        """Queue a decoded batch (None: forget the replica's blocks); it is applied in slices,
        the first once the requests ready now have run."""
        gen = self.generation.get(replica, 0)
        self.pending.append(_Pending(replica, gen, None if events is None else deque(events)))
        if not self._draining:
            self._draining = True
            self.loop.call_soon(self._drain)

    def _drain(self) -> None:
        """Apply one slice; if batches remain, come back after what else is ready."""
        t0 = time.perf_counter()
        budget, index = self.slice_blocks, self.index
        while budget > 0 and self.pending:
            item = self.pending[0]
            if item.generation != self.generation.get(item.replica, 0):
                self.pending.popleft()  # the replica was reset since: stale
                continue
            if item.events is None:
                index.drop_replica(item.replica)
                self.pending.popleft()
                budget -= 1
                continue
            events, used = take_slice(item.events, budget)
            index.apply(item.replica, events)
            budget -= max(1, used)
            if not item.events:
                self.pending.popleft()
                self.num_batches += 1
                self.last_batch_at = time.monotonic()
        self.slice_seconds.append(time.perf_counter() - t0)
        if self.pending:
            self.loop.call_soon(self._drain)
        else:
            self._draining = False

    # -- reading -------------------------------------------------------------------------------
    async def _run(self) -> None:
        poller = zmq.asyncio.Poller()
        by_socket = {}
        for r, s in self.streams.items():
            poller.register(s.sub, zmq.POLLIN)
            by_socket[s.sub] = r
        wake = asyncio.ensure_future(self._wake.wait())
        try:
            while True:
                polled = asyncio.ensure_future(poller.poll(int(CATCH_UP_S * 1000)))
                await asyncio.wait((polled, wake), return_when=asyncio.FIRST_COMPLETED)
                ready = polled.result() if polled.done() else []
                if not polled.done():
                    polled.cancel()
                for sock, _ in ready:
                    r = by_socket[sock]
                    # Everything queued on this socket now, then the others get a turn.
                    for _ in range(64):
                        try:
                            frames = await sock.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        if len(frames) != 3:
                            log.warning("replica %d sent a malformed event message", r)
                            continue
                        await self._receive(r, int.from_bytes(frames[1], "big"), frames[2])
                if wake.done():
                    self._wake.clear()
                    wake = asyncio.ensure_future(self._wake.wait())
                for r, s in self.streams.items():
                    if s.resync:
                        s.resync = False
                        if s.reset:
                            s.reset = False
                            s.last_seq = -1
                        await self._replay(r, s, None)
                if not ready and not wake.done():
                    await self._catch_up()
        finally:
            wake.cancel()

    async def _receive(self, r: int, seq: int, payload: bytes) -> None:
        s = self.streams[r]
        if s.reset or seq < s.last_seq + 1:  # restarted (or found gone): from 0 again
            s.reset = False
            s.last_seq = -1
            self.submit(r, None)
        if seq > s.last_seq + 1:
            await self._replay(r, s, seq)
        if seq == s.last_seq + 1:
            self._decode(r, payload)
            s.last_seq = seq

    async def _catch_up(self) -> None:
        """No event came for :data:`CATCH_UP_S`: ask each replica not known to be gone for
        anything after its last batch (a lost batch is otherwise found only when a later one
        shows the gap, and a quiet replica may publish none)."""
        for r, s in self.streams.items():
            if not s.reset:
                await self._replay(r, s, None, CATCH_UP_TIMEOUT_MS)

    async def _replay(
        self, r: int, s: _Stream, upto: int | None, timeout_ms: int = REPLAY_TIMEOUT_MS
    ) -> None:
        """Ask for batches ``last_seq + 1 .. upto - 1`` (None: every one the replica keeps)."""
        if s.replay_endpoint is None:
            if upto is not None:
                log.warning("replica %d skipped events %d..%d and has no replay socket",
                            r, s.last_seq + 1, upto - 1)  # fmt: skip
                s.last_seq = upto - 1
            return
        assert self.ctx is not None
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(s.replay_endpoint)
            await sock.send_multipart((b"", (s.last_seq + 1).to_bytes(8, "big")))
            deadline = time.monotonic() + timeout_ms / 1000
            while time.monotonic() < deadline:
                if not await sock.poll(timeout_ms):
                    break
                frames = await sock.recv_multipart()
                if len(frames) != 3:
                    break
                seq = int.from_bytes(frames[1], "big", signed=True)
                if seq < 0:
                    break
                if seq == s.last_seq + 1 and (upto is None or seq < upto):
                    self._decode(r, frames[2])
                    s.last_seq = seq
                    self.num_replayed += 1
        finally:
            sock.close(linger=0)
        if upto is not None and s.last_seq < upto - 1:
            log.warning("replica %d's replay lacks events %d..%d; its index may be stale",
                        r, s.last_seq + 1, upto - 1)  # fmt: skip
            s.last_seq = upto - 1

    def _decode(self, r: int, payload: bytes) -> None:
        try:
            batch = self.decoder.decode(payload)
        except msgspec.DecodeError:
            log.warning("replica %d sent an event batch that does not decode", r)
            return
        self.submit(r, batch.events)

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, zmq.ZMQError):
                await self._task
            self._task = None
        for s in self.streams.values():
            s.sub.close(linger=0)
        if self.ctx is not None:
            self.ctx.term()
            self.ctx = None
