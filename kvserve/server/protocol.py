"""OpenAI request models (pydantic), the mapping onto :class:`SamplingParams`, and errors.

Models are strict (``"1"`` is not an integer, ``1.5`` is not ``n``) so a wrong type is refused
rather than guessed at, and closed (``extra="forbid"``): ``request_fields.screen`` has already
refused or set aside every field they do not declare, so a declared field is one the server
honours. Range checks are left to :class:`SamplingParams`, the single place that
knows the allowed values; its :class:`InvalidRequestError` names the engine field, which
:func:`api_error_from_invalid` renames to the HTTP field the client actually sent.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, field_validator

from kvserve.errors import InvalidRequestError
from kvserve.sched.request import SamplingParams
from kvserve.server.api_errors import api_error_from_invalid, bad_request
from kvserve.server.structured import Constraint, StructuredFields
from kvserve.server.tools import ChatTool, ToolPlan


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    include_usage: bool | None = False
    # vLLM's: every chunk carries the usage so far (with include_usage).
    continuous_usage_stats: bool | None = False
    # OpenAI's random padding against length side channels: only off (refused when true).
    include_obfuscation: bool | None = None


class _SamplingFields(StructuredFields):
    """Fields common to /v1/completions and /v1/chat/completions (with the constraint fields
    of :class:`StructuredFields`)."""

    model_config = ConfigDict(strict=True, extra="forbid")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: Any = None
    stop_token_ids: list[int] | None = None
    n: int = 1
    best_of: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    # OpenAI's: {"token id": bias in [-100, 100]}; the keys are token ids as strings.
    logit_bias: dict[str, Any] | None = None
    # vLLM's extra field: only these tokens may be sampled.
    allowed_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None  # None: true (vLLM's default)
    include_stop_str_in_output: bool = False
    # vLLM's: the prompt's own log-probs (top-n beside each actual token); not when streaming.
    prompt_logprobs: int | None = None
    # vLLM's: keep only this many prompt tokens (-1: max_model_len - 1), from the end ("left",
    # the default for generation, as vLLM) or the start ("right").
    truncate_prompt_tokens: int | None = None
    truncation_side: Literal["left", "right"] | None = None
    # vLLM's: the response's id is "cmpl-<request_id>" / "chatcmpl-<request_id>".
    request_id: str | None = None
    # vLLM's: token ids beside the text (and the prompt's); logprob tokens as "token_id:N".
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Client-chosen cache partition *within* its tenant (vLLM: cache_salt; OpenAI's name).
    cache_salt: str | None = None
    prompt_cache_key: str | None = None
    # kvserve extension: this request's KV retention policy ("window:512", "none").
    kv_retention: str | None = None
    # vLLM's scheduling priority (lower is served first, under --scheduling-policy priority)
    # and kvserve's workload class by name (--workload-classes).
    priority: int | None = None
    workload_class: str | None = None
    # vLLM's disaggregated prefill/decode protocol (kvserve.disagg.params): the answer of a
    # request sent with {"do_remote_decode": true} carries where its KV can be pulled from.
    kv_transfer_params: dict[str, Any] | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, v: Any) -> Any:
        if v is None or isinstance(v, str):
            return v
        if isinstance(v, list) and all(isinstance(s, str) for s in v):
            return v
        raise ValueError("must be a string or a list of strings")

    def check_common(self) -> None:
        """Cross-field rules that pydantic's per-field types cannot express."""
        if self.best_of is not None and self.best_of != self.n:
            raise bad_request("best_of", "is not supported (only best_of == n)")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options", "is only allowed when stream is true")
        if self.stream_options is not None and self.stream_options.include_obfuscation:
            raise bad_request("stream_options.include_obfuscation",
                              "is not supported by this server (only false)")  # fmt: skip
        if self.prompt_logprobs is not None and self.stream:
            raise bad_request("prompt_logprobs", "is not available when stream is true")
        t = self.truncate_prompt_tokens
        if t is not None and t != -1 and t < 1:
            raise bad_request("truncate_prompt_tokens", f"must be -1 or >= 1, got {t}")
        if self.request_id is not None and not 1 <= len(self.request_id) <= 256:
            raise bad_request("request_id", "must be 1 to 256 characters")

    def truncate(self, ids: list[int], max_model_len: int) -> list[int]:
        """The prompt after ``truncate_prompt_tokens`` (vLLM's rule: -1 keeps room for one
        output token)."""
        keep = self.truncate_prompt_tokens
        if keep is None:
            return ids
        if keep == -1:
            keep = max_model_len - 1
        if keep >= len(ids):
            return ids
        return ids[:keep] if self.truncation_side == "right" else ids[-keep:]

    @property
    def client_salt(self) -> str | None:
        return self.cache_salt if self.cache_salt is not None else self.prompt_cache_key

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        so = self.stream_options
        return bool(so and so.include_usage and so.continuous_usage_stats)

    def sampling_kwargs(self, constraint: Constraint | None) -> dict[str, Any]:
        """Only the fields the client set; SamplingParams' defaults (vLLM's) fill the rest."""
        kw: dict[str, Any] = {
            "n": self.n,
            "stop": self.stop,
            "stop_token_ids": self.stop_token_ids,
            "ignore_eos": self.ignore_eos,
            "min_tokens": self.min_tokens,
            "skip_special_tokens": self.skip_special_tokens is not False,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "seed": self.seed,
        }
        if self.kv_retention is not None:
            kw["kv_retention"] = self.kv_retention
        if self.logit_bias:
            kw["logit_bias"] = _logit_bias(self.logit_bias)
        if self.allowed_token_ids is not None:
            kw["allowed_token_ids"] = self.allowed_token_ids
        if self.prompt_logprobs is not None:
            kw["prompt_logprobs"] = self.prompt_logprobs
        if constraint is not None:
            kw["structured_outputs"] = constraint.params()
        for name in (
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
        ):
            value = getattr(self, name)
            if value is not None:
                kw[name] = value
        return kw


class CompletionRequest(_SamplingFields):
    """POST /v1/completions. ``max_tokens`` defaults to 16, as in OpenAI's API."""

    prompt: Any
    max_tokens: int | None = 16
    logprobs: int | None = None
    # The prompt's text (and, with logprobs, its tokens' log-probs) before the completion.
    echo: bool | None = False
    add_special_tokens: bool = True

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, v: Any) -> Any:
        if isinstance(v, str):
            return v
        if isinstance(v, list) and v:
            if all(isinstance(x, str) for x in v):
                return v
            if all(_is_int(x) for x in v):
                return v
            if all(isinstance(x, list) and x and all(_is_int(t) for t in x) for x in v):
                return v
        if isinstance(v, list) and not v:
            raise ValueError("must not be empty")
        raise ValueError(
            "must be a string, a list of strings, a list of token ids or a list of such lists"
        )

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: text or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if isinstance(p[0], int):
            return [list(p)]
        return list(p)

    def sampling_params(self, constraint: Constraint | None = None) -> SamplingParams:
        self.check_common()
        kw = self.sampling_kwargs(constraint)
        kw["max_tokens"] = self.max_tokens
        kw["logprobs"] = self.logprobs
        if self.echo and self.logprobs is not None and self.prompt_logprobs is None:
            kw["prompt_logprobs"] = self.logprobs  # echoed prompt tokens get logprobs too
        return _build_params(kw, {})


def _logit_bias(bias: dict[str, Any]) -> dict[int, Any]:
    """OpenAI's string keys as token ids; the values are checked by SamplingParams."""
    out = {}
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit()):
            raise bad_request("logit_bias", f"keys must be token ids (digits), got {key!r}")
        out[int(key)] = value
    return out


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


Role = Literal["system", "developer", "user", "assistant", "tool"]


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    role: Role
    content: Any = None
    name: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, v: Any) -> Any:
        """Text or a list of text parts (joined by newlines, as vLLM does)."""
        if v is None or isinstance(v, str):
            return v
        if isinstance(v, list):
            texts = []
            for part in v:
                if not isinstance(part, dict) or part.get("type") != "text":
                    raise ValueError("only text content parts ({'type': 'text'}) are supported")
                if not isinstance(part.get("text"), str):
                    raise ValueError("a text part needs a string 'text'")
                texts.append(part["text"])
            return "\n".join(texts)
        raise ValueError("must be a string or a list of text parts")


def message_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The messages as the chat template reads them. An assistant's ``tool_calls`` carry
    their arguments as objects (templates write them with ``tojson``; OpenAI sends text), a
    tool's reply its ``tool_call_id``, as vLLM hands them to the template."""
    out = []
    for i, m in enumerate(messages):
        d: dict[str, Any] = {"role": m.role, "content": m.content or ""}
        if m.name is not None:
            d["name"] = m.name
        extra = m.model_extra or {}
        if m.role == "assistant" and extra.get("tool_calls") is not None:
            d["tool_calls"] = _template_calls(extra["tool_calls"], f"messages[{i}].tool_calls")
        if m.role == "tool" and extra.get("tool_call_id") is not None:
            if not isinstance(extra["tool_call_id"], str):
                raise bad_request(f"messages[{i}].tool_call_id", "must be a string")
            d["tool_call_id"] = extra["tool_call_id"]
        out.append(d)
    return out


def _template_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(calls, list):
        raise bad_request(where, "must be a list of tool calls")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_request(f"{where}[{j}].function", "must be {name, arguments}")
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                raise bad_request(f"{where}[{j}].function.arguments",
                                  "must be a JSON object's text") from None  # fmt: skip
        out.append({**call, "function": {**fn, "arguments": args}})
    return out


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions. ``max_completion_tokens`` is OpenAI's newer name for
    ``max_tokens``; without either, the reply may run to max_model_len."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    # vLLM's: continue the last (assistant) message instead of starting a new one.
    continue_final_message: bool = False
    # vLLM's: BOS on top of what the chat template writes (off: the template has it).
    add_special_tokens: bool = False
    # vLLM's: the reply starts with the last message's content when it is the assistant's.
    echo: bool | None = False
    # vLLM's: the rendered chat template in the response (in the first chunk when streaming).
    return_prompt_text: bool | None = None
    tools: list[ChatTool] | None = None
    tool_choice: Any = None  # "none" | "auto" | "required" | {"type": "function", ...}
    parallel_tool_calls: bool | None = None

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template reads them (OpenAI's JSON)."""
        if not self.tools:
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

    @field_validator("messages")
    @classmethod
    def _messages(cls, v: list[ChatMessage]) -> list[ChatMessage]:
        if not v:
            raise ValueError("must contain at least one message")
        return v

    def message_dicts(self) -> list[dict[str, Any]]:
        return message_dicts(self.messages)

    def output_constraint(self, plan: ToolPlan | None) -> Constraint | None:
        """The constraint the request asked for, or the one its tool_choice implies."""
        asked = self.constraint()
        forced = plan.constraint if plan is not None else None
        if asked is not None and forced is not None:
            raise bad_request("tool_choice", f"forces a tool call, which cannot be combined "
                              f"with {asked.source}")  # fmt: skip
        return asked or forced

    def sampling_params(self, constraint: Constraint | None = None) -> SamplingParams:
        self.check_common()
        if self.top_logprobs and not self.logprobs:  # 0 is vLLM's default: no alternatives
            raise bad_request("top_logprobs", "requires logprobs to be true")
        kw = self.sampling_kwargs(constraint)
        use_mct = self.max_completion_tokens is not None
        kw["max_tokens"] = self.max_completion_tokens if use_mct else self.max_tokens
        kw["logprobs"] = (self.top_logprobs or 0) if self.logprobs else None
        rename = {"logprobs": "top_logprobs"}
        if use_mct:
            rename["max_tokens"] = "max_completion_tokens"
        return _build_params(kw, rename)


def _build_params(kw: dict[str, Any], rename: dict[str, str]) -> SamplingParams:
    try:
        return SamplingParams(**kw)
    except InvalidRequestError as e:
        raise api_error_from_invalid(e, rename) from None
