"""A node other than node 0 of an ``mp`` engine across machines (``kvserve serve ...
--nnodes K --node-rank r --headless``): this machine's tensor-parallel ranks, no engine and
no API server.

The node connects to node 0's channel for it (:mod:`kvserve.executor.node_link`), says who it
is, and waits for node 0's engine to send the start: the engine's settings (one source for
every setting a rank reads, so the ranks cannot disagree; only the model's directory is this
machine's own), the pool size and the group to join. It then spawns its ranks,
``r * tp / K`` to ``(r + 1) * tp / K - 1``, as the ``mp`` backend's worker processes, placed by
their rank on this machine, and relays: each call from node 0 to every local rank, each
rank's reply back, unread. A rank whose process ends is reported to node 0 (which fails the
engine naming it) and the node stops its other ranks and exits 1.

It exits 0 when node 0's engine shuts down cleanly, and 1, with a message saying why, when
node 0 fails the group, when node 0's engine is gone (its process ended, or no heartbeat for
``HEARTBEAT_TIMEOUT_S``), and when no engine sends the start within ``KVSERVE_NODE_WAIT_S``.
SIGTERM and SIGINT stop its ranks and exit 0.
"""

from __future__ import annotations

import dataclasses
import logging
import pickle
import platform
import signal
import time
from multiprocessing.connection import Connection
from typing import Any

import zmq

from kvserve import envs
from kvserve.config import ConfigError, EngineConfig
from kvserve.executor.node_link import (
    CALL,
    DIED,
    HEARTBEAT_TIMEOUT_S,
    HELLO,
    REPLY,
    START,
    STOP,
    NodeLink,
    node_port,
)
from kvserve.executor.worker_process import RankPlace, ended, start_worker, stop_workers

log = logging.getLogger("kvserve.headless")


class _Stopped(Exception):
    """SIGTERM or SIGINT: stop the ranks and exit 0."""


def run_headless(config: EngineConfig) -> int:
    """Serve this node's ranks until node 0's engine stops; the process's exit status."""
    par = config.parallel
    if par.nnodes < 2 or par.node_rank == 0:
        raise ConfigError(f"node_rank: --headless runs a node other than node 0 of --nnodes "
                          f"above 1; got node_rank {par.node_rank} of nnodes {par.nnodes} "
                          "(node 0 runs the engine: drop --headless)")  # fmt: skip
    assert par.master_port is not None  # ParallelConfig requires it with nnodes above 1
    endpoint = f"tcp://{par.master_addr}:{node_port(par.master_port, par.node_rank)}"
    ctx = zmq.Context()
    link = NodeLink(ctx, endpoint, bind=False)
    procs: list[Any] = []
    conns: list[Connection] = []
    code = 1

    def stop(*_: Any) -> None:
        raise _Stopped

    old = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        link.send_obj(HELLO, {"node_rank": par.node_rank, "nnodes": par.nnodes,
                              "tensor_parallel_size": par.tensor_parallel_size,
                              "host": platform.node()})  # fmt: skip
        start = _await_start(link, par.nnodes, envs.KVSERVE_NODE_WAIT_S)
        if isinstance(start, int):
            return start
        head_config, num_blocks, max_model_len, dist_init = start
        # every setting node 0's; the model where this machine keeps it
        worker_config = dataclasses.replace(head_config, model=config.model)
        local_world = par.tensor_parallel_size // par.nnodes
        first = par.node_rank * local_world
        for i in range(local_world):
            place = RankPlace(first + i, i, local_world)
            proc, conn = start_worker(worker_config, num_blocks, max_model_len, place, dist_init)
            procs.append(proc)
            conns.append(conn)
        log.info("node %d: workers %d-%d (pids %s) joined node 0's engine at %s",
                 par.node_rank, first, first + local_world - 1,
                 ", ".join(str(p.pid) for p in procs), endpoint)  # fmt: skip
        code = _relay(link, procs, conns, first)
    except _Stopped:
        log.info("node %d: stopping (signal)", par.node_rank)
        code = 0
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        # a clean end asks the ranks to stop (each shuts its worker down); a failed group's
        # ranks may wait in a collective that will never complete
        stop_workers(procs, conns, at_once=code != 0)
        link.close(linger_s=1.0)
        ctx.term()
    return code


def _await_start(link: NodeLink, nnodes: int, wait_s: float) -> tuple[Any, ...] | int:
    """Node 0's start message, or the exit status where none comes."""
    deadline = time.monotonic() + wait_s
    while (left := deadline - time.monotonic()) > 0:
        msg = link.recv(min(left, 0.5))
        if msg is not None and msg[0] == START:
            return pickle.loads(msg[1])
        if msg is not None and msg[0] == STOP:
            log.error("node 0's engine refused this node: %s", msg[1].decode())
            return 1
        if link.check():
            log.error("node 0's engine at %s went away before it started this node's workers",
                      link.endpoint)  # fmt: skip
            return 1
    log.error("no engine at %s sent the start within %g s (KVSERVE_NODE_WAIT_S): start node 0 "
              "with `kvserve serve ... --nnodes %d --node-rank 0` and the same --master-addr "
              "and --master-port", link.endpoint, wait_s, nnodes)  # fmt: skip
    return 1


def _relay(link: NodeLink, procs: list[Any], conns: list[Connection], first: int) -> int:
    """Pass calls to the local ranks and their replies back until the group ends; each wake-up
    looks only at what fired (replies before deaths: a rank's last reply still goes back)."""
    poller = zmq.Poller()
    link.register(poller)
    by_pipe = {conn.fileno(): i for i, conn in enumerate(conns)}
    by_sentinel = {proc.sentinel: i for i, proc in enumerate(procs)}
    for fd in (*by_pipe, *by_sentinel):
        poller.register(fd, zmq.POLLIN)
    while True:
        fired = dict(poller.poll())
        if link.sock in fired:
            while (msg := link.recv(0)) is not None:
                if msg[0] == CALL:
                    for i, conn in enumerate(conns):
                        try:
                            conn.send_bytes(msg[1])
                        except OSError:  # a closed pipe: the worker is gone
                            return _died(link, procs, first, i)
                elif msg[0] == STOP:
                    why = msg[1].decode()
                    if why:
                        log.error("node 0's engine stopped the group: %s", why)
                        return 1
                    log.info("node 0's engine shut down; stopping this node's workers")
                    return 0
        for fd, i in by_pipe.items():
            if fd in fired:
                try:
                    data = conns[i].recv_bytes()
                except (EOFError, OSError):
                    return _died(link, procs, first, i)
                link.send(REPLY, str(first + i).encode(), data)
        for fd, i in by_sentinel.items():
            if fd in fired:
                return _died(link, procs, first, i)
        if link.monitor in fired and link.check():
            log.error("lost node 0's engine at %s: its process ended or it answered no "
                      "heartbeat for %g s; stopping this node's workers", link.endpoint,
                      HEARTBEAT_TIMEOUT_S)  # fmt: skip
            return 1


def _died(link: NodeLink, procs: list[Any], first: int, i: int) -> int:
    how = ended(procs[i])
    link.send(DIED, str(first + i).encode(), how.encode())
    log.error("worker %d %s; stopping this node's workers", first + i, how)
    return 1
