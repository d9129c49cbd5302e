"""AsyncKVClient's data path against a real server: recycled ``get`` buffers, reads split over
the pool's connections, request timeouts, and requests posted without waiting for their answer."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import sys
import time
from typing import Callable

import numpy as np
import pytest

from kvstore.bench.common import make_keys
from kvstore.client import AsyncKVClient, KVClient
from kvstore.errors import BlockSizeError, InvalidRequest, RequestTimeout, TransportError
from kvstore.protocol import Ping, Unpin
from kvstore.server.process import ServerProcess

from shm_helpers import unix_path  # noqa: F401  (a fixture)



class WeakBuffer(bytearray):
    """A bytearray that can be weakly referenced (to see that nothing holds it any more)."""


async def test_get_recycles_only_dropped_buffers() -> None:
    with ServerProcess("--capacity", "32MiB") as srv:
        async with AsyncKVClient(srv.addr, namespace="t", recycle_bytes=8 << 20) as kv:
            keys = make_keys("r", 4)
            blocks = [bytes([i + 1]) * 65536 for i in range(4)]
            await kv.put(keys, blocks)
            first = await kv.get(keys)
            kept = first[0]  # the caller still holds block 0 (and a view of block 1)
            view = memoryview(first[1])
            ids = [id(b) for b in first]
            del first
            gc.collect()
            second = await kv.get(keys)
            assert [bytes(b) for b in second] == blocks
            reused = {id(b) for b in second} & set(ids)
            assert reused == set(ids[2:])  # the dropped ones serve again (already touched); held ones never
            assert bytes(kept) == blocks[0] and bytes(view) == blocks[1]
            await kv.put(make_keys("r2", 1), [b"\x07" * 65536])
            assert bytes(kept) == blocks[0]  # a held block never changes under its owner


def test_the_recycler_lets_go_of_dropped_buffers_of_a_size_no_longer_asked_for() -> None:
    """Full of one size, a request of another size frees dropped buffers of the first (held ones
    stay held, and are never handed out); the held bytes stay within the bound."""
    from kvstore.client.buffers import Recycler

    r = Recycler(max_bytes=4 * 1000)
    small = [r.take(1000) for _ in range(4)]
    assert r.held == 4000
    kept = small[0]
    del small
    big = r.take(2000)  # no room: the dropped 1000-byte buffers go, the held one stays
    assert len(big) == 2000 and r.held == 1000 + 2000
    assert r.take(1000) is not kept and r.take(2000) is not big  # (held ones never come back)
    assert r.held <= r.max_bytes


async def test_large_read_is_split_over_connections() -> None:
    with ServerProcess("--capacity", "64MiB") as srv:
        async with AsyncKVClient(srv.addr, namespace="t", pool_size=4, split_bytes=256 << 10) as kv:
            keys = make_keys("s", 24)
            blocks = [os.urandom(100_000 + i) for i in range(24)]
            present = [i for i in range(24) if i % 5]
            await kv.put([keys[i] for i in present], [blocks[i] for i in present])
            for _ in range(2):  # the second get knows the block size, so it splits too
                out = await kv.get(keys)
                assert [None if b is None else bytes(b) for b in out] == [
                    blocks[i] if i in present else None for i in range(24)]
            bufs = [bytearray(len(b)) for b in blocks]
            assert await kv.get_into(keys, bufs) == [i in present for i in range(24)]
            assert all(bufs[i] == blocks[i] for i in present)
            assert len(kv.nodes[0].conns) > 1


async def test_request_timeout_discards_the_connection() -> None:
    with ServerProcess("--capacity", "16MiB") as srv:
        async with AsyncKVClient(srv.addr, namespace="t", timeout=0.5) as kv:
            keys = make_keys("t", 1)
            await kv.put(keys, [b"x" * 1000])
            assert srv.proc is not None
            os.kill(srv.proc.pid, signal.SIGSTOP)
            try:
                with pytest.raises(RequestTimeout):
                    await kv.get(keys)
                assert all(c.closed for c in kv.nodes[0].conns)
            finally:
                os.kill(srv.proc.pid, signal.SIGCONT)
            assert bytes((await kv.get(keys))[0]) == b"x" * 1000  # a new connection


async def test_a_posted_request_is_answered_and_dropped_even_when_it_fails(caplog: pytest.LogCaptureFixture) -> None:
    with ServerProcess("--capacity", "16MiB") as srv:
        async with AsyncKVClient(srv.addr, namespace="t", pool_size=1) as kv:
            conn = await kv.nodes[0].connection()
            with caplog.at_level(logging.ERROR):
                conn.post(Ping())
                conn.post(Unpin(keys=[b""]))  # an invalid key: the server answers with an error frame
                assert conn.in_flight == 2
                assert await kv.ping() >= 0  # answered behind the two posted requests, on the same connection
                assert conn.in_flight == 0 and not conn.closed
                gc.collect()
            assert not [r for r in caplog.records if "exception was never retrieved" in r.getMessage()]
            conn.close()
            conn.post(Ping())  # a closed connection sends nothing and raises nothing


async def test_bytes_like_keys_are_sent_as_bytes_and_bad_keys_are_refused_before_the_wire() -> None:
    with ServerProcess("--capacity", "16MiB") as srv:
        async with AsyncKVClient(srv.addr, namespace="t", pool_size=1) as kv:
            keys = make_keys("bl", 3)
            await kv.put([bytearray(keys[0]), memoryview(keys[1]), keys[2]], [b"a", b"b", b"c"])
            assert [bytes(b) for b in await kv.get(keys)] == [b"a", b"b", b"c"]
            for bad in (["text"], [b""], [keys[0], b"x" * 129], [7]):
                with pytest.raises(InvalidRequest, match="block key must be"):
                    await kv.lookup(bad)  # type: ignore[arg-type]
            assert "lookup" not in (await kv.stats())["requests"]  # refused before the wire


async def test_a_read_over_two_servers_returns_only_once_every_part_has_settled() -> None:
    """One server's share fails at once (its blocks do not fit their buffers); the other is stopped.
    The call must not raise until the stopped server's part has landed: it writes into the buffers."""
    with ServerProcess("--capacity", "16MiB") as slow, ServerProcess("--capacity", "16MiB") as fast:
        async with AsyncKVClient([slow.addr, fast.addr], namespace="t") as kv:
            on = {addr: [k for k in make_keys("both", 40) if kv.ring.nodes[kv.ring.node_of(k)] == addr]
                  for addr in (slow.addr, fast.addr)}
            keys = on[slow.addr][:3] + on[fast.addr][:3]
            await kv.put(keys, [b"\x01" * 1000] * 3 + [b"\x02" * 2000] * 3)
            bufs = [bytearray(1000) for _ in keys]
            assert slow.proc is not None
            os.kill(slow.proc.pid, signal.SIGSTOP)
            try:
                call = asyncio.ensure_future(kv.get_into(keys, bufs))
                await asyncio.sleep(0.3)  # the fast server's refusal is in by now
                assert not call.done()  # (it raised here, and the stopped server's reply landed later)
            finally:
                os.kill(slow.proc.pid, signal.SIGCONT)
            with pytest.raises(BlockSizeError):
                await call
            assert bufs[:3] == [b"\x01" * 1000] * 3  # landed before the call raised


async def test_a_block_larger_than_its_buffer_fails_alone_when_the_reply_is_over_the_limit() -> None:
    """Blocks sized for their buffers fit one reply, but one stored block is larger than its
    buffer and the blocks found add up to more than the server's --max-frame-size: refused
    whole (TooLarge), the share failed every key. Asked in halves, only that key fails."""
    with ServerProcess("--capacity", "16MiB", "--max-frame-size", "1MiB") as srv:
        async with AsyncKVClient(srv.addr, namespace="t") as kv:
            keys = make_keys("over", 8)
            blocks = [bytes([i]) * (900_000 if i == 5 else 100_000) for i in range(8)]
            await kv.put(keys, blocks)
            assert await kv.lookup(keys, pin=True) == 8
            bufs = [bytearray(100_000) for _ in keys]  # 800,000 bytes asked: one request
            with pytest.raises(BlockSizeError) as info:
                await kv.get_into(keys, bufs, unpin=True)
            assert list(info.value.errors) == [5]  # type: ignore[attr-defined]
            assert [bytes(b) for i, b in enumerate(bufs) if i != 5] == [b for i, b in enumerate(blocks) if i != 5]
            assert (await kv.stats())["store"]["pinned_blocks"] == 0  # (each lease dropped by the half that read it)


async def test_requests_that_must_not_run_twice_are_not_retried() -> None:
    """A connection lost after a request was sent: a plain lookup is asked again; one that pins,
    or a get that unpins, raises instead (the server may have run it: leases would double)."""
    with ServerProcess("--capacity", "16MiB") as srv:
        async with AsyncKVClient(srv.addr, namespace="t", pool_size=1) as kv:
            keys = make_keys("once", 3)
            await kv.put(keys, [b"x"] * 3)
            for call, retried in ((lambda: kv.lookup(keys), True), (lambda: kv.lookup(keys, pin=True), False),
                                  (lambda: kv.get(keys, unpin=True), False), (lambda: kv.get(keys), True)):
                conn = await kv.nodes[0].connection()  # the one connection the call will use
                task = asyncio.ensure_future(call())
                for _ in range(10):  # until the request is on the wire (a pinned lookup sends from a task of its own)
                    if conn.in_flight:
                        break
                    await asyncio.sleep(0)
                assert conn.in_flight == 1
                conn.abort(TransportError("connection lost"))
                if retried:
                    assert await task
                else:
                    with pytest.raises(TransportError):
                        await task


async def test_a_closed_client_stays_closed_until_connect() -> None:
    with ServerProcess("--capacity", "16MiB") as srv:
        kv = AsyncKVClient(srv.addr, namespace="t")
        await kv.connect()
        await kv.put(make_keys("c", 1), [b"x"])
        await kv.close()
        with pytest.raises(TransportError, match="closed"):
            await kv.exists(make_keys("c", 1))
        assert kv.nodes[0].conns == []  # nothing reopened
        await kv.connect()
        assert await kv.exists(make_keys("c", 1)) == [True]
        await kv.close()


def test_a_blocking_client_says_whether_it_is_closed() -> None:
    """(``AsyncKVClient.closed`` existed; ``KVClient.closed`` raised AttributeError)"""
    with ServerProcess("--capacity", "16MiB") as srv:
        kv = KVClient(srv.addr, namespace="t")
        assert not kv.closed
        kv.close()
        assert kv.closed
        with pytest.raises(TransportError, match="closed"):
            kv.exists(make_keys("c", 1))
        kv.connect()
        assert not kv.closed and kv.exists(make_keys("c", 1)) == [False]
        kv.close()


def test_a_blocking_client_used_after_fork_raises_in_the_child() -> None:
    with ServerProcess("--capacity", "16MiB") as srv, KVClient(srv.addr, namespace="t") as kv:
        kv.put(make_keys("f", 1), [b"x"])
        pid = os.fork()
        if pid == 0:  # the child: its copy of the client has no loop thread behind it
            signal.signal(signal.SIGALRM, signal.SIG_DFL)  # (pytest-timeout's handler would not end a hung child)
            signal.alarm(10)  # (it used to wait forever)
            try:
                kv.exists(make_keys("f", 1))
                code = 1
            except TransportError:
                code = 0
            except BaseException:
                code = 2
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert kv.exists(make_keys("f", 1)) == [True]  # the parent's client is fine


def test_an_interrupted_blocking_call_writes_nothing_into_its_buffer_after_it_raises() -> None:
    with ServerProcess("--capacity", "16MiB") as srv, KVClient(srv.addr, namespace="t", pool_size=1) as kv:
        k = make_keys("int", 1)
        kv.put(k, [b"x" * 1000])
        buf = bytearray(1000)
        assert srv.proc is not None
        os.kill(srv.proc.pid, signal.SIGSTOP)  # the get_into below waits
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        old = signal.signal(signal.SIGALRM, signal.default_int_handler)  # a Ctrl-C, in effect
        try:
            with pytest.raises(KeyboardInterrupt):
                kv.get_into(k, [buf])
            buf[:] = b"y" * 1000  # the caller's again
        finally:
            signal.signal(signal.SIGALRM, old)
            os.kill(srv.proc.pid, signal.SIGCONT)
        assert kv.ping() >= 0  # (answered after the interrupted get's reply, on the same connection)
        assert buf == b"y" * 1000  # that reply was read and dropped
        (conn,) = kv._aio.nodes[0].conns
        assert not conn.closed  # and the connection kept
        assert kv.get_into(k, [buf]) == [True] and buf == b"x" * 1000


@pytest.mark.parametrize("setting", [{"recycle_bytes": "x"}, {"recycle_bytes": None}, {"split_bytes": "x"},
                                     {"split_bytes": -1}, {"limits": None}, {"pool_size": 0}, {"shm": "yes"},
                                     {"namespace": ""}, {"namespace": "n" * 257}, {"namespace": None},
                                     {"namespace": "a\udc80"}])
def test_bad_settings_are_invalid_requests_when_the_client_is_made(setting: dict[str, object]) -> None:
    """(they raised TypeError or AttributeError, one only at the first get; pool_size=0 meant 1; a bad
    namespace was refused by the server's HELLO at the first call)"""
    with pytest.raises(InvalidRequest, match=next(iter(setting))):
        AsyncKVClient("127.0.0.1:7600", **setting)  # type: ignore[arg-type]


async def test_flush_of_an_empty_or_non_string_namespace_is_refused_not_taken_for_the_own(kv_server: ServerProcess) -> None:
    """(``namespace or self.namespace``: flush("") -- an unset variable, say -- emptied the client's own)"""
    async with AsyncKVClient(kv_server.addr, namespace="flush-own") as kv:
        keys = make_keys("flush-own", 3)
        await kv.put(keys, [b"x" * 100] * 3)
        for bad in ("", 0, False, b"", "n" * 257):
            with pytest.raises(InvalidRequest, match="namespace is a string of 1..256 characters"):
                await kv.flush(bad)  # type: ignore[arg-type]
        for servers, says in ((5, "not int"), ([kv.nodes[0].addr, 5], "address strings")):  # (docs review: TypeError)
            with pytest.raises(InvalidRequest, match=f"servers must be .*{says}"):
                await kv.flush(servers=servers)  # type: ignore[arg-type]
        assert await kv.exists(keys) == [True] * 3
        assert await kv.flush("other") == 0 and await kv.flush() == 3


async def test_pin_and_unpin_flags_that_are_truthy_but_not_bool_mean_what_they_say(kv_server: ServerProcess) -> None:
    """The server takes only true or false for pin/unpin (a pin="false" from another client pinned):
    the client sends 1, 0 and numpy bools as the booleans they equal, and refuses anything else."""
    async with AsyncKVClient(kv_server.addr, namespace="truthy") as kv:
        keys = make_keys("truthy", 2)
        await kv.put(keys, [b"x" * 100] * 2)
        assert await kv.lookup(keys, pin=1) == 2  # type: ignore[arg-type]
        assert await kv.get(keys, unpin=np.True_) is not None  # type: ignore[arg-type]
        assert await kv.get_into(keys, [bytearray(100) for _ in keys], unpin=0) == [True, True]  # type: ignore[arg-type]
        assert (await kv.stats())["store"]["leases"] == 0
        bads: list[object] = ["false", "no", 2, None, np.array([True, False])]
        with contextlib.suppress(ImportError):  # (the suite runs without torch too: the client's extra)
            import torch

            bads.append(torch.tensor([True, False]))
        for bad in bads:
            with pytest.raises(InvalidRequest, match="pin must be True or False"):
                await kv.lookup(keys, pin=bad)  # type: ignore[arg-type]
            with pytest.raises(InvalidRequest, match="unpin must be True or False"):
                await kv.get(keys, unpin=bad)  # type: ignore[arg-type]
            with pytest.raises(InvalidRequest, match="strict must be True or False"):  # (docs review)
                await kv.exists(keys, strict=bad)  # type: ignore[arg-type]
        assert (await kv.stats())["store"]["leases"] == 0


@pytest.mark.parametrize("lease_ms", [10**30, 0, -5, 2.5, "5"])
async def test_a_bad_lease_is_refused_before_the_wire_by_name(lease_ms: object) -> None:
    """(10**30 said "cannot encode Lookup: Integer value out of range", naming msgpack, not lease_ms)"""
    kv = AsyncKVClient("127.0.0.1:1")  # (nothing listens there: the check comes first)
    with pytest.raises(InvalidRequest, match="lease_ms must be a positive integer of milliseconds"):
        await kv.lookup([bytes(32)], pin=True, lease_ms=lease_ms)  # type: ignore[arg-type]
    await kv.close()


def test_the_blocking_client_shows_the_async_clients_parameters() -> None:
    """KVClient(addr, **kwargs) showed help() no parameter at all; a misspelt one still fails at once."""
    import inspect

    assert inspect.signature(KVClient) == inspect.signature(AsyncKVClient)
    assert "pool_size" in inspect.signature(KVClient).parameters
    with pytest.raises(TypeError, match="pool_sise"):
        KVClient("127.0.0.1:7600", pool_sise=2)


@pytest.mark.parametrize("addr", ["http://127.0.0.1:7600", "redis://127.0.0.1:7600", "127.0.0.1", "h:0"])
def test_an_address_that_is_not_host_port_is_an_invalid_request(addr: str) -> None:
    """(a URL was taken for a host named "http://127.0.0.1" and failed at the resolver, a TransportError)"""
    with pytest.raises(InvalidRequest, match="host:port"):
        AsyncKVClient(addr)


async def test_keys_of_any_iterable_empty_buffers_of_any_shape_and_a_misfit_named_by_its_key() -> None:
    with ServerProcess("--capacity", "16MiB") as srv:
        async with AsyncKVClient(srv.addr, namespace="t", pool_size=2, split_bytes=1 << 20) as kv:
            empty, keys = make_keys("empty", 1), make_keys("shapes", 4)
            await kv.put(iter(empty), [np.zeros((0, 4))])  # an empty block, whatever its shape
            assert await kv.get_into(iter(empty), [np.zeros((0, 4))]) == [True]  # (keys: no len needed)
            blocks = [bytes([i]) * (1 << 20) for i in range(4)]
            await kv.put(keys, blocks)
            bufs = [bytearray(1 << 20) for _ in range(3)] + [bytearray(100)]
            with pytest.raises(BlockSizeError) as info:  # split in two parts: key 3 is the second part's 1
                await kv.get_into(keys, bufs)
            assert keys[3].hex() in str(info.value) and list(info.value.errors) == [3]
            assert bufs[:3] == blocks[:3]


async def test_a_recycled_buffer_its_last_holder_resized_is_not_handed_out_again() -> None:
    """A block ``get`` returned is the caller's bytearray: grown or cut before it was dropped, it came
    back from the recycler for its old size and the next get failed (ProtocolError, connection lost)."""
    with ServerProcess("--capacity", "16MiB") as srv:
        async with AsyncKVClient(srv.addr, namespace="t", pool_size=1) as kv:
            keys = make_keys("resized", 2)
            blocks = [os.urandom(65536) for _ in keys]
            await kv.put(keys, blocks)
            for resize in (lambda b: b.extend(b"tail"), lambda b: b.__delitem__(slice(10, None))):
                (mine,) = await kv.get(keys[:1])
                resize(mine)
                del mine
                for _ in range(3):
                    assert [bytes(b) for b in await kv.get(keys[1:])] == blocks[1:]
            assert kv._recycler is not None and kv._recycler.held == sum(
                len(b) for q in kv._recycler._by_size.values() for b in q)


async def test_unusable_arguments_raise_typed_errors_and_leave_nothing_pending() -> None:
    torch = pytest.importorskip("torch")
    with ServerProcess("--capacity", "16MiB") as srv:
        async with AsyncKVClient(srv.addr, namespace="t", pool_size=1) as kv:
            k = make_keys("typed", 1)
            with pytest.raises(InvalidRequest, match="bytes-like"):
                await kv.put(k, [torch.zeros(4)])
            await kv.put(k, [torch.zeros(4).view(torch.uint8).numpy()])  # the way the message names
            with pytest.raises(InvalidRequest, match="not a writable buffer"):  # (as a put's: not a size)
                await kv.get_into(k, [torch.zeros(4)])
            with pytest.raises(BlockSizeError, match="writable contiguous"):  # (a buffer, unfit)
                await kv.get_into(k, [b"abcd"])
            with pytest.raises(InvalidRequest, match="lease_ms must be"):  # (before the encoder says "encode")
                await kv.lookup(k, pin=True, lease_ms=2**70)
            assert kv.nodes[0].conns[0].in_flight == 0
            assert await kv.lookup(k) == 1


@pytest.mark.parametrize("transport", ["tcp", "shm"])
async def test_get_into_buffers_that_share_memory_are_refused_before_anything_is_read(
        make_server: Callable[..., ServerProcess], unix_path: str, transport: str) -> None:
    """One buffer for two keys: a large read is split over connections, both halves landed in it at
    once and the call returned [True, True] for bytes of neither block."""
    srv = make_server("--capacity", "128MiB", "--unix", unix_path)
    addr = f"unix:{unix_path}" if transport == "shm" else srv.addr
    async with AsyncKVClient(addr, namespace="t", shm=transport == "shm") as kv:
        keys = make_keys("alias", 3)
        size = 24 << 20
        await kv.put(keys, [bytes([0xAA]) * size, bytes([0xBB]) * size, bytes([0xCC]) * 4096])
        whole = np.zeros(size + 4096, dtype=np.uint8)
        for bufs, pair in (([whole[:size], whole[:size], whole[size:]], "0 and 1"),  # the same memory
                           ([whole[size:], whole[:size], whole[size - 4096:]], "1 and 2"),  # a tail overlapping
                           ([bytearray(size), whole[:size], whole[: size - 1]], "1 and 2"),
                           ([bytearray(size), whole[:size], whole[size - 1: size + 4095]], "1 and 2")):  # one byte
            with pytest.raises(InvalidRequest, match=f"buffers {pair} share memory"):
                await kv.get_into(keys, bufs)
            assert not whole.any()  # nothing was read into them
        empty = np.zeros(0, dtype=np.uint8)  # (empty buffers hold no memory to share)
        out = [np.zeros(size, dtype=np.uint8), whole[:size], whole[size:]]
        assert await kv.get_into(keys, out) == [True] * 3
        assert (out[0] == 0xAA).all() and (out[1] == 0xBB).all() and (out[2] == 0xCC).all()
        await kv.put(make_keys("alias-empty", 2), [b"", b""])
        assert await kv.get_into(make_keys("alias-empty", 2), [empty, empty]) == [True, True]


async def test_buffers_of_python_objects_are_refused_for_put_and_get_into() -> None:
    """A numpy array of dtype=object exports pointers: put stored them, get_into wrote block bytes
    over them and the process crashed when it read the array."""
    with ServerProcess("--capacity", "16MiB") as srv:
        async with AsyncKVClient(srv.addr, namespace="t", pool_size=1) as kv:
            k = make_keys("objects", 1)
            with pytest.raises(InvalidRequest, match="plain data, not Python objects"):
                await kv.put(k, [np.array([b"a", 1], dtype=object)])
            assert await kv.exists(k) == [False]
            await kv.put(k, [b"\x07" * 16])
            target = np.empty(2, dtype=object)
            with pytest.raises(InvalidRequest, match="plain data, not Python objects"):
                await kv.get_into(k, [target])
            assert list(target) == [None, None]  # untouched, still readable
            # plain data whose format names its fields (a letter O in a name is no object)
            record = np.zeros(2, dtype=[("Offset", "<u4"), ("len", "<u4")])
            await kv.put(make_keys("record", 1), [record])
            out = np.ones(2, dtype=record.dtype)
            assert await kv.get_into(make_keys("record", 1), [out]) == [True] and not out["Offset"].any()
            # numpy's datetime64 exports no buffer at all (a bare ValueError came out of put)
            dates = np.zeros(2, dtype="datetime64[s]")
            with pytest.raises(InvalidRequest, match="cannot include dtype 'M'"):
                await kv.put(make_keys("dates", 1), [dates])
            with pytest.raises(InvalidRequest, match="cannot include dtype 'M'"):
                await kv.get_into(make_keys("record", 1), [dates])

@pytest.mark.parametrize("transport", ["tcp", "shm"])
async def test_a_put_that_continues_a_stored_prefix_is_evicted_before_that_prefix(
        make_server: Callable[..., ServerProcess], unix_path: str, transport: str) -> None:
    """Room for 8 one-page blocks: the prefix A (4), its continuation B (4), then 4 blocks of an
    unrelated chain C must evict 4. Put with ``parent``, B goes first, as a chain's tail does;
    put without it, B counted as a newer chain of its own and A's blocks went instead."""
    srv = make_server("--capacity", "512KiB", "--page-size", "64KiB", "--unix", unix_path)
    addr = f"unix:{unix_path}" if transport == "shm" else srv.addr
    for ns, with_parent in (("linked", True), ("unlinked", False)):
        async with AsyncKVClient(addr, namespace=ns, pool_size=1, shm=transport == "shm") as kv:
            assert (kv.nodes[0].shm is not None) == (transport == "shm")
            a, b, c = make_keys(f"{ns}a", 4), make_keys(f"{ns}b", 4), make_keys(f"{ns}c", 4)
            block = [b"\x05" * 65536] * 4
            await kv.put(a, block)
            await kv.put(b, block, parent=a[-1] if with_parent else None)
            await kv.put(c, block)
            if with_parent:
                assert await kv.exists(a + b) == [True] * 4 + [False] * 4
                assert await kv.lookup(a + b) == 4
            else:
                assert await kv.exists(a + b) == [False] * 4 + [True] * 4
                assert await kv.lookup(a + b) == 0  # B is stored but unreachable
            await kv.flush(ns)


def test_helper_threads_share_a_big_batch_and_keep_job_order(monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    from kvstore.client import workers

    monkeypatch.setattr(workers, "THREADS", 3)  # whatever this machine's CPU count

    def job(i: int) -> Callable[[], tuple[int, str]]:
        return lambda: (i, threading.current_thread().name)

    enough = max(workers.PARALLEL_MIN, 10 * workers.JOB_MIN)
    big = workers.run_parallel([job(i) for i in range(10)], enough)
    assert [i for i, _ in big] == list(range(10))
    names = {name for _, name in big}
    assert threading.current_thread().name in names and any(n.startswith("kvstore-client") for n in names)
    me = {threading.current_thread().name}
    small = workers.run_parallel([job(i) for i in range(10)], workers.PARALLEL_MIN - 1)
    assert {name for _, name in small} == me  # inline: too few bytes for a hand-off
    many_small = workers.run_parallel([job(i) for i in range(64)], 64 * workers.JOB_MIN - 1)
    assert [i for i, _ in many_small] == list(range(64)) and {name for _, name in many_small} == me  # small jobs
    assert workers.PARALLEL_MIN <= 64 * workers.JOB_MIN - 1  # (so it was the jobs' size that kept them inline)


async def test_a_big_put_hashed_on_helper_threads_stores_each_blocks_own_checksum(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import xxhash

    from kvstore.client import aio, workers

    monkeypatch.setattr(workers, "THREADS", 3)
    blocks = [os.urandom(256 << 10) for _ in range(12)]  # 3 MiB: over PARALLEL_MIN
    views = [memoryview(b) for b in blocks]
    assert aio.checksums(views) == [xxhash.xxh3_64_intdigest(b) for b in blocks]
    with ServerProcess("--capacity", "32MiB") as srv:
        async with AsyncKVClient(srv.addr, namespace="t") as kv:  # verify=True: a misplaced checksum fails the get
            keys = make_keys("big", len(blocks))
            await kv.put(keys, blocks)
            assert [bytes(b) for b in await kv.get(keys)] == blocks


async def test_a_large_put_on_the_stock_asyncio_loop_is_fed_a_piece_at_a_time() -> None:
    """Before Python 3.12 the stock transport joins ``writelines`` into one bytes (a copy of the whole
    batch into fresh memory) and copies what the socket does not take at once into its own buffer:
    it is now given one piece at a time, each when its buffer is empty. Puts and small requests
    pipelined on one connection keep their bytes in order."""

    assert type(asyncio.get_running_loop()).__module__.startswith("asyncio")  # (pytest-asyncio's loop)
    with ServerProcess("--capacity", "128MiB") as srv:
        async with AsyncKVClient(srv.addr, namespace="paced", pool_size=1) as kv:
            await kv.ping()
            conn = kv.nodes[0].conns[0]
            transport = conn.transport
            assert transport is not None
            most = buffered = 0
            write = transport.write

            def watched(data: bytes) -> None:
                nonlocal most, buffered
                buffered = max(buffered, transport.get_write_buffer_size())  # (before: it was handed none)
                most = max(most, len(data))
                write(data)

            transport.write = watched  # type: ignore[method-assign]
            blocks = [[os.urandom(1 << 20) for _ in range(16)] for _ in range(3)]
            keys = [make_keys(f"paced{j}", 16) for j in range(3)]
            small = [b"s" * 100]
            calls = [kv.put(k, b) for k, b in zip(keys, blocks)] + [kv.put(make_keys("tiny", 1), small)]
            calls += [kv.exists(keys[0]) for _ in range(5)]
            results = await asyncio.gather(*calls)
            assert [r.stored for r in results[:4]] == [16, 16, 16, 1]
            for j in range(3):
                bufs = [bytearray(1 << 20) for _ in range(16)]
                assert all(await kv.get_into(keys[j], bufs))
                assert bufs == blocks[j]
            assert len(kv.nodes[0].conns) == 1 and conn.in_flight == 0
            if sys.version_info < (3, 12):  # (3.12's transport sends a list as it is)
                assert most == 1 << 20 and buffered == 0, (most, buffered)  # (connection.PIECE)


async def test_cancelling_one_request_queued_behind_a_put_leaves_the_others_waiting() -> None:
    """Requests queued behind a put that fills the socket wait on one shared future: a cancel of one
    of them cancelled it for all (the put and the others raised CancelledError, nobody's cancel)."""
    with ServerProcess("--capacity", "256MiB") as srv:
        assert srv.proc is not None
        async with AsyncKVClient(srv.addr, namespace="queued", pool_size=1, timeout=30) as kv:
            await kv.ping()
            conn = kv.nodes[0].conns[0]
            os.kill(srv.proc.pid, signal.SIGSTOP)
            try:
                keys = make_keys("queued", 48)
                put = asyncio.ensure_future(kv.put(keys, [os.urandom(1 << 20) for _ in range(48)]))
                for _ in range(100):  # until the socket is full
                    await asyncio.sleep(0.01)
                    if conn._can_write is not None:
                        break
                assert conn._can_write is not None
                others = [asyncio.ensure_future(kv.exists(keys[:1])) for _ in range(4)]
                await asyncio.sleep(0.05)
                others[0].cancel()
                await asyncio.sleep(0.05)
            finally:
                os.kill(srv.proc.pid, signal.SIGCONT)
            outcomes = await asyncio.gather(put, *others[1:], return_exceptions=True)
            assert not any(isinstance(o, asyncio.CancelledError) for o in outcomes), outcomes
            assert others[0].cancelled()


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_cancelled_put_whose_bytes_all_went_keeps_the_connection_for_the_others(make_server, unix_path: str,
                                                                                  loop: str) -> None:
    """A put cancelled once its bytes had all gone to the socket, while another caller's put still
    waited in the transport: the connection was discarded (the transport held bytes, not this put's),
    failing the other put (uvloop; and Python 3.12-3.13.1's stock loop)."""
    import uvloop

    srv = make_server("--capacity", "128MiB", "--unix", unix_path, "--no-shm")  # (a 4 MiB send buffer)
    assert srv.proc is not None

    async def main() -> None:
        async with AsyncKVClient(f"unix:{unix_path}", namespace="kept", pool_size=1, retries=0, timeout=30) as kv:
            await kv.ping()
            conn = kv.nodes[0].conns[0]
            assert conn.transport is not None
            os.kill(srv.proc.pid, signal.SIGSTOP)
            try:  # 1.5 MiB: sent from the caller's memory, and all of it fits in the socket
                a = asyncio.ensure_future(kv.put(make_keys("kept-a", 1), [os.urandom(3 << 19)]))
                for _ in range(300):
                    await asyncio.sleep(0.01)
                    if not conn.transport.get_write_buffer_size() and not conn._out:
                        break
                assert not conn.transport.get_write_buffer_size(), "the first put did not fit in the socket"
                b_keys = make_keys("kept-b", 8)
                b = asyncio.ensure_future(kv.put(b_keys, [os.urandom(4 << 20) for _ in range(8)]))
                for _ in range(300):
                    await asyncio.sleep(0.01)
                    if conn.transport.get_write_buffer_size():
                        break
                assert conn.transport.get_write_buffer_size(), "the second put's bytes should wait"
                a.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await a
                assert not conn.closed  # (was: "request cancelled; connection discarded", and b failed)
            finally:
                os.kill(srv.proc.pid, signal.SIGCONT)
            assert (await b).stored == 8
            assert await kv.lookup(b_keys) == 8

    (uvloop.run if loop == "uvloop" else asyncio.run)(main())


async def test_a_cancelled_request_leaves_the_other_requests_on_its_connection_alone() -> None:
    """One task's cancelled get_into (a wait_for timing out, before, while or after its reply comes)
    neither fails another task's pinned lookup and unpinning get on the same connection nor leaks
    their leases (it discarded the connection: they failed, and their leases waited for expiry),
    and no byte lands in its buffers after the cancel."""
    import random

    rng = random.Random(5)
    with ServerProcess("--capacity", "64MiB") as srv:
        async with AsyncKVClient(srv.addr, namespace="cancel", pool_size=1, timeout=30) as kv:
            keys = make_keys("cancel", 8)
            blocks = [os.urandom(1 << 20) for _ in keys]
            await kv.put(keys, blocks)
            (conn,) = kv.nodes[0].conns
            drops = 0
            real_drop = conn.reader.drop_payload

            def counting_drop(rid: int) -> None:
                nonlocal drops
                drops += 1
                real_drop(rid)

            conn.reader.drop_payload = counting_drop  # type: ignore[method-assign]

            async def innocent() -> None:
                n = await kv.lookup(keys, pin=True)
                bufs = [bytearray(1 << 20) for _ in range(n)]
                assert await kv.get_into(keys[:n], bufs, unpin=True) == [True] * n and bufs == blocks[:n]

            cancelled: list[list[bytearray]] = []
            for _ in range(600):  # until enough cancels came while their reply was coming in, bounded
                if len(cancelled) >= 20 and drops >= 3:
                    break
                bufs = [bytearray(1 << 20) for _ in keys]
                other = asyncio.ensure_future(innocent())
                try:
                    await asyncio.wait_for(kv.get_into(keys, bufs), rng.uniform(0, 0.008))
                except asyncio.TimeoutError:
                    for b in bufs:
                        b[:] = b"\xee" * len(b)  # the caller's again: nothing may write into it now
                    cancelled.append(bufs)
                await other
            await kv.ping()
            assert kv.nodes[0].conns == [conn] and not conn.closed  # never discarded
            assert all(b == b"\xee" * len(b) for bufs in cancelled for b in bufs)
            assert len(cancelled) >= 20 and drops >= 3  # (some cancels came while their reply was coming in)
            store = (await kv.stats())["store"]
            assert store["leases"] == 0 and store["pinned_blocks"] == 0


async def test_a_cancelled_request_whose_reply_never_comes_still_times_its_connection_out() -> None:
    """(kept for its reply, it waited forever: the connection looked busy for good)"""
    with ServerProcess("--capacity", "16MiB") as srv:
        assert srv.proc is not None
        async with AsyncKVClient(srv.addr, namespace="t", pool_size=1, timeout=0.5, retries=0) as kv:
            k = make_keys("stuck", 1)
            await kv.put(k, [b"x" * 100])
            (conn,) = kv.nodes[0].conns
            os.kill(srv.proc.pid, signal.SIGSTOP)
            try:
                with pytest.raises(asyncio.TimeoutError):
                    await asyncio.wait_for(kv.exists(k), 0.1)
                assert not conn.closed and conn.in_flight == 1  # kept, its reply awaited
                await asyncio.sleep(1.0)
                assert conn.closed and "cancelled request" in str(conn.close_reason)
            finally:
                os.kill(srv.proc.pid, signal.SIGCONT)
            assert await kv.exists(k) == [True]  # on a new connection


async def test_a_cancelled_get_into_keeps_no_reference_to_its_buffers() -> None:
    """(its reply's deadline timer held the request, and through it the caller's buffers, for the
    whole client timeout after the reply had been read and dropped)"""
    import weakref

    with ServerProcess("--capacity", "64MiB") as srv:
        async with AsyncKVClient(srv.addr, namespace="t", pool_size=1, timeout=30) as kv:
            keys = make_keys("kept", 8)
            await kv.put(keys, [bytes(1 << 20)] * 8)
            (conn,) = kv.nodes[0].conns
            refs = []
            for _ in range(20):
                bufs = [WeakBuffer(1 << 20) for _ in keys]
                refs += [weakref.ref(b) for b in bufs]
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(kv.get_into(keys, bufs), 0.001)
                del bufs
            await kv.ping()  # after every dropped reply, on the same connection
            assert kv.nodes[0].conns == [conn]
            gc.collect()
            assert not [r for r in refs if r() is not None]


async def test_a_request_cancelled_while_its_reply_payload_comes_in_lets_its_buffers_go() -> None:
    """A server that stalls half-way through a reply's payload: the cancelled request's sink, with the
    caller's buffer, stayed referenced until the connection's deadline."""
    import weakref

    from kvstore.client.connection import open_connection
    from kvstore.protocol import DEFAULT_LIMITS, NEED_DATA, Frame, FrameReader, Hello, reply

    writers: list[asyncio.StreamWriter] = []

    async def stalling(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        writers.append(w)
        frames = FrameReader(is_server=True)
        while data := await r.read(65536):
            frames.feed(data)
            while (ev := frames.next_event()) is not NEED_DATA:
                if isinstance(ev, Frame) and isinstance(ev.msg, Hello):
                    w.writelines(reply(ev.msg.OP, ev.request_id))
                elif isinstance(ev, Frame):  # a reply head, 1,000 bytes of its 1 MiB payload, then nothing
                    w.write(bytes(reply(ev.msg.OP, ev.request_id, payload_len=1 << 20)[0]) + b"x" * 1000)
            await w.drain()

    class Sink:
        def __init__(self, buf: WeakBuffer) -> None:
            self.buf, self.sizes = buf, [len(buf)]

        def target(self, i: int) -> list[memoryview]:
            return [memoryview(self.buf)]

    server = await asyncio.start_server(stalling, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    conn = await open_connection("127.0.0.1", port, namespace="t", token=None, tls=None, limits=DEFAULT_LIMITS,
                                 timeout=5)
    try:
        buf = WeakBuffer(1 << 20)
        ref = weakref.ref(buf)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(conn.request(Ping(), make_sink=lambda f: Sink(buf), timeout=30), 0.5)
        assert not conn.closed and conn.in_flight == 1  # kept: the rest of its payload is read and dropped
        del buf
        gc.collect()
        assert ref() is None
    finally:
        await conn.aclose()
        server.close()
        for w in writers:
            w.close()
            await w.wait_closed()
        await server.wait_closed()


async def test_request_ids_wrap_at_32_bits_without_losing_a_request() -> None:
    """(past 2**32 requests on one connection the id after 0 went out masked but was filed
    unmasked: its reply was 'to an unknown request' and the connection was aborted)"""
    import itertools

    with ServerProcess("--capacity", "16MiB") as srv:
        async with AsyncKVClient(srv.addr, namespace="t", pool_size=1, retries=0) as kv:
            await kv.ping()
            (conn,) = kv.nodes[0].conns
            conn._ids = itertools.count(2**32 - 2)
            for _ in range(4):
                assert await kv.exists(make_keys("wrap", 1)) == [False]
            assert kv.nodes[0].conns == [conn] and not conn.closed


async def test_a_server_lost_mid_put_leaves_no_unread_failure_behind() -> None:
    """A put cut off while its pieces were still going out: every future the connection made has its
    outcome read (asyncio logged 'Future exception was never retrieved' for the flow-control ones)."""
    seen: list[str] = []
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda _, ctx: seen.append(str(ctx.get("message"))))
    try:
        with ServerProcess("--capacity", "256MiB") as srv:
            assert srv.proc is not None
            kv = AsyncKVClient(srv.addr, namespace="lost", pool_size=1, timeout=30, retries=0)
            try:
                await kv.ping()
                conn = kv.nodes[0].conns[0]
                blocks = [os.urandom(1 << 20) for _ in range(160)]
                os.kill(srv.proc.pid, signal.SIGSTOP)
                put = asyncio.ensure_future(kv.put(make_keys("lost", 160), blocks))
                for _ in range(100):  # the socket full: the put waits for it to drain
                    await asyncio.sleep(0.01)
                    if conn._can_write is not None:
                        break
                first = conn._can_write
                assert first is not None
                os.kill(srv.proc.pid, signal.SIGCONT)
                for _ in range(100000):  # drained once ...
                    await asyncio.sleep(0)
                    if conn._can_write is not first:
                        break
                # ... and full again (stopped once more: a server reading faster than this client
                # writes never filled the socket again, and the put could end before the kill)
                os.kill(srv.proc.pid, signal.SIGSTOP)
                for _ in range(100):
                    await asyncio.sleep(0.01)
                    if conn._can_write not in (None, first):
                        break
                assert conn._can_write not in (None, first)
                os.kill(srv.proc.pid, signal.SIGKILL)
                assert not put.done()
                with pytest.raises(TransportError):
                    await put
                assert not conn._out  # (the queued pieces, the caller's blocks, let go)
            finally:
                await kv.close()
        del put, conn
        gc.collect()
        await asyncio.sleep(0.05)
        gc.collect()
        assert seen == []
    finally:
        loop.set_exception_handler(None)


async def test_a_request_the_server_refuses_before_its_payload_gets_the_servers_answer() -> None:
    """A server that refuses a frame answers at once and closes; the client, still sending, used to
    be reset mid-send and report 'connection reset by peer' without reading the answer; and a
    request answered before all of it was sent returned while its payload (the caller's memory)
    was still queued to go out."""
    from kvstore.client.connection import open_connection
    from kvstore.errors import ProtocolError
    from kvstore.messages import Put
    from kvstore.protocol import Limits

    block = bytearray(os.urandom(64 << 20))
    with ServerProcess("--capacity", "128MiB", "--max-frame-size", "4MiB") as srv:
        for _ in range(5):
            conn = await open_connection("127.0.0.1", srv.port, namespace="early", token=None, tls=None,
                                         limits=Limits(), timeout=5)
            try:
                with pytest.raises(ProtocolError, match="over the limit"):
                    await conn.request(Put(keys=make_keys("big", 1), sizes=[len(block)]), [memoryview(block)],
                                       timeout=30)
            finally:
                await conn.aclose()
    with ServerProcess("--capacity", "128MiB") as srv:
        conn = await open_connection("127.0.0.1", srv.port, namespace="early", token=None, tls=None,
                                     limits=Limits(), timeout=5)
        try:
            with pytest.raises(InvalidRequest, match="sizes add up to 1"):  # answered, the payload skipped
                await conn.request(Put(keys=make_keys("bad", 1), sizes=[1]), [memoryview(block)], timeout=30)
            assert not conn._out  # nothing of the caller's left to send
            if conn._out is not None:  # (paced) the rest of its frame was never sent: the stream is out of step
                assert conn.closed
        finally:
            await conn.aclose()


async def test_a_put_ending_in_an_empty_block_keeps_its_connection() -> None:
    """Its empty last block was queued as a piece of its own and counted as sent a loop turn after
    the server, which needs no byte of it, had answered: the connection was dropped as if the put
    had been refused half-sent, and the request queued behind it failed."""
    async def busy(stop: asyncio.Event) -> None:  # other work on the loop: an engine's step, 2 ms at a time
        while not stop.is_set():
            time.sleep(0.002)
            await asyncio.sleep(0)

    stop = asyncio.Event()
    other = asyncio.ensure_future(busy(stop))
    try:
        with ServerProcess("--capacity", "128MiB") as srv:
            async with AsyncKVClient(srv.addr, namespace="tail", pool_size=1, retries=0, timeout=10) as kv:
                await kv.ping()
                conn = kv.nodes[0].conns[0]
                for trial in range(10):
                    put = asyncio.ensure_future(kv.put(make_keys(f"tail{trial}", 2), [os.urandom((2 << 20) + 1), b""]))
                    await asyncio.sleep(0.001)
                    queued = asyncio.ensure_future(kv.exists(make_keys("absent", 1)))
                    assert (await put).stored == 2 and await queued == [False]
                assert kv.nodes[0].conns == [conn] and not conn.closed
    finally:
        stop.set()
        await other


async def test_a_non_contiguous_payload_is_refused_at_send_on_the_stock_loop() -> None:
    """The low-level request() with ``payload_len`` takes views as given; on the paced transport a
    non-contiguous one raised inside the pump after the header had gone, and the request hung."""
    from kvstore.client.connection import open_connection
    from kvstore.messages import Put
    from kvstore.protocol import Limits

    view = memoryview(bytearray(4 << 20))[::2]
    with ServerProcess("--capacity", "64MiB") as srv:
        conn = await open_connection("127.0.0.1", srv.port, namespace="flat", token=None, tls=None,
                                     limits=Limits(), timeout=5)
        try:
            with pytest.raises(InvalidRequest, match="contiguous"):
                await conn.request(Put(keys=make_keys("flat", 1), sizes=[len(view)]), [view],
                                   payload_len=len(view), timeout=5)
            assert not conn.closed and not conn._out  # refused before anything was queued: the connection goes on
            assert (await conn.request(Ping(), timeout=5)).fields == {}
        finally:
            await conn.aclose()


def test_blocking_clients_dropped_without_close_close_their_connections() -> None:
    """(their sockets stayed open in the shared loop thread for the life of the process: 50 dropped
    clients held 50 fds here and 50 connections on the server)"""

    def fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    with ServerProcess("--capacity", "16MiB") as srv:
        with KVClient(srv.addr, namespace="t") as kv:  # (the loop thread, started)
            kv.ping()
        gc.collect()
        before = fds()
        dropped = [KVClient(srv.addr, namespace="t") for _ in range(20)]
        for client in dropped:
            client.ping()
        assert fds() >= before + 20
        del dropped, client
        gc.collect()
        deadline = time.monotonic() + 10
        while fds() > before and time.monotonic() < deadline:
            time.sleep(0.05)
        assert fds() <= before
        with KVClient(srv.addr, namespace="t") as kv:
            assert kv.stats()["connections"] == 1


async def test_a_get_of_unknown_sizes_over_the_reply_limit_is_asked_for_in_parts() -> None:
    """``get`` (no buffers) guesses block sizes from its last reply: a fresh client's get of 8 x 1 MiB
    from a server with --max-frame-size 4MiB was refused (TooLarge) whole, every time. Refused, it
    asks for halves (the refusal sent nothing and kept the leases), down to what a reply carries."""
    with ServerProcess("--capacity", "64MiB", "--max-frame-size", "4MiB") as srv:
        keys = make_keys("parts", 8)
        blocks = [bytes([i]) * (1 << 20) for i in range(8)]
        async with AsyncKVClient(srv.addr, namespace="t") as kv:
            await kv.put(keys, blocks)
        for warm in (None, [b"s"]):
            async with AsyncKVClient(srv.addr, namespace="t") as kv:
                if warm:  # (its guess: tiny blocks)
                    await kv.put(make_keys("small", 1), warm)
                    await kv.get(make_keys("small", 1))
                assert await kv.lookup(keys, pin=True) == 8
                got = await kv.get(keys, unpin=True)
                assert [bytes(b) for b in got] == blocks  # type: ignore[arg-type]
                store = (await kv.stats())["store"]
                assert store["leases"] == 0  # each lease dropped once, by the part that carried its block
