"""The wheel carries the bundled model: installed outside the checkout and run from another
directory, ``kvserve generate`` uses the model inside the installed package and prints text.

This is the failure it guards against: the default model was looked up relative to the source
tree, so a non-editable install found nothing and served a randomly generated checkpoint.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# What the build reads (pyproject's readme included); copied so that the build's own
# build/ and egg-info directories never land in the checkout.
SOURCES = ("pyproject.toml", "README.md", "kvserve")
CHILD = """\
import sys
sys.path.insert(0, {site!r})
import kvserve
assert kvserve.__file__.startswith({site!r}), kvserve.__file__
from kvserve.cli import main
sys.exit(main(["generate", "--prompt", "Hello", "--max-tokens", "8"]))
"""


def _pip(*args: str, cwd: Path) -> None:
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    out = subprocess.run([sys.executable, "-m", "pip", *args], cwd=cwd, env=env,
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(REPO / name, src / name)
    _pip("wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(tmp), str(src),
         cwd=tmp)  # fmt: skip
    (wheel,) = tmp.glob("kvserve-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for f in ("config.json", "model.safetensors", "tokenizer.json", "README.md"):
        assert f"kvserve/bundled/kvserve-ref/{f}" in names, f
    _pip("install", "--no-deps", "--no-index", "--target", str(tmp / "site"), str(wheel), cwd=tmp)
    return tmp / "site"


def test_installed_wheel_generates_with_its_bundled_model_from_elsewhere(site, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", CHILD.format(site=str(site))], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    m = re.search(r"\[kvserve\] model (\S+):", out.stderr)
    assert m, out.stderr[-3000:]
    assert Path(m.group(1)).resolve() == (site / "kvserve" / "bundled" / "kvserve-ref").resolve()
    text = out.stdout.strip()
    assert text and text.isprintable(), out.stdout
