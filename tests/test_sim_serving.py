"""The simulator's serving-overhead term (kvserve.sim.serving) against hand-computed times: a
cost model whose steps take a fixed overhead, a fixed extra for any prompt work and a time per
token, plus known serving terms, so each request's TTFT and each gap between tokens can be
written down for a lone engine, one behind a hop and a disaggregated pair; the fit recovers
terms put into synthetic gaps by a formula; a profile written before the term loads with it
off and the simulator says so; the flags the calibration serves with parse back to the
engine's settings."""

from __future__ import annotations

import json
import math
import random
from dataclasses import replace
from pathlib import Path

import pytest

from kvserve.bench.runner import LoadSpec
from kvserve.bench.workloads import BenchRequest
from kvserve.cli import main
from kvserve.engine_args import default_model
from kvserve.sim.cost import SERVING_FIELDS, Profile
from kvserve.sim.engine import SimTarget, build_engine
from kvserve.sim.serving import (
    ServingPoint,
    fit_hop,
    fit_per_token,
    fit_serving,
    fit_share,
    serve_flags,
)
from kvserve.sim.simulate import simulate_load

OVERHEAD, PREFILL, PER_TOKEN = 0.01, 0.05, 0.001  # seconds
REQ, STEP, TOKEN = 0.004, 0.002, 0.0005  # the front end's terms
HOP_REQ, HOP_TOKEN = 0.003, 0.0002  # the hop's
BW = 1e6  # bytes/s
BS = 16
KW = dict(model=default_model(), num_gpu_blocks=64, block_size=BS, enable_prefix_caching=True)


def profile(**serving: float) -> Profile:
    # Peaks so high that the roofline terms vanish: a step is overhead + per-token time,
    # plus PREFILL when it computes any prompt token.
    return Profile(device="test", peak_flops=1e30, peak_bandwidth=1e30, source="test",
                   dtype="float32", step_overhead_s=OVERHEAD, per_token_s=PER_TOKEN,
                   prefill_step_s=PREFILL, **serving)  # fmt: skip


SERVING = dict(serve_request_s=REQ, serve_step_s=STEP, serve_token_s=TOKEN,
               hop_request_s=HOP_REQ, hop_token_s=HOP_TOKEN, serving_measured=True)  # fmt: skip


def prompts(n_words: int = 40) -> tuple[list[str], int]:
    """Two prompts of equal token count with no block in common, and that count."""
    sim = build_engine(SimTarget(dict(KW), profile()))
    ps = [" ".join(f"{c}{i}" for i in range(n_words)) for c in "ab"]
    n = {len(sim.encode(p)) for p in ps}
    assert len(n) == 1
    return ps, n.pop()


@pytest.mark.parametrize(("hop", "share"), [(False, 1.0), (True, 1.0), (False, 0.25)])
def test_two_streams_pass_the_front_end_one_at_a_time_and_pay_it_per_step_and_token(hop, share):
    ps, n = prompts()
    out = 5
    reqs = [BenchRequest(i, "chat", p, out, n) for i, p in enumerate(ps)]
    t = SimTarget(dict(KW), profile(**SERVING, serve_request_share=share), behind_hop=hop)
    res, (sim,) = simulate_load(t, reqs, LoadSpec(concurrency=2), seed=0)
    a, b = res.records
    assert a.success and b.success and a.output_tokens == out
    c = REQ + (HOP_REQ if hop else 0.0)
    tok = TOKEN + (HOP_TOKEN if hop else 0.0)
    # The front end takes the two requests one at a time: the first joins the idle engine
    # after c (costing it nothing: nothing ran), its prompt is prefilled alone; the second
    # joins at 2c, while the first is in flight, so the engine loses share x c before the
    # step that prefills it beside the first one's decode.
    p1 = OVERHEAD + PREFILL + PER_TOKEN * n
    p2 = OVERHEAD + PREFILL + PER_TOKEN * (n + 1)
    d2, d1 = OVERHEAD + 2 * PER_TOKEN, OVERHEAD + PER_TOKEN
    assert a.ttft == pytest.approx(c + p1, rel=1e-9)
    assert b.ttft == pytest.approx(c + p1 + STEP + tok + share * c + p2, rel=1e-9)
    # Each gap: the front end streams the step's tokens, then the next step.
    first = STEP + tok + share * c + p2
    assert a.itl == pytest.approx([first] + [STEP + 2 * tok + d2] * (out - 2), rel=1e-9)
    assert b.itl == pytest.approx([STEP + 2 * tok + d2] * (out - 2) + [STEP + 2 * tok + d1],
                                  rel=1e-9)  # fmt: skip
    # The steps themselves are the engine's: the term is not model time.
    assert sim.runner.busy_s == pytest.approx(p1 + p2 + (out - 2) * d2 + d1)


def test_only_a_fresh_engines_first_request_pays_the_first_request_term():
    ps, n = prompts()
    first = 0.2
    reqs = [BenchRequest(i, "chat", p, 2, n) for i, p in enumerate(ps)]
    prof = profile(serve_request_s=REQ, serve_first_request_s=first, serving_measured=True)
    res, _ = simulate_load(SimTarget(dict(KW), prof), reqs, LoadSpec(concurrency=1))
    a, b = sorted(res.records, key=lambda r: r.send_time)
    p1 = OVERHEAD + PREFILL + PER_TOKEN * n
    assert a.ttft == pytest.approx(REQ + first + p1, rel=1e-9)
    assert b.ttft == pytest.approx(REQ + p1, rel=1e-9)


@pytest.mark.parametrize("hop", [False, True])
def test_a_requests_hop_time_grows_with_its_prompt(hop):
    """Behind a hop, a lone request joins the engine after the front end's and the hop's
    per-request terms plus the hop's per-prompt-token term times its prompt; without one,
    after the front end's alone, whatever its length."""
    hop_per = 7e-6
    prof = profile(serve_request_s=REQ, hop_request_s=HOP_REQ, hop_request_token_s=hop_per,
                   serving_measured=True)  # fmt: skip
    for n_words in (20, 60):
        ps, n = prompts(n_words)
        res, _ = simulate_load(SimTarget(dict(KW), prof, behind_hop=hop),
                               [BenchRequest(0, "chat", ps[0], 2, n)],
                               LoadSpec(concurrency=1))  # fmt: skip
        (rec,) = res.records
        front = REQ + ((HOP_REQ + hop_per * n) if hop else 0.0)
        assert rec.ttft == pytest.approx(front + OVERHEAD + PREFILL + PER_TOKEN * n, rel=1e-9)


def test_the_per_token_fit_is_the_slope_between_two_lengths():
    fixed, per = 0.0013, 4.5e-6
    assert fit_per_token((32, fixed + per * 32), (1024, fixed + per * 1024)) == pytest.approx(
        per, rel=1e-9
    )
    # a long prompt no dearer than a short one: no per-token cost
    assert fit_per_token((32, 0.002), (1024, 0.0015)) == 0.0
    with pytest.raises(ValueError, match="larger"):
        fit_per_token((64, 0.001), (64, 0.002))


def test_a_profile_without_the_term_replays_as_before():
    ps, n = prompts()
    reqs = [BenchRequest(i, "chat", p, 4, n) for i, p in enumerate(ps)]
    res, _ = simulate_load(SimTarget(dict(KW), profile()), reqs, LoadSpec(concurrency=2))
    for r in res.records:
        assert r.ttft == pytest.approx(OVERHEAD + PREFILL + PER_TOKEN * 2 * n, rel=1e-9)
        assert r.itl == pytest.approx([OVERHEAD + 2 * PER_TOKEN] * 3, rel=1e-9)


def test_routed_replicas_are_behind_the_hop_by_default():
    assert SimTarget(dict(KW), profile()).hop is False
    assert SimTarget(dict(KW), profile(), replicas=2, router="least_load").hop is True
    assert SimTarget(dict(KW), profile(), prefill_replicas=1, decode_replicas=1,
                     kv_transfer_bandwidth=BW).hop is True  # fmt: skip
    assert SimTarget(dict(KW), profile(), replicas=2, behind_hop=False).hop is False


def test_a_disaggregated_request_pays_each_engines_front_end_and_the_proxy_hop():
    """Behind kvserve proxy: the request reaches the prefill engine through the hop and its
    front end, its step samples the first token; the decode leg passes them in turn before
    the decode engine asks for the blocks, so the pull starts that much later (neither engine
    was busy: neither lost time to them); each decode step's token is streamed by the decode
    engine's front end and relayed by the hop."""
    ps, n = prompts()
    out = 4
    sim = build_engine(SimTarget(dict(KW), profile()))
    block_bytes = BS * sim.shape.kv_bytes_per_token
    t = SimTarget(dict(KW), profile(**SERVING), prefill_replicas=1, decode_replicas=1,
                  kv_transfer_bandwidth=BW)  # fmt: skip
    res, (pre, dec) = simulate_load(t, [BenchRequest(0, "chat", ps[0], out, n)],
                                    LoadSpec(concurrency=1))  # fmt: skip
    (rec,) = res.records
    assert rec.success and rec.output_tokens == out
    req = REQ + HOP_REQ
    prefill = OVERHEAD + PREFILL + PER_TOKEN * n
    pull = math.ceil(n / BS) * block_bytes / BW
    assert rec.ttft == pytest.approx(req + prefill + req + pull, rel=1e-9)
    # The landed token is the prefill's (the decode engine's runner sampled nothing for
    # it); each later one: the front end's turn after the step before, then a decode step.
    decode = OVERHEAD + PER_TOKEN
    first = decode  # the step after the landing: no token streamed by the decode side yet
    later = STEP + TOKEN + HOP_TOKEN + decode
    assert rec.itl == pytest.approx([first] + [later] * (out - 2), rel=1e-9)


def test_the_fit_recovers_the_terms_put_into_synthetic_gaps():
    rng = random.Random(5)
    step, token = 0.0021, 0.00037
    points = []
    for b in (1, 2, 4, 8, 16):
        engine = 0.001 + 0.0003 * b + rng.uniform(0, 0.002)  # any engine-only gap
        points.append(ServingPoint(b, engine + step + token * b, engine))
    got = fit_serving(points)
    assert got == pytest.approx((step, token), rel=1e-9)
    hop = 0.00011
    direct = [ServingPoint(p.streams, p.measured_s + hop * p.streams, p.measured_s)
              for p in points]  # fmt: skip
    assert fit_hop(direct) == pytest.approx(hop, rel=1e-9)


def test_the_fit_keeps_the_terms_non_negative():
    # gaps that shrink with the stream count: no per-token cost, the mean excess per step
    pts = [ServingPoint(b, 0.01 + 0.004 - 0.0001 * b, 0.01) for b in (1, 2, 4)]
    step, token = fit_serving(pts)
    assert token == 0.0 and step == pytest.approx(0.004 - 0.0001 * 7 / 3, rel=1e-9)
    # a line through a negative intercept: a slope through 0 instead (least squares)
    pts = [ServingPoint(b, 0.01 + 0.001 * b - 0.0005, 0.01) for b in (1, 2, 4)]
    step, token = fit_serving(pts)
    ys, bs = [0.0005, 0.0015, 0.0035], [1, 2, 4]
    assert step == 0.0
    assert token == pytest.approx(sum(b * y for b, y in zip(bs, ys, strict=True)) / 21)
    assert fit_hop([ServingPoint(2, 0.001, 0.002)]) == 0.0


def test_the_share_is_the_grid_value_whose_replay_meets_the_measured_gap():
    # a replay whose gap grows with the share by a known line: the nearest grid value
    def replay(s: float) -> float:
        return 0.002 + 0.004 * s

    assert fit_share(0.002 + 0.004 * 0.37, replay) == pytest.approx(0.35)
    assert fit_share(0.0, replay) == 0.0 and fit_share(1.0, replay) == 1.0


def test_the_share_replay_is_of_a_warm_server():
    """The share's measured run follows others on the same server: its replay pays no
    first-request term, whatever the profile's."""
    from kvserve.sim.serving import share_gap

    vocab = json.loads((Path(default_model()) / "config.json").read_text())["vocab_size"]
    warm = profile(serve_request_s=REQ, serve_token_s=TOKEN)
    cold = replace(warm, serve_first_request_s=0.5)
    assert share_gap(KW, cold, vocab, 0.5) == share_gap(KW, warm, vocab, 0.5)


def test_a_profile_written_before_the_term_loads_with_it_off_and_says_so(tmp_path):
    data = profile().to_json()
    for name in (*SERVING_FIELDS, "serve_request_share", "serving_measured"):
        del data[name]
    data["calibration"] = {"model": "m", "steps": 10}
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    p = Profile.load(path)
    assert all(getattr(p, f) == 0.0 for f in SERVING_FIELDS) and not p.serving_measured
    notes = build_engine(SimTarget(dict(KW), p)).notes
    assert any("no serving-overhead term" in n for n in notes)
    measured = replace(p, **SERVING)
    assert not any("serving" in n for n in build_engine(SimTarget(dict(KW), measured)).notes)


def test_a_negative_term_is_refused_naming_it(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({**profile().to_json(), "serve_token_s": -1.0}))
    with pytest.raises(ValueError, match="serve_token_s must be >= 0"):
        Profile.load(path)


def test_the_flags_it_serves_with_parse_back_to_the_engines_settings():
    import argparse

    from kvserve.engine_args import add_engine_args, add_model_arg, engine_kwargs

    def parse(argv: list[str]) -> dict:
        p = argparse.ArgumentParser()
        add_model_arg(p)
        add_engine_args(p)
        return engine_kwargs(p.parse_args(argv))

    kw = parse([default_model(), "--dtype", "bfloat16", "--block-size", "32",
                "--enable-prefix-caching", "--max-model-len", "512",
                "--kv-transfer-config", '{"kv_connector": "X", "kv_role": "kv_both"}'])  # fmt: skip
    flags = serve_flags(kw)
    assert flags[0] == kw["model"]
    assert parse(flags) == kw


def test_serving_without_calibrate_is_refused(tmp_path, capsys):
    prof = tmp_path / "p.json"
    profile().save(prof)
    assert main(["simulate", "--profile", str(prof), "--serving", "--num-prompts", "2",
                 "--no-plots", "--output-dir", str(tmp_path)]) == 2  # fmt: skip
    assert "serving: " in capsys.readouterr().err


def _short_calibration(monkeypatch, grid: list[float]) -> None:  # noqa: ANN001
    """Fewer and shorter streams than a calibration's, and a coarse share grid."""
    import kvserve.sim.serving as serving

    short = dict(STREAMS=(1, 2), DECODE_TOKENS=6, ROUNDS=1, SOLO=2, SHARE_TOKENS=8,
                 SHARE_INJECT=2, SHARE_GRID=grid)  # fmt: skip
    for name, value in short.items():
        monkeypatch.setattr(serving, name, value)


def test_the_measurement_serves_the_engines_flags_and_fills_the_profile(checkpoint, monkeypatch):
    """A real kvserve serve of a tiny model and kvserve router in front of it (fewer and
    shorter streams than a calibration): every figure measured, the terms set, no process
    left behind (the conftest fixture checks)."""
    import kvserve.sim.serving as serving

    _short_calibration(monkeypatch, [0.0, 0.5, 1.0])
    kw = dict(model=checkpoint("llama_gqa"), dtype="float32", num_gpu_blocks=64,
              max_model_len=128, block_size=BS)  # fmt: skip
    prof = profile()
    rep = serving.measure_serving(kw, prof, vocab=256)
    assert prof.serving_measured and prof.calibration["serving"] is rep
    for key in ("gap_s", "engine_gap_s", "hop_gap_s"):
        assert len(rep[key]) == 2 and all(0 < g < 5 for g in rep[key])
    assert 0 < rep["ttft_s"] < 5 and 0 < rep["hop_ttft_s"] < 5 and 0 < rep["share_run_gap_s"] < 5
    assert prof.serve_request_share in (0.0, 0.5, 1.0)
    # the replay is the profile's: a lone request's TTFT is one prefill step
    assert rep["engine_ttft_s"] == pytest.approx(OVERHEAD + PREFILL + PER_TOKEN * 32)
    assert all(getattr(prof, f) >= 0 for f in SERVING_FIELDS)
    assert prof.serve_request_s == pytest.approx(max(rep["ttft_s"] - rep["engine_ttft_s"], 0))
    assert prof.serve_first_request_s == pytest.approx(max(rep["first_ttft_s"] - rep["ttft_s"], 0))


def test_the_routers_cpu_per_request_of_two_prompt_lengths_gives_the_hop_terms(monkeypatch):
    """The bundled model (it has a tokenizer): lone text requests of two lengths through a
    router that tokenizes them; the hop's per-prompt-token term is the slope of its CPU
    seconds per request between the two lengths (its per-request term stays the TTFT's
    excess), and the text prompts are as long as asked."""
    import kvserve.sim.serving as serving
    from kvserve.model.tokenizer import Tokenizer

    _short_calibration(monkeypatch, [0.0, 1.0])
    monkeypatch.setattr(serving, "LONG_PROMPT_TOKENS", 256)
    monkeypatch.setattr(serving, "TEXT_REQUESTS", 4)
    model = default_model()
    tok = Tokenizer(model)
    kw = dict(model=model, dtype="float32", num_gpu_blocks=64, block_size=BS, max_model_len=512)
    prof = profile()
    rep = serving.measure_serving(kw, prof, vocab=tok.vocab_size, tokenizer=tok,
                                  tokenizer_dir=model, max_model_len=512)  # fmt: skip
    n_s, n_l = rep["text_prompt_tokens"]
    assert serving.PROMPT_TOKENS <= n_s < serving.PROMPT_TOKENS + 8
    assert 256 <= n_l < 256 + 8
    cpu = rep["router_cpu_s_per_request"]
    assert len(cpu) == 2 and all(0 < c < 1 for c in cpu)
    assert prof.hop_request_token_s == pytest.approx(max((cpu[1] - cpu[0]) / (n_l - n_s), 0))
    assert prof.hop_request_s == pytest.approx(max(rep["hop_ttft_s"] - rep["ttft_s"], 0))
    # per token relayed: the router's CPU per streamed token, unless the gaps show more
    one, many = rep["router_relay_cpu_s"]
    assert 0 < one < 1 and 0 < many < 1
    by_cpu = max((many - one) / (serving.DECODE_TOKENS - 1), 0.0)
    gaps = zip((1, 2), rep["hop_gap_s"], rep["gap_s"], strict=True)
    by_gaps = serving.fit_hop([serving.ServingPoint(b, h, g) for b, h, g in gaps])
    assert prof.hop_token_s == pytest.approx(max(by_cpu, by_gaps))


def test_cpu_seconds_reads_a_busy_process(tmp_path):
    """Against the process's own clock: a second of spinning here reads as about a second."""
    import os
    import time

    from kvserve.sim.serving import cpu_seconds

    before, own = cpu_seconds(os.getpid()), time.process_time()
    end = time.perf_counter() + 0.3
    while time.perf_counter() < end:
        pass
    spent, own = cpu_seconds(os.getpid()) - before, time.process_time() - own
    assert spent == pytest.approx(own, rel=0.2, abs=0.02)
