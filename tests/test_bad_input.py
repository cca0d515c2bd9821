"""Bad input is refused with an error naming the field; the engine then serves the next
request normally and holds no leaked blocks (checked by the make_llm fixture)."""

from __future__ import annotations

import json
import shutil

import pytest

from kvserve import LLM, SamplingParams
from kvserve.config import ConfigError
from kvserve.model.loader import ModelLoadError
from kvserve.sched.request import InvalidRequestError

GOOD = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture
def llm(checkpoint, make_llm):
    return make_llm(checkpoint("llama_gqa"), max_model_len=128, dtype="float32")


@pytest.mark.parametrize(
    "prompt, params, field",
    [
        ("x" * 200, GOOD, "prompt"),  # longer than max_model_len
        ("", GOOD, "prompt"),
        ([], GOOD, "prompt"),
        ([1, 2, 10_000], GOOD, "prompt_token_ids"),
        ([1, -3], GOOD, "prompt_token_ids"),
        ("hello", {"max_tokens": 0}, "max_tokens"),
        ("hello", {"max_tokens": -5}, "max_tokens"),
        ("hello", {"max_tokens": 500}, "max_tokens"),  # prompt + max_tokens > max_model_len
        ("hello", {"temperature": -0.5}, "temperature"),
        ("hello", {"top_p": 0.0}, "top_p"),
        ("hello", {"top_p": 1.5}, "top_p"),
        ("hello", {"top_k": -2}, "top_k"),
        ("hello", {"top_k": 0}, "top_k"),
        ("hello", {"min_p": 2.0}, "min_p"),
        ("hello", {"n": 0}, "n"),
        ("hello", {"logprobs": 1000}, "logprobs"),
        ("hello", {"temperature": float("nan")}, "temperature"),
        ("hello", {"stop": [""]}, "stop"),
        ({"prompt": "hi", "cache_salt": 5}, GOOD, "cache_salt"),
        (None, GOOD, "prompt"),
    ],
)
def test_bad_request_names_field_and_engine_recovers(llm, prompt, params, field):
    with pytest.raises(InvalidRequestError) as err:
        if isinstance(params, dict):
            params = SamplingParams(**{"temperature": 0, **params})
        llm.generate([prompt], params)
    assert err.value.field == field
    assert field in str(err.value)
    out = llm.generate(["hello"], GOOD)[0]
    assert len(out.outputs[0].token_ids) == 4
    assert not llm.engine.has_unfinished_requests()


def test_batch_with_one_bad_prompt_submits_nothing(llm):
    with pytest.raises(InvalidRequestError):
        llm.generate(["fine", ""], GOOD)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.kv.num_used_blocks == 0


def test_request_that_can_never_fit_the_pool(checkpoint, make_llm):
    llm = make_llm(checkpoint("llama_gqa"), num_gpu_blocks=4, block_size=4, dtype="float32")
    with pytest.raises(InvalidRequestError, match="max_tokens: .* 4"):
        llm.generate(["a" * 10], SamplingParams(max_tokens=20))
    assert llm.generate(["ab"], GOOD)[0].outputs[0].finish_reason == "length"


def test_missing_model_dir(tmp_path):
    with pytest.raises(FileNotFoundError, match="model"):
        LLM(str(tmp_path / "nope"))


def test_missing_weights(checkpoint, tmp_path):
    dst = tmp_path / "m"
    shutil.copytree(checkpoint("llama_gqa"), dst)
    (dst / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        LLM(str(dst))


def test_missing_tensor_is_named(checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file

    dst = tmp_path / "m"
    shutil.copytree(checkpoint("llama_gqa"), dst)
    t = load_file(dst / "model.safetensors")
    del t["model.layers.1.mlp.up_proj.weight"]
    t["model.layers.0.self_attn.k_proj.weight"] = t["model.layers.0.self_attn.k_proj.weight"][:3]
    save_file(t, dst / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"k_proj.weight.*shape|up_proj"):
        LLM(str(dst))


def test_unknown_architecture(checkpoint, tmp_path):
    dst = tmp_path / "m"
    shutil.copytree(checkpoint("llama_gqa"), dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["architectures"] = ["GPTNeoXForCausalLM"]
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="architectures: unsupported architecture"):
        LLM(str(dst))


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"block_size": 3}, "block_size"),
        ({"block_size": 512}, "block_size"),
        ({"dtype": "int4"}, "dtype"),
        ({"kv_cache_dtype": "fp4"}, "kv_cache_dtype"),
        ({"kv_cache_memory": "lots"}, "kv_cache_memory"),
        ({"num_gpu_blocks": 0}, "num_gpu_blocks"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"max_model_len": 10**9}, "max_model_len"),
        ({"scheduling_policy": "random"}, "scheduling_policy"),
    ],
)
def test_bad_engine_config(checkpoint, kwargs, field):
    with pytest.raises(ConfigError, match=field):
        LLM(checkpoint("llama_gqa"), **kwargs)
