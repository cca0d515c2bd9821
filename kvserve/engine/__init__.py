"""The engine: :class:`LLMEngine` (text in, outputs out) over :class:`EngineCore` (the
scheduler and KV manager driven by a runner and a clock)."""

from kvserve.connectors.prefix import PrefixPayload
from kvserve.engine.core import EngineCore
from kvserve.engine.inputs import EngineCoreRequest, PromptType
from kvserve.engine.llm_engine import LLMEngine
from kvserve.engine.stats import EngineStats

__all__ = [
    "EngineCore",
    "EngineCoreRequest",
    "EngineStats",
    "LLMEngine",
    "PrefixPayload",
    "PromptType",
]
