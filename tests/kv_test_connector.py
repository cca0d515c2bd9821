"""A KV connector written against the API alone (kvserve.connectors.base), for the tests of
its contract: a store of blocks in a directory (one file per block hash) that one engine
fills by holding a finished request's blocks (delay_free) while its worker writes them, and
another engine loads from, asynchronously, with some loads failing on purpose.

Options (``kv_connector_extra_config``):
- ``store``: the directory (shared by the engines, and by their worker processes);
- ``save``: hold every finished request's full blocks and write them to the store;
- ``send_steps``: steps between a hold and its ``finished_sending`` notice (default 2);
- ``recv_steps``: steps between a load's start and its ``finished_recving`` notice (default 1);
- ``fail_block``: index, within each load, of a block whose load fails (default none);
- ``never_send``: never report a hold sent (the lease must free it);
- ``lease_s``: the hold's lease;
- ``layer_wise``: ask for the per-layer hooks (each call is recorded in ``layer_calls``).
Every hook counts its calls in ``calls`` (the scheduler side's are read by the tests).
"""

from __future__ import annotations

import pickle
from collections import Counter
from pathlib import Path
from typing import Any

from kvserve.connectors.base import KVConnector, Role


class StoreConnector(KVConnector):
    def __init__(self, role: Role, config: Any) -> None:
        super().__init__(role)
        opts = config.kv_transfer_config.kv_connector_extra_config
        self.store = Path(opts["store"])
        self.save = bool(opts.get("save", False))
        self.send_steps = int(opts.get("send_steps", 2))
        self.recv_steps = int(opts.get("recv_steps", 1))
        self.fail_block = opts.get("fail_block")
        self.never_send = bool(opts.get("never_send", False))
        self.lease_s = float(opts.get("lease_s", self.lease_s))
        self.layer_wise = bool(opts.get("layer_wise", False))
        self.layer_calls: list[tuple[str, int]] = []
        self.block_size = config.cache.block_size
        self.calls: Counter[str] = Counter()
        # scheduler side
        self._asked: dict[str, list[bytes]] = {}  # hashes a load would fetch
        self._loads: dict[str, list[tuple[int, bytes]]] = {}  # to start: blocks and hashes
        self._sends: dict[str, list[tuple[int, bytes]]] = {}
        self.allocated: dict[str, int] = {}  # request -> external tokens it was given blocks for
        self.finished: list[str] = []
        # worker side
        self.storage: Any = None
        self._meta: dict[str, Any] | None = None
        self._receiving: dict[str, int] = {}  # request -> steps until it is reported
        self._sending: dict[str, int] = {}
        self._invalid: set[int] = set()

    def _path(self, block_hash: bytes) -> Path:
        return self.store / block_hash.hex()

    # -- scheduler side ----------------------------------------------------------------------
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        self.calls["get_num_new_matched_tokens"] += 1
        bs = self.block_size
        hashes = request.block_hashes[: (request.num_tokens - 1) // bs]
        n = 0
        for h in hashes[num_computed_tokens // bs :]:
            if not self._path(h).exists():
                break
            n += 1
        if n:
            start = num_computed_tokens // bs
            self._asked[request.request_id] = hashes[start : start + n]
        return n * bs, True

    def update_state_after_alloc(
        self, request: Any, block_ids: list[int], num_external_tokens: int
    ) -> None:
        self.calls["update_state_after_alloc"] += 1
        rid = request.request_id
        self.allocated[rid] = num_external_tokens
        hashes = self._asked.pop(rid)
        assert len(block_ids) * self.block_size == num_external_tokens
        self._loads[rid] = list(zip(block_ids, hashes, strict=True))

    def cancel_load(self, request: Any) -> None:
        self.calls["cancel_load"] += 1
        self._loads.pop(request.request_id, None)

    def build_connector_meta(self) -> dict[str, Any] | None:
        self.calls["build_connector_meta"] += 1
        meta = {"loads": self._loads, "sends": self._sends}
        self._loads, self._sends = {}, {}
        return meta if meta["loads"] or meta["sends"] else None

    def update_connector_output(self, output: Any) -> None:
        self.calls["update_connector_output"] += 1

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict | None]:
        self.calls["request_finished"] += 1
        self.finished.append(request.request_id)
        if not self.save:
            return False, None
        full = request.num_computed_tokens // self.block_size
        blocks = list(zip(block_ids[:full], request.block_hashes[:full], strict=True))
        self._sends[request.request_id] = blocks
        return True, {"stored_blocks": len(blocks)}

    # -- worker side -------------------------------------------------------------------------
    def register_kv_caches(self, storage: Any) -> None:
        self.storage = storage

    def bind_connector_metadata(self, metadata: Any) -> None:
        self.calls["bind_connector_metadata"] += 1
        self._meta = metadata

    def save_before_step(self) -> None:
        """The held blocks are not handed out again while held: write them now."""
        if not self._meta:
            return
        for rid, blocks in self._meta["sends"].items():
            for b, h in blocks:
                payload = self.storage.export_blocks([b]).wait()
                self._path(h).write_bytes(pickle.dumps(payload))
            self._sending[rid] = self.send_steps

    def start_load_kv(self) -> None:
        self.calls["start_load_kv"] += 1
        if not self._meta:
            return
        for rid, blocks in self._meta["loads"].items():
            for i, (b, h) in enumerate(blocks):
                if i == self.fail_block:
                    self._invalid.add(b)
                    continue
                self.storage.import_blocks([b], pickle.loads(self._path(h).read_bytes()))
            self._receiving[rid] = self.recv_steps

    def wait_for_layer_load(self, layer: int) -> None:
        self.layer_calls.append(("load", layer))

    def save_kv_layer(self, layer: int) -> None:
        self.layer_calls.append(("save", layer))

    def wait_for_save(self) -> None:
        self.calls["wait_for_save"] += 1

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        self.calls["get_finished"] += 1
        sent, received = set(), set()
        for pending, done in ((self._sending, sent), (self._receiving, received)):
            for rid in list(pending):
                pending[rid] -= 1
                if pending[rid] <= 0:
                    del pending[rid]
                    done.add(rid)
        if self.never_send:
            sent = set()
        return sent, received

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._invalid = self._invalid, set()
        return out

    def clear_connector_metadata(self) -> None:
        self._meta = None
