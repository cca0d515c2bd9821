"""The router's KV-event subscriber: one SUB socket per replica, read by one thread, applied to
the :class:`~kvserve.router.index.PrefixIndex` under a lock the policies share.

Gaps are filled from the replica's replay socket (a DEALER speaking REQ's envelope: a REQ
socket takes only the first of the many replies a replay sends). A sequence number lower than
expected means the replica restarted (its numbers begin again at 0, its first batch is
``AllBlocksCleared``): what it held is forgotten and its stream is replayed from 0.
:meth:`EventSubscriber.reset` does the same when a health check finds a replica gone.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import msgspec
import zmq

from kvserve.kv.events import KVEventBatch
from kvserve.router.index import PrefixIndex

log = logging.getLogger("kvserve.router")

REPLAY_TIMEOUT_MS = 2000


class _Stream:
    def __init__(self, ctx: zmq.Context, endpoint: str, replay: str | None, topic: str) -> None:
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
    """Reads every replica's events into ``index`` until :meth:`close`."""

    def __init__(
        self,
        index: PrefixIndex,
        lock: threading.Lock,
        endpoints: list[tuple[int, str, str | None]],
        topic: str = "",
        on_batch: Callable[[int], None] | None = None,
    ) -> None:
        """``endpoints``: (replica, PUB endpoint, replay endpoint or None) per replica."""
        self.index, self.lock = index, lock
        self.ctx = zmq.Context()
        self.decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.streams = {r: _Stream(self.ctx, ep, rp, topic) for r, ep, rp in endpoints}
        self.on_batch = on_batch
        self.num_batches = 0
        self.num_replayed = 0
        self.last_batch_at = 0.0  # time.monotonic() of the last batch applied
        self._running = True
        self._thread = threading.Thread(target=self._run, name="kvserve-router-events",
                                        daemon=True)  # fmt: skip
        self._thread.start()

    def reset(self, replica: int) -> None:
        """The replica went away: forget its blocks now, replay its stream from 0 later."""
        with self.lock:
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

    def _run(self) -> None:
        poller = zmq.Poller()
        by_socket = {}
        for r, s in self.streams.items():
            poller.register(s.sub, zmq.POLLIN)
            by_socket[s.sub] = r
        while self._running:
            try:
                ready = dict(poller.poll(100))
            except zmq.ZMQError:
                break
            for sock in ready:
                r = by_socket[sock]
                try:
                    _, seq_bytes, payload = sock.recv_multipart()
                except ValueError:
                    log.warning("replica %d sent a malformed event message", r)
                    continue
                self._receive(r, int.from_bytes(seq_bytes, "big"), payload)
            for r, s in self.streams.items():
                if s.resync:
                    s.resync = False
                    if s.reset:
                        s.reset = False
                        s.last_seq = -1
                    self._replay(r, s, None)
        for s in self.streams.values():
            s.sub.close(linger=0)
        self.ctx.term()

    def _receive(self, r: int, seq: int, payload: bytes) -> None:
        s = self.streams[r]
        if s.reset or seq < s.last_seq + 1:  # restarted (or found gone): from 0 again
            s.reset = False
            s.last_seq = -1
            with self.lock:
                self.index.drop_replica(r)
        if seq > s.last_seq + 1:
            self._replay(r, s, seq)
        if seq == s.last_seq + 1:
            self._apply(r, payload)
            s.last_seq = seq

    def _replay(self, r: int, s: _Stream, upto: int | None) -> None:
        """Ask for batches ``last_seq + 1 .. upto - 1`` (None: every one the replica keeps)."""
        if s.replay_endpoint is None:
            if upto is not None:
                log.warning("replica %d skipped events %d..%d and has no replay socket",
                            r, s.last_seq + 1, upto - 1)  # fmt: skip
                s.last_seq = upto - 1
            return
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(s.replay_endpoint)
            sock.send_multipart((b"", (s.last_seq + 1).to_bytes(8, "big")))
            deadline = time.monotonic() + REPLAY_TIMEOUT_MS / 1000
            while time.monotonic() < deadline:
                if not sock.poll(REPLAY_TIMEOUT_MS):
                    break
                frames = sock.recv_multipart()
                if len(frames) != 3:
                    break
                seq = int.from_bytes(frames[1], "big", signed=True)
                if seq < 0:
                    break
                if seq == s.last_seq + 1 and (upto is None or seq < upto):
                    self._apply(r, frames[2])
                    s.last_seq = seq
                    self.num_replayed += 1
        finally:
            sock.close(linger=0)
        if upto is not None and s.last_seq < upto - 1:
            log.warning("replica %d's replay lacks events %d..%d; its index may be stale",
                        r, s.last_seq + 1, upto - 1)  # fmt: skip
            s.last_seq = upto - 1

    def _apply(self, r: int, payload: bytes) -> None:
        try:
            batch = self.decoder.decode(payload)
        except msgspec.DecodeError:
            log.warning("replica %d sent an event batch that does not decode", r)
            return
        with self.lock:
            self.index.apply(r, batch.events)
        self.num_batches += 1
        self.last_batch_at = time.monotonic()
        if self.on_batch is not None:
            self.on_batch(r)

    def close(self) -> None:
        self._running = False
        self._thread.join(timeout=2)
