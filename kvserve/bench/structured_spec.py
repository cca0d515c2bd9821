"""``kvserve bench --structured SPEC``: every request carries one output constraint, so a run
measures constrained serving (the grammar's compile and per-step mask) against a plain one.

SPEC is one of ``json_object``, ``json:FILE`` (a JSON schema file) or ``json:{...}`` (inline),
``regex:PATTERN``, ``choice:A|B|C``, ``grammar:FILE`` (llguidance's Lark syntax). It becomes
vLLM's ``structured_outputs`` request field, which kvserve and vLLM both take, and
:class:`~kvserve.structured.params.StructuredOutputsParams` for the in-process engine.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

FORMS = "json_object, json:FILE, json:{...}, regex:PATTERN, choice:A|B|C, grammar:FILE"


def parse_structured(spec: str) -> dict[str, Any]:
    """SPEC -> the ``structured_outputs`` dict; an argparse error naming the form otherwise."""
    kind, _, value = spec.partition(":")
    if kind == "json_object" and not value:
        return {"json_object": True}
    if not value:
        raise argparse.ArgumentTypeError(f"{spec!r}: expected one of {FORMS}")
    if kind == "json":
        text = value if value.lstrip().startswith("{") else _read(value)
        try:
            schema = json.loads(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"{spec!r}: not a JSON schema: {e}") from None
        return {"json": schema}
    if kind == "regex":
        return {"regex": value}
    if kind == "choice":
        return {"choice": value.split("|")}
    if kind == "grammar":
        return {"grammar": _read(value)}
    raise argparse.ArgumentTypeError(f"{spec!r}: expected one of {FORMS}")


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError as e:
        raise argparse.ArgumentTypeError(f"{path}: {e.strerror}") from None
