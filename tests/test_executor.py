"""The executors: the ``mp`` worker process against the in-process ``uni`` one, a worker's
death turned into an engine error within seconds, a worker's exception failing only its call.
(Exactness under both executors is in test_exactness.py.)"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import httpx
import pytest

from kvserve import SamplingParams
from kvserve.engine.core import EngineDeadError
from kvserve.executor import WorkerDiedError, WorkerError
from tests.serve_process import ServeProcess

REPO = Path(__file__).resolve().parent.parent
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, exited but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _attention_backend(worker) -> str:  # noqa: ANN001 - a Worker
    return worker.runner.attention.name


def test_mp_worker_runs_in_another_process_and_matches_uni(checkpoint, make_llm):
    """vLLM's entry point: LLM(..., distributed_executor_backend="mp",
    attention_backend="torch"); the worker process builds what the config names."""
    ckpt = checkpoint("llama_gqa")
    uni = make_llm(ckpt, dtype="float32", num_gpu_blocks=64)
    mp = make_llm(ckpt, dtype="float32", num_gpu_blocks=64, distributed_executor_backend="mp",
                  attention_backend="torch")  # fmt: skip
    assert mp.engine.executor.collective_rpc(_attention_backend) == ["torch"]
    (pid,) = mp.engine.executor.worker_pids
    assert pid != os.getpid() and alive(pid)
    prompts = ["one two three", "a much longer prompt " * 5, "x"]
    want = [o.outputs[0].token_ids for o in uni.generate(prompts, GREEDY)]
    got = [o.outputs[0].token_ids for o in mp.generate(prompts, GREEDY)]
    assert got == want
    # The engine knows the pool's layout without holding the storage.
    assert mp.engine.worker_info.kv_layout == uni.engine.worker_info.kv_layout == "float32"
    assert not hasattr(mp.engine, "storage") and not hasattr(mp.engine, "model")
    mp.engine.shutdown()
    deadline = time.monotonic() + 10
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(pid), "the worker outlived its engine's shutdown"


KV_FORMATS = ["bfloat16", "fp8_e4m3", "fp8_e5m2", "int8", "kivi4", "kivi2"]
RETENTION = ["window:32", "sinks:4,window:28", "snapkv:32", "h2o:32"]


@pytest.mark.parametrize(
    "option", [{"kv_cache_dtype": f} for f in KV_FORMATS] + [{"kv_retention": r} for r in RETENTION]
)
def test_lossy_options_give_the_same_tokens_in_a_worker_process(checkpoint, make_llm, option):
    """A lossy KV format or retention policy is not exact against transformers, but it must
    give the same tokens whichever process runs it (the in-process engine is the reference)."""
    ckpt = checkpoint("llama_gqa")
    prompts = [[(7 * i + j) % 200 + 3 for i in range(n)] for j, n in enumerate((70, 9, 130, 41))]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    runs = []
    for executor in ("uni", "mp"):
        llm = make_llm(ckpt, dtype="float32", num_gpu_blocks=96, block_size=8,
                       distributed_executor_backend=executor, **option)  # fmt: skip
        runs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
        llm.shutdown()
    assert runs[1] == runs[0]
    assert all(len(t) == 24 for t in runs[0])


def _raise_in_worker(worker, message):  # noqa: ANN001 - a Worker
    raise ValueError(message)


def _rank(worker) -> int:  # noqa: ANN001 - a Worker
    return worker.rank


def test_a_worker_exception_fails_only_that_call(checkpoint, make_llm):
    llm = make_llm(checkpoint("llama_gqa"), num_gpu_blocks=32, distributed_executor_backend="mp")
    ex = llm.engine.executor
    with pytest.raises(WorkerError, match=r"worker 0: ValueError: no such thing"):
        ex.collective_rpc(_raise_in_worker, ("no such thing",))
    assert ex.collective_rpc(_rank) == [0]
    assert llm.generate(["still works"], GREEDY)[0].outputs[0].token_ids


def test_a_killed_worker_fails_every_request_naming_it_within_seconds(checkpoint, make_llm):
    llm = make_llm(checkpoint("llama_gqa"), dtype="float32", num_gpu_blocks=64,
                   distributed_executor_backend="mp")  # fmt: skip
    engine = llm.engine
    (pid,) = engine.executor.worker_pids
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    engine.add_request("a", "first request", long)
    engine.add_request("b", "second request " * 3, long)
    for _ in range(3):
        engine.step()
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    finished = {}
    while engine.has_unfinished_requests() and time.monotonic() - t0 < 5:
        for o in engine.step():
            if o.finished:
                finished[o.request_id] = o
    assert time.monotonic() - t0 < 5
    assert set(finished) == {"a", "b"}
    for o in finished.values():
        assert o.error is not None and "worker 0" in o.error and "SIGKILL" in o.error, o.error
    assert engine.kv.num_used_blocks == 0
    with pytest.raises(EngineDeadError, match="worker 0"):
        engine.add_request("c", "too late", GREEDY)
    with pytest.raises(WorkerDiedError):
        engine.check_health()


def test_a_worker_that_cannot_start_is_an_error_at_start(checkpoint, tmp_path):
    from kvserve.config import EngineConfig
    from kvserve.executor.multiproc import MultiprocExecutor

    broken = tmp_path / "broken"
    broken.mkdir()
    ckpt = Path(checkpoint("llama_gqa"))
    (broken / "config.json").write_text((ckpt / "config.json").read_text())  # no weights
    with pytest.raises(WorkerError, match="worker 0: could not start"):
        MultiprocExecutor(EngineConfig(model=str(broken)), num_blocks=8, max_model_len=64)


def test_served_mp_engine_whose_worker_dies_answers_unhealthy_and_exits_0(checkpoint):
    """`kvserve serve --distributed-executor-backend mp`: killing the worker mid-stream ends
    the stream with an error naming the worker within seconds, /health answers 503, and
    SIGTERM still exits 0."""
    ckpt = checkpoint("llama_gqa")
    args = ["--model", ckpt, "--max-model-len", "256", "--dtype", "float32",
            "--num-gpu-blocks", "64", "--distributed-executor-backend", "mp",
            "--disable-access-log"]  # fmt: skip
    with ServeProcess(args) as srv:
        url, proc = srv.url, srv.proc
        workers = [int(m.group(1)) for x in srv.log if (m := re.search(r"worker 0: pid (\d+)", x))]
        assert len(workers) == 1 and workers[0] in children_of(proc.pid), srv.text
        body = {"prompt": "a long one", "max_tokens": 200, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            os.kill(workers[0], signal.SIGKILL)
            t0 = time.monotonic()
            rest = [line for line in lines if line]
            assert time.monotonic() - t0 < 5
        error = json.loads(rest[-2][6:])["error"]
        assert "worker 0" in error["message"], error
        assert rest[-1] == "data: [DONE]"
        health = httpx.get(url + "/health", timeout=5)
        assert health.status_code == 503 and "worker 0" in health.text
        r = httpx.post(url + "/v1/completions", json={"prompt": "x"}, timeout=5)
        assert r.status_code == 503
        assert srv.stop() == 0, srv.text


def children_of(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                out.append(int(entry))
    return out
