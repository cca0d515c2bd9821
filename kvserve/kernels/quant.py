"""Fused decode attention over quantized KV blocks (``quant_attention.c``), built on first use
with the system C compiler and loaded with ctypes, like the dense kernel beside it.

The storages' ``gather`` (dequantize every block, then SDPA) stays the reference path; tests
compare the two. ``KVSERVE_DISABLE_KERNELS=1`` or a missing compiler selects the reference.
The kernel never sees a storage object: the CPU attention backend passes each format's tensors
through a :class:`CacheView`, so this module depends on no KV format's internals.
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import torch

from kvserve.kernels import NativeLibrary

log = logging.getLogger("kvserve.kernels")
_SRC = Path(__file__).with_name("quant_attention.c")
_FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fopenmp", "-std=c11"]
_RES_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_KIVI_LUTS: dict[int, torch.Tensor] = {}
_FP8_LUTS: dict[torch.dtype, torch.Tensor] = {}

_p, _i, _i64, _f = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float


class _Cache(ctypes.Structure):
    _fields_ = [
        ("fmt", _i),
        ("D", _i),
        ("bs", _i),
        ("KVH", _i),
        ("bits", _i),
        ("group", _i),
        ("e4m3", _i),
        ("k_codes", _p),
        ("v_codes", _p),
        ("lut", _p),
        ("k_head_scale", _p),
        ("v_head_scale", _p),
        ("k_tok_scale", _p),
        ("v_tok_scale", _p),
        ("k_meta", _p),
        ("k_base", _p),
        ("v_scale", _p),
        ("v_zero", _p),
        ("res_of_block", _p),
        ("res_k", _p),
        ("res_v", _p),
        ("res_dtype", _i),
        ("q_rot", _p),
    ]


def _declare(lib: ctypes.CDLL) -> None:
    fn = lib.kvserve_quant_decode
    fn.restype = _i
    fn.argtypes = [_p, _p, _p, _i64, _p, _p, _i, _i, _i, _f, ctypes.POINTER(_Cache), _i]


_LIB = NativeLibrary(_SRC, _FLAGS, "quantized KV attention", _declare)


def native_available() -> bool:
    return _LIB.get() is not None


def supports(q: torch.Tensor, num_kv_heads: int, head_dim: int, block_size: int,
             device: torch.device, residual_dtype: torch.dtype | None = None) -> bool:  # fmt: skip
    """Whether the kernel takes this geometry (and the residual dtype, for KIVI)."""
    g = q.shape[1] // num_kv_heads
    return (
        device.type == "cpu"
        and g <= 64
        and head_dim <= 256
        and block_size <= 256
        and (residual_dtype is None or residual_dtype in _RES_DTYPES)
        and native_available()
    )


class CacheView:
    """One layer's stored codes and metadata as the kernel reads them: a C descriptor plus
    the tensors it points into (kept alive here). The CPU attention backend builds one per
    layer and keeps it (``KVStorage.kernel_views``) while the layer's tensors stay where they
    are."""

    __slots__ = ("desc", "keep")

    def __init__(self, desc: _Cache, keep: list[torch.Tensor]) -> None:
        self.desc = desc
        self.keep = keep


def fp8_view(k_codes: torch.Tensor, v_codes: torch.Tensor, k_scale: torch.Tensor,
             v_scale: torch.Tensor, fp8_dtype: torch.dtype) -> CacheView:  # fmt: skip
    """codes [blocks, KVH, bs, D] uint8 (fp8 bit patterns), scales [KVH]."""
    if fp8_dtype not in _FP8_LUTS:  # decode table for CPUs without F16C
        codes = torch.arange(256, dtype=torch.uint8).view(fp8_dtype)
        _FP8_LUTS[fp8_dtype] = codes.float().nan_to_num(0.0)
    lut = _FP8_LUTS[fp8_dtype]
    ks, vs = k_scale.float().contiguous(), v_scale.float().contiguous()
    _, kvh, bs, d = k_codes.shape
    c = _Cache(
        fmt=0,
        D=d,
        bs=bs,
        KVH=kvh,
        e4m3=int(fp8_dtype == torch.float8_e4m3fn),
        k_codes=k_codes.data_ptr(),
        v_codes=v_codes.data_ptr(),
        k_head_scale=ks.data_ptr(),
        v_head_scale=vs.data_ptr(),
        lut=lut.data_ptr(),
    )
    return CacheView(c, [k_codes, v_codes, ks, vs, lut])


def int8_view(k_codes: torch.Tensor, v_codes: torch.Tensor, k_scale: torch.Tensor,
              v_scale: torch.Tensor) -> CacheView:  # fmt: skip
    """codes [blocks, KVH, bs, D] int8, float16 scales [blocks, KVH, bs]."""
    _, kvh, bs, d = k_codes.shape
    c = _Cache(
        fmt=1,
        D=d,
        bs=bs,
        KVH=kvh,
        k_codes=k_codes.data_ptr(),
        v_codes=v_codes.data_ptr(),
        k_tok_scale=k_scale.data_ptr(),
        v_tok_scale=v_scale.data_ptr(),
    )
    return CacheView(c, [k_codes, v_codes, k_scale, v_scale])


def kivi_view(k_codes: torch.Tensor, v_codes: torch.Tensor, k_meta: torch.Tensor,
              k_base: torch.Tensor, v_scale: torch.Tensor, v_zero: torch.Tensor, bits: int,
              group: int, head_dim: int, key_scale_steps: int) -> CacheView:  # fmt: skip
    """KIVI codes and metadata (see kvserve/kv/kivi_storage.py); key scale code ``i`` decodes
    as ``2 ** (-i / key_scale_steps)``."""
    if key_scale_steps not in _KIVI_LUTS:
        steps = torch.arange(256, dtype=torch.float32)
        _KIVI_LUTS[key_scale_steps] = torch.exp2(-steps / key_scale_steps)
    lut = _KIVI_LUTS[key_scale_steps]
    _, kvh, bs, _ = k_codes.shape
    c = _Cache(
        fmt=2,
        D=head_dim,
        bs=bs,
        KVH=kvh,
        bits=bits,
        group=group,
        k_codes=k_codes.data_ptr(),
        v_codes=v_codes.data_ptr(),
        k_meta=k_meta.data_ptr(),
        k_base=k_base.data_ptr(),
        v_scale=v_scale.data_ptr(),
        v_zero=v_zero.data_ptr(),
        lut=lut.data_ptr(),
    )
    return CacheView(c, [k_codes, v_codes, k_meta, k_base, v_scale, v_zero, lut])


def decode(
    view: CacheView,
    q: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    window: int | None,
    residual: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    q_rotation: torch.Tensor | None = None,
    seq_windows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention of q [B, H, D] over the view's blocks. ``residual`` (KIVI): the
    residual slot of each block (-1: quantized) and the full-precision residual K and V;
    ``q_rotation``: the orthonormal matrix keys were rotated by before quantization;
    ``seq_windows`` [B]: each sequence's retention window (0: none), beside the layer's."""
    lib = _LIB.get()
    assert lib is not None
    c = view.desc
    extra: list[torch.Tensor] = []
    if residual is not None:
        res, rk, rv = residual
        c.res_of_block, c.res_k, c.res_v = res.data_ptr(), rk.data_ptr(), rv.data_ptr()
        c.res_dtype = _RES_DTYPES[rk.dtype]
        extra += [res, rk, rv]
    if q_rotation is not None:  # queries for the rotated keys of quantized blocks
        q_rot = (q.float() @ q_rotation).contiguous()
        c.q_rot = q_rot.data_ptr()
        extra.append(q_rot)
    b, h, d = q.shape
    qf = q.float().contiguous()
    out = torch.empty_like(qf)
    bt, lens = block_tables.contiguous(), seq_lens.contiguous()
    wins = None if seq_windows is None else seq_windows.to(torch.int32).contiguous()
    rc = lib.kvserve_quant_decode(
        qf.data_ptr(),
        out.data_ptr(),
        bt.data_ptr(),
        bt.shape[1],
        lens.data_ptr(),
        None if wins is None else wins.data_ptr(),
        b,
        h,
        window or 0,
        d**-0.5,
        ctypes.byref(c),
        torch.get_num_threads(),
    )
    del extra  # tensors whose pointers the call used stay alive until here
    if rc == -3:
        raise RuntimeError(
            f"quantized decode: a sequence's length passes its block table's {bt.shape[1]} "
            f"blocks of {c.bs}"
        )
    if rc != 0:
        raise RuntimeError(f"quantized decode kernel rejected shapes q={tuple(q.shape)}")
    return out.to(q.dtype)
