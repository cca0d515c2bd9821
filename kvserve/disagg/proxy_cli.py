"""``kvserve proxy``'s flags (the command line imports this, not the proxy's web stack)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from kvserve.disagg import PROXY_POLICIES as POLICIES


def url(text: str) -> str:
    if not text.startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(f"expected an engine's base URL (http://HOST:PORT), "
                                         f"got {text!r}")  # fmt: skip
    return text.rstrip("/")


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected seconds > 0, got {text!r}")
    return value


def add_proxy_parser(sub: Any) -> Callable[[argparse.Namespace], int]:
    p = sub.add_parser("proxy", help="an OpenAI-compatible front for disaggregated prefill "
                       "and decode engines (vLLM's kv_transfer_params protocol)")  # fmt: skip
    p.add_argument(
        "--prefill",
        nargs="+",
        required=True,
        type=url,
        metavar="URL",
        help="base URLs of prefill engines (kv_role kv_producer or kv_both)",
    )
    p.add_argument(
        "--decode",
        nargs="+",
        required=True,
        type=url,
        metavar="URL",
        help="base URLs of decode engines (kv_role kv_consumer or kv_both)",
    )
    p.add_argument(
        "--policy",
        choices=POLICIES,
        default="round_robin",
        help="how an engine of each role is picked",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (0: a free one)")
    p.add_argument("--timeout", type=positive_float, default=600.0,
                   help="seconds a call to an engine may take")  # fmt: skip
    return cmd_proxy


def cmd_proxy(args: argparse.Namespace) -> int:
    from kvserve.disagg.proxy import serve_proxy

    serve_proxy(args.prefill, args.decode, args.policy, args.host, args.port, args.timeout)
    return 0
