"""Quantized paged KV storage: fp8 (e4m3 / e5m2), int8 and KIVI-style 4- and 2-bit.

Each class keeps the :class:`~kvserve.kv.storage.KVStorage` seam: ``write`` new tokens at flat
slots, ``gather`` whole blocks back in the compute dtype (dequantized in tensor code, no
per-token loops), ``copy_blocks`` for copy-on-write, ``bytes_per_token`` with metadata.

- fp8 and int8 quantize each token as it is written (their scales do not depend on later
  tokens).
- KIVI keys are quantized per channel over the tokens of a block, so a block can only be
  quantized once it is full. The partial tail block of each sequence lives in a small
  full-precision *residual* pool (KIVI's residual window, one block per sequence) and is
  quantized exactly once, after its last slot is written (in batches, see kivi_storage.py).
  Prefix-cache hits only ever reuse full blocks and copy-on-write only copies partial ones, so
  both fit this rule.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from kvserve.kv import codecs
from kvserve.kv.storage import KVStorage

log = logging.getLogger("kvserve.kv")
FP8_HEADROOM = 4.0


class Fp8KVStorage(KVStorage):
    """float8 codes ``[num_blocks, kv_heads, block_size, head_dim]`` per layer with one scale
    per (layer, KV head) for K and one for V.

    Scales come from the checkpoint (``k_scale`` / ``v_scale``) when it has them; otherwise
    (or with ``calculate_kv_scales``) they are calibrated from the amax of the first write to
    each layer -- the first prefill -- times ``FP8_HEADROOM``. The headroom costs almost
    nothing (fp8's error is relative: the normal range spans 2**15 below max for e4m3) and
    keeps later, larger tokens out of saturation; the default scale of 1.0 is the known trap.
    Scales never change after the first code is written, so every block stays decodable.
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        fp8_format: str = "fp8_e4m3",
        k_scales: torch.Tensor | None = None,
        v_scales: torch.Tensor | None = None,
        use_kernels: bool = True,
    ) -> None:
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.num_kv_heads, self.head_dim, self.dtype = num_kv_heads, head_dim, dtype
        self.device = torch.device(device)
        self.use_kernels = use_kernels
        self.fp8_dtype = codecs.FP8_DTYPES[fp8_format]
        self.format_name = fp8_format
        shape = (num_blocks, num_kv_heads, block_size, head_dim)
        dev = self.device
        self.k_codes = [
            torch.zeros(shape, dtype=torch.uint8, device=dev) for _ in range(num_layers)
        ]
        self.v_codes = [
            torch.zeros(shape, dtype=torch.uint8, device=dev) for _ in range(num_layers)
        ]
        self.k_scale = self._scales(k_scales)
        self.v_scale = self._scales(v_scales)
        self.calibrated = [k_scales is not None and v_scales is not None] * num_layers

    def _scales(self, given: torch.Tensor | None) -> list[torch.Tensor]:
        """[num_layers, kv_heads] (or broadcastable) -> per-layer float32 [kv_heads]."""
        if given is None:
            return [
                torch.ones(self.num_kv_heads, device=self.device) for _ in range(self.num_layers)
            ]
        g = torch.as_tensor(given, dtype=torch.float32).reshape(self.num_layers, -1)
        g = g.expand(self.num_layers, self.num_kv_heads)
        if not bool((g > 0).all() and g.isfinite().all()):
            raise ValueError("k_scale / v_scale: checkpoint scales must be finite and > 0")
        return [g[i].clone().to(self.device) for i in range(self.num_layers)]

    @classmethod
    def bytes_per_token(  # type: ignore[override]
        cls, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype = torch.uint8
    ) -> float:
        """One byte per element; the per-(layer, head) scales are per pool, not per token."""
        return 2 * num_layers * num_kv_heads * head_dim

    def _calibrate(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        k_amax, v_amax = k.float().abs().amax(dim=(0, 2)), v.float().abs().amax(dim=(0, 2))
        if not bool(torch.cat([k_amax, v_amax]).isfinite().all()):
            return  # a non-finite first batch says nothing about the scale; wait for the next
        if bool(k_amax.max() > 0) and bool(v_amax.max() > 0):
            self.k_scale[layer] = codecs.fp8_scale_from_amax(k_amax, self.fp8_dtype, FP8_HEADROOM)
            self.v_scale[layer] = codecs.fp8_scale_from_amax(v_amax, self.fp8_dtype, FP8_HEADROOM)
            self.calibrated[layer] = True

    def write(
        self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        if not self.calibrated[layer] and k.shape[0]:
            self._calibrate(layer, k, v)
        blk, off = slot_mapping // self.block_size, slot_mapping % self.block_size
        ks, vs = self.k_scale[layer][:, None], self.v_scale[layer][:, None]
        self.k_codes[layer][blk, :, off] = codecs.fp8_quantize(k, ks, self.fp8_dtype)
        self.v_codes[layer][blk, :, off] = codecs.fp8_quantize(v, vs, self.fp8_dtype)

    def gather(self, layer: int, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        def decode(scale: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
            s = scale.to(self.dtype)[:, None, None]
            return lambda codes: codes.view(self.fp8_dtype).to(self.dtype) * s

        return (
            self.gather_blocks(block_tables, decode(self.k_scale[layer]), self.k_codes[layer]),
            self.gather_blocks(block_tables, decode(self.v_scale[layer]), self.v_codes[layer]),
        )

    def decode_attention(self, layer, q, block_tables, seq_lens, window):  # noqa: ANN001
        from kvserve.kernels import quant

        if not self.use_kernels or not quant.supports(self, q):
            return None
        return quant.decode_fp8(self, layer, q, block_tables, seq_lens, window)

    def block_tensors(self) -> list[torch.Tensor]:
        return self.k_codes + self.v_codes  # scales are per (layer, head), not per block

    def nbytes(self) -> int:
        return sum(t.numel() for t in self.k_codes + self.v_codes)

    def fixed_nbytes(self) -> int:
        """Bytes outside the per-token figure: the per-(layer, head) scales."""
        return sum(t.numel() * 4 for t in self.k_scale + self.v_scale)


class Int8KVStorage(KVStorage):
    """int8 codes plus one float16 scale per (token, KV head), symmetric absmax.

    Per-token scales need no calibration and follow each token's own range, so outlier
    tokens cost only their own precision. 130 bytes per 128-element head row: 0.508x bf16.
    """

    format_name = "int8"

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
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.num_kv_heads, self.head_dim, self.dtype = num_kv_heads, head_dim, dtype
        self.device = dev = torch.device(device)
        self.use_kernels = use_kernels
        shape = (num_blocks, num_kv_heads, block_size, head_dim)
        sshape = (num_blocks, num_kv_heads, block_size)
        self.k_codes = [torch.zeros(shape, dtype=torch.int8, device=dev) for _ in range(num_layers)]
        self.v_codes = [torch.zeros(shape, dtype=torch.int8, device=dev) for _ in range(num_layers)]
        self.k_scale = [
            torch.zeros(sshape, dtype=torch.float16, device=dev) for _ in range(num_layers)
        ]
        self.v_scale = [
            torch.zeros(sshape, dtype=torch.float16, device=dev) for _ in range(num_layers)
        ]

    @classmethod
    def bytes_per_token(  # type: ignore[override]
        cls, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype = torch.int8
    ) -> float:
        return 2 * num_layers * num_kv_heads * (head_dim + 2)

    def write(
        self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        blk, off = slot_mapping // self.block_size, slot_mapping % self.block_size
        for x, codes, scales in ((k, self.k_codes, self.k_scale), (v, self.v_codes, self.v_scale)):
            c, s = codecs.int8_quantize(x)
            codes[layer][blk, :, off] = c
            scales[layer][blk, :, off] = s

    def gather(self, layer: int, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        def decode(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
            return codes.to(self.dtype) * scale.to(self.dtype)[..., None]

        k = self.gather_blocks(block_tables, decode, self.k_codes[layer], self.k_scale[layer])
        v = self.gather_blocks(block_tables, decode, self.v_codes[layer], self.v_scale[layer])
        return k, v

    def decode_attention(self, layer, q, block_tables, seq_lens, window):  # noqa: ANN001
        from kvserve.kernels import quant

        if not self.use_kernels or not quant.supports(self, q):
            return None
        return quant.decode_int8(self, layer, q, block_tables, seq_lens, window)

    def block_tensors(self) -> list[torch.Tensor]:
        return self.k_codes + self.v_codes + self.k_scale + self.v_scale

    def nbytes(self) -> int:
        ts = self.k_codes + self.v_codes + self.k_scale + self.v_scale
        return sum(t.numel() * t.element_size() for t in ts)

    def fixed_nbytes(self) -> int:
        return 0
