"""The raw limit: a minimal uvloop socket pair moving the same bytes as kvstore, nothing else.

One request = a 16-byte header, and then

- ``up`` (what a PUT moves): the client writes ``batch`` blocks with one
  ``writelines``; the server ``recv_into``s them, block by block, into a
  reused, pre-touched buffer and answers one byte;
- ``down`` (what a GET moves): the server writes ``batch`` blocks (views of
  one pre-built buffer) with one ``writelines``; the client ``recv_into``s
  them into a reused, pre-touched buffer.

Both sides use ``asyncio.BufferedProtocol`` on uvloop, as kvstore does, so the
ratio kvstore / raw is what kvstore's framing, metadata, bookkeeping and
checksums cost. No key, no metadata, no store, no checksum.

Run the server as ``python -m kvstore.bench.raw`` (prints ``PORT <n>`` and
serves until stdin closes or it gets an ``exit`` request).
"""

from __future__ import annotations

import asyncio
import socket
import struct
import sys
from typing import Any, cast

HEADER = struct.Struct("!BxxxIQ")  # op, batch, block size
UP, DOWN, EXIT = 1, 2, 0


def _nodelay(transport: asyncio.BaseTransport) -> None:
    sock = transport.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class _ServerProto(asyncio.BufferedProtocol):
    """Header, then (up) payload into a reused slot per block; (down) a writelines of views."""

    slots: dict[int, memoryview] = {}  # bytes -> a reused pre-touched buffer, shared by connections

    def __init__(self, done: asyncio.Future[None]) -> None:
        self.done = done
        self.hdr = memoryview(bytearray(HEADER.size))
        self.pos = 0
        self.payload: memoryview | None = None  # receiving an up payload
        self.size = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.tr = cast(asyncio.Transport, transport)
        _nodelay(transport)

    @classmethod
    def slot(cls, nbytes: int) -> memoryview:
        mv = cls.slots.get(nbytes)
        if mv is None:
            mv = cls.slots[nbytes] = memoryview(bytearray(b"\x01") * nbytes)  # written: pages touched
        return mv

    def get_buffer(self, sizehint: int) -> memoryview:
        if self.payload is None:
            return self.hdr[self.pos:]
        end = (self.pos // self.size + 1) * self.size  # stop at the block's end, as kvstore's views do
        return self.payload[self.pos:end]

    def buffer_updated(self, nbytes: int) -> None:
        self.pos += nbytes
        if self.payload is not None:
            if self.pos == len(self.payload):
                self.payload, self.pos = None, 0
                self.tr.write(b"A")
            return
        if self.pos < HEADER.size:
            return
        self.pos = 0
        op, batch, size = HEADER.unpack(self.hdr)
        if op == UP:
            self.size, self.payload = size, self.slot(size * batch)
        elif op == DOWN:
            src = self.slot(size * batch)
            self.tr.writelines([src[i * size:(i + 1) * size] for i in range(batch)])
        else:
            self.tr.close()
            if not self.done.done():
                self.done.set_result(None)

    def eof_received(self) -> bool:
        return False


async def serve(port: int = 0) -> None:
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()
    server = await loop.create_server(lambda: _ServerProto(done), "127.0.0.1", port)
    print(f"PORT {server.sockets[0].getsockname()[1]}", flush=True)
    stdin_closed = loop.run_in_executor(None, sys.stdin.read)  # the parent died or closed our stdin
    await asyncio.wait([done, stdin_closed], return_when=asyncio.FIRST_COMPLETED)
    server.close()


class RawClient(asyncio.BufferedProtocol):
    """The client side: one connection, one request at a time."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.ack = memoryview(bytearray(1))
        self.dst: memoryview | None = None
        self.size = 0
        self.pos = 0
        self.want = 0
        self.waiter: asyncio.Future[None] | None = None
        self.lost: BaseException | None = None

    @classmethod
    async def connect(cls, port: int) -> RawClient:
        _, proto = await asyncio.get_running_loop().create_connection(cls, "127.0.0.1", port)
        return proto

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.tr = cast(asyncio.Transport, transport)
        _nodelay(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = exc or ConnectionError("raw server closed the connection")
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(self.lost)

    def get_buffer(self, sizehint: int) -> memoryview:
        if self.dst is None:
            return self.ack
        end = (self.pos // self.size + 1) * self.size
        return self.dst[self.pos:end]

    def buffer_updated(self, nbytes: int) -> None:
        self.pos += nbytes
        if self.pos >= self.want:
            self.dst = None  # complete: nothing more is expected
            if self.waiter is not None and not self.waiter.done():
                self.waiter.set_result(None)

    async def _wait(self, want: int) -> None:
        if self.lost is not None:
            raise ConnectionError("raw connection lost") from self.lost
        self.pos, self.want = 0, want
        self.waiter = self.loop.create_future()
        await self.waiter

    async def up(self, blocks: list[Any]) -> None:
        """Send ``blocks`` (equal sizes) and wait for the one-byte ack."""
        self.dst = None
        self.tr.writelines([HEADER.pack(UP, len(blocks), len(blocks[0])), *blocks])
        await self._wait(1)

    async def down(self, dst: memoryview, size: int, batch: int) -> None:
        """Ask for ``batch`` blocks of ``size`` bytes, received into ``dst`` (``size * batch`` bytes)."""
        self.dst, self.size = dst, size
        self.tr.write(HEADER.pack(DOWN, batch, size))
        await self._wait(size * batch)

    def close(self) -> None:
        self.tr.close()


def main() -> None:
    try:
        import uvloop
    except ImportError:  # pragma: no cover
        asyncio.run(serve())
    else:
        uvloop.run(serve())


if __name__ == "__main__":
    main()
