"""The systems the benchmark measures side by side, each behind the same small interface.

A target starts its server on loopback (and stops it by PID), prepares a
``(size, batch)`` cell, and hands out *ops*: ``async op(i)`` performs request
``i`` of a measurement (one batch). All clients run on the benchmark's one
event loop (uvloop), one after another, never at the same time.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, Awaitable, Callable

from kvstore.config import parse_size

from .common import free_port, make_blocks, make_keys
from .raw import EXIT, HEADER, RawClient

Op = Callable[[int], Awaitable[None]]


def ignore_sigint() -> None:
    """In a server child, before exec: a terminal's Ctrl-C goes to the bench alone, which stops its
    servers (hit mid-start, a server said only "did not start"); every other signal to the process
    group (a closed terminal, a cancelled job) still reaches them."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


class Target:
    """One system: a server process and a client."""

    name = ""
    pid: int | None = None
    note = ""

    async def start(self) -> None:
        raise NotImplementedError

    async def stop(self) -> None:
        raise NotImplementedError

    async def prepare(self, size: int, batch: int, rounds: int) -> dict[str, Op]:
        """Populate what the cell's reads need; return ``{op name: op}``."""
        raise NotImplementedError

    async def release(self) -> None:
        """The cell is over: let go of what :meth:`prepare` held for it."""

    async def fill(self) -> int:
        """Fill a store to its capacity before the matrix (bytes written; 0: nothing to fill).

        A cache in service is full: every put then makes room by evicting, in
        memory that has long been faulted in. Filled first, kvstore and Redis
        are measured in that steady state from the first cell on.
        """
        return 0


class RawTarget(Target):
    """A minimal uvloop BufferedProtocol pair (:mod:`kvstore.bench.raw`)."""

    name = "raw"

    async def start(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "kvstore.bench.raw"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, preexec_fn=ignore_sigint)
        self.pid = self.proc.pid
        assert self.proc.stdout is not None
        line = await asyncio.get_running_loop().run_in_executor(None, self.proc.stdout.readline)
        if not line.startswith("PORT "):
            self.proc.kill()
            raise RuntimeError(f"raw server did not start: {line!r}")
        self.port = int(line.split()[1])
        self.client = await RawClient.connect(self.port)

    async def stop(self) -> None:
        with contextlib.suppress(Exception):
            self.client.tr.write(HEADER.pack(EXIT, 0, 0))
            self.client.close()
        with contextlib.suppress(Exception):
            assert self.proc.stdin is not None
            self.proc.stdin.close()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)

    async def prepare(self, size: int, batch: int, rounds: int) -> dict[str, Op]:
        blocks = [memoryview(b) for b in make_blocks(size, batch)]
        dst = memoryview(bytearray(b"\x01") * (size * batch))
        c = self.client

        async def up(i: int) -> None:
            await c.up(blocks)

        async def down(i: int) -> None:
            await c.down(dst, size, batch)

        return {"up": up, "down": down}


class KVStoreTarget(Target):
    """kvstore-server with the asyncio client (pool of ``pool_size`` connections).

    ``transport``: ``"tcp"`` (loopback), ``"unix"`` (the ``--unix`` socket, payloads on the
    socket) or ``"shm"`` (the same socket for control, payloads through the shared arena).
    """

    NAMES = {"tcp": "kvstore", "unix": "kvstore-unix", "shm": "kvstore-shm"}

    def __init__(self, capacity: str, pool_size: int = 4, server_args: tuple[str, ...] = (),
                 transport: str = "tcp") -> None:
        self.capacity = capacity
        self.pool_size = pool_size
        self.transport = transport
        self.name = self.NAMES[transport]
        self.server_args = server_args
        self._seq = 0
        self._pinned: list[bytes] = []  # the cell's keys, leased while it runs
        self.client: Any = None
        self.unverified: Any = None  # the TCP system's second client, verify=False
        self.dir: tempfile.TemporaryDirectory[str] | None = None  # holds the Unix socket

    async def start(self) -> None:
        from kvstore.server.process import ServerProcess

        args = list(self.server_args)
        path = ""
        if self.transport != "tcp":
            self.dir = tempfile.TemporaryDirectory(prefix="kvstore-bench-unix-")
            path = os.path.join(self.dir.name, "kv.sock")
            args += ["--unix", path]
        self.server = ServerProcess("--capacity", self.capacity, "--idle-timeout", "0", "--frame-timeout", "0",
                                    *args, ignore_sigint=True)
        # Started on the loop's thread, blocking it for the start (nothing else runs yet): in an
        # executor, a cancel (Ctrl-C, SIGTERM) left the thread to finish starting a server nobody stopped.
        try:
            self.server.start()  # (a server that does not start is killed)
        except BaseException:
            if self.dir is not None:
                self.dir.cleanup()
            raise
        assert self.server.proc is not None
        self.pid = self.server.proc.pid
        try:
            await self._connect(path)
        except BaseException:
            await self.stop()  # a server this bench started never outlives a failed start
            raise

    async def _connect(self, path: str) -> None:
        from kvstore.client import AsyncKVClient

        self.client = AsyncKVClient(f"unix:{path}" if path else self.server.addr, namespace="bench", pool_size=self.pool_size, timeout=120,
                                    shm=self.transport == "shm")
        await self.client.connect()
        if self.transport == "shm" and not any(n.shm for n in self.client.nodes):
            raise RuntimeError("kvstore-shm: the server did not offer its shared memory")
        # Over TCP, a second client that skips checksum verification: what verifying costs
        # shows as get_into against get_into_nv, measured in the same interleaved cells.
        if self.transport == "tcp":
            self.unverified = AsyncKVClient(self.server.addr, namespace="bench", pool_size=self.pool_size,
                                            timeout=120, verify=False)
            await self.unverified.connect()

    async def stop(self) -> None:
        for client in (self.client, self.unverified):
            if client is not None:
                with contextlib.suppress(Exception):
                    await client.close()
        await asyncio.get_running_loop().run_in_executor(None, self.server.stop)
        if self.dir is not None:
            self.dir.cleanup()

    async def stats(self) -> dict[str, Any]:
        return await self.client.stats()

    async def fill(self) -> int:
        return await _fill(parse_size(self.capacity), self.client.put)

    async def release(self) -> None:
        if self._pinned:
            await self.client.unpin(self._pinned)
            self._pinned = []

    async def prepare(self, size: int, batch: int, rounds: int) -> dict[str, Op]:
        kv = self.client
        keys = make_keys(f"cell:{size}:{batch}", batch)
        blocks = make_blocks(size, batch)
        await kv.put(keys, blocks)
        # Leased for the cell (a few seconds; 10 min is the most a server grants by default): the put op
        # stores fresh keys and may cycle the whole capacity within one measurement (faster transports
        # run more rounds); eviction must not take the blocks gets read.
        await kv.lookup(keys, pin=True, lease_ms=10 * 60_000)
        self._pinned = keys  # (unpinned after the cell: each cell pinned held room from the later ones)
        dst = [bytearray(b"\x01") * size for _ in range(batch)]  # the caller's buffers, touched once

        async def put(i: int) -> None:
            # New keys every request (a dedup'd put skips the payload): the store fills up and
            # evicts, as in service. Hashing 32 keys costs ~30 us, inside the timing.
            self._seq += 1
            await kv.put(make_keys(f"put:{self._seq}", batch), blocks)

        async def get(i: int) -> None:
            out = await kv.get(keys)
            if None in out:  # a bench bug (evicted), not a slow path
                raise RuntimeError("kvstore: a benchmark block went missing")

        async def get_into(i: int) -> None:
            found = await kv.get_into(keys, dst)
            if not all(found):
                raise RuntimeError("kvstore: a benchmark block went missing")

        ops: dict[str, Callable[[int], Awaitable[None]]] = {"put": put, "get": get, "get_into": get_into}
        unverified = self.unverified
        if unverified is not None and batch > 1:  # the cost shows in batches; single requests are round-trip bound
            async def get_into_nv(i: int) -> None:
                if not all(await unverified.get_into(keys, dst)):
                    raise RuntimeError("kvstore: a benchmark block went missing")

            ops["get_into_nv"] = get_into_nv
        return ops


class RedisTarget(Target):
    """redis-server (no persistence) via redis-py's asyncio client with hiredis, pipelined.

    It runs with ``capacity`` as ``--maxmemory`` and ``volatile-lru``: its ``set`` writes new
    keys every request, with a TTL that makes them evictable, just as kvstore's ``put`` stores
    new keys and evicts; the keys the gets read carry no TTL and stay. Redis counts its clients'
    reply buffers against ``--maxmemory`` too, so on a full Redis a large GET or MGET evicts
    stored keys while it answers, and the SETs after it find that room free: Redis's reads carry
    some eviction work here and its writes less (a few percent either way, as measured).
    """

    name = "redis"
    #: TTL of the keys ``set`` writes: long enough never to expire during a run, present so
    #: that volatile-lru may evict them (and never the keys the gets read).
    PUT_TTL_S = 24 * 3600

    def __init__(self, capacity: int, executable: str = "redis-server") -> None:
        self.executable = executable
        self.capacity = capacity
        self._seq = 0

    @staticmethod
    def available(executable: str = "redis-server") -> bool:
        return shutil.which(executable) is not None and importlib.util.find_spec("redis") is not None

    async def start(self) -> None:
        import redis.asyncio as aredis

        self.dir = tempfile.TemporaryDirectory(prefix="kvstore-bench-redis-")
        for _ in range(20):
            port = free_port()
            self.proc = subprocess.Popen(
                [self.executable, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no",
                 "--loglevel", "warning", "--dir", self.dir.name, "--protected-mode", "yes",
                 "--maxmemory", str(self.capacity), "--maxmemory-policy", "volatile-lru"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=ignore_sigint)
            self.client = aredis.Redis(host="127.0.0.1", port=port)
            try:
                if await self._await_start(port):
                    return
            except BaseException:  # (a cancel too: the server this bench started never outlives the start)
                await self.client.aclose()
                self._kill()
                self.dir.cleanup()
                raise
            await self.client.aclose()
            self._kill()
        self.dir.cleanup()
        raise RuntimeError("redis-server did not start")

    async def _await_start(self, port: int) -> bool:
        """Wait for the server just started on ``port``; False if it exited (the port was taken)."""
        import redis

        for _ in range(100):
            if self.proc.poll() is not None:
                return False
            try:
                info = await self.client.info("server")
            except redis.ConnectionError:
                await asyncio.sleep(0.05)
                continue
            if info["process_id"] != self.proc.pid:  # never talk to someone else's server
                raise RuntimeError(f"port {port} answered by a redis-server this bench did not start")
            self.pid = self.proc.pid
            self.port = port
            self.version = info.get("redis_version")
            self.hiredis = redis.utils.HIREDIS_AVAILABLE
            return True
        return False

    def _kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    async def stop(self) -> None:
        with contextlib.suppress(Exception):
            await self.client.aclose()
        self._kill()
        self.dir.cleanup()

    async def memory(self) -> dict[str, int]:
        info = await self.client.info("memory")
        return {"used_memory": int(info["used_memory"]), "used_memory_rss": int(info["used_memory_rss"])}

    async def fill(self) -> int:
        async def put(keys: list[bytes], blocks: list[bytearray]) -> None:
            p = self.client.pipeline(transaction=False)
            for k, v in zip(keys, blocks):
                p.set(k, memoryview(v), ex=self.PUT_TTL_S)  # (redis-py encodes a bytearray from 8.0 only)
            await p.execute()

        return await _fill(self.capacity, put)

    async def stored_bytes(self) -> int:
        """The bytes of every value stored (one pipelined STRLEN per key)."""
        total = 0
        async for keys in _chunks(self.client.scan_iter(count=1000), 1000):
            p = self.client.pipeline(transaction=False)
            for k in keys:
                p.strlen(k)
            total += sum(await p.execute())
        return total

    async def prepare(self, size: int, batch: int, rounds: int) -> dict[str, Op]:
        r = self.client
        keys = make_keys(f"cell:{size}:{batch}", batch)
        # memoryviews: redis-py's hiredis packer sends them as they are, as kvstore and the raw
        # pair send theirs; bytes it copies into each command (two page faults per 4 KiB measured).
        vals = [memoryview(b) for b in make_blocks(size, batch)]
        await r.mset(dict(zip(keys, vals)))

        ttl = self.PUT_TTL_S

        async def set_(i: int) -> None:
            # New keys every request, as kvstore's put: overwriting one batch of keys would
            # reuse the same few warm allocations and never evict (measured up to 1.5x faster).
            self._seq += 1
            new = make_keys(f"put:{self._seq}", batch)
            if batch == 1:
                await r.set(new[0], vals[0], ex=ttl)
                return
            p = r.pipeline(transaction=False)
            for k, v in zip(new, vals):
                p.set(k, v, ex=ttl)
            await p.execute()

        async def get(i: int) -> None:
            if batch == 1:
                out: list[Any] = [await r.get(keys[0])]
            else:
                p = r.pipeline(transaction=False)
                for k in keys:
                    p.get(k)
                out = await p.execute()
            if len(out[-1]) != size:
                raise RuntimeError("redis: bad reply")

        async def mget(i: int) -> None:
            out: list[Any] = await r.mget(keys)
            if len(out[-1]) != size:
                raise RuntimeError("redis: bad reply")

        return {"set": set_, "get": get, "mget": mget}


async def _fill(capacity: int, put: Callable[[list[bytes], list[bytearray]], Awaitable[Any]]) -> int:
    """Put new keys until 5 % more than ``capacity`` went in (Redis's ``maxmemory`` counts its
    overhead too): batches of 32 blocks of 1 MiB, or of a sixteenth of a small store."""
    block, batch = max(4096, min(1 << 20, capacity // 512)), 32
    blocks = make_blocks(block, batch)
    written = 0
    while written < capacity * 1.05:
        await put(make_keys(f"fill:{written}", batch), blocks)
        written += block * batch
    return written


async def _chunks(it: Any, n: int) -> Any:
    """Lists of up to ``n`` items from an async iterator."""
    chunk: list[Any] = []
    async for item in it:
        chunk.append(item)
        if len(chunk) == n:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def lmcache_status() -> tuple[bool, str]:
    """Whether LMCache's standalone server can be measured here, and why not."""
    exe = shutil.which("lmcache_server")
    mod = importlib.util.find_spec("lmcache")
    if exe is None and mod is None:
        return False, "LMCache is not installed (no `lmcache` module, no `lmcache_server`): skipped"
    return False, ("LMCache is installed but its lm:// client is not wired into kvstore-bench yet: skipped "
                   "(its PUT is unacknowledged and it has no batch op, so a fair pipelined comparison needs care)")


async def timed_rounds(op: Op, rounds: int) -> tuple[float, list[int]]:
    """Run ``rounds`` requests one after another; (wall seconds, per-request ns)."""
    lat: list[int] = []
    clock = time.perf_counter_ns
    t0 = clock()
    for i in range(rounds):
        s = clock()
        await op(i)
        lat.append(clock() - s)
    return (clock() - t0) / 1e9, lat
