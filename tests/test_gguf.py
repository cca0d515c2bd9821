"""GGUF checkpoints: a tiny file written with the gguf package's own writer (random weights,
a small byte-level BPE vocabulary, a chat template; float32 and quantized tensors) loads in
kvserve with the same greedy tokens as transformers' GGUF loader; broken files are refused
with messages that say what is wrong."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from kvserve import SamplingParams
from kvserve.model.gguf import GGUFError, prepare_gguf, unpermute_rotary_rows

gguf = pytest.importorskip("gguf")

CHAT = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SHAPE = dict(hidden=64, inter=128, layers=2, heads=4, kv_heads=2)


def _vocab() -> tuple[list[str], list[str], list[int]]:
    """A byte-level BPE vocabulary: the 256 byte symbols, some merges, then special tokens."""
    from tokenizers import pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tokens = sorted(alphabet)
    merges = []
    for a, b in [("t", "h"), ("th", "e"), ("a", "n"), ("Ġ", "t"), ("Ġt", "h"), ("Ġth", "e"),
                 ("i", "n"), ("Ġ", "a"), ("e", "r"), ("o", "n"), ("Ġa", "n")]:  # fmt: skip
        merges.append(f"{a} {b}")
        if a + b not in tokens:
            tokens.append(a + b)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    types = [1] * len(tokens) + [3] * len(specials)
    return tokens + specials, merges, types


def write_tiny_gguf(path, quant: str = "Q8_0", *, arch: str = "llama", bad_type=None,  # noqa: ANN001
                    extra_tensor: str | None = None, seed: int = 0) -> None:  # fmt: skip
    h, f, n_layers = SHAPE["hidden"], SHAPE["inter"], SHAPE["layers"]
    heads, kvh = SHAPE["heads"], SHAPE["kv_heads"]
    d = h // heads
    tokens, merges, types = _vocab()
    v = len(tokens)
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(n_layers)
    w.add_context_length(256)
    w.add_embedding_length(h)
    w.add_feed_forward_length(f)
    w.add_head_count(heads)
    w.add_head_count_kv(kvh)
    w.add_rope_dimension_count(d)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(v)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(tokens)
    w.add_token_merges(merges)
    w.add_token_types(types)
    w.add_bos_token_id(v - 3)
    w.add_eos_token_id(v - 1)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT)
    qtype = getattr(gguf.GGMLQuantizationType, quant)

    def tensor(name: str, shape: tuple[int, ...], std: float = 0.08, norm: bool = False) -> None:
        x = 1 + 0.1 * rng.standard_normal(shape) if norm else std * rng.standard_normal(shape)
        x = x.astype(np.float32)
        if norm or quant == "F32":
            w.add_tensor(name, x)
        elif bad_type is not None and name.endswith("attn_v.weight"):
            bs, ts = gguf.GGML_QUANT_SIZES[bad_type]
            raw = np.zeros((shape[0], shape[1] // bs * ts), dtype=np.uint8)
            w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=bad_type)
        else:
            q = gguf.quants.quantize(x, qtype)
            w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=qtype)

    tensor("token_embd.weight", (v, h), std=0.5)
    for i in range(n_layers):
        tensor(f"blk.{i}.attn_norm.weight", (h,), norm=True)
        tensor(f"blk.{i}.attn_q.weight", (heads * d, h))
        tensor(f"blk.{i}.attn_k.weight", (kvh * d, h))
        tensor(f"blk.{i}.attn_v.weight", (kvh * d, h))
        tensor(f"blk.{i}.attn_output.weight", (h, heads * d))
        tensor(f"blk.{i}.ffn_norm.weight", (h,), norm=True)
        tensor(f"blk.{i}.ffn_gate.weight", (f, h))
        tensor(f"blk.{i}.ffn_up.weight", (f, h))
        tensor(f"blk.{i}.ffn_down.weight", (h, f))
    tensor("output_norm.weight", (h,), norm=True)
    if extra_tensor:
        tensor(extra_tensor, (h,), norm=True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSERVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.mark.parametrize("quant", ["F32", "Q8_0", "Q4_1"])
def test_gguf_greedy_equals_transformers(make_llm, tmp_path, cache, quant):
    transformers = pytest.importorskip("transformers")
    path = tmp_path / f"tiny-{quant}.gguf"
    write_tiny_gguf(path, quant)
    model_dir = prepare_gguf(path)
    cfg = json.loads((model_dir / "config.json").read_text())
    assert cfg["tie_word_embeddings"] and cfg["num_key_value_heads"] == 2
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=path.name, dtype=torch.float32
    )
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    llm = make_llm(str(path), dtype="float32", block_size=4, num_gpu_blocks=64)
    tok = llm.get_tokenizer()
    text = "the tiny then an in the answer"
    assert tok.encode(text) == hf_tok(text)["input_ids"]
    chat = [{"role": "user", "content": "then the answer"}]
    ids = tok.encode_chat(chat)
    want_ids = hf_tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
    assert ids == (want_ids["input_ids"] if hasattr(want_ids, "keys") else want_ids)
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    got = llm.generate([{"prompt_token_ids": ids}, text], sp)
    for out, prompt in zip(got, [ids, tok.encode(text)], strict=True):
        with torch.no_grad():
            want = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=12,
                               min_new_tokens=12)[0, len(prompt):].tolist()  # fmt: skip
        assert out.outputs[0].token_ids == want
    assert llm.engine.model_config.num_hidden_layers == 2


def test_second_start_uses_the_cache(tmp_path, cache):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
    first = prepare_gguf(path)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert prepare_gguf(tmp_path) == first  # the directory holding it names the same file
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    assert str(first).startswith(str(cache))


def test_unpermute_inverts_llama_cpp_permutation():
    """llama.cpp's convert_hf_to_gguf permute: reshape (heads, 2, d/2) and swap the axes."""
    w = np.arange(4 * 8 * 3, dtype=np.float32).reshape(32, 3)
    permuted = w.reshape(4, 2, 4, 3).swapaxes(1, 2).reshape(w.shape)
    assert np.array_equal(unpermute_rotary_rows(permuted, 4), w)


def test_malformed_file_is_refused(tmp_path, cache):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + bytes(range(200)))
    with pytest.raises(GGUFError, match="not a readable GGUF file"):
        prepare_gguf(bad)
    truncated = tmp_path / "truncated.gguf"
    write_tiny_gguf(truncated)
    truncated.write_bytes(truncated.read_bytes()[:5000])
    with pytest.raises(GGUFError, match="truncated.gguf"):
        prepare_gguf(truncated)


def test_unknown_architecture_is_refused(tmp_path, cache):
    path = tmp_path / "falcon.gguf"
    write_tiny_gguf(path, arch="falcon")
    with pytest.raises(GGUFError, match="architecture 'falcon'.*supported: llama, qwen2"):
        prepare_gguf(path)


def test_unsupported_quantization_type_is_refused_by_name(tmp_path, cache):
    path = tmp_path / "q81.gguf"
    write_tiny_gguf(path, bad_type=gguf.GGMLQuantizationType.Q8_1)
    with pytest.raises(GGUFError, match="attn_v.weight.*Q8_1.*cannot dequantize"):
        prepare_gguf(path)


def test_unmapped_tensor_is_refused(tmp_path, cache):
    path = tmp_path / "rope.gguf"
    write_tiny_gguf(path, extra_tensor="rope_freqs.weight")
    with pytest.raises(GGUFError, match="rope_freqs"):
        prepare_gguf(path)


def test_engine_reports_gguf_errors_as_bad_model(tmp_path, cache):
    from kvserve.cli import main

    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"not gguf at all")
    assert main(["generate", "--model", str(bad), "--max-tokens", "2"]) == 2
