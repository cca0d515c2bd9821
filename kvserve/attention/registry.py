"""The registry of attention backends: one dict from ``--attention-backend`` name to class.

``auto`` (or None) picks, among the registered backends that run on the device and are
available there, the one with the highest ``auto_priority``: on a CPU the C kernels (``cpu``)
where they build and are not switched off (``KVSERVE_DISABLE_KERNELS=1``), else ``torch``;
on CUDA ``torch``. A new backend is a module with an
:class:`~kvserve.attention.backend.AttentionBackend` subclass (usually of
:class:`~kvserve.attention.torch_backend.TorchBackend`, overriding the kernel hooks it serves)
and an entry here; its class attributes say where it runs and how ``auto`` ranks it.

The registry names its classes by import path and imports them (and torch) only when one is
asked for, so building a command line parser stays light.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from kvserve.config import ConfigError

if TYPE_CHECKING:
    import torch

    from kvserve.attention.backend import AttentionBackend

ATTENTION_BACKENDS: dict[str, str] = {
    "torch": "kvserve.attention.torch_backend:TorchBackend",
    "cpu": "kvserve.attention.cpu_backend:CpuBackend",
    "triton": "kvserve.attention.triton_backend:TritonBackend",
}
AUTO = "auto"
# The CLI's choices.
ATTENTION_BACKEND_CHOICES: tuple[str, ...] = (AUTO, *ATTENTION_BACKENDS)


def backend_class(name: str) -> type[AttentionBackend]:
    """The class of a registered backend name."""
    module, cls = ATTENTION_BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)


def resolve_backend(name: str | None, device: torch.device) -> str:
    """The registered name that ``name`` (a name, ``auto`` or None) runs as on ``device``.
    Raises :class:`ConfigError` naming ``attention_backend`` for a name not registered or a
    backend that does not run on the device."""
    if name is None or name == AUTO:
        usable = [backend_class(n) for n in ATTENTION_BACKENDS]
        usable = [c for c in usable if c.runs_on(device) and c.available(device)]
        return max(usable, key=lambda c: c.auto_priority).name
    if not isinstance(name, str) or name not in ATTENTION_BACKENDS:
        raise ConfigError(
            f"attention_backend: must be one of {', '.join(ATTENTION_BACKEND_CHOICES)}, "
            f"got {name!r}"
        )
    if not backend_class(name).runs_on(device):
        here = [n for n in ATTENTION_BACKENDS if backend_class(n).runs_on(device)]
        raise ConfigError(
            f"attention_backend: {name!r} does not run on {device.type} devices; there, choose "
            f"one of {', '.join([AUTO, *here])}"
        )
    return name


def make_backend(name: str | None, device: torch.device) -> AttentionBackend:
    """The backend ``name`` (a name, ``auto`` or None) for ``device`` (see
    :func:`resolve_backend`)."""
    return backend_class(resolve_backend(name, device))()
