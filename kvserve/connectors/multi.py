"""Several connectors as one (vLLM's MultiConnector): the offload tiers beside a transfer to
another engine, or a test's connector beside both.

Each hook is called on the connectors that implement it, in order. A waiting request's
external tokens come from the first connector that has any (the others are not asked to load
it); its later hooks go to that connector. Metadata, payloads and reports are kept per
connector, so each sees only its own. A finished request whose blocks several connectors hold
(``delay_free``) keeps them until every one of those has reported it sent: the worker side
tags each report with its connector, and the scheduler side counts them off.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvserve.connectors.base import KVConnector, KVConnectorOutput, Role, StepBlocks


@dataclass(slots=True)
class MultiMeta:
    parts: list[Any]  # one per connector (None: nothing for it this step)


def _tag(i: int, request_id: str) -> str:
    return f"{i}\0{request_id}"


def _untag(tagged: str) -> tuple[int, str]:
    i, rid = tagged.split("\0", 1)
    return int(i), rid


def _implements(connector: KVConnector, hook: str) -> bool:
    return getattr(type(connector), hook) is not getattr(KVConnector, hook)


class MultiConnector(KVConnector):
    def __init__(self, role: Role, connectors: list[KVConnector]) -> None:
        super().__init__(role)
        self.connectors = connectors
        self.lease_s = max((c.lease_s for c in connectors), default=self.lease_s)
        self.loads_finish_on_workers = any(c.loads_finish_on_workers for c in connectors)
        self.layer_wise = any(c.layer_wise for c in connectors)
        self._loader: dict[str, KVConnector] = {}  # request -> the connector loading it
        self._holding: dict[str, set[int]] = {}  # request -> connectors holding its blocks

    def _with(self, hook: str) -> list[KVConnector]:
        return [c for c in self.connectors if _implements(c, hook)]

    # -- scheduler side ----------------------------------------------------------------------
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        for c in self._with("get_num_new_matched_tokens"):
            num, load_async = c.get_num_new_matched_tokens(request, num_computed_tokens)
            if num is None:
                return None, False
            if num > 0:
                self._loader[request.request_id] = c
                return num, load_async
        return 0, False

    def update_state_after_alloc(
        self, request: Any, block_ids: list[int], num_external_tokens: int
    ) -> None:
        self._loader[request.request_id].update_state_after_alloc(
            request, block_ids, num_external_tokens
        )

    def take_finished_loads(self, wait: bool = False) -> dict[str, int]:
        out: dict[str, int] = {}
        for c in self._with("take_finished_loads"):
            out.update(c.take_finished_loads(wait))
        return out

    def load_is_cache_hit(self, request: Any) -> bool:
        c = self._loader.get(request.request_id)
        return c.load_is_cache_hit(request) if c is not None else True

    def load_failure_reason(self, request: Any) -> str | None:
        c = self._loader.get(request.request_id)
        return c.load_failure_reason(request) if c is not None else None

    def landed_output_tokens(self, request: Any) -> list[int]:
        c = self._loader.get(request.request_id)
        return c.landed_output_tokens(request) if c is not None else []

    def get_kv_connector_stats(self) -> dict[str, Any] | None:
        out = KVConnectorOutput()
        for c in self._with("get_kv_connector_stats"):
            out.merge(KVConnectorOutput(kv_connector_stats=c.get_kv_connector_stats() or {}))
        return out.kv_connector_stats

    def cancel_load(self, request: Any) -> None:
        c = self._loader.pop(request.request_id, None)
        if c is not None:
            c.cancel_load(request)

    def on_blocks(self, blocks: StepBlocks) -> None:
        for c in self._with("on_blocks"):
            c.on_blocks(blocks)

    def on_scheduled(self, request: Any, num_new_tokens: int) -> None:
        for c in self._with("on_scheduled"):
            c.on_scheduled(request, num_new_tokens)

    def on_step_done(self, scheduler_output: Any, seconds: float) -> None:
        for c in self._with("on_step_done"):
            c.on_step_done(scheduler_output, seconds)

    def build_connector_meta(self) -> MultiMeta | None:
        parts = [c.build_connector_meta() for c in self.connectors]
        return MultiMeta(parts) if any(p is not None for p in parts) else None

    def take_worker_payloads(self) -> list[Any] | None:
        parts = [c.take_worker_payloads() for c in self.connectors]
        return parts if any(p is not None for p in parts) else None

    def receive_scheduler_payloads(self, payloads: list[Any]) -> None:
        for c, p in zip(self.connectors, payloads, strict=True):
            if p is not None:
                c.receive_scheduler_payloads(p)

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """Untag the workers' reports (see the module docstring), then pass them on."""
        sent: set[str] = set()
        for tagged in output.finished_sending:
            i, rid = _untag(tagged)
            holding = self._holding.get(rid)
            if holding is None:
                continue
            holding.discard(i)
            if not holding:
                del self._holding[rid]
                sent.add(rid)
        output.finished_sending = sent
        output.finished_recving = {_untag(t)[1] for t in output.finished_recving}
        for c in self._with("update_connector_output"):
            c.update_connector_output(output)

    def step_failed(self, metadata: Any) -> None:
        parts = metadata.parts if metadata is not None else [None] * len(self.connectors)
        for c, p in zip(self.connectors, parts, strict=True):
            c.step_failed(p)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict | None]:
        self._loader.pop(request.request_id, None)
        holding, params = set(), None
        for i, c in enumerate(self.connectors):
            if not _implements(c, "request_finished"):
                continue
            d, p = c.request_finished(request, block_ids)
            if d:
                holding.add(i)
            if p:
                params = {**(params or {}), **p}
        if holding:
            self._holding[request.request_id] = holding
        return bool(holding), params

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for c in self.connectors:
            out.update(c.stats())
        return out

    def shutdown(self) -> None:
        for c in self.connectors:
            c.shutdown()

    # -- worker side -------------------------------------------------------------------------
    def register_kv_caches(self, storage: Any) -> None:
        for c in self.connectors:
            c.register_kv_caches(storage)

    def bind_connector_metadata(self, metadata: Any) -> None:
        parts = metadata.parts if metadata is not None else [None] * len(self.connectors)
        for c, p in zip(self.connectors, parts, strict=True):
            c.bind_connector_metadata(p)

    def receive_worker_payloads(self, payloads: list[Any]) -> None:
        for c, p in zip(self.connectors, payloads, strict=True):
            if p is not None:
                c.receive_worker_payloads(p)

    def save_before_step(self) -> None:
        for c in self._with("save_before_step"):
            c.save_before_step()

    def start_load_kv(self) -> None:
        for c in self._with("start_load_kv"):
            c.start_load_kv()

    def wait_for_layer_load(self, layer: int) -> None:
        for c in self._with("wait_for_layer_load"):
            c.wait_for_layer_load(layer)

    def save_kv_layer(self, layer: int) -> None:
        for c in self._with("save_kv_layer"):
            c.save_kv_layer(layer)

    def wait_for_save(self) -> None:
        for c in self._with("wait_for_save"):
            c.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        sent: set[str] = set()
        received: set[str] = set()
        for i, c in enumerate(self.connectors):
            if _implements(c, "get_finished"):
                s, r = c.get_finished(finished_req_ids)
                sent |= {_tag(i, rid) for rid in s}
                received |= {_tag(i, rid) for rid in r}
        return sent, received

    def get_block_ids_with_load_errors(self) -> set[int]:
        out: set[int] = set()
        for c in self._with("get_block_ids_with_load_errors"):
            out |= c.get_block_ids_with_load_errors()
        return out

    def num_scheduler_payloads(self) -> int:
        return sum(c.num_scheduler_payloads() for c in self.connectors)

    def take_scheduler_payloads(self) -> list[Any]:
        return [c.take_scheduler_payloads() for c in self.connectors]

    def clear_connector_metadata(self) -> None:
        for c in self.connectors:
            c.clear_connector_metadata()
