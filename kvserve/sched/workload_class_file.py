"""Reading a workload-class file: JSON or YAML (repeated keys refused), every entry validated
into :mod:`kvserve.sched.workload_classes`, errors naming the entry and the field; and the built-in
classes (``--workload-classes default``; why each looks as it does is in that module's
docstring).

Apart from the classes themselves because the request, the scheduler and the server need only
those; only the engine reads files.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from kvserve.config import ConfigError
from kvserve.sched.workload_classes import (
    ENTRY_KEYS,
    FILE_KEYS,
    KV_KEYS,
    MAPPED_KEYS,
    MATCH_KEYS,
    SLO_KEYS,
    TOP_KEYS,
    ClassMatch,
    FieldError,
    WorkloadClass,
    WorkloadClasses,
    is_int,
    is_number,
)


# -- parsing ----------------------------------------------------------------------------------
def _keys(where: str, d: object, allowed: tuple[str, ...]) -> dict[str, Any]:
    """``d`` as a mapping with only ``allowed`` keys. An explicit null is refused: leaving the
    key out is how a file asks for the default, and a null would read as "off" to some."""
    if not isinstance(d, dict):
        raise ConfigError(f"{where}: must be a mapping, got {type(d).__name__}")
    for k, v in d.items():
        if k not in allowed:
            raise ConfigError(f"{where}: unknown key {k!r}; allowed: {', '.join(allowed)}")
        if v is None:
            raise ConfigError(f"{where}.{k}: null is not a value; leave the key out for the "
                              "default")  # fmt: skip
    return d


def _entry(where: str, name: str, d: dict[str, Any]) -> WorkloadClass:
    kw: dict[str, Any] = {}
    if "match" in d:
        try:
            kw["match"] = ClassMatch(**_keys(f"{where}.match", d["match"], MATCH_KEYS))
        except FieldError as e:
            raise ConfigError(f"{where}.match.{e.field}: {e.reason}") from None
    for k in ("priority", "output_estimate"):
        if k in d:
            kw[k] = d[k]
    slo = _keys(f"{where}.slo", d.get("slo", {}), SLO_KEYS)
    for k, attr in (("ttft_ms", "ttft_slo"), ("tpot_ms", "tpot_slo")):
        if k in slo:
            v = slo[k]
            if not (is_number(v) and math.isfinite(v) and v > 0):
                raise ConfigError(f"{where}.slo.{k}: must be a number > 0, got {v!r}")
            kw[attr] = v / 1000
    kw.update(_keys(f"{where}.kv", d.get("kv", {}), KV_KEYS))
    try:
        return WorkloadClass(name, **kw)
    except FieldError as e:
        raise ConfigError(f"{where}.{FILE_KEYS.get(e.field, e.field)}: {e.reason}") from None


def _listed(data: list[Any]) -> list[tuple[str, int | None, WorkloadClass]]:
    out, seen = [], {}
    for i, d in enumerate(data):
        name = d.get("name") if isinstance(d, dict) else None
        where = f"workload_classes[{i}]" + (f" ({name})" if isinstance(name, str) and name else "")
        if isinstance(d, dict) and "order" in d:
            raise ConfigError(f"{where}.order: a list is tried in its own order; 'order' is for "
                              "the mapping form (classes: {name: entry})")  # fmt: skip
        d = _keys(where, d, ENTRY_KEYS)
        if not isinstance(name, str) or not name:
            raise ConfigError(f"{where}.name: must be a non-empty string, got {name!r}")
        if name in seen:
            raise ConfigError(f"{where}.name: {name!r} is defined twice (also {seen[name]})")
        seen[name] = where
        out.append((where, None, _entry(where, name, d)))
    return out


def _mapped(data: dict[Any, Any]) -> list[tuple[str, int | None, WorkloadClass]]:
    out = []
    for name, d in data.items():
        if not isinstance(name, str) or not name:
            raise ConfigError(f"workload_classes: a class name must be a non-empty string, "
                              f"got {name!r}")  # fmt: skip
        where = f"workload_classes.{name}"
        d = _keys(where, d, MAPPED_KEYS)
        order = d.get("order")
        if order is not None and not is_int(order):
            raise ConfigError(f"{where}.order: must be an integer, got {order!r}")
        out.append((where, order, _entry(where, name, d)))
    # Pairwise is enough: the classes one request matches then all have distinct orders.
    for i, (wa, oa, a) in enumerate(out):
        for wb, ob, b in out[i + 1 :]:
            if a.match.overlaps(b.match) and (oa is None or ob is None or oa == ob):
                raise ConfigError(f"{wa} and {wb}: one request can match both; give each a "
                                  "distinct 'order' (lower is tried first)")  # fmt: skip
    # An entry without an order overlaps no other, so where it goes does not matter: last.
    out.sort(key=lambda t: (t[1] is None, t[1] or 0))
    return out


def parse_workload_classes(data: object, source: str = "<data>") -> WorkloadClasses:
    """The validated classes of already-parsed JSON or YAML data: ``{classes: [...]}``,
    ``{classes: {name: entry}}`` or a bare list."""
    if isinstance(data, dict):
        d = _keys("workload_classes", data, TOP_KEYS)
        if "classes" not in d:
            raise ConfigError("workload_classes: missing key 'classes'")
        data = d["classes"]
    if isinstance(data, list):
        built = _listed(data)
    elif isinstance(data, dict):
        built = _mapped(data)
    elif data is None:  # an empty file
        built = []
    else:
        raise ConfigError("workload_classes: expected a list of classes or a mapping with "
                          f"'classes', got {type(data).__name__}")  # fmt: skip
    if not built:
        raise ConfigError("workload_classes: the file defines no class")
    for j, (later, _, b) in enumerate(built):
        for where, _, a in built[:j]:
            if a.match.is_catch_all:
                raise ConfigError(f"{later}: unreachable: {where} before it matches every "
                                  "request (the catch-all must come last)")  # fmt: skip
            if a.match.covers(b.match):
                raise ConfigError(f"{later}: unreachable: every request it matches goes to "
                                  f"{where} first (put the more specific class first)")  # fmt: skip
    paths = {c.name: where for where, _, c in built}
    return WorkloadClasses([c for _, _, c in built], source, paths)


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """JSON objects whose keys are unique: a repeated class name would drop a class."""
    d: dict[str, Any] = {}
    for k, v in pairs:
        if k in d:
            raise ValueError(f"duplicate key {k!r}")
        d[k] = v
    return d


def _read_yaml(text: str) -> object:
    import yaml  # only when a YAML file is read

    class Loader(yaml.SafeLoader):
        """PyYAML's safe loader, refusing a repeated key as :func:`_unique_keys` does."""

        def construct_mapping(self, node: Any, deep: bool = False) -> dict[Any, Any]:
            seen: set[Any] = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue  # "<<: *base" may be overridden, by design
                key = self.construct_object(key_node, deep=deep)
                try:
                    repeated = key in seen
                except TypeError:
                    continue  # unhashable: SafeLoader itself refuses it
                if repeated:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key {key!r}", key_node.start_mark
                    )
                seen.add(key)
            return super().construct_mapping(node, deep=deep)

    return yaml.load(text, Loader=Loader)  # a SafeLoader: no arbitrary objects


def load_workload_classes(source: str) -> WorkloadClasses:
    """``default`` (the built-in classes) or a ``.json``, ``.yaml`` or ``.yml`` file."""
    if source == "default":
        return DEFAULT_CLASSES
    suffix = Path(source).suffix.lower()
    if suffix not in (".json", ".yaml", ".yml"):
        raise ConfigError(f"workload_classes: expected 'default' or a .json, .yaml or .yml "
                          f"file, got {source!r}")  # fmt: skip
    try:
        text = Path(source).read_text()
        data = (
            json.loads(text, object_pairs_hook=_unique_keys)
            if suffix == ".json"
            else _read_yaml(text)
        )
    except Exception as e:  # noqa: BLE001 - OSError, JSON's ValueError, yaml.YAMLError
        raise ConfigError(f"workload_classes: cannot read {source}: {e}") from None
    return parse_workload_classes(data, source)


# The built-in classes; the module docstring says why each looks the way it does.
DEFAULT_CLASSES = parse_workload_classes(
    [
        {"name": "agent", "match": {"prefix_share": [0.5, 1], "prompt_tokens": [512, 8192]},
         "priority": 0, "slo": {"ttft_ms": 1000, "tpot_ms": 200}, "output_estimate": "learned"},
        {"name": "long-document", "match": {"prompt_tokens": [8192, None]}, "priority": 1,
         "slo": {"ttft_ms": 10000, "tpot_ms": 300}, "output_estimate": "learned"},
        {"name": "rag", "match": {"prompt_tokens": [2048, 8192]}, "priority": 0,
         "slo": {"ttft_ms": 3000, "tpot_ms": 200}, "output_estimate": "learned"},
        {"name": "chat", "match": {"prompt_tokens": [0, 2048]}, "priority": 0,
         "slo": {"ttft_ms": 1000, "tpot_ms": 200}, "output_estimate": "learned"},
    ],
    "default",
)  # fmt: skip
