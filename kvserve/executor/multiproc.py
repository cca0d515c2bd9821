"""Workers in processes of their own (vLLM's ``mp`` backend): the engine sends each step.

The engine's machine (node 0) runs its ranks as spawned worker processes
(:mod:`kvserve.executor.worker_process`), one duplex pipe each. With ``--nnodes K`` the
tensor-parallel ranks span K machines, ``tensor_parallel_size / K`` on each: every other node
runs ``kvserve serve ... --node-rank r --headless`` (:mod:`kvserve.executor.headless`), which
starts its own ranks and relays calls and replies over its channel to node 0
(:mod:`kvserve.executor.node_link`). A call goes to every rank, local or remote, as the same
pickled message, and every reply, from a pipe or a channel, comes back to one loop
(:meth:`MultiprocExecutor._receive_all`) with the same ``ok`` / ``error`` meaning.

Failure is an error within seconds, never a hang. Every wait also watches each local worker's
process sentinel, each node's channel (a node reports a rank whose process ended; a node whose
process ended or that stops answering heartbeats is a lost connection), so a rank that dies is
reported at once as :class:`~kvserve.executor.abstract.WorkerDiedError` naming the rank, the
node and how it ended. A rank that raises while another has not answered within
``ERROR_GRACE_S`` has left its peers waiting in a collective that will never complete: the
ranks are out of step, so that too is a :class:`WorkerDiedError` naming the rank and its error,
not a wait for the collective's own timeout. Either way the executor stops every worker
(the other nodes' too) and refuses every later call with the same error. A call that every
rank answers, even with an error, fails only itself.

A program that starts an ``mp`` engine at import time must guard it with ``if __name__ ==
"__main__":``, as any ``spawn`` user must: the worker imports the program's main module.
"""

from __future__ import annotations

import logging
import pickle
import time
import weakref
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import zmq

from kvserve import envs
from kvserve.config import ConfigError, EngineConfig
from kvserve.distributed import DistributedInit, free_port
from kvserve.distributed.communicator import backend_for
from kvserve.executor.abstract import (
    Executor,
    Method,
    StepHandle,
    WorkerDiedError,
    WorkerError,
)
from kvserve.executor.node_link import (
    CALL,
    DIED,
    HEARTBEAT_TIMEOUT_S,
    HELLO,
    REPLY,
    START,
    STOP,
    NodeLink,
    bind_address,
    node_port,
)
from kvserve.executor.worker_process import RankPlace, ended, start_worker, stop_workers
from kvserve.sched.output import ModelRunnerOutput, SchedulerOutput
from kvserve.worker.worker import WorkerInfo

log = logging.getLogger("kvserve.executor")

# After a rank's error, how long to wait for the other ranks' replies (or a death that
# explains it) before calling the group out of step: a peer stuck in a collective never
# answers, and one that is merely slower than this after its peer raised is taken as stuck
# too (the grace trades that against how soon a real desync is reported).
ERROR_GRACE_S = 1.0


@dataclass(slots=True)
class RemoteNode:
    """Another node's ranks, reached over its channel."""

    node_rank: int
    link: NodeLink
    ranks: range
    host: str = "?"


class MultiprocExecutor(Executor):
    remote = True

    def __init__(self, config: EngineConfig, num_blocks: int, max_model_len: int) -> None:
        par = config.parallel
        if par.node_rank != 0:
            raise ConfigError(
                f"node_rank: node {par.node_rank} runs no engine; start it "
                "with `kvserve serve ... --headless` (node 0 runs the engine)"
            )
        world_size = par.tensor_parallel_size
        local_world = world_size // par.nnodes
        dist_init = None
        if par.nnodes > 1:  # rank 0, here, hosts the rendezvous every node names
            assert par.master_port is not None  # ParallelConfig requires it
            dist_init = DistributedInit(world_size, par.master_addr, par.master_port,
                                        backend_for(config.device))  # fmt: skip
        elif world_size > 1:  # the ranks meet on a free loopback port of this machine
            dist_init = DistributedInit(world_size, "127.0.0.1", free_port(),
                                        backend_for(config.device))  # fmt: skip
        self._world_size = world_size
        self._procs: list[Any] = []
        self._conns: list[Connection] = []
        self._nodes: list[RemoteNode] = []
        self._dead: str | None = None
        self._late_death: str | None = None
        self._in_flight: deque[StepHandle] = deque()  # steps sent, replies not yet taken
        self._ctx: zmq.Context | None = zmq.Context() if par.nnodes > 1 else None
        self._finalizer = weakref.finalize(self, _shutdown, self._procs, self._conns,
                                           self._nodes, self._ctx)  # fmt: skip
        try:
            if par.nnodes > 1:
                self._await_nodes(config, local_world)
            for rank in range(local_world):
                place = RankPlace(rank, rank, local_world)
                proc, conn = start_worker(config, num_blocks, max_model_len, place, dist_init)
                self._procs.append(proc)
                self._conns.append(conn)
            for node in self._nodes:
                node.link.send_obj(START, (config, num_blocks, max_model_len, dist_init))
            # every wait watches each waited-for local rank's pipe and process, and each
            # node's channel and its monitor
            self._fds = [(conn.fileno(), proc.sentinel)
                         for conn, proc in zip(self._conns, self._procs, strict=True)]  # fmt: skip
            self._node_items = [(sock, zmq.POLLIN) for node in self._nodes
                                for sock in (node.link.sock, node.link.monitor)]  # fmt: skip
            infos = self._receive_all()
            for rank, proc in enumerate(self._procs):
                log.info("worker %d: pid %d", rank, proc.pid)
        except BaseException:
            self._finalizer()
            raise
        self.info = WorkerInfo.of_ranks(infos)

    @property
    def worker_pids(self) -> list[int]:
        """The local workers' pids (node 0's ranks)."""
        return [p.pid for p in self._procs]

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.collective_rpc("execute_model", (scheduler_output,))[0]

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> StepHandle:
        """Send the step and return: every rank reads it from its pipe once it is done with
        the steps sent before, so the engine's planning of the next step overlaps this one."""
        handle = StepHandle(self._land_steps)
        try:
            self._raise_if_dead()
            self._send(pickle.dumps(("execute_model", (scheduler_output,), {}),
                                    pickle.HIGHEST_PROTOCOL))  # fmt: skip
        except WorkerDiedError as e:
            handle.land(None, e)
            return handle
        self._in_flight.append(handle)
        return handle

    def _land_steps(self) -> None:
        """Take the replies of every step in flight, oldest first (a rank answers its calls
        in order); a step that failed keeps its error for its ``result()``."""
        while self._in_flight:
            handle = self._in_flight.popleft()
            try:
                self._raise_if_dead()
                handle.land(self._receive_all()[0], None)
            except (WorkerDiedError, WorkerError) as e:
                handle.land(None, e)

    def collective_rpc(
        self, method: Method, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> list[Any]:
        self._land_steps()  # their replies come first
        self._raise_if_dead()
        self._send(pickle.dumps((method, args, kwargs or {}), pickle.HIGHEST_PROTOCOL))
        return self._receive_all()

    def _send(self, message: bytes) -> None:
        """One call's message to every rank, local and remote."""
        for rank, conn in enumerate(self._conns):
            try:
                conn.send_bytes(message)
            except OSError:  # a closed pipe: the worker is gone
                raise self._fail(self._local_death(rank)) from None
        for node in self._nodes:
            if not node.link.send(CALL, message):  # its connection is gone
                raise self._fail(self._node_gone(node))

    def check_health(self) -> None:
        self._land_steps()  # a reply in flight is a step's, not news of a death
        self._raise_if_dead()
        self._events(set(range(self._world_size)), None)  # a death between calls

    def shutdown(self) -> None:
        self._finalizer()

    def _raise_if_dead(self) -> None:
        """The group's death, as the error every later call gets."""
        if self._dead is not None:
            raise WorkerDiedError(self._dead)
        if self._late_death is not None:  # a rank that ended after its last reply
            raise self._fail(self._late_death)

    # -- the engine's side of a call ---------------------------------------------------------
    def _receive_all(self) -> list[Any]:
        """Every rank's reply to the call it was sent, in rank order. A rank's death raises
        at once (the ranks wait on each other, so a dead rank is the cause, and a survivor's
        error, a collective that lost its peer, only its echo); a rank's error with a peer
        still silent ERROR_GRACE_S later leaves the group out of step. A rank that has
        replied is no longer watched during this call: its collectives are done, so its
        peers can finish theirs, and its end (a worker that could not start exits after
        saying why) is the next call's business."""
        pending = set(range(self._world_size))
        replies: dict[int, tuple[str, Any]] = {}
        error_at: float | None = None
        local = len(self._procs)
        while pending:
            timeout = -1
            if error_at is not None:
                timeout = max(0, int((error_at + ERROR_GRACE_S - time.monotonic()) * 1000))
            items = [(fd, zmq.POLLIN) for rank in pending if rank < local
                     for fd in self._fds[rank]] + self._node_items  # fmt: skip
            ready = {fd for fd, _ in zmq.zmq_poll(items, timeout)}
            for rank, reply in self._events(pending, ready):
                replies[rank] = reply
                pending.discard(rank)
                if reply[0] == "error" and error_at is None:
                    error_at = time.monotonic()
            if (pending and error_at is not None
                    and time.monotonic() >= error_at + ERROR_GRACE_S):  # fmt: skip
                raise self._fail(self._out_of_step(replies))
        for rank in range(self._world_size):
            kind, value = replies[rank]
            if kind == "error":
                raise WorkerError(f"worker {rank}{self._where(rank)}: {value}")
        return [replies[rank][1] for rank in range(self._world_size)]

    def _events(self, pending: set[int], ready: set[Any] | None) -> list[tuple[int, Any]]:
        """The replies of ``pending`` ranks that have arrived, looking only where the poll
        found something (``ready``; None: everywhere); raises WorkerDiedError for a pending
        rank whose process ended or whose node is gone."""
        out = []
        for rank, conn in enumerate(self._conns):
            if rank not in pending:
                continue
            if conn.poll(0) if ready is None else self._fds[rank][0] in ready:
                try:
                    out.append((rank, pickle.loads(conn.recv_bytes())))
                except (EOFError, OSError):
                    raise self._fail(self._local_death(rank)) from None
        for node in self._nodes:
            while (msg := node.link.recv(0)) is not None:
                rank = int(msg[1]) if msg[0] in (REPLY, DIED) else -1
                if msg[0] == REPLY and rank in pending:
                    out.append((rank, pickle.loads(msg[2])))
                elif msg[0] == DIED:
                    self._late_death = (f"worker {rank} {msg[2].decode()}{self._where(rank)}; "
                                        "the engine cannot run more steps")  # fmt: skip
                    if rank in pending:
                        raise self._fail(self._late_death)
            if node.link.check() and pending.intersection(node.ranks):
                raise self._fail(self._node_gone(node))
        answered = {rank for rank, _ in out}
        for rank, proc in enumerate(self._procs):
            if rank not in pending or rank in answered:
                continue
            if (ready is None or self._fds[rank][1] in ready) and proc.exitcode is not None:
                raise self._fail(self._local_death(rank))
        return out

    def _out_of_step(self, replies: dict[int, tuple[str, Any]]) -> str:
        rank = min(r for r, (kind, _) in replies.items() if kind == "error")
        silent = [r for r in range(self._world_size) if r not in replies]
        return (f"worker {rank}{self._where(rank)} raised {replies[rank][1]} while worker(s) "
                f"{', '.join(map(str, silent))} still waited in the step: the tensor-parallel "
                "ranks are out of step; the engine cannot run more steps")  # fmt: skip

    def _where(self, rank: int) -> str:
        for node in self._nodes:
            if rank in node.ranks:
                return f" on node {node.node_rank} ({node.host})"
        return ""

    def _node_gone(self, node: RemoteNode) -> str:
        return (f"node {node.node_rank} ({node.host}, workers {node.ranks.start}-"
                f"{node.ranks.stop - 1}) is gone: its kvserve process ended or it answered no "
                f"heartbeat for {HEARTBEAT_TIMEOUT_S:g} s; the engine cannot run more "
                "steps")  # fmt: skip

    def _local_death(self, rank: int) -> str:
        return f"worker {rank} {ended(self._procs[rank])}; the engine cannot run more steps"

    def _fail(self, message: str) -> WorkerDiedError:
        """The group cannot run another step: record why, stop every worker (here at once,
        the other nodes' by telling them why), and return the error to raise."""
        self._dead = message
        log.error("%s", message)
        for proc in self._procs:
            if proc.exitcode is None:
                proc.terminate()
        for node in self._nodes:
            node.link.send(STOP, message.encode())
        return WorkerDiedError(message)

    # -- start-up with other nodes -------------------------------------------------------------
    def _await_nodes(self, config: EngineConfig, local_world: int) -> None:
        """Bind each other node's channel and wait (KVSERVE_NODE_WAIT_S at most) until every
        node has said hello with a matching shape."""
        par = config.parallel
        assert self._ctx is not None and par.master_port is not None
        host = bind_address(par.master_addr)
        for r in range(1, par.nnodes):
            endpoint = f"tcp://{host}:{node_port(par.master_port, r)}"
            try:
                link = NodeLink(self._ctx, endpoint, bind=True)
            except zmq.ZMQError as e:
                raise ConfigError(
                    f"master_port: node {r}'s channel cannot bind {endpoint} "
                    f"({e}); ports master_port to master_port + "
                    f"{par.nnodes - 1} must be free on node 0"
                ) from None
            ranks = range(r * local_world, (r + 1) * local_world)
            self._nodes.append(RemoteNode(r, link, ranks))
        wait_s = envs.KVSERVE_NODE_WAIT_S
        deadline = time.monotonic() + wait_s
        for node in self._nodes:
            msg = node.link.recv(max(0.0, deadline - time.monotonic()))
            if msg is None:
                raise ConfigError(
                    f"nnodes: node {node.node_rank} of {par.nnodes} did not connect to "
                    f"{node.link.endpoint} within {wait_s} s (KVSERVE_NODE_WAIT_S); start it "
                    f"with `kvserve serve ... --nnodes {par.nnodes} --node-rank "
                    f"{node.node_rank} --master-addr {par.master_addr} --master-port "
                    f"{par.master_port} --headless`")  # fmt: skip
            hello = pickle.loads(msg[1]) if msg[0] == HELLO else {}
            node.host = str(hello.get("host", "?"))
            want = {"node_rank": node.node_rank, "nnodes": par.nnodes,
                    "tensor_parallel_size": par.tensor_parallel_size}  # fmt: skip
            got = {k: hello.get(k) for k in want}
            if got != want:
                why = (f"nnodes: the node at {node.link.endpoint} ({node.host}) runs "
                       f"{got}, node 0 expects {want}")  # fmt: skip
                node.link.send(STOP, why.encode())
                raise ConfigError(why)
            log.info("node %d (%s) connected: workers %d-%d", node.node_rank, node.host,
                     node.ranks.start, node.ranks.stop - 1)  # fmt: skip


def _shutdown(procs: list[Any], conns: list[Connection], nodes: list[RemoteNode],
              ctx: zmq.Context | None) -> None:  # fmt: skip
    """Tell the other nodes to stop, stop the local workers, close the channels."""
    for node in nodes:
        try:
            node.link.send(STOP, b"")
        except zmq.ZMQError:
            pass
    stop_workers(procs, conns)
    for node in nodes:
        node.link.close(linger_s=1.0)
    if ctx is not None:
        ctx.term()
