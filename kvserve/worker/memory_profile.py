"""The profiling forward that sizes a GPU's KV pool (vLLM's ``determine_available_memory``).

After the weights load, the worker runs the step's two largest shapes at
``max_num_batched_tokens`` prompt tokens (:func:`profile_batches`) on a pool just large
enough for them, reads the allocator's peak and the memory outside torch, and gives the KV
pool what is left under ``gpu_memory_utilization``
(:class:`kvserve.kv.gpu_budget.GpuMemoryBudget`, the arithmetic ``kvserve plan`` uses).
The sampler's own tensors are not profiled (they are [max_num_seqs, vocab] at most, as the
logits are, which are).

:func:`profile_forward` is device-neutral (CI runs it on a CPU); only
:func:`measure_gpu_budget` reads CUDA's counters.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvserve.config import EngineConfig, ModelConfig
from kvserve.kv.formats import kv_bytes_per_token, kv_fixed_bytes
from kvserve.kv.gpu_budget import GpuMemoryBudget
from kvserve.sched.output import ScheduledSeq


def profile_batches(num_tokens: int, max_num_seqs: int, max_model_len: int,
                    block_size: int) -> tuple[list[list[ScheduledSeq]], int]:  # fmt: skip
    """The step's two largest shapes at ``num_tokens`` tokens, each on consecutive blocks
    from 0, and the most blocks either uses: the longest prefill chunks ``max_model_len``
    allows (attention's peak; one chunk when the length allows it) and vLLM's dummy batch of
    ``min(max_num_seqs, num_tokens)`` sequences, each taking a logits row (the logits'
    peak)."""
    long_seqs = -(-num_tokens // max_model_len)
    shapes = [long_seqs, max(long_seqs, min(max_num_seqs, num_tokens))]
    batches, most = [], 0
    for n_seqs in dict.fromkeys(shapes):
        base, extra = divmod(num_tokens, n_seqs)
        seqs, next_block = [], 0
        for i in range(n_seqs):
            n = base + (i < extra)
            blocks = list(range(next_block, next_block + -(-n // block_size)))
            next_block += len(blocks)
            rid = f"profile-{i}"
            seqs.append(ScheduledSeq(rid, [0] * n, 0, 0, blocks, (rid,)))
        batches.append(seqs)
        most = max(most, next_block)
    return batches, most


def profile_forward(runner, seqs: list[ScheduledSeq]) -> None:  # noqa: ANN001 - a ModelRunner
    """One forward of ``seqs`` through the runner's model and its logits rows, with no
    sampling state touched: the step's activation peak."""
    with torch.inference_mode():
        items = runner._order(seqs)
        input_ids, positions, meta = runner._prepare(items)
        runner.storage.begin_step(meta.slot_mapping_host)
        rows = []
        t = 0
        for s in items:
            t += s.num_tokens
            rows.append(t - 1)
        keep = torch.tensor(rows, dtype=torch.long, device=runner.device)
        hidden = runner.model(input_ids, positions, runner.storage, meta, keep)
        runner.model.logits(hidden)


def measure_gpu_budget(
    device: torch.device,
    utilization: float,
    block_bytes: float,
    fixed_bytes: float,
    run_profile: Callable[[], int],
) -> GpuMemoryBudget:
    """CUDA only. ``run_profile`` runs the profiling forward and returns the bytes of the
    temporary pool it used (not counted as activations). Weights are what the allocator holds
    before it; the activation peak is the allocator's peak during it above that; non-torch
    memory is what the device reports in use beyond torch's reserved bytes."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    weights = torch.cuda.memory_allocated(device)
    pool = run_profile()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    non_torch = max(0, (total - free) - torch.cuda.memory_reserved(device))
    return GpuMemoryBudget(
        total_bytes=total,
        gpu_memory_utilization=utilization,
        weight_bytes=weights,
        activation_peak_bytes=max(0, peak - weights - pool),
        non_torch_bytes=non_torch,
        block_bytes=block_bytes,
        fixed_bytes=fixed_bytes,
    )


def size_gpu_pool(
    runner,  # noqa: ANN001 - a ModelRunner without a storage yet
    make_storage: Callable[[int], object],
    config: EngineConfig,
    mc: ModelConfig,
    kv_name: str,
    dtype: torch.dtype,
    max_model_len: int,
) -> GpuMemoryBudget:
    """The profiling forward on a pool just large enough for it, then the budget; the
    temporary pool is dropped before the real one is built."""
    cc, sc = config.cache, config.scheduler
    batches, used = profile_batches(sc.max_num_batched_tokens, sc.max_num_seqs,
                                    max_model_len, cc.block_size)  # fmt: skip

    def run() -> int:
        runner.set_storage(make_storage(used))
        pool = runner.storage.nbytes()
        for seqs in batches:
            profile_forward(runner, seqs)
        runner.storage = None
        return pool

    model_dtype = str(dtype).removeprefix("torch.")
    bpt = kv_bytes_per_token(kv_name, mc.num_hidden_layers, mc.num_key_value_heads,
                             mc.head_dim, model_dtype, cc.block_size)  # fmt: skip
    fixed = kv_fixed_bytes(kv_name, mc.num_hidden_layers, mc.num_key_value_heads, mc.head_dim,
                           dtype, cc.block_size, sc.max_num_seqs)  # fmt: skip
    return measure_gpu_budget(runner.device, cc.gpu_memory_utilization, bpt * cc.block_size,
                              fixed, run)  # fmt: skip
