"""The server's lifecycle: listen, serve, and on SIGTERM/SIGINT drain and stop.

Only lifecycle lives here (the shape of uvicorn's ``server.py``); what a
request does is :mod:`.service`, how its bytes move is :mod:`.connection`.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import math
import os
import resource
import signal
import socket
import ssl
import time
import weakref
from typing import TYPE_CHECKING, Any

from kvstore.config import ServerConfig, format_size
from kvstore.sockets import bracketed
from kvstore.store import BlockStore

from .auth import EncryptedKey, TokenTable, server_tls_context, warn_if_exposed
from .connection import Connection, RejectedConnection
from .service import Service, Session
from .shm import bind_unix_listener, check_unix_path, remove_unix_listener

if TYPE_CHECKING:
    from .metrics import MetricsServer
    from .redis_tier import RedisTier

log = logging.getLogger(__name__)


class StartupError(Exception):
    """The server cannot start as configured; the message names the flag and the file or address at fault."""


def _reason(exc: OSError) -> str:
    """The OS's reason alone: the caller names the file or address (asyncio's bind error repeats it)."""
    if exc.errno and exc.errno > 0 and not isinstance(exc, (ssl.SSLError, socket.gaierror)):
        return os.strerror(exc.errno)
    return exc.strerror or str(exc)


def _load_tokens(path: str | None) -> TokenTable | None:
    """The token file, read before the arena is pre-faulted: a bad one fails at once, by name."""
    if not path:
        return None
    try:
        return TokenTable.load(path)
    except OSError as exc:
        raise StartupError(f"--token-file {path}: {_reason(exc)}") from None
    except ValueError as exc:  # no token, a bad line (its message starts with the path), not UTF-8
        where = "" if str(exc).startswith(path) else f"{path}: "
        raise StartupError(f"--token-file {where}{exc}") from None


def _tls_context(config: ServerConfig) -> ssl.SSLContext | None:
    """The TLS context; load_cert_chain's errors name neither file, so each is opened first."""
    for flag, path in (("--tls-cert", config.tls_cert), ("--tls-key", config.tls_key)):
        if path:
            try:
                open(path, "rb").close()
            except OSError as exc:
                raise StartupError(f"{flag} {path}: {_reason(exc)}") from None
    try:
        return server_tls_context(config.tls_cert, config.tls_key)
    except EncryptedKey as exc:
        raise StartupError(f"--tls-key {config.tls_key}: {exc}") from None
    except ssl.SSLError as exc:
        raise StartupError(f"--tls-cert {config.tls_cert} --tls-key {config.tls_key}: not a PEM certificate "
                           f"chain and its private key ({exc.reason or exc})") from None


def _make_store(config: ServerConfig) -> BlockStore:
    """The block store; its arena is a shareable memfd when shm will be offered on a Unix socket."""
    if config.prefault and config.page_size > 0:  # (the arena's size: whole pages, at least one)
        size = max(1, config.capacity // config.page_size) * config.page_size
        log.info("pre-faulting %s of block memory (--capacity); the server listens when done", format_size(size))

    def make(shared: bool) -> BlockStore:
        return BlockStore(config.capacity, eviction=config.eviction, page_size=config.page_size,
                          lease_s=config.lease_seconds, prefault=config.prefault, shared_arena=shared,
                          max_block_size=min(config.max_block, config.max_frame_size))  # (GET must fit it)

    if not (config.unix and config.shm):
        return make(False)
    try:
        return make(True)
    except OSError as exc:  # no memfd here: the Unix socket still works, without shm
        log.warning("shared memory unavailable (%s): the Unix socket will serve without it", exc)
        return make(False)


def _listen_error(host: str, port: int, flag: str, exc: OSError) -> StartupError:
    """An unknown or foreign host is --host's fault, the rest the port flag's."""
    if isinstance(exc, socket.gaierror) or exc.errno == errno.EADDRNOTAVAIL:
        return StartupError(f"--host {host}: cannot listen on {host}:{port}: {_reason(exc)}")
    return StartupError(f"{flag} {port}: cannot listen on {host}:{port}: {_reason(exc)}")


def _unix_error(path: str, exc: OSError) -> StartupError:
    """(server.shm's messages name --unix and the path; a few of the system's do not)"""
    return StartupError(exc.strerror if (exc.strerror or "").startswith("--unix") else f"--unix {path}: {_reason(exc)}")


def _check_bindable(host: str, port: int | None, flag: str) -> None:
    """Fail now if ``host:port`` cannot be bound (in use, foreign host), not after ``--capacity``
    is pre-faulted: minutes for a large one, and again at every restart by a supervisor."""
    if not port:  # (off, or any free port)
        return
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        for family, kind, proto, _, addr in infos:
            with socket.socket(family, kind, proto) as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the listeners do
                if family == socket.AF_INET6:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                sock.bind(addr)
    except OSError as exc:
        raise _listen_error(host, port, flag, exc) from None


#: Descriptors the server needs besides its clients' connections and Redis's: listeners, the
#: metrics server and its scrapes, shm attaches in progress, files.
FD_RESERVE = 64
#: How long a connection may wait for its HELLO before a newer one may close it (see
#: ``Server._crowd_out_one``): a client's HELLO takes a round trip.
HELLO_GRACE_S = 1.0


def _fit_open_file_limit(max_connections: int, reserve: int) -> int:
    """Raise the soft open-file limit to what ``--max-connections`` needs (the hard limit caps it);
    the connections it leaves room for.

    Past the limit ``accept`` fails (EMFILE) and the client's connection is dropped without a
    word, and so does every new connection to Redis (read-throughs then answer "missing"),
    while a connection refused at ``--max-connections`` gets an error reply. Many systems start
    services with a soft limit of 1024, under the default ``--max-connections`` 1024.
    """
    need = max_connections + reserve
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return max_connections
    target = need if hard == resource.RLIM_INFINITY else min(need, hard)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = target
    except (ValueError, OSError):
        pass
    if soft >= need:
        log.info("open-file limit raised to %d (--max-connections %d)", soft, max_connections)
        return max_connections
    fit = max(1, soft - min(reserve, soft // 2))
    log.warning("the open-file limit is %d (ulimit -n; hard limit %d): --max-connections %d lowered to %d "
                "(raise the limit, e.g. LimitNOFILE= in systemd, to serve more)", soft, hard, max_connections, fit)
    return fit


def _backing_tier(config: ServerConfig) -> RedisTier | None:
    """The Redis tier the config asks for, or ``None``. redis-py is imported only then: it is
    a quarter of a memory-only server's start-up."""
    if not config.redis and not config.redis_cluster:
        return None
    from .redis_tier import RedisTier
    return RedisTier.from_config(config)


#: Signals that stop the server gracefully (drain, flush the write-behind queue, exit 0).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class Server:
    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        # the settings, files and Redis URL first: a bad one fails now, not after seconds of pre-faulting
        config.check()
        tokens = _load_tokens(config.token_file)
        self.tls = _tls_context(config)
        self.tier = _backing_tier(config)  # None: memory only (connects later, in serve_forever)
        _check_bindable(config.host, config.port, "--port")  # and the ports (listened on once pre-faulted)
        _check_bindable(config.host, config.metrics_port, "--metrics-port")
        if config.unix:
            try:
                check_unix_path(config.unix)
            except OSError as exc:
                raise _unix_error(config.unix, exc) from None
        self.max_connections = config.max_connections  # (fitted to the open-file limit at the start)
        try:
            self.store = _make_store(config)
        except (OSError, MemoryError) as exc:
            reason = _reason(exc) if isinstance(exc, OSError) else "out of memory"
            flag = f"--capacity {format_size(config.capacity)}"
            if config.page_size > config.capacity:  # (the arena holds one page at least)
                flag = f"--page-size {format_size(config.page_size)} (over {flag}: one page is mapped)"
            raise StartupError(f"{flag}: cannot map the block memory: {reason}") from None
        self.service = Service(self.store, config, self.tier, tokens)
        self.limits = config.limits()
        self.metrics: MetricsServer | None = None
        self.connections: set[Connection] = set()
        #: Connections yet to authenticate (with a token file) -> when they came, oldest first: see
        #: ``_crowd_out_one``.
        self.waiting_for_hello: dict[Connection, float] | None = {} if self.service.auth is not None else None
        self._crowd_logged = -math.inf
        self._handshaking: weakref.WeakSet[Connection] = weakref.WeakSet()
        self._handshake_logged = -math.inf
        self._servers: list[asyncio.AbstractServer] = []
        self._stopping = asyncio.Event()  # (a stop asked before serve_forever runs is kept)
        self._hurry = False  # asked to stop again while stopping
        self._hurried = asyncio.Event()
        self._tasks: list[asyncio.Task[Any]] = []
        self.poll = self.service.poll  # None: --busy-poll-us 0
        self.port: int | None = None
        self._unix_inode: int | None = None  # of the socket file we created (removed on shutdown)
        #: Acknowledged write-behind blocks the tier could not write before the server stopped
        #: (logged; ``kvstore-server`` then exits 1): lost with the process.
        self.unwritten_blocks = 0

    def _new_connection(self) -> Connection | RejectedConnection:
        # A TLS connection joins self.connections once its handshake is done; until then it counts
        # here (it leaves this weak set with the protocol object when the handshake fails).
        handshaking = sum(1 for c in self._handshaking if c.transport is None and not c.lost)
        waiting = self.waiting_for_hello
        if waiting and (len(waiting) >= max(1, self.max_connections // 4)
                        or len(self.connections) + handshaking >= self.max_connections):
            self._crowd_out_one(waiting)
        conn: Connection | RejectedConnection
        if len(self.connections) + handshaking >= self.max_connections:
            self.service.counters.connections_rejected += 1
            conn = RejectedConnection(self.max_connections, self.service.counters)
        else:
            conn = Connection(self.service, self.limits, self.connections, self.poll, self.waiting_for_hello)
            if self.tls is not None:
                self._handshaking.add(conn)
        if self.tls is not None:
            # The handshake's outcome reaches no protocol callback: a connection whose handshake
            # fails (or times out) is dropped before its connection_made, and let go of at once.
            weakref.finalize(conn, self._handshake_over, conn.session).atexit = False
        return conn

    def _crowd_out_one(self, waiting: dict[Connection, float]) -> None:
        """A new connection while a quarter of the slots wait for a HELLO, or none is free: close the
        oldest one that has waited HELLO_GRACE_S. Peers that never say HELLO, reconnecting as fast
        as they are closed, held every slot until --frame-timeout; a client's HELLO takes a round
        trip, so clients connecting at once never close each other."""
        now = time.monotonic()
        # (oldest first; one refused or timed out already is on its way out)
        conn = next((c for c in waiting if not c.closing), None)
        if conn is None or now - waiting[conn] < HELLO_GRACE_S:
            return
        conn.crowd_out()
        if now - self._crowd_logged > 10.0:
            self._crowd_logged = now
            log.warning("connections without a HELLO for %gs closed for newer ones (%d wait for theirs; "
                        "--max-connections %d)", HELLO_GRACE_S, len(waiting), self.max_connections,
                        extra={"event": "auth_crowded"})

    def _handshake_over(self, session: Session) -> None:
        """A TLS connection's protocol is gone; it never came up if its handshake failed."""
        if session.connected:
            return
        counters = self.service.counters
        counters.tls_handshake_failures += 1
        now = time.monotonic()
        if now - self._handshake_logged > 10.0:  # (one line per 10 s: a plaintext client retrying is a flood)
            self._handshake_logged = now
            log.warning("TLS handshakes failing (%d since start): a client without TLS, trusting another CA, "
                        "or not done within --frame-timeout", counters.tls_handshake_failures,
                        extra={"event": "tls_handshake_failed"})

    async def start(self) -> None:
        if self.tier is not None:
            try:
                await self.tier.start()  # a Redis that is down only makes it start degraded
            except ValueError as exc:  # ... one without the URL's database fails the start
                await self.tier.close()
                flag = "--redis-cluster" if self.config.redis_cluster else "--redis"
                raise StartupError(f"{flag} {self.tier.target.removeprefix('cluster ')}: {exc}") from None
        reserve = FD_RESERVE + (self.tier.max_connections() if self.tier is not None else 0)
        self.max_connections = self.service.max_connections = _fit_open_file_limit(self.config.max_connections, reserve)
        try:
            await self._start_tcp()
            await self._start_unix()
            self._tasks.append(asyncio.create_task(self._housekeeping()))
            if self.tier is not None:  # (apart: a probe of a Redis that hangs waits --redis-timeout)
                self._tasks.append(asyncio.create_task(self._tier_health()))
            self._tasks.append(asyncio.create_task(self._reap_connections()))
            warn_if_exposed(self.config.host, self.service.auth, self.tls is not None)
            await self._start_metrics()
        except BaseException:  # (a socket file left behind would read as a live server's to the next start)
            await self._close_at_once()
            raise
        log.info("kvstore-server listening on %s:%d capacity=%s eviction=%s tls=%s auth=%s", bracketed(self.config.host),
                 self.port, format_size(self.store.stats()["capacity"]), self.config.eviction,
                 "on" if self.tls else "off", "on" if self.service.auth else "off")

    async def _start_tcp(self) -> None:
        host, port = self.config.host, self.config.port
        handshake_timeout = (self.config.frame_timeout or None) if self.tls else None
        try:
            srv = await asyncio.get_running_loop().create_server(
                self._new_connection, host, port, reuse_address=True, backlog=1024, ssl=self.tls,
                ssl_handshake_timeout=handshake_timeout)
        except OSError as exc:
            raise _listen_error(host, port, "--port", exc) from None
        self._servers.append(srv)
        self.port = srv.sockets[0].getsockname()[1]

    async def _close_at_once(self) -> None:
        """:meth:`_close_now`, the metrics listener, and the tier, not flushed: a start that
        failed or was stopped half-way, or a cancelled server."""
        self._close_now()
        if self.metrics is not None:
            await self.metrics.close()
        if self.tier is not None:
            await self._end_tier_checks(0.0)
            self.tier.give_up()
            await self.tier.close()

    async def _end_tier_checks(self, timeout: float) -> None:
        """Let write-behind checks of blocks put again (``Service.tier_checks``) end, for at most
        ``timeout`` seconds or until the stop is asked again: a block they queue joins the queue's
        last flush. The rest are cut off, and the log says so."""
        checks: set[asyncio.Task[None]] = set(self.service.tier_checks)
        if not checks:
            return
        if timeout > 0:
            await self._until_hurried(checks, asyncio.get_running_loop().time() + timeout)
        cut = [t for t in checks if not t.done()]
        for task in cut:
            task.cancel()
        await asyncio.wait(checks)  # (each lets go of its pins as it ends)
        if cut:
            log.warning("stopping: %d check(s) in Redis of blocks put again were cut off (those blocks "
                        "were not checked, nor written again if Redis lacked them)", len(cut))

    async def _until_hurried(self, tasks: set[Any], deadline: float) -> set[Any]:
        """Wait for ``tasks`` until the loop's ``deadline`` or the stop is asked again; the ones
        not done. Nothing of its own is left pending when the caller's task is cancelled here."""
        loop = asyncio.get_running_loop()
        hurried = asyncio.create_task(self._hurried.wait())
        pending = set(tasks)
        try:
            while pending and not hurried.done() and loop.time() < deadline:
                _, pending = await asyncio.wait(pending | {hurried}, timeout=deadline - loop.time(),
                                                return_when=asyncio.FIRST_COMPLETED)
                pending.discard(hurried)
        finally:
            hurried.cancel()
        return pending

    async def _start_unix(self) -> None:
        """The same-host listener (--unix): same protocol, plus shared memory unless --no-shm."""
        path = self.config.unix
        if not path:
            return
        try:
            sock = bind_unix_listener(path)
        except OSError as exc:
            raise _unix_error(path, exc) from None
        self._unix_inode = os.stat(path).st_ino
        try:
            srv = await asyncio.get_running_loop().create_unix_server(self._new_connection, sock=sock, backlog=1024)
        except BaseException:
            sock.close()
            remove_unix_listener(path, self._unix_inode)
            raise
        self._servers.append(srv)
        log.info("unix socket %s (mode 0660) shm=%s", path, "on" if self.service.shm.offered else "off",
                 extra={"event": "unix_listening", "path": path})

    async def _start_metrics(self) -> None:
        if self.config.metrics_port is None:
            return
        from .metrics import MetricsServer  # (prometheus-client: only for a server that exports metrics)
        self.metrics = MetricsServer(self.service, self.config.host, self.config.metrics_port,
                                     draining=self._stopping.is_set)
        try:
            port = await self.metrics.start()
        except OSError as exc:
            raise _listen_error(self.config.host, self.config.metrics_port, "--metrics-port", exc) from None
        log.info("metrics served at http://%s:%d/metrics (health: /readyz, /healthz, /livez)", bracketed(self.config.host), port,
                 extra={"event": "metrics_started", "metrics_port": port})

    async def _reap_connections(self) -> None:
        """Close idle connections and drop stalled frames (--idle-timeout, --frame-timeout)."""
        idle, frame = self.config.idle_timeout, self.config.frame_timeout
        if not idle and not frame:
            return
        loop = asyncio.get_running_loop()
        period = min(1.0, *(t / 4 for t in (idle, frame) if t))  # a timeout fires at most 25 % late
        while True:
            await asyncio.sleep(period)
            now = loop.time()
            for conn in list(self.connections):
                conn.check_timeouts(now, idle, frame)

    async def _housekeeping(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            try:
                await self._housekeep()
            except Exception:  # (a bug in one step must not end lease expiry for good)
                log.exception("housekeeping failed; trying again in 1 s")

    async def _housekeep(self) -> None:
        self.store.expire_leases()
        expired = self.service.shm.expire()  # read pins of a client that hangs mid-copy
        for conn in list(self.connections):
            conn.release_sent()  # replies read by a client that sends nothing more
            if expired:
                conn.update_idle()  # a drain waiting only for those pins ends now

    async def _tier_health(self) -> None:
        assert self.tier is not None
        while True:
            await asyncio.sleep(1.0)
            try:
                await self.tier.check_health()  # notices outages and recoveries (with back-off)
            except Exception:
                log.exception("tier health check failed; trying again in 1 s")

    def request_stop(self) -> None:
        """Stop: drain, flush the write-behind queue, exit. A second request while that runs (a second
        Ctrl-C) stops the waiting: busy connections are closed, unwritten blocks reported (exit 1)."""
        if not self._stopping.is_set():
            self._stopping.set()
        elif not self._hurry:
            self._hurry = True
            log.warning("stopping now (asked again): no more waiting for connections or for Redis",
                        extra={"event": "stop_hurried"})
            self._hurried.set()
            if self.tier is not None:
                self.tier.give_up()

    async def serve_forever(self, install_signals: bool = True) -> None:
        """Serve until SIGTERM, SIGINT or SIGHUP (a closed terminal, a reload the server does not do:
        each drains and flushes, never a kill), or :meth:`request_stop`. SIGHUP stays ignored
        when the server was started ignoring it (``nohup``). The loop gets its own signal
        handling back when this returns (an embedding program's Ctrl-C). Cancelled, it stops
        at once: no drain, no write-behind flush."""
        loop = asyncio.get_running_loop()
        handled = [sig for sig in STOP_SIGNALS if install_signals and not (
            sig == signal.SIGHUP and signal.getsignal(sig) is signal.SIG_IGN)]
        for sig in handled:  # before the "listening" line: a supervisor may stop the server as it sees it
            loop.add_signal_handler(sig, self.request_stop)
        try:
            if not await self._started():
                return
            await self._stopping.wait()
            log.info("stopping: draining %d connection(s)", len(self.connections))
            await self.shutdown()
        except asyncio.CancelledError:  # (an embedding program's cancel: stop at once, no drain, no flush)
            await self._close_at_once()
            raise
        finally:
            for sig in handled:
                loop.remove_signal_handler(sig)

    async def _started(self) -> bool:
        """:meth:`start`, unless a stop is asked for first (a Redis that hangs can hold the start
        for --redis-timeout): then the server never listens. Whether it started."""
        starting = asyncio.ensure_future(self.start())
        stop = asyncio.ensure_future(self._stopping.wait())
        try:
            await asyncio.wait([starting, stop], return_when=asyncio.FIRST_COMPLETED)
        finally:  # (cancelled too: no start may go on alone)
            stop.cancel()
            if not starting.done():
                starting.cancel()
                await asyncio.gather(starting, return_exceptions=True)
        if not starting.cancelled():
            starting.result()  # (its errors: StartupError and the like)
            return True
        await self._close_at_once()  # (what the start had bound before it was cancelled)
        log.info("stopped before it started serving")
        return False

    def _close_now(self) -> None:
        """Stop listening and serving without a drain: listeners, the socket file, the server's
        tasks and every connection. (The tier is not flushed: :meth:`request_stop` does that.)"""
        for srv in self._servers:
            srv.close()
        if self.config.unix and self._unix_inode is not None:  # (only ours: a failed bind may find another's)
            remove_unix_listener(self.config.unix, self._unix_inode)
        for task in self._tasks:
            task.cancel()
        for conn in list(self.connections):
            conn.close()

    async def shutdown(self) -> None:
        """Stop accepting, let in-flight requests finish (bounded), then close."""
        for srv in self._servers:
            srv.close()
        if self.config.unix:
            remove_unix_listener(self.config.unix, self._unix_inode)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.drain_seconds
        for conn in list(self.connections):
            conn.start_drain()
        busy = {asyncio.create_task(c.idle.wait()) for c in self.connections}
        if busy:
            try:
                busy = await self._until_hurried(busy, deadline)
            finally:  # (also when the server's own task is cancelled here: no task left pending)
                for t in busy:
                    t.cancel()
            if busy:
                log.warning("drain %s; closing %d busy connection(s)",
                            "cut short" if self._hurry else "timed out", len(busy))
        for conn in list(self.connections):
            conn.finish()
        # Let the closing connections deliver their last replies: while any still has bytes to send
        # (until the drain deadline, at least a second), not for a peer that only owes a goodbye
        # (a TLS client that never answers close_notify has nothing left to receive).
        flush_until = max(deadline, loop.time() + 1.0)
        quiet = 0
        while self.connections and loop.time() < flush_until and quiet < 3 and not self._hurry:
            quiet = quiet + 1 if all(c.unsent_bytes() == 0 for c in self.connections) else 0
            await asyncio.sleep(0.01)
        for task in self._tasks:
            task.cancel()
        if self.tier is not None:
            await self._end_tier_checks(0.0 if self._hurry else self.config.redis_timeout + 1.0)
            self.unwritten_blocks = await self.tier.close()  # flushes the write-behind queue before exit
        if self.metrics is not None:
            await self.metrics.close()
        for srv in self._servers:
            await srv.wait_closed()
        log.info("stopped")
