"""bf16 linear layers on weights packed in the AMX tile layout: on AMX tiles
(``amx_gemm.c``) or, on CPUs without them, with AVX-512 float32 FMAs (``avx512_gemm.c``), both
built on first use with the system C compiler and loaded with ctypes; ``F.linear`` (plain
weights) is the reference tests compare against.

A packed weight is a bf16 tensor of shape ``[N / 16, K / 32, 16, 32]``: four dimensions, so no
code path can mistake it for a dense ``[N, K]`` matrix. :func:`available` is False where the
build machine has no AMX, the OS refuses the tile state, there is no compiler, or
``KVSERVE_DISABLE_KERNELS=1``, :func:`avx512_available` where it has no AVX-512 (or the same
two); the caller then keeps oneDNN.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import Any

import torch

from kvserve import envs
from kvserve.kernels import DOT_GAIN, NativeLibrary, best_time

_p, _i, _i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
EPI_NONE, EPI_ADD, EPI_SWIGLU, EPI_F32 = 0, 1, 2, 4


def _declare(lib: ctypes.CDLL) -> None:
    lib.kvserve_amx_available.restype = _i
    lib.kvserve_amx_pack.argtypes = [_p, _i64, _i64, _p]
    lib.kvserve_amx_unpack.argtypes = [_p, _i64, _i64, _p]
    _declare_linear(lib.kvserve_amx_linear)


def _declare_linear(fn: Any) -> None:  # both kernels' entry points
    fn.restype = _i
    fn.argtypes = [_p, _i64, _i64, _i64, _p, _p, _i64, _p, _i, _p, _i64, _p, _i64, _i, _p,
                   ctypes.c_float]  # fmt: skip


def _declare512(lib: ctypes.CDLL) -> None:
    lib.kvserve_avx512_available.restype = _i
    lib.kvserve_avx512_set_dot.restype = _i
    lib.kvserve_avx512_set_dot.argtypes = [_i]
    _declare_linear(lib.kvserve_avx512_linear)
    lib.kvserve_avx512_linear_f32.restype = _i
    lib.kvserve_avx512_linear_f32.argtypes = [_p, _i64, _i64, _i64, _p, _p, _i64, _p, _i, _p,
                                              _i64, _p, _i64, _i]  # fmt: skip


_FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fopenmp", "-std=c11"]
_LIB = NativeLibrary(Path(__file__).with_name("amx_gemm.c"), _FLAGS, "AMX linear layers",
                     _declare)  # fmt: skip
_LIB512 = NativeLibrary(Path(__file__).with_name("avx512_gemm.c"), _FLAGS,
                        "AVX-512 linear layers", _declare512)  # fmt: skip
# kernel name -> (its library, its entry point), for :func:`linear`
_ENTRY = {"amx": (_LIB, "kvserve_amx_linear"), "avx512": (_LIB512, "kvserve_avx512_linear")}
KERNELS = tuple(_ENTRY)


def available() -> bool:
    lib = _LIB.get()
    return lib is not None and lib.kvserve_amx_available() == 1


def avx512_available() -> bool:
    lib = _LIB512.get()
    return lib is not None and lib.kvserve_avx512_available() == 1


_mode_decided = False  # avx512_dot_products has set the kernel's mode (checked per GEMM)
# The probe's GEMM: a decode step's rows through a 1,024 x 1,024 matrix.
DOT_PROBE = (16, 1024, 1024)


def avx512_dot_products() -> bool:
    """Whether the AVX-512 kernel runs on the CPU's bf16 dot products rather than float32
    FMAs, decided once per process before its first use: where it has them and they measured
    faster here (an AMD Zen 4 retires a 512-bit ``vdpbf16ps``, 32 multiply-adds, as fast as a
    512-bit FMA; a Xeon without AMX at half that rate). ``KVSERVE_AVX512_BF16_DOT`` = 1 / 0
    decides instead (1: where the build has them)."""
    return _dot_mode(envs.KVSERVE_AVX512_BF16_DOT)


@functools.cache
def _dot_mode(forced: bool | None) -> bool:
    lib = _LIB512.get()
    if lib is None or lib.kvserve_avx512_available() != 1 or lib.kvserve_avx512_set_dot(1) != 1:
        return False  # no build, or none with the dot products
    if forced is not None:
        return lib.kvserve_avx512_set_dot(forced) == 1
    m, k, n = DOT_PROBE
    g = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=g).bfloat16()
    wp = pack(torch.randn(n, k, generator=g).bfloat16())
    y = torch.empty(m, n, dtype=torch.bfloat16)

    def run(on: int) -> None:
        lib.kvserve_avx512_set_dot(on)
        lib.kvserve_avx512_linear(x.data_ptr(), k, m, k, wp.data_ptr(), None, n, None, EPI_NONE,
                                  None, 0, y.data_ptr(), n, torch.get_num_threads(), None,
                                  0.0)  # fmt: skip

    faster = best_time(run, 1) * DOT_GAIN < best_time(run, 0)
    return lib.kvserve_avx512_set_dot(faster) == 1


def packable(w: torch.Tensor, kernel: str = "amx") -> bool:
    """A dense CPU matrix whose dimensions the tiles take (both multiples of 32), bf16, or
    float32 for the ``avx512`` kernel."""
    dtypes = (torch.bfloat16, torch.float32) if kernel == "avx512" else (torch.bfloat16,)
    return (w.dim() == 2 and w.dtype in dtypes and w.device.type == "cpu"
            and w.shape[0] % 32 == 0 and w.shape[1] % 32 == 0)  # fmt: skip


def is_packed(w: torch.Tensor) -> bool:
    """In the bf16 tile layout (4 dimensions) or the float32 one (3, see :func:`pack`)."""
    if w.dtype == torch.float32:
        return w.dim() == 3 and w.shape[2] == 16
    return w.dim() == 4 and w.shape[2:] == (16, 32)


def pack(w: torch.Tensor) -> torch.Tensor:
    """``w [N, K]`` in the tile layout, as ``[N / 16, K / 32, 16, 32]`` for bf16; float32
    as ``[N / 16, K, 16]``, each block of 16 output columns one sequential run of K vectors
    (the AVX-512 kernel's float32 tiles)."""
    n, k = w.shape
    if w.dtype == torch.float32:
        assert packable(w, "avx512")
        return w.reshape(n // 16, 16, k).transpose(1, 2).contiguous()
    lib = _LIB.get()
    assert lib is not None and packable(w)
    w = w.contiguous()
    out = torch.empty(n // 16, k // 32, 16, 32, dtype=torch.bfloat16)
    lib.kvserve_amx_pack(w.data_ptr(), n, k, out.data_ptr())
    return out


def unpack(wp: torch.Tensor) -> torch.Tensor:
    """The dense ``[N, K]`` matrix back, bit for bit."""
    assert is_packed(wp)
    if wp.dtype == torch.float32:
        return wp.transpose(1, 2).reshape(wp.shape[0] * 16, wp.shape[1])
    lib = _LIB.get()
    assert lib is not None
    n, k = wp.shape[0] * 16, wp.shape[1] * 32
    out = torch.empty(n, k, dtype=torch.bfloat16)
    lib.kvserve_amx_unpack(wp.contiguous().data_ptr(), n, k, out.data_ptr())
    return out


def linear(
    x: torch.Tensor,
    wp: torch.Tensor,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    up: torch.Tensor | None = None,
    kernel: str = "amx",
    norm: tuple[torch.Tensor, float] | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """``x [M, K] @ W^T`` (bf16), plus ``bias`` or plus ``residual [M, N]``, or with ``up``
    (the up projection, packed): ``silu(x Wg^T) * (x Wu^T)``. Rounded to bf16 once.
    ``kernel``: one of :data:`KERNELS`. ``norm`` (a bf16 weight [K], contiguous, and an
    epsilon): x goes through that RMSNorm first, inside the kernel, with the roundings of
    :func:`kvserve.kernels.pointwise.rms_norm` (the same bits). ``out_dtype`` float32 (not
    with ``residual`` or ``up``): the same bf16 values, stored as float32 (an LM head's
    logits, without a pass converting them). Float32 weights (the ``avx512`` kernel's
    float32 layout): x, ``residual`` and the result float32, nothing rounded, no ``norm``."""
    gemm = PackedLinear(wp, up=up, bias=bias, kernel=kernel, norm=norm, out_dtype=out_dtype,
                        residual=residual is not None)  # fmt: skip
    return gemm(x, residual)


class PackedLinear:
    """:func:`linear` for one packed matrix, with everything that stays the same from call
    to call decided once: the entry point, the epilogue, the bias in float32, the norm.

    A decode step of a small model calls each of its GEMMs once per layer, on a few rows, and
    the work around a kernel call (choosing the entry point and epilogue, converting the bias,
    checking the layout) costs as much as the call itself there; a caller that multiplies by
    the same matrix every step keeps one of these (:class:`kvserve.model.linear_ops.LayerPlan`).
    The kernel sees the arguments :func:`linear` would give it, so the result is the same.
    ``residual``: calls pass a residual [M, N] to add (the add epilogue)."""

    __slots__ = ("fn", "wp", "up", "bias", "n", "k", "epi", "norm_w", "eps", "out_dtype", "f32",
                 "in_dtype", "kernel")  # fmt: skip

    def __init__(
        self,
        wp: torch.Tensor,
        up: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
        kernel: str = "amx",
        norm: tuple[torch.Tensor, float] | None = None,
        out_dtype: torch.dtype = torch.bfloat16,
        residual: bool = False,
    ) -> None:
        self.f32 = wp.dtype == torch.float32
        self.in_dtype = wp.dtype  # x's: float32 for float32 weights, bf16 for packed bf16
        self.kernel = kernel
        if self.f32:
            assert kernel == "avx512" and norm is None  # out_dtype: float32 whatever it says
            lib = _LIB512.get()
            assert lib is not None
            self.fn = lib.kvserve_avx512_linear_f32
            self.k, self.out_dtype = wp.shape[1], torch.float32
        else:
            native, entry = _ENTRY[kernel]
            lib = native.get()
            assert lib is not None
            global _mode_decided
            if kernel == "avx512" and not _mode_decided:
                avx512_dot_products()  # the kernel's mode, measured before its first GEMM
                _mode_decided = True
            self.fn = getattr(lib, entry)
            self.k, self.out_dtype = wp.shape[1] * 32, out_dtype
            assert out_dtype in (torch.bfloat16, torch.float32)
        self.n = wp.shape[0] * 16
        self.wp, self.up = wp, up
        self.bias = None if bias is None else bias.float().contiguous()
        wide = self.out_dtype == torch.float32 and not self.f32  # bf16 values in float32
        assert not wide or (up is None and not residual)
        if up is not None:
            self.epi = EPI_SWIGLU
        elif residual:
            self.epi = EPI_ADD
        else:
            self.epi = EPI_F32 if wide else EPI_NONE
        self.norm_w, self.eps = (None, 0.0) if norm is None else norm
        if norm is not None:
            assert norm[0].shape == (self.k,) and norm[0].dtype == torch.bfloat16
            assert norm[0].is_contiguous()

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """``x [M, K]``'s product (``residual``: given exactly when the epilogue adds it)."""
        m, k = x.shape
        n = self.n
        assert k == self.k and x.dtype == self.in_dtype
        if x.stride(1) != 1:
            x = x.contiguous()
        y = torch.empty(m, n, dtype=self.out_dtype)
        aux, ldaux = None, 0
        if self.epi == EPI_ADD:
            assert residual is not None and residual.shape == (m, n)
            assert residual.dtype == x.dtype
            if residual.stride(1) != 1:
                residual = residual.contiguous()
            aux, ldaux = residual.data_ptr(), residual.stride(0)
        else:
            assert residual is None
        up = None if self.up is None else self.up.data_ptr()
        b = None if self.bias is None else self.bias.data_ptr()
        if self.f32:
            rc = self.fn(x.data_ptr(), x.stride(0), m, k, self.wp.data_ptr(), up, n, b, self.epi,
                         aux, ldaux, y.data_ptr(), n, torch.get_num_threads())  # fmt: skip
        else:
            nw = None if self.norm_w is None else self.norm_w.data_ptr()
            rc = self.fn(x.data_ptr(), x.stride(0), m, k, self.wp.data_ptr(), up, n, b, self.epi,
                         aux, ldaux, y.data_ptr(), n, torch.get_num_threads(), nw,
                         self.eps)  # fmt: skip
        if rc:
            _check(rc, self.kernel, x, self.wp)
        return y


def _check(rc: int, kernel: str, x: torch.Tensor, wp: torch.Tensor) -> None:
    """A kernel's return code as the error it stands for (0: none)."""
    if rc == 2:
        raise MemoryError(f"{kernel} linear: could not allocate the packed activations")
    if rc != 0:
        raise RuntimeError(f"{kernel} linear declined x={tuple(x.shape)} w={tuple(wp.shape)}")
