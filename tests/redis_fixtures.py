"""Real ``redis-server`` processes for the tests: one server, or a 3-master Redis Cluster.

Each process gets a free loopback port and a directory under pytest's
``tmp_path``; every wait is bounded in time, and every process is stopped by
the fixture that started it. Tests import the fixtures from here::

    from redis_fixtures import RedisProcess, redis_server  # noqa: F401
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import signal
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path
from typing import Awaitable, Callable, Iterator, Sequence

import pytest

REDIS_SERVER = "redis-server"
REDIS_CLI = "redis-cli"


def free_port(with_bus: bool = False) -> int:
    """A loopback port free right now (and ``port + 10000`` too, for a cluster node's bus)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port: int = s.getsockname()[1]
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


def reserved_bytes(addr: str) -> int:
    """The bytes a kvstore server holds for blocks on their way in (its stats, asked on a connection of its own)."""
    from kvstore.client import KVClient

    with KVClient(addr, retries=0) as kv:
        return int(kv.stats()["store"]["reserved_bytes"])


def make_cert(directory: Path) -> Path:
    """A self-signed EC certificate for 127.0.0.1 (``redis.crt``, key beside it as ``redis.key``)."""
    cert, key = directory / "redis.crt", directory / "redis.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], capture_output=True, timeout=30, check=True)
    return cert


class RedisProcess:
    """One ``redis-server`` on 127.0.0.1; :meth:`cli` runs the real ``redis-cli`` against it."""

    def __init__(self, directory: Path, *, port: int | None = None, appendonly: bool = False,
                 cluster: bool = False, password: str | None = None, tls: bool = False,
                 args: Sequence[str] = ()) -> None:
        self.dir = directory
        self.args = list(args)  # more redis-server options, e.g. ["--maxmemory", "1mb"]
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port(with_bus=cluster)
        self.appendonly = appendonly
        self.cluster = cluster
        self.password = password
        self.cert = make_cert(self.dir) if tls else None  # self-signed for 127.0.0.1; also the CA
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        if self.cert is None:
            return f"redis://{auth}127.0.0.1:{self.port}/0"
        return f"rediss://{auth}127.0.0.1:{self.port}/0?ssl_ca_certs={self.cert}"

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        ports = ["--port", str(self.port)]
        if self.cert is not None:
            key = str(self.cert.with_suffix(".key"))
            ports = ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", str(self.cert),
                     "--tls-key-file", key, "--tls-ca-cert-file", str(self.cert), "--tls-auth-clients", "no"]
        cmd = [REDIS_SERVER, *ports, "--bind", "127.0.0.1", "--save", "",
               "--appendonly", "yes" if self.appendonly else "no", "--dir", str(self.dir),
               "--logfile", str(self.dir / "redis.log"), "--daemonize", "no"]
        if self.password:
            cmd += ["--requirepass", self.password]
        if self.cluster:
            cmd += ["--cluster-enabled", "yes", "--cluster-config-file", str(self.dir / "nodes.conf"),
                    "--cluster-node-timeout", "5000"]
        return cmd + self.args

    def start(self, timeout: float = 10.0) -> RedisProcess:
        self.proc = subprocess.Popen(self.command(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_until(self.ready, timeout, f"redis-server on port {self.port}")
        return self

    def ready(self) -> bool:
        """PONG on a raw socket (not ``-LOADING``): accepting commands, its data loaded."""
        if self.proc is None or self.proc.poll() is not None:
            raise RuntimeError(f"redis-server on port {self.port} exited; see {self.dir / 'redis.log'}")
        hello = (f"AUTH {self.password}\r\n" if self.password else "").encode() + b"PING\r\n"
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as raw:
                if self.cert is None:
                    return self._ask(raw, hello)
                tls = ssl.create_default_context(cafile=str(self.cert))
                with tls.wrap_socket(raw, server_hostname="127.0.0.1") as s:
                    return self._ask(s, hello)
        except OSError:
            return False

    @staticmethod
    def _ask(s: socket.socket, hello: bytes) -> bool:
        s.sendall(hello)
        reply = b""
        while reply.count(b"\r\n") < hello.count(b"\r\n"):
            chunk = s.recv(256)
            if not chunk:
                return False
            reply += chunk
        return reply.endswith(b"+PONG\r\n")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)

    def cli_args(self) -> list[str]:
        """How to point the real ``redis-cli`` at this server."""
        args = [REDIS_CLI, "-h", "127.0.0.1", "-p", str(self.port)]
        if self.password:
            args += ["-a", self.password, "--no-auth-warning"]
        if self.cert is not None:
            args += ["--tls", "--cacert", str(self.cert)]
        return args

    def cli(self, *args: str, timeout: float = 10.0) -> str:
        """Run ``redis-cli -p PORT args...``; its stdout, stripped. Raises on a non-zero exit."""
        done = subprocess.run([*self.cli_args(), *args], capture_output=True, text=True, timeout=timeout,
                              check=True)
        return done.stdout.strip()

    def cli_bytes(self, *args: str, timeout: float = 10.0) -> bytes:
        """Like :meth:`cli` with ``--raw``: the reply bytes as stored (plus redis-cli's newline)."""
        done = subprocess.run([*self.cli_args(), "--raw", *args], capture_output=True, timeout=timeout, check=True)
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


_SLOW_PROXY = """
import asyncio, sys
listen, target, rate = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])

async def pipe(r, w):
    try:
        while data := await r.read(1 << 14):
            w.write(data)
            await w.drain()
            await asyncio.sleep(len(data) / rate)
    except OSError:  # the other side went away
        return
    finally:
        w.close()

async def handle(r, w):
    r2, w2 = await asyncio.open_connection("127.0.0.1", target)
    await asyncio.gather(pipe(r, w2), pipe(r2, w))

async def main():
    server = await asyncio.start_server(handle, "127.0.0.1", listen)
    print("ready", flush=True)
    await server.serve_forever()

asyncio.run(main())
"""


class SlowLink:
    """A TCP relay on 127.0.0.1 to ``target_port`` that moves at most ``rate`` bytes/s each way
    per connection: a slow network in front of a real Redis."""

    def __init__(self, target_port: int, rate: float) -> None:
        self.port = free_port()
        self.proc = subprocess.Popen([sys.executable, "-c", _SLOW_PROXY, str(self.port), str(target_port), str(rate)],
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None and self.proc.stdout.readline().strip() == "ready"

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


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
    """Start redis-servers with options: ``make_redis(appendonly=True, password="pw", tls=True,
    args=["--maxmemory", "1mb"])``."""
    started: list[RedisProcess] = []

    def make(*, appendonly: bool = False, password: str | None = None, tls: bool = False,
             args: Sequence[str] = ()) -> RedisProcess:
        proc = RedisProcess(tmp_path / f"redis{len(started)}", appendonly=appendonly, password=password,
                            tls=tls, args=args).start()
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


# ------------------------------------------------------------------ data helpers shared by the Redis tests


def chain(n: int, tag: str) -> list[bytes]:
    return [hashlib.sha256(f"{tag}:{i}".encode()).digest() for i in range(n)]


def payloads(got: list[bytearray | None]) -> list[bytes | None]:
    """A get's result as comparable bytes (None stays None)."""
    return [None if g is None else bytes(g) for g in got]


def blocks(keys: list[bytes], size: int) -> list[bytes]:
    return [random.Random(k).randbytes(size) for k in keys]
