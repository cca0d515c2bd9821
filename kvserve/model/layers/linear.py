"""Linear layers that hold one tensor-parallel shard of their weight and compute through a
backend (:mod:`kvserve.model.linear_ops`), in the shape of vLLM's parallel linear layers.

The split is Megatron's, as gpt-fast's ``tp.py`` applies it to a Llama: the projections that
widen (Q/K/V, gate/up) are column-parallel, each rank computing a slice of the outputs from the
whole input; those that narrow (attention output, down) are row-parallel, each rank multiplying
its slice of the inputs by the matching columns of the weight, so that the partial products
summed over the ranks (one all-reduce) are the output. Between the two, attention heads and
the MLP's intermediate features stay on their rank.

Each module keeps its backend in ``ops`` (one object for the whole model, chosen once by
:func:`~kvserve.model.linear_ops.select_ops`) and calls only its narrow methods; the backend may
replace ``weight`` by a layout of its own when it adopts the model. Weights are allocated
uninitialized: each parameter's ``weight_loader`` (vLLM's convention) takes the whole
checkpoint tensor and copies this rank's shard of it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from kvserve.model.layers.parallel_state import (
    SINGLE_RANK,
    TensorParallelGroup,
    divide,
    kv_head_split,
)
from kvserve.model.linear_ops import TorchOps


def copy_shard(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    """``dst[:] = src`` in dst's dtype, refusing a shard of another shape (``copy_`` would
    broadcast it)."""
    if dst.shape != src.shape:
        raise ValueError(
            f"{what}: a shard of shape {tuple(src.shape)} for a slot of {tuple(dst.shape)}"
        )
    dst.copy_(src)


def default_weight_loader(
    param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: str | int | None = None
) -> None:
    """A parameter every rank holds whole (a norm's weight)."""
    copy_shard(param.data, loaded_weight, "weight")


class LinearBase(nn.Module):
    """``y = x W^T + b`` over this rank's ``[out_features, in_features]`` shard of ``W``.

    ``gemm_names`` names the GEMMs the module runs for the backends and the simulator's cost
    model (:data:`~kvserve.model.linear_ops.GEMM_NAMES`; a merged gate/up projection runs
    two)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        tp: TensorParallelGroup | None,
        params_dtype: torch.dtype | None,
        gemm_names: tuple[str, ...],
    ) -> None:
        super().__init__()
        self.tp = tp or SINGLE_RANK
        self.in_features, self.out_features = in_features, out_features
        self.gemm_names = gemm_names
        dtype = params_dtype or torch.get_default_dtype()
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=dtype), requires_grad=False
        )
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False)
            self.bias.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        else:
            self.register_parameter("bias", None)
        self.ops: TorchOps = TorchOps()

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: str | int | None = None
    ) -> None:
        raise NotImplementedError

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, rank={self.tp.rank}/{self.tp.world_size}"
        )


class ColumnParallelLinear(LinearBase):
    """``W`` split by rows (output features): each rank computes its slice of the outputs from
    the whole input; ``gather_output`` concatenates the slices over the ranks. ``norm``, an
    RMSNorm applied to the input first, lets the backend fuse the two."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        gather_output: bool = False,
        tp: TensorParallelGroup | None = None,
        params_dtype: torch.dtype | None = None,
        gemm_names: tuple[str, ...] = (),
    ) -> None:
        tp = tp or SINGLE_RANK
        out = divide(output_size, tp.world_size, f"{type(self).__name__} output_size")
        super().__init__(input_size, out, bias, tp, params_dtype, gemm_names)
        self.gather_output = gather_output and tp.world_size > 1

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: str | int | None = None
    ) -> None:
        size = param.shape[0]
        src = loaded_weight.narrow(0, self.tp.rank * size, size)
        copy_shard(param.data, src, type(self).__name__)

    def forward(self, x: torch.Tensor, norm: nn.Module | None = None) -> torch.Tensor:
        out = self.ops.linear(x, self) if norm is None else self.ops.norm_linear(norm, x, self)
        return self.tp.all_gather(out) if self.gather_output else out


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input in one GEMM (gate and up), each
    split over the ranks on its own: a rank's weight is ``[gate shard; up shard]``, so that
    its output splits into its gate and up features like the unsharded one.

    The MLP reads it through the backend's SwiGLU methods, which fuse SiLU and the product
    into the two GEMMs; a packing backend keeps the up rows apart for that (``up_weight``),
    and then the plain product (:meth:`forward`) is refused rather than computed wrong."""

    def __init__(
        self,
        input_size: int,
        output_sizes: Sequence[int],
        bias: bool = False,
        tp: TensorParallelGroup | None = None,
        params_dtype: torch.dtype | None = None,
        gemm_names: tuple[str, ...] = ("gate", "up"),
    ) -> None:
        tp = tp or SINGLE_RANK
        for size in output_sizes:
            divide(size, tp.world_size, "MergedColumnParallelLinear output_sizes")
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), bias, False, tp, params_dtype, gemm_names)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: str | int | None = None
    ) -> None:
        """``shard_id``: which of the projections ``loaded_weight`` is (0 gate, 1 up)."""
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(
                f"MergedColumnParallelLinear shard_id: must be an integer in "
                f"[0, {len(self.output_sizes)}), got {shard_id!r}"
            )
        ws = self.tp.world_size
        offset = sum(self.output_sizes[:shard_id]) // ws
        size = self.output_sizes[shard_id] // ws
        src = loaded_weight.narrow(0, self.tp.rank * size, size)
        copy_shard(param.data.narrow(0, offset, size), src, "MergedColumnParallelLinear")

    def forward(self, x: torch.Tensor, norm: nn.Module | None = None) -> torch.Tensor:
        if "up_weight" in self._parameters:
            raise RuntimeError(
                f"{self.ops.name} keeps the up projection apart for the fused SwiGLU: "
                "compute through ops.swiglu (the MLP does)"
            )
        return super().forward(x, norm)


class QKVParallelLinear(ColumnParallelLinear):
    """The Q, K and V projections in one GEMM, split by attention head: each rank holds
    ``num_heads`` query heads and the ``num_kv_heads`` KV heads they read. Where the group has
    more ranks than the model has KV heads, each KV head is replicated on the
    ``num_kv_head_replicas`` ranks whose query heads it serves (vLLM's rule), so that every
    rank's attention is whole."""

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        total_num_heads: int,
        total_num_kv_heads: int,
        bias: bool = False,
        tp: TensorParallelGroup | None = None,
        params_dtype: torch.dtype | None = None,
    ) -> None:
        tp = tp or SINGLE_RANK
        ws = tp.world_size
        self.head_size = head_size
        self.num_heads = divide(total_num_heads, ws, "num_attention_heads")
        self.num_kv_heads, self.num_kv_head_replicas = kv_head_split(total_num_kv_heads, ws)
        self.q_size = self.num_heads * head_size
        self.kv_size = self.num_kv_heads * head_size
        out = (self.q_size + 2 * self.kv_size) * ws
        super().__init__(hidden_size, out, bias, False, tp, params_dtype, ("qkv",))

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: str | int | None = None
    ) -> None:
        """``shard_id``: "q", "k" or "v", the checkpoint's projection ``loaded_weight`` is
        (its weight or its bias)."""
        slots = {"q": (0, self.q_size), "k": (self.q_size, self.kv_size),
                 "v": (self.q_size + self.kv_size, self.kv_size)}  # fmt: skip
        if shard_id not in slots:
            raise ValueError(
                f'QKVParallelLinear shard_id: must be "q", "k" or "v", got {shard_id!r}'
            )
        offset, size = slots[shard_id]
        # the ranks that replicate a KV head read the same rows of K and V
        shard = self.tp.rank if shard_id == "q" else self.tp.rank // self.num_kv_head_replicas
        src = loaded_weight.narrow(0, shard * size, size)
        copy_shard(param.data.narrow(0, offset, size), src, f"QKVParallelLinear {shard_id}")


class RowParallelLinear(LinearBase):
    """``W`` split by columns (input features): each rank multiplies its slice of the input
    (the column-parallel layer's output before it) by its columns, and the all-reduce sums
    the partial products. The bias, whole on rank 0 and zero on the others, is added once.

    ``forward(x, residual)`` returns ``residual + x W^T``. The add runs in the GEMM's epilogue
    (the backend's ``linear_add``) only where nothing stands between the product and the add:
    one rank (no all-reduce of a partial product) and no bias (the fused op adds none);
    otherwise the product is reduced first, then added."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        tp: TensorParallelGroup | None = None,
        params_dtype: torch.dtype | None = None,
        gemm_names: tuple[str, ...] = (),
    ) -> None:
        tp = tp or SINGLE_RANK
        inp = divide(input_size, tp.world_size, "RowParallelLinear input_size")
        super().__init__(inp, output_size, bias, tp, params_dtype, gemm_names)
        self.fuse_residual = tp.world_size == 1 and not bias

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: str | int | None = None
    ) -> None:
        if param.dim() == 1:  # the bias: added by rank 0 alone, through the all-reduce
            if self.tp.rank:
                param.data.zero_()
                return
            copy_shard(param.data, loaded_weight, "RowParallelLinear bias")
            return
        size = param.shape[1]
        src = loaded_weight.narrow(1, self.tp.rank * size, size)
        copy_shard(param.data, src, "RowParallelLinear")

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if self.fuse_residual:
            if residual is None:
                return self.ops.linear(x, self)
            return self.ops.linear_add(x, self, residual)
        out = self.tp.all_reduce(self.ops.linear(x, self))
        return out if residual is None else residual + out
