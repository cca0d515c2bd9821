"""Quantized paged KV storage, per token: fp8 (e4m3 / e5m2) and int8.

Each class keeps the :class:`~kvserve.kv.storage.KVStorage` interface: ``write`` new tokens
at flat slots, ``gather`` whole blocks back in the compute dtype (dequantized in tensor code,
no per-token loops), ``bytes_per_token`` with metadata. Both quantize each token as it is
written: their scales do not depend on later tokens. (KIVI, whose keys are quantized per
channel over a block, lives in :mod:`kvserve.kv.kivi_storage`.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kvserve.kv import codecs
from kvserve.kv.storage import KVFormatMismatch, KVStorage

FP8_HEADROOM = 4.0


class Fp8KVStorage(KVStorage):
    """float8 codes ``[num_blocks + 1, kv_heads, block_size, head_dim]`` per layer with one
    scale per (layer, KV head) for K and one for V.

    Scales come from the checkpoint (``k_scale`` / ``v_scale``) when it has them; otherwise
    (or with ``calculate_kv_scales``) they are calibrated from the amax of the first write to
    each layer -- the first prefill -- times ``FP8_HEADROOM``. The headroom costs almost
    nothing (fp8's error is relative: the normal range spans 2**15 below max for e4m3) and
    keeps later, larger tokens out of saturation; the default scale of 1.0 is the known trap.
    Scales never change after the first code is written, so every block stays decodable.
    They are pool-wide, so an exported block carries them and a pool with other scales
    refuses it (it never decodes one pool's codes with another's scales).
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
        layer_slots: tuple[int, ...] | None = None,
    ) -> None:
        super().__init__(num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype,
                         device, layer_slots)  # fmt: skip
        self.fp8_dtype = codecs.FP8_DTYPES[fp8_format]
        self.format_name = fp8_format
        shape = (self.num_rows, num_kv_heads, block_size, head_dim)
        self.k_codes = self.per_layer(*shape, dtype=torch.uint8)
        self.v_codes = self.per_layer(*shape, dtype=torch.uint8)
        self.k_scale = self._scales(k_scales)
        self.v_scale = self._scales(v_scales)
        self.calibrated = [k_scales is not None and v_scales is not None] * num_layers

    @classmethod
    def from_format(cls, name: str, num_layers: int, num_blocks: int, block_size: int,
                    num_kv_heads: int, head_dim: int, compute_dtype: torch.dtype,
                    device: torch.device | str = "cpu", **options: Any) -> KVStorage:  # fmt: skip
        """``k_scales`` / ``v_scales``: per-layer, optionally per-KV-head dequantization scales
        from the checkpoint; None calibrates them from the first prefill."""
        return cls(num_layers, num_blocks, block_size, num_kv_heads, head_dim, compute_dtype,
                   device, fp8_format=name, k_scales=options.get("k_scales"),
                   v_scales=options.get("v_scales"),
                   layer_slots=options.get("layer_slots"))  # fmt: skip

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
    def format_bytes_per_token(
        cls, name: str, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int = 16
    ) -> float:
        """One byte per element; the per-(layer, head) scales are per pool, not per token."""
        return 2 * num_layers * num_kv_heads * head_dim

    @classmethod
    def format_fixed_bytes(
        cls,
        name: str,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        compute_dtype: torch.dtype,
        max_num_seqs: int,
    ) -> int:
        """The null block plus one float32 scale per (layer, KV head) for K and for V."""
        null = super().format_fixed_bytes(name, num_layers, num_kv_heads, head_dim, block_size,
                                          compute_dtype, max_num_seqs)  # fmt: skip
        return null + 2 * num_layers * num_kv_heads * 4

    def block_tensors(self) -> dict[str, list[torch.Tensor]]:
        return {"k_codes": self.k_codes, "v_codes": self.v_codes}

    def fixed_tensors(self) -> list[torch.Tensor]:
        return self.k_scale + self.v_scale

    def _calibrate(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        k_amax, v_amax = k.float().abs().amax(dim=(0, 2)), v.float().abs().amax(dim=(0, 2))
        if not bool(torch.cat([k_amax, v_amax]).isfinite().all()):
            return  # a non-finite first batch says nothing about the scale; wait for the next
        if bool(k_amax.max() > 0) and bool(v_amax.max() > 0):
            self.k_scale[layer] = codecs.fp8_scale_from_amax(k_amax, self.fp8_dtype, FP8_HEADROOM)
            self.v_scale[layer] = codecs.fp8_scale_from_amax(v_amax, self.fp8_dtype, FP8_HEADROOM)
            self.calibrated[layer] = True
            self.kernel_views.pop(layer, None)

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

    # -- pool-wide scales travel with exported blocks ------------------------------------------
    def _export_pool(self) -> dict[str, Any]:
        return {
            "k_scale": torch.stack(self.k_scale).cpu(),
            "v_scale": torch.stack(self.v_scale).cpu(),
            "calibrated": list(self.calibrated),
        }

    def _import_pool(self, pool: dict[str, Any]) -> None:
        """Layers not yet calibrated adopt the payload's scales (then the codes decode exactly
        as they did there); a calibrated layer with other scales refuses the payload."""
        for layer in range(self.num_layers):
            if not self.calibrated[layer] or not pool["calibrated"][layer]:
                continue
            same = torch.equal(self.k_scale[layer].cpu(), pool["k_scale"][layer]) and torch.equal(
                self.v_scale[layer].cpu(), pool["v_scale"][layer]
            )
            if not same:
                raise KVFormatMismatch(
                    f"kv payload: fp8 scales of layer {layer} differ from this pool's; "
                    "the blocks would decode wrongly here"
                )
        for layer in range(self.num_layers):
            if not self.calibrated[layer] and pool["calibrated"][layer]:
                self.k_scale[layer] = pool["k_scale"][layer].to(self.device).clone()
                self.v_scale[layer] = pool["v_scale"][layer].to(self.device).clone()
                self.calibrated[layer] = True
                self.kernel_views.pop(layer, None)


class Int8KVStorage(KVStorage):
    """int8 codes plus one float16 scale per (token, KV head), symmetric absmax.

    Per-token scales need no calibration and follow each token's own range, so outlier
    tokens cost only their own precision. 130 bytes per 128-element head row: 0.508x bf16.
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
        layer_slots: tuple[int, ...] | None = None,
    ) -> None:
        super().__init__(num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype,
                         device, layer_slots)  # fmt: skip
        self.format_name = "int8"
        shape = (self.num_rows, num_kv_heads, block_size, head_dim)
        sshape = (self.num_rows, num_kv_heads, block_size)
        self.k_codes = self.per_layer(*shape, dtype=torch.int8)
        self.v_codes = self.per_layer(*shape, dtype=torch.int8)
        self.k_scale = self.per_layer(*sshape, dtype=torch.float16)
        self.v_scale = self.per_layer(*sshape, dtype=torch.float16)

    @classmethod
    def format_bytes_per_token(
        cls, name: str, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int = 16
    ) -> float:
        return 2 * num_layers * num_kv_heads * (head_dim + 2)

    def block_tensors(self) -> dict[str, list[torch.Tensor]]:
        return {
            "k_codes": self.k_codes,
            "v_codes": self.v_codes,
            "k_scale": self.k_scale,
            "v_scale": self.v_scale,
        }

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
