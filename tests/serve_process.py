"""``kvserve serve`` as a child process for the tests that need the real command line.

One place bounds every wait: a thread copies the server's stderr into :attr:`log`, so
waiting for a line never blocks past its timeout even when the server hangs without writing,
and :meth:`stop` kills a server that ignores SIGTERM instead of waiting for it forever.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType

REPO = Path(__file__).resolve().parent.parent


class ServeProcess:
    """``python -m kvserve.cli serve ARGS --port 0`` on 127.0.0.1, started and waited for.

    ``env`` replaces the environment when given (a test that controls ``HF_*`` variables);
    otherwise the test's environment is inherited. ``PYTHONUNBUFFERED`` is always set, so a
    line reaches the log when the server writes it.
    """

    def __init__(
        self,
        args: list[str],
        env: dict[str, str] | None = None,
        start_timeout: float = 120,
        port: int = 0,
        ready: str | None = r"running on (http://\S+)",
    ) -> None:
        """``port``: 0 for a free one; a fixed one to restart a server at the same URL.
        ``ready``: the line that says it serves (its group is the URL); None: do not wait
        (a ``--headless`` node, which serves no HTTP)."""
        cmd = [sys.executable, "-m", "kvserve.cli", "serve", *args, "--port", str(port)]
        env = {**(os.environ if env is None else env), "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                     text=True, cwd=REPO, env=env)  # fmt: skip
        self.log: list[str] = []
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        self.url = ""
        if ready is None:
            return
        try:
            self.url = self.wait_for(ready, start_timeout).group(1)
        except BaseException:
            self.close()
            raise

    def _pump(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.log.append(line)
            self._lines.put(line)
        self._lines.put(None)

    @property
    def text(self) -> str:
        """Everything the server wrote to stderr so far."""
        return "".join(self.log)

    def _lines_until(self, deadline: float) -> Iterator[str | None]:
        """Lines as the server writes them until ``deadline``; ``None`` once it exited."""
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self._lines.get(timeout=left)
            except queue.Empty:
                return
            yield line
            if line is None:
                return

    def wait_for(self, pattern: str, timeout: float = 60) -> re.Match[str]:
        """The first line from now on that matches ``pattern``; an AssertionError with the
        log when the server exits or ``timeout`` seconds pass first."""
        for line in self._lines_until(time.monotonic() + timeout):
            if line is None:
                raise AssertionError(f"kvserve serve exited ({self.proc.wait()}):\n{self.text}")
            if m := re.search(pattern, line):
                return m
        raise AssertionError(f"no line matching {pattern!r} within {timeout} s:\n{self.text}")

    def drain(self, timeout: float = 10) -> str:
        """The whole log once the process has exited (waiting up to ``timeout``)."""
        for _ in self._lines_until(time.monotonic() + timeout):
            pass
        return self.text

    def stop(self, timeout: float = 30) -> int:
        """SIGTERM, then the exit status; a server still running after ``timeout`` is killed
        and the test fails."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired as e:
            self.close()
            raise AssertionError(
                f"kvserve serve ignored SIGTERM for {timeout} s:\n{self.text}"
            ) from e
        self.drain()
        return rc

    def close(self) -> None:
        """Kill the server if it still runs (a test's cleanup path)."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)

    def __enter__(self) -> ServeProcess:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
