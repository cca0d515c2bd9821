"""Deterministic random checkpoints in Hugging Face format, written without ``transformers``.

Tests load the same directory in ``transformers`` and in kvserve and compare them; benchmarks
use it for the ~5 M and ~50 M parameter random Llamas. The default init std (0.15) makes
greedy outputs diverse on tiny configs: a model that repeats one token would prove nothing.
The tokenizer is a plain byte-level BPE with no merges (every byte is a token) plus BOS/EOS.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

ARCH = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mistral": "MistralForCausalLM",
}
SPECIAL_TOKENS = ["<s>", "</s>", "<pad>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}"
    "\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def byte_level_tokenizer_json() -> dict[str, Any]:
    """tokenizer.json of a byte-level BPE without merges: ids 0-255 are bytes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_chars = sorted(alphabet, key=lambda c: _byte_of(c))
    vocab = {c: i for i, c in enumerate(byte_chars)}
    for i, t in enumerate(SPECIAL_TOKENS):
        vocab[t] = 256 + i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 256)]
    )
    return json.loads(tok.to_str())


def _byte_of(ch: str) -> int:
    """Inverse of GPT-2's bytes_to_unicode for one character."""
    printable = list(range(ord("!"), ord("~") + 1))
    printable += list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[chr(b)] = b
        else:
            mapping[chr(256 + extra)] = b
            extra += 1
    return mapping[ch]


def make_random_checkpoint(
    path: str | Path,
    arch: str = "llama",
    vocab_size: int = 320,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int | None = None,
    max_position_embeddings: int = 2048,
    rope_theta: float = 10000.0,
    rope_scaling: dict[str, Any] | None = None,
    sliding_window: int | None = None,
    tie_word_embeddings: bool = False,
    init_std: float = 0.15,
    seed: int = 0,
    dtype: str = "float32",
) -> Path:
    """Write config.json, model.safetensors, tokenizer files and generation_config.json."""
    if arch not in ARCH:
        raise ValueError(f"arch: must be one of {', '.join(ARCH)}, got {arch!r}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    hd = head_dim or hidden_size // num_heads
    g = torch.Generator().manual_seed(seed)

    def randn(*shape: int, std: float = init_std) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    t: dict[str, torch.Tensor] = {"model.embed_tokens.weight": randn(vocab_size, hidden_size)}
    q, kv = num_heads * hd, num_kv_heads * hd
    for i in range(num_layers):
        p = f"model.layers.{i}."
        t[p + "self_attn.q_proj.weight"] = randn(q, hidden_size)
        t[p + "self_attn.k_proj.weight"] = randn(kv, hidden_size)
        t[p + "self_attn.v_proj.weight"] = randn(kv, hidden_size)
        t[p + "self_attn.o_proj.weight"] = randn(hidden_size, q)
        if arch == "qwen2":
            t[p + "self_attn.q_proj.bias"] = randn(q, std=0.1)
            t[p + "self_attn.k_proj.bias"] = randn(kv, std=0.1)
            t[p + "self_attn.v_proj.bias"] = randn(kv, std=0.1)
        t[p + "mlp.gate_proj.weight"] = randn(intermediate_size, hidden_size)
        t[p + "mlp.up_proj.weight"] = randn(intermediate_size, hidden_size)
        t[p + "mlp.down_proj.weight"] = randn(hidden_size, intermediate_size)
        t[p + "input_layernorm.weight"] = 1 + randn(hidden_size, std=0.1)
        t[p + "post_attention_layernorm.weight"] = 1 + randn(hidden_size, std=0.1)
    t["model.norm.weight"] = 1 + randn(hidden_size, std=0.1)
    if not tie_word_embeddings:
        t["lm_head.weight"] = randn(vocab_size, hidden_size)
    torch_dtype = getattr(torch, dtype)
    save_file(
        {k: v.to(torch_dtype).contiguous() for k, v in t.items()},
        str(path / "model.safetensors"),
        metadata={"format": "pt"},
    )

    bos, eos = 256, 257
    config: dict[str, Any] = {
        "architectures": [ARCH[arch]],
        "model_type": arch,
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": hd,
        "hidden_act": "silu",
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "rope_theta": rope_theta,
        "tie_word_embeddings": tie_word_embeddings,
        "attention_bias": arch == "qwen2",
        "bos_token_id": bos,
        "eos_token_id": eos,
        "torch_dtype": dtype,
    }
    if rope_scaling:
        config["rope_scaling"] = rope_scaling
    if arch == "mistral":
        config["sliding_window"] = sliding_window
    if arch == "qwen2":
        config["use_sliding_window"] = sliding_window is not None
        config["sliding_window"] = sliding_window
        config["max_window_layers"] = 0
    (path / "config.json").write_text(json.dumps(config, indent=2))
    (path / "generation_config.json").write_text(
        json.dumps({"bos_token_id": bos, "eos_token_id": eos}, indent=2)
    )
    (path / "tokenizer.json").write_text(json.dumps(byte_level_tokenizer_json()))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<s>",
                "eos_token": "</s>",
                "pad_token": "<pad>",
                "model_max_length": max_position_embeddings,
                "chat_template": CHAT_TEMPLATE,
                "tokenizer_class": "PreTrainedTokenizerFast",
            },
            indent=2,
        )
    )
    (path / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"})
    )
    return path
