"""The simulated disaggregated deployment (kvserve.sim.pd) against hand-computed times: a cost
model whose steps take a fixed overhead, a fixed extra for any prompt work and a time per
token, and a link of known bandwidth, so TTFT is the prefill step plus the pulled blocks'
bytes over the bandwidth, each decode step the decode-only formula, and a repeated prompt
pulls only the block the decode side's prefix cache lacks. The colocated replay through the
same driver equals the plain one (its independent implementation); the flags are refused
with messages naming them."""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

import pytest

from kvserve.bench.runner import LoadSpec
from kvserve.bench.workloads import BenchRequest
from kvserve.cli import main
from kvserve.engine_args import default_model
from kvserve.sim.cost import Profile
from kvserve.sim.engine import SimTarget, build_engine
from kvserve.sim.pd import TraceFeed
from kvserve.sim.simulate import _Trace, run_disaggregated, simulate_load

OVERHEAD, PREFILL, PER_TOKEN = 0.01, 0.05, 0.001  # seconds
BW = 1e6  # bytes/s
BS = 16
KW = dict(model=default_model(), num_gpu_blocks=64, block_size=BS, enable_prefix_caching=True)
PROMPT = " ".join(f"w{i}" for i in range(40))


def profile() -> Profile:
    # Peaks so high that the roofline terms vanish: a step is overhead + per-token time,
    # plus PREFILL when it computes any prompt token.
    return Profile(device="test", peak_flops=1e30, peak_bandwidth=1e30, source="test",
                   dtype="float32", step_overhead_s=OVERHEAD, per_token_s=PER_TOKEN,
                   prefill_step_s=PREFILL)  # fmt: skip


def target(**kw) -> SimTarget:
    return SimTarget(dict(KW), profile(), **kw)


def test_ttft_is_prefill_plus_transfer_and_decode_steps_hold_no_prefill():
    sim = build_engine(target())
    n = len(sim.encode(PROMPT))
    block_bytes = BS * sim.shape.kv_bytes_per_token
    full = n // BS
    assert n % BS and full >= 2  # a partial last block: the repeat pulls exactly that one
    out = 5
    reqs = [BenchRequest(i, "chat", PROMPT, out, n) for i in range(2)]
    t = target(prefill_replicas=1, decode_replicas=1, kv_transfer_bandwidth=BW)
    res, (pre, dec) = simulate_load(t, reqs, LoadSpec(concurrency=1), seed=0)
    first, second = sorted(res.records, key=lambda r: r.send_time)
    assert first.success and second.success and first.output_tokens == out
    # The first: the whole prompt prefilled, every block pulled.
    prefill = OVERHEAD + PREFILL + PER_TOKEN * n
    assert first.ttft == pytest.approx(prefill + math.ceil(n / BS) * block_bytes / BW, rel=1e-9)
    # Each later token: one decode step of one sequence (no PREFILL: no prompt work).
    assert first.itl == pytest.approx([OVERHEAD + PER_TOKEN] * (out - 1), rel=1e-9)
    # The repeat: the prefill engine's own cache holds the full blocks, and the decode
    # engine's holds the blocks it was sent, so only the partial block travels.
    prefill2 = OVERHEAD + PREFILL + PER_TOKEN * (n - full * BS)
    assert second.ttft == pytest.approx(prefill2 + block_bytes / BW, rel=1e-9)
    assert second.cached_tokens == full * BS
    assert second.itl == pytest.approx([OVERHEAD + PER_TOKEN] * (out - 1), rel=1e-9)
    c = dec.engine.connector.counters
    assert c["transfers"] == 2 and c["blocks"] == math.ceil(n / BS) + 1
    # The decode engine computed no prompt token: one step per token after the first.
    assert dec.runner.steps == 2 * (out - 1)
    assert dec.runner.busy_s == pytest.approx(2 * (out - 1) * (OVERHEAD + PER_TOKEN))
    assert pre.runner.steps == 2


def test_the_import_into_the_decode_pool_lengthens_the_step_it_lands_in():
    copy = 1e-7  # seconds per byte of a pool copy (the profile's export cost)
    sim = build_engine(target())
    n = len(sim.encode(PROMPT))
    nbytes = math.ceil(n / BS) * BS * sim.shape.kv_bytes_per_token
    t = SimTarget(dict(KW), replace(profile(), offload_export_s_per_byte=copy),
                  prefill_replicas=1, decode_replicas=1, kv_transfer_bandwidth=BW)  # fmt: skip
    res, _ = simulate_load(t, [BenchRequest(0, "chat", PROMPT, 3, n)], LoadSpec(concurrency=1))
    (rec,) = res.records
    prefill = OVERHEAD + PREFILL + PER_TOKEN * n
    assert rec.ttft == pytest.approx(prefill + nbytes / BW, rel=1e-9)  # stamped as it lands
    step = OVERHEAD + PER_TOKEN
    assert rec.itl == pytest.approx([step + nbytes * copy, step], rel=1e-9)


@pytest.mark.parametrize("prefault", [False, True])
def test_an_import_into_blocks_never_written_pays_their_first_touch(prefault):
    """A CPU pool's pages are faulted in on first write: the real import into fresh blocks
    pays that inside the step it lands in, unless the pool was faulted in at start."""
    copy, touch = 1e-7, 3e-7  # seconds per byte: the copy, and a first write's page faults
    sim = build_engine(target())
    # a prompt whose decode tokens stay in its last (imported) block: no step writes a
    # block of its own for the first time
    prompts = (" ".join(f"w{i}" for i in range(k)) for k in range(20, 60))
    prompt = next(p for p in prompts if 1 <= len(sim.encode(p)) % BS <= 12)
    n = len(sim.encode(prompt))
    nbytes = math.ceil(n / BS) * BS * sim.shape.kv_bytes_per_token
    prof = replace(profile(), offload_export_s_per_byte=copy, first_touch_s_per_byte=touch)
    t = SimTarget({**KW, "kv_cache_prefault": prefault}, prof, prefill_replicas=1,
                  decode_replicas=1, kv_transfer_bandwidth=BW)  # fmt: skip
    res, _ = simulate_load(t, [BenchRequest(0, "chat", prompt, 3, n)], LoadSpec(concurrency=1))
    (rec,) = res.records
    step = OVERHEAD + PER_TOKEN
    landing = step + nbytes * copy + (0.0 if prefault else nbytes * touch)
    assert rec.itl == pytest.approx([landing, step], rel=1e-9)


def test_the_colocated_replay_through_the_driver_equals_the_plain_one():
    reqs = [BenchRequest(i, "chat", f"{PROMPT} q{i} " + "x " * (3 * i), 3 + i % 4, 0)
            for i in range(8)]  # fmt: skip
    load = LoadSpec(request_rate=20.0)
    plain, _ = simulate_load(target(), reqs, load, seed=3)
    trace = _Trace(reqs, load, None, None, 0.0, 0.5)
    from kvserve.bench.workloads import arrival_times

    sends = arrival_times(len(reqs), load.request_rate, load.burstiness, 3)
    trace.offsets = sends
    driven, _ = run_disaggregated(target(), trace, TraceFeed(reqs, sends, None))

    def key(res):  # noqa: ANN001
        return sorted((r.index, round(r.send_time, 9), round(r.ttft, 9),
                       [round(x, 9) for x in r.itl]) for r in res.records)  # fmt: skip

    assert key(driven) == key(plain)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        (dict(prefill_replicas=1), "decode_replicas: .*--decode-replicas"),
        (dict(decode_replicas=2), "prefill_replicas: .*--prefill-replicas"),
        (dict(prefill_replicas=1, decode_replicas=1), "kv_transfer_bandwidth: give"),
        (dict(prefill_replicas=1, decode_replicas=1, kv_transfer_bandwidth=0.0),
         "kv_transfer_bandwidth: must be"),
        (dict(kv_transfer_bandwidth=1e9), "kv_transfer_bandwidth: .*--prefill-replicas"),
        (dict(prefill_replicas=-1, decode_replicas=1, kv_transfer_bandwidth=1e9),
         "prefill_replicas: must be"),
        (dict(prefill_replicas=1, decode_replicas=1, kv_transfer_bandwidth=1e9, replicas=2),
         "replicas: counts colocated"),
        (dict(prefill_replicas=1, decode_replicas=1, kv_transfer_bandwidth=1e9,
              router="prefix"), "router: "),
    ],
)  # fmt: skip
def test_bad_disaggregation_settings_name_the_field(kw, match):
    with pytest.raises(ValueError, match=match):
        target(**kw)


def test_the_cli_refuses_with_the_flag_named(tmp_path, capsys):
    prof = tmp_path / "p.json"
    profile().save(prof)
    base = ["simulate", "--profile", str(prof), "--num-prompts", "2", "--no-plots",
            "--output-dir", str(tmp_path)]  # fmt: skip
    assert main([*base, "--prefill-replicas", "1", "--decode-replicas", "1"]) == 2
    assert "--kv-transfer-bandwidth" in capsys.readouterr().err
    assert main([*base, "--prefill-replicas", "1", "--decode-replicas", "1",
                 "--kv-transfer-bandwidth", "1e9", "--kv-offload-cpu", "1GiB"]) == 2  # fmt: skip
    assert "kv_offload_cpu: offload tiers are not modelled" in capsys.readouterr().err
    assert main([*base, "--prefill-replicas", "1", "--decode-replicas", "1",
                 "--kv-transfer-bandwidth", "1e9", "--concurrency", "2",
                 "--request-rate", "5"]) == 2  # fmt: skip
    assert "concurrency: an in-flight cap" in capsys.readouterr().err


def test_the_benchmarks_burst_feed_sends_as_its_http_client_does():
    """benchmarks/pd.py's pd-burst on the simulator: streams send their next request when the
    last one ends, until ``seconds``; the first burst at period/2, each next one ``period``
    after the last of its requests ends, none from ``seconds`` - period/2 on."""
    from benchmarks.pd import BurstFeed
    from kvserve.sim.simulate import simulate_feed

    w = {"streams": 2, "short_prompt": 8, "decode_tokens": 6, "burst": 3, "long_prompt": 40,
         "burst_tokens": 2, "period": 0.4, "seconds": 3.0}  # fmt: skip
    t = target(prefill_replicas=1, decode_replicas=1, kv_transfer_bandwidth=100 * BW)
    res, _ = simulate_feed(t, BurstFeed(w, 1000))
    recs = res.records
    assert all(r.success for r in recs)
    bursts = sorted({round(r.send_time, 9) for r in recs if r.kind == "burst"})
    assert bursts[0] == pytest.approx(w["period"] / 2)
    for prev, nxt in zip(bursts, bursts[1:], strict=False):
        ends = [r.send_time + r.e2e for r in recs
                if r.kind == "burst" and round(r.send_time, 9) == prev]  # fmt: skip
        assert len(ends) == w["burst"]
        assert nxt == pytest.approx(max(ends) + w["period"])
    assert len(bursts) >= 2 and bursts[-1] < w["seconds"] - w["period"] / 2
    steady = sorted((r.send_time, r.send_time + r.e2e) for r in recs if r.kind == "steady")
    starts = [s for s, _ in steady]
    ends = [e for _, e in steady]
    assert starts[: w["streams"]] == [0.0] * w["streams"]
    # every later send is some earlier request's end, and none comes after ``seconds``
    for s in starts[w["streams"] :]:
        assert min(abs(s - e) for e in ends) < 1e-9 and s < w["seconds"]
    assert max(ends) >= w["seconds"]


def test_legs_that_all_wait_take_each_request_when_it_is_sent():
    """Requests two seconds apart, each done before the next is sent, over two prefill
    engines: every pick sees both idle and takes the first, so the second never runs a step.
    (Sending the rest of the trace at once the first time every leg was idle spread it over
    both by their stale loads.)"""
    out = 3
    reqs = [BenchRequest(i, "chat", f"{PROMPT} q{i}", out, 42) for i in range(6)]
    t = target(prefill_replicas=2, decode_replicas=1, kv_transfer_bandwidth=BW)
    res, (pre0, pre1, dec) = simulate_load(t, reqs, LoadSpec(0.5), seed=0)
    recs = sorted(res.records, key=lambda r: r.send_time)
    assert all(r.success for r in recs)
    for a, b in itertools.pairwise(recs):  # the premise: each ends before the next is sent
        assert a.send_time + a.ttft + sum(a.itl) < b.send_time
    assert pre0.runner.steps == len(reqs) and pre1.runner.steps == 0
