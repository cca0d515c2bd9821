"""Load a Hugging Face checkpoint directory (single or sharded safetensors) into our model."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from kvserve.config import ConfigError, ModelConfig
from kvserve.kv.storage import TORCH_DTYPES
from kvserve.model.linear_ops import select_ops
from kvserve.model.llama import LlamaForCausalLM


class ModelLoadError(ValueError):
    """The checkpoint is missing a file or a tensor, or a tensor has the wrong shape."""


def resolve_dtype(dtype: str, cfg: ModelConfig) -> torch.dtype:
    """``auto`` follows the checkpoint's ``torch_dtype`` (float32 when it names none)."""
    if dtype == "auto":
        return TORCH_DTYPES.get(cfg.torch_dtype, torch.float32)
    if dtype not in TORCH_DTYPES:
        raise ConfigError(f"dtype: must be one of auto, {', '.join(TORCH_DTYPES)}, got {dtype!r}")
    return TORCH_DTYPES[dtype]


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


@contextmanager
def _skip_init() -> Iterator[None]:
    """Build the module tree without initializing the weights the checkpoint replaces: their
    random init costs seconds on a 100 M-parameter model, and building on the meta device
    instead costs importing torch._dynamo (over a second). Parameters are left as allocated
    (``torch.empty``) until ``load_state_dict(assign=True)`` puts the real ones in."""
    classes = (nn.Linear, nn.Embedding)
    saved = [c.reset_parameters for c in classes]
    for c in classes:
        c.reset_parameters = lambda self: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        for c, f in zip(classes, saved, strict=True):
            c.reset_parameters = f  # type: ignore[method-assign]


def load_model(
    model_dir: str | Path,
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
) -> LlamaForCausalLM:
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

    h, inter = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    state: dict[str, torch.Tensor] = {
        "embed_tokens.weight": take("model.embed_tokens.weight", (cfg.vocab_size, h)),
        "norm.weight": take("model.norm.weight", (h,)),
    }
    if cfg.tie_word_embeddings:
        state["lm_head.weight"] = state["embed_tokens.weight"]
    else:
        state["lm_head.weight"] = take("lm_head.weight", (cfg.vocab_size, h))
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        state[f"layers.{i}.qkv_proj.weight"] = torch.cat(
            [take(a + "q_proj.weight", (q, h)), take(a + "k_proj.weight", (kv, h)),
             take(a + "v_proj.weight", (kv, h))]
        )  # fmt: skip
        if cfg.attention_bias:
            state[f"layers.{i}.qkv_proj.bias"] = torch.cat(
                [take(a + "q_proj.bias", (q,)), take(a + "k_proj.bias", (kv,)),
                 take(a + "v_proj.bias", (kv,))]
            )  # fmt: skip
        state[f"layers.{i}.o_proj.weight"] = take(a + "o_proj.weight", (h, q))
        state[f"layers.{i}.gate_up_proj.weight"] = torch.cat(
            [
                take(p + "mlp.gate_proj.weight", (inter, h)),
                take(p + "mlp.up_proj.weight", (inter, h)),
            ]
        )
        state[f"layers.{i}.down_proj.weight"] = take(p + "mlp.down_proj.weight", (h, inter))
        state[f"layers.{i}.input_layernorm.weight"] = take(p + "input_layernorm.weight", (h,))
        state[f"layers.{i}.post_attention_layernorm.weight"] = take(
            p + "post_attention_layernorm.weight", (h,)
        )

    with _skip_init():
        model = LlamaForCausalLM(cfg, max_positions, device).to(device)
    tied = state["lm_head.weight"] is state["embed_tokens.weight"]
    head_fp32 = state["lm_head.weight"].to(device=device, dtype=torch.float32)
    state = {k: v.to(device=device, dtype=dtype) for k, v in state.items()}
    if tied:
        state["lm_head.weight"] = state["embed_tokens.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    if dtype != torch.float32:  # for settling greedy near-ties in float32 (see the sampler)
        model.lm_head_fp32 = head_fp32
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
