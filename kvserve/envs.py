"""Every environment variable kvserve reads, in one place: typed, documented, and read when
asked (``envs.KVSERVE_DISABLE_AMX``), not at import, so that a test's ``monkeypatch.setenv``
or an entry point's setting counts from the next read on.

Each entry of :data:`VARIABLES` says what the variable does and its default; a value that
does not parse is a :class:`ValueError` naming the variable. Empty counts as unset. Modules
read ``envs.NAME`` and never ``os.environ`` for these, so a variable's meaning is written
once. :data:`NATIVE_VARIABLES` are read by the C kernels themselves and only documented here.

Like :mod:`kvserve.config`, this module imports no torch.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def _flag(name: str, raw: str) -> bool:
    """0 or 1"""
    if raw not in ("0", "1"):
        raise ValueError(f"{name}: must be 0 or 1, got {raw!r}")
    return raw == "1"


def _count(name: str, raw: str) -> int:
    """integer >= 0"""
    try:
        n = int(raw)
    except ValueError:
        n = -1
    if n < 0:
        raise ValueError(f"{name}: must be an integer >= 0, got {raw!r}")
    return n


def _positive(name: str, raw: str) -> int:
    """integer >= 1"""
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"{name}: must be an integer >= 1, got {raw!r}")
    return n


def _text(name: str, raw: str) -> str:
    """text"""
    return raw.strip()


def _path(name: str, raw: str) -> Path:
    """path"""
    return Path(raw)


_CPU_LIST = re.compile(r"\d+(-\d+)?(,\d+(-\d+)?)*")


def _cpu_binding(name: str, raw: str) -> str:
    """auto, nobind, a CPU list, or one CPU list per tensor-parallel rank joined by |"""
    mode = raw.strip()
    if mode not in ("auto", "nobind") and not all(
        _CPU_LIST.fullmatch(part.replace(" ", "")) for part in mode.split("|")
    ):
        raise ValueError(f"{name}: {raw!r} is not auto, nobind or a CPU list like 0-3,8 (or "
                         "one list per tensor-parallel rank, 0-3|4-7)")  # fmt: skip
    return mode


def _secret(name: str, raw: str) -> str:
    """text of 16+ characters"""
    if len(raw) < 16:
        raise ValueError(f"{name}: must be at least 16 characters, got {len(raw)}")
    return raw


@dataclass(frozen=True, slots=True)
class EnvVar:
    """One variable: how its text becomes a value, the value when unset, and what it does.
    The parser's docstring names the values it takes (the configuration reference's type)."""

    name: str
    parse: Callable[[str, str], Any]
    default: Any
    doc: str

    def read(self) -> Any:
        raw = os.environ.get(self.name)
        if raw is None or raw == "":
            return self.default
        return self.parse(self.name, raw)


VARIABLES: dict[str, EnvVar] = {
    v.name: v
    for v in (
        # Where kvserve keeps files
        EnvVar("KVSERVE_CACHE", _path, None,
               "Directory for what kvserve derives or downloads and can obtain again (built "
               "kernels, checkpoint fingerprints, prepared models, benchmark checkpoints); "
               "unset: $KVSERVE_CACHE_DIR, else $XDG_CACHE_HOME/kvserve, else ~/.cache/kvserve."),
        EnvVar("KVSERVE_CACHE_DIR", _path, None,
               "The older name of KVSERVE_CACHE, read where that is unset; default unset."),
        EnvVar("XDG_CACHE_HOME", _path, None,
               "The user's cache root (freedesktop.org's): kvserve's cache is its kvserve/ "
               "when neither of the above is set; unset: ~/.cache."),
        # Native kernels and linear layers (read when a model is loaded, unless said otherwise)
        EnvVar("CC", _text, None,
               "The C compiler that builds the native kernels on first use; unset: gcc, else "
               "cc, from PATH."),
        EnvVar("KVSERVE_DISABLE_KERNELS", _flag, False,
               "1: every native kernel gives way to its PyTorch reference; read once, when "
               "kvserve.kernels is imported (assign kvserve.kernels.DISABLED to switch later); "
               "default 0."),
        EnvVar("KVSERVE_DISABLE_ONEDNN", _flag, False,
               "1: linear layers on a CPU run the plain-PyTorch reference instead of oneDNN and "
               "kvserve's GEMM kernels; default 0."),
        EnvVar("KVSERVE_DISABLE_PREPACK", _flag, False,
               "1: oneDNN multiplies dense weights instead of its packed layout (an A/B "
               "switch; no AMX or AVX-512 GEMM kernel then); default 0."),
        EnvVar("KVSERVE_DISABLE_AMX", _flag, False,
               "1: bf16 linear layers skip kvserve's AMX kernel (the AVX-512 kernel or oneDNN "
               "instead); default 0."),
        EnvVar("KVSERVE_DISABLE_AVX512_GEMM", _flag, False,
               "1: bf16 and float32 linear layers skip kvserve's AVX-512 kernel (oneDNN's "
               "GEMMs instead); default 0."),
        EnvVar("KVSERVE_UPCAST_MIN_ROWS", _count, None,
               "N: steps of at least N tokens run a bf16 model's GEMMs on float32 copies of the "
               "weights (0: never), whatever the start-up measurement or the free memory says; "
               "unset: measured on this CPU."),
        EnvVar("KVSERVE_AVX512_BF16_DOT", _flag, None,
               "0 / 1: the AVX-512 GEMM kernel runs bf16 on float32 FMAs / on the CPU's bf16 "
               "dot products (1 only where it was built with them); unset: measured once per "
               "process."),
        EnvVar("KVSERVE_PREFILL_BF16_DOT", _flag, None,
               "0 / 1: the prefill attention kernel runs bf16 on float32 FMAs / on the CPU's "
               "bf16 dot products (1 only where it was built with them); unset: measured once "
               "per process."),
        EnvVar("KVSERVE_MALLOC_TUNING", _flag, True,
               "0: leave glibc's malloc thresholds as they are (kvserve.kernels.allocator says "
               "why a CPU engine raises them); default 1."),
        EnvVar("KVSERVE_CPU_OMP_THREADS_BIND", _cpu_binding, "auto",
               "How a CPU engine pins its compute threads during a step (vLLM's "
               "VLLM_CPU_OMP_THREADS_BIND): auto, one logical CPU per physical core of those "
               "the process may use; nobind; or a CPU list such as 0-3,8; with tensor parallelism, "
               "auto gives each rank its own share of the cores, and 0-3|4-7 names each "
               "rank's list; default auto."),
        # A torchrun launch (--distributed-executor-backend external_launcher): torchrun's own
        EnvVar("RANK", _count, None,
               "torchrun's: this process's rank among all of the launch's, the engine's "
               "tensor-parallel rank under external_launcher; unset: not launched so."),
        EnvVar("WORLD_SIZE", _positive, None,
               "torchrun's: the launch's process count, which must equal "
               "--tensor-parallel-size under external_launcher; unset: not launched so."),
        EnvVar("LOCAL_RANK", _count, None,
               "torchrun's: the rank among this machine's processes (its GPU, cuda:LOCAL_RANK; "
               "its share of the CPUs); unset: RANK."),
        EnvVar("LOCAL_WORLD_SIZE", _positive, None,
               "torchrun's: the processes on this machine, which share its CPUs; unset: "
               "WORLD_SIZE."),
        EnvVar("MASTER_ADDR", _text, "127.0.0.1",
               "torchrun's: the host of rank 0, where the group meets; default 127.0.0.1."),
        EnvVar("MASTER_PORT", _positive, None,
               "torchrun's: the port on MASTER_ADDR where the group meets, required under "
               "external_launcher; unset: not launched so."),
        # Several machines without Ray (--nnodes)
        EnvVar("KVSERVE_NODE_WAIT_S", _positive, 300,
               "Seconds node 0's engine waits for every --headless node to connect, and a "
               "--headless node waits for node 0's engine, before it exits with an error naming "
               "what it waited for; default 300."),
        # Server
        EnvVar("KVSERVE_TENANT_SECRET", _secret, None,
               "The server's secret under which tenants' prefix-cache salts are derived (16+ "
               "characters): replicas that share it share tenant partitions in a shared "
               "offload tier; unset: random per process."),
        # Benchmarks and tests (read by benchmarks/ and tests/, documented with the rest)
        EnvVar("KVSERVE_BENCH_THREADS", _positive, None,
               "Compute threads the benchmarks give each engine; unset: two, or one on a "
               "one-CPU machine."),
        EnvVar("KVSERVE_VLLM_PYTHON", _text, None,
               "The Python of a virtualenv with vLLM, the peer the throughput benchmark runs "
               "beside kvserve; unset: no peer (or --vllm-python)."),
        EnvVar("KVSERVE_TEST_DEVICE", _text, "cpu",
               "The device the test suite's engines run on (cuda: the same tests as a smoke "
               "test of the device paths); default cpu."),
    )
}  # fmt: skip

# Read by the C kernels at each call (getenv), not through this module.
NATIVE_VARIABLES: dict[str, str] = {
    "KVSERVE_QUANT_SCALAR": "Set to anything: the quantized-KV attention kernel takes its "
    "portable path instead of AVX-512 (tests compare the two); default unset.",
}


def set_for_process(name: str, value: str, only_if_unset: bool = False) -> None:
    """Set ``name`` for this process and those it starts: what a tensor-parallel rank tells
    its own libraries (its CPU list for the thread binding, gloo's loopback interface)."""
    if only_if_unset and os.environ.get(name):
        return
    os.environ[name] = value


def __getattr__(name: str) -> Any:
    var = VARIABLES.get(name)
    if var is None:
        raise AttributeError(f"module 'kvserve.envs' has no attribute {name!r}")
    return var.read()


def __dir__() -> list[str]:
    return sorted([*globals(), *VARIABLES])
