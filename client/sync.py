"""``KVClient``: the blocking client, a facade over :class:`AsyncKVClient`.

Not a second implementation: every call runs the async client's coroutine on
one background event-loop thread shared by all blocking clients of the process
(``asyncio.run_coroutine_threadsafe``), and waits for its result.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from concurrent.futures import Future
from typing import Any, Coroutine, Sequence, TypeVar

from kvstore.errors import TransportError

from .aio import AsyncKVClient, PutResult

T = TypeVar("T")


class _LoopThread:
    """A daemon thread running an event loop (uvloop where available)."""

    _lock = threading.Lock()
    _instance: _LoopThread | None = None

    def __init__(self) -> None:
        try:
            import uvloop
            self.loop = uvloop.new_event_loop()
        except ImportError:  # pragma: no cover
            self.loop = asyncio.new_event_loop()
        self.pid = os.getpid()
        self.thread = threading.Thread(target=self.loop.run_forever, name="kvstore-client-loop", daemon=True)
        self.thread.start()

    @classmethod
    def get(cls) -> _LoopThread:
        with cls._lock:
            if cls._instance is None or cls._instance.pid != os.getpid():  # a forked child needs its own
                cls._instance = _LoopThread()
            return cls._instance

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        if os.getpid() != self.pid:  # forked: the loop thread (and the connections) stayed in the parent
            coro.close()
            raise TransportError("this KVClient was made in the parent of a fork; make a new one in this process")
        fut: Future[T] = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return fut.result()
        except BaseException:
            # E.g. KeyboardInterrupt: cancel the request (its connection is dropped), and wait one turn of
            # the loop for that to happen, so that no reply lands in the caller's buffers after we raise.
            if not fut.cancel():
                raise  # the call had ended (its own exception): nothing is in flight
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(asyncio.sleep(0), self.loop).result(timeout=5)
            raise


class KVClient:
    """Blocking client with the same methods and arguments as :class:`AsyncKVClient`."""

    def __init__(self, addr: str | Sequence[str] = "127.0.0.1:7600", **kwargs: Any) -> None:
        self._runner = _LoopThread.get()
        self._aio = self._runner.run(_make(addr, kwargs))

    @property
    def namespace(self) -> str:
        return self._aio.namespace

    def __enter__(self) -> KVClient:
        self.connect()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def connect(self) -> None:
        self._runner.run(self._aio.connect())

    def close(self) -> None:
        self._runner.run(self._aio.close())

    def put(self, keys: Sequence[bytes], blocks: Sequence[Any], *, parent: bytes | None = None) -> PutResult:
        return self._runner.run(self._aio.put(keys, blocks, parent=parent))

    def lookup(self, keys: Sequence[bytes], *, pin: bool = False, lease_ms: int | None = None) -> int:
        return self._runner.run(self._aio.lookup(keys, pin=pin, lease_ms=lease_ms))

    def get(self, keys: Sequence[bytes], *, unpin: bool = False) -> list[bytearray | None]:
        return self._runner.run(self._aio.get(keys, unpin=unpin))

    def get_into(self, keys: Sequence[bytes], buffers: Sequence[Any], *, unpin: bool = False) -> list[bool]:
        return self._runner.run(self._aio.get_into(keys, buffers, unpin=unpin))

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        return self._runner.run(self._aio.exists(keys))

    def delete(self, keys: Sequence[bytes]) -> int:
        return self._runner.run(self._aio.delete(keys))

    def unpin(self, keys: Sequence[bytes]) -> int:
        return self._runner.run(self._aio.unpin(keys))

    def flush(self, namespace: str | None = None) -> int:
        return self._runner.run(self._aio.flush(namespace))

    def stats(self) -> dict[str, Any]:
        return self._runner.run(self._aio.stats())

    def ping(self) -> float:
        return self._runner.run(self._aio.ping())


async def _make(addr: str | Sequence[str], kwargs: dict[str, Any]) -> AsyncKVClient:
    return AsyncKVClient(addr, **kwargs)  # built on the loop thread: its locks belong to that loop
