"""The Redis tier under faults and races found by review: a put during a flush, a delete of a put
waiting for room, a full write-behind queue during an outage, a Redis restarted with a lower value
limit, and the counters of misses and deletes.

Real redis-server and kvstore-server processes; races are set up with ``CLIENT PAUSE ... WRITE``
and by polling for a state, never by sleeping.
"""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path
from typing import Any

import pytest

from kvstore.client import AsyncKVClient
from kvstore.errors import TooLarge, Unavailable
from redis.asyncio import Redis

from kvstore.server.redis_layout import HEADER_SIZE, block_key
from kvstore.server.redis_tier import RedisTier
from kvstore.server.tier import TierBlock

from redis_fixtures import (  # noqa: F401  (fixtures)
    RedisProcess, blocks, chain, eventually, make_redis, payloads, redis_server,
)
from shm_helpers import unix_path  # noqa: F401  (a fixture)
from test_tier_races import SLOW, paused_writes, until_blocked, until_stats

NS = "faults/bf16"
MEM = "16MiB"


def in_redis(redis: RedisProcess, ns: str, keys: list[bytes]) -> list[bool]:
    return [redis.cli("EXISTS", block_key(ns, k)) == "1" for k in keys]


def tier_is(**want: Any):  # type: ignore[no-untyped-def]
    return lambda st: all(st["tier"][k] == v for k, v in want.items())


# ---------------------------------------------------------------- a put during a flush of its namespace


@pytest.mark.parametrize("mode", ["write-through", "write-behind"])
async def test_a_put_acknowledged_during_a_flush_is_in_redis_afterwards(make_redis, make_server, mode: str) -> None:
    # The flush clears memory, then SCANs and DELs in Redis; a put acknowledged in between stayed in
    # memory while the SCAN deleted it from Redis (a kill -9 then lost it; a re-put answered 'existed').
    redis = make_redis(args=["--enable-debug-command", "yes"])
    redis.cli("DEBUG", "POPULATE", "20000", f"kvstore:{NS}", "16")  # filler: the SCAN takes 20 rounds
    srv = make_server("--capacity", MEM, "--redis", redis.url, "--redis-mode", mode, *SLOW)
    keys = chain(20, "during-flush")
    data = blocks(keys, 1000)
    async with AsyncKVClient(srv.addr, namespace=NS, retries=0, timeout=60) as a, \
            AsyncKVClient(srv.addr, namespace=NS, retries=0, timeout=60) as b:
        with paused_writes(redis):
            flushing = asyncio.ensure_future(a.flush())
            await until_blocked(redis)  # memory is flushed; the SCAN's first DEL waits
            puts = [asyncio.ensure_future(b.put([k], [d])) for k, d in zip(keys, data)]
            await until_stats(b, "the puts' blocks to be in memory", lambda st: st["store"]["blocks"] == 20)
        assert await flushing >= 20000
        assert [(await p).stored for p in puts] == [1] * 20

        async def written() -> bool:
            return (await b.stats())["tier"]["backlog_blocks"] == 0

        await eventually(written, 15, "the write-behind queue to drain")
        assert await b.exists(keys) == [True] * 20
    # (was: most of them missing; each one a block a kill -9 would lose)
    assert in_redis(redis, NS, keys) == [True] * 20


# ---------------------------------------------------------------- write-behind: a full queue


async def test_write_behind_delete_cancels_a_put_waiting_for_room(make_redis, make_server) -> None:
    redis = make_redis()
    srv = make_server("--capacity", MEM, "--redis", redis.url, "--redis-mode", "write-behind",
                      "--redis-queue-bytes", "100000", *SLOW)
    first, waiting = chain(2, "room")
    data = blocks([first, waiting], 60_000)
    async with AsyncKVClient(srv.addr, namespace=NS, retries=0, timeout=60) as a, \
            AsyncKVClient(srv.addr, namespace=NS, retries=0) as b:
        with paused_writes(redis):
            assert (await a.put([first], data[:1])).stored == 1
            await until_blocked(redis)  # its SET is in flight and holds the queue's room
            put = asyncio.ensure_future(a.put([waiting], data[1:]))  # in memory, waits for room
            await until_stats(b, "the waiting put's block to be in memory", lambda st: st["store"]["blocks"] == 2)
            deleting = asyncio.ensure_future(b.delete([waiting]))
            await until_blocked(redis, 2)  # the delete's DEL waits too
        assert await deleting == 1
        assert (await put).stored == 1  # (acknowledged before the delete: deleted since)
        await until_stats(b, "the queue to drain", tier_is(backlog_blocks=0))
        assert payloads(await b.get([waiting])) == [None]  # (was: back, written after its delete)
    assert in_redis(redis, NS, [first, waiting]) == [True, False]


async def test_write_behind_put_fails_at_once_when_the_queue_is_full_and_redis_down(tmp_path: Path,
                                                                                    make_server) -> None:
    # It waited for the whole outage (or its client's timeout): no request may wait on a Redis that is down.
    redis = RedisProcess(tmp_path / "redis").start()
    try:
        srv = make_server("--capacity", MEM, "--redis", redis.url, "--redis-mode", "write-behind",
                          "--redis-queue-bytes", "100000")
        keys = chain(8, "outage")
        data = blocks(keys, 16_000)
        async with AsyncKVClient(srv.addr, namespace=NS, retries=0, timeout=20) as kv:
            redis.stop()
            await until_stats(kv, "the tier to be degraded", tier_is(state="degraded"))
            for i in range(6):  # 6 x 16 KB fit in 100,000 bytes
                assert (await kv.put(keys[i:i + 1], data[i:i + 1])).stored == 1
            with pytest.raises(Unavailable, match="redis tier"):
                await kv.put(keys[6:], data[6:])
            assert await kv.exists(keys[6:]) == [False, False]  # not acknowledged, not kept
            assert (await kv.stats())["tier"]["backlog_blocks"] == 6  # (none of the failed put's blocks)
            redis.start()  # same port
            await until_stats(kv, "the queue to drain", tier_is(state="ok", backlog_blocks=0))
            assert (await kv.put(keys[6:], data[6:])).stored == 2
            await until_stats(kv, "the queue to drain", tier_is(backlog_blocks=0))
        assert all(in_redis(redis, NS, keys))
    finally:
        redis.stop()


@pytest.mark.parametrize("mode", ["write-through", "write-behind"])
async def test_puts_refused_in_an_outage_are_not_counted_stored_nor_evict_memory(make_redis, make_server,
                                                                                  mode: str) -> None:
    """In an outage every refused block was counted in kvstore_stored_blocks_total, and in
    write-through a refused put into a full memory evicted a good block to make room for one it
    then dropped."""
    redis = make_redis()
    srv = make_server("--capacity", "1MiB", "--page-size", "64KiB", "--redis", redis.url, "--redis-mode", mode,
                      "--redis-queue-bytes", "100000", "--redis-timeout", "1")
    hot, new = chain(16, "hot"), chain(12, "new")
    async with AsyncKVClient(srv.addr, namespace=NS, retries=0, timeout=20) as kv:
        assert (await kv.put(hot, blocks(hot, 60_000))).stored == 16  # memory full
        await until_stats(kv, "the queue to drain", tier_is(backlog_blocks=0))
        redis.stop()
        await until_stats(kv, "the tier to be degraded", tier_is(state="degraded"))
        before = await kv.stats()
        refused = 0
        for k in new:
            try:
                await kv.put([k], blocks([k], 60_000))
            except Unavailable:
                refused += 1
        after = await kv.stats()
        with pytest.raises(TooLarge):  # (not Unavailable, "send it again later": it can never be stored)
            await kv.put(chain(1, "huge"), [b"x" * (2 << 20)])
        if mode == "write-through":  # blocks in memory but perhaps not in Redis (it may have restarted
            with pytest.raises(Unavailable):  # empty) are not acknowledged as "existed" either
                await kv.put(hot[:2], blocks(hot[:2], 60_000))
            assert (await kv.stats())["store"]["blocks"] == 16  # (kept in memory: a retry checks them)
    stored = after["store"]["stored"] - before["store"]["stored"]
    if mode == "write-through":
        assert after["store"]["evictions"] == before["store"]["evictions"]
        assert after["store"]["blocks"] == 16
        assert refused == 12 and stored == 0
    else:  # the queue took one block of 60 KB (100,000 bytes), then was full
        assert refused == 11 and stored == 1  # (12 were counted)
        srv.kill()  # (a stop would wait out its flush of that block to the stopped Redis: 10 s)


async def test_the_write_behind_backlog_of_an_outage_leaves_no_rss_behind_once_written(tmp_path: Path,
                                                                                         make_server) -> None:
    """RSS stayed at the backlog's peak after an outage had drained (+176 MiB, from the second
    outage on): glibc kept the freed block-sized values in its heap. A drained backlog of more
    than 32 MiB now gives the heap's free pages back."""
    import os

    def rss() -> int:
        assert srv.proc is not None
        with open(f"/proc/{srv.proc.pid}/status") as f:
            return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmRSS:"))

    redis = RedisProcess(tmp_path / "redis").start()
    try:
        srv = make_server("--capacity", "64MiB", "--redis", redis.url, "--redis-mode", "write-behind",
                          "--redis-queue-bytes", "128MiB")
        block = os.urandom(1 << 20)
        async with AsyncKVClient(srv.addr, namespace=NS, retries=0, timeout=20) as kv:
            before = rss()
            for outage in range(2):  # (the first outage's frees raise glibc's mmap threshold)
                redis.stop()
                await until_stats(kv, "the tier to be degraded", tier_is(state="degraded"))
                for i in range(12):  # 96 MiB acknowledged while Redis is down
                    keys = chain(8, f"rss{outage}.{i}")
                    assert (await kv.put(keys, [block] * 8)).stored == 8
                assert (await kv.stats())["tier"]["backlog_bytes"] > 96 << 20
                redis.start()
                await until_stats(kv, "the queue to drain", tier_is(state="ok", backlog_blocks=0))
                after = rss()
                assert after < before + (40 << 20), f"outage {outage}: RSS {before >> 20} -> {after >> 20} MiB"
    finally:
        redis.stop()


async def test_a_refused_write_behind_put_leaves_an_earlier_put_of_the_same_key_queued(tmp_path: Path) -> None:
    """The tier alone, in process, over a real Redis that goes down: K is queued (acknowledged), then a
    put of K again (evicted from memory meanwhile) and two more finds the queue full and is refused.
    Taking its items back took K's queued block with them: acknowledged, and then nowhere."""
    redis = RedisProcess(tmp_path / "redis").start()
    size = 1000
    tier = RedisTier(Redis(host="127.0.0.1", port=redis.port, socket_timeout=0.5, socket_connect_timeout=0.5),
                     target="test", mode="write-behind", queue_bytes=3 * (size + HEADER_SIZE), flush_timeout=1.0)
    try:
        await tier.start()
        redis.stop()
        tier._next_probe = 0  # (probe now, not after the back-off)
        await tier.check_health()
        assert tier.stats()["state"] == "degraded"

        def block(key: bytes) -> TierBlock:
            return TierBlock(key, [memoryview(key[:1] * size)], 0, size)

        await tier.store(NS, [block(b"K")])
        await tier.store(NS, [block(b"Y")])
        with pytest.raises(Unavailable):
            await tier.store(NS, [block(b"K"), block(b"X"), block(b"Z")])
        got = await tier.fetch(NS, [b"K", b"Y", b"X"])
        assert [None if g is None else bytes(g[0]) for g in got] == [b"K" * size, b"Y" * size, None]
        assert tier.stats()["backlog_blocks"] == 2
    finally:
        await tier.close()
        redis.stop()


# ---------------------------------------------------------------- a Redis restarted with a lower value limit


@pytest.mark.parametrize("mode", ["write-through", "write-behind"])
async def test_a_redis_restarted_with_a_lower_value_limit_is_learnt(tmp_path: Path, make_server, mode: str) -> None:
    # The limit was read once: a block over the new one was acknowledged, Redis reset each connection
    # that sent it, and the tier went degraded/recovered for ever with the queue stuck behind it.
    redis = RedisProcess(tmp_path / "before").start()
    lower = RedisProcess(tmp_path / "after", port=redis.port, args=["--proto-max-bulk-len", "1mb"])
    try:
        srv = make_server("--capacity", MEM, "--redis", redis.url, "--redis-mode", mode)
        keys = chain(4, "limit")
        data = blocks(keys, 1000)
        data[1] = data[3] = random.Random(3).randbytes(2 << 20)
        async with AsyncKVClient(srv.addr, namespace=NS, retries=0, timeout=20) as kv:
            redis.stop()
            await until_stats(kv, "the tier to be degraded", tier_is(state="degraded"))
            if mode == "write-behind":  # queued during the outage, the limit then still 512 MB
                assert (await kv.put(keys[:3], data[:3])).stored == 3
            lower.start()
            await until_stats(kv, "recovery and the queue to drain", tier_is(state="ok", backlog_blocks=0))
            with pytest.raises(TooLarge, match="backing tier"):  # refused at PUT, as the limit is now 1 MB
                await kv.put(keys[3:], data[3:])
            assert (await kv.stats())["tier"]["outages"] == 1
        if mode == "write-behind":
            assert in_redis(lower, NS, keys) == [True, False, True, False]
            srv.wait_log("stay in memory only")
    finally:
        lower.stop()
        redis.stop()


# ---------------------------------------------------------------- counters


async def test_values_that_are_not_kvstore_blocks_count_as_fetch_misses(redis_server: RedisProcess,
                                                                       make_server) -> None:
    keys = chain(3, "foreign")
    srv = make_server("--capacity", MEM, "--redis", redis_server.url)
    redis_server.cli("SET", block_key(NS, keys[0]), "hello")  # a foreign string
    redis_server.cli("SET", block_key(NS, keys[1]), "KVB\x02" + "\x01" * 12 + "data")  # another layout version
    redis_server.cli("RPUSH", block_key(NS, keys[2]), "x")  # another type
    async with AsyncKVClient(srv.addr, namespace=NS, retries=0) as kv:
        assert payloads(await kv.get(keys)) == [None, None, None]
        tier = (await kv.stats())["tier"]
    assert (tier["fetch_misses"], tier["fetched_blocks"]) == (3, 0)  # (was 1: only the list)


@pytest.mark.parametrize("op", ["delete", "flush"])
async def test_write_behind_blocks_only_in_the_queue_count_as_deleted(make_redis, make_server, op: str) -> None:
    # Evicted from memory and not yet in Redis, they were dropped from the queue but answered n=0.
    redis = make_redis()
    srv = make_server("--capacity", "1MiB", "--redis", redis.url, "--redis-mode", "write-behind", *SLOW)
    keys = chain(40, "count")
    data = blocks(keys, 60_000)
    async with AsyncKVClient(srv.addr, namespace=NS, retries=0, timeout=60) as kv:
        with paused_writes(redis):
            for k, d in zip(keys, data):
                assert (await kv.put([k], [d])).stored == 1  # the first one's SET waits; the rest queue
            await until_blocked(redis)
            st = await kv.stats()
            assert st["store"]["blocks"] < 30 and st["tier"]["backlog_blocks"] == 40  # memory evicted some
            victims = keys[5:8]  # evicted, waiting in the queue
            assert await kv.exists(victims) == [True] * 3  # (answered from the queue)
            if op == "delete":
                removing = asyncio.ensure_future(kv.delete(victims))
                await until_blocked(redis, 2)  # its DEL waits
            else:
                removing = asyncio.ensure_future(kv.flush())
                await until_stats(kv, "the flush to begin", lambda st: st["store"]["blocks"] == 0)
        assert await removing == (3 if op == "delete" else 40)
        assert payloads(await kv.get(victims)) == [None] * 3
        await until_stats(kv, "the queue to drain", tier_is(backlog_blocks=0))
    assert in_redis(redis, NS, victims) == [False] * 3


async def test_a_delete_that_waits_too_long_on_a_write_in_flight_says_so(make_redis, make_server) -> None:
    """(coverage review) A DELETE waits for a write of its keys already in flight, at most
    max(--drain-seconds, 5) s; past that it was refused as "redis tier ... is unavailable ():
    ... the server reconnects to redis on its own", with the tier up and nothing reconnecting."""
    redis = make_redis()
    srv = make_server("--capacity", MEM, "--redis", redis.url, "--redis-mode", "write-behind", "--drain-seconds", "1",
                      *SLOW)
    keys = chain(1, "in-flight")
    async with AsyncKVClient(srv.addr, namespace=NS, retries=0, timeout=60) as kv:
        with paused_writes(redis):
            assert (await kv.put(keys, blocks(keys, 1000))).stored == 1
            await until_blocked(redis)  # its SET waits
            with pytest.raises(Unavailable, match=r"deleted from memory but not from redis .* still in flight after 5 s") as refused:
                await kv.delete(keys)
            assert "reconnects" not in str(refused.value) and "()" not in str(refused.value)
            assert (await kv.stats())["tier"]["state"] == "ok"
        assert await kv.delete(keys) == 1  # (sent again once the write has landed)
    assert in_redis(redis, NS, keys) == [False]


async def test_a_put_of_another_namespace_does_not_wait_for_a_flush(make_redis, make_server) -> None:
    redis = make_redis()
    srv = make_server("--capacity", MEM, "--redis", redis.url, *SLOW)
    [key] = chain(1, "other-ns")
    async with AsyncKVClient(srv.addr, namespace=NS, retries=0, timeout=60) as a, \
            AsyncKVClient(srv.addr, namespace="other", retries=0) as b:
        await a.put([key], [b"x"])
        with paused_writes(redis):
            flushing = asyncio.ensure_future(a.flush())
            await until_blocked(redis)  # the flush's DEL waits
            other = asyncio.ensure_future(b.put([key], [b"y"]))
            await until_blocked(redis, 2)  # its SET went out: it did not wait on the flush of NS
        assert await flushing == 1 and (await other).stored == 1
    assert in_redis(redis, NS, [key]) == [False] and in_redis(redis, "other", [key]) == [True]



async def test_blocks_read_from_the_write_behind_queue_count_as_fetched(make_redis, make_server) -> None:
    """(a get served from the queue -- blocks evicted from memory before Redis had them -- left
    kvstore_tier_fetched_blocks_total as it was, though the blocks came back from the tier)"""
    redis = make_redis()
    srv = make_server("--capacity", "1MiB", "--page-size", "64KiB", "--redis", redis.url,
                      "--redis-mode", "write-behind", *SLOW)
    keys = chain(18, "queued")  # 16 pages of memory: the first ones are evicted while still queued
    data = blocks(keys, 60_000)
    async with AsyncKVClient(srv.addr, namespace=NS, retries=0, timeout=20) as kv:
        with paused_writes(redis):
            for k, d in zip(keys, data):
                assert (await kv.put([k], [d])).stored == 1
            st = await kv.stats()
            assert st["tier"]["backlog_blocks"] == 18 and st["store"]["evictions"] >= 2
            assert payloads(await kv.get(keys[:2])) == data[:2]
            assert (await kv.stats())["tier"]["fetched_blocks"] == st["tier"]["fetched_blocks"] + 2


@pytest.mark.parametrize("mode", ["write-through", "write-behind"])
async def test_a_redis_demoted_to_a_replica_is_one_steady_outage_until_it_is_a_master_again(
        make_redis, make_server, mode: str) -> None:
    """A replica (an old master after a failover demoted it) answers PING and refuses writes with
    READONLY: the probe took it for up, so write-behind went degraded and recovered once a second
    (an outage counted and two warnings each time) and write-through showed the tier up between
    refused puts."""
    master, redis = make_redis(), make_redis()
    srv = make_server("--capacity", MEM, "--redis", redis.url, "--redis-mode", mode, "--redis-timeout", "1")
    before, during = chain(2, "before-demotion"), chain(2, "while-a-replica")
    async with AsyncKVClient(srv.addr, namespace=NS, retries=0, timeout=20) as kv:
        assert (await kv.put(before, blocks(before, 1000))).stored == 2
        await until_stats(kv, "the queue to drain", tier_is(backlog_blocks=0))
        redis.cli("REPLICAOF", "127.0.0.1", str(master.port))
        try:
            await kv.put(during, blocks(during, 1000))  # write-behind: queued; write-through: refused
        except Unavailable:
            assert mode == "write-through"
        await until_stats(kv, "the tier to be degraded", tier_is(state="degraded"))
        failures = (await kv.stats())["tier"]["failures"]
        await until_stats(kv, "three more failed probes", lambda st: st["tier"]["failures"] >= failures + 3)
        tier = (await kv.stats())["tier"]
        assert tier["state"] == "degraded" and tier["outages"] == 1, tier
        assert "a replica of 127.0.0.1:" in tier["last_error"]
        assert not any("redis tier recovered" in line for line in list(srv.log))
        redis.cli("REPLICAOF", "NO", "ONE")
        await until_stats(kv, "the tier to recover", tier_is(state="ok", backlog_blocks=0))
        again = (await kv.put(during, blocks(during, 1000))).statuses  # (write-behind: queued, now written)
        assert again == ["existed" if mode == "write-behind" else "stored"] * 2
    assert in_redis(redis, NS, during) == [True, True]


@pytest.mark.parametrize("refusal", ["acl", "renamed"])
async def test_a_redis_that_refuses_role_is_probed_with_ping(make_redis, make_server, refusal: str) -> None:
    """(the probe asks ROLE, to tell a replica; an ACL may refuse it, or rename-command take it away:
    PING alone then -- a renamed ROLE's "unknown command" left the tier degraded for good)"""
    redis = make_redis(args=["--rename-command", "ROLE", ""] if refusal == "renamed" else [])
    url = redis.url
    if refusal == "acl":
        redis.cli("ACL", "SETUSER", "norole", "on", ">pw-norole", "~*", "+@all", "-role")
        url = f"redis://norole:pw-norole@127.0.0.1:{redis.port}/0"
    srv = make_server("--capacity", MEM, "--redis", url)
    [key] = chain(1, "norole")
    async with AsyncKVClient(srv.addr, namespace=NS, retries=0) as kv:
        assert (await kv.stats())["tier"]["state"] == "ok"
        assert (await kv.put([key], [b"x" * 100])).stored == 1
    assert in_redis(redis, NS, [key]) == [True]


def test_a_redis_that_resets_each_connection_is_an_outage_not_a_crash() -> None:
    """Under uvloop, redis-py writing on a connection reset right after its accept raises a bare
    RuntimeError ("unable to perform operation on <TCPTransport closed=True>"): it used to escape the
    tier's start (the server failed to start) and its health probe (ending the server's
    housekeeping: no more recovery, lease expiry or pin expiry)."""
    import socket
    import struct
    import threading

    import uvloop
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    port = listener.getsockname()[1]

    def reset_each() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:  # closed: the test is over
                return
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            conn.close()  # an RST, right after the accept

    thread = threading.Thread(target=reset_each, daemon=True)
    thread.start()

    async def starts() -> list[str]:
        states = []
        for _ in range(40):
            client = Redis(host="127.0.0.1", port=port, socket_timeout=1, socket_connect_timeout=1,
                           retry=Retry(NoBackoff(), 0))  # (each attempt is what is being tested)
            tier = RedisTier(client, target="resetting")
            await tier.start()  # raised RuntimeError in some of the 40
            await tier.check_health()
            states.append(tier.stats()["state"])
            await tier.close()
        return states

    try:
        assert set(uvloop.run(starts())) == {"degraded"}
    finally:
        listener.close()
        thread.join(5)


# ---------------------------------------------------------------- a Redis that hangs


async def test_read_pins_expire_while_a_health_probe_waits_on_a_redis_that_hangs(make_redis, make_server,
                                                                                unix_path: str) -> None:
    """The once-a-second housekeeping awaited the tier's probe: against a frozen Redis it waited
    --redis-timeout each time, and shared-memory read pins outlived --lease-seconds by as much."""
    import signal

    from kvstore.protocol import ShmGet

    redis = make_redis()
    make_server("--capacity", MEM, "--unix", unix_path, "--redis", redis.url, "--redis-timeout", "60",
                "--lease-seconds", "1")
    keys = chain(1, "hung-redis")
    async with AsyncKVClient("unix:" + unix_path, namespace=NS, retries=0, timeout=30) as kv:
        assert (await kv.put(keys, blocks(keys, 100_000))).stored == 1
        assert redis.proc is not None
        redis.proc.send_signal(signal.SIGSTOP)
        try:
            await asyncio.sleep(1.5)  # a probe is waiting on it now
            conn = await kv.nodes[0].connection()
            assert (await conn.request(ShmGet(keys=keys))).fields["handle"]  # pinned (in memory: no Redis call)

            async def expired() -> bool:
                return (await kv.stats())["shm"]["expired"] == 1

            await eventually(expired, 10, "the read pins to expire")
        finally:
            redis.proc.send_signal(signal.SIGCONT)


async def test_a_stop_asked_while_the_start_waits_on_redis_leaves_nothing_of_the_tier_behind(make_redis) -> None:  # type: ignore[no-untyped-def]
    """(In process: the CLI's exit ends everything anyway; an embedding program runs on.) The
    stop cancels the start; what the start had opened, the tier's tasks and its connections to
    Redis, is closed with it, not left to an embedding program's loop."""
    import signal

    from kvstore.config import ServerConfig
    from kvstore.server.app import Server

    redis = make_redis()
    assert redis.proc is not None
    redis.proc.send_signal(signal.SIGSTOP)
    try:
        before = set(asyncio.all_tasks())
        server = Server(ServerConfig(host="127.0.0.1", port=0, capacity=1 << 20, prefault=False, redis=redis.url,
                                     redis_mode="write-behind", redis_timeout=5))
        serving = asyncio.ensure_future(server.serve_forever(install_signals=False))
        await asyncio.sleep(0.5)  # (the start waits on the frozen Redis)
        assert not serving.done()
        server.request_stop()
        await asyncio.wait_for(serving, 10)
        await asyncio.sleep(0.1)
        assert [t.get_name() for t in set(asyncio.all_tasks()) - before if t is not asyncio.current_task()] == []
    finally:
        redis.proc.send_signal(signal.SIGCONT)

    async def only_the_cli_connected() -> bool:
        return int(redis.cli("INFO", "clients").split("connected_clients:")[1].split()[0]) == 1

    await eventually(only_the_cli_connected, 10, "the server's connections to Redis to close")


def test_a_stop_asked_while_the_start_waits_on_a_redis_that_hangs_never_listens(make_redis) -> None:  # type: ignore[no-untyped-def]
    """The start waited out the probe of a frozen Redis (about twice --redis-timeout), then listened
    -- a supervisor saw the server come up -- and only then stopped."""
    import signal
    import subprocess
    import sys

    redis = make_redis()
    assert redis.proc is not None
    redis.proc.send_signal(signal.SIGSTOP)
    cmd = [str(Path(sys.executable).with_name("kvstore-server")), "--port", "0", "--capacity", "4MiB",
           "--redis", redis.url, "--redis-timeout", "5"]
    server = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    try:
        assert server.stderr is not None
        for line in server.stderr:  # (the arena is ready; the tier's first probe is waiting)
            if "pre-faulting" in line:
                break
        time.sleep(0.5)
        server.send_signal(signal.SIGTERM)
        _, err = server.communicate(timeout=30)
    finally:
        server.kill()
        redis.proc.send_signal(signal.SIGCONT)
    assert server.returncode == 0
    assert "stopped before it started serving" in err and "listening" not in err
    assert "draining" not in err  # (nothing to drain: a mutant went on to the drain of a server that never served)
