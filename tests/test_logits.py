"""One forward pass's logits match transformers within 1e-4 (float32)."""

from __future__ import annotations

import pytest
import torch

from kvserve.attention.metadata import AttentionMetadata, PrefillChunk
from kvserve.kv.storage import DenseKVStorage
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
    model = engine.executor.driver_worker.model
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


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_selected_rows_match_transformers_and_every_kv_row_is_written(checkpoint, make_llm, name):
    """With ``rows`` the last layer finishes only those tokens: their logits still match
    transformers' at those positions (in the order asked, repeats kept), and the cache holds
    every token's K/V, the last layer's too, even when no row is asked for."""
    path = checkpoint(name)
    (ids,) = prompts_of_lengths([70], seed=4)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        out = hf(torch.tensor([ids]), use_cache=True)
    expected = out.logits[0]
    engine = make_llm(path, dtype="float32").engine
    model, cfg = engine.executor.driver_worker.model, engine.model_config
    bs, n = 16, len(ids)

    def run(rows: torch.Tensor | None) -> tuple[torch.Tensor, DenseKVStorage]:
        storage = DenseKVStorage(len(model.layers), 8, bs, cfg.num_key_value_heads,
                                 cfg.head_dim, torch.float32)  # fmt: skip
        meta = AttentionMetadata(slot_mapping=torch.arange(n), block_size=bs,
                                 prefills=[PrefillChunk(0, n, 0, None)])  # fmt: skip
        with torch.inference_mode():
            return model(torch.tensor(ids), torch.arange(n), storage, meta, rows), storage

    rows = torch.tensor([n - 1, 5, 5, 0])
    hidden, _ = run(rows)
    assert hidden.shape == (4, cfg.hidden_size)
    torch.testing.assert_close(model.logits(hidden), expected[rows], atol=1e-4, rtol=0)

    none, storage = run(torch.tensor([], dtype=torch.long))
    assert none.shape[0] == 0
    last = len(model.layers) - 1
    k_hf = out.past_key_values.layers[last].keys[0]  # [KVH, n, D], rotated
    v_hf = out.past_key_values.layers[last].values[0]
    kvh, d, nb = cfg.num_key_value_heads, cfg.head_dim, (n + bs - 1) // bs
    k = storage.k[last][:nb].transpose(0, 1).reshape(kvh, -1, d)[:, :n]
    v = storage.v[last][:nb].transpose(0, 1).reshape(kvh, -1, d)[:, :n]
    kept = k_hf.shape[1]  # a sliding-window model's cache keeps its window's newest tokens
    torch.testing.assert_close(k[:, n - kept :], k_hf, atol=1e-4, rtol=0)
    torch.testing.assert_close(v[:, n - kept :], v_hf, atol=1e-4, rtol=0)
