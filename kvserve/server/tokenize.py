"""vLLM's ``POST /tokenize`` and ``POST /detokenize``: the server's own tokenizer and chat
template, so a client counts and builds prompts exactly as the server will see them.

``/tokenize`` takes a prompt (``add_special_tokens`` defaults to true, as for a completion) or
chat messages (rendered through the chat template as ``/v1/chat/completions`` renders them;
``add_special_tokens`` defaults to false, the template writes its own) and answers
``{"count", "max_model_len", "tokens", "token_strs"}``; ``token_strs`` are the vocabulary's
strings for the ids (byte-level tokens as the vocabulary writes them, e.g. ``Ġthe``) when
``return_token_strs`` is true, else null. ``/detokenize`` decodes ids to ``{"prompt"}`` with
special tokens kept, as vLLM does.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from kvserve.model.tokenizer import Tokenizer
from kvserve.server.api_errors import bad_request
from kvserve.server.chat_prompt import render_chat
from kvserve.server.protocol import ChatMessage, message_dicts
from kvserve.server.serving import ServerState
from kvserve.server.tools import ChatTool


class TokenizeCompletionRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    model: str | None = None
    messages: list[ChatMessage]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool | None = False
    # vLLM's: the tools the chat template describes (the prompt chat completions would send)
    tools: list[ChatTool] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    model: str | None = None
    tokens: list[int]


def _tokenizer(state: ServerState, field: str) -> Tokenizer:
    if state.tokenizer is None:
        raise bad_request(field, "this model has no tokenizer.json")
    return state.tokenizer


def tokenize(state: ServerState, req: TokenizeCompletionRequest | TokenizeChatRequest) -> dict:
    state.check_model(req.model)
    if isinstance(req, TokenizeChatRequest):
        if not req.messages:
            raise bad_request("messages", "must contain at least one message")
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        text = render_chat(state.tokenizer, message_dicts(req.messages),
                           req.add_generation_prompt, req.continue_final_message,
                           tools)  # fmt: skip
        tok = _tokenizer(state, "messages")
    else:
        text, tok = req.prompt, _tokenizer(state, "prompt")
    ids = tok.encode(text, add_special_tokens=req.add_special_tokens)
    strs: list[Any] | None = None
    if req.return_token_strs:
        strs = [tok.id_to_token(t) for t in ids]
    return {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids,
            "token_strs": strs}  # fmt: skip


def detokenize(state: ServerState, req: DetokenizeRequest) -> dict:
    state.check_model(req.model)
    tok = _tokenizer(state, "tokens")
    vocab = tok.vocab_size
    for i, t in enumerate(req.tokens):
        if not 0 <= t < vocab:
            raise bad_request("tokens", f"token ids must be in [0, {vocab}) for this model's "
                              f"tokenizer; got {t} at index {i}")  # fmt: skip
    return {"prompt": tok.decode(req.tokens, skip_special_tokens=False)}
