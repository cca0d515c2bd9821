"""``kvserve bench --structured SPEC``: the SPEC forms, and a run whose every request is
constrained (its outputs are the choice's strings, against the same run unconstrained)."""

from __future__ import annotations

import argparse
import json

import pytest

from kvserve.bench.structured_spec import parse_structured
from kvserve.cli import main


def test_spec_forms(tmp_path):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    f = tmp_path / "s.json"
    f.write_text(json.dumps(schema))
    g = tmp_path / "g.lark"
    g.write_text('start: "x"')
    assert parse_structured("json_object") == {"json_object": True}
    assert parse_structured(f"json:{f}") == {"json": schema}
    assert parse_structured('json:{"type": "string"}') == {"json": {"type": "string"}}
    assert parse_structured("regex:[a-z]{3}") == {"regex": "[a-z]{3}"}
    assert parse_structured("choice:yes|no|maybe") == {"choice": ["yes", "no", "maybe"]}
    assert parse_structured(f"grammar:{g}") == {"grammar": 'start: "x"'}


@pytest.mark.parametrize("spec", ["yaml:x", "regex", "json:{not json", "json:/no/such/file"])
def test_bad_spec_is_an_argument_error(spec):
    with pytest.raises(argparse.ArgumentTypeError):
        parse_structured(spec)


def test_bench_in_process_with_a_constraint(checkpoint, tmp_path, capsys):
    common = ["bench", "--model", checkpoint("llama_gqa"), "--workload", "chat",
              "--num-prompts", "4", "--length-scale", "0.1", "--max-model-len", "512",
              "--output-dir", str(tmp_path), "--warmup", "0", "--no-progress", "--no-plots",
              "--json"]  # fmt: skip
    assert main([*common, "--label", "free"]) == 0
    capsys.readouterr()
    assert main([*common, "--label", "yn", "--structured", "choice:yes|no"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["completed"] == 4 and summary["structured"] == "choice"
    yn = json.loads((tmp_path / "yn.json").read_text())["records"]
    free = json.loads((tmp_path / "free.json").read_text())["records"]
    assert all(r["output_text"] in ("yes", "no") and r["finish_reason"] == "stop" for r in yn)
    assert not any(r["output_text"] in ("yes", "no") for r in free)
