"""The engine's settings, read from the config dataclasses' fields: the one source that
:class:`kvserve.LLM`'s keyword arguments, :func:`kvserve.llm.engine_config` and the engine
flags (:mod:`kvserve.engine_args`) are generated from, as vLLM's ``EngineArgs`` reads its
configs' fields.

A field of :class:`~kvserve.config.EngineConfig` whose default is a config dataclass
(``cache``, ``scheduler``) is walked into; every other field is a setting, named by its field
name, flat across the nested configs (two configs may not use one name). What a setting needs
beyond its type and default lives in the field's ``metadata``:

``help``
    one phrase for ``--help`` and the docs (plain text; no ``%`` escaping).
``choices``
    the allowed values: a tuple, or ``"module:NAME"`` naming a registry's tuple, imported
    when a parser is built, so that :mod:`kvserve.config` imports no registry.
``flag``
    the flag, where it is not ``--`` and the field name with dashes.
``metavar``
    the value's name in ``--help``.
``aliases``
    other spellings of the flag (vLLM's short forms, ``-tp``).
``unit``
    ``"tokens"`` for a length (its flag reads ``32k`` and ``32K`` as vLLM does) or
    ``"bytes"`` for a size (``4GiB``); see :func:`kvserve.engine_args.token_count`.
``json``
    on a field that holds a config dataclass: one setting given whole (a dict, the dataclass,
    or JSON text on the command line), not walked into (vLLM's ``--kv-transfer-config``).

Adding a setting is adding a field with its metadata; nothing else lists them.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import importlib
import types
import typing
from dataclasses import MISSING, dataclass
from typing import Any

from kvserve.config import ConfigError, EngineConfig
from kvserve.vllm_args import vllm_keyword


class UnknownSettingError(ConfigError, TypeError):
    """A keyword that is no engine setting; the message names it. A TypeError too, as
    Python's own error for an unexpected keyword argument is."""


@dataclass(frozen=True, slots=True)
class Setting:
    """One field of a config dataclass, as a keyword argument and a flag."""

    field: dataclasses.Field
    owner: type  # the dataclass that declares the field
    path: tuple[str, ...]  # attributes from the root config: ("cache", "block_size")
    annotation: Any  # the field's type, resolved

    @property
    def name(self) -> str:
        return self.field.name

    @property
    def required(self) -> bool:
        return self.field.default is MISSING and self.field.default_factory is MISSING

    @property
    def default(self) -> Any:
        if self.field.default is not MISSING:
            return self.field.default
        if self.field.default_factory is not MISSING:
            return self.field.default_factory()
        raise ConfigError(f"{self.name}: has no default; it must be given")

    @property
    def flag(self) -> str:
        return self.field.metadata.get("flag") or "--" + self.name.replace("_", "-")

    @property
    def help(self) -> str:
        return self.field.metadata.get("help", "")

    @property
    def aliases(self) -> tuple[str, ...]:
        return tuple(self.field.metadata.get("aliases", ()))

    @property
    def metavar(self) -> str | None:
        return self.field.metadata.get("metavar")

    @property
    def unit(self) -> str | None:
        return self.field.metadata.get("unit")

    def choices(self) -> tuple[Any, ...] | None:
        """The allowed values, a registry's imported now where the metadata names one."""
        choices = self.field.metadata.get("choices")
        if isinstance(choices, str):
            module, _, name = choices.partition(":")
            choices = getattr(importlib.import_module(module), name)
        return tuple(choices) if choices is not None else None

    @property
    def value_type(self) -> type:
        """What a flag's text becomes: ``bool``, ``int``, ``float`` or ``str`` (``None`` left
        out of a union; a union of several types, such as a size given as bytes or as
        ``"2GiB"``, stays text for the config to parse)."""
        args = typing.get_args(self.annotation)
        if isinstance(self.annotation, types.UnionType) or typing.get_origin(self.annotation):
            kinds = [a for a in args if a is not type(None)]
        else:
            kinds = [self.annotation]
        if len(kinds) == 1 and kinds[0] in (bool, int, float, str):
            return kinds[0]
        return str


def _nested(f: dataclasses.Field, annotation: Any) -> type | None:
    """The config dataclass a field holds, or None for a plain setting."""
    if f.metadata.get("json"):
        return None
    for candidate in (f.default_factory, annotation):
        if isinstance(candidate, type) and dataclasses.is_dataclass(candidate):
            return candidate
    return None


def _annotations(cls: type) -> dict[str, Any]:
    try:
        return typing.get_type_hints(cls)
    except NameError:  # a class made where its annotations' names cannot be looked up
        return {f.name: f.type for f in dataclasses.fields(cls)}


@functools.cache
def settings_of(root: type = EngineConfig) -> dict[str, Setting]:
    """Every setting of ``root`` and of the config dataclasses nested in it, by name, in
    field order. Raises :class:`ConfigError` where two configs use one name."""
    out: dict[str, Setting] = {}

    def walk(cls: type, path: tuple[str, ...]) -> None:
        hints = _annotations(cls)
        for f in dataclasses.fields(cls):
            if not f.init:
                continue
            annotation = hints.get(f.name, f.type)
            nested = _nested(f, annotation)
            if nested is not None:
                walk(nested, (*path, f.name))
                continue
            if f.name in out:
                raise ConfigError(
                    f"{f.name}: a field of both {out[f.name].owner.__name__} and "
                    f"{cls.__name__}; a setting's name must be unique"
                )
            out[f.name] = Setting(f, cls, (*path, f.name), annotation)

    walk(root, ())
    return out


def default_of(cls: type, name: str) -> Any:
    """The default of setting ``name`` of config dataclass ``cls`` (or of one nested in it):
    what a tool that needs the engine's default reads instead of restating it."""
    setting = settings_of(cls).get(name)
    if setting is None:
        raise ConfigError(f"{name}: no setting of {cls.__name__}")
    return setting.default


def build_config(root: type = EngineConfig, /, **kwargs: Any) -> Any:
    """``root`` built from flat keyword arguments, each routed to the config that declares
    it; a setting not given takes its field's default. Raises :class:`UnknownSettingError`
    (:func:`unknown_setting_message`) naming a keyword that is no setting."""
    known = settings_of(root)
    unknown = [k for k in kwargs if k not in known]
    if unknown:
        raise UnknownSettingError(unknown_setting_message(unknown[0], known))

    def build(cls: type) -> Any:
        hints = _annotations(cls)
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            nested = _nested(f, hints.get(f.name, f.type)) if f.init else None
            if nested is not None:
                values[f.name] = build(nested)
            elif f.init and f.name in kwargs:  # names are unique across the nested configs
                values[f.name] = kwargs[f.name]
        return cls(**values)

    return build(root)


def unknown_setting_message(name: str, known: dict[str, Setting]) -> str:
    """Why keyword ``name`` is refused: the keyword, the nearest settings by spelling, and,
    for one of vLLM's engine arguments that kvserve lacks, what to use instead
    (:mod:`kvserve.vllm_args`), never an internal function's name."""
    close = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
    hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
    vllm = vllm_keyword(name)
    head = vllm.keyword_message() if vllm is not None else f"{name}: unknown engine argument"
    owners = ", ".join(sorted({s.owner.__name__ for s in known.values()}))
    text = head + hint
    return (
        f"{text}{' ' if text.endswith('?') else '. '}The keywords are the fields of {owners} "
        "(docs/reference/configuration.md lists them)"
    )
