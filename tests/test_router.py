"""``kvserve router`` over two real ``kvserve serve`` processes on loopback, with KV events on:
a prompt's continuation goes to the replica that holds its prefix and that replica reports
the hit the router expected; a tenant's prompt is never routed by another tenant's blocks and
nothing of either shows in the router's metrics; a replica killed mid-stream ends that
stream with a clear error while requests not started on it are served by the other, its
blocks leave the router's index, and once restarted it is re-learned from its events."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import uvicorn

from kvserve.distributed import free_port
from kvserve.router.app import Replica, RouterState, build_app, cache_config_of
from kvserve.router.index import PrefixIndex
from kvserve.router.policies import make_policy
from kvserve.server.tenants import TenantResolver
from tests.conftest import prompts_of_lengths
from tests.serve_process import ServeProcess

SECRET = "router-test-secret-0123456789"
KEYS = {"key-a": "tenant-a", "key-b": "tenant-b"}


class RouterThread:
    """The router's app under uvicorn in a thread, on a free loopback port."""

    def __init__(self, state: RouterState) -> None:
        self.state = state
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        config = uvicorn.Config(build_app(state), log_level="warning", access_log=False)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True)  # fmt: skip
        self.thread.start()
        _until(lambda: self.server.started, 20, "router start")

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(20)


def _until(cond, timeout: float, what: str) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


@pytest.fixture
def cluster(checkpoint, tmp_path, monkeypatch):
    """Two replicas (tenant keys, a shared tenant secret, events on ipc sockets) and the
    router in front of them with the prefix policy."""
    tenants = tmp_path / "tenants.json"
    tenants.write_text(json.dumps(KEYS))
    env = {**os.environ, "KVSERVE_TENANT_SECRET": SECRET}
    specs = []
    for i in range(2):
        ev, rp = f"ipc://{tmp_path}/ev{i}", f"ipc://{tmp_path}/rp{i}"
        cfg = json.dumps({"enable_kv_cache_events": True, "endpoint": ev, "replay_endpoint": rp})
        args = ["--model", checkpoint("llama_gqa"), "--dtype", "float32", "--block-size", "16",
                "--num-gpu-blocks", "96", "--max-model-len", "1024", "--tenants", str(tenants),
                "--kv-events-config", cfg, "--disable-access-log",
                "--served-model-name", "m"]  # fmt: skip
        specs.append((args, free_port(), ev, rp))

    def start(spec):  # noqa: ANN001, ANN202
        return ServeProcess(spec[0], env=env, port=spec[1])

    with ThreadPoolExecutor(2) as pool:
        servers = list(pool.map(start, specs))
    index = PrefixIndex(2)
    monkeypatch.setenv("KVSERVE_TENANT_SECRET", SECRET)  # the router shares the replicas'
    resolver = TenantResolver.from_args(None, str(tenants))
    replicas = [Replica(f"r{i}", s.url, sp[2], sp[3]) for i, (s, sp) in
                enumerate(zip(servers, specs, strict=True))]  # fmt: skip
    state = RouterState(replicas, make_policy("prefix", index=index), index, resolver,
                        health_interval_s=0.2)  # fmt: skip
    router = RouterThread(state)
    ctx = {"router": router, "state": state, "servers": servers, "specs": specs, "env": env}
    try:
        yield ctx
    finally:
        router.close()
        for s in ctx["servers"]:
            s.close()


def complete(url: str, prompt, key: str, **kw):  # noqa: ANN001, ANN201
    body = {"model": "m", "prompt": prompt, "max_tokens": 2, "temperature": 0, **kw}
    r = httpx.post(url + "/v1/completions", json=body, timeout=60,
                   headers={"Authorization": f"Bearer {key}"})  # fmt: skip
    assert r.status_code == 200, r.text
    return r.json()


def test_router_routes_by_prefix_keeps_tenants_apart_and_survives_a_replica(cluster):
    router, state = cluster["router"], cluster["state"]
    idx, url = state.index, router.url
    shared, tail, other = prompts_of_lengths([100, 20, 60], vocab=300, seed=11)

    # 0. A replica's metrics give its pool as prefix_approx reads it (--num-gpu-blocks 96,
    # --block-size 16).
    page = httpx.get(cluster["servers"][0].url + "/metrics", timeout=10).text
    assert cache_config_of(page) == (96, 16)

    # 1. The first request lands somewhere; its blocks reach the index from the events.
    complete(url, shared, "key-a")
    salt_a = state.tenants.cache_salt("tenant-a", None)
    _until(lambda: len(idx.chain(shared, salt_a)) == 6, 10, "the first prompt's events")
    holder = next(r for r in range(2) if idx.overlap(r, idx.chain(shared, salt_a))[0] == 6)
    # Load on the holder must not outweigh its 6 cached blocks: it wins the continuation.
    out = complete(url, shared + tail, "key-a")
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 96
    # The continuation's 7th block is stored now too: the next one expects and hits 7.
    _until(lambda: idx.overlap(holder, idx.chain(shared + tail, salt_a))[0] == 7, 10, "7 blocks")
    out = complete(url, shared + tail, "key-a")
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 112
    m = _metrics(url)
    name = f"r{holder}"
    assert m[("kvserve:router_expected_hit_tokens_total", name)] == 96 + 112
    assert m[("kvserve:router_reported_hit_tokens_total", name)] == 96 + 112

    # 2. Tenant B sends the same tokens: A's blocks must not draw it (it scores 0).
    salt_b = state.tenants.cache_salt("tenant-b", None)
    assert idx.chain(shared, salt_b) == []
    before = _metrics(url)
    out = complete(url, shared + tail, "key-b")
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    after = _metrics(url)
    assert sum(after[k] - before.get(k, 0) for k in after
               if k[0] == "kvserve:router_expected_hit_tokens_total") == 0  # fmt: skip
    text = httpx.get(url + "/metrics", timeout=10).text
    for secret in ("tenant-a", "tenant-b", salt_a, salt_b, "key-a"):
        assert secret not in text

    # 3. Kill the holder while it streams; the stream ends with a clear error, the other
    # replica serves everything sent afterwards, the holder's blocks leave the index.
    victim = cluster["servers"][holder]
    body = {"model": "m", "prompt": shared + other, "max_tokens": 800, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60,
                      headers={"Authorization": "Bearer key-a"}) as resp:  # fmt: skip
        assert resp.status_code == 200
        chunks = resp.iter_text()
        first = next(chunks)
        assert first.startswith("data: ")
        victim.proc.kill()
        rest = "".join(chunks)
    assert "replica_failed" in rest and rest.rstrip().endswith("data: [DONE]"), rest[-400:]
    survivors = [complete(url, p, "key-a") for p in prompts_of_lengths([40] * 4, 300, seed=3)]
    assert len(survivors) == 4  # none failed: none had started on the dead replica
    _until(lambda: not state.replicas[holder].load.healthy, 5, "the health check")
    assert idx.num_blocks(holder) == 0

    # 4. Restart it at the same URL and endpoints: healthy again, and re-learned from its
    # events (a prompt sent to it directly shows up in the router's index).
    args, port, _, _ = cluster["specs"][holder]
    cluster["servers"][holder] = ServeProcess(args, env=cluster["env"], port=port)
    _until(lambda: state.replicas[holder].load.healthy, 10, "the restarted replica")
    fresh = prompts_of_lengths([64], vocab=300, seed=99)[0]
    complete(cluster["servers"][holder].url, fresh, "key-a")
    _until(lambda: idx.overlap(holder, idx.chain(fresh, salt_a))[0] == 4, 10, "re-learning")
    assert idx.overlap(1 - holder, idx.chain(fresh, salt_a))[0] == 0
    for s in cluster["servers"]:
        assert s.stop() == 0


def _metrics(url: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    text = httpx.get(url + "/metrics", timeout=10).text
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if "replica" in s.labels:
                out[(s.name, s.labels["replica"])] = s.value
    return out


def test_router_cli_refuses_bad_flags(capsys):
    from kvserve.cli import main

    with pytest.raises(SystemExit):
        main(["router", "--replica", "http://127.0.0.1:1", "--routing-logic", "random"])
    # prefix without any events endpoint: a clear error naming the flag, exit 2
    assert main(["router", "--replica", "http://127.0.0.1:1"]) == 2
    assert main(["router", "--replica", "127.0.0.1:1", "--routing-logic", "round_robin"]) == 2
    assert main(["router", "--replica", "http://127.0.0.1:1", "--routing-logic",
                 "prefix_approx", "--approx-capacity-blocks", "0"]) == 2  # fmt: skip
    assert "approx_capacity_blocks: must be >= 1, got 0" in capsys.readouterr().err
    assert main(["router", "--replica", "http://127.0.0.1:1", "--routing-logic",
                 "prefix_approx", "--block-size", "0"]) == 2  # fmt: skip
    assert "block_size: must be >= 1, got 0" in capsys.readouterr().err
    assert main(["router", "--replica", "http://127.0.0.1:1", "--routing-logic",
                 "prefix_approx", "--balance-abs-threshold", "-1"]) == 2  # fmt: skip
    assert "balance_abs_threshold: must be >= 0, got -1" in capsys.readouterr().err
