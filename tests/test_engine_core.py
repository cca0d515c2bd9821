"""The engine core without a model: the real Scheduler and KVCacheManager driven by a fake
runner and a virtual clock; the step input as plain data (pickled, run in another process);
a runner or clock that fails."""

from __future__ import annotations

import hashlib
import pickle
import random

import pytest
import torch

from kvserve import SamplingParams
from kvserve.config import SchedulerConfig
from kvserve.engine import EngineCore, EngineCoreRequest
from kvserve.kv.grouped import GroupedKVCacheManager
from kvserve.kv.layer_groups import LayerGroups
from kvserve.kv.manager import KVCacheManager
from kvserve.sched.output import (
    PENDING_TOKEN_ID,
    ModelRunnerOutput,
    ScheduledSeq,
    SchedulerOutput,
)
from kvserve.sched.request import RequestStatus
from tests.conftest import check_blocks, prompts_of_lengths

VOCAB = 50
STOP = 3  # a stop token id the fake runner produces now and then


def fake_token(req_id: str, i: int) -> int:
    """The fake runner's i-th token for a request: a function of the id and i only, so the
    expected output of every request is known without running anything."""
    return hashlib.sha256(f"{req_id}:{i}".encode()).digest()[0] % VOCAB


class FakeRunner:
    """Returns tokens from :func:`fake_token` and checks every step input it is given: slots
    inside the sequence's own blocks, no slot written twice, positions and cache indices
    where the scheduler says the sequence stands."""

    def __init__(
        self, num_blocks: int, block_size: int, windows: tuple[int | None, ...] = (None,)
    ) -> None:
        """``windows``: each layer group's window (a hybrid model's per-group tables): every
        entry a step's queries reach must sit in a real block of each group's table."""
        self.num_blocks, self.block_size = num_blocks, block_size
        self.windows = windows
        self.drawn: dict[str, int] = {}
        self.calls = 0
        self.pending_steps = 0  # steps planned before the one before them landed

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self.calls += 1
        self.pending_steps += so.pending_token_ids
        for seq in so.seqs:  # only a decode token may be pending, and only the last one
            assert PENDING_TOKEN_ID not in seq.token_ids[:-1]
            if seq.token_ids[-1] == PENDING_TOKEN_ID:
                assert so.pending_token_ids and seq.num_tokens == 1 and seq.sample_ids
        for rid in so.finished_req_ids:
            self.drawn.pop(rid, None)
        for nr in so.new_requests:
            assert nr.req_id not in self.drawn, "sampling state sent twice"
            self.drawn[nr.req_id] = len(nr.output_token_ids)
        written: set[int] = set()
        out = ModelRunnerOutput()
        bs = self.block_size
        for seq in so.seqs:
            tables = [seq.block_ids, *seq.group_block_ids]
            assert len(tables) == len(self.windows)
            for table, w in zip(tables, self.windows, strict=True):
                view = ScheduledSeq(seq.req_id, seq.token_ids, seq.position, seq.num_cached,
                                    table)  # fmt: skip
                slots = view.cache_slots(bs).tolist()
                assert all(0 <= s < self.num_blocks * bs for s in slots)
                assert not written & set(slots), "two sequences (or groups) write one slot"
                written |= set(slots)
                assert len(table) * bs >= seq.num_cached + seq.num_tokens
                first = max(0, seq.num_cached - w + 1) if w else 0
                reached = {table[j // bs] for j in range(first, seq.num_cached + seq.num_tokens)}
                assert self.num_blocks not in reached, "a query's entry was dropped"
            assert list(seq.positions) == list(range(seq.num_cached, seq.num_cached + len(slots)))
            for rid in seq.sample_ids:
                i = self.drawn[rid]
                self.drawn[rid] = i + 1
                out.req_ids.append(rid)
                out.token_ids.append(fake_token(rid, i))
                out.logprobs.append(None)
        return out


class VirtualClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        self.t += 0.001
        return self.t


def expected_tokens(req_id: str, params: SamplingParams, max_tokens: int) -> list[int]:
    """What the scheduler must produce for a request the fake runner serves."""
    out = []
    while len(out) < max_tokens:
        t = fake_token(req_id, len(out))
        out.append(t)
        if len(out) >= params.min_tokens and t in (params.stop_token_ids or ()):
            break
    return out


def run_random_workload(
    seed: int,
    num_requests: int = 1000,
    groups: LayerGroups | None = None,
    async_scheduling: bool = False,
) -> dict:
    rng = random.Random(seed)
    block_size, num_blocks = 4, 24
    if groups is None:
        kv = KVCacheManager(num_blocks, block_size, enable_caching=True)
        runner = FakeRunner(num_blocks, block_size)
    else:  # a hybrid model's per-group tables over a pool of the same bytes
        kv = GroupedKVCacheManager(groups, num_blocks, block_size, enable_caching=True)
        runner = FakeRunner(num_blocks * groups.num_groups, block_size, groups.windows)
    clock = VirtualClock()
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=40,
                             async_scheduling=async_scheduling)  # fmt: skip
    core = EngineCore(config, kv, runner, max_model_len=96, clock=clock)
    prefixes = [[rng.randrange(VOCAB) for _ in range(rng.randrange(4, 24))] for _ in range(6)]
    requests: dict[str, tuple[SamplingParams, int, list]] = {}
    outputs: dict[str, tuple] = {}
    aborted: set[str] = set()
    added = steps = 0
    while added < num_requests or core.has_unfinished_requests():
        for _ in range(min(rng.choice([0, 0, 1, 2, 3]), num_requests - added)):
            rid = f"r{added}"
            added += 1
            prompt = rng.choice(prefixes)[: rng.randrange(1, 25)]
            prompt = prompt + [rng.randrange(VOCAB) for _ in range(rng.randrange(0, 12))]
            max_tokens = rng.randrange(1, 24)
            params = SamplingParams(
                n=rng.choice([1, 1, 1, 2, 3]),
                max_tokens=max_tokens,
                stop_token_ids=[STOP] if rng.random() < 0.7 else None,
                min_tokens=min(rng.choice([0, 0, 2]), max_tokens),
                seed=rng.randrange(100),
            )
            req = EngineCoreRequest(rid, None, prompt, params, params.max_tokens, clock())
            children = core.add_request(req)
            requests[rid] = (params, params.max_tokens, children)
        live = list(core.families)
        if live and rng.random() < 0.05:
            victim = rng.choice(live)
            core.abort_request(victim)
            aborted.add(victim)
        core.step()
        check_blocks(core)
        steps += 1
        assert steps < 50_000, "the workload does not finish"
    for rid, (params, max_tokens, children) in requests.items():
        outputs[rid] = tuple((c.status.value, tuple(c.output_token_ids)) for c in children)
        for c in children:
            assert c.is_finished
            want = expected_tokens(c.request_id, params, max_tokens)
            got = c.output_token_ids
            if rid in aborted:
                assert got == want[: len(got)]
            else:
                assert got == want, (c.request_id, got, want)
                stops = bool(params.stop_token_ids) and len(want) >= params.min_tokens
                stopped = stops and want[-1] == STOP
                assert c.status.value == ("stop" if stopped else "length")
            m = c.metrics
            if got:
                assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time
                assert m.token_times == sorted(m.token_times)
    assert kv.num_used_blocks == 0
    kv.check_invariants()
    return {
        "outputs": outputs,
        "preemptions": core.scheduler.stats.num_preemptions,
        "hits": kv.stats.hits,
        "steps": steps,
        "aborted": len(aborted),
        "pending_steps": runner.pending_steps,
    }


def test_thousand_random_requests_without_a_model():
    """Shared prefixes, n > 1, aborts, preemption in a small pool and stop tokens, checked
    after every step, against the tokens the fake runner was asked for, and reproducible."""
    first = run_random_workload(seed=7)
    assert len(first["outputs"]) == 1000
    assert first["preemptions"] > 20 and first["hits"] > 0 and first["aborted"] > 10
    assert run_random_workload(seed=7) == first
    assert run_random_workload(seed=8, num_requests=50)["outputs"] != first["outputs"]


def test_thousand_random_requests_with_async_scheduling():
    """The same workload with each step planned before the one in flight has landed: the
    tokens the fake runner was asked for, blocks checked after every step, no block left
    held; preemption still happens (with nothing in flight) and aborts land cleanly."""
    run = run_random_workload(seed=7, async_scheduling=True)
    assert len(run["outputs"]) == 1000
    assert run["preemptions"] > 20 and run["hits"] > 0 and run["aborted"] > 10
    assert run["pending_steps"] > run["steps"] // 2  # most steps went out before a landing
    assert run_random_workload(seed=7)["pending_steps"] == 0


@pytest.mark.parametrize("windows", [(None, 8), (None, None, 6, 6, 6, 6), (12, None, 5)])
def test_random_requests_on_per_group_tables(windows):
    """The same workload on a hybrid model's per-group tables: the same tokens as the fake
    runner was asked for, every group's blocks checked after every step, no group ever
    dropping an entry a query reaches, and prefix hits through every group."""
    groups = LayerGroups.of(windows)
    run = run_random_workload(seed=7, num_requests=300, groups=groups)
    assert run["preemptions"] > 0 and run["hits"] > 0 and run["aborted"] > 0


# -- the step input is plain data -------------------------------------------------------------
ENGINE_KW = dict(dtype="float32", block_size=4, num_gpu_blocks=64, max_num_batched_tokens=24)


def _remote_steps(config, num_blocks: int, max_model_len: int, blobs: list[bytes]) -> list:  # noqa: ANN001
    """In a fresh process: build a runner from the engine config and execute the pickled
    steps, in order; return the sampled tokens of each."""
    from kvserve.worker.model_runner import build_runner

    torch.set_num_threads(1)
    runner = build_runner(config, num_blocks, max_model_len)
    outs = []
    for blob in blobs:
        out = runner.execute_model(pickle.loads(blob))
        outs.append((out.req_ids, out.token_ids))
    return outs


def test_step_input_pickles_and_runs_in_another_process(make_llm, checkpoint):
    llm = make_llm(checkpoint("llama_gqa"), **ENGINE_KW)
    engine = llm.engine
    prompts = prompts_of_lengths([9, 30, 5], seed=4)
    sp = SamplingParams(temperature=0.7, seed=3, max_tokens=4, ignore_eos=True, n=2)
    for i, p in enumerate(prompts):
        engine.add_request(f"q{i}", {"prompt_token_ids": p}, sp)
    sched, blobs, local = engine.core.scheduler, [], []
    for _ in range(4):  # chunked prefill, the fork at the first token, then decode
        so = sched.schedule()
        blob = pickle.dumps(so)
        assert pickle.loads(blob) == so
        blobs.append(blob)
        out = engine.executor.driver_worker.runner.execute_model(so)
        assert pickle.loads(pickle.dumps(out)) == out  # the reply of a worker process
        local.append((out.req_ids, out.token_ids))
        sched.update_from_output(so, out, 0.0, 0.0)
    assert any(len(ids) > 1 for ids, _ in local)
    ctx = torch.multiprocessing.get_context("spawn")
    with ctx.Pool(1) as pool:
        remote = pool.apply(_remote_steps, (engine.config, engine.num_blocks,
                                            engine.max_model_len, blobs))  # fmt: skip
    assert remote == local
    engine.abort_request([f"q{i}" for i in range(3)])


# -- a runner or clock that fails ---------------------------------------------------------------
class FailingRunner(FakeRunner):
    def __init__(self, num_blocks: int, block_size: int, fail_on: set[int]) -> None:
        super().__init__(num_blocks, block_size)
        self.fail_on = fail_on

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        if self.calls + 1 in self.fail_on:
            self.calls += 1
            raise RuntimeError("injected runner fault")
        return super().execute_model(so)


def _core(runner, clock) -> EngineCore:  # noqa: ANN001
    kv = KVCacheManager(32, 4)
    return EngineCore(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=8), kv, runner,
                      max_model_len=64, clock=clock)  # fmt: skip


def _add(core: EngineCore, rid: str, n_prompt: int, max_tokens: int = 6) -> list:
    p = SamplingParams(max_tokens=max_tokens, n=2 if rid == "b" else 1)
    first = 10 * (ord(rid) - ord("a")) + 1  # no shared prefix: each runs from its first step
    prompt = list(range(first, first + n_prompt))
    return core.add_request(EngineCoreRequest(rid, None, prompt, p, max_tokens, 0.0))


def _drain(core: EngineCore) -> None:
    while core.has_unfinished_requests():
        core.step()
        check_blocks(core)


@pytest.mark.parametrize("what", ["runner", "clock"])
def test_a_failing_step_fails_its_requests_only(what):
    """Step 3 fails (in the runner, or in the clock read after it): the requests it scheduled
    finish with status error and free their blocks; the requests outside that step (the
    forked second sample of b, and c) finish with exactly their tokens."""
    raised = []

    def clock() -> float:
        if what == "clock" and runner.calls == 3 and not raised:
            raised.append(1)
            raise OSError("injected clock fault")
        return float(runner.calls)

    runner = FailingRunner(32, 4, {3} if what == "runner" else set())
    core = _core(runner, clock)
    a, b, c = _add(core, "a", 5), _add(core, "b", 7), _add(core, "c", 3)
    for _ in range(2):
        core.step()  # a and b#0 run (max_num_seqs=2); b#1 forked at b#0's first token; c waits
    updated = core.step()  # the failing step
    check_blocks(core)
    failed = {r.request_id for r in updated if r.status == RequestStatus.FINISHED_ERROR}
    assert failed == {"a", "b#0"}
    assert all("injected" in r.error for r in (a[0], b[0]))
    _drain(core)
    assert core.kv.num_used_blocks == 0
    sp = SamplingParams(max_tokens=6)
    for r in (b[1], c[0]):
        assert r.status == RequestStatus.FINISHED_LENGTH and r.error is None
        assert r.output_token_ids == expected_tokens(r.request_id, sp, 6)


def test_runner_failure_reaches_the_caller_as_an_error_output(make_llm, checkpoint):
    llm = make_llm(checkpoint("llama_gqa"), **ENGINE_KW)
    engine = llm.engine
    real = engine.executor.driver_worker.runner.execute_model
    calls = []

    def flaky(so):  # noqa: ANN001
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected")
        return real(so)

    engine.executor.driver_worker.runner.execute_model = flaky
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": p} for p in prompts_of_lengths([6])], sp)[0]
    assert out.outputs[0].finish_reason == "error" and "injected" in out.error
    again = llm.generate([{"prompt_token_ids": p} for p in prompts_of_lengths([6])], sp)[0]
    assert again.outputs[0].finish_reason == "length" and len(again.outputs[0].token_ids) == 5


@pytest.mark.parametrize("fmt", ["float32", "kivi2"])
def test_null_block_is_never_handed_out_or_written(make_llm, checkpoint, fmt):
    """The pad block of every table: no request gets it, no write reaches it (it stays zero,
    so a masked read of it is finite), whatever the workload does (chunks, n > 1, preemption)."""
    llm = make_llm(checkpoint("llama_gqa"), kv_cache_dtype=fmt, dtype="float32", block_size=4,
                   num_gpu_blocks=20, max_num_batched_tokens=16)  # fmt: skip
    engine = llm.engine
    null = engine.executor.driver_worker.storage.null_block
    assert null == engine.kv.null_block == engine.num_blocks
    seen: list[int] = []
    engine.core.step_hooks.append(
        lambda core: seen.extend(b for s in core.last_step.seqs for b in s.block_ids)
    )
    sp = SamplingParams(temperature=0.9, seed=1, max_tokens=12, ignore_eos=True, n=2)
    llm.generate([{"prompt_token_ids": p} for p in prompts_of_lengths([9, 23, 14])], sp)
    assert engine.stats().num_preemptions > 0
    assert seen and max(seen) < null
    for ts in engine.executor.driver_worker.storage.block_tensors().values():
        for t in ts:
            assert not t[null].any()
