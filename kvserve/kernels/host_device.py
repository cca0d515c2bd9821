"""A step's small tensors across between the host and the device, without stalling the host.

On a GPU the host queues a step's kernels and runs ahead of them. A blocking copy of host data
to the device (``torch.tensor(x, device="cuda")``, ``t.to("cuda")`` from pageable memory)
makes it wait until every kernel already queued has run, and so does every read of a value on
the host (``.tolist()``, ``.item()``, ``.cpu()``). One such wait per step is the price of the
sampled tokens; each further one leaves the device idle while the host queues what comes
next. So every upload in a step goes through :func:`to_device` (staged in pinned memory and
copied without blocking: the caching host allocator keeps a staging block alive until its
copy has run) and every download through one :func:`to_host` call (what the host needs of the
step, packed into one copy). On a CPU host and device share one memory: the data is wrapped
where it lies and nothing is copied.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

Data = np.ndarray | Sequence[int] | Sequence[float] | Sequence[bool] | torch.Tensor


def _on_host(data: Data, dtype: torch.dtype | None) -> torch.Tensor:
    if isinstance(data, torch.Tensor):
        t = data
    elif isinstance(data, np.ndarray):
        t = torch.from_numpy(np.ascontiguousarray(data))
    else:
        return torch.tensor(data, dtype=dtype)
    return t if dtype is None or t.dtype == dtype else t.to(dtype)


def _upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    if host.device.type != "cpu":  # already on a device: no staging
        return host.to(device, non_blocking=True)
    return host.pin_memory().to(device, non_blocking=True)


def to_device(data: Data, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``data`` (a NumPy array, a list of numbers or a host tensor) as a tensor on ``device``,
    copied without blocking the host. On a CPU: the same memory where it can be."""
    host = _on_host(data, dtype)
    if device.type == "cpu":
        return host
    return _upload(host, device)


def _download(tensors: Sequence[torch.Tensor]) -> list[list]:
    if all(t.device.type == "cpu" for t in tensors):
        return [t.tolist() for t in tensors]
    return _packed(tensors)


def _packed(tensors: Sequence[torch.Tensor]) -> list[list]:
    # One copy: every tensor as float64 (exact for float32 values and for integers below
    # 2**53, token ids and counts among them), split and cast back on the host.
    flat = torch.cat([t.reshape(-1).to(torch.float64) for t in tensors]).cpu()
    out, start = [], 0
    for t in tensors:
        n = t.numel()
        out.append(flat[start : start + n].view(t.shape).to(t.dtype).tolist())
        start += n
    return out


def to_host(*tensors: torch.Tensor) -> list[list]:
    """Each tensor's values as (nested) Python lists, read in one device-to-host copy: a
    step's one wait for the device."""
    return _download(tensors)
