"""Forked helpers: ``fork_map`` and ``fork_iter`` give what the plain loop gives, errors too."""

from __future__ import annotations

import os

import pytest

from kvserve.bench.forks import fork_call, fork_iter, fork_map


def test_fork_map_equals_the_loop_and_runs_elsewhere():
    pids = fork_map(lambda x: (x * x, os.getpid()), list(range(7)), 2)
    assert [v for v, _ in pids] == [x * x for x in range(7)]
    assert any(p != os.getpid() for _, p in pids)


def test_fork_iter_yields_the_items_in_order_made_in_another_process():
    def make():
        for i in range(1000):
            yield i, os.getpid()

    got = list(fork_iter(make, chunk=64))
    assert [i for i, _ in got] == list(range(1000))
    assert {p for _, p in got} != {os.getpid()}


def test_fork_iter_raises_the_producers_error_after_the_items_before_it():
    def make():
        yield from range(5)
        raise ValueError("field: bad at item 5")

    seen = []
    with pytest.raises(ValueError, match="field: bad at item 5"):
        for x in fork_iter(make, chunk=2):
            seen.append(x)
    assert seen == [0, 1, 2, 3, 4]


def test_fork_iter_reports_a_producer_that_dies():
    def make():
        yield 1
        os._exit(3)

    with pytest.raises(RuntimeError, match="exit code 3"):
        list(fork_iter(make, chunk=1))


def test_closing_fork_iter_early_stops_the_producer():
    def make():
        i = 0
        while True:  # endless: only the consumer's close ends it
            yield i
            i += 1

    it = fork_iter(make, chunk=8)
    assert [next(it) for _ in range(20)] == list(range(20))
    it.close()  # returns: the producer was stopped, not waited for


def test_fork_call_returns_the_result_or_raises_the_error_from_another_process():
    wait = fork_call(lambda: (sum(range(100)), os.getpid()))
    total, pid = wait()
    assert total == 4950 and pid != os.getpid()

    def bad():
        raise ValueError("field: out of range")

    with pytest.raises(ValueError, match="field: out of range"):
        fork_call(bad)()
    with pytest.raises(RuntimeError, match="exit code 4"):
        fork_call(lambda: os._exit(4))()


def test_children_freeze_what_they_inherit():
    """Each forked child starts with the parent's objects frozen (out of the collector's
    generations), so a collection there never walks them: its freeze count covers at least
    the objects the collector tracked here when it was forked; and its collector is on."""
    import gc

    keep = [{"i": i} for i in range(50_000)]  # tracked objects the children inherit
    tracked = len(gc.get_objects())
    state = lambda *_: (gc.get_freeze_count(), gc.isenabled())  # noqa: E731
    gc.disable()  # a parent mid-replay: the children still collect their own garbage
    try:
        got = [fork_call(state)(), *fork_map(state, [0, 1], 2), *fork_iter(lambda: iter([state()]))]
    finally:
        gc.enable()
    assert all(frozen >= 0.9 * tracked and on for frozen, on in got), (tracked, got)
    del keep
