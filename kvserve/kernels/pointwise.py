"""Fused RMSNorm, in-place rotary embedding, the KV cache write and the rows' top-k of the
greedy sampler (``pointwise.c``), built on first use with the system C compiler and loaded
with ctypes, like the attention kernels beside it.

``RMSNorm.forward``, ``RotaryEmbedding.forward`` (kvserve/model/llama.py), the dense
storage's indexed assignment (kvserve/kv/storage.py) and ``torch.topk`` stay the references;
tests compare. Each function returns None / False when it cannot take the input (no compiler,
``KVSERVE_DISABLE_KERNELS=1``, a dtype or layout it does not handle), and the caller then runs
the reference.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from kvserve.kernels import NativeLibrary, packed_rows

_SRC = Path(__file__).with_name("pointwise.c")
# No -ffast-math, no contraction: the kernels round where the reference rounds.
_FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-ffp-contract=off", "-fopenmp", "-std=c11"]
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_MAX_ROT = 512  # the kernel's per-row scratch
_p, _i, _i64, _f = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float


def _declare(lib: ctypes.CDLL) -> None:
    lib.kvserve_rms_norm.restype = _i
    lib.kvserve_rms_norm.argtypes = [_p, _i64, _p, _p, _i64, _i, _f, _i, _i]
    lib.kvserve_rotary.restype = _i
    lib.kvserve_rotary.argtypes = [_p, _i64, _i, _p, _i64, _i, _i, _i, _p, _p, _i64, _p, _i64,
                                   _i, _i]  # fmt: skip
    lib.kvserve_kv_write.restype = _i
    lib.kvserve_kv_write.argtypes = [_p, _p, _i64, _i, _i, _i, _p, _i64, _p, _i64, _p, _i64, _i]
    lib.kvserve_topk_rows.restype = _i
    lib.kvserve_topk_rows.argtypes = [_p, _i64, _i64, _i64, _i, _p, _p, _i]


_LIB = NativeLibrary(_SRC, _FLAGS, "fused RMSNorm / rotary / KV write", _declare)


def native_available() -> bool:
    return _LIB.get() is not None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """``weight * round(x * rsqrt(mean(x^2) + eps))`` for x [T, dim]; None if not handled."""
    lib = _LIB.get()
    if lib is None or x.dim() != 2 or not packed_rows(x, _DTYPES) or weight.dtype != x.dtype:
        return None
    w = weight.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype)
    rc = lib.kvserve_rms_norm(x.data_ptr(), x.stride(0), w.data_ptr(), out.data_ptr(),
                               x.shape[0], x.shape[1], eps, _DTYPES[x.dtype],
                               torch.get_num_threads())  # fmt: skip
    return out if rc == 0 else None


def rotary_(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> bool:
    """Rotate q [T, H, D] and k [T, KVH, D] in place with the float32 tables cos/sin
    [max_positions, rot]; False (nothing touched) if not handled. A position outside the
    tables raises IndexError, as the reference's gather does."""
    rot = cos.shape[-1]
    if not (
        q.dim() == 3
        and k.dim() == 3
        and q.dtype == k.dtype
        and q.shape[0] == k.shape[0] == positions.shape[0]
        and q.shape[2] == k.shape[2]
        and packed_rows(q, _DTYPES)
        and packed_rows(k, _DTYPES)
        and positions.dtype == torch.int64
        and positions.is_contiguous()
        and cos.dtype == sin.dtype == torch.float32
        and cos.is_contiguous()
        and sin.is_contiguous()
        and rot % 2 == 0
        and rot <= min(q.shape[-1], _MAX_ROT)
    ):
        return False
    lib = _LIB.get()
    if lib is None:
        return False
    rc = lib.kvserve_rotary(q.data_ptr(), q.stride(0), q.shape[1], k.data_ptr(), k.stride(0),
                             k.shape[1], q.shape[2], rot, cos.data_ptr(), sin.data_ptr(),
                             cos.shape[0], positions.data_ptr(), q.shape[0], _DTYPES[q.dtype],
                             torch.get_num_threads())  # fmt: skip
    if rc == 2:
        raise IndexError(f"rotary: a position is outside [0, {cos.shape[0]})")
    return rc == 0


def kv_write(
    k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
    v: torch.Tensor,
) -> bool:  # fmt: skip
    """Copy k, v [T, KVH, D] into slots ``slots`` (int64 [T]) of the pools [rows, KVH,
    block_size, D] (same dtype, contiguous); False (nothing touched) if not handled. A slot
    outside the pools raises IndexError, as the reference's indexing does."""
    if not (
        k_pool.dtype == v_pool.dtype == k.dtype == v.dtype
        and k_pool.dtype in _DTYPES
        and k_pool.is_contiguous()
        and v_pool.is_contiguous()
        and k_pool.shape == v_pool.shape
        and k.dim() == 3
        and k.shape == v.shape
        and k.shape[1:] == (k_pool.shape[1], k_pool.shape[3])
        and packed_rows(k, _DTYPES)
        and packed_rows(v, _DTYPES)
        and slots.dtype == torch.int64
        and slots.is_contiguous()
        and slots.device.type == "cpu"
        and slots.shape == (k.shape[0],)
    ):
        return False
    lib = _LIB.get()
    if lib is None:
        return False
    rows, kvh, bs, d = k_pool.shape
    rc = lib.kvserve_kv_write(k_pool.data_ptr(), v_pool.data_ptr(), rows, kvh, bs, d,
                              slots.data_ptr(), k.shape[0], k.data_ptr(), k.stride(0),
                              v.data_ptr(), v.stride(0), k.element_size())  # fmt: skip
    if rc == 2:
        raise IndexError(f"KV write: a slot is outside [{-rows * bs}, {rows * bs})")
    return rc == 0


TOPK_MAX = 16  # the kernel's per-row list


def topk_rows(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The ``k`` largest values of each row of x [rows, cols] (float32), largest first, and
    their indices (int64), the lower index first among equal values (as ``argmax``); None if
    not handled (then ``torch.topk``): k outside [1, min(cols, TOPK_MAX)], another dtype or
    layout, or a NaN in x."""
    if (
        x.dim() != 2
        or not packed_rows(x, (torch.float32,))
        or not 1 <= k <= min(x.shape[1], TOPK_MAX)
    ):
        return None
    lib = _LIB.get()
    if lib is None:
        return None
    rows, cols = x.shape
    vals = torch.empty(rows, k, dtype=torch.float32)
    idx = torch.empty(rows, k, dtype=torch.int64)
    rc = lib.kvserve_topk_rows(x.data_ptr(), x.stride(0), rows, cols, k, vals.data_ptr(),
                               idx.data_ptr(), torch.get_num_threads())  # fmt: skip
    return (vals, idx) if rc == 0 else None
