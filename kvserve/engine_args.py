"""Engine flags, their defaults and their help: one definition that ``kvserve generate``,
``serve``, ``bench``, ``quality``, ``plan`` and ``make run`` all import.

A leaf on purpose: it imports only :mod:`kvserve.config` (and, when no model is given, the
synthetic checkpoint writer), so every command can import it at module level without
importing the CLI that imports them.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from kvserve.config import DTYPES, SCHEDULING_POLICIES
from kvserve.kv.formats import KV_CACHE_DTYPES

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
    """The parsed engine flags as :class:`kvserve.LLM` keyword arguments."""
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
