"""Engine flags, their defaults and their help, generated from the config dataclasses'
fields (:mod:`kvserve.config_fields`): ``kvserve generate``, ``serve``, ``bench``, ``quality``,
``simulate``, ``tune`` and ``make run`` all add them here, and nothing restates a default.

A leaf on purpose: it imports only :mod:`kvserve.config`, its fields and the model resolver
(a registry that gives a flag its choices is imported when the parser is built), so every
command can import it at module level without importing the CLI that imports them.
"""

from __future__ import annotations

import argparse
from typing import Any

from kvserve.config import ConfigError, EngineConfig
from kvserve.config_fields import Setting, settings_of
from kvserve.model.resolve import BUNDLED_NAME, resolve_model


def default_model() -> str:
    """The bundled reference model's directory inside the installed package; raises
    :class:`FileNotFoundError` when the installation lacks it (never a stand-in model)."""
    return resolve_model(None)


def add_engine_args(p: argparse.ArgumentParser, config: type = EngineConfig) -> None:
    """One flag per setting of ``config`` (vLLM's names: ``--block-size``,
    ``--enable-prefix-caching`` / ``--no-enable-prefix-caching``, ...), in one argument group
    per config dataclass, each flag's ``--help`` ending with its default; plus ``--model``
    and ``--kv-offloading-size``, vLLM's name for ``--kv-offload-cpu`` in GiB."""
    groups: dict[type, Any] = {}

    def group(cls: type) -> Any:
        if cls not in groups:
            doc = " ".join((cls.__doc__ or "").split("\n\n")[0].split())
            groups[cls] = p.add_argument_group(cls.__name__, doc.replace("%", "%%") or None)
        return groups[cls]

    for s in settings_of(config).values():
        if s.name == "model":
            group(s.owner).add_argument(
                "--model", default=None, help=f"{_help(s)} (default: {BUNDLED_NAME})"
            )
        elif not s.required:
            _add_flag(group(s.owner), s)
        if s.name == "kv_offload_cpu":
            group(s.owner).add_argument(
                "--kv-offloading-size",
                type=float,
                default=None,
                metavar="GIB",
                help="vLLM's name for --kv-offload-cpu, in GiB",
            )


def add_setting_flags(p: Any, names: list[str], config: type = EngineConfig) -> None:
    """The flags of the settings ``names`` alone, as :func:`add_engine_args` makes them, on a
    parser or an argument group: for a command that takes a few engine settings
    (``kvserve plan``)."""
    settings = settings_of(config)
    for name in names:
        _add_flag(p, settings[name])


def _help(s: Setting) -> str:
    return s.help.replace("%", "%%")


def _add_flag(g: Any, s: Setting) -> None:
    kw: dict[str, Any] = {"dest": s.name, "default": s.default, "help": _help(s)}
    if s.field.metadata.get("json"):  # a config given whole: none unless the flag is given
        kw["default"] = None
    if s.value_type is bool:
        # A switch that is off by default needs no --no- form; one that is on gets both.
        kw["action"] = argparse.BooleanOptionalAction if s.default else "store_true"
    else:
        if s.value_type in (int, float):
            kw["type"] = s.value_type
        kw["choices"] = s.choices()
        kw["metavar"] = s.metavar
    action = g.add_argument(s.flag, **kw)
    if "%(default)" not in (action.help or ""):  # BooleanOptionalAction adds its own
        action.help = f"{action.help} (default: %(default)s)".lstrip()


def engine_kwargs(args: argparse.Namespace, config: type = EngineConfig) -> dict[str, Any]:
    """The parsed engine flags as :class:`kvserve.LLM` keyword arguments (every setting of
    ``config``), the model resolved (the bundled one where none is given)."""
    revision = getattr(args, "revision", None)
    model = resolve_model(args.model, revision) if args.model else default_model()
    kwargs: dict[str, Any] = {"model": model}
    for name, s in settings_of(config).items():
        if not s.required:
            kwargs[name] = getattr(args, name)
    kwargs["kv_offload_cpu"] = _offload_cpu(args)
    return kwargs


def _offload_cpu(args: argparse.Namespace) -> str | None:
    if args.kv_offloading_size is None:
        return args.kv_offload_cpu
    if args.kv_offload_cpu is not None:
        raise ConfigError(
            "kv_offloading_size: give --kv-offload-cpu or --kv-offloading-size, not both"
        )
    if args.kv_offloading_size <= 0:
        raise ConfigError(f"kv_offloading_size: must be > 0 GiB, got {args.kv_offloading_size}")
    return f"{args.kv_offloading_size}GiB"
