"""llama.cpp's GGUF checkpoints: read with the ``gguf`` package, dequantized, turned into a
Hugging Face-format directory the engine loads like any other, and cached.

What is mapped (as llama.cpp's ``convert_hf_to_gguf.py`` and transformers' GGUF loader do):

- the architecture and shapes from the ``{arch}.*`` metadata keys into a ``config.json``
  (``llama`` and ``qwen2``; tied embeddings when the file has no ``output.weight``);
- tensor names ``token_embd``, ``blk.N.attn_q`` ... ``output`` onto ours, and the Q/K rows of
  Llama-family files back from llama.cpp's rotary layout (it interleaves each head's two
  halves; our rotary, like transformers', rotates halves);
- every tensor dequantized to float32 by ``gguf.quants.dequantize`` (each type that package
  can dequantize; others are refused by name), kept in float32 on disk so that ``--dtype``
  decides the compute precision at load (``auto``: the device's fast dtype,
  :mod:`kvserve.model.dtype`);
- the tokenizer from ``tokenizer.ggml.*`` (byte-level BPE: ``tokenizer.ggml.model = gpt2``,
  with the pre-tokenizer ``tokenizer.ggml.pre`` names) into ``tokenizer.json``, and the chat
  template into ``tokenizer_config.json``. Other tokenizer models are refused with a pointer to
  ``--tokenizer DIR``.

The converted directory lives under the user cache, keyed by the file's path, size and
modification time, so the second start skips the conversion.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from kvserve.config import user_cache_dir

CONVERTER_VERSION = 1
# Written into every converted directory: where it came from, and that it came from a GGUF file
# (kvserve.model.dtype: ``--dtype auto`` then picks the device's fast dtype).
GGUF_MARKER = "kvserve_gguf.json"
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
# llama.cpp permutes Q and K rows of these architectures for its rotary kernel.
PERMUTED_QK = {"llama"}
# tokenizer.ggml.pre -> the pre-tokenizer regex llama.cpp uses for it (None: GPT-2's own).
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZERS = {"default": None, "gpt2": None, "smollm": "digits", "qwen2": _QWEN2_SPLIT,
                  "llama-bpe": _LLAMA3_SPLIT}  # fmt: skip
TOKEN_CONTROL, TOKEN_USER_DEFINED = 3, 4


class GGUFError(ValueError):
    """A GGUF file the engine cannot use; the message names the file and what is wrong."""


def _reader(path: Path) -> Any:
    from gguf import GGUFReader

    try:
        return GGUFReader(str(path))
    except Exception as e:  # noqa: BLE001 - any parse failure is a malformed file to report
        msg = f"model: {path} is not a readable GGUF file ({type(e).__name__}: {e})"
        raise GGUFError(msg) from None


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def _require(reader: Any, key: str, path: Path) -> Any:
    value = _field(reader, key)
    if value is None:
        raise GGUFError(f"model: {path} lacks the GGUF metadata key {key!r}")
    return value


def gguf_config(reader: Any, path: Path) -> dict[str, Any]:
    """A ``config.json`` for the file, from its ``{arch}.*`` metadata."""
    arch = _require(reader, "general.architecture", path)
    if arch not in ARCHITECTURES:
        raise GGUFError(
            f"model: {path} has GGUF architecture {arch!r}; supported: {', '.join(ARCHITECTURES)}"
        )
    heads = int(_require(reader, f"{arch}.attention.head_count", path))
    hidden = int(_require(reader, f"{arch}.embedding_length", path))
    head_dim = int(_field(reader, f"{arch}.attention.key_length", hidden // heads))
    tokens = _field(reader, "tokenizer.ggml.tokens")
    vocab = int(_field(reader, f"{arch}.vocab_size", len(tokens) if tokens else 0))
    names = {t.name for t in reader.tensors}
    cfg: dict[str, Any] = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(_require(reader, f"{arch}.feed_forward_length", path)),
        "num_hidden_layers": int(_require(reader, f"{arch}.block_count", path)),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(_field(reader, f"{arch}.context_length", 2048)),
        "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "torch_dtype": "float32",
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
    }
    rot = _field(reader, f"{arch}.rope.dimension_count")
    if rot is not None and int(rot) != head_dim:
        cfg["partial_rotary_factor"] = int(rot) / head_dim
    scaling = _field(reader, f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        if scaling != "linear":
            raise GGUFError(f"model: {path} uses rope scaling {scaling!r}; supported: linear")
        factor = float(_require(reader, f"{arch}.rope.scaling.factor", path))
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": factor}
    if "rope_freqs.weight" in names:
        raise GGUFError(f"model: {path} carries per-frequency rope factors (rope_freqs), "
                        "which kvserve does not support")  # fmt: skip
    window = _field(reader, f"{arch}.attention.sliding_window")
    if window:
        cfg["sliding_window"] = int(window)
        if arch == "qwen2":
            cfg["use_sliding_window"] = True
    return cfg


def _hf_name(name: str) -> str | None:
    """Our (transformers') tensor name for a llama.cpp one; None for one we do not map."""
    top = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight":
           "model.norm.weight", "output.weight": "lm_head.weight"}  # fmt: skip
    if name in top:
        return top[name]
    parts = name.split(".")
    if len(parts) != 4 or parts[0] != "blk":
        return None
    _, layer, kind, suffix = parts
    sub = {
        "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
    }.get(kind)  # fmt: skip
    return None if sub is None else f"model.layers.{layer}.{sub}.{suffix}"


def unpermute_rotary_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K permutation: within each head it stores the rows of the two rotary
    halves interleaved (row 2i, 2i+1 from rows i and i + d/2); put the halves back."""
    d = w.shape[0] // n_head
    return w.reshape(n_head, d // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensors(reader: Any, cfg: dict[str, Any], path: Path) -> dict[str, np.ndarray]:
    """Every tensor dequantized to float32, under our names."""
    from gguf.quants import dequantize

    arch = cfg["model_type"]
    out: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        name = _hf_name(t.name)
        if name is None:
            raise GGUFError(f"model: {path} has tensor {t.name!r}, which kvserve does not map")
        try:
            w = np.array(dequantize(t.data, t.tensor_type), dtype=np.float32)  # owned, writable
        except NotImplementedError:
            raise GGUFError(
                f"model: tensor {t.name!r} of {path} is stored as {t.tensor_type.name}, which "
                "the gguf package cannot dequantize"
            ) from None
        shape = tuple(int(x) for x in reversed(t.shape))  # GGUF lists the fastest dim first
        w = w.reshape(shape)
        if arch in PERMUTED_QK and t.name.endswith((".attn_q.weight", ".attn_k.weight")):
            heads = (
                cfg["num_attention_heads"] if ".attn_q." in t.name else cfg["num_key_value_heads"]
            )
            w = unpermute_rotary_rows(w, heads)
        out[name] = np.ascontiguousarray(w)
    return out


def gguf_tokenizer(reader: Any, path: Path) -> tuple[Any, dict[str, Any]]:
    """(a ``tokenizers.Tokenizer``, tokenizer_config.json contents) from the file's metadata."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
    )

    kind = _field(reader, "tokenizer.ggml.model")
    if kind is None:
        raise GGUFError(f"model: {path} carries no tokenizer; pass --tokenizer DIR")
    if kind != "gpt2":
        raise GGUFError(
            f"model: {path} has a {kind!r} tokenizer (tokenizer.ggml.model); kvserve builds "
            "byte-level BPE ('gpt2') tokenizers from GGUF: pass --tokenizer DIR with the "
            "model's tokenizer.json"
        )
    pre = _field(reader, "tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise GGUFError(
            f"model: {path} needs the pre-tokenizer {pre!r} (tokenizer.ggml.pre), which "
            f"kvserve does not know (known: {', '.join(PRE_TOKENIZERS)}); pass --tokenizer DIR"
        )
    tokens = list(_require(reader, "tokenizer.ggml.tokens", path))
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges", [])]
    types = list(_field(reader, "tokenizer.ggml.token_type", [1] * len(tokens)))
    try:
        tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
    except Exception as e:  # noqa: BLE001 - the tokenizers library raises a bare Exception
        raise GGUFError(f"model: the tokenizer metadata of {path} is inconsistent: {e}") from None
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    split = PRE_TOKENIZERS[pre]
    if split is None:
        tok.pre_tokenizer = byte_level
    elif split == "digits":
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])  # fmt: skip
    tok.decoder = decoders.ByteLevel()
    special = [t for t, ty in zip(tokens, types, strict=True) if ty == TOKEN_CONTROL]
    user = [t for t, ty in zip(tokens, types, strict=True) if ty == TOKEN_USER_DEFINED]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    if user:
        tok.add_tokens([AddedToken(t, normalized=False) for t in user])

    def token(key: str) -> str | None:
        i = _field(reader, key)
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    bos = token("tokenizer.ggml.bos_token_id")
    add_bos = bool(_field(reader, "tokenizer.ggml.add_bos_token", False))
    if add_bos and bos is not None:
        bos_id = int(_field(reader, "tokenizer.ggml.bos_token_id"))
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )
    cfg = {
        "bos_token": bos,
        "eos_token": token("tokenizer.ggml.eos_token_id"),
        "pad_token": token("tokenizer.ggml.padding_token_id"),
        "unk_token": token("tokenizer.ggml.unknown_token_id"),
        "add_bos_token": add_bos,
        "chat_template": _field(reader, "tokenizer.chat_template"),
    }
    return tok, {k: v for k, v in cfg.items() if v is not None}


def convert_gguf(path: Path, out_dir: Path) -> None:
    """Write the Hugging Face-format directory of ``path`` into ``out_dir``."""
    import torch
    from safetensors.torch import save_file

    reader = _reader(path)
    cfg = gguf_config(reader, path)
    tensors = gguf_tensors(reader, cfg, path)
    tok, tok_cfg = gguf_tokenizer(reader, path)
    if cfg["vocab_size"] != tok.get_vocab_size(with_added_tokens=True):
        cfg["vocab_size"] = int(tensors["model.embed_tokens.weight"].shape[0])
    tok_cfg["model_max_length"] = cfg["max_position_embeddings"]
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({k: torch.from_numpy(v) for k, v in tensors.items()},
              str(out_dir / "model.safetensors"))  # fmt: skip
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))
    if cfg["eos_token_id"] is not None:
        gen = {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"]}
        (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2))


def find_gguf(path: Path) -> Path | None:
    """The GGUF file ``path`` names: itself, or the only ``*.gguf`` in a directory."""
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir():
        files = sorted(path.glob("*.gguf"))
        if len(files) > 1:
            raise GGUFError(f"model: {path} holds several GGUF files; name one: "
                            + ", ".join(f.name for f in files))  # fmt: skip
        return files[0] if files else None
    return None


def prepare_gguf(path: Path) -> Path:
    """The cached Hugging Face-format directory of a GGUF file (converted on first use)."""
    src = find_gguf(Path(path))
    if src is None:
        raise GGUFError(f"model: no .gguf file at {path}")
    st = src.stat()
    key = f"{src.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\0{CONVERTER_VERSION}"
    out = user_cache_dir() / "gguf" / hashlib.sha256(key.encode()).hexdigest()[:24]
    if (out / "config.json").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".convert-"))
    try:
        convert_gguf(src, tmp)
        (tmp / GGUF_MARKER).write_text(json.dumps({"source": str(src.resolve()),
            "size": st.st_size, "converter": CONVERTER_VERSION}))  # fmt: skip
        try:
            os.replace(tmp, out)  # atomic: a concurrent start sees all of it or nothing
        except OSError:
            if not (out / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
