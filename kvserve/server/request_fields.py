"""Which top-level request fields the server refuses, and what it does with fields nobody knows.

vLLM's and OpenAI's request models are wider than what kvserve implements, and a field that is
dropped silently breaks a client with no error (a JSON pipeline that sends ``guided_json`` and
gets free text back). So every field of vLLM's ``ChatCompletionRequest`` and
``CompletionRequest`` and of OpenAI's create parameters is either declared on the request
models of :mod:`kvserve.server.protocol` (honoured) or listed in :data:`REFUSED` with the values
that mean "off" (accepted as a no-op, since clients send defaults); any other value is a 400
naming the field. A field honoured by the other endpoint is a 400 that says where it belongs.

A field neither API defines is accepted, as vLLM accepts it (clients send extras), but logged
once per name and counted in ``kvserve:ignored_request_fields_total{field}``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from prometheus_client import Counter
from pydantic import BaseModel

from kvserve.server.api_errors import bad_request

log = logging.getLogger("kvserve.server")

_TOOLS = "send tools and tool_choice instead (OpenAI's replacement)"
_MULTIMODAL = "this server serves text-only models"
_TEMPLATE = "the server's chat template takes no per-request input"
_RENDER = "it applies only to vLLM's render endpoints, which kvserve does not have"


@dataclass(frozen=True, slots=True)
class Refused:
    """A field kvserve does not implement: ``off`` are the values that leave the feature off
    (accepted, no effect); any other value is refused with ``why``."""

    off: tuple[Any, ...]
    why: str

    def is_off(self, value: Any) -> bool:
        # type-exact: 0 is not False, 1 is not True
        return any(value is None if o is None else type(value) is type(o) and value == o
                   for o in self.off)  # fmt: skip


def _refused(why: str, *off: Any) -> Refused:
    return Refused((None, *off), why)


REFUSED: dict[str, Refused] = {
    # OpenAI's legacy function calling (tools and tool_choice replace it).
    "functions": _refused(_TOOLS, []),
    "function_call": _refused(_TOOLS, "none"),
    # Reasoning models: no reasoning parser, so any reasoning stays in the content.
    "reasoning_effort": _refused("there is no reasoning parser"),
    "thinking_token_budget": _refused("there is no reasoning parser"),
    "include_reasoning": _refused(
        "there is no reasoning parser; reasoning, if any, stays in the content", True
    ),  # fmt: skip
    "verbosity": _refused("the model's own verbosity is the only one", "medium"),
    # Chat template input.
    "chat_template": _refused(_TEMPLATE),
    "chat_template_kwargs": _refused(_TEMPLATE, {}),
    "documents": _refused(_TEMPLATE, []),
    # Multimodal input and output.
    "mm_processor_kwargs": _refused(_MULTIMODAL, {}),
    "media_io_kwargs": _refused(_MULTIMODAL, {}),
    "prompt_embeds": _refused("prompts are text or token ids"),
    "modalities": _refused(_MULTIMODAL, ["text"]),
    "audio": _refused(_MULTIMODAL),
    # Sampling features the engine does not have.
    "use_beam_search": _refused("beam search is not implemented", False),
    "length_penalty": _refused("it applies only to beam search, which is not implemented", 1.0),
    "bad_words": _refused("use logit_bias or allowed_token_ids", []),
    "logprob_token_ids": _refused("use logprobs / top_logprobs"),
    "watermarking": _refused("watermarking is not implemented", False),
    "repetition_detection": _refused("use repetition_penalty or stop"),
    "spaces_between_special_tokens": _refused(
        "special tokens are decoded as the tokenizer joins them (as vLLM's fast detokenizer does)",
        True,
    ),  # fmt: skip
    "stream_interval": _refused("every engine step's tokens are streamed", 1),
    "suffix": _refused("fill-in-the-middle is not implemented", ""),
    # Serving features kvserve does not have.
    "ec_transfer_params": _refused(_MULTIMODAL),
    "vllm_xargs": _refused("there are no custom request extensions", {}),
    "session_id": _refused("requests carry no session state"),
    "routed_experts_prompt_start": _refused("no mixture-of-experts routing data is returned", 0),
    "return_weight_versions": _refused("the weights do not change while serving", False),
    "return_token_offsets": _refused(_RENDER, False),
    "mm_payload": _refused(_RENDER, "tensors"),
    "return_mm_kwargs": _refused(_RENDER, False),
    # OpenAI's platform features.
    "store": _refused("completions are not stored", False),
    "metadata": _refused("completions are not stored", {}),
    "moderation": _refused("there is no moderation"),
    "prediction": _refused("predicted outputs are not implemented"),
    "web_search_options": _refused("there is no web search"),
    "service_tier": _refused("there is one service tier", "auto", "default"),
    "prompt_cache_retention": _refused(
        "cached prefixes live in memory (the KV pool) while it has room", "in_memory"
    ),  # fmt: skip
    "prompt_cache_options": _refused("prefix caching is automatic", {}),
    "safety_identifier": _refused("use user, which workload classes match on"),
}


def screen(
    data: dict[str, Any],
    model: type[BaseModel],
    endpoint: str,
    elsewhere: dict[str, type[BaseModel]],
    ignored: IgnoredFields,
) -> dict[str, Any]:
    """``data`` less its no-op and unknown fields, ready for ``model``; raises a 400 naming the
    first field it refuses. ``elsewhere`` maps the other endpoints to their models, so that a
    field one of them honours is refused here with a pointer, not ignored."""
    out = {}
    for name, value in data.items():
        if name in model.model_fields:
            out[name] = value
        elif (refused := REFUSED.get(name)) is not None:
            if not refused.is_off(value):
                raise bad_request(name, f"is not supported by this server: {refused.why}")
        elif owners := [path for path, m in elsewhere.items() if name in m.model_fields]:
            raise bad_request(name, f"is not a field of {endpoint} (it is one of {owners[0]})")
        else:
            ignored.record(name)
    return out


class IgnoredFields:
    """Unknown fields: a warning the first time each name is seen, a count every time.

    Names come from clients, so both the set of logged names and the counter's label values
    are bounded: past :attr:`MAX_NAMES` distinct names (or a name longer than
    :attr:`MAX_LEN`) the rest are counted under ``field="_other"``."""

    MAX_NAMES = 100
    MAX_LEN = 64
    OTHER = "_other"

    def __init__(self, counter: Counter) -> None:
        self.counter = counter
        self.seen: set[str] = set()
        self.overflowed = False

    def record(self, name: str) -> None:
        label = name
        if name not in self.seen:
            if len(self.seen) >= self.MAX_NAMES or len(name) > self.MAX_LEN:
                label = self.OTHER
                if not self.overflowed:
                    self.overflowed = True
                    log.warning("unknown request fields beyond %d names (or longer than %d "
                                "characters) are ignored and counted as field=%r, not logged",
                                self.MAX_NAMES, self.MAX_LEN, self.OTHER)  # fmt: skip
            else:
                self.seen.add(name)
                log.warning("request field %r is not known to kvserve (nor to OpenAI's or "
                            "vLLM's API) and is ignored", name)  # fmt: skip
        self.counter.labels(label).inc()
