"""LLMEngine (add_request / step / abort), vLLM-shaped: the engine core plus text.

The engine builds the pieces from an :class:`~kvserve.config.EngineConfig`: an executor
(:mod:`kvserve.executor`) whose workers hold the model and the KV pool, in this process or in
worker processes, and the KV manager that accounts for the pool. It composes three stages per
request: the :class:`~kvserve.engine.inputs.InputProcessor` validates and tokenizes, the
:class:`~kvserve.engine.core.EngineCore` schedules, runs and updates, and the
:class:`~kvserve.engine.outputs.OutputProcessor` turns tokens into text and outputs. The engine
holds no model or storage object: what it needs of them is an executor call. A custom
``runner`` (and ``clock``) replaces the model: then no weights are loaded.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from kvserve.config import ConfigError, EngineConfig, ModelConfig
from kvserve.connectors.factory import scheduler_connector
from kvserve.connectors.prefix import PrefixPayload, PrefixTransferConnector
from kvserve.engine.bandwidth import BandwidthMeter
from kvserve.engine.core import Clock, EngineCore, EngineDeadError
from kvserve.engine.inputs import InputProcessor, PromptType
from kvserve.engine.kv_events import make_publisher
from kvserve.engine.offload import apply_policies, build_offload
from kvserve.engine.outputs import OutputProcessor, RequestFamily
from kvserve.engine.sizing import model_fingerprint, num_kv_blocks
from kvserve.engine.startup_log import StartupSummary
from kvserve.engine.stats import EngineStats
from kvserve.executor import Executor, RunnerExecutor, make_executor
from kvserve.kv.events import device_medium
from kvserve.kv.formats import (
    canonical_kv_format,
    kv_bytes_per_token,
    kv_fixed_bytes,
    storage_class,
)
from kvserve.kv.grouped import GroupedKVCacheManager
from kvserve.kv.hashing import BlockHash
from kvserve.kv.layer_groups import engine_layer_groups
from kvserve.kv.manager import KVCacheManager
from kvserve.kv.offload import OffloadTiers
from kvserve.kv.rank_payloads import merge_values
from kvserve.kv.storage import BlockPayload, KVStorage
from kvserve.model.dtype import choose_dtype, is_gguf_dir
from kvserve.model.layers import check_tensor_parallel, kv_head_split
from kvserve.model.resolve import resolve_model
from kvserve.model.tokenizer import Tokenizer
from kvserve.sched.output import Runner
from kvserve.sched.request import (
    InvalidRequestError,
    Request,
    RequestOutput,
    RequestTags,
    SamplingParams,
)
from kvserve.sched.retention import parse_retention
from kvserve.sched.workload_class_file import load_workload_classes
from kvserve.structured.compiler import engine_grammar_compiler

log = logging.getLogger("kvserve.engine")


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        runner: Runner | Executor | None = None,
        clock: Clock | None = None,
        offload: OffloadTiers | None = None,
    ) -> None:
        # A path, a name or a hub id, resolved once: the workers and the tools that read
        # config.model get the directory (a hub id is never looked up twice).
        model_dir = Path(resolve_model(config.model, config.revision))
        given, config = config.model, dataclasses.replace(config, model=str(model_dir))
        self.config = config
        self.model_config = mc = ModelConfig.from_pretrained(model_dir)
        tok_dir = Path(config.tokenizer or model_dir)
        self.tokenizer: Tokenizer | None = None
        if (tok_dir / "tokenizer.json").exists():
            self.tokenizer = Tokenizer(tok_dir, mc.eos_token_ids)
        self.eos_token_ids = self.tokenizer.eos_token_ids if self.tokenizer else mc.eos_token_ids
        # Structured outputs: constraints compile when a request comes (refused then if they
        # cannot), cached for the runner's matchers; no grammar library loads until then.
        self.grammars = engine_grammar_compiler(config, model_dir, mc)

        sc, cc = config.scheduler, config.cache
        self.retention = parse_retention(cc.kv_retention)
        self.max_model_len = sc.max_model_len or mc.max_position_embeddings
        r = self.retention
        streams = (
            r is not None
            and r.bounds_distance
            and not r.percent
            and r.sinks + r.window <= mc.max_position_embeddings
        )
        if self.max_model_len > mc.max_position_embeddings and not streams:
            raise ConfigError(
                f"max_model_len: {self.max_model_len} exceeds the model's "
                f"max_position_embeddings ({mc.max_position_embeddings}); only a "
                f"kv_retention window in tokens, sinks included, within that limit (e.g. "
                f"'sinks:4,window:1020') keeps every distance inside it"
            )
        self.device = torch.device(config.device)
        dtype_choice = choose_dtype(config.dtype, mc, config.device, is_gguf_dir(model_dir))
        self.dtype = dtype_choice.dtype
        model_dtype = str(self.dtype).removeprefix("torch.")
        self.kv_cache_dtype = kv_name = canonical_kv_format(cc.kv_cache_dtype, model_dtype)
        self.kv_entry_copy = storage_class(kv_name).supports_entry_copy
        if self.retention is not None:
            self.retention.validate(cc.block_size, any(mc.layer_windows), kv_name,
                                    self.kv_entry_copy)  # fmt: skip
        self.block_size = cc.block_size
        # With tensor parallelism each rank's pool holds its KV heads: the pool's figures
        # (its bytes per token, the blocks kv_cache_memory buys) are one rank's.
        tp = config.parallel.tensor_parallel_size
        check_tensor_parallel(mc.num_attention_heads, mc.num_key_value_heads,
                              mc.intermediate_size, tp)  # fmt: skip
        kv_heads = kv_head_split(mc.num_key_value_heads, tp)[0]
        self.bytes_per_token = kv_bytes_per_token(
            kv_name, mc.num_hidden_layers, kv_heads, mc.head_dim, model_dtype,
            block_size=self.block_size,
        )  # fmt: skip
        # None on CUDA: the worker sizes the pool after its profiling forward (WorkerInfo)
        num_blocks = num_kv_blocks(cc, sc, mc, kv_name, self.dtype, self.max_model_len,
                                   self.bytes_per_token, self.device, kv_heads)  # fmt: skip

        self.executor: Executor
        if runner is None:
            self.executor = make_executor(config, num_blocks, self.max_model_len)
        elif isinstance(runner, Executor):  # workers of the caller's own (a test's ranks)
            self.executor = runner
        else:
            self.executor = RunnerExecutor(runner)
        info = self.worker_info = self.executor.info
        if num_blocks is None:  # a runner given on CUDA without a pool size: none to ask
            if info is None:
                raise ConfigError("num_gpu_blocks: give it (or kv_cache_memory) with a runner")
            num_blocks = info.num_blocks
            log.info("KV pool on %s: %s", info.device, info.memory_budget)
        if info is not None and info.cuda_graphs:
            log.info("CUDA graphs: %s", info.cuda_graphs)
        self.num_blocks: int = num_blocks
        layout, partial_cap = kv_name, None
        if info is not None:
            layout, partial_cap = info.kv_layout, info.partial_block_capacity
            if cc.kv_cache_prefault:
                t0 = time.perf_counter()
                touched = self.executor.collective_rpc("prefault")[0]
                log.info("KV pool: %.2f GiB faulted in at start in %.2f s (--kv-cache-prefault)",
                         touched / 2**30, time.perf_counter() - t0)  # fmt: skip
        self.model_id = model_fingerprint(model_dir)
        # A hybrid model (full and sliding layers): a block table per layer group, so that
        # window layers give their blocks back (kvserve.kv.layer_groups).
        self.layer_groups = engine_layer_groups(
            mc.layer_windows, kv_name, cc.kv_offload, cc.disable_hybrid_kv_cache_manager
        )
        self.kv: KVCacheManager | GroupedKVCacheManager
        if self.layer_groups is not None:
            self.kv = GroupedKVCacheManager(
                self.layer_groups, self.num_blocks, self.block_size, cc.enable_prefix_caching,
                model_id=self.model_id, kv_format=f"{layout}/bs{self.block_size}",
            )  # fmt: skip
        else:
            self.kv = KVCacheManager(
                self.num_blocks,
                self.block_size,
                cc.enable_prefix_caching,
                model_id=self.model_id,
                kv_format=f"{layout}/bs{self.block_size}",
                max_partial_blocks=partial_cap,
            )
        # A model whose every layer slides over the same window never reads behind it: its
        # blocks go back to the pool, exactly.
        windows = set(mc.layer_windows)
        self.native_window = 0
        if len(windows) == 1 and None not in windows:
            self.native_window = int(windows.pop())
        # ``offload``: tiers to use instead of the ones the config names (the simulator's,
        # modelled on its clock); the config's policies apply to them all the same.
        if offload is not None:
            apply_policies(offload, cc)
            self.offload = offload
        else:
            # a tier holds every rank's bytes of a block (under torchrun, this process's rank's)
            ranks = 1 if config.parallel.distributed_executor_backend == "external_launcher" else tp
            self.offload = build_offload(cc, info, self.kv.root, self.bytes_per_token * ranks)
        if self.offload is not None:
            self.kv.write_through_hits = self.offload.write_through_hits
        # The connectors that move KV bytes each step (the offload tiers, the user's), and
        # the one that moves cached prefixes between engines, between steps.
        self.connector = scheduler_connector(config, self.kv, self.offload)
        self.prefix_transfer: PrefixTransferConnector | None = None
        if info is not None and self.layer_groups is None:
            self.prefix_transfer = PrefixTransferConnector(
                self.kv, self.model_id, info.kv_layout, self._export_blocks, self._import_blocks,
                self._store_evicted if self.offload is not None else None,
            )  # fmt: skip
        self.core = EngineCore(sc, self.kv, self.executor, self.max_model_len, self.eos_token_ids,
                               clock or time.monotonic, self.native_window, self.connector,
                               config.kv_transfer_config.kv_load_failure_policy)  # fmt: skip
        self.workload_classes = None
        if sc.workload_classes is not None:
            self.workload_classes = load_workload_classes(sc.workload_classes)
            self.workload_classes.check_pool(cc.kv_cache_dtype)
        self.inputs = InputProcessor(
            self.tokenizer, mc.vocab_size, self.max_model_len, self.num_blocks, self.block_size,
            self.retention, sc.max_num_batched_tokens, self.native_window,
            any(mc.layer_windows), (kv_name, self.kv_entry_copy), self.workload_classes,
            self.kv.cached_share,
            self.layer_groups.windows if self.layer_groups is not None else (),
        )  # fmt: skip
        for c in self.workload_classes.classes if self.workload_classes else ():
            try:  # each class's policy on this engine, at start rather than per request
                if c.kv_retention:
                    self.inputs.checked_retention(c.kv_retention)
            except ConfigError as e:
                raise ConfigError(f"workload class {c.name!r}: {e}") from None
        # Achieved memory bandwidth (kvserve.engine.bandwidth), against a peak measured now.
        self.bandwidth: BandwidthMeter | None = None
        if info is not None:
            peak = self.executor.collective_rpc("measure_peak_bandwidth")[0]
            self.bandwidth = BandwidthMeter(info.weight_bytes, self.bytes_per_token,
                                            peak)  # fmt: skip
            meter = self.bandwidth
            self.core.step_hooks.append(
                lambda core: meter.record(core.last_step, core.last_step_seconds)
            )
        # KV events (kvserve.engine.kv_events): what the pool and the tiers hold, after
        # each step, for a router.
        self.kv_events = make_publisher(config.kv_events_config)
        if self.kv_events is not None:
            try:
                self.kv.enable_events(device_medium(config.device))
            except ConfigError:
                self.kv_events.shutdown()
                raise
            if self.offload is not None:
                self.offload.enable_events(self.block_size)
            self.kv_events.publish_cleared()
            self.core.step_hooks.append(lambda core: self.publish_kv_events())
        self.outputs = OutputProcessor(self.tokenizer, self.core.finish_request)
        self._ids = itertools.count()
        self.startup_summary = StartupSummary(
            given, str(model_dir), self.num_blocks, self.block_size, self.bytes_per_token,
            kv_fixed_bytes(kv_name, mc.num_hidden_layers, kv_heads, mc.head_dim,
                           self.dtype, self.block_size, sc.max_num_seqs),
            self.max_model_len, sc.max_num_seqs, kv_name,
            "auto: the compute dtype" if cc.kv_cache_dtype == "auto" else "--kv-cache-dtype",
            model_dtype, dtype_choice.reason, config.device,
            info.compute if info is not None else None, any(mc.layer_windows),
        )  # fmt: skip
        log.info("%s", self.startup_summary)

    @property
    def scheduler(self) -> Any:
        return self.core.scheduler

    @property
    def requests(self) -> dict[str, Request]:
        """The unfinished samples by id (``id#i`` for sample i of an ``n > 1`` request)."""
        return self.core.scheduler.requests

    @property
    def num_steps(self) -> int:
        return self.core.num_steps

    @property
    def clock(self) -> Clock:
        return self.core.clock

    # -- requests -----------------------------------------------------------------------
    def add_request(
        self,
        request_id: str | None,
        prompt: PromptType,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        stream: bool = False,
        return_prompt_logits: bool = False,
        priority: int | None = None,
        tags: RequestTags | None = None,
    ) -> str:
        """Validate and queue a request; raises :class:`InvalidRequestError` (nothing queued).

        ``return_prompt_logits`` (for evaluation tools such as the quality gate) attaches the
        full ``[prompt_len, vocab]`` log-softmax of the prompt to the output; such a request
        computes every prompt position itself (no prefix-cache hits)."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(
                "sampling_params: must be a SamplingParams", "sampling_params"
            )
        if self.core.dead is not None:
            raise EngineDeadError(self.core.dead)
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self.outputs.families or request_id in self.core.families:
            raise InvalidRequestError(
                f"request_id: {request_id!r} is already running", "request_id"
            )
        arrival = self.core.clock() if arrival_time is None else arrival_time
        tags = tags or RequestTags()
        if priority is not None:
            tags = dataclasses.replace(tags, priority=priority)  # validated again
        req = self.inputs.process(request_id, prompt, params, arrival, return_prompt_logits,
                                  tags)  # fmt: skip
        if params.structured_outputs is not None:
            self.grammars.compile(params.structured_outputs)  # InvalidRequestError, nothing queued
        children = self.core.add_request(req)
        self.outputs.add(
            RequestFamily(
                request_id,
                req.prompt,
                req.prompt_token_ids,
                params,
                stream,
                children,
                self.tokenizer,
                return_prompt_logits,
            )  # fmt: skip
        )
        return request_id

    def prepare_structured_outputs(self, params: SamplingParams) -> None:
        """Compile ``params``' constraint now (InvalidRequestError naming the field if it
        cannot be): thread-safe, so a server can call it off the engine's thread, and
        ``add_request`` then finds it in the cache instead of compiling on the engine's."""
        if params.structured_outputs is not None:
            self.grammars.compile(params.structured_outputs)

    def abort_request(self, request_ids: str | Sequence[str]) -> None:
        """Stop requests now and free their blocks; unknown ids are ignored."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for rid in request_ids:
            self.core.abort_request(rid)
            self.outputs.abort(rid)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """Schedule, execute and update one step, then the outputs of what changed."""
        return self.outputs.process(self.core.step())

    # -- moving prefixes between engines ------------------------------------------------
    def export_prefix(self, token_ids: list[int], cache_salt: str | None = None) -> PrefixPayload:
        """The longest cached full-block prefix of ``token_ids`` as a picklable payload
        (hashes, model and format identity, the blocks' stored bytes)."""
        return self._prefix_connector("export_prefix").export_prefix(token_ids, cache_salt)

    def import_prefix(self, payload: PrefixPayload) -> int:
        """Place a payload's blocks in this engine's prefix cache (between steps); returns how
        many blocks were imported. Raises :class:`ValueError` for another model, format or
        block size, and places nothing then."""
        return self._prefix_connector("import_prefix").import_prefix(payload)

    def _export_blocks(self, block_ids: list[int]) -> BlockPayload:
        return merge_values(self.executor.collective_rpc("export_blocks", (block_ids,)))

    def _import_blocks(self, block_ids: list[int], blocks: BlockPayload) -> None:
        self.executor.collective_rpc("import_blocks", (block_ids, blocks))

    def _store_evicted(self, evicted: list[tuple[int, BlockHash]]) -> None:
        """Cached blocks an import is about to overwrite go to the tiers first."""
        hashes = [h for _, h in evicted]
        self.offload.store(hashes, self._export_blocks([b for b, _ in evicted]))

    def check_health(self) -> None:
        """Raise :class:`~kvserve.executor.WorkerDiedError` if a worker is gone."""
        self.executor.check_health()

    @property
    def dead(self) -> str | None:
        """Why the engine cannot run another step (a worker died), or None."""
        return self.core.dead

    def shutdown(self) -> None:
        """Stop the offload worker (queued stores are written first, for a bounded time) and
        the executor's workers."""
        try:
            if self.kv_events is not None:
                self.publish_kv_events()
                self.kv_events.shutdown()
            if self.connector is not None:
                self.connector.shutdown()  # the offload tiers flush their queued stores
            elif self.offload is not None:
                self.offload.flush(timeout_s=10.0)
                self.offload.close()
        finally:
            self.executor.shutdown()

    def _prefix_connector(self, what: str) -> PrefixTransferConnector:
        if self.layer_groups is not None:
            raise RuntimeError(
                f"{what}: not with per-group block tables (a hybrid sliding-window model); "
                "start the engine with disable_hybrid_kv_cache_manager"
            )
        if self.prefix_transfer is None:
            raise RuntimeError(f"{what}: this engine's KV lives in a custom runner")
        return self.prefix_transfer

    # -- observability -------------------------------------------------------------------
    def stats(self) -> EngineStats:
        kv, sched = self.kv, self.core.scheduler
        held_waste = sum(
            kv.num_held_slots(r) - (r.num_computed_tokens - r.num_evicted_tokens)
            for r in sched.running
        )
        allocated = kv.num_used_blocks * self.block_size
        last = self.core.last_step
        st, loads, bw = sched.stats, sched.loads, self.bandwidth
        connected = self.connector.stats() if self.connector is not None else {}
        return EngineStats(
            num_running=len(sched.running),
            num_waiting=len(sched.waiting),
            kv_blocks_used=kv.num_used_blocks,
            kv_blocks_total=kv.num_blocks,
            kv_cached_free_blocks=kv.num_cached_free_blocks,
            token_slots_held=max(0, allocated - held_waste),
            token_slots_allocated=allocated,
            num_preemptions=st.num_preemptions,
            step_prefill_tokens=last.num_prefill_tokens,
            step_decode_tokens=last.num_decode_tokens,
            prompt_tokens_total=st.prompt_tokens_total,
            prefill_tokens_computed_total=st.prefill_tokens_computed_total,
            generation_tokens_total=st.generation_tokens_total,
            prefix_cache_queries=kv.stats.queries,
            prefix_cache_hits=kv.stats.hits,
            prefix_cache_evictions=kv.num_evictions,
            num_steps=self.core.num_steps,
            retention_evicted_tokens=dict(st.retention_evicted_tokens),
            retention_reclaimed_blocks=st.retention_reclaimed_blocks,
            window_freed_blocks=getattr(kv, "window_freed_blocks", 0),
            kv_offload=self.offload.stats() if self.offload is not None else {},
            tier_hit_tokens=loads.hit_tokens if loads is not None else 0,
            kv_transfer=_with_tokens(connected.get("kv_transfer", {}), loads),
            tier_loads_abandoned=loads.abandoned if loads is not None else 0,
            tier_loads_skipped=connected.get("skipped", 0),
            preempted_tokens_restored=st.preempted_tokens_restored,
            preempted_tokens_recomputed=st.preempted_tokens_recomputed,
            allocation_failures=st.allocation_failures,
            queue_time_sum=st.queue_time_sum,
            queue_time_count=st.queue_time_count,
            admission=sched.admission.stats if sched.admission is not None else None,
            memory_bytes_read=bw.bytes_read if bw is not None else 0,
            step_seconds=bw.seconds if bw is not None else 0.0,
            memory_bandwidth_peak=bw.peak if bw is not None else 0.0,
        )

    def reset_prefix_cache(self) -> bool:
        done = self.kv.reset_prefix_cache()
        self.publish_kv_events()
        return done

    def publish_kv_events(self) -> None:
        """Publish the pool's and the tiers' events since the last call (one batch)."""
        if self.kv_events is None:
            return
        events = self.kv.take_events()
        if self.offload is not None:
            events += self.offload.take_events()
        self.kv_events.publish(events)

    def replace_storage(self, wrap: Callable[[KVStorage], KVStorage]) -> None:
        """Swap the KV storage for ``wrap(storage)`` (test-only corruptions, instrumented
        storages); only between steps, while no request holds blocks."""
        if self.kv.num_used_blocks:
            raise RuntimeError("replace_storage: requests still hold KV blocks")
        self.executor.collective_rpc("wrap_storage", (wrap,))


def _with_tokens(transfer: dict[str, Any], loads: Any) -> dict[str, Any]:
    """The connector's transfer counters with the prompt tokens received from peers beside
    them: loaded, but counted apart from the tiers' cache hits (``tier_hit_tokens``)."""
    if not transfer:
        return transfer
    received = loads.transferred_tokens if loads is not None else 0
    return {**transfer, "tokens_received": received}
