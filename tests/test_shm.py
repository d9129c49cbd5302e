"""The shared-memory path against real server processes: round trips, pins under eviction churn,
a client SIGKILLed mid-put, who may map the arena, and the fallbacks to the socket."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import random
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections import deque
from pathlib import Path
from typing import Any, AsyncIterator

import pytest
import xxhash

from kvstore.client import AsyncKVClient, KVClient
from kvstore.errors import CapacityError, InvalidRequest, NotFound, RequestTimeout, TooLarge, TransportError, Unauthorized
from kvstore.config import ServerConfig
from kvstore.messages import DEFAULT_LIMITS
from kvstore.protocol import (
    STORED, Frame, FrameReader, Hello, Message, ShmAttach, ShmCommit, ShmGet, ShmPut, encode, reply,
)
from kvstore.server.app import Server
from kvstore.server.service import Session
from kvstore.client.shm import ShmChannel

from redis_fixtures import RedisProcess, eventually, redis_server  # noqa: F401  (redis_server is a fixture)
from shm_helpers import (  # noqa: F401  (unix_path is a fixture)
    MakeServer, arena_mappings, assert_attach_maps, behind_a_cancelled_put, data, error_code, key, raw_exchange, reply_fields,
    shm_locate, shm_release,
    unix_path,
)

TOKEN = "global-token-5e1f"
NS_TOKEN = "llama-only-0b7d"


def unix(path: str) -> str:
    return f"unix:{path}"


# ---------------------------------------------------------------- round trips


@pytest.mark.parametrize("size", [1 << 20, 4 << 20], ids=["1MiB", "4MiB"])
async def test_shm_round_trip_every_byte_and_no_payload_on_the_socket(make_server: MakeServer, unix_path: str, size: int) -> None:
    make_server("--capacity", "256MiB", "--unix", unix_path)
    keys = [key(i, f"rt{size}") for i in range(32)]
    blocks = [data(k, size) for k in keys]
    # One connection: a verified get posts its release without waiting, and the
    # stats request after it must reach the server behind it to see it done.
    async with AsyncKVClient(unix(unix_path), namespace="rt", pool_size=1) as kv:
        assert kv.nodes[0].shm is not None
        before = (await kv.stats())["bytes_in"]
        res = await kv.put(keys, blocks)
        assert (res.stored, res.existed) == (32, 0)
        bufs = [bytearray(size) for _ in keys]
        assert await kv.get_into(keys, bufs) == [True] * 32
        assert bufs == blocks  # every byte
        assert [bytes(b) for b in await kv.get(keys[:3])] == blocks[:3]
        assert (await kv.put(keys, blocks)).existed == 32  # dedup: nothing copied again
        stats = await kv.stats()
    assert stats["bytes_in"] - before < size  # 128 MiB moved, only control frames on the socket
    assert stats["shm"]["puts"] == 2 and stats["shm"]["gets"] == 2 and stats["shm"]["open_handles"] == 0
    assert stats["store"]["pinned_blocks"] == 0  # every read pin released


async def test_a_small_put_goes_over_the_socket_a_large_one_through_the_arena(
        make_server: MakeServer, unix_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """By default a put under ShmChannel.inline_put_bytes (2 MiB) is sent inline: one round trip
    beats the arena's two there. Bytes intact either way, and gets still take the arena."""
    from kvstore.client.shm import ShmChannel

    monkeypatch.undo()  # (conftest sends every put through the arena)
    assert ShmChannel.inline_put_bytes == 2 << 20
    make_server("--capacity", "64MiB", "--unix", unix_path)
    small = [key(i, "small") for i in range(3)]
    large = [key(i, "large") for i in range(2)]
    blocks = {k: data(k, 300_000) for k in small} | {k: data(k, 1 << 20) for k in large}
    async with AsyncKVClient(unix(unix_path), namespace="route", pool_size=1) as kv:
        assert kv.nodes[0].shm is not None
        before = await kv.stats()
        assert (await kv.put(small, [blocks[k] for k in small])).stored == 3  # 900 KB: inline
        middle = await kv.stats()
        assert (await kv.put(large, [blocks[k] for k in large])).stored == 2  # 2 MiB: the arena
        after = await kv.stats()
        bufs = [bytearray(len(blocks[k])) for k in small + large]
        assert await kv.get_into(small + large, bufs) == [True] * 5
        assert bufs == [blocks[k] for k in small + large]
        done = await kv.stats()
    assert middle["shm"]["puts"] == before["shm"]["puts"] and middle["bytes_in"] - before["bytes_in"] >= 900_000
    assert after["shm"]["puts"] == middle["shm"]["puts"] + 1 and after["bytes_in"] - middle["bytes_in"] < 100_000
    assert done["shm"]["gets"] == after["shm"]["gets"] + 1


async def test_a_large_get_through_the_arena_is_not_split_over_connections(make_server: MakeServer,
                                                                          unix_path: str) -> None:
    """Over a socket a get of at least twice ``split_bytes`` goes out in parts over the pool's
    connections; through the arena the copy is the client's own, so parts would only add round
    trips (a mutant split it: four SHM_GETs for one get)."""
    make_server("--capacity", "64MiB", "--unix", unix_path)
    keys = [key(i, "unsplit") for i in range(8)]
    blocks = [data(k, 1 << 20) for k in keys]
    async with AsyncKVClient(unix(unix_path), namespace="split", pool_size=4, split_bytes=1 << 20) as kv:
        assert kv.nodes[0].shm is not None
        await kv.put(keys, blocks)
        before = (await kv.stats())["shm"]["gets"]
        bufs = [bytearray(1 << 20) for _ in keys]
        assert await kv.get_into(keys, bufs) == [True] * 8 and bufs == blocks
        assert (await kv.stats())["shm"]["gets"] == before + 1


async def test_an_announced_socket_path_that_now_belongs_to_another_server_is_not_mapped(
        make_server: MakeServer, unix_path: str) -> None:
    """``shm=True`` over TCP attaches through the socket path the server announces; on another
    host, or after the path was taken over, that path can lead to another server. Its arena is not
    this server's: used, a get would copy another server's bytes and a put write into slots the
    other server has given to its own blocks. The client stays on the socket (the instance is
    checked at the attach, and again before each operation: either check alone holds it)."""
    first = make_server("--capacity", "32MiB", "--unix", unix_path)
    os.unlink(unix_path)  # (it listens on, unreachable by that path)
    other = make_server("--capacity", "32MiB", "--unix", unix_path)
    keys = [key(i, "elsewhere") for i in range(4)]
    blocks = [data(k, 1 << 20) for k in keys]
    mine = [key(i, "mine") for i in range(4)]
    async with AsyncKVClient(other.addr, namespace="n") as owner:
        await owner.put(mine, [data(k, 1 << 20) for k in mine])
    async with AsyncKVClient(first.addr, namespace="n", shm=True) as kv:
        assert (await kv.put(keys, blocks)).stored == 4  # (4 MiB: through the arena, were there one)
        bufs = [bytearray(1 << 20) for _ in keys]
        assert await kv.get_into(keys, bufs) == [True] * 4 and bufs == blocks
        assert kv.nodes[0].shm is None
        assert (await kv.stats())["shm"]["attached"] == 0
    async with AsyncKVClient(other.addr, namespace="n") as owner:
        assert await owner.exists(keys) == [False] * 4
        assert [bytes(b) for b in await owner.get(mine)] == [data(k, 1 << 20) for k in mine]  # type: ignore[arg-type]


async def test_odd_sizes_missing_keys_and_wrong_buffers(make_server: MakeServer, unix_path: str) -> None:
    make_server("--capacity", "16MiB", "--unix", unix_path, "--page-size", "4KiB")
    sizes = [0, 1, 4095, 4096, 4097, 300_001]  # empty, sub-page, page edges, many pages
    keys = [key(i, "odd") for i in range(len(sizes))]
    blocks = [data(k, n) for k, n in zip(keys, sizes)]
    async with AsyncKVClient(unix(unix_path), namespace="odd") as kv:
        await kv.put(keys, blocks)
        got = await kv.get(keys + [key(99, "absent")])
        assert [None if g is None else bytes(g) for g in got] == blocks + [None]
        bufs = [bytearray(n) for n in sizes]
        bufs[3] = bytearray(5)  # wrong size: refused, the others still arrive
        with pytest.raises(Exception, match="buffer") as info:
            await kv.get_into(keys, bufs)
        assert [bytes(b) for i, b in enumerate(bufs) if i != 3] == [b for i, b in enumerate(blocks) if i != 3]
        assert info.value.result[3] is None  # type: ignore[attr-defined]
        assert (await kv.stats())["store"]["pinned_blocks"] == 0


def test_a_reply_locating_the_most_runs_allowed_fits_the_meta_a_client_reads() -> None:
    """The bound's arithmetic, worst case: MAX_REPLY_RUNS runs at offsets past 4 GiB, of lengths
    past 64 KiB, beside the sizes and checksums of the largest batch."""
    from kvstore.server.shm import MAX_REPLY_RUNS

    n = DEFAULT_LIMITS.max_batch
    locs = [[[(1 << 40) + j, 1 << 30] for j in range(MAX_REPLY_RUNS // n + (i < MAX_REPLY_RUNS % n))] for i in range(n)]
    head = reply(ShmGet.OP, 1, sizes=[2 << 30] * n, checksums=[(1 << 64) - 1] * n, locs=locs,
                 handle=(1 << 63) - 1)[0]
    assert sum(map(len, locs)) == MAX_REPLY_RUNS
    assert len(head) - 20 <= DEFAULT_LIMITS.max_meta


@pytest.mark.parametrize("transport", ["tcp", "shm"])
async def test_a_put_refused_for_every_key_of_a_full_batch_is_answered_with_every_error(
        make_server: MakeServer, unix_path: str, transport: str) -> None:
    """(review) 16,384 keys refused with the store's 341-byte CapacityError made a reply of 5.7 MiB
    of meta, over the 4 MiB a client reads: a ProtocolError instead of the outcome of each key.
    The server bounds the error texts of one reply; a key left without one takes the last one
    sent for its status."""
    srv = make_server("--capacity", "4MiB", "--page-size", "4KiB", "--unix", unix_path)
    async with AsyncKVClient(unix(unix_path) if transport == "shm" else srv.addr, namespace="e") as kv:
        assert (kv.nodes[0].shm is not None) == (transport == "shm")
        fill = [key(i, "fill") for i in range(1024)]
        assert (await kv.put(fill, [b"f" * 4096] * 1024)).stored == 1024  # full of one reachable chain
        keys = [key(i, "new") for i in range(16384)]
        with pytest.raises(CapacityError) as info:  # (their parent is not stored: they may not evict it)
            await kv.put(keys, [b"n" * 4096] * 16384, parent=key(0, "missing-parent"))
        errors = info.value.errors  # type: ignore[attr-defined]
        assert sorted(errors) == list(range(16384))
        assert len({str(e) for e in errors.values()}) == 1 and "no room for a block of 4.0 KiB" in str(errors[16383])
        assert await kv.exists(keys[:1] + fill[:1]) == [False, True]  # (the same connection: not lost)


@contextlib.asynccontextmanager
async def fragmented(unix_path: str, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[AsyncKVClient]:
    """A client of a server (in this process) whose MAX_REPLY_RUNS is lowered to 100 (the real bound
    needs GiBs of blocks) and whose arena of 4 KiB pages has 512 free one-page runs: a block put
    next lies in one run per page."""
    from kvstore.server import shm as server_shm
    from test_integrity import ThreadedServer

    monkeypatch.setattr(server_shm, "MAX_REPLY_RUNS", 100)
    config = ServerConfig(port=0, capacity=4 << 20, page_size=4096, prefault=False, unix=unix_path)
    with ThreadedServer(config):
        for _ in range(500):
            if os.path.exists(unix_path):
                break
            await asyncio.sleep(0.01)
        async with AsyncKVClient(unix(unix_path), namespace="frag", pool_size=1) as kv:
            ones = [key(i, "one-page") for i in range(1024)]
            assert (await kv.put(ones, [b"p" * 4096] * 1024)).stored == 1024  # (in parts, too: one run each)
            assert await kv.delete(ones[::2]) == 512
            yield kv


async def test_blocks_in_more_runs_than_a_reply_may_locate_are_put_and_read_in_parts(
        unix_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """(item left open) In a fragmented arena (small pages, every other one taken) a block lies in
    one run per page, and a big batch's SHM_GET or SHM_PUT reply could locate more runs than the
    4 MiB the client reads of a reply's meta: a ProtocolError, and the connection lost. Over
    MAX_REPLY_RUNS a batch is refused as TooLarge, reservations given back and no lease dropped;
    the client puts, or asks for, each half (a put's second half continuing the first's chain)."""
    async with fragmented(unix_path, monkeypatch) as kv:
        keys = [key(i, "scattered") for i in range(8)]
        blocks = [data(k, 16 * 4096) for k in keys]  # 16 runs each: 128 in all, 64 a half
        before = await kv.stats()
        assert (await kv.put(keys, blocks)).stored == 8
        after = await kv.stats()
        assert await kv.lookup(keys) == 8  # one chain
        assert [bytes(b) for b in await kv.get(keys)] == blocks
        assert await kv.lookup(keys, pin=True) == 8 and await kv.lookup(keys, pin=True) == 8
        bufs = [bytearray(len(b)) for b in blocks]
        assert await kv.get_into(keys, bufs, unpin=True) == [True] * 8 and bufs == blocks
        end = await kv.stats()
        assert await kv.unpin(keys) == 8  # (the second lease of each: the get dropped one)
    assert after["shm"]["puts"] - before["shm"]["puts"] == 3  # the refused one, then its halves
    assert after["bytes_in"] - before["bytes_in"] < 64 << 10  # (the blocks went through the arena)
    assert after["store"]["used_bytes"] == (512 + 128) * 4096  # (the refused reservation: given back)
    assert end["shm"]["gets"] - after["shm"]["gets"] == 6  # two gets: refused, then each half
    assert end["store"]["pinned_blocks"] == 8 and end["shm"]["open_handles"] == 0


async def test_one_block_in_more_runs_than_a_reply_may_locate_goes_over_the_socket(
        unix_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """(fix review) A single block was never refused: one of 2 GiB in 4 KiB pages may lie in
    524,288 runs, a 4.7 MiB meta. Refused too, it is put and read over the socket."""
    async with fragmented(unix_path, monkeypatch) as kv:
        k = key(0, "one-scattered")
        block = data(k, 120 * 4096)  # 120 runs
        before = await kv.stats()
        assert (await kv.put([k], [block])).stored == 1
        assert await kv.lookup([k], pin=True) == 1
        assert bytes((await kv.get([k], unpin=True))[0]) == block
        after = await kv.stats()
    assert after["bytes_in"] - before["bytes_in"] > len(block) and after["bytes_out"] - before["bytes_out"] > len(block)
    assert after["shm"]["puts"] - before["shm"]["puts"] == 1 and after["shm"]["gets"] - before["shm"]["gets"] == 1
    assert after["store"]["pinned_blocks"] == 0 and after["shm"]["open_handles"] == 0


async def test_a_halved_put_whose_second_half_is_refused_keeps_the_first_halfs_outcome(
        unix_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """(fix review) The halves ran as one call: the second refused at the bound of puts waiting
    for a commit (CapacityError: put over the socket) sent the whole batch again over the socket,
    and the first half, stored by this very put, came back "existed"; a second half that failed
    marked the first failed too."""
    from kvstore.server.shm import ShmService

    real_put, calls = ShmService.put, []

    def put(self: ShmService, session: Session, msg: ShmPut) -> Any:
        calls.append(len(msg.keys))
        if len(calls) == 3:  # the second half (as when other clients' uncommitted puts hold the bound)
            raise CapacityError("shared-memory puts waiting for their commit hold too many keys (put over the socket)")
        return real_put(self, session, msg)

    async with fragmented(unix_path, monkeypatch) as kv:
        monkeypatch.setattr(ShmService, "put", put)
        await kv.close()  # (a new connection takes the wrapper)
        async with AsyncKVClient(unix(unix_path), namespace="frag", pool_size=1) as kv2:
            keys = [key(i, "halves") for i in range(8)]
            blocks = [data(k, 16 * 4096) for k in keys]
            result = await kv2.put(keys, blocks)
            assert calls == [8, 4, 4] and result.statuses == ["stored"] * 8
            assert await kv2.lookup(keys) == 8 and [bytes(b) for b in await kv2.get(keys)] == blocks


@pytest.mark.parametrize("op", ["put", "get"])
async def test_a_halved_request_whose_server_stops_answering_is_not_asked_further(
        unix_path: str, monkeypatch: pytest.MonkeyPatch, op: str) -> None:
    """(second fix review) 32 blocks in 512 runs are asked in halves down to 4 keys. The server
    answers the first 4 and never the next: every level above then asked for its own second half
    all the same, each waiting out the client's timeout (8 and 16 keys more here; up to 14 levels
    of 30 s at the batch limit). The rest now fails with the timeout, unasked."""
    from kvstore.server.shm import ShmService

    real, calls, silent = getattr(ShmService, op), [], []

    def handler(self: ShmService, session: Session, msg: Any) -> Any:
        calls.append(len(msg.keys))
        if len(calls) == 5:  # the second 4-key half: no answer, ever
            silent.append(asyncio.get_running_loop().create_future())
            return silent[-1]
        return real(self, session, msg)

    async with fragmented(unix_path, monkeypatch) as kv:
        keys = [key(i, "silent") for i in range(32)]
        blocks = [data(k, 16 * 4096) for k in keys]  # 16 runs each: 512 in all
        if op == "get":
            assert (await kv.put(keys, blocks)).stored == 32
        monkeypatch.setattr(ShmService, op, handler)
        await kv.close()  # (a new connection takes the wrapper)
        async with AsyncKVClient(unix(unix_path), namespace="frag", pool_size=1, timeout=1.0) as kv2:
            with pytest.raises(RequestTimeout) as info:
                await (kv2.put(keys, blocks) if op == "put" else kv2.get(keys))
        loop = silent[0].get_loop()
        loop.call_soon_threadsafe(silent[0].cancel)
    assert calls == [32, 16, 8, 4, 4]
    assert sorted(info.value.errors) == list(range(4, 32))  # type: ignore[attr-defined]
    if op == "put":
        assert info.value.result.statuses[:4] == ["stored"] * 4  # type: ignore[attr-defined]
    else:
        assert [bytes(b) for b in info.value.result[:4]] == blocks[:4]  # type: ignore[attr-defined]


async def test_an_unpinning_read_handed_a_connection_to_an_older_server_is_sent_on_another(
        make_server: MakeServer, unix_path: str) -> None:
    """(coverage review) A pooled connection to the server instance before a restart (one a drain
    kept open beside the new server's) is not used for shared memory: it is dropped and the op
    goes to another connection. Nothing was sent on it, but an unpinning read (never sent twice)
    failed with a TransportError there -- and quarantined the new server, which had done nothing."""
    make_server("--capacity", "16MiB", "--unix", unix_path)
    keys = [key(i, "older") for i in range(4)]
    blocks = [data(k, 256 << 10) for k in keys]
    async with AsyncKVClient(unix(unix_path), namespace="o", pool_size=4, retries=0, quarantine=5.0) as kv:
        await kv.put(keys, blocks)
        assert await kv.lookup(keys, pin=True) == 4
        await asyncio.gather(*(kv.get(keys) for _ in range(8)))  # (the pool opens more connections)
        older = list(kv.nodes[0].conns)
        assert len(older) > 1
        for conn in older:  # (its fix review: each one dropped took one of the op's retries)
            conn.hello = {**conn.hello, "shm": {**conn.hello["shm"], "instance": "an older server's"}}
        buffers = [bytearray(256 << 10) for _ in keys]
        assert await kv.get_into(keys, buffers, unpin=True) == [True] * 4
        assert [bytes(b) for b in buffers] == blocks and any(conn.closed for conn in older)
        assert (await kv.stats())["store"]["leases"] == 0 and await kv.exists(keys) == [True] * 4


async def test_a_server_that_does_not_accept_is_not_taken_for_one_that_stopped() -> None:
    """(coverage review) The probe that decides whether the server of a mapped arena is still there
    (``Node._instance_now``) took a connect that timed out -- a server stalled, its accept queue
    full -- for "nothing listens": on Python 3.11 and later ``asyncio.TimeoutError`` is an OSError,
    and that handler came first. The client unmapped the arena of a live server and mapped it again."""
    from kvstore.client import node as client_node

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)  # never accepted: a connect or two fill its queue, later ones time out
        port = listener.getsockname()[1]
        waiting = []
        try:
            for _ in range(4):
                s = socket.socket()
                s.setblocking(False)
                s.connect_ex(("127.0.0.1", port))
                waiting.append(s)
            kv = AsyncKVClient(f"127.0.0.1:{port}", connect_timeout=0.5)  # (not connected: the probe is its own)
            assert await kv.nodes[0]._instance_now() is client_node._NO_ANSWER
            await kv.close()
        finally:
            for s in waiting:
                s.close()


@pytest.mark.parametrize("quarantine", [0.0, 5.0])
async def test_a_halved_get_whose_copy_outlasted_its_pins_still_asks_the_other_halves(
        unix_path: str, monkeypatch: pytest.MonkeyPatch, quarantine: float) -> None:
    """(third fix review) A copy whose read pins expired (--lease-seconds) fails with a
    RequestTimeout after the server answered; the halved get took it for a server that stopped
    answering and asked none of the other halves: 32 keys failed for 4. (Fourth:) a client with
    a quarantine also quarantined that server, and the other halves failed with it."""
    from kvstore.client.shm import CopyExpired
    from kvstore.server.shm import ShmService

    real_release, releases = ShmService.release, []

    def release(self: ShmService, session: Session, msg: Any) -> Any:
        releases.append(msg.handle)
        fields = real_release(self, session, msg)
        return {"held": False} if len(releases) == 1 else fields  # (the first copy: as if its pins expired)

    async with fragmented(unix_path, monkeypatch) as kv:
        keys = [key(i, "expired") for i in range(32)]
        blocks = [data(k, 16 * 4096) for k in keys]  # 512 runs: asked down to 4 keys at a time
        assert (await kv.put(keys, blocks)).stored == 32
        monkeypatch.setattr(ShmService, "release", release)
        await kv.close()  # (a new connection takes the wrapper)
        async with AsyncKVClient(unix(unix_path), namespace="frag", pool_size=1, verify=False,
                                 quarantine=quarantine) as kv2:
            with pytest.raises(CopyExpired) as info:  # (unverified: the release's answer decides)
                await kv2.get(keys)
            assert await kv2.exists(keys[:1]) == [True]  # (not quarantined)
    assert sorted(info.value.errors) == [0, 1, 2, 3]  # type: ignore[attr-defined]
    assert [bytes(b) for b in info.value.result[4:]] == blocks[4:]  # type: ignore[attr-defined]
    assert len(releases) == 8


@pytest.mark.parametrize("transport", ["tcp", "shm"])
async def test_each_failed_keys_error_text_comes_back_or_one_the_client_can_tell(
        make_server: MakeServer, unix_path: str, transport: str) -> None:
    """(second fix review) Past the reply's budget for error texts, a key took the last text of its
    status, or none: one refused as too large came back "block not stored", a 64 KiB block was
    said to be one of 4 KiB. Only a text equal to the last one sent for its status is left out now
    (a status's first text always goes); past the budget, texts that differ are left out too."""
    srv = make_server("--capacity", "4MiB", "--page-size", "4KiB", "--max-block", "8KiB", "--unix", unix_path)
    async with AsyncKVClient(unix(unix_path) if transport == "shm" else srv.addr, namespace="t") as kv:
        fill = [key(i, "fill") for i in range(1024)]
        assert (await kv.put(fill, [b"f" * 4096] * 1024)).stored == 1024  # full of one reachable chain
        keys = [key(i, "mixed") for i in range(1002)]
        blocks = [b"n" * 4096] * 1000 + [b"L" * 9000, b"s" * 8192]
        with pytest.raises(CapacityError) as info:  # (their parent is not stored: they may not evict it)
            await kv.put(keys, blocks, parent=key(0, "missing-parent"))
        texts = {i: str(e) for i, e in info.value.errors.items()}  # type: ignore[attr-defined]
        assert len(texts) == 1002 and len({texts[i] for i in range(1000)}) == 1
        assert "a block of 4.0 KiB" in texts[0] and "a block of 8.0 KiB" in texts[1001]
        assert type(info.value.errors[1000]) is TooLarge and "9000 bytes" in texts[1000]  # type: ignore[attr-defined]
        # Past the budget: 4,000 blocks over --max-block, each refused with a text naming its size.
        sizes = [8193 + i for i in range(4000)]
        keys = [key(i, "sizes") for i in range(4000)]
        with pytest.raises(TooLarge) as info:
            await kv.put(keys, [b"z" * n for n in sizes])
        texts = {i: str(e) for i, e in info.value.errors.items()}  # type: ignore[attr-defined]
        assert len(texts) == 4000 and all("bytes is over the 8192 bytes" in t for t in texts.values())
        exact = [i for i in range(4000) if f"a block of {sizes[i]} bytes" in texts[i]]
        assert exact == list(range(len(exact))) and 1000 < len(exact) < 4000  # (256 KiB of ~130-byte texts)


def test_sync_client_uses_shm_too(make_server: MakeServer, unix_path: str) -> None:
    make_server("--capacity", "16MiB", "--unix", unix_path)
    keys = [key(i, "sync") for i in range(4)]
    blocks = [data(k, 100_000) for k in keys]
    with KVClient(unix(unix_path), namespace="s") as kv:
        kv.put(keys, blocks)
        bufs = [bytearray(100_000) for _ in keys]
        assert kv.get_into(keys, bufs) == [True] * 4 and bufs == blocks
        shm = kv.stats()["shm"]
        assert (shm["gets"], shm["puts"]) == (1, 1)
        assert (shm["put_keys"], shm["pins"]) == (0, 0)  # (a commit gives its keys back to the bound)


async def test_concurrent_shm_and_tcp_clients_on_the_same_blocks(make_server: MakeServer, unix_path: str) -> None:
    srv = make_server("--capacity", "64MiB", "--unix", unix_path)
    keys = [key(i, "both") for i in range(48)]
    blocks = [data(k, random.Random(i).randrange(1, 300_000)) for i, k in enumerate(keys)]
    async with AsyncKVClient(unix(unix_path), namespace="b") as shm_kv, \
            AsyncKVClient(srv.addr, namespace="b") as tcp_kv:
        assert shm_kv.nodes[0].shm is not None and tcp_kv.nodes[0].shm is None
        await asyncio.gather(shm_kv.put(keys[0::2], blocks[0::2]), tcp_kv.put(keys[1::2], blocks[1::2]))

        async def read(kv: AsyncKVClient, rounds: int) -> None:
            for r in range(rounds):
                order = random.Random(r).sample(range(len(keys)), len(keys))
                got = await kv.get([keys[i] for i in order])
                assert [bytes(g) for g in got] == [blocks[i] for i in order]

        await asyncio.gather(read(shm_kv, 6), read(tcp_kv, 6), read(shm_kv, 6),
                             shm_kv.put(keys, blocks), tcp_kv.put(keys, blocks))
        stats = await tcp_kv.stats()
    assert stats["store"]["blocks"] == 48 and stats["store"]["stored"] == 48  # each stored once, whoever put it


# ---------------------------------------------------------------- pins under eviction churn


async def test_eviction_churn_never_tears_a_pinned_shm_read(make_server: MakeServer, unix_path: str) -> None:
    """Randomised: writers over shm and TCP keep a small store evicting while readers hold SHM_GET
    pins across a pause, then check every byte they copy. Without the pins the paused readers would
    copy slots that eviction handed to newer blocks."""
    seed = int.from_bytes(os.urandom(4), "big")
    rng = random.Random(seed)
    srv = make_server("--capacity", "12MiB", "--unix", unix_path)
    recent: deque[tuple[bytes, int]] = deque(maxlen=24)
    checked = {"pinned": 0, "plain": 0}
    stop = time.monotonic() + 3.0

    async def writer(kv: AsyncKVClient, tag: str) -> None:
        n = 0
        while time.monotonic() < stop:
            batch = [(key(n + j, f"{tag}{seed}"), rng.randrange(1, 512 << 10)) for j in range(4)]
            n += 4
            try:
                await kv.put([k for k, _ in batch], [data(k, s) for k, s in batch])
            except CapacityError:
                pass  # everything left pinned or reserved: fine, try again
            recent.extend(batch)
            await asyncio.sleep(0)

    async def pinned_reader(kv: AsyncKVClient) -> None:
        seg = kv.nodes[0].shm
        assert seg is not None
        while time.monotonic() < stop:
            picks = rng.sample(list(recent), min(3, len(recent)))
            conn, fields = await shm_locate(kv, [k for k, _ in picks])
            await asyncio.sleep(rng.uniform(0, 0.03))  # the writers evict meanwhile
            for (k, size), loc in zip(picks, fields["locs"]):
                if loc is not None:
                    assert b"".join(bytes(v) for v in seg.segment.views(loc)) == data(k, size), f"seed {seed}"
                    checked["pinned"] += 1
            if fields["handle"]:
                assert await shm_release(conn, fields["handle"])

    async def plain_reader(kv: AsyncKVClient) -> None:
        while time.monotonic() < stop:
            picks = rng.sample(list(recent), min(4, len(recent)))
            got = await kv.get([k for k, _ in picks])  # verify=True: a torn copy would raise
            for (k, size), g in zip(picks, got):
                if g is not None:
                    assert bytes(g) == data(k, size), f"seed {seed}"
                    checked["plain"] += 1

    async with AsyncKVClient(unix(unix_path), namespace="churn") as a, \
            AsyncKVClient(unix(unix_path), namespace="churn") as b, \
            AsyncKVClient(srv.addr, namespace="churn") as tcp:
        recent.append((key(-1, "first"), 1000))
        await tcp.put([key(-1, "first")], [data(key(-1, "first"), 1000)])
        await asyncio.gather(writer(a, "a"), writer(tcp, "t"), pinned_reader(b), pinned_reader(a), plain_reader(b))
        stats = await tcp.stats()
    assert stats["store"]["evictions"] > 20, stats["store"]
    assert checked["pinned"] > 20 and checked["plain"] > 20, (checked, seed)
    assert stats["store"]["pinned_blocks"] == 0 and stats["shm"]["open_handles"] == 0


async def test_read_pins_time_out_and_the_copy_is_refused(make_server: MakeServer, unix_path: str) -> None:
    make_server("--capacity", "8MiB", "--unix", unix_path, "--lease-seconds", "1")
    k = key(1, "lease")
    async with AsyncKVClient(unix(unix_path), namespace="l") as kv:
        await kv.put([k], [data(k, 5000)])
        conn, fields = await shm_locate(kv, [k])
        assert (await kv.stats())["store"]["pinned_blocks"] == 1

        async def unpinned() -> bool:  # past the lease, and past a housekeeping sweep (every second)
            return (await kv.stats())["store"]["pinned_blocks"] == 0

        await eventually(unpinned, 10, "the read pin to expire")
        assert await shm_release(conn, fields["handle"]) is False  # the client learns its copy is not safe
        assert (await kv.stats())["shm"]["expired"] == 1
        assert [bytes(b) for b in await kv.get([k])] == [data(k, 5000)]  # a normal read is unaffected


async def nothing_held(probe: AsyncKVClient, what: str) -> None:
    """Wait (5 s at most) until the server holds no shm handle, pinned block or reserved byte."""
    async def clear() -> bool:
        st = await probe.stats()
        return (st["shm"]["open_handles"], st["store"]["pinned_blocks"], st["store"]["reserved_bytes"]) == (0, 0, 0)

    await eventually(clear, 5, what)


@pytest.mark.parametrize("op", ["get", "put"])
async def test_an_shm_call_cancelled_as_its_reply_arrives_leaves_no_handle_behind(
        make_server: MakeServer, unix_path: str, op: str) -> None:
    """A cancel that lands in the loop turn the SHM_GET / SHM_PUT reply arrives in (a wait_for timing
    out, another task's cancel): the reply was dropped with its handle, the pooled connection kept,
    and the server held the read pins (until the lease ran out) or the reserved slots (as long as
    the client stayed connected). The handle is given back now, and the connection stays with the
    requests pipelined on it (ending it instead failed a pinned lookup in flight there, its leases
    left to expire)."""
    make_server("--capacity", "64MiB", "--unix", unix_path)
    keys = [key(i, "cancel") for i in range(4)]
    blocks = [data(k, 1 << 20) for k in keys]
    async with AsyncKVClient(unix(unix_path), namespace="c", pool_size=1) as kv, \
            AsyncKVClient(unix(unix_path), namespace="c", shm=False) as probe:
        await kv.put(keys, blocks)
        (conn,) = kv.nodes[0].conns
        send = conn._send

        def send_then_cancel(*args, **kwargs):  # type: ignore[no-untyped-def]
            pending = send(*args, **kwargs)
            pending.future.add_done_callback(lambda _: task.cancel())  # as the reply is set
            return pending

        conn._send = send_then_cancel  # type: ignore[method-assign]
        task = asyncio.ensure_future(kv.get(keys) if op == "get" else kv.put([key(i, "new") for i in range(4)], blocks))
        await asyncio.sleep(0)  # (its request is out)
        conn._send = send  # type: ignore[method-assign]
        lookup = asyncio.ensure_future(kv.lookup(keys, pin=True))  # pipelined behind it, on the same connection
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await lookup == 4
        assert await kv.unpin(keys) == 4

        await nothing_held(probe, "the cancelled call's handle to be given back")
        assert kv.nodes[0].conns == [conn] and not conn.closed
        assert [bytes(b) for b in await kv.get(keys)] == blocks


async def test_shm_calls_cancelled_at_random_points_give_their_handles_back(
        make_server: MakeServer, unix_path: str) -> None:
    """Cancelled before, as or after their replies come: the handles of the replies nobody takes go
    back (a release is sent), the connection stays, and nothing stays pinned or reserved."""
    make_server("--capacity", "64MiB", "--unix", unix_path)
    keys = [key(i, "rnd") for i in range(8)]
    blocks = [data(k, 1 << 20) for k in keys]
    rng = random.Random(7)
    async with AsyncKVClient(unix(unix_path), namespace="r", pool_size=1) as kv, \
            AsyncKVClient(unix(unix_path), namespace="r", shm=False) as probe:
        await kv.put(keys, blocks)
        (conn,) = kv.nodes[0].conns
        start = time.perf_counter()  # the timeouts span a call's own time, however fast this machine is
        await kv.get(keys)
        await kv.put([key(j, "rnd-first") for j in range(8)], blocks)
        span = (time.perf_counter() - start) / 2
        cancelled = finished = 0
        for i in range(600):  # until enough of both, bounded
            call = kv.get(keys) if i % 2 else kv.put([key(i * 8 + j, "rnd-new") for j in range(8)], blocks)
            try:
                await asyncio.wait_for(call, rng.uniform(0, span))
                finished += 1
            except asyncio.TimeoutError:
                cancelled += 1
            if cancelled >= 30 and finished >= 5:
                break
            if i % 50 == 49 and finished > 5 * (cancelled + 1):  # (span was measured on a slow moment)
                span /= 2

        await nothing_held(probe, "every cancelled call's handle to be given back")
        assert cancelled >= 30 and kv.nodes[0].conns == [conn] and not conn.closed
        assert [bytes(b) for b in await kv.get(keys)] == blocks


async def test_an_unpinning_shm_get_queued_behind_a_cancelled_put_is_sent_again(
        make_server: MakeServer, unix_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A put cancelled while its payload goes out ends the connection; an unpinning SHM_GET queued
    behind it never reached the server. The socket path sends such a request again (NotSent); the
    shared-memory path did not retry it (an unpin must not run twice) and failed the read."""
    make_server("--capacity", "256MiB", "--unix", unix_path)
    monkeypatch.setattr(ShmChannel, "inline_put_bytes", 1 << 30)  # the big put goes over the socket
    keys = [key(i, "behind") for i in range(4)]
    blocks = [data(k, 1 << 20) for k in keys]
    aborted = 0
    async with AsyncKVClient(unix(unix_path), namespace="q", pool_size=1) as kv:
        await kv.put(keys, blocks)
        assert kv.nodes[0].shm is not None
        for trial in range(5):
            assert await kv.lookup(keys, pin=True) == 4
            conn, got = await behind_a_cancelled_put(kv, f"big{trial}", lambda: kv.get(keys, unpin=True),
                                                     block_bytes=16 << 20)  # 64 MiB going out first
            aborted += conn.closed  # (cancelled mid-payload: the connection ended; else the put had gone out)
            assert [bytes(b) for b in await got] == blocks  # (sent again on a new connection)
            assert (await kv.stats())["store"]["leases"] == 0
    assert aborted


async def test_a_drain_ends_when_the_only_pins_it_waits_for_expire(make_server: MakeServer, unix_path: str) -> None:
    """A client that hangs mid-copy holds read pins; once they expire nothing is left to drain."""
    srv = make_server("--capacity", "8MiB", "--unix", unix_path, "--lease-seconds", "0.5", "--drain-seconds", "60")
    k = key(1, "drain")
    async with AsyncKVClient(unix(unix_path), namespace="d") as kv:
        await kv.put([k], [data(k, 5000)])
        await shm_locate(kv, [k])  # pinned, never released
        assert (await kv.stats())["shm"]["open_handles"] == 1
        code = await asyncio.to_thread(srv.stop, timeout=20)  # (the drain waited out its 60 s)
    assert code == 0, "".join(srv.log[-5:])
    assert not any("drain timed out" in line for line in srv.log), "".join(srv.log[-5:])


async def test_a_read_in_flight_from_a_replaced_server_copies_out_of_its_arena(
        make_server: MakeServer, unix_path: str) -> None:
    """A rolling restart: the new server takes over the socket path while the old one still owes a
    read on a pooled connection. Re-attaching to the new arena for a second connection must not
    unmap the old one under that read (a ValueError came out of the get when its answer arrived)."""
    old_srv = make_server("--capacity", "32MiB", "--unix", unix_path)
    new_path = unix_path + ".new"
    make_server("--capacity", "32MiB", "--unix", new_path)
    keys = [key(i, "rolling") for i in range(4)]
    blocks = [data(k, 1 << 20) for k in keys]
    gc.collect()  # (other tests' arenas and clients, not yet collected, would go during this one)
    mapped = arena_mappings()
    async with AsyncKVClient(unix(new_path), namespace="r", shm=False) as kv:
        await kv.put(keys, blocks)  # the new server holds the same blocks: either answer is right
    async with AsyncKVClient(unix(unix_path), namespace="r", pool_size=2, timeout=30) as kv:
        await kv.put(keys, blocks)
        node = kv.nodes[0]
        old_channel = node.shm
        assert old_channel is not None
        os.rename(new_path, unix_path)  # the old server keeps serving the connection it has
        os.kill(old_srv.proc.pid, signal.SIGSTOP)  # and is slow to answer
        try:
            first = asyncio.ensure_future(kv.get(keys))
            deadline = time.monotonic() + 10
            while not any(conn.in_flight for conn in node.conns):  # its SHM_GET is out
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)
            assert [bytes(b) for b in await kv.get(keys)] == blocks  # a second connection: the new server
            assert node.shm is not None and node.shm is not old_channel
        finally:
            os.kill(old_srv.proc.pid, signal.SIGCONT)
        assert [bytes(b) for b in await first] == blocks
        del old_channel, first
        gc.collect()
        assert arena_mappings() == mapped + 1  # the old arena went with the last read holding it


@pytest.mark.parametrize("policy", ["lru", "arc"])
@pytest.mark.parametrize("transport", ["tcp", "shm"])
async def test_a_put_continuing_a_chain_never_evicts_that_chain(make_server: MakeServer, unix_path: str,
                                                                  transport: str, policy: str) -> None:
    """An engine stores a request's blocks step by step (each PUT names the last block as parent) in
    a full store: the room comes from other chains; once the chain alone fills the store, its next
    blocks are refused, not stored by evicting the block they hang off (out of every lookup's reach)."""
    srv = make_server("--capacity", "256KiB", "--page-size", "64KiB", "--eviction", policy, "--unix", unix_path)
    a = [key(i, "long") for i in range(6)]
    x, y = key(0, "other"), key(1, "other")
    addr = srv.addr if transport == "tcp" else unix(unix_path)
    async with AsyncKVClient(addr, namespace="chain", pool_size=1) as kv:
        assert (kv.nodes[0].shm is not None) == (transport == "shm")
        await kv.put(a[:2], [data(k, 1000) for k in a[:2]])
        await kv.put([x, y], [data(x, 1000), data(y, 1000)])  # full; the long chain is the older one
        for i in (2, 3):  # -> evict y, then x
            assert (await kv.put([a[i]], [data(a[i], 1000)], parent=a[i - 1])).stored == 1
        assert await kv.lookup(a) == 4 and await kv.exists([x, y]) == [False, False]
        with pytest.raises(CapacityError, match="the stored chain this block continues") as info:
            await kv.put(a[4:], [data(k, 1000) for k in a[4:]], parent=a[3])
        assert info.value.result.statuses == ["failed", "failed"]
        assert await kv.lookup(a) == 4
        with pytest.raises(CapacityError, match="parent is not stored"):  # (an engine's store in flight)
            await kv.put(a[5:], [data(a[5], 1000)], parent=a[4])  # its parent was refused: not a reachable block's room
        assert await kv.lookup(a) == 4
        assert [bytes(b) for b in await kv.get(a[:4])] == [data(k, 1000) for k in a[:4]]
        stats = await kv.stats()
    assert stats["store"]["stranded_blocks"] == 0 and stats["store"]["evictions"] == 2
    assert stats["shm"]["puts"] == (6 if transport == "shm" else 0)


@pytest.mark.parametrize("transport", ["tcp", "shm"])
async def test_a_put_filling_a_chains_gap_stores_what_follows_and_joins_the_chain(
        make_server: MakeServer, unix_path: str, transport: str) -> None:
    """A chain lost a block in its middle (deleted, or evicted while the rest was being read); a
    prompt restating the chain fills the gap. The blocks after the gap, found stored but stranded,
    made the put's later blocks count as continuing nothing, refused in a full store."""
    srv = make_server("--capacity", "512KiB", "--page-size", "64KiB", "--unix", unix_path)  # 8 blocks
    c = [key(i, "gap") for i in range(8)]
    o = [key(i, "gap-other") for i in range(2)]
    addr = srv.addr if transport == "tcp" else unix(unix_path)
    async with AsyncKVClient(addr, namespace="gap", pool_size=1) as kv:
        await kv.put(c[:6], [data(k, 1000) for k in c[:6]])
        await kv.put(o, [data(k, 1000) for k in o])  # full
        assert await kv.delete([c[2]]) == 1  # c3..c5 stranded
        res = await kv.put(c[2:], [data(k, 1000) for k in c[2:]], parent=c[1])
        assert res.statuses == ["stored", "existed", "existed", "existed", "stored", "stored"]
        stats = (await kv.stats())["store"]
        assert stats["stranded_blocks"] == 0  # joined at the commit, before any lookup
        assert await kv.lookup(c) == 8 and await kv.exists(o) == [False, False]
        assert [bytes(b) for b in await kv.get(c)] == [data(k, 1000) for k in c]


@pytest.mark.parametrize("transport", ["tcp", "shm"])
async def test_a_chains_gap_put_back_alone_makes_the_rest_of_the_chain_reachable(
        make_server: MakeServer, unix_path: str, transport: str) -> None:
    """The blocks after a chain's gap stayed stranded when the gap's block was put back alone
    (after its parent), and went first when the store needed room: evicted before older chains."""
    srv = make_server("--capacity", "512KiB", "--page-size", "64KiB", "--unix", unix_path)  # 8 blocks
    c = [key(i, "gap1") for i in range(5)]
    o = [key(i, "gap1-older") for i in range(3)]
    n = [key(i, "gap1-new") for i in range(2)]
    addr = srv.addr if transport == "tcp" else unix(unix_path)
    async with AsyncKVClient(addr, namespace="gap1", pool_size=1) as kv:
        await kv.put(o, [data(k, 1000) for k in o])
        await kv.put(c, [data(k, 1000) for k in c])  # full
        assert await kv.delete([c[2]]) == 1  # c3, c4 stranded
        assert (await kv.stats())["store"]["stranded_blocks"] == 2
        assert (await kv.put([c[2]], [data(c[2], 1000)], parent=c[1])).stored == 1
        assert (await kv.stats())["store"]["stranded_blocks"] == 0
        await kv.put(n, [data(k, 1000) for k in n])  # -> evicts o2, o1: the older chain's tail (was c4, c3)
        assert await kv.lookup(c) == 5 and await kv.exists(o) == [True, False, False]
        assert [bytes(b) for b in await kv.get(c)] == [data(k, 1000) for k in c]


@pytest.mark.parametrize("transport", ["tcp", "shm"])
async def test_a_put_continuing_a_restored_parent_through_its_stranded_child_is_stored(
        make_server: MakeServer, unix_path: str, transport: str) -> None:
    """E's child S stayed, stranded, while E was evicted and stored again alone; a put of [S, N]
    after E: N was refused as continuing nothing (S stranded), though the commit joins S to E."""
    srv = make_server("--capacity", "384KiB", "--page-size", "64KiB", "--unix", unix_path)  # 6 blocks
    e, s, n = (key(i, "restored") for i in range(3))
    o = [key(i, "restored-other") for i in range(4)]
    addr = srv.addr if transport == "tcp" else unix(unix_path)
    async with AsyncKVClient(addr, namespace="restored", pool_size=1) as kv:
        await kv.put([e, s], [data(e, 1000), data(s, 1000)])
        assert await kv.delete([e]) == 1  # s stranded
        await kv.put([e], [data(e, 1000)])  # back alone, as a head: s joined to it again
        await kv.put(o, [data(k, 1000) for k in o])  # full
        res = await kv.put([s, n], [data(s, 1000), data(n, 1000)], parent=e)
        assert res.statuses == ["existed", "stored"]
        assert await kv.lookup([e, s, n]) == 3 and (await kv.stats())["store"]["stranded_blocks"] == 0


# ---------------------------------------------------------------- a client killed mid-put

_KILLED_WRITER = textwrap.dedent("""
    import asyncio, sys
    from kvstore.client import AsyncKVClient
    from kvstore.protocol import ShmPut

    async def main(path, keys, size):
        kv = AsyncKVClient("unix:" + path, namespace="kill")
        await kv.connect()
        node = kv.nodes[0]
        assert node.shm is not None
        conn = await node.connection()
        resp = await conn.request(ShmPut(keys=keys, sizes=[size] * len(keys)))
        for loc in resp.fields["locs"]:
            views = node.shm.segment.views(loc)
            views[0][: len(views[0]) // 2] = b"\\xab" * (len(views[0]) // 2)  # half written, then killed
        print("reserved", resp.fields["handle"], flush=True)
        await asyncio.sleep(60)

    asyncio.run(main(sys.argv[1], [bytes.fromhex(h) for h in sys.argv[3:]], int(sys.argv[2])))
""")


async def test_client_killed_mid_put_leaves_no_block(make_server: MakeServer, unix_path: str) -> None:
    srv = make_server("--capacity", "16MiB", "--unix", unix_path)
    keys = [key(i, "killed") for i in range(3)]
    size = 300_000
    child = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, unix_path, str(size), *(k.hex() for k in keys)],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(child.stdout.readline), 30)
        assert line.startswith("reserved")
        async with AsyncKVClient(srv.addr, namespace="kill") as kv:
            stats = await kv.stats()
            assert stats["store"]["reserved_bytes"] >= 3 * size  # slots held for the writer...
            assert await kv.exists(keys) == [False] * 3  # ... and invisible until committed
            child.kill()  # SIGKILL: no chance to clean up
            child.wait(10)
            for _ in range(100):
                stats = await kv.stats()
                if stats["store"]["reserved_bytes"] == 0:
                    break
                await asyncio.sleep(0.05)
            assert stats["store"]["reserved_bytes"] == 0 and stats["store"]["blocks"] == 0
            assert stats["shm"]["aborted_on_close"] == 1
            assert await kv.exists(keys) == [False] * 3 and await kv.lookup(keys) == 0
            blocks = [data(k, size) for k in keys]
            assert (await kv.put(keys, blocks)).stored == 3  # stored afresh, not "existed"
            assert [bytes(b) for b in await kv.get(keys)] == blocks
    finally:
        child.kill()
        child.wait(10)
        if child.stdout is not None:
            child.stdout.close()


async def _reserved(kv: AsyncKVClient, keys: list[bytes], size: int) -> tuple[Any, Any]:
    """An SHM_PUT of ``keys`` on one of ``kv``'s connections, never committed: (that connection, its reply)."""
    assert kv.nodes[0].shm is not None
    conn = await kv.nodes[0].connection()
    return conn, await conn.request(ShmPut(keys=keys, sizes=[size] * len(keys)))


async def test_a_commit_with_checksums_not_one_per_key_is_refused_and_gives_the_slots_back(
        make_server: MakeServer, unix_path: str) -> None:
    """A client of its own committing 1 or 3 checksums for 2 keys: refused, the reservation given
    back, nothing stored, and the connection serves on (without the check, a mutant answered
    "internal error: IndexError")."""
    make_server("--capacity", "8MiB", "--unix", unix_path)
    size = 1 << 20
    keys = [key(i, "sums") for i in range(2)]
    async with AsyncKVClient("unix:" + unix_path, namespace="sums") as kv:
        for sums in ([1], [1, 2, 3]):
            conn, resp = await _reserved(kv, keys, size)
            with pytest.raises(InvalidRequest, match=f"{len(sums)} checksums for 2 keys"):
                await conn.request(ShmCommit(handle=resp.fields["handle"], checksums=sums))
            stats = await kv.stats()
            assert stats["store"]["reserved_bytes"] == 0 and stats["shm"]["put_keys"] == 0
            assert await kv.exists(keys) == [False, False] and not conn.closed
        assert (await kv.put(keys, [data(k, size) for k in keys])).stored == 2


async def test_a_client_slow_to_copy_into_its_slots_is_not_cut_off_by_the_idle_timeout(
        make_server: MakeServer, unix_path: str) -> None:
    """Closing the connection would free the slots while the client, only slow (paused, in a
    debugger), may still write into them: over the blocks of whoever got those pages next."""
    srv = make_server("--capacity", "4MiB", "--unix", unix_path, "--idle-timeout", "1")
    size = 1 << 20
    keys = [key(i, "slow") for i in range(2)]
    async with AsyncKVClient("unix:" + unix_path, namespace="slow") as kv, \
            AsyncKVClient(srv.addr, namespace="other", shm=False) as other:
        node = kv.nodes[0]
        conn, resp = await _reserved(kv, keys, size)
        await asyncio.sleep(3)  # three idle-timeout checks with nothing sent
        assert not conn.closed
        others = [key(i, "other") for i in range(2)]  # the rest of the store
        assert (await other.put(others, [data(k, size) for k in others])).stored == 2
        for loc, k in zip(resp.fields["locs"], keys):  # the slow client writes at last
            node.shm.segment.views(loc)[0][:] = data(k, size)
        done = await conn.request(ShmCommit(handle=resp.fields["handle"],
                                            checksums=[xxhash.xxh3_64_intdigest(data(k, size)) for k in keys]))
        assert done.fields["status"] == [STORED] * 2
        assert [bytes(b) for b in await kv.get(keys)] == [data(k, size) for k in keys]
        assert [bytes(b) for b in await other.get(others)] == [data(k, size) for k in others]


async def test_a_put_not_committed_within_the_longest_lease_gives_its_slots_back(
        make_server: MakeServer, unix_path: str) -> None:
    """Its connection is exempt from the timeouts (above); a client that died while a forked child
    keeps its socket open held the slots for good. They go after --max-lease-seconds."""
    make_server("--capacity", "4MiB", "--unix", unix_path, "--idle-timeout", "1",
                "--lease-seconds", "1", "--max-lease-seconds", "2")
    async with AsyncKVClient("unix:" + unix_path, namespace="stuck") as kv:
        conn, resp = await _reserved(kv, [key(0, "stuck")], 3 << 20)
        assert (await kv.stats())["store"]["reserved_bytes"] >= 3 << 20

        async def given_back() -> bool:
            st = await kv.stats()
            return st["store"]["reserved_bytes"] == 0 and st["shm"]["put_expired"] == 1

        await eventually(given_back, 10, "the slots to be given back")
        assert not conn.closed
        with pytest.raises(NotFound):
            await conn.request(ShmCommit(handle=resp.fields["handle"], checksums=[0]))
        others = [key(i, "after") for i in range(3)]  # the room is there again
        assert (await kv.put(others, [data(k, 1 << 20) for k in others])).stored == 3


@pytest.mark.parametrize("quarantine", [0.0, 5.0])
async def test_a_put_whose_copy_outlasts_the_longest_lease_says_so(make_server: MakeServer, unix_path: str,
                                                                  monkeypatch: pytest.MonkeyPatch,
                                                                  quarantine: float) -> None:
    """It raised NotFound, "no open SHM_PUT with handle 1": the class of a missing key, naming a handle.
    (coverage review) With ``quarantine=``, that timeout also quarantined the server, which had
    answered: the client's copy was the slow one."""
    import kvstore.client.shm as client_shm

    make_server("--capacity", "16MiB", "--unix", unix_path, "--lease-seconds", "1", "--max-lease-seconds", "2")
    copy_in = client_shm.ShmChannel._copy_in

    def paused(self: Any, locs: Any, views: Any) -> Any:
        time.sleep(3.5)  # (the process paused mid-put: a debugger, SIGSTOP)
        return copy_in(self, locs, views)

    async with AsyncKVClient("unix:" + unix_path, namespace="paused", retries=0, quarantine=quarantine) as kv:
        assert kv.nodes[0].shm is not None
        monkeypatch.setattr(client_shm.ShmChannel, "_copy_in", paused)
        k = [key(0, "paused")]
        with pytest.raises(RequestTimeout, match=r"a shared-memory put of 1 block\(s\) was not committed within the "
                                                 r"server's --max-lease-seconds; .* none of them was stored"):
            await kv.put(k, [data(k[0], 4 << 20)])
        monkeypatch.setattr(client_shm.ShmChannel, "_copy_in", copy_in)
        assert await kv.exists(k) == [False]  # (not quarantined)
        await kv.put(k, [data(k[0], 4 << 20)])
        assert [bytes(b) for b in await kv.get(k)] == [data(k[0], 4 << 20)]


async def test_a_second_signal_ends_a_drain_that_waits_for_a_copy(make_server: MakeServer, unix_path: str) -> None:
    """A drain waits for open shared-memory puts (--drain-seconds); asked again, it stops waiting."""
    srv = make_server("--capacity", "4MiB", "--unix", unix_path, "--drain-seconds", "600")
    async with AsyncKVClient("unix:" + unix_path, namespace="slow") as kv:
        await _reserved(kv, [key(0, "drain")], 1 << 20)
        assert srv.proc is not None
        srv.proc.send_signal(signal.SIGTERM)
        await asyncio.to_thread(srv.wait_log, "stopping: draining")
        await asyncio.sleep(0.3)
        assert srv.proc.poll() is None  # waiting for the copy
        srv.proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(srv.proc.wait, 20) == 0
    assert any("drain cut short; closing 1 busy connection(s)" in line for line in srv.log)
    assert not any("never retrieved" in line or "Traceback" in line for line in srv.log)


async def test_a_drain_that_times_out_closes_the_busy_connection_without_an_error(
        make_server: MakeServer, unix_path: str) -> None:
    srv = make_server("--capacity", "4MiB", "--unix", unix_path, "--drain-seconds", "0.5")
    async with AsyncKVClient("unix:" + unix_path, namespace="slow") as kv:
        await _reserved(kv, [key(0, "drain")], 1 << 20)
        assert srv.proc is not None
        srv.proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(srv.proc.wait, 20) == 0
    assert any("drain timed out; closing 1 busy connection(s)" in line for line in srv.log)
    assert not any("never retrieved" in line or "Traceback" in line for line in srv.log)  # (a gather left behind)


# ---------------------------------------------------------------- who may map the arena


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "tokens"
    path.write_text(f"{TOKEN}\nllama/*:{NS_TOKEN}\n?:one-letter\n[*]:star-only\n")
    return path


async def test_only_a_client_with_the_token_can_map_the_segment(make_server: MakeServer, unix_path: str, token_file: Path) -> None:
    make_server("--capacity", "8MiB", "--unix", unix_path, "--token-file", str(token_file))
    for token in (None, "wrong"):
        frames, fds = raw_exchange(unix_path, Hello(token=token), ShmAttach())
        assert fds == []  # no descriptor ever reached it
        assert error_code(frames[0]) == Unauthorized.code and len(frames) == 1  # refused, then closed
    frames, fds = raw_exchange(unix_path, ShmAttach())  # skipping HELLO does not help
    assert fds == [] and error_code(frames[0]) == Unauthorized.code
    # a token limited to some namespaces is refused too: the arena holds every namespace
    frames, fds = raw_exchange(unix_path, Hello(token=NS_TOKEN, namespace="llama/a"), ShmAttach(),
                               ShmPut(keys=[key(0, "tok")], sizes=[10]))
    assert fds == [] and error_code(frames[1]) == Unauthorized.code
    assert error_code(frames[2]) == Unauthorized.code  # nor may it reserve (and publish unwritten) slots
    assert "shm" not in reply_fields(frames[0])  # (its HELLO is not offered the arena either)
    # Nor one whose patterns happen to match the name "*": only the pattern "*" grants every namespace.
    for token, namespace in (("one-letter", "x"), ("star-only", "*")):
        frames, fds = raw_exchange(unix_path, Hello(token=token, namespace=namespace), ShmAttach())
        assert fds == [] and "shm" not in reply_fields(frames[0]) and error_code(frames[1]) == Unauthorized.code
    frames, fds = raw_exchange(unix_path, Hello(token=TOKEN), ShmAttach())
    try:
        assert len(fds) == 1 and reply_fields(frames[1])["size"] == 8 << 20
        assert os.readlink(f"/proc/self/fd/{fds[0]}").startswith("/memfd:kvstore-arena")  # not a /dev/shm file
        with pytest.raises(PermissionError):
            os.ftruncate(fds[0], 4096)  # sealed: a client cannot shrink the arena under the server
    finally:
        for fd in fds:
            os.close(fd)
    with pytest.raises(Unauthorized):
        async with AsyncKVClient(unix(unix_path), token="wrong", retries=0):
            pass
    async with AsyncKVClient(unix(unix_path), token=NS_TOKEN, namespace="llama/a") as limited:
        assert limited.nodes[0].shm is None  # falls back to the socket, transparently
        await limited.put([key(1, "tok")], [b"limited"])
        assert await limited.get([key(1, "tok")]) == [b"limited"]
    async with AsyncKVClient(unix(unix_path), token=TOKEN, namespace="llama/a") as full:
        assert full.nodes[0].shm is not None
        assert [bytes(b) for b in await full.get([key(1, "tok")])] == [b"limited"]


async def test_a_server_whose_arena_cannot_be_shared_serves_its_unix_socket_without_it_and_says_why(
        make_server: MakeServer, unix_path: str) -> None:
    """An operator's file-size limit (``ulimit -f``) below --capacity: the memfd cannot be sized, so
    the server serves without shared memory. (coverage review) Its refusal of SHM_ATTACH said "it
    needs --unix PATH and no --no-shm", both of which it had."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, hard))  # (the server inherits it)
    try:
        srv = make_server("--capacity", "8MiB", "--unix", unix_path)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    srv.wait_log("shared memory unavailable")
    frames, fds = raw_exchange(unix_path, Hello(), ShmAttach())
    assert fds == [] and error_code(frames[1]) == InvalidRequest.code
    assert "could not be shared at start" in frames[1].msg.message and "--no-shm" not in frames[1].msg.message
    async with AsyncKVClient(unix(unix_path), namespace="nofd") as kv:
        await kv.put([key(0, "nofd")], [b"over the socket"])
        assert kv.nodes[0].shm is None and await kv.get([key(0, "nofd")]) == [b"over the socket"]


async def test_shm_attach_needs_a_hello_first_without_tokens_too(make_server: MakeServer, unix_path: str) -> None:
    make_server("--capacity", "8MiB", "--unix", unix_path)
    frames, fds = raw_exchange(unix_path, ShmAttach())
    assert fds == [] and error_code(frames[0]) == InvalidRequest.code  # no descriptor before HELLO
    assert_attach_maps(unix_path, 8 << 20)


def test_the_arena_is_passed_once_per_connection(make_server: MakeServer, unix_path: str) -> None:
    """An unread reply's descriptor counts against the server user's open-file limit: a peer asking
    again and again without reading would have the kernel refuse every other client's attach."""
    make_server("--capacity", "8MiB", "--unix", unix_path)
    frames, fds = raw_exchange(unix_path, Hello(), ShmAttach(), ShmAttach())
    for fd in fds:
        os.close(fd)
    assert len(fds) == 1 and reply_fields(frames[1])["size"] == 8 << 20
    assert error_code(frames[2]) == InvalidRequest.code
    assert_attach_maps(unix_path, 8 << 20)  # a fresh connection gets its own


async def test_a_peer_gone_before_its_attach_reply_is_not_a_server_error(make_server: MakeServer, unix_path: str) -> None:
    srv = make_server("--capacity", "8MiB", "--unix", unix_path)
    stream = b"".join(bytes(b) for i, m in enumerate([Hello(), ShmAttach()], 1) for b in encode(m, i))
    for _ in range(20):
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(unix_path)
            s.sendall(stream)
    async with AsyncKVClient(unix(unix_path)) as kv:
        async def alone() -> bool:
            return (await kv.stats())["connections"] <= 2  # the client's own and its attach's
        await eventually(alone, 10, "the 20 peers' connections to close")
        stats = await kv.stats()
    assert "shm_attach" not in stats["errors"], stats["errors"]
    assert not [line for line in srv.log if "internal error" in line]


async def test_shm_read_pins_are_bounded_and_a_client_at_the_bound_reads_over_the_socket(
        make_server: MakeServer, unix_path: str) -> None:
    """A peer that never releases its SHM_GET handles cannot grow the server's memory without end:
    past the bound (64 Ki pins for a small arena) SHM_GET is refused, and clients read over the socket."""

    make_server("--capacity", "8MiB", "--unix", unix_path)
    k = key(1, "pins")
    async with AsyncKVClient(unix(unix_path)) as kv:
        assert kv.nodes[0].shm is not None
        await kv.put([k], [data(k, 4096)])
        hog, frames = pipelined(unix_path, [Hello(), *[ShmGet(keys=[k] * 16384) for _ in range(5)]])
        try:
            assert all(reply_fields(f)["handle"] for f in frames[1:5])  # 4 x 16384 pins: at the bound
            assert error_code(frames[5]) == CapacityError.code
            assert (await kv.stats())["shm"]["pins"] == 4 * 16384
            buf = bytearray(4096)
            assert await kv.get_into([k], [buf]) == [True] and buf == data(k, 4096)  # over the socket
            assert (await kv.stats())["errors"]["shm_get"] == 2  # the hog's fifth and the client's, refused
        finally:
            hog.close()

        async def released() -> bool:
            return (await kv.stats())["shm"]["pins"] == 0
        await eventually(released, 10, "the hog's pins to go with its connection")
        shm_gets = (await kv.stats())["shm"]["gets"]
        assert await kv.get_into([k], [buf]) == [True] and buf == data(k, 4096)
        assert (await kv.stats())["shm"]["gets"] == shm_gets + 1  # the arena again


async def test_shm_puts_waiting_for_their_commit_are_bounded_and_a_client_at_the_bound_puts_over_the_socket(
        make_server: MakeServer, unix_path: str) -> None:
    """SHM_PUTs never committed kept their whole state (a status and an error string per key, a pin per
    key that existed) until the connection closed or --max-lease-seconds: one reserved key and 16,383
    refused ones a request grew the server by ~5.6 MiB each, without bound. Past 64 Ki keys waiting
    (a small arena), SHM_PUT is refused, and clients put over the socket."""
    make_server("--capacity", "8MiB", "--unix", unix_path, "--max-block", "2MiB")
    hog_keys = [[key(j * 16384 + i, "hog") for i in range(16384)] for j in range(5)]
    sizes = [1] + [4 << 20] * 16383  # one slot reserved, the others over --max-block
    hog, frames = pipelined(unix_path, [Hello(), *[ShmPut(keys=ks, sizes=sizes) for ks in hog_keys]])
    async with AsyncKVClient(unix(unix_path), namespace="p") as kv:
        assert kv.nodes[0].shm is not None
        try:
            assert all(reply_fields(f)["handle"] for f in frames[1:5])  # 4 x 16384 keys: at the bound
            assert error_code(frames[5]) == CapacityError.code
            assert (await kv.stats())["shm"]["put_keys"] == 4 * 16384
            k, block = key(1, "p"), data(key(1, "p"), 2 << 20)  # (a put of 2 MiB or more goes through the arena)
            shm_puts = (await kv.stats())["shm"]["puts"]
            assert (await kv.put([k], [block])).stored == 1
            stats = await kv.stats()
            assert stats["shm"]["puts"] == shm_puts and stats["errors"]["shm_put"] == 2  # refused: the socket
            assert [bytes(b) for b in await kv.get([k])] == [block]
        finally:
            hog.close()

        async def released() -> bool:
            return (await kv.stats())["shm"]["put_keys"] == 0
        await eventually(released, 10, "the hog's puts to be aborted with its connection")
        shm_puts = (await kv.stats())["shm"]["puts"]
        await kv.put([key(2, "p")], [data(key(2, "p"), 2 << 20)])
        assert (await kv.stats())["shm"]["commits"] >= 1 and (await kv.stats())["shm"]["puts"] == shm_puts + 1


async def test_shm_read_pins_of_blocks_read_through_from_redis_are_bounded_too(
        make_server: MakeServer, unix_path: str, redis_server: RedisProcess) -> None:
    """Pipelined SHM_GETs of a block only Redis has all pass a check of the pins held while their
    fetches run: the bound counts every key of a request from the start."""
    k = key(1, "tier-pins")
    first = make_server("--capacity", "8MiB", "--redis", redis_server.url)
    async with AsyncKVClient(first.addr) as kv:
        await kv.put([k], [data(k, 64)])  # write-through: in Redis
    first.stop()
    make_server("--capacity", "8MiB", "--unix", unix_path, "--redis", redis_server.url)  # memory empty
    hog, frames = pipelined(unix_path, [Hello(), *[ShmGet(keys=[k] * 16384) for _ in range(6)]])
    frames.sort(key=lambda f: f.request_id)  # (the refusals come first: the others wait for Redis)
    try:
        assert [bool(reply_fields(f)["handle"]) for f in frames[1:5]] == [True] * 4  # 4 x 16384: the bound
        assert [error_code(f) for f in frames[5:]] == [CapacityError.code] * 2
        async with AsyncKVClient(unix(unix_path)) as kv:
            assert (await kv.stats())["shm"]["pins"] == 4 * 16384
    finally:
        hog.close()


async def test_an_shm_read_whose_connection_closes_while_redis_answers_pins_nothing_after(
        make_server: MakeServer, unix_path: str, redis_server: RedisProcess) -> None:
    """An SHM_GET of a block in memory and one only Redis has pins the first while it waits for the
    second; the connection went away meanwhile. Those pins are released when Redis answers: kept
    (on a session that had ended, which no lease expiry visits again), they held the block for good."""
    here, there = key(1, "closing-read"), key(2, "closing-read")
    first = make_server("--capacity", "8MiB", "--redis", redis_server.url)
    async with AsyncKVClient(first.addr) as kv:
        await kv.put([here, there], [data(here, 4096), data(there, 4096)])  # write-through: in Redis
    first.stop()
    srv = make_server("--capacity", "8MiB", "--unix", unix_path, "--redis", redis_server.url)
    async with AsyncKVClient(srv.addr) as kv:
        assert await kv.get([here]) == [data(here, 4096)]  # read through: now in memory too
        redis_server.cli("CLIENT", "PAUSE", "1000")  # the read of `there` waits on Redis
        sock, frames = pipelined(unix_path, [Hello()])
        sock.sendall(b"".join(bytes(b) for b in encode(ShmGet(keys=[here, there]), 2)))
        await asyncio.sleep(0.2)
        sock.close()  # before the reply
        for _ in range(100):
            stats = await kv.stats()
            if stats["shm"]["pins"] == 0 and stats["store"]["pinned_blocks"] == 0:
                break
            await asyncio.sleep(0.05)
        assert (stats["shm"]["pins"], stats["store"]["pinned_blocks"]) == (0, 0)
        assert await kv.get([here, there]) == [data(here, 4096), data(there, 4096)]


def pipelined(path: str, msgs: list[Message]) -> tuple[socket.socket, list[Frame]]:
    """Send ``msgs`` in one write on a new Unix connection, read one reply each; the socket stays open."""
    sock = socket.socket(socket.AF_UNIX)
    try:
        sock.settimeout(10)
        sock.connect(path)
        sock.sendall(b"".join(bytes(b) for i, m in enumerate(msgs, 1) for b in encode(m, i)))
        reader, frames = FrameReader(is_server=False), []
        while len(frames) < len(msgs):
            chunk = sock.recv(1 << 20)
            assert chunk, f"closed after {len(frames)} replies"
            reader.feed(chunk)
            while isinstance(event := reader.next_event(), Frame):
                frames.append(event)
    except BaseException:
        sock.close()
        raise
    return sock, frames


async def test_no_connect_timeout_still_maps_the_arena(make_server: MakeServer, unix_path: str) -> None:
    make_server("--capacity", "8MiB", "--unix", unix_path)
    async with AsyncKVClient(unix(unix_path), connect_timeout=None) as kv:
        assert kv.nodes[0].shm is not None
        await kv.put([key(1, "nt")], [b"no timeout"])
        assert [bytes(b) for b in await kv.get([key(1, "nt")])] == [b"no timeout"]


# ---------------------------------------------------------------- fallbacks


async def test_no_shm_server_falls_back_to_the_socket(make_server: MakeServer, unix_path: str) -> None:
    make_server("--capacity", "8MiB", "--unix", unix_path, "--no-shm")
    frames, fds = raw_exchange(unix_path, Hello(), ShmAttach())
    assert fds == [] and "shm" not in reply_fields(frames[0]) and error_code(frames[1]) is not None
    async with AsyncKVClient(unix(unix_path), shm=True) as kv:
        assert kv.nodes[0].shm is None
        await kv.put([key(1, "noshm")], [b"x" * 70_000])
        assert await kv.get([key(1, "noshm")]) == [b"x" * 70_000]
        assert (await kv.stats())["shm"]["gets"] == 0


async def test_an_attach_refused_at_the_connection_limit_is_asked_again_by_a_later_connection(
        make_server: MakeServer, unix_path: str) -> None:
    """A server at --max-connections refuses the attach's connection: the client used the socket
    for that server instance for good. A later new connection of its pool asks again."""

    make_server("--capacity", "16MiB", "--unix", unix_path, "--max-connections", "3")
    others = [socket.socket(socket.AF_UNIX) for _ in range(2)]
    for s in others:  # two of the three slots taken
        s.connect(unix_path)
    k = [key(1, "limit")]
    try:
        async with AsyncKVClient(unix(unix_path), namespace="limit", pool_size=2) as kv:
            assert kv.nodes[0].shm is None  # its attach was the fourth connection: refused
            await kv.put(k, [b"x" * 4096])
            for s in others:
                s.close()

            async def room() -> bool:  # the server has seen them go (its stats: on kv's one connection)
                return (await kv.stats())["connections"] == 1

            await eventually(room, 10, "the two slots to be free")
            bufs = [[bytearray(4096)] for _ in range(8)]
            await asyncio.gather(*(kv.get_into(k, b) for b in bufs))  # the pool opens its second connection
            assert kv.nodes[0].shm is not None  # whose attach found room
            assert all(b == [b"x" * 4096] for b in bufs)
            assert (await kv.stats())["shm"]["attached"] == 1
    finally:
        for s in others:
            s.close()


async def test_an_attach_that_timed_out_is_asked_again_later_not_by_every_new_connection(
        make_server: MakeServer, unix_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """An attach that got no answer within the connect timeout (a loaded server; here the attach
    fails so, once, by a stand-in) turned shared memory off for that server instance for good;
    then every new connection tried again, each waiting up to connect_timeout. Now the first new
    connection ATTACH_RETRY_S later does."""
    import kvstore.client.shm as client_shm

    make_server("--capacity", "16MiB", "--unix", unix_path, "--idle-timeout", "1")
    real, calls = client_shm.attach, []

    def attach_timing_out_once(*args: Any, **kw: Any) -> Any:
        calls.append(args)
        if len(calls) == 1:
            raise TransportError(client_shm._TIMED_OUT)
        return real(*args, **kw)

    monkeypatch.setattr(client_shm, "attach", attach_timing_out_once)
    monkeypatch.setattr(client_shm, "ATTACH_RETRY_S", 0.5)
    k = [key(1, "slow")]
    async with AsyncKVClient(unix(unix_path), namespace="slow", pool_size=2) as kv:
        assert kv.nodes[0].shm is None
        await kv.put(k, [b"x" * 4096])
        bufs = [[bytearray(4096)] for _ in range(8)]
        await asyncio.gather(*(kv.get_into(k, b) for b in bufs))  # the pool opens its second connection
        assert len(kv.nodes[0].conns) == 2 and len(calls) == 1  # ... within the wait: no attach
        await asyncio.sleep(1.6)  # the server closes both, idle; the next call opens one
        assert all(b == [b"x" * 4096] for b in bufs)
        assert await kv.get_into(k, bufs[0]) == [True]
        assert len(calls) == 2 and kv.nodes[0].shm is not None


def test_an_attach_refused_at_the_limit_is_unavailable_even_when_its_hello_cannot_be_sent(
        make_server: MakeServer, unix_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The refusing server answers and closes at once: a HELLO sent after that fails (broken pipe),
    and the attach raised that TransportError, never retried, instead of the answer waiting unread."""
    import time

    from kvstore.client.shm import attach
    from kvstore.errors import Unavailable

    make_server("--capacity", "16MiB", "--unix", unix_path, "--max-connections", "1")
    holder = socket.socket(socket.AF_UNIX)
    holder.connect(unix_path)  # the only slot
    try:
        time.sleep(0.2)
        send = socket.socket.sendall

        def late_send(self: socket.socket, *args: object) -> None:  # (a busy thread: the close comes first)
            time.sleep(0.1)
            send(self, *args)  # type: ignore[arg-type]

        monkeypatch.setattr(socket.socket, "sendall", late_send)
        for _ in range(3):
            with pytest.raises(Unavailable, match="limit"):
                attach(unix_path, namespace="x", token=None, timeout=5)
    finally:
        holder.close()


async def test_tcp_client_told_shm_true_attaches_on_the_same_host(make_server: MakeServer, unix_path: str) -> None:
    srv = make_server("--capacity", "8MiB", "--unix", unix_path)
    k = key(1, "told")
    async with AsyncKVClient(srv.addr, shm=True) as told, AsyncKVClient(srv.addr) as plain, \
            AsyncKVClient(unix(unix_path), shm=False) as refused:
        assert told.nodes[0].shm is not None  # found the announced socket and the same arena
        assert plain.nodes[0].shm is None and refused.nodes[0].shm is None  # TCP by default; shm=False: never
        await told.put([k], [b"y" * 50_000])
        assert await plain.get([k]) == [b"y" * 50_000] and await refused.get([k]) == [b"y" * 50_000]
        assert (await plain.stats())["shm"]["puts"] == 1


@pytest.mark.parametrize("peer, same_host", [
    ("127.0.0.1:40000", True), ("::1:40000", True), ("::ffff:127.0.0.1:40000", True),  # (dual-stack listener)
    ("10.1.2.3:40000", False), ("::ffff:10.1.2.3:40000", False), ("", False),
])
def test_hello_offers_shm_only_to_peers_it_serves_shm(unix_path: str, peer: str, same_host: bool) -> None:
    """A same-host client that came in by the host's network address would attach over the Unix
    socket and then have every shm request refused (only loopback peers are served): HELLO does
    not offer it shm, so it uses the socket. The real service, not started (no peer can be made
    from another address here: tests bind 127.0.0.1 only)."""
    service = Server(ServerConfig(port=0, capacity=1 << 20, prefault=False, unix=unix_path)).service
    assert "shm" in service.shm.hello_fields(Session(unix=True))
    assert ("shm" in service.shm.hello_fields(Session(peer=peer))) == same_host


async def test_tcp_client_told_shm_true_without_a_unix_socket_uses_tcp(make_server: MakeServer) -> None:
    srv = make_server("--capacity", "8MiB")
    async with AsyncKVClient(srv.addr, shm=True) as kv:
        assert kv.nodes[0].shm is None
        await kv.put([key(1, "tcp")], [b"z"])
        assert await kv.get([key(1, "tcp")]) == [b"z"]


async def test_server_restart_reattaches_the_new_arena(unix_path: str) -> None:
    from kvstore.server.process import ServerProcess

    k = key(1, "restart")
    kv = AsyncKVClient(unix(unix_path), retries=3, backoff=0.1)
    try:
        with ServerProcess("--capacity", "8MiB", "--unix", unix_path):
            await kv.put([k], [b"first"])
            first = kv.nodes[0].shm
            assert first is not None
        with ServerProcess("--capacity", "8MiB", "--unix", unix_path):
            assert await kv.get([k]) == [None]  # a new, empty server: re-attached, the old mapping never read
            assert kv.nodes[0].shm is not None and kv.nodes[0].shm is not first
            await kv.put([k], [b"second"])
            assert [bytes(b) for b in await kv.get([k])] == [b"second"]
    finally:
        await kv.close()


def test_shm_handles_wrap_around_past_the_ones_still_open() -> None:
    from kvstore.server.shm import ShmSession

    st = ShmSession()
    first = st.add("a")  # type: ignore[arg-type]  (the session only files grants)
    st.next_handle = 0xFFFFFFFF  # the last handle: the next wraps to 1, still open
    assert [st.add("b"), st.add("c")] == [0xFFFFFFFF, first + 1]  # type: ignore[arg-type]
    assert st.grants == {first: "a", 0xFFFFFFFF: "b", first + 1: "c"}



def test_an_shm_put_of_a_block_over_the_frame_limit_is_refused(make_server: MakeServer, unix_path: str) -> None:
    """SHM_PUT carries no payload, so the frame limit never saw its blocks: one over --max-frame-size
    was stored, found by LOOKUP, and refused by every GET over a socket (protocol review)."""
    make_server("--capacity", "8MiB", "--max-frame-size", "1MiB", "--unix", unix_path)
    k = key(0, "over")
    frames, _ = raw_exchange(unix_path, Hello(namespace="p"), ShmPut(keys=[k], sizes=[2 << 20]),
                             ShmPut(keys=[key(1, "fits")], sizes=[1 << 20]))
    refused, fits = reply_fields(frames[1]), reply_fields(frames[2])
    assert refused["handle"] == 0 and refused["locs"] == [None] and refused["status"] == [TooLarge.code]
    assert "--max-frame-size" in str(refused.get("errors")), refused
    assert fits["handle"] and fits["locs"][0] is not None  # (a block at the limit is reserved)


async def test_a_block_over_the_reply_limit_is_refused_naming_the_flag_not_asking_for_fewer(
        make_server: MakeServer, unix_path: str, redis_server: RedisProcess) -> None:
    """Read through from a Redis that a server with a larger --max-frame-size filled, a block over
    this server's limit cannot come back over the socket: the refusal said "ask for fewer at a
    time", which cannot help with one block. And LOOKUP and EXISTS found it present: a decode
    node saw a hit it could never load (review); such a block counts as absent there."""
    big = make_server("--capacity", "16MiB", "--redis", redis_server.url)
    srv = make_server("--capacity", "16MiB", "--max-frame-size", "1MiB", "--unix", unix_path, "--redis", redis_server.url)
    k, small = key(1, "over-reply"), key(2, "over-reply")
    async with AsyncKVClient(big.addr, namespace="o") as kv:
        assert (await kv.put([small, k], [data(small, 1 << 20), data(k, 3 << 20)])).stored == 2
    async with AsyncKVClient(srv.addr, namespace="o") as tcp:
        assert await tcp.lookup([small, k]) == 1 and await tcp.exists([small, k]) == [True, False]
        with pytest.raises(TooLarge, match=r"a block of 3145728 bytes is over the reply limit of 1048576 "
                                           r"\(--max-frame-size\): it cannot be read from this server in one piece"):
            await tcp.get([k])
