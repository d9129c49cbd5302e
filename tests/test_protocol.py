"""The codec with no sockets: a client-side and a server-side reader over an in-memory link."""

from __future__ import annotations

import struct

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.errors import InvalidRequest, ProtocolError, TooLarge
from kvstore.protocol import (
    HEADER, MAGIC, NEED_DATA, VERSION, Delete, ErrorReply, Exists, Flush, Frame, FrameReader, Get, Hello, Limits,
    Lookup, PayloadDone, Ping, Put, Reply, ShmGet, ShmPut, Stats, Unpin, encode, error_reply, foreign_reply, reply,
)


class ListSink:
    def __init__(self, sizes: list[int], drop: set[int] = frozenset()) -> None:  # type: ignore[assignment]
        self.sizes = sizes
        self.bufs = [bytearray(s) for s in sizes]
        self.drop = drop

    def target(self, i: int) -> list[memoryview] | None:
        return None if i in self.drop else [memoryview(self.bufs[i])]


def wire(buffers: list) -> bytes:
    return b"".join(bytes(b) for b in buffers)


def events(reader: FrameReader, data: bytes, chunk: int = 7, sink_for=None) -> list:
    """Feed data in small chunks, collecting events; sink_for(frame) supplies payload sinks."""
    out = []
    for i in range(0, len(data), chunk):
        reader.feed(data[i:i + chunk])
        while (ev := reader.next_event()) is not NEED_DATA:
            out.append(ev)
            if isinstance(ev, Frame) and ev.payload_len and sink_for is not None:
                reader.set_sink(sink_for(ev))
    return out


REQUESTS = [
    Hello(namespace="llama/bf16/tp0", token="s3cret", client="t"),
    Ping(),
    Lookup(keys=[b"a" * 32, b"b" * 32], pin=True, lease_ms=500),
    Get(keys=[b"k1", b"k2"], unpin=True),
    Exists(keys=[b"x"]),
    Delete(keys=[b"x", b"y"]),
    Unpin(keys=[b"x"]),
    Stats(),
    Flush(namespace="ns"),
]


@pytest.mark.parametrize("msg", REQUESTS, ids=lambda m: type(m).__name__)
def test_every_request_round_trips(msg) -> None:
    reader = FrameReader(is_server=True)
    (frame,) = events(reader, wire(encode(msg, 42)))
    assert frame.request_id == 42 and frame.error is None
    assert frame.msg == msg


def test_put_payload_lands_in_sink_targets_and_dropped_blocks_are_skipped() -> None:
    blocks = [b"A" * 1000, b"", b"B" * 70000, b"C" * 5]
    msg = Put(keys=[b"1", b"2", b"3", b"4"], sizes=[len(b) for b in blocks], checksums=[1, 2, 3, 4])
    data = wire(encode(msg, 7, blocks)) + wire(encode(Ping(), 8))
    sinks = []

    def sink_for(frame: Frame) -> ListSink:
        sinks.append(ListSink(frame.msg.sizes, drop={3}))
        return sinks[-1]

    for chunk in (1, 13, 4096, len(data)):
        sinks.clear()
        evs = events(FrameReader(), data, chunk, sink_for)
        assert [type(e) for e in evs] == [Frame, PayloadDone, Frame]
        assert evs[0].msg == msg and evs[1].request_id == 7 and isinstance(evs[2].msg, Ping)
        assert [bytes(b) for b in sinks[0].bufs[:3]] == blocks[:3]
        assert bytes(sinks[0].bufs[3]) == b"\0" * 5  # dropped: never written


class SeeingSink(ListSink):
    """A sink with the optional ``received`` hook: records every piece as it lands."""

    def __init__(self, sizes: list[int], drop: set[int] = frozenset()) -> None:  # type: ignore[assignment]
        super().__init__(sizes, drop)
        self.pieces: list[tuple[int, bytes]] = []

    def received(self, i: int, piece: memoryview) -> None:
        self.pieces.append((i, bytes(piece)))


def test_received_hook_sees_each_kept_block_piece_by_piece_in_order() -> None:
    blocks = [b"A" * 1000, b"", b"B" * 70000, b"C" * 5]
    msg = Put(keys=[b"1", b"2", b"3", b"4"], sizes=[len(b) for b in blocks])
    data = wire(encode(msg, 7, blocks))
    for chunk in (1, 13, 4096, len(data)):
        sinks: list[SeeingSink] = []
        events(FrameReader(), data, chunk, lambda f: sinks.append(SeeingSink(f.msg.sizes, drop={3})) or sinks[-1])
        (sink,) = sinks
        assert [i for i, _ in sink.pieces] == sorted(i for i, _ in sink.pieces)  # in block order
        for i, block in enumerate(blocks):
            got = b"".join(p for j, p in sink.pieces if j == i)
            assert got == (b"" if i == 3 else block)  # the dropped block is never seen
        assert chunk > 1000 or len([p for j, p in sink.pieces if j == 0]) > 1  # small reads: many pieces


def test_payload_without_sink_is_discarded_and_stream_stays_in_step() -> None:
    data = wire(encode(Put(keys=[b"k"], sizes=[300000]), 1, [b"z" * 300000])) + wire(encode(Ping(), 2))
    evs = events(FrameReader(), data, 65536)
    assert [type(e) for e in evs] == [Frame, PayloadDone, Frame]


def test_get_buffer_lends_the_sink_target_for_zero_copy_receive() -> None:
    block = bytes(range(256)) * 4096  # 1 MiB
    data = wire(encode(Put(keys=[b"k"], sizes=[len(block)]), 1, [block]))
    reader = FrameReader()
    head_len = len(data) - len(block)
    reader.feed(data[:head_len])
    frame = reader.next_event()
    sink = ListSink([len(block)])
    reader.set_sink(sink)
    assert reader.next_event() is NEED_DATA
    buf = reader.get_buffer()
    assert buf.obj is sink.bufs[0]  # the destination itself, not an intermediate buffer
    buf[:] = block
    reader.buffer_updated(len(block))
    assert isinstance(reader.next_event(), PayloadDone)
    assert bytes(sink.bufs[0]) == block and frame.request_id == 1


def test_a_payload_dropped_mid_way_lands_nowhere_and_the_stream_stays_in_step() -> None:
    """The client's cancel of a get_into whose reply is coming in: not one byte more reaches the
    sink's buffers (the caller has them back), the rest is read and dropped, the next frame parses."""
    blocks = [b"A" * 70000, b"", b"B" * 70000, b"C" * 5]
    msg = Put(keys=[b"1", b"2", b"3", b"4"], sizes=[len(b) for b in blocks])
    data = wire(encode(msg, 7, blocks)) + wire(encode(Ping(), 8))
    head = len(wire(encode(msg, 7)))
    for cut in (head, head + 1, head + 40000, head + 70000, head + 100000, len(data) - 20 - len(wire(encode(Ping(), 8)))):
        reader = FrameReader()
        sink = SeeingSink(msg.sizes)
        evs: list[object] = []
        fed = 0
        for chunk in (data[:cut], data[cut:]):
            for n in range(0, len(chunk), 4096):  # (feed: into get_buffer's view, as a transport does)
                reader.feed(chunk[n:n + 4096])
                while (ev := reader.next_event()) is not NEED_DATA:
                    evs.append(ev)
                    if isinstance(ev, Frame) and ev.request_id == 7:
                        reader.set_sink(sink)
            if fed == 0:
                reader.drop_payload(7)
                seen = list(sink.pieces)
                before = [bytes(b) for b in sink.bufs]
                reader.get_buffer()  # (a view lent, then the receive finds nothing)
            fed += 1
        assert sink.pieces == seen and [bytes(b) for b in sink.bufs] == before, cut
        assert [type(e) for e in evs] == [Frame, PayloadDone, Frame] and isinstance(evs[2].msg, Ping)
    with pytest.raises(ValueError):
        FrameReader().drop_payload(7)  # (no payload coming in)


def test_replies_and_errors_parse_on_the_client_side() -> None:
    data = wire(reply(Lookup.OP, 5, n=3)) + wire(error_reply(6, 5, "no room"))
    evs = events(FrameReader(is_server=False), data)
    assert evs[0].msg == Reply(op=Lookup.OP, fields={"n": 3})
    assert evs[1].msg == ErrorReply(code=5, message="no room") and evs[1].request_id == 6


@pytest.mark.parametrize(
    "msg, exc",
    [
        (Lookup(keys=[b""]), InvalidRequest),
        (Lookup(keys=[b"x" * 129]), InvalidRequest),
        (Lookup(keys=["text"]), InvalidRequest),  # type: ignore[list-item]
        (Lookup(keys=[b"k"] * 20), TooLarge),
        (Hello(namespace=""), InvalidRequest),
        (Flush(namespace="n" * 257), InvalidRequest),  # (was unbounded: a refused flush logged 4 MiB names)
        (Put(keys=[b"k"], sizes=[-1]), InvalidRequest),
        (Put(keys=[b"k", b"j"], sizes=[1]), InvalidRequest),
        (Lookup(keys=[b"k"], pin="false"), InvalidRequest),  # type: ignore[arg-type]  (it pinned)
        (Get(keys=[b"k"], unpin=1), InvalidRequest),  # type: ignore[arg-type]
        (ShmGet(keys=[b"k"], unpin=None), InvalidRequest),  # type: ignore[arg-type]
    ],
)
def test_invalid_requests_are_reported_per_frame(msg, exc) -> None:
    reader = FrameReader(Limits(max_batch=16))
    (frame,) = events(reader, wire(encode(msg, 3)))
    assert frame.msg is None and isinstance(frame.error, exc)


def _request(meta: bytes) -> bytes:
    return HEADER.pack(MAGIC, VERSION, Get.OP, 3, len(meta), 0) + meta


@pytest.mark.parametrize("inner", [b"\x80", b"\x90"])  # an empty map, an empty array: one byte each
def test_a_request_meta_of_millions_of_containers_is_refused_at_the_start(inner: bytes) -> None:
    """(4 MiB of empty maps decoded whole: ~0.4 s of the server's event loop and ~300 MB, and then
    refused for the batch) -- flat, and nested one array deep."""
    n = (4 << 20) - 64
    for meta in (b"\x81\xa4keys\xdd" + n.to_bytes(4, "big") + inner * n,
                 b"\x81\xa4keys\xdc\x01\x00" + (b"\xdc\x3f\xff" + inner * 0x3FFF) * 256):
        with pytest.raises(ProtocolError, match="exceeds max_array_len|more than 64 maps and arrays"):
            events(FrameReader(Limits()), _request(meta[:(4 << 20)]), chunk=1 << 20)


@pytest.mark.parametrize("meta, why", [(b"\x81\xa4keys" + b"\x91" * 2000 + b"\x00", "StackError: nested too deep"),
                                       (b"\x81\xa4keys\xc1", "FormatError: a byte msgpack reserves")],
                         ids=["nested", "reserved byte"])
def test_a_meta_msgpack_refuses_without_a_word_is_refused_saying_why(meta: bytes, why: str) -> None:
    """(coverage review) msgpack's StackError and FormatError carry no text: the refusal read
    "bad msgpack meta: ValueError: ", naming nothing, on the wire and in the server's log."""
    with pytest.raises(ProtocolError, match=f"^bad msgpack meta: {why}"):
        events(FrameReader(Limits(), is_server=True), _request(meta))


def test_a_request_array_far_over_the_batch_limit_is_a_protocol_error_and_a_little_over_too_large() -> None:
    reader = FrameReader(Limits(max_batch=16))
    (frame,) = events(reader, wire(encode(Lookup(keys=[b"k"] * (2 * 16 + 64)), 3)))
    assert isinstance(frame.error, TooLarge)  # (answered, the connection goes on)
    with pytest.raises(ProtocolError, match="exceeds max_array_len"):
        events(reader, wire(encode(Lookup(keys=[b"k"] * (2 * 16 + 65)), 4)))
    replies = FrameReader(Limits(max_batch=16), is_server=False)  # (a client reads replies unbounded)
    (frame,) = events(replies, wire(encode(Reply(op=Lookup.OP, fields={"found": [1] * 1000}), 4)))
    assert frame.msg.fields["found"] == [1] * 1000


@pytest.mark.parametrize("field", ["sizes", "checksums"])
def test_a_value_nested_deeper_than_repr_goes_is_an_invalid_request_not_a_crash(field: str) -> None:
    """msgpack decodes ~1000 levels of lists, more than Python's repr can print: the checks that
    name a bad value used to raise RecursionError out of the codec (an internal error, connection closed)."""
    meta = {"keys": [b"k"], "sizes": [1], "checksums": [], field: ["DEEP"]}
    # 1000 lists, one in the next, around a 0: packed by hand (msgpack before 1.2 refuses to pack
    # what its unpacker takes)
    data = msgpack.packb(meta).replace(msgpack.packb("DEEP"), b"\x91" * 1000 + b"\x00")
    reader = FrameReader(Limits())
    (frame, done) = events(reader, HEADER.pack(MAGIC, VERSION, Put.OP, 3, len(data), 1) + data + b"x")
    assert frame.msg is None and isinstance(frame.error, InvalidRequest) and "list" in str(frame.error)


def test_put_whose_sizes_lie_about_the_payload_is_invalid() -> None:
    msg = Put(keys=[b"k"], sizes=[10])
    head = encode(msg, 1, [b"x" * 4], payload_len=4)
    (frame, done) = events(FrameReader(), wire(head))
    assert isinstance(frame.error, InvalidRequest) and isinstance(done, PayloadDone)


@pytest.mark.parametrize(
    "data, match",
    [
        (b"XX" + bytes(18), "magic"),
        (HEADER.pack(MAGIC, VERSION + 1, 2, 1, 0, 0), "version"),
        (HEADER.pack(MAGIC, VERSION, 99, 1, 0, 0), "unknown op"),
        (HEADER.pack(MAGIC, VERSION, 2, 1, 1 << 30, 0), "meta"),
        (HEADER.pack(MAGIC, VERSION, 3, 1, 5, 1 << 50), "payload"),
        (HEADER.pack(MAGIC, VERSION, 2, 1, 3, 0) + b"\xc1\xc1\xc1", "msgpack"),
        (HEADER.pack(MAGIC, VERSION, 2, 1, 2, 0) + msgpack.packb([1]), "map"),
        (HEADER.pack(MAGIC, VERSION, 2, 1, 0, 0), r"no meta: .* empty msgpack map \(0x80\)"),  # a PING, meta left out
    ],
)
def test_malformed_frames_raise_protocol_error(data: bytes, match: str) -> None:
    reader = FrameReader(Limits(max_meta=1 << 20))
    reader.feed(data)
    with pytest.raises(ProtocolError, match=match):
        reader.next_event()


def test_lying_meta_length_allocates_nothing_before_the_bytes_arrive() -> None:
    reader = FrameReader(Limits(max_meta=4 << 20))
    reader.feed(HEADER.pack(MAGIC, VERSION, 2, 1, 4 << 20, 0))
    assert reader.next_event() is NEED_DATA
    assert len(reader._buf) == 256 << 10  # nothing grows on a header's word alone
    reader.feed(b"\x80" * (256 << 10))  # the buffer full: it doubles, not to the meta's 4 MiB
    assert reader.next_event() is NEED_DATA
    assert len(reader._buf) == 512 << 10
    reader.feed(b"\x80" * (600 << 10))  # as the meta's bytes arrive, the buffer grows with them
    assert reader.next_event() is NEED_DATA
    assert 856 << 10 <= len(reader._buf) <= 1 << 20


def test_the_buffer_a_big_meta_grew_is_given_back_once_it_is_parsed() -> None:
    """Kept, every connection that once received a large batch's meta held up to 4 MiB for life."""
    reader = FrameReader()
    big = Lookup(keys=[bytes([i % 251]) * 120 + i.to_bytes(4, "big") for i in range(8000)])
    (frame,) = events(reader, wire(encode(big, 1)), chunk=1 << 20)
    assert isinstance(frame.msg, Lookup) and len(reader._buf) >= 1 << 20
    assert len(reader.get_buffer()) == 256 << 10


@pytest.mark.parametrize("field, over", [("meta", False), ("meta", True), ("payload", False), ("payload", True)])
def test_the_meta_and_payload_limits_take_exactly_their_size(field: str, over: bool) -> None:
    reader = FrameReader(Limits(max_meta=1000, max_payload=5000))
    meta_len, payload_len = (1000 + over, 0) if field == "meta" else (10, 5000 + over)
    reader.feed(HEADER.pack(MAGIC, VERSION, Put.OP, 1, meta_len, payload_len))
    if over:
        with pytest.raises(ProtocolError, match=f"{field} of {meta_len if field == 'meta' else payload_len} bytes"):
            reader.next_event()
    else:
        assert reader.next_event() is NEED_DATA


def test_a_request_meta_of_more_fields_than_any_message_has_is_refused_unread() -> None:
    """A request's meta is one flat map of a few fields: a map of more than 64 entries is refused
    by the decoder (before any of it is built), so one frame cannot hold a million-entry map."""
    meta = msgpack.packb({f"f{i}": i for i in range(65)})
    with pytest.raises(ProtocolError, match="max_map_len"):
        events(FrameReader(), _request(meta))
    (frame,) = events(FrameReader(), _request(msgpack.packb({f"f{i}": i for i in range(64)})))
    assert isinstance(frame.error, InvalidRequest)  # (64: decoded, then refused for its unknown fields)


@pytest.mark.parametrize("op, meta, match", [
    (0x80 | 0x7E, {}, "unknown reply op"),  # the reply bit on an op no request has
    (0x02, {}, "unknown reply op"),  # a request's op (PING) in a reply
    (0xFF, {"code": "5", "message": "no room"}, "malformed error reply"),
    (0xFF, {"code": 5, "message": b"no room"}, "malformed error reply"),
])
def test_replies_the_client_cannot_read_are_protocol_errors(op: int, meta: dict, match: str) -> None:
    data = msgpack.packb(meta)
    with pytest.raises(ProtocolError, match=match):
        events(FrameReader(is_server=False), HEADER.pack(MAGIC, VERSION, op, 1, len(data), 0) + data)


def test_a_sink_must_cover_the_payload_exactly() -> None:
    reader = FrameReader()
    reader.feed(wire(encode(Put(keys=[b"k"], sizes=[4]), 1, [b"abcd"])))
    frame = reader.next_event()
    assert isinstance(frame, Frame) and frame.payload_len == 4
    for sizes in ([3], [5], [2, 3]):
        with pytest.raises(ValueError, match="cover exactly"):
            reader.set_sink(ListSink(sizes))
    sink = ListSink([4])
    reader.set_sink(sink)
    assert isinstance(reader.next_event(), PayloadDone) and sink.bufs == [bytearray(b"abcd")]


def test_foreign_protocols_get_a_reply_they_understand() -> None:
    assert foreign_reply(b"GET / HTTP/1.1\r\n").startswith(b"HTTP/1.1 400")
    assert foreign_reply(b"*1\r\n$4\r\nPING\r\n").startswith(b"-ERR")
    assert foreign_reply(b"\x00\x01garbage") is None


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=300), st.sampled_from([True, False]))
def test_any_bytes_parse_or_raise_protocol_error(data: bytes, is_server: bool) -> None:
    reader = FrameReader(Limits(max_meta=4096, max_payload=1 << 20), is_server=is_server)
    try:
        events(reader, data, chunk=17)
    except ProtocolError:
        pass


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 255), st.binary(max_size=64), st.integers(0, 70))
def test_well_framed_random_meta_parses_or_raises_protocol_error(op: int, meta: bytes, payload_len: int) -> None:
    data = HEADER.pack(MAGIC, VERSION, op, 1, len(meta), payload_len) + meta + bytes(payload_len)
    try:
        evs = events(FrameReader(Limits(max_meta=4096)), data, chunk=9)
    except ProtocolError:
        return
    assert isinstance(evs[0], Frame)


def test_header_layout_is_stable() -> None:
    # documented in docs/protocol.md: 20 bytes, network order
    assert HEADER.size == 20
    assert struct.unpack("!2sBBIIQ", wire(encode(Ping(), 9))[:20]) == (b"KV", 1, 2, 9, 1, 0)


def test_put_parent_round_trips_and_a_bad_parent_is_refused() -> None:
    for msg in (Put(keys=[b"k1", b"k2"], sizes=[0, 0], parent=b"p" * 32), ShmPut(keys=[b"k"], sizes=[3], parent=b"p")):
        (frame,) = events(FrameReader(is_server=True), wire(encode(msg, 9)))
        assert frame.error is None and frame.msg == msg
    for bad in ("text", b"", b"x" * 129, 7):
        (frame,) = events(FrameReader(is_server=True), wire(encode(Put(keys=[b"k"], sizes=[0], parent=bad), 9)))
        assert isinstance(frame.error, InvalidRequest) and frame.msg is None
