"""The time of one engine step, from what the step computes, on a device with known peaks.

A step is one flat batch, so its time is a sum of a few terms, each a physical quantity of the
batch over a device peak, divided by an efficiency factor:

- host work: a fixed cost per step, per scheduled sequence, per step with prompt chunks and
  per chunk, per token, per sampled row, and per prompt token of a request's first step (its
  block hashes, its sampling state) (scheduling, batch building, sampling, Python);
- the linear layers: ``max(FLOPs / (peak x e_gemm), weight bytes / (bandwidth x e_weights))``,
  the roofline of reading every weight once against computing every token through it; an
  engine whose large steps take another GEMM path (a bf16 model's oneDNN GEMMs in float32
  or bf16 on a CPU without AMX, :class:`~kvserve.model.linear_ops.UpcastOps`) has a second
  efficiency for steps of at least ``large_step_tokens`` tokens, which are compute-bound;
- prefill attention: FLOPs of each new token against the cache entries it attends to (causal,
  windows honoured), over peak x ``e_prefill_attention`` for the entries of its own chunk and
  peak x ``e_context_attention`` for those cached before it (a prefix hit, an earlier chunk:
  read from the paged cache on another path);
- decode attention: the cache bytes the decode tokens read, over bandwidth x ``e_decode_kv``,
  and at that rate a retention compaction's copies (each kept entry read and written once);
- tensor parallelism: two all-reduces of the hidden state per layer over the interconnect;
- a CPU pool's first writes into its pages, and, where the GEMMs are oneDNN's, each GEMM
  shape of the step that oneDNN's bounded caches no longer hold (:class:`ShapeCache`): it
  builds that shape's primitive again.

The weight term reaching its floor is the only non-linear piece, and it is a hinge:
``max(a F, a F_knee)``. Calibration (:func:`fit_profile`) therefore searches the knee and
solves a non-negative least squares for everything else, weighted by relative error so that a
2 ms decode step counts as much as a 200 ms prefill step. A :class:`Profile` is plain JSON: the
device's peaks, where they come from, and the factors; a CPU calibration and a CUDA run fill
the same fields.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np

from kvserve.config import CacheConfig
from kvserve.config_fields import default_of
from kvserve.model.linear_ops import GEMM_NAMES
from kvserve.plan.capacity import ArchSpec, bytes_per_token
from kvserve.plan.gpus import GPU, PCIE_GEN5, link_between_ranks
from kvserve.sched.output import SchedulerOutput

PROFILE_VERSION = 1
# The efficiency of a term the calibration found no time for: its time is then negligible.
UNSEEN = 1e6
# Profile fields in seconds (scaled together) and efficiencies (device terms, at most 1 when
# fitted); the fit's device terms by column name.
PHYSICAL = ("prefill_attention", "context_attention", "decode_kv")
SECONDS_FIELDS = (
    "step_overhead_s", "per_seq_s", "per_prefill_seq_s", "prefill_step_s",
    "per_new_prompt_token_s", "per_solo_seq_s", "per_token_s",
    "per_sampled_row_s", "first_touch_s_per_byte", "new_shape_s",
)  # fmt: skip
# Offload fields in seconds (measured, not fitted).
OFFLOAD_SECONDS_FIELDS = (
    "offload_export_s_per_byte", "offload_store_s_per_block", "offload_load_s_per_block",
)  # fmt: skip
# The serving loop's own host time, outside the steps (measured, not fitted).
HOST_SECONDS_FIELDS = ("request_overhead_s", "request_overhead_per_token_s", "loop_gap_s")
# Serving over HTTP (measured over a real server: kvserve.sim.serving).
SERVING_FIELDS = ("serve_request_s", "serve_step_s", "serve_token_s", "hop_request_s",
                  "hop_request_token_s", "hop_token_s", "serve_first_request_s")  # fmt: skip
# Fields of profiles whose new-shape term counted step row counts instead of GEMM shapes:
# read, and the term left off.
RETIRED_SHAPE_FIELDS = ("new_shape_min_tokens", "shape_cache_rows")
TIER_NAMES = ("cpu", "disk", "redis")  # offload tiers, as kvserve.kv.tiers names them
EFFICIENCY_FIELDS = (
    "gemm_efficiency", "weight_read_efficiency", "prefill_attention_efficiency",
    "context_attention_efficiency",
    "decode_kv_efficiency", "gemm_efficiency_large",
)  # fmt: skip


@dataclass(slots=True, frozen=True)
class ModelShape:
    """What the cost model needs of a model: its shapes and bytes, for one GPU of a replica."""

    num_layers: int
    hidden_size: int
    num_heads: int
    head_dim: int
    vocab_size: int
    layer_params: int  # active parameters in the decoder layers (no embedding, no LM head)
    weight_bytes_per_param: float  # as the replica computes with them
    kv_bytes_per_token: float  # every layer, metadata included, one GPU's share
    layer_windows: tuple[int | None, ...]
    tp: int = 1
    # The layers grouped by their own sliding window (None: full attention), with how many
    # have it: read once per simulated step, so computed once here.
    window_groups: tuple[tuple[int | None, int], ...] = field(init=False)

    def __post_init__(self) -> None:
        windows = self.layer_windows or (None,) * self.num_layers
        groups = tuple((w, windows.count(w)) for w in dict.fromkeys(windows))
        object.__setattr__(self, "window_groups", groups)

    @classmethod
    def from_arch(
        cls,
        spec: ArchSpec,
        kv_cache_dtype: str,
        compute_dtype: str,
        tied_embeddings: bool,
        tp: int = 1,
    ) -> ModelShape:
        """``compute_dtype`` is a dense dtype name (weights are read in it);
        ``tied_embeddings`` is the config's ``tie_word_embeddings`` (one table counted)."""
        width = {"float32": 4.0, "bfloat16": 2.0, "float16": 2.0}[compute_dtype]
        tables = spec.vocab_size * spec.hidden_size * (1 if tied_embeddings else 2)
        layers = max(1, spec.num_active_parameters - tables)
        return cls(
            num_layers=spec.num_layers,
            hidden_size=spec.hidden_size,
            num_heads=spec.num_attention_heads,
            head_dim=spec.mla_latent_dim or spec.head_dim,
            vocab_size=spec.vocab_size,
            layer_params=layers,
            weight_bytes_per_param=width,
            kv_bytes_per_token=bytes_per_token(spec, kv_cache_dtype, tp, compute_dtype),
            layer_windows=spec.layer_windows,
            tp=tp,
        )

    @property
    def head_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def weight_bytes(self) -> float:
        """Bytes one step reads of this GPU's weights (the embedding table is only gathered)."""
        return (self.layer_params + self.head_params) * self.weight_bytes_per_param / self.tp


@dataclass(slots=True)
class StepFeatures:
    """The physical quantities of one step that its time depends on (one GPU's share)."""

    seqs: int = 0
    prefill_seqs: int = 0  # sequences computing more than one token (a prompt chunk)
    tokens: int = 0
    sampled_rows: int = 0
    linear_flops: float = 0.0
    prefill_attention_flops: float = 0.0
    context_attention_flops: float = 0.0  # the part over cache entries from before the chunk
    decode_kv_bytes: float = 0.0
    compact_bytes: float = 0.0  # a retention compaction's copies: kept entries read and written
    allreduce_bytes: float = 0.0
    first_touch_bytes: float = 0.0  # pool blocks written for the first time
    new_prompt_tokens: int = 0  # prompts scheduled for the first time (hashed, set up)
    solo_seqs: int = 0  # attended on their own (sinks, a compaction's scoring, H2O's mass)
    new_shape: int = 0  # GEMM shapes the backend builds state for in this step (ShapeCache)


def _attended(cached: int, n: int, window: int | None) -> float:
    """Sum over a chunk's tokens of the cache entries each attends to: token i sees
    ``cached + i + 1`` entries, at most ``window``."""
    if n <= 0:
        return 0.0
    lo, hi = cached + 1, cached + n  # context of the first and the last token
    if not window or hi <= window:
        return (lo + hi) * n / 2
    if lo >= window:
        return float(window * n)
    below = window - lo  # tokens whose context is under the window: lo .. window-1
    return (lo + window - 1) * below / 2 + window * (n - below)


def step_features(
    out: SchedulerOutput,
    shape: ModelShape,
    touched: set[int] | None = None,
    block_size: int = default_of(CacheConfig, "block_size"),
) -> StepFeatures:
    """What the scheduled batch computes: tokens through every linear layer, sampled rows
    through the LM head, attention over each sequence's cache (its retention window and the
    layers' own windows honoured), and the decode tokens' cache reads. With ``touched`` (the
    pool blocks written so far, updated here), also the bytes of blocks written for the
    first time: a CPU pool's pages are faulted in on first write."""
    f = StepFeatures()
    # Layers by their own window: (window or None, how many layers have it).
    groups = shape.window_groups
    per_pair = 4 * shape.num_heads * shape.head_dim / shape.tp  # QK^T and PV, FLOPs per entry
    kv_per_entry = shape.kv_bytes_per_token / shape.num_layers  # one layer's entry
    block_bytes = shape.kv_bytes_per_token * block_size
    # Sums in locals, not on f: this loop runs per sequence per simulated step.
    seqs = solo = tokens = sampled = prefill_seqs = 0
    decode_entries = pairs = context = first_touch = compacted = 0.0
    # No layer has a window of its own: a decode token without a retention window reads
    # every cache entry in every layer.
    all_layers = groups[0][1] if len(groups) == 1 and not groups[0][0] else 0
    seqs = len(out.seqs)
    for s in out.seqs:
        n = len(s.token_ids)
        cached = s.num_cached
        end = cached + n
        solo += s.per_sequence
        tokens += n
        sampled += len(s.sample_ids) + s.num_prompt_logit_rows
        own = s.window + s.sinks if s.window else None
        if n == 1 and all_layers and own is None:
            decode_entries += all_layers * end
        elif n == 1:
            for w, count in groups:
                bound = (min(own, w) if own and w else own or w) or end
                decode_entries += count * min(end, bound)
        else:
            for w, count in groups:
                bound = min(own, w) if own and w else own or w
                every = _attended(cached, n, bound)
                pairs += count * every
                if cached:  # the entries before the chunk: the cache's, not its own
                    context += count * (every - _attended(0, n, bound))
            prefill_seqs += 1
        if s.compact:  # every layer copies its kept entries into fresh blocks
            compacted += s.compact[1]
        if touched is not None and n:
            first, last = cached // block_size, (end - 1) // block_size
            for b in (*s.block_ids[first : last + 1], *s.compact_block_ids):
                if b not in touched:
                    touched.add(b)
                    first_touch += block_bytes
    f.seqs, f.solo_seqs, f.tokens, f.sampled_rows = seqs, solo, tokens, sampled
    f.prefill_seqs = prefill_seqs
    f.decode_kv_bytes = decode_entries * kv_per_entry
    f.compact_bytes = 2 * compacted * shape.kv_bytes_per_token
    f.prefill_attention_flops = pairs * per_pair
    f.context_attention_flops = context * per_pair
    f.first_touch_bytes = first_touch
    if out.new_requests:
        f.new_prompt_tokens = sum(len(r.prompt_token_ids) for r in out.new_requests)
    f.linear_flops = (
        2.0 * (shape.layer_params * f.tokens + shape.head_params * f.sampled_rows) / shape.tp
    )
    if shape.tp > 1:  # two all-reduces per layer of the hidden states, ring: 2 (tp-1)/tp
        elem = shape.weight_bytes_per_param
        volume = 2 * shape.num_layers * f.tokens * shape.hidden_size * elem
        f.allreduce_bytes = volume * 2 * (shape.tp - 1) / shape.tp
    return f


class ShapeCache:
    """The GEMM shapes whose state a per-shape backend still holds, least recently used
    first: oneDNN builds a primitive per input shape and keeps it in a bounded LRU cache
    (:data:`kvserve.model.linear_ops.ONEDNN_CACHE_CAPACITY` entries), and a call of a shape
    it no longer holds builds it again, once for all layers (they share their shapes).

    A step's GEMMs and their row counts (a model of two or more layers): every layer's five
    (:data:`~kvserve.model.linear_ops.GEMM_NAMES`) at the step's tokens, except that in a
    step that reads fewer rows than it computes (a prompt chunk: only its last row samples)
    the last layer's output, gate, up and down projections take only the sampled rows, as
    does the LM head. Under serving traffic the token count of a step with a prompt chunk is
    new almost every time, and the sampled rows of one are the next decode step's batch
    size: such a decode step finds most of its shapes built. Each GEMM builds state only
    from its own fewest rows (:attr:`Profile.shape_state_rows`; the others run on a kernel
    that keeps none)."""

    LAYER = ("qkv", "o", "gate", "up", "down")

    def __init__(self, entries: int, rows: dict[str, int]) -> None:
        self.entries = entries
        self.rows = rows
        self._held: OrderedDict[tuple[str, int], None] = OrderedDict()

    @classmethod
    def of(cls, profile: Profile) -> ShapeCache | None:
        """The profile's cache, or None where its device keeps no per-shape state."""
        if not (profile.shape_cache_entries and profile.shape_state_rows):
            return None
        return cls(profile.shape_cache_entries, profile.shape_state_rows)

    @classmethod
    def calls(cls, f: StepFeatures) -> list[tuple[str, int]]:
        """The step's GEMMs as (name, rows), in the order the model calls them."""
        t, s = f.tokens, f.sampled_rows
        out = [(name, t) for name in cls.LAYER]
        if s and (f.prefill_seqs or s != t):  # the last layer keeps the sampled rows
            out += [(name, s) for name in cls.LAYER[1:]]
        if s:
            out.append(("head", s))
        return out

    def mark(self, f: StepFeatures) -> StepFeatures:
        """Set ``f.new_shape`` to the number of GEMM shapes the step builds, and hold them."""
        held, least, new = self._held, self.rows, 0
        for key in self.calls(f):
            fewest = least.get(key[0])
            if fewest is None or key[1] < fewest:
                continue
            if key in held:
                held.move_to_end(key)
                continue
            new += 1
            held[key] = None
            if len(held) > self.entries:
                held.popitem(last=False)
        f.new_shape = new
        return f


@dataclass(slots=True)
class Profile:
    """A device's peaks and the efficiency factors of the cost model (JSON on disk)."""

    device: str
    peak_flops: float  # FLOP/s of the compute dtype, dense
    peak_bandwidth: float  # bytes/s of device memory
    source: str  # where the peaks and the factors come from
    dtype: str = "bfloat16"
    step_overhead_s: float = 0.0
    per_seq_s: float = 0.0
    per_prefill_seq_s: float = 0.0
    prefill_step_s: float = 0.0  # once per step that computes any prompt chunk
    per_new_prompt_token_s: float = 0.0  # a request's first step: its prompt's block hashes
    # A sequence a retention policy attends on its own, outside the fused kernel's batch; 0
    # until a calibration that ran a retention policy measures it.
    per_solo_seq_s: float = 0.0
    per_token_s: float = 0.0
    per_sampled_row_s: float = 0.0
    gemm_efficiency: float = 0.5
    # Steps of at least this many tokens run their GEMMs on another path, at
    # gemm_efficiency_large of peak_flops (0: one path for every step).
    large_step_tokens: int = 0
    gemm_efficiency_large: float = 0.5
    weight_read_efficiency: float = 0.7
    prefill_attention_efficiency: float = 0.4
    # A prompt chunk's attention to the cache entries before it (a prefix hit, an earlier
    # chunk) runs on another path than attention within the chunk (read from the paged cache).
    context_attention_efficiency: float = 0.4
    decode_kv_efficiency: float = 0.6
    # A CPU pool is calloc'd: the first write to a block faults its pages in (0 on a GPU,
    # whose pool is allocated whole).
    first_touch_s_per_byte: float = 0.0
    # A GEMM backend that builds state per input shape (oneDNN's primitives, on a CPU) keeps
    # it in a bounded LRU cache and builds it again for a shape the cache no longer holds
    # (ShapeCache): the seconds one such build costs, the GEMMs that build state (by
    # linear_ops.GEMM_NAMES) each with the fewest rows of a call that does, and how many
    # shapes the cache holds (0 / empty: no such state).
    new_shape_s: float = 0.0
    shape_state_rows: dict[str, int] = field(default_factory=dict)
    shape_cache_entries: int = 0
    interconnect_bandwidth: float = 0.0  # bytes/s per GPU (NVLink), for tp > 1
    allreduce_latency_s: float = 0.0  # per all-reduce, for tp > 1
    request_overhead_s: float = 0.0  # per added request (validation, tokenization)
    request_overhead_per_token_s: float = 0.0
    # The serving loop's own time between two steps of a busy engine (publishing its state,
    # handing finished requests back), past the requests it added meanwhile: the step after
    # waits for it.
    loop_gap_s: float = 0.0
    # Serving over HTTP (kvserve.sim.serving; `kvserve simulate --calibrate --serving`): what
    # the front end (parsing, detokenizing, one SSE event per token per stream), and a proxy
    # or router hop in front of it, cost the engine on the cores they share with it. Per
    # request accepted, per step that streams tokens, per token streamed; the hop's per
    # request and per token of its prompt (a router tokenizes a text prompt and hashes its
    # blocks) and per token streamed. All 0 in a profile calibrated without it
    # (serving_measured); the per-prompt-token term also where the model had no tokenizer
    # to write text prompts with.
    serve_request_s: float = 0.0
    serve_step_s: float = 0.0
    serve_token_s: float = 0.0
    hop_request_s: float = 0.0
    hop_request_token_s: float = 0.0
    hop_token_s: float = 0.0
    # A fresh server's first request: the one-time work its first steps do (per-shape kernel
    # state, the allocator's first pages, lazy initialization), past a warm request's time.
    serve_first_request_s: float = 0.0
    # The share of a request's front-end (and hop) time that the engine's steps lose when
    # it arrives while they run (the rest overlaps them); the request joins the engine after
    # all of it.
    serve_request_share: float = 1.0
    serving_measured: bool = False
    # Offload tiers (kvserve.sim.tiers), by tier name (cpu, disk, redis): the bytes/s a load
    # moves from the tier into one GPU's pool, and the fixed seconds of each batch of blocks
    # asked of it; and the step's seconds per byte of blocks exported to the tiers.
    tier_bandwidth: dict[str, float] = field(default_factory=dict)
    tier_latency_s: dict[str, float] = field(default_factory=dict)
    offload_export_s_per_byte: float = 0.0
    # The offload worker's own time per block it stores (encoding, the host tier's copy) and
    # per block it loads (checking, decoding), and the share of that time the engine's steps
    # lose to it: 1 on a CPU engine whose compute threads take every core (the worker runs
    # beside them on the same cores), 0 on a GPU (the worker has host cores to itself).
    offload_store_s_per_block: float = 0.0
    offload_load_s_per_block: float = 0.0
    offload_worker_share: float = 0.0
    # A CPU engine whose compute threads take every core loads what its host tier holds on
    # the engine thread, when asked (kvserve.kv.offload.KVOffload.start_load), not on the
    # worker: the step that starts such a load pays its time.
    inline_host_loads: bool = False
    calibration: dict[str, Any] = field(default_factory=dict)  # fit quality, what it ran
    version: int = PROFILE_VERSION

    def step_time(self, f: StepFeatures, shape: ModelShape) -> float:
        """Seconds for one step of features ``f`` on this device."""
        t = (
            self.step_overhead_s
            + self.per_seq_s * f.seqs
            + self.per_prefill_seq_s * f.prefill_seqs
            + (self.prefill_step_s if f.prefill_seqs else 0.0)
            + self.per_new_prompt_token_s * f.new_prompt_tokens
            + self.per_solo_seq_s * f.solo_seqs
            + self.per_token_s * f.tokens
            + self.per_sampled_row_s * f.sampled_rows
        )
        if self.large_step_tokens and f.tokens >= self.large_step_tokens:
            t += f.linear_flops / (self.peak_flops * self.gemm_efficiency_large)
        else:
            compute = f.linear_flops / (self.peak_flops * self.gemm_efficiency)
            weights = shape.weight_bytes / (self.peak_bandwidth * self.weight_read_efficiency)
            t += max(compute, weights)
        own = f.prefill_attention_flops - f.context_attention_flops
        t += own / (self.peak_flops * self.prefill_attention_efficiency)
        t += f.context_attention_flops / (self.peak_flops * self.context_attention_efficiency)
        # KV memory traffic: the decode tokens' reads, and a compaction's copies
        kv_bytes = f.decode_kv_bytes + f.compact_bytes
        t += kv_bytes / (self.peak_bandwidth * self.decode_kv_efficiency)
        t += f.first_touch_bytes * self.first_touch_s_per_byte
        t += f.new_shape * self.new_shape_s
        if shape.tp > 1 and f.tokens:
            if self.interconnect_bandwidth <= 0:
                raise ValueError(
                    f"profile {self.device!r}: tp > 1 needs interconnect_bandwidth > 0"
                )
            t += f.allreduce_bytes / self.interconnect_bandwidth
            t += 2 * shape.num_layers * self.allreduce_latency_s
        return t

    def worker_time(self, stored: int = 0, loaded: int = 0) -> float:
        """Seconds a step loses to the offload worker storing ``stored`` blocks and loading
        ``loaded`` blocks beside it."""
        per = stored * self.offload_store_s_per_block + loaded * self.offload_load_s_per_block
        return self.offload_worker_share * per

    def request_time(self, prompt_tokens: int) -> float:
        """Host seconds to accept one request (validation, tokenization) between steps."""
        return self.request_overhead_s + self.request_overhead_per_token_s * prompt_tokens

    def serving_request_time(self, hop: bool, prompt_tokens: int = 0) -> float:
        """Engine seconds a request of ``prompt_tokens`` costs the HTTP front end (and the
        hop in front of it)."""
        t = self.serve_request_s
        if hop:
            t += self.hop_request_s + self.hop_request_token_s * prompt_tokens
        return t

    def serving_step_time(self, tokens: int, hop: bool) -> float:
        """Engine seconds the front end (and the hop) take after a step that streamed
        ``tokens`` tokens (one per sequence that sampled), before the next step."""
        if tokens <= 0:
            return 0.0
        per = self.serve_token_s + (self.hop_token_s if hop else 0.0)
        return self.serve_step_s + per * tokens

    # -- files ------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def save(self, path: str | Path) -> Path:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(self.to_json(), indent=2) + "\n")
        return p

    @classmethod
    def from_json(cls, data: dict[str, Any], where: str = "profile") -> Profile:
        if not isinstance(data, dict):
            raise ValueError(f"{where}: expected a JSON object")
        if any(name in data for name in RETIRED_SHAPE_FIELDS):
            # A profile with these fields charged its new_shape_s per step row count, not
            # per GEMM shape: its term stays off rather than charge 5-10x.
            data = {k: v for k, v in data.items()
                    if k not in RETIRED_SHAPE_FIELDS and k != "new_shape_s"}  # fmt: skip
        if "context_attention_efficiency" not in data and "prefill_attention_efficiency" in data:
            # A profile without the context term: every prompt chunk's attention at one rate.
            data = {**data, "context_attention_efficiency": data["prefill_attention_efficiency"]}
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{where}: unknown fields {unknown}; known: {sorted(known)}")
        if data.get("version", PROFILE_VERSION) != PROFILE_VERSION:
            raise ValueError(
                f"{where}: version {data.get('version')!r}, this kvserve reads {PROFILE_VERSION}"
            )
        for name in ("device", "peak_flops", "peak_bandwidth", "source"):
            if name not in data:
                raise ValueError(f"{where}: missing field {name!r}")
        p = cls(**data)
        for name in ("peak_flops", "peak_bandwidth"):
            if not getattr(p, name) > 0:
                raise ValueError(f"{where}: {name} must be > 0, got {getattr(p, name)!r}")
        for name in EFFICIENCY_FIELDS:
            v = getattr(p, name)
            if not (isinstance(v, int | float) and 0 < v):
                raise ValueError(f"{where}: {name} must be > 0, got {v!r}")
        rows = p.shape_state_rows
        if not isinstance(rows, dict) or any(
            name not in GEMM_NAMES or not (isinstance(n, int) and n >= 1)
            for name, n in rows.items()
        ):
            raise ValueError(
                f"{where}: shape_state_rows must map GEMM names {GEMM_NAMES} to integers >= 1,"
                f" got {rows!r}"
            )
        for name in ("large_step_tokens", "shape_cache_entries"):
            n = getattr(p, name)
            if not (isinstance(n, int) and n >= 0):
                raise ValueError(f"{where}: {name} must be an integer >= 0, got {n!r}")
        for name in (*SECONDS_FIELDS, *OFFLOAD_SECONDS_FIELDS, *HOST_SECONDS_FIELDS,
                     *SERVING_FIELDS):  # fmt: skip
            v = getattr(p, name)
            if not (isinstance(v, int | float) and v >= 0):
                raise ValueError(f"{where}: {name} must be >= 0 seconds, got {v!r}")
        if not isinstance(p.serving_measured, bool):
            raise ValueError(
                f"{where}: serving_measured must be true or false, got {p.serving_measured!r}"
            )
        if not isinstance(p.inline_host_loads, bool):
            raise ValueError(
                f"{where}: inline_host_loads must be true or false, got {p.inline_host_loads!r}"
            )
        for name in ("offload_worker_share", "serve_request_share"):
            share = getattr(p, name)
            if not (isinstance(share, int | float) and 0 <= share <= 1):
                raise ValueError(f"{where}: {name} must be in [0, 1], got {share!r}")
        for name, positive in (("tier_bandwidth", True), ("tier_latency_s", False)):
            table = getattr(p, name)
            if not isinstance(table, dict):
                raise ValueError(f"{where}: {name} must be an object of tier name -> number")
            for tier, v in table.items():
                if tier not in TIER_NAMES:
                    raise ValueError(f"{where}: {name}: unknown tier {tier!r}; known: {TIER_NAMES}")
                if not (isinstance(v, int | float) and (v > 0 if positive else v >= 0)):
                    bound = "> 0" if positive else ">= 0"
                    raise ValueError(f"{where}: {name}[{tier!r}] must be {bound}, got {v!r}")
        return p

    def serving_terms(self) -> dict[str, Any]:
        """The serving-over-HTTP terms (:data:`SERVING_FIELDS`, all 0 when not measured), the
        share fitted with them and whether they were measured, as a benchmark reports them."""
        fields = (*SERVING_FIELDS, "serve_request_share", "serving_measured")
        return {f: getattr(self, f) for f in fields}

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"profile: file not found: {p}")
        try:
            data = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"profile: {p}: invalid JSON ({e.msg})") from None
        return cls.from_json(data, f"profile {p}")


# -- shipped GPU profiles --------------------------------------------------------------------
# Peaks are the planner's datasheet figures. The factors are not measured by us (no GPU here):
# they are the usual fractions serving engines report on these parts (dense bf16 GEMMs at large
# M reach ~60-70 % of peak, weight streaming ~80 % of HBM bandwidth, paged decode attention
# ~60-70 %, flash-attention prefill ~40-50 %), and a CUDA-graph decode step's launch floor of a
# few hundred microseconds. A calibration on the real GPU (`kvserve simulate --calibrate`)
# replaces them.
GPU_FACTORS = dict(
    step_overhead_s=3e-4,
    per_seq_s=2e-6,
    per_token_s=0.0,
    per_sampled_row_s=1e-6,
    gemm_efficiency=0.65,
    weight_read_efficiency=0.8,
    prefill_attention_efficiency=0.45,
    context_attention_efficiency=0.45,
    decode_kv_efficiency=0.65,
    allreduce_latency_s=1e-5,
)
# Offload tiers on a GPU: assumptions, not measurements (no GPU here), in the profile so a
# measured figure can replace them. Host memory: pinned buffers over the part's PCIe x16 link
# at ~80 % of its one-direction peak (Gen5 64 GB/s, Gen4 32 GB/s). Disk: a local NVMe drive
# (PCIe Gen4, ~6 GB/s sequential read, ~100 us a request). Redis: a 25 GbE network, ~2.5
# GB/s after framing, ~0.5 ms a pipelined round trip. A tier's entries reach the GPU through
# host memory, so a slower tier's figure includes the PCIe hop's (it is much the faster).
TIER_LATENCY_S = {"cpu": 1e-5, "disk": 1e-4, "redis": 5e-4}


def gpu_tier_links(gpu_key: str) -> dict[str, float]:
    """Bytes/s of a tier load into one GPU of ``gpu_key`` (see above), by tier name."""
    pcie = (64e9 if gpu_key in PCIE_GEN5 else 32e9) * 0.8
    return {"cpu": pcie, "disk": 6e9, "redis": 2.5e9}


def gpu_profile(gpu: GPU) -> Profile:
    """The shipped profile of a planner GPU (datasheet peaks, typical factors)."""
    return Profile(
        device=gpu.name,
        peak_flops=gpu.flops_per_s,
        peak_bandwidth=gpu.bandwidth_bytes_per_s,
        source=f"peaks: {gpu.source}; factors: typical serving-engine efficiencies "
        "(kvserve.sim.cost.GPU_FACTORS), not calibrated on this part",
        interconnect_bandwidth=link_between_ranks(gpu.key)[1],
        tier_bandwidth=gpu_tier_links(gpu.key),
        tier_latency_s=dict(TIER_LATENCY_S),
        # An evicted block's copy out runs on a copy stream beside the forward pass; what
        # the step pays is the launch, in per_seq_s's noise.
        offload_export_s_per_byte=0.0,
        **GPU_FACTORS,  # type: ignore[arg-type]
    )


# -- calibration ---------------------------------------------------------------------------
def _nnls(a: np.ndarray, b: np.ndarray, iters: int = 200) -> np.ndarray:
    """Non-negative least squares (Lawson-Hanson active set) for small problems."""
    m, n = a.shape
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    w = a.T @ (b - a @ x)
    for _ in range(iters):
        if passive.all() or not (w[~passive] > 1e-12 * max(1.0, np.abs(w).max())).any():
            break
        j = int(np.argmax(np.where(passive, -np.inf, w)))
        passive[j] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            neg = passive & (z <= 0)
            alpha = np.min(x[neg] / (x[neg] - z[neg] + 1e-300))
            x = x + alpha * (z - x)
            passive &= x > 1e-15
            x[~passive] = 0.0
            if not passive.any():
                break
        w = a.T @ (b - a @ x)
    return x


@dataclass(slots=True)
class FitReport:
    steps: int
    median_abs_error: float  # relative, per step
    p90_abs_error: float
    total_time_error: float  # relative error of the summed step time
    knee_flops: float
    squared_error: float = 0.0  # sum of the steps' squared relative errors


def fit_profile(
    samples: list[tuple[StepFeatures, float]],
    shape: ModelShape,
    base: Profile,
    large_peak_flops: float | None = None,
    first_touch_s_per_byte: float | None = None,
) -> tuple[Profile, FitReport]:
    """Factors that best explain measured ``(features, seconds)`` steps, on ``base``'s
    peaks. A term the steps never exercise (no decode, no prefill) keeps ``base``'s factor.
    With ``base.large_step_tokens``, steps that large get their own GEMM efficiency (against
    ``base.peak_flops``, at most ``large_peak_flops`` / ``base.peak_flops``: the other path's
    own measured peak, when given). ``first_touch_s_per_byte``, when given, is that term's
    measured cost and is not fitted: first writes into the pool grow with a prefill step's
    tokens, as its GEMMs and host work do, and a fit cannot tell them apart. A step marked
    by :class:`ShapeCache` pays ``new_shape_s`` per GEMM shape it builds (``new_shape``),
    fitted: decode steps build some too, which sets it apart from the prefill steps' own
    terms."""
    if len(samples) < 8:
        raise ValueError(f"calibration: needs at least 8 measured steps, got {len(samples)}")
    feats = [f for f, _ in samples]
    t = np.array([s for _, s in samples], dtype=np.float64)
    if not (t > 0).all():
        raise ValueError("calibration: every measured step time must be > 0")
    P, B = base.peak_flops, base.peak_bandwidth
    cols = {
        "step_overhead_s": np.ones(len(t)),
        "per_seq_s": np.array([f.seqs for f in feats], dtype=np.float64),
        "per_prefill_seq_s": np.array([f.prefill_seqs for f in feats], dtype=np.float64),
        "prefill_step_s": np.array([1.0 if f.prefill_seqs else 0.0 for f in feats]),
        "per_new_prompt_token_s": np.array([f.new_prompt_tokens for f in feats], dtype=float),
        "per_solo_seq_s": np.array([f.solo_seqs for f in feats], dtype=float),
        "per_token_s": np.array([f.tokens for f in feats], dtype=np.float64),
        "per_sampled_row_s": np.array([f.sampled_rows for f in feats], dtype=np.float64),
        "prefill_attention": np.array(
            [f.prefill_attention_flops - f.context_attention_flops for f in feats]
        )
        / P,
        "context_attention": np.array([f.context_attention_flops for f in feats]) / P,
        "decode_kv": np.array([f.decode_kv_bytes + f.compact_bytes for f in feats]) / B,
        "first_touch_s_per_byte": np.array([f.first_touch_bytes for f in feats]),
        "new_shape_s": np.array([f.new_shape for f in feats], dtype=np.float64),
    }
    known = np.zeros(len(t))  # seconds of measured terms, not fitted
    if first_touch_s_per_byte is not None:
        known = known + cols.pop("first_touch_s_per_byte") * first_touch_s_per_byte
    lin = np.array([f.linear_flops for f in feats]) / P
    large = np.array([bool(base.large_step_tokens) and f.tokens >= base.large_step_tokens
                      for f in feats])  # fmt: skip
    if large.any():  # compute-bound: no weight-read floor
        cols["gemm_large"] = np.where(large, lin, 0.0)
        lin = np.where(large, 0.0, lin)
    names = list(cols)
    used = [n for n in names if cols[n].any()]
    wt = 1.0 / t  # relative error
    # The device terms are in units of their peak time, and no term beats its peak: their
    # coefficients are 1 + a non-negative excess (efficiency <= 1).
    floors = dict.fromkeys(PHYSICAL, 1.0)
    floors["gemm_large"] = P / large_peak_flops if large_peak_flops else 1.0
    floor = np.array([floors.get(n, 0.0) for n in used] + [1.0])
    best: tuple[float, np.ndarray, float] | None = None
    small = lin[~large] if (~large).any() else lin
    knees = np.unique(np.quantile(small, np.linspace(0.0, 1.0, 41)))
    for knee in np.concatenate(([0.0], knees)):
        hinge = np.where(large, 0.0, np.maximum(lin, knee))
        a = np.column_stack([cols[n] for n in used] + [hinge]) * wt[:, None]
        scale = np.abs(a).max(axis=0)
        scale[scale == 0] = 1.0
        rhs = np.ones(len(t)) - known * wt - a @ floor
        x = _nnls(a / scale, rhs) / scale + floor
        loss = float(np.sum((a @ x + known * wt - 1.0) ** 2))
        if best is None or loss < best[0]:
            best = (loss, x, float(knee))
    assert best is not None
    _, x, knee = best
    coef = dict(zip(used, x[:-1], strict=True))
    gemm_inv = x[-1]
    p = Profile(**{**base.to_json(), "calibration": {}})
    p.step_overhead_s = float(coef.get("step_overhead_s", 0.0))
    p.per_seq_s = float(coef.get("per_seq_s", 0.0))
    p.per_prefill_seq_s = float(coef.get("per_prefill_seq_s", 0.0))
    p.prefill_step_s = float(coef.get("prefill_step_s", 0.0))
    p.per_new_prompt_token_s = float(coef.get("per_new_prompt_token_s", 0.0))
    if "per_solo_seq_s" in used:  # measured only when the calibration ran a retention policy
        p.per_solo_seq_s = float(coef["per_solo_seq_s"])
    p.per_token_s = float(coef.get("per_token_s", 0.0))
    p.per_sampled_row_s = float(coef.get("per_sampled_row_s", 0.0))
    p.first_touch_s_per_byte = (
        first_touch_s_per_byte
        if first_touch_s_per_byte is not None
        else float(coef.get("first_touch_s_per_byte", 0.0))
    )
    p.new_shape_s = float(coef.get("new_shape_s", 0.0))
    # max(F / (P e_g), W / (B e_w)) is the hinge a max(F, knee): e_g = 1 / a, and the weight
    # read takes a x knee seconds.
    p.gemm_efficiency = 1.0 / gemm_inv if gemm_inv > 0 else UNSEEN
    floor = knee * gemm_inv
    p.weight_read_efficiency = shape.weight_bytes / (B * floor) if floor > 0 else UNSEEN
    for name, attr in (
        ("prefill_attention", "prefill_attention_efficiency"),
        ("context_attention", "context_attention_efficiency"),
        ("decode_kv", "decode_kv_efficiency"),
        ("gemm_large", "gemm_efficiency_large"),
    ):
        c = coef.get(name, 0.0)
        if name in used:  # exercised: a zero coefficient means too cheap to see
            setattr(p, attr, 1.0 / c if c > 0 else UNSEEN)
    if "context_attention" not in used and "prefill_attention" in used:
        p.context_attention_efficiency = p.prefill_attention_efficiency  # no chunk had any
    # A relative-error fit under-predicts the mean of right-skewed step times (a noisy step
    # is slower, never faster); the simulated clock is a sum of steps, so scale every term
    # to make the summed time exact.
    pred = np.array([p.step_time(f, shape) for f in feats])
    r = float(t.sum() / pred.sum())
    for name in SECONDS_FIELDS:
        setattr(p, name, getattr(p, name) * r)
    for name in EFFICIENCY_FIELDS:
        if getattr(p, name) != UNSEEN:  # the marker stays recognisable in the profile
            setattr(p, name, getattr(p, name) / r)
    pred *= r
    rel = np.abs(pred - t) / t
    report = FitReport(
        steps=len(t),
        median_abs_error=float(np.median(rel)),
        p90_abs_error=float(np.quantile(rel, 0.9)),
        total_time_error=float(pred.sum() / t.sum() - 1.0),
        knee_flops=knee * P,
        squared_error=float(np.sum(rel**2)),
    )
    return p, report
