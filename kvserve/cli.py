"""``kvserve`` command line: generate, serve, bench, plan, simulate, tune, quality and download."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from typing import Any

# Each subcommand registers its own parser; the engine flags they share live in the leaf
# kvserve.engine_args, so none of them imports this module back.
from kvserve import __version__
from kvserve.bench.cli import add_bench_parser
from kvserve.download import add_download_parser
from kvserve.engine_args import add_engine_args, engine_kwargs
from kvserve.entrypoint import setup_process
from kvserve.plan.cli import add_plan_parser
from kvserve.quality.cli import add_quality_parser
from kvserve.server.command import add_serve_parser
from kvserve.sim.cli import add_simulate_parser, add_tune_parser


def cmd_generate(args: argparse.Namespace) -> int:
    from kvserve import LLM, SamplingParams

    llm = LLM(**engine_kwargs(args))
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        seed=args.sample_seed,
        ignore_eos=args.ignore_eos,
        stop=args.stop,
    )
    prompts: list[Any] = args.prompt or ["The pass code for"]
    if args.chat:
        tok = llm.get_tokenizer()
        assert tok is not None
        prompts = [{"prompt_token_ids": tok.encode_chat([{"role": "user", "content": p}])}
                   for p in prompts]  # fmt: skip
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    dt = time.perf_counter() - t0
    for out in outs:
        print(out.outputs[0].text)
    s = llm.stats()
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    print(
        f"[kvserve] model {llm.engine.config.model}: {len(outs)} request(s), "
        f"{s.prompt_tokens_total} prompt + {n_out} output tokens in {dt:.2f}s "
        f"({n_out / dt:.1f} tok/s); steps {s.num_steps}; KV blocks "
        f"{s.kv_blocks_total} x {llm.engine.block_size} tokens ({llm.engine.kv_cache_dtype}); "
        f"preemptions {s.num_preemptions}; prefix hits {s.prefix_cache_hits}/"
        f"{s.prefix_cache_queries} tokens",
        file=sys.stderr,
    )
    return 0


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, Callable[..., int]]]:
    parser = argparse.ArgumentParser(prog="kvserve", description=__doc__)
    parser.add_argument("--version", action="version", version=__version__,
                        help="print kvserve's version and exit")  # fmt: skip
    sub = parser.add_subparsers(dest="command", required=True)
    handlers: dict[str, Callable[..., int]] = {}

    g = sub.add_parser("generate", help="generate text offline and print it")
    add_engine_args(g)
    g.add_argument("--prompt", action="append", help="repeat for a batch")
    g.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--sample-seed", type=int, default=None, help="per-request sampling seed")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--stop", action="append")
    handlers["generate"] = cmd_generate

    handlers["serve"] = add_serve_parser(sub)
    handlers["bench"] = add_bench_parser(sub)
    handlers["plan"] = add_plan_parser(sub)
    handlers["simulate"] = add_simulate_parser(sub)
    handlers["tune"] = add_tune_parser(sub)
    handlers["quality"] = add_quality_parser(sub)
    handlers["download"] = add_download_parser(sub)
    return parser, handlers


def main(argv: list[str] | None = None) -> int:
    parser, handlers = build_parser()
    args = parser.parse_args(argv)
    setup_process()  # every command is an entry point; `serve` adds its own settings
    from kvserve.config import ConfigError
    from kvserve.sched.request import InvalidRequestError

    try:
        return handlers[args.command](args)
    except (ConfigError, InvalidRequestError, FileNotFoundError, ValueError) as e:
        print(f"kvserve {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
