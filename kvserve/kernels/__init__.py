"""Optional native kernels, built on first use with the system C compiler and loaded with
ctypes (no torch headers, so a build takes about a second).

Every kernel has a plain-PyTorch reference beside it that tests compare against; when no
compiler is available, or ``KVSERVE_DISABLE_KERNELS=1`` is set, the engine uses the reference
path and says so in its log. The shared library links the same OpenMP runtime torch has
loaded (``libgomp.so.1``), so there is one thread pool, not two competing ones.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kvserve import envs
from kvserve.config import user_cache_dir

log = logging.getLogger("kvserve.kernels")
_SRC = Path(__file__).with_name("paged_attention.c")
# -ffast-math lets gcc call glibc's vectorised expf; the kernel never sees inf or NaN
# (masked keys are skipped, not set to -inf), so finite-math assumptions hold. It applies to
# compilation only (see build_library).
_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-std=c11"]
_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_IO_DTYPES = {torch.float32: 0, torch.bfloat16: 1}  # queries and output


def _cache_dir() -> Path:
    return user_cache_dir() / "kernels"


def _cpu_features() -> bytes:
    """The CPU's feature flags as the kernel reports them (Linux), or its name elsewhere."""
    try:
        with open("/proc/cpuinfo", "rb") as f:
            for line in f:
                if line.startswith(b"flags"):
                    return line
    except OSError:
        pass
    import platform

    return platform.processor().encode()


def build_library(src: Path, flags: list[str], what: str) -> ctypes.CDLL | None:
    """Compile ``src`` into a cached shared library and load it; None (with a warning) when
    there is no compiler or the build fails, so callers fall back to their reference path.

    Compiling and linking are separate steps on purpose: a shared object *linked* with
    ``-ffast-math`` carries gcc's ``crtfastmath`` constructor, which turns on flush-to-zero
    for the whole process when it loads; compiled-only, the flags stay inside the kernel.
    """
    cc = envs.CC or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        log.warning("no C compiler found: %s uses its PyTorch reference", what)
        return None
    headers = b"".join(p.read_bytes() for p in sorted(src.parent.glob("*.h")))
    # -march=native code is for this CPU only: its features are part of the key, so a cache
    # directory shared with another machine never hands it an instruction it lacks.
    key = hashlib.sha256(src.read_bytes() + headers + " ".join([cc, *flags]).encode()
                         + _cpu_features())  # fmt: skip
    key = key.hexdigest()[:16]
    out = _cache_dir() / f"{src.stem}-{key}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmpdir = tempfile.mkdtemp(dir=out.parent)
        obj, lib = os.path.join(tmpdir, "k.o"), os.path.join(tmpdir, "k.so")
        try:
            for cmd in (
                [cc, *flags, "-fPIC", f"-I{src.parent}", "-c", str(src), "-o", obj],
                [cc, "-shared", "-fopenmp", obj, "-o", lib, "-lm"],
            ):
                subprocess.run(cmd, check=True, capture_output=True, timeout=120)
            os.replace(lib, out)  # atomic: concurrent builders never see a partial file
        except (OSError, subprocess.SubprocessError) as e:
            detail = (getattr(e, "stderr", b"") or b"")[:500]
            log.warning("%s build failed (%s): using the PyTorch reference. %s", what, e, detail)
            return None
        finally:
            shutil.rmtree(tmpdir, ignore_errors=True)
    return ctypes.CDLL(str(out))


# ``KVSERVE_DISABLE_KERNELS=1`` when the process started: every kernel gives way to its
# PyTorch reference. Read once: ``NativeLibrary.get`` runs a dozen times per decoder layer
# per step, and an ``os.environ`` lookup there showed in small decode steps' profiles.
# Assign to switch in a running process (tests do, with ``monkeypatch.setattr``).
DISABLED = envs.KVSERVE_DISABLE_KERNELS


class NativeLibrary:
    """One kernel source, built (:func:`build_library`) and given its ctypes signatures by
    ``declare`` on the first :meth:`get`; None when there is no compiler, the build failed or
    the kernels are switched off (:data:`DISABLED`, read at each call)."""

    def __init__(
        self, src: Path, flags: list[str], what: str, declare: Callable[[ctypes.CDLL], None]
    ) -> None:
        self.src, self.flags, self.what, self.declare = src, flags, what, declare
        self._lib: ctypes.CDLL | None = None
        self._tried = False

    def get(self) -> ctypes.CDLL | None:
        if DISABLED:
            return None
        if not self._tried:
            self._tried = True
            lib = build_library(self.src, self.flags, self.what)
            if lib is not None:
                self.declare(lib)
            self._lib = lib
        return self._lib


# How much faster a kernel's bf16 dot-product path must be at its start-up probe to be chosen
# over its float32 FMAs (timing noise).
DOT_GAIN = 1.1


def best_time(fn: Callable[..., object], *args: object, reps: int = 5, **kwargs: object) -> float:
    """The fastest of ``reps`` calls of ``fn(*args, **kwargs)`` in seconds, after one untimed
    call (which builds oneDNN's primitive, warms the caches): what a start-up probe compares."""
    fn(*args, **kwargs)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn(*args, **kwargs)
        times.append(time.perf_counter() - t0)
    return min(times)


def packed_rows(x: torch.Tensor, dtypes: Any) -> bool:
    """A 2-D or 3-D CPU tensor in one of ``dtypes`` whose last dims are packed: the rows of the
    flat batch may be strided (views into a fused QKV output), the values inside a row not."""
    # Checked for every norm, rotary and K/V write of every layer: the shape and strides are
    # read once (each tensor accessor is a call into torch).
    if x.dtype not in dtypes or not x.is_cpu:
        return False
    shape, strides = x.shape, x.stride()
    if len(shape) == 2:
        return strides[1] == 1 and strides[0] >= shape[1]
    if len(shape) == 3:
        return strides[2] == 1 and strides[1] == shape[2] and strides[0] >= shape[1] * shape[2]
    return False


def _declare(lib: ctypes.CDLL) -> None:
    fn = lib.kvserve_paged_attention
    fn.restype = ctypes.c_int
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    fn.argtypes = [p, p, p, p, i64, p, p, p, p, p, i32, i32, i32, i32, i32, i32,
                   ctypes.c_float, i32, i32, i32, i32, p, p, p, p]  # fmt: skip


_LIB = NativeLibrary(_SRC, _FLAGS, "paged attention", _declare)


def native_available() -> bool:
    return _LIB.get() is not None


def supports(dtype: torch.dtype, device: torch.device, num_q_per_kv: int, head_dim: int,
             block_size: int) -> bool:  # fmt: skip
    return device.type == "cpu" and dtype in _DTYPES and native_available()


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    group: Any,
    window: int | None,
    out: torch.Tensor,
    votes: tuple[torch.Tensor, torch.Tensor] | None = None,
    q_back: torch.Tensor | None = None,
) -> None:
    """Attention of the group's query rows over their cached blocks, written into ``out``.

    q/out: [T, H, D] (rows ``[0, group.num_rows)`` are touched); k_cache/v_cache:
    [num_blocks, KVH, block_size, D]; ``group`` has int64 tensors q_start, q_len, ctx_len [B]
    and block_tables [B, n], and ``windows`` (int32 [B], a sequence's retention window, 0 for
    none) or None (see :class:`kvserve.attention.metadata.PagedGroup`). ``window`` is the layer's.

    ``votes`` (H2O's attention mass), int64 [B] addresses and row strides: for each sequence
    whose address is not 0, the probability each visible key receives, summed over the
    sequence's queries and each KV head's query heads, is added to that float32 [KVH, stride]
    buffer (a block size of at most 256).

    StreamingLLM: ``group.sinks`` (int32 [B], or None) gives a windowed sequence's sink count;
    each of its rows also sees the sink keys before its window, scored with its row of
    ``q_back`` (the query rotated back by the row's position shift, see
    :func:`kvserve.attention.rotary.rotate_back`).
    """
    lib = _LIB.get()
    assert lib is not None
    n = group.num_rows
    _, h, d = q.shape
    _, kvh, bs, _ = k_cache.shape
    # bf16 queries go in as they are (the kernel's bf16 dot products need them exact);
    # anything else as float32. The output is written in float32 or bf16 directly.
    qf = q[:n].contiguous() if q.dtype == torch.bfloat16 else q[:n].float().contiguous()
    direct = out.dtype in _IO_DTYPES and out.is_contiguous()
    dst = out if direct else torch.empty(qf.shape, dtype=torch.float32)
    bt = group.block_tables.contiguous()
    wins = getattr(group, "windows", None)
    wins = None if wins is None else wins.to(torch.int32).contiguous()
    sinks = getattr(group, "sinks", None)
    sinks = None if sinks is None else sinks.to(torch.int32).contiguous()
    if sinks is not None:
        assert q_back is not None, "a group with sinks needs the rotated-back queries"
        q_back = q_back[:n].to(qf.dtype).contiguous()
    rc = lib.kvserve_paged_attention(
        qf.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        bt.data_ptr(),
        bt.shape[1],
        group.q_start.data_ptr(),
        group.q_len.data_ptr(),
        group.ctx_len.data_ptr(),
        None if wins is None else wins.data_ptr(),
        dst.data_ptr(),
        bt.shape[0],
        h,
        kvh,
        d,
        bs,
        window or 0,
        d**-0.5,
        _DTYPES[k_cache.dtype],
        torch.get_num_threads(),
        _IO_DTYPES[qf.dtype],
        _IO_DTYPES[dst.dtype],
        None if votes is None else votes[0].data_ptr(),
        None if votes is None else votes[1].data_ptr(),
        None if sinks is None else sinks.data_ptr(),
        None if sinks is None else q_back.data_ptr(),
    )
    if rc == -3:
        raise RuntimeError(
            f"paged attention: a sequence's context (ctx_len + q_len) passes its block table's "
            f"{bt.shape[1]} blocks of {bs}"
        )
    if rc != 0:
        raise RuntimeError(f"paged attention kernel failed (code {rc}) for q={tuple(q.shape)}")
    if not direct:
        out[:n] = dst[:n].to(out.dtype)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    window: int | None,
    seq_windows: torch.Tensor | None = None,
) -> torch.Tensor:
    """One new token per sequence: q [B, H, D], seq_lens [B] keys including the new one;
    ``seq_windows`` [B] each sequence's retention window (0: none) beside the layer's."""
    from types import SimpleNamespace

    b = q.shape[0]
    group = SimpleNamespace(
        num_rows=b,
        q_start=torch.arange(b, dtype=torch.int64),
        q_len=torch.ones(b, dtype=torch.int64),
        ctx_len=(seq_lens - 1).to(torch.int64).contiguous(),
        block_tables=block_tables.to(torch.int64),
        windows=seq_windows,
    )
    out = torch.empty(q.shape, dtype=q.dtype if q.dtype in _IO_DTYPES else torch.float32)
    paged_attention(q, k_cache, v_cache, group, window, out)
    return out.to(q.dtype)
