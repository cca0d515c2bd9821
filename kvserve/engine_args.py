"""Engine flags, their defaults and their help, generated from the config dataclasses'
fields (:mod:`kvserve.config_fields`): ``kvserve generate``, ``serve``, ``bench``, ``quality``,
``simulate``, ``tune`` and ``make run`` all add them here, and nothing restates a default.

Also the grammar every command shares: the model given positionally (vLLM's
``vllm serve MODEL``) or as ``--model`` (:func:`add_model_arg`, :func:`model_arg`), and the
two parsers every length and size flag uses, :func:`token_count` (``32k``, as vLLM's
``--max-model-len``) and :func:`byte_size` (``4GiB``).

A leaf on purpose: it imports only :mod:`kvserve.config`, its fields and the model resolver
(a registry that gives a flag its choices is imported when the parser is built), so every
command can import it at module level without importing the CLI that imports them.
"""

from __future__ import annotations

import argparse
import re
from typing import Any

from kvserve.config import ConfigError, EngineConfig, parse_bytes
from kvserve.config_fields import Setting, settings_of
from kvserve.model.resolve import BUNDLED_NAME, resolve_model

TOKEN_FORMS = (
    "a token count such as 4096, 32k (32,000) or 32K (32,768): k, m, g are powers of 1000, "
    "K, M, G powers of 1024, as vLLM reads them"
)
SIZE_FORMS = (
    "a size such as 4GiB or 4Gi (4 x 2**30 bytes), 4GB or 4G (4 x 10**9), 512MiB, 1.5GB or a "
    "byte count (units K, M, G, T, upper case)"
)
_TOKEN_SUFFIX = re.compile(r"([0-9]+(?:\.[0-9]+)?)([kKmMgGtT])")
_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
UNIT_HELP = {
    "tokens": "; 32k = 32,000 and 32K = 32,768 tokens, as vLLM",
    "bytes": "; 4GiB = 4 x 2**30 bytes, 4GB = 4 x 10**9",
}


def parse_tokens(text: str, name: str) -> int:
    """A token count: a whole number, or one with vLLM's suffixes (its ``human_readable_int``):
    ``32k`` = 32,000 (k, m, g, t: powers of 1000, a decimal allowed: ``1.5k``) and ``32K`` =
    32,768 (K, M, G, T: powers of 1024, whole numbers only). Raises :class:`ConfigError`
    naming ``name`` and the accepted forms."""
    s = str(text).strip()
    m = _TOKEN_SUFFIX.fullmatch(s)
    try:
        if m is None:
            n = int(s)
        elif m.group(2) in _DECIMAL:
            n = int(float(m.group(1)) * _DECIMAL[m.group(2)])
        else:
            n = int(m.group(1)) * _BINARY[m.group(2)]
    except ValueError:
        n = -1
    if n < 0:
        raise ConfigError(f"{name}: expected {TOKEN_FORMS}; got {text!r}")
    return n


def token_count(text: str) -> int:
    """argparse ``type`` of a length flag (:func:`parse_tokens`); argparse names the flag."""
    try:
        return parse_tokens(text, "value")
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("value: ")) from None


def byte_size(text: str) -> int:
    """argparse ``type`` of a size flag: :func:`kvserve.config.parse_bytes`, the parser the
    configs use, so a flag and ``LLM(kv_cache_memory="4GiB")`` read a size alike."""
    try:
        return parse_bytes(text, "value")
    except ConfigError:
        raise argparse.ArgumentTypeError(f"expected {SIZE_FORMS}; got {text!r}") from None


def default_model() -> str:
    """The bundled reference model's directory inside the installed package; raises
    :class:`FileNotFoundError` when the installation lacks it (never a stand-in model)."""
    return resolve_model(None)


def add_model_arg(
    p: argparse.ArgumentParser, help: str | None = None, flag_help: str | None = None, **kw: Any
) -> None:
    """The model as a positional ``MODEL`` (vLLM's ``vllm serve MODEL``), beside the
    ``--model`` flag: that of :func:`add_engine_args`, or one added here with ``flag_help``
    for a command without engine flags. :func:`model_arg` reads the two as one."""
    p.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help=help
        or "the model, as --model takes it (vLLM's form: kvserve serve MODEL); give "
        "one or the other",
        **kw,
    )
    if flag_help is not None:
        p.add_argument("--model", default=None, help=flag_help, **kw)


def model_arg(args: argparse.Namespace) -> str | None:
    """The model given positionally or as ``--model`` (None when neither is). Raises
    :class:`ConfigError` when both are given and differ, naming the two."""
    tag, flag = getattr(args, "model_tag", None), getattr(args, "model", None)
    if tag is not None and flag is not None and tag != flag:
        raise ConfigError(
            f"model: given twice, as MODEL ({tag!r}) and as --model ({flag!r}); give one"
        )
    return tag if tag is not None else flag


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
        if s.unit == "tokens":
            kw["type"] = token_count
        elif s.unit == "bytes":
            kw["type"] = byte_size
        elif s.value_type in (int, float):
            kw["type"] = s.value_type
        kw["help"] += UNIT_HELP.get(s.unit or "", "")
        kw["choices"] = s.choices()
        kw["metavar"] = s.metavar or ("TOKENS" if s.unit == "tokens" else None)
        if "nargs" in s.field.metadata:  # a list flag, vLLM's form: --cuda-graph-sizes 1 2 4
            kw["nargs"] = s.field.metadata["nargs"]
    action = g.add_argument(s.flag, *s.aliases, **kw)
    if "%(default)" not in (action.help or ""):  # BooleanOptionalAction adds its own
        action.help = f"{action.help} (default: %(default)s)".lstrip()


def engine_kwargs(args: argparse.Namespace, config: type = EngineConfig) -> dict[str, Any]:
    """The parsed engine flags as :class:`kvserve.LLM` keyword arguments (every setting of
    ``config``), the model resolved (the bundled one where none is given, given positionally
    or as ``--model``; a hub id at ``--revision``)."""
    model = model_arg(args)
    revision = getattr(args, "revision", None)
    kwargs: dict[str, Any] = {"model": resolve_model(model, revision) if model else default_model()}
    for name, s in settings_of(config).items():
        if not s.required:
            kwargs[name] = getattr(args, name)
    kwargs["kv_offload_cpu"] = _offload_cpu(args)
    return kwargs


def _offload_cpu(args: argparse.Namespace) -> str | int | None:
    if args.kv_offloading_size is None:
        return args.kv_offload_cpu
    if args.kv_offload_cpu is not None:
        raise ConfigError(
            "kv_offloading_size: give --kv-offload-cpu or --kv-offloading-size, not both"
        )
    if args.kv_offloading_size <= 0:
        raise ConfigError(f"kv_offloading_size: must be > 0 GiB, got {args.kv_offloading_size}")
    return f"{args.kv_offloading_size}GiB"
