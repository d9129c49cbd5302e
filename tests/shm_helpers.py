"""Helpers shared by the same-host transport tests (Unix socket, shared memory, integrity)."""

from __future__ import annotations

import asyncio
import hashlib
import os
import random
import shutil
import socket
import tempfile
from typing import Any, Awaitable, Callable, Iterator, TypeVar

import pytest

from kvstore.client import AsyncKVClient
from kvstore.protocol import (
    ErrorReply, Frame, FrameReader, Hello, Message, Reply, ShmAttach, ShmGet, ShmRelease, encode,
)
from kvstore.server.process import ServerProcess

#: The ``make_server`` fixture of conftest.py: ``make_server("--capacity", "8MiB")`` -> a started server.
MakeServer = Callable[..., ServerProcess]
T = TypeVar("T")


def key(i: int, tag: str = "") -> bytes:
    return hashlib.sha256(f"{tag}:{i}".encode()).digest()


def data(k: bytes, size: int) -> bytes:
    """A block's content, derived from its key: any reader can tell right bytes from wrong ones."""
    return random.Random(k).randbytes(size)


@pytest.fixture
def unix_path() -> Iterator[str]:
    """A short socket path (AF_UNIX paths are limited to 107 bytes; pytest's tmp_path can be longer)."""
    directory = tempfile.mkdtemp(prefix="kvs", dir="/tmp")
    try:
        yield f"{directory}/kv.sock"
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def raw_exchange(path: str, *msgs: Message, timeout: float = 5.0) -> tuple[list[Frame], list[int]]:
    """Send ``msgs`` (request ids 1..n) on a fresh Unix connection; the reply frames and any passed fds.

    Reads until every request is answered or the server closes the connection.
    """
    frames: list[Frame] = []
    fds: list[int] = []
    reader = FrameReader(is_server=False)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(path)
        sock.sendall(b"".join(bytes(b) for i, m in enumerate(msgs, 1) for b in encode(m, i)))
        while len(frames) < len(msgs):
            chunk, got, _, _ = socket.recv_fds(sock, 65536, 4)
            fds.extend(got)
            if not chunk:
                break
            reader.feed(chunk)
            while isinstance(event := reader.next_event(), Frame):
                frames.append(event)
    return frames, fds


def error_code(frame: Frame) -> int | None:
    return frame.msg.code if isinstance(frame.msg, ErrorReply) else None


def reply_fields(frame: Frame) -> dict[str, Any]:
    assert isinstance(frame.msg, Reply), frame.msg
    return frame.msg.fields


def assert_attach_maps(path: str, size: int) -> None:
    """HELLO then SHM_ATTACH on a fresh connection: one descriptor comes back, for ``size`` bytes."""
    frames, fds = raw_exchange(path, Hello(), ShmAttach())
    try:
        assert len(fds) == 1 and reply_fields(frames[1])["size"] == size
    finally:
        for fd in fds:
            os.close(fd)


def arena_mappings() -> int:
    """Distinct server arenas mapped into this process."""
    with open("/proc/self/maps") as f:
        return len({line.split()[4] for line in f if "kvstore-arena" in line})


async def shm_locate(kv: AsyncKVClient, keys: list[bytes]) -> tuple[Any, dict[str, Any]]:
    """A raw SHM_GET on one of the client's connections: ``(connection, reply fields)``; pins held."""
    node = kv.nodes[0]
    conn = await node.connection()
    resp = await conn.request(ShmGet(keys=keys))
    return conn, resp.fields


async def shm_release(conn: Any, handle: int) -> bool:
    resp = await conn.request(ShmRelease(handle=handle))
    return resp.fields["held"] is True


async def behind_a_cancelled_put(kv: AsyncKVClient, tag: str, request: Callable[[], Awaitable[T]],
                                 block_bytes: int = 4 << 20) -> tuple[Any, asyncio.Future[T]]:
    """Start a put of four new blocks, queue ``request()`` behind it on the same connection (a client
    with ``pool_size=1``), and cancel the put: ``(that connection, the request's future)``. The
    connection is closed when the cancel came while the put's payload went out: the request then
    never reached the server; otherwise the put had gone out whole."""
    put = asyncio.ensure_future(kv.put([key(i, tag) for i in range(4)], [bytes(block_bytes)] * 4))
    await asyncio.sleep(0)
    queued = asyncio.ensure_future(request())
    await asyncio.sleep(0.002)
    (conn,) = kv.nodes[0].conns
    put.cancel()
    await asyncio.gather(put, return_exceptions=True)
    return conn, queued
