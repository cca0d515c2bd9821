"""Causal attention of a prefill chunk over its own fresh K/V (``prefill_attention.c``),
built on first use with the system C compiler and loaded with ctypes.

SDPA (``is_causal=True``) stays the reference in kvserve/model/attention.py; tests compare the
two. :func:`prefill_attention` returns False, with nothing written, wherever the kernel does
not apply (no compiler or no AVX-512, ``KVSERVE_DISABLE_KERNELS=1``, float16, an unsupported
head size or layout), and the caller runs SDPA.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from kvserve.kernels import NativeLibrary, packed_rows

_SRC = Path(__file__).with_name("prefill_attention.c")
_FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fopenmp", "-std=c11"]
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_p, _i, _i64, _f = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float


def _declare(lib: ctypes.CDLL) -> None:
    fn = lib.kvserve_prefill_attention
    fn.restype = _i
    fn.argtypes = [_p, _i64, _p, _p, _i64, _p, _i64, _i, _i, _i, _f, _i, _i, _i]


_LIB = NativeLibrary(_SRC, _FLAGS, "prefill attention", _declare)


def native_available() -> bool:
    return _LIB.get() is not None


def prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, window: int | None
) -> bool:
    """Causal attention of q [L, H, D] over k/v [L, KVH, D] (positions 0..L-1), written into
    out [L, H, D] (contiguous); False if not handled."""
    if not (
        q.dim() == k.dim() == v.dim() == 3
        and packed_rows(q, _DTYPES)
        and packed_rows(k, _DTYPES)
        and packed_rows(v, _DTYPES)
        and k.stride(0) == v.stride(0)
        and q.shape[0] == k.shape[0] == v.shape[0] == out.shape[0]
        and k.shape == v.shape
        and q.shape[2] == k.shape[2]
        and out.shape == q.shape
        and q.dtype == k.dtype == v.dtype == out.dtype
        and out.is_contiguous()
        and native_available()
    ):
        return False
    lib = _LIB.get()
    assert lib is not None
    L, h, d = q.shape
    rc = lib.kvserve_prefill_attention(q.data_ptr(), q.stride(0), k.data_ptr(), v.data_ptr(),
                                        k.stride(0), out.data_ptr(), L, h, k.shape[1], d,
                                        d**-0.5, window or 0, _DTYPES[q.dtype],
                                        torch.get_num_threads())  # fmt: skip
    if rc == 2:
        raise MemoryError("prefill attention: could not allocate the packed K/V")
    return rc == 0
