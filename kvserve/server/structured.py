"""A request's output constraint, from whichever field the client used to ask for it.

OpenAI's ``response_format`` (``json_object``, ``json_schema``), vLLM's ``structured_outputs``
extra field (its :class:`StructuredOutputsParams` as a dict) and the ``guided_*`` fields that
vLLM had before it (``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``,
with ``guided_whitespace_pattern``) all become one :class:`StructuredOutputsParams`. Two of them
at once is a 400 naming both, since which one wins would be a guess. The engine's errors name
``structured_outputs.<field>``; :attr:`Constraint.rename` maps that back to the field the client
sent (``response_format.json_schema.schema``), so a 400 points at the client's own JSON.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvserve.errors import InvalidRequestError
from kvserve.server.api_errors import api_error_from_invalid, bad_request
from kvserve.structured.params import CONSTRAINTS, PREFIX, StructuredOutputsParams

# guided_* field -> StructuredOutputsParams field (vLLM's mapping before it removed them).
GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


class JsonSchemaFormat(BaseModel):
    """``response_format.json_schema``: OpenAI's shape (the ``openai`` client's ``parse``
    sends ``name``, ``schema`` and ``strict: true``)."""

    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredFields(BaseModel):
    """The request fields that ask for a constraint (both endpoints)."""

    model_config = ConfigDict(strict=True, extra="forbid")
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    # The backend is the server's (--structured-outputs-backend); accepted and not used, as
    # vLLM's V1 engine does with a per-request backend.
    guided_decoding_backend: str | None = None

    def constraint(self) -> Constraint | None:
        """The one constraint asked for, or None; a 400 naming the fields otherwise."""
        asked: list[Constraint] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            asked.append(Constraint({"json_object": True}, "response_format"))
        elif rf is not None and rf.type == "json_schema":
            where = "response_format.json_schema.schema"
            if rf.json_schema is None or rf.json_schema.json_schema is None:
                raise bad_request(where, "is required when response_format.type is 'json_schema'")
            asked.append(Constraint({"json": rf.json_schema.json_schema}, where))
        if self.structured_outputs is not None:
            asked.append(Constraint(dict(self.structured_outputs), PREFIX, keep_names=True))
        for name, target in GUIDED.items():
            if (value := getattr(self, name)) is not None:
                asked.append(Constraint({target: value}, name))
        if len(asked) > 1:
            a, b = asked[0].source, asked[1].source
            raise bad_request(b, f"cannot be combined with {a}: a request takes one constraint")
        if not asked:
            if self.guided_whitespace_pattern is not None:
                raise bad_request("guided_whitespace_pattern",
                                  "applies only with guided_json or response_format")  # fmt: skip
            return None
        c = asked[0]
        if self.guided_whitespace_pattern is not None:
            c.kwargs.setdefault("whitespace_pattern", self.guided_whitespace_pattern)
            c.extra["whitespace_pattern"] = "guided_whitespace_pattern"
        return c


@dataclass
class Constraint:
    """A constraint and where the client asked for it (``source``: the HTTP field)."""

    kwargs: dict[str, Any]
    source: str
    keep_names: bool = False  # the client sent structured_outputs: its own names are right
    extra: dict[str, str] = field(default_factory=dict)

    @property
    def rename(self) -> dict[str, str]:
        """Engine field -> HTTP field, for the engine's errors about this constraint."""
        if self.keep_names:
            return {}
        out = {f"{PREFIX}.{name}": self.source for name in CONSTRAINTS}
        out[PREFIX] = self.source
        out.update({f"{PREFIX}.{k}": v for k, v in self.extra.items()})
        return out

    def params(self) -> StructuredOutputsParams:
        """The engine's parameters; a 400 naming the client's field when they are wrong."""
        if self.keep_names:
            known = set(StructuredOutputsParams.__dataclass_fields__)
            unknown = sorted(set(self.kwargs) - known)
            if unknown:
                raise bad_request(f"{PREFIX}.{unknown[0]}", "is not a field of structured_outputs "
                                  f"(its fields: {', '.join(sorted(known))})")  # fmt: skip
        try:
            return StructuredOutputsParams(**self.kwargs)
        except InvalidRequestError as e:
            raise api_error_from_invalid(e, self.rename) from None


def tools_constraint(grammar: str, source: str) -> Constraint:
    """The grammar that forces a tool call; its errors name the tools' ``parameters``."""
    return Constraint({"grammar": grammar}, source)
