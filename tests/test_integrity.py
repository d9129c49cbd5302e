"""End-to-end checksums: a block corrupted in the server's memory or in Redis is reported
(``IntegrityError``) and treated as missing -- over TCP, the Unix socket and shared memory alike."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Any, Callable, Iterator, TypeVar

import pytest

from kvstore.client import AsyncKVClient, KVClient
from kvstore.config import ServerConfig
from kvstore.errors import IntegrityError, KVStoreError
from kvstore.server.app import Server
from kvstore.server.redis_layout import HEADER_SIZE, block_key

from redis_fixtures import RedisProcess, redis_server  # noqa: F401  (fixture)
from shm_helpers import MakeServer, data, key, shm_locate, shm_release, unix_path  # noqa: F401  (fixture)

T = TypeVar("T")
NS = "integrity"


def flip(view: memoryview, offset: int) -> None:
    view[offset] ^= 0xFF


async def expect_corrupt(kv: AsyncKVClient, keys: list[bytes], bad: int, blocks: list[bytes]) -> None:
    """get and get_into raise IntegrityError naming one bad block; the bad block is None, the rest intact."""
    with pytest.raises(IntegrityError, match="1 of .* checksum") as info:
        await kv.get(keys)
    result: list[Any] = info.value.result  # type: ignore[attr-defined]
    assert result[bad] is None  # never returned as data
    assert [bytes(r) for i, r in enumerate(result) if i != bad] == [b for i, b in enumerate(blocks) if i != bad]
    bufs = [bytearray(len(b)) for b in blocks]
    with pytest.raises(IntegrityError):
        await kv.get_into(keys, bufs)
    assert isinstance(info.value, KVStoreError)


# ---------------------------------------------------------------- corrupted in the server's memory


@pytest.mark.parametrize("put_via", ["tcp", "shm"])
async def test_block_corrupted_in_server_memory_is_caught_on_every_path(make_server: MakeServer, unix_path: str,
                                                                         put_via: str) -> None:
    """Whichever way the block came in (a put through shared memory hashes as it copies) and
    whichever way it goes out. With verify=False, on every path, the bytes come back unchecked."""
    srv = make_server("--capacity", "16MiB", "--unix", unix_path)
    keys = [key(i, "mem") for i in range(4)]
    blocks = [data(k, 200_000) for k in keys]
    async with AsyncKVClient(srv.addr, namespace=NS) as tcp, \
            AsyncKVClient(f"unix:{unix_path}", namespace=NS) as shm, \
            AsyncKVClient(f"unix:{unix_path}", namespace=NS, shm=False) as sock, \
            AsyncKVClient(f"unix:{unix_path}", namespace=NS, verify=False) as unchecked, \
            AsyncKVClient(srv.addr, namespace=NS, verify=False) as unchecked_tcp, \
            AsyncKVClient(f"unix:{unix_path}", namespace=NS, shm=False, verify=False) as unchecked_sock:
        await (tcp if put_via == "tcp" else shm).put(keys, blocks)
        assert (await shm.stats())["shm"]["puts"] == int(put_via == "shm")
        # Corrupt block 2 in place, through the shared mapping (as a stray write or bad RAM would).
        conn, fields = await shm_locate(shm, [keys[2]])
        offset, _ = fields["locs"][0][0]
        assert shm.nodes[0].shm is not None
        flip(shm.nodes[0].shm.segment.buffer, offset + 12345)
        assert await shm_release(conn, fields["handle"])
        for kv in (tcp, shm, sock):
            await expect_corrupt(kv, keys, 2, blocks)
        for kv in (unchecked, unchecked_tcp, unchecked_sock):  # the bytes as stored: it *was* the check that caught it
            got = await kv.get(keys)
            assert got[2] is not None and bytes(got[2]) != blocks[2] and bytes(got[2])[12345] == blocks[2][12345] ^ 0xFF
        assert (await tcp.stats())["store"]["pinned_blocks"] == 0


class ThreadedServer:
    """The real :class:`Server` on a background thread with its own loop, so a test can reach its memory."""

    def __init__(self, config: ServerConfig) -> None:
        self.server = Server(config)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_until_complete,
                                       args=(self.server.serve_forever(install_signals=False),), daemon=True)

    def __enter__(self) -> ThreadedServer:
        self.thread.start()
        self.call(lambda: None)  # the loop runs
        for _ in range(500):
            if self.server.port:
                return self
            threading.Event().wait(0.01)
        raise RuntimeError("in-process server did not start")

    def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the server's loop thread (the store is not thread-safe) and return its result."""
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        self.loop.call_soon_threadsafe(lambda: fut.set_result(fn()))
        return fut.result(10)

    def __exit__(self, *exc: object) -> None:
        self.loop.call_soon_threadsafe(self.server.request_stop)
        self.thread.join(15)
        self.loop.close()


@pytest.fixture
def threaded_server() -> Iterator[ThreadedServer]:
    with ThreadedServer(ServerConfig(port=0, capacity=8 << 20, prefault=False, idle_timeout=0,
                                     frame_timeout=0)) as srv:
        yield srv


def test_block_corrupted_in_a_private_arena_in_process(threaded_server: ThreadedServer) -> None:
    keys = [key(i, "inproc") for i in range(3)]
    blocks = [data(k, 70_000) for k in keys]
    store = threaded_server.server.store
    assert store.arena.fd is None  # no --unix: a private arena, reachable only from inside
    with KVClient(f"127.0.0.1:{threaded_server.server.port}", namespace=NS) as kv:
        kv.put(keys, blocks)

        def corrupt() -> None:
            ref = store.acquire(NS, keys[0])
            assert ref is not None
            (start, _), *_ = ref.extent
            flip(store.arena.buffer, start * store.arena.page_size + 69_999)  # the very last byte
            store.release(ref)

        threaded_server.call(corrupt)
        with pytest.raises(IntegrityError) as info:
            kv.get(keys)
        assert info.value.result[0] is None  # type: ignore[attr-defined]
        assert kv.get(keys[1:]) == blocks[1:]


# ---------------------------------------------------------------- corrupted in Redis


async def test_block_corrupted_in_redis_is_caught_on_the_shm_path_and_not_cached(
        redis_server: RedisProcess, make_server: MakeServer, unix_path: str) -> None:
    keys = [key(i, "redis") for i in range(3)]
    blocks = [data(k, 100_000) for k in keys]
    writer = make_server("--capacity", "8MiB", "--redis", redis_server.url)
    async with AsyncKVClient(writer.addr, namespace=NS) as kv:
        await kv.put(keys, blocks)
    writer.stop()
    redis_key = block_key(NS, keys[1])
    patch = "XXXX" if blocks[1][500:504] != b"XXXX" else "YYYY"
    redis_server.cli("SETRANGE", redis_key, str(HEADER_SIZE + 500), patch)  # 4 bytes of the block changed
    assert redis_server.cli("STRLEN", redis_key) == str(HEADER_SIZE + 100_000)

    reader = make_server("--capacity", "8MiB", "--redis", redis_server.url, "--unix", unix_path)
    async with AsyncKVClient(f"unix:{unix_path}", namespace=NS) as shm, \
            AsyncKVClient(reader.addr, namespace=NS) as tcp:
        assert shm.nodes[0].shm is not None
        await expect_corrupt(shm, keys, 1, blocks)  # read through Redis, over shared memory
        stats = await tcp.stats()
        assert stats["store"]["blocks"] == 2  # the intact blocks were promoted into memory, the corrupt one not
        assert stats["shm"]["inline_blocks"] >= 1  # it came inline, so the client could check it
        await expect_corrupt(tcp, keys, 1, blocks)  # over TCP too, every time: never cached
        assert (await tcp.stats())["store"]["blocks"] == 2
    reader.wait_log("fails its checksum")
