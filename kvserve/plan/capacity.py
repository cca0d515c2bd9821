"""The KV formula applied to a Hugging Face ``config.json``: bytes per token, per sequence,
capacity in tokens and the concurrency ceiling.

KV bytes = 2 x layers x tokens x KV heads x head dim x bytes per element (K and V), summed over
sequences. We never redo that arithmetic here: every per-token figure comes from
:func:`kvserve.kv.storage.kv_bytes_per_token`, the function the engine sizes its pool with, so a
storage format's metadata (scales, zero points) is counted exactly as the engine counts it and the
planner cannot drift from the engine. Capacity is counted in whole blocks, as the engine counts it.

Architectures the engine cannot run are still planned: the parser below only needs the shapes.
MLA (DeepSeek-V2/V3, ``kv_lora_rank``) caches one latent of ``kv_lora_rank + qk_rope_head_dim``
elements per token per layer instead of a K and a V; we pass that width as a single "head" and
halve the K+V figure, which is exact for dense formats. Sliding-window layers hold at most their
window. The engine frees the blocks behind a window: with one table when every layer has the
same window (Mistral), with a table per layer group when some layers attend everything (a
hybrid model; :mod:`kvserve.kv.layer_groups`). So the ``*_window_aware`` figures are what it
holds for a sequence (within a block or two per layer; ``kvserve plan --validate`` runs one
sequence past the window to check), and the plain figures count every layer at full length:
what it holds with ``--disable-hybrid-kv-cache-manager``, with KIVI or with offload tiers.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvserve.config import SUPPORTED_ARCHITECTURES, CacheConfig, ModelConfig
from kvserve.config_fields import default_of
from kvserve.kv.formats import KV_CACHE_DTYPES
from kvserve.kv.gpu_budget import GpuMemoryBudget

DENSE_DTYPE_BYTES = {"float32": 4.0, "bfloat16": 2.0, "float16": 2.0}
SAFETENSORS_DTYPE_BYTES = {
    "F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2,
    "I16": 2, "U16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "BOOL": 1,
}  # fmt: skip
STORAGE_FORMATS = tuple(f for f in KV_CACHE_DTYPES if f != "auto")


class PlanError(ValueError):
    """A config or option the planner cannot use; the message names the field."""


@dataclass(slots=True, frozen=True)
class ArchSpec:
    """The shapes that decide KV size, weight size and decode work."""

    architecture: str
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    max_position_embeddings: int
    torch_dtype: str
    layer_windows: tuple[int | None, ...]
    mla_latent_dim: int | None
    num_parameters: int
    num_active_parameters: int
    expert_parameters: int
    num_experts: int
    experts_per_token: int
    weight_bytes_per_param: float
    weight_bytes_on_disk: int | None

    @property
    def is_mla(self) -> bool:
        return self.mla_latent_dim is not None

    @property
    def kv_dtype_auto(self) -> str:
        """What ``--kv-cache-dtype auto`` resolves to: the checkpoint's dtype, as in the engine."""
        return self.torch_dtype if self.torch_dtype in DENSE_DTYPE_BYTES else "bfloat16"

    def weight_bytes(self, dtype: str | None = None) -> int:
        """Weights in ``dtype`` (a dense dtype), or as stored: the checkpoint's own byte count
        when its files are present, else parameters x the config's (quantized) width."""
        if dtype is not None and dtype != "auto":
            return int(self.num_parameters * DENSE_DTYPE_BYTES[dtype])
        if self.weight_bytes_on_disk is not None:
            return self.weight_bytes_on_disk
        return int(self.num_parameters * self.weight_bytes_per_param)


def load_config(path: str | Path) -> tuple[dict[str, Any], Path | None]:
    """``config.json`` as a dict, and the model directory when one was given."""
    p = Path(path)
    cfg_path = p / "config.json" if p.is_dir() else p
    if not cfg_path.exists():
        raise FileNotFoundError(f"model: config.json not found: {cfg_path}")
    with open(cfg_path) as f:
        cfg = json.load(f)
    # Multimodal wrappers (Gemma 3, Llama 4, Qwen2-VL...) keep the decoder under text_config.
    if "num_hidden_layers" not in cfg and isinstance(cfg.get("text_config"), dict):
        cfg = {**cfg, **cfg["text_config"]}
    return cfg, cfg_path.parent


def arch_from_config(cfg: dict[str, Any], model_dir: Path | None = None) -> ArchSpec:
    """Parse the shapes the planner needs from any decoder config, supported by the engine
    or not (then the engine's own parser decides the sliding windows, so the two agree)."""

    def need(name: str) -> int:
        if cfg.get(name) is None:
            raise PlanError(f"config.json: missing required field {name!r}")
        return int(cfg[name])

    layers, hidden, heads = (
        need("num_hidden_layers"),
        need("hidden_size"),
        need("num_attention_heads"),
    )
    vocab = need("vocab_size")
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    arch = (cfg.get("architectures") or [str(cfg.get("model_type", "unknown"))])[0]
    mla = None
    if cfg.get("kv_lora_rank"):
        mla = int(cfg["kv_lora_rank"]) + int(cfg.get("qk_rope_head_dim") or 0)
        kv_heads = 1
    windows = _layer_windows(cfg, arch, layers)
    params, active, experts, n_exp, k_exp = _count_parameters(cfg, layers, hidden, heads, vocab)
    if arch in SUPPORTED_ARCHITECTURES:  # the engine's exact count (norms and biases included)
        params = active = ModelConfig.from_dict(cfg).num_parameters()
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
    return ArchSpec(
        architecture=arch,
        num_layers=layers,
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        hidden_size=hidden,
        vocab_size=vocab,
        max_position_embeddings=int(cfg.get("max_position_embeddings") or 2048),
        torch_dtype=dtype,
        layer_windows=windows,
        mla_latent_dim=mla,
        num_parameters=params,
        num_active_parameters=active,
        expert_parameters=experts,
        num_experts=n_exp,
        experts_per_token=k_exp,
        weight_bytes_per_param=_weight_width(cfg, dtype),
        weight_bytes_on_disk=checkpoint_bytes(model_dir) if model_dir else None,
    )


def load_arch(path: str | Path) -> ArchSpec:
    """:class:`ArchSpec` of a model directory or a bare ``config.json`` (no weights needed)."""
    cfg, model_dir = load_config(path)
    return arch_from_config(cfg, model_dir)


def _layer_windows(cfg: dict[str, Any], arch: str, layers: int) -> tuple[int | None, ...]:
    if arch in SUPPORTED_ARCHITECTURES:
        return ModelConfig.from_dict(cfg).layer_windows
    window = cfg.get("sliding_window")
    types = cfg.get("layer_types")
    if types:
        return tuple(window if t == "sliding_attention" else None for t in types)
    if not window:
        return (None,) * layers
    window = int(window)
    pattern = cfg.get("sliding_window_pattern")
    if pattern:  # Gemma 3: every pattern-th layer is global
        return tuple(None if (i + 1) % int(pattern) == 0 else window for i in range(layers))
    if cfg.get("model_type") == "gemma2":  # even layers slide, odd ones are global
        return tuple(window if i % 2 == 0 else None for i in range(layers))
    return (window,) * layers


def _count_parameters(
    cfg: dict[str, Any], layers: int, h: int, heads: int, vocab: int
) -> tuple[int, int, int, int, int]:
    """(total, active per token, routed-expert total, experts, experts per token) from shapes.

    Dense Llama-family, Mixtral/Qwen-MoE-style experts and DeepSeek MLA are covered; norms and
    biases are left out (well under 0.1 % of any real model)."""
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    hd = int(cfg.get("head_dim") or h // heads)
    if cfg.get("kv_lora_rank"):
        r_kv, rope = int(cfg["kv_lora_rank"]), int(cfg.get("qk_rope_head_dim") or 0)
        nope, v_hd = int(cfg.get("qk_nope_head_dim") or hd), int(cfg.get("v_head_dim") or hd)
        q_rank = cfg.get("q_lora_rank")
        qk = heads * (nope + rope)
        q = h * int(q_rank) + int(q_rank) * qk if q_rank else h * qk
        attn = q + h * (r_kv + rope) + r_kv * heads * (nope + v_hd) + heads * v_hd * h
    else:
        attn = 2 * h * heads * hd + 2 * h * kv_heads * hd
    inter = int(cfg.get("intermediate_size") or 4 * h)
    n_exp = int(
        cfg.get("n_routed_experts") or cfg.get("num_local_experts") or cfg.get("num_experts") or 0
    )
    k_exp = int(cfg.get("num_experts_per_tok") or 0) if n_exp else 0
    dense_mlp = 3 * h * inter
    emb = vocab * h * (1 if cfg.get("tie_word_embeddings") else 2)
    if not n_exp:
        total = layers * (attn + dense_mlp) + emb
        return total, total, 0, 0, 0
    expert = 3 * h * int(cfg.get("moe_intermediate_size") or inter)
    shared = 3 * h * int(cfg.get("moe_intermediate_size") or inter) * int(
        cfg.get("n_shared_experts") or 0
    ) + 3 * h * int(cfg.get("shared_expert_intermediate_size") or 0)
    dense_layers = int(cfg.get("first_k_dense_replace") or 0)
    moe_layers = layers - dense_layers
    router = h * n_exp
    total = (
        layers * attn
        + dense_layers * dense_mlp
        + moe_layers * (n_exp * expert + shared + router)
        + emb
    )
    active = (
        layers * attn + dense_layers * dense_mlp + moe_layers * (k_exp * expert + shared + router)
    ) + emb
    return total, active, moe_layers * n_exp * expert, n_exp, k_exp


def _weight_width(cfg: dict[str, Any], dtype: str) -> float:
    """Bytes per parameter as the checkpoint is served: quantized configs say so."""
    q = cfg.get("quantization_config") or {}
    if q.get("bits"):
        return int(q["bits"]) / 8
    if str(q.get("quant_method", "")).startswith("fp8"):
        return 1.0
    return DENSE_DTYPE_BYTES.get(dtype, 2.0)


def checkpoint_bytes(model_dir: Path) -> int | None:
    """Exact weight bytes from the index's ``total_size`` or the safetensors headers (only
    the headers are read); None when the directory holds no weights."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        total = json.loads(index.read_text()).get("metadata", {}).get("total_size")
        if total:
            return int(total)
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        return None
    size = 0
    for p in files:
        with open(p, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        for name, t in header.items():
            if name != "__metadata__":
                size += math.prod(t["shape"]) * SAFETENSORS_DTYPE_BYTES.get(t["dtype"], 2)
    return size


# -- the formula --------------------------------------------------------------------------
def kv_heads_per_gpu(spec: ArchSpec, tp: int) -> int:
    """KV heads one GPU stores: heads split across ``tp`` ranks, replicated when there are
    fewer heads than ranks (as vLLM does); an MLA latent is replicated on every rank."""
    if spec.is_mla:
        return 1
    return max(1, math.ceil(spec.num_kv_heads / tp))


def bytes_per_token(
    spec: ArchSpec, kv_cache_dtype: str, tp: int = 1, model_dtype: str | None = None
) -> float:
    """KV bytes one token occupies on one GPU, across all layers, in the given format
    (metadata included), computed by the engine's own accounting function. ``model_dtype``
    is the compute dtype (``auto`` follows it); it defaults to the checkpoint's.

    Raises NotImplementedError for a format the engine does not implement yet."""
    from kvserve.kv.formats import kv_bytes_per_token

    mdt = model_dtype or spec.kv_dtype_auto
    fmt = mdt if kv_cache_dtype == "auto" else kv_cache_dtype
    if spec.is_mla:
        assert spec.mla_latent_dim is not None
        return kv_bytes_per_token(fmt, spec.num_layers, 1, spec.mla_latent_dim, mdt) / 2
    return kv_bytes_per_token(fmt, spec.num_layers, kv_heads_per_gpu(spec, tp), spec.head_dim, mdt)


def format_table(spec: ArchSpec, tp: int = 1) -> tuple[dict[str, float], dict[str, str]]:
    """Bytes per token for every storage format the engine implements, and for the others
    the reason they are missing. Formats are asked, never assumed, so a format that lands in
    the engine shows up here with no change to the planner."""
    ok: dict[str, float] = {}
    missing: dict[str, str] = {}
    for fmt in STORAGE_FORMATS:
        try:
            ok[fmt] = bytes_per_token(spec, fmt, tp)
        except (NotImplementedError, ValueError) as e:
            missing[fmt] = str(e)
    return ok, missing


def window_fraction(spec: ArchSpec, context: int) -> float:
    """Share of the full-length KV that layers hold at ``context`` when each sliding-window
    layer keeps only its window (1.0 without sliding layers)."""
    held = sum(min(context, w) if w else context for w in spec.layer_windows)
    return held / (context * spec.num_layers) if context else 1.0


def blocks_for(memory_bytes: float, bytes_per_tok: float, block_size: int) -> int:
    """Whole blocks that fit in ``memory_bytes``: the engine's own pool-sizing rule."""
    if memory_bytes <= 0:
        return 0
    return int(memory_bytes // (bytes_per_tok * block_size))


@dataclass(slots=True)
class Capacity:
    """What one model replica (``tp`` GPUs) can hold at a context length."""

    kv_bytes_per_token: float  # whole model (all ranks)
    kv_bytes_per_token_per_gpu: float
    kv_bytes_per_sequence: float
    kv_bytes_per_sequence_window_aware: float
    kv_bytes_total: float  # for the requested batch
    weight_bytes: int
    weight_bytes_per_gpu: float
    kv_budget_bytes_per_gpu: float
    num_blocks: int
    kv_capacity_tokens: int
    max_concurrent_sequences: int
    max_concurrent_sequences_window_aware: int


def capacity(
    spec: ArchSpec,
    kv_cache_dtype: str,
    memory_bytes: float,
    context: int,
    batch: int = 1,
    tp: int = 1,
    gpu_memory_utilization: float = 0.9,
    block_size: int = default_of(CacheConfig, "block_size"),
    weight_dtype: str | None = None,
) -> Capacity:
    """KV capacity of a ``tp``-GPU replica: memory x utilization minus this rank's weight
    shard, counted in whole blocks; the concurrency ceiling at ``context`` tokens each.

    The engine's own rule (:class:`~kvserve.kv.gpu_budget.GpuMemoryBudget`) without the
    terms only a run measures: activations, CUDA graphs and memory outside torch are not
    subtracted (the formula excludes them, as the seed says); ``gpu_memory_utilization`` is
    the margin that leaves room for them."""
    if context < 1:
        raise PlanError(f"context: must be >= 1 token, got {context}")
    if tp < 1:
        raise PlanError(f"tp: must be >= 1, got {tp}")
    if not 0 < gpu_memory_utilization <= 1:
        raise PlanError(f"gpu_memory_utilization: must be in (0, 1], got {gpu_memory_utilization}")
    per_gpu = bytes_per_token(spec, kv_cache_dtype, tp)
    whole = bytes_per_token(spec, kv_cache_dtype, 1)
    weights = spec.weight_bytes(weight_dtype)
    gpu = GpuMemoryBudget(memory_bytes, gpu_memory_utilization, weights / tp, 0, 0,
                          per_gpu * block_size)  # fmt: skip
    budget, blocks = gpu.kv_budget_bytes, gpu.num_blocks
    seq_blocks = math.ceil(context / block_size)
    frac = window_fraction(spec, context)
    seq_blocks_wa = max(1, math.ceil(context * frac / block_size))
    return Capacity(
        kv_bytes_per_token=whole,
        kv_bytes_per_token_per_gpu=per_gpu,
        kv_bytes_per_sequence=whole * context,
        kv_bytes_per_sequence_window_aware=whole * context * frac,
        kv_bytes_total=whole * context * batch,
        weight_bytes=weights,
        weight_bytes_per_gpu=weights / tp,
        kv_budget_bytes_per_gpu=budget,
        num_blocks=blocks,
        kv_capacity_tokens=blocks * block_size,
        max_concurrent_sequences=blocks // seq_blocks,
        max_concurrent_sequences_window_aware=blocks // seq_blocks_wa,
    )
