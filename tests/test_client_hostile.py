"""The client against a broken or hostile server: every malformed reply is a typed error.

The server here is a few lines of asyncio in the test itself, on loopback: it answers
HELLO properly and then whatever the test scripts -- the point is what a real server
would never send. (A review's fuzzer found each of these raising TypeError, KeyError
or AttributeError, returning a wrong answer, or waiting without end.)
"""

from __future__ import annotations

import asyncio
import contextlib
import mmap
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any, AsyncIterator, Callable

import msgpack
import pytest

from kvstore.client import AsyncKVClient
from kvstore.client.connection import open_connection
from kvstore.client.shm import ShmSegment, attach
from kvstore.errors import NotFound, ProtocolError, TransportError
from kvstore.protocol import DEFAULT_LIMITS, HEADER, MAGIC, NEED_DATA, VERSION, Frame, FrameReader, Ping, reply

Script = Callable[[int, int, asyncio.StreamWriter], None]  # (op, request id, writer)


def raw_reply(op: int, rid: int, meta: dict[str, Any], payload: bytes = b"") -> bytes:
    m = msgpack.packb(meta, use_bin_type=True)
    return HEADER.pack(MAGIC, VERSION, op, rid, len(m), len(payload)) + m + payload


@pytest.fixture
async def hostile() -> AsyncIterator[Callable[[Script], str]]:
    """``start(script)`` -> the address of a server that says HELLO, then lets ``script`` answer."""
    servers: list[asyncio.Server] = []
    writers: list[asyncio.StreamWriter] = []

    async def start(script: Script) -> str:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writers.append(writer)
            frames = FrameReader(is_server=True)
            while data := await reader.read(1 << 16):
                frames.feed(data)
                while (ev := frames.next_event()) is not NEED_DATA:
                    if not isinstance(ev, Frame):
                        continue
                    if ev.op == 1:
                        writer.write(b"".join(reply(1, ev.request_id, version=VERSION, server="hostile",
                                                    namespace="default")))
                    else:
                        script(ev.op, ev.request_id, writer)
            writer.close()

        srv = await asyncio.start_server(handle, "127.0.0.1", 0)
        servers.append(srv)
        return f"127.0.0.1:{srv.sockets[0].getsockname()[1]}"

    yield lambda script: start(script)  # type: ignore[return-value]
    for srv in servers:
        srv.close()
    for writer in writers:  # every connection closed for good before the test's loop ends
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
    for srv in servers:
        await srv.wait_closed()


def answer(meta: dict[str, Any], payload: bytes = b"") -> Script:
    return lambda op, rid, w: w.write(raw_reply(op | 0x80, rid, meta, payload))


@pytest.mark.parametrize("meta", [
    {"status": [[1]]}, {"status": [{}]}, {"status": [0.0]}, {"status": [True]}, {"status": [None]},
    {"status": [0], "errors": [1]}, {"status": [0], "errors": "boom"}, {"status": [4], "errors": {"0": 7}},
])
async def test_a_malformed_put_status_is_a_protocol_error(hostile, meta: dict[str, Any]) -> None:
    async with AsyncKVClient(await hostile(answer(meta)), pool_size=1, retries=0, timeout=2) as kv:
        with pytest.raises(ProtocolError):
            await kv.put([b"k" * 16], [b"x"])


@pytest.mark.parametrize("meta", [
    {"sizes": ["4"], "checksums": [0]}, {"sizes": [4.0], "checksums": [0]}, {"sizes": [-5], "checksums": [0]},
    {"sizes": [-1], "checksums": ["x"]}, {"sizes": [-1], "checksums": [-1]},
])
async def test_malformed_get_sizes_or_checksums_are_a_protocol_error_not_a_miss(hostile, meta: dict[str, Any]) -> None:
    async with AsyncKVClient(await hostile(answer(meta)), pool_size=1, retries=0, timeout=2) as kv:
        with pytest.raises(ProtocolError):
            await kv.get([b"k" * 16])


async def test_malformed_exists_and_delete_answers_are_protocol_errors(hostile) -> None:
    def script(op: int, rid: int, w: asyncio.StreamWriter) -> None:
        w.write(raw_reply(op | 0x80, rid, {"present": ["no"]} if op == 6 else {"n": -7}))

    async with AsyncKVClient(await hostile(script), pool_size=1, retries=0, timeout=2) as kv:
        with pytest.raises(ProtocolError):
            await kv.exists([b"k" * 16])  # ("no" was read as True)
        with pytest.raises(ProtocolError):
            await kv.delete([b"k" * 16])  # (-7 was returned as a count)


async def test_an_error_reply_with_a_payload_ends_the_connection_cleanly(hostile) -> None:
    """Its payload used to be taken for the next reply's end: a KeyError broke a concurrent request."""
    def script(op: int, rid: int, w: asyncio.StreamWriter) -> None:
        if op == 5:
            w.write(raw_reply(0xFF, rid, {"code": NotFound.code, "message": "nf"}, b"abcd"))
        else:
            w.write(raw_reply(op | 0x80, rid, {}))

    async with AsyncKVClient(await hostile(script), pool_size=1, retries=0, timeout=2) as kv:
        results = await asyncio.gather(kv.get([b"k" * 16]), kv.ping(), return_exceptions=True)
    assert all(isinstance(r, ProtocolError) for r in results), results
    assert "error reply with a payload" in str(results[0])


async def test_a_posted_request_the_server_never_answers_does_not_stay_pending(hostile) -> None:
    host, port = (await hostile(lambda op, rid, w: None)).split(":")
    conn = await open_connection(host, int(port), namespace="default", token=None, tls=None,
                                 limits=DEFAULT_LIMITS, timeout=2)
    conn.post(Ping(), timeout=0.2)
    assert conn.in_flight == 1
    await asyncio.sleep(0.5)
    assert conn.in_flight == 0 and conn.closed  # timed out: the connection is not trusted any more


def test_shm_locations_that_overlap_are_refused() -> None:
    """A block named as the same arena bytes 200,000 times over made the client allocate (and copy)
    200,000 times the block's size."""
    segment = ShmSegment(mmap.mmap(-1, 1 << 20), 4096, "test")
    try:
        assert [len(v) for v in segment.views([[8192, 4096], [0, 4096]])] == [4096, 4096]  # runs in any order
        for loc in ([[0, 1 << 20]] * 200_000, [[0, 8192], [4096, 4096]], [[0, 4096], [0, 1]]):
            with pytest.raises(ProtocolError, match="overlap"):
                segment.views(loc)
        with pytest.raises(ProtocolError, match="outside"):
            segment.views([[(1 << 20) - 10, 11]])
    finally:
        segment.close()


def test_an_attach_answered_a_byte_at_a_time_gives_up_at_the_timeout(tmp_path: Path) -> None:
    path = str(tmp_path / "trickle.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)
    hello = b"".join(reply(1, 1, version=VERSION, server="trickle", namespace="default"))
    stop = threading.Event()

    def trickle() -> None:
        conn, _ = listener.accept()
        with conn:
            for byte in hello * 100:
                if stop.wait(0.1):
                    return
                conn.sendall(bytes([byte]))

    thread = threading.Thread(target=trickle, daemon=True)
    thread.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(TransportError, match="within the connect timeout"):
            attach(path, namespace="default", token=None, timeout=1.0)
        assert time.monotonic() - t0 < 3  # (each byte used to restart the timeout: no end)
    finally:
        stop.set()
        thread.join(5)
        listener.close()
        os.unlink(path)


async def test_a_peer_that_never_answers_hello_is_a_transport_error_after_connect_timeout() -> None:
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()  # accepts (in the kernel) and says nothing
        kv = AsyncKVClient(f"127.0.0.1:{silent.getsockname()[1]}", connect_timeout=0.3, retries=0)
        try:
            with pytest.raises(TransportError, match="did not answer HELLO within 0.3s"):
                await kv.ping()
        finally:
            await kv.close()
