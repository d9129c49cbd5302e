"""One client connection: pipelined requests matched to replies by request id.

Replies' payloads are received by ``recv_into`` straight into their destination
(the caller's buffers for ``get_into``). A request whose caller is cancelled
once its own payload has gone out is forgotten, not its connection: its reply,
or what is left of it, is read and dropped (never into the caller's buffers),
so the other requests on the connection go on. A connection on which anything
else went wrong mid-request -- a cancel while the request's own payload is still
going out, a timed-out request, a protocol error, a lost peer -- is closed and
never reused: its byte stream may be out of step.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import select
import ssl
import sys
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Sequence, cast

from kvstore.errors import (
    InternalError, InvalidRequest, KVStoreError, ProtocolError, RequestTimeout, ServerError, TransportError, from_code,
)
from kvstore.protocol import ErrorReply, Frame, FrameReader, Hello, Limits, Message, NEED_DATA, PayloadDone, PayloadSink, Reply, encode
from kvstore.sockets import tune

SinkFactory = Callable[[dict[str, Any]], PayloadSink]

#: Before Python 3.12 the stock asyncio socket transport joins ``writelines`` into one ``bytes`` and
#: copies what the socket does not take at once into its buffer: a 32 MiB put was copied twice
#: into fresh memory (1 MiB x 32 puts ~4x slower than on uvloop). From 3.12.0 to 3.12.8 and in
#: 3.13.0-3.13.1 its ``writelines`` never pauses the protocol (CPython gh-127655): a put to a stalled
#: server sat whole in the buffer. On such a transport the client hands it a payload a piece at a
#: time, each when its buffer is empty (:meth:`ClientConnection._pump`).
PIECE = 1 << 20


def _piecewise(transport: asyncio.BaseTransport) -> bool:
    if type(transport).__module__ != "asyncio.selector_events":
        return False
    v = sys.version_info[:3]
    return v < (3, 12, 9) or (3, 13) <= v < (3, 13, 2)


class NotHome(TransportError):
    """A client used from another event loop than its first, or in a forked child: the caller's
    mistake, raised at once (not retried, and not held against the server)."""


class NotSent(TransportError):
    """The connection ended before any byte of this request went out: the server never saw it,
    so it may be sent again whatever it does (a pinned lookup too)."""


def refusal(exc: BaseException | None) -> bool:
    """Whether an error reply means the request did not run: the server refused it as a whole (an
    internal error may come from half-way through; a lost connection tells nothing)."""
    return isinstance(exc, ServerError) and not isinstance(exc, InternalError)


@dataclass
class _Pending:
    future: asyncio.Future[Any]
    make_sink: SinkFactory | None
    fields: dict[str, Any] | None = None
    sink: PayloadSink | None = None
    rid: int = 0
    dropped: bool = False  # the caller gave up: the reply (and its payload) is read and dropped
    orphan: Callable[[dict[str, Any]], None] | None = None  # gives back what a dropped reply hands over
    refused: Callable[[], None] | None = None  # called when a dropped request is refused (it did not run)
    error: KVStoreError | None = None  # the error reply, once in
    stream_start: int = 0  # the byte offset, in what the connection sends, of this request's frame
    stream_end: int = 0  # ... and just past it
    copied: bool = False  # sent from a copy of its own (a small request, paced), not from the caller's memory


@dataclass
class Response:
    fields: dict[str, Any]
    sink: PayloadSink | None = None


class ClientConnection(asyncio.BufferedProtocol):
    def __init__(self, limits: Limits) -> None:
        self.reader = FrameReader(limits, is_server=False)
        self.transport: asyncio.Transport | None = None
        self.pending: dict[int, _Pending] = {}
        self._ids = itertools.count(1)
        self._can_write: asyncio.Future[None] | None = None
        self._out: deque[Any] | None = None  # pieces waiting for an empty transport buffer (paced)
        self._queued = self._handed = 0  # frame items given to _write / handed whole to the transport
        self._framed = self._given = 0  # bytes of frames given to _write / to the transport
        self._pump_soon: asyncio.Handle | None = None
        self._answer: Any = None  # (paced: a poll object on the socket)
        self._tls = False
        self.closed = False
        self.close_reason: KVStoreError | None = None
        self.hello: dict[str, Any] = {}
        self.gone = asyncio.Event()  # set once the transport is closed for good (connection_lost)
        self.on_lost: Callable[[ClientConnection], None] | None = None  # called then, once

    # -- asyncio callbacks
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, transport)
        self.transport = transport
        # (over TLS the transport's buffer counts ciphertext, records larger than what was given it)
        self._tls = transport.get_extra_info("sslcontext") is not None
        tune(transport.get_extra_info("socket"))
        if _piecewise(transport):
            self._out = deque()
            transport.set_write_buffer_limits(high=0)  # resume_writing() whenever its buffer has drained
            self._answer = select.poll()  # (has the server answered? see _pump)
            self._answer.register(transport.get_extra_info("socket").fileno(), select.POLLIN)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._out is not None:
            self._out.clear()  # (the callers' buffers: not referenced past the connection)
        reason = self.close_reason or TransportError(f"connection lost: {exc}" if exc else "connection closed by server")
        self._fail_all(reason)
        if self._can_write is not None and not self._can_write.done():
            self._can_write.set_result(None)  # (each waiter finds the failure in its own request's future)
        self.gone.set()
        if self.on_lost is not None:
            self.on_lost(self)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.reader.get_buffer()

    def buffer_updated(self, nbytes: int) -> None:
        self.reader.buffer_updated(nbytes)
        try:
            while not self.closed:
                event = self.reader.next_event()
                if event is NEED_DATA:
                    break
                if isinstance(event, Frame):
                    self._on_frame(event)
                elif isinstance(event, PayloadDone):
                    self._on_done(event.request_id)
        except ProtocolError as exc:
            self.abort(exc)
        except Exception as exc:  # e.g. a sink rejecting a size: the stream can't be trusted now
            self.abort(ProtocolError(f"client failed to handle a reply: {exc!r}"))
        if self._out and not self.closed:
            self._pump_later()

    def pause_writing(self) -> None:
        self._can_write = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self._can_write is not None and not self._can_write.done():
            self._can_write.set_result(None)
        self._can_write = None
        if self._out:
            self._pump()

    def _write(self, frame: Sequence[Any]) -> bool:
        """Send (or queue) a frame's buffers; True if what goes is a copy of them."""
        assert self.transport is not None
        n = sum(map(len, frame))  # (flat byte views: see _send)
        self._framed += n
        if self._out is None:
            self.transport.writelines(frame)
            self._given += n
            return False
        copied = n <= PIECE
        if copied:
            frame = [b"".join(frame)]  # (one send for a small request)
        self._out.extend(frame)
        self._queued += len(frame)
        self._pump()
        return copied

    def _pump(self) -> None:
        """Hand the transport the next piece when its buffer is empty (it keeps what the socket did
        not take: a copy before Python 3.12, a view of the caller's memory from 3.12); the one after
        on the next loop turn, so that an answer the server sends meanwhile (an error, before it
        closes) is read before the next send."""
        out, transport = self._out, self.transport
        assert out is not None and transport is not None
        if not out or transport.get_write_buffer_size() or transport.is_closing():
            return
        if self._answer.poll(0):  # read it first (buffer_updated pumps on): a server that refuses
            return  # a request answers, then closes; a send after that is reset, losing the answer
        piece = out.popleft()
        if len(piece) > PIECE:
            out.appendleft(piece[PIECE:])
            piece = piece[:PIECE]
        else:
            self._handed += 1  # (the item's last piece)
        transport.write(piece)
        self._given += len(piece)
        if out and not transport.get_write_buffer_size():  # (else resume_writing pumps)
            self._pump_later()

    def _pump_later(self) -> None:
        if self._pump_soon is None:
            self._pump_soon = asyncio.get_running_loop().call_soon(self._pumped)

    def _pumped(self) -> None:
        self._pump_soon = None
        self._pump()

    # -- replies
    def _on_frame(self, frame: Frame) -> None:
        msg = frame.msg
        if isinstance(msg, ErrorReply) and frame.request_id == 0:
            # the server could not tie the error to a request: it closes the connection
            self.abort(from_code(msg.code, msg.message))
            return
        p = self.pending.get(frame.request_id)
        if p is None:
            raise ProtocolError(f"reply to unknown request {frame.request_id}")
        if isinstance(msg, ErrorReply):
            if frame.payload_len:  # (its bytes would be read as another reply's)
                raise ProtocolError("error reply with a payload")
            del self.pending[frame.request_id]
            error = p.error = from_code(msg.code, msg.message)
            if not p.future.done():
                p.future.set_exception(error)
            elif p.dropped and p.refused is not None and refusal(error):
                p.refused()
            return
        assert isinstance(msg, Reply)
        p.fields = msg.fields
        if p.dropped:  # (a payload with no sink set is read and dropped by the reader)
            if not frame.payload_len:
                self._on_done(frame.request_id)
            return
        if p.make_sink is not None:  # also without a payload: the sink sees the empty blocks
            p.sink = p.make_sink(msg.fields)
            self.reader.set_sink(p.sink)
        if not frame.payload_len:
            self._on_done(frame.request_id)
        elif p.sink is None:
            raise ProtocolError("unexpected payload in reply")

    def _on_done(self, rid: int) -> None:
        p = self.pending.pop(rid)
        if p.dropped and p.orphan is not None and p.fields is not None:
            p.orphan(p.fields)
        if not p.future.done():
            p.future.set_result(Response(p.fields or {}, p.sink))

    def _fail_all(self, exc: KVStoreError) -> None:
        """Fail every pending request; on a connection lost (not refused by the server), those none
        of whose bytes reached the socket with :class:`NotSent` (an abort drops what the transport
        still holds)."""
        self.closed = True
        pending, self.pending = self.pending, {}
        held = self.transport.get_write_buffer_size() if self.transport is not None and not self._tls else 0
        sent = self._given - held  # (over TLS: all it was given, which never makes too much NotSent)
        lost = isinstance(exc, TransportError)
        unsent: NotSent | None = None
        for p in pending.values():
            if not p.future.done():
                if lost and p.stream_start >= sent:
                    unsent = unsent or NotSent(f"{exc} (before the request was sent)")
                    p.future.set_exception(unsent)
                else:
                    p.future.set_exception(exc)

    # -- requests
    @property
    def in_flight(self) -> int:
        return len(self.pending)

    async def request(self, msg: Message, payload: Sequence[memoryview] = (), payload_len: int | None = None,
                      make_sink: SinkFactory | None = None, timeout: float | None = None,
                      orphan: Callable[[dict[str, Any]], None] | None = None,
                      refused: Callable[[], None] | None = None) -> Response:
        """Send one request and wait for its reply.

        ``timeout`` (seconds) raises :class:`RequestTimeout` and discards the
        connection. It is a timer on the reply's future rather than
        ``asyncio.wait_for``, which costs a task and several loop iterations
        per request (measured: ~20 us of client CPU per request here).

        A cancelled caller leaves the connection to the others once its payload
        is all handed over: its reply, or the rest of it, is then read and
        dropped (no byte more lands in the caller's buffers). ``orphan``: for a reply
        that hands over server-side state (an shm handle), called with the fields of
        a successful reply nobody takes, to give that state back. ``refused``: for a request
        whose caller was cancelled, called if the server refuses it (it did not run: an unpinning
        GET refused as too large has dropped no lease).
        """
        p = self._send(msg, payload, payload_len, make_sink)
        fut = p.future
        end = self._queued if self._out is not None else None  # (paced: its last item's number)
        timer = fut.get_loop().call_later(timeout, self._time_out, fut, timeout) if timeout else None
        try:
            if self._can_write is not None:  # (shared by every request waiting: one's cancel is not the others')
                await asyncio.shield(self._can_write)
            return await fut
        except asyncio.CancelledError:
            # The caller gave up: its buffers may still be referenced by the transport or about
            # to receive bytes. Unless neither can be, drop the connection.
            if fut.done() and not fut.cancelled():  # (answered, or failed, as the cancel came)
                if orphan is not None and fut.exception() is None:
                    orphan(fut.result().fields)
                elif refused is not None and refusal(fut.exception()):
                    refused()
                _drop_outcome(fut)
            elif self.pending.get(p.rid) is not p:
                # Its reply came whole between the cancel and now (the caller had not resumed yet;
                # the cancel had cancelled ``fut``, so the reply is on ``p`` only).
                if orphan is not None and p.fields is not None:
                    orphan(p.fields)
                elif refused is not None and refusal(p.error):
                    refused()
            elif not self.closed and self._handed_over(payload, p, end):
                if p.fields is not None:  # (its reply's payload is coming in: none of it goes to the caller)
                    self.reader.drop_payload(p.rid)
                p.dropped, p.make_sink, p.sink = True, None, None  # (nothing of the caller's is kept)
                p.orphan, p.refused = orphan, refused  # (once its reply is in)
                fut.cancel()
                if timer is not None:  # its deadline still ends the connection if the reply never comes
                    fut.get_loop().call_at(timer.when(), self._dropped_timed_out, p.rid, timeout)
            else:
                fut.cancel()
                self.abort(TransportError("request cancelled; connection discarded"))
            raise
        finally:
            if timer is not None:
                timer.cancel()
            if end is not None and self._handed < end and not self.closed and not p.dropped:
                # Answered (refused) before all of it was handed over: the rest is the caller's
                # memory, not to be read once this returns. (A reply comes after the payload.)
                self.abort(TransportError("the server answered before the request was sent; connection discarded"))

    def _handed_over(self, payload: Sequence[memoryview], p: _Pending, end: int | None) -> bool:
        """Whether the transport holds none of a request's payload (the caller's memory) any more."""
        if not payload or p.copied:
            return True
        assert self.transport is not None
        if end is not None and self._handed < end:  # paced: pieces not handed yet
            return False
        if end is not None and sys.version_info < (3, 12):  # (a stock transport copied what it kept)
            return True
        # What it keeps may be a view of the caller's memory (uvloop; from 3.12, the stock one):
        # all of this frame has gone to the socket once what it holds starts past the frame's end.
        return self._given - self.transport.get_write_buffer_size() >= p.stream_end

    def post(self, msg: Message, timeout: float | None = None) -> None:
        """Send a small request nobody waits for; its answer is read and dropped.

        A connection that is already closed sends nothing: a caller posting a
        release relies on the server dropping a closed connection's pins anyway.
        An answer that does not come within ``timeout`` ends the connection, as
        for :meth:`request` (a server that stopped answering; the request is not
        left pending forever).
        """
        try:
            fut = self._send(msg).future
        except KVStoreError:
            return
        fut.add_done_callback(_drop_outcome)
        if timeout:
            timer = fut.get_loop().call_later(timeout, self._time_out, fut, timeout)
            fut.add_done_callback(lambda _: timer.cancel())

    def _send(self, msg: Message, payload: Sequence[memoryview] = (), payload_len: int | None = None,
              make_sink: SinkFactory | None = None) -> _Pending:
        """Write one request; its entry, whose future the reply (or error) will settle."""
        if self.closed or self.transport is None or self.transport.is_closing():
            raise self.close_reason or TransportError("connection is closed")
        rid = next(self._ids) & 0xFFFFFFFF or next(self._ids) & 0xFFFFFFFF  # (u32 on the wire; 0 is no request's)
        try:
            # Flat byte views (a non-contiguous one is refused here, whichever transport; the paced
            # writer cuts pieces from them); empty ones never go.
            frame = [v for v in (memoryview(p).cast("B") for p in encode(msg, rid, payload, payload_len)) if v.nbytes]
        except (OverflowError, TypeError, ValueError) as exc:  # e.g. an integer msgpack cannot carry
            raise InvalidRequest(f"cannot encode {type(msg).__name__}: {exc}") from None
        p = self.pending[rid] = _Pending(asyncio.get_running_loop().create_future(), make_sink, rid=rid,
                                         stream_start=self._framed)
        p.copied = self._write(frame)
        p.stream_end = self._framed
        return p

    def _time_out(self, fut: asyncio.Future[Any], timeout: float) -> None:
        if fut.done():
            return
        fut.set_exception(RequestTimeout(f"no reply within {timeout}s"))
        # The reply may still arrive into the caller's buffers: the connection cannot be reused.
        # Other requests on it fail with a (retryable) TransportError.
        self.abort(TransportError("a request timed out; connection discarded"))

    def _dropped_timed_out(self, rid: int, timeout: float | None) -> None:
        p = self.pending.get(rid)
        if p is not None and p.dropped:
            self.abort(TransportError(f"no reply within {timeout}s (to a cancelled request); connection discarded"))

    def abort(self, reason: KVStoreError) -> None:
        if self.close_reason is None:
            self.close_reason = reason
        if self._out:
            self._out.clear()  # (callers' buffers: let go now, not at connection_lost)
        self._fail_all(reason)
        if self.transport is not None:
            self.transport.abort()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    async def discard(self, reason: KVStoreError) -> None:
        """Abort, and return once the socket is closed: for a connection that failed before it was
        used (nothing on it is worth a TLS close_notify round trip with a peer that may not answer)."""
        self.abort(reason)
        if self.transport is not None:
            await self.gone.wait()

    async def aclose(self, grace: float = 1.0) -> None:
        """Close, and return once the transport is gone: a TLS connection first exchanges
        close_notify with the server (a round trip), and a loop that ends before that leaves
        its socket open. A peer that has not finished within ``grace`` seconds is cut off."""
        self.close()
        if self.transport is None:
            return
        try:
            await asyncio.wait_for(self.gone.wait(), grace)
        except asyncio.TimeoutError:
            self.transport.abort()  # (closes the socket now, and reports it on the next turn)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.gone.wait(), grace)


def _drop_outcome(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()  # retrieved, so asyncio does not log it as lost


async def open_connection(host: str, port: int, *, namespace: str, token: str | None, tls: ssl.SSLContext | None,
                          limits: Limits, timeout: float | None, server_hostname: str | None = None,
                          unix: str | None = None, hello: bool = True) -> ClientConnection:
    """Connect (to ``unix`` when given: a Unix socket path, no TLS) and say HELLO (without
    ``hello``: a bare connection, good for PING only, which a server answers without a token)."""
    loop = asyncio.get_running_loop()
    where = f"unix:{unix}" if unix else f"{host}:{port}"
    try:
        if unix:
            connecting = loop.create_unix_connection(lambda: ClientConnection(limits), unix)
        else:
            connecting = loop.create_connection(lambda: ClientConnection(limits), host, port, ssl=tls,
                                                server_hostname=server_hostname if tls else None)
        _, conn = await asyncio.wait_for(connecting, timeout)
    except asyncio.TimeoutError:
        raise TransportError(f"timed out connecting to {where}") from None
    except ssl.SSLError as exc:  # (chained: a certificate refused is the caller's to fix, see AsyncKVClient.connect)
        raise TransportError(f"TLS handshake with {where} failed: {_tls_reason(exc)}") from exc
    except OSError as exc:
        raise TransportError(f"cannot connect to {where}: {exc.strerror or exc}") from None
    if not hello:
        return conn
    try:  # (the request's own timer: wait_for on Python 3.11 drops a cancel that comes as the reply does)
        resp = await conn.request(Hello(namespace=namespace, token=token, client="kvstore-py"), timeout=timeout)
    except BaseException as exc:  # (also a cancel: close() of the client cuts off a HELLO that gets no answer)
        await conn.discard(TransportError("HELLO failed; connection discarded"))  # (no socket outlives the call)
        if isinstance(exc, RequestTimeout):
            raise TransportError(f"{where} did not answer HELLO within {timeout}s (is it a kvstore server?)") from None
        if isinstance(exc, TransportError) and tls is None and not unix:  # what a TLS server does with plain text
            raise TransportError(f"{where} closed the connection at HELLO (does it expect TLS? "
                                 f"tls=True or a CA file; kvstore-cli: --tls or --tls-ca)") from None
        raise
    conn.hello = resp.fields
    return conn


def _tls_reason(exc: ssl.SSLError) -> str:
    """Why a handshake failed, with the likely fix for the two usual mistakes."""
    reason = getattr(exc, "verify_message", None) or exc.reason or str(exc)
    if "mismatch" in reason.lower():
        reason += " (server_hostname / --tls-server-name names the host the certificate was made for)"
    elif exc.reason == "WRONG_VERSION_NUMBER":
        reason += " (the server answered in plain text: is it started with --tls-cert?)"
    return reason


__all__ = ["ClientConnection", "Response", "open_connection"]
