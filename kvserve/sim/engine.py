"""The engine the simulator runs, and what it is built from.

Nothing here schedules: :class:`~kvserve.engine.LLMEngine` is built exactly as ``kvserve
serve`` builds it (same flags, same :class:`~kvserve.sched.scheduler.Scheduler`, same
:class:`~kvserve.kv.manager.KVCacheManager`, admission, retention and workload classes), with
a :class:`~kvserve.sim.runner.CostModelRunner` in place of the model and a virtual clock in
place of time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvserve.config import CacheConfig
from kvserve.config_fields import default_of
from kvserve.engine import LLMEngine
from kvserve.engine.offload import LOAD_TIMEOUTS
from kvserve.llm import engine_config
from kvserve.plan.capacity import PlanError, capacity, load_arch, load_config
from kvserve.plan.gpus import GPU
from kvserve.router.policies import DEFAULT_OVERLAP_WEIGHT
from kvserve.sim.cost import ModelShape, Profile
from kvserve.sim.fleet import RouterProcesses, check_policy
from kvserve.sim.pd import check_roles
from kvserve.sim.runner import CostModelRunner, VirtualClock
from kvserve.sim.tiers import SimOffload, modelled_tiers
from kvserve.sim.tokenizer import HashTokenizer


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
    # The prefix policies' (and the oracle's) weight of the blocks a replica must compute,
    # as kvserve router's --overlap-weight.
    overlap_weight: float = DEFAULT_OVERLAP_WEIGHT
    # Where the router's own work runs (the profile's hop terms): 0, on the replicas' cores,
    # each replica charged for the requests and tokens it serves (a benchmark on one host);
    # N, in N router processes on cores of their own, which the requests queue for
    # (kvserve.sim.fleet.RouterProcesses).
    router_processes: int = 0
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
        if not self.overlap_weight > 0:
            raise ValueError(f"overlap_weight: must be > 0, got {self.overlap_weight}")
        if not isinstance(self.router_processes, int) or self.router_processes < 0:
            raise ValueError(
                f"router_processes: must be an integer >= 0, got {self.router_processes!r}"
            )
        if self.router_processes and self.disaggregated:
            raise ValueError(
                "router_processes: models kvserve router in front of colocated "
                "replicas; a disaggregated run's proxy is charged as a hop"
            )
        if self.router_processes and self.replicas < 2:
            raise ValueError(
                "router_processes: models kvserve router in front of two or "
                f"more replicas, not {self.replicas}"
            )
        if self.tp > 1 and self.gpu is None:
            raise ValueError("tp: tensor parallelism is simulated on a --gpu only")

    @property
    def disaggregated(self) -> bool:
        return self.prefill_replicas > 0

    @property
    def hop(self) -> bool:
        """Whether each replica is charged the hop in front of it: not when the router has
        cores of its own (``router_processes``)."""
        if self.behind_hop is not None:
            return self.behind_hop
        if self.router_processes:
            return False
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
    # The router's processes when they have cores of their own (one object for the fleet).
    router: RouterProcesses | None = None


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
