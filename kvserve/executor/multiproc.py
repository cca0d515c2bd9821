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

import logging
import multiprocessing as mp
import os
import pickle
import signal
import traceback
import weakref
from multiprocessing.connection import Connection, wait
from typing import Any

from kvserve.config import EngineConfig
from kvserve.executor.abstract import Executor, Method, WorkerDiedError, WorkerError, call_worker
from kvserve.sched.output import ModelRunnerOutput, SchedulerOutput

log = logging.getLogger("kvserve.executor")

SHUTDOWN_TIMEOUT_S = 5.0


class MultiprocExecutor(Executor):
    remote = True

    def __init__(
        self, config: EngineConfig, num_blocks: int, max_model_len: int, world_size: int = 1
    ) -> None:
        ctx = mp.get_context("spawn")
        self._procs: list[Any] = []
        self._conns: list[Connection] = []
        self._dead: str | None = None
        try:
            for rank in range(world_size):
                parent, child = ctx.Pipe(duplex=True)
                proc = ctx.Process(
                    target=_worker_main,
                    args=(child, config, num_blocks, max_model_len, rank),
                    name=f"kvserve-worker-{rank}",
                    daemon=True,
                )
                proc.start()
                child.close()  # the worker's end lives in the worker only: EOF when it dies
                self._procs.append(proc)
                self._conns.append(parent)
            self._finalizer = weakref.finalize(self, _stop, self._procs, self._conns)
            infos = [self._receive(rank) for rank in range(world_size)]
            for rank, proc in enumerate(self._procs):
                log.info("worker %d: pid %d", rank, proc.pid)
        except BaseException:
            _stop(self._procs, self._conns)
            raise
        self.info = infos[0]

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
        return [self._receive(rank) for rank in range(len(self._conns))]

    def check_health(self) -> None:
        if self._dead is not None:
            raise WorkerDiedError(self._dead)
        for rank, proc in enumerate(self._procs):
            if not proc.is_alive():
                raise self._died(rank)

    def shutdown(self) -> None:
        self._finalizer()

    # -- the engine's side of a call ---------------------------------------------------------
    def _receive(self, rank: int) -> Any:
        """The worker's reply to the call it was sent; raises WorkerDiedError as soon as the
        worker's process ends without one."""
        conn, proc = self._conns[rank], self._procs[rank]
        while True:
            ready = wait([conn, proc.sentinel])
            if conn in ready:
                try:
                    kind, value = pickle.loads(conn.recv_bytes())
                except (EOFError, OSError):
                    raise self._died(rank) from None
                break
            if proc.sentinel in ready:
                raise self._died(rank)
        if kind == "error":
            raise WorkerError(f"worker {rank}: {value}")
        return value

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
    conn: Connection, config: EngineConfig, num_blocks: int, max_model_len: int, rank: int
) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from kvserve.worker.worker import Worker

    try:
        worker = Worker(config, num_blocks, max_model_len, rank)
        _reply(conn, "ok", worker.info())
    except BaseException as e:  # noqa: BLE001 - the engine reports it and stops the process
        _reply(conn, "error", f"could not start: {type(e).__name__}: {e}")
        return
    while True:
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


def _reply(conn: Connection, kind: str, value: Any) -> None:
    try:
        data = pickle.dumps((kind, value), pickle.HIGHEST_PROTOCOL)
    except Exception as e:  # noqa: BLE001 - an unpicklable result is the call's failure
        data = pickle.dumps(("error", f"result not picklable: {type(e).__name__}: {e}"))
    try:
        conn.send_bytes(data)
    except OSError:
        os._exit(0)  # the engine is gone
