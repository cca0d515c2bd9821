"""KVServeConnector: disaggregated prefill and decode between kvserve engines, on CPUs (and
any device), over ZMQ/TCP. (vLLM's NixlConnector, the GPU path over RDMA, is planned.)

A prefill engine (``kv_role`` kv_producer or kv_both) runs a request that carries
``kv_transfer_params: {"do_remote_decode": true}`` to its first token, answers with where its
blocks are (:mod:`kvserve.disagg.params`) and holds them (``delay_free``) under a lease of
``lease_s`` (``kv_connector_extra_config``). A decode engine (kv_consumer or kv_both) given
that answer pulls the blocks its own prefix cache lacks, imports them and goes on from the
first token, so it computes no prompt token the prefill engine sent; when the prefill engine
sampled nothing it could continue from (``n`` > 1, logprobs, a grammar), the decode engine
computes the last prompt token itself, as vLLM's does.

Who does what:

- The scheduler side decides from ids and hashes only: what to pull (block indices), what to
  hold, what to release; a request that is aborted or finishes on either side releases the
  other side's blocks (a decode engine's abort sends a release; a prefill engine's abort
  never holds).
- The worker side owns the bytes. A prefill engine's worker serves a read as it arrives, from
  the side channel's thread, when its pool is in host memory: a held block is never written
  (its request is finished, and a prefix-cache hit only reads it), so the copy can run beside
  a step, and a read does not wait out the prefill step under way (a whole chunk of a long
  prompt). One lock orders reads against the ends of holds (release, lease), which the step
  thread decides: a lease ends between two reads, never during one. A device pool's reads
  are served in the step thread, whose stream the copies follow. A decode engine's worker
  fetches in a background thread and imports in its step thread, then releases the prefill
  engine's hold. A prefill peer that stops answering heartbeats fails
  its fetches within ``heartbeat_timeout_s`` (1 s): the scheduler then recomputes the blocks
  or fails the request, as ``kv_load_failure_policy`` says.

Options (``kv_connector_extra_config``): ``lease_s`` (30), ``heartbeat_timeout_s`` (1.0),
``read_timeout_s`` (the lease).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from kvserve.connectors.base import KVConnector, KVConnectorOutput, Role
from kvserve.disagg import params as kp
from kvserve.disagg import wire
from kvserve.disagg.transport import Fetch, KVClient, KVServer, Releaser
from kvserve.sched.request import RequestStatus

# A read or a release may arrive before the step that starts its hold (the answer that names
# the blocks leaves after the step that finished the request): an unknown request is refused
# (a release of one dropped) after this.
UNKNOWN_GRACE_S = 1.0


def _reason_key(error: str) -> str:
    """A failure's label in the metrics (few values: the error texts vary)."""
    for key, marker in (("handshake", "handshake"), ("peer_unreachable", "unreachable"),
                        ("lease_expired", "not held"), ("timeout", "timed out"),
                        ("import", "import"), ("hash_mismatch", "hash"),
                        ("bad_params", "kv_transfer_params")):  # fmt: skip
        if marker in error:
            return key
    return "other"


def _refuse_hybrid(config: Any) -> None:
    """A hybrid model (full and sliding-window layers) keeps a block table per layer group;
    its blocks are not handed over yet: refuse at start rather than move the wrong bytes."""
    from kvserve.config import ConfigError, ModelConfig
    from kvserve.kv.layer_groups import LayerGroups

    cc = config.cache
    if cc.disable_hybrid_kv_cache_manager or cc.kv_offload:
        return
    if LayerGroups.of(ModelConfig.from_pretrained(config.model).layer_windows) is not None:
        raise ConfigError("kv_connector: KVServeConnector does not hand over a hybrid model's "
                          "per-layer-group blocks; start the engines with "
                          "--disable-hybrid-kv-cache-manager")  # fmt: skip


class KVServeConnector(KVConnector):
    loads_finish_on_workers = True

    def __init__(self, role: Role, config: Any) -> None:
        super().__init__(role)
        tc = config.kv_transfer_config
        extra = tc.kv_connector_extra_config
        self.kv_role = tc.kv_role or "kv_both"
        self.produces = self.kv_role in ("kv_producer", "kv_both")
        self.consumes = self.kv_role in ("kv_consumer", "kv_both")
        self.host, self.port = tc.kv_ip, tc.kv_port
        self.engine_id = tc.engine_id or f"kvserve@{tc.kv_ip}:{tc.kv_port}"
        self.block_size = config.cache.block_size
        self.lease = float(extra.get("lease_s", 30.0))
        self.lease_s = self.lease + 10.0  # the scheduler's backstop: the worker's lease ends first
        self.heartbeat_timeout_s = float(extra.get("heartbeat_timeout_s", 1.0))
        self.read_timeout_s = float(extra.get("read_timeout_s", self.lease))
        self.model_dir = config.model
        _refuse_hybrid(config)  # (on the worker side first: before any thread starts)
        # scheduler side
        # request -> (where to pull from, or why it cannot be; block indices; first tokens)
        self._asked: dict[str, tuple[kp.RemotePrefill | str, list[int], list[int]]] = {}
        self._sends: dict[str, list[int]] = {}
        self._recvs: dict[str, dict[str, Any]] = {}
        self._cancels: list[str] = []
        self._releaser: Releaser | None = None
        self._consumed: set[str] = set()  # asked once: a later ask computes locally
        self._fetched: set[str] = set()  # handed to the workers (they release the peer)
        self._inject: dict[str, list[int]] = {}
        self._reasons: dict[str, str] = {}
        self._started: dict[str, float] = {}
        self.counters: Counter[str] = Counter()
        self.failures: Counter[str] = Counter()
        self.leases_held = 0
        # worker side
        self.storage: Any = None
        self.server: KVServer | None = None
        self.client: KVClient | None = None
        self._holds: dict[str, tuple[list[int], float]] = {}
        # Reads, hold ends and the worker's counters, between the step thread and the side
        # channel's (which serves reads as they arrive from a host-memory pool).
        self._lock = threading.RLock()
        self._fetching: dict[str, dict[str, Any]] = {}
        self._sent: set[str] = set()
        self._received: set[str] = set()
        self._invalid: set[int] = set()
        self._wstats: dict[str, Any] = {}

    # -- scheduler side ----------------------------------------------------------------------
    def _release(self, remote: kp.RemotePrefill) -> None:
        """Tell the prefill engine it may free the request's blocks (now, from this thread)."""
        if self._releaser is None:
            self._releaser = Releaser()
        self._releaser.release(remote.host, remote.port, remote.request_id)

    def _fail_early(self, request: Any, num_computed: int, error: str) -> tuple[int, bool]:
        """Answers that cannot be pulled fail as a load that never arrives, so the scheduler
        applies kv_load_failure_policy to them like to any other failed pull."""
        end = request.num_prompt_tokens - 1
        if num_computed >= end:
            self.failures[_reason_key(error)] += 1
            return 0, False
        self._asked[request.request_id] = (error, [], [])
        return end - num_computed, True

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        params, rid = request.kv_transfer_params, request.request_id
        if not self.consumes or not kp.wants_remote_prefill(params) or rid in self._consumed:
            return 0, False
        self._consumed.add(rid)
        try:
            remote = kp.remote_prefill(params, rid)
        except kp.BadTransferParams as e:
            return self._fail_early(request, num_computed_tokens, str(e))
        bs, p = self.block_size, request.num_prompt_tokens
        why = None
        if remote.num_tokens is not None and remote.num_tokens != p:
            why = f"the prefill engine's prompt has {remote.num_tokens} tokens, this one {p}"
        elif len(remote.block_ids) != -(-p // bs):
            why = (f"kv_transfer_params.remote_block_ids: {len(remote.block_ids)} blocks for a "
                   f"{p}-token prompt in blocks of {bs}")  # fmt: skip
        elif remote.block_hashes is not None:
            ours = request.block_hashes
            n = min(len(ours), len(remote.block_hashes))
            if ours[:n] != remote.block_hashes[:n]:
                why = "block hash mismatch: the prefill engine hashed other tokens or salt"
        if why is not None:
            self._release(remote)
            return self._fail_early(request, num_computed_tokens, why)
        simple = (not request.forks and request.output_logprobs is None
                  and request.sampling_params.structured_outputs is None
                  and request.prompt_logits is None)  # fmt: skip
        inject = remote.first_token_ids[:1] if simple and request.num_output_tokens == 0 else []
        end = p if inject else p - 1
        if num_computed_tokens >= end:  # our own cache holds it all: nothing to pull
            self._release(remote)
            return 0, False
        first, last = num_computed_tokens // bs, -(-end // bs)
        self._asked[rid] = (remote, list(range(first, last)), inject)
        return end - num_computed_tokens, True

    def update_state_after_alloc(
        self, request: Any, block_ids: list[int], num_external_tokens: int
    ) -> None:
        rid = request.request_id
        remote, indices, inject = self._asked.pop(rid)
        if isinstance(remote, str):  # failed before it started (see _fail_early)
            self._recvs[rid] = {"error": remote, "block_ids": list(block_ids)}
            return
        if len(block_ids) != len(indices):
            raise RuntimeError(f"{rid}: {len(block_ids)} blocks for {len(indices)} to load")
        self._recvs[rid] = {"host": remote.host, "port": remote.port,
                            "remote_request_id": remote.request_id, "indices": indices,
                            "block_ids": list(block_ids)}  # fmt: skip
        self._fetched.add(rid)
        self._started[rid] = time.monotonic()
        if inject:
            self._inject[rid] = inject

    def cancel_load(self, request: Any) -> None:
        rid = request.request_id
        self._asked.pop(rid, None)
        self._inject.pop(rid, None)
        self._started.pop(rid, None)
        recv = self._recvs.pop(rid, None)
        if recv is not None and "error" not in recv:  # never reached the workers
            self._release(kp.remote_prefill(request.kv_transfer_params, rid))
        elif rid in self._fetched:
            self._cancels.append(rid)  # the workers drop the fetch (when they next step)
            self._release(kp.remote_prefill(request.kv_transfer_params, rid))
        self._fetched.discard(rid)

    def load_is_cache_hit(self, request: Any) -> bool:
        return False

    def load_failure_reason(self, request: Any) -> str | None:
        return self._reasons.pop(request.request_id, None)

    def landed_output_tokens(self, request: Any) -> list[int]:
        return self._inject.pop(request.request_id, [])

    def build_connector_meta(self) -> dict[str, Any] | None:
        meta = {"send": self._sends, "recv": self._recvs, "cancel": self._cancels}
        self._sends, self._recvs, self._cancels = {}, {}, []
        return meta if any(meta.values()) else None

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        st = dict(output.kv_connector_stats)
        for rid, error in st.pop("failed", {}).items():
            self.failures[_reason_key(error)] += 1
            self._reasons[rid] = error
            self._inject.pop(rid, None)  # recomputed if at all: nothing to go on from
        for k, v in st.items():
            self.counters[k] += v
        self.leases_held -= len(output.finished_sending)
        now = time.monotonic()
        for rid in output.finished_recving:
            t0 = self._started.pop(rid, None)
            if t0 is not None:
                self.counters["load_seconds"] += now - t0

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict | None]:
        rid, params = request.request_id, request.kv_transfer_params
        self._consumed.discard(rid)
        self._inject.pop(rid, None)
        self._reasons.pop(rid, None)
        if kp.wants_remote_prefill(params) and rid not in self._fetched and self.consumes:
            try:  # it never pulled: the prefill engine may let its blocks go
                remote = kp.remote_prefill(params, rid)
                self._release(remote)
            except kp.BadTransferParams:
                pass
        self._fetched.discard(rid)
        ok = request.status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH)
        if not (self.produces and kp.wants_remote_decode(params) and ok):
            return False, None
        bs, p = self.block_size, request.num_prompt_tokens
        n = -(-p // bs)
        ids = list(block_ids[:n])
        if len(ids) < n or request.num_computed_tokens < p:
            return False, None  # (a retention policy dropped some): nothing whole to hand out
        self._sends[rid] = ids
        self.leases_held += 1
        self.counters["holds"] += 1
        hashes = request.block_hashes[: p // bs]
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_host": self.host,
            "remote_port": self.port,
            "remote_block_ids": ids,
            "remote_request_id": rid,
            "tp_size": 1,
            "remote_block_hashes": [h.hex() for h in hashes],
            "remote_num_tokens": p,
            "first_token_ids": list(request.output_token_ids[:1]),
        }

    def stats(self) -> dict[str, Any]:
        return {"kv_transfer": {**self.counters, "failures": dict(self.failures),
                                "leases_held": self.leases_held}}  # fmt: skip

    # -- worker side -------------------------------------------------------------------------
    def register_kv_caches(self, storage: Any) -> None:
        self.storage = storage
        if self.server is not None or self.client is not None:
            return
        from kvserve.engine.sizing import model_fingerprint

        handshake = {"model": model_fingerprint(Path(self.model_dir)), **storage.identity()}
        if self.produces:
            on_inbox = self._serve_reads if storage.device.type == "cpu" else None
            self.server = KVServer(self.host, self.port, self.engine_id, handshake, on_inbox)
        if self.consumes:
            self.client = KVClient(self.engine_id, handshake, self.heartbeat_timeout_s,
                                   self.read_timeout_s)  # fmt: skip

    def bind_connector_metadata(self, metadata: Any) -> None:
        if not metadata:
            return
        now = time.monotonic()
        if metadata["send"]:
            with self._lock:
                for rid, ids in metadata["send"].items():
                    self._holds[rid] = (ids, now + self.lease)
                    self.server.ended.discard(rid)  # (an id used again)
                if self.server.on_inbox is not None:
                    self._serve_reads()  # reads that came before their hold began
        client = self.client
        for rid in metadata["cancel"]:  # (the scheduler side released the peer)
            self._fetching.pop(rid, None)
            client.cancel(rid)
        for rid, f in metadata["recv"].items():
            if "error" in f:  # nothing to pull: reported failed with this step
                self._received.add(rid)
                self._invalid.update(f["block_ids"])
                self._wstats.setdefault("failed", {})[rid] = f["error"]
                continue
            self._fetching[rid] = f
            client.fetch(Fetch(rid, f["host"], f["port"], f["remote_request_id"], f["indices"]))

    def _count(self, key: str, n: float = 1) -> None:
        with self._lock:
            self._wstats[key] = self._wstats.get(key, 0) + n

    def _end_hold(self, rid: str) -> None:
        """(under the lock) ``rid``'s blocks may go: reported sent with the next step."""
        del self._holds[rid]
        self._sent.add(rid)
        self.server.end(rid)

    def _serve(self) -> None:
        """(step thread) Answer the reads and releases that arrived, then end the leases that
        ran out."""
        with self._lock:
            now = time.monotonic()
            self._serve_inbox(now)
            for rid, (_, until) in list(self._holds.items()):
                if now >= until:
                    self._end_hold(rid)
                    self._count("leases_expired")

    def _serve_reads(self) -> None:
        """(either thread) Answer the reads and releases in the inbox. A read of a hold whose
        lease ran out ends it and is refused; one of a hold not begun yet waits for it."""
        with self._lock:
            self._serve_inbox(time.monotonic())

    def _serve_inbox(self, now: float) -> None:
        server = self.server
        later = []
        while server.inbox:
            peer, msg, at = server.inbox.popleft()
            if not isinstance(msg, wire.Read | wire.Release):
                continue
            if isinstance(msg, wire.Release):
                if msg.request_id in self._holds:
                    self._end_hold(msg.request_id)
                elif msg.request_id not in server.ended and now - at < UNKNOWN_GRACE_S:
                    later.append((peer, msg, at))  # (its hold begins with the next step)
                continue
            hold = self._holds.get(msg.request_id)
            if hold is not None and now >= hold[1]:
                self._end_hold(msg.request_id)
                self._count("leases_expired")
                hold = None
            if hold is None and msg.request_id not in server.ended and now - at < UNKNOWN_GRACE_S:
                later.append((peer, msg, at))  # its hold may start in the next step
                continue
            if hold is None:
                server.send(peer, wire.Refused(f"request {msg.request_id!r} is not held here "
                                               "(its lease expired or it was released)",
                                               msg.xfer_id))  # fmt: skip
                continue
            ids = hold[0]
            if not msg.indices or not all(0 <= i < len(ids) for i in msg.indices):
                server.send(peer, wire.Refused("read: block index out of range", msg.xfer_id))
                continue
            payload = self.storage.export_blocks([ids[i] for i in msg.indices])
            desc, frames = wire.pack_payload(payload)
            server.send(peer, wire.ReadOk(msg.xfer_id, desc), frames)
            self._count("bytes_sent", wire.payload_bytes(frames))
            self._count("blocks_sent", len(msg.indices))
        server.inbox.extendleft(reversed(later))

    def _import(self) -> None:
        """Place the fetches that arrived; every one, good or failed, releases its peer."""
        client = self.client
        while client.results:
            res = client.results.popleft()
            f = self._fetching.pop(res.request_id, None)
            if f is None:
                continue  # cancelled
            error = res.error
            if error is None:
                try:
                    self.storage.import_blocks(f["block_ids"], res.payload)
                except Exception as e:  # a format the pool cannot read fails this load only
                    error = f"import failed: {type(e).__name__}: {e}"
            self._received.add(res.request_id)
            if error is None:
                self._count("bytes_received", res.nbytes)
                self._count("blocks_received", len(f["block_ids"]))
                self._count("transfer_seconds", res.seconds)
                self._count("transfers")
            else:
                self._invalid.update(f["block_ids"])
                self._wstats.setdefault("failed", {})[res.request_id] = error
            client.release(f["host"], f["port"], f["remote_request_id"])

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        if self.server is not None:
            self._serve()
        if self.client is not None:
            self._import()
        with self._lock:
            sent, received = self._sent, self._received
            self._sent, self._received = set(), set()
        return sent, received

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._invalid = self._invalid, set()
        return out

    def get_kv_connector_stats(self) -> dict[str, Any] | None:
        with self._lock:
            out, self._wstats = self._wstats, {}
        return out or None

    def shutdown(self) -> None:
        for end in (self.server, self.client, self._releaser):
            if end is not None:
                end.close()
