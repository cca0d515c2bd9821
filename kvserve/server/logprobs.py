"""Engine log-probs (``{token_id: logprob}`` per position) in the shapes the API returns:
the legacy completions one, chat's ``content`` list, and vLLM's ``prompt_logprobs``.

A token is shown by its own bytes, not by decoding it alone: byte-level tokens that are part of
a multi-byte character would all decode to U+FFFD and collide as dict keys. Bytes that are not
valid UTF-8 are written ``bytes:\\xNN`` as OpenAI does; with vLLM's
``return_tokens_as_token_ids`` every token is written ``token_id:N`` instead.
"""

from __future__ import annotations

from typing import Any

from kvserve.model.tokenizer import Tokenizer
from kvserve.sched.request import CompletionOutput

# One position: a token id and the log-probs there (None: the prompt's first token has none).
Position = tuple[int, dict[int, float] | None]


def _gpt2_byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: byte-level BPE vocab characters -> bytes."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    cs, extra = list(bs), 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


_BYTE_DECODER = _gpt2_byte_decoder()


class LogprobFormatter:
    """One request's log-prob formatting (a token's text is computed once per id)."""

    def __init__(self, tok: Tokenizer | None, top_n: int, as_token_ids: bool = False) -> None:
        self.tok = tok
        self.top_n = top_n
        self.as_token_ids = as_token_ids
        self.offset: dict[int, int] = {}
        self._cache: dict[int, tuple[str, bytes]] = {}

    def token(self, tid: int) -> tuple[str, bytes]:
        """A token's text and bytes."""
        if tid not in self._cache:
            raw = self.tok.id_to_token(tid) if self.tok else None
            if self.as_token_ids or raw is None:  # (or an id the tokenizer does not have)
                data = f"token_id:{tid}".encode()
            elif len(raw) == 6 and raw.startswith("<0x") and raw.endswith(">"):
                data = bytes([int(raw[3:5], 16)])  # SentencePiece byte fallback
            elif all(ch in _BYTE_DECODER for ch in raw):
                data = bytes(_BYTE_DECODER[ch] for ch in raw)
            else:
                assert self.tok is not None
                data = self.tok.decode([tid], skip_special_tokens=False).encode()
            try:
                text = data.decode()
            except UnicodeDecodeError:
                text = "bytes:" + "".join(f"\\x{b:02x}" for b in data)
            self._cache[tid] = (text, data)
        return self._cache[tid]

    def _s(self, tid: int) -> str:
        return self.token(tid)[0]

    def completion(
        self, k: int, c: CompletionOutput, before: list[Position] | None = None
    ) -> dict[str, Any] | None:
        """The legacy shape for choice ``k``; ``before`` are echoed prompt positions."""
        if c.logprobs is None:
            return None
        out: dict[str, list[Any]] = {
            "tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []
        }  # fmt: skip
        positions = [*(before or ()), *zip(c.token_ids, c.logprobs, strict=False)]
        for tid, lps in positions:
            s = self._s(tid)
            out["tokens"].append(s)
            out["token_logprobs"].append(lps.get(tid) if lps is not None else None)
            top: dict[str, float] | None = None
            if lps is not None:
                top = {}
                for t, lp in sorted(lps.items(), key=lambda kv: -kv[1]):
                    top.setdefault(self._s(t), lp)  # ids that decode alike keep the best
            out["top_logprobs"].append(top)
            out["text_offset"].append(self.offset.get(k, 0))
            self.offset[k] = self.offset.get(k, 0) + (0 if s.startswith("bytes:") else len(s))
        return out

    def chat(self, c: CompletionOutput) -> dict[str, Any] | None:
        if c.logprobs is None:
            return None
        content = []
        for tid, lps in zip(c.token_ids, c.logprobs, strict=False):
            s, data = self.token(tid)
            top = sorted(lps.items(), key=lambda kv: -kv[1])[: self.top_n]
            content.append({
                "token": s, "logprob": lps.get(tid), "bytes": list(data),
                "top_logprobs": [
                    {"token": self._s(i), "logprob": lp, "bytes": list(self.token(i)[1])}
                    for i, lp in top
                ],
            })  # fmt: skip
        return {"content": content}

    def prompt(
        self, lps: list[dict[int, float] | None], n: int
    ) -> list[dict[str, dict[str, Any]] | None]:
        """vLLM's ``prompt_logprobs``: per position ``{token id: {logprob, rank,
        decoded_token}}``. The top ``n`` have their rank; a prompt token outside them (the
        entry beyond ``n``) has ``rank: null``, since only the top ``n`` were computed."""
        out: list[dict[str, dict[str, Any]] | None] = []
        for entry in lps:
            if entry is None:
                out.append(None)
                continue
            ranked = sorted(entry.items(), key=lambda kv: -kv[1])
            out.append({
                str(t): {"logprob": lp, "rank": i + 1 if i < n else None,
                         "decoded_token": self._s(t)}
                for i, (t, lp) in enumerate(ranked)
            })  # fmt: skip
        return out
