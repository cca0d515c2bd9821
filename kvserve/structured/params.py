"""What a request asks its output to match: vLLM's ``StructuredOutputsParams``.

Exactly one constraint is set: ``json`` (a JSON schema, as a dict or its text), ``regex``,
``choice`` (the output is one of the strings), ``grammar`` (a grammar in llguidance's
Lark syntax; with the xgrammar backend, EBNF/GBNF) or ``json_object`` (any JSON object).
``structural_tag`` is vLLM's too but is not supported yet: a request that sets it is refused.

Whitespace: by default the JSON constraints allow a *bounded* run of whitespace between
tokens (:data:`DEFAULT_WHITESPACE`), so a model cannot pad an object with whitespace until
``max_tokens`` runs out; ``disable_any_whitespace`` allows none (compact separators),
``whitespace_pattern`` (a regex) replaces the default.

Validation here covers what can be checked without a tokenizer (types, the one-constraint
rule, that ``json`` text parses); the grammar library
checks the rest when the engine compiles the constraint (:mod:`kvserve.structured.compiler`),
and each failure is an :class:`~kvserve.errors.InvalidRequestError` naming the field, e.g.
``structured_outputs.json``.
"""

from __future__ import annotations

import json as _json
from dataclasses import dataclass
from typing import Any

from kvserve.errors import InvalidRequestError

PREFIX = "structured_outputs"
# Between JSON tokens: up to this much whitespace (spaces, newlines, tabs) in one run.
DEFAULT_WHITESPACE = r"[ \t\n]{0,8}"
CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


def _bad(name: str, message: str) -> InvalidRequestError:
    return InvalidRequestError(f"{PREFIX}.{name}: {message}", field=f"{PREFIX}.{name}")


@dataclass(slots=True)
class StructuredOutputsParams:
    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        given = [n for n in CONSTRAINTS if getattr(self, n) not in (None, False)]
        if len(given) != 1:
            which = ", ".join(given) if given else "none"
            raise InvalidRequestError(
                f"{PREFIX}: exactly one of {', '.join(CONSTRAINTS)} must be set, got {which}",
                field=PREFIX,
            )
        if self.json is not None:
            self._check_json()
        if self.regex is not None:
            _check_pattern("regex", self.regex)
        if self.choice is not None:
            c = self.choice
            if not isinstance(c, list | tuple) or not all(isinstance(s, str) for s in c):
                raise _bad("choice", f"must be a list of strings, got {c!r}")
            if not c:
                raise _bad("choice", "must not be empty")
            self.choice = list(c)
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar):
            raise _bad("grammar", "must be a non-empty grammar text (llguidance's Lark syntax)")
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise _bad("json_object", f"must be true or false, got {self.json_object!r}")
        if self.structural_tag is not None:
            raise _bad("structural_tag", "is not supported yet (planned); use json or grammar")
        if not isinstance(self.disable_any_whitespace, bool):
            raise _bad("disable_any_whitespace", "must be true or false")
        if self.whitespace_pattern is not None:
            _check_pattern("whitespace_pattern", self.whitespace_pattern)

    def _check_json(self) -> None:
        s = self.json
        if isinstance(s, str):
            try:
                s = _json.loads(s)
            except ValueError as e:
                raise _bad("json", f"is not valid JSON: {e}") from None
        if not isinstance(s, dict):
            raise _bad("json", f"must be a JSON schema (an object), got {type(s).__name__}")

    @property
    def kind(self) -> str:
        """The constraint set: one of :data:`CONSTRAINTS`."""
        return next(n for n in CONSTRAINTS if getattr(self, n) not in (None, False))

    @property
    def field(self) -> str:
        """The request field an error in the constraint names (``structured_outputs.json``)."""
        return f"{PREFIX}.{self.kind}"

    def schema(self) -> dict | None:
        """The JSON schema of a ``json`` or ``json_object`` constraint, as data."""
        if self.json_object:
            return {"type": "object"}
        if isinstance(self.json, str):
            return _json.loads(self.json)
        return self.json

    def whitespace(self) -> str | None:
        """The whitespace regex between JSON tokens; None for none at all (compact)."""
        if self.disable_any_whitespace:
            return None
        return self.whitespace_pattern or DEFAULT_WHITESPACE

    def key(self) -> tuple[Any, ...]:
        """A hashable identity of the constraint (the compile cache's key)."""
        kind = self.kind
        if kind in ("json", "json_object"):
            value: Any = _json.dumps(self.schema(), sort_keys=True, ensure_ascii=False)
        elif kind == "choice":
            value = tuple(self.choice)
        else:
            value = getattr(self, kind)
        return (kind, value, self.disable_any_whitespace, self.whitespace_pattern)


def _check_pattern(name: str, pattern: Any) -> None:
    """Type only: the grammar library's regex dialect (not Python's) decides the rest, when
    the engine compiles the constraint."""
    if not isinstance(pattern, str) or not pattern:
        raise _bad(name, f"must be a non-empty regular expression, got {pattern!r}")
