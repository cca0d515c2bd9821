"""What in a step would make a CUDA host wait for the device, found on a CPU.

On a GPU the host queues kernels and runs ahead; it stops and waits for every queued kernel
when it reads a tensor's values (``.tolist()``, ``.item()``, ``.cpu()``, ``.numpy()``, a
tensor in an ``if``), when an op's output size depends on values (``nonzero``, a boolean mask
as an index, ``repeat_interleave`` without ``output_size``, ``unique``), and when it copies
host data to the device with a blocking copy (``torch.tensor(x, device=...)``,
``t.to(device)``). On a CPU none of these waits, so none shows in a timing: :class:`SyncAudit`
records them while a step runs, on the thread that entered it. Dispatched ops are seen by a
dispatch mode; value reads and copies by wrapping the tensor methods that do them. The
sanctioned ways across, :func:`kvserve.kernels.host_device.to_device` and ``to_host``, are
counted apart.
"""

from __future__ import annotations

import contextlib
import threading
import traceback
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kvserve.kernels import host_device

# ops whose output's size or a host value depends on the data: each is a device sync on CUDA
DATA_DEPENDENT = {
    "aten._local_scalar_dense.default",
    "aten.nonzero.default",
    "aten.nonzero_static.default",
    "aten.masked_select.default",
    "aten._unique2.default",
    "aten.unique_dim.default",
    "aten.unique_consecutive.default",
    "aten.is_nonzero.default",
    "aten.equal.default",
    "aten.allclose.default",
}


def _bool_index(args: Any) -> bool:
    idx = args[1] if len(args) > 1 else ()
    return any(isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in idx or ())


class _Ops(TorchDispatchMode):
    def __init__(self, audit: SyncAudit) -> None:
        super().__init__()
        self.audit = audit

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        name = str(func)
        kwargs = kwargs or {}
        if name in DATA_DEPENDENT:
            self.audit.note(name)
        elif name.startswith(("aten.index.Tensor", "aten.index_put")) and _bool_index(args):
            self.audit.note(f"{name} with a boolean mask")
        elif name.startswith("aten.repeat_interleave") and kwargs.get("output_size") is None:
            if len(args) < 3 or args[2] is None:
                self.audit.note(f"{name} without output_size")
        return func(*args, **kwargs)


def _names_a_device(args: tuple, kwargs: dict) -> bool:
    if "device" in kwargs:
        return True
    return any(isinstance(a, (torch.device, str)) for a in args)


class SyncAudit:
    """``with SyncAudit() as audit: ...`` then ``audit.syncs`` (what would wait, each with
    where it happened) and ``audit.downloads`` (calls of ``to_host``)."""

    def __init__(self) -> None:
        self.syncs: list[tuple[str, str]] = []
        self.downloads = 0
        self.uploads = 0
        self._sanctioned = 0
        self._thread = threading.get_ident()

    def note(self, what: str) -> None:
        # Other threads (a grammar's mask filled beside the forward pass) work on host
        # tensors: only the stepping thread's reads and copies cross to a device.
        if self._sanctioned or threading.get_ident() != self._thread:
            return
        stack = traceback.extract_stack()[:-2]
        ours = [f for f in stack if "/kvserve/" in f.filename and "sync_audit" not in f.filename]
        where = f"{ours[-1].filename.split('/kvserve/')[-1]}:{ours[-1].lineno}" if ours else "?"
        self.syncs.append((what, where))

    def reset(self) -> None:
        self.syncs.clear()
        self.downloads = self.uploads = 0

    @contextlib.contextmanager
    def _patched(self) -> Iterator[None]:
        audit = self
        saved: list[tuple[Any, str, Any]] = []

        def patch(owner: Any, name: str, make: Any) -> None:
            orig = getattr(owner, name)
            saved.append((owner, name, orig))
            setattr(owner, name, make(orig))

        def reads(label: str):  # noqa: ANN202
            def make(orig):  # noqa: ANN001, ANN202
                def wrapper(*a, **k):  # noqa: ANN002, ANN003, ANN202
                    audit.note(label)
                    return orig(*a, **k)

                return wrapper

            return make

        for name in ("tolist", "item", "numpy", "cpu"):
            patch(torch.Tensor, name, reads(f"Tensor.{name}()"))

        def to(orig):  # noqa: ANN001, ANN202
            def wrapper(self, *a, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
                if _names_a_device(a, k) and not k.get("non_blocking"):
                    audit.note("Tensor.to(device) without non_blocking")
                return orig(self, *a, **k)

            return wrapper

        patch(torch.Tensor, "to", to)

        def made_on(label: str):  # noqa: ANN202
            def make(orig):  # noqa: ANN001, ANN202
                def wrapper(*a, **k):  # noqa: ANN002, ANN003, ANN202
                    if k.get("device") is not None:
                        audit.note(f"{label}(data, device=...)")
                    return orig(*a, **k)

                return wrapper

            return make

        patch(torch, "tensor", made_on("torch.tensor"))
        patch(torch, "as_tensor", made_on("torch.as_tensor"))

        def counted(attr: str):  # noqa: ANN202
            def make(orig):  # noqa: ANN001, ANN202
                def wrapper(*a, **k):  # noqa: ANN002, ANN003, ANN202
                    setattr(audit, attr, getattr(audit, attr) + 1)
                    audit._sanctioned += 1
                    try:
                        return orig(*a, **k)
                    finally:
                        audit._sanctioned -= 1

                return wrapper

            return make

        patch(host_device, "_upload", counted("uploads"))
        patch(host_device, "_download", counted("downloads"))
        try:
            yield
        finally:
            for owner, name, orig in reversed(saved):
                setattr(owner, name, orig)

    def __enter__(self) -> SyncAudit:
        self._thread = threading.get_ident()
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(self._patched())
        self._stack.enter_context(_Ops(self))
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()
