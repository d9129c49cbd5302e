"""``Node``: one server as a client sees it -- a small pool of pipelined connections, opened
lazily, with retries and a quarantine after failures. :class:`~.aio.AsyncKVClient` cuts its
batches per server and sends each share through that server's node.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import math
import os
import time
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Sequence

from kvstore.errors import InvalidRequest, KVStoreError, RequestTimeout, TransportError, Unavailable
from kvstore.protocol import Message, Ping

from .connection import ClientConnection, NotHome, NotSent, Response, open_connection
from .shm import ShmChannel, file_id, open_channel

if TYPE_CHECKING:
    from .aio import AsyncKVClient

log = logging.getLogger(__name__)

#: Forks this process descends from: a forked child's copy of a client shares its parent's
#: sockets (and its event loop's epoll set), so it must never use nor close them.
_forks = [0]
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=lambda: _forks.__setitem__(0, _forks[0] + 1))


def _parse_addr(addr: str) -> tuple[str, int]:
    """``"host:port"`` -> ``(host, port)``; raises ``InvalidRequest``."""
    if "://" in addr:  # ("http://h:7600" would parse as the host "http://h" and fail at the resolver)
        raise InvalidRequest(f"address must be 'host:port' (no scheme), got {addr!r}")
    host, sep, port = addr.rpartition(":")
    if not sep or not (port.isascii() and port.isdigit() and 0 < int(port) < 65536):
        raise InvalidRequest(f"address must be 'host:port' (port 1-65535), got {addr!r}")
    if "," in addr:  # (a vLLM kvstore_addr may be a comma-separated list; a client's address is one server)
        raise InvalidRequest(f"one address per string (pass a list for several servers), got {addr!r}")
    bracketed = host.startswith("[") and host.endswith("]")
    if bracketed:
        host = host[1:-1]
    if "[" in host or "]" in host or (":" in host and not bracketed):  # ("::1:7600": host ':' port 1, or ::1 port 7600?)
        raise InvalidRequest(f"an IPv6 address goes in brackets, once, as in '[::1]:7600'; got {addr!r}")
    return check_host(host, f"address {addr!r}") or "127.0.0.1", int(port)


def check_host(host: str, what: str) -> str:
    """``host`` if the resolver and TLS can take it as a name, else ``InvalidRequest`` (a name part
    over 63 characters, an empty one -- ``a..b`` -- or text that is not Unicode failed at connect
    time with a ``UnicodeError`` of the codec, past the client's typed errors)."""
    try:
        host.encode("idna")
    except UnicodeError as exc:
        raise InvalidRequest(f"{what}: not a usable host name ({exc})") from None
    return host


_CLOSED = "the client is closed"
_NO_ANSWER = object()  # (Node._instance_now: the server's arena instance could not be asked)
#: How often an idle client whose connections the server closed looks at the socket file of the
#: server whose arena it maps (Node._watch_socket).
WATCH_S = 1.0


def _retrieve(task: asyncio.Task[Any]) -> None:
    if not task.cancelled():
        task.exception()


def forks() -> int:
    """How many forks this process descends from (a client's home names it)."""
    return _forks[0]


def claim_home(client: AsyncKVClient) -> None:
    """Make this process and event loop the home of the client's connections, to all its servers,
    on its first call; raise :class:`NotHome` on a call from anywhere else (its sockets are another
    loop's, closed maybe, or a parent process's; one home for all: a foreign loop's call must not
    adopt a server not used yet)."""
    home = client.home
    if home is None:
        client.home = (_forks[0], asyncio.get_running_loop())
    elif home[0] != _forks[0]:
        raise NotHome("this AsyncKVClient was made in the parent of a fork; make a new one in this process")
    elif home[1] is not asyncio.get_running_loop():
        raise NotHome("this AsyncKVClient's connections belong to the event loop it first ran on "
                      "(an asyncio.run per call?); use one client per event loop")


class Node:
    """One server: a small pool of pipelined connections, opened lazily."""

    def __init__(self, addr: str, client: AsyncKVClient) -> None:
        self.addr = addr
        try:
            addr.encode()
        except UnicodeEncodeError:  # (a path or name read from bytes that are not UTF-8)
            raise InvalidRequest(f"address {addr!r} is not valid text") from None
        self.unix: str | None = addr[len("unix:"):] if addr.startswith("unix:") else None  # a Unix socket path
        if self.unix == "":
            raise InvalidRequest("a Unix socket address is 'unix:/path/to.sock'")
        self.host, self.port = ("localhost", 0) if self.unix else _parse_addr(addr)
        self.client = client
        self.shm: ShmChannel | None = None  # the server's arena, mapped (client/shm.py)
        self.shm_tried: str | None = None  # the server instance an attach was last tried with
        self.shm_retry_at = 0.0  # ... and when it may be tried again (monotonic; inf: never)
        self.conns: list[ClientConnection] = []
        # Connections being opened, each by a task of its own: they count toward pool_size, and a caller
        # that finds every slot taken by one waits for it instead of queueing for a connect of its own
        # (queued connects would add up: a server that never answers would cost each caller every
        # wait before its own).
        self.opening: set[asyncio.Task[ClientConnection]] = set()
        self.probing: set[asyncio.Task[None]] = set()  # is the server whose arena is mapped still there?
        self._attaching = asyncio.Lock()  # one open_channel at a time: it replaces self.shm
        # What one request may carry: the client's own limits, and the server's once its HELLO says.
        self.max_payload, self.max_batch = client.limits.max_payload, client.limits.max_batch
        self.lease_cut_told = False  # whether a log line said the server cut a pinned lookup's lease
        self.failed_told = -math.inf  # when a log line last said a lookup (or exists) went on without it
        self.hello_seen = False  # whether a connection has told the limits (and attached the arena)
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

    async def ready(self, idempotent: bool = True, always: bool = False) -> None:
        """Before a request to this server is cut, when no open connection has told its limits
        (its first request, or after its connections closed): a PING, so that a HELLO's limits
        (and arena) shape the cut. Its attempts are the request's (a failure here is the request's
        failure, ``always`` too: sent in a quarantine); a round trip more, once per server and
        reconnection."""
        if not self.limits_known:
            await self.call(Ping(), idempotent=idempotent, always=always)

    def _at_home(self) -> bool:
        """Whether this process and event loop own the client's connections (or it has none yet)."""
        home = self.client.home
        return home is None or (home[0] == _forks[0] and home[1] is asyncio.get_running_loop())

    async def connection(self) -> ClientConnection:
        if self.client.closed:  # (a request in flight while the client closed must not reconnect)
            raise TransportError(_CLOSED)
        claim_home(self.client)
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
        # Refused (the server's connection limit) while other connections are open or opening:
        # use those rather than fail the call. (Not after a connect that failed otherwise: waiting
        # for connects begun since, by other callers, would cost this call more than its own
        # connect_timeout per attempt.)
        pending = set(self.opening) if isinstance(error, Unavailable) else set()
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
            conn.on_lost = self._lost
            self.hello_seen = True  # (after the attach: a call that saw it early would pass the arena by)
            return conn
        finally:
            self.opening.discard(asyncio.current_task())  # type: ignore[arg-type]

    def _lost(self, conn: ClientConnection) -> None:
        """The last connection to the server whose arena is mapped closed: ask whether that server is
        still there (``_check_arena``). Its arena lives as long as a process maps it, and held until
        the next call it stood beside the arena a restarted server pre-faults: twice ``--capacity``
        of the host's memory."""
        info = conn.hello.get("shm")
        channel = self.shm
        if (channel is None or not isinstance(info, dict) or info.get("instance") != channel.segment.instance
                or any(c is not conn and not c.closed for c in self.conns)):
            return  # (a connection to an older server instance, or others left: nothing to ask yet)
        task = asyncio.get_running_loop().create_task(self._check_arena(channel))
        self.probing.add(task)
        task.add_done_callback(self.probing.discard)
        task.add_done_callback(_retrieve)

    async def _check_arena(self, channel: ShmChannel) -> None:
        """Let go of ``channel`` unless the server is still there: gone (nothing listens: a stopping
        server closes its listeners first) or another instance, it is unmapped; there, or not
        answering as a server should (stalled, at its limit, or a killed one whose socket has not
        closed yet), its socket file is watched (attaching again would populate the page tables of
        the whole arena anew)."""
        instance = await self._instance_now()
        if instance is _NO_ANSWER or instance == channel.segment.instance:
            await self._watch_socket(channel)
        else:
            self._unmap(channel)

    async def _instance_now(self) -> object:
        """The arena instance the server names in a new connection's HELLO: None where nothing
        listens (or it offers none), :data:`_NO_ANSWER` where the probe got no HELLO. (Apart from
        ``_check_arena``: a failed probe's traceback, kept in reference cycles, must not hold the
        channel, which kept a killed server's arena mapped until a full garbage collection.)"""
        c = self.client
        try:
            if self.unix:
                _, writer = await asyncio.wait_for(asyncio.open_unix_connection(self.unix), c.connect_timeout)
            else:
                _, writer = await asyncio.wait_for(asyncio.open_connection(self.host, self.port), c.connect_timeout)
            writer.close()
        except asyncio.TimeoutError:  # (first: on Python 3.11 and later it is an OSError too)
            return _NO_ANSWER
        except OSError:
            return None  # nothing listens: stopped
        try:
            probe = await open_connection(self.host, self.port, namespace=c.namespace, token=c.token,
                                          tls=c.tls, limits=c.limits, timeout=c.connect_timeout,
                                          server_hostname=c.server_hostname or self.host, unix=self.unix)
        except KVStoreError:
            return _NO_ANSWER
        info = probe.hello.get("shm")
        await probe.aclose()
        return info.get("instance") if isinstance(info, dict) else None

    async def _watch_socket(self, channel: ShmChannel) -> None:
        """Still there, but no connection is left to notice when it stops (closed for being idle):
        watch its socket file instead, which a stopping server removes (and a restarted one binds
        anew), about once a second, until a connection is open again. A file that changed is
        asked who serves there (a chmod of a live server's socket must not unmap its arena)."""
        if channel.segment.socket is None:
            return
        path, ident = channel.segment.socket
        while self.shm is channel and not any(not c.closed for c in self.conns):
            await asyncio.sleep(WATCH_S)
            try:
                now = file_id(os.stat(path))
            except OSError:  # gone: the server stopped, or a restarted one removed it first
                self._unmap(channel)
                return
            if now == ident:
                continue
            # Another file, or the same one changed (a chmod): is it still this server? Asked once per
            # change (a server at its connection limit refuses the probe: asked every second, it
            # counted two refused connections a second per idle client).
            instance = await self._instance_now()
            if instance == channel.segment.instance or instance is _NO_ANSWER:
                ident = now
            else:
                self._unmap(channel)

    def _unmap(self, channel: ShmChannel) -> None:
        if self.shm is channel:
            self.shm, self.shm_tried = None, None
            # Unmapped now where no copy holds a view (else when the last one ends): a failed call's
            # traceback keeps the channel in reference cycles that only a full collection breaks.
            channel.segment.close()

    async def call(self, msg: Message, payload: Sequence[memoryview] = (), payload_len: int | None = None,
                   make_sink: Callable[[dict[str, Any]], Any] | None = None, idempotent: bool = True,
                   orphan: Callable[[Response], None] | None = None,
                   unsent: Callable[[], None] | None = None, always: bool = False) -> Response:
        """One request, retried on a lost connection if ``idempotent``, or if it was never sent;
        sent even in a quarantine if ``always`` (an UNPIN: refusing a give-back only leaves leases
        behind).

        ``orphan``: once sent, the request is seen through even if the caller stops waiting (a
        cancel), and a reply that comes then goes to ``orphan`` (a pinned LOOKUP: what it pinned).
        ``unsent``: called when the call ends (an error, a cancel) before the request reached a
        connection, or with its bytes never sent, or when its caller was cancelled and the server
        then refused it (an unpinning GET: the leases it was to drop).
        """
        c = self.client
        sent = False  # whether the server may have the request
        try:
            if not always:
                self.check_up()
            attempts = 1 + c.retries
            for attempt in range(attempts):
                try:
                    conn = await self.connection()  # (a cancel while this waits: nothing sent)
                    request = conn.request(msg, payload, payload_len, make_sink, timeout=c.timeout, refused=unsent)
                    sent = True  # (its first step hands the frame to the connection)
                    resp = await request if orphan is None else await _kept(request, orphan)
                    self.failures = 0
                    return resp
                except RequestTimeout:
                    raise self.failed(RequestTimeout(f"{self.addr} did not answer within {c.timeout}s")) from None
                except NotHome:
                    raise  # (the caller's mistake: nothing to retry, and the server is not at fault)
                except TransportError as exc:
                    sent = sent and not isinstance(exc, NotSent)
                    if attempt == attempts - 1 or c.closed or not (idempotent or isinstance(exc, NotSent)):
                        if c.closed:
                            raise
                        if self.addr in str(exc):
                            raise self.failed(exc)
                        raise self.failed(type(exc)(f"{self.addr}: {exc}")) from exc  # ("connection lost": whose?)
                    await asyncio.sleep(c.backoff * 2**attempt)
            raise AssertionError("unreachable")
        except BaseException:
            if not sent and unsent is not None:
                unsent()
            raise

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
        for probe in self.probing:
            probe.cancel()
        opening, self.opening = self.opening, set()
        conns, self.conns = self.conns, []
        self._attaching = asyncio.Lock()  # (a lock waited on binds to that loop: the next home's own)
        if not self._at_home():  # another loop's or the parent's sockets: forgotten here, never touched
            self.shm, self.shm_tried = None, None
            return
        for conn in conns:  # what a request cut off by this reports (not "closed by server")
            conn.close_reason = conn.close_reason or TransportError(_CLOSED)
            conn.on_lost = None  # (closed by us: nothing to ask the server)
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
