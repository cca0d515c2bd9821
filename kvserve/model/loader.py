"""Load a Hugging Face checkpoint directory (single or sharded safetensors) into our model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors import safe_open

from kvserve.config import ModelConfig
from kvserve.model.layers import TensorParallelGroup, default_weight_loader
from kvserve.model.linear_ops import select_ops
from kvserve.model.llama import LlamaForCausalLM


class ModelLoadError(ValueError):
    """The checkpoint is missing a file or a tensor, or a tensor has the wrong shape."""


def weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        files = [model_dir / s for s in shards]
        missing = [str(p) for p in files if not p.exists()]
        if missing:
            raise ModelLoadError(f"model: missing weight shard(s): {', '.join(missing)}")
        return files
    single = model_dir / "model.safetensors"
    if single.exists():
        return [single]
    raise ModelLoadError(
        f"model: no weights in {model_dir} (expected model.safetensors or "
        "model.safetensors.index.json; .bin checkpoints are not supported)"
    )


def _read_tensors(files: list[Path]) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                tensors[name] = f.get_tensor(name)
    return tensors


class CheckpointTensor(NamedTuple):
    """A checkpoint tensor the model loads and where it goes: ``shard`` is which part of the
    parameter it is (q/k/v of the fused QKV projection, 0/1 of the fused gate/up one), None
    for a parameter of its own."""

    name: str
    shape: tuple[int, ...]
    param: str
    shard: str | int | None = None


def checkpoint_tensors(cfg: ModelConfig) -> list[CheckpointTensor]:
    """Every tensor of a Hugging Face Llama-family checkpoint the model loads. A tied LM head
    is the embedding table's parameter and has none."""
    h, inter = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    out = [
        CheckpointTensor("model.embed_tokens.weight", (cfg.vocab_size, h), "embed_tokens.weight"),
        CheckpointTensor("model.norm.weight", (h,), "norm.weight"),
    ]
    if not cfg.tie_word_embeddings:
        out.append(CheckpointTensor("lm_head.weight", (cfg.vocab_size, h), "lm_head.weight"))
    for i in range(cfg.num_hidden_layers):
        p, ours = f"model.layers.{i}.", f"layers.{i}."
        for kind in ("weight", "bias") if cfg.attention_bias else ("weight",):
            for shard, rows in (("q", q), ("k", kv), ("v", kv)):
                shape = (rows, h) if kind == "weight" else (rows,)
                out.append(CheckpointTensor(f"{p}self_attn.{shard}_proj.{kind}", shape,
                                            f"{ours}qkv_proj.{kind}", shard))  # fmt: skip
        out += [
            CheckpointTensor(p + "self_attn.o_proj.weight", (h, q), ours + "o_proj.weight"),
            CheckpointTensor(p + "mlp.gate_proj.weight", (inter, h),
                             ours + "mlp.gate_up_proj.weight", 0),
            CheckpointTensor(p + "mlp.up_proj.weight", (inter, h),
                             ours + "mlp.gate_up_proj.weight", 1),
            CheckpointTensor(p + "mlp.down_proj.weight", (h, inter), ours + "mlp.down_proj.weight"),
        ]  # fmt: skip
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out.append(CheckpointTensor(f"{p}{norm}.weight", (h,), f"{ours}{norm}.weight"))
    return out


def load_model(
    model_dir: str | Path,
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    tp: TensorParallelGroup | None = None,
) -> LlamaForCausalLM:
    """The checkpoint's model in ``dtype`` on ``device``, this rank's shards of it for one
    rank of ``tp``, with the compute backend :func:`select_ops` picks for them."""
    model_dir = Path(model_dir)
    tensors = _read_tensors(weight_files(model_dir))

    def take(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        t = tensors.get(name)
        if t is None:
            raise ModelLoadError(f"model: missing tensor {name!r} in {model_dir}")
        if tuple(t.shape) != shape:
            raise ModelLoadError(
                f"model: tensor {name!r} has shape {tuple(t.shape)}, expected {shape}"
            )
        return t

    entries = checkpoint_tensors(cfg)
    for e in entries:  # every tensor checked before any is copied
        take(e.name, e.shape)
    model = LlamaForCausalLM(cfg, max_positions, device, dtype, tp).to(device)
    if dtype != torch.float32:  # for settling greedy near-ties in float32 (see the sampler)
        head = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
        model.lm_head.keep_float32(tensors[head])
    # Each parameter's loader keeps this rank's shard (vLLM's weight_loader convention); the
    # checkpoint's copy is freed as it goes.
    params = dict(model.named_parameters())
    for e in entries:
        param = params[e.param]
        loader = getattr(param, "weight_loader", default_weight_loader)
        loader(param, tensors.pop(e.name), e.shard)
    unfilled = params.keys() - {e.param for e in entries}
    if unfilled:  # would stay uninitialized: checkpoint_tensors misses a parameter
        raise ModelLoadError(f"model: no checkpoint tensor for {', '.join(sorted(unfilled))}")
    model.set_ops(select_ops(device, dtype))
    return model.eval().requires_grad_(False)


def load_kv_scales(
    model_dir: str | Path, cfg: ModelConfig
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """fp8 KV dequantization scales the checkpoint provides, as ``[num_layers, n]`` float32
    (``n`` is 1 or the KV head count), for K and for V; None where it provides none.

    Per-layer tensors ``model.layers.{i}.self_attn.k_scale`` / ``v_scale`` (scalars or one per
    KV head, the layout vLLM-quantized checkpoints use) win over global ``k_scale`` /
    ``v_scale`` floats in config.json. Only tensor names are listed, no weights are read."""
    files = weight_files(Path(model_dir))
    found: dict[str, dict[int, torch.Tensor]] = {"k_scale": {}, "v_scale": {}}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                parts = name.split(".")
                if len(parts) == 5 and parts[-1] in found and parts[-2] == "self_attn":
                    found[parts[-1]][int(parts[2])] = f.get_tensor(name).float().reshape(-1)
    out: list[torch.Tensor | None] = []
    for key, glob in (("k_scale", cfg.k_scale), ("v_scale", cfg.v_scale)):
        per_layer = found[key]
        if len(per_layer) == cfg.num_hidden_layers:
            rows = [per_layer[i] for i in range(cfg.num_hidden_layers)]
            width = max(r.numel() for r in rows)
            out.append(torch.stack([r.expand(width) for r in rows]))
        elif per_layer:
            raise ModelLoadError(
                f"model: {key} present for {len(per_layer)} of {cfg.num_hidden_layers} layers"
            )
        elif glob is not None:
            out.append(torch.full((cfg.num_hidden_layers, 1), float(glob)))
        else:
            out.append(None)
    return out[0], out[1]
