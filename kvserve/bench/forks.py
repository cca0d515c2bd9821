"""Independent pure-Python work side by side: ``fork_map`` runs a function over items in
forked processes; ``fork_iter`` makes an iterator's items in a forked process while this one
consumes them; ``fork_call`` runs one call in a forked process while this one goes on.

Simulations and report writing are pure Python and single-threaded, so a machine's other
cores sit idle while one runs; ``kvserve tune``'s candidates, ``kvserve simulate --sweep``'s
points and the chunks of a long run's per-request records are independent of each other.
Forked children inherit the data and the function's closure instead of receiving them
pickled (a long trace is hundreds of MB of prompts); only the results come back, pickled.
None of this does tensor work, so the children start no thread pools that a fork could leave
in a bad state. Each child first freezes the objects it inherited (``gc.freeze``): a garbage
collection there would otherwise walk all of them, a long run's records are millions, and
copy every page it touched from the parent. Its own garbage is collected as usual, even where
the parent had turned its collector off (a simulation's replay does).
"""

from __future__ import annotations

import gc
import multiprocessing as mp
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any, TypeVar

T = TypeVar("T")
R = TypeVar("R")

_WORK: tuple[Callable[[Any], Any], Sequence[Any]] | None = None


def can_fork() -> bool:
    """Whether this platform starts processes by forking (Linux; not Windows or macOS's
    default), which every helper here needs to run anything side by side."""
    return "fork" in mp.get_all_start_methods()


def _call(i: int) -> Any:
    fn, items = _WORK  # type: ignore[misc]  # set by fork_map before the fork
    return fn(items[i])


def fork_map(fn: Callable[[T], R], items: Sequence[T], jobs: int) -> list[R]:
    """``[fn(x) for x in items]``, in up to ``jobs`` forked processes; in order here when
    ``jobs`` < 2, there is one item, or the platform cannot fork."""
    global _WORK
    if jobs < 2 or len(items) < 2 or not can_fork():
        return [fn(x) for x in items]
    _WORK = (fn, items)
    try:
        with ProcessPoolExecutor(
            min(jobs, len(items)), mp.get_context("fork"), initializer=_child_gc
        ) as pool:
            return list(pool.map(_call, range(len(items))))
    finally:
        _WORK = None


def start_forked(
    target: Callable[..., None], *args: Any, duplex: bool = False
) -> tuple[Connection, BaseProcess]:
    """A daemon forked process running ``target(*args, conn)`` and this process's end of
    the pipe to it (receive only unless ``duplex``)."""
    ctx = mp.get_context("fork")
    mine, theirs = ctx.Pipe(duplex=duplex)
    proc = ctx.Process(target=_frozen, args=(target, *args, theirs), daemon=True)
    proc.start()
    theirs.close()
    return mine, proc


def _child_gc() -> None:
    gc.freeze()  # what the parent had: never collected here (see the module's docstring)
    gc.enable()


def _frozen(target: Callable[..., None], *args: Any) -> None:
    _child_gc()
    target(*args)


def receive(conn: Connection, proc: BaseProcess, who: str) -> Any:
    """The next message from ``proc``, or a RuntimeError naming ``who`` if it ended first."""
    try:
        return conn.recv()
    except EOFError:
        raise ended_early(proc, who) from None


def ended_early(proc: BaseProcess, who: str, wait: float | None = None) -> RuntimeError:
    """The error for a helper process that ended before its work did (after joining it,
    for at most ``wait`` seconds), with its exit code."""
    proc.join(wait)
    return RuntimeError(f"{who}: its process ended early (exit code {proc.exitcode})")


def fork_iter(make: Callable[[], Iterable[T]], chunk: int = 256) -> Iterator[T]:
    """The items of ``make()``, made in a forked process and taken here in order, so that
    making them overlaps with whatever this process does with them (in-process where the
    platform cannot fork). The producer runs at most a chunk or two ahead (the pipe pushes
    back); an exception it raises is raised here at the item it stopped at, and closing this
    iterator early stops it."""
    if not can_fork():
        yield from make()
        return
    recv, proc = start_forked(_produce, make, chunk)
    try:
        while True:
            kind, payload = receive(recv, proc, "fork_iter")
            if kind == "error":
                raise payload
            if kind == "end":
                return
            yield from payload
    finally:
        recv.close()
        if proc.is_alive():
            proc.terminate()
        proc.join()


def _produce(make: Callable[[], Iterable[Any]], chunk: int, conn: Connection) -> None:
    """``fork_iter``'s producer: the items in chunks, then an end mark or the exception."""
    buf: list[Any] = []
    try:
        for x in make():
            buf.append(x)
            if len(buf) >= chunk:
                conn.send(("items", buf))
                buf = []
        if buf:
            conn.send(("items", buf))
        conn.send(("end", None))
    except BrokenPipeError:  # the consumer stopped early
        pass
    except Exception as e:  # noqa: BLE001 - handed to the consumer to raise
        try:
            if buf:  # the items made before it come first
                conn.send(("items", buf))
            conn.send(("error", e))
        except Exception:  # noqa: BLE001 - an exception that does not pickle
            conn.send(("error", RuntimeError(f"{type(e).__name__}: {e}")))
    finally:
        conn.close()


def fork_call(fn: Callable[[], R]) -> Callable[[], R]:
    """Start ``fn()`` in a forked process now; the function returned waits for its result
    (or raises its exception). In-process at once where the platform cannot fork."""
    if not can_fork():
        result = fn()
        return lambda: result
    recv, proc = start_forked(_call_into, fn)

    def wait() -> R:
        try:
            ok, value = receive(recv, proc, "fork_call")
        finally:
            recv.close()
        proc.join()
        if not ok:
            raise value
        return value

    return wait


def _call_into(fn: Callable[[], Any], conn: Connection) -> None:
    try:
        result = (True, fn())
    except Exception as e:  # noqa: BLE001 - handed to the waiter to raise
        result = (False, e)
    try:
        conn.send(result)
    except Exception as e:  # noqa: BLE001 - a result or exception that does not pickle
        conn.send((False, RuntimeError(f"fork_call: {type(e).__name__}: {e}")))
    finally:
        conn.close()
