"""Tokenizer from a Hugging Face directory (``tokenizer.json``) with its chat template.

Only the ``tokenizers`` library is used, not ``transformers``. Encoding applies the
tokenizer's own post-processor (which is where Llama-style tokenizers add BOS), exactly as
``AutoTokenizer(text)`` does; a rendered chat template already holds its special tokens, so it
is encoded without adding more.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer


class ChatTemplateError(ValueError):
    pass


def _raise(message: str) -> None:
    raise ChatTemplateError(message)


def _token_str(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


class Tokenizer:
    def __init__(self, path: str | Path, extra_eos_ids: tuple[int, ...] = ()) -> None:
        path = Path(path)
        tok_file = path / "tokenizer.json"
        if not tok_file.exists():
            raise FileNotFoundError(f"tokenizer: {tok_file} not found")
        self._tok = HFTokenizer.from_file(str(tok_file))
        cfg: dict[str, Any] = {}
        if (path / "tokenizer_config.json").exists():
            with open(path / "tokenizer_config.json") as f:
                cfg = json.load(f)
        self.chat_template: str | None = cfg.get("chat_template")
        if isinstance(self.chat_template, list):  # named templates: take "default"
            named = {t["name"]: t["template"] for t in self.chat_template}
            self.chat_template = named.get("default") or next(iter(named.values()), None)
        jinja_file = path / "chat_template.jinja"
        if self.chat_template is None and jinja_file.exists():
            self.chat_template = jinja_file.read_text()
        self.bos_token = _token_str(cfg.get("bos_token"))
        self.eos_token = _token_str(cfg.get("eos_token"))
        self.pad_token = _token_str(cfg.get("pad_token"))
        self.model_max_length = cfg.get("model_max_length")
        eos_ids = list(extra_eos_ids)
        gen_cfg = path / "generation_config.json"
        if gen_cfg.exists():
            with open(gen_cfg) as f:
                gen_eos = json.load(f).get("eos_token_id")
            if gen_eos is not None:
                eos_ids += gen_eos if isinstance(gen_eos, list) else [gen_eos]
        if self.eos_token is not None:
            tid = self._tok.token_to_id(self.eos_token)
            if tid is not None:
                eos_ids.append(tid)
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(int(t) for t in eos_ids))
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        self._env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        self._env.globals["raise_exception"] = _raise
        self._env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self._env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(
            x, ensure_ascii=False, indent=indent
        )

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The prompt text; ``tools`` (OpenAI's JSON) go to the template as transformers'
        ``apply_chat_template(tools=...)`` passes them, for templates that describe them."""
        if not self.chat_template:
            raise ChatTemplateError(
                "messages: this model has no chat template (tokenizer_config.json "
                "chat_template); use a completion prompt instead"
            )
        template = self._env.from_string(self.chat_template)
        return template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **({"tools": tools} if tools else {}),
        )

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        return self.encode(self.apply_chat_template(messages), add_special_tokens=False)


class IncrementalDetokenizer:
    """Turns a growing list of output ids into text, emitting only complete characters.

    It decodes a short window (a few tokens of context plus the new ones) and emits the
    difference, so the cost per token is constant and tokenizers that drop a leading space
    at the start of a decode (SentencePiece) still produce the right spaces. The emitted
    deltas concatenate to the same text however the ids are grouped into updates.
    """

    CONTEXT = 5

    __slots__ = ("tok", "ids", "prefix_offset", "read_offset", "text", "skip_special", "_seen")

    def __init__(self, tok: Tokenizer, prompt_ids: list[int], skip_special: bool = True) -> None:
        self.tok = tok
        self.ids = list(prompt_ids[-self.CONTEXT :])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""
        self.skip_special = skip_special
        self._seen = 0

    def update(self, output_ids: list[int], final: bool = False) -> str:
        """Feed the full output id list so far; return the newly decoded text."""
        new = output_ids[self._seen :]
        self._seen = len(output_ids)
        if not new:
            return self._flush() if final else ""
        self.ids.extend(new)
        prefix = self.tok.decode(self.ids[self.prefix_offset : self.read_offset], self.skip_special)
        full = self.tok.decode(self.ids[self.prefix_offset :], self.skip_special)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            self.text += delta
            return delta
        return self._flush() if final else ""

    def _flush(self) -> str:
        """At the end, emit whatever is pending even if it is an incomplete character."""
        prefix = self.tok.decode(self.ids[self.prefix_offset : self.read_offset], self.skip_special)
        full = self.tok.decode(self.ids[self.prefix_offset :], self.skip_special)
        delta = full[len(prefix) :] if len(full) > len(prefix) else ""
        self.prefix_offset = self.read_offset = len(self.ids)
        self.text += delta
        return delta
