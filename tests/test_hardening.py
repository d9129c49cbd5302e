"""Hostile and careless clients against a real kvstore-server: slowloris, floods, fuzz, back-pressure."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import random
import resource
import socket
import time
from pathlib import Path
from typing import Any

import msgpack
import pytest

from kvstore.client import AsyncKVClient
from kvstore.errors import Unavailable
from kvstore.protocol import HEADER, MAGIC, REQUESTS, VERSION, Get, Ping, Put, encode

MARKER = b"PAYLOAD-MUST-NOT-BE-LOGGED"


def key(i: int, tag: str) -> bytes:
    return hashlib.sha256(f"{tag}{i}".encode()).digest()


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


async def closed_within(reader: asyncio.StreamReader, seconds: float) -> float:
    """Read (discarding) until EOF; returns how long that took."""
    t0 = time.monotonic()
    while await asyncio.wait_for(reader.read(65536), seconds):
        pass
    return time.monotonic() - t0


async def exchange(port: int, data: bytes, count: int | None = None) -> list[Any]:
    """Send raw bytes; the frames answered: ``count`` of them (the connection must stay open that
    long), or all until the server closes."""
    from kvstore.protocol import FrameReader, NEED_DATA

    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    frames, got = FrameReader(is_server=False), []
    try:
        writer.write(data)
        while count is None or len(got) < count:
            chunk = await asyncio.wait_for(reader.read(65536), 10)
            if not chunk:
                assert count is None, "the server closed the connection"
                break
            frames.feed(chunk)
            while (ev := frames.next_event()) is not NEED_DATA:
                got.append(ev)
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
    return got


# ---------------------------------------------------------------- timeouts


async def test_slowloris_and_idle_connections_are_dropped_while_others_work(make_server) -> None:
    srv = make_server("--capacity", "64MiB", "--idle-timeout", "2", "--frame-timeout", "1")
    put = b"".join(bytes(b) for b in encode(Put(keys=[key(1, "slow")], sizes=[1 << 20]), 1, payload_len=1 << 20))
    async with AsyncKVClient(srv.addr, namespace="good", pool_size=1) as kv:
        # slowloris: a partial header, then one byte every 0.2 s -- never idle, never a whole frame
        r1, w1 = await asyncio.open_connection("127.0.0.1", srv.port)
        w1.write(put[:10])

        async def trickle() -> None:
            for b in put[10:]:
                await asyncio.sleep(0.2)
                if w1.is_closing():
                    return
                w1.write(bytes([b]))

        trickler = asyncio.create_task(trickle())
        r2, w2 = await asyncio.open_connection("127.0.0.1", srv.port)  # silent
        dropped = asyncio.create_task(closed_within(r1, 4))
        idle = asyncio.create_task(closed_within(r2, 5))
        while not dropped.done():  # the good client keeps working meanwhile
            await kv.put([key(int(time.monotonic() * 1000), "g")], [b"ok" * 100])
            await asyncio.sleep(0.1)
        # not before their timeouts (--frame-timeout 1, --idle-timeout 2); closed_within bounds the wait
        assert await dropped > 0.9
        assert await idle > 1.8
        trickler.cancel()
        for w in (w1, w2):
            w.close()
            with contextlib.suppress(OSError):
                await w.wait_closed()
        stats = await kv.stats()  # the good client is still connected: it was never idle for 2 s
    assert stats["timeouts"] == {"idle": 1, "frame": 1, "reply": 0, "auth": 0}
    assert stats["store"]["reserved_bytes"] == 0  # the slowloris' reservation went with it
    assert stats["namespaces"]["good"]["blocks"] >= 10


async def test_a_reply_waiting_to_drain_is_not_idle(make_server) -> None:
    srv = make_server("--capacity", "48MiB", "--idle-timeout", "1")
    big = random.Random(3).randbytes(24 << 20)
    async with AsyncKVClient(srv.addr) as kv:  # namespace "default": the raw GET below sends no HELLO
        await kv.put([b"big"], [big])
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
    sock.settimeout(10)
    sock.connect(("127.0.0.1", srv.port))
    with sock:
        sock.sendall(b"".join(bytes(b) for b in encode(Get(keys=[b"big"]), 7)))
        await asyncio.sleep(2.2)  # read nothing for 2.2 idle timeouts: the server is the one waiting
        got = bytearray()
        while len(got) < len(big) + HEADER.size:
            chunk = sock.recv(1 << 20)
            assert chunk, "the server closed a connection whose reply had not drained"
            got += chunk
        meta_len = HEADER.unpack_from(got)[4]
        assert bytes(got[HEADER.size + meta_len:]) == big
        # still open: an idle close would have flushed the reply and then hung up
        sock.sendall(b"".join(bytes(b) for b in encode(Ping(), 8)))
        pong = sock.recv(4096)
    assert HEADER.unpack_from(pong)[2:4] == (Ping.OP | 0x80, 8)


# ---------------------------------------------------------------- connection cap


async def test_connections_over_the_cap_are_refused_and_the_server_keeps_serving(make_server) -> None:
    cap = 10
    srv = make_server("--capacity", "8MiB", "--max-connections", str(cap))
    clients = [AsyncKVClient(srv.addr, namespace="cap", pool_size=1) for _ in range(cap)]
    await asyncio.gather(*(c.connect() for c in clients))

    async def refused() -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", srv.port)
        try:
            return await asyncio.wait_for(reader.read(), 10)  # the error reply, then EOF
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()  # (closed for good before the loop ends: no unclosed-transport warning)

    answers = await asyncio.gather(*(refused() for _ in range(220)))
    for data in answers:
        _, _, op, rid, meta_len, _ = HEADER.unpack_from(data)
        meta = msgpack.unpackb(data[HEADER.size:HEADER.size + meta_len])
        assert (op, rid, meta["code"]) == (0xFF, 0, Unavailable.code) and "limit of 10" in meta["message"]
    try:
        async with AsyncKVClient(srv.addr, retries=0) as extra:
            await extra.ping()
        raise AssertionError("an 11th client got in")
    except Unavailable:
        pass
    assert all(await asyncio.gather(*(c.ping() for c in clients)))  # the admitted ones still work
    await clients[0].close()
    for _ in range(100):  # until the server has seen it go (bounded)
        if (await clients[1].stats())["connections"] < cap:
            break
        await asyncio.sleep(0.05)
    async with AsyncKVClient(srv.addr, namespace="cap") as late:  # a freed slot is usable again
        await late.put([b"k"], [b"v"])
        stats = await late.stats()
    await asyncio.gather(*(c.close() for c in clients[1:]))
    assert stats["connections_rejected"] == 221


def open_files(pid: int) -> int:
    """A process's soft open-file limit, from /proc."""
    with open(f"/proc/{pid}/limits") as f:
        return int(next(line for line in f if line.startswith("Max open files")).split()[3])


async def test_the_open_file_limit_is_raised_for_max_connections_or_the_cap_lowered_to_fit(make_server) -> None:
    """Under a soft limit of 1024 (ulimit -n; a common default) and the default --max-connections
    1024, a 1,500-connection burst got 492 connections dropped without a word (accept failed with
    EMFILE before the cap refused anything), and the Redis tier, unable to connect, went down. The
    server raises its soft limit to what the cap needs; where the hard limit forbids it, it lowers
    the cap, so that the connections over it get the cap's error reply."""
    hard = min(4096, resource.getrlimit(resource.RLIMIT_NOFILE)[1])  # (raising it needs privilege)
    raised = make_server("--capacity", "8MiB", "--max-connections", "400", open_files=(300, hard))
    assert open_files(raised.proc.pid) == 400 + 64  # (FD_RESERVE; a Redis tier adds its pool's)
    async with AsyncKVClient(raised.addr) as kv:
        assert (await kv.stats())["max_connections"] == 400
    low = make_server("--capacity", "8MiB", "--max-connections", "400", open_files=(214, 214))
    assert any("--max-connections 400 lowered to 150" in line for line in low.log)
    socks: list[socket.socket] = []
    async with AsyncKVClient(low.addr, namespace="fd", pool_size=1) as kv:
        try:
            await kv.ping()
            for _ in range(149):
                socks.append(socket.create_connection(("127.0.0.1", low.port)))
            with pytest.raises(Unavailable, match="limit of 150 connections"):  # an error reply, not a drop
                async with AsyncKVClient(low.addr, retries=0):
                    pass
            for s in socks[:10]:
                s.close()
            for _ in range(100):  # until the server has seen them go (bounded)
                if (await kv.stats())["connections"] <= 140:
                    break
                await asyncio.sleep(0.05)
            async with AsyncKVClient(low.addr, namespace="fd") as late:  # room again
                assert await late.ping() >= 0
            stats = await kv.stats()
            assert (stats["connections_rejected"], stats["max_connections"]) == (1, 150)  # the cap in force
        finally:
            for s in socks:
                s.close()


async def test_max_pending_out_stops_reading_a_client_that_does_not_read(make_server) -> None:
    async def answered_while_not_reading(srv_args: tuple[str, ...]) -> int:
        srv = make_server("--capacity", "16MiB", *srv_args)
        async with AsyncKVClient(srv.addr) as kv:
            await kv.put([b"blk"], [bytes(1 << 20)])
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
            sock.connect(("127.0.0.1", srv.port))
            with sock:
                gets = b"".join(bytes(b) for i in range(1, 101) for b in encode(Get(keys=[b"blk"]), i))
                sock.sendall(gets)  # 100 x 1 MiB replies asked for in one write; none read
                answered = -1
                while answered != (answered := (await kv.stats())["requests"].get("get", 0)):
                    await asyncio.sleep(0.5)  # until the server stops answering (it is not read)
                return answered

    default = await answered_while_not_reading(())  # --max-pending-out 64MiB
    limited = await answered_while_not_reading(("--max-pending-out", "2MiB"))
    assert 60 <= default <= 75  # 64 MiB of replies queued (+ what the socket buffers took), then paused
    assert limited <= 8  # the server stops reading, and stops parsing what it already read


async def test_gets_of_many_small_blocks_stop_being_read_by_their_count_not_only_their_bytes(make_server) -> None:
    """A GET of 16384 copies of a 1-byte block asks ~50 KB and queues a pin and a buffer per key
    (~6 MiB of server memory): 60 of them stay far under --max-pending-out's 64 MiB, so only the
    count of queued buffers and pins stops a client that does not read (uvloop fails a transport
    at ~2**20 buffers)."""
    from kvstore.protocol import Frame, FrameReader, Reply

    srv = make_server("--capacity", "16MiB", "--page-size", "4KiB")
    async with AsyncKVClient(srv.addr) as kv:
        await kv.put([b"tiny"], [b"t"])
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
        sock.connect(("127.0.0.1", srv.port))
        with sock:
            # (sent from a thread: the socket buffers may not hold all 3 MB while the server does
            # not read, and a blocked loop could not read the replies that let it go on)
            sending = asyncio.ensure_future(asyncio.to_thread(
                sock.sendall, b"".join(bytes(b) for i in range(1, 61) for b in encode(Get(keys=[b"tiny"] * 16384), i))))
            answered = -1
            while answered != (answered := (await kv.stats())["requests"].get("get", 0)):
                await asyncio.sleep(0.5)  # until the server stops answering (it is not read)
            assert answered < 40, answered  # paused by the count; it used to answer all 60
            sock.settimeout(10)
            reader, replies = FrameReader(is_server=False), []
            while len(replies) < 60:  # read now: every reply comes, whole
                chunk = await asyncio.to_thread(sock.recv, 1 << 20)
                assert chunk, f"connection closed after {len(replies)} replies"
                reader.feed(chunk)
                while isinstance(event := reader.next_event(), Frame):
                    replies.append(event)
            await sending
        assert all(isinstance(f.msg, Reply) and f.msg.fields["sizes"] == [1] * 16384 for f in replies)
        for _ in range(30):  # a reply's pins go once it is written, the last ones at the next sweep (1 s)
            if (stats := await kv.stats())["store"]["pinned_blocks"] == 0:
                break
            await asyncio.sleep(0.1)
    assert stats["store"]["pinned_blocks"] == 0


async def test_a_client_that_stops_reading_its_reply_is_dropped_and_its_pins_released(make_server) -> None:
    """The blocks of a reply stay pinned until it is sent. A client that asked for 24 MiB and
    stopped reading held them for good (back-pressure bounds the bytes queued, not the time):
    a reply that does not move for --frame-timeout now ends the connection, as a stalled
    request does. One that keeps reading, however slowly, is not dropped."""
    srv = make_server("--capacity", "64MiB", "--frame-timeout", "2", "--idle-timeout", "300")
    keys = [key(i, "stall") for i in range(6)]
    async with AsyncKVClient(srv.addr) as kv:
        await kv.put(keys, [bytes(4 << 20)] * 6)
        slow = socket.create_connection(("127.0.0.1", srv.port))
        stalled = socket.socket()
        stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
        stalled.connect(("127.0.0.1", srv.port))
        with slow, stalled:
            for sock in (slow, stalled):
                sock.sendall(b"".join(bytes(b) for b in encode(Get(keys=keys), 1)))
            deadline, got = time.monotonic() + 20, 0
            while (await kv.stats())["timeouts"]["reply"] == 0 and time.monotonic() < deadline:
                got += len(await asyncio.to_thread(slow.recv, 64 << 10))  # a slow reader: 64 KiB per 50 ms
                await asyncio.sleep(0.05)
            stats = await kv.stats()
            assert stats["timeouts"]["reply"] == 1 and stats["connections"] == 2  # ours and the slow one
            while got <= 24 << 20:  # the slow reader gets its whole reply (header, meta, 24 MiB)
                n = len(await asyncio.to_thread(slow.recv, 1 << 20))
                assert n, "the slow reader's connection was closed"
                got += n
        assert (await kv.stats())["store"]["pinned_blocks"] == 0


async def test_a_burst_of_pipelined_requests_lets_other_connections_take_turns(make_server, tmp_path) -> None:
    """(overload review) A read event hands over up to 8 MiB of a connection's frames, and all of
    them were handled before any other connection was heard: a peer pipelining 300,000 PINGs held
    another client's request for ~2 s. Each connection gets FRAMES_PER_TURN at a time now: a STATS
    sent as such a burst has arrived (a Unix socket queues megabytes of it at once) is answered
    while most of it still waits (it was answered after the 1.6 MB queued)."""
    path = str(tmp_path / "kv.sock")
    srv = make_server("--capacity", "16MiB", "--frame-timeout", "30", "--unix", path, "--no-shm")
    n = 300_000
    burst = b"".join(bytes(b) for b in encode(Ping(), 1)) * n  # 6.3 MB
    async with AsyncKVClient(srv.addr, pool_size=1) as kv:
        await kv.ping()
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as hog:
            hog.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8 << 20)
            hog.connect(path)
            await asyncio.to_thread(hog.sendall, burst)
            pings = (await kv.stats())["requests"].get("ping", 0)
            assert pings < 40_000, pings  # (it was 76,461, the queued part; ~500 now: a turn or two)
            hog.shutdown(socket.SHUT_WR)
            while await asyncio.to_thread(hog.recv, 1 << 20):  # every PING is answered all the same
                pass
        assert (await kv.stats())["requests"]["ping"] == n + 1


async def test_a_client_that_reads_every_reply_is_not_taken_for_one_that_stopped(make_server) -> None:
    """(overload review) The check read TIOCOUTQ, which over TCP counts bytes sent and not yet
    acknowledged: the last small reply of a client asking every few ms sat unacknowledged (delayed
    ACK) at each check, read as "not moved", and the connection was dropped as a reply timeout about
    every --frame-timeout. Over TCP the bytes not yet sent count now."""
    srv = make_server("--capacity", "16MiB", "--frame-timeout", "1", "--idle-timeout", "300")
    async with AsyncKVClient(srv.addr, pool_size=1) as kv:
        (conn,) = kv.nodes[0].conns
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            await kv.ping()
            await asyncio.sleep(0.01)
        stats = await kv.stats()
        assert stats["timeouts"]["reply"] == 0 and kv.nodes[0].conns == [conn] and not conn.closed


async def test_a_client_that_stops_reading_then_sends_a_bad_frame_is_dropped_all_the_same(make_server) -> None:
    """The bad frame made the connection 'closing', and a closing connection was skipped by the
    timeouts while its close waited for the reply to flush: it held its slot and the reply's pins
    for as long as the peer kept the socket open. The reply timeout now ends it too."""
    srv = make_server("--capacity", "64MiB", "--frame-timeout", "2", "--idle-timeout", "300")
    keys = [key(i, "stall-then-garbage") for i in range(6)]
    async with AsyncKVClient(srv.addr) as kv:
        await kv.put(keys, [bytes(4 << 20)] * 6)
        stalled = socket.socket()
        stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
        stalled.connect(("127.0.0.1", srv.port))
        with stalled:
            stalled.sendall(b"".join(bytes(b) for b in encode(Get(keys=keys), 1)) + b"not a frame at all")
            deadline = time.monotonic() + 20
            while (await kv.stats())["timeouts"]["reply"] == 0 and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
            stats = await kv.stats()
            assert stats["timeouts"]["reply"] == 1 and stats["connections"] == 1  # (ours)
            assert stats["store"]["pinned_blocks"] == 0


def read_frame(sock: socket.socket) -> int:
    """Read one whole reply frame; its payload length."""
    def exactly(n: int) -> None:
        while n:
            n -= len(sock.recv(min(n, 1 << 20)))
    head = b""
    while len(head) < HEADER.size:
        head += sock.recv(HEADER.size - len(head))
    *_, meta_len, payload_len = HEADER.unpack(head)
    exactly(meta_len + payload_len)
    return payload_len


async def test_a_client_that_keeps_reading_keeps_only_unread_replies_pinned(make_server) -> None:
    srv = make_server("--capacity", "64MiB")
    keys = [key(i, "pipelined") for i in range(12)]
    async with AsyncKVClient(srv.addr) as kv:
        await kv.put(keys, [bytes(4 << 20)] * 12)
        with socket.create_connection(("127.0.0.1", srv.port)) as sock:
            def get(i: int) -> None:
                sock.sendall(b"".join(bytes(b) for b in encode(Get(keys=[keys[i % 12]]), i + 1)))

            depth, pinned = 6, []  # 24 MiB asked for at any time: more than the socket buffers hold
            for i in range(depth):
                get(i)
            for i in range(depth, depth + 36):
                assert await asyncio.to_thread(read_frame, sock) == 4 << 20
                await asyncio.sleep(0.01)  # a reader a little slower than the server: its replies queue up
                get(i)
                pinned.append((await kv.stats())["store"]["pinned_blocks"])
            for _ in range(depth):
                await asyncio.to_thread(read_frame, sock)
    # Pins were released only when the server's output buffer ran dry: every block read stayed pinned.
    assert max(pinned) <= depth + 1, pinned


# ---------------------------------------------------------------- fuzz


def fuzz_inputs(rng: random.Random, good_frames: list[bytes]) -> bytes:
    """One hostile input: garbage, lying headers, random metas, mutated or truncated good frames."""
    kind = rng.randrange(6)
    if kind == 0:
        return rng.randbytes(rng.randrange(1, 2048))
    if kind == 1:  # a plausible header that lies about its lengths
        return HEADER.pack(MAGIC, VERSION, rng.choice(list(REQUESTS)), rng.getrandbits(32),
                           rng.choice([0, 1, 100, 1 << 20, 1 << 31, rng.getrandbits(32)]),
                           rng.choice([0, 1, 1 << 20, 1 << 40, rng.getrandbits(64)])) + rng.randbytes(rng.randrange(64))
    if kind == 2:  # a well-framed request whose meta is a random map
        meta = msgpack.packb({rng.choice(["keys", "sizes", "checksums", "namespace", "pin", "lease_ms", "unpin",
                                          "token", "version", "x"]):
                              rng.choice([None, -1, 0, 2**63, "s", b"k" * rng.randrange(200), [b"k"], [1, 2], {},
                                          [rng.randbytes(rng.randrange(1, 40)) for _ in range(rng.randrange(5))],
                                          [rng.randrange(1 << 20) for _ in range(rng.randrange(5))], 1.5, True])
                              for _ in range(rng.randrange(5))})
        payload = MARKER * rng.randrange(3)
        return HEADER.pack(MAGIC, VERSION, rng.choice(list(REQUESTS)), rng.getrandbits(32), len(meta),
                           len(payload)) + meta + payload
    frame = bytearray(rng.choice(good_frames))
    if kind == 3:  # bit flips
        for _ in range(rng.randrange(1, 8)):
            frame[rng.randrange(len(frame))] ^= 1 << rng.randrange(8)
        return bytes(frame)
    if kind == 4:  # truncated
        return bytes(frame[:rng.randrange(1, len(frame))])
    return bytes(frame) * rng.randrange(1, 4)  # valid, repeated (dedup path)


async def test_random_frame_fuzz_leaves_server_serving_with_acked_blocks_intact(make_server) -> None:
    # Small pages and a 256 KiB block limit: garbage PUTs cannot reserve enough to evict anything.
    srv = make_server("--capacity", "64MiB", "--page-size", "4KiB", "--max-block", "256KiB", "--frame-timeout", "1",
                      "--log-format", "json")
    rng = random.Random(20240611)
    acked: dict[bytes, bytes] = {}
    good_frames = [b"".join(bytes(b) for b in encode(Put(keys=[key(i, "fz")], sizes=[64]), i, [MARKER.ljust(64)]))
                   for i in range(5)] + [b"".join(bytes(b) for b in encode(Get(keys=[key(i, "fz")]), i))
                                          for i in range(5)]
    async with AsyncKVClient(srv.addr, namespace="acked-ns-6c1f") as kv:
        for i in range(40):
            k, v = key(i, "acked"), MARKER + rng.randbytes(rng.choice([100, 4096, 200_000]))
            await kv.put([k], [v])
            acked[k] = v
        assert await kv.lookup(list(acked), pin=True, lease_ms=600_000) == 40  # eviction may not take them
        rss_before = rss_kib(srv.proc.pid)

        async def attacker(seed: int, deadline: float) -> int:
            r = random.Random(seed)
            sent = 0
            while time.monotonic() < deadline:
                reader, writer = await asyncio.open_connection("127.0.0.1", srv.port)
                try:
                    for _ in range(r.randrange(1, 4)):
                        writer.write(fuzz_inputs(r, good_frames))
                    if r.random() < 0.5:
                        writer.write_eof()
                    await asyncio.wait_for(reader.read(1 << 16), 0.05)
                except (OSError, asyncio.TimeoutError):  # the server closed first, or is waiting for more
                    pass
                finally:
                    writer.close()
                    with contextlib.suppress(OSError):
                        await writer.wait_closed()
                sent += 1
            return sent

        deadline = time.monotonic() + 5
        attacks = asyncio.gather(*(attacker(rng.getrandbits(32), deadline) for _ in range(6)))
        while time.monotonic() < deadline:  # a good client keeps storing and reading meanwhile
            k, v = key(len(acked), "acked"), MARKER + rng.randbytes(1000)
            await kv.put([k], [v])
            acked[k] = v
            assert bytes((await kv.get([k]))[0]) == v
            await asyncio.sleep(0.005)
        assert sum(await attacks) > 250
        await asyncio.sleep(1.3)  # stragglers time out (--frame-timeout 1)
        keys = list(acked)
        got = await kv.get(keys)
        assert [bytes(g) if g is not None else None for g in got] == [acked[k] for k in keys]
        stats = await kv.stats()
        rss_after = rss_kib(srv.proc.pid)
    assert stats["connections"] == 1
    assert stats["store"]["reserved_bytes"] == 0
    assert stats["store"]["evictions"] == 0
    assert rss_after - rss_before < 96 << 10, (rss_before, rss_after)  # KiB: bounded, no leak per connection
    assert srv.stop() == 0
    lines = [json.loads(line) for line in srv.log]  # --log-format json: every line is one JSON event
    assert all({"ts", "level", "logger", "msg"} <= set(ev) for ev in lines)
    assert not [ev for ev in lines if ev["level"] in ("error", "critical")], "the fuzz hit an internal error"
    assert not any(MARKER.decode() in line for line in srv.log)


async def test_empty_blocks_in_a_put_that_never_arrives_whole_evict_nothing(make_server) -> None:
    """A PUT header naming 1000 empty blocks and one of 2 bytes, then 1 byte: the frame never
    completes. Empty blocks are reserved at the commit, so it holds one page (each took a page as
    the header arrived, evicting the cache for a frame that was never going to be stored)."""
    srv = make_server("--capacity", "8MiB", "--page-size", "64KiB")  # 128 pages
    victims = [key(i, "victim") for i in range(100)]
    liar = Put(keys=[key(i, "empty") for i in range(1001)], sizes=[0] * 1000 + [2])
    async with AsyncKVClient(srv.addr, namespace="v") as kv:
        await kv.put(victims, [b"v" * 1000] * len(victims))
        _, w = await asyncio.open_connection("127.0.0.1", srv.port)
        w.write(b"".join(bytes(b) for b in encode(liar, 1, payload_len=2)) + b"x")
        deadline = time.monotonic() + 10
        while (stats := await kv.stats())["store"]["reserved_bytes"] == 0:  # the 2-byte block's first byte came
            assert time.monotonic() < deadline, "the server never reserved the 2-byte block"
            await asyncio.sleep(0.02)
        assert stats["store"]["reserved_bytes"] == 64 << 10
        assert stats["store"]["evictions"] == 0
        assert await kv.exists(victims) == [True] * len(victims)
        w.close()
    # (the empty blocks of a PUT that arrives whole are stored: test_server, test_empty_blocks_...)


async def test_a_meta_nested_too_deep_to_print_is_refused_and_the_connection_goes_on(make_server) -> None:
    """A PUT whose sizes hold a list nested 1000 deep (msgpack allows it; Python's repr does not)
    used to end in an internal error and a closed connection."""
    from kvstore.protocol import ErrorReply

    srv = make_server("--capacity", "16MiB", "--log-format", "json")
    # (packed by hand: msgpack before 1.2 refuses to pack 1000 levels, which its unpacker takes)
    meta = msgpack.packb({"keys": [key(0, "deep")], "sizes": ["DEEP"], "checksums": []}).replace(
        msgpack.packb("DEEP"), b"\x91" * 1000 + b"\x00")
    got = await exchange(srv.port, HEADER.pack(MAGIC, VERSION, Put.OP, 7, len(meta), 0) + meta
                         + b"".join(bytes(b) for b in encode(Ping(), 8)), count=2)
    assert got[0].request_id == 7 and isinstance(got[0].msg, ErrorReply) and got[0].msg.code == 2  # InvalidRequest
    assert got[1].request_id == 8 and not isinstance(got[1].msg, ErrorReply)  # and PING still answered
    assert srv.stop() == 0
    assert not [line for line in srv.log if '"error"' in line or "Traceback" in line]


async def test_a_meta_with_misnamed_or_mistyped_fields_is_refused_not_answered_as_empty(make_server) -> None:
    """(protocol review) Field names packed as bytes, a misspelled or missing `keys`, or `pin` given
    as a string were read as defaults: a PUT that stored nothing answered as a success, a LOOKUP of
    a stored key answered 0, a LOOKUP with pin="false" pinned. Each is an InvalidRequest now."""
    from kvstore.protocol import ErrorReply, Lookup

    srv = make_server("--capacity", "16MiB")
    k = key(0, "named")
    async with AsyncKVClient(srv.addr) as kv:
        await kv.put([k], [b"x" * 100])
    metas = [(Put.OP, {b"keys": [k], b"sizes": [0], b"checksums": []}, "field names must be strings"),
             (Lookup.OP, {b"keys": [k]}, "field names must be strings"),
             (Lookup.OP, {"key": [k]}, "LOOKUP needs the field(s) keys"),
             (Put.OP, {"keys": [k]}, "PUT needs the field(s) sizes"),
             (Lookup.OP, {"keys": [k], "pin": "false"}, "pin must be true or false"),
             (Get.OP, {"keys": [k], "unpin": 1}, "unpin must be true or false"),
             (Put.OP, {"keys": [k], "sizes": [0], "checksums": None}, "checksums must be a list"),
             (Put.OP, {"keys": [k], "sizes": [0], "checksums": False}, "checksums must be a list"),
             (Put.OP, {"keys": [k], "sizes": [0], "checksums": {}}, "checksums must be a list")]
    data = b"".join(HEADER.pack(MAGIC, VERSION, op, i, len(m), 0) + m
                    for i, (op, meta, _) in enumerate(metas, 1) for m in [msgpack.packb(meta)])
    got = await exchange(srv.port, data + b"".join(bytes(b) for b in encode(Ping(), 99)), count=len(metas) + 1)
    for frame, (_, _, message) in zip(got, metas):
        assert isinstance(frame.msg, ErrorReply) and frame.msg.code == 2 and message in frame.msg.message, frame.msg
    assert got[-1].request_id == 99 and not isinstance(got[-1].msg, ErrorReply)  # the connection goes on
    async with AsyncKVClient(srv.addr) as kv:
        assert (await kv.stats())["store"]["leases"] == 0  # (pin="false" had pinned)
        assert (await kv.get([k]))[0] == b"x" * 100  # (a PUT with checksums nil had replaced it with b"")


def test_a_client_still_sending_when_its_frame_is_refused_reads_the_answer(make_server) -> None:
    """The server answered a frame over its limit and closed with the client's bytes unread, so the
    kernel reset the connection: a client still sending got the reset, and the answer could be lost
    with it (a CI run saw "connection reset by peer" instead of the answer). It now half-closes after
    the answer and drops what the peer still sends, up to LINGER_S, before closing."""
    srv = make_server("--capacity", "8MiB", "--max-frame-size", "1MiB")
    payload = memoryview(bytes(64 << 20))
    head = bytes(encode(Put(keys=[key(0, "refused")], sizes=[len(payload)]), 1, [payload])[0])  # (not the payload)
    with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as sock:
        sock.sendall(head + bytes(1 << 20))  # the head is refused on sight; the payload keeps coming
        time.sleep(0.3)  # the server has answered and closed its side meanwhile
        sock.sendall(bytes(1 << 20))  # (old server: reset here, or the answer gone)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    magic, _, op, _, meta_len, payload_len = HEADER.unpack_from(answer)
    assert (magic, op, payload_len, len(answer)) == (MAGIC, 0xFF, 0, HEADER.size + meta_len), answer[:64]
    meta = msgpack.unpackb(answer[HEADER.size:])  # one error reply, then the server's FIN
    assert "over the limit" in meta["message"], meta
    with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as sock:  # and it keeps serving
        sock.sendall(b"".join(bytes(b) for b in encode(Ping(), 1)))
        assert sock.recv(HEADER.size)[:2] == MAGIC


async def test_a_meta_of_millions_of_empty_maps_is_refused_without_decoding_them(make_server) -> None:
    """(each such 4 MiB frame cost the server ~300 MB and ~0.4 s of its event loop before the
    batch limit refused it; ten at once held another client's PING for seconds)"""
    from kvstore.protocol import ErrorReply

    srv = make_server("--capacity", "16MiB")
    assert srv.proc is not None
    meta = b"\x81\xa4keys\xdc\x00\xff" + (b"\xdc\x3f\xff" + b"\x80" * 0x3FFF) * 255  # 4,178,438 bytes
    before = rss_kib(srv.proc.pid)
    got = await exchange(srv.port, HEADER.pack(MAGIC, VERSION, Get.OP, 7, len(meta), 0) + meta)
    assert len(got) == 1 and isinstance(got[0].msg, ErrorReply) and got[0].msg.code == 9
    assert "more than 64 maps and arrays" in got[0].msg.message
    assert rss_kib(srv.proc.pid) - before < 64 << 10  # (was ~300 MB more)
    async with AsyncKVClient(srv.addr, namespace="after") as kv:
        await kv.ping()
