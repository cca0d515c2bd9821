"""Copies of KV blocks between a GPU pool and host memory that keep the engine's step moving.

On CUDA an export gathers the blocks on the compute stream (a device-to-device copy at HBM
speed), then copies them to **pinned** host memory on a stream of its own: the engine thread
does not wait for the transfer, and the next step's kernels overlap it. The payload carries an
event that whoever reads its bytes waits on (:meth:`BlockPayload.wait`): the offload worker
before it checksums them, an import before it reads them. An import copies each tensor to the
device once on the copy stream (from pinned memory, so the engine thread does not wait either)
and makes the compute stream wait for that copy, not for anything else.

On the CPU there is nothing to overlap: an export is one copy into the payload, an import one
copy out of it.
"""

from __future__ import annotations

from typing import Any

import torch


class HostCopies:
    """Device <-> host copies for one pool's ``device``."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream: Any = None
        if device.type == "cuda":
            self.stream = torch.cuda.Stream(device)

    @property
    def pins(self) -> bool:
        """Whether host buffers for this device should be pinned (page-locked), so that
        copies to and from it run asynchronously."""
        return self.stream is not None

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        """A pinned host copy of the device tensor ``t``, started on the copy stream once the
        compute stream has produced ``t``; read it only after :meth:`done`'s event."""
        if self.stream is None:
            return t.cpu()
        out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            out.copy_(t, non_blocking=True)
        t.record_stream(self.stream)  # the allocator must not reuse t before the copy ends
        return out

    def done(self) -> Any:
        """An event that completes when every copy queued so far has, or None on the CPU."""
        if self.stream is None:
            return None
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` on the device, for kernels on the current stream. A pinned ``t`` is copied on
        the copy stream without blocking the caller; a pageable one the usual way."""
        if self.stream is None or not t.is_pinned():
            return t.to(self.device)
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.stream):
            out = t.to(self.device, non_blocking=True)
        compute.wait_stream(self.stream)
        out.record_stream(compute)  # allocated on the copy stream, used on the compute one
        return out
