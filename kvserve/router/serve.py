"""Build the router's state from its flags and serve it with uvicorn."""

from __future__ import annotations

import argparse
import signal
from pathlib import Path

import uvicorn

from kvserve.model.tokenizer import Tokenizer
from kvserve.router.app import Replica, RouterState, build_app, parse_replica
from kvserve.router.index import PrefixIndex
from kvserve.router.policies import make_policy
from kvserve.server.tenants import TenantResolver


def build_router_state(args: argparse.Namespace) -> RouterState:
    replicas = []
    for i, spec in enumerate(args.replica):
        url, events, replay = parse_replica(spec)
        replicas.append(Replica(f"r{i}", url, events, replay))
    if args.routing_logic == "prefix" and not any(r.events for r in replicas):
        raise ValueError("routing_logic: prefix reads the replicas' KV events; give each "
                         "--replica its events endpoint (URL,EVENTS[,REPLAY]) or use "
                         "prefix_approx")  # fmt: skip
    tokenizer = None
    if args.tokenizer is not None:
        if not (Path(args.tokenizer) / "tokenizer.json").exists():
            raise ValueError(f"tokenizer: no tokenizer.json in {args.tokenizer}")
        tokenizer = Tokenizer(Path(args.tokenizer), ())
    index = PrefixIndex(len(replicas))
    policy = make_policy(args.routing_logic, index=index, block_size=args.block_size,
                         approx_capacity_blocks=args.approx_capacity_blocks,
                         overlap_weight=args.overlap_weight,
                         balance_abs=args.balance_abs_threshold,
                         balance_rel=args.balance_rel_threshold)  # fmt: skip
    tenants = TenantResolver.from_args(args.api_key, args.tenants)
    return RouterState(replicas, policy, index, tenants, tokenizer, args.session_key,
                       args.health_interval, topic=args.kv_events_topic)  # fmt: skip


def run_router(args: argparse.Namespace) -> int:
    state = build_router_state(args)
    config = uvicorn.Config(build_app(state), host=args.host, port=args.port,
                            log_level=args.log_level, access_log=False,
                            timeout_graceful_shutdown=5, backlog=2048)  # fmt: skip
    signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        uvicorn.Server(config).run()
    except KeyboardInterrupt:
        pass
    return 0
