"""Where KV entries evicted from the device pool wait to be loaded back: host memory, a local
disk, a shared Redis (:mod:`kvserve.kv.redis_tier`).

A tier stores opaque entry bytes (:mod:`kvserve.kv.tier_entry` makes and checks them) under a
block-hash key, within a byte budget, evicting least-recently-used entries to make room. The
engine's offload worker calls :meth:`Tier.put` / :meth:`Tier.get` while the engine thread asks
:meth:`Tier.count_present` how much of a prefix a tier holds, so every tier is thread-safe;
no lock is held across disk or network I/O. Backend failures raise :class:`TierError` with a
``reason`` the caller can back off on; a tier never returns a partly written entry.
"""

from __future__ import annotations

import errno
import itertools
import os
import threading
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any


class TierError(Exception):
    """A tier's backend failed. ``reason``: ``timeout`` (a bounded wait ran out),
    ``unavailable`` (cannot connect), ``full`` (the disk has no space) or ``error``."""

    def __init__(self, reason: str, message: str = "") -> None:
        super().__init__(f"kv tier ({reason}): {message}" if message else f"kv tier ({reason})")
        self.reason = reason


class Tier(ABC):
    """A byte-budgeted LRU store of entries by key. ``put`` is first-writer-wins: an entry
    under a key is the same bytes whoever writes it (keys are content hashes), so a second
    write would only cost I/O."""

    name: str = ""
    flag: str = ""  # the CLI flags that configure this tier, for error messages
    size_flag: str = ""

    def __init__(self, capacity_bytes: int) -> None:
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int):
            raise ValueError(f"{self.size_flag}: capacity must be an int, got {capacity_bytes!r}")
        if capacity_bytes < 1:
            raise ValueError(f"{self.size_flag}: capacity must be >= 1 byte, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.num_evictions = 0
        # Keys this tier evicted since the owner last took them (None: not recorded; the
        # KV events' BlockRemoved). A Redis tier evicts on the server and cannot name them.
        self.evicted_keys: list[bytes] | None = None
        self._lock = threading.Lock()

    @abstractmethod
    def put(self, key: bytes, data: bytes) -> bool:
        """Store ``data`` under ``key``, evicting LRU entries until it fits. False (nothing
        stored) if it is larger than the capacity or ``key`` is already present."""

    @abstractmethod
    def get(self, key: bytes) -> bytes | None:
        """The entry under ``key`` (now most recently used), or None."""

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """``get`` of each key, in order (a remote tier does it in one round trip)."""
        return [self.get(k) for k in keys]

    @abstractmethod
    def count_present(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` are present: a prefix is only useful up to its first
        missing block. Does not touch the LRU order (the gets that follow do)."""

    @abstractmethod
    def delete(self, key: bytes) -> None:
        """Drop ``key`` (an entry that failed its checksum); absent keys are ignored."""

    @property
    @abstractmethod
    def used_bytes(self) -> int: ...

    @property
    @abstractmethod
    def num_entries(self) -> int: ...

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release the backend's resources."""


class HostTier(Tier):
    """Entries in host memory: an OrderedDict in LRU order (oldest first)."""

    name = "cpu"
    flag = size_flag = "--kv-offload-cpu"

    def __init__(self, capacity_bytes: int) -> None:
        super().__init__(capacity_bytes)
        self._entries: OrderedDict[bytes, bytes] = OrderedDict()
        self._used = 0

    def put(self, key: bytes, data: bytes) -> bool:
        data = bytes(data)
        with self._lock:
            if len(data) > self.capacity_bytes or key in self._entries:
                return False
            while self._used + len(data) > self.capacity_bytes:
                gone, old = self._entries.popitem(last=False)
                self._used -= len(old)
                self.num_evictions += 1
                if self.evicted_keys is not None:
                    self.evicted_keys.append(gone)
            self._entries[key] = data
            self._used += len(data)
            return True

    def get(self, key: bytes) -> bytes | None:
        with self._lock:
            data = self._entries.get(key)
            if data is not None:
                self._entries.move_to_end(key)
            return data

    def count_present(self, keys: Sequence[bytes]) -> int:
        with self._lock:
            return _leading(keys, self._entries)

    def delete(self, key: bytes) -> None:
        with self._lock:
            data = self._entries.pop(key, None)
            if data is not None:
                self._used -= len(data)

    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def num_entries(self) -> int:
        return len(self._entries)


class DiskTier(Tier):
    """One file per entry, ``<key hex>.kv``, in a directory this engine owns.

    A put writes a temp file in the same directory and ``os.replace``-s it onto its name: the
    rename is atomic, so a reader (or an engine restarted after a crash) sees a complete file
    or none, and stale temp files are recognisable by name. No fsync: a renamed file whose
    data a power cut lost fails the entry checksum and is dropped, which is all a cache needs.
    The index (key -> size, LRU order) lives in memory; at start the directory's entries are
    adopted oldest-mtime first, and a get refreshes the mtime so that order survives restarts.
    A put reserves its bytes before writing, so files on disk never exceed the capacity.
    """

    name = "disk"
    flag = "--kv-offload-disk"
    size_flag = "--kv-offload-disk-size"
    SUFFIX = ".kv"
    TMP_SUFFIX = ".tmp"
    CHUNK = 16 << 20  # bytes per os.write call

    def __init__(self, directory: str | os.PathLike[str], capacity_bytes: int) -> None:
        super().__init__(capacity_bytes)
        self.directory = Path(directory)
        self._check_directory()
        self._index: OrderedDict[bytes, int] = OrderedDict()
        self._used = 0
        self._reserved = 0
        self._writing: set[bytes] = set()
        self._tmp_ids = itertools.count()
        self._adopt()

    # -- start ---------------------------------------------------------------------------------
    def _check_directory(self) -> None:
        d = self.directory
        if d.exists() and not d.is_dir():
            raise ValueError(f"{self.flag}: {str(d)!r} is not a directory")
        try:
            d.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"{self.flag}: cannot create directory {str(d)!r}: {e}") from None
        probe = d / f".probe-{os.getpid()}-{threading.get_ident()}{self.TMP_SUFFIX}"
        try:
            os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
            os.unlink(probe)
        except OSError as e:
            raise ValueError(f"{self.flag}: directory {str(d)!r} is not writable: {e}") from None

    def _adopt(self) -> None:
        found: list[tuple[float, bytes, int]] = []
        for entry in os.scandir(self.directory):
            if not entry.is_file(follow_symlinks=False):
                continue
            if entry.name.endswith(self.TMP_SUFFIX):  # a write that never finished
                _unlink(entry.path)
                continue
            if not entry.name.endswith(self.SUFFIX):
                continue
            try:
                key = bytes.fromhex(entry.name[: -len(self.SUFFIX)])
                st = entry.stat(follow_symlinks=False)
            except (ValueError, OSError):
                continue
            found.append((st.st_mtime, key, st.st_size))
        for _, key, size in sorted(found, key=lambda f: (f[0], f[1])):
            self._index[key] = size
            self._used += size
        with self._lock:
            self._evict_locked(0)

    # -- entries -------------------------------------------------------------------------------
    def path_of(self, key: bytes) -> Path:
        return self.directory / f"{key.hex()}{self.SUFFIX}"

    def put(self, key: bytes, data: bytes) -> bool:
        n = len(data)
        with self._lock:
            if n > self.capacity_bytes or key in self._index or key in self._writing:
                return False
            self._evict_locked(n)
            if self._used + self._reserved + n > self.capacity_bytes:
                return False  # other puts in flight hold the room
            self._writing.add(key)
            self._reserved += n
        ok = False
        try:
            self._write(key, data)
            ok = True
        finally:
            with self._lock:
                self._writing.discard(key)
                self._reserved -= n
                if ok:
                    self._index[key] = n
                    self._used += n
        return True

    def _write(self, key: bytes, data: bytes) -> None:
        tmp = self.directory / f".{key.hex()}.{os.getpid()}.{next(self._tmp_ids)}{self.TMP_SUFFIX}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                view = memoryview(data).cast("B")
                while view:
                    view = view[os.write(fd, view[: self.CHUNK]) :]
            finally:
                os.close(fd)
            os.replace(tmp, self.path_of(key))
        except OSError as e:
            _unlink(tmp)
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise TierError("full", f"disk tier {str(self.directory)!r}: {e}") from e
            raise TierError("error", f"disk tier {str(self.directory)!r}: {e}") from e

    def get(self, key: bytes) -> bytes | None:
        with self._lock:
            if key not in self._index:
                return None
            self._index.move_to_end(key)
        path = self.path_of(key)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            with self._lock:  # removed behind our back: a miss, and no longer indexed
                if key in self._index and not path.exists():
                    self._used -= self._index.pop(key)
            return None
        except OSError as e:
            raise TierError("error", f"disk tier: reading {str(path)!r}: {e}") from e
        try:
            os.utime(path)
        except OSError:
            pass
        return data

    def count_present(self, keys: Sequence[bytes]) -> int:
        with self._lock:
            return _leading(keys, self._index)

    def delete(self, key: bytes) -> None:
        with self._lock:
            size = self._index.pop(key, None)
            if size is not None:
                self._used -= size
                _unlink(self.path_of(key))

    def _evict_locked(self, room: int) -> None:
        """Remove oldest entries until ``room`` more bytes fit (the lock is held: an unlink
        outside it could remove a file a concurrent put of the same key just renamed)."""
        while self._index and self._used + self._reserved + room > self.capacity_bytes:
            key, size = self._index.popitem(last=False)
            self._used -= size
            self.num_evictions += 1
            if self.evicted_keys is not None:
                self.evicted_keys.append(key)
            _unlink(self.path_of(key))

    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def num_entries(self) -> int:
        return len(self._index)


def _leading(keys: Sequence[bytes], present: Any) -> int:
    return next((i for i, key in enumerate(keys) if key not in present), len(keys))


def _unlink(path: str | os.PathLike[str]) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
