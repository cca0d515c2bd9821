"""Hugging Face hub ids (``org/name``, ``org/name@revision``) to a snapshot directory, through
``huggingface_hub``'s own cache and API, so the cache is the one transformers and vLLM share.

The cache is where ``huggingface_hub`` puts it (``HF_HUB_CACHE``, else ``HF_HOME/hub``, else
``~/.cache/huggingface/hub``). With ``HF_HUB_OFFLINE=1`` only the cache is read and nothing is
sent anywhere; a model missing from it is an error naming the id, the cache and the variable.
Online, the repository's file list decides what to fetch: the configuration, tokenizer and
``model*.safetensors`` files the loader reads, or, for a repository without safetensors, its
one ``.gguf`` file; never every file (repositories also carry ``.bin``, ONNX and consolidated
copies of the same weights). When the hub cannot be reached the cache is used if it holds the
model, as ``huggingface_hub`` itself does.

``huggingface_hub`` is imported only when a hub id is resolved: local paths and model names
never pay for it.
"""

from __future__ import annotations

import fnmatch
import logging
import re
from typing import Any, NamedTuple

log = logging.getLogger("kvserve.model")

# org/name, as the hub spells repository ids, with an optional @revision (a branch, a tag, a
# commit hash, or refs/pr/N).
_HUB_ID = re.compile(r"(?P<repo>[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9_.-]+)(?:@(?P<rev>\S+))?")
DEFAULT_REVISION = "main"
# Fetched whenever the repository has them: what ModelConfig, the tokenizer and the chat
# template read.
META_PATTERNS = [
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
]
# The weights kvserve.model.loader reads: model.safetensors or its shards and their index.
SAFETENSORS_PATTERNS = ["model*.safetensors", "model.safetensors.index.json"]
MAX_LISTED_FILES = 8  # of a repository's .gguf files, in the error that asks for one


class HubId(NamedTuple):
    repo_id: str
    revision: str | None


def parse_hub_id(name: str) -> HubId | None:
    """``org/name[@revision]`` as its parts; None for anything else (a bare name is never a
    hub id here: the hub's legacy ids without an organisation have ``org/name`` spellings,
    and a typo of a model name should not become a network request)."""
    m = _HUB_ID.fullmatch(name)
    if m is None or ".." in m["repo"] or "--" in m["repo"]:
        return None
    return HubId(m["repo"], m["rev"])


def download_patterns(repo_id: str, files: list[str]) -> list[str]:
    """What to fetch from a repository holding ``files``: its configuration and tokenizer
    with either its safetensors weights or, where it has none, its only ``.gguf`` file.
    Raises :class:`FileNotFoundError` naming the repository when it has neither, or several
    ``.gguf`` files and no way to choose."""
    top = [f for f in files if "/" not in f]
    if any(fnmatch.fnmatch(f, p) for f in top for p in SAFETENSORS_PATTERNS):
        return META_PATTERNS + SAFETENSORS_PATTERNS
    ggufs = sorted(f for f in top if f.lower().endswith(".gguf"))
    if len(ggufs) == 1:
        return META_PATTERNS + ggufs
    if ggufs:
        shown = ", ".join(ggufs[:MAX_LISTED_FILES]) + (", ..." if len(ggufs) > MAX_LISTED_FILES
                                                       else "")  # fmt: skip
        raise FileNotFoundError(
            f"model: {repo_id!r} holds {len(ggufs)} .gguf files ({shown}) and no safetensors; "
            f"download one (`hf download {repo_id} FILE`) and pass its path"
        )
    raise FileNotFoundError(
        f"model: {repo_id!r} has no model*.safetensors and no .gguf file at its top level "
        "(kvserve does not load .bin checkpoints)"
    )


def _describe(hub: HubId) -> str:
    return f"{hub.repo_id!r} (revision {hub.revision or DEFAULT_REVISION})"


def hub_snapshot(hub: HubId) -> str:
    """The local snapshot directory of ``hub``: from the cache when offline or when the hub
    cannot be reached, else downloaded (only what :func:`download_patterns` names) into it.
    Raises :class:`FileNotFoundError` with what to do for a missing model, revision or
    cache entry."""
    from huggingface_hub import constants

    if not constants.HF_HUB_OFFLINE:
        try:
            return _download(hub)
        except _Unreachable as e:
            log.warning("model %s: the hub at %s cannot be reached (%s); using the cache",
                        hub.repo_id, constants.ENDPOINT, e.__cause__)  # fmt: skip
            return _from_cache(hub, reason=f"the hub at {constants.ENDPOINT} cannot be reached "
                               f"({type(e.__cause__).__name__}: {e.__cause__})")  # fmt: skip
    return _from_cache(
        hub, reason="HF_HUB_OFFLINE=1 forbids downloading it (unset HF_HUB_OFFLINE to download)"
    )


class _Unreachable(Exception):
    """The hub could not answer (network, proxy, server error): the cache may still serve."""


def _download(hub: HubId) -> str:
    from huggingface_hub import HfApi, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HFValidationError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        info = HfApi().model_info(hub.repo_id, revision=hub.revision)
        files = [s.rfilename for s in info.siblings or []]
        patterns = download_patterns(hub.repo_id, files)
        log.info("model %s: fetching what the Hugging Face cache lacks of %s",
                 _describe(hub), ", ".join(patterns))  # fmt: skip
        return str(snapshot_download(hub.repo_id, revision=hub.revision, allow_patterns=patterns))
    except GatedRepoError as e:
        raise FileNotFoundError(
            f"model: {hub.repo_id!r} is gated on the hub: accept its terms on its page and set "
            f"HF_TOKEN (the hub said: {_first_line(e)})"
        ) from None
    except RevisionNotFoundError:
        raise FileNotFoundError(
            f"model: {hub.repo_id!r} has no revision {hub.revision!r} on the hub (give a branch, "
            "a tag or a commit hash with --revision or model@revision)"
        ) from None
    except RepositoryNotFoundError:
        raise FileNotFoundError(
            f"model: {hub.repo_id!r} is not a model on the Hugging Face hub (nor a local path or "
            "a known model name); a private model needs HF_TOKEN"
        ) from None
    except HFValidationError as e:
        raise FileNotFoundError(f"model: {hub.repo_id!r} is not a valid hub id: {e}") from None
    except FileNotFoundError:
        raise
    except Exception as e:  # connection, proxy, timeout, a 5xx: the cache may hold it
        raise _Unreachable() from e


def _from_cache(hub: HubId, reason: str) -> str:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    incomplete: Any = LocalEntryNotFoundError
    try:
        from huggingface_hub.errors import IncompleteSnapshotError

        incomplete = IncompleteSnapshotError
    except ImportError:  # older huggingface_hub: no completeness check
        pass
    try:
        return str(snapshot_download(hub.repo_id, revision=hub.revision, local_files_only=True,
                                     allow_patterns=META_PATTERNS))  # fmt: skip
    except incomplete as e:
        raise FileNotFoundError(
            f"model: {_describe(hub)} is only partly in the Hugging Face cache at "
            f"{constants.HF_HUB_CACHE}, and {reason}: {_first_line(e)}"
        ) from None
    except LocalEntryNotFoundError:
        raise FileNotFoundError(
            f"model: {_describe(hub)} is not in the Hugging Face cache at "
            f"{constants.HF_HUB_CACHE} (HF_HUB_CACHE, else HF_HOME/hub), and {reason}"
        ) from None


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]
