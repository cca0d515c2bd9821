"""The gated feed-forward block of the Llama family (SwiGLU) over parallel linear layers."""

from __future__ import annotations

import torch
from torch import nn

from kvserve.model.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from kvserve.model.layers.parallel_state import TensorParallelGroup
from kvserve.model.linear_ops import TorchOps


class MLP(nn.Module):
    """``residual + down(silu(x Wg^T) * (x Wu^T))``, with ``x`` RMS-normed by ``norm`` first
    where one is given: gate and up column-parallel in one GEMM, down row-parallel, so that
    each rank's intermediate features stay on it.

    With one rank the whole block is one backend call (``norm_swiglu_add``), which fuses what
    the backend can: the norm into the gate/up kernel's row copy, SiLU and the product into
    the gate and up GEMMs' epilogues, and the residual add into the down projection's. With
    more ranks the down projection's partial products are all-reduced before the residual is
    added (:class:`RowParallelLinear`)."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        tp: TensorParallelGroup | None = None,
        params_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size] * 2, tp=tp, params_dtype=params_dtype
        )
        self.down_proj = RowParallelLinear(
            intermediate_size, hidden_size, tp=tp, params_dtype=params_dtype,
            gemm_names=("down",),
        )  # fmt: skip
        self.fuse_residual = self.down_proj.fuse_residual
        self.ops: TorchOps = TorchOps()

    def forward(
        self,
        x: torch.Tensor,
        norm: nn.Module | None = None,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        ops = self.ops
        if residual is not None and self.fuse_residual:
            if norm is None:
                return ops.swiglu_add(x, self.gate_up_proj, self.down_proj, residual)
            return ops.norm_swiglu_add(norm, x, self.gate_up_proj, self.down_proj, residual)
        if norm is None:
            h = ops.swiglu(x, self.gate_up_proj)
        else:
            h = ops.norm_swiglu(norm, x, self.gate_up_proj)
        return self.down_proj(h, residual=residual)
