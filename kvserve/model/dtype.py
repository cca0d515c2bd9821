"""The compute dtype ``--dtype`` asks for and, for ``auto``, which one and why: the reason is
printed in the start-up log, so a figure always says what it ran in.

``auto`` follows a safetensors checkpoint's ``torch_dtype``, as vLLM and transformers do. A GGUF
file has no such dtype (its weights are quantized and kvserve dequantizes them to float32), so
``auto`` takes the device's fast one: bfloat16 on a GPU (float16 on one without bf16), and on a
CPU bfloat16 only where it has a bf16 matmul instruction (AVX512-BF16's ``vdpbf16ps`` or AMX
tiles). Without one, bf16 matmuls convert to float32 first and run at about half float32's
speed, so float32 is both exact and faster there.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple

import torch

from kvserve.config import ConfigError, ModelConfig
from kvserve.kv.storage import TORCH_DTYPES
from kvserve.model.gguf import GGUF_MARKER

# /proc/cpuinfo flag -> the instruction set it names, in the order the log names them
BF16_CPU_FLAGS = {"avx512_bf16": "AVX512-BF16", "amx_bf16": "AMX"}


class DtypeChoice(NamedTuple):
    dtype: torch.dtype
    reason: str  # why, for the start-up log: "auto: ...", or "--dtype"

    @property
    def name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This CPU's bf16 matmul flags, named as ``/proc/cpuinfo`` names them, from PyTorch's own
    detection (the one the linear backends consult, :mod:`kvserve.model.linear_ops`; it also
    checks that the OS grants the AMX tile state)."""
    found = set()
    if torch.cpu._is_avx512_bf16_supported():
        found.add("avx512_bf16")
    if torch.cpu._is_amx_tile_supported():
        found.add("amx_bf16")
    return frozenset(found)


def fast_cpu_dtype(flags: Iterable[str]) -> DtypeChoice:
    """bfloat16 on a CPU with a bf16 matmul instruction (AVX512-BF16 or AMX), else float32."""
    have = set(flags)
    isa = [name for flag, name in BF16_CPU_FLAGS.items() if flag in have]
    if isa:
        return DtypeChoice(torch.bfloat16, f"this CPU has {' and '.join(isa)}")
    return DtypeChoice(
        torch.float32, "this CPU has neither AVX512-BF16 nor AMX, so bf16 matmuls are slower"
    )


def is_gguf_dir(model_dir: str | Path) -> bool:
    """Whether ``model_dir`` is a GGUF file's converted directory."""
    return (Path(model_dir) / GGUF_MARKER).is_file()


def choose_dtype(
    dtype: str,
    cfg: ModelConfig,
    device: str | torch.device = "cpu",
    gguf: bool = False,
    flags: Iterable[str] | None = None,
) -> DtypeChoice:
    """The compute dtype for ``--dtype dtype`` on ``device``, and why. ``gguf``: the model
    came from a GGUF file; ``flags``: the CPU's (None: this machine's, :func:`cpu_flags`)."""
    if dtype != "auto":
        if dtype not in TORCH_DTYPES:
            raise ConfigError(
                f"dtype: must be one of auto, {', '.join(TORCH_DTYPES)}, got {dtype!r}"
            )
        return DtypeChoice(TORCH_DTYPES[dtype], "--dtype")
    if not gguf:
        named = cfg.torch_dtype in TORCH_DTYPES
        return DtypeChoice(
            TORCH_DTYPES.get(cfg.torch_dtype, torch.float32),
            "auto: the checkpoint's torch_dtype" if named else "auto: float32, the checkpoint "
            f"names {cfg.torch_dtype!r}",
        )  # fmt: skip
    device = torch.device(device)
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return DtypeChoice(torch.bfloat16, "auto: a GGUF model on a GPU")
        return DtypeChoice(torch.float16, "auto: a GGUF model on a GPU without bf16")
    if device.type != "cpu":
        return DtypeChoice(torch.float32, f"auto: a GGUF model on {device.type}")
    fast = fast_cpu_dtype(cpu_flags() if flags is None else flags)
    return DtypeChoice(fast.dtype, f"auto: a GGUF model, and {fast.reason}")
