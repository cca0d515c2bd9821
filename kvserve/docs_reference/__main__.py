"""``python -m kvserve.docs_reference [--check] [--root DIR]``: write the reference pages, or
check the committed ones (exit 1, each difference named)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvserve.docs_reference import check, write


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvserve.docs_reference", description=__doc__)
    p.add_argument("--root", type=Path, default=Path.cwd(), help="the repository root")
    p.add_argument("--check", action="store_true", help="compare instead of writing")
    args = p.parse_args(argv)
    if args.check:
        problems = check(args.root)
        for line in problems:
            print(line, file=sys.stderr)
        return 1 if problems else 0
    for path in write(args.root):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
