"""The write-behind queue on its own (server/write_queue.py): byte accounting, what a failed write
puts back, and the keys a delete holds. The Redis tier's tests drive it through a real server and
Redis; these pin down the rules those runs seldom reach in isolation (each was a mutation of the
queue that every tier test survived)."""

from __future__ import annotations

import asyncio

from kvstore.server.write_queue import QueuedBlock, WriteQueue

NEVER = lambda: False  # noqa: E731  (Redis is up: a put waits for room instead of being refused)


def block(key: bytes, value: bytes, seq: int) -> QueuedBlock:
    return QueuedBlock("ns", key, value, checksum=seq, seq=seq)


async def test_a_key_queued_again_replaces_its_copy_and_counts_its_bytes_once() -> None:
    """(A block evicted from memory and put again while its first copy still waits.) Counted twice,
    the backlog never drained to 0, and once the leak reached --redis-queue-bytes every
    write-behind put waited for good with Redis up."""
    q = WriteQueue(1 << 20)
    first, second = block(b"k", b"A" * 100, 1), block(b"k", b"B" * 100, 2)
    assert await q.put([first], NEVER)
    assert await q.put([second], NEVER)
    assert (len(q), q.nbytes, q.get("ns", b"k")) == (1, 100, second)
    await q.finish(await q.take(), written=True)
    assert (len(q), q.nbytes) == (0, 0)


async def test_a_block_larger_than_the_whole_queue_passes_alone() -> None:
    """--redis-queue-bytes below one block (the CLI allows it): such a block is queued when the
    queue is empty, or every write-behind put would wait for good."""
    q = WriteQueue(10)
    assert await asyncio.wait_for(q.put([block(b"big", b"x" * 100, 1)], NEVER), 5)
    assert q.nbytes == 100
    late = asyncio.create_task(q.put([block(b"next", b"y" * 5, 2)], NEVER))
    await asyncio.sleep(0.01)
    assert not late.done()  # (no room beside it: waits for the big one's write)
    await q.finish(await q.take(), written=True)
    assert await asyncio.wait_for(late, 5) and q.nbytes == 5


async def test_a_failed_write_goes_back_to_the_head_in_order() -> None:
    q = WriteQueue(1 << 20)
    assert await q.put([block(k, b"v" * 10, i) for i, k in enumerate((b"a", b"b", b"c"), 1)], NEVER)
    batch = await q.take()
    assert [it.key for it in batch] == [b"a", b"b", b"c"]
    assert await q.put([block(b"d", b"v" * 10, 4)], NEVER)
    await q.finish(batch, written=False)
    assert list(k for _, k in q.waiting) == [b"a", b"b", b"c", b"d"] and q.nbytes == 40


async def test_a_failed_write_does_not_replace_a_newer_copy_put_while_it_flew() -> None:
    """The newer copy was acknowledged after the one in flight: it is the one Redis must get, and
    the old one's bytes leave the count (kept, the backlog never drained to 0)."""
    q = WriteQueue(1 << 20)
    assert await q.put([block(b"k", b"A" * 100, 1)], NEVER)
    batch = await q.take()
    newer = block(b"k", b"B" * 100, 2)
    assert await q.put([newer], NEVER)
    await q.finish(batch, written=False)
    assert (q.get("ns", b"k"), len(q), q.nbytes) == (newer, 1, 100)
    await q.finish(await q.take(), written=True)
    assert (len(q), q.nbytes) == (0, 0)


async def test_a_block_deleted_while_in_flight_is_not_put_back_when_its_write_fails() -> None:
    """Put back, it would be written after the delete's DEL, and the deleted block would come back
    in Redis (and be read again)."""
    q = WriteQueue(1 << 20)
    assert await q.put([block(b"k", b"A" * 100, 1)], NEVER)
    batch = await q.take()
    dropped, in_flight = await q.discard(lambda it: it.key == b"k")
    assert (dropped, in_flight, q.get("ns", b"k")) == (set(), True, None)
    await q.finish(batch, written=False)
    assert (len(q), q.nbytes, dict(q.waiting)) == (0, 0, {})


async def test_take_passes_over_held_keys_and_takes_the_others() -> None:
    """A delete holds its keys until its DEL is answered, so that a copy put after the delete began
    reaches Redis after the DEL; the other keys keep flowing (a held key taken beside them was
    written before the DEL, which then removed an acknowledged block from Redis)."""
    q = WriteQueue(1 << 20)
    q.held = {("ns", b"held")}
    assert await q.put([block(b"held", b"x" * 10, 1), block(b"free", b"y" * 10, 2)], NEVER)
    assert [it.key for it in await asyncio.wait_for(q.take(), 5)] == [b"free"]
    q.held = ()
    await q.wake()
    assert [it.key for it in await asyncio.wait_for(q.take(), 5)] == [b"held"]


async def test_a_put_waiting_for_room_is_refused_whole_once_redis_is_down() -> None:
    """Refused, none of its items stays queued, and a copy of an earlier put that one of them had
    replaced is put back (that put was acknowledged)."""
    q = WriteQueue(100)
    earlier = block(b"a", b"1" * 40, 1)
    assert await q.put([earlier], NEVER)
    down = False
    # "a" again fits (in place of the earlier copy); "b" does not fit beside it and waits
    put = asyncio.create_task(q.put([block(b"a", b"2" * 40, 2), block(b"b", b"3" * 70, 3)], lambda: down))
    await asyncio.sleep(0.01)
    assert not put.done() and q.get("ns", b"a") is not earlier
    down = True
    await q.wake()
    assert await asyncio.wait_for(put, 5) is False
    assert (q.get("ns", b"a"), q.get("ns", b"b"), len(q), q.nbytes) == (earlier, None, 1, 40)
