"""Engine flags, their defaults and their help: one definition that ``kvserve generate``,
``serve``, ``bench``, ``quality``, ``plan`` and ``make run`` all import.

A leaf on purpose: it imports only :mod:`kvserve.config`, the KV format and attention backend
registries and the model resolver, so every command can import it at module level without
importing the CLI that imports them.
"""

from __future__ import annotations

import argparse
from typing import Any

from kvserve.attention.registry import ATTENTION_BACKEND_CHOICES
from kvserve.config import (
    ADMISSION_POLICIES,
    DTYPES,
    OFFLOAD_WRITE_POLICIES,
    PREEMPTION_MODES,
    SCHEDULING_POLICIES,
    ConfigError,
)
from kvserve.kv.formats import KV_CACHE_DTYPES
from kvserve.model.resolve import resolve_model

MODEL_HELP = "model name (kvserve-ref, smollm2), HF directory or .gguf file (default: kvserve-ref)"


def default_model() -> str:
    """The bundled reference model's directory inside the installed package; raises
    :class:`FileNotFoundError` when the installation lacks it (never a stand-in model)."""
    return resolve_model(None)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Engine flags, named as vLLM names them."""
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None, help=MODEL_HELP)
    g.add_argument("--tokenizer", default=None)
    g.add_argument("--dtype", default="auto", choices=DTYPES)
    g.add_argument("--device", default="cpu")
    g.add_argument(
        "--attention-backend",
        default=None,
        choices=ATTENTION_BACKEND_CHOICES,
        help="how attention is computed: 'torch' (gather + SDPA, the reference, any device) "
        "or 'cpu' (kvserve's C kernels, the reference wherever one declines); 'auto' (the "
        "default) picks by device: 'cpu' on a CPU where the kernels build, else 'torch'",
    )
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--num-gpu-blocks", type=int, default=None)
    g.add_argument("--kv-cache-memory", default=None, help="e.g. 2GiB")
    g.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES)
    g.add_argument("--calculate-kv-scales", action="store_true")
    g.add_argument(
        "--kv-cache-prefault",
        action="store_true",
        help="CPU: fault the KV pool's pages in at start, as vLLM's zero-filled KV space is, "
        "so the first requests do not pay a page fault per 4 KiB of new KV (start-up takes "
        "longer and the whole pool is resident from the start)",
    )
    g.add_argument(
        "--disable-hybrid-kv-cache-manager",
        action="store_true",
        help="hybrid models (full and sliding-window layers): one block table for every "
        "layer, so blocks behind the windows are not freed (as vLLM's flag)",
    )
    g.add_argument(
        "--kv-retention",
        default=None,
        metavar="SPEC",
        help="KV retention policy, lossy, off by default: 'window:W' keeps each token's W "
        "most recent cache entries (W tokens, or 'window:50%%' of each prompt) and returns "
        "older blocks to the pool; 'sinks:4,window:508' keeps the first 4 as well "
        "(StreamingLLM); 'snapkv:512' keeps the 512 prompt tokens its last 32 queries attend "
        "to most, plus those 32; 'h2o:512' keeps the 512 entries with the most attention "
        "mass (a quarter of them the newest)",
    )
    o = p.add_argument_group(
        "KV offload tiers",
        "prefix-cache blocks evicted from the pool go down to these (each bounded, LRU) and "
        "come back as hits; entries are checksummed and keyed by the model's weights, the KV "
        "format and the tenant, so a wrong entry is a miss, never wrong output",
    )
    o.add_argument(
        "--kv-offload-cpu",
        default=None,
        metavar="SIZE",
        help="host-memory tier of this size (e.g. 8GiB)",
    )
    o.add_argument(
        "--kv-offloading-size",
        type=float,
        default=None,
        metavar="GIB",
        help="vLLM's name for --kv-offload-cpu, in GiB",
    )
    o.add_argument(
        "--kv-offload-disk",
        default=None,
        metavar="DIR",
        help="local-disk tier in this directory (entries survive a restart)",
    )
    o.add_argument("--kv-offload-disk-size", default="10GiB", metavar="SIZE")
    o.add_argument(
        "--kv-offload-redis",
        default=None,
        metavar="URL",
        help="Redis tier, redis://HOST:PORT/DB (shared by replicas on one server)",
    )
    o.add_argument(
        "--kv-offload-redis-size",
        default="1GiB",
        metavar="SIZE",
        help="bytes of entries kept in Redis, across all replicas",
    )
    o.add_argument(
        "--kv-offload-timeout",
        type=float,
        default=0.5,
        metavar="SECONDS",
        help="bound on one tier operation; a load gives up after ten",
    )
    o.add_argument(
        "--kv-offload-write-policy",
        default="write_back",
        choices=OFFLOAD_WRITE_POLICIES,
        help="when a block goes down: when the pool evicts it (default), as soon as "
        "it is computed, or once it has been hit --kv-offload-reuse-threshold times",
    )
    o.add_argument("--kv-offload-reuse-threshold", type=int, default=2, metavar="N")
    o.add_argument(
        "--preemption-mode",
        default=None,
        choices=PREEMPTION_MODES,
        help="a preempted request's blocks come back from the tiers (swap; the default with "
        "a tier) or are computed again (recompute; the only mode without a tier)",
    )
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument(
        "--scheduling-policy",
        default="fcfs",
        choices=SCHEDULING_POLICIES,
        help="fcfs; lpm: longest cached prefix first; priority: each request's priority "
        "field, lower first (vLLM's); each bounded against starvation",
    )
    a = p.add_argument_group("admission control")
    a.add_argument(
        "--admission",
        default="greedy",
        choices=ADMISSION_POLICIES,
        help="greedy: admit while a request's next chunk fits (vLLM's); projected: while its "
        "whole prompt after prefix hits plus its expected output fits beside what running "
        "requests will still grow by, and refuse (429/503) requests whose workload class's "
        "TTFT SLO cannot be met",
    )
    a.add_argument(
        "--admission-watermark",
        type=float,
        default=0.01,
        metavar="FRACTION",
        help="projected: KV blocks kept free beyond every projection",
    )
    a.add_argument(
        "--workload-classes",
        default=None,
        metavar="FILE",
        help="workload classes (YAML or JSON; 'default' for chat, rag, long-document and "
        "agent): per-class SLO, priority, output estimate and KV policy",
    )
    g.add_argument("--seed", type=int, default=0)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The parsed engine flags as :class:`kvserve.LLM` keyword arguments."""
    return dict(
        model=resolve_model(args.model) if args.model else default_model(),
        tokenizer=args.tokenizer,
        dtype=args.dtype,
        device=args.device,
        attention_backend=args.attention_backend,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        num_gpu_blocks=args.num_gpu_blocks,
        kv_cache_memory=args.kv_cache_memory,
        kv_cache_dtype=args.kv_cache_dtype,
        calculate_kv_scales=args.calculate_kv_scales,
        kv_cache_prefault=args.kv_cache_prefault,
        disable_hybrid_kv_cache_manager=args.disable_hybrid_kv_cache_manager,
        kv_retention=args.kv_retention,
        kv_offload_cpu=_offload_cpu(args),
        kv_offload_disk=args.kv_offload_disk,
        kv_offload_disk_size=args.kv_offload_disk_size,
        kv_offload_redis=args.kv_offload_redis,
        kv_offload_redis_size=args.kv_offload_redis_size,
        kv_offload_timeout=args.kv_offload_timeout,
        kv_offload_write_policy=args.kv_offload_write_policy,
        kv_offload_reuse_threshold=args.kv_offload_reuse_threshold,
        preemption_mode=args.preemption_mode,
        enable_prefix_caching=args.enable_prefix_caching,
        enable_chunked_prefill=args.enable_chunked_prefill,
        scheduling_policy=args.scheduling_policy,
        admission=args.admission,
        admission_watermark=args.admission_watermark,
        workload_classes=args.workload_classes,
        seed=args.seed,
    )


def _offload_cpu(args: argparse.Namespace) -> str | None:
    if args.kv_offloading_size is None:
        return args.kv_offload_cpu
    if args.kv_offload_cpu is not None:
        raise ConfigError(
            "kv_offloading_size: give --kv-offload-cpu or --kv-offloading-size, not both"
        )
    if args.kv_offloading_size <= 0:
        raise ConfigError(f"kv_offloading_size: must be > 0 GiB, got {args.kv_offloading_size}")
    return f"{args.kv_offloading_size}GiB"
