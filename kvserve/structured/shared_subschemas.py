"""Repeated subschemas compiled once: identical ``format``/``pattern``-bearing subschemas moved
into ``$defs`` and referenced, before a JSON schema goes to the grammar library.

Why: llguidance compiles a string's ``format`` or ``pattern`` anew at each place it occurs,
with an emptiness check on the regex each time (a ``format: uri`` costs about as much as the
rest of a small schema), while a ``$ref`` target is compiled once. API-object schemas repeat
the same field shape many times (every ``*_url`` a ``format: uri`` string, every timestamp a
``date-time``), so one shared definition per distinct shape takes much of their compile time
away. The rewrite changes no accepted output: a ``$ref`` to an identical subschema validates
exactly what the subschema did.

It stays within what is plainly equivalent, and returns the schema untouched otherwise:

- only subschemas under ``properties``, ``items``, ``prefixItems``, ``additionalProperties``
  and ``anyOf`` move (the walk also enters ``$defs`` and ``definitions`` but moves none of
  their own entries); whatever sits under other keywords (``allOf``, ``oneOf``, ``not``,
  ``if``...) is left as written;
- a schema with a base-URI or anchor keyword (``$id``, ``id``, ``$anchor``, dynamic or
  recursive references) or a ``$ref`` other than ``#``, ``#/$defs/NAME`` or
  ``#/definitions/NAME`` is left whole, so no reference can point into a place that moved;
- two subschemas are the same when they are equal after dropping annotations that no
  validator reads (``title``, ``description``, ``examples``...); the shared definition keeps
  the first one's annotations.

Where the rewritten schema does not compile, the caller compiles the original, so a
library's error message always speaks of the schema as the client wrote it.
"""

from __future__ import annotations

import json
import re
from typing import Any

# Keywords whose value is one subschema, a list of subschemas, or a map of named subschemas:
# the places where a subschema may be moved to $defs.
_ONE = ("items", "additionalProperties")
_LIST = ("anyOf", "prefixItems", "items")
_MAP = ("properties",)
# Maps the walk enters without moving their entries (they are already definitions).
_DEFS = ("$defs", "definitions")
_WALKED = frozenset(_ONE + _LIST + _MAP + _DEFS)
# Annotations: no validator reads them, so they do not make two subschemas different.
_ANNOTATIONS = frozenset(
    ("title", "description", "examples", "example", "$comment", "deprecated", "readOnly",
     "writeOnly")
)  # fmt: skip
# A subschema is worth sharing when compiling it builds a regex: these keywords do.
_COSTLY = frozenset(("format", "pattern"))
# In the compact JSON text: a base-URI or anchor keyword, a draft-04 "id" (conservatively:
# any "id" key with a string value), or a $ref that is not "#" or "#/$defs|definitions/NAME".
_NOT_MOVABLE = re.compile(
    r'"\$(id|anchor|dynamicAnchor|dynamicRef|recursiveAnchor|recursiveRef)":|"id":"'
    r'|"\$ref":(?!"#(/(\$defs|definitions)/[^/"]+)?")'
)
PREFIX = "kvserve_shared_"


def share_repeated_subschemas(schema: dict) -> dict:
    """``schema`` with each repeated costly subschema moved to ``$defs`` once and referenced
    where it was; the same object when there is nothing to share or the rewrite would not be
    plainly equivalent (see the module's notes). The input is never modified."""
    try:
        return _share(schema)
    except RecursionError:  # nested past Python's stack: the library judges it as written
        return schema


def _share(schema: dict) -> dict:
    text = json.dumps(schema, ensure_ascii=False, separators=(",", ":"))
    if sum(text.count(f'"{k}":') for k in _COSTLY) < 2 or _NOT_MOVABLE.search(text):
        return schema
    existing = schema.get("$defs", {})
    if not isinstance(existing, dict):
        return schema
    keys: dict[int, str | None] = {}
    counts: dict[str, int] = {}
    _scan(schema, False, keys, counts)
    shared = {i: k if k is not None and counts[k] > 1 else None for i, k in keys.items()}
    if not any(shared.values()):
        return schema
    taken = set(existing)
    names: dict[str, str] = {}
    defs: dict[str, Any] = {}

    def ref(key: str, sub: dict) -> dict:
        name = names.get(key)
        if name is None:
            i = len(names)
            while f"{PREFIX}{i}" in taken:
                i += 1
            name = names[key] = f"{PREFIX}{i}"
            taken.add(name)
            defs[name] = None  # reserved before the body is rewritten
            defs[name] = _rewrite(sub, shared, ref)
        return {"$ref": f"#/$defs/{name}"}

    out = _rewrite(schema, shared, ref)
    out["$defs"] = {**out.get("$defs", {}), **defs}
    return out


def _children(schema: dict) -> list[tuple[str, str | int | None, dict, bool]]:
    """(keyword, name or index or None, subschema, movable) for each subschema walked."""
    out: list = []
    if _WALKED.isdisjoint(schema):
        return out
    for kw in _MAP + _DEFS:
        m = schema.get(kw)
        if isinstance(m, dict):
            movable = kw in _MAP
            out.extend((kw, n, sub, movable) for n, sub in m.items() if isinstance(sub, dict))
    for kw in _ONE:
        sub = schema.get(kw)
        if isinstance(sub, dict):
            out.append((kw, None, sub, True))
    for kw in _LIST:
        seq = schema.get(kw)
        if isinstance(seq, list):
            out.extend((kw, i, sub, True) for i, sub in enumerate(seq) if isinstance(sub, dict))
    return out


def _scan(schema: dict, movable: bool, keys: dict[int, str | None], counts: dict[str, int]) -> bool:
    """Whether ``schema`` or a subschema walked below it has a costly keyword. Each such node
    is in ``keys`` (by identity): the movable ones with their key (their JSON, annotations at
    the top left out), counted in ``counts``; the others (the root, definitions) with None."""
    costly = not _COSTLY.isdisjoint(schema)
    for _, _, sub, sub_movable in _children(schema):
        costly = _scan(sub, sub_movable, keys, counts) or costly
    if costly:
        key = None
        if movable:
            bare = {k: v for k, v in schema.items() if k not in _ANNOTATIONS}
            key = json.dumps(bare, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
            counts[key] = counts.get(key, 0) + 1
        keys[id(schema)] = key
    return costly


def _rewrite(schema: dict, shared: dict[int, str | None], ref) -> dict:
    """A copy of ``schema`` with its shared subschemas replaced by references (``ref``),
    outermost first; the node itself is never replaced. ``shared``: every node with a costly
    keyword at or below it (no other can hold a shared one), to its key when it is shared."""
    out = dict(schema)
    for kw, where, sub, movable in _children(schema):
        if id(sub) not in shared:
            continue
        key = shared[id(sub)] if movable else None
        new = _rewrite(sub, shared, ref) if key is None else ref(key, sub)
        if where is None:
            out[kw] = new
            continue
        if out[kw] is schema[kw]:
            out[kw] = dict(schema[kw]) if isinstance(where, str) else list(schema[kw])
        out[kw][where] = new
    return out
