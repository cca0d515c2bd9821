"""benchmarks/gpu_engine.py on a CPU: its arguments, and a tiny smoke run of the engine part
(the GPU figures and the transformers comparison come from a run on a GPU)."""

from __future__ import annotations

import pytest

from benchmarks import gpu_engine


def test_defaults_are_the_issues_settings_and_bad_arguments_are_refused(capsys):
    a = gpu_engine.parse_args([])
    assert (a.device, a.shape, a.batch, a.prompt, a.output) == ("cuda", "1b", 64, 512, 256)
    assert a.kv == ["auto", "fp8"] and a.modes == ["eager", "graphs"]
    assert a.dtype == "bfloat16" and a.gpu_memory_utilization == 0.9
    # Llama-3.2-1B's shape, from its config.json
    s = gpu_engine.SHAPES["1b"]
    assert (s["hidden_size"], s["num_layers"], s["num_heads"], s["num_kv_heads"]) == (
        2048, 16, 32, 8)  # fmt: skip
    for argv, msg in (
        (["--device", "cpu"], "--modes graphs: CUDA graphs run only with --device cuda"),
        (["--batch", "0"], "--batch: must be >= 1"),
        (["--modes", "fast"], "--modes: each one of eager, graphs"),
        (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization: must be in (0, 1]"),
    ):
        with pytest.raises(SystemExit):
            gpu_engine.parse_args(argv)
        assert msg in capsys.readouterr().err


def test_a_tiny_smoke_run_on_a_cpu(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(gpu_engine, "MODEL_CACHE", tmp_path)
    out = gpu_engine.main(["--device", "cpu", "--shape", "tiny", "--batch", "2", "--prompt",
                           "16", "--output", "4", "--modes", "eager", "--kv", "auto",
                           "--no-hf", "--bandwidth-mib", "8"])  # fmt: skip
    (run,) = out["runs"]
    assert run["kv"] == "float32" and run["mode"] == "eager" and run["num_blocks"] > 0
    assert run["output_tok_s"] > 0 and run["decode_step_ms"] > 0 and run["roofline_ms"] > 0
    assert "transformers_tok_s" not in out  # --no-hf: transformers' import alone takes ~10 s
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith('{"batch": 2')
