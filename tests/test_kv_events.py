"""KV events on vLLM's wire format: a subscriber written here to vLLM's published schema (the
msgspec structs of ``vllm/distributed/kv_events.py`` and the multipart frames and replay
protocol of its ``ZmqEventPublisher``, copied by field, not imported from kvserve) rebuilds
each medium's block set from a real engine's events, and that set is exactly what the pool
and the host tier hold. A subscriber that joins late or drops out asks the replay socket and
loses nothing. Block hashes are checked against the documented algorithm (SHA-256 of the
parent hash and the tokens as little-endian int64), recomputed here with hashlib."""

from __future__ import annotations

import hashlib
import struct
import time
from typing import Any

import msgspec
import pytest
import zmq

from kvserve import SamplingParams
from kvserve.config import ConfigError, KVEventsConfig
from tests.conftest import prompts_of_lengths

# -- vLLM's schema (vllm/distributed/kv_events.py, array_like version) ------------------------
ExternalBlockHash = bytes | int


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)
END_SEQ = -1


class Subscriber:
    """vLLM's example subscriber's logic: SUB for the stream, a request to the replay socket
    when the sequence numbers skip (or, for a fresh subscriber, from 0)."""

    def __init__(self, endpoint: str, replay: str, topic: str) -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt_string(zmq.SUBSCRIBE, topic)
        self.sub.connect(endpoint)
        self.replay_endpoint = replay
        self.topic = topic
        self.last_seq = -1
        self.blocks: dict[str, set] = {}
        self.tokens: dict[Any, tuple[Any, list[int]]] = {}  # hash -> (parent, tokens)

    def apply(self, batch: KVEventBatch) -> None:
        for ev in batch.events:
            if isinstance(ev, AllBlocksCleared):
                self.blocks.clear()
            elif isinstance(ev, BlockStored):
                self.blocks.setdefault(ev.medium, set()).update(ev.block_hashes)
                bs, parent = ev.block_size, ev.parent_block_hash
                for i, h in enumerate(ev.block_hashes):
                    if ev.token_ids:
                        self.tokens[h] = (parent, ev.token_ids[i * bs : (i + 1) * bs])
                    parent = h
            else:
                self.blocks.get(ev.medium, set()).difference_update(ev.block_hashes)

    def replay(self, start: int) -> None:
        # A DEALER speaking REQ's envelope (an empty delimiter frame): a REQ socket takes
        # only the first of the many replies a replay sends.
        req = self.ctx.socket(zmq.DEALER)
        req.setsockopt(zmq.LINGER, 0)
        req.connect(self.replay_endpoint)
        req.send_multipart((b"", start.to_bytes(8, "big")))
        while True:
            assert req.poll(5000), "no answer from the replay socket"
            empty, seq_bytes, payload = req.recv_multipart()
            assert empty == b""
            seq = int.from_bytes(seq_bytes, "big", signed=True)
            if seq == END_SEQ:
                assert payload == b""
                break
            if seq > self.last_seq:
                assert seq == self.last_seq + 1, (seq, self.last_seq)
                self.apply(DECODER.decode(payload))
                self.last_seq = seq
        req.close()

    def drain(self, upto: int, timeout: float = 10) -> None:
        """Read the stream until batch ``upto`` is applied, replaying any gap."""
        deadline = time.monotonic() + timeout
        while self.last_seq < upto:
            assert time.monotonic() < deadline, f"stopped at {self.last_seq} of {upto}"
            if not self.sub.poll(100):
                if self.last_seq < upto:
                    self.replay(self.last_seq + 1)
                continue
            topic, seq_bytes, payload = self.sub.recv_multipart()
            assert topic == self.topic.encode() and len(seq_bytes) == 8
            seq = int.from_bytes(seq_bytes, "big")
            if seq > self.last_seq + 1:
                self.replay(self.last_seq + 1)
            if seq == self.last_seq + 1:
                self.apply(DECODER.decode(payload))
                self.last_seq = seq

    def close(self) -> None:
        self.sub.close(linger=0)
        self.ctx.term()


GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
CONFIG = {
    "enable_kv_cache_events": True,
    "publisher": "zmq",
    "endpoint": "tcp://127.0.0.1:*",
    "replay_endpoint": "tcp://127.0.0.1:*",
    "topic": "kv@test",
}


def _sha(parent: bytes, tokens: list[int]) -> bytes:
    return hashlib.sha256(parent + struct.pack(f"<{len(tokens)}q", *tokens)).digest()


def test_a_vllm_decoder_rebuilds_the_pool_and_tier_from_a_real_engine(checkpoint, make_llm):
    llm = make_llm(checkpoint("llama_gqa"), num_gpu_blocks=24, block_size=16,
                   kv_offload_cpu="96KiB", kv_events_config=CONFIG)  # fmt: skip
    pub = llm.engine.kv_events
    assert pub is not None and pub.replay_endpoint is not None
    late = Subscriber(pub.endpoint, pub.replay_endpoint, "kv@test")
    early = Subscriber(pub.endpoint, pub.replay_endpoint, "kv@test")
    try:
        time.sleep(0.2)  # PUB/SUB: a subscription takes a moment to reach the publisher
        shared = prompts_of_lengths([96], vocab=300, seed=1)[0]
        tails = prompts_of_lengths([40, 72, 150, 150, 150], vocab=300, seed=2)
        prompts = [shared + t for t in tails[:2]] + tails[2:]  # evicts: 24 blocks in all
        salted = {"prompt_token_ids": shared + tails[0], "cache_salt": "tenant-b"}
        llm.generate(prompts[:2], GREEDY)
        early.drain(pub.num_published - 1)
        early.close()  # drops out; comes back below and replays what it missed
        llm.generate([*prompts[2:], salted], GREEDY)
        assert llm.engine.offload.flush()
        llm.engine.publish_kv_events()  # the tier's writes since the last step
        assert pub.flush()
        last = pub.num_published - 1
        assert last > early.last_seq

        back = Subscriber(pub.endpoint, pub.replay_endpoint, "kv@test")
        back.last_seq, back.blocks, back.tokens = early.last_seq, early.blocks, early.tokens
        back.drain(last)
        late.drain(last)  # joined before anything and read nothing yet: replays from 0

        pool = set(llm.engine.kv.pool.cached)
        tier = llm.engine.offload.tiers[0]
        ns = len(llm.engine.offload.namespace)
        tier_hashes = {k[ns:] for k in tier._entries}
        assert pool and tier_hashes, "the run must leave blocks in the pool and the tier"
        assert llm.engine.kv.num_evictions > 0 and tier.num_evictions > 0
        for sub in (back, late):
            assert sub.blocks.get("CPU", set()) == pool
            assert sub.blocks.get("CPU_TIER", set()) == tier_hashes
            assert set(sub.blocks) <= {"CPU", "CPU_TIER"}
        # The hashes are the documented chain, and the tokens the prompt's.
        checked = 0
        for h, (parent, toks) in late.tokens.items():
            assert len(toks) == 16
            if parent is not None:
                assert _sha(parent, toks) == h
                checked += 1
        assert checked > 10
        first = [h for h, (p, t) in late.tokens.items() if p is None and t == shared[:16]]
        assert len(first) == 2, "the salted tenant's first block is a chain of its own"
        back.close()

        # A reset empties the pool: one AllBlocksCleared, and the subscriber holds nothing.
        assert llm.reset_prefix_cache()
        assert pub.flush() and pub.num_published == last + 2
        late.drain(pub.num_published - 1)
        assert not late.blocks
    finally:
        late.close()


@pytest.mark.parametrize(
    ("value", "field"),
    [
        ({"publisher": "kafka"}, "publisher"),
        ({"buffer_steps": 0}, "buffer_steps"),
        ({"endpoint": "5557"}, "endpoint"),
        ({"topicc": "x"}, "topicc"),
        ("{not json", "not JSON"),
    ],
)
def test_bad_kv_events_config_is_refused_naming_the_field(value, field):
    with pytest.raises(ConfigError, match=field):
        KVEventsConfig.from_any(value)
