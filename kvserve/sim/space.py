"""``kvserve tune``'s search space: its dimensions, the values each takes by default, and the
``--search NAME=V1,V2`` items that ask for some.

Tune searches what it is asked and nothing else; only when nothing is asked (or
``--default-space`` says so) does it add :func:`default_space`, and its output names each
dimension it added. Import-light (no torch): the CLI describes the space in ``--help``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvserve.config import ConfigError, EngineConfig, parse_bytes
from kvserve.config_fields import default_of
from kvserve.engine_args import parse_tokens
from kvserve.kv.formats import KV_CACHE_DTYPES
from kvserve.sim.fleet import SIM_POLICIES


def _bool(s: str) -> bool:
    v = s.strip().lower()
    if v in ("1", "true", "on", "yes"):
        return True
    if v in ("0", "false", "off", "no"):
        return False
    raise ValueError(f"search: expected on/off, got {s!r}")


def _optional(s: str) -> str | None:
    return None if s.strip().lower() in ("none", "off", "") else s.strip()


def _engine_default(name: str) -> Any:
    return default_of(EngineConfig, name)


def _tokens(s: str) -> int:
    """A token count as the flags read it (``8k``, ``8K``)."""
    try:
        return parse_tokens(s, "value")
    except ConfigError as e:
        raise ValueError(str(e).removeprefix("value: ")) from None


# name -> (type, default values); the first value, the engine's default, is where the search
# starts. The dimensions with one value (a retention policy, a host tier: host memory is not
# in the GPU-hour price, so an operator says how much of it a replica may have) are searched
# only when asked.
DIMENSIONS: dict[str, tuple[Callable[[str], Any], tuple[Any, ...]]] = {
    "enable_prefix_caching": (_bool, (True, False)),
    "kv_cache_dtype": (str, ("auto", "fp8_e4m3", "int8", "kivi4")),
    "kv_retention": (_optional, (None,)),
    "kv_offload_cpu": (_optional, (None,)),
    "block_size": (int, (_engine_default("block_size"), 32)),
    "max_num_seqs": (int, (_engine_default("max_num_seqs"), 64)),
    "max_num_batched_tokens": (_tokens, (_engine_default("max_num_batched_tokens"), 8192)),
    "admission": (str, ("greedy", "projected")),
    "replicas": (int, (1, 2)),
    "tp": (int, (1, 2)),
    # How the replicas are routed (kvserve.router.policies): searched only when asked.
    "router": (str, ("round_robin",)),
}
TARGET_KEYS = ("replicas", "tp", "router")  # the others are engine flags


def default_space(pinned: set[str] = frozenset()) -> dict[str, tuple[Any, ...]]:
    """The space searched when nothing is asked: every dimension with more than one default
    value, but those in ``pinned`` (a flag the user set keeps its value)."""
    return {k: v for k, (_, v) in DIMENSIONS.items() if len(v) > 1 and k not in pinned}


def first_pass_size(space: dict[str, tuple[Any, ...]]) -> int:
    """Configurations the first pass of the descent tries: the start, then every other value
    of each dimension once (each differs from all tried before in the dimension it varies)."""
    return 1 + sum(len(v) - 1 for v in space.values())


def describe_space(space: dict[str, tuple[Any, ...]]) -> str:
    return "; ".join(f"{k}={','.join(show_value(v) for v in vals)}" for k, vals in space.items())


def parse_search(items: list[str] | None) -> dict[str, tuple[Any, ...]]:
    """The space ``NAME=V1,V2`` items (repeatable) ask for, exactly: the dimensions named,
    with their values in order (``NAME=V`` pins one); nothing else."""
    space: dict[str, tuple[Any, ...]] = {}
    for item in items or []:
        name, eq, values = item.partition("=")
        name = name.strip().replace("-", "_")
        if not eq or name not in DIMENSIONS:
            raise ValueError(
                f"search: expected NAME=V1,V2 with NAME one of {', '.join(DIMENSIONS)}, "
                f"got {item!r}"
            )
        kind = DIMENSIONS[name][0]
        vals = [v.strip() for v in values.split(",") if v.strip()]
        if not vals:
            raise ValueError(f"search: {name} has no values (the search space is empty)")
        try:
            parsed = tuple(dict.fromkeys(kind(v) for v in vals))
        except ValueError as e:
            raise ValueError(f"search: {name}: {e}") from None
        if name == "kv_cache_dtype":
            bad = [v for v in parsed if v not in KV_CACHE_DTYPES]
            if bad:
                raise ValueError(
                    f"search: kv_cache_dtype: unknown {bad}; known: {', '.join(KV_CACHE_DTYPES)}"
                )
        if name == "router":
            bad = [v for v in parsed if v not in SIM_POLICIES]
            if bad:
                raise ValueError(f"search: router: unknown {bad}; known: {', '.join(SIM_POLICIES)}")
        if name == "kv_offload_cpu":
            for v in parsed:
                if v is not None:
                    parse_bytes(v, "search: kv_offload_cpu")  # ConfigError is a ValueError
        if name in ("replicas", "tp", "block_size", "max_num_seqs", "max_num_batched_tokens"):
            if any(v < 1 for v in parsed):
                raise ValueError(f"search: {name} values must be >= 1, got {parsed}")
        space[name] = parsed
    return space


def show_value(v: Any) -> str:
    """A value as --search writes it: on/off, none."""
    if v is None:
        return "none"
    if isinstance(v, bool):
        return "on" if v else "off"
    return str(v)
