"""The engine's start-up block: what the KV pool holds and in which dtypes, and why.

One block, logged once when an engine is built, so ``kvserve serve`` and :class:`kvserve.LLM`
say the same: the pool in GiB (and in bytes, exact), its blocks x block size = tokens, how many
sequences of ``max_model_len`` tokens it holds at once (vLLM's "maximum concurrency"), the KV
cache's format and the compute dtype, each with the reason it was chosen. The figures are the
engine's own (the block count and bytes per token it sized the pool with), not recomputed here.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StartupSummary:
    model: str  # as given: a name, a path or a hub id
    model_dir: str  # what it resolved to
    num_blocks: int
    block_size: int
    bytes_per_token: float  # K and V of one token over all layers, metadata included
    fixed_bytes: int  # the format's bytes besides the blocks (null block, scales, residuals)
    max_model_len: int
    max_num_seqs: int
    kv_cache_dtype: str
    kv_reason: str
    compute_dtype: str
    dtype_reason: str
    device: str
    linear_backend: str | None = None  # the linear layers' backend, where a model is loaded
    sliding_window: bool = False  # some layers keep only a window: a sequence may hold fewer

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def pool_bytes(self) -> int:
        """The blocks' bytes (the format's fixed bytes apart)."""
        return round(self.num_tokens * self.bytes_per_token)

    @property
    def blocks_per_sequence(self) -> int:
        """Blocks one sequence of ``max_model_len`` tokens holds (the last one partly full)."""
        return -(-self.max_model_len // self.block_size)

    @property
    def max_sequences(self) -> int:
        """Sequences of ``max_model_len`` tokens the pool holds at once."""
        return self.num_blocks // self.blocks_per_sequence

    def lines(self) -> list[str]:
        where = self.model if self.model == self.model_dir else f"{self.model} ({self.model_dir})"
        fixed = ""
        if self.fixed_bytes:
            fixed = f", + {_size(self.fixed_bytes)} the format keeps besides its blocks"
        window = "; sliding-window layers hold fewer" if self.sliding_window else ""
        compute = f"{self.compute_dtype} ({self.dtype_reason}) on {self.device}"
        if self.linear_backend:
            compute += f", linear layers: {self.linear_backend}"
        return [
            f"engine: model {where}",
            f"  KV pool:  {self.pool_bytes / 2**30:.2f} GiB ({self.pool_bytes:,} bytes) = "
            f"{self.num_blocks:,} blocks x {self.block_size} tokens = {self.num_tokens:,} tokens "
            f"at {_number(self.bytes_per_token)} bytes per token{fixed}",
            f"  fits:     {self.max_sequences:,} sequences of max_model_len {self.max_model_len:,}"
            f" ({self.blocks_per_sequence:,} blocks each{window}); max_num_seqs "
            f"{self.max_num_seqs:,}",
            f"  KV dtype: {self.kv_cache_dtype} ({self.kv_reason})",
            f"  compute:  {compute}",
        ]

    def __str__(self) -> str:
        return "\n".join(self.lines())


def _number(x: float) -> str:
    return f"{x:,.0f}" if x == int(x) else f"{x:,.2f}"


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{n} bytes"
