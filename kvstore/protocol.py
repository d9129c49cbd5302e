"""The kvstore wire protocol, sans-IO: bytes in, messages out, and back.

No sockets and no asyncio here (the approach of h11): the server and the client
feed received bytes into a :class:`FrameReader` and write what :func:`encode`
returns. The byte layout is documented in ``docs/protocol.md``; in short, every
frame is::

    header   20 bytes  "!2sBBIIQ": magic b"KV", version, op, request id, meta length, payload length
    meta     msgpack map (the message's fields)          -- never block bytes
    payload  raw block bytes, concatenated in key order  -- never msgpack

Block bytes never pass through msgpack, so they can be received straight into
their final buffers: after a frame's head (header + meta) the reader asks its
consumer where each block goes (:class:`PayloadSink`), one block at a time, so
a lying length can make the receiver reserve at most one block.

Invariant (checked by a Hypothesis test): any byte string either parses or
raises :class:`~kvstore.errors.ProtocolError` -- nothing else.

The messages themselves live in :mod:`kvstore.messages` and are re-exported
here, so a caller imports everything about the wire from one place.
"""

from __future__ import annotations

import mmap
import re
import struct
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Protocol, Sequence

import msgpack

from .errors import InvalidRequest, ProtocolError, TooLarge
from .messages import (
    DEFAULT_LIMITS, ERROR_OP, EXISTED, REPLY_BIT, REQUESTS, STORED, VERSION, Delete, ErrorReply, Exists, Flush, Get,
    Hello, Limits, Lookup, Message, Ping, Put, Reply, ShmAttach, ShmCommit, ShmGet, ShmPut, ShmRelease, Stats, Unpin,
)

MAGIC = b"KV"
HEADER = struct.Struct("!2sBBIIQ")
HEADER_SIZE = HEADER.size  # 20


# --------------------------------------------------------------------------- encoding


def encode(
    msg: Message, request_id: int, payload: Sequence[memoryview | bytes] = (), payload_len: int | None = None
) -> list[bytes | memoryview]:
    """The buffers of one frame: head (header + meta) first, then the payload
    buffers untouched, ready for a scatter-gather write (``writelines``)."""
    op = msg.op | REPLY_BIT if isinstance(msg, Reply) else msg.OP
    meta = msgpack.packb(msg.to_meta(), use_bin_type=True)
    if payload_len is None:
        payload_len = sum(len(memoryview(p).cast("B")) for p in payload)
    head = HEADER.pack(MAGIC, VERSION, op, request_id & 0xFFFFFFFF, len(meta), payload_len) + meta
    return [head, *payload]


def reply(op: int, request_id: int, payload: Sequence[memoryview | bytes] = (), payload_len: int | None = None,
          **fields: Any) -> list[bytes | memoryview]:
    return encode(Reply(op=op, fields=fields), request_id, payload, payload_len)


def error_reply(request_id: int, code: int, message: str) -> list[bytes | memoryview]:
    return encode(ErrorReply(code=code, message=message[:1000]), request_id)


# --------------------------------------------------------------------------- decoding


@dataclass(frozen=True)
class Frame:
    """A frame's head has been parsed. ``msg`` is a validated request, a
    :class:`Reply` or an :class:`ErrorReply`; or ``error`` is set when the frame is
    well-formed but its meta is not a valid request (the payload is then skipped)."""

    op: int
    request_id: int
    payload_len: int
    msg: Message | None
    error: Exception | None = None


@dataclass(frozen=True)
class PayloadDone:
    """Every payload byte of the frame ``request_id`` has been delivered."""

    request_id: int


class _NeedData:
    def __repr__(self) -> str:
        return "NEED_DATA"


NEED_DATA = _NeedData()


class PayloadSink(Protocol):
    """Where a frame's payload goes: block ``i`` has ``sizes[i]`` bytes and is
    received into ``target(i)`` (views adding up to exactly that size) or
    dropped when ``target(i)`` is None. ``target`` is called lazily, when the
    first byte of block ``i`` is about to arrive. A sink may also have
    ``received(i, view)``, called with each piece of block ``i`` as it lands
    (while it is still in cache: the client checksums blocks this way)."""

    @property
    def sizes(self) -> Sequence[int]: ...

    def target(self, i: int) -> list[memoryview] | None: ...


class _Discard:
    def __init__(self, n: int) -> None:
        self.sizes = [n]

    def target(self, i: int) -> None:
        return None


_BUF_SIZE = 256 << 10


def _head_buffer() -> tuple[Any, memoryview]:
    """The reader's head buffer: anonymous memory whose pages count in RSS only once
    written. A ``bytearray`` of the same size is zero-filled, so every connection
    would cost the whole 256 KiB (measured: 259 KiB of server RSS per connection);
    this way a connection costs the pages its reads have written: a few KiB for small
    requests, the whole buffer only where large reads land in it (payload that arrives
    with a frame's head; offering less measured slower, an extra read per block)."""
    buf = mmap.mmap(-1, _BUF_SIZE)
    return buf, memoryview(buf)



#: A request meta up to this many bytes is decoded without counting its maps and arrays.
_SMALL_META = 64 << 10
#: Maps and arrays a larger request meta may hold (requests are one map of flat fields).
_MAX_CONTAINERS = 64
#: What msgpack's errors that carry no text mean.
_SILENT = {"StackError": "nested too deep", "FormatError": "a byte msgpack reserves (0xc1)"}


class FrameReader:
    """Incremental frame parser that can lend out its next receive buffer.

    Use: ``buf = reader.get_buffer(); n = sock.recv_into(buf); reader.buffer_updated(n)``,
    then ``reader.next_event()`` until it returns ``NEED_DATA``. After a
    :class:`Frame` with a payload, call :meth:`set_sink` before the next event
    (without it the payload is discarded). While a payload block is being
    received, :meth:`get_buffer` returns the block's own destination, so the
    bytes land there without a copy.
    """

    def __init__(self, limits: Limits = DEFAULT_LIMITS, *, is_server: bool = True) -> None:
        self.limits = limits
        self.is_server = is_server
        self._buf, self._view = _head_buffer()
        self._r = 0  # first unconsumed byte in _buf
        self._w = 0  # end of received bytes in _buf
        self._header: tuple[int, int, int, int] | None = None  # op, rid, meta_len, payload_len
        # payload state
        self._rid = 0
        self._sink: PayloadSink | None = None
        self._on_received: Callable[[int, memoryview], None] | None = None
        self._item = 0  # index of the block being received
        self._left_in_item = 0
        self._targets: list[memoryview] = []  # remaining destination views of the current block
        self._discarding = False
        self._payload_left = 0
        self._in_payload = False
        self._lent_target = False
        self.frames = 0

    # -- receiving
    @property
    def in_frame(self) -> bool:
        """True between a frame's first byte and its last (the stream is mid-frame)."""
        return self._header is not None or self._in_payload or self._w > self._r

    def get_buffer(self) -> memoryview:
        if self._payload_left and self._r == self._w and not self._discarding:
            self._ensure_targets()
            if self._targets:
                self._lent_target = True
                return self._targets[0]
        self._lent_target = False
        if self._r == self._w:
            self._r = self._w = 0
            if len(self._buf) > _BUF_SIZE:  # a big meta has been parsed: give its buffer back
                self._buf, self._view = _head_buffer()
        elif len(self._buf) - self._w < 4096:
            self._compact()
            if self._w == len(self._buf):
                self._grow(2 * len(self._buf))
        return self._view[self._w:]

    def buffer_updated(self, n: int) -> None:
        if self._lent_target:
            self._lent_target = False
            self._advance_target(n)
        else:
            self._w += n

    def feed(self, data: bytes) -> None:
        """Push bytes in (tests and non-buffered transports); copies as get_buffer would."""
        mv = memoryview(data)
        while mv:
            buf = self.get_buffer()
            n = min(len(buf), len(mv))
            buf[:n] = mv[:n]
            self.buffer_updated(n)
            mv = mv[n:]

    def buffered(self) -> bytes:
        """The received bytes not parsed yet (to recognise a foreign protocol)."""
        return bytes(self._view[self._r:self._w])

    def set_sink(self, sink: PayloadSink) -> None:
        if sum(sink.sizes) != self._payload_left or self._sink is not None and self._item:
            raise ValueError("a sink must cover exactly the pending payload")
        self._sink = sink
        self._on_received = getattr(sink, "received", None)
        self._item = 0
        self._left_in_item = sink.sizes[0] if sink.sizes else 0
        self._targets = []
        self._discarding = False
        self._skip_empty_items()

    def drop_payload(self, request_id: int) -> None:
        """Send the rest of frame ``request_id``'s payload, now coming in, nowhere (its
        reader stopped waiting): no byte more lands in the sink's buffers."""
        if not self._in_payload or self._rid != request_id:
            raise ValueError(f"no payload of request {request_id} is coming in")
        # (a view lent by get_buffer whose receive found nothing is not used again: get_buffer lends anew)
        self._lent_target = False
        self._sink = _Discard(self._payload_left)
        self._on_received = None
        self._item, self._left_in_item, self._targets, self._discarding = 0, self._payload_left, [], True

    # -- events
    def next_event(self) -> Frame | PayloadDone | _NeedData:
        if self._in_payload:
            if self._sink is None:
                self.set_sink(_Discard(self._payload_left))
            self._drain_buffered_payload()
            if self._payload_left:
                return NEED_DATA
            self._sink = None
            self._in_payload = False
            return PayloadDone(self._rid)
        if self._header is None:
            if self._w - self._r < HEADER_SIZE:
                if self._w - self._r >= len(MAGIC) and self._view[self._r:self._r + len(MAGIC)] != MAGIC:
                    raise ProtocolError("bad magic: not a kvstore frame")  # say so without waiting for more
                return NEED_DATA
            self._header = self._parse_header(self._view[self._r:self._r + HEADER_SIZE])
            self._r += HEADER_SIZE
        op, rid, meta_len, payload_len = self._header
        if self._w - self._r < meta_len:
            if self._w == len(self._buf):  # full: make room, growing only as the bytes actually arrive
                self._grow(min(meta_len, 2 * len(self._buf)))
            return NEED_DATA
        meta_bytes = self._view[self._r:self._r + meta_len]
        self._r += meta_len
        self._header = None
        self.frames += 1
        self._rid, self._payload_left = rid, payload_len
        self._in_payload = payload_len > 0
        self._sink = None
        msg, error = self._parse_meta(op, meta_bytes, payload_len)
        return Frame(op, rid, payload_len, msg, error)

    # -- internals
    def _parse_header(self, raw: memoryview) -> tuple[int, int, int, int]:
        magic, version, op, rid, meta_len, payload_len = HEADER.unpack(raw)
        if magic != MAGIC:
            raise ProtocolError(f"bad magic {bytes(magic)!r}: not a kvstore frame")
        if version != VERSION:
            raise ProtocolError(f"unsupported protocol version {version} (this side speaks {VERSION})")
        if meta_len > self.limits.max_meta:
            raise ProtocolError(f"meta of {meta_len} bytes is over the limit of {self.limits.max_meta}")
        if payload_len > self.limits.max_payload:
            raise ProtocolError(f"payload of {payload_len} bytes is over the limit of {self.limits.max_payload}")
        if self.is_server and op not in REQUESTS:
            raise ProtocolError(f"unknown op {op}")
        if not self.is_server and op != ERROR_OP and not (op & REPLY_BIT and op & ~REPLY_BIT in REQUESTS):
            raise ProtocolError(f"unknown reply op {op}")
        return op, rid, meta_len, payload_len

    def _unpack_request(self, raw: memoryview) -> Any:
        """A request's meta: one map of flat fields, so its arrays are bounded by the batch and its
        maps and arrays are few. Unbounded, a meta of millions of empty maps (one byte each) cost
        the event loop ~0.4 s and ~300 MB per 4 MiB frame before any field was checked."""
        bounds = {"max_array_len": 2 * self.limits.max_batch + 64, "max_map_len": 64}  # (past the batch: code 4)
        if len(raw) <= _SMALL_META:  # (a few thousand objects at most: not worth a call per container)
            return msgpack.unpackb(raw, raw=False, strict_map_key=True, use_list=True, **bounds)
        containers = 0

        def count(obj: Any) -> Any:
            nonlocal containers
            containers += 1
            if containers > _MAX_CONTAINERS:
                raise ProtocolError(f"a request's meta holds more than {_MAX_CONTAINERS} maps and arrays")
            return obj

        return msgpack.unpackb(raw, raw=False, strict_map_key=True, use_list=True, object_hook=count,
                               list_hook=count, **bounds)

    def _parse_meta(self, op: int, raw: memoryview, payload_len: int) -> tuple[Message | None, Exception | None]:
        if not len(raw):  # (msgpack's own complaint would be a bare ValueError)
            raise ProtocolError("no meta: a message with no fields carries the empty msgpack map (0x80)")
        try:
            if self.is_server:
                meta = self._unpack_request(raw)
            else:
                meta = msgpack.unpackb(raw, raw=False, strict_map_key=True, use_list=True)
        except ProtocolError:
            raise
        except ValueError as exc:  # (a bound of _unpack_request's, or garbage; msgpack's StackError and
            # FormatError, for nesting too deep and a reserved byte, say nothing)
            name = exc.__class__.__name__
            raise ProtocolError(f"bad msgpack meta: {name}: {str(exc)[:200] or _SILENT.get(name, 'not msgpack')}") from None
        except Exception as exc:  # msgpack raises many types on garbage
            raise ProtocolError(f"bad msgpack meta: {exc.__class__.__name__}") from None
        if not isinstance(meta, dict):
            raise ProtocolError("meta must be a msgpack map")
        if op == ERROR_OP:
            code, message = meta.get("code"), meta.get("message")
            if type(code) is not int or not isinstance(message, str):
                raise ProtocolError("malformed error reply")
            return ErrorReply(code=code, message=message), None
        if op & REPLY_BIT:
            return Reply(op=op & ~REPLY_BIT, fields=meta), None
        cls = REQUESTS[op]
        try:
            msg = cls.from_meta(meta, payload_len, self.limits)
            msg.validate(payload_len, self.limits)  # type: ignore[attr-defined]
        except (InvalidRequest, TooLarge) as exc:
            return None, exc
        except Exception as exc:  # e.g. RecursionError on a value nested a thousand deep: still just invalid
            return None, InvalidRequest(f"invalid {cls.__name__.upper()} meta ({exc.__class__.__name__})")
        return msg, None

    def _grow(self, size: int) -> None:
        """A fresh buffer of at least ``size`` bytes holding the unparsed bytes (the old one may still be lent out)."""
        n = self._w - self._r
        buf = bytearray(max(size, n, _BUF_SIZE))
        buf[:n] = self._view[self._r:self._w]
        self._buf, self._view = buf, memoryview(buf)
        self._r, self._w = 0, n

    def _compact(self) -> None:
        n = self._w - self._r
        if self._r:
            self._view[:n] = self._view[self._r:self._w]
            self._r, self._w = 0, n

    def _ensure_targets(self) -> None:
        """Ask the sink for the current block's destination when it starts."""
        if self._targets or self._discarding or not self._left_in_item:
            return
        assert self._sink is not None
        item_size = self._sink.sizes[self._item]
        if self._left_in_item != item_size:
            return  # a block already partly dropped stays dropped
        views = self._sink.target(self._item)
        if views is None:
            self._discarding = True
            return
        views = [v.cast("B") if v.format != "B" or v.ndim != 1 else v for v in views]
        if sum(map(len, views)) != item_size:
            raise ValueError("sink target does not match the block size")
        self._targets = views if all(views) else [v for v in views if len(v)]

    def _advance_target(self, n: int) -> None:
        head = self._targets[0]
        if self._on_received is not None:
            self._on_received(self._item, head[:n])
        if n == len(head):
            self._targets.pop(0)
        else:
            self._targets[0] = head[n:]
        self._consumed(n)

    def _consumed(self, n: int) -> None:
        self._left_in_item -= n
        self._payload_left -= n
        if self._left_in_item == 0:
            self._targets = []
            self._discarding = False
            self._item += 1
            self._skip_empty_items()

    def _skip_empty_items(self) -> None:
        assert self._sink is not None
        sizes = self._sink.sizes
        while self._item < len(sizes) and sizes[self._item] == 0:
            self._sink.target(self._item)  # let the sink see zero-length blocks too
            self._item += 1
        self._left_in_item = sizes[self._item] if self._item < len(sizes) else 0

    def _drain_buffered_payload(self) -> None:
        """Move payload bytes that arrived in the head buffer to their targets."""
        while self._payload_left and self._w > self._r:
            self._ensure_targets()
            n = min(self._w - self._r, self._left_in_item)
            if not self._discarding:
                head = self._targets[0]
                n = min(n, len(head))
                head[:n] = self._view[self._r:self._r + n]
                self._r += n
                self._advance_target(n)
            else:
                self._r += n
                self._consumed(n)
        if self._r == self._w:
            self._r = self._w = 0


# --------------------------------------------------------------------------- foreign protocols

_HTTP_METHODS = (b"GET ", b"POST ", b"PUT ", b"HEAD ", b"DELETE ", b"OPTIONS ", b"PATCH ", b"CONNECT ", b"PRI * ")


def foreign_reply(data: bytes | memoryview) -> bytes | None:
    """A reply a human's tool understands, when the first bytes are HTTP or Redis RESP.

    Nothing else can be framed for them; the connection is closed after it.
    """
    head = bytes(data[:8])
    if head.startswith(_HTTP_METHODS):
        body = b"This is a kvstore server; it speaks the kvstore binary protocol (docs/protocol.md), not HTTP.\n"
        return (b"HTTP/1.1 400 Bad Request\r\nContent-Type: text/plain\r\nConnection: close\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    if head[:1] in (b"*", b"$") or head.upper().startswith((b"PING", b"INFO", b"AUTH", b"HELLO")):
        return b"-ERR this is a kvstore server, not Redis (see docs/protocol.md)\r\n"
    return None


def iter_payload(blocks: Iterable[Any]) -> list[memoryview]:
    """Flat byte views of bytes-like blocks (bytes, bytearray, memoryview, numpy
    arrays, anything exporting a C-contiguous buffer), without copying."""
    views = []
    for b in blocks:
        try:
            mv = memoryview(b)
        except TypeError:
            raise InvalidRequest(f"a block must be bytes-like, not {type(b).__name__} (tensors: kvstore.engine."
                                 "transfer.PagedKVTransfer, or a CPU tensor's .view(torch.uint8).numpy())") from None
        except ValueError as exc:  # (numpy's datetime64 exports no buffer: "cannot include dtype 'M'")
            raise InvalidRequest(f"a block must be a plain buffer: {exc} (a numpy array: .view(numpy.uint8))") from None
        if not mv.c_contiguous:
            raise InvalidRequest("a block must be a C-contiguous buffer")
        views.append(flat_bytes(mv))
    return views


_FIELD_NAMES = re.compile(r":[^:]*:")


def flat_bytes(mv: memoryview) -> memoryview:
    """A C-contiguous view as one flat run of bytes (the same memory); an empty one of any shape
    (``np.zeros((0, 4))``, which ``cast`` refuses) as an empty view. A buffer of Python objects
    (numpy ``dtype=object``: its bytes are pointers) is refused: stored, it means nothing; read
    into, it crashes the process."""
    if mv.format == "B" and mv.ndim == 1:
        return mv
    if "O" in _FIELD_NAMES.sub("", mv.format):  # (a structured format names its fields: "T{I:Offset:}")
        raise InvalidRequest("a block must hold plain data, not Python objects (a numpy array of dtype=object; "
                             "a list of tensors made into one array?)")
    return mv.cast("B") if mv.nbytes else memoryview(bytearray())


__all__ = [
    # framing
    "HEADER", "HEADER_SIZE", "MAGIC", "NEED_DATA", "Frame", "FrameReader", "PayloadDone", "PayloadSink", "encode",
    "error_reply", "flat_bytes", "foreign_reply", "iter_payload", "reply",
    # messages (kvstore.messages)
    "DEFAULT_LIMITS", "ERROR_OP", "EXISTED", "REPLY_BIT", "REQUESTS", "STORED", "VERSION", "Delete", "ErrorReply",
    "Exists", "Flush", "Get", "Hello", "Limits", "Lookup", "Message", "Ping", "Put", "Reply", "ShmAttach",
    "ShmCommit", "ShmGet", "ShmPut", "ShmRelease", "Stats", "Unpin",
]
