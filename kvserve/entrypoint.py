"""What an entry point does to the whole process before it builds an engine.

Settings that belong to the process rather than to one engine (environment variables that a
library reads once, the interpreter's GIL switch interval) are changed here and nowhere else:
a module imported by a user's program must leave the process as it found it. The entry
points are the ``kvserve`` commands (:func:`kvserve.cli.main`), a server's start
(``kvserve serve``, :class:`kvserve.server.app.BackgroundServer`) and :class:`kvserve.LLM`'s
construction (an ``LLM(...)`` in a notebook is an entry point too). A worker process started
by an executor inherits the environment variables set here; it calls :func:`setup_process`
itself for anything else.
"""

from __future__ import annotations

import gc
import os
import sys

# oneDNN keeps a compiled primitive, and PyTorch's ideep layer a cache entry holding it, for
# every input shape it has seen: 1,024 of each by default. An engine step's row count is its
# token count, which changes almost every step under serving traffic, so a server's memory
# grew for hours towards a thousand primitives per matrix shape. Rebuilding a primitive costs
# far less than a step; 64 bounds both caches. Each variable is read once, at the process's
# first oneDNN call: set before it, and the user's own settings win.
ONEDNN_CACHE_CAPACITY = 64
ONEDNN_CACHE_VARS = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")
ONEDNN_DEFAULT_CAPACITY = 1024  # PyTorch's, where a variable is unset

# The server's engine thread and its event loop share one GIL. At CPython's default switch
# interval (5 ms) a thread that wants the GIL may wait that long for the other to let go: a
# token reaches its socket up to 5 ms after its step, and the next step starts up to 5 ms late
# when the loop was writing. Switches happen only while both threads want to run, so a shorter
# interval costs an idle loop nothing.
GIL_SWITCH_INTERVAL_S = 0.0005


def setup_process(serve: bool = False) -> None:
    """Bound oneDNN's per-shape caches (unless the user set them), and with ``serve`` (an
    HTTP server: an event loop beside the engine thread) shorten the GIL switch interval.
    Idempotent; call it before the first model is loaded."""
    for var in ONEDNN_CACHE_VARS:
        os.environ.setdefault(var, str(ONEDNN_CACHE_CAPACITY))
    if serve:
        sys.setswitchinterval(min(sys.getswitchinterval(), GIL_SWITCH_INTERVAL_S))


def onednn_cache_entries() -> int:
    """How many GEMM shapes (one primitive each) oneDNN's caches hold at once, as this
    process set them: the smaller of the two, PyTorch's default where unset or unreadable."""
    caps = []
    for var in ONEDNN_CACHE_VARS:
        try:
            caps.append(int(os.environ.get(var, ONEDNN_DEFAULT_CAPACITY)))
        except ValueError:
            caps.append(ONEDNN_DEFAULT_CAPACITY)
    return max(min(caps), 1)


def freeze_startup_heap() -> None:
    """Put every object alive now (the modules, the model's Python objects, the tokenizer) out
    of the garbage collector's reach, in a process that runs one engine for its whole life: a
    server, a worker rank. A full collection scans every object it can reach, and the step
    that triggers one waits for the scan; a rank's pause stalls the other ranks at their next
    collective. vLLM freezes its engine process the same way. Not for an ``LLM(...)`` in a
    user's program, which may drop an engine and build another: frozen objects in a reference
    cycle are never freed."""
    gc.collect()
    gc.freeze()
