"""The configuration reference, read from where each setting is defined: the engine settings
from the config dataclasses (:func:`kvserve.config_fields.settings_of`) as
:func:`kvserve.engine_args.add_engine_args` turns them into flags, every command's own flags
from its parser (:func:`kvserve.cli.build_parser`), and the environment variables from
:mod:`kvserve.envs`.

Argparse keeps a parser's arguments in ``_actions``; reading them is what every tool that
documents an argparse CLI does, as argparse offers no public listing.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import types
import typing
from collections.abc import Callable, Iterator
from typing import Any

from kvserve import envs
from kvserve.cli import build_parser
from kvserve.config import EngineConfig
from kvserve.config_fields import Setting, settings_of
from kvserve.docs_reference.markdown import code, table, text, value
from kvserve.engine_args import add_engine_args

# engine_args ends each flag's help with its default, BooleanOptionalAction adds the same: the
# page has a column for it.
_DEFAULT_SUFFIX = re.compile(r"\s*\(default: %\(default\)s\)")
_COLUMNS = ("Flag", "Type", "Default", "Choices", "Help")

INTRO = """\
# Configuration reference

!!! note "Generated from the code"
    `python -m kvserve.docs_reference` (or `make reference`) writes this page from the config
    dataclasses, the command parsers and `kvserve/envs.py`; a test fails when the committed
    page differs from what the code says. Change a setting's help in the code, then
    regenerate.
"""


def configuration_page(
    config: type = EngineConfig,
    parser: Callable[[], argparse.ArgumentParser] = lambda: build_parser()[0],
) -> str:
    """The page: engine settings, the server's flags, each command's own flags, the
    environment variables."""
    engine = _engine_parser(config)
    engine_keys = {_key(a) for a in _arguments(engine)}
    commands = list(_commands(parser()))
    users = [name for name, _, p in commands if engine_keys <= {_key(a) for a in _arguments(p)}]
    parts = [INTRO, _engine_section(config, engine, users)]
    for name, _, p in commands:
        if name == "kvserve serve":
            parts.append(_server_section(p, engine_keys))
    parts.append("## Commands\n\nEach command's own flags; the engine flags are above.")
    for name, about, p in commands:
        if name != "kvserve serve":
            parts.append(_command_section(name, about, p, engine_keys))
    parts.append(_environment_section())
    return "\n\n".join(part.strip("\n") for part in parts) + "\n"


def _engine_parser(config: type) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvserve", add_help=False)
    add_engine_args(p, config)
    return p


def _engine_section(config: type, engine: argparse.ArgumentParser, users: list[str]) -> str:
    """One table per config dataclass, as ``--help`` groups them."""
    settings = settings_of(config)
    takers = ", ".join(code(name) for name in users)
    out = [
        "## Engine settings",
        f"Each setting is a keyword argument of `LLM(...)` and a flag of {takers}, with "
        "vLLM's names where vLLM has the setting. A switch that is on by default also has a "
        "`--no-` form.",
    ]
    groups: dict[type, list[list[str]]] = {}
    owner = EngineConfig
    for action in _arguments(engine):
        s = settings.get(action.dest)
        owner = s.owner if s is not None else owner  # an extra flag joins the one before it
        groups.setdefault(owner, []).append(_setting_row(action, s, engine.prog))
    for owner, rows in groups.items():
        doc = " ".join((owner.__doc__ or "").split("\n\n")[0].split())
        out.append(f"### {owner.__name__}\n\n{text(doc)}".rstrip())
        header = ("Flag", "`LLM(...)` keyword", "Type", "Default", "Choices", "Help")
        out.append(table(header, rows))
    return "\n\n".join(out)


def _setting_row(action: argparse.Action, s: Setting | None, prog: str) -> list[str]:
    if s is None:  # a flag engine_args adds beside the settings (vLLM's spelling of one)
        return [_flags(action), "—", _action_type(action), value(action.default),
                _choices(action.choices), text(_help(action, prog))]  # fmt: skip
    if s.required:
        default = "required"
    elif dataclasses.is_dataclass(s.default) and s.default == type(s.default)():
        default = code(f"{type(s.default).__name__}()")
    else:
        default = value(s.default)
    return [_flags(action), code(s.name), code(_type_name(s.annotation)), default,
            _choices(s.choices()), text(_help(action, prog))]  # fmt: skip


def _server_section(p: argparse.ArgumentParser, engine_keys: set[tuple]) -> str:
    own = [a for a in _arguments(p) if _key(a) not in engine_keys]
    return "\n\n".join([
        "## Server",
        "`kvserve serve` takes every engine flag and these.",
        table(_COLUMNS, (_row(a, p.prog) for a in own)),
    ])  # fmt: skip


def _command_section(
    name: str, about: str, p: argparse.ArgumentParser, engine_keys: set[tuple]
) -> str:
    keys = {_key(a) for a in _arguments(p)}
    own = [a for a in _arguments(p) if _key(a) not in engine_keys]
    out = [f"### {name}", text(about)]
    if engine_keys <= keys:
        out.append("Takes every engine flag.")
    elif shared := [a for a in _arguments(p) if _key(a) in engine_keys]:
        out.append("Takes the engine flags " + ", ".join(_flags(a) for a in shared) + ".")
    out.append(table(_COLUMNS, (_row(a, p.prog) for a in own)) if own else "No flags of its own.")
    return "\n\n".join(part for part in out if part)


def _environment_section() -> str:
    rows = []
    for v in envs.VARIABLES.values():
        kind = (v.parse.__doc__ or "").strip()
        if not kind:
            raise ValueError(f"{v.name}: its parser {v.parse.__name__} has no docstring "
                             "naming the values it takes")  # fmt: skip
        rows.append([code(v.name), text(kind), _env_default(v.default), text(v.doc)])
    native = [[code(name), "set or unset", "unset", text(doc)]
              for name, doc in envs.NATIVE_VARIABLES.items()]  # fmt: skip
    header = ("Variable", "Values", "Default", "Meaning")
    return "\n\n".join([
        "## Environment variables",
        "Read when used, not at import. A value that does not parse is an error naming the "
        "variable; an empty value counts as unset.",
        table(header, rows),
        "### Read by the native kernels",
        table(header, native),
    ])  # fmt: skip


def _commands(
    parser: argparse.ArgumentParser, name: str = "kvserve"
) -> Iterator[tuple[str, str, argparse.ArgumentParser]]:
    """(``kvserve bench compare``, its one-line help, its parser) for every subcommand, nested
    ones after their parent."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            about = {a.dest: a.help or "" for a in action._choices_actions}
            for sub, p in action.choices.items():
                yield f"{name} {sub}", about.get(sub, ""), p
                yield from _commands(p, f"{name} {sub}")


def _arguments(p: argparse.ArgumentParser) -> list[argparse.Action]:
    skip = argparse._HelpAction | argparse._SubParsersAction
    return [a for a in p._actions if not isinstance(a, skip) and a.help != argparse.SUPPRESS]


def _key(a: argparse.Action) -> tuple:
    """An argument's identity across parsers: an engine flag is the same on every command."""
    return tuple(a.option_strings), a.dest, a.help


def _row(a: argparse.Action, prog: str) -> list[str]:
    return [_flags(a), _action_type(a), value(a.default), _choices(a.choices),
            text(_help(a, prog))]  # fmt: skip


def _flags(a: argparse.Action) -> str:
    if not a.option_strings:
        optional = ", optional" if a.nargs == "?" else ""
        return f"{code(a.metavar or a.dest)} (positional{optional})"
    return ", ".join(code(o) for o in a.option_strings)


def _action_type(a: argparse.Action) -> str:
    if a.nargs == 0:
        return "switch"
    name = "str" if a.type is None else getattr(a.type, "__name__", "str")
    if isinstance(a, argparse._AppendAction):
        return f"{name}, repeatable"
    if a.nargs in ("+", "*"):
        return f"{name}, one or more" if a.nargs == "+" else f"{name}, any number"
    return name


def _choices(choices: Any) -> str:
    return ", ".join(code(str(c)) for c in choices) if choices else ""


def _help(a: argparse.Action, prog: str) -> str:
    """The help as ``--help`` prints it (``%(default)s`` and the like filled in), without the
    default it ends with."""
    h = _DEFAULT_SUFFIX.sub("", a.help or "")
    if "%" not in h:
        return h
    params = {k: v for k, v in vars(a).items() if v is not argparse.SUPPRESS}
    params["prog"] = prog
    if params.get("choices") is not None:
        params["choices"] = ", ".join(map(str, params["choices"]))
    return h % params


def _type_name(t: Any) -> str:
    if t is type(None):
        return "None"
    if isinstance(t, type) and not isinstance(t, types.GenericAlias):
        return t.__name__
    if isinstance(t, types.UnionType) or typing.get_origin(t) is typing.Union:
        return " | ".join(_type_name(a) for a in typing.get_args(t))
    return str(t).replace("typing.", "")


def _env_default(v: Any) -> str:
    if v is None:
        return "unset"
    if isinstance(v, bool):
        return code("1" if v else "0")
    return code(str(v))
