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
from pathlib import Path

import torch

log = logging.getLogger("kvserve.kernels")
_SRC = Path(__file__).with_name("paged_attention.c")
# -ffast-math lets gcc call glibc's vectorised expf; the kernel never sees inf or NaN
# (masked keys are skipped, not set to -inf), so finite-math assumptions hold.
_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-shared", "-fPIC", "-std=c11"]
_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_lib: ctypes.CDLL | None = None
_tried = False


def _cache_dir() -> Path:
    base = os.environ.get("KVSERVE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kvserve"
    )
    return Path(base) / "kernels"


def _build() -> ctypes.CDLL | None:
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        log.warning("no C compiler found: using the PyTorch reference attention")
        return None
    src = _SRC.read_bytes()
    key = hashlib.sha256(src + " ".join([cc, *_FLAGS]).encode()).hexdigest()[:16]
    out = _cache_dir() / f"paged_attention-{key}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
        os.close(fd)
        try:
            subprocess.run(
                [cc, *_FLAGS, str(_SRC), "-o", tmp, "-lm"],
                check=True,
                capture_output=True,
                timeout=120,
            )
            os.replace(tmp, out)  # atomic: concurrent builders never see a partial file
        except (OSError, subprocess.SubprocessError) as e:
            detail = getattr(e, "stderr", b"") or b""
            log.warning(
                "kernel build failed (%s): using the PyTorch reference. %s", e, detail[:500]
            )
            Path(tmp).unlink(missing_ok=True)
            return None
    lib = ctypes.CDLL(str(out))
    fn = lib.kvserve_paged_decode
    fn.restype = ctypes.c_int
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    fn.argtypes = [p, p, p, p, i64, p, p, i32, i32, i32, i32, i32, i32, ctypes.c_float, i32, i32]
    return lib


def native_available() -> bool:
    global _lib, _tried
    if os.environ.get("KVSERVE_DISABLE_KERNELS") == "1":
        return False
    if not _tried:
        _tried = True
        _lib = _build()
    return _lib is not None


def supports(dtype: torch.dtype, device: torch.device, num_q_per_kv: int, head_dim: int,
             block_size: int) -> bool:  # fmt: skip
    return (
        device.type == "cpu"
        and dtype in _DTYPES
        and num_q_per_kv <= 64
        and head_dim <= 256
        and block_size <= 256
        and native_available()
    )


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    window: int | None,
) -> torch.Tensor:
    """Attention of one new token per sequence over its cached blocks.

    q: [B, H, D]; k_cache/v_cache: [num_blocks, KVH, block_size, D]; block_tables: [B, n]
    int64; seq_lens: [B] int64 keys per sequence. Returns [B, H, D] in q's dtype.
    """
    assert _lib is not None
    b, h, d = q.shape
    nb, kvh, bs, _ = k_cache.shape
    qf = q.float().contiguous()
    out = torch.empty_like(qf)
    bt = block_tables.contiguous()
    lens = seq_lens.contiguous()
    rc = _lib.kvserve_paged_decode(
        qf.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        bt.data_ptr(),
        bt.shape[1],
        lens.data_ptr(),
        out.data_ptr(),
        b,
        h,
        kvh,
        d,
        bs,
        window or 0,
        d**-0.5,
        _DTYPES[k_cache.dtype],
        torch.get_num_threads(),
    )
    if rc != 0:
        raise RuntimeError(f"paged decode kernel rejected shapes q={tuple(q.shape)}")
    return out.to(q.dtype)
