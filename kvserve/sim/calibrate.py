"""``kvserve simulate --calibrate``: the cost model's factors from the real engine's steps.

The real engine (weights, kernels, tokenizer: what ``kvserve serve`` runs) runs a workload
under ``kvserve bench``'s in-process target, exactly as a measured run does (its thread, the
load generator beside it); every ``LLMEngine.step()`` is timed whole (scheduling, the forward
pass, sampling, output processing, and the serving loop's own time before the next step of a
busy engine) beside the features of the batch it ran, and every ``add_request`` beside its
prompt length. The device's peaks are
measured first (a representative GEMM in the compute dtype; a streaming read), so the fitted
factors are efficiencies against this machine's own ceilings, the same fields a CUDA run fills.

Before the workload, a few prompts of random tokens are prefilled alone (a quarter, half and
all of the step's token budget, one step each). A workload's large steps mix many sequences'
chunks with decodes, so their GEMM cost and their per-sequence costs grow together and the
fit cannot tell them apart; it put the difference on the GEMMs and over-predicted a long
prompt prefilled alone (``benchmarks/simulator.py`` compares the two). The solo steps pin the
large-step GEMM cost on its own. Each is followed by two chunks that continue it after its
cached blocks (prefix caching on): attention over cached context, which runs at a rate of
its own and which the workload's steps mix with everything else. Then a few decode probes
(:func:`decode_probes`) set the KV reads apart from the per-sequence costs.
"""

from __future__ import annotations

import asyncio
import math
import tempfile
import time
from dataclasses import replace
from typing import Any, NamedTuple

import numpy as np
import torch

from kvserve.bench.engine_target import EngineTarget
from kvserve.bench.runner import LoadSpec, benchmark
from kvserve.bench.workloads import BenchRequest
from kvserve.engine.offload import compute_takes_every_core
from kvserve.entrypoint import onednn_cache_entries
from kvserve.kv.offload import KVOffload
from kvserve.kv.storage import KVStorage
from kvserve.kv.tier_entry import encode_entry
from kvserve.kv.tiers import DiskTier, HostTier, Tier
from kvserve.model.linear_ops import GEMM_NAMES
from kvserve.plan.capacity import load_arch, load_config
from kvserve.sched.request import SamplingParams
from kvserve.sim.cost import (
    FitReport,
    ModelShape,
    Profile,
    ShapeCache,
    StepFeatures,
    fit_profile,
)
from kvserve.sim.cost import step_features as features_of
from kvserve.worker.bandwidth import device_name, measure_peak_bandwidth


def measure_gemm_peak(dtype: torch.dtype, hidden: int, device: str = "cpu") -> float:
    """FLOP/s of a representative GEMM (2,048 tokens x hidden -> 3 x hidden), best of five."""
    a = torch.randn(2048, hidden, dtype=dtype, device=device)
    w = torch.randn(3 * hidden, hidden, dtype=dtype, device=device)
    torch.nn.functional.linear(a, w)
    best = float("inf")
    for _ in range(5):
        if a.is_cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        torch.nn.functional.linear(a, w)
        if a.is_cuda:
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return 2 * 2048 * hidden * 3 * hidden / best


def measure_first_touch(nbytes: int = 64 << 20, rounds: int = 3) -> float:
    """Seconds per byte that a first write into fresh pool memory costs over a second write
    (the pool is calloc'd: its pages are faulted in on first write), the median over
    ``rounds`` fresh buffers of ``nbytes``; 0 where it costs nothing measurable."""
    from kvserve.kv.storage import zeros

    extra = []
    for _ in range(rounds):
        buf = zeros((nbytes,), torch.uint8, torch.device("cpu"))
        t0 = time.perf_counter()
        buf.fill_(1)
        t1 = time.perf_counter()
        buf.fill_(2)
        t2 = time.perf_counter()
        extra.append((t1 - t0) - (t2 - t1))
        del buf
    return max(float(np.median(extra)), 0.0) / nbytes


class TierPath(NamedTuple):
    """The tier path as :func:`measure_tier_path` timed it."""

    bandwidth: dict[str, float]  # tier name -> bytes/s of a load into the pool
    latency: dict[str, float]  # tier name -> seconds per load
    export_s_per_byte: float  # the step's copy of evicted blocks out of the pool
    # The offload worker's own seconds per block: encoding one and putting it in host memory,
    # and checking and decoding one and joining it for the import
    store_s_per_block: float
    load_s_per_block: float


def _ops_facts(worker: Any) -> tuple[int, torch.dtype, dict[str, int]]:
    """Of the worker's linear backend: the rows from which it runs its large-step GEMM, that
    GEMM's dtype, and the GEMMs it builds per-shape state for."""
    ops = worker.model.ops
    return ops.large_step_rows, ops.large_step_dtype, ops.shape_state_rows


def _tier_path(worker: Any, bytes_per_block: float) -> TierPath:
    """:func:`measure_tier_path` on a worker's own pool."""
    return measure_tier_path(worker.storage, bytes_per_block)


def measure_tier_path(
    storage: KVStorage,
    bytes_per_block: float,
    blocks: int = 16,
    rounds: int = 9,
    spread_bytes: int = 64 << 20,
) -> TierPath:
    """The tier path on this machine, in the engine's own KV format, as the engine takes it:
    per tier (a host tier; a disk tier in a temporary directory, so the page cache's speed, not
    the drive's), ``KVOffload.start_load`` until its result is polled, then the runner's
    import into the pool; timed for one block and for ``blocks``, the median of ``rounds``,
    for a latency per load and a bandwidth. Also the step's export (seconds per byte), and the
    worker's own share of a store and of a load per block (the host tier's). Writes the
    pool's first blocks back with their own bytes: nothing changes in the pool.

    A load in a run reads entries stored long before, right after a step left the compute
    threads spinning; a best-of-n of the same blocks, hot in cache from their store, ran well
    under the real loads' time. So the entries are spread over ``spread_bytes`` (more than a
    last-level cache), each load reads blocks stored long before it, and a small parallel GEMM
    precedes it."""
    n = min(blocks, storage.num_blocks)
    ids = list(range(n))
    exports = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        payload = storage.export_blocks(ids)
        exports.append(time.perf_counter() - t0)
    keys = [i.to_bytes(8, "little") for i in ids]
    store = float("inf")
    host = HostTier(1 << 40)
    for _ in range(rounds):  # as the worker stores: one entry per block
        for k in keys:
            host.delete(k)
        t0 = time.perf_counter()
        datas = [encode_entry(k, payload.select([i])) for i, k in enumerate(keys)]
        for k, d in zip(keys, datas, strict=True):
            host.put(k, d)
        store = min(store, time.perf_counter() - t0)
    host.close()
    # Groups of n entries, each load reading a group no load read before, the first ones
    # stored before the rest of the spread
    real_bytes = sum(t.nbytes for t in payload.tensors.values())
    groups = max(2 * rounds, math.ceil(spread_bytes / max(real_bytes, 1)))
    hashes = [[(g * n + i).to_bytes(16, "little") for i in ids] for g in range(groups)]
    a = torch.randn(256, 256)
    bandwidth, latency = {}, {}
    decode = float("inf")
    inline = compute_takes_every_core(str(storage.device))
    with tempfile.TemporaryDirectory(prefix="kvserve-calibrate-") as tmp:
        tiers: list[Tier] = [HostTier(1 << 40), DiskTier(tmp, 2 * groups * len(datas[0]) * n)]
        for tier in tiers:
            offload = KVOffload([tier], b"calibrate", storage.identity(),
                                pin_memory=storage.host_copies.pins,
                                inline_host_loads=inline)  # fmt: skip
            try:
                for hs in hashes:  # one group at a time: no store backlog to drop
                    offload.store(hs, payload)
                    if not offload.flush(60.0):
                        raise RuntimeError(f"calibration: the {tier.name} tier stores stalled")
                times: dict[int, list[float]] = {1: [], n: []}
                fetched: list[float] = []
                for r in range(rounds):
                    for m, hs in ((1, hashes[2 * r]), (n, hashes[2 * r + 1])):
                        torch.mm(a, a)  # the compute threads as a step leaves them
                        t0 = time.perf_counter()
                        offload.start_load("calibrate", hs[:m])
                        got = None
                        while got is None:
                            got = offload.poll_loads(wait=True).get("calibrate")
                        t1 = time.perf_counter()
                        at = 0
                        for p in got.payloads:
                            storage.import_blocks(ids[at : at + p.num_blocks], p)
                            at += p.num_blocks
                        times[m].append(time.perf_counter() - t0)
                        if at != m:
                            raise RuntimeError(f"calibration: the {tier.name} tier lost blocks")
                        if m == n:
                            fetched.append(t1 - t0)
            finally:
                offload.close()
            one, many = float(np.median(times[1])), float(np.median(times[n]))
            per_block = max((many - one) / max(n - 1, 1), 1e-12)
            bandwidth[tier.name] = bytes_per_block / per_block
            latency[tier.name] = max(one - per_block, 0.0)
            if tier.name == "cpu":
                decode = float(np.median(fetched))
    return TierPath(bandwidth, latency, min(exports) / (n * bytes_per_block), store / n,
                    decode / n)  # fmt: skip


# New tokens of the chunks that continue each solo prompt after its cached blocks.
CONTEXT_CHUNK_TOKENS = (64, 256)
# Solo prefills before the workload, as shares of the largest prompt the probe may use.
SOLO_PREFILL_SHARES = (0.25, 0.5, 1.0)
SOLO_PREFILL_MIN_TOKENS = 16
# Decode probes after them: (sequences, context) pairs, "long" the longest context that
# DECODE_PROBE_BATCH sequences fit in half the pool; each decodes DECODE_PROBE_TOKENS.
DECODE_PROBE_BATCH = 4
DECODE_PROBE_SHORT = 64
DECODE_PROBE_TOKENS = 16


def decode_probes(max_model_len: int, num_blocks: int, block_size: int
                  ) -> list[tuple[int, int]]:  # fmt: skip
    """(sequences, prompt tokens) of the decode probes: DECODE_PROBE_BATCH sequences over a
    long context and over DECODE_PROBE_SHORT tokens, and one over the long context alone. In
    a workload's decode steps the sequences and their cached tokens grow together, so a fit
    over them alone cannot tell the KV reads from the per-sequence costs (the fitted KV
    read efficiency moved widely between calibrations of one machine); these steps differ in one
    of the two at a time. None where the long context would not be longer than the short."""
    b, t = DECODE_PROBE_BATCH, DECODE_PROBE_TOKENS
    room = min(max_model_len - t, (num_blocks * block_size) // (2 * b) - t)
    long = room // block_size * block_size
    if long <= 2 * DECODE_PROBE_SHORT:
        return []
    return [(b, long), (b, DECODE_PROBE_SHORT), (1, long)]


def solo_prefill_lengths(budget: int, max_model_len: int, num_blocks: int, block_size: int
                         ) -> list[int]:  # fmt: skip
    """The prompt lengths of the solo prefills: shares of the step's token budget, capped by
    the context (one token left to sample) and by half the pool (the probe must never
    preempt or wait)."""
    room = min(budget, max_model_len - 1, (num_blocks * block_size) // 2)
    lengths = [int(room * share) for share in SOLO_PREFILL_SHARES]
    return [n for n in lengths if n >= SOLO_PREFILL_MIN_TOKENS]


def fit_shape_cache(
    trace: list[tuple[StepFeatures, float, bool]],
    shape: ModelShape,
    base: Profile,
    large_peak: float | None,
    first_touch: float,
) -> tuple[Profile, FitReport]:
    """:func:`fit_profile` over the trace's fitted steps, with the GEMM shapes each builds
    counted by :class:`ShapeCache` replayed over every step in order. How many shapes the
    cache holds is chosen here too, the size (an eighth of ``base.shape_cache_entries`` at a
    time, down to a quarter) whose fit explains the steps best: oneDNN's cache is a capacity
    of entries, but replayed with a real run's GEMM calls it missed as a smaller LRU of
    shapes would, and a wrong size charges the wrong steps."""
    full = base.shape_cache_entries
    sizes = sorted({max(len(GEMM_NAMES), full * k // 8) for k in range(2, 9)}) if full else [0]

    def replay(size: int) -> Profile:
        trial = replace(base, shape_cache_entries=size)
        cache = ShapeCache.of(trial)
        for f, _, _ in trace:
            f.new_shape = 0
            if cache is not None:
                cache.mark(f)
        return trial

    best: tuple[Profile, FitReport] | None = None
    for size in sizes:
        trial = replay(size)
        steps = [(f, seconds) for f, seconds, fitted in trace if fitted]
        fit = fit_profile(steps, shape, trial, large_peak, first_touch)
        if best is None or fit[1].squared_error < best[1].squared_error:
            best = fit
    assert best is not None
    replay(best[0].shape_cache_entries)  # the steps' counts as the chosen cache made them
    return best


def calibrate(
    target: EngineTarget,
    runs: list[tuple[list[BenchRequest], LoadSpec]],
    seed: int = 0,
    warmup: list[BenchRequest] | None = None,
) -> tuple[Profile, FitReport]:
    """Run the real engine behind ``target`` on each (requests, load) in turn, measure this
    device's peaks, fit the factors to every step. The caller builds the target first, so
    the workloads can be counted with its tokenizer without loading the model twice.
    Several loads of one workload (all at once, and an open loop at a rate the engine
    sustains) show it both large batches and a busy stream of small prefills beside decodes."""
    if not runs:
        raise ValueError("calibration: needs at least one (workload, load) run")
    eng = target.engine
    model = str(eng.config.model)
    cfg, _ = load_config(model)
    spec = load_arch(model)
    dtype = str(eng.dtype).removeprefix("torch.")
    shape = ModelShape.from_arch(
        spec, eng.kv_cache_dtype, dtype, bool(cfg.get("tie_word_embeddings"))
    )
    dev = str(eng.config.device)
    peak_flops = measure_gemm_peak(eng.dtype, spec.hidden_size, dev)
    peak_bw = measure_peak_bandwidth(torch.device(dev))
    base = Profile(
        device=device_name(dev),
        peak_flops=peak_flops,
        peak_bandwidth=peak_bw,
        source="peaks measured on this machine (a 2048 x hidden x 3 hidden GEMM in the compute "
        "dtype; a streaming read); factors fitted to the real engine's step times",
        dtype=dtype,
    )
    # A bf16 model whose large steps run another GEMM (UpcastOps: oneDNN's, in float32 or
    # bf16): their own efficiency, bounded by that GEMM's own peak.
    base.large_step_tokens, large_dtype, shape_rows = eng.executor.collective_rpc(_ops_facts)[0]
    large_peak = (
        measure_gemm_peak(large_dtype, spec.hidden_size, dev) if base.large_step_tokens else None
    )
    # A backend that builds state per GEMM shape (oneDNN): which GEMMs build one (its caches'
    # LRU, replayed over the steps); what that costs is fitted with the other terms.
    base.shape_state_rows = shape_rows
    if base.shape_state_rows:
        base.shape_cache_entries = onednn_cache_entries()
    # Every step in order (the warm-up's too: they fill the cache), with whether it is fitted.
    trace: list[tuple[StepFeatures, float, bool]] = []
    adds: list[tuple[int, float]] = []
    warm = len(warmup or [])
    step, add = eng.step, eng.add_request

    # The real pool's blocks written so far (None: faulted in at start, none is new).
    touched: set[int] | None = None if eng.config.cache.kv_cache_prefault else set()
    probing = False  # the solo prefills: recorded, though no request was added through add

    # The serving loop's own time between two steps of a busy engine in the workload
    # (publishing its state, handing finished requests back), less the requests it added
    # meanwhile (their own term): a term of its own, not folded into the step before, since
    # the probes' steps follow each other with no serving loop between them and a fit over
    # both would charge only part of it.
    busy_since: float | None = None  # the last workload step's end, when it left work
    added = 0.0  # seconds of adds since then
    gaps: list[float] = []

    def timed_step() -> Any:
        nonlocal busy_since, added
        a = time.perf_counter()
        if busy_since is not None:
            gaps.append(max(a - busy_since - added, 0.0))
        out = step()
        b = time.perf_counter()
        if eng.core.last_step.seqs:
            f = features_of(eng.core.last_step, shape, touched, eng.block_size)
            trace.append((f, b - a, probing or len(adds) > warm))  # warm-up: touches only
        busy = bool(eng.core.last_step.seqs) and eng.has_unfinished_requests()
        busy_since = b if busy and not probing and len(adds) > warm else None
        added = 0.0
        return out

    def timed_add(*args: Any, **kwargs: Any) -> Any:
        nonlocal added
        a = time.perf_counter()
        rid = add(*args, **kwargs)
        req = eng.requests.get(rid)
        took = time.perf_counter() - a
        adds.append((req.num_prompt_tokens if req else 0, took))
        added += took
        return rid

    eng.step, eng.add_request = timed_step, timed_add  # type: ignore[method-assign]
    solo = solo_prefill_lengths(eng.config.scheduler.max_num_batched_tokens, eng.max_model_len,
                                eng.num_blocks, eng.block_size)  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    vocab = eng.model_config.vocab_size

    def alone(prompts: list[list[int]], params: SamplingParams) -> None:
        """``prompts`` together, with nothing else running, until they finish."""
        for ids in prompts:
            add(None, ids, params)
        while eng.has_unfinished_requests():
            timed_step()

    prefill = SamplingParams(temperature=0.0, max_tokens=1)

    # Each solo prompt, then (prefix caching on) chunks that continue it after its cached
    # blocks: attention over cached context, which the workload's steps mix with the rest.
    longest = min(eng.max_model_len - 1, (eng.num_blocks - 1) * eng.block_size)
    continued: list[tuple[int, int]] = []
    probing = True
    for n in solo:  # on this thread, before the target's engine thread starts
        ids = torch.randint(0, vocab, (n,), generator=gen).tolist()
        alone([ids], prefill)
        for extra in CONTEXT_CHUNK_TOKENS if eng.config.cache.enable_prefix_caching else ():
            if n + extra <= longest:
                alone([ids + torch.randint(0, vocab, (extra,), generator=gen).tolist()], prefill)
                continued.append((n, extra))
    # Decodes that tell KV reads from per-sequence costs (see decode_probes).
    probed = decode_probes(eng.max_model_len, eng.num_blocks, eng.block_size)
    decode = SamplingParams(temperature=0.0, max_tokens=DECODE_PROBE_TOKENS, ignore_eos=True)
    for batch, context in probed:
        alone([torch.randint(0, vocab, (context,), generator=gen).tolist() for _ in range(batch)],
              decode)  # fmt: skip
    probing = False
    t0 = time.perf_counter()  # the workload's wall time, without the probes
    workloads, loads = [r for r, _ in runs], [ld for _, ld in runs]
    asyncio.run(benchmark(target, workloads, loads, seed, warmup, progress=False))
    wall = time.perf_counter() - t0
    adds = adds[warm:]
    # A CPU pool's first writes, measured rather than fitted (see fit_profile); a GPU pool
    # is allocated whole.
    touch = measure_first_touch() if dev == "cpu" else 0.0
    profile, report = fit_shape_cache(trace, shape, base, large_peak, touch)
    if adds:
        x = np.array([[1.0, n] for n, _ in adds])
        y = np.array([s for _, s in adds])
        coef = np.linalg.lstsq(x, y, rcond=None)[0]
        if coef[1] < 0:  # no measurable per-token cost: a constant
            coef = np.array([float(y.mean()), 0.0])
        profile.request_overhead_s = max(0.0, float(coef[0]))
        profile.request_overhead_per_token_s = max(0.0, float(coef[1]))
    # The mean, not the median: the simulated clock sums the gaps, and the loop's occasional
    # long one (a collection, a burst of finished requests) is part of the run's time.
    profile.loop_gap_s = float(np.mean(gaps)) if gaps else 0.0
    if eng.worker_info is not None:
        bpb = shape.kv_bytes_per_token * eng.block_size
        path = eng.executor.collective_rpc(_tier_path, (bpb,))[0]
        profile.tier_bandwidth, profile.tier_latency_s = path.bandwidth, path.latency
        profile.offload_export_s_per_byte = path.export_s_per_byte
        profile.offload_store_s_per_block = path.store_s_per_block
        profile.offload_load_s_per_block = path.load_s_per_block
        # The worker shares the cores with the engine's compute threads when those take
        # every core (a CPU engine); on a GPU it has host cores of its own. Such an engine
        # also loads from its host tier on the engine thread (KVOffload.start_load).
        every_core = compute_takes_every_core(dev)
        profile.offload_worker_share = 1.0 if every_core else 0.0
        profile.inline_host_loads = every_core
    profile.calibration = {
        "model": model,
        "kv_cache_dtype": eng.kv_cache_dtype,
        "num_requests": sum(len(r) for r in workloads),
        "loads": [ld.describe() for ld in loads],
        "solo_prefills": solo,
        "context_chunks": continued,
        "decode_probes": probed,
        "seed": seed,
        "wall_s": wall,
        "steps": report.steps,
        "median_abs_step_error": report.median_abs_error,
        "p90_abs_step_error": report.p90_abs_error,
        "total_time_error": report.total_time_error,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    return profile, report
