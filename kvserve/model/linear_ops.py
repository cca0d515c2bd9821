"""The compute ops of a decoder block (linear layers, RMSNorm, rotary), as swappable backends.

``TorchOps`` is the reference: plain ``F.linear`` plus separate element-wise ops, and the
``RMSNorm`` / ``RotaryEmbedding`` modules' own forward. ``OneDNNOps`` is the CPU fast path:
oneDNN matmuls with fused epilogues (SiLU on the gate projection, the product with the up
projection, the residual add after ``o_proj`` and ``down_proj``), so the MLP's intermediate
activations are written once instead of four times, and the native RMSNorm and in-place
rotary kernels (kvserve/kernels/pointwise.c), which replace chains of full-size temporaries
(attention is the attention backend's, :mod:`kvserve.attention`). The kernels round where the
references round (rotary is bit-identical); RMSNorm's sum of squares runs in its own order,
so float32 results match the reference to rounding, as oneDNN's GEMMs do. ``AMXOps``
and ``UpcastOps`` are bf16 variants of it for CPUs with and without AMX tiles. The parallel
linear modules (:mod:`kvserve.model.layers`) each hold the backend and call these methods, so
the model code never knows which backend runs; tests compare the two, and the float32
exactness tests against transformers run through the fast path.
"""

from __future__ import annotations

import functools
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from kvserve import envs
from kvserve.kernels import amx, best_time, pointwise

# The GEMMs of a step by name: a decoder layer's QKV, output (with the residual add), gate
# (SiLU), up (product) and down (add) projections, and the LM head's. The simulator's cost
# model counts the per-shape state a backend builds by these names (``shape_state_rows``).
GEMM_NAMES = ("qkv", "o", "gate", "up", "down", "head")


def gemm_layers(model: nn.Module) -> list[tuple[tuple[str, ...], nn.Module]]:
    """The model's matrices a backend may keep in its own layout, in the model's order, each
    with the names of the GEMMs it takes part in (:data:`GEMM_NAMES`; the fused gate/up
    projection two): the modules that name theirs in ``gemm_names`` (kvserve.model.layers'
    linear modules and LM head), i.e. every decoder layer's four and the LM head."""
    return [(m.gemm_names, m) for m in model.modules() if getattr(m, "gemm_names", ())]


def decoder_gemms(model: nn.Module) -> list[list[nn.Module]]:
    """Each decoder layer's QKV, output, gate/up and down modules, in the model's order."""
    order = [("qkv",), ("o",), ("gate", "up"), ("down",)]
    layers: list[list[nn.Module]] = []
    layer: list[nn.Module] = []
    for names, lin in gemm_layers(model):
        if names == order[len(layer)]:
            layer.append(lin)
            if len(layer) == len(order):
                layers.append(layer)
                layer = []
    return layers


def linear_layers(model: nn.Module) -> list[tuple[nn.Module, bool]]:
    """:func:`gemm_layers`' matrices, each with whether it is the fused gate/up projection.
    A head tied to the embedding table becomes a copy when a backend packs it (the lookup
    gathers rows of the dense table): the vocabulary-wide GEMM of every step is worth that
    memory."""
    return [(lin, len(names) == 2) for names, lin in gemm_layers(model)]


def _dense(w: torch.Tensor) -> torch.Tensor:
    if w.layout == torch._mkldnn:
        return w.to_dense()
    return amx.unpack(w) if amx.is_packed(w) else w


_FLOAT32_COPIES = ("weight32", "up_weight32", "bias32")
# A packing backend's matrices for its own kernel, kept in the layer's ``__dict__`` as
# (weight, up weight or None, bias or None) when it adopts the model: a decode step's GEMM
# calls read them there, skipping the module's parameter lookups and the layout check.
KERNEL_WEIGHTS = "kernel_weights"
KernelWeights = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]


def _is_dense(w: torch.Tensor) -> bool:
    return w.layout == torch.strided and not amx.is_packed(w)


class TorchOps:
    name = "torch"

    def adopt(self, model: nn.Module) -> None:
        """Put the model's matrices in the layout this backend computes with: plain dense
        ``[out, in]`` tensors (undoing a packing backend, see :meth:`OneDNNOps.adopt`)."""
        for lin, gate_up in linear_layers(model):
            for name in (*_FLOAT32_COPIES, KERNEL_WEIGHTS):  # other backends' (UpcastOps...)
                lin.__dict__.pop(name, None)
            if _is_dense(lin.weight):
                continue
            w = _dense(lin.weight)
            if gate_up:
                w = torch.cat([w, _dense(lin.up_weight)])
                del lin.up_weight
            lin.weight = nn.Parameter(w, requires_grad=False)

    def describe(self) -> str:
        """The backend in a server's start-up log."""
        return self.name

    @property
    def large_step_rows(self) -> int:
        """Steps of at least this many tokens run their GEMMs on another path (0: none do);
        the simulator's cost model gives them their own efficiency."""
        return 0

    @property
    def large_step_dtype(self) -> torch.dtype:
        """The dtype of those steps' GEMMs."""
        return torch.float32

    @property
    def shape_state_rows(self) -> dict[str, int]:
        """The GEMMs (by :data:`GEMM_NAMES`) whose calls build state per input row count
        (oneDNN's primitives, see :data:`ONEDNN_CACHE_CAPACITY`), each with the fewest rows
        of a call that does; empty where none do. A call whose shape the caches no longer
        hold builds it again, which the simulator's cost model charges."""
        return {}

    def linear(self, x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
        return F.linear(x, layer.weight, layer.bias)

    def linear_add(self, x: torch.Tensor, layer: nn.Linear, residual: torch.Tensor) -> torch.Tensor:
        """``residual + x @ W^T`` (no bias: o_proj and down_proj have none in this family)."""
        return residual + F.linear(x, layer.weight)

    def swiglu_add(
        self, x: torch.Tensor, gate_up: nn.Linear, down: nn.Linear, residual: torch.Tensor
    ) -> torch.Tensor:
        """``residual + down(silu(x Wg^T) * (x Wu^T))`` with ``gate_up`` holding [Wg; Wu]."""
        gate, up = F.linear(x, gate_up.weight).chunk(2, dim=-1)
        return residual + F.linear(F.silu(gate) * up, down.weight)

    def swiglu(self, x: torch.Tensor, gate_up: nn.Linear) -> torch.Tensor:
        """``silu(x Wg^T) * (x Wu^T)``: the MLP without its down projection, for a
        row-parallel one whose all-reduce stands between the product and the residual add."""
        gate, up = F.linear(x, gate_up.weight).chunk(2, dim=-1)
        return F.silu(gate) * up

    def rms_norm(self, norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return norm(x)

    def logits(self, x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
        """The LM head's logits in float32: ``linear(x)`` converted (a backend may write them
        in float32 directly, :class:`PackedOps`)."""
        return self.linear(x, layer).float()

    def norm_linear(self, norm: nn.Module, x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
        """``linear(rms_norm(x))``: a backend may fuse the two (:class:`PackedOps`)."""
        return self.linear(self.rms_norm(norm, x), layer)

    def norm_swiglu_add(
        self,
        norm: nn.Module,
        x: torch.Tensor,
        gate_up: nn.Linear,
        down: nn.Linear,
        residual: torch.Tensor,
    ) -> torch.Tensor:
        """``swiglu_add(rms_norm(x), ...)``: a backend may fuse the norm into the gate/up GEMM."""
        return self.swiglu_add(self.rms_norm(norm, x), gate_up, down, residual)

    def norm_swiglu(self, norm: nn.Module, x: torch.Tensor, gate_up: nn.Linear) -> torch.Tensor:
        """``swiglu(rms_norm(x), gate_up)``, fused where ``norm_swiglu_add`` is."""
        return self.swiglu(self.rms_norm(norm, x), gate_up)

    def rotary(
        self, rotary: nn.Module, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return rotary(positions, q, k)

    def layer_plan(self, layer: nn.Module) -> LayerPlan | None:
        """A decoder layer's projections with their dispatch decided once (:class:`LayerPlan`),
        or None where this backend has none: the layer's modules then run as they are."""
        return None


class OneDNNOps(TorchOps):
    """``prepack``: keep every matrix in oneDNN's blocked layout for this CPU (packed once at
    load, replacing the dense weight, so no extra memory), instead of handing oneDNN plain
    weights that it re-lays-out on every call. That re-layout costs most at decode sizes (a
    few dozen rows per step), which is also how vLLM's CPU build runs its GEMMs."""

    name = "onednn"

    # Row count oneDNN picks the packed layout for: a decode step's batch. Other row counts
    # use the same packed weights.
    PACK_ROWS = 64

    def __init__(self, prepack: bool = False) -> None:
        self._lp = torch.ops.mkldnn._linear_pointwise
        self.prepack = prepack

    def adopt(self, model: nn.Module) -> None:
        super().adopt(model)  # dense first, whatever the previous backend left
        if not self.prepack:
            return
        for lin, gate_up in linear_layers(model):
            w = lin.weight.detach()
            if gate_up:  # SiLU fuses into the gate's GEMM and the product into the up one's
                inter = w.shape[0] // 2
                up = nn.Parameter(self._pack(w[inter:].contiguous()), requires_grad=False)
                lin.up_weight = up
                w = w[:inter].contiguous()
            lin.weight = nn.Parameter(self._pack(w), requires_grad=False)

    def _pack(self, w: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._reorder_linear_weight(w, self.PACK_ROWS)

    @property
    def shape_state_rows(self) -> dict[str, int]:
        return dict.fromkeys(GEMM_NAMES, 1)  # every GEMM is oneDNN's

    def linear(self, x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
        return self._lp(x, layer.weight, layer.bias, "none", [], "")

    def linear_add(self, x: torch.Tensor, layer: nn.Linear, residual: torch.Tensor) -> torch.Tensor:
        return self._lp.binary(x, residual, layer.weight, None, "add")

    def swiglu_add(
        self, x: torch.Tensor, gate_up: nn.Linear, down: nn.Linear, residual: torch.Tensor
    ) -> torch.Tensor:
        wg, wu = _gate_up_weights(gate_up)
        gate = self._lp(x, wg, None, "swish", [], "")
        h = self._lp.binary(x, gate, wu, None, "mul")
        return self._lp.binary(h, residual, down.weight, None, "add")

    def swiglu(self, x: torch.Tensor, gate_up: nn.Linear) -> torch.Tensor:
        wg, wu = _gate_up_weights(gate_up)
        gate = self._lp(x, wg, None, "swish", [], "")
        return self._lp.binary(x, gate, wu, None, "mul")

    def rms_norm(self, norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
        out = pointwise.rms_norm(x, norm.weight, norm.eps)
        return norm(x) if out is None else out

    def rotary(
        self, rotary: nn.Module, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if pointwise.rotary_(positions, q, k, rotary.cos, rotary.sin):
            return q, k
        return rotary(positions, q, k)


def _gate_up_weights(gate_up: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """The gate and up matrices of a merged gate/up projection, for oneDNN."""
    w = gate_up.weight
    if w.layout == torch._mkldnn:  # packed by adopt: the gate rows, the up rows apart
        return w, gate_up.up_weight
    inter = w.shape[0] // 2  # row slices of a contiguous matrix are contiguous: no copies
    return w[:inter], w[inter:]


class PackedOps(OneDNNOps):
    """bf16 with kvserve's own GEMM kernels (kvserve/kernels/amx.py): every matrix whose
    dimensions are multiples of 32 is packed into the AMX tile layout at load (replacing the
    dense weight) and multiplied by the native kernel, with the bias, the residual add and
    SwiGLU's silu-and-product in its epilogue; other matrices stay with packed oneDNN.
    ``kernel`` "amx" runs on the CPU's AMX tiles; "avx512", for CPUs without them, on its
    float32 FMA units or, where they measured faster, its bf16 dot products ("avx512-dot" in
    the start-up log; :func:`kvserve.kernels.amx.avx512_dot_products`). Measured in a whole
    forward pass, each beat oneDNN's packed bf16 matmuls at every batch size, most at decode
    sizes (``benchmarks/gemm_dtypes.py``), and neither keeps per-shape state."""

    def __init__(self, kernel: str | None = "amx", dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__(prepack=True)
        self.kernel = kernel  # None (a subclass's choice): every matrix packed for oneDNN
        self.name = kernel or "onednn"
        if dtype == torch.float32:
            if kernel != "avx512":
                raise ValueError(f"PackedOps: float32 runs on the avx512 kernel, not {kernel}")
            self.name = "avx512-f32"
        elif kernel == "avx512" and amx.avx512_dot_products():
            self.name = "avx512-dot"
        self._onednn_gemms = frozenset(GEMM_NAMES)  # the GEMMs left with oneDNN (adopt)

    def _pack(self, w: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None and amx.packable(w, self.kernel):
            return amx.pack(w)
        return super()._pack(w)

    def adopt(self, model: nn.Module) -> None:
        super().adopt(model)
        left: set[str] = set()
        for names, lin in gemm_layers(model):
            if amx.is_packed(lin.weight):
                up = lin.up_weight if len(names) == 2 else None
                lin.__dict__[KERNEL_WEIGHTS] = (lin.weight, up, lin.bias)
            else:
                left.update(names)
        self._onednn_gemms = frozenset(left)

    @property
    def shape_state_rows(self) -> dict[str, int]:
        return dict.fromkeys(self._onednn_gemms, 1)  # the kernel keeps no per-shape state

    @staticmethod
    def _kernel_weights(layer: nn.Linear) -> KernelWeights | None:
        """The layer's tile-packed matrices (:meth:`adopt`'s record), or None where it stays
        with oneDNN."""
        return layer.__dict__.get(KERNEL_WEIGHTS)

    def layer_plan(self, layer: nn.Module) -> LayerPlan | None:
        """The plan of a decoder layer whose four matrices this backend packed for its kernel
        and whose output projections have no bias, for the steps the kernel takes (below
        :attr:`large_step_rows`, where a subclass has one); None otherwise."""
        qkv, o = layer.qkv_proj, layer.o_proj
        gate_up, down = layer.mlp.gate_up_proj, layer.mlp.down_proj
        kws = [self._kernel_weights(lin) for lin in (qkv, o, gate_up, down)]
        if self.kernel is None or any(kw is None for kw in kws) or o.bias is not None:
            return None
        if down.bias is not None or kws[2][1] is None:
            return None
        (wq, _, bq), (wo, _, _), (wg, wu, _), (wd, _, _) = kws
        norm1, norm2 = layer.input_layernorm, layer.post_attention_layernorm
        # bf16: the norms run inside the kernel as it copies the rows in, as norm_linear and
        # norm_swiglu_add do; float32 (no norm in that kernel): on their own, first. The
        # activations are in the weights' dtype, so the weights stand in for them here.
        in1, in2 = _bf16_norm(norm1, wq), _bf16_norm(norm2, wg)
        fused = o.fuse_residual
        k = self.kernel
        large = self.large_step_rows
        return LayerPlan(
            ops=self,
            qkv=amx.PackedLinear(wq, bias=bq, kernel=k, norm=in1),
            o=amx.PackedLinear(wo, kernel=k, residual=fused),
            gate_up=amx.PackedLinear(wg, up=wu, kernel=k, norm=in2),
            down=amx.PackedLinear(wd, kernel=k, residual=fused),
            norm1=None if in1 is not None else norm1,
            norm2=None if in2 is not None else norm2,
            tp=None if fused else o.tp,
            max_rows=large - 1 if large else LayerPlan.ANY_ROWS,
        )

    def linear(self, x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
        kw = self._kernel_weights(layer)
        if kw is not None:
            return amx.linear(x, kw[0], bias=kw[2], kernel=self.kernel)
        return super().linear(x, layer)

    def linear_add(self, x: torch.Tensor, layer: nn.Linear, residual: torch.Tensor) -> torch.Tensor:
        kw = self._kernel_weights(layer)
        if kw is not None:
            return amx.linear(x, kw[0], residual=residual, kernel=self.kernel)
        return super().linear_add(x, layer, residual)

    def swiglu_add(
        self, x: torch.Tensor, gate_up: nn.Linear, down: nn.Linear, residual: torch.Tensor
    ) -> torch.Tensor:
        return self._swiglu_add(x, gate_up, down, residual, None)

    def _swiglu_add(
        self,
        x: torch.Tensor,
        gate_up: nn.Linear,
        down: nn.Linear,
        residual: torch.Tensor,
        norm: tuple[torch.Tensor, float] | None,
    ) -> torch.Tensor:
        """``swiglu_add``, with ``norm`` (:meth:`_norm_in_kernel`'s) applied by the kernel."""
        gu = self._kernel_weights(gate_up)
        if gu is None:  # dims not multiples of 32: oneDNN's (never with a norm to apply)
            return super().swiglu_add(x, gate_up, down, residual)
        h = amx.linear(x, gu[0], up=gu[1], kernel=self.kernel, norm=norm)
        dw = self._kernel_weights(down)
        if dw is not None:
            return amx.linear(h, dw[0], residual=residual, kernel=self.kernel)
        return super().linear_add(h, down, residual)

    def swiglu(self, x: torch.Tensor, gate_up: nn.Linear) -> torch.Tensor:
        return self._swiglu(x, gate_up, None)

    def _swiglu(
        self, x: torch.Tensor, gate_up: nn.Linear, norm: tuple[torch.Tensor, float] | None
    ) -> torch.Tensor:
        gu = self._kernel_weights(gate_up)
        if gu is None:  # oneDNN's (never with a norm to apply)
            return super().swiglu(x, gate_up)
        return amx.linear(x, gu[0], up=gu[1], kernel=self.kernel, norm=norm)

    # The norm before a projection runs inside the kernel, as it copies the rows in: a
    # decode step saves a call, a pass and a buffer per norm (two per layer).
    def norm_linear(self, norm: nn.Module, x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
        fused = self._norm_in_kernel(norm, x, layer)
        if fused is None:
            return super().norm_linear(norm, x, layer)
        kw = self._kernel_weights(layer)
        return amx.linear(x, kw[0], bias=kw[2], kernel=self.kernel, norm=fused)

    def norm_swiglu_add(
        self,
        norm: nn.Module,
        x: torch.Tensor,
        gate_up: nn.Linear,
        down: nn.Linear,
        residual: torch.Tensor,
    ) -> torch.Tensor:
        fused = self._norm_in_kernel(norm, x, gate_up)
        if fused is None:
            return super().norm_swiglu_add(norm, x, gate_up, down, residual)
        return self._swiglu_add(x, gate_up, down, residual, fused)

    def norm_swiglu(self, norm: nn.Module, x: torch.Tensor, gate_up: nn.Linear) -> torch.Tensor:
        fused = self._norm_in_kernel(norm, x, gate_up)
        if fused is None:
            return super().norm_swiglu(norm, x, gate_up)
        return self._swiglu(x, gate_up, fused)

    def _norm_in_kernel(
        self, norm: nn.Module, x: torch.Tensor, layer: nn.Linear
    ) -> tuple[torch.Tensor, float] | None:
        """(weight, eps) of the RMSNorm before ``layer`` where the kernel can apply it to
        ``x`` itself (the layer packed for it, bf16 weight and input), else None."""
        if self._kernel_weights(layer) is None:
            return None
        return _bf16_norm(norm, x)

    def logits(self, x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
        kw = self._head_weights(x, layer)
        if kw is None:
            return super().logits(x, layer)
        # the bf16 logits, stored as float32 by the kernel: no pass converting them
        return amx.linear(x, kw[0], bias=kw[2], kernel=self.kernel, out_dtype=torch.float32)

    def _head_weights(self, x: torch.Tensor, layer: nn.Linear) -> KernelWeights | None:
        """The LM head's packed matrices where this backend's kernel computes ``x``'s
        logits, else None."""
        return self._kernel_weights(layer)


def _bf16_norm(norm: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, float] | None:
    """(weight, eps) of an RMSNorm whose weight and input are bf16 (the linear kernels' rows
    are), else None."""
    if x.dtype != torch.bfloat16:
        return None
    w = norm.weight
    if (
        w.dtype != torch.bfloat16
        or w.dim() != 1
        or not w.is_contiguous()
        or not isinstance(norm.eps, float)
    ):
        return None
    return w, norm.eps


class AllReduce(Protocol):
    """The group a row-parallel projection's partial products are summed over
    (:class:`kvserve.model.layers.parallel_state.TensorParallelGroup`)."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor: ...


class LayerPlan:
    """A decoder layer's four projections on a packing backend's kernel, for steps of at most
    ``max_rows`` tokens, with the dispatch the module path makes on every call decided once.

    On the module path each GEMM passes through the module's ``__call__``, its ``forward``,
    the backend's fused method, its checks of which matrices it packed, whether the step is
    large and whether the norm fits in the kernel, and :func:`kvserve.kernels.amx.linear`'s
    choice of entry point and epilogue: about a dozen Python calls, as long as the kernel
    call itself at a small model's decode sizes. The plan keeps one
    :class:`~kvserve.kernels.amx.PackedLinear` per matrix and calls the kernel with the
    arguments the module path gives it, in the same order, so the bits are the same (the
    tests compare the two). ``tp``: the group whose all-reduce stands between each output
    projection and its residual add (None with one rank: the add is the kernel's epilogue).
    ``norm1`` / ``norm2``: the RMSNorms run before the QKV and gate/up GEMMs, or None where
    the kernel applies them."""

    ANY_ROWS = 1 << 62

    __slots__ = ("ops", "qkv", "o", "gate_up", "down", "norm1", "norm2", "tp", "max_rows")

    def __init__(
        self,
        ops: TorchOps,
        qkv: amx.PackedLinear,
        o: amx.PackedLinear,
        gate_up: amx.PackedLinear,
        down: amx.PackedLinear,
        norm1: nn.Module | None,
        norm2: nn.Module | None,
        tp: AllReduce | None,
        max_rows: int,
    ) -> None:
        self.ops, self.qkv, self.o, self.gate_up, self.down = ops, qkv, o, gate_up, down
        self.norm1, self.norm2, self.tp, self.max_rows = norm1, norm2, tp, max_rows

    def qkv_rows(self, x: torch.Tensor) -> torch.Tensor:
        """``qkv_proj(x, norm=input_layernorm)``."""
        if self.norm1 is not None:
            x = self.ops.rms_norm(self.norm1, x)
        return self.qkv(x)

    def attention_out(self, attn: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``o_proj(attn, residual=residual)``."""
        if self.tp is None:
            return self.o(attn, residual)
        return self.tp.all_reduce(self.o(attn)).add_(residual)

    def mlp(self, h: torch.Tensor) -> torch.Tensor:
        """``mlp(h, norm=post_attention_layernorm, residual=h)``."""
        x = h if self.norm2 is None else self.ops.rms_norm(self.norm2, h)
        g = self.gate_up(x)
        if self.tp is None:
            return self.down(g, h)
        return self.tp.all_reduce(self.down(g)).add_(h)


class AMXOps(PackedOps):
    """bf16 on the CPU's AMX tiles (kvserve/kernels/amx_gemm.c)."""

    def __init__(self) -> None:
        super().__init__("amx")


class UpcastOps(PackedOps):
    """A bfloat16 model whose large GEMMs run on another path, for CPUs where that is faster
    (chosen by timing, :func:`large_step_gemm`): steps of at least ``min_rows`` tokens
    multiply packed oneDNN copies of the weights in ``dtype``, smaller steps the packed bf16
    matrices (kvserve's ``kernel``, see :class:`PackedOps`, or oneDNN where it is None).
    Decode-sized GEMMs stream the weights from memory, so bf16's half bytes and a kernel
    without oneDNN's per-call set-up win there; prefill-sized ones are bound by the
    multiply-adds, and which instruction does those fastest depends on the CPU:

    - ``dtype`` float32: without AMX, a Xeon's bf16 dot-product instruction (``vdpbf16ps``)
      retires half the multiply-adds per cycle of its two float32 FMA ports, so oneDNN's bf16
      GEMMs top out near half the float32 rate. The copies are float32 (the activations
      converted on the way in and out); not for the LM head, which in prefill sees only the
      sampled rows, and each costs twice the bf16 bytes.
    - ``dtype`` bfloat16: an AMD Zen 4 core splits each 512-bit FMA over two 256-bit halves
      but retires a 512-bit ``vdpbf16ps`` (twice the multiply-adds) as fast, so oneDNN's bf16
      GEMM runs at about twice the rate of any float32 FMA loop, kvserve's kernel included,
      from a few rows up. The copies are oneDNN's packed bf16 layout (the bf16 bytes once
      more), the LM head's too: a decode step's batch is above ``min_rows`` here.

    The arithmetic is the bf16 GEMM's either way: bf16 inputs (their products are exact in
    float32), float32 sums and epilogue, the result rounded to bf16 once; only the order of
    the sums differs, as between any two GEMM kernels. The KV cache and the activations stay
    bf16.

    A float32 model (``model_dtype`` float32, ``dtype`` float32) takes the same split without
    converting anything: small steps on the AVX-512 kernel's float32 tiles, large ones on
    oneDNN's float32 GEMM over a packing of its own (:func:`select_ops`).

    The copies' memory is what the KV pool and other processes would use, and for a large
    model it is large (an 8 B model: 32 GB in float32). Unless ``forced`` (the user set the
    threshold), the copies are made only when they take at most ``UPCAST_MEMORY_SHARE`` of
    the memory available at load time; otherwise every GEMM stays packed bf16 and
    :meth:`describe` says why."""

    def __init__(
        self,
        min_rows: int,
        forced: bool = False,
        kernel: str | None = None,
        dtype: torch.dtype = torch.float32,
        measure_split: bool = False,
        model_dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        super().__init__(kernel, dtype=model_dtype)
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"UpcastOps dtype: float32 or bfloat16, got {dtype}")
        if model_dtype == torch.float32 and dtype != torch.float32:
            raise ValueError("UpcastOps: a float32 model's large steps stay float32")
        self.dtype = dtype
        # A float32 model (the kernel's float32 tiles for small steps) copies nothing up: its
        # large steps run oneDNN's float32 GEMM on its own packing of the same values.
        self.model_dtype = model_dtype
        if model_dtype == torch.bfloat16:
            self.name += "-upcast" if dtype == torch.float32 else "-onednn"
        self.min_rows = min_rows
        self.forced = forced
        self.measure_split = measure_split and kernel is not None and dtype == torch.bfloat16
        self.skipped: tuple[int, int] | None = None  # (copy bytes, bytes available) if so
        self._copied: frozenset[str] = frozenset()  # the GEMMs with copies (adopt)

    def adopt(self, model: nn.Module) -> None:
        # In float32, only sampled rows reach the LM head in prefill: rarely min_rows of them.
        named = [
            (names, lin)
            for names, lin in gemm_layers(model)
            if names != ("head",) or self.dtype == torch.bfloat16
        ]
        layers = [(lin, len(names) == 2) for names, lin in named]
        # A packing backend keeps the up half of gate_up apart (see OneDNNOps.adopt).
        need = self.dtype.itemsize * sum(
            lin.weight.numel() + (lin.up_weight.numel() if gu and hasattr(lin, "up_weight") else 0)
            for lin, gu in layers
        )
        avail = available_memory()
        if not self.forced and avail is not None and need > UPCAST_MEMORY_SHARE * avail:
            self.skipped = (need, avail)
            self._copied = frozenset()
            PackedOps.adopt(self, model)  # packed bf16 for every step
            return
        self.skipped = None
        self._copied = frozenset(n for names, _ in named for n in names)
        TorchOps.adopt(self, model)  # dense bf16 first: the copies come from it
        pack = torch.ops.mkldnn._reorder_linear_weight
        copies = []
        for lin, gate_up in layers:
            w = lin.weight.detach().to(self.dtype)
            c = {"bias32": None if lin.bias is None else lin.bias.detach().to(self.dtype)}
            if gate_up:  # the gate rows and the up rows apart, as the bf16 packing keeps them
                inter = w.shape[0] // 2
                c["up_weight32"] = pack(w[inter:].contiguous(), self.PACK_ROWS)
                w = w[:inter].contiguous()
            c["weight32"] = pack(w.contiguous(), self.PACK_ROWS)
            copies.append((lin, c))
        super().adopt(model)  # packs the bf16 matrices
        for lin, c in copies:  # plain attributes, not parameters: decode steps read bf16
            lin.__dict__.update(c)
        if self.measure_split:
            self.min_rows = self._split_on(model)

    def _split_on(self, model: nn.Module) -> int:
        """The step size from which oneDNN's bf16 GEMMs beat the kernel on this model's own
        decoder layers (QKV, output and SwiGLU + down projections with their epilogues),
        timed both ways at doubling row counts over the first layers whose weights exceed
        ``SPLIT_WEIGHT_BYTES``, so that they stream from memory as in a real step.

        The start-up probe (:func:`large_step_gemm`) times one 1,024 x 1,024 matrix held in
        cache, and the crossover moves with the shapes and with where the weights come from:
        on a Zen 4 the kernel still led oneDNN at 64 rows on SmolLM2's 576-wide layers where
        the two tied on the probe's matrix. A model without such layers keeps the probe's
        answer; where the kernel still leads at the largest size timed, oneDNN takes the steps
        twice that size and more (prefill chunks, where its bf16 GEMM measured ahead). Below
        the first size timed the kernel led on every model measured."""
        chosen, size = [], 0
        for lins in decoder_gemms(model):
            if not all("weight32" in lin.__dict__ for lin in lins):
                return self.min_rows
            chosen.append(lins)
            size += sum(lin.weight.numel() * 2 for lin in lins)
            if size >= SPLIT_WEIGHT_BYTES:
                break
        if not chosen:
            return self.min_rows
        gen = torch.Generator().manual_seed(0)
        hidden, width = chosen[0][0].in_features, chosen[0][1].in_features
        found = 2 * MODEL_SPLIT_ROWS[-1]
        for rows in MODEL_SPLIT_ROWS:
            x = torch.randn(rows, hidden, generator=gen).to(torch.bfloat16)
            xo = torch.randn(rows, width, generator=gen).to(torch.bfloat16)
            self.min_rows = rows + 1  # the kernel
            t_kernel = best_time(self._layers_gemms, chosen, x, xo, reps=2)
            self.min_rows = rows  # oneDNN
            if best_time(self._layers_gemms, chosen, x, xo, reps=2) <= t_kernel:
                found = rows
                break
        return found  # adopt sets min_rows to it (the loop left the last size timed)

    def _layers_gemms(
        self, layers: list[list[nn.Linear]], x: torch.Tensor, xo: torch.Tensor
    ) -> None:
        for qkv, o, gate_up, down in layers:
            self.linear(x, qkv)
            self.linear_add(xo, o, x)
            self.swiglu_add(x, gate_up, down, x)

    @property
    def large_step_rows(self) -> int:
        return 0 if self.skipped is not None else self.min_rows

    @property
    def shape_state_rows(self) -> dict[str, int]:
        # The copies' GEMMs from min_rows; matrices the kernel cannot take at every size.
        large = dict.fromkeys(self._copied, self.large_step_rows) if self.large_step_rows else {}
        return {**large, **super().shape_state_rows}

    def describe(self) -> str:
        if self.skipped is not None:
            need, avail = (b / 2**30 for b in self.skipped)
            room = (f"of the weights would take {need:.1f} GiB, over "
                    f"{UPCAST_MEMORY_SHARE:.0%} of the {avail:.1f} GiB available")  # fmt: skip
            if self.model_dtype == torch.float32:
                return f"{self.name}: oneDNN packings {room}; the kernel at every step size"
            copies = f"{str(self.dtype).removeprefix('torch.')} copies"
            return (f"{self.name} off: {copies} {room} (KVSERVE_UPCAST_MIN_ROWS=N makes them "
                    "anyway); bf16 GEMMs")  # fmt: skip
        if self.model_dtype == torch.float32:
            return f"{self.name} (oneDNN's GEMMs in steps of {self.min_rows}+ tokens)"
        if self.dtype == torch.float32:
            return f"{self.name} (float32 GEMMs in steps of {self.min_rows}+ tokens)"
        return f"{self.name} (oneDNN's bf16 GEMMs in steps of {self.min_rows}+ tokens)"

    @property
    def large_step_dtype(self) -> torch.dtype:
        return self.dtype

    def _big(self, x: torch.Tensor, layer: nn.Linear) -> bool:
        return x.shape[0] >= self.min_rows and "weight32" in layer.__dict__

    def linear(self, x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
        if not self._big(x, layer):
            return super().linear(x, layer)
        out = self._lp(x.to(self.dtype), layer.weight32, layer.bias32, "none", [], "")
        return out.to(x.dtype)

    def linear_add(self, x: torch.Tensor, layer: nn.Linear, residual: torch.Tensor) -> torch.Tensor:
        if not self._big(x, layer):
            return super().linear_add(x, layer, residual)
        xd, rd = x.to(self.dtype), residual.to(self.dtype)
        out = self._lp.binary(xd, rd, layer.weight32, None, "add")
        return out.to(x.dtype)

    def _norm_in_kernel(
        self, norm: nn.Module, x: torch.Tensor, layer: nn.Linear
    ) -> tuple[torch.Tensor, float] | None:
        if self._big(x, layer):  # the copies' GEMM: the norm runs on its own
            return None
        return super()._norm_in_kernel(norm, x, layer)

    def _head_weights(self, x: torch.Tensor, layer: nn.Linear) -> KernelWeights | None:
        return None if self._big(x, layer) else super()._head_weights(x, layer)

    def swiglu(self, x: torch.Tensor, gate_up: nn.Linear) -> torch.Tensor:
        if not self._big(x, gate_up):
            return super().swiglu(x, gate_up)
        xd = x.to(self.dtype)
        gate = self._lp(xd, gate_up.weight32, None, "swish", [], "")
        return self._lp.binary(xd, gate, gate_up.up_weight32, None, "mul").to(x.dtype)

    def swiglu_add(
        self, x: torch.Tensor, gate_up: nn.Linear, down: nn.Linear, residual: torch.Tensor
    ) -> torch.Tensor:
        if not self._big(x, gate_up):
            return super().swiglu_add(x, gate_up, down, residual)
        xd = x.to(self.dtype)
        gate = self._lp(xd, gate_up.weight32, None, "swish", [], "")
        h = self._lp.binary(xd, gate, gate_up.up_weight32, None, "mul")
        out = self._lp.binary(h, residual.to(self.dtype), down.weight32, None, "add")
        return out.to(x.dtype)


# The GEMM timed in both dtypes to decide whether a bf16 model's large GEMMs run in float32
# (UpcastOps): prefill-sized rows, a mid-size matrix; and how much faster float32 must be,
# so that the choice does not flip with timing noise.
UPCAST_PROBE = (256, 1024, 1024)  # rows, in, out
UPCAST_GAIN = 1.25
# Steps with fewer tokens keep bf16 where the CPU has a bf16 dot product: at small decode
# batches the GEMMs stream the weights from memory, bf16's are half the bytes, and the
# conversions in and out weigh more. Timed over every layer of the benchmark models with the
# conversions (benchmarks/gemm_dtypes.py), float32 first pulls ahead at this many rows.
UPCAST_MIN_ROWS = 64
# With kvserve's AVX-512 kernel as the bf16 GEMM on a CPU whose bf16 dot product is no faster
# than its float32 FMAs (oneDNN's bf16 GEMM under UPCAST_GAIN times faster than its float32 one
# at the probe), both the kernel and oneDNN's float32 GEMM run on the float32 FMA units, and
# below this many rows the kernel is as fast or faster (it reads half the weight bytes); from
# it, oneDNN's tuned float32 GEMM was ahead in the engine's prefill.
UPCAST_MIN_ROWS_AVX512 = 128
# Where oneDNN's bf16 GEMM is the fast one, the kernel keeps the steps below the first of these
# row counts at which oneDNN's is faster on the probe's matrix.
SPLIT_PROBE_ROWS = (2, 4, 8, 16, 32, 64, 128, 256)
# The step sizes UpcastOps times on a model's own layers (measure_split), and how many bytes
# of their weights it streams per step: twice the 32 MiB last-level cache of the CPUs seen.
MODEL_SPLIT_ROWS = (16, 32, 64, 128, 256)
SPLIT_WEIGHT_BYTES = 64 << 20
# A float32 model's steps of this many tokens and more run oneDNN's float32 GEMM instead of the
# AVX-512 kernel's float32 tiles (UpcastOps with model_dtype float32): the row count from
# which the two measured even, on one thread and on two, on a 576 x 1,536 float32 matrix.
FLOAT32_KERNEL_MAX_ROWS = 64
# The share of the memory available at load time that the float32 copies may take.
UPCAST_MEMORY_SHARE = 0.25


def available_memory() -> int | None:
    """Bytes the kernel says can be allocated without swapping (``MemAvailable``), or None
    where there is no /proc/meminfo."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def large_step_gemm(kernel: str | None = None) -> tuple[int, torch.dtype] | None:
    """``(rows, dtype)``: steps of at least ``rows`` tokens run a bf16 model's GEMMs on
    oneDNN in ``dtype`` (:class:`UpcastOps`), or None for never.

    ``KVSERVE_UPCAST_MIN_ROWS`` decides when set (0 = never; float32 copies); otherwise it is
    measured on this CPU, once per process: oneDNN's bf16 GEMM against its float32 one at a
    prefill-sized step, and, with kvserve's AVX-512 kernel as the small-step GEMM (``kernel``
    "avx512") where oneDNN's bf16 one is the fast one, the step size from which it beats the
    kernel."""
    rows = envs.KVSERVE_UPCAST_MIN_ROWS
    if rows is None:
        return _measured_split(kernel)
    return (rows, torch.float32) if rows else None


@functools.cache
def _measured_split(kernel: str | None) -> tuple[int, torch.dtype] | None:
    m, k, n = UPCAST_PROBE
    gen = torch.Generator().manual_seed(0)
    x, w = (
        torch.randn(max(m, *SPLIT_PROBE_ROWS), k, generator=gen),
        torch.randn(n, k, generator=gen),
    )
    lp = torch.ops.mkldnn._linear_pointwise
    packed, best = {}, {}
    for dtype in (torch.float32, torch.bfloat16):
        xd = x[:m].to(dtype)
        try:
            packed[dtype] = torch.ops.mkldnn._reorder_linear_weight(
                w.to(dtype), OneDNNOps.PACK_ROWS
            )
            best[dtype] = best_time(lp, xd, packed[dtype], None, "none", [], "")
        except RuntimeError:  # a CPU oneDNN has no bf16 path for: the packed backend decides
            return None
    if best[torch.bfloat16] * UPCAST_GAIN <= best[torch.float32]:  # bf16's dot product wins
        if kernel != "avx512":
            return None  # oneDNN's bf16 GEMM at every size
        wk, wb = amx.pack(w.to(torch.bfloat16)), packed[torch.bfloat16]
        for rows in SPLIT_PROBE_ROWS:
            xb = x[:rows].to(torch.bfloat16)
            t_onednn = best_time(lp, xb, wb, None, "none", [], "")
            if t_onednn <= best_time(amx.linear, xb, wk, kernel=kernel):
                return rows, torch.bfloat16
        return None  # the kernel at every size
    if kernel == "avx512":
        return UPCAST_MIN_ROWS_AVX512, torch.float32
    if best[torch.bfloat16] < UPCAST_GAIN * best[torch.float32]:
        return None
    # Without a bf16 dot product (oneDNN converts), float32 wins at every size.
    return (UPCAST_MIN_ROWS if torch.cpu._is_avx512_bf16_supported() else 1), torch.float32


def select_ops(device: torch.device, dtype: torch.dtype) -> TorchOps:
    """oneDNN on CPU for float32/bfloat16 when PyTorch ships it (``KVSERVE_DISABLE_ONEDNN=1``
    forces the reference); plain PyTorch everywhere else, e.g. on CUDA."""
    if (
        device.type == "cpu"
        and dtype in (torch.float32, torch.bfloat16)
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and not envs.KVSERVE_DISABLE_ONEDNN
    ):
        # Packed weights measured faster at decode sizes in both dtypes, and for bf16 even at
        # prefill sizes on an AMX Xeon; float32's greedy tokens still equal transformers' (the
        # exactness tests). KVSERVE_DISABLE_PREPACK=1 for A/B.
        # Without AMX, which GEMM is fastest by step size depends on the CPU: large_step_gemm.
        prepack = not envs.KVSERVE_DISABLE_PREPACK
        bf16 = prepack and dtype == torch.bfloat16
        if bf16 and not envs.KVSERVE_DISABLE_AMX and amx.available():
            return AMXOps()
        # Without AMX, kvserve's AVX-512 kernel where the CPU has AVX-512 (faster than
        # oneDNN's bf16 GEMMs at every size measured; KVSERVE_DISABLE_AVX512_GEMM=1 for A/B).
        use512 = bf16 and not envs.KVSERVE_DISABLE_AVX512_GEMM
        kernel = "avx512" if use512 and amx.avx512_available() else None
        split = large_step_gemm(kernel) if bf16 else None
        if split is not None:
            forced = envs.KVSERVE_UPCAST_MIN_ROWS is not None
            return UpcastOps(split[0], forced=forced, kernel=kernel, dtype=split[1],
                             measure_split=not forced)  # fmt: skip
        if kernel is not None:
            return PackedOps(kernel)
        # float32 decode steps stream the weights too, and the kernel's float32 tiles read
        # them faster than oneDNN's GEMM; prefill-sized steps are bound by the multiply-adds,
        # where oneDNN's blocking is ahead, so they keep it on a packing of their own where
        # memory allows (KVSERVE_DISABLE_AVX512_GEMM=1 for A/B).
        f32 = prepack and dtype == torch.float32 and not envs.KVSERVE_DISABLE_AVX512_GEMM
        if f32 and amx.avx512_available():
            return UpcastOps(FLOAT32_KERNEL_MAX_ROWS, kernel="avx512", model_dtype=torch.float32)
        return OneDNNOps(prepack=prepack)
    return TorchOps()
