"""The Redis tier: entries shared by every engine that points at one server.

Replicas share one byte budget and one LRU order, kept on the server (a ZSET of keys scored by a
shared counter, a hash of sizes, a byte counter) and changed only by Lua scripts, so a put and
the evictions it causes are one step for every client; the entry itself is a single SET NX of
header and payload, visible only complete. The client fails fast: a bounded socket timeout and
one immediate retry on a dropped connection, never on a timeout.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any
from urllib.parse import parse_qs, urlsplit

from kvserve.kv.tiers import Tier, TierError

# Puts and evicts in one server-side step, so every client of the Redis sees one budget and one
# LRU order, and an entry (SET NX of the whole value) is visible only complete. Undeclared
# victim keys make this a standalone-Redis script (not Redis Cluster).
_PUT = """
local n = string.len(ARGV[1])
local cap = tonumber(ARGV[3])
if n > cap then return {0, 0} end
if not redis.call('SET', KEYS[1], ARGV[1], 'NX') then return {0, 0} end
redis.call('ZADD', KEYS[2], redis.call('INCR', KEYS[5]), ARGV[2])
redis.call('HSET', KEYS[4], ARGV[2], n)
local used = redis.call('INCRBY', KEYS[3], n)
local evicted = 0
while used > cap do
  local victim = redis.call('ZRANGE', KEYS[2], 0, 0)[1]
  if (not victim) or victim == ARGV[2] then
    redis.call('SET', KEYS[3], n)  -- only the new entry is left: resynchronise the counter
    break
  end
  local size = tonumber(redis.call('HGET', KEYS[4], victim) or '0')
  redis.call('DEL', ARGV[4] .. victim)
  redis.call('HDEL', KEYS[4], victim)
  redis.call('ZREM', KEYS[2], victim)
  used = redis.call('DECRBY', KEYS[3], size)
  evicted = evicted + 1
end
return {1, evicted}
"""

# Drop a key from the books (the entry is gone or being deleted).
_FORGET = """
local size = redis.call('HGET', KEYS[4], ARGV[1])
if size then
  redis.call('HDEL', KEYS[4], ARGV[1])
  redis.call('DECRBY', KEYS[3], size)
end
redis.call('ZREM', KEYS[2], ARGV[1])
return 0
"""
# After a GET: touch a hit (ZADD XX: never re-adds what a concurrent put evicted); a miss still
# in the books (the value went some other way, e.g. a server-side maxmemory eviction) leaves them.
_TOUCH = (
    """
if redis.call('EXISTS', KEYS[1]) == 1 then
  redis.call('ZADD', KEYS[2], 'XX', redis.call('INCR', KEYS[5]), ARGV[1])
  return 1
end
"""
    + _FORGET
)
_DELETE = "redis.call('DEL', KEYS[1])\n" + _FORGET


class RedisTier(Tier):
    """Entries in a Redis shared by every replica: one byte budget and one LRU order for all.

    Keys, under ``namespace``: ``:e:<key hex>`` the entry, ``:lru`` a ZSET of key hexes scored
    by ``:clock`` (an INCR counter, so the order is total across clients without trusting their
    clocks), ``:size`` a HASH of key hex -> bytes and ``:bytes`` their sum. Puts run as one Lua
    script (see ``_PUT``); a get is one pipelined round trip (GET, then a touch script).
    Timeouts bound every call and the client does not retry them: the caller backs off.
    Capacity is passed by each client on each put; replicas should agree on it.
    ``used_bytes`` and ``num_entries`` ask the server (and may raise :class:`TierError`);
    ``num_evictions`` counts the evictions this client's puts made.
    """

    name = "redis"
    flag = "--kv-offload-redis"
    size_flag = "--kv-offload-redis-size"

    def __init__(
        self, url: str, capacity_bytes: int, timeout_s: float = 0.5, namespace: str = "kvserve"
    ) -> None:
        super().__init__(capacity_bytes)
        _check_redis_url(url, self.flag)
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", namespace):
            raise ValueError(
                f"{self.flag}: namespace must match [A-Za-z0-9_.-]+, got {namespace!r}"
            )
        if not timeout_s > 0:
            raise ValueError(f"{self.flag}: timeout_s must be > 0, got {timeout_s!r}")
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError:
            raise ValueError(
                f"{self.flag}: the Redis client is not installed; pip install 'kvserve[redis]'"
            ) from None
        self._redis = redis
        self.url = url
        self.timeout_s = timeout_s
        self.namespace = namespace
        # One immediate retry on a connection error only: a pooled connection may be stale
        # after a server restart. A timeout is never retried (it would multiply the wait).
        retry = Retry(NoBackoff(), 1, supported_errors=(redis.exceptions.ConnectionError,))
        self._client = redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=retry
        )
        ns = namespace
        self._prefix = f"{ns}:e:"
        self._books = [f"{ns}:lru", f"{ns}:bytes", f"{ns}:size", f"{ns}:clock"]
        self._put = self._client.register_script(_PUT)
        self._touch = self._client.register_script(_TOUCH)
        self._delete = self._client.register_script(_DELETE)

    @contextmanager
    def _errors(self, what: str) -> Iterator[None]:
        exc = self._redis.exceptions
        try:
            yield
        except exc.TimeoutError as e:
            raise TierError("timeout", f"redis {what}: {e}") from e
        except exc.ConnectionError as e:
            raise TierError("unavailable", f"redis {what}: {e}") from e
        except exc.RedisError as e:
            raise TierError("error", f"redis {what}: {e}") from e

    def _keys(self, hexkey: str) -> list[str]:
        return [self._prefix + hexkey, *self._books]

    def put(self, key: bytes, data: bytes) -> bool:
        if len(data) > self.capacity_bytes:
            return False
        h = key.hex()
        with self._errors("put"):
            stored, evicted = self._put(
                keys=self._keys(h), args=[data, h, self.capacity_bytes, self._prefix]
            )
        if evicted:
            with self._lock:
                self.num_evictions += int(evicted)
        return bool(stored)

    def get(self, key: bytes) -> bytes | None:
        h = key.hex()
        keys = self._keys(h)
        with self._errors("get"):
            for attempt in range(2):
                pipe = self._client.pipeline(transaction=False)
                pipe.get(keys[0])
                pipe.evalsha(self._touch.sha, len(keys), *keys, h)
                try:
                    value, _ = pipe.execute()
                    return value
                except self._redis.exceptions.NoScriptError:
                    if attempt:
                        raise
                    self._client.script_load(_TOUCH)  # a restarted or flushed server
        return None  # pragma: no cover

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """One round trip for every key (GETs and their LRU touches in one pipeline): a
        prefix of hundreds of blocks would otherwise cost hundreds of round trips."""
        if not keys:
            return []
        with self._errors("get_many"):
            for attempt in range(2):
                pipe = self._client.pipeline(transaction=False)
                for key in keys:
                    h = key.hex()
                    ks = self._keys(h)
                    pipe.get(ks[0])
                    pipe.evalsha(self._touch.sha, len(ks), *ks, h)
                try:
                    return pipe.execute()[::2]
                except self._redis.exceptions.NoScriptError:
                    if attempt:
                        raise
                    self._client.script_load(_TOUCH)
        return [None] * len(keys)  # pragma: no cover

    def count_present(self, keys: Sequence[bytes]) -> int:
        if not keys:
            return 0
        with self._errors("count_present"):
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(self._prefix + key.hex())
            found = pipe.execute()
        return next((i for i, hit in enumerate(found) if not hit), len(found))

    def delete(self, key: bytes) -> None:
        h = key.hex()
        with self._errors("delete"):
            self._delete(keys=self._keys(h), args=[h])

    @property
    def used_bytes(self) -> int:
        with self._errors("used_bytes"):
            return int(self._client.get(self._books[1]) or 0)

    @property
    def num_entries(self) -> int:
        with self._errors("num_entries"):
            return int(self._client.zcard(self._books[0]))

    def flush_namespace(self) -> int:
        """Delete every key of this namespace (tests, and an operator starting over); returns
        how many were deleted."""
        n = 0
        with self._errors("flush_namespace"):
            batch: list[Any] = []
            for k in self._client.scan_iter(match=f"{self.namespace}:*", count=1000):
                batch.append(k)
                if len(batch) >= 1000:
                    n += self._client.delete(*batch)
                    batch = []
            if batch:
                n += self._client.delete(*batch)
        return n

    def close(self) -> None:
        self._client.close()


def _check_redis_url(url: str, flag: str) -> None:
    """``redis://HOST:PORT/DB``, ``rediss://...`` or ``unix:///path?db=N``; checked without
    connecting, so a typo fails at start rather than as a stream of unavailable errors."""
    if not isinstance(url, str) or not url.strip():
        raise ValueError(f"{flag}: expected a URL such as redis://HOST:6379/0, got {url!r}")
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss", "unix"):
        raise ValueError(
            f"{flag}: scheme {parts.scheme!r} in {url!r}: expected redis://, rediss:// or unix://"
        )
    db = parse_qs(parts.query).get("db", [None])[-1]
    if parts.scheme == "unix":
        if not parts.path:
            raise ValueError(f"{flag}: {url!r} names no socket path (unix:///path/to/socket)")
    else:
        if not parts.hostname:
            raise ValueError(f"{flag}: {url!r} names no host (redis://HOST:PORT/DB)")
        try:
            port = parts.port
        except ValueError:
            raise ValueError(f"{flag}: port in {url!r} must be an integer in 1-65535") from None
        if port is not None and not 1 <= port <= 65535:
            raise ValueError(f"{flag}: port {port} in {url!r} must be in 1-65535")
        path = parts.path.strip("/")
        if path:
            db = path
    if db is not None and not re.fullmatch(r"[0-9]+", db):
        raise ValueError(f"{flag}: database {db!r} in {url!r} must be a non-negative integer")
