"""The registry of KV formats: one dict from ``kv_cache_dtype`` name to storage class.

The engine builds its storage with :func:`make_kv_storage`; the byte figures come from the same
classes (:func:`kv_bytes_per_token`, :func:`kv_fixed_bytes`), so the pool size, the planner and
the allocated tensors agree. The CLI's choices are :data:`KV_CACHE_DTYPES`, derived from the
registry. A storage's ``format_name`` is what goes into prefix-cache keys: it carries the
layout (bits, group size, rotation) so two layouts never share blocks.

The registry names its classes by import path and this module imports torch only when a
class is asked for, so building a command line parser stays light.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kvserve.config import ConfigError

if TYPE_CHECKING:
    import torch

    from kvserve.kv.storage import KVStorage

_DENSE = "kvserve.kv.storage:DenseKVStorage"
_FP8 = "kvserve.kv.quant_storage:Fp8KVStorage"
_KIVI = "kvserve.kv.kivi_storage:KiviKVStorage"
KV_FORMATS: dict[str, str] = {
    "float32": _DENSE,
    "bfloat16": _DENSE,
    "float16": _DENSE,
    "fp8_e4m3": _FP8,
    "fp8_e5m2": _FP8,
    "int8": "kvserve.kv.quant_storage:Int8KVStorage",
    "kivi4": _KIVI,
    "kivi2": _KIVI,
}
ALIASES = {"fp8": "fp8_e4m3"}
KV_CACHE_DTYPES: tuple[str, ...] = ("auto", *KV_FORMATS, *ALIASES)
LOSSLESS_FORMATS = tuple(n for n, c in KV_FORMATS.items() if c == _DENSE)


def storage_class(name: str) -> type[KVStorage]:
    """The storage class of a canonical format name."""
    module, cls = KV_FORMATS[name].split(":")
    return getattr(importlib.import_module(module), cls)


def canonical_kv_format(kv_cache_dtype: str, model_dtype: str) -> str:
    """``auto`` -> the model dtype's name, ``fp8`` -> ``fp8_e4m3``; others unchanged.
    Raises :class:`ConfigError` naming ``kv_cache_dtype`` for a name no storage implements."""
    name = model_dtype if kv_cache_dtype == "auto" else ALIASES.get(kv_cache_dtype, kv_cache_dtype)
    if name not in KV_FORMATS:
        raise ConfigError(
            f"kv_cache_dtype: must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}"
        )
    return name


def kv_bytes_per_token(
    kv_cache_dtype: str,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    model_dtype: str,
    block_size: int = 16,
) -> float:
    """Bytes one token's K and V occupy across all layers in the given storage format,
    metadata (scales, zero points) included. The engine sizes its pool with this figure and
    ``kvserve plan`` reports it. ``auto`` follows the model dtype.

    ``block_size`` matters only for KIVI formats, whose key metadata is per block (per channel
    over the block's tokens); the default is the engine's default block size."""
    name = canonical_kv_format(kv_cache_dtype, model_dtype)
    return storage_class(name).format_bytes_per_token(
        name, num_layers, num_kv_heads, head_dim, block_size
    )


def kv_fixed_bytes(
    kv_cache_dtype: str,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    compute_dtype: torch.dtype,
    block_size: int = 16,
    max_num_seqs: int = 256,
) -> int:
    """Bytes a format needs besides its per-token figure, inside ``kv_cache_memory``: the null
    block, KIVI's residual pool (one full-precision block per running sequence plus a flush
    batch) and fp8's per-(layer, head) scales. Storages report them as ``fixed_nbytes()``."""
    name = canonical_kv_format(kv_cache_dtype, str(compute_dtype).removeprefix("torch."))
    return storage_class(name).format_fixed_bytes(
        name, num_layers, num_kv_heads, head_dim, block_size, compute_dtype, max_num_seqs
    )


def pool_num_blocks(
    kv_cache_memory: float,
    kv_cache_dtype: str,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    model_dtype: str,
    block_size: int = 16,
    max_num_seqs: int = 256,
) -> int:
    """The engine's pool-sizing rule: whole blocks that fit in ``kv_cache_memory`` after the
    format's fixed bytes, so no KV byte sits outside the memory the operator gave."""
    import torch

    fixed = kv_fixed_bytes(kv_cache_dtype, num_layers, num_kv_heads, head_dim,
                           getattr(torch, model_dtype), block_size, max_num_seqs)  # fmt: skip
    bpt = kv_bytes_per_token(
        kv_cache_dtype, num_layers, num_kv_heads, head_dim, model_dtype, block_size
    )
    return max(0, int((kv_cache_memory - fixed) // (bpt * block_size)))


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
    k_scales: Any = None,
    v_scales: Any = None,
    layer_slots: tuple[int, ...] | None = None,
) -> KVStorage:
    """The storage for a format name (``auto`` and aliases resolved against ``dtype``);
    ``dtype`` is the compute dtype that ``gather`` returns (and, for dense formats, ``auto``'s
    storage dtype).

    ``k_scales`` / ``v_scales`` (fp8 only): per-layer, optionally per-KV-head dequantization
    scales from the checkpoint; None calibrates them from the first prefill."""
    name = canonical_kv_format(name, str(dtype).removeprefix("torch."))
    return storage_class(name).from_format(
        name, num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, device,
        max_num_seqs=max_num_seqs, k_scales=k_scales, v_scales=v_scales,
        **({"layer_slots": layer_slots} if layer_slots is not None else {}),
    )  # fmt: skip
