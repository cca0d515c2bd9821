"""Tensor parallelism across machines without Ray (``--nnodes``): two "nodes" on this machine,
each a ``kvserve serve`` process on loopback, node 1 ``--headless``.

The references: the single-rank in-process engine for the tokens (itself equal to
transformers in test_exactness.py); for failures, the rank and node a test killed, and the
bounds the brief sets (seconds, not the collective's 120 s timeout); for the flags, vLLM's
names and the rules written in the docs (N / K ranks per node, node-rank in [0, K)).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import time

import httpx
import pytest

from kvserve import LLM, SamplingParams
from kvserve.config import ConfigError
from kvserve.engine_args import engine_kwargs
from kvserve.executor import WorkerDiedError
from kvserve.llm import engine_config
from tests.serve_process import ServeProcess

MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
PROMPTS = [[(7 * i + j) % 200 + 3 for i in range(n)] for j, n in enumerate((40, 9, 23))]


def free_port_pair() -> int:
    """A port P with P and P + 1 free on loopback (the rendezvous and node 1's channel)."""
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            if port >= 65535:
                continue
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
        return port
    raise RuntimeError("no two adjacent free ports")


def node_args(ckpt: str, port: int, node_rank: int) -> list[str]:
    args = ["--model", ckpt, "--dtype", "float32", "--num-gpu-blocks", "64",
            "--max-model-len", "256", "-tp", "2", "--nnodes", "2", "--node-rank",
            str(node_rank), "--master-addr", "127.0.0.1", "--master-port", str(port),
            "--disable-access-log"]  # fmt: skip
    return args + (["--headless"] if node_rank else [])


def start_two_nodes(ckpt: str) -> tuple[ServeProcess, ServeProcess, int]:
    """Node 1 (headless) first, as a cluster's nodes start in any order; then node 0, which
    waits for it. Returns (node 0, node 1, node 1's worker pid)."""
    port = free_port_pair()
    node1 = ServeProcess(node_args(ckpt, port, 1), ready=None)
    try:
        node0 = ServeProcess(node_args(ckpt, port, 0))
    except BaseException:
        node1.close()
        raise
    try:
        pid = int(node1.wait_for(r"workers 1-1 \(pids (\d+)\) joined", 30).group(1))
    except BaseException:
        node0.close()
        node1.close()
        raise
    return node0, node1, pid


def wait_exit(proc: ServeProcess, timeout: float) -> int | None:
    try:
        return proc.proc.wait(timeout=timeout)
    except Exception:  # noqa: BLE001 - still running: the caller asserts
        return None


def test_two_nodes_give_the_single_rank_tokens_and_a_lost_head_stops_the_headless_node(
    checkpoint, make_llm
):
    ckpt = checkpoint("llama_gqa")
    want = [o.outputs[0].token_ids for o in
            make_llm(ckpt, dtype="float32", num_gpu_blocks=64, max_model_len=256)
            .generate(PROMPTS, GREEDY)]  # fmt: skip
    node0, node1, _ = start_two_nodes(ckpt)
    with node0, node1:
        assert "node 1 (" in node0.text and "connected: workers 1-1" in node0.text, node0.text
        body = {"prompt": PROMPTS, "max_tokens": MAX_TOKENS, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True}  # fmt: skip
        r = httpx.post(node0.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        choices = sorted(r.json()["choices"], key=lambda c: c["index"])
        assert [c["token_ids"] for c in choices] == want
        assert httpx.get(node0.url + "/health", timeout=5).status_code == 200
        head_worker = int(re.search(r"worker 0: pid (\d+)", node0.text).group(1))
        # node 0 vanishes: the headless node notices and exits 1 saying why
        node0.proc.kill()
        t0 = time.monotonic()
        assert wait_exit(node1, 10) == 1, node1.text
        assert time.monotonic() - t0 < 10
        assert "lost node 0's engine" in node1.drain(), node1.text
        deadline = time.monotonic() + 10  # node 0's own worker follows its engine
        while os.path.exists(f"/proc/{head_worker}") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not os.path.exists(f"/proc/{head_worker}")


def test_a_killed_rank_on_another_node_fails_the_engine_naming_rank_and_node(checkpoint):
    node0, node1, remote_pid = start_two_nodes(checkpoint("llama_gqa"))
    with node0, node1:
        url = node0.url
        body = {"prompt": "a long one", "max_tokens": 200, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            os.kill(remote_pid, signal.SIGKILL)
            t0 = time.monotonic()
            rest = [line for line in lines if line]
            assert time.monotonic() - t0 < 5
        error = rest[-2]
        assert "worker 1" in error and "node 1" in error and "SIGKILL" in error, error
        health = httpx.get(url + "/health", timeout=5)
        assert health.status_code == 503 and "worker 1" in health.text
        # the headless node stops and says why; node 0 still exits cleanly on SIGTERM
        assert wait_exit(node1, 10) == 1, node1.text
        assert f"worker 1 (pid {remote_pid}) was killed by SIGKILL" in node1.drain()
        assert node0.stop() == 0, node0.text


def test_a_remote_rank_that_raises_mid_step_fails_the_group_at_once(checkpoint):
    """Node 0 as an ``LLM`` in this process, node 1 headless: rank 1, on node 1, raises in
    its step while rank 0 waits for it in a collective; the engine reports it within
    seconds (not the collective's 120 s), naming rank, node and error, refuses later calls,
    and node 1 stops its rank and exits 1 saying why."""
    from tests.test_tensor_parallel import _break_rank_1, _rank

    ckpt = checkpoint("llama_gqa")
    port = free_port_pair()
    with ServeProcess(node_args(ckpt, port, 1), ready=None) as node1:
        llm = LLM(ckpt, dtype="float32", num_gpu_blocks=64, max_model_len=256,
                  tensor_parallel_size=2, nnodes=2, master_port=port)  # fmt: skip
        ex = llm.engine.executor
        assert ex.collective_rpc(_rank) == [0, 1]
        ex.collective_rpc(_break_rank_1)
        t0 = time.monotonic()
        (out,) = llm.generate([PROMPTS[1]], GREEDY)
        assert time.monotonic() - t0 < 5
        assert out.error is not None
        assert "worker 1 on node 1 (" in out.error, out.error
        assert "raised RuntimeError: injected fault in rank 1's step" in out.error, out.error
        with pytest.raises(WorkerDiedError, match="out of step"):
            ex.collective_rpc(_rank)
        assert wait_exit(node1, 10) == 1, node1.text
        assert "node 0's engine stopped the group: worker 1 on node 1" in node1.drain()
        llm.shutdown()


def test_a_node_that_waits_for_its_peer_gives_up_naming_it(checkpoint, monkeypatch):
    """Bounded waits: a headless node with no engine, and an engine with no headless node,
    each exit with an error naming what they waited for (KVSERVE_NODE_WAIT_S)."""
    ckpt = checkpoint("llama_gqa")
    port = free_port_pair()
    env = {**os.environ, "KVSERVE_NODE_WAIT_S": "1"}
    lonely = ServeProcess(node_args(ckpt, port, 1), env=env, ready=None)
    with lonely:
        monkeypatch.setenv("KVSERVE_NODE_WAIT_S", "1")
        t0 = time.monotonic()
        other = free_port_pair()  # node 0 on another port pair: nobody comes
        while abs(other - port) < 2:
            other = free_port_pair()
        with pytest.raises(ConfigError, match=rf"nnodes: node 1 of 2 did not connect to "
                           rf"tcp://127\.0\.0\.1:{other + 1} within 1 s"):  # fmt: skip
            LLM(ckpt, dtype="float32", num_gpu_blocks=16, tensor_parallel_size=2, nnodes=2,
                master_port=other)  # fmt: skip
        assert time.monotonic() - t0 < 10
        assert wait_exit(lonely, 30) == 1, lonely.text
        text = lonely.drain()
        assert f"no engine at tcp://127.0.0.1:{port + 1} sent the start within 1 s" in text


# A bare ZeroMQ peer (no kvserve import: it starts in a blink) that binds or connects, says
# hello, and then only sleeps; the test stops it with SIGSTOP, so it answers no heartbeat.
SILENT_PEER = """
import sys, time, zmq
s = zmq.Context().socket(zmq.DEALER)
(s.bind if sys.argv[1] == "bind" else s.connect)(sys.argv[2])
s.send(b"hello")
while True:
    time.sleep(1)
"""


def test_a_channel_whose_peer_stops_answering_heartbeats_is_lost_within_seconds():
    """Both ends of a node's channel (node 0's binds, a headless node's connects) notice a
    peer that is alive but silent (stopped: its TCP connection stays open) after the
    heartbeat timeout, and not before."""
    import subprocess
    import sys

    import zmq

    from kvserve.executor.node_link import HEARTBEAT_TIMEOUT_S, NodeLink

    ctx = zmq.Context()
    ports = [free_port_pair(), free_port_pair()]
    ours = [NodeLink(ctx, f"tcp://127.0.0.1:{ports[0]}", bind=True)]
    peers = [subprocess.Popen([sys.executable, "-c", SILENT_PEER, "connect",
                               f"tcp://127.0.0.1:{ports[0]}"]),
             subprocess.Popen([sys.executable, "-c", SILENT_PEER, "bind",
                               f"tcp://127.0.0.1:{ports[1]}"])]  # fmt: skip
    try:
        ours.append(NodeLink(ctx, f"tcp://127.0.0.1:{ports[1]}", bind=False))
        for link in ours:
            assert link.recv(30) == [b"hello"]
            assert not link.check() and link.connected
        for p in peers:
            p.send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        lost_after = [None, None]
        while None in lost_after and time.monotonic() - t0 < HEARTBEAT_TIMEOUT_S + 5:
            for i, link in enumerate(ours):
                if lost_after[i] is None and link.check():
                    lost_after[i] = time.monotonic() - t0
            time.sleep(0.05)
        for t in lost_after:
            assert t is not None and HEARTBEAT_TIMEOUT_S - 1 < t < HEARTBEAT_TIMEOUT_S + 3, t
    finally:
        for p in peers:
            p.kill()
            p.wait(timeout=10)
        for link in ours:
            link.close()
        ctx.term()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(tensor_parallel_size=3, nnodes=2, master_port=29500),
         r"tensor_parallel_size: 3 ranks do not divide evenly over nnodes = 2"),
        (dict(tensor_parallel_size=2, nnodes=2, node_rank=2, master_port=29500),
         r"node_rank: must be an integer in \[0, nnodes = 2\), got 2"),
        (dict(tensor_parallel_size=2, nnodes=2, node_rank=-1, master_port=29500),
         r"node_rank: must be an integer in \[0, nnodes = 2\), got -1"),
        (dict(tensor_parallel_size=2, nnodes=3, master_port=29500),
         r"nnodes: must be an integer in \[1, tensor_parallel_size = 2\], got 3"),
        (dict(tensor_parallel_size=2, nnodes=2),
         r"master_port: required with nnodes above 1"),
        (dict(tensor_parallel_size=2, nnodes=2, master_port=65535),
         r"master_port: must be an integer in \[1, 65534\]"),
        (dict(tensor_parallel_size=2, nnodes=2, master_port=29500,
              distributed_executor_backend="ray"),
         r"distributed_executor_backend: nnodes above 1 runs the mp backend's workers"),
    ],
)  # fmt: skip
def test_flags_that_cannot_span_the_nodes_are_refused_naming_the_field(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        engine_config("any-model", **kwargs)


def test_the_flags_are_vllms_and_headless_belongs_to_another_node(checkpoint):
    from kvserve.cli import build_parser
    from kvserve.executor.headless import run_headless

    ckpt = checkpoint("llama_gqa")
    parser, _ = build_parser()
    args = parser.parse_args(["serve", ckpt, "-tp", "4", "--nnodes", "2", "--node-rank", "1",
                              "--master-addr", "10.0.0.7", "--master-port", "29500",
                              "--headless"])  # fmt: skip
    assert args.headless
    kw = engine_kwargs(args)
    assert (kw["nnodes"], kw["node_rank"], kw["master_addr"], kw["master_port"]) == (
        2, 1, "10.0.0.7", 29500)  # fmt: skip
    config = engine_config(**kw)
    assert config.parallel.distributed_executor_backend == "mp"
    head = engine_config(ckpt, tensor_parallel_size=2, nnodes=2, master_port=29500)
    with pytest.raises(ConfigError, match=r"node_rank: --headless runs a node other than "
                       r"node 0"):  # fmt: skip
        run_headless(head)
    # node 1 without --headless would be a second engine: refused before any process starts
    with pytest.raises(ConfigError, match=r"node_rank: node 1 runs no engine; start it with "
                       r"`kvserve serve \.\.\. --headless`"):  # fmt: skip
        LLM(ckpt, dtype="float32", num_gpu_blocks=16, tensor_parallel_size=2, nnodes=2,
            node_rank=1, master_port=29500)  # fmt: skip
