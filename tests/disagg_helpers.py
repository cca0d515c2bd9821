"""Prefill/decode engine pairs in one process, driven step by step (the disaggregation tests'
and the pd benchmark's fault runs share them)."""

from __future__ import annotations

import time
from typing import Any

from kvserve import SamplingParams
from kvserve.sched.request import RequestTags

BS = 8


def transfer_config(role: str, port: int, **extra: Any) -> dict[str, Any]:
    return {"kv_connector": "KVServeConnector", "kv_role": role, "kv_ip": "127.0.0.1",
            "kv_port": port, "kv_connector_extra_config": extra}  # fmt: skip


def worker_side(llm: Any) -> Any:
    return llm.engine.executor.driver_worker.connector


def prefill(engine: Any, rid: str, prompt: list[int], params: SamplingParams,
            max_steps: int = 200) -> Any:  # fmt: skip
    """The prefill half: max_tokens 1 with do_remote_decode; returns its final output."""
    engine.add_request(rid, {"prompt_token_ids": prompt}, params.clone(max_tokens=1, n=1),
                       tags=RequestTags(kv_transfer_params={"do_remote_decode": True}))  # fmt: skip
    for _ in range(max_steps):
        for o in engine.step():
            if o.request_id == rid and o.finished:
                return o
    raise AssertionError(f"prefill of {rid} did not finish")


def decode(engines: list[Any], engine: Any, rid: str, prompt: list[int], params: SamplingParams,
           kv_transfer_params: dict | None, timeout_s: float = 30.0) -> Any:  # fmt: skip
    """The decode half on ``engine``, stepping every engine in ``engines`` (the prefill engine
    serves reads in its steps) until ``rid`` finishes."""
    engine.add_request(rid, {"prompt_token_ids": prompt}, params,
                       tags=RequestTags(kv_transfer_params=kv_transfer_params))  # fmt: skip
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        time.sleep(0.0005)  # the transport's threads run between steps
        for e in engines:
            if e is engine:
                for o in e.step():
                    if o.request_id == rid and o.finished:
                        return o
            elif e.has_unfinished_requests():
                e.step()
    raise AssertionError(f"decode of {rid} did not finish")


def settle(engines: list[Any], timeout_s: float = 30.0) -> None:
    """Step until no engine holds anything (held blocks released or their leases ended)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        time.sleep(0.0005)
        busy = [e for e in engines if e.has_unfinished_requests()]
        if not busy:
            return
        for e in busy:
            e.step()
    raise AssertionError("engines did not settle")
