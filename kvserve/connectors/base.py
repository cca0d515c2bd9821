"""The KV connector API: every movement of KV bytes between pools, tiers and engines.

A connector has two sides, modelled on vLLM's v1 connector
(``vllm/distributed/kv_transfer/kv_connector/v1/base.py``). One class implements both and is
built once per role: in the engine's process for :attr:`Role.SCHEDULER`, in each worker for
:attr:`Role.WORKER`. The two sides talk through plain data only:

- each step, the scheduler side describes what the workers should move
  (:meth:`KVConnector.build_connector_meta`: block ids and hashes, never bytes), and it rides
  the step's :class:`~kvserve.sched.output.SchedulerOutput`;
- the worker side reports what finished in the step's output
  (:class:`KVConnectorOutput`: requests whose blocks were sent or received, blocks whose
  load failed, how many payloads it holds for the scheduler side).

Bytes that must cross between the two sides (an offload tier that lives in the engine's
process) travel on their own channel, the executor's ``collective_rpc``: the engine hands
:meth:`KVConnector.take_worker_payloads` to the workers before the step and collects
:meth:`KVConnector.take_scheduler_payloads` from them after it. A connector with a transport
of its own (another engine over the network) never uses that channel.

The scheduler's side of the contract:

1. For a waiting request, :meth:`get_num_new_matched_tokens` says how many tokens past the
   locally cached ones the connector can provide (a multiple of the block size), or ``None``
   for "not yet: ask again next step", and whether they arrive asynchronously.
2. The scheduler allocates blocks for them and calls :meth:`update_state_after_alloc` with
   the fresh blocks; an asynchronous load leaves the request waiting (``loading``) while it
   holds those blocks.
3. A load completes when the connector reports it (:meth:`take_finished_loads` on the
   scheduler side, or ``finished_recving`` from the workers); the blocks up to the first one
   that failed count as computed. What failed follows the ``kv_load_failure_policy``:
   ``recompute`` (the blocks stay in the table and are computed like any other) or ``fail``
   (the request finishes with an error).
4. When a request finishes, :meth:`request_finished` may answer ``delay_free``: the
   scheduler keeps the request's blocks until the workers report it in
   ``finished_sending`` (or the connector's lease runs out), so another process can still
   read them. Block conservation holds throughout: held blocks are in use.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from kvserve.kv.hashing import BlockHash


class Role(enum.Enum):
    SCHEDULER = "scheduler"
    WORKER = "worker"


@dataclass(slots=True)
class KVConnectorOutput:
    """What the worker side of every connector finished in one step."""

    finished_sending: set[str] = field(default_factory=set)  # their held blocks may go
    finished_recving: set[str] = field(default_factory=set)  # their loads landed
    invalid_block_ids: set[int] = field(default_factory=set)  # blocks whose load failed
    num_payloads: int = 0  # payloads waiting for the scheduler side (take_scheduler_payloads)
    # vLLM's field: what a connector's worker side measured (counters are summed on merge;
    # a dict value is merged key by key).
    kv_connector_stats: dict[str, Any] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(
            self.finished_sending or self.finished_recving or self.invalid_block_ids
            or self.num_payloads or self.kv_connector_stats
        )  # fmt: skip

    def merge(self, other: KVConnectorOutput) -> None:
        self.finished_sending |= other.finished_sending
        self.finished_recving |= other.finished_recving
        self.invalid_block_ids |= other.invalid_block_ids
        self.num_payloads += other.num_payloads
        mine = self.kv_connector_stats
        for k, v in other.kv_connector_stats.items():
            if isinstance(v, dict):
                mine[k] = {**mine.get(k, {}), **v}
            else:
                mine[k] = mine.get(k, 0) + v


@dataclass(slots=True)
class StepBlocks:
    """What the KV manager did to blocks in one scheduling step that a connector may act on
    (ids and hashes, no bytes): cached blocks it handed out for new content, before they are
    overwritten (``evicted``; the first ``num_restored`` are a failed step's, which may have
    been written already), and cached blocks that reached a hit count a connector asked for
    (``hot``)."""

    evicted: list[tuple[int, BlockHash]] = field(default_factory=list)
    num_restored: int = 0
    hot: list[tuple[int, BlockHash]] = field(default_factory=list)


class KVConnector:
    """Both sides of a connector; every hook has a default that does nothing, so a connector
    implements only what it moves. ``role`` says which side this instance is."""

    # Seconds a ``delay_free`` hold lasts without a ``finished_sending`` notice before the
    # scheduler frees the blocks anyway (a peer that died must not strand them).
    lease_s: float = 120.0
    # Whether a load completes when the workers report it (``finished_recving``: the engine
    # keeps stepping the workers while one is in flight, though no request runs), or on the
    # scheduler side (:meth:`take_finished_loads`).
    loads_finish_on_workers: bool = True
    # Whether the worker side moves KV layer by layer: the model's attention layers then call
    # wait_for_layer_load and save_kv_layer (otherwise they are never called).
    layer_wise: bool = False

    def __init__(self, role: Role) -> None:
        self.role = role

    # -- scheduler side ----------------------------------------------------------------------
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens past ``num_computed_tokens`` this connector can load for ``request`` (a
        multiple of the block size, or up to the prompt's end; None: not known yet, ask
        again), and whether the load is asynchronous (the request waits for it)."""
        return 0, False

    def load_is_cache_hit(self, request: Any) -> bool:
        """Whether ``request``'s loaded tokens count as prefix-cache hits (an offload tier's)
        or are reported apart as transferred (a peer engine's prefill)."""
        return True

    def load_failure_reason(self, request: Any) -> str | None:
        """Why ``request``'s load failed, if the connector knows (put in its error)."""
        return None

    def landed_output_tokens(self, request: Any) -> list[int]:
        """Output tokens a peer already sampled for ``request``, appended when its whole load
        lands (only if the load covers every token the request has): the request goes on
        decoding from them instead of computing its last prompt token again."""
        return []

    def update_state_after_alloc(
        self, request: Any, block_ids: list[int], num_external_tokens: int
    ) -> None:
        """The scheduler gave ``request`` fresh ``block_ids`` for the tokens this connector
        said it can load."""

    def take_finished_loads(self, wait: bool = False) -> dict[str, int]:
        """Loads the scheduler side knows to be complete now (request id -> blocks that
        arrived; the rest of its external blocks failed); their bytes reach the workers with
        this step (:meth:`take_worker_payloads`), before its forward pass. ``wait``: nothing
        else can run, so the connector may wait a little (bounded) for one."""
        return {}

    def cancel_load(self, request: Any) -> None:
        """The scheduler gave up on a request's load (it was aborted, or its blocks were
        taken back when memory ran out): forget it."""

    def on_blocks(self, blocks: StepBlocks) -> None:
        """The KV manager's block events of the step being scheduled."""

    def on_scheduled(self, request: Any, num_new_tokens: int) -> None:
        """``request`` computes ``num_new_tokens`` more tokens in the step being scheduled."""

    def on_step_done(self, scheduler_output: Any, seconds: float) -> None:
        """The step ran in ``seconds`` (what a connector weighs its transfers against)."""

    def build_connector_meta(self) -> Any:
        """This step's plain-data instructions for the worker side (None: nothing)."""
        return None

    def take_worker_payloads(self) -> Any:
        """Bytes the worker side needs for this step (None: none), sent before the step."""
        return None

    def receive_scheduler_payloads(self, payloads: Any) -> None:
        """Bytes the worker side produced for this side (what ``take_scheduler_payloads``
        returned)."""

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """The workers' report of the step."""

    def step_failed(self, metadata: Any) -> None:
        """The step that carried ``metadata`` failed before or during the forward pass: what
        it should have moved may not have moved."""

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict | None]:
        """``request`` finished; whether its blocks must stay allocated until the workers
        report it in ``finished_sending`` (delay_free), and parameters for its output (e.g.
        where a peer can fetch its KV)."""
        return False, None

    def stats(self) -> dict[str, Any]:
        return {}

    def shutdown(self) -> None:
        """Release threads and connections (idempotent)."""

    # -- worker side -------------------------------------------------------------------------
    def register_kv_caches(self, storage: Any) -> None:
        """The worker's KV storage, which loads write into and saves read from."""

    def bind_connector_metadata(self, metadata: Any) -> None:
        """This step's instructions, before anything else of the step."""

    def receive_worker_payloads(self, payloads: Any) -> None:
        """Bytes the scheduler side sent for this step (before it)."""

    def save_before_step(self) -> None:
        """Save blocks that this step may overwrite (cache entries evicted for new content),
        before the step's copies, loads and writes."""

    def start_load_kv(self) -> None:
        """Start (or do) this step's loads into fresh blocks, before the forward pass."""

    def wait_for_layer_load(self, layer: int) -> None:
        """Block until ``layer``'s loaded KV is in place (a layer-wise pipelined load)."""

    def save_kv_layer(self, layer: int) -> None:
        """``layer``'s KV of this step is written (a layer-wise pipelined save)."""

    def wait_for_save(self) -> None:
        """After the forward pass: save what this step filled and must go out now."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """Requests whose sends and whose receives completed since the last call;
        ``finished_req_ids`` finished in the scheduler since then."""
        return set(), set()

    def get_kv_connector_stats(self) -> dict[str, Any] | None:
        """What the worker side measured since the last call (vLLM's hook), for the step's
        report."""
        return None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose load failed since the last call (their content is not to be trusted)."""
        return set()

    def num_scheduler_payloads(self) -> int:
        return 0

    def take_scheduler_payloads(self) -> Any:
        """Bytes produced for the scheduler side (offload stores), taken once."""
        return None

    def clear_connector_metadata(self) -> None:
        """The step is over."""
