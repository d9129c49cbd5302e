"""Real ``redis-server`` processes for the tests: one server, or a 3-master Redis Cluster.

Each process gets a free loopback port and a directory under pytest's
``tmp_path``; every wait is bounded in time, and every process is stopped by
the fixture that started it. Tests import the fixtures from here::

    from redis_fixtures import RedisProcess, redis_server  # noqa: F401
"""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Awaitable, Callable, Iterator

import pytest

REDIS_SERVER = "redis-server"
REDIS_CLI = "redis-cli"


def free_port(with_bus: bool = False) -> int:
    """A loopback port free right now (and ``port + 10000`` too, for a cluster node's bus)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if not with_bus:
            return port
        if port + 10000 < 65536:
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port + 10000))
                except OSError:
                    continue
            return port
    raise RuntimeError("no free port pair found")


def wait_until(cond: Callable[[], bool], timeout: float, what: str, interval: float = 0.05) -> None:
    """Poll ``cond`` until true; ``TimeoutError`` naming ``what`` after ``timeout`` seconds."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what}")


class RedisProcess:
    """One ``redis-server`` on 127.0.0.1; :meth:`cli` runs the real ``redis-cli`` against it."""

    def __init__(self, directory: Path, *, port: int | None = None, appendonly: bool = False,
                 cluster: bool = False) -> None:
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port(with_bus=cluster)
        self.appendonly = appendonly
        self.cluster = cluster
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        cmd = [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
               "--appendonly", "yes" if self.appendonly else "no", "--dir", str(self.dir),
               "--logfile", str(self.dir / "redis.log"), "--daemonize", "no"]
        if self.cluster:
            cmd += ["--cluster-enabled", "yes", "--cluster-config-file", str(self.dir / "nodes.conf"),
                    "--cluster-node-timeout", "5000"]
        return cmd

    def start(self, timeout: float = 10.0) -> RedisProcess:
        self.proc = subprocess.Popen(self.command(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_until(self.ready, timeout, f"redis-server on port {self.port}")
        return self

    def ready(self) -> bool:
        """PONG on a raw socket (not ``-LOADING``): accepting commands, its data loaded."""
        if self.proc is None or self.proc.poll() is not None:
            raise RuntimeError(f"redis-server on port {self.port} exited; see {self.dir / 'redis.log'}")
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                s.sendall(b"PING\r\n")
                return s.recv(64).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)

    def cli(self, *args: str, timeout: float = 10.0) -> str:
        """Run ``redis-cli -p PORT args...``; its stdout, stripped. Raises on a non-zero exit."""
        done = subprocess.run([REDIS_CLI, "-h", "127.0.0.1", "-p", str(self.port), *args],
                              capture_output=True, text=True, timeout=timeout, check=True)
        return done.stdout.strip()

    def cli_bytes(self, *args: str, timeout: float = 10.0) -> bytes:
        """Like :meth:`cli` with ``--raw``: the reply bytes as stored (plus redis-cli's newline)."""
        done = subprocess.run([REDIS_CLI, "-h", "127.0.0.1", "-p", str(self.port), "--raw", *args],
                              capture_output=True, timeout=timeout, check=True)
        return done.stdout


class RedisClusterProcesses:
    """Three masters, no replicas, created with ``redis-cli --cluster create``."""

    def __init__(self, directory: Path) -> None:
        self.nodes = [RedisProcess(directory / f"node{i}", cluster=True) for i in range(3)]

    @property
    def spec(self) -> str:
        """The ``--redis-cluster`` value: every master."""
        return ",".join(n.addr for n in self.nodes)

    def start(self, timeout: float = 20.0) -> RedisClusterProcesses:
        for node in self.nodes:
            node.start()
        subprocess.run([REDIS_CLI, "--cluster", "create", *(n.addr for n in self.nodes), "--cluster-replicas", "0",
                        "--cluster-yes"], capture_output=True, text=True, timeout=timeout, check=True)
        wait_until(self.ok, timeout, "cluster_state:ok on every node", interval=0.1)
        return self

    def ok(self) -> bool:
        return all("cluster_state:ok" in n.cli("CLUSTER", "INFO") for n in self.nodes)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisProcess]:
    """A fresh redis-server without persistence."""
    proc = RedisProcess(tmp_path / "redis").start()
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture
def make_redis(tmp_path: Path) -> Iterator[Callable[..., RedisProcess]]:
    """Start redis-servers with options: ``make_redis(appendonly=True)``."""
    started: list[RedisProcess] = []

    def make(*, appendonly: bool = False) -> RedisProcess:
        proc = RedisProcess(tmp_path / f"redis{len(started)}", appendonly=appendonly).start()
        started.append(proc)
        return proc

    try:
        yield make
    finally:
        for proc in started:
            proc.stop()


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterProcesses]:
    """One 3-master cluster per test module (creating one takes a second or two)."""
    cluster = RedisClusterProcesses(tmp_path_factory.mktemp("cluster"))
    try:
        yield cluster.start()
    finally:
        cluster.stop()


async def eventually(cond: Callable[[], Awaitable[bool]], timeout: float, what: str, interval: float = 0.1) -> None:
    """Await ``cond`` until true; ``TimeoutError`` naming ``what`` after ``timeout`` seconds."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if await cond():
            return
        await asyncio.sleep(interval)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
