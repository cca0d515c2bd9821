"""The KV connector contract, shown by a connector written in the tests against the API alone
(tests/kv_test_connector.py): a finished request's blocks stay held (delay_free) until the
workers report them sent, loads land asynchronously and their failures are recomputed or fail
the request as kv_load_failure_policy says, block conservation holds after every step, and the
same under the worker-process executor."""

from __future__ import annotations

import pytest

from kvserve import SamplingParams
from kvserve.config import ConfigError, KVTransferConfig
from tests.conftest import check_blocks

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
BS = 8
PROMPT = [(5 * i + 7) % 200 + 3 for i in range(8 * BS + 3)]  # 8 full blocks and a partial one


def connector(store, **extra):
    return {"kv_connector": "StoreConnector", "kv_connector_module_path": "tests.kv_test_connector",
            "kv_connector_extra_config": {"store": str(store), **extra}}  # fmt: skip


def fill_store(make_llm, ckpt, store) -> list[int]:
    """An engine computes PROMPT and its connector writes the full blocks to ``store``;
    returns the tokens it generated."""
    src = make_llm(ckpt, dtype="float32", block_size=BS, num_gpu_blocks=24,
                   kv_transfer_config=connector(store, save=True, send_steps=1))  # fmt: skip
    want = run(src.engine, "a", PROMPT).outputs[0].token_ids
    while src.engine.has_unfinished_requests():
        src.engine.step()
    return want


def scheduler_side(llm):
    return llm.engine.connector


def run(engine, rid, prompt, params=GREEDY, max_steps=200):
    """Step until ``rid`` finishes; every step checks block conservation."""
    engine.add_request(rid, {"prompt_token_ids": prompt}, params)
    for _ in range(max_steps):
        for o in engine.step():
            if o.request_id == rid and o.finished:
                return o
        check_blocks(engine.core)
    raise AssertionError(f"{rid} did not finish in {max_steps} steps")


def test_finished_blocks_stay_held_until_the_workers_report_them_sent(checkpoint, make_llm,
                                                                     tmp_path):  # fmt: skip
    llm = make_llm(checkpoint("llama_gqa"), dtype="float32", block_size=BS, num_gpu_blocks=24,
                   kv_transfer_config=connector(tmp_path, save=True, send_steps=3))  # fmt: skip
    engine, sched = llm.engine, llm.engine.core.scheduler
    out = run(engine, "a", PROMPT)
    held_blocks = len(engine.kv.block_ids(sched.held["a"][0]))
    assert held_blocks == 10 and engine.kv.num_used_blocks == held_blocks
    assert engine.has_unfinished_requests()  # steps go on for the transfer
    assert out.kv_transfer_params == {"stored_blocks": 9}  # (64 + 3 + 8 - 1) // 8 full blocks
    steps = 0
    while sched.held:
        engine.step()
        check_blocks(engine.core)
        steps += 1
    assert steps == 3  # send_steps after the hold began, not sooner
    assert engine.kv.num_used_blocks == 0 and not engine.has_unfinished_requests()
    assert len(list(tmp_path.iterdir())) == 9
    assert sched.stats.held_for_transfer == 1 and sched.stats.held_lease_expired == 0


def test_a_hold_never_reported_sent_is_freed_when_its_lease_ends(checkpoint, make_llm,
                                                                tmp_path):  # fmt: skip
    now = [0.0]
    llm = make_llm(checkpoint("llama_gqa"), dtype="float32", block_size=BS, num_gpu_blocks=24,
                   kv_transfer_config=connector(tmp_path, save=True, never_send=True,
                                                lease_s=5.0))  # fmt: skip
    engine = llm.engine
    engine.core.clock = lambda: now[0]
    run(engine, "a", PROMPT)
    for _ in range(3):
        engine.step()
    assert engine.kv.num_used_blocks > 0  # still held: the lease has not ended
    now[0] += 6.0
    engine.step()
    assert engine.kv.num_used_blocks == 0
    assert engine.core.scheduler.stats.held_lease_expired == 1


@pytest.mark.parametrize("executor", ["uni", "mp"])
def test_blocks_load_from_the_connector_asynchronously_and_give_the_same_tokens(
    checkpoint, make_llm, tmp_path, executor
):
    ckpt = checkpoint("llama_gqa")
    want = fill_store(make_llm, ckpt, tmp_path)
    dst = make_llm(ckpt, dtype="float32", block_size=BS, num_gpu_blocks=24,
                   distributed_executor_backend=executor,
                   kv_transfer_config=connector(tmp_path, recv_steps=2))  # fmt: skip
    out = run(dst.engine, "b", PROMPT)
    assert out.outputs[0].token_ids == want
    assert out.num_cached_tokens == 8 * BS  # every full block but the last token's came over
    calls = scheduler_side(dst).calls
    assert calls["update_state_after_alloc"] == 1
    assert scheduler_side(dst).allocated == {"b": 8 * BS}
    assert dst.engine.core.scheduler.loads.hit_tokens == 8 * BS
    assert dst.engine.stats().prefill_tokens_computed_total == len(PROMPT) - 8 * BS


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_failed_load_follows_the_failure_policy(checkpoint, make_llm, tmp_path, policy):
    ckpt = checkpoint("llama_gqa")
    want = fill_store(make_llm, ckpt, tmp_path)
    tc = connector(tmp_path, fail_block=3) | {"kv_load_failure_policy": policy}
    dst = make_llm(ckpt, dtype="float32", block_size=BS, num_gpu_blocks=24,
                   kv_transfer_config=tc)  # fmt: skip
    out = run(dst.engine, "b", PROMPT)
    loads = dst.engine.core.scheduler.loads
    assert loads.failed_blocks == 5  # the 4th block and every one after it in the chain
    if policy == "recompute":
        assert out.error is None
        assert out.outputs[0].token_ids == want  # blocks 3-7 computed again: exact
        assert out.num_cached_tokens == 3 * BS
    else:
        assert out.error is not None and "kv load failed" in out.error
        assert out.outputs[0].token_ids == []
    assert dst.engine.kv.num_used_blocks == 0


def test_kv_transfer_config_is_checked():
    with pytest.raises(ConfigError, match="kv_load_failure_policy"):
        KVTransferConfig(kv_load_failure_policy="retry")
    with pytest.raises(ConfigError, match="kv_connector_module_path"):
        KVTransferConfig(kv_connector="Nope")
    with pytest.raises(ConfigError, match="unknown field"):
        KVTransferConfig.from_any('{"kv_conector": "x"}')


def test_a_connector_that_cannot_be_imported_is_refused_at_start(checkpoint, make_llm):
    bad = {"kv_connector": "Missing", "kv_connector_module_path": "tests.kv_test_connector"}
    with pytest.raises(ConfigError, match="kv_connector: 'Missing'"):
        make_llm(checkpoint("llama_gqa"), kv_transfer_config=bad)


@pytest.mark.parametrize("layer_wise", [True, False])
def test_a_layer_wise_connector_is_called_around_each_layers_attention(
    checkpoint, make_llm, tmp_path, layer_wise
):
    llm = make_llm(checkpoint("llama_gqa"), dtype="float32", block_size=BS, num_gpu_blocks=24,
                   kv_transfer_config=connector(tmp_path, layer_wise=layer_wise))  # fmt: skip
    worker_side = llm.engine.executor.driver_worker.connector
    layers = llm.engine.model_config.num_hidden_layers
    llm.generate([PROMPT[:20]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    steps = 3  # the prompt's step, then two decode steps
    want = [(kind, i) for i in range(layers) for kind in ("load", "save")] * steps
    assert worker_side.layer_calls == (want if layer_wise else [])
