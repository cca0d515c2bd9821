"""The KV side channel's two ends, each a thread that owns its ZMQ sockets.

:class:`KVServer` (a prefill engine's worker) answers hellos and heartbeats at once, from its
own thread, so a busy engine still looks alive; reads and releases go to an inbox its owner
drains (the worker: see :mod:`kvserve.disagg.connector` for which thread, and why a lease can
only end between two reads, never during one), and answers leave through an outbox.

:class:`KVClient` (a decode engine's worker) fetches blocks from any number of prefill
engines: it says hello once per peer, pings every peer it waits on, and gives up on a peer
that has not answered for ``heartbeat_timeout_s`` (failing every fetch it had there), so a
dead prefill engine costs a decode engine about a second, not a long read timeout.
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import zmq

from kvserve.config import ConfigError
from kvserve.disagg import wire

log = logging.getLogger("kvserve.disagg")

POLL_MS = 50  # the longest a thread sleeps: work from other threads wakes it at once
PING_INTERVAL_S = 0.2


class _Waker:
    """Wakes a thread blocked in ``zmq.Poller.poll`` from any other thread: an inproc PULL
    socket in the poller, and a PUSH socket per waking thread."""

    def __init__(self, ctx: Any) -> None:
        self._ctx = ctx
        self.addr = f"inproc://kvserve-wake-{id(self)}"
        self.sock = ctx.socket(zmq.PULL)
        self.sock.bind(self.addr)
        self._local = threading.local()
        self._pushes: list[Any] = []

    def wake(self) -> None:
        push = getattr(self._local, "sock", None)
        if push is None:
            push = self._local.sock = self._ctx.socket(zmq.PUSH)
            push.setsockopt(zmq.LINGER, 0)
            push.connect(self.addr)
            self._pushes.append(push)
        try:
            push.send(b"", zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # a wake-up is already pending, or the thread has stopped

    def drain(self) -> None:
        while True:
            try:
                self.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return

    def close(self) -> None:
        for s in self._pushes:
            s.close(0)
        self.sock.close(0)


class KVServer:
    """A ROUTER socket on ``host:port`` (port 0: a free one, see :attr:`port`).

    ``on_inbox`` (optional) is called from this thread after each message it puts in the
    inbox: an owner that can serve reads outside its step thread drains the inbox there."""

    def __init__(self, host: str, port: int, engine_id: str, handshake: dict[str, Any],
                 on_inbox: Any = None) -> None:  # fmt: skip
        self.engine_id = engine_id
        self.on_inbox = on_inbox
        self.handshake = handshake  # {"model": ..., **storage identity}
        # (peer, message, arrival time) for the owner (see on_inbox)
        self.inbox: collections.deque[tuple[bytes, Any, float]] = collections.deque()
        # Requests whose hold ended (read, released, expired): a read of one is refused from
        # this thread at once, even while the engine is idle and takes no steps.
        self.ended: set[str] = set()
        self._ended_order: collections.deque[str] = collections.deque()
        self._outbox: collections.deque[list[Any]] = collections.deque()
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        try:
            if port == 0:
                self.port = self._sock.bind_to_random_port(f"tcp://{host}")
            else:
                self._sock.bind(f"tcp://{host}:{port}")
                self.port = port
        except zmq.ZMQError as e:
            self._sock.close(0)
            raise ConfigError(f"kv_port: cannot listen on {host}:{port}: {e}") from None
        self.refused_hellos = 0
        self._waker = _Waker(self._ctx)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-server", daemon=True)
        self._thread.start()

    def end(self, request_id: str) -> None:
        """(step thread) ``request_id``'s hold is over."""
        self.ended.add(request_id)
        self._ended_order.append(request_id)
        if len(self._ended_order) > 4096:
            self.ended.discard(self._ended_order.popleft())

    def send(self, peer: bytes, msg: wire.Message, frames: list[Any] = ()) -> None:
        """Queue an answer (any thread)."""
        self._outbox.append([peer, wire.encode(msg), *frames])
        self._waker.wake()

    def _run(self) -> None:
        sock, poller = self._sock, zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._waker.sock, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                self._once(sock, poller)
            except Exception:  # one bad message must not end the side channel
                log.exception("KV side channel: server loop")
        sock.close(0)
        self._waker.close()

    def _once(self, sock: Any, poller: Any) -> None:
        ready = dict(poller.poll(POLL_MS))
        if self._waker.sock in ready:
            self._waker.drain()
        if sock in ready:
            while True:
                try:
                    parts = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                if len(parts) >= 2:
                    self._handle(parts[0], parts[1])
        while self._outbox:
            sock.send_multipart(self._outbox.popleft(), copy=False)

    def _handle(self, peer: bytes, data: bytes) -> None:
        try:
            msg = wire.decode(data)
        except Exception:
            return  # not ours: ignore
        if isinstance(msg, wire.Ping):
            self._sock.send_multipart([peer, wire.encode(wire.Pong(msg.seq))])
        elif isinstance(msg, wire.Hello):
            theirs = {"version": msg.version, "model": msg.model, **msg.identity}
            ours = {"version": wire.PROTOCOL_VERSION, **self.handshake}
            why = wire.first_mismatch(ours, theirs)
            if why is None:
                reply: wire.Message = wire.HelloOk(self.engine_id)
            else:
                self.refused_hellos += 1
                reply = wire.Refused(f"handshake refused: {why}")
            self._sock.send_multipart([peer, wire.encode(reply)])
        elif isinstance(msg, wire.Read) and msg.request_id in self.ended:
            reply = wire.Refused(f"request {msg.request_id!r} is not held here (its lease "
                                 "expired or it was released)", msg.xfer_id)  # fmt: skip
            self._sock.send_multipart([peer, wire.encode(reply)])
        else:
            self.inbox.append((peer, msg, time.monotonic()))
            if self.on_inbox is not None:
                self.on_inbox()

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._waker.wake()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=2.0)


@dataclass
class Fetch:
    """One request's read from one prefill engine."""

    request_id: str  # this engine's
    host: str
    port: int
    remote_request_id: str
    indices: list[int]
    xfer_id: int = 0
    started: float = 0.0


@dataclass
class FetchResult:
    request_id: str
    payload: Any = None  # a BlockPayload, or None when it failed
    error: str | None = None
    nbytes: int = 0
    seconds: float = 0.0
    frames: Any = None  # the memory the payload's tensors view, kept until it is imported


@dataclass
class _Peer:
    sock: Any
    ready: bool = False  # the hello was answered
    last_seen: float = 0.0
    last_ping: float = 0.0
    queued: list[Fetch] = field(default_factory=list)  # before the hello's answer
    inflight: dict[int, Fetch] = field(default_factory=dict)


class KVClient:
    def __init__(
        self,
        engine_id: str,
        handshake: dict[str, Any],
        heartbeat_timeout_s: float = 1.0,
        read_timeout_s: float = 120.0,
    ) -> None:
        self.engine_id = engine_id
        self.handshake = handshake
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.read_timeout_s = read_timeout_s
        self.results: collections.deque[FetchResult] = collections.deque()
        self._jobs: collections.deque[tuple[str, Any]] = collections.deque()
        self._ctx = zmq.Context.instance()
        self._peers: dict[tuple[str, int], _Peer] = {}
        self._ids = itertools.count(1)
        self._pings = itertools.count(1)
        self._waker = _Waker(self._ctx)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-client", daemon=True)
        self._thread.start()

    # -- any thread ---------------------------------------------------------------------------
    def fetch(self, job: Fetch) -> None:
        self._jobs.append(("fetch", job))
        self._waker.wake()

    def cancel(self, request_id: str) -> None:
        self._jobs.append(("cancel", request_id))
        self._waker.wake()

    def release(self, host: str, port: int, remote_request_id: str) -> None:
        self._jobs.append(("release", (host, port, remote_request_id)))
        self._waker.wake()

    # -- the client's thread -----------------------------------------------------------------
    def _peer(self, host: str, port: int) -> _Peer:
        key = (host, port)
        p = self._peers.get(key)
        if p is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(f"tcp://{host}:{port}")
            now = time.monotonic()
            p = self._peers[key] = _Peer(sock, last_seen=now, last_ping=now)
            ident = {k: v for k, v in self.handshake.items() if k != "model"}
            model = self.handshake["model"]
            hello = wire.Hello(wire.PROTOCOL_VERSION, self.engine_id, model, ident)
            sock.send(wire.encode(hello))
        return p

    def _drop(self, key: tuple[str, int], error: str) -> None:
        """Fail every fetch at a peer and forget its socket (a later fetch reconnects)."""
        p = self._peers.pop(key)
        for f in [*p.queued, *p.inflight.values()]:
            self.results.append(FetchResult(f.request_id, error=error))
        p.sock.close(0)

    def _send_read(self, p: _Peer, f: Fetch) -> None:
        f.xfer_id = next(self._ids)
        f.started = time.monotonic()
        p.inflight[f.xfer_id] = f
        p.sock.send(wire.encode(wire.Read(f.xfer_id, f.remote_request_id, f.indices)))

    def _take_jobs(self) -> None:
        while self._jobs:
            kind, arg = self._jobs.popleft()
            if kind == "fetch":
                p = self._peer(arg.host, arg.port)
                if p.ready:
                    self._send_read(p, arg)
                else:
                    p.queued.append(arg)
            elif kind == "cancel":
                for p in self._peers.values():
                    p.queued = [f for f in p.queued if f.request_id != arg]
                    for x, f in list(p.inflight.items()):
                        if f.request_id == arg:
                            del p.inflight[x]
            else:
                host, port, rid = arg
                self._peer(host, port).sock.send(wire.encode(wire.Release(rid)))

    def _receive(self, key: tuple[str, int], p: _Peer) -> None:
        while key in self._peers:
            try:
                parts = p.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            now = time.monotonic()
            p.last_seen = now
            try:
                msg = wire.decode(parts[0].buffer)
            except Exception:
                continue
            if isinstance(msg, wire.HelloOk):
                p.ready = True
                for f in p.queued:
                    self._send_read(p, f)
                p.queued = []
            elif isinstance(msg, wire.Refused) and msg.xfer_id < 0:
                self._drop(key, msg.reason)  # the handshake: nothing there can be read
            elif isinstance(msg, wire.Refused):
                f = p.inflight.pop(msg.xfer_id, None)
                if f is not None:
                    self.results.append(FetchResult(f.request_id, error=msg.reason))
            elif isinstance(msg, wire.ReadOk):
                f = p.inflight.pop(msg.xfer_id, None)
                if f is None:
                    continue  # cancelled meanwhile
                frames = [x.buffer for x in parts[1:]]
                try:
                    payload = wire.unpack_payload(msg.payload, frames)
                except Exception as e:  # a malformed answer fails the fetch, not the thread
                    self.results.append(FetchResult(f.request_id, error=f"bad payload: {e}"))
                    continue
                self.results.append(FetchResult(f.request_id, payload,
                                                nbytes=wire.payload_bytes(frames),
                                                seconds=now - f.started, frames=parts))  # fmt: skip

    def _heartbeat(self, now: float) -> None:
        for key, p in list(self._peers.items()):
            waiting = p.queued or p.inflight
            if not waiting:
                p.last_seen = max(p.last_seen, now - PING_INTERVAL_S)  # idle: nothing to judge
                continue
            if now - p.last_seen > self.heartbeat_timeout_s:
                self._drop(key, f"prefill engine {key[0]}:{key[1]} is unreachable (no answer "
                                f"for {self.heartbeat_timeout_s:g} s)")  # fmt: skip
                continue
            late = [f for f in p.inflight.values() if now - f.started > self.read_timeout_s]
            for f in late:
                del p.inflight[f.xfer_id]
                self.results.append(FetchResult(f.request_id, error="read timed out"))
            if now - p.last_ping >= PING_INTERVAL_S:
                p.last_ping = now
                p.sock.send(wire.encode(wire.Ping(next(self._pings))))

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._once()
            except Exception:  # a bug here must not strand every fetch: say so, go on
                log.exception("KV side channel: client loop")
        for p in self._peers.values():
            p.sock.close(0)
        self._waker.close()

    def _once(self) -> None:
        self._take_jobs()
        poller = zmq.Poller()
        poller.register(self._waker.sock, zmq.POLLIN)
        socks = {p.sock: key for key, p in self._peers.items()}
        for s in socks:
            poller.register(s, zmq.POLLIN)
        busy = any(p.queued or p.inflight for p in self._peers.values())
        ready = dict(poller.poll(int(PING_INTERVAL_S * 500) if busy else POLL_MS))
        for s in ready:
            if s is self._waker.sock:
                self._waker.drain()
            elif socks[s] in self._peers:
                self._receive(socks[s], self._peers[socks[s]])
        self._heartbeat(time.monotonic())

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._waker.wake()
        if self._thread.is_alive():
            self._thread.join(timeout=2.0)


class Releaser:
    """Fire-and-forget releases from a decode engine's scheduler side (its engine thread), so
    an abort frees the prefill engine's blocks at once, though no step reaches the workers."""

    def __init__(self) -> None:
        self._ctx = zmq.Context.instance()
        self._socks: dict[tuple[str, int], Any] = {}

    def release(self, host: str, port: int, remote_request_id: str) -> None:
        sock = self._socks.get((host, port))
        if sock is None:
            sock = self._socks[(host, port)] = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 500)  # a release queued at shutdown still goes
            sock.setsockopt(zmq.SNDHWM, 10000)
            sock.connect(f"tcp://{host}:{port}")
        try:
            sock.send(wire.encode(wire.Release(remote_request_id)), zmq.NOBLOCK)
        except zmq.Again:
            pass  # the peer is gone or far behind: its lease frees the blocks

    def close(self) -> None:
        for s in self._socks.values():
            s.close()
        self._socks = {}
