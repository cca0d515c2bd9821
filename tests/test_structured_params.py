"""StructuredOutputsParams validation (vLLM's names; errors name the field), the compile
cache's identity, and the mask's treatment of ids past the tokenizer's vocabulary."""

from __future__ import annotations

import re

import pytest
import torch

from kvserve import SamplingParams, StructuredOutputsParams
from kvserve.sched.request import InvalidRequestError


@pytest.mark.parametrize(
    "kwargs, field, words",
    [
        ({}, "structured_outputs", "exactly one"),
        (dict(json={"type": "object"}, regex="a"), "structured_outputs", "json, regex"),
        (dict(json="{not json"), "structured_outputs.json", "not valid JSON"),
        (dict(json="[1, 2]"), "structured_outputs.json", "JSON schema"),
        (dict(json="true"), "structured_outputs.json", "JSON schema"),
        (dict(choice=[]), "structured_outputs.choice", "must not be empty"),
        (dict(choice=["a", 1]), "structured_outputs.choice", "list of strings"),
        (dict(regex=""), "structured_outputs.regex", "non-empty"),
        (dict(grammar=3), "structured_outputs.grammar", "Lark"),
        (dict(json_object="yes"), "structured_outputs.json_object", "true or false"),
        (dict(structural_tag="{}"), "structured_outputs.structural_tag", "planned"),
        (dict(json_object=True, whitespace_pattern=""), "structured_outputs.whitespace_pattern",
         "non-empty"),
    ],
)  # fmt: skip
def test_bad_params_name_the_field(kwargs, field, words):
    with pytest.raises(InvalidRequestError) as err:
        StructuredOutputsParams(**kwargs)
    assert err.value.field == field and str(err.value).startswith(field + ":")
    assert words in str(err.value)


def test_sampling_params_takes_only_the_dataclass():
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(structured_outputs={"json": {"type": "object"}})
    assert err.value.field == "structured_outputs"
    so = StructuredOutputsParams(choice=["a", "b"])
    assert SamplingParams(structured_outputs=so).clone(n=2).structured_outputs is so


def test_the_cache_key_is_the_constraint_not_its_spelling():
    a = StructuredOutputsParams(json={"type": "object", "required": ["x"]})
    b = StructuredOutputsParams(json='{"required": ["x"],   "type": "object"}')
    assert a.key() == b.key()
    assert (
        a.key()
        != StructuredOutputsParams(json={"type": "object"}, disable_any_whitespace=True).key()
    )
    assert StructuredOutputsParams(json_object=True).schema() == {"type": "object"}
    assert a.field == "structured_outputs.json"


def _outside_strings(text: str) -> str:
    """The JSON text with string literals removed (what whitespace limits apply to)."""
    return re.sub(r'"(?:[^"\\]|\\.)*"?', '""', text)


def test_json_object_whitespace_is_bounded(make_llm):
    """vLLM #4093: json_object generating whitespace forever. A run of whitespace between
    tokens is at most 8 characters; disable_any_whitespace allows none."""
    llm = make_llm("kvserve-ref", max_model_len=256, dtype="float32")
    for so, longest in (
        (StructuredOutputsParams(json_object=True), 8),
        (StructuredOutputsParams(json_object=True, disable_any_whitespace=True), 0),
    ):
        p = SamplingParams(temperature=1.0, n=4, max_tokens=40, structured_outputs=so)
        for c in llm.generate(["{"], p)[0].outputs:
            assert c.text.lstrip().startswith("{")
            runs = re.findall(r"[ \t\n\r]+", _outside_strings(c.text))
            assert max(map(len, runs), default=0) <= longest, repr(c.text)  # fmt: skip


def test_padded_vocabulary_ids_are_always_masked(checkpoint):
    """A model whose embedding has rows past its tokenizer (320 rows, 259 tokens here): those
    ids are cleared in every constrained row, whatever the grammar library wrote."""
    from pathlib import Path

    from kvserve.config import ModelConfig
    from kvserve.sample.structured_outputs import StructuredOutputsLogitsProcessor
    from kvserve.sample.token_bitmask import unpack_bitmask
    from kvserve.structured.compiler import GrammarCompiler

    path = Path(checkpoint("llama_gqa"))
    mc = ModelConfig.from_pretrained(path)
    compiler = GrammarCompiler("llguidance", path, mc.vocab_size, mc.eos_token_ids)
    proc = StructuredOutputsLogitsProcessor(mc.vocab_size, "cpu", compiler)

    class View:
        sampling_params = SamplingParams(structured_outputs=StructuredOutputsParams(regex=".*"))
        prompt_token_ids = [1]
        output_token_ids: list[int] = []
        eos_token_ids = mc.eos_token_ids

    state = proc.new_state(View())
    known = compiler.tokenizer_vocab_size
    assert 0 < known < mc.vocab_size
    backend = compiler.backend()
    backend.fill_bitmasks = lambda matchers, mask: None  # a library that allows every id
    allowed = unpack_bitmask(proc.bitmask([state]), mc.vocab_size)[0]
    assert allowed[:known].all() and not allowed[known:].any()
    del backend.fill_bitmasks
    allowed = unpack_bitmask(proc.bitmask([state]), mc.vocab_size)[0]
    assert allowed.any() and not allowed[known:].any()
    assert isinstance(allowed, torch.Tensor)


def test_backend_setting_takes_vllm_names_and_refuses_others():
    """vLLM's backend values: 'guidance' is its name for llguidance, 'auto' its default."""
    from kvserve.config import ConfigError
    from kvserve.llm import engine_config

    for given, want in (("guidance", "llguidance"), ("auto", "llguidance"),
                        ("xgrammar", "xgrammar"), ("llguidance", "llguidance")):  # fmt: skip
        cfg = engine_config("kvserve-ref", structured_outputs_backend=given)
        assert cfg.structured_outputs.structured_outputs_backend == want
    for kw, field in ((dict(structured_outputs_backend="outlines"), "structured_outputs_backend"),
                      (dict(structured_outputs_compile_timeout=0),
                       "structured_outputs_compile_timeout")):  # fmt: skip
        with pytest.raises(ConfigError) as err:
            engine_config("kvserve-ref", **kw)
        assert str(err.value).startswith(field)
