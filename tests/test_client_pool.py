"""A client's connection pool under concurrent callers, a put spread over servers one of which is
down, and close() while a connection still waits for its HELLO answer. Real servers (or a silent
listening socket) on loopback; a server "stops answering" by SIGSTOP."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from kvstore.client import AsyncKVClient, KVClient, PutResult
from kvstore.client.sharding import Ring
from kvstore.errors import BlockSizeError, RequestTimeout, TooLarge, TransportError, Unauthorized

from shm_helpers import MakeServer, behind_a_cancelled_put, key, unix_path  # noqa: F401  (unix_path is a fixture)


def test_callers_sharing_a_client_do_not_wait_out_each_others_connects(make_server: MakeServer) -> None:
    """Eight threads call one client of a server that accepts connections but never answers. Each
    call may cost connect_timeout * (1 + retries), its own attempts: the opens used to queue behind
    one lock, so the later callers waited out every earlier caller's connect first (the 6th: 15 s)."""
    srv = make_server("--capacity", "8MiB")
    assert srv.proc is not None
    connect_timeout, retries, callers = 1.0, 2, 8
    keys = [key(i, "stopped") for i in range(4)]
    kv = KVClient(srv.addr, namespace="p", timeout=1.0, connect_timeout=connect_timeout, retries=retries)

    def call() -> tuple[BaseException | None, float]:
        t0 = time.monotonic()
        try:
            kv.exists(keys)
        except BaseException as exc:  # noqa: BLE001  (judged below)
            return exc, time.monotonic() - t0
        return None, time.monotonic() - t0

    os.kill(srv.proc.pid, signal.SIGSTOP)
    try:
        with ThreadPoolExecutor(callers) as pool:
            outcomes = list(pool.map(lambda _: call(), range(callers)))
    finally:
        os.kill(srv.proc.pid, signal.SIGCONT)
        kv.close()
    assert all(isinstance(exc, TransportError) for exc, _ in outcomes), outcomes
    budget = connect_timeout * (1 + retries)  # (3 s; queued behind each other the last took ~8x that)
    assert max(took for _, took in outcomes) < 2 * budget + 1, outcomes


@pytest.mark.parametrize("transport", ["tcp", "shm"])
async def test_concurrent_first_calls_open_at_most_pool_size_connections(
        make_server: MakeServer, unix_path: str, transport: str) -> None:
    srv = make_server("--capacity", "8MiB", "--unix", unix_path)
    keys = [key(i, "pool") for i in range(4)]
    kv = AsyncKVClient(f"unix:{unix_path}" if transport == "shm" else srv.addr, namespace="p", pool_size=3)
    try:
        results = await asyncio.gather(*(kv.exists(keys) for _ in range(12)))
        assert results == [[False] * 4] * 12
        conns = kv.nodes[0].conns
        assert 1 <= len(conns) <= 3
        stats = await kv.stats()  # (over one of the pooled connections: no other client)
        assert stats["connections"] == len(conns)
        if transport == "shm":  # one arena attach (on a side connection of its own), not one per opener
            assert kv.nodes[0].shm is not None and stats["shm"]["attached"] == 1
            assert stats["connections_total"] == len(conns) + 1
        else:
            assert stats["connections_total"] == len(conns)
    finally:
        await kv.close()


@pytest.mark.parametrize("down", ["terminated", "stopped"])
async def test_a_put_over_servers_one_of_them_down_tells_which_blocks_were_stored(
        make_server: MakeServer, down: str) -> None:
    """The live server's share is stored; the exception says so in .result (it used to carry none,
    and an engine could not tell which blocks it still had to store elsewhere)."""
    live, dead = make_server("--capacity", "8MiB"), make_server("--capacity", "8MiB")
    assert dead.proc is not None
    kv = AsyncKVClient([live.addr, dead.addr], namespace="p", timeout=1.0, connect_timeout=1.0, backoff=0.01)
    keys = [key(i, "sharded") for i in range(16)]
    on_dead = {i for i, k in enumerate(keys) if kv.nodes[kv.ring.node_of(k)].addr == dead.addr}
    assert 0 < len(on_dead) < len(keys)  # (16 keys: both servers get some but once in 32,000 runs)
    try:
        await kv.connect()
        if down == "terminated":
            dead.stop()
        else:  # a connection is open: the put is sent and never answered
            os.kill(dead.proc.pid, signal.SIGSTOP)
        try:
            with pytest.raises(TransportError) as info:
                await kv.put(keys, [b"block %d" % i for i in range(len(keys))])
        finally:
            if down == "stopped":
                os.kill(dead.proc.pid, signal.SIGCONT)
        assert isinstance(info.value, RequestTimeout) == (down == "stopped")
        result: Any = info.value.result  # type: ignore[attr-defined]
        assert isinstance(result, PutResult)
        assert result.statuses == ["failed" if i in on_dead else "stored" for i in range(len(keys))]
        assert (result.stored, result.existed, result.failed) == (len(keys) - len(on_dead), 0, len(on_dead))
        assert set(result.errors) == on_dead
        assert all(isinstance(e, TransportError) for e in result.errors.values())
    finally:
        await kv.close()
    async with AsyncKVClient(live.addr, namespace="p") as check:  # what .result says is stored, is
        assert await check.exists(keys) == [i not in on_dead for i in range(len(keys))]


def _assert_peer_sees_close(listener: socket.socket) -> None:
    """The client's connection, as the listener accepted it, reaches end of stream (HELLO bytes first)."""
    listener.settimeout(5)
    peer, _ = listener.accept()
    with peer:
        peer.settimeout(2)
        while peer.recv(65536):
            pass


async def test_close_cuts_off_a_connection_waiting_for_its_hello() -> None:
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()  # accepts (in the kernel) and never answers
        kv = AsyncKVClient(f"127.0.0.1:{silent.getsockname()[1]}", connect_timeout=30)
        call = asyncio.ensure_future(kv.ping())
        await asyncio.sleep(0.2)
        t0 = time.monotonic()
        await asyncio.wait_for(kv.close(), 5)
        with pytest.raises(TransportError, match="client is closed"):
            await asyncio.wait_for(call, 5)
        assert time.monotonic() - t0 < 3  # not the 30 s connect timeout
        assert not kv.nodes[0].opening and kv.nodes[0].conns == []
        _assert_peer_sees_close(silent)  # no socket left open once close() returned


def test_close_of_a_blocking_client_cuts_off_a_connection_waiting_for_its_hello() -> None:
    with socket.socket() as silent, ThreadPoolExecutor(1) as pool:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        kv = KVClient(f"127.0.0.1:{silent.getsockname()[1]}", connect_timeout=30)
        call = pool.submit(kv.ping)
        time.sleep(0.2)
        t0 = time.monotonic()
        kv.close()
        with pytest.raises(TransportError, match="client is closed"):
            call.result(5)
        assert time.monotonic() - t0 < 3
        _assert_peer_sees_close(silent)


async def test_a_peer_that_closes_after_hello_costs_a_call_its_retries_only() -> None:
    """A peer that answers HELLO and hangs up (a proxy whose backend is gone, a server draining):
    each such connection is one attempt of the call, which then fails. The reworked pool once
    reconnected at once, without end (20,000 connections in 10 s)."""
    from kvstore.protocol import HEADER, Hello, reply

    accepted = 0

    async def answer_hello_and_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal accepted
        accepted += 1
        try:
            _, _, _, rid, meta_len, payload_len = HEADER.unpack(await reader.readexactly(HEADER.size))
            await reader.readexactly(meta_len + payload_len)
            writer.writelines([bytes(b) for b in reply(Hello.OP, rid, version=1)])
        finally:
            writer.close()

    peer = await asyncio.start_server(answer_hello_and_close, "127.0.0.1", 0)
    kv = AsyncKVClient(f"127.0.0.1:{peer.sockets[0].getsockname()[1]}", pool_size=1, connect_timeout=1,
                       timeout=1, retries=2, backoff=0.01)
    try:
        with pytest.raises(TransportError):
            await asyncio.wait_for(kv.ping(), 20)
        assert 1 <= accepted <= 3  # 1 + retries
    finally:
        await kv.close()
        peer.close()
        await peer.wait_closed()


async def test_close_during_the_first_arena_attach_leaves_the_next_connect_free_to_attach(
        make_server: MakeServer, unix_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """close() that cut off the first attach (mapping a large arena takes a while) used to leave the
    server's instance marked as tried, so after connect() the client never mapped it again."""
    import kvstore.client.shm as shm

    real_attach = shm.attach

    def slow_attach(*args: Any, **kwargs: Any) -> Any:  # (mapping 1 GiB took 75-180 ms here; a host
        time.sleep(0.5)                                  # with huge pages may take ~1 ms)
        return real_attach(*args, **kwargs)

    monkeypatch.setattr(shm, "attach", slow_attach)
    make_server("--capacity", "1GiB", "--unix", unix_path)
    kv = AsyncKVClient(f"unix:{unix_path}", connect_timeout=30)
    node = kv.nodes[0]
    call = asyncio.ensure_future(kv.exists([key(1, "attach")]))
    for _ in range(20_000):  # (the attach starts once the pool connection has said HELLO)
        if node.shm_tried is not None or call.done():
            break
        await asyncio.sleep(0.001)
    assert node.shm is None and not call.done(), "the attach ended before the test could close the client"
    await kv.close()
    with pytest.raises(TransportError, match="closed"):
        await call
    try:
        await kv.connect()
        assert node.shm is not None  # mapped now
        assert await kv.exists([key(1, "attach")]) == [False]
    finally:
        await kv.close()


async def test_calls_use_the_connections_that_opened_when_others_are_refused(make_server: MakeServer) -> None:
    """The server takes one more connection (--max-connections): of the pool's three opens two are
    refused. Calls that waited for a refused open use the one that opened instead of failing."""
    srv = make_server("--capacity", "8MiB", "--max-connections", "2")
    keys = [key(i, "refused") for i in range(2)]
    async with AsyncKVClient(srv.addr, namespace="p") as other:  # holds one of the two
        kv = AsyncKVClient(srv.addr, namespace="p", pool_size=3, retries=0)
        try:
            results = await asyncio.gather(*(kv.exists(keys) for _ in range(60)), return_exceptions=True)
            assert results == [[False, False]] * 60, [r for r in results if isinstance(r, BaseException)][:3]
            assert len(kv.nodes[0].conns) == 1
        finally:
            await kv.close()
        assert await other.ping() >= 0


async def test_a_put_over_servers_one_of_which_refuses_its_share_tells_what_the_other_stored(
        make_server: MakeServer, tmp_path: Path) -> None:
    """A share refused whole (here by a server that wants a token this client lacks) fails its keys;
    the .result of the error still holds what the other server stored."""
    tokens = tmp_path / "tokens"
    tokens.write_text("a-token-this-client-lacks\n")
    roomy, strict = make_server("--capacity", "8MiB"), make_server("--capacity", "8MiB", "--token-file", str(tokens))
    kv = AsyncKVClient([roomy.addr, strict.addr], namespace="p")
    keys = [key(i, "refused-share") for i in range(32)]
    on_strict = {i for i, k in enumerate(keys) if kv.nodes[kv.ring.node_of(k)].addr == strict.addr}
    assert 2 < len(on_strict) < len(keys)
    try:
        with pytest.raises(Unauthorized) as info:
            await kv.put(keys, [bytes([i]) * (32 << 10) for i in range(len(keys))])
        result: Any = info.value.result  # type: ignore[attr-defined]
        assert result.statuses == ["failed" if i in on_strict else "stored" for i in range(len(keys))]
        assert set(result.errors) == on_strict
    finally:
        await kv.close()
    async with AsyncKVClient(roomy.addr, namespace="p") as only:
        assert await only.exists(keys) == [i not in on_strict for i in range(len(keys))]


@pytest.mark.parametrize("op", ["get", "get_into"])
async def test_a_get_over_servers_one_of_them_down_keeps_the_others_blocks(make_server: MakeServer, op: str) -> None:
    """A get whose share on one server fails raises once every share settled; .result holds the
    blocks the other server sent (for get_into: the caller's buffers, filled)."""
    live, dead = make_server("--capacity", "8MiB"), make_server("--capacity", "8MiB")
    kv = AsyncKVClient([live.addr, dead.addr], namespace="p", connect_timeout=1.0, backoff=0.01)
    keys = [key(i, "sharded-get") for i in range(16)]
    blocks = [bytes([i]) * 5000 for i in range(len(keys))]
    on_dead = {i for i, k in enumerate(keys) if kv.nodes[kv.ring.node_of(k)].addr == dead.addr}
    assert 0 < len(on_dead) < len(keys)
    try:
        await kv.put(keys, blocks)
        dead.stop()
        bufs = [bytearray(5000) for _ in keys]
        with pytest.raises(TransportError) as info:
            await (kv.get(keys) if op == "get" else kv.get_into(keys, bufs))
        result: Any = info.value.result  # type: ignore[attr-defined]
        assert [r is None for r in result] == [i in on_dead for i in range(len(keys))]
        assert [bytes(result[i]) for i in range(len(keys)) if i not in on_dead] == \
            [blocks[i] for i in range(len(keys)) if i not in on_dead]
        if op == "get_into":
            assert all(bufs[i] == blocks[i] for i in range(len(keys)) if i not in on_dead)
    finally:
        await kv.close()


async def test_a_batch_error_names_the_callers_own_mistake_before_a_server_that_is_down(
        make_server: MakeServer) -> None:
    """One server down, and on the other a buffer of the wrong size (the caller's bug): the error
    raised is the BlockSizeError, not the lower key's TransportError, and .errors has each key's."""
    live = make_server("--capacity", "8MiB")
    dead = _nothing_listens()
    kv = AsyncKVClient([dead, live.addr], namespace="p", retries=0, connect_timeout=1)
    candidates = [key(i, "mistake") for i in range(64)]  # (the ports, so the placement, change per run)
    on = {k: kv.nodes[kv.ring.node_of(k)].addr for k in candidates}
    keys = [k for k in candidates if on[k] == dead][:3] + [k for k in candidates if on[k] == live.addr][:3]
    on_live = [3, 4, 5]  # the dead server's keys come first
    assert [on[k] for k in keys] == [dead] * 3 + [live.addr] * 3
    try:
        async with AsyncKVClient(live.addr, namespace="p") as direct:
            await direct.put([keys[i] for i in on_live], [b"x" * 1000] * len(on_live))
        bufs = [bytearray(999 if i == on_live[-1] else 1000) for i in range(len(keys))]
        with pytest.raises(BlockSizeError) as info:
            await kv.get_into(keys, bufs)
        errors: Any = info.value.errors  # type: ignore[attr-defined]
        assert isinstance(errors[on_live[-1]], BlockSizeError)
        assert all(isinstance(errors[i], TransportError) for i in range(len(keys)) if i not in on_live)
        assert set(errors) == {i for i in range(len(keys)) if i not in on_live} | {on_live[-1]}
    finally:
        await kv.close()


async def test_a_server_that_cannot_be_reached_is_raised_as_itself_to_each_caller() -> None:
    """One server, down: put and get raise the connect error itself (its message and traceback,
    with .result), and callers that shared a failed open each get an exception of their own."""
    dead = _nothing_listens()
    kv = AsyncKVClient(dead, namespace="p", pool_size=1, retries=0, connect_timeout=1)
    try:
        with pytest.raises(TransportError, match="^cannot connect") as info:
            await kv.put([key(1, "down")], [b"x"])
        assert info.value.result.statuses == ["failed"]  # type: ignore[attr-defined]
        raised = await asyncio.gather(*(kv.exists([key(i, "down")]) for i in range(4)), return_exceptions=True)
        assert all(isinstance(e, TransportError) for e in raised)
        assert len({id(e) for e in raised}) == 4
    finally:
        await kv.close()


def test_a_client_over_several_servers_starts_while_one_is_down(
        make_server: MakeServer, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """``with KVClient([up, down])`` raised at connect(): an engine written as the README shows
    could not start while one shard was down. The one down is now logged and its keys fail or
    miss as if it had failed later; with no server up, or a refused token, connect() still raises."""
    live = make_server("--capacity", "8MiB")
    dead, dead2 = _nothing_listens(), _nothing_listens()
    ring = Ring([live.addr, dead])
    keys = [key(i, "one-down") for i in range(32)]
    on_live = [ring.nodes[ring.node_of(k)] == live.addr for k in keys]
    assert 0 < sum(on_live) < len(keys)
    with caplog.at_level("WARNING", logger="kvstore.client.aio"):
        with KVClient([live.addr, dead], namespace="p", retries=0, connect_timeout=1) as kv:
            with pytest.raises(TransportError) as info:
                kv.put(keys, [b"x" * 100] * len(keys))
            assert info.value.result.statuses == ["stored" if up else "failed" for up in on_live]  # type: ignore[attr-defined]
            assert kv.exists(keys) == on_live
            with pytest.raises(TransportError):  # (strict: a server that failed is not "absent")
                kv.exists(keys, strict=True)
    assert [r.getMessage() for r in caplog.records if "connected to" in r.getMessage()] == [
        f"connected to 1 of 2 servers; {dead} failed (cannot connect to {dead}: Connection refused): "
        "calls will try it again"]
    full = make_server("--capacity", "8MiB", "--max-connections", "1")  # at its limit: out of reach too
    with KVClient(full.addr, namespace="p") as holder, KVClient([live.addr, full.addr], namespace="p") as kv:
        served = Ring([live.addr, full.addr])  # (a key of the full server counts as missing)
        assert kv.exists(keys) == [on_live[i] and served.nodes[served.node_of(k)] == live.addr
                                   for i, k in enumerate(keys)]
        assert holder.exists(keys[:1]) == [False]
    tokens = tmp_path / "tokens"
    tokens.write_text("right-token\n")
    guarded = make_server("--capacity", "8MiB", "--token-file", str(tokens))
    for addrs, token, error in (([dead, dead2], None, TransportError), ([guarded.addr, dead], "wrong", Unauthorized)):
        kv = KVClient(addrs, namespace="p", token=token, retries=0, connect_timeout=1)
        try:
            with pytest.raises(error):
                kv.connect()
        finally:
            kv.close()


async def test_a_connect_cut_off_by_a_timeout_closes_what_it_opened(make_server: MakeServer) -> None:
    """A connect() cancelled (a timeout around it) while one server stayed silent kept the
    connection it had opened to the other: each retry of the caller's left one more open there."""
    live = make_server("--capacity", "8MiB")
    with socket.socket() as silent:  # listens, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        kv = AsyncKVClient([live.addr, f"127.0.0.1:{silent.getsockname()[1]}"], namespace="p", connect_timeout=5)
        try:
            for _ in range(2):
                with pytest.raises(asyncio.TimeoutError):
                    await asyncio.wait_for(kv.connect(), 0.5)
                assert [(n.conns, n.opening) for n in kv.nodes] == [([], set()), ([], set())]
        finally:
            await kv.close()
    async with AsyncKVClient(live.addr, namespace="p") as check:
        until = time.monotonic() + 5
        while (await check.stats())["connections"] > 1 and time.monotonic() < until:  # (closes land)
            await asyncio.sleep(0.05)
        assert (await check.stats())["connections"] == 1  # its own: none left over


def _nothing_listens() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"  # (closed again: nothing listens there)


@pytest.mark.parametrize("limit", ["frame", "batch"])
async def test_a_batch_over_the_servers_limits_goes_out_in_parts(make_server: MakeServer, limit: str) -> None:
    """A put or get_into bigger than one request may carry (a long prompt's KV can be several GB)
    is sent as consecutive parts within the limits the server announces in HELLO; it used to be
    refused whole (a frame over --max-frame-size even cost the connection)."""
    flags = ("--max-frame-size", "64KiB") if limit == "frame" else ("--max-batch", "4")
    srv = make_server("--capacity", "8MiB", *flags)
    keys = [key(i, f"parts-{limit}") for i in range(10)]
    blocks = [bytes([i]) * 30_000 for i in range(len(keys))]
    async with AsyncKVClient(srv.addr, namespace="p") as kv:
        node = kv.nodes[0]
        assert (node.max_payload, node.max_batch) == ((64 << 10, 16384) if limit == "frame" else (2 << 30, 4))
        res = await kv.put(keys, blocks)
        assert res.statuses == ["stored"] * len(keys)
        bufs = [bytearray(30_000) for _ in keys]
        assert await kv.get_into(keys, bufs) == [True] * len(keys) and bufs == blocks
        assert [bytes(b) for b in await kv.get(keys)] == blocks  # (sized by the last reply's blocks)
        assert await kv.lookup(keys) == len(keys)  # one chain, part after part
        stats = await kv.stats()
        assert stats["requests"]["put"] == (5 if limit == "frame" else 3)
        assert not stats["errors"] and stats["connections_total"] <= 4  # nothing refused, no connection lost


async def test_the_clients_own_limits_cut_a_batch_too_when_they_are_the_lower(make_server: MakeServer) -> None:
    """A request goes out within the lower of the client's ``limits`` and the server's: a client
    whose codec takes smaller frames than the server's (an older client, a tighter setting) must
    not be sent replies it would refuse, nor send requests over its own bound."""
    from kvstore.protocol import Limits

    srv = make_server("--capacity", "8MiB")
    keys = [key(i, "own-limits") for i in range(10)]
    async with AsyncKVClient(srv.addr, namespace="p", limits=Limits(max_batch=4)) as kv:
        await kv.connect()
        assert kv.nodes[0].max_batch == 4
        assert (await kv.put(keys, [bytes([i]) * 1000 for i in range(10)])).stored == 10
        assert await kv.lookup(keys) == 10
        stats = await kv.stats()
    assert stats["requests"]["put"] == 3 and stats["requests"]["lookup"] == 3 and not stats["errors"]


async def test_key_lists_over_the_servers_max_batch_go_out_in_runs(make_server: MakeServer) -> None:
    """A lookup, exists, unpin or delete of more keys than --max-batch (a very long prompt's chain)
    was refused whole (InvalidRequest); the client now sends runs the server takes, and a lookup
    stops at the first run that finds a key missing."""
    srv = make_server("--capacity", "8MiB", "--max-batch", "4")
    keys = [key(i, "key-runs") for i in range(10)]  # runs 0-3, 4-7, 8-9
    async with AsyncKVClient(srv.addr, namespace="p") as kv:
        await kv.put(keys, [bytes([i]) * 1000 for i in range(len(keys))])
        assert await kv.lookup(keys) == 10
        assert await kv.lookup(keys, pin=True) == 10
        assert await kv.unpin(keys) == 10  # every leading block was pinned once
        assert await kv.delete([keys[6], keys[9]]) == 2
        assert await kv.exists(keys) == [i not in (6, 9) for i in range(10)]
        before = (await kv.stats())["requests"]["lookup"]
        assert await kv.lookup(keys, pin=True) == 6
        assert (await kv.stats())["requests"]["lookup"] - before == 2  # the third run was not asked
        assert await kv.unpin(keys) == 6
        assert await kv.delete([keys[4]]) == 1
        assert await kv.lookup(keys) == 4  # the second run finds its first key missing
        assert await kv.delete(keys) == 7
        stats = await kv.stats()
        assert not stats["errors"] and stats["store"]["blocks"] == 0


@pytest.mark.parametrize("transport", ["tcp", "shm"])
@pytest.mark.parametrize("size, flag", [(100_000, "--max-frame-size"), (50_000, "--max-block")])
async def test_a_block_over_the_servers_limits_fails_alone_and_costs_no_connection(
        make_server: MakeServer, unix_path: str, transport: str, size: int, flag: str) -> None:
    """One block bigger than a request may carry (--max-frame-size, over the socket) or than a block
    may be (--max-block) fails with TooLarge naming the limit, its key only. Over the frame limit
    the server would take the frame for garbage and drop the connection; over --max-block it
    refused the whole batch, naming that block's size in every key's error. Through shared memory
    too: the arena once took a block over the frame limit, which no GET over a socket could read."""
    block_limit = ("--max-block", "40KiB") if flag == "--max-block" else ()
    srv = make_server("--capacity", "8MiB", "--max-frame-size", "64KiB", *block_limit, "--unix", unix_path)
    keys = [key(i, f"too-large-{size}-{transport}") for i in range(3)]
    blocks = [b"a" * 30_000, b"b" * size, b"c" * 30_000]
    async with AsyncKVClient(srv.addr if transport == "tcp" else f"unix:{unix_path}", namespace="p") as kv:
        assert (kv.nodes[0].shm is not None) == (transport == "shm")
        with pytest.raises(TooLarge, match=f"{size} bytes.*{flag}") as info:
            await kv.put(keys, blocks)
        result: Any = info.value.result  # type: ignore[attr-defined]
        assert result.statuses == ["stored", "failed", "stored"] and set(result.errors) == {1}
        assert await kv.exists(keys) == [True, False, True]
        stats = await kv.stats()  # (shm: a second connection maps the arena)
        assert stats["connections_total"] == (1 if transport == "tcp" else 2) and not stats["errors"]


async def _leases(servers: list[Any]) -> list[int]:
    out = []
    for srv in servers:
        async with AsyncKVClient(srv.addr, namespace="p") as probe:
            out.append((await probe.stats())["store"]["leases"])
    return out


async def _leases_settle(servers: list[Any], want: int = 0) -> list[int]:
    """The servers' lease counts once they reach ``want`` each (leases given back in the
    background), or as they are after 5 s."""
    for _ in range(50):
        counts = await _leases(servers)
        if counts == [want] * len(servers):
            break
        await asyncio.sleep(0.1)
    return counts


async def test_a_sharded_pinned_lookup_longer_than_max_batch_leaves_only_the_chains_leases(
        make_server: MakeServer) -> None:
    """Each server pins its share's own prefix; the leases past the chain's end are dropped after, and
    that drop must go in runs too (one UNPIN over --max-batch keys was refused, silently: the blocks
    stayed pinned until their lease ran out)."""
    servers = [make_server("--capacity", "8MiB", "--max-batch", "4") for _ in range(3)]
    keys = [key(i, "sharded-runs") for i in range(40)]
    async with AsyncKVClient([s.addr for s in servers], namespace="p") as kv:
        await kv.put(keys[:25], [bytes([i]) * 1000 for i in range(25)])
        assert await kv.delete([keys[2]]) == 1
        assert await kv.lookup(keys, pin=True) == 2
        assert sum(await _leases(servers)) == 2
        assert await kv.unpin(keys[:2]) == 2
        assert await kv.lookup(keys[3:], pin=True) == 22  # the rest of the stored chain: runs on every server
        assert sum(await _leases(servers)) == 22
        assert await kv.unpin(keys[3:25]) == 22
        assert await _leases(servers) == [0, 0, 0]


async def test_a_pinned_lookup_that_fails_gives_back_the_leases_it_took(make_server: MakeServer) -> None:
    """The caller of a failed lookup learns of no lease, so none may be left: a server that answered
    pinned its share, the caller gave up waiting for another -- the first one's leases are given
    back. A lookup that another server fails (times out) answers from the one that answered:
    the leases it keeps are the answer's."""
    up, stopped = make_server("--capacity", "8MiB"), make_server("--capacity", "8MiB")
    assert stopped.proc is not None
    kv = AsyncKVClient([up.addr, stopped.addr], namespace="p", timeout=1.0, retries=0)
    keys = [key(i, "failed-pin") for i in range(16)]
    ring = Ring([up.addr, stopped.addr])
    first_stopped = next(i for i, k in enumerate(keys) if ring.nodes[ring.node_of(k)] == stopped.addr)
    try:
        await kv.put(keys, [bytes([i]) * 1000 for i in range(16)])
        os.kill(stopped.proc.pid, signal.SIGSTOP)
        try:
            assert await kv.lookup(keys, pin=True, lease_ms=600_000) == first_stopped  # (after 1 s)
            assert await _leases([up]) == [first_stopped]  # the up server's leases past the answer dropped
            assert await kv.unpin(keys[:first_stopped]) == first_stopped
            with pytest.raises(asyncio.TimeoutError):  # a caller that gives up (a cancel) takes none
                await asyncio.wait_for(kv.lookup(keys, pin=True, lease_ms=600_000), 0.5)
        finally:
            os.kill(stopped.proc.pid, signal.SIGCONT)
        # (given back in the background; were the up server's share: until the 10-minute lease ran out)
        assert await _leases_settle([up]) == [0]
    finally:
        await kv.close()


async def test_a_pinned_lookup_cancelled_in_flight_gives_back_what_its_reply_says_it_pinned(
        make_server: MakeServer) -> None:
    """The LOOKUP was sent when the caller gave up: the server still pins (its reply came to no
    one, and the cancel cost the connection), and those leases stayed for their 10 minutes. Only
    what it pinned is given back -- the prefix up to the chain's gap -- never another client's
    leases on the keys past it."""
    srv = make_server("--capacity", "8MiB")
    assert srv.proc is not None
    kv = AsyncKVClient(srv.addr, namespace="p", timeout=10.0, pool_size=1)
    keys = [key(i, "in-flight-pin") for i in range(12)]
    try:
        await kv.put(keys, [bytes([i]) * 1000 for i in range(12)])
        assert await kv.delete(keys[4:5]) == 1  # a gap: a lookup of keys[:8] pins keys[:4]
        async with AsyncKVClient(srv.addr, namespace="p") as other:
            assert await other.lookup(keys[5:8], pin=True, lease_ms=600_000) == 3
        os.kill(srv.proc.pid, signal.SIGSTOP)  # the request waits in the server's socket
        try:
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(kv.lookup(keys[:8], pin=True, lease_ms=600_000), 0.3)
        finally:
            os.kill(srv.proc.pid, signal.SIGCONT)
        for _ in range(100):  # until the lookup has run (it pinned 4 more)...
            async with AsyncKVClient(srv.addr, namespace="p") as probe:
                if (await probe.stats())["store"]["lookups"] == 2:
                    break
            await asyncio.sleep(0.05)
        assert await _leases_settle([srv], 3) == [3]  # ... and was given back: the other client's 3 stay
        await asyncio.sleep(0.3)
        assert await _leases([srv]) == [3]
        await kv.put(keys[4:5], [bytes([4]) * 1000])
        assert await kv.lookup(keys) == 12  # (and the client goes on)
    finally:
        await kv.close()


@pytest.mark.parametrize("when", ["connecting", "waiting for a pooled connection"])
@pytest.mark.parametrize("transport", ["tcp", "shm"])
async def test_an_unpinning_get_cancelled_before_it_was_sent_gives_back_its_leases(
        make_server: MakeServer, unix_path: str, transport: str, when: str) -> None:
    """(sharding review) A get_into(unpin=True) split over pooled connections, cancelled (an engine's
    deadline) while its later parts waited for their connections, left those parts' leases for their
    whole time: they were never sent, and nothing gave them back. So did one cancelled while its
    first connection opened. Exactly one lease per key is dropped: sent, or given back."""
    srv = make_server("--capacity", "32MiB", "--unix", unix_path)
    addr = f"unix:{unix_path}" if transport == "shm" else srv.addr
    keys = [key(i, "unsent-unpin") for i in range(24)]
    async with AsyncKVClient(srv.addr, namespace="p") as other:
        await other.put(keys, [bytes([i]) * 16384 for i in range(24)])
        for _ in range(2):  # two leases per key: the load's and another reader's
            assert await other.lookup(keys, pin=True, lease_ms=600_000) == 24
    kv = AsyncKVClient(addr, namespace="p", pool_size=4, split_bytes=64 << 10)
    try:
        if when != "connecting":
            assert await kv.exists(keys[:1]) == [True]  # one connection open; the others come when asked
        load = asyncio.ensure_future(kv.get_into(keys, [bytearray(16384) for _ in keys], unpin=True))
        await asyncio.sleep(0)
        load.cancel()
        with pytest.raises(asyncio.CancelledError):
            await load
        assert await _leases_settle([srv], 24) == [24]  # (were 48 before: the unsent parts' kept)
        assert await kv.unpin(keys) == 24  # the other reader's lease on every key is still there
        assert await _leases([srv]) == [0]
    finally:
        await kv.close()


@pytest.mark.parametrize("refusal", ["too large", "shared-memory pins at their limit"])
async def test_an_unpinning_get_cancelled_then_refused_gives_back_its_leases(
        make_server: MakeServer, unix_path: str, refusal: str) -> None:
    """(fix review) A server refuses a whole GET before it drops any lease: too large for one reply
    (the client then asks for halves), or, same host, its shared-memory read pins at their limit
    (the client then reads over the socket). Cancelled before that refusal came, or between the
    halves, the get left its leases pinned for their time."""
    from kvstore.protocol import ShmGet

    shm = refusal != "too large"
    srv = make_server("--capacity", "32MiB", "--max-frame-size", "1MiB", "--unix", unix_path)
    addr = f"unix:{unix_path}" if shm else srv.addr
    keys = [key(i, "refused-unpin") for i in range(4)]
    async with AsyncKVClient(srv.addr, namespace="p") as other:
        await other.put(keys, [bytes([i]) * (400 << 10) for i in range(4)])  # 1.6 MiB: over one reply
        hog = AsyncKVClient(addr, namespace="p")
        try:
            if shm:  # another reader holds every shared-memory read pin (65,536)
                conn = await hog.nodes[0].connection()
                for _ in range(4):
                    await conn.request(ShmGet(keys=[keys[0]] * 16384, unpin=False))
            for turns in (1, 2, 4, 8, 16, 32):
                for _ in range(2):  # two leases per key: the load's and another reader's
                    assert await other.lookup(keys, pin=True, lease_ms=600_000) == 4
                kv = AsyncKVClient(addr, namespace="p", split_bytes=0)
                try:
                    await kv.ping()  # (connected: its limits known)
                    load = asyncio.ensure_future(kv.get(keys, unpin=True))
                    for _ in range(turns):
                        await asyncio.sleep(0)
                    load.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await load
                    assert await _leases_settle([srv], 4) == [4], turns  # (8: none dropped; 6: a half's kept)
                    assert await other.unpin(keys) == 4
                finally:
                    await kv.close()
        finally:
            await hog.close()


@pytest.mark.parametrize("retries", [0, 2])
async def test_a_first_call_to_a_silent_server_makes_its_own_attempts_only(retries: int) -> None:
    """Learning a server's limits before the first request is that request's own attempts: against a
    server that accepts and never answers, 1 + retries connections (an early attempt of its own made one more)."""
    accepted = 0

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal accepted
        accepted += 1
        await reader.read()  # until the client gives up
        writer.close()

    peer = await asyncio.start_server(silent, "127.0.0.1", 0)
    kv = AsyncKVClient(f"127.0.0.1:{peer.sockets[0].getsockname()[1]}", pool_size=1, connect_timeout=0.3,
                       timeout=0.3, retries=retries, backoff=0.01)
    try:
        k = key(0, "silent")
        for call, attempts in ((lambda: kv.exists([k]), 1 + retries), (lambda: kv.lookup([k], pin=True), 1)):
            accepted = 0  # (a pinned lookup must not run twice: one attempt)
            with pytest.raises(TransportError):
                await call()
            await asyncio.sleep(0.1)  # (the last connection's accept)
            assert accepted == attempts
    finally:
        await kv.close()
        peer.close()
        await peer.wait_closed()


def test_a_clients_first_call_follows_the_servers_limits(make_server: MakeServer) -> None:
    """A client that has not connected yet knows only its own limits: its first call went out whole
    (a lookup over --max-batch refused, a put over --max-frame-size cost every key and the connection)."""
    srv = make_server("--capacity", "8MiB", "--max-batch", "4", "--max-frame-size", "1MiB")
    keys = [key(i, "first-call") for i in range(10)]

    def fresh() -> KVClient:
        return KVClient(srv.addr, namespace="p")  # (no `with`, no connect(): connects on the first call)

    kv = fresh()
    try:
        assert kv.lookup(keys) == 0
    finally:
        kv.close()
    kv = fresh()
    try:
        with pytest.raises(TooLarge) as info:
            kv.put(keys[:3], [b"a" * 1000, b"b" * (2 << 20), b"c" * 1000])
        assert info.value.result.statuses == ["stored", "failed", "stored"]  # type: ignore[attr-defined]
    finally:
        kv.close()
    kv = fresh()
    try:
        assert kv.exists(keys) == [True, False, True] + [False] * 7
        assert kv.stats()["errors"] == {}
    finally:
        kv.close()


@pytest.mark.parametrize("inline", [2 << 20, 0])  # the default (a 1.5 MB put goes inline), or through the arena
async def test_a_block_over_the_frame_limit_is_refused_through_the_arena_too(
        make_server: MakeServer, unix_path: str, monkeypatch: pytest.MonkeyPatch, inline: int) -> None:
    """The arena once took a block over --max-frame-size (the socket cannot carry it): a lookup then
    found it, but no GET over a socket could ever read it (refused over the reply limit, every time),
    so a remote decode node saw a hit it could not load (protocol review). It is TooLarge either way."""
    from kvstore.client.shm import ShmChannel

    monkeypatch.setattr(ShmChannel, "inline_put_bytes", inline)
    make_server("--capacity", "8MiB", "--max-frame-size", "1MiB", "--unix", unix_path)
    block = bytes(range(256)) * 6000  # 1.5 MB
    async with AsyncKVClient(f"unix:{unix_path}", namespace="p") as kv:
        assert kv.nodes[0].shm is not None
        with pytest.raises(TooLarge, match="--max-frame-size"):
            await kv.put([key(0, "mid")], [block])
        assert await kv.lookup([key(0, "mid")]) == 0
        assert (await kv.put([key(1, "fits")], [block[:1 << 20]])).statuses == ["stored"]  # (a block that fits)


def test_a_client_that_starts_before_its_server_learns_its_limits_when_it_comes(make_server: MakeServer) -> None:
    """The first calls fail (nothing listens); the first one after the server came up is cut by its limits."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    kv = KVClient(f"127.0.0.1:{port}", namespace="p", retries=0, connect_timeout=1)
    keys = [key(i, "late") for i in range(10)]
    try:
        with pytest.raises(TransportError):
            kv.exists(keys)
        make_server("--capacity", "8MiB", "--max-batch", "4", "--port", str(port))
        assert kv.exists(keys) == [False] * 10  # (was TooLarge: the 10 keys in one request)
        assert kv.stats()["errors"] == {}
    finally:
        kv.close()


async def test_a_call_that_starts_while_the_arena_is_attached_waits_for_it(
        make_server: MakeServer, unix_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A second call arriving after the first connection's HELLO but before its arena is mapped must
    wait for the arena, not take the socket (a block over --max-frame-size got TooLarge there, when
    the arena still took such blocks)."""
    import kvstore.client.node as node

    attaching = asyncio.Event()
    real_open_channel = node.open_channel

    async def slow_open_channel(node: Any, conn: Any) -> Any:
        attaching.set()
        await asyncio.sleep(0.3)
        return await real_open_channel(node, conn)

    monkeypatch.setattr(node, "open_channel", slow_open_channel)
    make_server("--capacity", "8MiB", "--unix", unix_path)
    kv = AsyncKVClient(f"unix:{unix_path}", namespace="p")
    try:
        first = asyncio.ensure_future(kv.exists([key(0, "attach")]))
        await asyncio.wait_for(attaching.wait(), 10)
        assert (await kv.put([key(1, "attach")], [b"x" * 4096])).statuses == ["stored"]
        assert await first == [False]
        assert kv.nodes[0].shm is not None
        assert (await kv.stats())["shm"]["puts"] == 1  # (through the arena: it waited for it)
    finally:
        await kv.close()


async def test_close_right_after_a_failed_pinned_lookup_lets_its_leases_go_first(make_server: MakeServer) -> None:
    """The give-back runs in the background; close() used to cut it off (it then found the client closed)."""
    up, stopped = make_server("--capacity", "8MiB"), make_server("--capacity", "8MiB")
    assert stopped.proc is not None
    kv = AsyncKVClient([up.addr, stopped.addr], namespace="p", timeout=1.0, retries=0)
    keys = [key(i, "close-after-pin") for i in range(16)]
    await kv.put(keys, [bytes([i]) * 1000 for i in range(16)])
    os.kill(stopped.proc.pid, signal.SIGSTOP)
    try:
        with pytest.raises(asyncio.TimeoutError):  # the caller gives up: the up server's leases go back
            await asyncio.wait_for(kv.lookup(keys, pin=True, lease_ms=600_000), 0.5)
        await kv.close()
    finally:
        os.kill(stopped.proc.pid, signal.SIGCONT)
    assert await _leases([up]) == [0]


async def test_a_lookup_cancelled_while_it_drops_the_leases_past_the_chain_leaves_none(
        make_server: MakeServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cancel in the last step of a sharded pinned lookup (dropping the leases past the chain's end)
    cut that drop off, and the caller, who learns of no lease, left the chain's own pinned."""
    servers = [make_server("--capacity", "8MiB") for _ in range(3)]
    keys = [key(i, "cancel-drop") for i in range(40)]
    dropping = asyncio.Event()
    real = AsyncKVClient._unpin_quietly

    async def slow_unpin(leases: Any) -> None:
        dropping.set()
        await asyncio.sleep(0.3)
        await real(leases)

    async with AsyncKVClient([s.addr for s in servers], namespace="p") as kv:
        await kv.put(keys, [bytes([i]) * 1000 for i in range(40)])
        assert await kv.delete([keys[5]]) == 1
        monkeypatch.setattr(AsyncKVClient, "_unpin_quietly", staticmethod(slow_unpin))
        task = asyncio.ensure_future(kv.lookup(keys, pin=True, lease_ms=600_000))
        await asyncio.wait_for(dropping.wait(), 10)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(50):
            if sum(await _leases(servers)) == 0:
                break
            await asyncio.sleep(0.1)
        assert await _leases(servers) == [0, 0, 0]


async def test_a_lookup_does_not_wait_to_give_back_the_leases_of_a_server_that_failed(
        make_server: MakeServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """A server that pinned its share's first run and then stopped answering: the drop of the
    leases past the answer waited on it too (a new connection's HELLO: connect_timeout)."""
    from kvstore.client.node import Node
    from kvstore.protocol import Lookup

    a, b = make_server("--capacity", "8MiB"), make_server("--capacity", "8MiB", "--max-batch", "4")
    assert b.proc is not None
    keys = [key(i, "fail-between-runs") for i in range(40)]
    ring = Ring([a.addr, b.addr])
    assert sum(ring.nodes[ring.node_of(k)] == b.addr for k in keys) > 4  # b's share takes two runs or more
    kv = AsyncKVClient([a.addr, b.addr], namespace="p", timeout=1.0, connect_timeout=30.0, retries=0)
    lookups_to_b = 0
    real_call = Node.call

    async def call(self: Node, msg: Any, *args: Any, **kwargs: Any) -> Any:
        nonlocal lookups_to_b
        if isinstance(msg, Lookup) and self.addr == b.addr:
            lookups_to_b += 1
            if lookups_to_b == 2:  # b answered its first run; it stops before the second
                os.kill(b.proc.pid, signal.SIGSTOP)
        return await real_call(self, msg, *args, **kwargs)

    try:
        await kv.put(keys, [bytes([i]) * 100 for i in range(40)])
        monkeypatch.setattr(Node, "call", call)
        try:  # answered after b's 1 s timeout, not after a 30 s HELLO to give b's leases back
            n = await asyncio.wait_for(kv.lookup(keys, pin=True, lease_ms=600_000), 15)
        finally:
            os.kill(b.proc.pid, signal.SIGCONT)
        first_b = next(i for i, k in enumerate(keys) if ring.nodes[ring.node_of(k)] == b.addr)
        assert n == first_b  # b failed: its keys count as missing
        assert await _leases([a]) == [sum(ring.nodes[ring.node_of(k)] == a.addr for k in keys[:n])]
    finally:
        await kv.close()


async def test_a_server_restarted_with_smaller_limits_gets_requests_cut_to_them(make_server: MakeServer) -> None:
    """The first call after the restart was cut to the old server's limits: TooLarge ("batch of 10
    keys is over the limit of 4"), where docs/client.md promises a call too big for one request goes out
    as several."""
    first = make_server("--capacity", "8MiB")
    keys = [key(i, "smaller-limits") for i in range(10)]
    async with AsyncKVClient(first.addr, namespace="p") as kv:
        assert (await kv.put(keys[:2], [b"x"] * 2)).stored == 2
        port = first.port
        first.stop()
        make_server("--capacity", "8MiB", "--port", str(port), "--max-batch", "4")
        await asyncio.sleep(0.2)  # (the client's loop sees its connections close)
        assert (await kv.put(keys, [bytes([i]) * 100 for i in range(10)])).stored == 10
        assert await kv.lookup(keys) == 10 and await kv.exists(keys) == [True] * 10
        assert [bytes(b) for b in await kv.get(keys)] == [bytes([i]) * 100 for i in range(10)]


@pytest.mark.parametrize("transport", ["tcp", "shm"])
async def test_a_quarantined_server_is_not_asked_until_its_time_is_up(
        make_server: MakeServer, unix_path: str, transport: str) -> None:
    """A server that stopped answering cost a scheduler one timeout per request, step after step
    (vLLM: 8.6 s per step for 4 requests); with ``quarantine`` it costs one, then calls fail at
    once until the time is up, and each failure in a row doubles it."""
    srv = make_server("--capacity", "8MiB", "--unix", unix_path)
    assert srv.proc is not None
    keys = [key(i, "quarantine") for i in range(3)]
    addr = f"unix:{unix_path}" if transport == "shm" else srv.addr
    async with AsyncKVClient(addr, namespace="q", timeout=0.5, connect_timeout=0.5, retries=0,
                             quarantine=0.4) as kv:
        await kv.put(keys, [b"x" * 3000] * 3)
        os.kill(srv.proc.pid, signal.SIGSTOP)
        try:
            with pytest.raises(RequestTimeout):
                await kv.get(keys)  # (through the arena for shm)
            for call in (kv.lookup(keys), kv.get(keys), kv.exists(keys), kv.stats()):
                with pytest.raises(TransportError, match="quarantine"):  # not asked: it did not wait
                    await call
            assert kv.nodes[0].failures == 1
            await asyncio.sleep(0.5)
            with pytest.raises(TransportError, match="within 0.5s"):  # the time is up: asked again (a new
                await kv.lookup(keys)  # connection's HELLO, or the old one's request), still silent
            assert kv.nodes[0].failures == 2  # (quarantined for 0.8 s now)
            with pytest.raises(TransportError, match="quarantine"):
                await kv.lookup(keys)
        finally:
            os.kill(srv.proc.pid, signal.SIGCONT)
        await asyncio.sleep(0.9)
        assert await kv.lookup(keys) == 3 and kv.nodes[0].failures == 0
        assert [bytes(b) for b in await kv.get(keys) if b is not None] == [b"x" * 3000] * 3
    with pytest.raises(Exception, match="quarantine"):
        AsyncKVClient(srv.addr, quarantine=-1)


async def test_calls_that_time_out_together_count_as_one_failure_of_the_server(make_server: MakeServer) -> None:
    """Four requests in flight when a server stalls all time out at once: one failure, one
    quarantine of its base length -- not four in a row (a mutant counted each: 8x as long, and
    a scheduler's lookups missed for 3.2 s after the server came back instead of 0.4)."""
    srv = make_server("--capacity", "64MiB")
    assert srv.proc is not None
    keys = [key(i, "together") for i in range(4)]
    async with AsyncKVClient(srv.addr, namespace="q", timeout=0.5, retries=0, quarantine=0.4, pool_size=4) as kv:
        await kv.put(keys, [b"x" * 3000] * 4)
        await asyncio.gather(*(kv.put([key(10 + i, "open")], [bytes(4 << 20)]) for i in range(4)))  # (4 connections)
        os.kill(srv.proc.pid, signal.SIGSTOP)
        try:
            got = await asyncio.gather(*(kv.lookup(keys[:i + 1]) for i in range(4)), return_exceptions=True)
        finally:
            os.kill(srv.proc.pid, signal.SIGCONT)
        assert all(isinstance(g, RequestTimeout) for g in got), got
        assert kv.nodes[0].failures == 1
        await asyncio.sleep(0.6)  # (past the one quarantine)
        assert await kv.lookup(keys) == 4


async def test_a_quarantined_server_still_gets_the_leases_it_gave_back(make_server: MakeServer) -> None:
    """A pinned lookup whose caller gave up hands its reply's leases to an UNPIN; when another call
    had timed out meanwhile, quarantine refused that UNPIN at once, and the leases stayed their
    whole term though the server answered again."""
    srv = make_server("--capacity", "64MiB", "--lease-seconds", "60")
    assert srv.proc is not None
    keys = [key(i, "orphan") for i in range(8)]
    async with AsyncKVClient(srv.addr, namespace="o", timeout=1.0, retries=0, quarantine=5, pool_size=4) as kv:
        await kv.put(keys, [b"x" * 100] * 8)
        # the pool's connections open (4 puts at once): each lookup below goes out on one
        await asyncio.gather(*(kv.put([key(50 + i, "big")], [os.urandom(4 << 20)]) for i in range(4)))
        os.kill(srv.proc.pid, signal.SIGSTOP)
        try:
            timing_out = asyncio.ensure_future(kv.lookup([key(99, "none")]))
            await asyncio.sleep(0.5)
            pinned = asyncio.ensure_future(kv.lookup(keys, pin=True))  # sent on another connection
            await asyncio.sleep(0.1)
            pinned.cancel()  # its caller gives up: its reply's leases go back when it comes
            with pytest.raises(RequestTimeout):
                await timing_out  # ... and the server is quarantined
        finally:
            os.kill(srv.proc.pid, signal.SIGCONT)
        async with AsyncKVClient(srv.addr, namespace="o") as observer:
            for _ in range(100):  # (the pinned lookup's reply, then its UNPIN)
                if (await observer.stats())["store"]["leases"] == 0:
                    break
                await asyncio.sleep(0.02)
            assert (await observer.stats())["store"]["leases"] == 0


async def test_requests_queued_behind_a_cancelled_put_are_sent_again_even_pinned(make_server: MakeServer) -> None:
    """A caller cancelling its put while the payload goes out ends the connection; the requests
    queued behind it on that connection never reached the server. A pinned lookup, an unpinning
    get and an unpin (not retried: they must not run twice) failed with TransportError anyway."""
    srv = make_server("--capacity", "64MiB")
    keys = [key(i, "behind") for i in range(4)]
    aborted = 0
    async with AsyncKVClient(srv.addr, namespace="q", pool_size=1) as kv:
        await kv.put(keys, [b"x" * 4096] * 4)
        for trial in range(5):
            big = [key(i, f"big{trial}") for i in range(4)]
            put = asyncio.ensure_future(kv.put(big, [bytes(4 << 20)] * 4))  # 16 MiB going out first
            await asyncio.sleep(0)
            pinned = asyncio.ensure_future(kv.lookup(keys, pin=True))  # behind it, on the same connection
            await asyncio.sleep(0.002)
            assert not put.done()
            (conn,) = kv.nodes[0].conns
            put.cancel()
            await asyncio.gather(put, return_exceptions=True)
            aborted += conn.closed  # (cancelled mid-payload: the connection ended; else the put had gone out)
            assert await pinned == 4  # (sent again on a new connection)
            assert await kv.get(keys, unpin=True) is not None
            assert (await kv.stats())["store"]["leases"] == 0
        stats = await kv.stats()
    assert stats["store"]["lookups"] == 5 and aborted  # each pinned lookup ran once


async def test_an_unpinning_get_that_never_went_out_gives_back_its_leases_when_not_retried(
        make_server: MakeServer) -> None:
    """With retries=0, an unpinning get queued behind a put cancelled mid-payload fails: its
    connection ended before any of its bytes went out. The leases it was to drop are given back
    (they held the blocks for the lease's whole time: the give-back took it for sent)."""
    srv = make_server("--capacity", "64MiB", "--lease-seconds", "600")
    keys = [key(i, "unsent-no-retry") for i in range(4)]
    async with AsyncKVClient(srv.addr, namespace="q", pool_size=1, retries=0) as kv:
        await kv.put(keys, [b"x" * 4096] * 4)
        for trial in range(5):  # (until one cancel finds the put still going out)
            assert await kv.lookup(keys, pin=True) == 4
            conn, load = await behind_a_cancelled_put(kv, f"no-retry-big{trial}", lambda: kv.get(keys, unpin=True))
            if conn.closed:
                with pytest.raises(TransportError):
                    await load
                assert await _leases_settle([srv]) == [0]
                break
            assert await load is not None
            assert await _leases([srv]) == [0]
        else:
            pytest.fail("no put was still going out when cancelled")


async def test_a_connect_that_fails_does_not_wait_for_connects_other_callers_began_since() -> None:
    """A call whose own connect failed waited for every connect still in progress, also those
    other callers began after it: against a silent server an attempt cost up to twice
    connect_timeout, and a call up to ~5.4 s where its connect_timeout * (1 + retries) was 3 s."""
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # until the client gives up
        writer.close()

    peer = await asyncio.start_server(silent, "127.0.0.1", 0)
    kv = AsyncKVClient(f"127.0.0.1:{peer.sockets[0].getsockname()[1]}", pool_size=2, connect_timeout=1.0,
                       retries=0)
    try:
        first = asyncio.ensure_future(kv.exists([key(0, "first")]))
        await asyncio.sleep(0.5)
        second = asyncio.ensure_future(kv.exists([key(1, "second")]))  # its own connect, 0.5 s behind
        await asyncio.sleep(0)
        with pytest.raises(TransportError, match="did not answer HELLO"):
            await first
        assert not second.done() and len(kv.nodes[0].opening) == 1  # (it had waited for this one too)
        with pytest.raises(TransportError, match="did not answer HELLO"):
            await second
    finally:
        await kv.close()
        peer.close()
        await peer.wait_closed()


async def test_over_tls_requests_behind_a_cancelled_put_are_not_taken_for_unsent(make_server: MakeServer,
                                                                                 tls_files: dict[str, Path]) -> None:
    """Over TLS the transport's buffer counts ciphertext (records larger than the frames given it),
    so what had gone out could not be told from what had not: a pinned lookup that had reached the
    server was sent again, and its leases doubled (review). Over TLS none is taken for unsent."""
    srv = make_server("--capacity", "64MiB", "--tls-cert", str(tls_files["cert"]), "--tls-key", str(tls_files["key"]))
    keys = [key(i, "tls-behind") for i in range(4)]
    async with AsyncKVClient(srv.addr, namespace="q", pool_size=1, tls=str(tls_files["ca"])) as kv:
        await kv.put(keys, [b"x" * 4096] * 4)
        for trial in range(5):  # (until one cancel finds the put still going out: a slow machine may drain it)
            put = asyncio.ensure_future(kv.put([key(i, f"tls-big{trial}") for i in range(8)], [bytes(4 << 20)] * 8))
            await asyncio.sleep(0)
            pinned = asyncio.ensure_future(kv.lookup(keys, pin=True))
            await asyncio.sleep(0.002)
            (conn,) = kv.nodes[0].conns
            put.cancel()
            await asyncio.gather(put, return_exceptions=True)
            if conn.closed:  # (cancelled mid-payload: the connection ended)
                with pytest.raises(TransportError, match="request cancelled; connection discarded"):
                    await pinned  # (not sent again: it may have run)
                break
            if await pinned:
                await kv.unpin(keys)
        else:
            pytest.fail("no put was still going out when cancelled")


async def test_an_unpin_is_sent_to_a_quarantined_server_even_with_no_connection_open(make_server: MakeServer) -> None:
    """(docs review) ``unpin`` is always tried under ``quarantine``; but with no connection to the
    server open (its last one ended with the timeout that quarantined it), the PING that learns
    its limits first was refused for the quarantine, and the leases stayed their whole term."""
    srv = make_server("--capacity", "64MiB", "--lease-seconds", "60")
    assert srv.proc is not None
    keys = [key(i, "unpin-q") for i in range(4)]
    async with AsyncKVClient(srv.addr, namespace="u", timeout=0.5, retries=0, quarantine=30, pool_size=1) as kv:
        await kv.put(keys, [b"x" * 100] * 4)
        assert await kv.lookup(keys, pin=True) == 4
        os.kill(srv.proc.pid, signal.SIGSTOP)
        try:
            with pytest.raises(RequestTimeout):
                await kv.lookup([key(99, "none")])  # the connection is dropped, the server quarantined
        finally:
            os.kill(srv.proc.pid, signal.SIGCONT)
        assert not kv.nodes[0].limits_known
        with pytest.raises(TransportError, match="quarantine"):
            await kv.lookup(keys)  # (still quarantined)
        assert await kv.unpin(keys) == 4
    async with AsyncKVClient(srv.addr, namespace="u") as observer:
        assert (await observer.stats())["store"]["leases"] == 0
