"""glibc malloc settings for a CPU engine: keep activation buffers in the heap, where a freed
buffer is reused by the next step, instead of mapping and unmapping them on every op.

PyTorch's CPU tensors come from ``malloc``. glibc serves requests above its mmap threshold
(128 KiB, raised adaptively up to 32 MiB) with fresh ``mmap`` pages, and returns heap memory
above its trim threshold to the OS; either way the next step's buffers of the same sizes fault
their pages in again, one 4 KiB page at a time (a kernel entry and a zeroed page each, dearer
still in a virtual machine). A prefill step of a few thousand tokens allocates tens of MB of
activations per layer. With the threshold at its ceiling and trimming off, those buffers stay
mapped and are reused: resident memory settles at the weights, the KV pool and the largest
step's working set, which ``max_num_batched_tokens`` bounds. vLLM's CPU build gets the same
effect by preloading tcmalloc. ``KVSERVE_MALLOC_TUNING=0`` leaves glibc's defaults.
"""

from __future__ import annotations

import ctypes
import logging
import platform

from kvserve import envs

log = logging.getLogger("kvserve.kernels")

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 32 << 20  # glibc's ceiling on 64-bit (half its 64 MiB arena heap)
TRIM_THRESHOLD = 1 << 30

_done = False


def tune_host_allocator() -> bool:
    """Apply the settings once per process; False where they do not apply (not glibc, turned
    off, or refused)."""
    global _done
    if _done:
        return True
    if not envs.KVSERVE_MALLOC_TUNING or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    ok = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
    ok = libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1 and ok
    if not ok:
        log.warning("glibc refused the malloc settings; activations are mapped per step")
    _done = ok
    return ok
