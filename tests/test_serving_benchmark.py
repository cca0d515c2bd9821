"""benchmarks/serving.py refuses bad arguments before it starts any server."""

from __future__ import annotations

import pytest

from benchmarks.serving import main


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--rates", "2,fast"], "--rates: comma list of request rates (req/s), got '2,fast'"),
        (["--rates", "2,0"], "--rates: every rate must be > 0 req/s, got '2,0'"),
        (["--rates", "nan"], "--rates: every rate must be > 0 req/s"),
        (["--rounds", "0"], "--rounds: must be >= 1, got 0"),
        (["--vllm-python", "/nonexistent/bin/python"], "--vllm-python: no `vllm` command"),
    ],
)
def test_bad_arguments_name_the_flag(capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err
