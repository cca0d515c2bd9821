"""Decode roofline and dollars per million tokens.

A decode step reads every weight of the replica once (for MoE, only the experts the batch
routes to) plus each sequence's whole KV, and does about 2 FLOPs per active parameter per token
plus the attention dot products. Its time is at least bytes / bandwidth and at least FLOPs /
peak; whichever is larger bounds tokens per second. Real engines reach perhaps 50-80 % of the
memory roofline, so this is the ceiling to measure against, not a forecast. ``kvserve bench``
uses :func:`usd_per_million` for measured throughput so both tools price tokens the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.plan.capacity import ArchSpec, window_fraction
from kvserve.plan.gpus import GPU


@dataclass(slots=True)
class Roofline:
    """One decode step of ``batch`` sequences at ``context`` tokens, per GPU of the replica."""

    batch: int
    context: int
    weight_bytes_read: float
    kv_bytes_read: float
    flops: float
    memory_time_s: float
    compute_time_s: float
    bound: str
    tokens_per_s: float  # whole replica
    tokens_per_s_per_gpu: float


def expected_experts_touched(num_experts: int, experts_per_token: int, batch: int) -> float:
    """Distinct experts a batch routes to per MoE layer when each token picks
    ``experts_per_token`` of ``num_experts`` uniformly: n (1 - (1 - k/n)^B)."""
    if not num_experts:
        return 0.0
    return num_experts * (1 - (1 - experts_per_token / num_experts) ** batch)


def decode_roofline(
    spec: ArchSpec,
    gpu: GPU,
    kv_bytes_per_token_per_gpu: float,
    weight_bytes: int,
    batch: int,
    context: int,
    tp: int = 1,
) -> Roofline:
    """Bytes read and FLOPs of one decode step, split over ``tp`` GPUs, against ``gpu``."""
    if batch < 1:
        raise ValueError(f"batch: must be >= 1, got {batch}")
    per_param = weight_bytes / spec.num_parameters
    weights = float(weight_bytes)
    if spec.num_experts:
        touched = expected_experts_touched(spec.num_experts, spec.experts_per_token, batch)
        unread = spec.expert_parameters * (1 - touched / spec.num_experts)
        weights -= unread * per_param
    frac = window_fraction(spec, context)
    kv = batch * context * frac * kv_bytes_per_token_per_gpu
    attn_width = spec.mla_latent_dim or spec.head_dim
    attn_flops = 4 * context * frac * spec.num_layers * spec.num_attention_heads * attn_width
    flops = batch * (2 * spec.num_active_parameters + attn_flops) / tp
    weights /= tp
    t_mem = (weights + kv) / gpu.bandwidth_bytes_per_s
    t_cmp = flops / gpu.flops_per_s
    step = max(t_mem, t_cmp)
    return Roofline(
        batch=batch,
        context=context,
        weight_bytes_read=weights,
        kv_bytes_read=kv,
        flops=flops,
        memory_time_s=t_mem,
        compute_time_s=t_cmp,
        bound="memory" if t_mem >= t_cmp else "compute",
        tokens_per_s=batch / step,
        tokens_per_s_per_gpu=batch / step / tp,
    )


@dataclass(slots=True)
class AllReduce:
    """The tensor-parallel all-reduces of one decode step, per GPU, over the link between
    ranks: two per layer of the batch's hidden states (after attention's output projection
    and after the MLP's down projection), in the activations' dtype, each a ring that sends
    (and receives) ``2 (tp - 1) / tp`` of the volume from every GPU."""

    tp: int
    link: str
    link_bandwidth_bytes_per_s: float
    bytes_per_step_per_gpu: float
    time_per_step_s: float
    share_of_step: float  # of the roofline step time plus the all-reduces


def decode_allreduce(
    spec: ArchSpec, batch: int, tp: int, link: str, bandwidth: float, step_s: float
) -> AllReduce:
    """:class:`AllReduce` for ``batch`` decode tokens on ``tp`` GPUs joined by ``link`` at
    ``bandwidth`` bytes/s one way, beside a step of ``step_s`` seconds."""
    if bandwidth <= 0:
        raise ValueError(f"link bandwidth: must be > 0 bytes/s, got {bandwidth}")
    act = 4 if spec.torch_dtype == "float32" else 2  # activations: the compute dtype
    volume = 2 * spec.num_layers * batch * spec.hidden_size * act
    per_gpu = volume * 2 * (tp - 1) / tp
    t = per_gpu / bandwidth
    share = t / (t + step_s) if t + step_s > 0 else 0.0
    return AllReduce(tp, link, bandwidth, per_gpu, t, share)


def usd_per_million(tokens_per_s: float, gpu_hour_cost: float, gpus: int = 1) -> float | None:
    """Dollars per million tokens at a sustained rate on ``gpus`` accelerators billed at
    ``gpu_hour_cost`` each per hour; None when nothing was produced (infinitely expensive)."""
    if tokens_per_s <= 0:
        return None
    return gpu_hour_cost * gpus / 3600.0 / tokens_per_s * 1e6
