"""The server's lifecycle: listen, serve, and on SIGTERM/SIGINT drain and stop.

Only lifecycle lives here (the shape of uvicorn's ``server.py``); what a
request does is :mod:`.service`, how its bytes move is :mod:`.connection`.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from typing import Any

from kvstore.config import ServerConfig, format_size
from kvstore.protocol import Limits
from kvstore.store import BlockStore

from .connection import Connection
from .service import Service

log = logging.getLogger(__name__)


class Server:
    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.store = BlockStore(
            config.capacity, eviction=config.eviction, page_size=config.page_size,
            lease_s=config.lease_seconds, prefault=config.prefault,
        )
        self.service = Service(self.store, config)
        self.limits = Limits()
        self.connections: set[Connection] = set()
        self._servers: list[asyncio.AbstractServer] = []
        self._stopping: asyncio.Event | None = None
        self._tasks: list[asyncio.Task[Any]] = []
        self.port: int | None = None

    def _new_connection(self) -> Connection:
        conn = Connection(self.service, self.limits, self.connections.discard)
        self.connections.add(conn)
        return conn

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._stopping = asyncio.Event()
        srv = await loop.create_server(self._new_connection, self.config.host, self.config.port,
                                       reuse_address=True, backlog=1024)
        self._servers.append(srv)
        self.port = srv.sockets[0].getsockname()[1]
        self._tasks.append(asyncio.create_task(self._housekeeping()))
        log.info("kvstore-server listening on %s:%d capacity=%s eviction=%s", self.config.host, self.port,
                 format_size(self.store.stats()["capacity"]), self.config.eviction)

    async def _housekeeping(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            self.store.expire_leases()

    def request_stop(self) -> None:
        if self._stopping is not None:
            self._stopping.set()

    async def serve_forever(self, install_signals: bool = True) -> None:
        await self.start()
        loop = asyncio.get_running_loop()
        if install_signals:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self.request_stop)
        assert self._stopping is not None
        await self._stopping.wait()
        log.info("stopping: draining %d connection(s)", len(self.connections))
        await self.shutdown()

    async def shutdown(self) -> None:
        """Stop accepting, let in-flight requests finish (bounded), then close."""
        for srv in self._servers:
            srv.close()
        for conn in list(self.connections):
            conn.start_drain()
        pending = [asyncio.create_task(c.idle.wait()) for c in self.connections]
        if pending:
            _, not_done = await asyncio.wait(pending, timeout=self.config.drain_seconds)
            for t in not_done:
                t.cancel()
            if not_done:
                log.warning("drain timed out; closing %d busy connection(s)", len(not_done))
        for conn in list(self.connections):
            conn.close()
        for _ in range(100):  # let closing transports flush their last replies
            if not self.connections:
                break
            await asyncio.sleep(0.01)
        for task in self._tasks:
            task.cancel()
        for srv in self._servers:
            await srv.wait_closed()
        log.info("stopped")
