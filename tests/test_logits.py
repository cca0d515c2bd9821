"""One forward pass's logits match transformers within 1e-4 (float32)."""

from __future__ import annotations

import pytest
import torch

from kvserve.kv.storage import DenseKVStorage
from kvserve.model.attention import AttentionMetadata, PrefillChunk
from tests.conftest import CHECKPOINTS, prompts_of_lengths

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_prefill_logits_match(checkpoint, make_llm, name):
    path = checkpoint(name)
    (ids,) = prompts_of_lengths([70], seed=3)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0]

    engine = make_llm(path, dtype="float32").engine
    model = engine.model
    bs = 16
    storage = DenseKVStorage(len(model.layers), 8, bs, engine.model_config.num_key_value_heads,
                        engine.model_config.head_dim, torch.float32)  # fmt: skip
    n = len(ids)
    meta = AttentionMetadata(slot_mapping=torch.arange(n), block_size=bs,
                             prefills=[PrefillChunk(0, n, 0, None)])  # fmt: skip
    with torch.inference_mode():
        hidden = model(torch.tensor(ids), torch.arange(n), storage, meta)
        got = model.logits(hidden)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
