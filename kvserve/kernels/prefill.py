"""Causal attention of a prefill chunk (``prefill_attention.c``; bf16 on AMX tiles in
``prefill_attention_amx.c`` where the CPU has them): over its own fresh K/V when it starts its
sequence, over its gathered context and its own K/V when it continues one. Built on first use
with the system C compiler and loaded with ctypes.

SDPA (``is_causal=True``) stays the reference in kvserve/attention/torch_backend.py; tests
compare the two. :func:`prefill_attention` returns False, with nothing written, wherever the
kernel does not apply (no compiler or no AVX-512, ``KVSERVE_DISABLE_KERNELS=1``, float16, an
unsupported head size or layout), and the caller runs SDPA.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from kvserve import envs
from kvserve.kernels import DOT_GAIN, NativeLibrary, best_time, packed_rows

_SRC = Path(__file__).with_name("prefill_attention.c")
_FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fopenmp", "-std=c11"]
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_p, _i, _i64, _f = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float


def _declare(lib: ctypes.CDLL) -> None:
    fn = lib.kvserve_prefill_attention
    fn.restype = _i
    fn.argtypes = [_p, _i64, _p, _p, _i64, _i64, _p, _i64, _i64, _i, _i, _i, _f, _i, _i, _i]
    lib.kvserve_prefill_has_bf16_dot.restype = _i


_LIB = NativeLibrary(_SRC, _FLAGS, "prefill attention", _declare)


def _declare_amx(lib: ctypes.CDLL) -> None:
    fn = lib.kvserve_prefill_attention_amx
    fn.restype = _i
    fn.argtypes = [_p, _i64, _p, _p, _i64, _i64, _p, _i64, _i64, _i, _i, _i, _f, _i, _i, _i]


# bf16 on AMX tiles where the build machine has them (it declines elsewhere).
_AMX = NativeLibrary(_SRC.with_name("prefill_attention_amx.c"), _FLAGS, "AMX prefill attention",
                     _declare_amx)  # fmt: skip


def native_available() -> bool:
    return _LIB.get() is not None


DT_BF16_DOT = 2  # the kernel's code for bf16 through bf16 dot products


def bf16_dot_products() -> bool:
    """Whether the FMA kernel runs bf16 through the CPU's bf16 dot products (dt 2) rather than
    float32 FMAs: where it has them and they measured faster here, once per process (an AMD
    Zen 4 retires a 512-bit ``vdpbf16ps`` as fast as a 512-bit FMA, twice the multiply-adds;
    a Xeon without AMX does not). ``KVSERVE_PREFILL_BF16_DOT`` = 1 / 0 decides instead (1:
    where the kernel has the path)."""
    forced = envs.KVSERVE_PREFILL_BF16_DOT
    if forced is not None:
        return forced and bf16_dot_built()
    return _dot_measured_faster()


def bf16_dot_built() -> bool:
    """Whether the FMA kernel was built with its bf16 dot-product path (AVX512-BF16)."""
    lib = _LIB.get()
    return lib is not None and lib.kvserve_prefill_has_bf16_dot() == 1


@functools.cache
def _dot_measured_faster() -> bool:
    lib = _LIB.get()
    if lib is None or not bf16_dot_built():
        return False
    g = torch.Generator().manual_seed(0)
    L, h, kvh, d = 256, 3, 1, 64  # a GQA group of SmolLM2's shape over a 256-token chunk
    q = torch.randn(L, h, d, generator=g).bfloat16()
    k, v = (torch.randn(L, kvh, d, generator=g).bfloat16() for _ in range(2))
    out = torch.empty_like(q)

    def run(dt: int) -> int:
        return lib.kvserve_prefill_attention(q.data_ptr(), q.stride(0), k.data_ptr(),
                                             v.data_ptr(), k.stride(0), k.stride(1),
                                             out.data_ptr(), L, L, h, kvh, d, d**-0.5, 0, dt,
                                             1)  # fmt: skip

    return best_time(run, DT_BF16_DOT) * DOT_GAIN < best_time(run, 1)


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
    return _attention(q, k, v, out, window)


def _amx_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, window: int | None
) -> int:
    """The AMX kernel's return code (0 done, 1 declined, 2 out of memory): bf16 only, keys
    ``[Lk, KVH, D]`` with any row and head strides and packed values."""
    amx = _AMX.get() if q.dtype == torch.bfloat16 else None
    if amx is None or k.stride(2) != 1 or v.stride() != k.stride():
        return 1
    L, h, d = q.shape
    return amx.kvserve_prefill_attention_amx(q.data_ptr(), q.stride(0), k.data_ptr(),
                                             v.data_ptr(), k.stride(0), k.stride(1),
                                             out.data_ptr(), L, k.shape[0], h, k.shape[1], d,
                                             d**-0.5, window or 0, 1,
                                             torch.get_num_threads())  # fmt: skip


def context_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, window: int | None
) -> bool:
    """Causal attention of a chunk q [L, H, D] that continues its sequence, over the whole
    sequence's keys k/v [Lk, KVH, D] (its cached context, then its own; any row and head
    strides, packed values), written into out [L, H, D] (contiguous): query i is at position
    Lk - L + i. False, with nothing written, where no kernel takes it (the caller uses SDPA).

    The FMA kernel (CPUs without AMX) converts and repacks every key and value of the call
    before it multiplies, and skips only the blocks above the diagonal: on float32 FMAs it
    is faster than SDPA's matrix products when the chunk's own triangle is a large share of
    the work, and several times slower for a short chunk after a long context (a question
    after a cached document), so it takes a chunk only when its context is no longer than
    the chunk. On bf16 dot products (a CPU where they beat float32 FMAs) its products run
    twice as fast while the repacking costs the same, and it beats SDPA from
    :data:`DOT_CONTEXT_MIN_QUERIES` queries after any context: it takes those too."""
    if not (
        q.dim() == k.dim() == v.dim() == 3
        and packed_rows(q, _DTYPES)
        and k.shape == v.shape
        and k.shape[0] >= q.shape[0]
        and q.shape[2] == k.shape[2]
        and out.shape == q.shape
        and q.dtype == k.dtype == v.dtype == out.dtype
        and out.is_contiguous()
        and k.stride(2) == 1
        and v.stride() == k.stride()
    ):
        return False
    n, ctx = q.shape[0], k.shape[0] - q.shape[0]
    dot = q.dtype == torch.bfloat16 and n >= DOT_CONTEXT_MIN_QUERIES and bf16_dot_products()
    return _attention(q, k, v, out, window, fma=ctx <= n or dot)


# Queries from which the kernel on bf16 dot products beats SDPA after a context of any length
# (the measured crossover); below it the kernel's repacking of every context key dominates.
DOT_CONTEXT_MIN_QUERIES = 16


def _attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    window: int | None,
    fma: bool = True,
) -> bool:
    """The AMX kernel where it takes the call, else (if ``fma``) the FMA kernel (queries at
    the last ``L`` of the ``Lk`` key positions); False where neither does."""
    rc = _amx_attention(q, k, v, out, window)
    lib = _LIB.get() if rc == 1 and fma else None
    if lib is not None:  # not for the tiles: the FMA kernel
        L, h, d = q.shape
        dt = _DTYPES[q.dtype]
        if dt == 1 and bf16_dot_products():
            dt = DT_BF16_DOT
        rc = lib.kvserve_prefill_attention(q.data_ptr(), q.stride(0), k.data_ptr(), v.data_ptr(),
                                            k.stride(0), k.stride(1), out.data_ptr(), L,
                                            k.shape[0], h, k.shape[1], d, d**-0.5, window or 0,
                                            dt, torch.get_num_threads())  # fmt: skip
    if rc == 2:
        raise MemoryError("prefill attention: could not allocate the packed K/V")
    return rc == 0
