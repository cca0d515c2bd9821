"""Disaggregated prefill and decode (kvserve.disagg) between two engines in one process: a
prefill engine hands its blocks to a decode engine over the ZMQ side channel, and the decode
engine's greedy tokens equal those of one colocated engine (an engine with no connector) token
for token, in every KV format, pulling only what its own prefix cache lacks and computing no
prompt token the prefill engine sent. Then the failures: a handshake that refuses a mismatch
naming the field, a dead prefill engine noticed within the heartbeat timeout, leases, aborts
on either side, and a seeded run of random faults after which both pools are idle."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import pytest

from kvserve import SamplingParams
from kvserve.config import ConfigError, KVTransferConfig
from kvserve.distributed import free_port
from tests.disagg_helpers import (
    BS,
    decode,
    prefill,
    settle,
    transfer_config,
    worker_side,
)

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
SHARED = [(5 * i + 7) % 200 + 3 for i in range(3 * BS)]  # three full blocks
PROMPT_A = SHARED + [(3 * i + 1) % 200 + 3 for i in range(BS + 3)]  # 4 full + a partial
PROMPT_B = SHARED + [(7 * i + 2) % 200 + 3 for i in range(2 * BS + 5)]  # 5 full + a partial


@pytest.fixture(autouse=True)
def no_bandwidth_probe(monkeypatch):
    """Each engine measures the memory's peak bandwidth at start (half a second); nothing
    here reads it, and these tests build many engines."""
    from kvserve.worker.worker import Worker

    monkeypatch.setattr(Worker, "measure_peak_bandwidth", lambda self: 1e10)


FORMATS = ["float32", "bfloat16", "fp8_e4m3", "fp8_e5m2", "int8", "kivi4", "kivi2"]


def engines(make_llm, ckpt, kv_dtype="float32", decode_kw=None, policy="recompute", **extra):
    """A prefill engine, a decode engine (prefix caching on) and a colocated reference."""
    common = dict(dtype="float32", block_size=BS, num_gpu_blocks=40, kv_cache_dtype=kv_dtype)
    port = free_port()
    p = make_llm(ckpt, **common, kv_transfer_config=transfer_config("kv_producer", port, **extra))
    tc = transfer_config("kv_consumer", free_port(), **extra) | {"kv_load_failure_policy": policy}
    d = make_llm(ckpt, **{**common, **(decode_kw or {})}, enable_prefix_caching=True,
                 kv_transfer_config=tc)  # fmt: skip
    return p, d


def reference(make_llm, ckpt, prompts, kv_dtype="float32", params=GREEDY):
    """One colocated engine's tokens, prompt after prompt (as the pair runs them)."""
    c = make_llm(ckpt, dtype="float32", block_size=BS, num_gpu_blocks=40, kv_cache_dtype=kv_dtype)
    return [c.generate([p], params)[0].outputs[0].token_ids for p in prompts]


def pd(p, d, rid, prompt, params=GREEDY):
    first = prefill(p.engine, rid, prompt, params)
    return first, decode([p.engine, d.engine], d.engine, rid, prompt, params,
                         first.kv_transfer_params)  # fmt: skip


def assert_idle(*llms, timeout_s=30.0):
    settle([x.engine for x in llms], timeout_s)
    for x in llms:
        assert x.engine.kv.num_used_blocks == 0
        x.engine.kv.check_invariants()


@pytest.mark.parametrize("kv_dtype", FORMATS)
def test_disaggregated_tokens_equal_colocated_and_only_missing_blocks_travel(
    checkpoint, make_llm, kv_dtype
):
    ckpt = checkpoint("llama_gqa")
    want = reference(make_llm, ckpt, [PROMPT_A, PROMPT_B], kv_dtype)
    p, d = engines(make_llm, ckpt, kv_dtype)
    dw = worker_side(d)

    first, out_a = pd(p, d, "a", PROMPT_A)
    assert first.outputs[0].token_ids == want[0][:1]
    params = first.kv_transfer_params
    assert params["do_remote_prefill"] is True and params["remote_port"] == p.engine.connector.port
    assert len(params["remote_block_ids"]) == 5 and params["remote_num_tokens"] == len(PROMPT_A)
    assert out_a.error is None and out_a.outputs[0].token_ids == want[0]
    assert (out_a.num_cached_tokens, out_a.num_transferred_tokens) == (0, len(PROMPT_A))
    assert d.engine.connector.counters["blocks_received"] == 5

    # B shares A's first three blocks, which the decode engine now caches: only the rest move.
    first, out_b = pd(p, d, "b", PROMPT_B)
    assert out_b.outputs[0].token_ids == want[1]
    assert out_b.num_cached_tokens == 3 * BS
    assert out_b.num_transferred_tokens == len(PROMPT_B) - 3 * BS
    assert d.engine.connector.counters["blocks_received"] == 5 + 3  # blocks 3, 4 and the partial
    # The decode engine computed no prompt token: every one came cached or transferred.
    assert d.engine.stats().prefill_tokens_computed_total == 0
    assert dw.client is not None and p.engine.connector.counters["holds"] == 2
    assert_idle(p, d)
    st = d.engine.stats()
    assert st.kv_transfer["failures"] == {}
    # Transferred tokens are counted apart from cache hits (vllm #46666 counted them as hits).
    assert st.kv_transfer["tokens_received"] == len(PROMPT_A) + len(PROMPT_B) - 3 * BS
    assert st.tier_hit_tokens == 0


def test_a_read_is_served_while_the_prefill_engine_takes_no_step(checkpoint, make_llm):
    """A prefill engine busy in a long step (a chunk of the next prompt) must not hold a
    decode engine's read until that step ends: here it takes no step at all after the one
    that begins the hold, and the decode engine still gets every block and the tokens."""
    ckpt = checkpoint("llama_gqa")
    (want,) = reference(make_llm, ckpt, [PROMPT_A])
    p, d = engines(make_llm, ckpt, read_timeout_s=5.0)
    first = prefill(p.engine, "a", PROMPT_A, GREEDY)
    p.engine.step()  # the step that begins the hold
    out = decode([d.engine], d.engine, "a", PROMPT_A, GREEDY, first.kv_transfer_params,
                 timeout_s=4.0)  # fmt: skip
    assert out.error is None and out.outputs[0].token_ids == want
    assert out.num_transferred_tokens == len(PROMPT_A)
    assert d.engine.stats().kv_transfer["failures"] == {}
    assert_idle(p, d)


@pytest.mark.parametrize(
    "decode_kw, field",
    [({"kv_cache_dtype": "bfloat16"}, "dtypes"), ({}, "model")],
)
def test_a_mismatched_peer_is_refused_naming_the_field(checkpoint, make_llm, decode_kw, field):
    ckpt = checkpoint("llama_gqa")
    other = checkpoint("llama_gqa", seed=99) if field == "model" else ckpt
    port = free_port()
    p = make_llm(ckpt, dtype="float32", block_size=BS, num_gpu_blocks=40,
                 kv_transfer_config=transfer_config("kv_producer", port))  # fmt: skip
    tc = transfer_config("kv_consumer", free_port()) | {"kv_load_failure_policy": "fail"}
    d = make_llm(other, dtype="float32", block_size=BS, num_gpu_blocks=40,
                 **decode_kw, kv_transfer_config=tc)  # fmt: skip
    first = prefill(p.engine, "a", PROMPT_A, GREEDY)
    params = dict(first.kv_transfer_params, remote_block_hashes=None)  # (the model's hashes differ)
    out = decode([p.engine, d.engine], d.engine, "a", PROMPT_A, GREEDY, params)
    assert out.error is not None and "handshake refused" in out.error and f"{field}:" in out.error
    assert d.engine.stats().kv_transfer["failures"] == {"handshake": 1}
    assert_idle(p, d)


def test_an_answer_for_other_tokens_is_not_pulled(checkpoint, make_llm):
    """The decode engine's own block hashes (here under another cache salt) must match the
    prefill engine's: otherwise nothing is pulled and the failure policy applies."""
    ckpt = checkpoint("llama_gqa")
    p, d = engines(make_llm, ckpt, policy="fail")
    first = prefill(p.engine, "a", PROMPT_A, GREEDY)
    d.engine.add_request("a", {"prompt_token_ids": PROMPT_A, "cache_salt": "other tenant"},
                         GREEDY, tags=_tags(first.kv_transfer_params))  # fmt: skip
    outs = [o for _ in range(50) for o in d.engine.step() if o.finished]
    out = outs[0]
    assert "block hash mismatch" in out.error and out.outputs[0].token_ids == []
    assert d.engine.stats().kv_transfer["failures"] == {"hash_mismatch": 1}
    assert d.engine.stats().kv_transfer.get("blocks_received", 0) == 0
    assert_idle(p, d, timeout_s=5.0)  # released at once, long before the hold's 30 s lease


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_dead_prefill_engine_is_noticed_within_a_second(checkpoint, make_llm, policy):
    ckpt = checkpoint("llama_gqa")
    want = reference(make_llm, ckpt, [PROMPT_A])[0]
    p, d = engines(make_llm, ckpt, policy=policy)
    first = prefill(p.engine, "a", PROMPT_A, GREEDY)
    p.engine.shutdown()  # the prefill engine is gone (its side channel with it)
    t0 = time.monotonic()
    out = decode([d.engine], d.engine, "a", PROMPT_A, GREEDY, first.kv_transfer_params)
    assert time.monotonic() - t0 < 1.5  # 1 s of silence, then the policy
    if policy == "recompute":
        assert out.error is None and out.outputs[0].token_ids == want
        assert out.num_transferred_tokens == 0
    else:
        assert "unreachable" in out.error and "kv_load_failure_policy: fail" in out.error
    assert d.engine.stats().kv_transfer["failures"] == {"peer_unreachable": 1}
    assert_idle(d)


def test_a_lease_that_expires_frees_the_blocks_and_a_late_decode_recomputes(checkpoint, make_llm):
    ckpt = checkpoint("llama_gqa")
    want = reference(make_llm, ckpt, [PROMPT_A])[0]
    p, d = engines(make_llm, ckpt, lease_s=0.2)
    first = prefill(p.engine, "a", PROMPT_A, GREEDY)
    assert p.engine.kv.num_used_blocks > 0  # held for the decode engine
    settle([p.engine])  # nobody reads: the lease ends
    assert p.engine.kv.num_used_blocks == 0
    assert worker_side(p)._holds == {}
    out = decode([p.engine, d.engine], d.engine, "a", PROMPT_A, GREEDY, first.kv_transfer_params)
    assert out.error is None and out.outputs[0].token_ids == want  # recomputed locally
    assert d.engine.stats().kv_transfer["failures"] == {"lease_expired": 1}
    assert_idle(p, d)


def test_aborts_on_either_side_release_both_sides_blocks(checkpoint, make_llm):
    ckpt = checkpoint("llama_gqa")
    p, d = engines(make_llm, ckpt, lease_s=60.0)
    # The decode side aborts while its pull may be in flight: the prefill engine's hold goes
    # with it, long before its 60 s lease.
    first = prefill(p.engine, "a", PROMPT_A, GREEDY)
    d.engine.add_request("a", {"prompt_token_ids": PROMPT_A}, GREEDY,
                         tags=_tags(first.kv_transfer_params))  # fmt: skip
    d.engine.step()
    d.engine.abort_request("a")
    assert_idle(p, d, timeout_s=5.0)  # long before the 60 s lease
    # The prefill side aborts before its first token: nothing is held or handed out.
    p.engine.add_request("b", {"prompt_token_ids": PROMPT_B}, GREEDY.clone(max_tokens=1),
                         tags=_tags({"do_remote_decode": True}))  # fmt: skip
    p.engine.abort_request("b")
    assert not p.engine.has_unfinished_requests() and p.engine.kv.num_used_blocks == 0
    # Both keep serving.
    _, out = pd(p, d, "c", PROMPT_B)
    assert out.error is None and len(out.outputs[0].token_ids) == GREEDY.max_tokens
    assert_idle(p, d)


def test_a_decode_engine_that_dies_mid_pull_leaves_nothing_held(checkpoint, make_llm):
    """The prefill engine's hold ends with its lease when the reader is gone for good, and
    the prefill engine serves on."""
    ckpt = checkpoint("llama_gqa")
    p, d = engines(make_llm, ckpt, lease_s=0.5)
    first = prefill(p.engine, "a", PROMPT_A, GREEDY)
    d.engine.add_request("a", {"prompt_token_ids": PROMPT_A}, GREEDY,
                         tags=_tags(first.kv_transfer_params))  # fmt: skip
    d.engine.step()  # the pull starts
    d.engine.shutdown()  # ... and the decode engine is gone
    assert_idle(p, timeout_s=5.0)
    assert p.engine.stats().kv_transfer["leases_expired"] == 1  # no release ever came
    second = prefill(p.engine, "b", PROMPT_B, GREEDY)
    assert second.kv_transfer_params["remote_num_tokens"] == len(PROMPT_B)
    assert_idle(p, timeout_s=5.0)


def _tags(params):
    from kvserve.sched.request import RequestTags

    return RequestTags(kv_transfer_params=params)


def test_kv_transfer_config_roles_and_the_builtin_connector():
    tc = KVTransferConfig(kv_connector="KVServeConnector", kv_role="kv_both")
    assert tc.kv_connector_module_path is None
    with pytest.raises(ConfigError, match="kv_role: must be one of kv_producer, kv_consumer"):
        KVTransferConfig(kv_connector="KVServeConnector", kv_role="prefill")
    with pytest.raises(ConfigError, match=r"kv_port: must be an integer in \[0, 65535\]"):
        KVTransferConfig(kv_connector="KVServeConnector", kv_port=70000)


def test_a_kv_port_in_use_is_refused_naming_it(checkpoint, make_llm):
    port = free_port()
    make_llm(checkpoint("llama_gqa"), kv_transfer_config=transfer_config("kv_producer", port))
    with pytest.raises(ConfigError, match=f"kv_port: cannot listen on 127.0.0.1:{port}"):
        make_llm(checkpoint("llama_gqa"), kv_transfer_config=transfer_config("kv_producer", port))


def test_a_hybrid_model_is_refused_at_start_naming_the_way_out(checkpoint, make_llm, tmp_path):
    src = Path(checkpoint("qwen2", sliding_window=24, num_layers=2))
    for f in src.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(cfg | {"max_window_layers": 1}))
    with pytest.raises(ConfigError, match="--disable-hybrid-kv-cache-manager"):
        make_llm(str(tmp_path), kv_transfer_config=transfer_config("kv_consumer", free_port()))


FAULTS = ("none", "drop_read", "delay_read", "drop_release", "abort_decode", "abort_prefill",
          "expire_lease", "kill_peer")  # fmt: skip


def test_random_faults_lose_nothing_and_leak_nothing(checkpoint, make_llm):
    """A seeded run of faults, one per request: every request ends with the colocated
    engine's tokens or a clear error, and after each both pools are idle."""
    ckpt = checkpoint("llama_gqa")
    prompts = [PROMPT_A, PROMPT_B]
    want = reference(make_llm, ckpt, prompts)
    p, d = engines(make_llm, ckpt, lease_s=0.6, read_timeout_s=0.3, heartbeat_timeout_s=0.5)
    pw, rng = worker_side(p), random.Random(64)
    served = pw.server
    outcomes: dict[str, int] = {}
    for run in range(24):
        fault = FAULTS[run % len(FAULTS)] if run < len(FAULTS) else rng.choice(FAULTS)
        k = rng.randrange(2)
        rid = f"r{run}"
        first = prefill(p.engine, rid, prompts[k], GREEDY)
        params = first.kv_transfer_params
        inbox = served.inbox
        if fault in ("drop_read", "drop_release", "delay_read"):
            kind = "Read" if fault != "drop_release" else "Release"
            served.inbox = _Filter(inbox, kind, fault == "delay_read", rng)
        if fault == "expire_lease":
            p.engine.step()  # the step that starts the hold on the worker
            pw._holds[rid] = (pw._holds[rid][0], 0.0)
        if fault == "kill_peer":
            params = dict(params, remote_port=free_port())  # nobody listens there
        if fault == "abort_decode":
            d.engine.add_request(rid, {"prompt_token_ids": prompts[k]}, GREEDY,
                                 tags=_tags(params))  # fmt: skip
            for _ in range(rng.randrange(1, 4)):
                d.engine.step()
                p.engine.step()
            d.engine.abort_request(rid)
            outcome = "aborted"
        elif fault == "abort_prefill":  # a second request, aborted before its first token
            p.engine.add_request(rid + "x", {"prompt_token_ids": prompts[k]},
                                 GREEDY.clone(max_tokens=1),
                                 tags=_tags({"do_remote_decode": True}))  # fmt: skip
            p.engine.step() if rng.random() < 0.5 else None
            p.engine.abort_request(rid + "x")
            out = decode([p.engine, d.engine], d.engine, rid, prompts[k], GREEDY, params)
            outcome = _judge(out, want[k])
        else:
            out = decode([p.engine, d.engine], d.engine, rid, prompts[k], GREEDY, params)
            outcome = _judge(out, want[k])
        served.inbox = inbox
        assert_idle(p, d)
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    assert outcomes.get("exact", 0) >= 15 and set(outcomes) <= {"exact", "aborted"}
    # The faults happened, and each was noticed for what it was.
    fails = d.engine.stats().kv_transfer["failures"]
    assert {"timeout", "lease_expired", "peer_unreachable"} <= set(fails), fails
    _, out = pd(p, d, "last", PROMPT_A)  # both keep serving
    assert out.outputs[0].token_ids == want[0]
    assert_idle(p, d)


def _judge(out, want) -> str:
    """A recompute-policy request ends exact (pulled or recomputed), or with a clear error."""
    if out.error is not None:
        assert "kv load failed" in out.error
        return "error"
    assert out.outputs[0].token_ids == want
    return "exact"


class _Filter:
    """A server inbox that drops (or delays, by re-queueing a few times) one kind of
    message: what a lossy or slow control path looks like to the step thread."""

    def __init__(self, inner, kind, delay, rng):
        self.inner, self.kind, self.delay, self.rng = inner, kind, delay, rng
        self.held = 0

    def append(self, item):
        if type(item[1]).__name__ == self.kind:
            if not self.delay:
                return
            time.sleep(self.rng.uniform(0.0, 0.05))
        self.inner.append(item)

    def __bool__(self):
        return bool(self.inner)

    def popleft(self):
        return self.inner.popleft()
