"""Workload classes: an operator's file that gives each kind of traffic its own SLO, priority,
output-length estimate and KV policy.

Interactive chat, RAG, long-document analysis and agents differ in what they keep and what
latency they need; one admission rule and one SLO for all of them serves none well. A class
file (``--workload-classes FILE``, YAML or JSON) lists classes; the engine matches each request
once, at arrival, by tenant (from its API key), the OpenAI ``user`` field, prompt length and the
share of its prompt already cached (or the request names its class: ``workload_class``)::

    classes:                  # a list: first match wins
      - name: chat
        match: {tenants: [acme], users: [alice], prompt_tokens: [0, 2048], prefix_share: [0, 0.5]}
        priority: 0           # vLLM's meaning: lower is served first
        slo: {ttft_ms: 1000, tpot_ms: 100}
        output_estimate: learned    # or max_tokens, or a number of tokens
        kv: {kv_retention: none, prefix_caching: true, kv_cache_dtype: auto}

``classes`` may also be a mapping from name to entry; its entries are tried by their ``order``
and two entries that one request could both match must each have a distinct ``order``. A
request no class matches belongs to the implicit ``default`` class (priority 0, no SLO,
``max_tokens`` as its estimate) unless the file defines ``default`` itself. Every error names
the entry and the field, at start.

This module is data and validation only (no torch): the admission code reads the classes.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvserve.config import ConfigError
from kvserve.retention import parse_retention

DEFAULT_CLASS = "default"
OUTPUT_ESTIMATES = ("max_tokens", "learned")
_ENTRY_KEYS = ("name", "order", "match", "priority", "slo", "output_estimate", "kv")
_MATCH_KEYS = ("tenants", "users", "prompt_tokens", "prefix_share")
_SLO_KEYS = ("ttft_ms", "tpot_ms")
_KV_KEYS = ("kv_retention", "prefix_caching", "kv_cache_dtype")


class UnknownClassError(ValueError):
    """A request named a class the file does not define."""

    field = "workload_class"


@dataclass(frozen=True, slots=True)
class ClassMatch:
    """Which requests a class takes; every constraint must hold (None / full range: any)."""

    tenants: frozenset[str] | None = None
    users: frozenset[str] | None = None
    prompt_tokens: tuple[int, int | None] = (0, None)  # [lo, hi)
    prefix_share: tuple[float, float] = (0.0, 1.0)  # [lo, hi]

    def matches(
        self, tenant: str | None, user: str | None, prompt_tokens: int, prefix_share: float
    ) -> bool:
        lo, hi = self.prompt_tokens
        return (
            (self.tenants is None or tenant in self.tenants)
            and (self.users is None or user in self.users)
            and lo <= prompt_tokens
            and (hi is None or prompt_tokens < hi)
            and self.prefix_share[0] <= prefix_share <= self.prefix_share[1]
        )

    def overlaps(self, other: ClassMatch) -> bool:
        """Could one request match both? Each dimension's sets or intervals must meet."""

        def sets(a: frozenset[str] | None, b: frozenset[str] | None) -> bool:
            return a is None or b is None or bool(a & b)

        (alo, ahi), (blo, bhi) = self.prompt_tokens, other.prompt_tokens
        tokens = (ahi is None or blo < ahi) and (bhi is None or alo < bhi)
        shares = max(self.prefix_share[0], other.prefix_share[0]) <= min(
            self.prefix_share[1], other.prefix_share[1]
        )
        return (
            sets(self.tenants, other.tenants)
            and sets(self.users, other.users)
            and tokens
            and shares
        )

    @property
    def is_catch_all(self) -> bool:
        return self == ClassMatch()


@dataclass(frozen=True, slots=True)
class WorkloadClass:
    name: str
    match: ClassMatch = field(default_factory=ClassMatch)
    priority: int = 0
    ttft_slo: float | None = None  # seconds
    tpot_slo: float | None = None
    output_estimate: str | int = "max_tokens"
    kv_retention: str | None = None  # a retention spec or "none"; None: the engine's default
    prefix_caching: bool = True
    kv_cache_dtype: str | None = None

    def meets_slo(self, ttft: float | None, tpot: float | None) -> bool:
        """Whether measured latencies meet the class's SLO (a set SLO with no measurement
        does not)."""
        for slo, got in ((self.ttft_slo, ttft), (self.tpot_slo, tpot)):
            if slo is not None and (got is None or got > slo):
                return False
        return True


class WorkloadClasses:
    """Validated classes in match order, the implicit default last."""

    def __init__(
        self, classes: Iterable[WorkloadClass], source: str, paths: dict[str, str] | None = None
    ) -> None:
        self.classes = tuple(classes)
        self.source = source
        self._paths = paths or {}  # name -> "workload_classes[i] (name)" for messages
        self._by_name = {c.name: c for c in self.classes}
        if DEFAULT_CLASS not in self._by_name:
            default = WorkloadClass(DEFAULT_CLASS)
            self.classes += (default,)
            self._by_name[DEFAULT_CLASS] = default

    @property
    def names(self) -> list[str]:
        return [c.name for c in self.classes]

    @property
    def needs_prefix_share(self) -> bool:
        return any(c.match.prefix_share != (0.0, 1.0) for c in self.classes)

    def get(self, name: str) -> WorkloadClass:
        try:
            return self._by_name[name]
        except KeyError:
            raise UnknownClassError(
                f"workload_class: unknown class {name!r}; this server has {', '.join(self.names)}"
            ) from None

    def classify(
        self,
        tenant: str | None = None,
        user: str | None = None,
        prompt_tokens: int = 0,
        prefix_share: float = 0.0,
        explicit: str | None = None,
    ) -> WorkloadClass:
        if explicit is not None:
            return self.get(explicit)
        for c in self.classes:
            if c.match.matches(tenant, user, prompt_tokens, prefix_share):
                return c
        return self._by_name[DEFAULT_CLASS]

    def check_pool(self, kv_cache_dtype: str) -> None:
        """One pool holds one KV format: a class may only name that one."""
        for c in self.classes:
            if c.kv_cache_dtype is not None and c.kv_cache_dtype != kv_cache_dtype:
                raise ConfigError(
                    f"{self._paths.get(c.name, c.name)}.kv.kv_cache_dtype: the pool stores "
                    f"{kv_cache_dtype!r}; a class may only name the pool's format"
                )

    def __eq__(self, other: object) -> bool:
        return isinstance(other, WorkloadClasses) and self.classes == other.classes

    def __repr__(self) -> str:
        return f"WorkloadClasses({self.names}, source={self.source!r})"


# -- parsing ----------------------------------------------------------------------------------
def _keys(where: str, d: Any, allowed: tuple[str, ...]) -> dict[str, Any]:
    if not isinstance(d, dict):
        raise ConfigError(f"{where}: must be a mapping, got {type(d).__name__}")
    for k in d:
        if k not in allowed:
            raise ConfigError(f"{where}: unknown key {k!r}; allowed: {', '.join(allowed)}")
    return d


def _int(where: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ConfigError(f"{where}: must be an integer, got {v!r}")
    return v


def _strings(where: str, v: Any) -> frozenset[str]:
    if not isinstance(v, list) or not v or not all(isinstance(x, str) and x for x in v):
        raise ConfigError(f"{where}: must be a non-empty list of strings, got {v!r}")
    return frozenset(v)


def _match(where: str, d: Any) -> ClassMatch:
    d = _keys(where, d, _MATCH_KEYS)
    kw: dict[str, Any] = {}
    for k in ("tenants", "users"):
        if k in d:
            kw[k] = _strings(f"{where}.{k}", d[k])
    if "prompt_tokens" in d:
        v = d["prompt_tokens"]
        ok = isinstance(v, list) and len(v) == 2
        lo, hi = v if ok else (None, None)
        ok = ok and not isinstance(lo, bool) and isinstance(lo, int) and lo >= 0
        ok = ok and (hi is None or (not isinstance(hi, bool) and isinstance(hi, int) and hi > lo))
        if not ok:
            raise ConfigError(f"{where}.prompt_tokens: must be [lo, hi] with integers "
                              f"0 <= lo < hi (hi may be null), got {v!r}")  # fmt: skip
        kw["prompt_tokens"] = (lo, hi)
    if "prefix_share" in d:
        v = d["prefix_share"]
        ok = isinstance(v, list) and len(v) == 2
        ok = ok and all(not isinstance(x, bool) and isinstance(x, int | float) for x in v)
        if not ok or not 0 <= v[0] <= v[1] <= 1:
            raise ConfigError(f"{where}.prefix_share: must be [lo, hi] with "
                              f"0 <= lo <= hi <= 1, got {v!r}")  # fmt: skip
        kw["prefix_share"] = (float(v[0]), float(v[1]))
    return ClassMatch(**kw)


def _entry(where: str, name: str, d: dict[str, Any]) -> WorkloadClass:
    kw: dict[str, Any] = {}
    if "match" in d:
        kw["match"] = _match(f"{where}.match", d["match"])
    if "priority" in d:
        kw["priority"] = _int(f"{where}.priority", d["priority"])
    if "slo" in d:
        slo = _keys(f"{where}.slo", d["slo"], _SLO_KEYS)
        for k, attr in (("ttft_ms", "ttft_slo"), ("tpot_ms", "tpot_slo")):
            if k in slo:
                v = slo[k]
                number = not isinstance(v, bool) and isinstance(v, int | float)
                if not number or not math.isfinite(v) or v <= 0:
                    raise ConfigError(f"{where}.slo.{k}: must be a number > 0, got {v!r}")
                kw[attr] = v / 1000.0
    if "output_estimate" in d:
        v = d["output_estimate"]
        if v not in OUTPUT_ESTIMATES and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ConfigError(f"{where}.output_estimate: must be max_tokens, learned or an "
                              f"integer >= 1, got {v!r}")  # fmt: skip
        kw["output_estimate"] = v
    if "kv" in d:
        kv = _keys(f"{where}.kv", d["kv"], _KV_KEYS)
        if "kv_retention" in kv:
            v = kv["kv_retention"]
            if not isinstance(v, str) or not v:
                raise ConfigError(f"{where}.kv.kv_retention: must be a retention spec such "
                                  f"as 'window:512' or 'none', got {v!r}")  # fmt: skip
            try:
                parse_retention(v)
            except ConfigError as e:
                raise ConfigError(f"{where}.kv.kv_retention: {e}") from None
            kw["kv_retention"] = v
        if "prefix_caching" in kv:
            if not isinstance(kv["prefix_caching"], bool):
                raise ConfigError(f"{where}.kv.prefix_caching: must be true or false, "
                                  f"got {kv['prefix_caching']!r}")  # fmt: skip
            kw["prefix_caching"] = kv["prefix_caching"]
        if "kv_cache_dtype" in kv:
            v = kv["kv_cache_dtype"]
            if not isinstance(v, str) or not v:
                raise ConfigError(f"{where}.kv.kv_cache_dtype: must be a KV format name, "
                                  f"got {v!r}")  # fmt: skip
            kw["kv_cache_dtype"] = v
    return WorkloadClass(name, **kw)


def parse_workload_classes(data: object, source: str = "<data>") -> WorkloadClasses:
    """The validated classes of already-parsed JSON or YAML data."""
    if isinstance(data, dict):
        data = _keys("workload_classes", data, ("classes",)).get("classes")
    if isinstance(data, list):
        listed = True
        entries = []
        for i, d in enumerate(data):
            name = d.get("name") if isinstance(d, dict) else None
            where = f"workload_classes[{i}] ({name})" if isinstance(name, str) else \
                f"workload_classes[{i}]"  # fmt: skip
            d = _keys(where, d, _ENTRY_KEYS)
            if not isinstance(name, str) or not name:
                raise ConfigError(f"{where}.name: must be a non-empty string, got {name!r}")
            entries.append((where, name, d))
    elif isinstance(data, dict):
        listed = False
        entries = []
        for name, d in data.items():
            where = f"workload_classes.{name}"
            d = _keys(where, d, tuple(k for k in _ENTRY_KEYS if k != "name"))
            entries.append((where, str(name), d))
    else:
        raise ConfigError("workload_classes: expected a list of classes or a mapping "
                          f"'classes:', got {type(data).__name__}")  # fmt: skip
    if not entries:
        raise ConfigError("workload_classes: the file defines no class")
    seen: dict[str, str] = {}
    built = []
    for where, name, d in entries:
        if name in seen:
            raise ConfigError(f"{where}.name: {name!r} is defined twice (also {seen[name]})")
        seen[name] = where
        order = _int(f"{where}.order", d["order"]) if "order" in d else None
        built.append((where, order, _entry(where, name, d)))
    if listed:
        for (where, _, c), (later, _, _) in zip(built, built[1:], strict=False):
            if c.match.is_catch_all:
                raise ConfigError(f"{later}: unreachable: {where} before it matches every "
                                  "request (put the catch-all last)")  # fmt: skip
        if any(o is not None for _, o, _ in built):
            built.sort(key=lambda t: (t[1] is None, t[1] if t[1] is not None else 0))
    else:
        for i, (wa, oa, a) in enumerate(built):
            for wb, ob, b in built[i + 1 :]:
                if a.match.overlaps(b.match) and (oa is None or ob is None or oa == ob):
                    raise ConfigError(f"{wa} and {wb}: one request can match both; give each "
                                      "a distinct 'order'")  # fmt: skip
        built.sort(key=lambda t: t[1] if t[1] is not None else 0)
    paths = {c.name: where for where, _, c in built}
    return WorkloadClasses([c for _, _, c in built], source, paths)


def load_workload_classes(source: str) -> WorkloadClasses:
    """``default`` (the built-in classes) or a .json / .yaml / .yml file."""
    if source == "default":
        return DEFAULT_CLASSES
    path = Path(source)
    if path.suffix not in (".json", ".yaml", ".yml"):
        raise ConfigError(f"workload_classes: expected 'default' or a .json, .yaml or .yml "
                          f"file, got {source!r}")  # fmt: skip
    try:
        text = path.read_text()
        if path.suffix == ".json":
            data = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text)
    except Exception as e:  # noqa: BLE001 - OSError, JSON's ValueError, yaml.YAMLError
        raise ConfigError(f"workload_classes: cannot read {source}: {e}") from None
    return parse_workload_classes(data, source)


# The built-in classes (``--workload-classes default``). Agents first: a multi-turn
# conversation or tool loop continues a cached context, so it is cheap to serve and latency
# bound. Long documents yield to interactive work (priority 1) but their SLO is loose, so they
# are not starved. The SLO numbers are defaults for an operator to edit, not measurements.
DEFAULT_CLASSES = parse_workload_classes(
    [
        {"name": "agent", "match": {"prefix_share": [0.5, 1], "prompt_tokens": [512, 8192]},
         "slo": {"ttft_ms": 1000, "tpot_ms": 200}, "output_estimate": "learned"},
        {"name": "long-document", "match": {"prompt_tokens": [8192, None]}, "priority": 1,
         "slo": {"ttft_ms": 10000, "tpot_ms": 300}, "output_estimate": "learned"},
        {"name": "rag", "match": {"prompt_tokens": [2048, 8192]},
         "slo": {"ttft_ms": 3000, "tpot_ms": 200}, "output_estimate": "learned"},
        {"name": "chat", "match": {"prompt_tokens": [0, 2048]},
         "slo": {"ttft_ms": 1000, "tpot_ms": 200}, "output_estimate": "learned"},
    ],
    "default",
)  # fmt: skip
