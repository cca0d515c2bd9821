"""``kvserve serve`` flags and their defaults, which the app imports too. Import-light: building
the CLI parser must not import FastAPI."""

from __future__ import annotations

import argparse

from kvserve.engine_args import add_engine_args, add_model_arg, byte_size

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024


def build_serve_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``serve`` on the ``kvserve`` subparsers: engine flags plus server flags."""
    p = sub.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server with Prometheus metrics",
        description="Serve MODEL (or --model) over vLLM's OpenAI-compatible API: "
        "kvserve serve smollm2 --port 8000.",
    )
    add_model_arg(p)
    add_engine_args(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on")
    g.add_argument("--port", type=int, default=8000, help="TCP port to listen on")
    g.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    g.add_argument(
        "--tenants",
        default=None,
        metavar="FILE",
        help='JSON {"API_KEY": "tenant"}; each tenant gets its own prefix-cache partition',
    )
    g.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="model name(s) clients use (default: the model as given)",
    )
    g.add_argument(
        "--max-queue",
        type=int,
        default=1024,
        help="sequences admitted beyond --max-num-seqs; more get 429 with Retry-After",
    )
    g.add_argument(
        "--max-body-bytes",
        type=byte_size,
        default=DEFAULT_MAX_BODY_BYTES,
        metavar="SIZE",
        help="largest request body; a larger one gets 413",
    )
    g.add_argument(
        "--allow-kv-retention-override",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="let a request choose its own kv_retention (an extra body field); with --no-... "
        "such a request gets a 400 naming the field",
    )
    g.add_argument(
        "--shutdown-timeout",
        type=int,
        default=30,
        help="seconds SIGTERM waits for in-flight requests before aborting them",
    )
    g.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="the server's and uvicorn's log level (vLLM's --uvicorn-log-level)",
    )
    g.add_argument(
        "--tool-call-parser",
        default=None,
        choices=["hermes", "llama3_json"],
        help="the format the model writes tool calls in (default: read from the chat "
        "template: <tool_call> blocks are hermes; else hermes for forced calls)",
    )
    g.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='allow tool_choice "auto" (the default when a request has tools): the model may '
        "answer or call, and its calls are parsed out of its text",
    )
    g.add_argument("--disable-access-log", action="store_true", help="no log line per HTTP request")
    g.add_argument(
        "--headless",
        action="store_true",
        help="with --nnodes above 1, on a node other than 0: run this machine's "
        "tensor-parallel ranks for node 0's engine, with no engine or API server (vLLM's flag)",
    )
    return p
