"""``kvserve`` command line: generate, serve, router, proxy, bench, plan, simulate, tune,
quality and download."""

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
from kvserve.disagg.proxy_cli import add_proxy_parser
from kvserve.download import add_download_parser
from kvserve.engine_args import (
    add_engine_args,
    add_model_arg,
    engine_kwargs,
    model_arg,
    token_count,
)
from kvserve.entrypoint import setup_process
from kvserve.plan.cli import add_plan_parser
from kvserve.quality.cli import add_quality_parser
from kvserve.router.command import add_router_parser
from kvserve.server.command import add_serve_parser
from kvserve.sim.cli import add_simulate_parser
from kvserve.sim.tune_cli import add_tune_parser
from kvserve.vllm_args import vllm_flag


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
    add_model_arg(g)
    add_engine_args(g)
    s = g.add_argument_group("sampling")
    s.add_argument("--prompt", action="append", help="a prompt (repeat for a batch; default: "
                   "'The pass code for')")  # fmt: skip
    s.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    s.add_argument("--max-tokens", type=token_count, default=64,
                   help="output tokens per prompt at most")  # fmt: skip
    s.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    s.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling's mass")
    s.add_argument("--top-k", type=int, default=-1, help="sample among the k likeliest "
                   "tokens (-1: all)")  # fmt: skip
    s.add_argument("--sample-seed", type=int, default=None, help="per-request sampling seed")
    s.add_argument("--ignore-eos", action="store_true", help="generate past the end token")
    s.add_argument("--stop", action="append", help="a string that ends the output (repeatable)")
    handlers["generate"] = cmd_generate

    handlers["serve"] = add_serve_parser(sub)
    handlers["router"] = add_router_parser(sub)
    handlers["proxy"] = add_proxy_parser(sub)
    handlers["bench"] = add_bench_parser(sub)
    handlers["plan"] = add_plan_parser(sub)
    handlers["simulate"] = add_simulate_parser(sub)
    handlers["tune"] = add_tune_parser(sub)
    handlers["quality"] = add_quality_parser(sub)
    handlers["download"] = add_download_parser(sub)
    show_defaults(parser)
    return parser, handlers


def show_defaults(parser: argparse.ArgumentParser) -> None:
    """End the help of every argument of ``parser`` and of its subcommands that has a
    default with ``(default: X)``, as the engine flags' does, so ``--help`` shows every
    default (argparse's ``ArgumentDefaultsHelpFormatter`` would print ``None`` too)."""
    for action in parser._actions:  # argparse offers no public listing of its arguments
        if isinstance(action, argparse._SubParsersAction):
            for p in action.choices.values():
                show_defaults(p)
            continue
        if isinstance(action, argparse._HelpAction) or action.help in (None, argparse.SUPPRESS):
            continue
        if action.default not in (None, argparse.SUPPRESS) and "%(default)" not in action.help:
            action.help += " (default: %(default)s)"


def subcommand_parser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices.get(name, parser)


def refuse_unknown(parser: argparse.ArgumentParser, command: str | None, extra: list[str]) -> None:
    """Exit as argparse does for arguments no parser took, naming for a vLLM flag kvserve
    lacks what to use instead (:mod:`kvserve.vllm_args`)."""
    p = subcommand_parser(parser, command) if command else parser
    for word in extra:
        known = vllm_flag(word) if word.startswith("-") else None
        if known is not None:  # the answer is the message: no usage before it
            p.exit(2, f"{p.prog}: error: {known.flag_message()}\n")
    p.error(f"unrecognized arguments: {' '.join(extra)}")


def main(argv: list[str] | None = None) -> int:
    parser, handlers = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        refuse_unknown(parser, getattr(args, "command", None), extra)
    setup_process()  # every command is an entry point; `serve` adds its own settings
    from kvserve.config import ConfigError
    from kvserve.sched.request import InvalidRequestError

    try:
        if hasattr(args, "model_tag"):  # the model given positionally or as --model, as one
            args.model, args.model_tag = model_arg(args), None
        return handlers[args.command](args)
    except (ConfigError, InvalidRequestError, FileNotFoundError, ValueError) as e:
        print(f"kvserve {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
