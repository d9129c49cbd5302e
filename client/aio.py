"""``AsyncKVClient``: the asyncio client, the one implementation of the client logic.

One client talks to one server, or to several (``addr`` a list): keys are then
spread by rendezvous hashing (:mod:`.sharding`) and each batch operation costs
one round trip per server, in parallel. Each server gets a small pool of
pipelined connections.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import ctypes
import logging
import math
import os
import ssl
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Awaitable, Callable, NoReturn, Sequence, TypeVar

import xxhash

from kvstore.errors import (
    BlockSizeError, CapacityError, IntegrityError, InvalidRequest, KVStoreError, ProtocolError, RequestTimeout,
    ServerError, TooLarge, TransportError, from_code,
)
from kvstore.keys import check_keys
from kvstore.protocol import (
    DEFAULT_LIMITS, EXISTED, STORED, Delete, Exists, Flush, Get, Limits, Lookup, Message, Ping, Put, Stats, Unpin,
    flat_bytes, iter_payload,
)

from . import replies, workers
from .connection import ClientConnection, Response, open_connection
from .shm import GetOutcome, ShmChannel, ShmGone, open_channel
from .sharding import Ring
from .workers import run_parallel

T = TypeVar("T")
log = logging.getLogger(__name__)

#: Forks this process descends from: a forked child's copy of a client shares its parent's
#: sockets (and its event loop's epoll set), so it must never use nor close them.
_forks = [0]
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=lambda: _forks.__setitem__(0, _forks[0] + 1))


def checksum(block: memoryview) -> int:
    """The block checksum stored beside every block: xxh3-64 (tens of GB/s)."""
    return xxhash.xxh3_64_intdigest(block)


def checksums(blocks: Sequence[memoryview]) -> list[int]:
    """Each block's checksum; a large batch of large blocks (:func:`workers.run_parallel`) is hashed
    on the helper threads too: a put's server waits for them with its core idle (puts of 1-4 MiB
    x 32 into a full store, A/B runs against hashing inline: 0.96-1.08x, median 1.03-1.06x)."""
    return run_parallel([partial(xxhash.xxh3_64_intdigest, b) for b in blocks], sum(map(len, blocks)))


@dataclass(frozen=True)
class PutResult:
    """Outcome of a put: counts, and per key ``"stored"``, ``"existed"`` or ``"failed"``."""

    stored: int
    existed: int
    failed: int
    statuses: list[str]
    errors: dict[int, KVStoreError] = field(default_factory=dict)


def _parse_addr(addr: str) -> tuple[str, int]:
    if "://" in addr:  # ("http://h:7600" would parse as the host "http://h" and fail at the resolver)
        raise InvalidRequest(f"address must be 'host:port' (no scheme), got {addr!r}")
    host, sep, port = addr.rpartition(":")
    if not sep or not (port.isascii() and port.isdigit() and 0 < int(port) < 65536):
        raise InvalidRequest(f"address must be 'host:port' (port 1-65535), got {addr!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


class _Recycler:
    """Buffers for ``get`` without caller buffers: the ones callers dropped, reused.

    A new ``bytearray(n)`` of a large block is fresh memory from the OS, zeroed
    and page-faulted before a byte is received (~1 GB/s on a small VM against
    tens of GB/s into touched memory; the benchmark's ``get`` of 1 MiB x 32 ran
    at 40 % of ``get_into`` for it). A block ``get`` returns is the caller's for
    as long as it holds a reference -- or anything made from it: a memoryview,
    a numpy array or a tensor over it holds one too. When the recycler's own
    reference is the last (CPython's reference count), the block is unreachable
    and its touched memory serves the next ``get`` of that size. Holds at most
    ``max_bytes`` of blocks; looks at a few per request, never scans them all.
    """

    _PROBE = 4  # candidates checked per request before a new buffer is made

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.held = 0
        self._by_size: dict[int, deque[bytearray]] = {}

    def take(self, size: int) -> bytearray:
        q = self._by_size.get(size)
        if q:
            for _ in range(min(len(q), self._PROBE)):
                buf = q.popleft()
                q.append(buf)
                if sys.getrefcount(buf) == 3:  # the deque, `buf`, getrefcount's argument: nobody else
                    if len(buf) == size:
                        return buf
                    q.pop()  # resized by its last holder (extend, del buf[i:]): not of this size any more
                    self.held -= size
        buf = bytearray(size)
        if self.held + size > self.max_bytes:
            self._trim(size)
        if self.held + size <= self.max_bytes:
            self._by_size.setdefault(size, deque()).append(buf)
            self.held += size
        return buf

    def _trim(self, size: int) -> None:
        """Let go of a few dropped buffers of other sizes (a size no longer asked for must not pin memory)."""
        looked = 0
        for other, q in list(self._by_size.items()):
            if other == size:
                continue
            for _ in range(len(q)):
                looked += 1
                buf = q.popleft()
                if sys.getrefcount(buf) == 2:  # `buf`, getrefcount's argument: free, forget it
                    self.held -= other
                else:
                    q.append(buf)
                if looked >= 16:
                    break
            if not q:
                del self._by_size[other]
            if looked >= 16 or self.held + size <= self.max_bytes:
                return


class _GetSink:
    """Receives a GET reply's blocks into new (or recycled) buffers, or into the caller's.

    With ``verify``, each block is checksummed piece by piece as it lands
    (``received``), while the piece is still in cache; a block that passes gets
    checksum 0 (nothing left to check), one that fails keeps its checksum and the
    caller reports it. ``finish`` settles the last block.
    """

    def __init__(self, fields: dict[str, Any], keys: Sequence[bytes], buffers: Sequence[memoryview] | None,
                 recycler: _Recycler | None = None, verify: bool = False) -> None:
        n = len(keys)
        self.keys = keys
        sizes = replies.block_sizes(fields.get("sizes"), n, "GET")
        sums = replies.checksums(fields.get("checksums"), n, "GET")
        self.index = [i for i, s in enumerate(sizes) if s >= 0]
        self.sizes = [sizes[i] for i in self.index]
        self.checksums = sums
        self.buffers = buffers
        self.recycler = recycler
        self.verify = verify
        self.out: list[memoryview | bytearray | None] = [None] * n
        self.errors: dict[int, KVStoreError] = {}
        self._hasher: Any = None  # of the block arriving now, when it is checked
        self._hashing = -1

    def target(self, j: int) -> list[memoryview] | None:
        self.finish()  # block j-1 is complete
        i, size = self.index[j], self.sizes[j]
        if self.buffers is None:
            buf = self.recycler.take(size) if self.recycler is not None else bytearray(size)
            dst: memoryview | bytearray = buf
        else:
            dst = self.buffers[i]
            if len(dst) != size:
                self.errors[i] = replies.size_error(self.keys[i], size, len(dst))
                return None
        self.out[i] = dst
        if self.verify and self.checksums[i]:
            self._hasher, self._hashing = xxhash.xxh3_64(), i
        return [memoryview(dst)]

    def received(self, j: int, piece: memoryview) -> None:
        if self._hasher is not None:
            self._hasher.update(piece)

    def finish(self) -> None:
        if self._hasher is not None:
            if self._hasher.intdigest() == self.checksums[self._hashing]:
                self.checksums[self._hashing] = 0
            self._hasher = None


_CLOSED = "the client is closed"


def _retrieve(task: asyncio.Task[Any]) -> None:
    if not task.cancelled():
        task.exception()


class _Node:
    """One server: a small pool of pipelined connections, opened lazily."""

    def __init__(self, addr: str, client: AsyncKVClient) -> None:
        self.addr = addr
        self.unix: str | None = addr[len("unix:"):] if addr.startswith("unix:") else None  # a Unix socket path
        if self.unix == "":
            raise InvalidRequest("a Unix socket address is 'unix:/path/to.sock'")
        self.host, self.port = ("localhost", 0) if self.unix else _parse_addr(addr)
        self.client = client
        self.shm: ShmChannel | None = None  # the server's arena, mapped (client/shm.py)
        self.shm_tried: str | None = None  # the server instance an attach was last tried with
        self.conns: list[ClientConnection] = []
        # Connections being opened, each by a task of its own: they count toward pool_size, and a caller
        # that finds every slot taken by one waits for it instead of queueing for a connect of its own
        # (queued connects would add up: a server that never answers would cost each caller every
        # wait before its own).
        self.opening: set[asyncio.Task[ClientConnection]] = set()
        self._attaching = asyncio.Lock()  # one open_channel at a time: it replaces self.shm
        # What one request may carry: the client's own limits, and the server's once its HELLO says.
        self.max_payload, self.max_batch = client.limits.max_payload, client.limits.max_batch
        self.lease_cut_told = False  # whether a log line said the server cut a pinned lookup's lease
        self.failed_told = -math.inf  # when a log line last said a lookup (or exists) went on without it
        self.hello_seen = False  # whether a connection has told the limits (and attached the arena)
        self.home: tuple[int, asyncio.AbstractEventLoop] | None = None  # (fork count, loop) of its connections
        self.down_until = -math.inf  # quarantined until (the client's ``quarantine``), after ...
        self.down_error: TransportError | None = None  # ... this failure,
        self.failures = 0  # the latest of so many in a row

    def batches(self, sizes: Sequence[int]) -> list[range]:
        """A batch cut into consecutive runs within the server's payload and key limits: one
        frame of a long prompt's KV (several GB for a large model) would be refused whole."""
        if len(sizes) <= self.max_batch and sum(sizes) <= self.max_payload:  # the usual case: one run
            return [range(len(sizes))]
        out: list[range] = []
        lo = total = 0
        for i, n in enumerate(sizes):
            if i > lo and (i - lo >= self.max_batch or total + n > self.max_payload):
                out.append(range(lo, i))
                lo, total = i, 0
            total += n
        out.append(range(lo, len(sizes)))
        return out

    def key_runs(self, n: int) -> list[range]:
        """``n`` keys of a request that carries no blocks (lookup, exists, ...) in runs the server's
        ``--max-batch`` allows: a chain of a very long prompt can pass it (16,384 blocks by default)."""
        step = self.max_batch
        return [range(lo, min(lo + step, n)) for lo in range(0, n, step)]

    @property
    def limits_known(self) -> bool:
        """Whether an open connection's HELLO has told this server's limits (and arena): once none
        is open, the next may reach a server restarted with others (a smaller --max-batch)."""
        return self.hello_seen and any(not c.closed for c in self.conns)

    async def ready(self, idempotent: bool = True) -> None:
        """Before a request to this server is cut, when no open connection has told its limits
        (its first request, or after its connections closed): a PING, so that a HELLO's limits
        (and arena) shape the cut. Its attempts are the request's (a failure here is the request's
        failure); a round trip more, once per server and reconnection."""
        if not self.limits_known:
            await self.call(Ping(), idempotent=idempotent)

    def _at_home(self) -> bool:
        """Whether this process and event loop own the node's connections (or it has none yet)."""
        if self.home is None:
            return True
        return self.home[0] == _forks[0] and self.home[1] is asyncio.get_running_loop()

    async def connection(self) -> ClientConnection:
        if self.client.closed:  # (a request in flight while the client closed must not reconnect)
            raise TransportError(_CLOSED)
        if self.home is None:
            self.home = (_forks[0], asyncio.get_running_loop())
        elif not self._at_home():  # its sockets are another loop's (closed, maybe), or a parent process's
            if self.home[0] != _forks[0]:
                raise TransportError("this AsyncKVClient was made in the parent of a fork; make a new one "
                                     "in this process")
            raise TransportError("this AsyncKVClient's connections belong to the event loop it first ran on "
                                 "(an asyncio.run per call?); use one client per event loop")
        for conn in self.conns:  # fast path: an idle live connection (no lists built per request)
            if not conn.pending and not conn.closed:
                return conn
        self.conns = [c for c in self.conns if not c.closed]
        idle = [c for c in self.conns if c.in_flight == 0]
        if idle:
            return idle[0]
        if len(self.conns) + len(self.opening) < self.client.pool_size:
            task = asyncio.ensure_future(self._open())
            task.add_done_callback(_retrieve)  # (its callers may all have gone: no "never retrieved" log)
            self.opening.add(task)
            waiting = {task}
        elif self.conns:
            return min(self.conns, key=lambda c: c.in_flight)
        else:
            waiting = set(self.opening)
        # (wait() does not cancel the opening when this caller is cancelled: other callers may share it)
        done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        opened = done.pop()
        if opened.cancelled():  # by close()
            raise TransportError(_CLOSED)
        error = opened.exception()  # (shared by every caller that waited for this open)
        if error is None:
            conn = opened.result()
            if conn.closed:  # (one of the caller's attempts: reconnecting here never ends with a peer that hangs up)
                raise conn.close_reason or TransportError(f"{self.addr} closed the connection")
            return conn
        # Refused (say, the server's connection limit) while other connections are open or
        # opening: use those rather than fail the call.
        pending = set(self.opening)
        while pending and not any(not c.closed for c in self.conns):
            _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        live = [c for c in self.conns if not c.closed]
        if not live:  # (a copy per caller: one shared object would gather every caller's frames)
            raise copy.copy(error) from error
        return min(live, key=lambda c: c.in_flight)

    async def _open(self) -> ClientConnection:
        """Open one pool connection, in a task of its own; close() cancels it (its socket is then closed)."""
        c = self.client
        try:
            conn = await open_connection(self.host, self.port, namespace=c.namespace, token=c.token, tls=c.tls,
                                         limits=c.limits, timeout=c.connect_timeout,
                                         server_hostname=c.server_hostname or self.host, unix=self.unix)
            limits = conn.hello.get("limits")
            if isinstance(limits, dict):  # (a server that does not say keeps the client's own)
                for name in ("max_payload", "max_batch"):
                    if type(limits.get(name)) is int and limits[name] > 0:
                        setattr(self, name, min(getattr(c.limits, name), limits[name]))
            try:
                async with self._attaching:
                    self.shm = await open_channel(self, conn)  # attach, keep, or drop the shared arena
            except BaseException:
                await conn.discard(TransportError("shared-memory attach failed; connection discarded"))
                raise
            if c.closed:  # close()'s cancel came as the open ended (and was lost): join nothing
                await conn.discard(TransportError(_CLOSED))
                raise TransportError(_CLOSED)
            self.conns.append(conn)
            self.hello_seen = True  # (after the attach: a call that saw it early would pass the arena by)
            return conn
        finally:
            self.opening.discard(asyncio.current_task())  # type: ignore[arg-type]

    async def call(self, msg: Message, payload: Sequence[memoryview] = (), payload_len: int | None = None,
                   make_sink: Callable[[dict[str, Any]], Any] | None = None, idempotent: bool = True,
                   orphan: Callable[[Response], None] | None = None) -> Response:
        """One request, retried on a lost connection if ``idempotent``.

        ``orphan``: once sent, the request is seen through even if the caller stops waiting (a
        cancel), and a reply that comes then goes to ``orphan`` (a pinned LOOKUP: what it pinned).
        """
        c = self.client
        if not isinstance(msg, Unpin):  # (a give-back is always tried: refusing it only leaves leases behind)
            self.check_up()
        attempts = 1 + (c.retries if idempotent else 0)
        for attempt in range(attempts):
            try:
                conn = await self.connection()
                request = conn.request(msg, payload, payload_len, make_sink, timeout=c.timeout)
                resp = await request if orphan is None else await _kept(request, orphan)
                self.failures = 0
                return resp
            except RequestTimeout:
                raise self.failed(RequestTimeout(f"{self.addr} did not answer within {c.timeout}s")) from None
            except TransportError as exc:
                if attempt == attempts - 1 or c.closed:
                    if c.closed:
                        raise
                    if self.addr in str(exc):
                        raise self.failed(exc)
                    raise self.failed(type(exc)(f"{self.addr}: {exc}")) from exc  # ("connection lost": whose?)
                await asyncio.sleep(c.backoff * 2**attempt)
        raise AssertionError("unreachable")

    def check_up(self) -> None:
        """Raise at once while the server is quarantined (the client's ``quarantine``)."""
        if self.down_error is not None and time.monotonic() < self.down_until:
            raise TransportError(f"{self.addr} is not asked for {self.down_until - time.monotonic():.1f}s more "
                                 f"(quarantine) after: {self.down_error}")

    def failed(self, exc: TransportError) -> TransportError:
        """Note a call that failed for good: with a ``quarantine``, the server is not asked for a while
        (calls that fail while it is already quarantined, having started before, do not extend it)."""
        q = self.client.quarantine
        now = time.monotonic()
        if q and now >= self.down_until:
            self.failures += 1
            self.down_until, self.down_error = now + q * 2 ** min(self.failures - 1, 3), exc
            log.warning("%s failed (%s): not asked for %.1fs", self.addr, exc, self.down_until - now)
        return exc

    async def close(self) -> None:
        opening, self.opening = self.opening, set()
        conns, self.conns = self.conns, []
        at_home, self.home = self._at_home(), None
        if not at_home:  # another loop's or the parent's sockets: forgotten here, never touched
            self.shm, self.shm_tried = None, None
            return
        for conn in conns:  # what a request cut off by this reports (not "closed by server")
            conn.close_reason = conn.close_reason or TransportError(_CLOSED)
        closing = asyncio.gather(*(conn.aclose() for conn in conns))
        while opening:  # cut off connects and HELLOs in progress (again while one runs on: wait_for on
            for task in opening:  # Python 3.11 can drop a cancel); each closes its socket as it ends
                task.cancel()
            _, opening = await asyncio.wait(opening, timeout=0.1)
        await closing
        if self.shm is not None:
            self.shm.segment.close()
        self.shm, self.shm_tried = None, None  # (also when close() cut off the first attach)


async def _kept(request: Awaitable[Response], orphan: Callable[[Response], None]) -> Response:
    """Await ``request``; if the caller is cancelled first, let it finish and hand its reply to ``orphan``."""
    task = asyncio.ensure_future(request)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        def settle(t: asyncio.Future[Response]) -> None:
            if not t.cancelled() and t.exception() is None:  # (a failed one: nothing to hand on)
                orphan(t.result())

        task.add_done_callback(settle)
        raise


class AsyncKVClient:
    """Asyncio client of one kvstore server, or of several (keys sharded).

    Args:
        addr: ``"host:port"``, ``"unix:/path/to.sock"`` (same host), or a list of them.
        namespace: the namespace every operation works in.
        token: shared secret, when the server requires one; trailing whitespace (the newline of a
            file read whole) is dropped, as the server drops it from its token file's lines.
        tls: an ``ssl.SSLContext``, ``True`` for the system defaults, or a CA file path.
        pool_size: connections per server.
        timeout: seconds a request may take before ``RequestTimeout`` (None: no limit; bad
            values of this and the other settings raise ``InvalidRequest``).
        connect_timeout: seconds to connect, say HELLO and map a same-host server's arena
            (None: no limit); with ``retries``, a server that never answers costs a call up to
            ``connect_timeout * (1 + retries)`` (and the backoff) before ``TransportError``,
            however many calls share the client: they wait for the same connects.
        retries: retries of a request after a transport error (never of a pinning lookup,
            an unpinning get or an unpin: the server may have run them already).
        quarantine: seconds a server that timed out or could not be reached is not asked:
            calls to it fail at once with ``TransportError`` (over several servers, a lookup
            or exists answers from the others at once), then the next call tries it again;
            each failure in a row doubles the time, up to 8x (an ``unpin``, and the leases a
            failed or cancelled lookup gives back, are always tried). For a cache whose caller must
            not wait a timeout per request on a server that stopped answering (an engine's
            scheduler); 0 (default): every call tries.
        verify: check each block's checksum on get (``IntegrityError`` on mismatch).
        shm: map the server's block arena and copy payloads through it (``docs/shm.md``):
            ``None`` (default) when connected over the Unix socket, ``True`` also from a
            TCP address (via the socket path the server announces, on its host only),
            ``False`` never. Whenever the server does not offer it, the socket is used.
        recycle_bytes: up to this many bytes of blocks returned by ``get`` are reused by
            later ``get`` calls once the caller has dropped every reference to them
            (their memory is already faulted in); 0 allocates every block afresh.
        split_bytes: a get or get_into of at least twice this many bytes from one server is
            split into parts of at least this size, sent in parallel over up to ``pool_size``
            connections (0: one request per server). Puts are never split: a batch is one chain.
    """

    def __init__(self, addr: str | Sequence[str] = "127.0.0.1:7600", *, namespace: str = "default",
                 token: str | None = None, tls: ssl.SSLContext | bool | str | None = None, pool_size: int = 4,
                 timeout: float = 30.0, connect_timeout: float | None = 5.0, retries: int = 2, backoff: float = 0.05,
                 quarantine: float = 0.0, verify: bool = True, limits: Limits = DEFAULT_LIMITS,
                 server_hostname: str | None = None, shm: bool | None = None, recycle_bytes: int = 256 << 20,
                 split_bytes: int = 16 << 20) -> None:
        addrs = [addr] if isinstance(addr, str) else _listed(addr, "addr")
        if not addrs:
            raise InvalidRequest("no server address given")
        if not all(isinstance(a, str) for a in addrs):
            raise InvalidRequest(f"a server address is a string, got {addrs!r}")
        if len(set(addrs)) != len(addrs):
            raise InvalidRequest(f"server addresses must be distinct, got {addrs}")
        self.namespace = namespace
        if token is not None and not isinstance(token, str):
            raise InvalidRequest(f"token must be a string, got {type(token).__name__}")
        # (not the leading: in the server's "GLOB: TOKEN" lines the space is part of the token)
        self.token = token.rstrip() if token is not None else None
        self.tls = _ssl_context(tls)
        self.server_hostname = server_hostname
        if type(pool_size) is not int or pool_size < 1:
            raise InvalidRequest(f"pool_size must be an integer >= 1, got {pool_size!r}")
        if type(retries) is not int or retries < 0:
            raise InvalidRequest(f"retries must be an integer >= 0, got {retries!r}")
        self.pool_size = pool_size
        self.timeout = _seconds("timeout", timeout)
        self.connect_timeout = _seconds("connect_timeout", connect_timeout)
        self.retries = retries
        self.backoff = _seconds("backoff", backoff, zero=True)
        self.quarantine = _seconds("quarantine", quarantine, zero=True) or 0.0
        for name, value in (("recycle_bytes", recycle_bytes), ("split_bytes", split_bytes)):
            if type(value) is not int or value < 0:
                raise InvalidRequest(f"{name} must be an integer >= 0 (bytes), got {value!r}")
        if not isinstance(limits, Limits):
            raise InvalidRequest(f"limits must be a kvstore.protocol.Limits, got {limits!r}")
        if shm not in (None, True, False):
            raise InvalidRequest(f"shm must be None, True or False, got {shm!r}")
        workers.check_setting()
        self.verify = verify
        self.limits = limits
        self.shm = shm
        self._recycler = _Recycler(recycle_bytes) if recycle_bytes > 0 else None
        self.split_bytes = split_bytes
        self._block_bytes = 0  # average block size of the last get: how big an unsized read is
        self.nodes = [_Node(a, self) for a in addrs]
        self.closed = False  # by close(), until connect()
        self._background: set[asyncio.Future[None]] = set()  # leases given back after a failed lookup
        self.ring = Ring([n.addr for n in self.nodes])

    async def __aenter__(self) -> AsyncKVClient:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def connect(self) -> None:
        """Open one connection per server now (fails fast on a wrong address or token)."""
        self.closed = False
        await asyncio.gather(*(n.connection() for n in self.nodes))

    async def close(self) -> None:
        """Close every connection; later calls raise ``TransportError`` until :meth:`connect`."""
        loop = asyncio.get_running_loop()
        giving_back = {f for f in self._background if f.get_loop() is loop}  # (another loop's: not ours to wait on)
        if giving_back:  # leases a failed lookup is giving back: let them go first (a second at most)
            await asyncio.wait(giving_back, timeout=1.0)
        self.closed = True
        await asyncio.gather(*(n.close() for n in self.nodes))

    # -- sharding helpers
    def _groups(self, keys: Sequence[bytes]) -> list[tuple[_Node, Sequence[int]]]:
        """Key indexes per server, each in the keys' order (one server: a range, no list)."""
        if len(self.nodes) == 1:
            return [(self.nodes[0], range(len(keys)))]
        groups: dict[int, list[int]] = {}
        for i, k in enumerate(keys):
            groups.setdefault(self.ring.node_of(k), []).append(i)
        return [(self.nodes[n], idx) for n, idx in groups.items()]

    def _local_parent(self, node: _Node, key: bytes | None) -> bytes | None:
        """``key`` as the parent of a server's share of a put, if that server holds it: a
        parent named but absent marks the block stranded (its predecessor was evicted)."""
        if key is None or len(self.nodes) == 1 or self.nodes[self.ring.node_of(key)] is node:
            return key
        return None

    def _read_groups(self, keys: Sequence[bytes], buffers: Sequence[memoryview] | None) -> list[tuple[_Node, Sequence[int]]]:
        """Like :meth:`_groups`, with a large read split into parts of at least
        ``split_bytes`` that go out in parallel over the server's pooled connections
        (block sizes: the buffers', or the last reply's average for ``get``), and one
        too big for a single reply into parts the server's limits allow."""
        groups = self._groups(keys)
        out: list[tuple[_Node, Sequence[int]]] = []
        for node, idx in groups:
            sizes = [len(buffers[i]) for i in idx] if buffers is not None else [self._block_bytes] * len(idx)
            runs = node.batches(sizes)
            if len(runs) > 1:  # one reply could not carry it
                out += [(node, idx[r.start:r.stop]) for r in runs]
                continue
            total = sum(sizes)
            parts = min(self.pool_size, len(idx), total // self.split_bytes) if self.split_bytes > 0 else 1
            if parts <= 1 or node.shm is not None:
                out.append((node, idx))
                continue
            step = -(-len(idx) // parts)
            out += [(node, idx[k:k + step]) for k in range(0, len(idx), step)]
        return out

    async def _per_node(self, keys: Sequence[bytes], fn: Callable[[_Node, Sequence[int]], Awaitable[T]],
                        groups: list[tuple[_Node, Sequence[int]]] | None = None) -> list[tuple[Sequence[int], T]]:
        groups = self._groups(keys) if groups is None else groups
        if len(groups) == 1:  # one server: no gather, no task (each costs loop iterations per request)
            node, idx = groups[0]
            return [(idx, await fn(node, idx))]
        # Every part settles before any error is raised: a part still running could write into the
        # caller's buffers (or read its blocks) after the call returned.
        results = await asyncio.gather(*(fn(node, idx) for node, idx in groups), return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r
        return [(idx, r) for (_, idx), r in zip(groups, results)]  # type: ignore[misc]

    # -- the API
    async def put(self, keys: Sequence[bytes], blocks: Sequence[Any], *, parent: bytes | None = None) -> PutResult:
        """Store blocks under content keys. Keys already stored are not stored again (``existed``).

        The keys are one chain, in order. ``parent`` is the key just before ``keys[0]``
        when the batch continues a stored prefix (an engine storing the blocks it
        computed after a prefix hit): the server then evicts the batch before that
        prefix, as it would a chain's tail, instead of treating it as a chain of its own.

        Raises:
            CapacityError (or another ServerError) when some block could not be stored, or
            TransportError / RequestTimeout when a server could not be reached or did not
            answer (any error of a server's share: its keys): the exception's ``result``
            attribute holds the per-key outcome (a PutResult), so with several servers the
            keys the others stored are known; ``errors``, each failed key's error.
            "failed" means not known to be stored: a server that took a batch and then
            went silent may have stored it.
        """
        keys = _checked_keys(keys)
        if parent is not None:
            parent = _checked_keys([parent])[0]
        views = iter_payload(_listed(blocks, "blocks"))
        if len(views) != len(keys):
            raise InvalidRequest(f"{len(keys)} keys but {len(views)} blocks")
        if not keys:
            return PutResult(0, 0, 0, [])

        async def one(node: _Node, idx: Sequence[int]) -> list[tuple[int, str | None] | KVStoreError]:
            try:
                await node.ready()
            except KVStoreError as exc:  # (this share's keys fail; the others' stand)
                return [exc] * len(idx)
            before = self._local_parent(node, keys[idx[0] - 1] if idx[0] else parent)
            share, blocks = _pick(keys, idx), _pick(views, idx)
            sizes = list(map(len, blocks))
            parts = node.batches(sizes)  # (each part continues the chain of the one before)
            whole = len(parts) == 1
            outcome: list[tuple[int, str | None] | KVStoreError] = []
            for part in parts:
                try:
                    outcome += await put_part(node, share if whole else share[part.start:part.stop],
                                              blocks if whole else blocks[part.start:part.stop],
                                              sizes if whole else sizes[part.start:part.stop],
                                              before if part.start == 0 else share[part.start - 1])
                except KVStoreError as exc:  # this part failed whole; what was stored before it still counts
                    return outcome + [exc] * (len(idx) - len(outcome))  # (a list: _per_node raises an exception)
            return outcome

        async def put_part(node: _Node, part_keys: list[bytes], blocks: list[memoryview], sizes: list[int],
                           before: bytes | None) -> list[tuple[int, str | None]]:
            nbytes = sum(sizes)
            too_large = len(sizes) == 1 and nbytes > node.max_payload  # (batches() gives such a block a run of its own)
            # same host: copied into the arena, checksummed on the way (small puts: ShmChannel.inline_put_bytes)
            if node.shm is not None and (nbytes >= node.shm.inline_put_bytes or too_large):
                with contextlib.suppress(ShmGone):  # (restarted without shm: the socket carries it)
                    return await node.shm.put(part_keys, blocks, before)
            if too_large:  # the server would drop the connection on its frame: say so here, for this key only
                return [(TooLarge.code, f"a block of {nbytes} bytes is over the {node.max_payload} bytes "
                                        f"one request to {node.addr} may carry (its --max-frame-size)")]
            msg = Put(keys=part_keys, sizes=sizes, checksums=checksums(blocks), parent=before)
            resp = await node.call(msg, blocks, nbytes)
            return replies.statuses(resp.fields, len(part_keys), "PUT")

        statuses: list[str] = [""] * len(keys)
        errors: dict[int, KVStoreError] = {}
        for idx, outcome in await self._per_node(keys, one):
            for i, item in zip(idx, outcome):
                if isinstance(item, KVStoreError):
                    statuses[i] = "failed"
                    errors[i] = item
                    continue
                code, message = item
                if code == STORED:
                    statuses[i] = "stored"
                elif code == EXISTED:
                    statuses[i] = "existed"
                else:
                    statuses[i] = "failed"
                    errors[i] = from_code(code, message or "block not stored")
        result = PutResult(statuses.count("stored"), statuses.count("existed"), len(errors), statuses, errors)
        if errors:
            _raise_partial(errors, len(keys), "not stored", result)
        return result

    async def lookup(self, keys: Sequence[bytes], *, pin: bool = False, lease_ms: int | None = None) -> int:
        """How many leading keys are present: the largest m with keys[:m] all stored.

        One round trip per server (one per ``--max-batch`` keys of a longer chain, until
        one finds a key missing). ``pin=True`` leases those blocks (``lease_ms``, default
        the server's) so eviction cannot take them before the fetch. A pinned lookup that
        raises (or is cancelled) gives back the leases it took: a request in flight when the
        caller is cancelled is seen through, and what it pinned is given back; one that gets
        no answer (a server that stopped answering) may have pinned, its leases end with their time.

        Over several servers, a lookup answers from those that did: a key of a server that
        failed (down, silent, refusing) counts as missing, so the answer is what can be fetched
        now, and a warning is logged (once per server per minute). It raises only when no
        server answered. Leases such a server took before it failed are given back in the
        background; ``close()`` gives that a second, after which they end with their time.
        """
        keys = _checked_keys(keys)
        Lookup.check_lease(lease_ms)
        if not keys:
            return 0

        pinned: list[tuple[_Node, Sequence[int]]] = []  # the leases taken, by key index

        def leased(lo: int, hi: int) -> list[tuple[_Node, list[bytes]]]:
            return [(node, [keys[i] for i in ix if lo <= i < hi]) for node, ix in pinned]

        async def one(node: _Node, idx: Sequence[int]) -> int:
            await node.ready(idempotent=not pin)
            found = 0
            for run in node.key_runs(len(idx)):  # (a run starts where the one before found every key)
                part = _pick(keys, idx[run.start:run.stop])
                resp = await node.call(Lookup(keys=part, pin=pin, lease_ms=lease_ms), idempotent=not pin,
                                       orphan=partial(self._unpin_orphan, node, part) if pin else None)
                n = resp.fields.get("n")
                if type(n) is not int or not 0 <= n <= len(part):
                    raise ProtocolError("malformed LOOKUP reply")
                found += n
                if pin and n:
                    pinned.append((node, idx[run.start:run.start + n]))
                granted = resp.fields.get("lease_ms")
                if lease_ms and type(granted) is int and granted < lease_ms and not node.lease_cut_told:
                    node.lease_cut_told = True  # (once per server: an engine asks the same on every lookup)
                    log.warning("%s leases pinned blocks for at most %d ms (its --max-lease-seconds); "
                                "asked for %d ms", node.addr, granted, lease_ms)
                if n < len(part):
                    break
            return found

        first_missing = len(keys)
        dropping = False
        try:
            shares = await self._answered(keys, one, "a lookup")
            failed = {node for node, _, n in shares if n is None}
            for _, idx, n in shares:
                if n is None:  # (its server failed)
                    first_missing = min(first_missing, idx[0])
                elif n < len(idx):
                    first_missing = min(first_missing, idx[n])
            if pin and len(shares) > 1:  # each server pinned its share's own prefix: drop the leases past the chain's
                dropping = True  # (shielded: a cancel must not cut the drop off half-way)
                past = leased(first_missing, len(keys))
                # (a server that failed after pinning an earlier run: not waited for)
                self._in_background(self._unpin_quietly([(node, ks) for node, ks in past if node in failed]))
                await asyncio.shield(self._in_background(
                    self._unpin_quietly([(node, ks) for node, ks in past if node not in failed])))
        except BaseException:  # (a cancel too) the caller learns of no lease: give back those it took
            # (in the background: not to wait on a server that failed, nor be cut off by a cancel). A LOOKUP
            # whose reply never came may have pinned too: unknown here, its lease ends with its time.
            if pinned:
                self._in_background(self._unpin_quietly(leased(0, first_missing if dropping else len(keys))))
            raise
        return first_missing

    async def _answered(self, keys: Sequence[bytes], one: Callable[[_Node, Sequence[int]], Awaitable[T]],
                        what: str) -> list[tuple[_Node, Sequence[int], T | None]]:
        """Each server, its share of ``keys`` and its answer, None for a server that failed (a
        ``KVStoreError``) while another answered; raises when none did."""
        groups = self._groups(keys)
        if len(groups) == 1:
            node, idx = groups[0]
            return [(node, idx, await one(node, idx))]
        results = await asyncio.gather(*(one(node, idx) for node, idx in groups), return_exceptions=True)
        failures = [r for r in results if isinstance(r, BaseException)]
        for r in failures:
            if not isinstance(r, KVStoreError):  # (a cancel, a bug)
                raise r
        if len(failures) == len(groups):
            raise failures[0]
        now = time.monotonic()
        for (node, _), r in zip(groups, results):
            if isinstance(r, KVStoreError) and now - node.failed_told > 60:
                node.failed_told = now
                log.warning("%s goes on without %s, its keys counted as missing: %s", what, node.addr, r)
        return [(node, idx, None if isinstance(r, BaseException) else r) for (node, idx), r in zip(groups, results)]

    def _unpin_orphan(self, node: _Node, part: list[bytes], resp: Response) -> None:
        """Give back what a pinned LOOKUP pinned after its caller stopped waiting (cancelled)."""
        n = resp.fields.get("n")
        if type(n) is int and 0 < n <= len(part) and not self.closed:
            self._in_background(self._unpin_quietly([(node, part[:n])]))

    def _in_background(self, work: Awaitable[None]) -> asyncio.Future[None]:
        """Run ``work`` on its own, kept until it ends (close() waits for it, a second at most)."""
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    @staticmethod
    async def _unpin_quietly(leases: list[tuple[_Node, list[bytes]]]) -> None:
        """Drop leases, in runs the servers take; best effort: a lease not dropped ends with its time."""
        async def drop(node: _Node, keys: list[bytes]) -> None:
            for run in node.key_runs(len(keys)):
                await node.call(Unpin(keys=keys[run.start:run.stop]), idempotent=False)

        await asyncio.gather(*(drop(node, keys) for node, keys in leases if keys), return_exceptions=True)

    async def get(self, keys: Sequence[bytes], *, unpin: bool = False) -> list[bytearray | None]:
        """The blocks, in key order; ``None`` where a key is missing.

        Raises:
            IntegrityError (a block failed its checksum), TransportError (a server could not
            be reached), ...: once every server's share has settled, with ``result``, the
            blocks in key order, ``None`` where missing or unusable (the others stand), and
            ``errors``, each unusable key's error.
        """
        out = await self._get(keys, None, unpin)
        return out  # type: ignore[return-value]

    async def get_into(self, keys: Sequence[bytes], buffers: Sequence[Any], *, unpin: bool = False) -> list[bool]:
        """Receive blocks straight into writable buffers of exactly the blocks' sizes.

        Returns per key whether it was found. Raises ``BlockSizeError`` when a
        buffer's size differs from its block's (after the whole reply is read); like
        every error of :meth:`get` it carries ``result`` (the filled buffers' views).
        So is a read-only or non-contiguous buffer; an object that is no buffer at all (a
        tensor) is an ``InvalidRequest``, as for :meth:`put`.
        """
        views = []
        for i, b in enumerate(_listed(buffers, "buffers")):
            try:
                mv = memoryview(b)
            except TypeError:
                raise InvalidRequest(f"buffer {i} is a {type(b).__name__}, not a writable buffer (tensors: "
                                     "kvstore.engine.transfer.PagedKVTransfer, or a CPU tensor's "
                                     ".view(torch.uint8).numpy())") from None
            except ValueError as exc:  # (numpy's datetime64 exports no buffer)
                raise InvalidRequest(f"buffer {i} is not a plain buffer: {exc} (a numpy array: "
                                     ".view(numpy.uint8))") from None
            if mv.readonly or not mv.c_contiguous:
                raise BlockSizeError(f"buffer {i} is not a writable contiguous buffer")
            views.append(flat_bytes(mv))
        keys = _listed(keys, "keys")  # (an iterator has no len: _get checks the keys themselves)
        if len(views) != len(keys):
            raise InvalidRequest(f"{len(keys)} keys but {len(views)} buffers")
        _refuse_overlaps(views)
        out = await self._get(keys, views, unpin)
        return [b is not None for b in out]

    async def _get(self, keys: Sequence[bytes], buffers: list[memoryview] | None,
                   unpin: bool) -> list[memoryview | bytearray | None]:
        keys = _checked_keys(keys)
        unready: dict[_Node, KVStoreError] = {}  # servers whose first connection failed: their shares fail
        if not all(node.limits_known for node in self.nodes):  # (a first call: the parts follow the limits)
            nodes = [node for node, _ in self._groups(keys)]
            for node, r in zip(nodes, await asyncio.gather(*(n.ready(not unpin) for n in nodes), return_exceptions=True)):
                if isinstance(r, KVStoreError):
                    unready[node] = r
                elif isinstance(r, BaseException):
                    raise r

        async def one(node: _Node, idx: Sequence[int]) -> _GetSink | GetOutcome:
            bufs = _pick(buffers, idx) if buffers is not None else None
            try:
                if node in unready:
                    raise unready[node]
                if node.shm is not None:  # same host: copied out of the arena, verified on the way
                    # (restarted without shm, or its shared-memory read pins at their limit: the socket carries it)
                    with contextlib.suppress(ShmGone, CapacityError):
                        return await node.shm.get(_pick(keys, idx), bufs, unpin, self.verify)
                share = _pick(keys, idx)
                resp = await node.call(Get(keys=share, unpin=unpin), idempotent=not unpin,
                                       make_sink=lambda f: _GetSink(f, share, bufs, self._recycler, self.verify))
            except TooLarge as exc:
                if buffers is not None or len(idx) < 2:  # (with buffers the sizes were known: a block too large)
                    return GetOutcome([None] * len(idx), [0] * len(idx), dict.fromkeys(range(len(idx)), exc))
                # Blocks of unknown sizes over the server's reply limit (nothing was sent, no lease
                # dropped): ask for each half.
                half = len(idx) // 2
                first, second = await one(node, idx[:half]), await one(node, idx[half:])
                return GetOutcome(first.out + second.out, first.checksums + second.checksums,
                                  {**first.errors, **{half + j: e for j, e in second.errors.items()}})
            except KVStoreError as exc:  # this share failed whole; the blocks of the others stand (.result)
                return GetOutcome([None] * len(idx), [0] * len(idx), dict.fromkeys(range(len(idx)), exc))
            assert isinstance(resp.sink, _GetSink)  # (a reply without payload has one too)
            resp.sink.finish()
            return resp.sink

        out: list[memoryview | bytearray | None] = [None] * len(keys)
        errors: dict[int, KVStoreError] = {}
        found = nbytes = 0
        for idx, sink in await self._per_node(keys, one, self._read_groups(keys, buffers)):
            for j, i in enumerate(idx):
                blob = sink.out[j]
                if blob is not None and self.verify and sink.checksums[j] and checksum(memoryview(blob)) != sink.checksums[j]:
                    errors[i] = IntegrityError(f"block {i} (key {keys[i].hex()}) failed its checksum")
                    blob = None
                if blob is not None:
                    found += 1
                    nbytes += len(blob)
                out[i] = blob
            errors.update({idx[j]: e for j, e in sink.errors.items()})
        if found:
            self._block_bytes = nbytes // found
        if errors:
            _raise_partial(errors, len(keys), "unusable", out)
        return out

    async def exists(self, keys: Sequence[bytes]) -> list[bool]:
        """Which keys are stored, in key order.

        Over several servers, as with ``lookup``: a key of a server that failed counts as absent
        (it cannot be read now; an engine asking what to store stores it again, and that put
        reports the server's failure), a warning is logged, and it raises only when no server
        answered. (``stats()`` lists a failed server under ``"errors"``; ``delete()``, ``unpin()``
        and ``flush()`` raise when one fails.)"""
        keys = _checked_keys(keys)
        if not keys:
            return []

        async def one(node: _Node, idx: Sequence[int]) -> list[bool]:
            await node.ready()
            out: list[bool] = []
            for run in node.key_runs(len(idx)):
                resp = await node.call(Exists(keys=_pick(keys, idx[run.start:run.stop])))
                out += replies.bools(resp.fields.get("present"), len(run), "present")
            return out

        present = [False] * len(keys)
        for _, idx, vals in await self._answered(keys, one, "an exists"):
            for i, v in zip(idx, vals or ()):
                present[i] = v
        return present

    async def delete(self, keys: Sequence[bytes]) -> int:
        """Delete blocks; returns how many were present."""
        return await self._count(_checked_keys(keys), lambda sub: Delete(keys=sub))

    async def unpin(self, keys: Sequence[bytes]) -> int:
        """Drop one lease per key (from ``lookup(pin=True)``); returns how many were dropped."""
        return await self._count(_checked_keys(keys), lambda sub: Unpin(keys=sub), idempotent=False)

    async def flush(self, namespace: str | None = None) -> int:
        """Delete every block of a namespace (this client's by default) on every server."""
        resps = await asyncio.gather(*(n.call(Flush(namespace=namespace or self.namespace), idempotent=True)
                                       for n in self.nodes))
        return sum(replies.count(r.fields, "n") for r in resps)

    async def stats(self) -> dict[str, Any]:
        """The server's statistics; with several servers, ``{"servers": {addr: stats}}``, and
        ``"errors": {addr: message}`` for those that failed (it raises only when none answered:
        a dashboard of four servers should show the three that are up)."""
        async def one(node: _Node) -> dict[str, Any]:
            st = (await node.call(Stats())).fields.get("stats")
            if not isinstance(st, dict):
                raise ProtocolError(f"malformed STATS reply from {node.addr}")
            return st

        if len(self.nodes) == 1:
            return await one(self.nodes[0])
        results = await asyncio.gather(*(one(n) for n in self.nodes), return_exceptions=True)
        failed = {n.addr: r for n, r in zip(self.nodes, results) if isinstance(r, BaseException)}
        for r in failed.values():
            if not isinstance(r, KVStoreError) or len(failed) == len(self.nodes):  # (a cancel, a bug; or none answered)
                raise r
        out: dict[str, Any] = {"servers": {n.addr: r for n, r in zip(self.nodes, results) if n.addr not in failed}}
        if failed:
            out["errors"] = {addr: f"{type(r).__name__}: {r}" for addr, r in failed.items()}
        return out

    async def ping(self) -> float:
        """Round-trip time in seconds (the slowest server's, when several)."""

        async def one(node: _Node) -> float:
            t0 = time.perf_counter()  # (not loop.time(): uvloop's moves in whole milliseconds)
            await node.call(Ping())
            return time.perf_counter() - t0

        if len(self.nodes) == 1:  # (a gather's task would add its loop turns, ~50 us here, to the time)
            return await one(self.nodes[0])
        return max(await asyncio.gather(*(one(n) for n in self.nodes)))

    async def _count(self, keys: list[bytes], make: Callable[[list[bytes]], Message], idempotent: bool = True) -> int:
        async def one(node: _Node, idx: Sequence[int]) -> int:
            await node.ready(idempotent)
            n = 0
            for run in node.key_runs(len(idx)):
                resp = await node.call(make(_pick(keys, idx[run.start:run.stop])), idempotent=idempotent)
                n += replies.count(resp.fields, "n")
            return n

        return sum(n for _, n in await self._per_node(keys, one)) if keys else 0


#: Which of a batch's errors names the exception raised: the caller's own mistake first, then a
#: corrupt block, then a server's refusal, then a server that could not be reached.
_RAISE_FIRST = (BlockSizeError, IntegrityError, ServerError)


def _raise_partial(errors: dict[int, KVStoreError], n: int, what: str, result: Any) -> NoReturn:
    """Raise for a batch that partly failed; ``.result`` holds the per-key outcome, ``.errors``
    each failed key's error. An error raised for every failed key at once (a server's share that
    failed whole, so it has a traceback; per-key statuses have none) is raised itself, with its
    own message, traceback and code."""
    def rank(i: int) -> tuple[int, int]:
        return next((r for r, t in enumerate(_RAISE_FIRST) if isinstance(errors[i], t)), len(_RAISE_FIRST)), i

    first = errors[min(errors, key=rank)]
    if first.__traceback__ is not None and all(e is first for e in errors.values()):
        exc = first
    else:
        exc = type(first)(f"{len(errors)} of {n} blocks {what}: {first}")
        exc.__cause__ = first
        if isinstance(first, ServerError):
            exc.code = first.code  # type: ignore[attr-defined]
    exc.result = result  # type: ignore[attr-defined]
    exc.errors = errors  # type: ignore[attr-defined]
    raise exc


def _pick(items: Sequence[T], idx: Sequence[int]) -> list[T]:
    """``items`` at ``idx`` (ascending, as the groups hold them); the list itself,
    not a copy, when ``idx`` is all of it: one server, the usual case."""
    if len(idx) == len(items) and isinstance(items, list):
        return items
    return [items[i] for i in idx]


def _listed(items: Any, what: str) -> list[Any]:
    """``items`` as a list: an argument that is no collection at all (e.g. None) is an InvalidRequest too,
    and so is one key or block passed alone (bytes would be taken apart into ints)."""
    if isinstance(items, (bytes, bytearray, str)) or (isinstance(items, memoryview) and items.ndim <= 1):
        raise InvalidRequest(f"{what} must be a sequence of them, not one {type(items).__name__} "
                             f"(for one, pass [{what[:-1]}])")
    try:
        return list(items)
    except (TypeError, NotImplementedError):  # (NotImplementedError: a memoryview of 2 dimensions or more)
        raise InvalidRequest(f"{what} must be a sequence, not {type(items).__name__}") from None


def _refuse_overlaps(views: Sequence[memoryview]) -> None:
    """Two destinations sharing memory would receive two blocks at once (a large read is split
    over connections): the buffer would hold neither, each checksum passing on its own bytes."""
    if len(views) < 2:
        return
    spans = sorted((ctypes.addressof(ctypes.c_char.from_buffer(v)), v.nbytes, i)
                   for i, v in enumerate(views) if v.nbytes)
    for (start, size, i), (nxt, _, j) in zip(spans, spans[1:]):
        if start + size > nxt:
            raise InvalidRequest(f"buffers {min(i, j)} and {max(i, j)} share memory: each block needs its own")


def _seconds(name: str, value: Any, zero: bool = False) -> float | None:
    """A setting in seconds: a number > 0 (>= 0 with ``zero``), or None (no limit)."""
    if value is None and not zero:
        return None
    # (the comparison refuses NaN too)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (value >= 0 if zero else value > 0):
        raise InvalidRequest(f"{name} must be a number of seconds {'>= 0' if zero else '> 0 or None'}, got {value!r}")
    return value


def _checked_keys(keys: Sequence[bytes]) -> list[bytes]:
    out = _listed(keys, "keys")
    try:
        check_keys(out)
    except InvalidRequest:  # bytes-like keys are accepted and sent as bytes; anything else fails again
        out = [bytes(k) if isinstance(k, (bytearray, memoryview)) else k for k in out]
        check_keys(out)
    return out


def _ssl_context(tls: ssl.SSLContext | bool | str | None) -> ssl.SSLContext | None:
    if tls is None or tls is False:
        return None
    if isinstance(tls, ssl.SSLContext):
        return tls
    if tls is True:
        return ssl.create_default_context()
    try:
        return ssl.create_default_context(cafile=tls)
    except (OSError, ssl.SSLError, TypeError) as exc:  # (FileNotFoundError names no file; TypeError: not a path)
        raise InvalidRequest(f"tls={tls!r}: cannot load it as a CA file ({getattr(exc, 'strerror', None) or exc})") from None


__all__ = ["AsyncKVClient", "PutResult"]
