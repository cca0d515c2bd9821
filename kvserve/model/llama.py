"""The Llama family (Llama, Qwen2 with qkv bias, Mistral with sliding windows) over a flat batch.

The network sees one flat batch of tokens (``[T]`` ids and positions) from many sequences; only
attention knows about sequences, through :class:`AttentionMetadata`. Its linear layers, MLP,
embedding and LM head are the parallel modules of :mod:`kvserve.model.layers`: each holds its
tensor-parallel shard (Q/K/V and gate/up fused into one matmul each as they load) and its
compute backend, so this code reads the same at any world size and on any backend. Keys are
stored after rotary embedding, as transformers does, so cached K/V match the reference's to
float32 rounding.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from kvserve.attention.backend import AttentionBackend
from kvserve.attention.layer import Attention
from kvserve.attention.metadata import AttentionMetadata
from kvserve.attention.registry import make_backend
from kvserve.attention.rotary import apply_rotary
from kvserve.config import ModelConfig
from kvserve.kv.storage import KVStorage
from kvserve.model.layers import (
    MLP,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    TensorParallelGroup,
    VocabParallelEmbedding,
    set_linear_ops,
)
from kvserve.model.linear_ops import LayerPlan, TorchOps


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies with the checkpoint's rope scaling (default, linear, llama3)."""
    dim = int(cfg.head_dim * cfg.partial_rotary_factor)
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    sc = cfg.rope_scaling
    if not sc:
        return inv
    factor = float(sc.get("factor", 1.0))
    if sc["rope_type"] == "linear":
        return inv / factor
    # llama3: long wavelengths slowed by `factor`, short ones kept, a smooth ramp between.
    low, high = float(sc.get("low_freq_factor", 1.0)), float(sc.get("high_freq_factor", 4.0))
    old_len = float(sc.get("original_max_position_embeddings", cfg.max_position_embeddings))
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int, device: torch.device) -> None:
        super().__init__()
        inv = rope_inv_freq(cfg).to(device)
        t = torch.arange(max_positions, device=device, dtype=torch.int64).float()
        freqs = torch.outer(t, inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.rot_dim = emb.shape[-1]
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos = self.cos[positions].to(q.dtype)[:, None, :]
        sin = self.sin[positions].to(q.dtype)[:, None, :]
        return apply_rotary(q, cos, sin, self.rot_dim), apply_rotary(k, cos, sin, self.rot_dim)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


class DecoderLayer(nn.Module):
    """One block; ``num_heads`` and ``num_kv_heads`` are this tensor-parallel rank's."""

    def __init__(
        self,
        cfg: ModelConfig,
        layer_idx: int,
        attention: AttentionBackend,
        tp: TensorParallelGroup | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = cfg.head_dim
        self.window = cfg.layer_windows[layer_idx]
        h = cfg.hidden_size
        self.qkv_proj = QKVParallelLinear(
            h, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads,
            bias=cfg.attention_bias, tp=tp, params_dtype=dtype,
        )  # fmt: skip
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.o_proj = RowParallelLinear(
            cfg.num_attention_heads * cfg.head_dim, h, bias=False, tp=tp, params_dtype=dtype,
            gemm_names=("o",),
        )  # fmt: skip
        self.mlp = MLP(h, cfg.intermediate_size, tp=tp, params_dtype=dtype)
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps, dtype)
        self.ops: TorchOps = TorchOps()  # rotary
        self.attn = Attention(attention, self.window)
        self.plan: LayerPlan | None = None  # the backend's, where it has one (set_ops)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        storage: KVStorage,
        meta: AttentionMetadata,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The layer's output for every token, or with ``rows`` (the last layer) for those rows
        only: every token's K/V is still written and attended, but the output projection and
        the MLP run only where a later step reads the result."""
        t = x.shape[0]
        ops = self.ops
        plan = self.plan
        if plan is not None and t > plan.max_rows:
            plan = None
        if plan is not None:  # the same kernel calls as the modules', decided once
            qkv = plan.qkv_rows(x)
        else:
            qkv = self.qkv_proj(x, norm=self.input_layernorm)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        q, k = ops.rotary(rotary, positions, q, k)  # the fast path rotates q and k in place
        attn = self.attn(q, k, v, self.layer_idx, storage, meta)
        attn = attn.reshape(t, self.q_size)
        if rows is not None:
            attn, x = attn[rows], x[rows]
            if not x.shape[0]:
                return x
        if plan is not None:
            return plan.mlp(plan.attention_out(attn, x))
        h = self.o_proj(attn, residual=x)
        return self.mlp(h, norm=self.post_attention_layernorm, residual=h)


class LlamaForCausalLM(nn.Module):
    """Llama / Qwen2 / Mistral decoder over a flat batch of tokens with a paged KV cache.

    Built for one rank of ``tp`` (one rank by default) with ``dtype`` weights, uninitialized:
    the loader fills them through each parameter's ``weight_loader``."""

    def __init__(
        self,
        cfg: ModelConfig,
        max_positions: int,
        device: torch.device,
        dtype: torch.dtype | None = None,
        tp: TensorParallelGroup | None = None,
    ) -> None:
        super().__init__()
        self.config = cfg
        h = cfg.hidden_size
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, h, tp=tp, params_dtype=dtype)
        attention = make_backend(None, torch.device(device))  # the runner may choose another
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, attention, tp, dtype) for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(h, cfg.rms_norm_eps, dtype)
        self.lm_head = ParallelLMHead(cfg.vocab_size, h, tp=tp, params_dtype=dtype)
        if cfg.tie_word_embeddings:
            self.lm_head.tie_weights(self.embed_tokens)
        self.rotary = RotaryEmbedding(cfg, max_positions, device)
        self.ops: TorchOps = TorchOps()

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        storage: KVStorage,
        meta: AttentionMetadata,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final hidden states (normed) ``[T, hidden]``, or ``[len(rows), hidden]`` for the
        token rows ``rows`` (int64, repeats allowed) in that order; logits come from
        :meth:`logits`.

        A step reads the final hidden state of few of its tokens (the last of each sequence
        that samples, and rows asked for prompt logprobs), so with ``rows`` the last layer
        runs its output projection and MLP on those rows only: a prefill chunk of thousands
        of tokens skips nearly all of that layer's work after attention, a chunk that
        finishes no prompt all of it. The result for a kept row is the same computation."""
        x = self.embed_tokens(input_ids)
        meta.rotary = self.rotary  # a sink retention policy re-rotates queries with it
        by_layer = meta.by_layer
        if by_layer is not None:  # a hybrid model: each layer group's own block tables
            for m in by_layer:
                m.rotary = self.rotary
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            m = meta if by_layer is None else by_layer[i]
            x = layer(x, positions, self.rotary, storage, m, rows if i == last else None)
        if not x.shape[0]:
            return x
        return self.ops.rms_norm(self.norm, x)

    def set_ops(self, ops: TorchOps) -> None:
        """Choose the compute backend (see :mod:`kvserve.model.linear_ops`): every linear
        module, MLP and the LM head computes through it (the layers also rotate with it, and
        the final norm runs on it)."""
        set_linear_ops(self, ops)  # the backend may keep the matrices in a layout of its own
        self.ops = ops
        for layer in self.layers:
            layer.ops = ops
            layer.plan = ops.layer_plan(layer)

    def set_attention_backend(self, backend: AttentionBackend) -> None:
        """Choose the attention backend of every layer (see :mod:`kvserve.attention`)."""
        for layer in self.layers:
            layer.attn.backend = backend

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    @property
    def lm_head_fp32(self) -> torch.Tensor | None:
        """The float32 LM head the loader keeps beside a reduced-precision model (None in
        float32)."""
        return self.lm_head.weight_fp32

    def exact_logits(self, hidden: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """Float32 logits of ``token_ids`` ([n, k]) for hidden rows [n, hidden], from
        :attr:`lm_head_fp32` (the sampler uses them to settle greedy near-ties)."""
        return self.lm_head.exact_logits(hidden, token_ids)
