"""Markdown for the generated reference pages, and the comparison that names what a committed
page lacks: tables whose first cell names the row (a flag, a metric, a variable), so a stale
page is reported by those names rather than as a diff to read."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import PurePath
from typing import Any

_ESCAPES = str.maketrans({"\\": "\\\\", "|": "\\|", "*": "\\*", "<": "&lt;", ">": "&gt;"})


def text(s: str) -> str:
    """Plain text for a table cell: one line, and nothing Markdown or HTML would take as
    markup (a ``|`` would end the cell, ``<name>`` would vanish as a tag)."""
    return " ".join(s.split()).translate(_ESCAPES)


def code(s: str) -> str:
    """A code span (fenced with two backticks where the text holds one)."""
    fence = "``" if "`" in s else "`"
    pad = " " if s.startswith("`") or s.endswith("`") else ""
    return f"{fence}{pad}{s}{pad}{fence}"


def value(v: Any) -> str:
    """A default or choice as Python writes it (what ``LLM(...)`` takes), in a code span."""
    if isinstance(v, float) and math.isinf(v):
        return code("inf")
    if isinstance(v, PurePath):  # its repr names the platform's class
        v = str(v)
    return code(repr(v))


def table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def row_name(line: str) -> str:
    """What a line of a page is about: a table row's first cell without its code fences, any
    other line itself (shortened)."""
    if line.startswith("| ") and not line.startswith("| ---"):
        return line[2:].split(" | ", 1)[0].replace("`", "").strip()
    return line if len(line) <= 80 else line[:77] + "..."


def differences(committed: str, generated: str) -> list[str]:
    """What ``committed`` lacks of ``generated`` and holds beyond it, each line named by
    :func:`row_name` (a row that changed appears in both lists, under one name)."""
    want, have = Counter(generated.splitlines()), Counter(committed.splitlines())
    missing = [row_name(line) for line in generated.splitlines() if want[line] > have[line]]
    extra = [row_name(line) for line in committed.splitlines() if have[line] > want[line]]
    out = [f"missing or different: {name}" for name in dict.fromkeys(missing) if name]
    out += [f"not in the code (or different): {name}" for name in dict.fromkeys(extra) if name]
    return out
