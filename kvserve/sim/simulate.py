"""The engine with a cost model for a forward pass and a virtual clock for time.

Nothing here schedules: :class:`~kvserve.engine.LLMEngine` is built exactly as ``kvserve
serve`` builds it (same flags, same :class:`~kvserve.sched.scheduler.Scheduler`, same
:class:`~kvserve.kv.manager.KVCacheManager`, admission, retention and workload classes), with
a :class:`CostModelRunner` in place of the model. The runner advances the clock by the step's
modelled time and returns one placeholder token per sampled row, so the scheduler's decisions
(batches, prefix hits, preemptions, refusals) are the real ones; only the step time is
modelled. Outputs are assumed to run to their requested length (``ignore_eos``, as ``kvserve
bench`` sends by default): a cost model cannot know when a model would stop.

The load is replayed as ``kvserve bench`` applies it to the in-process engine: open loop at
the bench's seeded arrival times (with an optional in-flight cap), or a closed loop of N
users; requests are accepted between steps; warm-up requests run first, one at a time. The
records and snapshots it returns are the bench's own types, so ``summarize`` and the report
code are shared and a simulated report reads like a measured one.
"""

from __future__ import annotations

import gc
import hashlib
import heapq
import math
import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from itertools import chain
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from kvserve.bench.forks import fork_iter, fork_map
from kvserve.bench.metrics import RequestRecord
from kvserve.bench.report import RecordEncoder
from kvserve.bench.runner import LoadSpec, RunResult
from kvserve.bench.workloads import (
    BenchRequest,
    WorkloadSpec,
    arrival_times,
    check_workload_spec,
    iter_workload,
)
from kvserve.config import CacheConfig
from kvserve.config_fields import default_of
from kvserve.connectors.base import KVConnectorOutput
from kvserve.connectors.offload import OffloadMeta
from kvserve.engine import LLMEngine
from kvserve.engine.offload import LOAD_TIMEOUTS
from kvserve.llm import engine_config
from kvserve.plan.capacity import PlanError, capacity, load_arch, load_config
from kvserve.plan.gpus import GPU
from kvserve.sched.output import ModelRunnerOutput, SchedulerOutput
from kvserve.sched.request import FINISHED_STATUSES, SamplingParams
from kvserve.sim.cost import ModelShape, Profile, ShapeCache, step_features
from kvserve.sim.fleet import IDLE, check_policy, routed_fleet
from kvserve.sim.pd import Feed, TraceFeed, check_roles, run_pd, transfer_config
from kvserve.sim.tiers import SERVER_TIERS, ModelledBlocks, SimOffload, modelled_tiers


class VirtualClock:
    """Seconds that pass only when told to."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class CostModelRunner:
    """A runner whose step takes the cost model's time and samples a placeholder token."""

    def __init__(self, profile: Profile, clock: VirtualClock, token_id: int) -> None:
        self.profile = profile
        self.clock = clock
        self.token_id = token_id
        self.shape: ModelShape | None = None  # set once the engine has resolved its formats
        self.busy_s = 0.0
        self.steps = 0
        self.sampled = 0  # tokens the last step sampled (each streamed to a client)
        self.fresh = True  # no request yet: the first pays the profile's first-request term
        # Behind a proxy or router: the profile's hop terms apply too (SimTarget.hop)
        self.hop = False
        self.block_size = default_of(CacheConfig, "block_size")  # the engine's, once built
        # Pool blocks written so far, for a profile that charges first writes (a CPU's)
        self.touched: set[int] | None = set() if profile.first_touch_s_per_byte else None
        # GEMM shapes whose state the backend holds, for a profile that charges a new one
        self.shapes = ShapeCache.of(profile) if profile.new_shape_s else None
        # Requests whose tier load the engine thread did (SimOffload's, with tiers)
        self.inline_loaded: set[str] = set()
        self._exports: list[tuple[list[bytes], ModelledBlocks]] = []  # for the tiers

    def _offload_time(self, meta: OffloadMeta) -> float:
        """What the step spends on the offload connector's work: copying out the blocks bound
        for the tiers (evicted ones before the pass, written-through after; the tiers only
        count them), and the worker's loads (those loaded inline were paid for by the step
        that asked: SimOffload)."""
        dt = 0.0
        for blocks in (meta.saves_before, meta.saves_after):
            if blocks:
                self._exports.append(([h for _, h in blocks], ModelledBlocks(len(blocks))))
        exported = len(meta.saves_before) + len(meta.saves_after)
        if exported:
            block_bytes = self.shape.kv_bytes_per_token * self.block_size
            dt += exported * block_bytes * self.profile.offload_export_s_per_byte
            dt += self.profile.worker_time(stored=exported)
        if meta.loads:
            inline = self.inline_loaded
            worked = sum(len(ids) for rid, ids in meta.loads.items() if rid not in inline)
            inline.difference_update(meta.loads)
            dt += self.profile.worker_time(loaded=worked)
        return dt

    # The offload connector's channel (what a worker answers through collective_rpc)
    def receive_kv_connector_payloads(self, payloads: Any) -> None:
        """Modelled loads carry no bytes: nothing to keep."""

    def take_kv_connector_payloads(self, complete: bool) -> Any:
        out, self._exports = self._exports, []
        return out

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        assert self.shape is not None, "the simulator sets the model shape before the first step"
        f = step_features(scheduler_output, self.shape, self.touched, self.block_size)
        if self.shapes is not None:
            self.shapes.mark(f)
        dt = self.profile.step_time(f, self.shape)
        ids = [rid for s in scheduler_output.seqs for rid in s.sample_ids]
        self.sampled = len(ids)
        out = ModelRunnerOutput(ids, [self.token_id] * len(ids), [None] * len(ids))
        meta = scheduler_output.kv_connector_metadata
        if isinstance(meta, OffloadMeta):
            dt += self._offload_time(meta)
            if self._exports:
                out.kv_connector_output = KVConnectorOutput(num_payloads=len(self._exports))
        self.clock.advance(dt)
        self.busy_s += dt
        self.steps += 1
        return out


# ASCII as HashTokenizer's pattern splits it: word characters (\w), whitespace (\s, what
# str.split() splits on), and the rest, each of which is a piece of its own.
_ASCII = [chr(i) for i in range(128)]
_ASCII_OTHER = "".join(c for c in _ASCII if not (c.isalnum() or c == "_" or c.isspace()))
_OTHER_TO_SPACE = str.maketrans(_ASCII_OTHER, " " * len(_ASCII_OTHER))
_ONLY_OTHER = str.maketrans("", "", "".join(c for c in _ASCII if c not in _ASCII_OTHER))
_MAX_WORDS = 1 << 16  # whitespace-separated words whose ids HashTokenizer remembers


class HashTokenizer:
    """Tokens for a model given by ``config.json`` alone: one token per word or punctuation
    mark, its id a stable hash into the vocabulary. Equal text gives equal ids (so shared
    prefixes hit the prefix cache as they would with the real tokenizer); lengths are what
    the workload asked for, in these tokens."""

    _PIECES = re.compile(r"\w+|[^\w\s]")

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._ids: dict[str, int] = {}
        self._word_ids: dict[str, tuple[int, ...]] = {}

    def encode(self, text: str) -> list[int]:
        # Pieces never span whitespace (\s and str.split() agree on it), so the text's ids
        # are its whitespace-separated words' ids in order; filler text repeats a few
        # hundred words, each looked up once here (up to _MAX_WORDS remembered).
        words = text.split()
        ids = list(map(self._word_ids.get, words))
        try:
            return list(chain.from_iterable(ids)) or [3]
        except TypeError:  # a word not seen yet (None): no scan for it in the common case
            pass
        for i, got in enumerate(ids):
            if got is None:
                got = ids[i] = tuple(map(self._id, self._PIECES.findall(words[i])))
                if len(self._word_ids) < _MAX_WORDS:
                    self._word_ids[words[i]] = got
        return list(chain.from_iterable(ids)) or [3]

    def _id(self, piece: str) -> int:
        tid = self._ids.get(piece)
        if tid is None:
            digest = hashlib.blake2b(piece.encode(), digest_size=8).digest()
            tid = 3 + int.from_bytes(digest, "little") % (self.vocab_size - 3)
            self._ids[piece] = tid
        return tid

    def count(self, text: str) -> int:
        """len(encode(text)) without hashing anything. ASCII text (the workloads' filler) is
        counted with two translations and a split, a few times faster than the pattern: its
        pieces are the runs of word characters left when every other non-space character
        becomes a space, plus one per such character."""
        if text.isascii():
            return max(1, len(text.translate(_OTHER_TO_SPACE).split())
                       + len(text.translate(_ONLY_OTHER)))  # fmt: skip
        return max(1, len(self._PIECES.findall(text)))


@dataclass(slots=True)
class SimTarget:
    """What is simulated: engine flags (``LLM``'s keyword arguments), the device profile and,
    for an accelerator, the GPU whose memory sizes the pool as ``kvserve plan`` does."""

    engine_kwargs: dict[str, Any]
    profile: Profile
    gpu: GPU | None = None
    tp: int = 1
    replicas: int = 1
    gpu_memory_utilization: float = 0.9
    label: str = "simulated engine"
    # How requests are dealt to the replicas: a policy of kvserve.router.policies, or
    # "oracle" (each engine's pool asked directly); see kvserve.sim.fleet.
    router: str = "round_robin"
    # Disaggregated prefill/decode (kvserve.sim.pd): replicas of each role (0: colocated
    # engines), and the decode side's pull rate in bytes/s.
    prefill_replicas: int = 0
    decode_replicas: int = 0
    kv_transfer_bandwidth: float | None = None
    # Whether clients reach the engines through a proxy or router (the profile's hop terms);
    # None: behind one when there is more than one engine (kvserve proxy, kvserve router).
    behind_hop: bool | None = None

    def __post_init__(self) -> None:
        for name in ("tp", "replicas"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}: must be an integer >= 1, got {v!r}")
        check_roles(self)
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization: must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        check_policy(self.router)
        if self.tp > 1 and self.gpu is None:
            raise ValueError("tp: tensor parallelism is simulated on a --gpu only")

    @property
    def disaggregated(self) -> bool:
        return self.prefill_replicas > 0

    @property
    def hop(self) -> bool:
        if self.behind_hop is not None:
            return self.behind_hop
        return self.disaggregated or self.replicas > 1

    @property
    def gpus(self) -> int:
        n = self.prefill_replicas + self.decode_replicas if self.disaggregated else self.replicas
        return self.tp * n


@dataclass(slots=True)
class SimEngine:
    """One simulated replica."""

    engine: LLMEngine
    clock: VirtualClock
    runner: CostModelRunner
    shape: ModelShape
    encode: Callable[[str], list[int]]
    num_blocks: int
    notes: list[str] = field(default_factory=list)
    offload: SimOffload | None = None  # the modelled tiers, with --kv-offload-*


def model_dir_of(model: str) -> str:
    """A model directory from a directory or a bare ``config.json`` path (no weights needed)."""
    p = Path(model)
    if p.is_file() and p.name.endswith(".json"):
        return str(p.parent)
    return model


def build_engine(target: SimTarget) -> SimEngine:
    """The real engine over a cost-model runner and a virtual clock. Raises ConfigError or
    PlanError naming the field for a config the engine or the planner cannot use."""
    kw = dict(target.engine_kwargs)
    kw["model"] = model_dir_of(str(kw["model"]))
    try:
        cfg, _ = load_config(kw["model"])
        spec = load_arch(kw["model"])
    except FileNotFoundError as e:
        raise PlanError(str(e)) from None
    except (ValueError, KeyError, TypeError) as e:
        raise PlanError(f"config.json: the planner cannot read it ({e})") from None
    if (
        target.gpu is not None
        and kw.get("num_gpu_blocks") is None
        and not kw.get("kv_cache_memory")
    ):
        # The pool a GPU holds, exactly as `kvserve plan` counts it.
        # KV "auto" follows the compute dtype, as in the engine: --dtype when given.
        wdt = None if kw.get("dtype") in (None, "auto") else kw["dtype"]
        fmt = kw.get("kv_cache_dtype") or "auto"
        fmt = (wdt or spec.kv_dtype_auto) if fmt == "auto" else fmt
        block_size = kw.get("block_size", default_of(CacheConfig, "block_size"))
        cap = capacity(
            spec, fmt, target.gpu.memory_bytes, spec.max_position_embeddings, 1, target.tp,
            target.gpu_memory_utilization, block_size, wdt,
        )  # fmt: skip
        if cap.num_blocks < 1:
            raise PlanError(
                f"gpu: the weights ({cap.weight_bytes_per_gpu / 2**30:.1f} GiB per GPU) leave "
                f"no KV room on {target.gpu.name} at tp={target.tp}; raise --tp"
            )
        kw["num_gpu_blocks"] = cap.num_blocks
    clock = VirtualClock()
    runner = CostModelRunner(target.profile, clock, token_id=0)
    config = engine_config(**kw)
    if config.cache.kv_cache_prefault:
        runner.touched = None  # every page was faulted in at start
    offload = None
    if config.cache.kv_offload:
        tiers = modelled_tiers(config.cache, target.profile)
        offload = SimOffload(tiers, clock, LOAD_TIMEOUTS * config.cache.kv_offload_timeout,
                             target.profile.inline_host_loads)  # fmt: skip
        runner.inline_loaded = offload.inline_loaded
    engine = LLMEngine(config, runner=runner, clock=clock, offload=offload)
    # The placeholder token: any id that is not an end of sequence.
    runner.token_id = next(i for i in range(3, spec.vocab_size) if i not in engine.eos_token_ids)
    dtype = str(engine.dtype).removeprefix("torch.")
    shape = ModelShape.from_arch(
        spec, engine.kv_cache_dtype, dtype, bool(cfg.get("tie_word_embeddings")), target.tp
    )
    runner.shape = shape
    runner.block_size = engine.block_size
    runner.hop = target.hop
    if offload is not None:
        offload.set_geometry(shape.kv_bytes_per_token * engine.block_size, target.tp)
    notes = []
    if target.gpu is not None and dtype != target.profile.dtype:
        notes.append(
            f"the engine computes in {dtype} but the profile's peaks are for "
            f"{target.profile.dtype}; pass --dtype {target.profile.dtype}"
        )
    if engine.tokenizer is not None:
        encode = engine.tokenizer.encode
    else:
        encode = HashTokenizer(spec.vocab_size).encode
        notes.append("no tokenizer.json beside the config: one token per word (hashed ids)")
    if target.profile.calibration and not target.profile.serving_measured:
        notes.append("the profile has no serving-overhead term (calibrated without --serving):"
                     " the HTTP front end and any proxy/router hop cost nothing here")  # fmt: skip
    return SimEngine(engine, clock, runner, shape, encode, engine.num_blocks, notes, offload)


def token_counter(target: SimTarget) -> tuple[Callable[[str], int], int]:
    """(token counter, max model length) the workload generator needs, from a simulated
    engine built for the purpose (its tokenizer, or the hashed one)."""
    count, _, max_len = _text_tools(target)
    return count, max_len


def _text_tools(
    target: SimTarget,
) -> tuple[Callable[[str], int], Callable[[str], list[int]], int]:
    """(token counter, encoder, max model length) of ``target``'s simulated engine."""
    sim = build_engine(target)
    encode = sim.encode
    tok = getattr(encode, "__self__", None)
    count = tok.count if isinstance(tok, HashTokenizer) else (lambda s: len(encode(s)))
    return count, encode, sim.engine.max_model_len


class EncodedWorkload(Sequence[BenchRequest]):
    """A workload made and tokenized in another process while the replay consumes it
    (:func:`stream_workload`): request ``i`` is taken from the producer when first asked
    for, with its prompt's token ids, which the replay takes instead of encoding again."""

    def __init__(self, items: Iterator[tuple[BenchRequest, list[int]]], n: int) -> None:
        self._items = items
        self._n = n
        self._reqs: list[BenchRequest] = []
        self._ids: list[list[int] | None] = []

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i: int) -> BenchRequest:  # type: ignore[override]
        if not 0 <= i < self._n:
            raise IndexError(i)
        while len(self._reqs) <= i:
            req, ids = next(self._items)
            self._reqs.append(req)
            self._ids.append(ids)
            if len(self._reqs) == self._n:  # the producer's end: it exits, and is reaped
                for _ in self._items:
                    raise RuntimeError(f"the workload made more than its {self._n} requests")
        return self._reqs[i]

    def token_ids(self, i: int) -> list[int]:
        """Request ``i``'s prompt ids, handed over once (the engine keeps its own)."""
        self[i]
        ids = self._ids[i]
        if ids is None:
            raise RuntimeError(f"request {i}'s token ids were already taken")
        self._ids[i] = None
        return ids


def stream_workload(target: SimTarget, spec: WorkloadSpec) -> EncodedWorkload:
    """``make_workload(spec, token_counter(target)[0])``, tokenized as ``target``'s engine
    encodes prompts, made in a forked process while this one replays it: on a machine with
    a core to spare, a long trace's text costs the replay little instead of running first.
    A spec error is raised here; a prompt too long for ``spec.max_model_len`` when the
    replay reaches it."""
    check_workload_spec(spec)

    def make() -> Iterator[tuple[BenchRequest, list[int]]]:
        count, encode, _ = _text_tools(target)
        for r in iter_workload(spec, count):
            yield r, encode(r.prompt)

    return EncodedWorkload(fork_iter(make), spec.num_prompts)


class _Replica:
    """Replays a share of the load on one simulated engine."""

    def __init__(
        self,
        sim: SimEngine,
        temperature: float,
        sample_every: float,
        on_done: Callable[[bool], None] | None = None,
    ) -> None:
        self.sim = sim
        self.on_done = on_done
        self.sink: RecordEncoder | None = None  # hears each final record (with t0)
        self._t0 = 0.0
        self.temperature = temperature
        self.sample_every = sample_every
        self.samples: list[dict[str, float]] = []
        self._next_sample = 0.0
        self._params: dict[int, SamplingParams] = {}  # by max_tokens
        self._sent = 0
        self.records: list[RequestRecord] = []
        # Fed by a router (kvserve.sim.fleet): more requests may come while ``open``; each
        # final record is reported to ``on_finish`` (its index in the share); prompts come
        # already tokenized (``routed_ids``, by index).
        self.open = False
        self.on_finish: Callable[[int], None] | None = None
        self.routed_ids: dict[int, list[int]] = {}
        self.on_send: Callable[[str, int], None] | None = None  # (engine's id, share index)
        self._due: list[tuple[float, int]] = []
        # The HTTP front end (the profile's serving request terms): one event loop, so the
        # requests sent to it pass through it one at a time, each joining the engine when
        # the front end is done with it: (ready at, send order, engine id, index, ids).
        self._front: list[tuple[float, int, str, int, list[int] | None]] = []
        self._front_free = -math.inf

    def _add(
        self,
        rid: str,
        req: BenchRequest,
        rec: RequestRecord,
        ids: list[int] | None = None,
        serving: float = 0.0,
    ) -> bool:
        """Hand ``req`` to the engine (``ids``: its prompt already tokenized); ``serving``:
        the front end's seconds for it that the engine's steps lost."""
        eng, clock = self.sim.engine, self.sim.clock
        if ids is None:
            ids = self.sim.encode(req.prompt)
        params = self._params.get(req.max_tokens)
        if params is None:  # requests share them (the engine never changes a request's)
            params = self._params[req.max_tokens] = SamplingParams(
                temperature=self.temperature, max_tokens=req.max_tokens, ignore_eos=True
            )
        runner = self.sim.runner
        if runner.fresh:
            serving += runner.profile.serve_first_request_s
            runner.fresh = False
        clock.advance(runner.profile.request_time(len(ids)) + serving)
        try:
            eng.add_request(rid, {"prompt_token_ids": ids}, params, arrival_time=rec.send_time)
        except Exception as e:  # noqa: BLE001 - refused requests are counted, as bench does
            rec.fail(f"refused ({type(e).__name__})", str(e))
            return False
        return True

    def run(
        self,
        requests: Sequence[BenchRequest],
        sends: list[float] | None,
        concurrency: int | None,
        t0: float,
    ) -> list[RequestRecord]:
        """Send ``requests`` at ``t0 + sends[i]`` (open loop; None: closed loop of
        ``concurrency`` users), at most ``concurrency`` in flight; step until all finish."""
        for _ in self.steps(requests, sends, concurrency, t0):
            pass
        return self.records

    def steps(
        self,
        requests: Sequence[BenchRequest],
        sends: list[float] | None,
        concurrency: int | None,
        t0: float,
    ) -> Iterator[None]:
        """:meth:`run` one iteration at a time (a step, or the clock moved to an arrival):
        it yields before each, so a fleet whose replicas share a tier can always advance the
        replica furthest behind in time. The records are in ``self.records``."""
        eng, clock, offload = self.sim.engine, self.sim.clock, self.sim.offload
        core = eng.core
        runner = self.sim.runner
        loop_gap = runner.profile.loop_gap_s  # the serving loop's time between steps
        self._t0 = t0
        # Each record is made when its request is sent (a streamed workload's requests
        # arrive while the replay runs); every request is sent before this ends.
        self.records = records = [None] * len(requests)  # type: ignore[list-item]
        due: list[tuple[float, int]] = []  # (send time, index) not yet sent
        if sends is None:
            due = [(t0, i) for i in range(min(concurrency or 1, len(requests)))]
            queued = list(range(len(due), len(requests)))[::-1]  # closed loop: next users
        else:
            due = [(t0 + s, i) for i, s in enumerate(sends)]
            queued = []
        heapq.heapify(due)
        self._due = due
        cap = concurrency if concurrency else math.inf
        inflight: dict[str, int] = {}
        backlog: list[int] = []  # arrived, waiting for an in-flight slot
        idle_steps = 0

        def send(i: int, when: float) -> None:
            if not self._send(i, when, requests, records, inflight) and sends is None and queued:
                heapq.heappush(due, (when, queued.pop()))  # refused: the user sends the next

        front = self._front

        def next_arrival() -> float:
            return min(due[0][0] if due else math.inf, front[0][0] if front else math.inf)

        while due or backlog or inflight or front or self.open:
            yield
            while backlog and len(inflight) < cap:  # a slot freed at the last step's end
                send(backlog.pop(0), clock.now)
            while due and due[0][0] <= clock.now:
                # Sent at its time, while the engine was busy: it waits for the step to end,
                # as the bench's request waits in the engine thread's inbox.
                when, i = heapq.heappop(due)
                if len(inflight) < cap:
                    send(i, when)
                else:
                    backlog.append(i)
            while front and front[0][0] <= clock.now:
                # Through the front end: the engine's steps lost its time if any ran.
                _, _, rid, i, ids = heapq.heappop(front)
                busy = core.has_unfinished_requests()
                share = self.sim.runner.profile.serve_request_share
                charge = share * self._serving_cost() if busy else 0.0
                if not self._add(rid, requests[i], records[i], ids, charge):
                    inflight.pop(rid, None)
                    self._done(i, records[i])
                    if sends is None and queued:
                        heapq.heappush(due, (clock.now, queued.pop()))
            if not core.has_unfinished_requests():
                # Every finish comes back from a step; a family gone without one is a bug
                # elsewhere, recorded rather than waited for (checked only when idle).
                waiting = {rid for _, _, rid, _, _ in front}
                for fam in [f for f in inflight if f not in waiting]:
                    i = inflight.pop(fam)
                    records[i].fail("lost", "the engine dropped the request without a result")
                    self._done(i, records[i])
                    if sends is None and queued:
                        heapq.heappush(due, (clock.now, queued.pop()))
                if due or front:
                    clock.now = max(clock.now, next_arrival())
                    continue
                if not backlog:
                    if self.open:
                        yield IDLE  # nothing to do until the router sends more
                        continue
                    break
            before = core.num_steps
            ran = runner.steps
            updated = core.step()
            if runner.steps > ran:
                # The front end streams the step's tokens (and the hop relays them) on the
                # engine's cores before its next step: stamped tokens stay as they were.
                clock.advance(runner.profile.serving_step_time(runner.sampled, runner.hop))
            self._sample(eng)
            if core.num_steps == before and not updated:
                idle_steps += 1
                if idle_steps > 1000:
                    raise RuntimeError(
                        "simulator: the scheduler made no progress for 1000 steps with "
                        f"{len(inflight)} requests in flight"
                    )
                # Idle until the next arrival, unless a tier load lands first: the engine
                # waited for it (a little at a time) in the step, so the clock moved.
                if (due or front) and not (offload is not None and offload.num_loading):
                    clock.now = max(clock.now, next_arrival())
                continue
            idle_steps = 0
            if loop_gap and core.has_unfinished_requests():
                clock.advance(loop_gap)  # before the next step of a busy engine
            for r in updated:
                if r.status not in FINISHED_STATUSES:
                    continue
                fam = r.parent_id
                if fam not in inflight or core.families.get(fam):
                    continue
                i = inflight.pop(fam)
                _fill(records[i], r)
                self._done(i, records[i])
                if sends is None and queued:  # the user sends its next request now
                    heapq.heappush(due, (clock.now, queued.pop()))

    def push(self, share: list[BenchRequest], req: BenchRequest, ids: list[int],
             when: float) -> None:  # fmt: skip
        """A router's request for this replica, sent at ``when`` (it joins ``share``, the
        list :meth:`steps` replays)."""
        i = len(share)
        share.append(req)
        self.records.append(None)  # type: ignore[arg-type]
        self.routed_ids[i] = ids
        heapq.heappush(self._due, (when, i))

    def _done(self, i: int, rec: RequestRecord) -> None:
        """Record ``i`` is final (its send time still on the replay's clock)."""
        if self.sink is not None:
            self.sink.add(i, rec, self._t0)
        if self.on_done is not None:
            self.on_done(rec.success)
        if self.on_finish is not None:
            self.on_finish(i)

    def _send(
        self,
        i: int,
        when: float,
        requests: Sequence[BenchRequest],
        records: list[RequestRecord],
        inflight: dict[str, int],
    ) -> bool:
        """Send request ``i``; False when the engine refused it at once (counted as done)."""
        r = requests[i]
        records[i] = rec = RequestRecord(r.index, r.kind, r.prefix_group, r.input_len,
                                         r.max_tokens)  # fmt: skip
        rec.send_time = when
        self._sent += 1
        rid = f"sim-{self._sent}"
        if self.on_send is not None:
            self.on_send(rid, i)
        ids = self.routed_ids.pop(i, None)
        if ids is None and isinstance(requests, EncodedWorkload):
            ids = requests.token_ids(i)
        cost = self._serving_cost()
        if cost:  # through the front end first, one request at a time
            ready = max(when, self._front_free) + cost
            self._front_free = ready
            heapq.heappush(self._front, (ready, self._sent, rid, i, ids))
            inflight[rid] = i
            return True
        if self._add(rid, r, rec, ids):
            inflight[rid] = i
            return True
        self._done(i, rec)
        return False

    def _serving_cost(self) -> float:
        runner = self.sim.runner
        return runner.profile.serving_request_time(runner.hop)

    def _sample(self, eng: LLMEngine) -> None:
        if self.sim.clock.now >= self._next_sample:
            from kvserve.bench.engine_target import engine_snapshot

            self.samples.append(engine_snapshot(eng))
            self._next_sample = self.sim.clock.now + self.sample_every


def _fill(rec: RequestRecord, r: Any) -> None:
    """A finished request's record from the engine's own timestamps (virtual seconds)."""
    m = r.metrics
    rec.prompt_tokens = len(r.prompt_token_ids)
    rec.output_tokens = r.num_output_tokens
    rec.cached_tokens = max(0, r.num_cached_tokens)
    rec.finish_reason = r.status.value
    rec.workload_class = r.workload_class.name if r.workload_class is not None else None
    if m.first_scheduled_time is not None:
        rec.queue_time = m.first_scheduled_time - m.arrival_time
    if r.refusal is not None:
        rec.fail(f"refused ({r.refusal.reason})", "admission control refused it")
        return
    if not m.token_times:
        rec.fail("aborted", f"finished as {r.status.value} without a token")
        return
    rec.succeed(m.token_times)


def simulate_load(
    target: SimTarget,
    requests: Sequence[BenchRequest],
    load: LoadSpec,
    seed: int = 0,
    warmup: list[BenchRequest] | None = None,
    temperature: float = 0.0,
    sample_every: float = 0.5,
    progress: Callable[[bool], None] | None = None,
    jobs: int = 1,
    records_to: RecordEncoder | None = None,
) -> tuple[RunResult, list[SimEngine] | list[ReplicaInfo]]:
    """Replay ``requests`` under ``load`` on ``target.replicas`` simulated engines (requests
    dealt round-robin, as a load balancer would) and collect one record each.

    Replicas that share nothing run one after another, or with ``jobs`` > 1 side by side in
    forked processes (:mod:`kvserve.bench.forks`) with the same results; each then reports a
    :class:`ReplicaInfo` instead of its engine, and ``progress`` hears of its requests when
    it ends. Replicas behind one Redis tier share it and run on one timeline
    (:func:`_run_fleet`). A lone replica takes ``requests`` as it sends them, so a
    :class:`EncodedWorkload` is made while it runs, and hands each final record to
    ``records_to`` (encoded for the JSON report while it runs)."""
    if records_to is not None and target.replicas != 1:
        raise ValueError(
            f"records_to: only a lone replica's records are encoded as it runs, "
            f"not {target.replicas} replicas'"
        )
    offsets = (
        None
        if load.closed_loop
        else arrival_times(len(requests), load.request_rate, load.burstiness, seed)
    )

    trace = _Trace(requests, load, offsets, warmup, temperature, sample_every, records_to)
    if target.disaggregated:
        if records_to is not None:
            raise ValueError("records_to: a disaggregated run's records are made at its end")
        feed = TraceFeed(requests, offsets, load.concurrency)
        return run_disaggregated(target, trace, feed, progress)

    def one(k: int, report: Callable[[bool], None] | None) -> _ReplicaRun:
        return _run_replica(target, trace, k, report)

    if target.replicas > 1 and target.router != "round_robin":
        runs = _run_routed(target, trace, progress)
    elif target.replicas > 1 and shares_tiers(target):
        runs = _run_fleet(target, trace, progress)
    elif jobs > 1 and target.replicas > 1:
        runs = fork_map(lambda k: one(k, None).detached(), range(target.replicas), jobs)
        if progress is not None:
            for run in runs:
                for _, rec in run.records:
                    progress(rec.success)
    else:
        runs = [one(k, progress) for k in range(target.replicas)]
    records: list[RequestRecord | None] = [None] * len(requests)
    before: dict[str, float] = {}
    after: dict[str, float] = {}
    samples: list[dict[str, float]] = []
    for run in runs:
        _merge(before, run.before, target.replicas)
        _merge(after, run.after, target.replicas)
        for i, r in run.records:
            records[i] = r
        samples += run.samples
    end = max(run.duration for run in runs)
    done = [r for r in records if r is not None]
    return RunResult(done, max(end, 1e-9), before, after, samples), [run.sim for run in runs]


@dataclass(slots=True)
class ReplicaInfo:
    """What a replica simulated in another process reports besides its records: the
    figures a report reads from a :class:`SimEngine` (``runner.steps``, ``runner.busy_s``)."""

    num_blocks: int
    notes: list[str]
    runner: Any


@dataclass(slots=True)
class _ReplicaRun:
    sim: SimEngine | ReplicaInfo
    records: list[tuple[int, RequestRecord]]  # (index in the trace, record)
    before: dict[str, float]
    after: dict[str, float]
    samples: list[dict[str, float]]
    duration: float

    def detached(self) -> _ReplicaRun:
        """The same run without its engine, to cross a process boundary."""
        s = self.sim
        runner = SimpleNamespace(steps=s.runner.steps, busy_s=s.runner.busy_s)
        info = ReplicaInfo(s.num_blocks, list(s.notes), runner)
        return _ReplicaRun(info, self.records, self.before, self.after, self.samples,
                           self.duration)  # fmt: skip


@dataclass(slots=True)
class _Trace:
    """What every replica of a run replays: the requests, the load and its send offsets
    (None: closed loop), the warm-up requests and the sampling settings."""

    requests: Sequence[BenchRequest]
    load: LoadSpec
    offsets: list[float] | None
    warmup: list[BenchRequest] | None
    temperature: float
    sample_every: float
    sink: RecordEncoder | None = None  # a lone replica's final records, as they are made


@dataclass(slots=True)
class _Share:
    """One replica's part of the trace, warmed up and ready to replay step by step."""

    sim: SimEngine
    rep: _Replica
    mine: list[int]  # indices in the trace
    t0: float
    before: dict[str, float]
    steps: Iterator[None]
    share: list[BenchRequest] = field(default_factory=list)  # a routed replica's, as fed


def _prepare(
    sim: SimEngine,
    target: SimTarget,
    trace: _Trace,
    k: int,
    progress: Callable[[bool], None] | None,
    routed: bool = False,
) -> _Share:
    """Replica ``k``'s share of the trace (every ``replicas``-th request from ``k``; none
    yet when ``routed``: a router feeds it), after its warm-up requests, one at a time."""
    from kvserve.bench.engine_target import engine_snapshot

    requests, load, offsets = trace.requests, trace.load, trace.offsets
    rep = _Replica(sim, trace.temperature, trace.sample_every)
    for w in trace.warmup or []:  # one at a time, as the bench warms up
        rep.run([w], [0.0], None, sim.clock.now)
    rep.on_done = progress
    rep.sink = trace.sink
    t0 = sim.clock.now
    rep._next_sample = t0
    before = engine_snapshot(sim.engine)
    mine = list(range(k, len(requests), target.replicas))
    share: Sequence[BenchRequest] = requests  # a lone replica's: taken as it is (streamed)
    sends = offsets
    if target.replicas > 1:
        share = [requests[i] for i in mine]
        sends = None if offsets is None else [offsets[i] for i in mine]
    cap = load.concurrency
    if cap is not None and target.replicas > 1:
        cap = max(1, math.ceil(cap / target.replicas))
    if routed:
        fed: list[BenchRequest] = []
        return _Share(sim, rep, [], t0, before, rep.steps(fed, [], cap, t0), fed)
    return _Share(sim, rep, mine, t0, before, rep.steps(share, sends, cap, t0))


def _finish(sh: _Share) -> _ReplicaRun:
    from kvserve.bench.engine_target import engine_snapshot

    recs = sh.rep.records
    for r in recs:
        r.send_time -= sh.t0
    return _ReplicaRun(sh.sim, list(zip(sh.mine, recs, strict=True)), sh.before,
                       engine_snapshot(sh.sim.engine), sh.rep.samples,
                       sh.sim.clock.now - sh.t0)  # fmt: skip


def _run_replica(
    target: SimTarget, trace: _Trace, k: int, progress: Callable[[bool], None] | None
) -> _ReplicaRun:
    """Replica ``k`` of a fleet that shares nothing: its engine, its share, what it measured."""
    sim = build_engine(target)
    with _no_collections():
        sh = _prepare(sim, target, trace, k, progress)
        for _ in sh.steps:
            pass
        return _finish(sh)


SHARED_TIERS = SERVER_TIERS  # a server every replica points at; host memory and disk are local


def shares_tiers(target: SimTarget) -> bool:
    """Whether the replicas of ``target`` share an offload tier (a Redis URL)."""
    return bool(target.engine_kwargs.get("kv_offload_redis"))


def _run_fleet(
    target: SimTarget, trace: _Trace, progress: Callable[[bool], None] | None
) -> list[_ReplicaRun]:
    """Replicas that share a tier (one Redis behind every replica, as ``kvserve serve
    --kv-offload-redis`` on each): one modelled tier object for all, and one timeline, the
    replica furthest behind in virtual time stepping next, so that a block one replica
    stores is a hit for another from the moment it was stored (to a step's resolution), and
    the server answers their loads one at a time, in the order they were asked."""
    sims = _fleet_engines(target)
    with _no_collections():
        shares = [_prepare(sim, target, trace, k, progress) for k, sim in enumerate(sims)]
        _start_shared_tiers(target, shares)
        ready = [(0.0, k) for k in range(len(shares))]
        while ready:
            _, k = heapq.heappop(ready)
            sh = shares[k]
            if next(sh.steps, _DONE) is _DONE:
                continue
            heapq.heappush(ready, (sh.sim.clock.now - sh.t0, k))
        return [_finish(sh) for sh in shares]


def _fleet_engines(target: SimTarget) -> list[SimEngine]:
    """The replicas' engines; those behind one Redis tier share one modelled tier object."""
    sims = [build_engine(target) for _ in range(target.replicas)]
    if not shares_tiers(target):
        return sims
    first = sims[0].offload
    for sim in sims[1:]:
        tiers = sim.offload.tiers  # type: ignore[union-attr]
        for i, tier in enumerate(tiers):
            if tier.name in SHARED_TIERS:
                tiers[i] = first.tiers[i]  # type: ignore[union-attr]
    return sims


def _start_shared_tiers(target: SimTarget, shares: list[_Share]) -> None:
    """The replay's timeline starts at each replica's end of warm-up (the warm-ups, one
    request at a time and not measured, leave a shared server idle)."""
    if not shares_tiers(target):
        return
    for sh in shares:
        sh.sim.offload.epoch = sh.t0  # type: ignore[union-attr]
        for tier in sh.sim.offload.tiers:  # type: ignore[union-attr]
            if tier.free_at is not None:
                tier.free_at = -math.inf


def _run_routed(
    target: SimTarget, trace: _Trace, progress: Callable[[bool], None] | None
) -> list[_ReplicaRun]:
    """Replicas behind ``target.router`` (:mod:`kvserve.sim.fleet`): one timeline, each
    request routed when it is sent, from the replicas' state then."""
    sims = _fleet_engines(target)
    requests = trace.requests

    def encode(req: BenchRequest, i: int) -> list[int]:
        if isinstance(requests, EncodedWorkload):
            return requests.token_ids(i)
        return sims[0].encode(req.prompt)

    with _no_collections():
        shares = [_prepare(sim, target, trace, k, progress, routed=True)
                  for k, sim in enumerate(sims)]  # fmt: skip
        _start_shared_tiers(target, shares)
        routed_fleet(shares, requests, trace.offsets, trace.load.concurrency, target.router,
                     encode)  # fmt: skip
        return [_finish(sh) for sh in shares]


def simulate_feed(
    target: SimTarget, feed: Feed, temperature: float = 0.0, sample_every: float = 0.5
) -> tuple[RunResult, list[SimEngine]]:
    """``feed``'s requests (:class:`kvserve.sim.pd.Feed`: who sends what when, such as a
    benchmark's own workload) on ``target``'s replicas, disaggregated or colocated."""
    trace = _Trace([], LoadSpec(), None, None, temperature, sample_every)
    return run_disaggregated(target, trace, feed)


def run_disaggregated(
    target: SimTarget,
    trace: _Trace,
    feed: Feed,
    progress: Callable[[bool], None] | None = None,
) -> tuple[RunResult, list[SimEngine]]:
    """``feed`` on ``target.prefill_replicas`` prefill and ``target.decode_replicas`` decode
    engines (:mod:`kvserve.sim.pd`), or on ``target.replicas`` colocated ones when
    ``target`` is not disaggregated (the same replay, to compare the two). Returns the
    records and the engines, prefill ones first."""
    if trace.offsets is not None and trace.load.concurrency is not None:
        raise ValueError("concurrency: an in-flight cap on an open loop (--concurrency "
                         "with --request-rate) is not modelled with "
                         "--prefill-replicas/--decode-replicas")  # fmt: skip
    n_pre = target.prefill_replicas
    n_dec = target.decode_replicas if target.disaggregated else target.replicas
    pre = [build_engine(target) for _ in range(n_pre)]
    dtarget = target
    if target.disaggregated:
        kw = {**target.engine_kwargs, "kv_transfer_config": transfer_config()}
        dtarget = replace(target, engine_kwargs=kw, prefill_replicas=0, decode_replicas=0,
                          kv_transfer_bandwidth=None, behind_hop=target.hop)  # fmt: skip
    dec = [build_engine(dtarget) for _ in range(n_dec)]
    for sim in dec if target.disaggregated else ():
        conn = sim.engine.connector
        conn.clock = sim.clock
        conn.bandwidth = float(target.kv_transfer_bandwidth)  # type: ignore[arg-type]
        conn.block_bytes = sim.shape.kv_bytes_per_token * sim.engine.block_size
        conn.import_s_per_byte = target.profile.offload_export_s_per_byte
        conn.touched = sim.runner.touched  # (the same set: a step's writes count too)
        conn.first_touch_s_per_byte = target.profile.first_touch_s_per_byte
    with _no_collections():
        shares = [_prepare(sim, target, trace, k, progress, routed=True)
                  for k, sim in enumerate(pre + dec)]  # fmt: skip
        for sh in shares[:n_pre]:
            sh.rep.on_done = None  # a request is done when its decode is
        records = run_pd(shares[:n_pre], shares[n_pre:], feed)
        runs = [_finish(sh) for sh in shares]
    n = len(runs)
    before: dict[str, float] = {}
    after: dict[str, float] = {}
    samples: list[dict[str, float]] = []
    for run in runs:
        _merge(before, run.before, n)
        _merge(after, run.after, n)
        samples += run.samples
    end = max(run.duration for run in runs)
    return RunResult(records, max(end, 1e-9), before, after, samples), pre + dec


_DONE = object()


@contextmanager
def _no_collections() -> Iterator[None]:
    """The replay allocates a few small objects per sequence per step, nearly all freed at
    once by reference counting, while the workload, the engine and the records stay alive:
    CPython's collector would rescan the survivors every few thousand allocations, seconds
    over a long trace, and find nothing, since the engine makes no reference cycles per step
    (tests/test_simulator.py checks a preempting, prefix-sharing replay leaves none). So the
    collector is off for the replay, what exists before it frozen out of its generations,
    and both restored after."""
    gc.collect()
    gc.freeze()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
        gc.unfreeze()


def _merge(acc: dict[str, float], snap: dict[str, float], replicas: int) -> None:
    """A fleet's snapshot: counters summed over replicas, gauges averaged."""
    for k, v in snap.items():
        counter = k.endswith(("_total", "_sum", "_count"))
        acc[k] = acc.get(k, 0.0) + (v if counter else v / replicas)
