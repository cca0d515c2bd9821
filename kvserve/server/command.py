"""``kvserve serve`` as the CLI registers it: the flags from :mod:`kvserve.server.args` and a
handler that imports the FastAPI app only when the command runs.

Apart from ``args`` because the app imports the flags' defaults: a handler beside them would
make ``args`` and ``app`` import each other.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from kvserve.server.args import build_serve_parser


def add_serve_parser(sub: Any) -> Callable[[argparse.Namespace], int]:
    """Register ``serve`` on the CLI's subparsers; returns its handler."""
    build_serve_parser(sub)
    return cmd_serve


def cmd_serve(args: argparse.Namespace) -> int:
    if args.max_queue < 0:
        raise ValueError(f"max_queue: must be >= 0, got {args.max_queue}")
    if args.headless:
        return run_headless_node(args)
    from kvserve.server.app import run_server

    return run_server(args)


def run_headless_node(args: argparse.Namespace) -> int:
    """``kvserve serve ... --headless``: this node's ranks for node 0's engine
    (:mod:`kvserve.executor.headless`), the model where this machine keeps it."""
    import logging

    from kvserve.engine_args import engine_kwargs
    from kvserve.entrypoint import setup_process
    from kvserve.executor.headless import run_headless
    from kvserve.llm import engine_config

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    setup_process(serve=True)
    return run_headless(engine_config(**engine_kwargs(args)))
