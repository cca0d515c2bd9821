"""The engine's start-up block and the compute dtype it reports.

The block's figures (GiB and bytes of the pool, blocks x block size = tokens, sequences of
max_model_len that fit) must equal what the test computes itself from the checkpoint's
config.json: K and V, per layer, per KV head, head_dim elements of the format's width per token.
``--dtype auto`` for a GGUF model is checked against CPU flag lines as ``/proc/cpuinfo`` prints
them on real CPUs, and on this machine against its own ``/proc/cpuinfo``."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import re
from pathlib import Path

import pytest
import torch

from kvserve.config import ConfigError, ModelConfig
from kvserve.model.dtype import choose_dtype, fast_cpu_dtype

LOG = "kvserve.engine"
# The "flags" lines of /proc/cpuinfo on real CPUs (cut to the vector and matrix extensions;
# the order is the kernel's).
CPUINFO = {
    "Sapphire Rapids (AMX)": "flags : fpu sse2 avx avx2 fma avx512f avx512dq avx512cd avx512bw "
    "avx512vl avx512_vnni avx512_bf16 avx512_fp16 amx_bf16 amx_tile amx_int8",
    "Cooper Lake (AVX512-BF16)": "flags : fpu sse2 avx avx2 fma avx512f avx512dq avx512cd "
    "avx512bw avx512vl avx512_vnni avx512_bf16",
    "Zen 4 (AVX512-BF16)": "flags : fpu sse2 avx avx2 fma avx512f avx512dq avx512cd avx512bw "
    "avx512vl avx512_bf16 avx512vbmi avx512_vnni",
    "Ice Lake (AVX-512, no bf16)": "flags : fpu sse2 avx avx2 fma avx512f avx512dq avx512cd "
    "avx512bw avx512vl avx512_vnni avx512_vbmi2",
    "Zen 3 (AVX2)": "flags : fpu sse2 avx avx2 fma",
}
BF16_CPUS = {"Sapphire Rapids (AMX)", "Cooper Lake (AVX512-BF16)", "Zen 4 (AVX512-BF16)"}


def flags_of(line: str) -> list[str]:
    return line.split(":", 1)[1].split()


def this_cpu_has_bf16_matmul() -> bool:
    with open("/proc/cpuinfo") as f:
        flags = next(flags_of(line) for line in f if line.startswith("flags"))
    return "avx512_bf16" in flags or "amx_bf16" in flags


@pytest.mark.parametrize("cpu", sorted(CPUINFO))
def test_fast_cpu_dtype_from_cpuinfo_flags(cpu):
    choice = fast_cpu_dtype(flags_of(CPUINFO[cpu]))
    assert choice.dtype == (torch.bfloat16 if cpu in BF16_CPUS else torch.float32)
    if cpu.startswith("Sapphire"):
        assert "AVX512-BF16 and AMX" in choice.reason
    elif cpu in BF16_CPUS:
        assert "AVX512-BF16" in choice.reason and "AMX" not in choice.reason
    else:
        assert "neither AVX512-BF16 nor AMX" in choice.reason


def test_auto_follows_the_checkpoint_unless_gguf(checkpoint, monkeypatch):
    fp32_cfg = ModelConfig.from_pretrained(checkpoint("llama_gqa"))
    bf16_cfg = dataclasses.replace(fp32_cfg, torch_dtype="bfloat16")
    amx, plain = flags_of(CPUINFO["Sapphire Rapids (AMX)"]), flags_of(CPUINFO["Zen 3 (AVX2)"])
    # safetensors: the checkpoint's torch_dtype whatever the CPU, as vLLM and transformers.
    assert choose_dtype("auto", bf16_cfg, "cpu", False, plain).dtype == torch.bfloat16
    assert choose_dtype("auto", fp32_cfg, "cpu", False, amx).dtype == torch.float32
    # GGUF (dequantized to float32 on disk): the CPU's fast dtype.
    got = choose_dtype("auto", fp32_cfg, "cpu", True, amx)
    assert got.dtype == torch.bfloat16 and got.reason.startswith("auto: a GGUF model")
    assert choose_dtype("auto", fp32_cfg, "cpu", True, plain).dtype == torch.float32
    # An explicit dtype is taken as it is, and says so.
    assert choose_dtype("float32", fp32_cfg, "cpu", True, amx) == (torch.float32, "--dtype")
    # A GPU: bf16 where it has it, else float16.
    for has_bf16, want in ((True, torch.bfloat16), (False, torch.float16)):
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda v=has_bf16: v)
        assert choose_dtype("auto", fp32_cfg, "cuda", True, plain).dtype == want
    with pytest.raises(ConfigError, match="dtype: must be one of auto, float32"):
        choose_dtype("fp64", fp32_cfg)


def block_of(caplog) -> str:
    (rec,) = [r for r in caplog.records if r.name == LOG and "KV pool:" in r.getMessage()]
    return rec.getMessage()


def parse(block: str) -> dict[str, object]:
    pool = re.search(r"KV pool:\s+([\d.]+) GiB \(([\d,]+) bytes\) = ([\d,]+) blocks x (\d+) "
                     r"tokens = ([\d,]+) tokens at ([\d,.]+) bytes per token", block)  # fmt: skip
    fits = re.search(r"fits:\s+([\d,]+) sequences of max_model_len ([\d,]+) \(([\d,]+) "
                     r"blocks each", block)  # fmt: skip
    kv = re.search(r"KV dtype: (\S+) \((.+)\)", block)
    compute = re.search(r"compute:\s+(\S+) \((.+?)\) on ([^\s,]+)", block)
    assert pool and fits and kv and compute, block

    def n(s: str) -> float:
        return float(s.replace(",", ""))

    return dict(gib=n(pool[1]), bytes=n(pool[2]), blocks=n(pool[3]), block_size=n(pool[4]),
                tokens=n(pool[5]), bytes_per_token=n(pool[6]), seqs=n(fits[1]),
                max_model_len=n(fits[2]), blocks_each=n(fits[3]), kv_dtype=kv[1],
                kv_reason=kv[2], dtype=compute[1], dtype_reason=compute[2],
                device=compute[3])  # fmt: skip


def kv_bytes_per_token(model_dir: str, element_bytes: int) -> int:
    """K and V of one token: per layer, per KV head, head_dim elements."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * element_bytes


@pytest.mark.parametrize(
    "kwargs, element_bytes, kv_dtype, kv_reason",
    [
        (dict(dtype="float32", num_gpu_blocks=300), 4, "float32", "auto: the compute dtype"),
        (dict(dtype="bfloat16", num_gpu_blocks=77, block_size=32), 2, "bfloat16",
         "auto: the compute dtype"),
        (dict(dtype="float32", num_gpu_blocks=50, kv_cache_dtype="fp8"), 1, "fp8_e4m3",
         "--kv-cache-dtype"),
    ],
)  # fmt: skip
def test_startup_block_equals_the_kv_formula(checkpoint, make_llm, caplog, kwargs,
                                             element_bytes, kv_dtype, kv_reason):  # fmt: skip
    ckpt = checkpoint("llama_gqa")
    caplog.set_level(logging.INFO, logger=LOG)
    make_llm(ckpt, max_model_len=200, max_num_seqs=4, **kwargs)
    got = parse(block_of(caplog))
    blocks, bs = kwargs["num_gpu_blocks"], kwargs.get("block_size", 16)
    bpt = kv_bytes_per_token(ckpt, element_bytes)
    assert got["bytes_per_token"] == bpt
    assert (got["blocks"], got["block_size"], got["tokens"]) == (blocks, bs, blocks * bs)
    assert got["bytes"] == blocks * bs * bpt
    assert got["gib"] == pytest.approx(blocks * bs * bpt / 2**30, abs=0.005)
    assert got["blocks_each"] == math.ceil(200 / bs)
    assert got["seqs"] == blocks // math.ceil(200 / bs) and got["max_model_len"] == 200
    assert (got["kv_dtype"], got["kv_reason"]) == (kv_dtype, kv_reason)
    assert (got["dtype"], got["dtype_reason"], got["device"]) == (kwargs["dtype"], "--dtype",
                                                                  "cpu")  # fmt: skip


def test_startup_block_of_a_memory_budget(checkpoint, make_llm, caplog):
    """--kv-cache-memory: whole blocks after the null block, in GiB as the budget was given."""
    ckpt = checkpoint("llama_mha")
    caplog.set_level(logging.INFO, logger=LOG)
    make_llm(ckpt, kv_cache_memory="1GiB", max_model_len=2048)  # dtype auto: float32
    got = parse(block_of(caplog))
    block_bytes = 16 * kv_bytes_per_token(ckpt, 4)
    blocks = 2**30 // block_bytes - 1  # the null block is the format's fixed bytes
    assert got["blocks"] == blocks and got["bytes"] == blocks * block_bytes
    assert got["gib"] == pytest.approx(blocks * block_bytes / 2**30, abs=0.005)
    assert got["seqs"] == blocks // (2048 // 16)
    assert got["dtype_reason"] == "auto: the checkpoint's torch_dtype"


def test_gguf_auto_dtype_is_this_cpus_fast_one_and_says_why(tmp_path, monkeypatch, make_llm,
                                                            caplog):  # fmt: skip
    from tests.test_gguf import write_tiny_gguf

    monkeypatch.setenv("KVSERVE_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, "Q8_0")
    caplog.set_level(logging.INFO, logger=LOG)
    llm = make_llm(str(path), num_gpu_blocks=32)
    got = parse(block_of(caplog))
    want = torch.bfloat16 if this_cpu_has_bf16_matmul() else torch.float32
    assert llm.engine.dtype == want
    assert got["dtype"] == str(want).removeprefix("torch.")
    assert got["dtype_reason"].startswith("auto: a GGUF model, and this CPU has ")
    assert got["kv_dtype"] == got["dtype"]  # auto KV follows the compute dtype
