"""The shared-memory communicator's inner loop (``collectives.c``): publish, await and sum
one collective in one native call, built on first use like the other kernels.

The communicator's torch-op path (kvserve/distributed/shm_communicator.py) stays the
reference and the fallback: with no compiler, ``KVSERVE_DISABLE_KERNELS=1``, or a dtype the
native sum does not take (only float32 and bfloat16 are summed here; any dtype can be
published and awaited).
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import torch

from kvserve.kernels import NativeLibrary

_SRC = Path(__file__).with_name("collectives.c")
# No -ffast-math, no contraction: every rank adds in the same order and rounds where the
# reference (torch.add) rounds.
_FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-ffp-contract=off", "-std=c11"]
SUM_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
# The phases of one call (collectives.c): a bit each.
PUBLISH, AWAIT, REDUCE = 1, 2, 4
_p, _i, _i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64


class ShmLayout(ctypes.Structure):
    """A communicator's segment and its place in it (``shm_layout`` in collectives.c)."""

    _fields_ = [
        ("segment", _p),
        ("slot", _i64),
        ("header", _i64),
        ("buffer_bytes", _i64),
        ("spin_ns", _i64),
        ("rank", ctypes.c_int32),
        ("world", ctypes.c_int32),
    ]


def _declare(lib: ctypes.CDLL) -> None:
    lib.kvserve_shm_collective.restype = _i
    lib.kvserve_shm_collective.argtypes = [ctypes.POINTER(ShmLayout), _i64, _p, _i64, _i, _i]


_LIB = NativeLibrary(_SRC, _FLAGS, "shared-memory collectives", _declare)


def shm_collective() -> Any:
    """``kvserve_shm_collective`` (collectives.c) as a ctypes function, or None where the
    native kernels are unavailable or switched off."""
    lib = _LIB.get()
    return None if lib is None else lib.kvserve_shm_collective
