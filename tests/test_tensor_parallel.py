"""Tensor parallelism: two ranks against one (the single-rank engine, itself equal to
transformers in test_exactness.py, is the reference throughout).

With real ranks (two worker processes of the ``mp`` executor joined by a gloo group on a
loopback port, their collectives through shared memory, or gloo's own where switched off),
greedy tokens in float32 equal the single-rank engine's on the three architectures of the
exactness tests (a GQA Llama, Qwen2 with its QKV bias, an MQA Llama whose one KV head every
rank replicates), through chunked prefill and preemption; each rank's pool holds only its KV
heads, bytes given by the KV formula. Killing one rank fails the engine naming that rank and
leaves no process behind. The Ray backend, on a local two-CPU cluster, gives the same tokens
and names a killed actor.

Every KV format, and a prefix brought back from the host tier, run on two ranks in threads
of this process (the parallel-layer tests' fake communicator, so no process start-up per
case): the per-rank storage and the ranks' merged payloads are the code under test there.
"""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from kvserve import LLM, SamplingParams
from kvserve.config import ConfigError
from kvserve.engine.core import EngineDeadError
from kvserve.engine.llm_engine import LLMEngine
from kvserve.executor import Executor, WorkerDiedError, WorkerError
from kvserve.executor.abstract import call_worker
from kvserve.kernels.openmp import serial_thread
from kvserve.llm import engine_config
from kvserve.worker.worker import Worker, WorkerInfo
from tests.test_parallel_layers import FakeGroup

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
# Two prompts longer than the step's token budget (chunked prefill), and more KV than the
# pool holds at once (preemption).
PROMPTS = [[(7 * i + j) % 300 + 3 for i in range(n)] for j, n in enumerate((70, 9, 130, 41))]
SMALL_POOL = dict(dtype="float32", num_gpu_blocks=24, block_size=8, max_num_batched_tokens=48,
                  max_model_len=256)  # fmt: skip
FLOAT32_BYTES = 4


def tokens(llm: LLM, prompts: list[Any] = PROMPTS) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]


def pool_bytes_formula(name: str, kv_heads: int, blocks: int) -> int:
    """K and V of ``kv_heads`` heads, for every layer and slot, in float32 (the KV formula)."""
    # imported here, not at module level: a worker that unpickles a function of this module
    # must not run conftest's torch.set_num_threads
    from tests.conftest import CHECKPOINTS

    cfg = CHECKPOINTS[name]
    head_dim = 64 // cfg["num_heads"]  # make_random_checkpoint's hidden size over its heads
    return 2 * 2 * kv_heads * head_dim * blocks * SMALL_POOL["block_size"] * FLOAT32_BYTES


@pytest.mark.parametrize("name", ["llama_gqa", "qwen2", "llama_mqa"])
def test_two_ranks_give_the_single_rank_tokens(checkpoint, make_llm, name):
    ckpt = checkpoint(name)
    one = make_llm(ckpt, **SMALL_POOL)
    # the ranks share this host: shared-memory collectives, or gloo's where switched off
    gloo = name == "qwen2"
    two = make_llm(ckpt, tensor_parallel_size=2, disable_custom_all_reduce=gloo, **SMALL_POOL)
    assert two.engine.config.parallel.distributed_executor_backend == "mp"
    comms = two.engine.executor.collective_rpc(_communicator)
    assert comms == ["TorchDistCommunicator" if gloo else "ShmCommunicator"] * 2
    pids = two.engine.executor.worker_pids
    assert len(pids) == 2 and os.getpid() not in pids
    want, got = tokens(one), tokens(two)
    assert got == want
    # a rank's start-up objects are out of the garbage collector's reach (a new process
    # freezes nothing of its own accord)
    assert all(n > 0 for n in two.engine.executor.collective_rpc(_frozen_objects))
    # each rank computes on its own share of this process's CPUs
    cpus = two.engine.executor.collective_rpc(_cpus_and_threads)
    if len(os.sched_getaffinity(0)) >= 2:
        assert not cpus[0][0] & cpus[1][0]
        assert all(c <= os.sched_getaffinity(0) and 1 <= n <= len(c) for c, n in cpus), cpus
    # prompts longer than the step's budget were chunked, and the small pool preempted
    for llm in (one, two):
        assert llm.engine.scheduler.num_preemptions > 0
    # each rank's pool holds its KV heads: half the single rank's where the two KV heads
    # divide, the whole (replicated) where the model has one
    (whole,) = one.engine.executor.collective_rpc("kv_pool_bytes")
    per_rank = two.engine.executor.collective_rpc("kv_pool_bytes")
    from tests.conftest import CHECKPOINTS

    total_kv_heads = CHECKPOINTS[name]["num_kv_heads"]
    assert whole == pool_bytes_formula(name, total_kv_heads, 24)
    assert per_rank == [pool_bytes_formula(name, max(1, total_kv_heads // 2), 24)] * 2
    if total_kv_heads == 2:
        assert per_rank == [whole // 2] * 2
    else:
        assert per_rank == [whole] * 2
    if name == "llama_gqa":  # this engine's last use: one rank killed (saves a start-up)
        kill_a_rank_and_check_the_engine_fails_by_name(
            two.engine, pids, "worker 1 (pid {pid}) was killed by SIGKILL"
        )
    else:  # one rank raises in a step, under gloo's collectives and shared memory's
        break_a_rank_and_check_the_group_fails_at_once(two.engine, pids)


def test_async_scheduling_over_two_ranks_gives_the_single_rank_tokens(checkpoint, make_llm):
    """The engine sends each step before the ranks' last one has landed (their pipes queue
    it): the tokens are one rank's, stepped one at a time; a call to the workers made while
    a step is in flight lands that step first and gets its own answer; a rank killed with a
    step in flight is named and fails every request."""
    ckpt = checkpoint("llama_gqa")
    want = tokens(make_llm(ckpt, **SMALL_POOL))
    two = make_llm(ckpt, tensor_parallel_size=2, async_scheduling=True, **SMALL_POOL)
    engine = two.engine
    overlapped: list[bool] = []
    answers: list[list[int]] = []

    def hook(core) -> None:  # noqa: ANN001 - an EngineCore
        overlapped.append(core._in_flight is not None)
        if core._in_flight is not None and not answers:
            answers.append(engine.executor.collective_rpc("kv_pool_bytes"))

    engine.core.step_hooks.append(hook)
    assert tokens(two) == want
    assert sum(overlapped) > len(overlapped) // 2
    assert answers == [[pool_bytes_formula("llama_gqa", 1, 24)] * 2]
    # the pool ran short: requests waited for a step in flight, or were preempted
    assert engine.scheduler.stats.allocation_failures > 0
    kill_a_rank_and_check_the_engine_fails_by_name(
        engine, engine.executor.worker_pids, "worker 1 (pid {pid}) was killed by SIGKILL"
    )


def _communicator(worker: Worker) -> str:
    return type(worker.tp.communicator).__name__


def _frozen_objects(worker: Worker) -> int:
    import gc

    return gc.get_freeze_count()


def _cpus_and_threads(worker: Worker) -> tuple[set[int], int]:
    import torch

    return os.sched_getaffinity(0), torch.get_num_threads()


def test_each_rank_gets_its_own_cpus_and_gpu(monkeypatch):
    from kvserve.distributed.placement import rank_cpus

    home = {0, 1, 2, 3}
    monkeypatch.setenv("KVSERVE_CPU_OMP_THREADS_BIND", "auto")
    shares = [rank_cpus(r, 2, home) for r in range(2)]
    assert sorted(shares[0] + shares[1]) == [0, 1, 2, 3] and not set(shares[0]) & set(shares[1])
    assert rank_cpus(0, 8, home) is None  # fewer CPUs than ranks: nothing to place
    # hyperthread siblings stay together: cores {0, 2} and {1, 3} go one to each rank
    import kvserve.distributed.placement as placement

    monkeypatch.setattr(placement, "physical_cores", lambda cpus: [[0, 2], [1, 3]])
    assert [rank_cpus(r, 2, home) for r in range(2)] == [[0, 2], [1, 3]]
    monkeypatch.undo()
    monkeypatch.setenv("KVSERVE_CPU_OMP_THREADS_BIND", "3|0-1")  # vLLM's per-rank form
    assert rank_cpus(0, 2, home) == [3] and rank_cpus(1, 2, home) == [0, 1]
    with pytest.raises(ValueError, match="2 CPU list.* for 3 tensor-parallel ranks"):
        rank_cpus(0, 3, home)
    monkeypatch.setenv("KVSERVE_CPU_OMP_THREADS_BIND", "nobind")
    assert rank_cpus(1, 2, home) is None
    # on CUDA, "cuda" means one GPU per rank; a device with an index is every rank's
    from kvserve.distributed import rank_device

    assert [rank_device("cuda", r, 2) for r in range(2)] == ["cuda:0", "cuda:1"]
    assert rank_device("cuda:3", 1, 2) == "cuda:3" and rank_device("cpu", 1, 2) == "cpu"


def test_a_torchrun_launch_is_read_from_torchruns_environment(checkpoint, monkeypatch):
    """external_launcher takes its rank and group from torchrun's variables; a launch of
    another size, or no launch, is refused naming what is wrong."""
    from kvserve.executor.external import torchrun_init

    config = engine_config(checkpoint("llama_gqa"), tensor_parallel_size=2,
                           distributed_executor_backend="external_launcher")  # fmt: skip
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ConfigError, match="runs under torchrun, which sets RANK"):
        torchrun_init(config)
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "10.0.0.7",
           "MASTER_PORT": "29511"}  # fmt: skip
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    rank, local, init = torchrun_init(config)
    assert (rank, local, init.world_size, init.backend) == (1, 0, 2, "gloo")
    assert init.init_method == "tcp://10.0.0.7:29511"
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ConfigError, match="tensor_parallel_size: 2, but torchrun launched "
                       "WORLD_SIZE 4"):  # fmt: skip
        torchrun_init(config)


def test_heads_that_do_not_divide_are_refused_before_any_rank_starts(checkpoint):
    ckpt = checkpoint("llama_gqa")  # 4 attention heads
    with pytest.raises(ConfigError, match="num_attention_heads: 4 is not divisible by "
                       "tensor_parallel_size 3"):  # fmt: skip
        LLM(ckpt, tensor_parallel_size=3)
    with pytest.raises(ConfigError, match="tensor_parallel_size: must be an integer"):
        LLM(ckpt, tensor_parallel_size=0)


def kill_a_rank_and_check_the_engine_fails_by_name(
    engine: LLMEngine, pids: list[int], message: str
) -> None:
    """The surviving rank's collective loses its peer; the engine names the dead rank
    (``message``, ``{pid}`` rank 1's), not the survivor's echo, fails every request in
    flight, and stops the survivor."""
    rank0, rank1 = pids
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    for i, p in enumerate(PROMPTS[:2]):
        engine.add_request(str(i), p, params)
    engine.step()
    os.kill(rank1, signal.SIGKILL)
    t0 = time.monotonic()
    finished = {}
    while engine.has_unfinished_requests() and time.monotonic() - t0 < 10:
        for o in engine.step():
            if o.finished:
                finished[o.request_id] = o
    assert time.monotonic() - t0 < 10
    assert set(finished) == {"0", "1"}
    for o in finished.values():
        assert o.error is not None
        assert message.format(pid=rank1) in o.error, o.error
    assert engine.kv.num_used_blocks == 0
    with pytest.raises(EngineDeadError, match="worker 1"):
        engine.add_request("late", [5, 6, 7], GREEDY)
    engine.shutdown()
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{rank0}") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{rank0}"), "the surviving rank outlived the engine"


def _rank(worker: Worker) -> int:
    return worker.rank


def _raise_on_every_rank(worker: Worker) -> None:
    raise ValueError(f"rank {worker.rank} refuses")


def _break_rank_1(worker: Worker) -> None:
    """Rank 1's next step raises before its first collective; rank 0's waits in it."""
    if worker.rank == 1:

        def fail(scheduler_output: Any) -> Any:
            raise RuntimeError("injected fault in rank 1's step")

        worker.runner.execute_model = fail


def break_a_rank_and_check_the_group_fails_at_once(engine: LLMEngine, pids: list[int]) -> None:
    """A call every rank answers, even with an error, fails only itself; a step that one
    rank leaves with an error while the other waits in a collective fails the engine within
    seconds (not the collective's 120 s timeout), naming the rank and its error, and stops
    both ranks."""
    ex = engine.executor
    with pytest.raises(WorkerError, match="worker 0: ValueError: rank 0 refuses"):
        ex.collective_rpc(_raise_on_every_rank)
    assert ex.collective_rpc(_rank) == [0, 1]
    ex.collective_rpc(_break_rank_1)
    engine.add_request("x", PROMPTS[1], GREEDY)
    t0 = time.monotonic()
    finished = {}
    while engine.has_unfinished_requests() and time.monotonic() - t0 < 30:
        for o in engine.step():
            if o.finished:
                finished[o.request_id] = o
    assert time.monotonic() - t0 < 5
    error = finished["x"].error
    assert error is not None
    assert "worker 1 raised RuntimeError: injected fault in rank 1's step" in error, error
    assert "out of step" in error, error
    with pytest.raises(EngineDeadError, match="worker 1 raised"):
        engine.add_request("late", [5, 6, 7], GREEDY)
    with pytest.raises(WorkerDiedError, match="worker 1 raised"):
        ex.collective_rpc(_rank)
    deadline = time.monotonic() + 10  # both ranks stopped, before the engine's shutdown
    while any(os.path.exists(f"/proc/{p}/stat") and _running(p) for p in pids):
        assert time.monotonic() < deadline, "a rank outlived its group's failure"
        time.sleep(0.05)
    engine.shutdown()


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


class ThreadRanks(Executor):
    """``world_size`` workers in threads of this process, each a rank of one fake group."""

    def __init__(self, config: Any, num_blocks: int, max_model_len: int, world_size: int) -> None:
        group = FakeGroup(world_size)
        self.pool = ThreadPoolExecutor(world_size, initializer=serial_thread)
        self.workers = [Worker(config, num_blocks, max_model_len, r, group.rank(r))
                        for r in range(world_size)]  # fmt: skip
        self.info = WorkerInfo.of_ranks([w.info() for w in self.workers])

    def execute_model(self, scheduler_output: Any) -> Any:
        return self.collective_rpc("execute_model", (scheduler_output,))[0]

    def collective_rpc(self, method: Any, args: tuple = (), kwargs: dict | None = None) -> list:
        futures = [self.pool.submit(call_worker, w, method, args, kwargs or {})
                   for w in self.workers]  # fmt: skip
        return [f.result(timeout=120) for f in futures]

    def shutdown(self) -> None:
        self.pool.shutdown()


@pytest.fixture
def thread_tp(monkeypatch):
    """thread_tp(model, **settings) -> an LLM whose engine runs two ranks in threads."""
    monkeypatch.setenv("KVSERVE_CPU_OMP_THREADS_BIND", "nobind")
    built = []

    def build(model: str, **settings: Any) -> LLM:
        config = engine_config(model, tensor_parallel_size=2, device="cpu", **settings)
        ranks = ThreadRanks(config, settings["num_gpu_blocks"], settings["max_model_len"], 2)
        llm = LLM.__new__(LLM)  # an LLM over an engine on the threads' ranks
        llm.engine = LLMEngine(config, runner=ranks)
        built.append((llm.engine, ranks))
        return llm

    yield build
    for engine, ranks in built:
        if engine.offload is not None:
            engine.offload.flush()
        engine.shutdown()
        ranks.shutdown()
        engine.kv.check_invariants()
        assert engine.kv.num_used_blocks == 0


@pytest.mark.parametrize(
    "kv_cache_dtype", ["bfloat16", "fp8_e4m3", "fp8_e5m2", "int8", "kivi4", "kivi2"]
)
def test_every_kv_format_holds_each_ranks_heads(checkpoint, make_llm, thread_tp, kv_cache_dtype):
    ckpt = checkpoint("llama_gqa")
    settings = dict(SMALL_POOL, num_gpu_blocks=64, kv_cache_dtype=kv_cache_dtype)
    one = make_llm(ckpt, **settings)
    two = thread_tp(ckpt, **settings)
    assert tokens(two, PROMPTS[:2]) == tokens(one, PROMPTS[:2])
    (whole,) = one.engine.executor.collective_rpc("kv_pool_bytes")
    assert two.engine.executor.collective_rpc("kv_pool_bytes") == [whole // 2] * 2


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "kivi4"])
def test_an_evicted_prefix_comes_back_from_the_host_tier_to_each_rank(
    checkpoint, make_llm, thread_tp, kv_cache_dtype
):
    """A prefix pushed out of every rank's pool is stored once (the ranks' heads in one
    entry) and loaded back, each rank taking its heads: the single rank's tokens before and
    after, and as many tokens from the tier. (KIVI's reloaded prefix is quantized where the
    first run still held full-precision rows: its second run differs from its first, alike
    on one rank and two.)"""
    from tests.test_kv_offload import evict_and_return, prompts_of_lengths

    ckpt = checkpoint("llama_gqa")
    settings = dict(dtype="float32", num_gpu_blocks=12, block_size=16, max_model_len=256,
                    kv_offload_cpu="4MiB", kv_cache_dtype=kv_cache_dtype)  # fmt: skip
    prompt, *flood = prompts_of_lengths([100, 100, 100, 100], vocab=320, seed=5)
    llms = [make_llm(ckpt, **settings), thread_tp(ckpt, **settings)]
    runs = [evict_and_return(llm, prompt, flood) for llm in llms]
    assert runs[1] == runs[0]  # tokens before and after the tier, and the tokens it served
    first, second, cached = runs[0]
    assert cached > 0
    for llm in llms:  # the cached tokens came back from the tier, not the pool
        assert llm.engine.stats().tier_hit_tokens == cached
    if kv_cache_dtype == "auto":  # lossless: the tier gives back the very bytes
        assert second == first


def test_ray_actors_as_ranks_give_the_single_rank_tokens(checkpoint, make_llm):
    """vLLM's --distributed-executor-backend ray on a local two-CPU cluster: one actor per
    rank, the same gloo group, the single-rank engine's tokens; a killed actor is named."""
    import ray  # the test extras install it

    ckpt = checkpoint("qwen2")
    settings = dict(SMALL_POOL, num_gpu_blocks=64)
    want = tokens(make_llm(ckpt, **settings), PROMPTS[:3])
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        two = make_llm(ckpt, tensor_parallel_size=2, distributed_executor_backend="ray",
                       **settings)  # fmt: skip
        assert len(set(two.engine.executor.pids)) == 2
        assert os.getpid() not in two.engine.executor.pids
        assert tokens(two, PROMPTS[:3]) == want
        assert all(n > 0 for n in two.engine.executor.collective_rpc(_frozen_objects))
        kill_a_rank_and_check_the_engine_fails_by_name(
            two.engine, two.engine.executor.pids, "worker 1 (Ray actor) died"
        )
    finally:
        ray.shutdown()
