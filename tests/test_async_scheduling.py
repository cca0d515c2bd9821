"""Async scheduling (vLLM's ``--async-scheduling``): each step planned and sent before the one
in flight has landed, its sampled tokens pending. The reference is the same engine stepping
one step at a time: every output (tokens, logprobs, finish reasons) must be the same, under
chunked prefill, prefix hits, preemption in a small pool, stop tokens, seeded sampling,
penalties and ``n`` > 1. The fake-runner workload of a thousand requests is in
tests/test_engine_core.py; the tensor-parallel run over the ``mp`` executor in
tests/test_tensor_parallel.py."""

from __future__ import annotations

import pytest

from kvserve import SamplingParams
from kvserve.config import ConfigError, SchedulerConfig
from kvserve.engine import EngineCore, EngineCoreRequest
from kvserve.kv.manager import KVCacheManager
from kvserve.sched.request import RequestStatus
from tests.test_engine_core import FakeRunner, VirtualClock, expected_tokens, fake_token

# Shared prefixes (hits), prompts longer than the step's budget (chunks), and more KV than
# the pool holds at once (preemption).
PREFIX = [(5 * i) % 200 + 3 for i in range(40)]
PROMPTS = [
    PREFIX + [11, 12, 13],
    PREFIX + [21, 22],
    [(7 * i) % 250 + 3 for i in range(90)],
    [9, 8, 7, 6],
    PREFIX[:17] + [(3 * i) % 90 + 3 for i in range(30)],
    [(11 * i) % 240 + 3 for i in range(60)],
]
ENGINE = dict(dtype="float32", num_gpu_blocks=40, block_size=8, max_num_batched_tokens=48,
              max_model_len=256, enable_prefix_caching=True)  # fmt: skip


def _params(stop: int) -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0, max_tokens=24, logprobs=3),
        SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=30),
        SamplingParams(
            temperature=0, max_tokens=40, repetition_penalty=1.3, presence_penalty=0.4
        ),  # fmt: skip
        SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[stop]),
        SamplingParams(n=2, temperature=1.0, seed=9, max_tokens=16),
        SamplingParams(temperature=0.7, top_k=20, seed=3, max_tokens=35, min_tokens=10),
    ]


def _outputs(llm, params):  # noqa: ANN001, ANN202
    outs = llm.generate(PROMPTS, params)
    return [[(c.token_ids, c.logprobs, c.finish_reason) for c in o.outputs] for o in outs]


def test_async_outputs_equal_one_step_at_a_time(checkpoint, make_llm):
    ckpt = checkpoint("llama_gqa")
    sync = make_llm(ckpt, **ENGINE)
    greedy = sync.generate([PROMPTS[3]], SamplingParams(temperature=0, max_tokens=12))
    stop = greedy[0].outputs[0].token_ids[5]  # request 3 stops early on it
    params = _params(stop)
    want = _outputs(sync, params)
    assert want[3][0][2] == "stop"

    fast = make_llm(ckpt, async_scheduling=True, **ENGINE)
    core = fast.engine.core
    overlapped = []  # after each landing: whether the next step was already on its way
    core.step_hooks.append(lambda c: overlapped.append(c._in_flight is not None))
    assert _outputs(fast, params) == want
    assert sum(overlapped) > len(overlapped) // 2
    for llm in (sync, fast):
        assert llm.engine.scheduler.num_preemptions > 0
        assert llm.engine.kv.stats.hits > 0
    # nothing is left in flight or pending once the requests are done
    assert core._in_flight is None and not core.has_unfinished_requests()


def test_a_request_id_reused_while_its_last_step_is_in_flight():
    """A request that stops on a token leaves one more step in flight for it; a new request
    added at once under the same id gets its own tokens, none of the old one's."""
    bs, blocks = 4, 16
    runner = FakeRunner(blocks, bs)
    kv = KVCacheManager(blocks, bs, enable_caching=False)
    core = EngineCore(SchedulerConfig(async_scheduling=True), kv, runner, max_model_len=64,
                      clock=VirtualClock())  # fmt: skip
    stops = SamplingParams(max_tokens=10, stop_token_ids=[fake_token("a", 1)])
    core.add_request(EngineCoreRequest("a", None, [1, 2, 3], stops, 10, 0.0))
    (old,) = core.families["a"]
    while not old.is_finished:
        core.step()
    assert old.output_token_ids == [fake_token("a", 0), fake_token("a", 1)]
    assert core._in_flight is not None  # the step after the stop is on its way
    plain = SamplingParams(max_tokens=5)
    (new,) = core.add_request(EngineCoreRequest("a", None, [4, 5, 6, 7, 8], plain, 5, 1.0))
    while core.has_unfinished_requests():
        core.step()
    assert new.output_token_ids == expected_tokens("a", plain, 5)
    assert kv.num_used_blocks == 0


@pytest.mark.parametrize("tier", [dict(kv_offload_cpu="64MiB"),
                                  dict(kv_transfer_config={"kv_connector": "KVServeConnector",
                                                           "kv_role": "kv_both"})])  # fmt: skip
def test_async_scheduling_with_a_connector_is_refused(checkpoint, tier):
    from kvserve import LLM

    with pytest.raises(ConfigError, match=r"^async_scheduling: .*kv_offload_cpu"):
        LLM(checkpoint("llama_gqa"), async_scheduling=True, **tier)


def test_a_failing_step_in_flight_fails_its_requests_only():
    """The runner raises on its third step, which lands while the fourth is already on its
    way with some of the same requests: those of the failed step end with its error, every
    other request gets exactly its tokens, and no block stays held."""
    failed_ids: list[str] = []

    class Failing(FakeRunner):
        def execute_model(self, so):  # noqa: ANN001, ANN202
            if self.calls == 2:
                self.calls += 1
                failed_ids.extend(s.req_id for s in so.seqs)
                raise RuntimeError("injected runner fault")
            return super().execute_model(so)

    bs, blocks = 4, 32
    runner = Failing(blocks, bs)
    kv = KVCacheManager(blocks, bs)
    config = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=8, async_scheduling=True)
    core = EngineCore(config, kv, runner, max_model_len=64, clock=VirtualClock())
    params = SamplingParams(max_tokens=6)
    reqs = {}
    for rid, n in (("a", 5), ("b", 3), ("c", 4)):
        first = 10 * (ord(rid) - ord("a")) + 1
        prompt = list(range(first, first + n))
        (reqs[rid],) = core.add_request(EngineCoreRequest(rid, None, prompt, params, 6, 0.0))
    while core.has_unfinished_requests():
        core.step()
    assert failed_ids and set(failed_ids) < set(reqs)
    for rid, r in reqs.items():
        if rid in failed_ids:
            assert r.status == RequestStatus.FINISHED_ERROR and "injected" in r.error
        else:
            assert r.output_token_ids == expected_tokens(rid, params, 6)
    assert kv.num_used_blocks == 0


def test_a_step_thread_in_the_engines_process_gives_the_same_outputs(
    checkpoint, make_llm, monkeypatch
):
    """The in-process worker on a thread of its own (a GPU's way; forced here on the CPU):
    the engine's thread plans while the step runs, outputs equal one step at a time, and a
    call to the worker made while a step is in flight runs after it, on that thread."""
    import threading

    from kvserve.executor.uniproc import UniProcExecutor

    ckpt = checkpoint("llama_gqa")
    want = _outputs(make_llm(ckpt, **ENGINE), _params(stop=7))
    monkeypatch.setattr(UniProcExecutor, "step_thread", True)
    llm = make_llm(ckpt, async_scheduling=True, **ENGINE)
    executor = llm.engine.executor
    asked: list[tuple[str, bool]] = []

    def on_worker(worker) -> tuple[str, bool]:  # noqa: ANN001 - a Worker
        return threading.current_thread().name, bool(worker.runner.states)

    def hook(core) -> None:  # noqa: ANN001 - an EngineCore
        if core._in_flight is not None and not asked:
            asked.append(executor.collective_rpc(on_worker)[0])

    llm.engine.core.step_hooks.append(hook)
    assert _outputs(llm, _params(stop=7)) == want
    ((name, busy),) = asked
    assert name.startswith("kvserve-step") and busy
