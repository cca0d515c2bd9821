"""``kvserve`` command line: generate (and, as they land, serve, bench, quality, plan)."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvserve.config import DTYPES, KV_CACHE_DTYPES, SCHEDULING_POLICIES

REPO_ROOT = Path(__file__).resolve().parent.parent
BUNDLED_MODEL = REPO_ROOT / "models" / "kvserve-ref"
GENERATED_MODEL = REPO_ROOT / ".cache" / "default-model"


def default_model() -> str:
    """The bundled reference model, or (until it exists) a small random checkpoint generated
    deterministically on first use into a git-ignored cache."""
    if (BUNDLED_MODEL / "config.json").exists():
        return str(BUNDLED_MODEL)
    if not (GENERATED_MODEL / "model.safetensors").exists():
        from kvserve.model.synthetic import make_random_checkpoint

        make_random_checkpoint(
            GENERATED_MODEL, vocab_size=260, hidden_size=128, intermediate_size=384,
            num_layers=4, num_heads=4, num_kv_heads=2, seed=0,
        )  # fmt: skip
    return str(GENERATED_MODEL)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Engine flags, named as vLLM names them."""
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None, help="HF model directory (default: bundled model)")
    g.add_argument("--tokenizer", default=None)
    g.add_argument("--dtype", default="auto", choices=DTYPES)
    g.add_argument("--device", default="cpu")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--num-gpu-blocks", type=int, default=None)
    g.add_argument("--kv-cache-memory", default=None, help="e.g. 2GiB")
    g.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES)
    g.add_argument("--calculate-kv-scales", action="store_true")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--scheduling-policy", default="fcfs", choices=SCHEDULING_POLICIES)
    g.add_argument("--seed", type=int, default=0)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return dict(
        model=args.model or default_model(),
        tokenizer=args.tokenizer,
        dtype=args.dtype,
        device=args.device,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        num_gpu_blocks=args.num_gpu_blocks,
        kv_cache_memory=args.kv_cache_memory,
        kv_cache_dtype=args.kv_cache_dtype,
        calculate_kv_scales=args.calculate_kv_scales,
        enable_prefix_caching=args.enable_prefix_caching,
        enable_chunked_prefill=args.enable_chunked_prefill,
        scheduling_policy=args.scheduling_policy,
        seed=args.seed,
    )


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
        f"[kvserve] {len(outs)} request(s), {s.prompt_tokens_total} prompt + {n_out} output "
        f"tokens in {dt:.2f}s ({n_out / dt:.1f} tok/s); steps {s.num_steps}; KV blocks "
        f"{s.kv_blocks_total} x {llm.engine.block_size} tokens ({llm.engine.kv_cache_dtype}); "
        f"preemptions {s.num_preemptions}; prefix hits {s.prefix_cache_hits}/"
        f"{s.prefix_cache_queries} tokens",
        file=sys.stderr,
    )
    return 0


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, Callable[..., int]]]:
    parser = argparse.ArgumentParser(prog="kvserve", description=__doc__)
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

    from kvserve.server.args import build_serve_parser, cmd_serve

    build_serve_parser(sub)
    handlers["serve"] = cmd_serve

    from kvserve.bench.cli import add_bench_parser
    from kvserve.plan.cli import add_plan_parser

    handlers["bench"] = add_bench_parser(sub)
    handlers["plan"] = add_plan_parser(sub)

    from kvserve.quality.cli import add_quality_parser

    handlers["quality"] = add_quality_parser(sub)
    return parser, handlers


def main(argv: list[str] | None = None) -> int:
    parser, handlers = build_parser()
    args = parser.parse_args(argv)
    from kvserve.config import ConfigError
    from kvserve.request import InvalidRequestError

    try:
        return handlers[args.command](args)
    except (ConfigError, InvalidRequestError, FileNotFoundError, ValueError) as e:
        print(f"kvserve {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
