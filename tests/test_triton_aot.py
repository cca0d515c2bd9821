"""Every Triton kernel variant the backend launches compiles for sm_90 and sm_80 on this
machine, with no GPU and no driver (Triton's ``GPUTarget``; ``ptxas`` from its wheel), within
the shared memory one block may have there (227 KiB on sm_90, 163 KiB on sm_80: the per-SM
228 / 164 KiB less the 1 KiB the driver keeps).

The compiler runs in a child process without ``TRITON_INTERPRET`` (under the interpreter
``triton.jit`` yields nothing compilable), two compilations at a time."""

from __future__ import annotations

import json
import os
import subprocess
import sys

FORMATS = {"dense", "fp8_e4m3", "fp8_e5m2", "int8", "kivi4", "kivi2"}


def test_every_variant_compiles_for_sm90_and_sm80_within_shared_memory():
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "kvserve.kernels.triton_aot", "--arch", "90", "80",
         "--workers", "2"],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    failed = [r for r in records if not r["ok"]]
    assert not failed, json.dumps(failed, indent=1)[:4000]
    assert proc.returncode == 0, proc.stderr[-2000:]
    limit = {"sm_90": 227 * 1024, "sm_80": 163 * 1024}
    assert all(0 <= r["shared"] <= limit[r["arch"]] and r["cubin_bytes"] > 0 for r in records)
    attention = {r["variant"] for r in records if r["kernel"] == "paged_attention_kernel"}
    assert {v.split("-")[1] for v in attention} == FORMATS
    assert {"float32", "bfloat16", "float16"} <= {v.split("-")[2] for v in attention}
    kernels = {(r["kernel"], r["arch"]) for r in records}
    assert kernels == {(k, a) for k in ("paged_attention_kernel", "merge_splits_kernel",
                                        "kv_write_kernel", "kivi_quantize_kernel")
                       for a in limit}  # fmt: skip
    per_arch = {a: sorted((r["variant"], r["kernel"]) for r in records if r["arch"] == a)
                for a in limit}  # fmt: skip
    assert per_arch["sm_90"] == per_arch["sm_80"]
