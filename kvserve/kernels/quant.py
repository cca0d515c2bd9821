"""Fused decode attention over quantized KV blocks (not built yet: callers fall back to the
dequantizing gather + SDPA reference path)."""

from __future__ import annotations

import torch


def supports(storage: object, q: torch.Tensor) -> bool:
    return False
