"""Run ``kvstore-server`` as a child process: for tests, benchmarks and examples.

The server is started with ``--port 0`` (any free port) and its startup log
line tells which port it got, so parallel runs never race for a port.
"""

from __future__ import annotations

import os
import re
import resource
import signal
import subprocess
import sys
import threading
import time
_LISTEN_RE = re.compile(r"listening on (\S+):(\d+)")


class ServerProcess:
    """A ``kvstore-server`` child bound to 127.0.0.1, stopped by :meth:`stop` or on exit of a ``with``."""

    def __init__(self, *args: str, env: dict[str, str] | None = None, start_timeout: float = 30.0,
                 open_files: tuple[int, int] | None = None, cwd: str | None = None,
                 ignore_sigint: bool = False) -> None:
        self.args = ["--host", "127.0.0.1", "--port", "0", *args]
        self.env = {**os.environ, **(env or {})}
        self.open_files = open_files  # (soft, hard) RLIMIT_NOFILE for the child, as ``ulimit -n`` sets it
        self.cwd = cwd  # (``python -m`` imports from the working folder first)
        self.start_timeout = start_timeout
        # Started with SIGINT ignored: a terminal's Ctrl-C, sent to the whole process group, leaves the
        # server to its caller, which stops it (kvstore-bench: a server hit mid-start said only "did not
        # start"); the server takes SIGINT again once it listens. Other signals to the group still reach it.
        self.ignore_sigint = ignore_sigint
        self.proc: subprocess.Popen[str] | None = None
        self.port = 0
        self.log: list[str] = []
        self._listening = threading.Event()
        self._pump_thread: threading.Thread | None = None

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> ServerProcess:
        cmd = [sys.executable, "-m", "kvstore.server.cli", *self.args]
        limits, ignore_sigint = self.open_files, self.ignore_sigint

        def prepare() -> None:  # (in the child, before exec)
            if limits is not None:
                resource.setrlimit(resource.RLIMIT_NOFILE, limits)
            if ignore_sigint:
                signal.signal(signal.SIGINT, signal.SIG_IGN)

        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=self.env,
                                     cwd=self.cwd,
                                     preexec_fn=prepare if limits is not None or ignore_sigint else None)
        self._pump_thread = threading.Thread(target=self._pump, daemon=True)
        self._pump_thread.start()
        if not self._listening.wait(self.start_timeout) or not self.port:
            self.kill()
            raise RuntimeError("kvstore-server did not start:\n" + "".join(self.log[-20:]))
        return self

    def _pump(self) -> None:
        assert self.proc is not None and self.proc.stderr is not None
        for line in self.proc.stderr:
            self.log.append(line)
            m = _LISTEN_RE.search(line)
            if m and not self._listening.is_set():
                self.port = int(m.group(2))
                self._listening.set()
        self._listening.set()  # exited: wake start()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int:
        """Send ``sig`` and wait; returns the exit code (kills after ``timeout``)."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait(5)
        self._close_pipe()
        return code

    def kill(self) -> None:
        """SIGKILL: no drain, no flush (a crash)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)
        self._close_pipe()

    def _close_pipe(self) -> None:
        if self._pump_thread is not None:
            self._pump_thread.join(5)
        if self.proc is not None and self.proc.stderr is not None:
            self.proc.stderr.close()

    def wait_log(self, pattern: str, timeout: float = 10.0) -> str:
        """The first log line matching ``pattern`` (waits for it)."""
        rx = re.compile(pattern)
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for line in list(self.log):
                if rx.search(line):
                    return line
            time.sleep(0.02)
        raise TimeoutError(f"no log line matching {pattern!r}:\n" + "".join(self.log[-20:]))

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

