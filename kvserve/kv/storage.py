"""Where K/V bytes live: per-layer tensors indexed by (block, offset in block).

The storage is the seam between the paged cache and its storage format. The model writes new
K/V through :meth:`KVStorage.write` and reads whole blocks back, in the compute dtype, through
:meth:`KVStorage.gather`. Quantized formats subclass it: a block then holds codes plus its own
scales, and ``bytes_per_token`` counts both, so the pool size follows from the real bytes.
"""

from __future__ import annotations

from typing import Any

import torch

TORCH_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


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
    ``kvserve plan`` reports it, so the two always agree. ``auto`` follows the model dtype.

    ``block_size`` matters only for KIVI formats, whose key metadata is per block (per channel
    over the block's tokens); the default is the engine's default block size."""
    from kvserve.kv.formats import canonical_kv_format, format_bytes_per_token

    name = canonical_kv_format(kv_cache_dtype, model_dtype)
    return format_bytes_per_token(name, num_layers, num_kv_heads, head_dim, block_size)


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
    format's fixed bytes (KIVI's full-precision residual for ``max_num_seqs`` partial blocks,
    fp8's scales). The planner calls the same function, so ``--validate`` compares like with
    like and no KV byte sits outside the memory the operator gave."""
    import torch

    from kvserve.kv.formats import canonical_kv_format, kv_fixed_bytes

    name = canonical_kv_format(kv_cache_dtype, model_dtype)
    fixed = kv_fixed_bytes(name, num_layers, num_kv_heads, head_dim,
                           getattr(torch, model_dtype), block_size, max_num_seqs)  # fmt: skip
    bpt = kv_bytes_per_token(name, num_layers, num_kv_heads, head_dim, model_dtype, block_size)
    return max(0, int((kv_cache_memory - fixed) // (bpt * block_size)))


class KVStorage:
    """Full-precision paged K/V: ``[num_blocks, kv_heads, block_size, head_dim]`` per layer.

    Blocks are head-major so that one KV head's rows of a block are contiguous: the decode
    kernel streams them, and a gather yields ``[B, kv_heads, tokens, head_dim]`` with each
    (sequence, head) matrix contiguous, which is what SDPA wants.
    """

    format_name = "dense"

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        use_kernels: bool = True,
    ) -> None:
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (num_blocks, num_kv_heads, block_size, head_dim)
        # Zero-filled: padded block-table entries point at real blocks whose values are masked
        # out, and masked values must be finite (0 * NaN would poison the weighted sum).
        self.k = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.use_kernels = use_kernels

    @classmethod
    def bytes_per_token(
        cls, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> float:
        """K and V bytes one token occupies across all layers (metadata included)."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * num_kv_heads * head_dim * itemsize

    def write(
        self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Store new tokens' K/V (``[T, kv_heads, head_dim]``) at flat slot indices."""
        blk = slot_mapping // self.block_size
        off = slot_mapping % self.block_size
        self.k[layer][blk, :, off] = k.to(self.dtype)
        self.v[layer][blk, :, off] = v.to(self.dtype)

    def gather(self, layer: int, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of whole blocks, ``[B, kv_heads, n * block_size, head_dim]`` for
        ``block_tables`` of shape ``[B, n]`` (the reference path), in the storage dtype for
        dense formats (the caller casts to its compute dtype)."""
        return (
            self.gather_blocks(block_tables, lambda x: x, self.k[layer]),
            self.gather_blocks(block_tables, lambda x: x, self.v[layer]),
        )

    def decode_attention(
        self,
        layer: int,
        q: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        window: int | None,
    ) -> torch.Tensor | None:
        """Fused decode attention straight from the blocks, or None when no kernel applies
        (the caller then gathers and runs SDPA)."""
        from kvserve import kernels

        g = q.shape[1] // self.num_kv_heads
        if not self.use_kernels or not kernels.supports(
            self.dtype, self.device, g, self.head_dim, self.block_size
        ):
            return None
        return kernels.paged_decode_attention(
            q, self.k[layer], self.v[layer], block_tables, seq_lens, window
        )

    def fused_attention(
        self, layer: int, q: torch.Tensor, group: Any, window: int | None, out: torch.Tensor
    ) -> bool:
        """Attend the rows of a :class:`~kvserve.model.attention.PagedGroup` (decode tokens
        and short continuation chunks) straight from the blocks with the native kernel,
        writing into ``out``; False when the kernel does not apply.

        The kernel reads ``self.k`` / ``self.v`` as dense head-major blocks, so it only serves
        storages that keep that layout (subclasses that override ``write`` store something
        else and answer False here; they may offer ``decode_attention`` instead).
        """
        from kvserve import kernels

        if type(self).write is not KVStorage.write or not self.use_kernels:
            return False
        g = q.shape[1] // self.num_kv_heads
        if not kernels.supports(self.dtype, self.device, g, self.head_dim, self.block_size):
            return False
        kernels.paged_attention(q, self.k[layer], self.v[layer], group, window, out)
        return True

    def block_tensors(self) -> list[torch.Tensor]:
        """Every tensor indexed by block id (codes and per-block metadata): what a block copy
        must copy. Quantized formats list their codes and scales."""
        return self.k + self.v

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks (copy-on-write of a shared partial block)."""
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], device=self.device)
        dst = torch.tensor([d for _, d in pairs], device=self.device)
        for t in self.block_tensors():
            t[dst] = t[src]

    def gather_blocks(
        self, block_tables: torch.Tensor, decode: Any, *per_layer: torch.Tensor
    ) -> torch.Tensor:
        """``[B, kv_heads, n * block_size, head_dim]`` from per-block tensors: the blocks of
        ``block_tables`` are selected from each tensor in ``per_layer`` and ``decode(*selected)``
        turns them into values ``[B * n, kv_heads, block_size, head_dim]``."""
        b, n = block_tables.shape
        flat = block_tables.reshape(-1)
        x = decode(*(t.index_select(0, flat) for t in per_layer))
        shape = (b, self.num_kv_heads, n * self.block_size, self.head_dim)
        return x.view(b, n, *x.shape[1:]).transpose(1, 2).reshape(shape)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)
