"""Persistent buffers for a step's inputs: filled in place on the host, copied to the device
without blocking.

Building each step's tensors anew and copying them from pageable memory costs an allocation
and a synchronous copy per tensor per step. These buffers are allocated once, at the step's
largest shape: one host byte buffer (pinned on CUDA, so copies from it are asynchronous) laid
out as typed fields at aligned offsets, and its twin on the device. A step writes its rows
into the host fields and copies just those rows; on a CPU host and device are one buffer and
nothing is copied.

The host field is reused by the next step, so a step may refill it only once the previous
step's copies ran: the engine's one sync per step (the sampled tokens) orders that.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

ALIGN = 64  # bytes: each field starts on a cache line (and a CUDA transaction)


@dataclass(frozen=True, slots=True)
class FieldLayout:
    """Where one field lives in the buffer."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]  # rows first: the capacity
    offset: int  # bytes from the buffer's start
    limit: str  # the setting that bounds its rows, for capacity errors

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * torch.empty((), dtype=self.dtype).element_size()


def step_layout(max_tokens: int, max_seqs: int, table_width: int) -> list[FieldLayout]:
    """The fields of a step's inputs: per token (ids, RoPE positions, cache slots), per
    sequence (cache lengths, retention windows, block tables of ``table_width`` blocks)."""
    spec = [
        ("token_ids", torch.int64, (max_tokens,), "max_num_batched_tokens"),
        ("positions", torch.int64, (max_tokens,), "max_num_batched_tokens"),
        ("slot_mapping", torch.int64, (max_tokens,), "max_num_batched_tokens"),
        ("seq_lens", torch.int64, (max_seqs,), "max_num_seqs"),
        ("windows", torch.int32, (max_seqs,), "max_num_seqs"),
        ("block_tables", torch.int64, (max_seqs, table_width), "max_num_seqs"),
    ]
    out, offset = [], 0
    for name, dtype, shape, limit in spec:
        f = FieldLayout(name, dtype, shape, offset, limit)
        out.append(f)
        offset += -(-f.nbytes // ALIGN) * ALIGN
    return out


class StepBuffers:
    """A step's input fields on the host (pinned on CUDA) and on the device."""

    def __init__(self, max_tokens: int, max_seqs: int, table_width: int,
                 device: torch.device) -> None:  # fmt: skip
        self.layout = {f.name: f for f in step_layout(max_tokens, max_seqs, table_width)}
        last = list(self.layout.values())[-1]
        self.nbytes = last.offset + last.nbytes
        self.device = device
        self.pinned = device.type == "cuda"
        self.host_bytes = torch.zeros(self.nbytes, dtype=torch.uint8, pin_memory=self.pinned)
        self.device_bytes = (
            self.host_bytes if device.type == "cpu"
            else torch.zeros(self.nbytes, dtype=torch.uint8, device=device)
        )  # fmt: skip
        self.host = {n: self._view(self.host_bytes, f) for n, f in self.layout.items()}
        self.on_device = {n: self._view(self.device_bytes, f) for n, f in self.layout.items()}

    @staticmethod
    def _view(buf: torch.Tensor, f: FieldLayout) -> torch.Tensor:
        return buf[f.offset : f.offset + f.nbytes].view(f.dtype).view(f.shape)

    def stage(self, name: str, values: np.ndarray, start: int = 0) -> torch.Tensor:
        """Write ``values`` into rows ``start..`` of the host field, copy those rows to the
        device without blocking, and return the device rows ``0..start+len(values)``.
        Raises ValueError naming the field and its bound when the rows do not fit."""
        f = self.layout[name]
        n = len(values)
        end = start + n
        if end > f.shape[0] or (len(f.shape) > 1 and np.shape(values)[1:] != f.shape[1:]):
            raise ValueError(
                f"{name}: {end} rows of shape {tuple(np.shape(values)[1:])} do not fit the "
                f"step buffer of {f.shape[0]} rows of {f.shape[1:]} ({f.limit})"
            )
        host = self.host[name]
        host[start:end].numpy()[...] = values
        dev = self.on_device[name]
        if self.device_bytes is not self.host_bytes:
            dev[start:end].copy_(host[start:end], non_blocking=True)
        return dev[:end]
