"""vLLM's ``kv_transfer_params`` fields, read and checked in one place.

A prefill engine is asked with ``{"do_remote_decode": true}`` and answers (NixlConnector's
names) ``do_remote_prefill``, ``do_remote_decode``, ``remote_engine_id``, ``remote_host``,
``remote_port``, ``remote_block_ids``, ``remote_request_id`` and ``tp_size``, plus ours:
``remote_block_hashes`` (hex, one per full prompt block: the decode engine checks that its own
prefix cache means the same tokens), ``remote_num_tokens`` (the prompt's length) and
``first_token_ids`` (the token the prefill engine sampled: the decode engine goes on from it).
A proxy that forwards the answer unchanged, as vLLM's does, needs to know none of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class BadTransferParams(ValueError):
    """kv_transfer_params a decode engine cannot use (the message names the field)."""


@dataclass(slots=True)
class RemotePrefill:
    engine_id: str
    host: str
    port: int
    request_id: str
    block_ids: list[int]
    block_hashes: list[bytes] | None
    num_tokens: int | None
    first_token_ids: list[int]


def wants_remote_decode(params: dict[str, Any] | None) -> bool:
    return bool(params) and params.get("do_remote_decode") is True


def wants_remote_prefill(params: dict[str, Any] | None) -> bool:
    return bool(params) and params.get("do_remote_prefill") is True


def _int(params: dict[str, Any], name: str, lo: int = 0, hi: int = 2**63) -> int:
    v = params.get(name)
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise BadTransferParams(f"kv_transfer_params.{name}: must be an integer in "
                                f"[{lo}, {hi}], got {v!r}")  # fmt: skip
    return v


def _ints(params: dict[str, Any], name: str) -> list[int]:
    v = params.get(name)
    if not isinstance(v, list) or not all(
        isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v
    ):
        raise BadTransferParams(f"kv_transfer_params.{name}: must be a list of non-negative "
                                f"integers, got {v!r}")  # fmt: skip
    return v


def _str(params: dict[str, Any], name: str) -> str:
    v = params.get(name)
    if not isinstance(v, str) or not v:
        raise BadTransferParams(f"kv_transfer_params.{name}: must be a non-empty string, "
                                f"got {v!r}")  # fmt: skip
    return v


def remote_prefill(params: dict[str, Any], request_id: str) -> RemotePrefill:
    """The prefill engine's answer, checked (BadTransferParams naming the field)."""
    hashes = params.get("remote_block_hashes")
    if hashes is not None:
        if not isinstance(hashes, list) or not all(isinstance(h, str) for h in hashes):
            raise BadTransferParams("kv_transfer_params.remote_block_hashes: must be a list of "
                                    "hex strings")  # fmt: skip
        try:
            hashes = [bytes.fromhex(h) for h in hashes]
        except ValueError:
            raise BadTransferParams("kv_transfer_params.remote_block_hashes: not hex") from None
    first = params.get("first_token_ids", [])
    return RemotePrefill(
        engine_id=str(params.get("remote_engine_id", "")),
        host=_str(params, "remote_host"),
        port=_int(params, "remote_port", 1, 65535),
        request_id=str(params.get("remote_request_id") or request_id),
        block_ids=_ints(params, "remote_block_ids"),
        block_hashes=hashes,
        num_tokens=_int(params, "remote_num_tokens") if "remote_num_tokens" in params else None,
        first_token_ids=_ints({"first_token_ids": first}, "first_token_ids"),
    )


def check_request_params(params: Any) -> None:
    """What a server checks in a request's ``kv_transfer_params`` before queueing it."""
    if params is None:
        return
    if not isinstance(params, dict):
        raise BadTransferParams(f"kv_transfer_params: must be a JSON object, got {params!r}")
    for flag in ("do_remote_decode", "do_remote_prefill"):
        if flag in params and not isinstance(params[flag], bool):
            raise BadTransferParams(f"kv_transfer_params.{flag}: must be true or false")
    if wants_remote_prefill(params):
        remote_prefill(params, "-")
