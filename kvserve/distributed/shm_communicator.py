"""All-reduce and all-gather through shared memory, for ranks on one host (vLLM's CPU
``shm`` all-reduce, in its shape: one segment, a buffer and a sequence flag per rank).

Over gloo, each collective of a decode step is a round trip through the loopback TCP stack and
a wake-up of a thread that sleeps in ``epoll``: on a small model that is most of a step. Ranks
that share a host can instead meet in memory: every rank copies its tensor into its own buffer
of one shared segment (an anonymous memory file), raises its flag to the collective's sequence
number, waits until every peer's flag has reached it, and reads the peers' buffers. Each rank
sums the buffers in rank order, so every rank holds the same bits. Two buffers per rank,
alternated by the sequence number's parity, keep a fast rank from overwriting data a slow one
still reads: a rank can only reach collective ``n + 2`` after every peer has raised its flag
for ``n + 1``, which each does only once it has finished reading ``n``. A tensor larger than a
buffer goes in chunks, each a collective of its own.

The wait spins for a millisecond (a peer is usually microseconds away: each rank computes on
its own core, and a rank that slept would pay a wake-up, on a virtual machine a halted vCPU's,
on every collective), then yields the CPU (a rank that shares its core with the one it
awaits), then sleeps in short naps (a peer that is slow). It is bounded: every few
milliseconds it checks that each peer's process still exists (a killed peer: an error naming
its rank and pid within milliseconds, not a hang) and gives up after ``timeout_s``, as a gloo
collective does.

One collective is one native call where the kernels are built (:mod:`kvserve.kernels.collectives`:
the copy in, the flag, the first millisecond's spin and the rank-order sum; a sum of float32 or
bfloat16, any dtype for the rest); the torch ops below are its reference and the path of other
dtypes and of a machine with no compiler. Past the spin, Python's wait takes over. The flags
are plain stores and loads on that path: ordering them after the data relies on x86's total
store order, so :func:`shm_supported` offers shared memory on x86-64 alone.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import platform
import time
from pathlib import Path

import torch
import torch.distributed as dist

from kvserve.kernels import collectives

# Bytes of one rank's buffer: a chunk of a larger tensor goes through it at a time.
BUFFER_BYTES = 4 << 20
# A header slot per rank: its flag (the last sequence number it published) and its pid, on a
# cache line of its own so that ranks never write the same line.
SLOT = 64
SPIN_S = 0.001  # spinning this long before the first yield
YIELD_S = 0.005  # yielding until this long, then naps
NAP_S = 50e-6
PEER_CHECK_S = 0.005  # how often a long wait checks that the peers are alive


class PeerGoneError(RuntimeError):
    """A tensor-parallel peer's process ended while this rank waited for it."""


def shm_supported(device: torch.device) -> bool:
    """Whether the shared-memory path may run here: CPU tensors on x86-64 Linux (with
    ``memfd_create`` for the segment)."""
    return (
        device.type == "cpu"
        and platform.machine().lower() in ("x86_64", "amd64")
        and Path("/proc/self/stat").exists()
        and hasattr(os, "memfd_create")
    )


def host_identity() -> str:
    """What two processes on one host share and two hosts do not: the boot id (and the host
    name, for a container that shares a kernel but not its process table, through which the
    ranks open the segment and watch each other)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{platform.node()}/{boot}"


def _alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie, dead but not yet reaped, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2 :][:1] not in ("Z", "X")


class ShmCommunicator:
    """The :class:`~kvserve.model.layers.Communicator` of ranks on one host, over a shared
    segment; built by :meth:`create` on every rank at once (a collective itself)."""

    def __init__(self, rank: int, world_size: int, device: torch.device, path: str,
                 timeout_s: float, buffer_bytes: int = BUFFER_BYTES,
                 native: bool = True) -> None:  # fmt: skip
        """``native``: run each collective through the native call where it is built (False:
        the torch ops alone, the reference)."""
        self.rank, self.world_size, self.device = rank, world_size, device
        self.timeout_s = timeout_s
        self.buffer_bytes = buffer_bytes
        header = world_size * SLOT
        size = header + 2 * world_size * buffer_bytes
        with open(path, "r+b") as f:
            self._mm = mmap.mmap(f.fileno(), size)
        self._words = memoryview(self._mm)[:header].cast("q")
        self._flag = [r * SLOT // 8 for r in range(world_size)]
        self._peers = [r for r in range(world_size) if r != rank]
        raw = torch.frombuffer(self._mm, dtype=torch.uint8)
        # the native call takes up to 64 ranks (one host's)
        self._native = collectives.shm_collective() if native and world_size <= 64 else None
        # the native call's fixed arguments, as one structure: the segment, this rank
        layout = collectives.ShmLayout(raw.data_ptr(), SLOT, header, buffer_bytes,
                                       int(SPIN_S * 1e9), rank, world_size)  # fmt: skip
        self._layout = ctypes.byref(layout)
        self._buffers = [
            [raw[header + (p * world_size + r) * buffer_bytes :][:buffer_bytes]
             for r in range(world_size)]
            for p in range(2)
        ]  # fmt: skip
        self._words[self._flag[rank] + 1] = os.getpid()
        self._seq = 0  # the last collective this rank published

    @classmethod
    def create(cls, rank: int, world_size: int, device: torch.device, timeout_s: float,
               buffer_bytes: int = BUFFER_BYTES,
               native: bool = True) -> ShmCommunicator:  # fmt: skip
        """Every rank of the default process group calls this together: rank 0 makes the
        segment, an anonymous file (``memfd_create``) that has no name anywhere, and gives
        the others its path in rank 0's descriptor table (``/proc/PID/fd/N``) over the group;
        once all have mapped it, rank 0 closes its descriptor. The segment is freed with the
        last process that maps it, whichever rank dies when: a rank 0 killed before the
        others opened it leaves nothing behind (their open fails), as a named file in
        ``/dev/shm`` would."""
        path = [""]
        fd = -1
        if rank == 0:
            fd = os.memfd_create("kvserve-tp", os.MFD_CLOEXEC)
            os.ftruncate(fd, world_size * SLOT + 2 * world_size * buffer_bytes)
            path[0] = f"/proc/{os.getpid()}/fd/{fd}"
        try:
            dist.broadcast_object_list(path, src=0)
            comm = cls(rank, world_size, device, path[0], timeout_s, buffer_bytes, native)
            dist.barrier()  # every rank has mapped it and written its pid
        finally:
            if fd >= 0:
                os.close(fd)
        return comm

    # -- the collectives ----------------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of ``x``, in rank order (the same bits on every rank), in place
        where ``x`` is contiguous."""
        if x.numel() == 0:  # no collective on any path: the ranks' sequences stay equal
            return x
        code = collectives.SUM_DTYPES.get(x.dtype) if self._native is not None else None
        if code is not None and x.is_contiguous():  # a decode step's rows: one call
            nbytes = x.numel() * x.element_size()
            if nbytes <= self.buffer_bytes:
                self._native_call(x.data_ptr(), nbytes, code, collectives.REDUCE)
                return x
        x = x.contiguous()
        flat = x.view(-1)
        step = self.buffer_bytes // x.element_size()
        for lo in range(0, flat.numel(), step):
            part = flat[lo : lo + step]
            if code is not None:
                self._native_call(part.data_ptr(), part.numel() * part.element_size(), code,
                                  collectives.REDUCE)  # fmt: skip
                continue
            views = self._exchange(part)
            torch.add(views[0], views[1], out=part)
            for v in views[2:]:
                part.add_(v)
        return x

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's ``x`` concatenated along ``dim``, rank 0's first."""
        x = x.contiguous()
        flat = x.view(-1)
        if flat.numel() * x.element_size() <= self.buffer_bytes:
            views = self._exchange(flat)
            return torch.cat([v.view(x.shape) for v in views], dim)
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        step = self.buffer_bytes // x.element_size()
        for lo in range(0, flat.numel(), step):
            views = self._exchange(flat[lo : lo + step])
            for part, v in zip(parts, views, strict=True):
                part.view(-1)[lo : lo + step].copy_(v)
        return torch.cat(parts, dim)

    def _exchange(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Publish ``flat`` (one buffer's worth at most) and return every rank's, as views
        of the segment that stay valid until this rank's next exchange but one."""
        seq = self._seq + 1
        nbytes = flat.numel() * flat.element_size()
        buffers = self._buffers[seq & 1]
        views = [b[:nbytes].view(flat.dtype) for b in buffers]
        if self._native is not None:
            self._native_call(flat.data_ptr(), nbytes, 0, 0)
            return views
        views[self.rank].copy_(flat)
        self._words[self._flag[self.rank]] = seq  # after the data: x86 keeps store order
        self._seq = seq
        self._wait(seq)
        return views

    def _native_call(self, data: int, nbytes: int, code: int, reduce: int) -> None:
        """Collective ``self._seq + 1`` through the native call: publish ``nbytes`` at address
        ``data``, await the peers (a spin of SPIN_S, then :meth:`_wait`), and with ``reduce``
        sum the ranks' buffers (dtype ``code``) into ``data``."""
        seq = self._seq = self._seq + 1
        native = self._native
        rc = native(self._layout, seq, data, nbytes, code,
                    collectives.PUBLISH | collectives.AWAIT | reduce)  # fmt: skip
        if rc == 1:  # a peer is further away than the spin: wait as the reference does
            self._wait(seq, spun=SPIN_S)
            if reduce:  # the flags are up: AWAIT only loads them again, with acquire order
                rc = native(self._layout, seq, data, nbytes, code, collectives.AWAIT | reduce)
        if rc not in (0, 1):
            raise RuntimeError(f"shared-memory collective {seq}: native call failed ({rc})")

    def _wait(self, seq: int, spun: float = 0.0) -> None:
        """Until every peer has published ``seq``; ``spun``: seconds already spent spinning."""
        words, flag = self._words, self._flag
        waiting = self._peers
        checked = time.perf_counter()
        start = checked - spun
        while True:
            waiting = [r for r in waiting if words[flag[r]] < seq]
            if not waiting:
                return
            now = time.perf_counter()
            if now - start < SPIN_S:
                continue  # the peer computes on a core of its own: it is moments away
            if now - start < YIELD_S:
                os.sched_yield()  # a process that shares this core may be the one awaited
            else:
                time.sleep(NAP_S)
            if now - checked >= PEER_CHECK_S:
                checked = now
                self._check_peers(waiting, now - start)

    def _check_peers(self, waiting: list[int], waited: float) -> None:
        """``waiting``: the ranks whose flag has not reached this collective yet."""
        for rank in waiting:
            pid = self._words[self._flag[rank] + 1]  # every rank wrote its pid
            if not _alive(pid):
                raise PeerGoneError(f"tensor-parallel rank {rank} (pid {pid}) is gone; the "
                                    "collective cannot complete")  # fmt: skip
        if waited > self.timeout_s:
            raise TimeoutError(f"tensor-parallel ranks {waiting} did not reach collective "
                               f"{self._seq} within {self.timeout_s:g} s")  # fmt: skip
