"""Fused decode attention over quantized KV blocks (``quant_attention.c``), built on first use
with the system C compiler and loaded with ctypes, like the dense kernel beside it.

The storages' ``gather`` (dequantize every block, then SDPA) stays the reference path; tests
compare the two. ``KVSERVE_DISABLE_KERNELS=1`` or a missing compiler selects the reference.
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
_KIVI_LUT: torch.Tensor | None = None
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
    fn.argtypes = [_p, _p, _p, _i64, _p, _i, _i, _i, _f, ctypes.POINTER(_Cache), _i]


_LIB = NativeLibrary(_SRC, _FLAGS, "quantized KV attention", _declare)


def native_available() -> bool:
    return _LIB.get() is not None


def supports(storage, q: torch.Tensor) -> bool:  # noqa: ANN001 - any quantized storage
    g = q.shape[1] // storage.num_kv_heads
    return (
        storage.device.type == "cpu"
        and g <= 64
        and storage.head_dim <= 256
        and storage.block_size <= 256
        and getattr(storage, "res_k", [torch.empty(0)])[0].dtype in _RES_DTYPES
        and native_available()
    )


def _run(q, block_tables, seq_lens, window, cache: _Cache, keep: list) -> torch.Tensor:  # noqa: ANN001
    lib = _LIB.get()
    assert lib is not None
    b, h, d = q.shape
    qf = q.float().contiguous()
    out = torch.empty_like(qf)
    bt, lens = block_tables.contiguous(), seq_lens.contiguous()
    rc = lib.kvserve_quant_decode(
        qf.data_ptr(),
        out.data_ptr(),
        bt.data_ptr(),
        bt.shape[1],
        lens.data_ptr(),
        b,
        h,
        window or 0,
        d**-0.5,
        ctypes.byref(cache),
        torch.get_num_threads(),
    )
    del keep  # tensors whose pointers the call used stay alive until here
    if rc != 0:
        raise RuntimeError(f"quantized decode kernel rejected shapes q={tuple(q.shape)}")
    return out.to(q.dtype)


def _cached(st, layer: int, build) -> tuple[_Cache, list]:  # noqa: ANN001
    """The per-layer kernel descriptor, built once: code and metadata tensors never move."""
    cache = st.__dict__.setdefault("_kernel_desc", {})
    if layer not in cache:
        cache[layer] = build()
    return cache[layer]


def decode_fp8(st, layer: int, q, block_tables, seq_lens, window) -> torch.Tensor:  # noqa: ANN001
    def build() -> tuple[_Cache, list]:
        if st.fp8_dtype not in _FP8_LUTS:  # decode table for CPUs without F16C
            codes = torch.arange(256, dtype=torch.uint8).view(st.fp8_dtype)
            _FP8_LUTS[st.fp8_dtype] = codes.float().nan_to_num(0.0)
        lut = _FP8_LUTS[st.fp8_dtype]
        ks, vs = st.k_scale[layer].float().contiguous(), st.v_scale[layer].float().contiguous()
        c = _Cache(
            fmt=0,
            D=st.head_dim,
            bs=st.block_size,
            KVH=st.num_kv_heads,
            e4m3=int(st.fp8_dtype == torch.float8_e4m3fn),
            k_codes=st.k_codes[layer].data_ptr(),
            v_codes=st.v_codes[layer].data_ptr(),
            k_head_scale=ks.data_ptr(),
            v_head_scale=vs.data_ptr(),
            lut=lut.data_ptr(),
        )
        return c, [ks, vs, lut]

    if not st.calibrated[layer]:  # scales may still change: no caching yet
        c, keep = build()
    else:
        c, keep = _cached(st, layer, build)
    return _run(q, block_tables, seq_lens, window, c, keep)


def decode_int8(st, layer: int, q, block_tables, seq_lens, window) -> torch.Tensor:  # noqa: ANN001
    def build() -> tuple[_Cache, list]:
        c = _Cache(
            fmt=1,
            D=st.head_dim,
            bs=st.block_size,
            KVH=st.num_kv_heads,
            k_codes=st.k_codes[layer].data_ptr(),
            v_codes=st.v_codes[layer].data_ptr(),
            k_tok_scale=st.k_scale[layer].data_ptr(),
            v_tok_scale=st.v_scale[layer].data_ptr(),
        )
        return c, []

    c, keep = _cached(st, layer, build)
    return _run(q, block_tables, seq_lens, window, c, keep)


def decode_kivi(st, layer: int, q, block_tables, seq_lens, window) -> torch.Tensor:  # noqa: ANN001
    from kvserve.kv.codecs import KEY_SCALE_STEPS

    global _KIVI_LUT
    if _KIVI_LUT is None:  # key scale codes: 2 ** (-i / 8), the codec's own formula
        _KIVI_LUT = torch.exp2(-torch.arange(256, dtype=torch.float32) / KEY_SCALE_STEPS)
    lut = _KIVI_LUT

    def build() -> tuple[_Cache, list]:
        c = _Cache(
            fmt=2,
            D=st.head_dim,
            bs=st.block_size,
            KVH=st.num_kv_heads,
            bits=st.bits,
            group=st.group,
            k_codes=st.k_codes[layer].data_ptr(),
            v_codes=st.v_codes[layer].data_ptr(),
            k_meta=st.k_meta[layer].data_ptr(),
            k_base=st.k_base[layer].data_ptr(),
            v_scale=st.v_scale[layer].data_ptr(),
            v_zero=st.v_zero[layer].data_ptr(),
            lut=lut.data_ptr(),
        )
        return c, [lut]

    c, keep = _cached(st, layer, build)
    # The residual map changes every step and the residual pool may grow: refresh those.
    res = st._res_t
    rk, rv = st.res_k[layer], st.res_v[layer]
    c.res_of_block, c.res_k, c.res_v = res.data_ptr(), rk.data_ptr(), rv.data_ptr()
    c.res_dtype = _RES_DTYPES[rk.dtype]
    extra = [res]
    if st.key_rotation is not None:  # queries for the rotated keys of quantized blocks
        q_rot = (q.float() @ st.key_rotation).contiguous()
        c.q_rot = q_rot.data_ptr()
        extra.append(q_rot)
    return _run(q, block_tables, seq_lens, window, c, [*keep, *extra])
