"""The KV-event publisher: vLLM's wire format over ZeroMQ, so a consumer written for vLLM's
``ZmqEventPublisher`` reads ours.

Each batch is one PUB message of three frames: the topic, the sequence number (8 bytes,
big-endian, from 0 at start), the msgpack payload (:mod:`kvserve.kv.events`). The last
``buffer_steps`` batches are kept; a subscriber that sees a gap sends the first sequence number
it lacks (8 bytes big-endian) to the replay ROUTER socket from a REQ socket and gets back, per
kept batch from there on, ``(seq, payload)``, then ``(-1, b"")`` as the end marker (vLLM's
protocol). Publishing is a queue put; a thread owns both sockets (a ZMQ socket belongs to one
thread), encodes, sends and answers replays, so the engine's step never waits on the network.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque

import msgspec
import zmq

from kvserve.config import KVEventsConfig
from kvserve.kv.events import AllBlocksCleared, KVCacheEvent, KVEventBatch

log = logging.getLogger("kvserve.engine")

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def _binds(endpoint: str) -> bool:
    """vLLM's rule: bind a wildcard or local-transport endpoint, connect to any other."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqEventPublisher:
    """PUB socket plus a replay ROUTER socket and the buffer of recent batches."""

    def __init__(self, config: KVEventsConfig) -> None:
        self._queue: queue.Queue[KVEventBatch | None] = queue.Queue(config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._topic = config.topic.encode()
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        try:
            if _binds(config.endpoint):
                self._pub.bind(config.endpoint)
                self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            else:
                self._pub.connect(config.endpoint)
                self.endpoint = config.endpoint
            self._replay: zmq.Socket | None = None
            self.replay_endpoint: str | None = None
            if config.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(config.replay_endpoint)
                self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as e:
            self._pub.close(linger=0)
            raise OSError(f"kv_events_config: cannot open {config.endpoint}: {e}") from None
        self.num_published = 0
        self._running = True
        self._thread = threading.Thread(target=self._run, name="kvserve-kv-events", daemon=True)
        self._thread.start()
        log.info("KV events: publishing on %s%s (topic %r)", self.endpoint,
                 f", replay on {self.replay_endpoint}" if self.replay_endpoint else "",
                 config.topic)  # fmt: skip

    def publish(self, events: list[KVCacheEvent]) -> None:
        """Queue one batch (a full queue drops it with a warning: subscribers replay)."""
        if not events or not self._running:
            return
        try:
            self._queue.put_nowait(KVEventBatch(ts=time.time(), events=events))
        except queue.Full:
            log.warning("KV events: queue full, %d events dropped", len(events))

    def publish_cleared(self) -> None:
        """The first batch: whatever a previous run of this engine published is gone."""
        self.publish([AllBlocksCleared()])

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        seq = 0
        while True:
            if self._replay is not None and self._replay.poll(0):
                try:
                    self._serve_replay()
                except zmq.ZMQError:
                    log.warning("KV events: a replay request failed", exc_info=True)
            try:
                batch = self._queue.get(timeout=0.05)
            except queue.Empty:
                if not self._running:
                    break
                continue
            if batch is None:
                self._queue.task_done()
                break
            payload = encoder.encode(batch)
            try:
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            except zmq.ZMQError:
                log.warning("KV events: a send failed (kept for replay)", exc_info=True)
            self._buffer.append((seq, payload))
            self.num_published = seq = seq + 1
            self._queue.task_done()
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("KV events: a malformed replay request (%d frames) ignored", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until every batch published so far is sent (False: not within the time)."""
        deadline = time.monotonic() + timeout_s
        while self._queue.unfinished_tasks and self._thread.is_alive():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def shutdown(self, timeout_s: float = 2.0) -> None:
        """Send what is queued (for up to ``timeout_s``), then close the sockets."""
        if not self._running:
            return
        self._running = False
        try:
            self._queue.put(None, timeout=timeout_s)
        except queue.Full:
            pass
        self._thread.join(timeout=timeout_s)


def make_publisher(config: KVEventsConfig) -> ZmqEventPublisher | None:
    """The publisher the config asks for (None: events off or the ``null`` publisher)."""
    return ZmqEventPublisher(config) if config.enabled else None
