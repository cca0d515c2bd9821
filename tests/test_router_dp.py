"""Data parallelism is replicas: two independent ``kvserve serve`` processes behind
``kvserve router``, both pointed at one real Redis tier (written through). A prompt computed on
one replica is a prefix hit on the other, loaded from Redis; the router's index learns from
the first replica's events that it holds the blocks on its device and in Redis."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx

from kvserve.router.app import Replica, RouterState
from kvserve.router.index import PrefixIndex
from kvserve.router.policies import make_policy
from kvserve.server.tenants import TenantResolver
from tests.conftest import prompts_of_lengths
from tests.serve_process import ServeProcess
from tests.test_router import RouterThread, _until


def test_replicas_behind_the_router_share_the_redis_tier(checkpoint, tmp_path, redis_url):
    specs = []
    for i in range(2):
        ev, rp = f"ipc://{tmp_path}/ev{i}", f"ipc://{tmp_path}/rp{i}"
        cfg = json.dumps({"enable_kv_cache_events": True, "endpoint": ev, "replay_endpoint": rp})
        args = ["--model", checkpoint("llama_gqa"), "--dtype", "float32", "--block-size", "16",
                "--num-gpu-blocks", "64", "--max-model-len", "512",
                "--kv-offload-redis", redis_url, "--kv-offload-write-policy", "write_through",
                "--kv-events-config", cfg, "--disable-access-log",
                "--served-model-name", "m"]  # fmt: skip
        specs.append((args, ev, rp))
    with ThreadPoolExecutor(2) as pool:
        servers = list(pool.map(lambda s: ServeProcess(s[0]), specs))
    index = PrefixIndex(2)
    replicas = [Replica(f"r{i}", s.url, sp[1], sp[2])
                for i, (s, sp) in enumerate(zip(servers, specs, strict=True))]  # fmt: skip
    # round_robin: the second request goes to the other replica whatever it holds.
    state = RouterState(replicas, make_policy("round_robin"), index,
                        TenantResolver.from_args(None, None))  # fmt: skip
    router = RouterThread(state)
    try:
        shared, tail = prompts_of_lengths([100, 20], vocab=300, seed=5)

        def complete(prompt: list[int]) -> int:
            body = {"model": "m", "prompt": prompt, "max_tokens": 2, "temperature": 0}
            r = httpx.post(router.url + "/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

        assert complete(shared) == 0  # replica 0 computes 6 full blocks, writes them through

        # The salt the replicas give an anonymous request, as the router computes it.
        salt = state.route_request({"prompt": shared}, False,
                                   state.tenants.authenticate(None), {}).salt  # fmt: skip

        def in_redis() -> bool:
            chain = index.chain(shared, salt)
            return len(chain) == 6 and all("REDIS" in index.media_of(0, h) for h in chain)

        _until(in_redis, 10, "replica 0's events")
        chain = lambda: index.chain(shared, salt)  # noqa: E731
        assert index.overlap(1, chain()) == (0, 0.0)  # replica 1 computed nothing
        # Replica 1 never saw the prompt: its 6 blocks come from Redis.
        assert complete(shared + tail) == 96
        _until(lambda: index.overlap(1, chain())[0] == 6, 10, "replica 1's events")
        for s in servers:
            assert s.stop() == 0
    finally:
        router.close()
        for s in servers:
            s.close()


def test_two_router_processes_share_the_replicas_through_their_events(checkpoint, tmp_path):
    """Router processes scale out behind a load balancer: each subscribes to every replica's
    events, so a prefix one router sent to a replica routes there from the other too. Router A
    deals round robin (the second prompt lands on replica 1 whatever it holds); router B,
    precise, never saw either request, and sends the second prompt's follow-up to replica 1,
    where it is a hit. Without the events B would tie and pick replica 0."""
    specs = []
    for i in range(2):
        ev, rp = f"ipc://{tmp_path}/ev{i}", f"ipc://{tmp_path}/rp{i}"
        cfg = json.dumps({"enable_kv_cache_events": True, "endpoint": ev, "replay_endpoint": rp})
        args = ["--model", checkpoint("llama_gqa"), "--dtype", "float32", "--block-size", "16",
                "--num-gpu-blocks", "64", "--max-model-len", "512", "--kv-events-config", cfg,
                "--disable-access-log", "--served-model-name", "m"]  # fmt: skip
        specs.append((args, ev, rp))
    with ThreadPoolExecutor(2) as pool:
        servers = list(pool.map(lambda s: ServeProcess(s[0]), specs))
    routers: list[RouterThread] = []
    try:
        indexes = []
        for policy in ("round_robin", "prefix"):
            index = PrefixIndex(2)
            replicas = [Replica(f"r{i}", s.url, sp[1], sp[2])
                        for i, (s, sp) in enumerate(zip(servers, specs, strict=True))]  # fmt: skip
            state = RouterState(replicas, make_policy(policy, index=index), index,
                                TenantResolver.from_args(None, None))  # fmt: skip
            routers.append(RouterThread(state))
            indexes.append(index)
        first, second, tail = prompts_of_lengths([100, 100, 20], vocab=300, seed=9)

        def complete(router: RouterThread, prompt: list[int]) -> int:
            body = {"model": "m", "prompt": prompt, "max_tokens": 2, "temperature": 0}
            r = httpx.post(router.url + "/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

        assert complete(routers[0], first) == 0  # replica 0
        assert complete(routers[0], second) == 0  # replica 1
        b = routers[1].state
        salt = b.route_request({"prompt": second}, False, b.tenants.authenticate(None), {}).salt
        chain = lambda: indexes[1].chain(second, salt)  # noqa: E731
        _until(lambda: len(chain()) == 6 and indexes[1].overlap(1, chain())[0] == 6, 10,
               "router B's index of replica 1")  # fmt: skip
        assert complete(routers[1], second + tail) == 96
        for s in servers:
            assert s.stop() == 0
    finally:
        for r in routers:
            r.close()
        for s in servers:
            s.close()
