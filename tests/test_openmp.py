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
