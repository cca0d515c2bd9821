"""The shared-memory communicator of ranks on one host, against gloo's collectives on the same
tensors and against a naive sum written here (every rank's tensor is regenerated from its seed
and summed in rank order, in the tensor's dtype), through its native call (collectives.c) and
through its torch ops alone.

The ranks are spawned once (a process start is the cost) and run every case: shapes and
dtypes, a tensor larger than a buffer (chunked), all-gather along each dim; then one rank
exits, and the others' next collective must name it within a second. A peer that lives but
never arrives is a timeout naming it (two communicators of one process over one segment).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import tempfile
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from kvserve.distributed import DistributedInit, free_port, init_distributed
from kvserve.distributed.communicator import TorchDistCommunicator
from kvserve.distributed.shm_communicator import SPIN_S, PeerGoneError, ShmCommunicator
from kvserve.kernels import collectives

# (shape, dtype): a decode step's hidden rows, odd sizes, half precision, integers
CASES = [
    ((1, 256), torch.float32),
    ((8, 64), torch.float32),
    ((3, 7, 5), torch.float32),
    ((4, 33), torch.bfloat16),
    ((5, 9), torch.float16),
    ((17,), torch.int64),
    ((2, 1000), torch.float32),  # 8,000 bytes: two chunks of the tests' 4 KiB buffers
]
BUFFER = 4096
WORLD = 3  # three ranks on two cores: one shares, so the wait must yield for it


def tensor_of(rank: int, case: int) -> torch.Tensor:
    shape, dtype = CASES[case]
    g = torch.Generator().manual_seed(1000 * case + rank)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-1000, 1000, shape, generator=g, dtype=dtype)


def naive_sum(case: int) -> torch.Tensor:
    total = tensor_of(0, case).clone()
    for r in range(1, WORLD):
        total = total + tensor_of(r, case)
    return total


def _rank(rank: int, port: int, out: Any) -> None:
    torch.set_num_threads(1)
    init = DistributedInit(WORLD, "127.0.0.1", port, "gloo", timeout_s=10)
    comm = init_distributed(init, rank, torch.device("cpu"))
    gloo = TorchDistCommunicator(rank, WORLD, torch.device("cpu"))
    small = ShmCommunicator.create(rank, WORLD, torch.device("cpu"), 5.0, buffer_bytes=BUFFER)
    torch_ops = ShmCommunicator.create(rank, WORLD, torch.device("cpu"), 5.0,
                                       buffer_bytes=BUFFER, native=False)  # fmt: skip
    shm = (comm, small, torch_ops)
    result: dict[str, Any] = {"chosen": type(comm).__name__, "reduced": [], "gathered": [],
                              "native": [c._native is not None for c in shm],
                              "built": collectives.shm_collective() is not None}  # fmt: skip
    for case in range(len(CASES)):
        x = tensor_of(rank, case)
        result["reduced"].append(
            (gloo.all_reduce(x.clone()), *(c.all_reduce(x.clone()) for c in shm))
        )
        dim = case % x.dim()
        result["gathered"].append(
            (dim, gloo.all_gather(x, dim), *(c.all_gather(x, dim) for c in shm))
        )
    if rank == WORLD - 1:
        out.put((rank, pickle.dumps(result)))  # bytes, not tensors shared by fd
        out.close()
        out.join_thread()  # the result is in the pipe before the process goes
        os._exit(0)  # gone without a word: the others' next collective must say so
    t0 = time.monotonic()
    try:
        small.all_reduce(torch.ones(4))
        result["ending"] = "no error"
    except PeerGoneError as e:
        result["ending"] = str(e)
    result["ending_s"] = time.monotonic() - t0
    out.put((rank, pickle.dumps(result)))


def run_ranks() -> dict[int, dict[str, Any]]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, out)) for r in range(WORLD)]
    for p in procs:
        p.start()
    try:
        results = {r: pickle.loads(b) for r, b in (out.get(timeout=60) for _ in procs)}
    finally:
        _reap(procs)
    return results


def test_shared_memory_collectives_equal_glooes_and_a_naive_sum():
    results = run_ranks()
    assert set(results) == set(range(WORLD))
    for rank, res in results.items():
        assert res["chosen"] == "ShmCommunicator", "ranks on one CPU host use shared memory"
        # the native call wherever it is built; the third communicator runs the torch ops
        built = res["built"]
        assert res["native"] == [built, built, False]
        for case, (gloo, *shm) in enumerate(res["reduced"]):
            want = naive_sum(case)
            for got in shm:  # default buffers, 4 KiB buffers (chunked), torch ops
                assert got.dtype == want.dtype and got.shape == want.shape
                assert torch.equal(got, want), (rank, case)  # rank order, the dtype's rounding
            # gloo may add in another order: equal up to the dtype's rounding
            tol = 1e-2 if want.element_size() == 2 else 1e-5
            torch.testing.assert_close(gloo, want, rtol=tol, atol=tol)
        for case, (dim, gloo, *shm) in enumerate(res["gathered"]):
            want = torch.cat([tensor_of(r, case) for r in range(WORLD)], dim)
            assert torch.equal(gloo, want), (rank, case)
            for got in shm:
                assert torch.equal(got, want), (rank, case)
    # the last rank exited: named at once, not after the 5 s timeout
    for rank in range(WORLD - 1):
        res = results[rank]
        assert res["ending"].startswith(f"tensor-parallel rank {WORLD - 1} (pid "), res["ending"]
        assert res["ending_s"] < 1.0, res["ending_s"]


def test_a_peer_that_never_arrives_is_a_timeout_naming_it():
    with tempfile.NamedTemporaryFile(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as f:
        f.truncate(2 * 64 + 2 * 2 * BUFFER)
        f.flush()
        ranks = [ShmCommunicator(r, 2, torch.device("cpu"), f.name, 0.2, BUFFER) for r in (0, 1)]
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match=r"tensor-parallel ranks \[1\] did not reach"):
            ranks[0].all_reduce(torch.ones(3))
        assert 0.2 <= time.monotonic() - t0 < 2.0


def test_a_peer_later_than_the_spin_is_awaited_then_summed():
    """Rank 1 arrives well after rank 0's native spin has given up: rank 0 waits in Python,
    then sums; both get the naive sum (float32 and bfloat16), and an empty tensor is no
    collective on either rank (the next one still pairs up)."""
    import threading

    with tempfile.NamedTemporaryFile(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as f:
        f.truncate(2 * 64 + 2 * 2 * BUFFER)
        f.flush()
        ranks = [ShmCommunicator(r, 2, torch.device("cpu"), f.name, 5.0, BUFFER) for r in (0, 1)]
        for dtype in (torch.float32, torch.bfloat16):
            g = torch.Generator().manual_seed(7)
            x = [torch.randn(8, 64, generator=g).to(dtype) for _ in range(2)]
            got: list[torch.Tensor] = []
            early = threading.Thread(
                target=lambda out, t: out.append(ranks[0].all_reduce(t)), args=(got, x[0].clone())
            )
            early.start()
            time.sleep(20 * SPIN_S)  # rank 0 is past its spin, in the Python wait
            assert early.is_alive()
            late = ranks[1].all_reduce(x[1].clone())
            early.join(timeout=10)
            assert not early.is_alive()
            want = x[0] + x[1]
            assert torch.equal(got[0], want) and torch.equal(late, want), dtype
        for r in ranks:
            assert r.all_reduce(torch.ones(0)).numel() == 0
        t = threading.Thread(target=lambda: ranks[0].all_reduce(torch.ones(3)))
        t.start()
        assert torch.equal(ranks[1].all_reduce(torch.ones(3)), torch.full((3,), 2.0))
        t.join(timeout=10)


def _creator_killed_before_the_barrier(rank: int, port: int, out: Any) -> None:
    torch.set_num_threads(1)
    init = DistributedInit(2, "127.0.0.1", port, "gloo", timeout_s=5)
    init_distributed(init, rank, torch.device("cpu"), custom_all_reduce=False)
    if rank == 0:

        def killed() -> None:  # between making the segment and the barrier after it
            with open("/proc/self/maps") as f:
                mapped = sorted({line.split(None, 5)[-1].strip() for line in f
                                 if "kvserve-tp" in line})  # fmt: skip
            out.put((0, mapped))
            out.close()
            out.join_thread()
            os._exit(3)

        dist.barrier = killed
    try:
        ShmCommunicator.create(rank, 2, torch.device("cpu"), 5.0, buffer_bytes=BUFFER)
        out.put((rank, "created"))
    except Exception as e:  # noqa: BLE001 - the test reports what the survivor saw
        out.put((rank, type(e).__name__))


def test_a_segment_does_not_outlive_a_creator_killed_before_the_barrier():
    """Rank 0 makes and maps the segment, then dies before the barrier that follows: the
    segment it mapped has no name left on the file system, and rank 1 fails (it cannot open
    the segment, or the barrier loses rank 0) instead of building a communicator."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_creator_killed_before_the_barrier, args=(r, port, out))
             for r in range(2)]  # fmt: skip
    for p in procs:
        p.start()
    try:
        results = dict(out.get(timeout=60) for _ in procs)
    finally:
        _reap(procs)
    assert procs[0].exitcode == 3
    mapped = results[0]
    assert len(mapped) == 1, mapped  # rank 0 had made and mapped the segment
    assert not os.path.exists(mapped[0]), f"{mapped[0]} outlived its group"
    assert results[1] != "created"


def _reap(procs: list) -> None:
    """Every rank's process ended: joined, killed where it outlives its wait (bounded)."""
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)
