"""What a prefill engine and a decode engine say to each other on the KV side channel.

Control messages are msgspec structs (tagged, so one decoder reads any of them); a block read's
answer carries the blocks' bytes as extra ZMQ frames, in the pool's own storage format (fp8,
int8 and KIVI codes travel compressed, with the pool-wide state and side rows they need), so
the importing pool holds the same bits the exporting pool did.

Frames on the wire: ``[message, *tensor frames]`` (a ROUTER socket adds the peer's identity in
front).
"""

from __future__ import annotations

import warnings
from typing import Any

import msgspec
import torch

from kvserve.kv.storage import BlockPayload

PROTOCOL_VERSION = 1


class Hello(msgspec.Struct, tag=True):
    """A decode engine's first message to a prefill engine: who it is and what its pool
    holds; the prefill engine refuses a mismatch, naming the field."""

    version: int
    engine_id: str
    model: str  # the checkpoint's fingerprint (config and weight bytes)
    identity: dict[str, Any]  # the storage's format, block size, layer and head geometry


class HelloOk(msgspec.Struct, tag=True):
    engine_id: str


class Refused(msgspec.Struct, tag=True):
    """A hello or a read that cannot be served; ``reason`` says why (a field, a lease)."""

    reason: str
    xfer_id: int = -1


class Ping(msgspec.Struct, tag=True):
    seq: int


class Pong(msgspec.Struct, tag=True):
    seq: int


class Read(msgspec.Struct, tag=True):
    """Read blocks of a held request: ``indices`` into the block ids the prefill engine handed
    out (the decode engine already holds the others in its prefix cache)."""

    xfer_id: int
    request_id: str
    indices: list[int]


class ReadOk(msgspec.Struct, tag=True):
    xfer_id: int
    payload: dict[str, Any]  # BlockPayload's fields, tensors replaced by frame references


class Release(msgspec.Struct, tag=True):
    """The decode engine is done with a held request (read, aborted or failed): the prefill
    engine may free its blocks."""

    request_id: str


Message = Hello | HelloOk | Refused | Ping | Pong | Read | ReadOk | Release
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes | memoryview) -> Message:
    return _decoder.decode(data)


def _pack(obj: Any, frames: list[memoryview]) -> Any:
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        frames.append(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
        return {"__tensor__": len(frames) - 1, "dtype": str(t.dtype).removeprefix("torch."),
                "shape": list(t.shape)}  # fmt: skip
    if isinstance(obj, dict):
        return {k: _pack(v, frames) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_pack(v, frames) for v in obj]
    return obj


def _unpack(obj: Any, frames: list[Any]) -> Any:
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            raw = frames[obj["__tensor__"]]
            if len(raw):
                with warnings.catch_warnings():  # read-only memory: only ever read (imported)
                    warnings.simplefilter("ignore", UserWarning)
                    flat = torch.frombuffer(raw, dtype=torch.uint8)
            else:
                flat = torch.empty(0, dtype=torch.uint8)
            return flat.view(getattr(torch, obj["dtype"])).reshape(obj["shape"])
        return {k: _unpack(v, frames) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_unpack(v, frames) for v in obj]
    return obj


def pack_payload(payload: BlockPayload) -> tuple[dict[str, Any], list[memoryview]]:
    """A payload as a plain description and the frames of its tensors (no copy of the
    tensors' bytes on the CPU)."""
    frames: list[memoryview] = []
    desc = {
        "identity": payload.identity,
        "num_blocks": payload.num_blocks,
        "tensors": _pack(payload.wait().tensors, frames),
        "pool": _pack(payload.pool, frames),
        "extra": _pack(payload.extra, frames),
    }
    return desc, frames


def unpack_payload(desc: dict[str, Any], frames: list[Any]) -> BlockPayload:
    """The payload, its tensors over ``frames``' memory (no copy: the caller keeps the frames
    alive until the blocks are imported, and nothing writes to them)."""
    return BlockPayload(
        identity=desc["identity"],
        num_blocks=desc["num_blocks"],
        tensors=_unpack(desc["tensors"], frames),
        pool=_unpack(desc["pool"], frames),
        extra=_unpack(desc["extra"], frames),
    )


def payload_bytes(frames: list[Any]) -> int:
    return sum(len(memoryview(f).cast("B")) for f in frames)


def first_mismatch(ours: dict[str, Any], theirs: dict[str, Any]) -> str | None:
    """The first field whose value differs between two handshakes (model, then the storage's
    identity field by field), as a message naming it; None when they match."""
    for key in sorted(set(ours) | set(theirs)):
        a, b = ours.get(key), theirs.get(key)
        if a != b:
            return f"{key}: the prefill engine has {a!r}, the decode engine {b!r}"
    return None
