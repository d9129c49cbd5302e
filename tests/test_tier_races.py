"""Races between clients over the Redis tier, and error replies that concern one key only.

Real redis-server and kvstore-server processes. A Redis ``CLIENT PAUSE ...
WRITE`` holds the tier's writes (and deletes) in flight while its reads still
go through, so each race is set up by polling for a state, never by sleeping.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
from typing import Any, Awaitable, Callable, Iterator

import pytest

from kvstore.client import AsyncKVClient
from kvstore.errors import Unavailable
from kvstore.protocol import Frame, FrameReader
from kvstore.server.process import ServerProcess
from kvstore.server.redis_layout import block_key

from shm_helpers import unix_path  # noqa: F401  (a fixture)
from redis_fixtures import (  # noqa: F401  (fixtures)
    RedisClusterProcesses, RedisProcess, blocks, chain, eventually, make_redis, payloads, redis_cluster,
    redis_server,
)

NS = "race/bf16/tp0"
MEM = "16MiB"
SLOW = ("--redis-timeout", "30")  # a paused write must not time out while the test holds it


@contextlib.contextmanager
def paused_writes(redis: RedisProcess) -> Iterator[None]:
    """Redis holds every write command (reads go on) until the block ends, failing or not."""
    redis.cli("CLIENT", "PAUSE", "60000", "WRITE")
    try:
        yield
    finally:
        redis.cli("CLIENT", "UNPAUSE")


def blocked_writes(redis: RedisProcess) -> int:
    """Clients whose commands wait on ``CLIENT PAUSE``: the tier's writes in flight."""
    info = dict(line.split(":", 1) for line in redis.cli("INFO", "clients").splitlines() if ":" in line)
    return int(info["blocked_clients"])


async def until_blocked(redis: RedisProcess, n: int = 1) -> None:
    async def held() -> bool:
        return blocked_writes(redis) >= n

    await eventually(held, 10, f"{n} write(s) to wait on the paused redis")


async def until_stats(kv: AsyncKVClient, what: str, cond: Callable[[dict[str, Any]], bool]) -> None:
    async def ok() -> bool:
        return bool(cond(await kv.stats()))

    await eventually(ok, 10, what)


# ---------------------------------------------------------------- dedup against a pending write-through


async def racing_puts(a: AsyncKVClient, b: AsyncKVClient, redis: RedisProcess, key: bytes,
                      data: bytes) -> tuple[asyncio.Future[Any], asyncio.Future[Any]]:
    """A's put of ``key`` held in Redis (writes paused), then B's put of it, found in memory."""
    first = asyncio.ensure_future(a.put([key], [data]))
    await until_blocked(redis)  # A's block is in memory, its SET held in Redis
    second = asyncio.ensure_future(b.put([key], [data]))
    await until_stats(a, "B's put to find the key in memory", lambda st: st["store"]["dedup"] == 1)
    return first, second


async def read_replies(sock: socket.socket, n: int) -> list[Frame]:
    """The next ``n`` frames the server sends on a raw socket (replies, in the order they come)."""
    reader, replies = FrameReader(is_server=False), []
    while len(replies) < n:
        chunk = await asyncio.to_thread(sock.recv, 65536)
        assert chunk, "the server closed the connection"
        reader.feed(chunk)
        while isinstance(event := reader.next_event(), Frame):
            replies.append(event)
    return replies


def second_putter(srv: ServerProcess, unix_path: str, via: str) -> tuple[AsyncKVClient, int]:
    """B, and the size of its block: over shared memory, one that goes through the arena (an
    SHM_PUT that finds the key stored reserves nothing, and its answer is the acknowledgement)."""
    if via == "shm":
        return AsyncKVClient(f"unix:{unix_path}", namespace=NS, retries=0), 3 << 20
    return AsyncKVClient(srv.addr, namespace=NS, retries=0), 16


@pytest.mark.parametrize("via", ["tcp", "shm"])
async def test_put_of_a_key_whose_tier_write_is_pending_shares_its_outcome(make_redis, make_server, unix_path: str,
                                                                          via: str) -> None:
    redis = make_redis()
    srv = make_server("--capacity", MEM, "--redis", redis.url, "--unix", unix_path, *SLOW)
    [key] = chain(1, "dedup")
    b, size = second_putter(srv, unix_path, via)
    [data] = blocks([key], size)
    async with AsyncKVClient(srv.addr, namespace=NS, retries=0) as a, b:
        assert (b.nodes[0].shm is not None) == (via == "shm")
        redis.cli("CLIENT", "PAUSE", "60000", "WRITE")
        first, second = await racing_puts(a, b, redis, key, data)
        redis.stop(signal.SIGKILL)  # A's write fails: its block leaves memory again

        with pytest.raises(Unavailable):
            await first
        with pytest.raises(Unavailable):  # (was: "existed", for a block then gone) the client stores it again
            await second
        assert await b.exists([key]) == [False]  # memory kept nothing unacknowledged


@pytest.mark.parametrize("via", ["tcp", "shm"])
async def test_put_of_a_key_whose_tier_write_is_pending_waits_for_success(make_redis, make_server, unix_path: str,
                                                                         via: str) -> None:
    redis = make_redis()
    srv = make_server("--capacity", MEM, "--redis", redis.url, "--unix", unix_path, *SLOW)
    [key] = chain(1, "dedup-ok")
    b, size = second_putter(srv, unix_path, via)
    [data] = blocks([key], size)
    async with AsyncKVClient(srv.addr, namespace=NS, retries=0) as a, b:
        assert (b.nodes[0].shm is not None) == (via == "shm")
        with paused_writes(redis):
            first, second = await racing_puts(a, b, redis, key, data)
        assert (await first).stored == 1
        assert (await second).existed == 1
    assert redis.cli("EXISTS", block_key(NS, key)) == "1"


@pytest.mark.parametrize("meanwhile", ["the write fails", "the write succeeds, then Redis loses the block",
                                       "the write fails, another put stores it, then Redis loses it"])
async def test_a_put_that_found_its_block_during_a_write_judges_it_at_its_commit(make_redis, make_server,
                                                                               meanwhile: str) -> None:
    """B's put found the key in memory while A's write of it ran, and that write ended before B's
    payload had all arrived. When it failed (the block left memory), B answered "existed" for a
    block then nowhere; when it succeeded and Redis then lost the block, B's first fix answered
    "existed" from A's outcome, skipping the check that writes such a block to Redis again."""
    import xxhash

    from kvstore.protocol import EXISTED, Hello, Put, Reply, encode

    redis = make_redis()
    srv = make_server("--capacity", MEM, "--redis", redis.url, *SLOW)
    key, other = chain(2, "late")
    data, more = blocks([key, other], 100_000)
    frames = encode(Hello(namespace=NS), 1) + encode(
        Put(keys=[key, other], sizes=[len(data), len(more)], checksums=[xxhash.xxh3_64_intdigest(b) for b in (data, more)]),
        2, [data, more])
    wire = b"".join(bytes(f) for f in frames)
    host, port = srv.addr.rsplit(":", 1)
    async with AsyncKVClient(srv.addr, namespace=NS, retries=0) as a:
        redis.cli("CLIENT", "PAUSE", "60000", "WRITE")
        first = asyncio.ensure_future(a.put([key], [data]))
        await until_blocked(redis)  # A's block is in memory, its SET held in Redis
        with socket.create_connection((host, int(port)), timeout=20) as b:
            b.sendall(wire[:-1000])  # B: its first block, found in memory; the second not whole yet
            await until_stats(a, "B's put to find the key in memory", lambda st: st["store"]["dedup"] == 1)
            if meanwhile.startswith("the write fails"):
                redis.stop(signal.SIGKILL)  # its block leaves memory again
                with pytest.raises(Unavailable):
                    await first
                if meanwhile != "the write fails":  # (B's first fix checked Redis for the copy that left)
                    redis.start()
                    await until_stats(a, "the tier to recover", lambda st: st["tier"]["state"] == "ok")
                    assert (await a.put([key], [data])).stored == 1
                    redis.cli("DEL", block_key(NS, key))
            else:
                redis.cli("CLIENT", "UNPAUSE")
                assert (await first).stored == 1
                redis.cli("DEL", block_key(NS, key))  # (expired, evicted, or a Redis restarted empty)
            b.sendall(wire[-1000:])  # B's commit, after A's write ended
            replies = await read_replies(b, 2)
        put = replies[1].msg
        assert isinstance(put, Reply)
        if meanwhile == "the write fails":
            assert put.fields["status"][0] == Unavailable.code  # (was 1, "existed", for a block then gone)
            assert await a.exists([key]) == [False]
        else:
            assert put.fields["status"][0] == EXISTED
            assert redis.cli("EXISTS", block_key(NS, key)) == "1"  # written again before "existed"


async def test_a_put_that_loses_its_commit_to_another_is_checked_in_redis_like_one_found_in_memory(
        redis_server: RedisProcess, make_server) -> None:
    """B's payload was arriving when A stored the same key; Redis then lost it (a restart without
    persistence, an expiry). B's commit found the key committed meanwhile and answered "existed"
    without the Redis check a block found in memory gets, so Redis never had it again."""
    import xxhash

    from kvstore.protocol import EXISTED, Hello, Put, Reply, encode

    srv = make_server("--capacity", MEM, "--redis", redis_server.url)
    [key] = chain(1, "lost-commit")
    [data] = blocks([key], 100_000)
    wire = b"".join(bytes(f) for f in encode(Hello(namespace=NS), 1) + encode(
        Put(keys=[key], sizes=[len(data)], checksums=[xxhash.xxh3_64_intdigest(data)]), 2, [data]))
    host, port = srv.addr.rsplit(":", 1)
    async with AsyncKVClient(srv.addr, namespace=NS, retries=0) as a:
        with socket.create_connection((host, int(port)), timeout=20) as b:
            b.sendall(wire[:-1000])  # B: its block reserved, not whole yet
            await until_stats(a, "B's reservation", lambda st: st["store"]["reserved_bytes"] > 0)
            assert (await a.put([key], [data])).stored == 1  # A commits first
            redis_server.cli("DEL", block_key(NS, key))
            b.sendall(wire[-1000:])
            replies = await read_replies(b, 2)
        put = replies[1].msg
        assert isinstance(put, Reply) and put.fields["status"] == [EXISTED]
        assert redis_server.cli("EXISTS", block_key(NS, key)) == "1"  # written again before "existed"
        assert (await a.stats())["store"]["pinned_blocks"] == 0


# ---------------------------------------------------------------- a delete racing a read-through


def remove(kv: AsyncKVClient, op: str, key: bytes) -> Awaitable[int]:
    """DELETE the key, or FLUSH its namespace: both drop it from memory first, then from Redis."""
    return kv.delete([key]) if op == "delete" else kv.flush()


@pytest.mark.parametrize("op", ["delete", "flush"])
@pytest.mark.parametrize("via", ["tcp", "shm"])
async def test_read_through_during_a_delete_does_not_bring_the_block_back(make_redis, make_server, unix_path: str,
                                                                         op: str, via: str) -> None:
    redis = make_redis()
    srv = make_server("--capacity", MEM, "--redis", redis.url, "--unix", unix_path, *SLOW)
    [key] = chain(1, "resurrect-wt")
    [data] = blocks([key], 16)
    reader = f"unix:{unix_path}" if via == "shm" else srv.addr  # shm: the reply locates blocks in the arena
    async with AsyncKVClient(srv.addr, namespace=NS, retries=0) as a, \
            AsyncKVClient(reader, namespace=NS, retries=0) as c:
        assert (c.nodes[0].shm is not None) == (via == "shm")
        await a.put([key], [data])
        with paused_writes(redis):  # DEL waits; GET is still answered
            deleting = asyncio.ensure_future(remove(a, op, key))
            await until_blocked(redis)  # memory has dropped it; Redis still has it
            assert payloads(await c.get([key])) in ([data], [None])  # concurrent with the delete: either
        assert await deleting == 1
        assert await c.exists([key]) == [False], "the deleted block came back (promoted by the GET)"
        assert payloads(await c.get([key])) == [None]


@pytest.mark.parametrize("op", ["delete", "flush"])
async def test_write_behind_delete_of_an_inflight_block_hides_it(make_redis, make_server, op: str) -> None:
    redis = make_redis()
    srv = make_server("--capacity", MEM, "--redis", redis.url, "--redis-mode", "write-behind", *SLOW)
    [key] = chain(1, "resurrect-wb")
    [data] = blocks([key], 16)
    async with AsyncKVClient(srv.addr, namespace=NS, retries=0) as a, \
            AsyncKVClient(srv.addr, namespace=NS, retries=0) as c:
        with paused_writes(redis):
            assert (await a.put([key], [data])).stored == 1  # acknowledged: queued
            await until_blocked(redis)  # the flusher's SET of it is in flight
            deleting = asyncio.ensure_future(remove(a, op, key))  # waits for that SET, then DELs
            await until_stats(c, "the delete to drop the block from memory", lambda st: st["store"]["blocks"] == 0)
            assert payloads(await c.get([key])) == [None], "the queue served a block whose delete had begun"
        assert await deleting == 1
        assert await c.exists([key]) == [False], "the deleted block came back"
        assert payloads(await c.get([key])) == [None]
    assert redis.cli("EXISTS", block_key(NS, key)) == "0"


@pytest.mark.parametrize("mode", ["write-behind", "write-through"])
@pytest.mark.parametrize("op", ["delete", "flush"])
async def test_a_block_put_again_during_its_delete_reaches_redis_after_the_del(make_redis, make_server, op: str,
                                                                              mode: str) -> None:
    """C put the key again while its DELETE waited for the write of an older copy. In write-behind
    the flusher sent C's copy before the delete's DEL: Redis lost it while memory kept it, and a
    restart lost an acknowledged block."""
    redis = make_redis()
    srv = make_server("--capacity", MEM, "--redis", redis.url, "--redis-mode", mode, *SLOW)
    [key] = chain(1, "put-during-delete")
    old, new = blocks([key], 4096), [b"n" * 4096]
    async with AsyncKVClient(srv.addr, namespace=NS, retries=0) as a, \
            AsyncKVClient(srv.addr, namespace=NS, retries=0) as c:
        with paused_writes(redis):
            putting_old = asyncio.ensure_future(a.put([key], old))
            await until_blocked(redis)  # the old copy's SET is in flight
            deleting = asyncio.ensure_future(remove(a, op, key))
            await until_stats(c, "the delete to drop the block from memory", lambda st: st["store"]["blocks"] == 0)
            putting = asyncio.ensure_future(c.put([key], new))
            await until_stats(c, "C's block in memory", lambda st: st["store"]["blocks"] == 1)
            if mode == "write-behind" and op == "delete":  # queued (held back), answered while the DEL waits
                assert (await putting).stored == 1 and not deleting.done()
        assert (await putting_old).stored == 1
        assert await deleting == 1
        assert (await putting).stored == 1
        await until_stats(c, "the backlog to drain", lambda st: st["tier"]["backlog_blocks"] == 0)
        assert payloads(await c.get([key])) == new
    assert redis.cli("EXISTS", block_key(NS, key)) == "1", "an acknowledged block is in memory only"


@pytest.mark.parametrize("mode", ["write-behind", "write-through"])
async def test_a_put_then_a_delete_sent_together_leave_the_block_nowhere(redis_server: RedisProcess, make_server,
                                                                        mode: str) -> None:
    """A PUT and a DELETE of the same key in one write: memory ran them in order, but the put's tier
    write started after the delete had noted what to drop, so the block was written after the DEL
    and a later get read it back from Redis."""
    import xxhash

    from kvstore.protocol import Delete, Hello, Put, encode

    srv = make_server("--capacity", MEM, "--redis", redis_server.url, "--redis-mode", mode)
    keys = chain(5, "put-then-delete")
    data = blocks(keys, 4096)
    host, port = srv.addr.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=20) as sock:
        frames = encode(Hello(namespace=NS), 1)
        for n, (k, d) in enumerate(zip(keys, data)):
            frames += encode(Put(keys=[k], sizes=[len(d)], checksums=[xxhash.xxh3_64_intdigest(d)]), 2 + 2 * n, [d])
            frames += encode(Delete(keys=[k]), 3 + 2 * n)
        sock.sendall(b"".join(bytes(f) for f in frames))
        replies = await read_replies(sock, 1 + 2 * len(keys))
    assert all(not r.msg.fields.get("errors") for r in replies)
    async with AsyncKVClient(srv.addr, namespace=NS, retries=0) as kv:
        await until_stats(kv, "the backlog to drain", lambda st: st["tier"]["backlog_blocks"] == 0)
        assert payloads(await kv.get(keys)) == [None] * len(keys), "a deleted block came back from Redis"
    assert [redis_server.cli("EXISTS", block_key(NS, k)) for k in keys] == ["0"] * len(keys)


# ---------------------------------------------------------------- an error reply concerns one key


async def _foreign_key_is_a_miss(writer: ServerProcess, reader: ServerProcess, hset: Callable[..., str]) -> None:
    good, odd, new = chain(3, "foreign")
    data = blocks([good, new], 16)
    async with AsyncKVClient(writer.addr, namespace=NS, retries=0) as w:
        await w.put([good], data[:1])
    hset(block_key(NS, odd), "f", "v")  # someone else's hash where a block would be: GET answers WRONGTYPE
    async with AsyncKVClient(reader.addr, namespace=NS, retries=0) as r:
        got = payloads(await r.get([good, odd]))  # reader's memory is empty: read through
        tier = (await r.stats())["tier"]
        assert tier["state"] == "ok" and tier["outages"] == 0, f"a foreign key degraded the tier: {tier['last_error']}"
        assert got == [data[0], None]
        assert (await r.put([new], data[1:])).stored == 1  # other writes go on
    reader.wait_log("could not be read")


async def test_a_foreign_key_type_is_a_miss_not_an_outage(redis_server: RedisProcess, make_server) -> None:
    writer = make_server("--capacity", MEM, "--redis", redis_server.url)
    reader = make_server("--capacity", MEM, "--redis", redis_server.url)
    await _foreign_key_is_a_miss(writer, reader, lambda *args: redis_server.cli("HSET", *args))


async def test_a_foreign_key_type_is_a_miss_in_a_cluster(redis_cluster: RedisClusterProcesses, make_server) -> None:
    writer = make_server("--capacity", MEM, "--redis-cluster", redis_cluster.spec)
    reader = make_server("--capacity", MEM, "--redis-cluster", redis_cluster.spec)
    await _foreign_key_is_a_miss(writer, reader, lambda *args: redis_cluster.nodes[0].cli("-c", "HSET", *args))


async def test_a_refused_write_fails_that_put_only(redis_server: RedisProcess, make_server) -> None:
    srv = make_server("--capacity", MEM, "--redis", redis_server.url)
    keys = chain(2, "oom")
    data = blocks(keys, 16)
    async with AsyncKVClient(srv.addr, namespace=NS, retries=0) as kv:
        redis_server.cli("CONFIG", "SET", "maxmemory", "1")  # every SET now answers OOM
        with pytest.raises(Unavailable, match="OOM|refused"):
            await kv.put(keys[:1], data[:1])
        assert await kv.exists(keys[:1]) == [False]  # not acknowledged, not kept
        assert (await kv.stats())["tier"]["state"] == "ok"  # Redis answers: not an outage
        redis_server.cli("CONFIG", "SET", "maxmemory", "0")
        assert (await kv.put(keys, data)).stored == 2


async def test_a_write_through_put_keeps_its_blocks_in_memory_until_redis_has_them(redis_server: RedisProcess) -> None:
    """In process (the real store, the real tier, a real Redis): a PUT's commit makes its blocks
    visible, and its Redis write starts a loop turn later. Another connection's put arriving in
    between could evict them; the write then left out the blocks gone from memory, and the PUT
    acknowledged them: in neither tier (a stress run of 12 clients into a 64 MiB store lost 26 in 25 s)."""
    from redis.asyncio import Redis

    from kvstore.errors import CapacityError
    from kvstore.protocol import Put
    from kvstore.server.redis_tier import RedisTier
    from kvstore.server.service import PutSink
    from kvstore.store import BlockStore

    page = 64 * 1024
    store = BlockStore(2 * page, page_size=page, prefault=False)
    tier = RedisTier(Redis(host="127.0.0.1", port=redis_server.port), target="test")
    await tier.start()
    try:
        def put(keys: list[bytes]) -> PutSink:
            sink = PutSink(store, NS, Put(keys=keys, sizes=[page] * len(keys), checksums=[7] * len(keys)), tier)
            for i in range(len(keys)):
                views = sink.target(i)
                if views is not None:
                    views[0][:] = bytes([len(keys[i])]) * page
            return sink

        mine = chain(2, "mine")
        pending = put(mine).commit()  # the tier write is a coroutine, not started yet
        assert asyncio.iscoroutine(pending)
        other = put(chain(1, "other"))  # the store is full: this reservation must evict something
        status = (await pending)["status"]
        acknowledged = [k for k, st in zip(mine, status) if st == 0]
        assert [redis_server.cli("EXISTS", block_key(NS, k)) for k in acknowledged] == ["1"] * len(acknowledged)
        assert status == [0, 0]
        assert other.status == [CapacityError.code]  # nothing else to evict: the committed blocks were pinned
        other.abort()
        assert store.stats()["pinned_blocks"] == 0  # and let go once Redis has them
        await put(chain(1, "after")).commit()  # (evictable now)
    finally:
        await tier.close()
