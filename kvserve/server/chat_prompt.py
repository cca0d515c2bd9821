"""A chat rendered through the model's template, as /v1/chat/completions and /tokenize both need.

``continue_final_message`` (vLLM's, from transformers' ``apply_chat_template``) renders the
conversation without a generation prompt and cuts the text right after the last message's
content, so the model continues that message (a prefill of the reply) instead of closing it
with the template's end-of-turn marker and starting another.
"""

from __future__ import annotations

from typing import Any

from jinja2 import TemplateError

from kvserve.model.tokenizer import ChatTemplateError, Tokenizer
from kvserve.server.api_errors import bad_request


def render_chat(
    tok: Tokenizer | None,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
    continue_final_message: bool = False,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """The prompt text; a 400 naming ``messages`` when the template refuses them."""
    if tok is None:
        raise bad_request("messages", "this model has no tokenizer; use /v1/completions")
    if continue_final_message and add_generation_prompt:
        raise bad_request("continue_final_message", "cannot be true while "
                          "add_generation_prompt is true (set it to false)")  # fmt: skip
    try:
        text = tok.apply_chat_template(messages, add_generation_prompt, tools)
    except (ChatTemplateError, TemplateError) as e:
        msg = str(e).removeprefix("messages: ")
        raise bad_request("messages", f"the chat template refused them: {msg}") from None
    if not continue_final_message:
        return text
    final = messages[-1].get("content") or ""
    for needle in (final, final.strip()):
        if needle and (at := text.rfind(needle)) >= 0:
            return text[: at + len(needle)]
    raise bad_request("continue_final_message", "the chat template does not write the last "
                      "message's content, so there is nothing to continue")  # fmt: skip
