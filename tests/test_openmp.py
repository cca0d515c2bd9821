"""Freeing a thread's OpenMP worker threads (kvserve.kernels.openmp): the builder of an engine
lets go of its pool before the engine thread steps it. Checked by counting the process's OS
threads in /proc, in a fresh interpreter so no other test's threads come and go."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and libgomp")

SCRIPT = r"""
import json, os, time, torch
from kvserve.kernels.openmp import release_thread_pool

def tasks():
    return len(os.listdir("/proc/self/task"))

def settle(want, timeout=5.0):
    end = time.monotonic() + timeout
    while tasks() != want and time.monotonic() < end:
        time.sleep(0.01)
    return tasks()

torch.set_num_threads(3)
x = torch.ones(1 << 22)
before = tasks()
y = (x * 2).sum()          # a parallel region: this thread's pool gets its 2 workers
with_pool = tasks()
released = release_thread_pool()
after = settle(with_pool - 2)
z = (x * 3).sum()          # the next region builds a new pool and computes as before
again = tasks()
print(json.dumps(dict(before=before, with_pool=with_pool, released=released, after=after,
                      again=again, y=float(y), z=float(z))))
"""


def test_release_frees_the_calling_threads_workers_and_work_goes_on():
    res = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["with_pool"] - out["before"] in (0, 2), out  # 0: the pool existed already
    assert out["released"] is True
    assert out["after"] == out["with_pool"] - 2, out
    assert out["again"] == out["with_pool"], out
    n = 1 << 22
    assert out["y"] == 2.0 * n and out["z"] == 3.0 * n


HELPER = r"""
import json, os, sys, threading, time, torch
from kvserve.kernels.openmp import serial_thread

def tasks():
    return len(os.listdir("/proc/self/task"))

torch.set_num_threads(3)
x = torch.ones(1 << 22)
(x * 2).sum()  # the main thread's pool: 2 workers
base = tasks()
seen = {}

def helper(serial):
    if serial:
        seen["serial"] = serial_thread()
    seen["sum"] = float((x * 5).sum())  # a parallel region on this thread
    seen["tasks"] = tasks()  # this thread and any pool it started, while it lives

t = threading.Thread(target=helper, args=(sys.argv[1] == "serial",))
t.start()
t.join()
seen["main_team"] = torch.get_num_threads()
seen["main_sum"] = float((x * 7).sum())
print(json.dumps(dict(base=base, **seen)))
"""


@pytest.mark.parametrize("serial", [True, False])
def test_serial_thread_keeps_a_helper_thread_from_starting_a_pool(serial):
    """A helper thread that calls serial_thread() adds only itself to the process (its
    parallel torch op runs on it alone, with the right result) and the main thread keeps its
    team of 3; the same helper without the call starts a pool of 2 workers of its own (what
    the offload worker did beside the engine's threads)."""
    arg = "serial" if serial else "plain"
    res = subprocess.run([sys.executable, "-c", HELPER, arg], capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    n = 1 << 22
    assert out["sum"] == 5.0 * n and out["main_sum"] == 7.0 * n
    assert out["main_team"] == 3
    if serial:
        assert out["serial"] is True
        assert out["tasks"] == out["base"] + 1, out
    else:
        assert out["tasks"] == out["base"] + 3, out
