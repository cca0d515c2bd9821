"""Rotary position embedding (RoPE) applied to queries and keys, and undone by a shift.

The model rotates this step's queries and keys with :func:`apply_rotary` before attention;
StreamingLLM's sink keys, stored rotated at their own positions, are scored with queries
rotated back by :func:`rotate_back` (RoPE rotations compose), so attention needs the same
formula the model uses: it lives here, below both.
"""

from __future__ import annotations

from typing import Any

import torch


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rot: int) -> torch.Tensor:
    """RoPE on the first ``rot`` channels of ``x`` (HF's rotate-half layout)."""
    if rot < x.shape[-1]:
        x_rot, x_pass = x[..., :rot], x[..., rot:]
        return torch.cat((apply_rotary(x_rot, cos, sin, rot), x_pass), dim=-1)
    half = rot // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def rotate_back(q: torch.Tensor, shift: torch.Tensor, rotary: Any) -> torch.Tensor:
    """Each row of ``q`` [T, H, D] rotated back by its ``shift`` [T] positions: against a
    sink key stored rotated at its own position, the score of a query at in-cache distance
    (StreamingLLM; see :func:`kvserve.attention.retention.retained_attention`). ``rotary``
    is the model's rotary embedding (``cos``/``sin`` tables and ``rot_dim``)."""
    cos = rotary.cos[shift][:, None, :]
    sin = rotary.sin[shift][:, None, :]
    return apply_rotary(q.float(), cos, -sin, rotary.rot_dim).to(q.dtype)
