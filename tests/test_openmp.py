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


BIND = r"""
import json, os, sys, threading, torch
from kvserve import LLM, SamplingParams
from kvserve.engine_args import default_model
from kvserve.kernels.openmp import release_thread_pool

torch.set_num_threads(2)

def masks():
    # every thread's CPUs as the kernel reports them (a thread that just ended is skipped)
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/status") as f:
                for line in f:
                    if line.startswith("Cpus_allowed_list"):
                        out[int(tid)] = line.split(":")[1].strip()
        except (FileNotFoundError, ProcessLookupError):
            continue
    return out

llm = LLM(default_model(), kv_cache_memory="8MiB")
runner = llm.engine.executor.driver_worker.runner
seen = []
execute = runner._execute

def spy(sched):
    seen.append((threading.get_native_id(), masks()))
    return execute(sched)

runner._execute = spy
params = SamplingParams(temperature=0, max_tokens=3)
res = {"cpus": runner.binding.cpus if runner.binding else None,
       "home": sorted(os.sched_getaffinity(0))}

def generate(tag):
    seen.clear()
    text = llm.generate(["the cache block"], params)[0].outputs[0].text
    res[tag] = {"text": text, "during": seen[-1], "after": masks()[threading.get_native_id()]}

def on_thread():
    release_thread_pool()  # as the server does: the builder's pool let go; this one is new
    generate("thread")

generate("main")
t = threading.Thread(target=on_thread)
t.start()
t.join()
res["main_after"] = masks()[threading.get_native_id()]
print(json.dumps(res))
"""


def _bind_run(env: dict[str, str]) -> tuple[subprocess.CompletedProcess[str], dict]:
    import os

    res = subprocess.run([sys.executable, "-c", BIND], capture_output=True, text=True,
                         timeout=300, env={**os.environ, **env})  # fmt: skip
    out = json.loads(res.stdout.strip().splitlines()[-1]) if res.returncode == 0 else {}
    return res, out


def _cpu_list(cpus: list[int]) -> str:
    return ",".join(map(str, cpus))


def test_a_step_runs_each_compute_thread_on_a_cpu_of_its_own_then_lets_go():
    """During a step the stepping thread is on the first CPU and its one OpenMP worker on the
    second (the kernel's Cpus_allowed_list for each thread); after it the stepping thread has
    its CPUs back. The same on a second thread whose pool is new, and the text is what the
    unbound engine generates."""
    import os

    res, out = _bind_run({"KVSERVE_CPU_OMP_THREADS_BIND": "auto"})
    assert res.returncode == 0, res.stderr[-2000:]
    ref, unbound = _bind_run({"KVSERVE_CPU_OMP_THREADS_BIND": "nobind"})
    assert ref.returncode == 0, ref.stderr[-2000:]
    assert unbound["cpus"] is None
    home = sorted(os.sched_getaffinity(0))
    if len(home) < 2:  # one CPU: nothing to bind, and nothing was
        assert out["cpus"] is None
        return
    cpus = out["cpus"]
    assert len(cpus) == 2 and len(set(cpus)) == 2 and set(cpus) <= set(home)
    for tag in ("main", "thread"):
        tid, during = out[tag]["during"]
        during = {int(k): v for k, v in during.items()}
        assert during[tid] == str(cpus[0]), (tag, during)
        assert str(cpus[1]) in [v for k, v in during.items() if k != tid], (tag, during)
        assert out[tag]["after"] == out["main_after"] != str(cpus[0])
        assert out[tag]["text"] == unbound[tag]["text"]
    # the unbound run's step left every thread where it was
    tid, during = unbound["main"]["during"]
    assert {int(k): v for k, v in during.items()}[tid] == unbound["main_after"]


@pytest.mark.parametrize(
    "value, message",
    [
        ("0-", "is not auto, nobind or a CPU list"),
        ("fast", "is not auto, nobind or a CPU list"),
        ("100000", "are not among those this process may use"),
    ],
)
def test_a_binding_it_cannot_use_is_refused_naming_the_variable(monkeypatch, value, message):
    from kvserve.kernels.openmp import ThreadBinding

    monkeypatch.setenv("KVSERVE_CPU_OMP_THREADS_BIND", value)
    with pytest.raises(ValueError, match=f"KVSERVE_CPU_OMP_THREADS_BIND: .*{message}"):
        ThreadBinding.from_env("cpu", threads=2)


def test_too_few_cpus_for_the_team_is_refused_with_the_fix(monkeypatch):
    import os

    from kvserve.kernels.openmp import ThreadBinding

    first = min(os.sched_getaffinity(0))
    monkeypatch.setenv("KVSERVE_CPU_OMP_THREADS_BIND", str(first))
    with pytest.raises(ValueError, match="1 CPU\\(s\\) for 2 compute threads.*OMP_NUM_THREADS=1"):
        ThreadBinding.from_env("cpu", threads=2)


def test_a_cpu_list_is_read_as_linux_writes_it_and_nothing_binds_where_it_cannot(monkeypatch):
    import os

    from kvserve.kernels.openmp import ThreadBinding, parse_cpus

    assert parse_cpus("0-3,8,10-11") == [0, 1, 2, 3, 8, 10, 11]
    home = sorted(os.sched_getaffinity(0))
    monkeypatch.setenv("KVSERVE_CPU_OMP_THREADS_BIND", _cpu_list(home[::-1]))
    if len(home) >= 2:  # the list's order is the team's: the stepping thread on the first
        assert ThreadBinding.from_env("cpu", threads=2).cpus == home[::-1][:2]
    monkeypatch.setenv("KVSERVE_CPU_OMP_THREADS_BIND", "auto")
    assert ThreadBinding.from_env("cuda", threads=2) is None  # a GPU engine's host threads
    assert ThreadBinding.from_env("cpu", threads=1) is None  # no team
    assert ThreadBinding.from_env("cpu", threads=len(home) + 1) is None  # more than the CPUs
