"""``KVClient``: the blocking client, a facade over :class:`AsyncKVClient`.

Not a second implementation: every call runs the async client's coroutine on
one background event-loop thread shared by all blocking clients of the process
(``asyncio.run_coroutine_threadsafe``), and waits for its result.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import sys
import threading
import weakref
from typing import Any, Callable, Collection, Coroutine, Sequence, TypeVar

from kvstore.errors import TransportError

from .aio import _NOT_PICKLED, AsyncKVClient, PutResult, _listed

T = TypeVar("T")


class _LoopThread:
    """A daemon thread running an event loop (uvloop where available)."""

    _lock = threading.Lock()
    _instance: _LoopThread | None = None

    def __init__(self) -> None:
        self.loop: asyncio.AbstractEventLoop
        try:
            import uvloop
            self.loop = uvloop.new_event_loop()
        except ImportError:  # pragma: no cover
            self.loop = asyncio.new_event_loop()
        self.pid = os.getpid()
        self.closing: set[asyncio.Task[None]] = set()  # closes of clients dropped unclosed, running
        self.thread = threading.Thread(target=self.loop.run_forever, name="kvstore-client-loop", daemon=True)
        self.thread.start()

    def can_wait(self) -> bool:
        """Whether a call may wait for the loop thread: not on that thread itself (it would wait on
        itself, and every client of the process with it), nor while the interpreter shuts down (the
        thread no longer runs: a ``__del__`` at exit would block the process for good)."""
        return threading.current_thread() is not self.thread and not sys.is_finalizing()

    @classmethod
    def _after_fork(cls) -> None:
        """A child forked while another thread held the lock would wait on it for good."""
        cls._lock = threading.Lock()

    @classmethod
    def get(cls) -> _LoopThread:
        with cls._lock:
            if cls._instance is None or cls._instance.pid != os.getpid():  # a forked child needs its own
                cls._instance = _LoopThread()
            return cls._instance

    def run(self, make: Callable[[], Coroutine[Any, Any, T]], orphan: Callable[[T], None] | None = None) -> T:
        """Run the coroutine ``make()`` makes on the loop thread and wait for it. ``orphan``: called
        there with the result of a call that succeeded as the caller was interrupted (a pinned
        lookup: its leases). The coroutine is made on the loop thread: an interrupt before it ran
        leaves none behind, never awaited."""
        if os.getpid() != self.pid:  # forked: the loop thread (and the connections) stayed in the parent
            raise TransportError("this KVClient was made in the parent of a fork; make a new one in this process")
        if not self.can_wait():
            raise TransportError("a KVClient call cannot wait here: " + (
                "the interpreter is shutting down" if sys.is_finalizing() else
                "this is the clients' own event-loop thread (a __del__ the garbage collector ran there?)"))
        call = _Call(make, orphan)
        try:
            self.loop.call_soon_threadsafe(call.start)
            call.wait()
            return call.result()
        except BaseException:
            # E.g. KeyboardInterrupt: cancel the request (its reply is dropped), and wait until the
            # call has ended, so that no reply lands in the caller's buffers after we raise. The
            # loop thread hands a result nobody takes to ``orphan`` (a second interrupt may cut
            # this block short: nothing after its first line is needed for that).
            self.loop.call_soon_threadsafe(call.abandon)
            if call.outcome is None:  # (else the call had ended: its own exception, nothing in flight)
                call.wait_out(self.loop)
            raise


os.register_at_fork(after_in_child=_LoopThread._after_fork)


class _Call:
    """One call's coroutine, made and run as a task on the loop thread.

    Its state changes on the loop only, where callbacks run in the order they were posted: an
    interrupt may come before ``start`` was posted, or after (the call may be running before the
    calling thread reaches its next line), and ``abandon``, posted after it, tells which.

    The caller waits on a plain lock the loop thread releases once, when the call ends: a signal
    handler may raise in the caller's wait at any point, and the loop thread never waits on
    anything the caller may hold then (a ``concurrent.futures.Future``'s condition, taken by
    ``result()`` and by ``set_result()`` alike, was left held by such an interrupt: the loop
    thread, and every KVClient of the process, hung).
    """

    def __init__(self, make: Callable[[], Coroutine[Any, Any, Any]], orphan: Callable[[Any], None] | None = None) -> None:
        self.make = make
        self.orphan = orphan  # takes the result of a call its caller abandoned (once)
        self.abandoned = False
        self.task: asyncio.Task[Any] | None = None
        #: ("result", value), ("error", exception) or ("cancelled", None), once the call has ended.
        self.outcome: tuple[str, Any] | None = None
        self._ended = threading.Lock()
        self._ended.acquire()  # released by the loop thread as the call ends

    def start(self) -> None:
        if self.outcome is not None:  # (abandoned before it started: nothing to run)
            return
        try:
            self.task = asyncio.get_running_loop().create_task(self.make())
        except BaseException as exc:  # (not left to the loop's log: the caller would wait for good)
            self._end(("error", exc))
            return
        self.task.add_done_callback(self._settle)

    def _settle(self, task: asyncio.Task[Any]) -> None:
        if task.cancelled():
            self._end(("cancelled", None))
        elif task.exception() is not None:
            self._end(("error", task.exception()))
        else:
            self._end(("result", task.result()))

    def _end(self, outcome: tuple[str, Any]) -> None:
        if self.outcome is None:
            self.outcome = outcome  # (before the release: a caller woken finds it set)
            self._ended.release()
            self._orphaned()

    def _orphaned(self) -> None:
        """On the loop: hand the result of a call its caller abandoned to ``orphan``, once. (An
        interrupt is let in once the loop thread lets go of the GIL: mostly after the reply was
        handled, so that the call had succeeded, and what it handed over would be dropped.)"""
        if self.abandoned and self.orphan is not None and self.outcome is not None and self.outcome[0] == "result":
            orphan, self.orphan = self.orphan, None
            orphan(self.outcome[1])

    def abandon(self) -> None:
        self.abandoned = True
        if self.task is None:  # start has not run: it never will run the call
            self._end(("cancelled", None))
        elif not self.task.done():
            self.task.cancel()
        else:  # (it had ended as the caller gave up)
            self._orphaned()

    def wait(self, timeout: float = -1) -> bool:
        """Wait until the call has ended (an interrupt may raise here); whether it has."""
        if self.outcome is None and self._ended.acquire(timeout=timeout):
            self._ended.release()  # (for a later wait; a wait interrupted here finds outcome set)
        return self.outcome is not None

    def result(self) -> Any:
        assert self.outcome is not None
        kind, value = self.outcome
        if kind == "error":
            raise value
        if kind == "cancelled":
            raise asyncio.CancelledError()
        return value

    def wait_out(self, loop: asyncio.AbstractEventLoop, limit: float = 5.0) -> None:
        """Cancel the call and wait (up to ``limit`` seconds) until it has ended, cancelling it again
        while it runs on: a cancel can be swallowed (``asyncio.wait_for`` on Python 3.11 drops one that
        arrives in the turn its awaitable completes)."""
        for _ in range(int(limit / 0.05)):
            loop.call_soon_threadsafe(self.abandon)
            if self.wait(0.05):
                return


class KVClient:
    """Blocking client with the same methods and arguments as :class:`AsyncKVClient`."""

    def __init__(self, addr: str | Sequence[str] = "127.0.0.1:7600", **kwargs: Any) -> None:
        self._runner = _LoopThread.get()
        self._aio = self._runner.run(lambda: _make(addr, kwargs))
        # Dropped without close(): its connections live on in the shared loop thread (fds, and slots of
        # the server's --max-connections) unless closed then.
        weakref.finalize(self, _close_abandoned, self._runner, self._aio).atexit = False

    def __reduce__(self) -> Any:
        raise TypeError(_NOT_PICKLED.format(type(self).__name__))

    @property
    def namespace(self) -> str:
        return self._aio.namespace

    @property
    def closed(self) -> bool:
        """Closed by :meth:`close` (``connect()`` opens it again), as ``AsyncKVClient.closed``; and
        in a forked child, where its connections and loop thread are the parent's (calls raise)."""
        return self._runner.pid != os.getpid() or self._aio.closed

    def __enter__(self) -> KVClient:
        self.connect()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def connect(self) -> None:
        self._runner.run(lambda: self._aio.connect())

    def close(self) -> None:
        """Close the connections. Where a call cannot wait (see ``_LoopThread.can_wait``), the close is
        only started, as for a client dropped without one (at shutdown the process's end closes them)."""
        if self._runner.pid != os.getpid():  # a forked child: the connections are the parent's, left alone
            return
        if not self._runner.can_wait():
            _close_abandoned(self._runner, self._aio)
            return
        self._runner.run(lambda: self._aio.close())

    def put(self, keys: Sequence[bytes], blocks: Sequence[Any], *, parent: bytes | None = None) -> PutResult:
        return self._runner.run(lambda: self._aio.put(keys, blocks, parent=parent))

    def lookup(self, keys: Sequence[bytes], *, pin: bool = False, lease_ms: int | None = None) -> int:
        if not pin:
            return self._runner.run(lambda: self._aio.lookup(keys, pin=pin, lease_ms=lease_ms))
        keys = _listed(keys, "keys")  # (an iterator would be used up: the leases are given back by key)
        return self._runner.run(lambda: self._aio.lookup(keys, pin=pin, lease_ms=lease_ms),
                                orphan=lambda n: self._aio._give_back(keys[:n]) if n else None)

    def get(self, keys: Sequence[bytes], *, unpin: bool = False) -> list[bytearray | None]:
        return self._runner.run(lambda: self._aio.get(keys, unpin=unpin))

    def get_into(self, keys: Sequence[bytes], buffers: Sequence[Any], *, unpin: bool = False) -> list[bool]:
        return self._runner.run(lambda: self._aio.get_into(keys, buffers, unpin=unpin))

    def exists(self, keys: Sequence[bytes], *, strict: bool = False) -> list[bool]:
        return self._runner.run(lambda: self._aio.exists(keys, strict=strict))

    def delete(self, keys: Sequence[bytes]) -> int:
        return self._runner.run(lambda: self._aio.delete(keys))

    def unpin(self, keys: Sequence[bytes]) -> int:
        return self._runner.run(lambda: self._aio.unpin(keys))

    def flush(self, namespace: str | None = None, *, servers: Collection[str] | None = None) -> int:
        return self._runner.run(lambda: self._aio.flush(namespace, servers=servers))

    def stats(self) -> dict[str, Any]:
        return self._runner.run(lambda: self._aio.stats())

    def ping(self) -> float:
        return self._runner.run(lambda: self._aio.ping())


# help(KVClient) and signature-reading tools show AsyncKVClient's parameters, which **kwargs passes on.
KVClient.__init__.__signature__ = inspect.signature(AsyncKVClient.__init__)  # type: ignore[attr-defined]


def _close_abandoned(runner: _LoopThread, aio: AsyncKVClient) -> None:
    """Close the connections of a KVClient collected unclosed, on the loop thread, without waiting."""
    if aio.closed or runner.pid != os.getpid() or runner.loop.is_closed():
        return

    def start() -> None:
        task = runner.loop.create_task(aio.close())
        runner.closing.add(task)
        task.add_done_callback(runner.closing.discard)

    runner.loop.call_soon_threadsafe(start)


async def _make(addr: str | Sequence[str], kwargs: dict[str, Any]) -> AsyncKVClient:
    return AsyncKVClient(addr, **kwargs)  # built on the loop thread: its locks belong to that loop
