"""Model names, paths and Hugging Face hub ids to a Hugging Face model directory, the same
from any directory.

The order, as vLLM's: a local path that holds a model (a directory with ``config.json``, a
``.gguf`` file or a directory holding one); then a model name (``kvserve-ref``, ``smollm2``);
then a hub id ``org/name[@revision]`` (:mod:`kvserve.model.hub`: the Hugging Face cache,
downloading when online). So ``--model kvserve-ref`` means the bundled model unless the working
directory holds a model of that name, and ``./kvserve-ref`` is always a path. The bundled
model is found inside the installed package, never relative to a checkout, so a wheel serves
the same weights as the source tree. Nothing here imports torch: ``kvserve plan`` and the
CLI's argument handling resolve models without it.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib.resources import files
from pathlib import Path

from kvserve.config import ConfigError, user_cache_dir
from kvserve.model.hub import HubId, hub_snapshot, parse_hub_id

BUNDLED_NAME = "kvserve-ref"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
ACCEPTED_FORMS = (
    "a Hugging Face model directory (with config.json), a .gguf file, "
    "or a directory holding one .gguf file"
)


def bundled_model_dir() -> Path:
    """The reference model shipped inside the package (``kvserve/bundled/kvserve-ref``)."""
    return Path(str(files("kvserve") / "bundled" / BUNDLED_NAME))


def model_cache_dir(name: str) -> Path:
    """Where ``kvserve download NAME`` puts a model: ``user_cache_dir()/models/NAME``."""
    return user_cache_dir() / "models" / name


def _bundled() -> str:
    path = bundled_model_dir()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"model: the bundled model {BUNDLED_NAME!r} is missing from this installation "
            f"(expected {path}/config.json); reinstall kvserve or pass --model"
        )
    return str(path)


def _smollm2() -> str:
    path = model_cache_dir("smollm2")
    if (path / "config.json").is_file():
        return str(path)
    if (path / SMOLLM2_GGUF).is_file():
        return resolve_model(str(path / SMOLLM2_GGUF))
    raise FileNotFoundError(
        f"model: 'smollm2' is not downloaded yet (looked in {path}); get it with "
        "`kvserve download smollm2`"
    )


# Name -> how to find it. Add a name here and it is accepted everywhere --model is.
MODEL_NAMES: dict[str, Callable[[], str]] = {BUNDLED_NAME: _bundled, "smollm2": _smollm2}


def _prepare_gguf(path: Path) -> str:
    # Lazily: the GGUF reader is needed only for GGUF input.
    from kvserve.model.gguf import prepare_gguf

    return str(prepare_gguf(path))


def _local_model(path: Path, given: str) -> str | None:
    """The model directory a local path holds (a GGUF file prepared first), or None where
    it holds none. Raises for a directory with several ``.gguf`` files."""
    if path.is_file() and path.suffix.lower() == ".gguf":
        return _prepare_gguf(path.resolve())
    if not path.is_dir():
        return None
    if (path / "config.json").is_file():
        return str(path.resolve())
    ggufs = sorted(p for p in path.iterdir() if p.suffix.lower() == ".gguf" and p.is_file())
    if len(ggufs) == 1:
        return _prepare_gguf(ggufs[0].resolve())
    if len(ggufs) > 1:
        raise FileNotFoundError(
            f"model: {given!r} holds {len(ggufs)} .gguf files "
            f"({', '.join(p.name for p in ggufs)}); pass one of them"
        )
    return None


def resolve_model(name_or_path: str | None, revision: str | None = None) -> str:
    """A Hugging Face-format model directory for a local path, a model name (``kvserve-ref``,
    the default, or ``smollm2``) or a Hugging Face hub id, tried in that order.

    A path is a model directory, a ``.gguf`` file or a directory holding one; a GGUF file is
    converted once into a cached directory (:func:`kvserve.model.gguf.prepare_gguf`), and a
    directory with ``config.json`` is returned as it is, so resolving a resolved model changes
    nothing. A hub id ``org/name`` (``org/name@revision``, or ``revision``) is the snapshot
    :func:`kvserve.model.hub.hub_snapshot` finds or downloads, which then resolves as a path;
    ``revision`` applies to hub ids only. Raises :class:`FileNotFoundError` naming what was
    given and what was tried.
    """
    if name_or_path is None:
        return MODEL_NAMES[BUNDLED_NAME]()
    path = Path(name_or_path).expanduser()
    if path.exists() and (found := _local_model(path, name_or_path)) is not None:
        return found
    if name_or_path in MODEL_NAMES:
        return MODEL_NAMES[name_or_path]()
    hub = None if path.exists() else parse_hub_id(name_or_path)
    if hub is not None:
        if revision is not None and hub.revision not in (None, revision):
            raise ConfigError(
                f"revision: {name_or_path!r} names revision {hub.revision!r} and revision is "
                f"{revision!r}; give one of them"
            )
        hub = HubId(hub.repo_id, hub.revision or revision)
        snapshot = Path(hub_snapshot(hub))
        found = _local_model(snapshot, name_or_path)
        if found is None:
            raise FileNotFoundError(
                f"model: the snapshot of {name_or_path!r} at {snapshot} has no config.json "
                "and no .gguf file"
            )
        return found
    what = "is neither a known model name nor an existing path, nor a hub id (org/name)"
    if path.is_dir():
        what = "is a directory without config.json or a .gguf file"
    elif path.exists():
        what = "is a file that is not a .gguf file"
    raise FileNotFoundError(
        f"model: {name_or_path!r} {what}; expected a model name "
        f"({', '.join(MODEL_NAMES)}), {ACCEPTED_FORMS}, or a Hugging Face hub id "
        "(org/name or org/name@revision)"
    )
