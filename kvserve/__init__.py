"""kvserve: a KV-cache-centric LLM inference engine.

Heavy modules (torch, the engine) are imported lazily so that light tools such as
``kvserve plan`` and the task generators start fast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "LLMEngine",
    "SamplingParams",
    "StructuredOutputsParams",
    "RequestOutput",
    "__version__",
]

if TYPE_CHECKING:
    from kvserve.engine import LLMEngine
    from kvserve.llm import LLM
    from kvserve.sched.request import RequestOutput, SamplingParams
    from kvserve.structured.params import StructuredOutputsParams

_LAZY = {
    "LLM": "kvserve.llm",
    "LLMEngine": "kvserve.engine",
    "SamplingParams": "kvserve.sched.request",
    "RequestOutput": "kvserve.sched.request",
    "StructuredOutputsParams": "kvserve.structured.params",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvserve' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
