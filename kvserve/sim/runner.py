"""The model side of the simulator: a runner whose step takes a cost model's time on a
virtual clock.

The runner advances the clock by the step's modelled time and returns one placeholder token per
sampled row, so the scheduler's decisions (batches, prefix hits, preemptions, refusals) are the
real ones; only the step time is modelled. Outputs are assumed to run to their requested length
(``ignore_eos``, as ``kvserve bench`` sends by default): a cost model cannot know when a model
would stop.
"""

from __future__ import annotations

from typing import Any

from kvserve.config import CacheConfig
from kvserve.config_fields import default_of
from kvserve.connectors.base import KVConnectorOutput
from kvserve.connectors.offload import OffloadMeta
from kvserve.sched.output import ModelRunnerOutput, SchedulerOutput
from kvserve.sim.cost import ModelShape, Profile, ShapeCache, step_features
from kvserve.sim.tiers import ModelledBlocks


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
