"""One client connection: a thin asyncio shell around the codec and the service.

Bytes arrive through ``BufferedProtocol`` so a PUT's payload is received by
``recv_into`` straight into store reservations. Replies go out with
``writelines`` (header + meta, then the blocks' memory, uncopied); blocks stay
pinned until the transport has handed them to the kernel. Back-pressure: a
connection whose unsent replies pass ``max_pending_out`` bytes (or
``MAX_QUEUED_BUFFERS`` buffers and pins) stops being read until they drain, so a
client that writes fast and reads slowly cannot balloon the server's memory.
"""

from __future__ import annotations

import asyncio
import dataclasses
import fcntl
import inspect
import logging
import math
import socket
import struct
import termios
import time
from collections import deque
from typing import Any, Awaitable, Callable, cast

from kvstore.errors import ProtocolError, Unauthorized, Unavailable
from kvstore.messages import OP_NAMES
from kvstore.protocol import (
    Delete, Exists, Flush, Frame, FrameReader, Get, Hello, Limits, Lookup, NEED_DATA, PayloadDone, Ping, Put,
    Stats, Unpin, error_reply, foreign_reply, reply,
)
from kvstore.protocol import ShmAttach, ShmCommit, ShmGet, ShmPut, ShmRelease
from kvstore.sockets import tune
from kvstore.store import BlockRef
from kvstore.throttle import ThrottledLog

from .poll import BusyPoll
from .service import Counters, GetResult, PutSink, Service, Session, error_fields
from .shm import unix_peer

log = logging.getLogger(__name__)
#: Frames that could not be parsed: a line a second at most, with a count of those held back.
_failure_log = ThrottledLog(log, seconds=1.0)

#: Buffers and block pins a connection's unsent replies may hold before it stops being read, as
#: ``max_pending_out`` bounds their bytes: a GET of many small (or repeated) blocks queues one
#: buffer and one pin per key in a few bytes, and uvloop fails a transport holding ~2**20 buffers.
MAX_QUEUED_BUFFERS = 1 << 16
#: After answering a frame it refuses, how long a connection still reads (and drops) what the peer
#: sends before it closes. Closing with the peer's bytes unread makes the kernel reset the
#: connection, and a client still sending then got the reset instead of the answer (seen under load).
LINGER_S = 1.0
#: Frames (and payload ends) one connection has handled before the others get a turn: a peer
#: pipelining 100,000 PINGs in one burst held every other client for ~0.7 s (a read event hands
#: over up to 8 MiB of them at once). ~1-3 ms of small requests here.
FRAMES_PER_TURN = 256
#: Linux's ioctl for the bytes of a TCP socket's send queue not yet sent (linux/sockios.h).
SIOCOUTQNSD = 0x894B
_DROPPED = memoryview(bytearray(1 << 16))  # where a lingering connection's input goes
#: The meta a peer may send before its HELLO's token is checked (HELLO's fits in a few hundred bytes):
#: decoding 4 MiB of msgpack builds millions of objects, ~0.3 s of the event loop and ~300 MB.
PRE_AUTH_META = 64 << 10


class Connection(asyncio.BufferedProtocol):
    def __init__(self, service: Service, limits: Limits, registry: set[Connection],
                 poll: BusyPoll | None = None, waiting_for_hello: dict[Connection, float] | None = None) -> None:
        self.service = service
        self.poll = poll  # the server's busy polling (None: off)
        self.session = service.new_session()
        self.limits = limits  # (until a token is shown, a frame's meta gets PRE_AUTH_META bytes)
        self.reader = FrameReader(limits if self.session.authenticated else
                                  dataclasses.replace(limits, max_meta=PRE_AUTH_META), is_server=True)
        svc = service
        self.handlers: dict[type, Callable[[Any, Any], Any]] = {  # op -> service method (PUT and attach aside)
            Hello: svc.hello, Ping: svc.ping, Lookup: svc.lookup, Get: svc.get, Exists: svc.exists,
            Delete: svc.delete, Unpin: svc.unpin, Stats: svc.stats, Flush: svc.flush,
            ShmGet: svc.shm.get, ShmPut: svc.shm.put, ShmCommit: svc.shm.commit, ShmRelease: svc.shm.release,
        }
        self.registry = registry  # the server's live connections: joined once the transport is up (after TLS)
        #: The server's connections yet to show a token, oldest first (None: no token file), from
        #: which a newer one crowds the oldest out (see ``crowd_out``).
        self.waiting_for_hello = waiting_for_hello if not self.session.authenticated else None
        self.transport: asyncio.Transport | None = None  # None until connected, and again once lost
        self.lost = False
        self.put_sink: PutSink | None = None
        self.put_rid = 0
        # Replies' pins until the kernel has their bytes: (bytes written up to the reply's end, its pins).
        self.unsent: deque[tuple[int, list[BlockRef]]] = deque()
        self.written = 0  # bytes handed to the transport
        self.output_pending = False
        self.queued = 0  # buffers and pins written since the transport last drained (MAX_QUEUED_BUFFERS)
        self.reading_paused = False
        self.turn: asyncio.Handle | None = None  # its turn is over: frames already read wait for the next
        self.closing = False
        self.lingering: asyncio.TimerHandle | None = None  # answered a refused frame: dropping input until then
        self.timed_out = False  # closed by a timeout (counted once)
        self.draining = False
        self.tasks: set[asyncio.Task[None]] = set()  # requests waiting on a backing tier
        self.out_of_step = False  # a frame could not be parsed: its error waits for the tasks' replies, then closes
        self.failing: asyncio.Future[None] | None = None  # (that wait, kept from the garbage collector)
        self.idle = asyncio.Event()
        self.idle.set()
        self.put_t0 = 0.0  # perf_counter() when the PUT in progress was parsed
        # What check_timeouts() compares between sweeps: bytes received, frames (heads and payloads) completed.
        self.received = 0
        self.events = 0
        self._seen = (-1, -1)
        self._last_rx_at = self._frame_since = self._unsent_since = 0.0
        self._first_check = 0.0  # the first check_timeouts (the authentication deadline counts from it)
        self._unsent_seen = 0  # unsent_bytes() at the last check_timeouts

    # -- asyncio callbacks
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, transport)
        self.transport = transport
        self.registry.add(self)
        if self.waiting_for_hello is not None:
            self.waiting_for_hello[self] = time.monotonic()
        sock = transport.get_extra_info("socket")
        tune(sock)
        # high=0: pause_writing/resume_writing tell exactly when unsent output exists and when it drained.
        transport.set_write_buffer_limits(high=0, low=0)
        peer = transport.get_extra_info("peername")
        self.session.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer or "")
        if sock is not None and sock.family == socket.AF_UNIX:
            self.session.unix = True  # a same-host peer: may map the shared arena (server/shm.py)
            self.session.peer = unix_peer(sock)
        self.session.connected = True
        self.service.counters.connections += 1
        self.service.counters.connections_total += 1

    def connection_lost(self, exc: Exception | None) -> None:
        if self.lingering is not None:
            self.lingering.cancel()
        if self.turn is not None:
            self.turn.cancel()
        if self.put_sink is not None:
            self.put_sink.abort()
            self.put_sink = None
        self.release_sent(everything=True)
        self.service.shm.end_session(self.session)  # drop its read pins, abort its unfinished shm puts
        self.service.counters.connections -= 1
        self.idle.set()
        self.registry.discard(self)
        if self.waiting_for_hello is not None:
            self.waiting_for_hello.pop(self, None)
        # A TLS transport's protocol keeps this connection's bound methods: with the transport kept
        # here, the pair (and the 256 KiB read buffer) waited for a full garbage collection, and a
        # server's RSS grew with TLS clients come and gone (3.5 MB per 500, a review's churn).
        self.lost, self.transport = True, None

    def get_buffer(self, sizehint: int) -> memoryview:
        return _DROPPED if self.lingering is not None or self.out_of_step else self.reader.get_buffer()

    def buffer_updated(self, nbytes: int) -> None:
        if self.lingering is not None or self.out_of_step:
            return
        self.reader.buffer_updated(nbytes)
        self.service.counters.bytes_in += nbytes
        self.received += nbytes
        if self.unsent:  # a client reading replies while it sends requests: unpin what it has read
            self.release_sent()
        self._process()
        self._poll()

    def eof_received(self) -> bool:
        if self.turn is not None:  # (TLS: the peer's close_notify came in the data whose frames wait for
            self.turn.cancel()    # their turn: answered now, all of them, before the transport closes)
            self.turn = None
            self._process(every=True)
        return False  # close our side too

    def pause_writing(self) -> None:
        if self.transport is not None and not self.transport.get_write_buffer_size():
            # A TLS transport pauses at an empty buffer too (0 >= high-water 0), and resumes at its
            # next check: nothing is pending, and taking it for pending kept idle connections busy.
            return
        self.output_pending = True
        if self.transport is not None and self.transport.get_write_buffer_size() > self.service.config.max_pending_out:
            self._pause_reading()

    def resume_writing(self) -> None:
        self.output_pending = False
        self.queued = 0
        self.release_sent(everything=True)
        if self.reading_paused:
            self.reading_paused = False
            if self.transport is not None and not self.closing and self.turn is None:
                self.transport.resume_reading()
                self._process()  # frames that were already buffered when reading paused
        self._poll()  # the reply is out: between requests now, unless more was written
        self.update_idle()

    def _poll(self) -> None:
        """Busy polling (server/poll.py): open the server's window between requests; close it while a
        transfer runs (polling while a payload arrives or a reply drains only makes reads smaller)."""
        if self.poll is None:
            return
        if self.reader.in_frame or self.output_pending:
            self.poll.stop()
        elif not (self.closing or self.draining):
            self.poll.kick()

    # -- frame handling
    def _process(self, every: bool = False) -> None:
        # Paused by back-pressure: frames already buffered wait too, or one read of small GETs
        # could queue thousands of pinned replies past max_pending_out. ``every``: no turns.
        handled = 0
        while not self.closing and not self.reading_paused and not self.out_of_step and self.turn is None:
            if handled == FRAMES_PER_TURN and not every:  # the other connections' turn, then the rest
                assert self.transport is not None
                self.transport.pause_reading()
                self.turn = asyncio.get_running_loop().call_soon(self._next_turn)
                break
            handled += 1
            try:
                event = self.reader.next_event()
            except ProtocolError as exc:
                self._protocol_failure(exc)
                return
            except Exception as exc:  # a bug must not take the server down
                log.exception("internal error on connection from %s", self.session.peer)
                self._protocol_failure(exc)
                return
            if event is NEED_DATA:
                break
            self.events += 1
            if isinstance(event, Frame):
                self._on_frame(event)
            elif isinstance(event, PayloadDone):
                self._on_payload_done(event)
        self.update_idle()

    def _next_turn(self) -> None:
        self.turn = None
        if self.transport is None or self.closing:
            return
        if not self.reading_paused:  # (else back-pressure paused it too, and resume_writing resumes it)
            self.transport.resume_reading()
        self._process()
        self._poll()

    def _on_frame(self, frame: Frame) -> None:
        t0 = time.perf_counter()
        msg = frame.msg
        name = OP_NAMES.get(type(msg), "invalid")
        try:
            self.service.check_allowed(self.session, frame.op)
            if frame.error is not None or msg is None:
                raise frame.error or ProtocolError("invalid request")
            if isinstance(msg, ShmAttach):  # the reply carries the arena's fd: written by shm, not here
                assert self.transport is not None
                self.service.shm.attach(self.session, self.transport, frame.request_id)
                self.service.counters.count(name)
                self.service.counters.latency.observe(name, time.perf_counter() - t0)
                return
            if isinstance(msg, Put):
                self.put_sink = self.service.begin_put(self.session, msg)
                self.put_rid, self.put_t0 = frame.request_id, t0
                self.reader.set_sink(self.put_sink)  # (it notes empty blocks at once; they are stored at the commit)
                if not frame.payload_len:
                    self._finish_put()
                return
            self._dispatch(frame.request_id, name, msg, t0)
        except Exception as exc:
            self._send_error(frame.request_id, name, exc, t0)
            if isinstance(exc, Unauthorized) and not self.session.authenticated:
                self.close()  # a refused HELLO: nothing else may happen on this connection

    def _dispatch(self, rid: int, name: str, msg: Any, t0: float = 0.0) -> None:
        self._respond(rid, name, msg.OP, self.handlers[type(msg)](self.session, msg), t0)
        if self.session.authenticated and self.reader.limits is not self.limits:  # (a HELLO with a token)
            self.reader.limits = self.limits
            if self.waiting_for_hello is not None:
                self.waiting_for_hello.pop(self, None)

    def _respond(self, rid: int, name: str, op: int, result: Any, t0: float = 0.0) -> None:
        """Write the reply now, or when the tier call it waits on completes."""
        kind = type(result)
        if kind is not dict and kind is not GetResult and inspect.isawaitable(result):  # no ABC check in memory
            task = asyncio.ensure_future(self._respond_later(rid, name, op, result, t0))
            self.tasks.add(task)
            task.add_done_callback(self._task_done)
            return
        if isinstance(result, GetResult):
            self._write(reply(op, rid, result.payload, result.payload_len, **result.fields), result.refs)
        else:
            self._write(reply(op, rid, **result))
        self.service.counters.count(name)
        if t0:
            self.service.counters.latency.observe(name, time.perf_counter() - t0)

    async def _respond_later(self, rid: int, name: str, op: int, pending: Awaitable[Any], t0: float = 0.0) -> None:
        try:
            result = await pending
        except Exception as exc:
            self._send_error(rid, name, exc, t0)
        else:
            self._respond(rid, name, op, result, t0)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self.tasks.discard(task)
        self.update_idle()

    def _on_payload_done(self, event: PayloadDone) -> None:
        if self.put_sink is not None and event.request_id == self.put_rid:
            self._finish_put()

    def _finish_put(self) -> None:
        sink, self.put_sink = self.put_sink, None
        assert sink is not None
        try:
            result = sink.commit()
        except Exception as exc:
            sink.abort()
            self._send_error(self.put_rid, "put", exc, self.put_t0)
            return
        self._respond(self.put_rid, "put", Put.OP, result, self.put_t0)

    # -- output
    def _write(self, buffers: list[Any], refs: list[BlockRef] | None = None) -> None:
        transport = self.transport
        if transport is None or transport.is_closing() or self.lingering is not None:  # (no answer goes out)
            if refs:
                self.service.release(refs)
            return
        transport.writelines(buffers)
        n = sum(map(len, buffers))
        self.written += n
        self.service.counters.bytes_out += n
        if refs:
            self.unsent.append((self.written, refs))  # the transport still references the blocks
        if self.unsent:
            self.release_sent()
        if self.output_pending:  # pause_writing() fired once, at the first unsent byte: re-check on every reply
            self.queued += len(buffers) + (len(refs) if refs else 0)
            if (self.queued > MAX_QUEUED_BUFFERS
                    or transport.get_write_buffer_size() > self.service.config.max_pending_out):
                self._pause_reading()

    def _send_error(self, rid: int, name: str, exc: BaseException, t0: float = 0.0) -> None:
        code, message = error_fields(exc)
        if code == 8:
            log.error("internal error serving %s from %s: %r", name, self.session.peer, exc)
        self.service.counters.count(name, failed=True)
        if t0:
            self.service.counters.latency.observe(name, time.perf_counter() - t0)
        self._write(error_reply(rid, code, message))

    def _protocol_failure(self, exc: BaseException) -> None:
        """Answer once (in a form the peer may understand) and close."""
        _failure_log.warning("closing connection from %s: %s", self.session.peer, exc)
        self.service.counters.count("malformed", failed=True)
        first = self.reader.buffered()[:16] if self.reader.frames == 0 else b""
        foreign = foreign_reply(first) if first else None
        if foreign is not None and self.transport is not None:
            self.transport.write(foreign)
            self.service.counters.bytes_out += len(foreign)
        elif self.tasks:  # requests before it still wait on the tier: their replies go out first
            self.out_of_step = True  # (nothing more is read from a stream that could not be parsed)
            self.failing = asyncio.ensure_future(self._fail_after_tasks(exc))
            return
        else:
            code, message = error_fields(exc)
            self._write(error_reply(0, code, message))
        self._linger()

    async def _fail_after_tasks(self, exc: BaseException) -> None:
        if self.tasks:  # (done meanwhile, perhaps)
            await asyncio.wait(set(self.tasks))  # (each ends: a tier call has --redis-timeout)
        code, message = error_fields(exc)
        self._write(error_reply(0, code, message))
        self._linger()

    def _linger(self) -> None:
        """Close once the peer has had the answer: our side now (its FIN follows the answer), the
        connection when the peer closes or after :data:`LINGER_S`, its bytes read and dropped
        meanwhile. (A TLS transport cannot half-close: it closes at once, as before.)"""
        transport = self.transport
        if self.closing or transport is None or transport.is_closing():  # (e.g. aborted by a failed fd send)
            return
        if not transport.can_write_eof():
            self.close()
            return
        self.closing = True
        transport.write_eof()
        self.lingering = asyncio.get_running_loop().call_later(LINGER_S, transport.close)
        if self.reading_paused:  # (paused by back-pressure: unread bytes are what would reset it)
            self.reading_paused = False
            transport.resume_reading()

    # -- lifecycle
    def _pause_reading(self) -> None:
        # (never while lingering: its input is dropped as it comes, and bytes left unread when it
        # closes reset the connection, the replies still on their way to the peer lost with it)
        if not self.reading_paused and self.transport is not None and self.lingering is None:
            self.reading_paused = True
            self.transport.pause_reading()

    def release_sent(self, everything: bool = False) -> None:
        """Unpin the blocks of replies the transport has handed to the kernel (all: it holds none).

        Called on every write and read, and once a second by the server for a client
        that reads without sending.
        """
        unsent = self.unsent
        sent = self.written if everything or self.transport is None else (
            self.written - self.transport.get_write_buffer_size())
        while unsent and unsent[0][0] <= sent:
            self.service.release(unsent.popleft()[1])

    def update_idle(self) -> None:
        """Set or clear ``idle``; a draining connection with nothing left to do closes. Called
        after each event here, and by the server when its shm pins expire."""
        busy = (self.reader.in_frame or self.put_sink is not None or self.output_pending or bool(self.tasks)
                or self.turn is not None  # (frames read wait for their turn)
                or self.service.shm.busy(self.session))  # a drain waits for shm copies to be released
        if busy:
            self.idle.clear()
        else:
            self.idle.set()
            if self.draining:
                self._linger()  # (requests still coming are dropped, not answered with a reset)

    def finish(self) -> None:
        """The drain's time is up: answer nothing more, let what was written go out, then close as a
        drain does (:meth:`_linger`). Closed at once, with the peer's next requests unread, the
        connection was reset, and the replies written before were lost with it."""
        self._linger()

    def close(self) -> None:
        """Close after flushing what was already written."""
        if not self.closing and self.transport is not None:
            self.closing = True
            self.transport.close()

    def unsent_bytes(self) -> int:
        """Bytes written for this peer and not yet gone: the transport's buffer plus what the
        socket has not sent (TCP: ``SIOCOUTQNSD``; ``SIOCOUTQ`` there counts bytes sent and not yet
        acknowledged too, and the last small reply to a client that asks every few ms waits for its
        ACK, delayed, at every check) or its peer has not read (Unix: ``SIOCOUTQ``). A TLS transport
        hands each reply to the layer under it at once and reports an empty buffer, so the socket
        is where a large reply in flight still shows."""
        transport = self.transport
        if transport is None:
            return 0
        n = transport.get_write_buffer_size()
        sock = transport.get_extra_info("socket")
        try:
            if sock is not None and sock.fileno() >= 0:
                ask = termios.TIOCOUTQ if sock.family == socket.AF_UNIX else SIOCOUTQNSD
                n += struct.unpack("i", fcntl.ioctl(sock.fileno(), ask, b"\0\0\0\0"))[0]
        except OSError:  # closed meanwhile, or a socket without a send queue to ask about
            pass
        return n

    def start_drain(self) -> None:
        """Finish the request in progress, flush its reply, then close. A peer that has not said
        HELLO on a server with tokens has nothing in progress worth waiting for (a frame it stopped
        in the middle of held a stop for --drain-seconds): it is closed at once."""
        self.draining = True
        if not self.session.authenticated:
            self.close()
            return
        self.update_idle()

    def check_timeouts(self, now: float, idle_timeout: float, frame_timeout: float) -> None:
        """Called about once a second: close a silent connection, drop one stuck mid-frame,
        one that has stopped reading its replies, or one that has not authenticated (a server
        with tokens) within the frame timeout: PINGs, allowed before HELLO, would otherwise keep
        tokenless peers in every connection slot.

        A connection waiting on *us* -- a reply still draining, a tier call,
        reading paused by back-pressure -- is neither idle nor stalled. Nor is
        one whose client holds shared-memory slots of a put: closing it would
        free them while that client, only slow, may still be writing into them
        (over the next owner's blocks). A
        slowloris that trickles bytes is not idle, but its frame never
        completes, so the frame timeout drops it. Nor is a reply that stopped
        draining waited for: its peer is not reading, and its blocks stay pinned
        until it is sent.
        """
        if self.transport is None:
            return
        unsent = self.unsent_bytes()
        if unsent != self._unsent_seen:  # the peer is reading (or nothing is owed)
            self._unsent_since = now
        self._unsent_seen = unsent
        if self.closing:  # closed once its output is flushed: a peer that stopped reading would hold
            if frame_timeout and unsent and now - self._unsent_since > frame_timeout:  # it (and pins) for good
                if self.timed_out:  # (a TLS idle close waits behind the stuck bytes: one timeout, not two)
                    self.transport.abort()
                else:
                    self._time_out("reply", frame_timeout)
            return
        waiting_on_us = self.output_pending or bool(self.tasks) or self.reading_paused or self.turn is not None
        mid_put = self.service.shm.writing(self.session)
        received, events = self.received, self.events
        if waiting_on_us or received != self._seen[0]:
            self._last_rx_at = now
        if waiting_on_us or events != self._seen[1] or not self.reader.in_frame:
            self._frame_since = now
        self._seen = (received, events)
        self._first_check = self._first_check or now
        if mid_put:
            self._last_rx_at = self._frame_since = self._unsent_since = now
        elif frame_timeout and now - self._frame_since > frame_timeout:
            self._time_out("frame", frame_timeout)
        elif frame_timeout and unsent and now - self._unsent_since > frame_timeout:
            self._time_out("reply", frame_timeout)  # the peer stopped reading; its reply's blocks stay pinned
        elif frame_timeout and not self.session.authenticated and now - self._first_check > frame_timeout:
            self._time_out("auth", frame_timeout)
        elif idle_timeout and now - self._last_rx_at > idle_timeout:
            self._time_out("idle", idle_timeout)

    def crowd_out(self) -> None:
        """Close a connection still without a token to make room for a newer one (the server's
        ``_crowd_out_one``)."""
        assert self.waiting_for_hello is not None and self.transport is not None
        self.waiting_for_hello.pop(self, None)
        self.registry.discard(self)  # (its slot is free now: connection_lost comes a loop turn later)
        self.service.counters.timeouts["auth"] += 1
        self.timed_out = self.closing = True
        self.transport.abort()

    def _time_out(self, kind: str, seconds: float) -> None:
        self.timed_out = True
        self.service.counters.timeouts[kind] += 1
        log.info("closing connection from %s: %s timeout (%gs)", self.session.peer, kind, seconds,
                 extra={"event": f"{kind}_timeout", "peer": self.session.peer})
        assert self.transport is not None
        self.closing = True
        if kind != "idle":
            self.transport.abort()  # a stalled peer may not read: do not wait to flush
        else:
            self.transport.close()


class RejectedConnection(asyncio.Protocol):
    """A connection over ``--max-connections``: one error reply (request id 0, ``Unavailable``), closed at once.

    It never gets a frame reader (its ``session`` tells only whether a TLS handshake came
    through), so a flood of them costs a socket each, briefly.
    """

    _last_log = -math.inf  # rate-limits the warning: a flood must not flood the log too

    def __init__(self, limit: int, counters: Counters) -> None:
        self.limit = limit
        self.counters = counters  # (the reply counts in bytes_out)
        self.session = Session()  # (only .connected: its TLS handshake succeeded)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, transport)
        self.session.connected = True
        message = f"server is at its limit of {self.limit} connections (--max-connections); try again later"
        reply = error_reply(0, Unavailable.code, message)
        transport.writelines(reply)
        self.counters.bytes_out += sum(map(len, reply))
        transport.close()
        now = time.monotonic()
        if now - RejectedConnection._last_log > 10.0:
            RejectedConnection._last_log = now
            log.warning("refusing connections: at the limit of %d (--max-connections)", self.limit,
                        extra={"event": "connection_rejected"})

    def data_received(self, data: bytes) -> None:
        pass  # whatever it sent is ignored; the transport is closing
