"""Workers as Ray actors (vLLM's ``--distributed-executor-backend ray``): one per device, on
whichever nodes of a Ray cluster a placement group finds room.

The engine joins the cluster the environment names (``RAY_ADDRESS``, or a local one it
starts; a program may call ``ray.init`` itself first), reserves one bundle per rank (a GPU
each on CUDA, a CPU each otherwise) packed onto as few nodes as fit, and starts an actor in
each. Rank 0's actor picks the rendezvous (its node's address and a free port); every actor
then builds its :class:`~kvserve.worker.worker.Worker` and joins the group. A call is one
remote method per actor; an actor that dies (its process, or its node) ends the engine with
:class:`~kvserve.executor.abstract.WorkerDiedError` naming the rank, and a call is bounded
besides by the group's collective timeout, so a lost node is an error, never a hang.

Ray is an optional extra (``kvserve[ray]``): nothing imports it until this backend is chosen.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from kvserve.config import ConfigError, EngineConfig
from kvserve.distributed import DistributedInit, free_port
from kvserve.distributed.communicator import COLLECTIVE_TIMEOUT_S, backend_for
from kvserve.entrypoint import freeze_startup_heap
from kvserve.executor.abstract import Executor, Method, WorkerDiedError, WorkerError, call_worker
from kvserve.sched.output import ModelRunnerOutput, SchedulerOutput
from kvserve.worker.worker import WorkerInfo

log = logging.getLogger("kvserve.executor")

# A call waits at most this long past the group's own collective timeout.
CALL_TIMEOUT_S = COLLECTIVE_TIMEOUT_S + 60.0


class RayWorkerWrapper:
    """The actor: a worker built on demand, and calls passed to it by name."""

    def __init__(self) -> None:
        self.worker: Any = None

    def rendezvous(self) -> tuple[str, int, str]:
        import ray

        addr = ray.util.get_node_ip_address()
        return addr, free_port(addr), ray.get_runtime_context().get_node_id()

    def start(
        self,
        config: EngineConfig,
        num_blocks: int,
        max_model_len: int,
        rank: int,
        dist_init: DistributedInit | None,
        place: bool,
    ) -> WorkerInfo:
        from kvserve.worker.worker import Worker, join_tensor_parallel_group

        tp = join_tensor_parallel_group(config, rank, dist_init, place)
        self.worker = Worker(config, num_blocks, max_model_len, rank, tp)
        freeze_startup_heap()  # an actor's process holds this worker alone
        return self.worker.info()

    def call(self, method: Method, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return call_worker(self.worker, method, args, kwargs)

    def pid(self) -> int:
        return os.getpid()


class RayExecutor(Executor):
    remote = True

    def __init__(self, config: EngineConfig, num_blocks: int, max_model_len: int) -> None:
        try:
            import ray
            from ray.util.placement_group import placement_group, remove_placement_group
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        except ImportError:
            raise ConfigError("distributed_executor_backend: 'ray' needs Ray (pip install "
                              "'kvserve[ray]')") from None  # fmt: skip
        self._ray = ray
        self._remove_pg = remove_placement_group
        self._actors: list[Any] = []
        self._pg = None
        self._dead: str | None = None
        world_size = config.parallel.tensor_parallel_size
        if not ray.is_initialized():
            ray.init(log_to_driver=False)  # Ray reads RAY_ADDRESS itself: a cluster, else local
        gpu = config.device.startswith("cuda")
        bundle = {"GPU": 1.0} if gpu else {"CPU": 1.0}
        try:
            self._pg = placement_group([bundle] * world_size, strategy="PACK")
            ready, _ = ray.wait([self._pg.ready()], timeout=CALL_TIMEOUT_S)
            if not ready:
                raise ConfigError(f"tensor_parallel_size: the Ray cluster has no room for "
                                  f"{world_size} bundles of {bundle}")  # fmt: skip
            actor_cls = ray.remote(RayWorkerWrapper)
            for rank in range(world_size):
                strategy = PlacementGroupSchedulingStrategy(
                    self._pg, placement_group_bundle_index=rank
                )
                self._actors.append(actor_cls.options(
                    num_cpus=0 if gpu else 1, num_gpus=1 if gpu else 0,
                    scheduling_strategy=strategy,
                ).remote())  # fmt: skip
            where = self._get([a.rendezvous.remote() for a in self._actors])
            addr, port, _ = where[0]  # rank 0's node hosts the group's rendezvous
            nodes = {node for *_, node in where}
            dist_init = None
            if world_size > 1:
                dist_init = DistributedInit(world_size, addr, port, backend_for(config.device))
            place = len(nodes) == 1  # ranks that share one machine split its cores
            infos = self._get([
                a.start.remote(config, num_blocks, max_model_len, rank, dist_init, place)
                for rank, a in enumerate(self._actors)
            ])  # fmt: skip
            self.pids = self._get([a.pid.remote() for a in self._actors])
        except BaseException:
            self.shutdown()
            raise
        log.info("ray workers: %d on %d node(s)", world_size, len(nodes))
        self.info = WorkerInfo.of_ranks(infos)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.collective_rpc("execute_model", (scheduler_output,))[0]

    def collective_rpc(
        self, method: Method, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> list[Any]:
        if self._dead is not None:
            raise WorkerDiedError(self._dead)
        return self._get([a.call.remote(method, args, kwargs or {}) for a in self._actors])

    def check_health(self) -> None:
        if self._dead is not None:
            raise WorkerDiedError(self._dead)

    def shutdown(self) -> None:
        ray = self._ray
        for a in self._actors:
            try:
                ray.kill(a)
            except Exception:  # noqa: BLE001, S110 - already gone
                pass
        self._actors = []
        if self._pg is not None:
            try:
                self._remove_pg(self._pg)
            except Exception:  # noqa: BLE001, S110 - the cluster is gone
                pass
            self._pg = None

    def _get(self, refs: list[Any]) -> list[Any]:
        """The calls' results in rank order; a dead actor (checked first: a survivor's
        failed collective is its echo) is WorkerDiedError, an exception WorkerError."""
        ray = self._ray
        ready, pending = ray.wait(refs, num_returns=len(refs), timeout=CALL_TIMEOUT_S)
        errors: list[tuple[int, BaseException]] = []
        out = []
        for rank, ref in enumerate(refs):
            if ref in pending:
                errors.append((rank, TimeoutError(f"no answer in {CALL_TIMEOUT_S:.0f} s")))
                out.append(None)
                continue
            try:
                out.append(ray.get(ref))
            except ray.exceptions.RayActorError as e:
                self._dead = (f"worker {rank} (Ray actor) died: {type(e).__name__}; the "
                              "engine cannot run more steps")  # fmt: skip
                log.error("%s", self._dead)
                raise WorkerDiedError(self._dead) from None
            except ray.exceptions.RayTaskError as e:
                errors.append((rank, e))
                out.append(None)
        for rank, e in errors:
            if isinstance(e, TimeoutError):
                self._dead = f"worker {rank} (Ray actor): {e}; the engine cannot run more steps"
                raise WorkerDiedError(self._dead)
            cause = e.cause if hasattr(e, "cause") else e
            raise WorkerError(f"worker {rank}: {type(cause).__name__}: {cause}")
        return out
