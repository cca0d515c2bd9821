"""``kvserve plan``: what a model's KV cache costs on an accelerator, and ``--validate`` that
the prediction is what the engine really allocates.

Only the validation (:mod:`kvserve.plan.validate`) imports the engine; the plan itself needs
torch just for the accounting function's dtype sizes, so it starts in about a second and needs
no weights.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvserve.config import DTYPES, EngineConfig
from kvserve.config_fields import default_of
from kvserve.engine_args import (
    add_model_arg,
    add_setting_flags,
    byte_size,
    model_arg,
    token_count,
)
from kvserve.model.resolve import resolve_model
from kvserve.plan.capacity import (
    ArchSpec,
    PlanError,
    capacity,
    format_table,
    load_arch,
)
from kvserve.plan.cost import decode_allreduce, decode_roofline, usd_per_million
from kvserve.plan.gpus import GPUS, get_gpu, link_between_ranks
from kvserve.plan.validate import validate, validate_windows


def human_bytes(n: float) -> str:
    """Binary units, as memory is sold and as the seed quotes it (4 GiB, 32 GiB)."""
    for unit, scale in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= scale:
            return f"{n / scale:.4g} {unit}"
    return f"{n:.4g} B"


def plan_model(model: str | None) -> str:
    """A bare ``config.json`` (or any non-GGUF file) is planned as it is; everything else is
    a model name or a model directory, resolved as every ``--model`` is."""
    if model is not None and Path(model).is_file() and Path(model).suffix.lower() != ".gguf":
        return model
    return resolve_model(model)


def add_plan_parser(sub: Any) -> Callable[[argparse.Namespace], int]:
    """Register ``plan`` on the CLI's subparsers; returns its handler."""
    p = sub.add_parser(
        "plan",
        help="KV bytes, capacity, concurrency ceiling, roofline and cost for a config.json",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_arg(
        p,
        flag_help="model name (kvserve-ref, smollm2), HF directory, config.json or .gguf file "
        "(default: kvserve-ref)",
    )
    p.add_argument(
        "--gpu",
        default="h100-sxm",
        help=f"one of {', '.join(GPUS)}, or custom:MEM_GIB:BW_TBS:BF16_TFLOPS",
    )
    p.add_argument("--list-gpus", action="store_true", help="print the GPU table with sources")
    p.add_argument("--tensor-parallel-size", "-tp", "--tp", dest="tp", type=int, default=1,
                   help="tensor-parallel GPUs per replica (vLLM's flag)")  # fmt: skip
    p.add_argument(
        "--link-bandwidth",
        type=float,
        default=None,
        metavar="GB/S",
        help="one-direction GB/s between the ranks, measured (default: the part's NVLink, "
        "else PCIe x16)",
    )
    add_setting_flags(p, ["kv_cache_dtype"])
    p.add_argument(
        "--dtype",
        default=default_of(EngineConfig, "dtype"),
        choices=DTYPES,
        help="weight dtype (auto: as stored / as the config says)",
    )
    p.add_argument(
        "--context",
        type=token_count,
        default=None,
        help="tokens per sequence; 32k = 32,000 and 32K = 32,768, as vLLM's --max-model-len "
        "(default: max_position_embeddings)",
    )
    p.add_argument(
        "--batch",
        type=int,
        default=None,
        help="concurrent sequences (default: the concurrency ceiling)",
    )
    add_setting_flags(p, ["block_size", "gpu_memory_utilization"])
    p.add_argument("--gpu-hour-cost", type=float, default=None, help="$ per GPU-hour")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "--validate",
        action="store_true",
        help="check predicted blocks against the live engine for every format",
    )
    p.add_argument(
        "--validate-memory",
        type=byte_size,
        default="64MiB",
        metavar="SIZE",
        help="KV budget the validation engines get",
    )
    p.add_argument(
        "--device", default=default_of(EngineConfig, "device"), help="device for --validate"
    )
    return cmd_plan  # fmt: skip


def plan(
    spec: ArchSpec,
    gpu_name: str = "h100-sxm",
    tp: int = 1,
    kv_cache_dtype: str = default_of(EngineConfig, "kv_cache_dtype"),
    context: int | None = None,
    batch: int | None = None,
    block_size: int = default_of(EngineConfig, "block_size"),
    gpu_memory_utilization: float = 0.9,
    gpu_hour_cost: float | None = None,
    weight_dtype: str | None = None,
    link_bandwidth: float | None = None,
) -> dict[str, Any]:
    """Every figure ``kvserve plan`` prints, as one JSON-ready dict."""
    gpu = get_gpu(gpu_name)
    context = context or spec.max_position_embeddings
    kv_fmt = spec.kv_dtype_auto if kv_cache_dtype == "auto" else kv_cache_dtype
    wdt = None if weight_dtype in (None, "auto") else weight_dtype

    def cap(fmt: str, b: int) -> Any:
        return capacity(
            spec, fmt, gpu.memory_bytes, context, b, tp, gpu_memory_utilization, block_size, wdt
        )

    try:
        main = cap(kv_fmt, batch or 1)
    except NotImplementedError as e:
        raise PlanError(str(e)) from None
    warnings: list[str] = []
    if main.kv_budget_bytes_per_gpu <= 0:
        warnings.append(
            f"weights ({human_bytes(main.weight_bytes_per_gpu)} per GPU) leave no KV room in "
            f"{gpu_memory_utilization:.0%} of {gpu.memory_gib:g} GiB; raise --tp"
        )
    if batch is None:
        batch = max(1, main.max_concurrent_sequences)
        main = cap(kv_fmt, batch)
    elif batch > main.max_concurrent_sequences:
        warnings.append(
            f"batch {batch} at {context} tokens does not fit: the ceiling is "
            f"{main.max_concurrent_sequences} sequences"
        )
    roof = decode_roofline(
        spec, gpu, main.kv_bytes_per_token_per_gpu, main.weight_bytes, batch, context, tp
    )
    roof1 = decode_roofline(
        spec, gpu, main.kv_bytes_per_token_per_gpu, main.weight_bytes, 1, context, tp
    )
    link, link_bw = link_between_ranks(gpu.key)
    if link_bandwidth is not None:
        link, link_bw = "given", link_bandwidth * 1e9
    step_s = batch / roof.tokens_per_s
    allreduce = decode_allreduce(spec, batch, tp, link, link_bw, step_s)
    ok, missing = format_table(spec, tp)
    formats = {}
    for fmt in ok:
        c = cap(fmt, batch)
        formats[fmt] = {
            "kv_bytes_per_token": c.kv_bytes_per_token,
            "kv_bytes_per_sequence": c.kv_bytes_per_sequence,
            "kv_capacity_tokens": c.kv_capacity_tokens,
            "max_concurrent_sequences": c.max_concurrent_sequences,
        }
    windows = sorted({w for w in spec.layer_windows if w})
    out: dict[str, Any] = {
        "architecture": spec.architecture,
        "num_layers": spec.num_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_kv_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "mla_latent_dim": spec.mla_latent_dim,
        "sliding_window_layers": sum(1 for w in spec.layer_windows if w),
        "sliding_windows": windows,
        "num_parameters": spec.num_parameters,
        "num_active_parameters": spec.num_active_parameters,
        "gpu": asdict(gpu),
        "tp": tp,
        "kv_cache_dtype": kv_fmt,
        "context": context,
        "batch": batch,
        "block_size": block_size,
        "gpu_memory_utilization": gpu_memory_utilization,
        **asdict(main),
        "formats": formats,
        "formats_not_implemented": missing,
        "roofline": asdict(roof),
        "roofline_batch_1": asdict(roof1),
        "allreduce": asdict(allreduce),
        "gpu_hour_cost": gpu_hour_cost,
        "usd_per_million_tokens": None,
        "usd_per_million_tokens_batch_1": None,
        "warnings": warnings,
    }
    if gpu_hour_cost is not None:
        out["usd_per_million_tokens"] = usd_per_million(roof.tokens_per_s, gpu_hour_cost, tp)
        out["usd_per_million_tokens_batch_1"] = usd_per_million(
            roof1.tokens_per_s, gpu_hour_cost, tp
        )
    return out


def print_plan(p: dict[str, Any], model: str, file: Any = sys.stdout) -> None:
    """The plan as a short human report: the formula's inputs, then what follows from them."""
    g = p["gpu"]
    w = (
        f", {p['sliding_window_layers']} sliding-window layers {p['sliding_windows']}"
        if p["sliding_window_layers"]
        else ""
    )
    kv = f"MLA latent {p['mla_latent_dim']}" if p["mla_latent_dim"] else (
        f"{p['num_kv_heads']} KV heads x head dim {p['head_dim']}"
    )  # fmt: skip
    lines = [
        f"model      {model}: {p['architecture']}, {p['num_layers']} layers, {kv}{w}",
        f"           {p['num_parameters'] / 1e9:.3g} B parameters "
        f"({p['num_active_parameters'] / 1e9:.3g} B active), weights "
        f"{human_bytes(p['weight_bytes'])}",
        f"gpu        {g['name']} x tp {p['tp']}: {g['memory_gib']:g} GiB, "
        f"{g['bandwidth_tbs']:g} TB/s, {g['bf16_tflops']:g} BF16 TFLOPS  [{g['source']}]",
        f"kv format  {p['kv_cache_dtype']}: {human_bytes(p['kv_bytes_per_token'])} per token "
        f"({human_bytes(p['kv_bytes_per_token_per_gpu'])} per GPU)",
        f"sequence   {p['context']:,} tokens: {human_bytes(p['kv_bytes_per_sequence'])}"
        + (
            f" ({human_bytes(p['kv_bytes_per_sequence_window_aware'])} held: sliding layers "
            "keep only their window)"
            if p["sliding_window_layers"]
            else ""
        ),
        f"batch      {p['batch']} sequences: {human_bytes(p['kv_bytes_total'])} of KV",
        f"capacity   {human_bytes(p['kv_budget_bytes_per_gpu'])} KV budget per GPU = "
        f"{p['num_blocks']:,} blocks x {p['block_size']} = {p['kv_capacity_tokens']:,} tokens; "
        f"max concurrent sequences at {p['context']:,} tokens: {p['max_concurrent_sequences']:,}",
    ]
    for label, key, cost_key in (
        ("roofline", "roofline", "usd_per_million_tokens"),
        ("batch 1", "roofline_batch_1", "usd_per_million_tokens_batch_1"),
    ):
        r = p[key]
        cost = f", ${p[cost_key]:.4g} per million tokens" if p[cost_key] is not None else ""
        lines.append(
            f"{label:<10} batch {r['batch']}: {r['tokens_per_s']:,.0f} decode tokens/s "
            f"({r['bound']}-bound; step reads {human_bytes(r['weight_bytes_read'])} weights + "
            f"{human_bytes(r['kv_bytes_read'])} KV per GPU){cost}"
        )
    a = p["allreduce"]
    if a["tp"] > 1:
        lines.append(
            f"all-reduce tp {a['tp']} over {a['link']} at "
            f"{a['link_bandwidth_bytes_per_s'] / 1e9:g} GB/s: "
            f"{human_bytes(a['bytes_per_step_per_gpu'])} per GPU per decode step, "
            f"{a['time_per_step_s'] * 1e6:,.1f} us ({a['share_of_step']:.1%} of the step)"
        )
    lines.append("formats    per token / per sequence / max concurrent sequences:")
    for fmt, f in p["formats"].items():
        lines.append(
            f"  {fmt:<10} {human_bytes(f['kv_bytes_per_token']):>10} "
            f"{human_bytes(f['kv_bytes_per_sequence']):>10} {f['max_concurrent_sequences']:>8,}"
        )
    if p["formats_not_implemented"]:
        lines.append(f"  not implemented yet: {', '.join(p['formats_not_implemented'])}")
    lines += [f"warning    {m}" for m in p["warnings"]]
    print("\n".join(lines), file=file)


def cmd_plan(args: argparse.Namespace) -> int:
    if args.list_gpus:
        for g in GPUS.values():
            print(
                f"{g.key:<10} {g.name:<28} {g.memory_gib:>4g} GiB {g.bandwidth_tbs:>5g} TB/s "
                f"{g.bf16_tflops:>7g} TFLOPS  {g.source}"
            )
        return 0
    args.model = plan_model(model_arg(args))
    spec = load_arch(args.model)
    p = plan(
        spec,
        gpu_name=args.gpu,
        tp=args.tp,
        kv_cache_dtype=args.kv_cache_dtype,
        context=args.context,
        batch=args.batch,
        block_size=args.block_size,
        gpu_memory_utilization=args.gpu_memory_utilization,
        gpu_hour_cost=args.gpu_hour_cost,
        weight_dtype=args.dtype,
        link_bandwidth=args.link_bandwidth,
    )
    p["model"] = str(args.model)
    status = 0
    if args.validate:
        model_dir = Path(args.model)
        if not model_dir.is_dir() or not list(model_dir.glob("*.safetensors")):
            raise PlanError("validate: needs a model directory with weights, not a config.json")
        rows = validate(
            str(model_dir),
            args.validate_memory,
            args.block_size,
            args.dtype,
            args.device,
        )
        p["validation"] = [asdict(r) for r in rows]
        status = 0 if rows and all(r.ok for r in rows) else 1
        win = validate_windows(str(model_dir), args.block_size, args.dtype, args.device)
        p["validation_windows"] = asdict(win) if win is not None else None
        if win is not None and not win.ok:
            status = 1
    if args.json:
        print(json.dumps(p))
        return status
    print_plan(p, str(args.model))
    if args.validate:
        print(
            f"validate   {human_bytes(args.validate_memory)} of KV on {args.device}, predicted "
            "vs engine:"
        )
        for r in p["validation"]:
            mark = "ok  " if r["ok"] else "FAIL"
            print(
                f"  {mark} {r['kv_cache_dtype']:<10} blocks {r['predicted_blocks']} vs "
                f"{r['engine_blocks']}; bytes {r['predicted_bytes']:.0f} vs {r['engine_bytes']}"
                + (
                    f"; dense closed form {r['closed_form_bytes']}"
                    if r["closed_form_bytes"] is not None
                    else ""
                )
                + (f"  ({r['reason']})" if r["reason"] else "")
            )
        w = p["validation_windows"]
        if w is not None:
            print(
                f"  {'ok  ' if w['ok'] else 'FAIL'} one sequence of {w['context']} tokens, "
                f"window-aware bytes {w['predicted_bytes']:.0f} predicted vs "
                f"{w['engine_bytes']} held by the engine (block rounding allows "
                f"{w['slack_bytes']:.0f} more)"
            )
    return status
