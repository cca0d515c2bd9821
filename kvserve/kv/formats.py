"""One place that maps a ``kv_cache_dtype`` to its storage class, its bytes and its name.

The engine builds its storage with :func:`make_kv_storage`; the byte figures come from the same
classes through :func:`kvserve.kv.storage.kv_bytes_per_token`, so the pool size, the planner
and the allocated tensors agree. :func:`kv_format_name` is the name that goes into
prefix-cache keys: it carries the layout (bits, group size) so two layouts never share blocks.
"""

from __future__ import annotations

import torch

from kvserve.kv.storage import TORCH_DTYPES, KVStorage

FP8_ALIASES = {"fp8": "fp8_e4m3"}
QUANTIZED_FORMATS = ("fp8_e4m3", "fp8_e5m2", "int8", "kivi4", "kivi2")


def canonical_kv_format(kv_cache_dtype: str, model_dtype: str) -> str:
    """``auto`` -> the model dtype's name, ``fp8`` -> ``fp8_e4m3``; others unchanged.
    Raises NotImplementedError for a name no storage implements."""
    name = (
        model_dtype if kv_cache_dtype == "auto" else FP8_ALIASES.get(kv_cache_dtype, kv_cache_dtype)
    )
    if name not in TORCH_DTYPES and name not in QUANTIZED_FORMATS:
        raise NotImplementedError(f"kv_cache_dtype: {kv_cache_dtype!r} is not implemented")
    return name


def format_bytes_per_token(
    name: str, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int = 16
) -> float:
    """Per-token bytes of a canonical format name (see :func:`canonical_kv_format`)."""
    from kvserve.kv.kivi_storage import KiviKVStorage
    from kvserve.kv.quant_storage import Fp8KVStorage, Int8KVStorage

    if name in TORCH_DTYPES:
        return KVStorage.bytes_per_token(num_layers, num_kv_heads, head_dim, TORCH_DTYPES[name])
    if name.startswith("fp8"):
        return Fp8KVStorage.bytes_per_token(num_layers, num_kv_heads, head_dim)
    if name == "int8":
        return Int8KVStorage.bytes_per_token(num_layers, num_kv_heads, head_dim)
    if name in ("kivi4", "kivi2"):
        bits = int(name[-1])
        return KiviKVStorage.bytes_per_token(
            num_layers, num_kv_heads, head_dim, bits=bits, block_size=block_size
        )
    raise NotImplementedError(f"kv_cache_dtype: {name!r} is not implemented")


def kv_fixed_bytes(
    name: str,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    compute_dtype: torch.dtype,
    block_size: int = 16,
    max_num_seqs: int = 256,
) -> int:
    """Bytes a format needs besides its per-token figure: KIVI's residual pool (one
    full-precision block per running sequence plus a flush batch) and fp8's per-(layer, head)
    scales. The engine keeps them outside ``kv_cache_memory``; storages report them as
    ``fixed_nbytes()``."""
    if name in ("kivi4", "kivi2"):
        from kvserve.kv.kivi_storage import FLUSH_BATCH

        itemsize = torch.empty((), dtype=compute_dtype).element_size()
        slots = max_num_seqs + FLUSH_BATCH
        return 2 * num_layers * slots * num_kv_heads * block_size * head_dim * itemsize
    if name.startswith("fp8"):
        return 2 * num_layers * num_kv_heads * 4
    return 0


def make_kv_storage(
    name: str,
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    *,
    max_num_seqs: int = 256,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
    use_kernels: bool = True,
) -> KVStorage:
    """The storage for a canonical format name; ``dtype`` is the compute dtype that
    ``gather`` returns (and, for dense formats, ``auto``'s storage dtype).

    ``k_scales`` / ``v_scales`` (fp8 only): per-layer, optionally per-KV-head dequantization
    scales from the checkpoint; None calibrates them from the first prefill."""
    from kvserve.kv.kivi_storage import KiviKVStorage
    from kvserve.kv.quant_storage import Fp8KVStorage, Int8KVStorage

    geo = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
    if name in TORCH_DTYPES:
        return KVStorage(*geo, TORCH_DTYPES[name], device, use_kernels=use_kernels)
    if name.startswith("fp8"):
        return Fp8KVStorage(*geo, dtype, device, fp8_format=name, k_scales=k_scales,
                            v_scales=v_scales, use_kernels=use_kernels)  # fmt: skip
    if name == "int8":
        return Int8KVStorage(*geo, dtype, device, use_kernels=use_kernels)
    if name in ("kivi4", "kivi2"):
        from kvserve.kv.kivi_storage import FLUSH_BATCH

        return KiviKVStorage(*geo, dtype, device, bits=int(name[-1]),
                             num_residual=max_num_seqs + FLUSH_BATCH,
                             use_kernels=use_kernels, rotate_keys=True)  # fmt: skip
    raise NotImplementedError(f"kv_cache_dtype: {name!r} is not implemented")
