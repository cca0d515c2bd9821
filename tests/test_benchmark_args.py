"""The throughput and tier benchmarks refuse bad device and tier arguments before they build
any model or start any server, naming the flag."""

from __future__ import annotations

import pytest

from benchmarks import kv_tiers, routing, throughput, tp


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--device", "tpu0"], "--device: "),
        (["--device", "cuda", "--vllm-python", "/x/python"],
         "--vllm-python: vLLM's CPU build is the peer on --device cpu only"),
        (["--rounds", "0"], "--rounds: must be >= 1, got 0"),
    ],
)  # fmt: skip
def test_throughput_names_the_bad_flag(capsys, argv, message):
    assert_refused(capsys, throughput.main, argv, message)


def assert_refused(capsys, main, argv, message):  # noqa: ANN001
    """``main(argv)`` exits with argparse's status 2, ``message`` on stderr."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--repeats", "--rounds", "--max-tokens"])
def test_tp_names_the_bad_flag(capsys, flag):
    """benchmarks/tp.py refuses a count below 1 before it builds a model, naming the flag."""
    with pytest.raises(SystemExit) as e:
        tp.main([flag, "0"])
    assert e.value.code == 2
    assert f"{flag}: must be >= 1, got 0" in capsys.readouterr().err


def test_throughput_refuses_cuda_where_torch_sees_none(capsys, monkeypatch):
    monkeypatch.setattr(throughput.torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as e:
        throughput.main(["--device", "cuda"])
    assert e.value.code == 2
    assert "--device: cuda asked for, but this torch sees no CUDA device" in (
        capsys.readouterr().err
    )


def test_kv_tiers_names_an_unknown_tier(capsys):
    with pytest.raises(SystemExit) as e:
        kv_tiers.main(["ttft", "--tiers", "cpu,tape"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--tiers: unknown tape; choose from device, cpu, disk, redis" in err


def test_gpu_check_parses_its_arguments_and_its_shell_script_is_valid(capsys):
    """benchmarks/gpu_check.sh runs only where a GPU is: here its bash parses and the Python
    part reads its arguments, refuses bad ones naming them, and prints its plan."""
    import json
    import shutil
    import subprocess
    from pathlib import Path

    from benchmarks import gpu_check

    script = Path(gpu_check.__file__).with_suffix(".sh")
    bash = shutil.which("bash")
    assert bash is not None
    assert subprocess.run([bash, "-n", str(script)], timeout=30).returncode == 0
    assert gpu_check.main(["--dry-run", "--contexts", "1024", "4096", "--formats", "kivi4"]) == 0
    plan = json.loads(capsys.readouterr().out)["plan"]
    assert plan["contexts"] == [1024, 4096] and plan["formats"] == ["kivi4"]
    assert plan["batch"] == 64
    with pytest.raises(SystemExit) as e:
        gpu_check.main(["--batch", "0"])
    assert e.value.code == 2
    assert "--batch, --contexts, --iters" in capsys.readouterr().err


@pytest.mark.parametrize("period", ["0", "-1"])
def test_pd_refuses_a_burst_period_that_is_not_positive(capsys, period):
    from benchmarks import pd

    with pytest.raises(SystemExit) as e:
        pd.main(["--period", period])
    assert e.value.code == 2
    assert f"--period: must be > 0 seconds, got {float(period)}" in capsys.readouterr().err


def test_routing_refuses_a_negative_warmup(capsys):
    with pytest.raises(SystemExit) as e:
        routing.main(["--warmup", "-1"])
    assert e.value.code == 2
    assert "--warmup: must be >= 0, got -1" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--replica-nice", "--client-nice"])
@pytest.mark.parametrize("value", ["-1", "20"])
def test_routing_refuses_a_niceness_it_cannot_set(capsys, flag, value):
    with pytest.raises(SystemExit) as e:
        routing.main([flag, value])
    assert e.value.code == 2
    assert f"{flag}: must be in [0, 19] (a niceness this process may set), got {value}" in (
        capsys.readouterr().err
    )


def test_routing_refuses_a_negative_guard(capsys):
    with pytest.raises(SystemExit) as e:
        routing.main(["--balance-abs-threshold", "-1"])
    assert e.value.code == 2
    assert "--balance-abs-threshold: must be >= 0, got -1" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--customer-skew", "-0.5"], "--customer-skew: must be >= 0, got -0.5"),
        (["--overlap-weight", "0"], "--overlap-weight: must be > 0, got 0.0"),
    ],
)  # fmt: skip
def test_routing_names_the_bad_flag(capsys, argv, message):
    assert_refused(capsys, routing.main, argv, message)


def test_routing_skew_shares_requests_as_zipf():
    """Equal shares with no skew; with skew 1 the first customer's share is 1 / H(n) of the
    requests (the harmonic number), each later one's in proportion to 1 / rank, all
    customers * users of them, each customer asked at least once."""
    assert routing.customer_requests(4, 8, 0.0) == [8, 8, 8, 8]
    n = routing.customer_requests(12, 64, 1.0)
    assert sum(n) == 768 and min(n) >= 1
    harmonic = sum(1 / r for r in range(1, 13))
    assert abs(n[0] - 768 / harmonic) <= 1
    assert all(abs(n[c] - 768 / harmonic / (c + 1)) <= 1 for c in range(12))
    assert routing.customer_requests(3, 1, 4.0) == [1, 1, 1]


def test_routing_warmup_shares_no_block_with_the_trace():
    """A warm-up prompt whose first block differs from every trace prompt's (and from the
    other warm-ups') can match none of their blocks: each block's hash chains its parent."""
    from pathlib import Path

    from kvserve.engine_args import default_model
    from kvserve.model.tokenizer import Tokenizer

    tok = Tokenizer(Path(default_model()), ())
    trace_ids = [tok.encode(p) for _, p in routing.make_trace(tok, 3, 64, 2, 8, 0)]
    warm = [tok.encode(p) for p in routing.warmup_prompts(tok, 2, 72, 0)]
    assert all(len(w) >= 72 for w in warm)
    firsts = [tuple(ids[:16]) for ids in trace_ids]
    assert len(set(firsts)) == 3  # the trace itself shares its contexts' blocks
    for w in warm:
        assert tuple(w[:16]) not in firsts
    assert len({tuple(w[:16]) for w in warm}) == 2


def test_routing_percentiles_of_real_runs_interpolate_as_the_simulators_do():
    """The real run's TTFT p90 and the simulated one are compared: both interpolate between
    ranks as numpy's default does, (n - 1) q."""
    from benchmarks.routing_stats import pct

    assert pct([4.0, 1.0, 3.0, 2.0], 0.9) == pytest.approx(3.7)  # rank 2.7: 3 + 0.7 (4 - 3)
    assert pct([5.0], 0.99) == 5.0
    assert pct([], 0.5) is None
