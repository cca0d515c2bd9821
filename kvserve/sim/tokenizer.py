"""The simulator's tokenizer for a model given by ``config.json`` alone (no
``tokenizer.json`` beside it): what a simulated engine encodes prompts with then."""

from __future__ import annotations

import hashlib
import re
from itertools import chain

# ASCII as HashTokenizer's pattern splits it: word characters (\w), whitespace (\s, what
# str.split() splits on), and the rest, each of which is a piece of its own.
_ASCII = [chr(i) for i in range(128)]
_ASCII_OTHER = "".join(c for c in _ASCII if not (c.isalnum() or c == "_" or c.isspace()))
_OTHER_TO_SPACE = str.maketrans(_ASCII_OTHER, " " * len(_ASCII_OTHER))
_ONLY_OTHER = str.maketrans("", "", "".join(c for c in _ASCII if c not in _ASCII_OTHER))
_MAX_WORDS = 1 << 16  # whitespace-separated words whose ids HashTokenizer remembers


class HashTokenizer:
    """Tokens for a model given by ``config.json`` alone: one token per word or punctuation
    mark, its id a stable hash into the vocabulary. Equal text gives equal ids (so shared
    prefixes hit the prefix cache as they would with the real tokenizer); lengths are what
    the workload asked for, in these tokens."""

    _PIECES = re.compile(r"\w+|[^\w\s]")

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._ids: dict[str, int] = {}
        self._word_ids: dict[str, tuple[int, ...]] = {}

    def encode(self, text: str) -> list[int]:
        # Pieces never span whitespace (\s and str.split() agree on it), so the text's ids
        # are its whitespace-separated words' ids in order; filler text repeats a few
        # hundred words, each looked up once here (up to _MAX_WORDS remembered).
        words = text.split()
        ids = list(map(self._word_ids.get, words))
        try:
            return list(chain.from_iterable(ids)) or [3]
        except TypeError:  # a word not seen yet (None): no scan for it in the common case
            pass
        for i, got in enumerate(ids):
            if got is None:
                got = ids[i] = tuple(map(self._id, self._PIECES.findall(words[i])))
                if len(self._word_ids) < _MAX_WORDS:
                    self._word_ids[words[i]] = got
        return list(chain.from_iterable(ids)) or [3]

    def _id(self, piece: str) -> int:
        tid = self._ids.get(piece)
        if tid is None:
            digest = hashlib.blake2b(piece.encode(), digest_size=8).digest()
            tid = 3 + int.from_bytes(digest, "little") % (self.vocab_size - 3)
            self._ids[piece] = tid
        return tid

    def count(self, text: str) -> int:
        """len(encode(text)) without hashing anything. ASCII text (the workloads' filler) is
        counted with two translations and a split, a few times faster than the pattern: its
        pieces are the runs of word characters left when every other non-space character
        becomes a space, plus one per such character."""
        if text.isascii():
            return max(1, len(text.translate(_OTHER_TO_SPACE).split())
                       + len(text.translate(_ONLY_OTHER)))  # fmt: skip
        return max(1, len(self._PIECES.findall(text)))
