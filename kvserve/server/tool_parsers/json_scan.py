"""Where JSON values end in text that may still be growing (a model's output mid-stream).

Tool-call parsers need to know, of a call's JSON as far as it has arrived, which key/value
pairs are complete and where the arguments value starts, so that the arguments can be streamed
as the model writes them (raw slices of its text, which concatenate to the final arguments).
``None`` means "the text ends before this value does"; malformed JSON raises ValueError.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

_WS = " \t\r\n"


def skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in _WS:
        i += 1
    return i


def value_end(s: str, i: int) -> int | None:
    """End (exclusive) of the JSON value starting at ``s[i]``, None when ``s`` ends first."""
    if i >= len(s):
        return None
    c = s[i]
    if c == '"':
        j = i + 1
        while j < len(s):
            if s[j] == "\\":
                j += 2
                continue
            if s[j] == '"':
                return j + 1
            j += 1
        return None
    if c in "{[":
        depth, j, in_str = 0, i, False
        while j < len(s):
            ch = s[j]
            if in_str:
                if ch == "\\":
                    j += 1
                elif ch == '"':
                    in_str = False
            elif ch == '"':
                in_str = True
            elif ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    if c in "-0123456789tfn":
        j = i
        while j < len(s) and s[j] in "-+.eE0123456789truefalsn":
            j += 1
        return None if j == len(s) else j
    raise ValueError(f"no JSON value at {s[i : i + 10]!r}")


@dataclass(frozen=True, slots=True)
class Member:
    """One key of an object: its value is ``s[start:end]`` (``end`` None: still arriving)."""

    key: str
    start: int
    end: int | None


@dataclass(frozen=True, slots=True)
class ObjectScan:
    members: list[Member]
    end: int | None  # past the closing brace; None while the object is incomplete


def scan_object(s: str, i: int) -> ObjectScan:
    """The top-level members of the object at ``s[i]`` (which is ``{``) as far as they go."""
    members: list[Member] = []
    j = skip_ws(s, i + 1)
    if j < len(s) and s[j] == "}":
        return ObjectScan(members, j + 1)
    while j < len(s):
        if s[j] != '"':
            raise ValueError(f"expected a key at {s[j : j + 10]!r}")
        k_end = value_end(s, j)
        if k_end is None:
            break
        key = json.loads(s[j:k_end])
        j = skip_ws(s, k_end)
        if j >= len(s):
            break
        if s[j] != ":":
            raise ValueError(f"expected ':' after key {key!r}")
        j = skip_ws(s, j + 1)
        if j >= len(s):
            break
        v_end = value_end(s, j)
        members.append(Member(key, j, v_end))
        if v_end is None:
            break
        j = skip_ws(s, v_end)
        if j >= len(s):
            break
        if s[j] == "}":
            return ObjectScan(members, j + 1)
        if s[j] != ",":
            raise ValueError(f"expected ',' or '}}' after the value of {key!r}")
        j = skip_ws(s, j + 1)
    return ObjectScan(members, None)
