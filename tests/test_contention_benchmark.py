"""benchmarks/contention.py refuses bad arguments before it starts any engine."""

from __future__ import annotations

import pytest

from benchmarks.contention import main


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--rounds", "0"], "--rounds: must be >= 1, got 0"),
        (["--prompts", "0"], "--prompts: must be >= 1, got 0"),
        (["--max-tokens", "-1"], "--max-tokens: must be >= 1, got -1"),
        (["--input-len", "0"], "--input-len: must be >= 1, got 0"),
        (["--vllm-python", "/nonexistent/bin/python"], "--vllm-python: no such interpreter"),
        (["--dtype", "int4"], "--dtype: invalid choice: 'int4'"),
    ],
)
def test_bad_arguments_name_the_flag(capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err
