"""Structured outputs: a request's output constrained by a JSON schema, a regex, a choice or a
grammar (vLLM's ``structured_outputs``), enforced by a token mask each step.

``params`` holds the request side (what a request asks for, validated when it is made); the
backends compile a constraint into a grammar once per (constraint, tokenizer) and make one
matcher per sample from it (:mod:`kvserve.structured.backend`). Only ``params`` is imported
here: the grammar libraries load when the engine first compiles.
"""

from kvserve.structured.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
