"""kvserve plan: the KV formula against hand-computed figures, and --validate against the engine."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from kvserve.cli import main
from kvserve.kv.formats import KV_CACHE_DTYPES
from kvserve.plan.capacity import (
    arch_from_config,
    bytes_per_token,
    capacity,
    checkpoint_bytes,
    format_table,
    kv_heads_per_gpu,
    load_arch,
    window_fraction,
)
from kvserve.plan.cli import plan, validate
from kvserve.plan.cost import decode_roofline, expected_experts_touched, usd_per_million
from kvserve.plan.gpus import GPUS, get_gpu
from kvserve.plan.validate import owned_tensor_bytes, validate_windows

GiB = 1024**3

# The seed's example: 32 layers, 8 KV heads, head dim 128 (Llama-3-8B shapes), bf16.
SEED = {
    "architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "vocab_size": 128256, "intermediate_size": 14336, "max_position_embeddings": 131072,
    "torch_dtype": "bfloat16",
}  # fmt: skip
LLAMA3_8B_PARAMS = 8_030_261_248  # 32 x (41,943,040 attn + 176,160,768 mlp + 8,192 norms)
#                                   + 2 x 128,256 x 4,096 embeddings + 4,096 final norm

DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
    "hidden_size": 7168, "num_hidden_layers": 61, "num_attention_heads": 128,
    "num_key_value_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "intermediate_size": 18432, "moe_intermediate_size": 2048, "n_routed_experts": 256,
    "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
    "vocab_size": 129280, "max_position_embeddings": 163840, "torch_dtype": "bfloat16",
    "quantization_config": {"quant_method": "fp8"},
}  # fmt: skip


def test_seed_example_exactly():
    spec = arch_from_config(SEED)
    assert bytes_per_token(spec, "bfloat16") == 2 * 32 * 8 * 128 * 2 == 131072
    one = capacity(spec, "bfloat16", 80 * GiB, context=32768, batch=1)
    eight = capacity(spec, "bfloat16", 80 * GiB, context=32768, batch=8)
    assert one.kv_bytes_per_sequence == 4 * GiB
    assert one.kv_bytes_total == 4 * GiB
    assert eight.kv_bytes_total == 32 * GiB


def test_seed_example_through_cli_json(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(SEED))
    rc = main(["plan", str(tmp_path / "config.json"), "--context", "32768", "--batch", "8",
               "--kv-cache-dtype", "bfloat16", "--gpu", "h100-sxm", "--json"])  # fmt: skip
    assert rc == 0
    p = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert p["kv_bytes_per_token"] == 131072
    assert p["kv_bytes_per_sequence"] == 4 * GiB
    assert p["kv_bytes_total"] == 32 * GiB
    # 0.9 x 80 GiB - 8,030,261,248 x 2 bytes of weights = 61,248,888,832 bytes of KV budget
    # = 29,205 blocks of 16 x 128 KiB; a 32,768-token sequence takes 2,048 blocks -> 14.
    assert p["weight_bytes"] == LLAMA3_8B_PARAMS * 2
    assert p["num_blocks"] == 29205
    assert p["max_concurrent_sequences"] == 14
    assert p["warnings"] == []


def test_capacity_hand_computed_tiny_model():
    cfg = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
           "vocab_size": 100, "intermediate_size": 128, "torch_dtype": "float32"}  # fmt: skip
    spec = arch_from_config(cfg)
    # 2 x (2*64*64 + 2*64*32 + 3*64*128 + 2*64) + 2*100*64 + 64
    assert spec.num_parameters == 86848
    c = capacity(spec, "bfloat16", 1 * GiB, context=1000, gpu_memory_utilization=1.0)
    assert c.kv_bytes_per_token == 2 * 2 * 2 * 16 * 2 == 256
    assert c.weight_bytes == 86848 * 4
    assert c.num_blocks == (GiB - 86848 * 4) // (256 * 16) == 262059
    assert c.kv_capacity_tokens == 262059 * 16
    assert c.max_concurrent_sequences == 262059 // 63 == 4159  # ceil(1000 / 16) = 63 blocks


def test_gqa_mqa_and_tensor_parallel_heads():
    mqa = arch_from_config({**SEED, "num_key_value_heads": 1})
    assert bytes_per_token(mqa, "bfloat16") == 2 * 32 * 1 * 128 * 2
    gqa = arch_from_config(SEED)
    assert kv_heads_per_gpu(gqa, 2) == 4
    assert bytes_per_token(gqa, "bfloat16", tp=2) == 131072 / 2
    assert kv_heads_per_gpu(gqa, 16) == 1  # fewer heads than ranks: replicated
    assert bytes_per_token(gqa, "bfloat16", tp=16) == 131072 / 8
    assert bytes_per_token(gqa, "float32") == 2 * 131072


def test_sliding_window_layers():
    mistral = arch_from_config(
        {**SEED, "architectures": ["MistralForCausalLM"], "sliding_window": 4096}
    )
    assert window_fraction(mistral, 32768) == 4096 / 32768
    c = capacity(mistral, "bfloat16", 80 * GiB, context=32768)
    assert c.kv_bytes_per_sequence == 4 * GiB  # the engine gives every layer the full table
    assert c.kv_bytes_per_sequence_window_aware == 512 * 1024**2
    assert c.max_concurrent_sequences_window_aware > c.max_concurrent_sequences
    gemma = arch_from_config({
        **SEED, "architectures": ["Gemma3ForCausalLM"], "num_hidden_layers": 6,
        "sliding_window": 1024, "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
    })  # fmt: skip
    assert gemma.layer_windows == (1024,) * 5 + (None,)
    assert window_fraction(gemma, 4096) == (5 * 1024 + 4096) / (6 * 4096)
    assert window_fraction(gemma, 512) == 1.0


def test_mla_deepseek_v3():
    spec = arch_from_config(DEEPSEEK_V3)
    assert spec.is_mla and spec.mla_latent_dim == 512 + 64
    # One latent of 576 bf16 elements per token per layer, not a K and a V per head.
    assert bytes_per_token(spec, "bfloat16") == 61 * 576 * 2 == 70272
    assert bytes_per_token(spec, "bfloat16", tp=8) == 70272  # replicated across ranks
    assert abs(spec.num_parameters / 671e9 - 1) < 0.005  # the published 671 B
    assert abs(spec.num_active_parameters / 37e9 - 1) < 0.03  # and 37 B active
    assert spec.weight_bytes() == spec.num_parameters  # fp8 checkpoint: 1 byte each


def test_every_format_is_either_planned_or_reported_missing():
    ok, missing = format_table(arch_from_config(SEED))
    assert set(ok) | set(missing) == set(KV_CACHE_DTYPES) - {"auto"}
    assert not set(ok) & set(missing)
    assert {"bfloat16", "float16", "float32"} <= set(ok)
    for fmt, b in ok.items():
        if fmt not in ("float32", "bfloat16", "float16"):
            assert b < 131072, f"{fmt} should be smaller than bf16"


def test_roofline_and_cost_hand_computed():
    spec = arch_from_config(SEED)
    gpu = get_gpu("custom:10:1:100")  # 1 TB/s, 100 TFLOPS
    r = decode_roofline(spec, gpu, 131072, LLAMA3_8B_PARAMS * 2, batch=1, context=32768)
    weights, kv = 16_060_522_496, 4_294_967_296
    assert r.weight_bytes_read == weights and r.kv_bytes_read == kv
    assert r.memory_time_s == pytest.approx((weights + kv) / 1e12)
    # 2 FLOPs per parameter + 4 x context x layers x heads x head_dim for QK^T and PV
    assert r.flops == 2 * LLAMA3_8B_PARAMS + 4 * 32768 * 32 * 32 * 128
    assert r.bound == "memory"
    assert r.tokens_per_s == pytest.approx(1e12 / (weights + kv))
    assert usd_per_million(1000.0, 3.6, 1) == pytest.approx(1.0)  # $3.6/h at 1000 tok/s
    assert usd_per_million(500.0, 3.6, 2) == pytest.approx(4.0)
    assert usd_per_million(0.0, 3.6) is None
    assert expected_experts_touched(256, 8, 1) == pytest.approx(8)
    assert expected_experts_touched(256, 8, 10_000) == pytest.approx(256)


def test_plan_json_keys_and_gpu_table(tmp_path, capsys):
    for g in GPUS.values():
        assert g.source.startswith("https://") and g.memory_gib > 0 and g.bandwidth_tbs > 0
    assert get_gpu("H100-SXM").bandwidth_tbs == 3.35 and get_gpu("h200").memory_gib == 141
    with pytest.raises(ValueError, match="gpu: unknown"):
        get_gpu("tpu-v9")
    p = plan(arch_from_config(SEED), "h200", context=8192, gpu_hour_cost=3.0)
    for key in ("kv_bytes_per_token", "kv_bytes_per_sequence", "kv_bytes_total",
                "max_concurrent_sequences", "kv_capacity_tokens", "weight_bytes", "roofline",
                "usd_per_million_tokens", "formats", "formats_not_implemented"):  # fmt: skip
        assert key in p, key
    assert p["batch"] == p["max_concurrent_sequences"]  # default batch: the ceiling
    assert p["usd_per_million_tokens"] == pytest.approx(
        3.0 / 3600 / p["roofline"]["tokens_per_s"] * 1e6
    )
    big = plan(arch_from_config(SEED), "l4", context=131072, batch=4)
    assert any("does not fit" in w for w in big["warnings"])


def test_checkpoint_bytes_reads_safetensors_headers(checkpoint):
    from kvserve.config import ModelConfig

    ckpt = checkpoint("llama_gqa")
    n = ModelConfig.from_pretrained(ckpt).num_parameters()
    from pathlib import Path

    assert checkpoint_bytes(Path(ckpt)) == n * 4  # float32 checkpoint


def test_validate_against_engine_every_implemented_format(checkpoint):
    ckpt = checkpoint("llama_gqa")
    rows = validate(ckpt, 8 * 1024**2, block_size=16)  # room for KIVI's residual pool
    ok, _ = format_table(arch_from_config(json.load(open(f"{ckpt}/config.json"))))
    assert [r.kv_cache_dtype for r in rows] == list(ok)
    assert "bfloat16" in ok
    for r in rows:
        assert r.ok, r
        assert r.engine_blocks == r.predicted_blocks
        assert r.engine_bytes and r.engine_bytes >= r.predicted_fixed_bytes
    dense = {r.kv_cache_dtype: r for r in rows if r.closed_form_bytes is not None}
    assert set(dense) == {"bfloat16", "float16", "float32"}
    # llama_gqa: 2 layers, 2 KV heads, head dim 16; 8 MiB of bf16 K and V in 16-token blocks,
    # one of which is the null block that pads block tables (a fixed cost, not usable)
    block = 2 * 2 * 2 * 16 * 2 * 16
    assert dense["bfloat16"].closed_form_bytes == block * 2047
    assert dense["bfloat16"].predicted_fixed_bytes == block
    assert dense["bfloat16"].engine_bytes == block * 2048 == 8 * 1024**2


def test_owned_tensor_bytes_counts_each_allocation_once():
    class Slotted:
        __slots__ = ("a", "b")

    t = torch.zeros(100)  # 400 bytes
    obj = SimpleNamespace(
        a=t,
        views=[t[:10], {"x": t.view(10, 10)}],
        other=(torch.zeros(3, dtype=torch.float16),),
        n=7,
    )
    assert owned_tensor_bytes(obj) == 400 + 6
    s = Slotted()
    s.a = [torch.zeros(2, dtype=torch.int64)]
    assert owned_tensor_bytes(s) == 16
    assert owned_tensor_bytes(SimpleNamespace(k=[], v=None)) == 0


class ClaimingStorage:
    """Claims, through the byte methods a storage has, as many bytes as the real storage
    owns, but owns only ``tensors``."""

    def __init__(self, real, tensors):
        self.k = tensors
        self._claimed = owned_tensor_bytes(real)

    def nbytes(self):
        return self._claimed

    def fixed_nbytes(self):
        return 0


@pytest.mark.parametrize(
    "tensors, reason",
    [([torch.zeros(4, dtype=torch.uint8)], "allocated bytes differ"), ([], "owns no tensor bytes")],
)
def test_validate_fails_when_the_storage_owns_fewer_bytes_than_predicted(
    checkpoint, monkeypatch, tensors, reason
):
    import kvserve.plan.validate as pv

    real_build = pv.build_engine

    def build_with_claiming_storage(*args):
        engine = real_build(*args)
        worker = SimpleNamespace(
            storage=ClaimingStorage(engine.executor.driver_worker.storage, tensors)
        )
        return SimpleNamespace(
            num_blocks=engine.num_blocks,
            executor=SimpleNamespace(collective_rpc=lambda fn: [fn(worker)]),
            shutdown=engine.shutdown,
        )

    monkeypatch.setattr(pv, "build_engine", build_with_claiming_storage)
    rows = validate(checkpoint("llama_gqa"), 8 * 1024**2, block_size=16)
    assert rows
    for r in rows:
        assert not r.ok, r
        assert r.engine_blocks == r.predicted_blocks  # the blocks agree; the bytes do not
        assert reason in r.reason, r
        assert r.engine_bytes == sum(t.numel() * t.element_size() for t in tensors)


def test_plan_validate_cli(checkpoint, capsys):
    ckpt = checkpoint("llama_gqa")
    rc = main(["plan", ckpt, "--validate", "--validate-memory", "8MiB", "--json"])
    p = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0
    assert p["validation"] and all(r["ok"] for r in p["validation"])
    assert {"bfloat16"} <= {r["kv_cache_dtype"] for r in p["validation"]}
    for r in p["validation"]:
        assert {"predicted_fixed_bytes", "closed_form_bytes"} <= set(r)


def test_plan_errors_name_the_field(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    assert main(["plan", str(tmp_path)]) == 2
    assert "num_hidden_layers" in capsys.readouterr().err
    (tmp_path / "config.json").write_text(json.dumps(SEED))
    assert main(["plan", str(tmp_path), "--validate"]) == 2
    assert "validate" in capsys.readouterr().err


def _hybrid_checkpoint(checkpoint, tmp_path) -> str:
    src = Path(checkpoint("qwen2", sliding_window=24, num_layers=4))
    for f in src.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["max_window_layers"] = 2  # layers 0-1 full attention, 2-3 a 24-token window
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path)


@pytest.mark.parametrize("name", ["hybrid", "mistral_swa"])
def test_validate_windows_against_a_live_sequence(checkpoint, tmp_path, name):
    """The planner's window-aware bytes for a sequence past the window are what the engine
    holds, to block rounding: per layer, its tokens (full) or its window (sliding)."""
    path = _hybrid_checkpoint(checkpoint, tmp_path) if name == "hybrid" else checkpoint(name)
    w = validate_windows(path, block_size=8)
    assert w is not None and w.ok, w
    layers = load_arch(path).layer_windows
    per_token_layer = 2 * 2 * 16 * 4  # K and V, 2 KV heads, head dim 16, float32
    held = sum(min(w.context, win) if win else w.context for win in layers)
    assert w.predicted_bytes == held * per_token_layer
    assert w.context > 2 * 24
    assert validate_windows(checkpoint("llama_gqa")) is None  # no sliding layer


def test_validate_windows_fails_with_one_table(checkpoint, tmp_path, monkeypatch):
    """With one block table for every layer the full layers pin the window layers' blocks:
    the engine holds more than the window-aware figure allows, and the check says so."""
    import kvserve.engine.llm_engine as le
    import kvserve.worker.model_runner as rn

    path = _hybrid_checkpoint(checkpoint, tmp_path)
    monkeypatch.setattr(le, "engine_layer_groups", lambda *a: None)
    monkeypatch.setattr(rn, "engine_layer_groups", lambda *a: None)
    w = validate_windows(path, block_size=8)
    assert not w.ok and w.engine_bytes > w.predicted_bytes + w.slack_bytes
    rc = main(["plan", path, "--validate", "--validate-memory", "8MiB", "--json"])
    assert rc == 1


def test_tensor_parallel_all_reduce_bytes_hand_computed(tmp_path, capsys):
    """Two all-reduces per layer of the batch's bf16 hidden states, a ring moving
    2 (tp - 1) / tp of them per GPU: 2 x 32 layers x 8 tokens x 4096 x 2 bytes = 4 MiB, of
    which tp 2 moves 4 MiB x 2 x 1/2 = 4 MiB per GPU; over H100 SXM NVLink (450 GB/s one way)
    that is 4,194,304 / 450e9 s. vLLM's -tp spelling of the flag."""
    (tmp_path / "config.json").write_text(json.dumps(SEED))
    rc = main(["plan", str(tmp_path / "config.json"), "-tp", "2", "--batch", "8",
               "--context", "4096", "--gpu", "h100-sxm", "--json"])  # fmt: skip
    assert rc == 0
    p = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    a = p["allreduce"]
    assert p["tp"] == 2 and a["link"] == "nvlink"
    assert a["bytes_per_step_per_gpu"] == 4 * 1024**2
    assert a["time_per_step_s"] == pytest.approx(4 * 1024**2 / 450e9)
    assert p["kv_bytes_per_token_per_gpu"] == 131072 / 2  # each GPU holds 4 of the 8 KV heads
    # a measured link instead: PCIe-class 25 GB/s, tp 4 moves 2 x 3/4 of the volume
    p = plan(arch_from_config(SEED), "l40s", tp=4, batch=8, context=4096, link_bandwidth=25)
    assert p["allreduce"]["link"] == "given"
    assert p["allreduce"]["bytes_per_step_per_gpu"] == 4 * 1024**2 * 2 * 3 / 4
    assert p["allreduce"]["time_per_step_s"] == pytest.approx(6 * 1024**2 / 25e9)
    assert plan(arch_from_config(SEED), "l40s", tp=2)["allreduce"]["link"] == "pcie4"
