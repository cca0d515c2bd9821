"""Workload classes: an operator's file that gives each kind of traffic its own SLO, priority,
output-length estimate and KV policy, for cache-aware admission control.

Interactive chat, RAG, long-document analysis and agents differ in what they keep and what
latency they need; one admission rule and one SLO for all of them serves none well. A class
file (``--workload-classes FILE``, YAML or JSON) lists classes; the scheduler classifies each
request once, at arrival, by tenant (from its API key), the OpenAI ``user`` field, prompt length
and the share of its prompt already cached, or the request names its class
(``workload_class``)::

    classes:                  # a list: first match wins
      - name: chat
        match: {tenants: [acme], users: [alice], prompt_tokens: [0, 2048], prefix_share: [0, 0.5]}
        priority: 0           # vLLM's meaning: lower is served first
        slo: {ttft_ms: 1000, tpot_ms: 100}
        output_estimate: learned    # or max_tokens, or a number of tokens
        kv: {kv_retention: none, prefix_caching: true, kv_cache_dtype: auto}

``prompt_tokens`` is half-open ``[lo, hi)`` (``hi: null``: unbounded) so that consecutive
length bands tile without a gap; ``prefix_share`` is closed, so ``[0.5, 1]`` takes a fully
cached prompt. ``classes`` may also be a mapping from name to entry, tried by each entry's
``order``: a mapping has no position, so two entries that one request could both match must
each carry a distinct ``order`` (else the winner would depend on the parser). A request that
no class matches belongs to the implicit ``default`` class (priority 0, no SLO, ``max_tokens``
as its estimate) unless the file defines ``default`` itself. A class that an earlier one
shadows (every request it matches, the earlier one takes) is refused as unreachable. Every
error names the entry and the field, at start.

The built-in classes (``--workload-classes default``), in match order:

- ``agent`` (prompt 512 to 8192 tokens, at least half of it cached): a multi-turn conversation
  or tool loop continuing a cached context. It comes first because the cache makes it cheap
  to serve (little prefill) while a person or a tool loop waits on each turn, so it is
  latency bound: a tight TTFT.
- ``long-document`` (8192 tokens and more): priority 1, so it yields to interactive work, but
  with a loose TTFT (10 s) so that under SLO-aware admission it is still admitted, not starved.
- ``rag`` (2048 to 8192): retrieved context makes a long prefill; a looser TTFT than chat.
- ``chat`` (below 2048): short prompts, interactive.

The SLO numbers are defaults for an operator to edit, not measurements of any model or
machine. This module is data and validation only (no torch): the scheduler reads the classes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from kvserve.config import ConfigError
from kvserve.sched.retention import FIELD as RETENTION_FIELD
from kvserve.sched.retention import parse_retention

DEFAULT_CLASS = "default"
OUTPUT_ESTIMATES = ("max_tokens", "learned")
TOP_KEYS = ("classes",)
ENTRY_KEYS = ("name", "match", "priority", "slo", "output_estimate", "kv")  # list form
MAPPED_KEYS = ("order", "match", "priority", "slo", "output_estimate", "kv")  # mapping form
MATCH_KEYS = ("tenants", "users", "prompt_tokens", "prefix_share")
SLO_KEYS = ("ttft_ms", "tpot_ms")
KV_KEYS = ("kv_retention", "prefix_caching", "kv_cache_dtype")
# Where a WorkloadClass field lives in the file, for re-raising its error under the entry.
FILE_KEYS = {"ttft_slo": "slo.ttft_ms", "tpot_slo": "slo.tpot_ms"}
FILE_KEYS |= {k: f"kv.{k}" for k in KV_KEYS}


class UnknownClassError(ValueError):
    """A request named a class the file does not define (a 400 naming ``workload_class``)."""

    field = "workload_class"


class FieldError(ConfigError):
    """A bad value of one dataclass field; the parser re-raises it under the entry's path."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field, self.reason = field, reason

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.field, self.reason)


def is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _names(field: str, v: object) -> frozenset[str]:
    # A bare string is iterable too: "acme" must not become {"a", "c", "m", "e"}.
    ok = isinstance(v, list | tuple | set | frozenset) and len(v) > 0
    if not ok or not all(isinstance(x, str) and x for x in v):
        raise FieldError(field, f"must be a non-empty list of strings, got {v!r}")
    return frozenset(v)


@dataclass(frozen=True, slots=True)
class ClassMatch:
    """Which requests a class takes: every constraint must hold (None, or the full range: any).
    Lists from a file are accepted and normalised (frozensets, tuples, float shares)."""

    tenants: frozenset[str] | None = None  # server tenant names
    users: frozenset[str] | None = None  # the OpenAI ``user`` request field
    prompt_tokens: tuple[int, int | None] = (0, None)  # [lo, hi); hi None: unbounded
    prefix_share: tuple[float, float] = (0.0, 1.0)  # [lo, hi]: share of the prompt cached

    def __post_init__(self) -> None:
        for f in ("tenants", "users"):
            if getattr(self, f) is not None:
                object.__setattr__(self, f, _names(f, getattr(self, f)))
        v = self.prompt_tokens
        lo, hi = v if isinstance(v, list | tuple) and len(v) == 2 else (None, None)
        if not (is_int(lo) and lo >= 0 and (hi is None or (is_int(hi) and hi > lo))):
            why = f"must be [lo, hi] with integers 0 <= lo < hi (hi may be null), got {v!r}"
            raise FieldError("prompt_tokens", why)
        object.__setattr__(self, "prompt_tokens", (lo, hi))
        v = self.prefix_share
        ok = isinstance(v, list | tuple) and len(v) == 2 and all(map(is_number, v))
        if not ok or not 0 <= v[0] <= v[1] <= 1:  # NaN fails the comparison
            why = f"must be [lo, hi] with 0 <= lo <= hi <= 1, got {v!r}"
            raise FieldError("prefix_share", why)
        object.__setattr__(self, "prefix_share", (float(v[0]), float(v[1])))

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
        """Could one request match both? Every dimension's sets or intervals must meet (the
        dimensions are independent, so that is also enough)."""

        def sets(a: frozenset[str] | None, b: frozenset[str] | None) -> bool:
            return a is None or b is None or bool(a & b)

        (alo, ahi), (blo, bhi) = self.prompt_tokens, other.prompt_tokens
        return (
            sets(self.tenants, other.tenants)
            and sets(self.users, other.users)
            and (ahi is None or blo < ahi)  # each interval is non-empty (lo < hi) ...
            and (bhi is None or alo < bhi)  # ... so they meet iff each starts before the other ends
            and max(self.prefix_share[0], other.prefix_share[0])
            <= min(self.prefix_share[1], other.prefix_share[1])
        )

    def covers(self, other: ClassMatch) -> bool:
        """Does every request that matches ``other`` match this one too? (Then ``other``
        after this one is unreachable.)"""

        def sets(a: frozenset[str] | None, b: frozenset[str] | None) -> bool:
            return a is None or (b is not None and b <= a)

        (alo, ahi), (blo, bhi) = self.prompt_tokens, other.prompt_tokens
        return (
            sets(self.tenants, other.tenants)
            and sets(self.users, other.users)
            and alo <= blo
            and (ahi is None or (bhi is not None and bhi <= ahi))
            and self.prefix_share[0] <= other.prefix_share[0]
            and other.prefix_share[1] <= self.prefix_share[1]
        )

    @property
    def is_catch_all(self) -> bool:
        return self == ClassMatch()


@dataclass(frozen=True, slots=True)
class WorkloadClass:
    """One class: how its requests are matched, ordered, judged and cached. SLOs are in
    seconds (the file gives milliseconds)."""

    name: str
    match: ClassMatch = ClassMatch()
    priority: int = 0  # vLLM's meaning: lower is served first
    ttft_slo: float | None = None
    tpot_slo: float | None = None
    output_estimate: str | int = "max_tokens"  # "max_tokens" | "learned" | tokens
    kv_retention: str | None = None  # a retention spec or "none"; None: the engine's default
    prefix_caching: bool = True  # False: the class's requests skip prefix-cache lookups
    kv_cache_dtype: str | None = None  # must be the pool's format (check_pool)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise FieldError("name", f"must be a non-empty string, got {self.name!r}")
        if not isinstance(self.match, ClassMatch):
            raise FieldError("match", f"must be a ClassMatch, got {type(self.match).__name__}")
        if not is_int(self.priority):
            raise FieldError("priority", f"must be an integer, got {self.priority!r}")
        for f in ("ttft_slo", "tpot_slo"):
            v = getattr(self, f)
            if v is not None and not (is_number(v) and math.isfinite(v) and v > 0):
                raise FieldError(f, f"must be a number of seconds > 0, got {v!r}")
        v = self.output_estimate
        if v not in OUTPUT_ESTIMATES and not (is_int(v) and v >= 1):
            raise FieldError(
                "output_estimate", f"must be max_tokens, learned or an integer >= 1, got {v!r}"
            )
        v = self.kv_retention
        if v is not None:
            if not isinstance(v, str) or not v.strip():
                why = f"must be a retention spec such as 'window:512', or 'none', got {v!r}"
                raise FieldError(RETENTION_FIELD, why)
            try:
                parse_retention(v)  # "none" (and "off") parse to no policy
            except ConfigError as e:
                reason = str(e).removeprefix(f"{RETENTION_FIELD}: ")
                raise FieldError(RETENTION_FIELD, reason) from None
        if not isinstance(self.prefix_caching, bool):
            raise FieldError(
                "prefix_caching", f"must be true or false, got {self.prefix_caching!r}"
            )
        v = self.kv_cache_dtype
        if v is not None and (not isinstance(v, str) or not v):
            raise FieldError("kv_cache_dtype", f"must be a KV format name, got {v!r}")

    def meets_slo(self, ttft: float | None, tpot: float | None) -> bool:
        """Whether measured latencies (seconds) meet the class's SLO. An SLO the class does
        not set is not checked; a set one without a measurement is not met (a request that
        never produced a token did not meet its TTFT)."""
        for slo, got in ((self.ttft_slo, ttft), (self.tpot_slo, tpot)):
            if slo is not None and (got is None or got > slo):
                return False
        return True


class WorkloadClasses:
    """Validated classes in match order, the implicit ``default`` last (unless the file
    defines one). Equal when their classes are, wherever they were read from."""

    __slots__ = ("classes", "source", "_paths", "_by_name")

    def __init__(
        self,
        classes: Iterable[WorkloadClass],
        source: str = "<data>",
        paths: dict[str, str] | None = None,
    ) -> None:
        self.classes: tuple[WorkloadClass, ...] = tuple(classes)
        self.source = source
        self._paths = paths or {}  # name -> "workload_classes[i] (name)", for messages
        self._by_name = {c.name: c for c in self.classes}
        if len(self._by_name) != len(self.classes):
            raise ConfigError(f"workload_classes: a class name is used twice in {self.names}")
        if DEFAULT_CLASS not in self._by_name:
            self._by_name[DEFAULT_CLASS] = WorkloadClass(DEFAULT_CLASS)
            self.classes += (self._by_name[DEFAULT_CLASS],)

    @property
    def names(self) -> list[str]:
        return [c.name for c in self.classes]

    @property
    def needs_prefix_share(self) -> bool:
        """Whether any class looks at the cached share, so the caller can skip the prefix
        cache lookup at arrival when none does."""
        return any(c.match.prefix_share != (0.0, 1.0) for c in self.classes)

    def get(self, name: str) -> WorkloadClass:
        try:
            return self._by_name[name]
        except (KeyError, TypeError):  # TypeError: an unhashable name from a request body
            raise UnknownClassError(
                f"workload_class: unknown class {name!r}; allowed: {', '.join(self.names)}"
            ) from None

    def classify(
        self,
        tenant: str | None = None,
        user: str | None = None,
        prompt_tokens: int = 0,
        prefix_share: float = 0.0,
        explicit: str | None = None,
    ) -> WorkloadClass:
        """The class a request names (``explicit``), else the first whose match fits, else
        the default class."""
        if explicit is not None:
            return self.get(explicit)
        for c in self.classes:
            if c.match.matches(tenant, user, prompt_tokens, prefix_share):
                return c
        return self._by_name[DEFAULT_CLASS]

    def check_pool(self, kv_cache_dtype: str) -> None:
        """One pool holds one KV format, so a class may only name that one; called at start
        once the pool's format is known."""
        for c in self.classes:
            if c.kv_cache_dtype is not None and c.kv_cache_dtype != kv_cache_dtype:
                where = self._paths.get(c.name, f"workload_classes ({c.name})")
                raise ConfigError(
                    f"{where}.kv.kv_cache_dtype: the pool stores {kv_cache_dtype!r}; a class "
                    f"may only name the pool's format (got {c.kv_cache_dtype!r})"
                )

    def __eq__(self, other: object) -> bool:
        return isinstance(other, WorkloadClasses) and self.classes == other.classes

    __hash__ = None  # compared by value, not meant as a key

    def __repr__(self) -> str:
        return f"WorkloadClasses({self.names}, source={self.source!r})"
