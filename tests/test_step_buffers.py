"""The step buffers' layout (offsets, dtypes, alignment) against hand-computed figures, their
fill and capacity errors, on a CPU (where host and device are one buffer)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvserve.worker.step_buffers import ALIGN, StepBuffers, step_layout


def test_layout_by_hand():
    # 100 tokens, 10 sequences, tables 7 blocks wide
    lay = {f.name: f for f in step_layout(100, 10, 7)}
    # int64 per token: 800 bytes each, rounded up to 832 (13 x 64)
    assert [lay[n].offset for n in ("token_ids", "positions", "slot_mapping")] == [0, 832, 1664]
    assert lay["seq_lens"].offset == 2496  # 80 bytes -> 128
    assert lay["windows"].offset == 2624 and lay["windows"].dtype == torch.int32  # 40 -> 64
    assert lay["block_tables"].offset == 2688 and lay["block_tables"].shape == (10, 7)
    assert lay["block_tables"].nbytes == 560
    assert all(f.offset % ALIGN == 0 for f in lay.values())
    buf = StepBuffers(100, 10, 7, torch.device("cpu"))
    assert buf.nbytes == 2688 + 560 and not buf.pinned
    assert buf.host["windows"].dtype == torch.int32 and buf.host["block_tables"].shape == (10, 7)


def test_stage_fills_in_place_and_a_cpu_shares_one_buffer():
    buf = StepBuffers(8, 4, 3, torch.device("cpu"))
    ptr = buf.on_device["slot_mapping"].data_ptr()
    out = buf.stage("slot_mapping", np.array([5, 6, 7]))
    assert out.tolist() == [5, 6, 7] and out.data_ptr() == ptr  # the same memory every step
    assert buf.stage("slot_mapping", np.array([9]), start=3).tolist() == [5, 6, 7, 9]
    t = buf.stage("block_tables", np.array([[1, 2, 3], [4, 5, 6]]))
    assert t.tolist() == [[1, 2, 3], [4, 5, 6]]
    # the fields do not overlap: filling one leaves its neighbours alone
    assert buf.host["positions"].tolist() == [0] * 8 and buf.host["seq_lens"].tolist() == [0] * 4
    raw = buf.host_bytes.numpy()
    f = buf.layout["slot_mapping"]
    assert raw[f.offset : f.offset + 8].view(np.int64)[0] == 5  # little-endian int64 at its offset


def test_overflow_names_the_field_and_its_bound():
    buf = StepBuffers(8, 4, 3, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"token_ids: 9 rows .* 8 rows .*max_num_batched_tokens"):
        buf.stage("token_ids", np.zeros(9, dtype=np.int64))
    with pytest.raises(ValueError, match=r"seq_lens: 5 rows .* 4 rows .*max_num_seqs"):
        buf.stage("seq_lens", np.zeros(2, dtype=np.int64), start=3)
    with pytest.raises(ValueError, match=r"block_tables: 1 rows of shape \(4,\)"):
        buf.stage("block_tables", np.zeros((1, 4), dtype=np.int64))
