"""The bytes of one KV tier entry: a :class:`BlockPayload` as it lies in host memory, on disk
or in Redis, and the checks that make loading one safe.

Layout (little-endian)::

    header  magic b"KVSV" | u16 version | u16 key length | u32 meta length | u64 body length
            | 16-byte xxh3_128 digest of key + meta + body
    key     the entry's key, echoed (a file renamed or a Redis value written under another
            key is caught, not silently loaded into the wrong prefix)
    meta    JSON: identity, num_blocks, the tensors / pool / extra structures with each tensor
            replaced by ``{"__t__": i}``, and ``specs[i]`` = dtype name, shape, body offset
    body    the tensors' raw bytes, concatenated in ``specs`` order

No pickle: entries come from a disk other processes write and a Redis other replicas share, so
loading one must never execute code. JSON and raw tensor bytes can only ever be data.

Encoding makes one join of the parts; decoding reads the header, hashes a memoryview and makes
one copy per tensor (the result owns its memory, so the input buffer can be freed), so a
~200 MB prefix costs no per-element Python work.
"""

from __future__ import annotations

import json
import math
import struct
import warnings
from typing import Any

import numpy as np
import torch
import xxhash

from kvserve.kv.storage import BlockPayload

ENTRY_VERSION = 1
MAGIC = b"KVSV"
_HEADER = struct.Struct("<4sHHIQ16s")
HEADER_SIZE = _HEADER.size
_REF = "__t__"

# Dtypes an entry may name, by their torch name: decoding maps names through this table only.
_DTYPE_NAMES = (
    "float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2",
    "float8_e4m3fnuz", "float8_e5m2fnuz", "int64", "int32", "int16", "int8", "uint8", "bool",
)  # fmt: skip
DTYPES: dict[str, torch.dtype] = {
    n: getattr(torch, n) for n in _DTYPE_NAMES if isinstance(getattr(torch, n, None), torch.dtype)
}


class EntryError(Exception):
    """An entry that cannot be loaded. ``reason`` is one of ``truncated``, ``checksum``,
    ``key``, ``version``, ``malformed``: a caller counts them and drops the entry."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"kv tier entry ({reason}): {message}")
        self.reason = reason


def encode_entry(key: bytes, payload: BlockPayload) -> bytes:
    """The bytes of ``payload`` stored under ``key`` (one allocation: a single join)."""
    if len(key) > 0xFFFF:
        raise ValueError(f"encode_entry: key is {len(key)} bytes, at most 65535")
    payload.wait()  # an export from a GPU may still be copying into host memory
    arrays: list[np.ndarray] = []
    specs: list[dict[str, Any]] = []
    offset = 0

    def walk(value: Any, where: str) -> Any:
        nonlocal offset
        if isinstance(value, torch.Tensor):
            name = str(value.dtype).removeprefix("torch.")
            if name not in DTYPES:
                raise ValueError(f"encode_entry: {where}: dtype {name} cannot be stored")
            t = value.detach().cpu().contiguous()
            raw = t.reshape(-1).view(torch.uint8).numpy()
            specs.append({"dtype": name, "shape": list(t.shape), "offset": offset})
            arrays.append(raw)
            offset += raw.nbytes
            return {_REF: len(specs) - 1}
        if isinstance(value, dict):
            if _REF in value:
                raise ValueError(f"encode_entry: {where}: the key {_REF!r} is reserved")
            out = {}
            for k, v in value.items():
                if not isinstance(k, str):
                    raise ValueError(f"encode_entry: {where}: dict key {k!r} is not a str")
                out[k] = walk(v, f"{where}.{k}")
            return out
        if isinstance(value, list | tuple):
            return [walk(v, f"{where}[{i}]") for i, v in enumerate(value)]
        if isinstance(value, np.generic):
            return value.item()
        if value is None or isinstance(value, bool | int | float | str):
            return value
        raise ValueError(f"encode_entry: {where}: cannot store a {type(value).__name__}")

    meta_obj = {
        "identity": walk(payload.identity, "identity"),
        "num_blocks": int(payload.num_blocks),
        "tensors": walk(payload.tensors, "tensors"),
        "pool": walk(payload.pool, "pool"),
        "extra": walk(payload.extra, "extra"),
        "specs": specs,
    }
    meta = json.dumps(meta_obj, separators=(",", ":")).encode()
    h = xxhash.xxh3_128()
    h.update(key)
    h.update(meta)
    for a in arrays:
        h.update(a)
    header = _HEADER.pack(MAGIC, ENTRY_VERSION, len(key), len(meta), offset, h.digest())
    return b"".join([header, key, meta, *arrays])


def decode_entry(
    key: bytes, data: bytes | bytearray | memoryview, copy: bool = True
) -> BlockPayload:
    """The payload in ``data``, checked to be a complete, intact entry of this version stored
    under ``key``; raises :class:`EntryError` (nothing partial is returned). With ``copy``
    False the tensors are read-only views of ``data`` (a caller that copies them anyway
    saves a copy into fresh memory, whose page faults cost more than the copy itself)."""
    view = memoryview(data).cast("B")
    if len(view) < HEADER_SIZE:
        raise EntryError(
            "truncated", f"{len(view)} bytes, shorter than the {HEADER_SIZE}-byte header"
        )
    magic, version, key_len, meta_len, body_len, digest = _HEADER.unpack_from(view)
    if magic != MAGIC:
        raise EntryError("malformed", f"magic {bytes(magic)!r}, expected {MAGIC!r}")
    if version != ENTRY_VERSION:
        raise EntryError("version", f"version {version}, this build reads {ENTRY_VERSION}")
    declared = HEADER_SIZE + key_len + meta_len + body_len
    if len(view) != declared:
        reason = "truncated" if len(view) < declared else "malformed"
        raise EntryError(reason, f"{len(view)} bytes, the header declares {declared}")
    k0, m0 = HEADER_SIZE, HEADER_SIZE + key_len
    b0 = m0 + meta_len
    if xxhash.xxh3_128_digest(view[k0:]) != digest:
        raise EntryError("checksum", "xxh3_128 digest of key, meta and body does not match")
    if view[k0:m0] != key:
        raise EntryError("key", f"stored under {bytes(view[k0:m0]).hex()}, asked for {key.hex()}")
    try:
        meta = json.loads(view[m0:b0].tobytes())
        tensors = _tensors(meta["specs"], view[b0:], body_len, copy)
        payload = BlockPayload(
            identity=_resolve(meta["identity"], tensors),
            num_blocks=meta["num_blocks"],
            tensors=_resolve(meta["tensors"], tensors),
            pool=_resolve(meta["pool"], tensors),
            extra=_resolve(meta["extra"], tensors),
        )
    except EntryError:
        raise
    except (ValueError, KeyError, TypeError, IndexError, AttributeError, RecursionError) as e:
        raise EntryError("malformed", f"meta: {type(e).__name__}: {e}") from None
    for name, value in (("identity", payload.identity), ("tensors", payload.tensors),
                        ("pool", payload.pool), ("extra", payload.extra)):  # fmt: skip
        if not isinstance(value, dict):
            raise EntryError("malformed", f"meta: {name} is a {type(value).__name__}, not a dict")
    if not isinstance(payload.num_blocks, int) or isinstance(payload.num_blocks, bool):
        raise EntryError("malformed", f"meta: num_blocks {payload.num_blocks!r} is not an int")
    if not all(isinstance(t, torch.Tensor) for t in payload.tensors.values()):
        raise EntryError("malformed", "meta: every value of tensors must be a tensor")
    return payload


def _tensors(
    specs: list[dict[str, Any]], body: memoryview, body_len: int, copy: bool = True
) -> list[torch.Tensor]:
    """The body's tensors, each a private copy (or a view of the body); the specs must tile
    the body exactly."""
    out: list[torch.Tensor] = []
    end = 0
    raw = np.frombuffer(body, dtype=np.uint8)
    for i, spec in enumerate(specs):
        dtype = DTYPES.get(spec["dtype"])
        shape = spec["shape"]
        if dtype is None:
            raise EntryError("malformed", f"tensor {i}: unknown dtype {spec['dtype']!r}")
        if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise EntryError("malformed", f"tensor {i}: bad shape {shape!r}")
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if spec["offset"] != end or end + nbytes > body_len:
            raise EntryError(
                "malformed",
                f"tensor {i}: {nbytes} bytes at offset {spec['offset']!r} do not follow the "
                f"previous tensor (end {end}) within the {body_len}-byte body",
            )
        if nbytes == 0:
            out.append(torch.empty(shape, dtype=dtype))
        else:
            part = raw[end : end + nbytes]
            if copy or part.flags.writeable:
                flat = torch.from_numpy(part.copy() if copy else part)
            else:
                with warnings.catch_warnings():  # read-only by contract: nobody writes to it
                    warnings.simplefilter("ignore", UserWarning)
                    flat = torch.from_numpy(part)
            out.append(flat.view(dtype).reshape(shape))
        end += nbytes
    if end != body_len:
        raise EntryError("malformed", f"tensors cover {end} of the {body_len}-byte body")
    return out


def _resolve(value: Any, tensors: list[torch.Tensor]) -> Any:
    """``value`` with every ``{"__t__": i}`` reference replaced by tensor ``i``."""
    if isinstance(value, dict):
        if _REF in value:
            if len(value) != 1 or not isinstance(value[_REF], int) or value[_REF] < 0:
                raise EntryError("malformed", f"meta: bad tensor reference {value!r}")
            return tensors[value[_REF]]
        return {k: _resolve(v, tensors) for k, v in value.items()}
    if isinstance(value, list):
        return [_resolve(v, tensors) for v in value]
    return value
