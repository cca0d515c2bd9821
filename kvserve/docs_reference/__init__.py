"""The reference pages of the docs site, generated from the code: the configuration
(:mod:`.configuration`) and the metrics (:mod:`.metrics`). ``python -m kvserve.docs_reference``
writes them (``make reference``); ``--check`` reports, by the names of the flags, metrics and
variables concerned, where the committed pages differ from what the code says now, as
``tests/test_docs_reference.py`` does in CI.

Nothing in the package imports this; it reads the commands, so it sits above them.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from kvserve.docs_reference.configuration import configuration_page
from kvserve.docs_reference.markdown import differences
from kvserve.docs_reference.metrics import metrics_page

# Page (relative to the repository root) -> what renders it.
PAGES: dict[str, Callable[[], str]] = {
    "docs/reference/configuration.md": configuration_page,
    "docs/reference/metrics.md": metrics_page,
}
REGENERATE = "python -m kvserve.docs_reference"


def check_page(path: str, committed: str | None, generated: str) -> list[str]:
    """Why the committed text of page ``path`` is not what the code generates now (nothing
    when it is): each row that is missing, differs or is left over, named."""
    if committed is None:
        return [f"{path}: missing; write it with `{REGENERATE}`"]
    if committed == generated:
        return []
    found = differences(committed, generated) or ["whitespace or line order"]
    return [f"{path} is out of date (regenerate it with `{REGENERATE}`): {d}" for d in found]


def check(root: Path) -> list[str]:
    """Every difference between the committed pages under ``root`` and the code."""
    out = []
    for rel, render in PAGES.items():
        path = root / rel
        committed = path.read_text(encoding="utf-8") if path.exists() else None
        out += check_page(rel, committed, render())
    return out


def write(root: Path) -> list[Path]:
    """Write every page under ``root``; the paths written."""
    written = []
    for rel, render in PAGES.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(render(), encoding="utf-8")
        written.append(path)
    return written
