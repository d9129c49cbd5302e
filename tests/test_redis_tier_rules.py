"""Rules of the Redis tier that a mutation review found no test holding (each rule's mutant passed
every tier test):

* a write-behind block of exactly the size Redis takes (``proto-max-bulk-len`` less the value
  header) is written and counted written (no failure, no false "never written" at the stop);
* a block put again while Redis is down is not queued again (its check cannot tell, so it waits
  for the next put), nor rewritten once Redis is back;
* the check of blocks put again under ``--redis-ttl`` reads each key's answer, not the ``EXPIRE``
  beside it: blocks Redis holds are not written again;
* a DELETE or FLUSH counts a block that was both queued and in Redis once;
* a put waiting for room in a full write-behind queue fails as soon as an outage is noticed,
  whoever notices it (not only the flusher);
* a read-through whose Redis part fails still serves the blocks found in the write-behind queue;
* lookup and exists count a block as large as the reply limit (``--max-frame-size``), which a GET
  returns, and not one byte more.

Real redis-server and kvstore-server processes on loopback; states are reached by polling the
server's stats or Redis (``CLIENT PAUSE``, ``CONFIG SET``, a stopped Redis), never by sleeping.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from kvstore.client import AsyncKVClient
from kvstore.errors import TooLarge, Unavailable
from kvstore.server.redis_layout import HEADER_SIZE, block_key

from redis_fixtures import (  # noqa: F401  (fixtures)
    RedisProcess, blocks, chain, eventually, make_redis, payloads, redis_server,
)
from test_tier_races import SLOW, paused_writes, until_blocked, until_stats

NS = "rules/bf16/tp0"
MEM = "16MiB"


def in_redis(redis: RedisProcess, keys: list[bytes]) -> list[bool]:
    return [redis.cli("EXISTS", block_key(NS, k)) == "1" for k in keys]


def tier_is(**want: object):  # type: ignore[no-untyped-def]
    return lambda st: all(st["tier"][k] == v for k, v in want.items())


# ---------------------------------------------------------------- the size Redis takes, exactly


async def test_a_write_behind_block_of_exactly_the_size_redis_takes_is_written_and_counted_so(make_redis,
                                                                                          make_server) -> None:
    """A block of exactly Redis's limit (proto-max-bulk-len less the 16-byte header) passes the PUT's
    size check, so it is acknowledged; the flusher must write it and count it written. Taken for
    "too big" there, it was written all the same but also counted a failure, logged as kept "in
    memory only", subtracted twice from the queue's bytes (backlog_bytes below 0, the queue's
    bound loosened), and the stop reported an acknowledged block never written and exited 1."""
    # (mutation: the flusher's too_big filter `len(value) - HEADER_SIZE > max_block` made `>=`)
    redis = make_redis(args=["--proto-max-bulk-len", "1mb"])
    limit = (1 << 20) - HEADER_SIZE
    srv = make_server("--capacity", MEM, "--redis", redis.url, "--redis-mode", "write-behind")
    [key], [over] = chain(1, "exact"), chain(1, "over")
    data = random.Random(7).randbytes(limit)
    async with AsyncKVClient(srv.addr, namespace=NS, retries=0, timeout=20) as kv:
        with pytest.raises(TooLarge, match="backing tier"):  # one byte more is refused at PUT
            await kv.put([over], [random.Random(8).randbytes(limit + 1)])
        assert (await kv.put([key], [data])).stored == 1
        await until_stats(kv, "the queue to drain", tier_is(backlog_blocks=0))
        assert in_redis(redis, [key, over]) == [True, False]
        tier = (await kv.stats())["tier"]
    assert (tier["stored_blocks"], tier["failures"], tier["backlog_bytes"]) == (1, 0, 0), \
        f"the block of exactly the limit was counted as dropped: {tier}"
    assert not any("stay in memory only" in line for line in srv.log)
    assert srv.stop() == 0, "the stop reported an acknowledged block unwritten: " + "".join(
        line for line in srv.log if "never written" in line)
    assert int(redis.cli("STRLEN", block_key(NS, key))) == 1 << 20
    reader = make_server("--capacity", MEM, "--redis", redis.url)  # empty memory: reads it back from Redis
    async with AsyncKVClient(reader.addr, namespace=NS, retries=0, timeout=20) as kv:
        assert payloads(await kv.get([key])) == [data]


# ---------------------------------------------------------------- a block put again during an outage


async def test_a_block_put_again_while_redis_is_down_is_not_queued_again(make_redis, make_server) -> None:
    """A block already written, put again while Redis is down, is answered "existed" and its check
    in Redis cannot tell: it must be left alone (the next put asks again). Taken for missing, every
    such re-put filled the write-behind backlog during the outage and rewrote blocks Redis already
    holds once it came back."""
    # (mutation: exists(strict=True) no longer raises Unavailable while Redis is down)
    redis = make_redis(appendonly=True)  # comes back with its data
    srv = make_server("--capacity", MEM, "--redis", redis.url, "--redis-mode", "write-behind")
    keys = chain(2, "outage-reput")
    data = blocks(keys, 50_000)
    async with AsyncKVClient(srv.addr, namespace=NS, retries=0, timeout=20) as kv:
        assert (await kv.put(keys, data)).stored == 2
        await until_stats(kv, "the blocks to be written", tier_is(backlog_blocks=0, stored_blocks=2))
        redis.stop()
        await until_stats(kv, "the tier to be degraded", tier_is(state="degraded"))
        assert (await kv.put(keys, data)).existed == 2
        assert (await kv.put(keys, data)).existed == 2
        assert (await kv.stats())["tier"]["backlog_blocks"] == 0, "blocks put again during the outage were queued"
        redis.start()  # (same port; the AOF brings the blocks back)
        await until_stats(kv, "the tier to recover and drain", tier_is(state="ok", backlog_blocks=0))
        tier = (await kv.stats())["tier"]
        assert tier["stored_blocks"] == 2, f"blocks Redis held were written again: {tier['stored_blocks']} writes"
        assert payloads(await kv.get(keys)) == data
    assert in_redis(redis, keys) == [True, True]


# ---------------------------------------------------------------- the check of blocks put again, with a TTL


@pytest.mark.parametrize("mode", ["write-through", "write-behind"])
async def test_blocks_put_again_under_a_ttl_are_renewed_not_rewritten(make_redis, make_server, mode: str) -> None:
    """Under --redis-ttl a put of blocks already stored checks them in Redis with an EXPIRE beside
    each read (their expiry renewed). Read out of step, the answers took the second block's
    EXPIRE reply for its header: blocks Redis holds counted as missing and were written again on
    every put of them (write-through: before the answer)."""
    # (mutation: `step` in RedisTier.exists leaves out the EXPIRE command)
    redis = make_redis()
    srv = make_server("--capacity", MEM, "--redis", redis.url, "--redis-mode", mode, "--redis-ttl", "300")
    keys = chain(3, f"ttl-{mode}")
    data = blocks(keys, 4096)

    def ttls() -> list[int]:
        return [int(redis.cli("TTL", block_key(NS, k))) for k in keys]

    async def renewed() -> bool:
        return all(250 < t <= 300 for t in ttls())

    async with AsyncKVClient(srv.addr, namespace=NS, retries=0, timeout=20) as kv:
        assert (await kv.put(keys, data)).stored == 3
        await until_stats(kv, "the blocks to be written", tier_is(backlog_blocks=0, stored_blocks=3))
        for k in keys:  # as if most of the 300 s had gone by
            redis.cli("EXPIRE", block_key(NS, k), "5")
        assert (await kv.put(keys, data)).existed == 3
        await eventually(renewed, 10, "the expiry of every block renewed")  # (the check has read its answers)
        await until_stats(kv, "the queue to drain", tier_is(backlog_blocks=0))
        tier = (await kv.stats())["tier"]
    assert tier["stored_blocks"] == 3, f"blocks Redis holds were written again: {tier['stored_blocks']} writes"
    assert not any("to the tier again" in line for line in srv.log)


# ---------------------------------------------------------------- delete counts


@pytest.mark.parametrize("op", ["delete", "flush"])
async def test_a_block_both_queued_and_in_redis_counts_once_when_deleted(make_redis, make_server, op: str) -> None:
    """A block in Redis that is queued again (put through a server whose memory lacked it: another
    server of the fleet wrote it, or this one evicted it) is dropped from the queue and deleted
    from Redis by one DELETE: that is one block, not two (and a FLUSH counts it once too)."""
    # (mutation: _not_counted no longer leaves out the names already counted as dropped from the queue)
    redis = make_redis()
    [other], [key] = chain(1, "in-flight"), chain(1, "both")
    writer = make_server("--capacity", MEM, "--redis", redis.url)  # write-through: in Redis once acknowledged
    async with AsyncKVClient(writer.addr, namespace=NS, retries=0) as kv:
        assert (await kv.put([key], [b"k" * 4096])).stored == 1
    srv = make_server("--capacity", MEM, "--redis", redis.url, "--redis-mode", "write-behind", *SLOW)
    async with AsyncKVClient(srv.addr, namespace=NS, retries=0, timeout=60) as kv:
        with paused_writes(redis):
            assert (await kv.put([other], [b"o" * 4096])).stored == 1
            await until_blocked(redis)  # the flusher's write of OTHER waits: KEY stays queued behind it
            assert (await kv.put([key], [b"k" * 4096])).stored == 1  # (not in this server's memory)
            assert (await kv.stats())["tier"]["backlog_blocks"] == 2
            if op == "delete":
                removing = asyncio.ensure_future(kv.delete([key]))
                await until_blocked(redis, 2)  # KEY dropped from the queue; its DEL waits
            else:
                removing = asyncio.ensure_future(kv.flush())
                await until_stats(kv, "the flush to begin", lambda st: st["store"]["blocks"] == 0)
        n = await removing
        assert n == (1 if op == "delete" else 2), f"{op} answered n={n}"
        await until_stats(kv, "the queue to drain", tier_is(backlog_blocks=0))
    assert in_redis(redis, [key, other]) == [False, op == "delete"]


# ---------------------------------------------------------------- a full queue when an outage is noticed


async def test_a_put_waiting_for_room_fails_when_a_request_notices_the_outage(make_redis, make_server) -> None:
    """A write-behind put waiting for room in a full queue must fail (Unavailable) once the tier
    knows Redis is down, whatever noticed it. Here the flusher sleeps between retries of blocks
    Redis refuses (out of memory) and a client's request finds Redis gone: the waiting put hung
    for the whole outage (or until its client gave up)."""
    # (mutation: _mark_down no longer wakes the queue's waiting puts)
    redis = make_redis()
    srv = make_server("--capacity", MEM, "--redis", redis.url, "--redis-mode", "write-behind",
                      "--redis-queue-bytes", "100000")
    first, waiting, missing = chain(3, "room-outage")
    data = blocks([first, waiting], 60_000)
    redis.cli("CONFIG", "SET", "maxmemory", "1")  # Redis refuses every write (OOM); the flusher retries every 2 s
    async with AsyncKVClient(srv.addr, namespace=NS, retries=0, timeout=60) as a, \
            AsyncKVClient(srv.addr, namespace=NS, retries=0, timeout=60) as b:
        assert (await a.put([first], data[:1])).stored == 1
        await until_stats(b, "Redis to refuse the first block", lambda st: st["tier"]["failures"] >= 1)
        put = asyncio.ensure_future(a.put([waiting], data[1:]))  # the queue is full: it waits for room
        await until_stats(b, "the waiting put's block to be in memory", lambda st: st["store"]["blocks"] == 2)
        refused = (await b.stats())["tier"]["failures"]
        # Right after the flusher's next refusal (it then sleeps 2 s): Redis goes away, and a read
        # finds it gone before the flusher looks again.
        await until_stats(b, "the flusher's next try", lambda st: st["tier"]["failures"] > refused)
        redis.stop()
        assert await b.exists([missing]) == [False]  # reads through: the outage is noticed here
        assert (await b.stats())["tier"]["state"] == "degraded"
        try:
            await asyncio.wait_for(asyncio.shield(put), 10)
        except Unavailable as exc:
            assert "redis tier" in str(exc)
        except asyncio.TimeoutError:
            raise AssertionError("a put waiting for room still waits 10 s into a noticed outage") from None
        else:
            raise AssertionError("a put waiting for room in a full queue was stored during an outage")
        assert await b.exists([waiting]) == [False]  # refused, not kept
        redis.start()  # (same port, no memory limit now)
        await until_stats(b, "the queue to drain", tier_is(state="ok", backlog_blocks=0))
    assert in_redis(redis, [first, waiting]) == [True, False]


# ---------------------------------------------------------------- a read-through whose Redis part fails


async def test_a_read_through_whose_redis_part_fails_still_serves_the_queued_blocks(make_redis, make_server) -> None:
    """A GET of a block only in the write-behind queue (evicted from memory, not written yet) beside
    one to read from Redis: if the Redis read fails (here it hangs past --redis-timeout), the
    queued block is still served. Raised instead, the failure turned the whole read into misses,
    the queued block included, though the server holds it."""
    # (mutation: _read_into raises an Unavailable part instead of skipping it)
    redis = make_redis()
    srv = make_server("--capacity", "256KiB", "--page-size", "64KiB", "--redis", redis.url,
                      "--redis-mode", "write-behind", "--redis-timeout", "1")  # memory: 4 blocks
    stored, queued, *fillers = chain(6, "part-fails")
    data = dict(zip([stored, queued, *fillers], blocks([stored, queued, *fillers], 60_000)))
    async with AsyncKVClient(srv.addr, namespace=NS, retries=0, timeout=60) as kv:
        assert (await kv.put([stored], [data[stored]])).stored == 1
        await until_stats(kv, "STORED to be written", tier_is(backlog_blocks=0, stored_blocks=1))
        redis.cli("CONFIG", "SET", "maxmemory", "1")  # Redis refuses writes: the rest stays queued
        for k in [queued, *fillers]:
            assert (await kv.put([k], [data[k]])).stored == 1  # the last ones evict STORED and QUEUED from memory
        st = await kv.stats()
        assert st["store"]["blocks"] == 4 and st["tier"]["backlog_blocks"] == 5, st
        # Every command waits (the pause ends on its own: redis-cli's UNPAUSE would wait too) while
        # the read of STORED times out, tried twice (redis-py's retry) at 1 s each.
        redis.cli("CLIENT", "PAUSE", "4000")
        got = payloads(await kv.get([queued, stored]))
        served = got[0] == data[queued]
        assert served, "the queued block was not served beside a failed Redis read"
        assert got[1] in (None, data[stored])  # (a miss; or read, on a machine slow enough to outlast the pause)
        redis.cli("CONFIG", "SET", "maxmemory", "0")
        await until_stats(kv, "the queue to drain", tier_is(state="ok", backlog_blocks=0))
        assert payloads(await kv.get([queued, stored])) == [data[queued], data[stored]]


# ---------------------------------------------------------------- lookups against the reply limit


async def test_lookup_counts_a_block_as_large_as_the_reply_limit(make_redis, make_server) -> None:
    """A block of exactly --max-frame-size bytes fits a GET reply, so a lookup and exists through
    that server count it when it is in Redis only (and not a block one byte larger, which a GET
    could not return). Counted absent, a prefix ended early at it and was recomputed."""
    # (mutation: exists(max_size=...) compares the Redis value's length, header included, to the limit)
    redis = make_redis()
    limit = 1 << 20
    fits, over = chain(2, "reply-limit")
    data = [random.Random(1).randbytes(limit), random.Random(2).randbytes(limit + 1)]
    writer = make_server("--capacity", MEM, "--redis", redis.url)  # default frame size; write-through
    async with AsyncKVClient(writer.addr, namespace=NS, retries=0, timeout=20) as kv:
        assert (await kv.put([fits, over], data)).stored == 2
    reader = make_server("--capacity", MEM, "--redis", redis.url, "--max-frame-size", str(limit))  # empty memory
    async with AsyncKVClient(reader.addr, namespace=NS, retries=0, timeout=20) as kv:
        assert await kv.lookup([fits, over]) == 1, "a block of exactly the reply limit did not count in the lookup"
        assert await kv.exists([fits, over]) == [True, False]
        assert payloads(await kv.get([fits])) == data[:1]  # (what the lookup promised: a GET returns it)
