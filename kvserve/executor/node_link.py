"""The channel between node 0's engine and another node's ranks (``--nnodes`` above 1).

Node ``r`` (1 <= r < nnodes) talks to node 0 over one pair of ZeroMQ DEALER sockets on TCP:
node 0 binds ``master_addr:master_port + r``, node ``r`` connects to it (``master_port``
itself is rank 0's torch.distributed rendezvous). A message is a few frames, the first naming
its kind; a call and a rank's reply travel as the bytes the local workers' pipes carry (one
pickle), so node 0 handles a remote rank's reply exactly as a local one's. Nothing
authenticates a peer and a message is unpickled: the nodes must share a trusted network, as
torch.distributed's rendezvous requires anyway.

Liveness is ZeroMQ's own: both ends send ZMTP heartbeats every ``HEARTBEAT_IVL_S`` from
ZeroMQ's I/O thread (so a node busy in a long step still answers them) and drop a connection
that is silent for ``HEARTBEAT_TIMEOUT_S``; a socket monitor reports the drop, as it reports
at once a peer whose process ended (its kernel closed the TCP connection). Either end treats
a lost connection as the end of the group: it cannot run another step.
"""

from __future__ import annotations

import pickle
import socket
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

HEARTBEAT_IVL_S = 1.0
HEARTBEAT_TIMEOUT_S = 3.0

# Message kinds (the first frame).
HELLO = b"hello"  # node r -> 0: who it is (pickled dict)
START = b"start"  # 0 -> node r: the config, pool size and group to start its ranks with
CALL = b"call"  # 0 -> node r: one pickled call, for each of its ranks
REPLY = b"reply"  # node r -> 0: rank, that rank's pickled reply
DIED = b"died"  # node r -> 0: rank, how its process ended
STOP = b"stop"  # 0 -> node r: stop the ranks and exit; why (empty: a clean shutdown)


def node_port(master_port: int, node_rank: int) -> int:
    """The port on node 0 where node ``node_rank``'s channel meets."""
    return master_port + node_rank


def bind_address(master_addr: str) -> str:
    """The address node 0 binds (ZeroMQ binds an interface's address, not a host name)."""
    try:
        return socket.gethostbyname(master_addr)
    except OSError:
        return master_addr


class NodeLink:
    """One end of a node's channel: a DEALER socket with heartbeats on and a monitor that
    says when the peer's connection is gone."""

    def __init__(self, ctx: zmq.Context, endpoint: str, bind: bool) -> None:
        self.endpoint = endpoint
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.HEARTBEAT_IVL, int(HEARTBEAT_IVL_S * 1000))
        self.sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(HEARTBEAT_TIMEOUT_S * 1000))
        self.sock.setsockopt(zmq.HEARTBEAT_TTL, int(HEARTBEAT_TIMEOUT_S * 1000))
        events = zmq.EVENT_ACCEPTED | zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED
        self.monitor = self.sock.get_monitor_socket(events)
        self.connected = False
        self.lost = False
        if bind:
            self.sock.bind(endpoint)
        else:
            self.sock.connect(endpoint)

    def send(self, *frames: bytes) -> bool:
        """Queue a message; False where it cannot be (no peer is connected: a DEALER would
        block until one comes, and a lost peer does not)."""
        try:
            self.sock.send_multipart(list(frames), flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return False
        return True

    def send_obj(self, kind: bytes, obj: Any) -> bool:
        return self.send(kind, pickle.dumps(obj, pickle.HIGHEST_PROTOCOL))

    def recv(self, timeout_s: float | None = 0) -> list[bytes] | None:
        """The next message, or None where none comes within ``timeout_s``."""
        if timeout_s is not None and not self.sock.poll(int(timeout_s * 1000)):
            return None
        return self.sock.recv_multipart()

    def check(self) -> bool:
        """Read the monitor's events; whether the peer's connection was lost after it was
        made (a peer that never came is the waiting side's business, not a loss)."""
        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)["event"]
            if event in (zmq.EVENT_ACCEPTED, zmq.EVENT_CONNECTED):
                self.connected = True
            elif event == zmq.EVENT_DISCONNECTED and self.connected:
                self.lost = True
        return self.lost

    def register(self, poller: zmq.Poller) -> None:
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)

    def close(self, linger_s: float = 0.0) -> None:
        """Close both sockets; ``linger_s``: how long a message still queued (a last STOP)
        may take to leave."""
        try:
            self.sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self.monitor.close(linger=0)
        self.sock.close(linger=int(linger_s * 1000))
