"""A worker process of the ``mp`` backend, as node 0's engine and a ``--headless`` node both
start it: spawned, one duplex pipe to it, a call and its reply one pickled message each way.

Each worker is started with ``spawn`` (a fresh interpreter: no inherited threads, locks or
OpenMP pools, and CUDA may be initialised in it) and builds its model and KV pool from the
engine's config; it places itself by its rank among its own machine's ranks (its share of the
cores, its GPU). A reply is ``("ok", result)`` or ``("error", message)``: a worker that raises
stays alive. A worker whose pipe closes (its parent is gone) exits; a worker ignores SIGINT (a
terminal's Ctrl-C reaches the whole process group: its parent decides when it stops).
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
from multiprocessing.connection import Connection
from typing import Any

from kvserve.config import EngineConfig
from kvserve.distributed import DistributedInit, place_local
from kvserve.entrypoint import freeze_startup_heap
from kvserve.executor.abstract import call_worker

log = logging.getLogger("kvserve.executor")

SHUTDOWN_TIMEOUT_S = 5.0
# How long a worker looks for the next call without sleeping (steps come back to back while
# requests run; an idle engine's workers sleep after this).
BUSY_LOOP_S = 0.05
SHUTDOWN = pickle.dumps(("shutdown", (), {}))


@dataclasses.dataclass(frozen=True, slots=True)
class RankPlace:
    """Where a rank runs: its rank in the group and among its machine's ranks."""

    rank: int
    local_rank: int
    local_world_size: int


def start_worker(
    config: EngineConfig,
    num_blocks: int | None,
    max_model_len: int,
    place: RankPlace,
    dist_init: DistributedInit | None,
) -> tuple[Any, Connection]:
    """Spawn rank ``place.rank``'s worker; its process and this side's end of its pipe."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=True)
    proc = ctx.Process(
        target=_worker_main,
        args=(child, config, num_blocks, max_model_len, place, dist_init),
        name=f"kvserve-worker-{place.rank}",
        daemon=True,
    )
    proc.start()
    child.close()  # the worker's end lives in the worker only: EOF when it dies
    return proc, parent


def how_it_ended(proc: Any) -> str:
    """How a worker's process ended, for the error that names it."""
    proc.join(timeout=1.0)
    code = proc.exitcode
    if code is None:
        return "closed its pipe"
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


def ended(proc: Any) -> str:
    """``(pid P) how it ended`` (:func:`how_it_ended`), for the error and the log line that
    name a worker's end."""
    return f"(pid {proc.pid}) {how_it_ended(proc)}"


def stop_workers(procs: list[Any], conns: list[Connection], at_once: bool = False) -> None:
    """Ask every worker to exit, then make sure it has: terminate, then kill, each bounded.
    ``at_once``: terminate without asking (a group out of step: its ranks may be waiting in
    a collective that will never complete, and would not read the request)."""
    if not at_once:
        for conn in conns:
            try:
                conn.send_bytes(SHUTDOWN)
            except (OSError, ValueError):
                pass
    for proc in procs:
        if at_once and proc.is_alive():
            proc.terminate()
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
    num_blocks: int | None,
    max_model_len: int,
    place: RankPlace,
    dist_init: DistributedInit | None,
) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from kvserve.worker.worker import Worker, join_tensor_parallel_group

    rank = place.rank
    try:
        # one GPU per rank where the config names just "cuda"; this machine's ranks split
        # its cores
        device = place_local(config.device, place.local_rank, place.local_world_size)
        config = dataclasses.replace(config, device=device)
        tp = join_tensor_parallel_group(config, rank, dist_init, place=False)
        worker = Worker(config, num_blocks, max_model_len, rank, tp)
        freeze_startup_heap()
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
