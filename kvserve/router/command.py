"""``kvserve router``: its flags and the handler that starts it (FastAPI is imported only when
the command runs)."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable
from typing import Any

from kvserve.router.policies import DEFAULT_OVERLAP_WEIGHT, POLICIES


def add_router_parser(sub: Any) -> Callable[[argparse.Namespace], int]:
    """Register ``router`` on the CLI's subparsers; returns its handler."""
    p = sub.add_parser("router", help="an OpenAI-compatible router over kvserve replicas",
                       description="Route each request to one of the replicas by a policy; "
                       "'prefix' reads the replicas' KV events (serve them with "
                       "--kv-events-config).")  # fmt: skip
    p.add_argument("--replica", action="append", required=True,
                   metavar="URL[,EVENTS[,REPLAY]]",
                   help="a replica's base URL, and its KV-event PUB and replay endpoints "
                   "(e.g. http://10.0.0.2:8000,tcp://10.0.0.2:5557,tcp://10.0.0.2:5558); "
                   "repeat for each replica")  # fmt: skip
    p.add_argument(
        "--routing-logic",
        default="prefix",
        choices=POLICIES,
        help="how a replica is chosen: round_robin, least_load (fewest requests in "
        "flight), session (a session header or the request's user stick to one "
        "replica), prefix (the replicas' KV events: most cached prefix, less load), "
        "prefix_approx (the router's own routing history) (default: %(default)s)",
    )
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="directory of the replicas' tokenizer.json (and chat template): the "
                   "prefix policies score text prompts by their tokens; without it only "
                   "token-id prompts are scored")  # fmt: skip
    p.add_argument("--session-key", default="x-session-id", metavar="HEADER",
                   help="the header that names a session (else the request's user) "
                   "(default: %(default)s)")  # fmt: skip
    p.add_argument(
        "--overlap-weight",
        type=float,
        default=DEFAULT_OVERLAP_WEIGHT,
        help="weight of the prompt blocks a replica must compute against the blocks "
        "in flight on it (Dynamo's overlap_score_weight, whose default is 1) "
        "(default: %(default)s)",
    )
    p.add_argument("--balance-abs-threshold", type=int, default=None, metavar="N",
                   help="SGLang's imbalance guard: route by load alone, whatever the cache, "
                   "when the busiest replica has more than N requests in flight beyond the "
                   "idlest... (default: no guard; the cost already weighs load)")  # fmt: skip
    p.add_argument(
        "--balance-rel-threshold",
        type=float,
        default=1.5,
        help="... and more than this many times as many (default: %(default)s)",
    )
    p.add_argument("--block-size", type=int, default=None,
                   help="prefix_approx: the replicas' block size (default: the first a replica "
                   "reports in vllm:cache_config_info's block_size on its /metrics; 16 "
                   "until one does)")  # fmt: skip
    p.add_argument("--approx-capacity-blocks", type=int, default=None,
                   help="prefix_approx: blocks a replica is assumed to keep (default: each "
                   "replica's KV pool, from vllm:cache_config_info's num_gpu_blocks on its "
                   "/metrics; 65536 until it says)")  # fmt: skip
    p.add_argument(
        "--kv-events-topic",
        default="",
        metavar="TOPIC",
        help="the topic the replicas publish on (default: all)",
    )
    p.add_argument(
        "--health-interval",
        type=float,
        default=1.0,
        metavar="SECONDS",
        help="seconds between health checks of each replica (default: %(default)s)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8080, help="TCP port to listen on "
                   "(default: %(default)s)")  # fmt: skip
    p.add_argument(
        "--api-key", default=None, help="require 'Authorization: Bearer KEY' (the replicas' key)"
    )
    p.add_argument(
        "--tenants",
        default=None,
        metavar="FILE",
        help='JSON {"API_KEY": "tenant"}, as the replicas were given; with '
        "$KVSERVE_TENANT_SECRET as theirs, the router computes their cache salts",
    )
    p.add_argument(
        "--log-level", default="info", choices=("critical", "error", "warning", "info", "debug")
    )
    return cmd_router


def cmd_router(args: argparse.Namespace) -> int:
    for name in ("overlap_weight", "balance_rel_threshold", "health_interval"):
        if getattr(args, name) <= 0:
            raise ValueError(f"{name}: must be > 0, got {getattr(args, name)}")
    for name in ("block_size", "approx_capacity_blocks"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ValueError(f"{name}: must be >= 1, got {getattr(args, name)}")
    if args.balance_abs_threshold is not None and args.balance_abs_threshold < 0:
        raise ValueError(f"balance_abs_threshold: must be >= 0, got {args.balance_abs_threshold}")
    from kvserve.router.serve import run_router

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    return run_router(args)
