"""Workers in processes of their own (vLLM's ``mp`` backend): the engine sends each step.

Each worker is started with ``spawn`` (a fresh interpreter: no inherited threads, locks or
OpenMP pools, and CUDA may be initialised in it) and builds its model and KV pool from the
engine's config. The engine and a worker talk over one duplex pipe: a call is one pickled
message each way. Every wait for a reply also waits on the worker's process sentinel, so a
worker that dies (killed, out of memory, a crash in a kernel) is reported at once as
:class:`~kvserve.executor.abstract.WorkerDiedError` naming the worker and how it ended, and the
executor refuses every later call with the same error. A worker whose engine goes away sees
its pipe close and exits; a worker ignores SIGINT (a terminal's Ctrl-C reaches the whole
process group: the engine decides when its workers stop).

A program that starts an ``mp`` engine at import time must guard it with ``if __name__ ==
"__main__":``, as any ``spawn`` user must: the worker imports the program's main module.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import os
import pickle
import signal
import time
import traceback
import weakref
from multiprocessing.connection import Connection, wait
from typing import Any

from kvserve.config import EngineConfig
from kvserve.distributed import DistributedInit, free_port, rank_device
from kvserve.distributed.communicator import backend_for
from kvserve.executor.abstract import Executor, Method, WorkerDiedError, WorkerError, call_worker
from kvserve.sched.output import ModelRunnerOutput, SchedulerOutput
from kvserve.worker.worker import WorkerInfo

log = logging.getLogger("kvserve.executor")

SHUTDOWN_TIMEOUT_S = 5.0
# After a rank's error, how long to wait for another rank's death to explain it.
ERROR_GRACE_S = 0.5
# How long a worker looks for the next call without sleeping (steps come back to back while
# requests run; an idle engine's workers sleep after this).
BUSY_LOOP_S = 0.05


class MultiprocExecutor(Executor):
    remote = True

    def __init__(self, config: EngineConfig, num_blocks: int, max_model_len: int) -> None:
        world_size = config.parallel.tensor_parallel_size
        dist_init = None
        if world_size > 1:  # the ranks meet on a free loopback port of this machine
            dist_init = DistributedInit(world_size, "127.0.0.1", free_port(),
                                        backend_for(config.device))  # fmt: skip
        ctx = mp.get_context("spawn")
        self._procs: list[Any] = []
        self._conns: list[Connection] = []
        self._dead: str | None = None
        try:
            for rank in range(world_size):
                parent, child = ctx.Pipe(duplex=True)
                proc = ctx.Process(
                    target=_worker_main,
                    args=(child, config, num_blocks, max_model_len, rank, dist_init),
                    name=f"kvserve-worker-{rank}",
                    daemon=True,
                )
                proc.start()
                child.close()  # the worker's end lives in the worker only: EOF when it dies
                self._procs.append(proc)
                self._conns.append(parent)
            self._finalizer = weakref.finalize(self, _stop, self._procs, self._conns)
            infos = self._receive_all()
            for rank, proc in enumerate(self._procs):
                log.info("worker %d: pid %d", rank, proc.pid)
        except BaseException:
            _stop(self._procs, self._conns)
            raise
        self.info = WorkerInfo.of_ranks(infos)

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.collective_rpc("execute_model", (scheduler_output,))[0]

    def collective_rpc(
        self, method: Method, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> list[Any]:
        if self._dead is not None:
            raise WorkerDiedError(self._dead)
        message = pickle.dumps((method, args, kwargs or {}), pickle.HIGHEST_PROTOCOL)
        for rank, conn in enumerate(self._conns):
            try:
                conn.send_bytes(message)
            except OSError:  # a closed pipe: the worker is gone
                raise self._died(rank) from None
        return self._receive_all()

    def check_health(self) -> None:
        if self._dead is not None:
            raise WorkerDiedError(self._dead)
        for rank, proc in enumerate(self._procs):
            if not proc.is_alive():
                raise self._died(rank)

    def shutdown(self) -> None:
        self._finalizer()

    # -- the engine's side of a call ---------------------------------------------------------
    def _receive_all(self) -> list[Any]:
        """Every worker's reply to the call it was sent, in rank order. Raises
        WorkerDiedError as soon as any worker's process ends: the ranks of a tensor-parallel
        group wait on each other, so a dead rank is the cause, and a survivor's error (a
        collective that lost its peer) only its echo."""
        pending = dict(enumerate(self._conns))
        replies: dict[int, tuple[str, Any]] = {}
        while pending:
            sentinels = {self._procs[rank].sentinel: rank for rank in pending}
            ready = wait([*pending.values(), *sentinels])
            for rank, conn in list(pending.items()):
                if conn in ready:
                    try:
                        replies[rank] = pickle.loads(conn.recv_bytes())
                    except (EOFError, OSError):
                        raise self._died(rank) from None
                    del pending[rank]
                    if replies[rank][0] == "error" and len(self._procs) > 1:
                        self._check_peers(ERROR_GRACE_S, pending)
            for obj in ready:
                if obj in sentinels and sentinels[obj] in pending:
                    raise self._died(sentinels[obj])
        for rank in range(len(self._conns)):
            kind, value = replies[rank]
            if kind == "error":
                raise WorkerError(f"worker {rank}: {value}")
        return [replies[rank][1] for rank in range(len(self._conns))]

    def _check_peers(self, grace_s: float, pending: dict[int, Connection]) -> None:
        """Raise WorkerDiedError for a worker of ``pending`` that ends within ``grace_s``
        with no reply sent."""
        if not pending:
            return
        ended = wait([self._procs[rank].sentinel for rank in pending], timeout=grace_s)
        for rank, conn in pending.items():
            if self._procs[rank].sentinel in ended and not conn.poll():
                raise self._died(rank)

    def _died(self, rank: int) -> WorkerDiedError:
        proc = self._procs[rank]
        proc.join(timeout=1.0)
        code = proc.exitcode
        if code is None:
            how = "closed its pipe"
        elif code < 0:
            how = f"was killed by {signal.Signals(-code).name}"
        else:
            how = f"exited with code {code}"
        self._dead = f"worker {rank} (pid {proc.pid}) {how}; the engine cannot run more steps"
        log.error("%s", self._dead)
        return WorkerDiedError(self._dead)


def _stop(procs: list[Any], conns: list[Connection]) -> None:
    """Ask every worker to exit, then make sure it has: terminate, then kill, each bounded."""
    for conn in conns:
        try:
            conn.send_bytes(pickle.dumps(("shutdown", (), {})))
        except (OSError, ValueError):
            pass
    for proc in procs:
        proc.join(timeout=SHUTDOWN_TIMEOUT_S)
        if proc.is_alive():
            proc.terminate()
            proc.join(timeout=SHUTDOWN_TIMEOUT_S)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=SHUTDOWN_TIMEOUT_S)
    for conn in conns:
        conn.close()


# -- the worker process ----------------------------------------------------------------------
def _worker_main(
    conn: Connection,
    config: EngineConfig,
    num_blocks: int,
    max_model_len: int,
    rank: int,
    dist_init: DistributedInit | None,
) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from kvserve.worker.worker import Worker, join_tensor_parallel_group

    try:
        if dist_init is not None:  # one GPU per rank where the config names just "cuda"
            device = rank_device(config.device, rank, dist_init.world_size)
            config = dataclasses.replace(config, device=device)
        tp = join_tensor_parallel_group(config, rank, dist_init)
        worker = Worker(config, num_blocks, max_model_len, rank, tp)
        _reply(conn, "ok", worker.info())
    except BaseException as e:  # noqa: BLE001 - the engine reports it and stops the process
        _reply(conn, "error", f"could not start: {type(e).__name__}: {e}")
        return
    while True:
        _await_call(conn)
        try:
            method, args, kwargs = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return  # the engine is gone: nothing will ask again
        if method == "shutdown":
            worker.shutdown()
            return
        try:
            result = call_worker(worker, method, args, kwargs)
        except Exception as e:  # noqa: BLE001 - a failed call fails only that call
            log.debug("worker %d: %s failed\n%s", rank, method, traceback.format_exc())
            _reply(conn, "error", f"{type(e).__name__}: {e}")
            continue
        _reply(conn, "ok", result)


def _await_call(conn: Connection) -> None:
    """Poll the pipe, yielding the CPU between looks, for BUSY_LOOP_S after a call (vLLM's
    shm_broadcast readers do the same for a second), then return to let the caller block.
    While steps follow each other, a rank that slept between them would pay a wake-up per
    step (on a virtual machine, a halted vCPU's) and lend its core to any other process;
    yielding still lets the engine, or a rank that shares the core, run."""
    deadline = time.monotonic() + BUSY_LOOP_S
    while not conn.poll(0) and time.monotonic() < deadline:
        os.sched_yield()


def _reply(conn: Connection, kind: str, value: Any) -> None:
    try:
        data = pickle.dumps((kind, value), pickle.HIGHEST_PROTOCOL)
    except Exception as e:  # noqa: BLE001 - an unpicklable result is the call's failure
        data = pickle.dumps(("error", f"result not picklable: {type(e).__name__}: {e}"))
    try:
        conn.send_bytes(data)
    except OSError:
        os._exit(0)  # the engine is gone
