"""Client half of the same-host shared-memory path (design: ``docs/shm.md``).

A client on the server's host maps the server's block arena (a memfd the
server passes over its Unix socket) and moves payload bytes with one
``memcpy`` each way; only small control frames cross the socket:

* get: ``SHM_GET`` pins and locates the blocks -> the client copies them out of
  the mapping into the caller's buffers (hashing each chunk while it is still
  in cache) -> ``SHM_RELEASE``. A copy that matched its stored checksum is the
  block, so the release is sent without waiting for its answer; otherwise (a
  block stored without a checksum, ``verify=False``, a mismatch) the copy
  counts only if the release answers ``held``: the pins lasted the whole copy,
  so no slot was reused under it.
* put: ``SHM_PUT`` reserves slots -> the client copies its blocks in (hashing
  the source as it goes) -> ``SHM_COMMIT`` with the checksums publishes them.

The attach itself runs on a short-lived *side* connection (a blocking socket:
asyncio transports cannot receive ancillary data): HELLO with the token, then
``SHM_ATTACH``, whose reply carries the fd (SCM_RIGHTS). Anything that goes
wrong there -- no Unix socket, ``--no-shm``, a namespace-limited token, another
host -- leaves the client on the socket path, transparently.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import mmap
import os
import socket
import time
import weakref
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Sequence, TypeVar

import xxhash

from kvstore.errors import (
    IntegrityError, KVStoreError, NotFound, ProtocolError, RequestTimeout, TransportError, Unavailable, from_code,
)
from kvstore.protocol import (
    ErrorReply, Frame, FrameReader, Hello, Message, Reply, ShmAttach, ShmCommit, ShmGet, ShmPut,
    ShmRelease, encode,
)

from . import replies
from .connection import ClientConnection, NotHome, NotSent, Response
from .workers import run_parallel

if TYPE_CHECKING:
    from .aio import AsyncKVClient
    from .node import Node

log = logging.getLogger(__name__)
T = TypeVar("T")

#: Copy-and-hash granularity: a chunk is hashed right after its copy, while it is
#: still in cache, so verification does not re-read DRAM. Measured on this VM
#: (32 x 4 MiB from a memfd mapping): 1 MiB chunks ran at about the plain copy's
#: speed; 64-512 KiB chunks were 30-50 % slower (memcpy picks slower stores for
#: mid-sized copies), so are whole 4 MiB blocks hashed after their copy.
CHUNK = 1 << 20
_MAX_FDS = 4  # ancillary room; anything beyond the one fd we expect is closed


# --------------------------------------------------------------------------- the mapping


FileId = tuple[int, int, int]


def file_id(st: os.stat_result) -> FileId:
    """Which file a path names: device, inode and change time. (The inode alone is not enough: a
    restarted server's socket file, made right after the dead one's was removed, took its inode
    number again, and a client's watch took it for the old server's.)"""
    return st.st_dev, st.st_ino, st.st_ctime_ns


class ShmSegment:
    """The server's block arena, mapped read-write into this process."""

    def __init__(self, region: mmap.mmap, page_size: int, instance: str) -> None:
        self.region = region
        self.buffer = memoryview(region)
        self.size = len(region)
        self.page_size = page_size
        self.instance = instance
        self.socket: tuple[str, FileId] | None = None  # the server's socket file (path, file_id) when attached
        self.inherited = False  # a forked child's copy of its parent's: no pages behind it here
        _segments.add(self)

    def views(self, loc: Any) -> list[memoryview]:
        """The arena byte ranges ``[[offset, length], ...]`` as views, checked against the mapping.

        Raises:
            ProtocolError: a range outside the mapping, or ranges that overlap (never trust an
                offset blindly; nor a block that names the same bytes many times over).
            TransportError: the mapping was closed (with the client).
        """
        if self.inherited:
            raise TransportError("the shared arena was mapped by the parent of this forked process")
        if not isinstance(loc, list):
            raise ProtocolError("malformed shm location")
        for item in loc:
            if (not isinstance(item, list) or len(item) != 2 or type(item[0]) is not int
                    or type(item[1]) is not int or item[0] < 0 or item[1] < 0 or item[0] + item[1] > self.size):
                raise ProtocolError(f"a shm location is malformed or outside the {self.size}-byte arena")
        spans = sorted(loc)
        if any(nxt[0] < cur[0] + cur[1] for cur, nxt in zip(spans, spans[1:])):
            raise ProtocolError("a shm location's ranges overlap")
        try:
            return [self.buffer[start:start + n] for start, n in loc]
        except ValueError:  # released: the client was closed meanwhile
            raise TransportError("the shared arena is no longer mapped (the client was closed)") from None

    def close(self) -> None:
        """Unmap (left to the garbage collector if a view of it is still alive somewhere)."""
        if self.inherited:
            return  # (see _forget_inherited)
        try:
            self.buffer.release()
            self.region.close()
        except BufferError:
            pass


_segments: weakref.WeakSet[ShmSegment] = weakref.WeakSet()
#: The mmap objects of arenas a forked child inherited, kept for the child's whole life: the
#: arena is mapped MADV_DONTFORK, so the child has a hole at its address, where its own mappings
#: (its own client's arena, malloc's) may land; freeing the inherited object would munmap them.
_inherited: list[mmap.mmap] = []


def _forget_inherited() -> None:
    for segment in list(_segments):
        segment.inherited = True
        _inherited.append(segment.region)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_inherited)


def attach(path: str, *, namespace: str, token: str | None, timeout: float | None) -> ShmSegment:
    """Map the arena of the server listening on Unix socket ``path`` (blocking; run it in a thread).

    Raises:
        Unauthorized, InvalidRequest, ...: the server refused (wrong token,
            namespace-limited token, shm not offered).
        TransportError: the socket could not be reached, closed early, or did not answer
            within ``timeout`` seconds in all (a reply trickling in does not extend it).
        ProtocolError: the reply made no sense or carried no descriptor.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    fds: list[int] = []
    try:
        try:
            sock.connect(path)
        except OSError as exc:
            raise TransportError(f"cannot connect to unix:{path}: {exc.strerror or exc}") from None
        reader = FrameReader(is_server=False)
        _ask(sock, reader, Hello(namespace=namespace, token=token, client="kvstore-py-shm"), 1, fds, deadline)
        fields = _ask(sock, reader, ShmAttach(), 2, fds, deadline)
        if len(fds) != 1:
            raise ProtocolError(f"SHM_ATTACH reply carried {len(fds)} descriptors, not 1")
        segment = _map(fds[0], fields)
        with contextlib.suppress(OSError):  # (a server that stops removes it: Node._watch_socket)
            segment.socket = (path, file_id(os.stat(path)))
        return segment
    finally:
        sock.close()
        for fd in fds:
            os.close(fd)


def _ask(sock: socket.socket, reader: FrameReader, msg: Message, rid: int, fds: list[int],
         deadline: float | None) -> dict[str, Any]:
    """Send one request and read its (payload-less) reply by ``deadline``, collecting passed descriptors."""
    try:
        _until(sock, deadline)
        sock.sendall(b"".join(bytes(b) for b in encode(msg, rid)))
    except OSError as exc:
        # A server that refuses the connection (at --max-connections) answers, then closes at
        # once: the send may fail before its answer is read. That answer says why.
        raise _refusal(sock, reader) or _attach_error(exc) from None
    while True:
        try:
            _until(sock, deadline)
            data, got, flags, _ = socket.recv_fds(sock, 65536, _MAX_FDS)
        except OSError as exc:
            raise _attach_error(exc) from None
        fds.extend(got)
        if flags & socket.MSG_CTRUNC:
            raise ProtocolError("shm attach: ancillary data truncated")
        if not data:
            raise TransportError("shm attach: the server closed the connection")
        reader.feed(data)
        event = reader.next_event()
        if isinstance(event, Frame):
            if isinstance(event.msg, ErrorReply) and event.request_id in (0, rid) and not event.payload_len:
                raise from_code(event.msg.code, event.msg.message)  # (id 0: refused as it connected)
            if event.payload_len or event.request_id != rid:
                raise ProtocolError("shm attach: unexpected reply")
            assert isinstance(event.msg, Reply)
            return event.msg.fields


def _refusal(sock: socket.socket, reader: FrameReader) -> KVStoreError | None:
    """The error frame a closing server left in the socket (request id 0), if there is one."""
    try:
        sock.settimeout(0.2)  # (it is there already, or nowhere)
        data = sock.recv(65536)
        reader.feed(data)
        event = reader.next_event()
    except (OSError, ProtocolError):
        return None
    if isinstance(event, Frame) and event.request_id == 0 and isinstance(event.msg, ErrorReply):
        return from_code(event.msg.code, event.msg.message)
    return None


_TIMED_OUT = "shm attach: no complete answer within the connect timeout"


def _until(sock: socket.socket, deadline: float | None) -> None:
    """The socket's timeout: what is left until ``deadline`` (a trickling reply does not extend it;
    None: no limit, as ``connect_timeout=None`` asks)."""
    if deadline is None:
        sock.settimeout(None)
        return
    left = deadline - time.monotonic()
    if left <= 0:
        raise TransportError(_TIMED_OUT)
    sock.settimeout(left)


def _attach_error(exc: OSError) -> TransportError:
    return TransportError(_TIMED_OUT if isinstance(exc, TimeoutError) else f"shm attach: {exc.strerror or exc}")


def _map(fd: int, fields: dict[str, Any]) -> ShmSegment:
    size, page_size, instance = fields.get("size"), fields.get("page_size"), fields.get("instance")
    if type(size) is not int or type(page_size) is not int or not isinstance(instance, str) or size <= 0:
        raise ProtocolError("malformed SHM_ATTACH reply")
    if os.fstat(fd).st_size < size:
        raise ProtocolError("the shared arena is smaller than announced")
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)  # no first-touch faults later
    region = mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    if hasattr(mmap, "MADV_DONTFORK"):  # a forked child (a worker pool) would keep the arena for its whole life
        region.madvise(mmap.MADV_DONTFORK)
    return ShmSegment(region, page_size, instance)


# --------------------------------------------------------------------------- copies

def _address(view: memoryview) -> int | None:
    """Address of a non-empty contiguous byte view, or None where Python has no safe way to it.

    ``view`` itself keeps the memory exported (and so in place) while the address is used.
    """
    if not view.readonly:
        return ctypes.addressof(ctypes.c_char.from_buffer(view))
    obj = view.obj
    if type(obj) is bytes and view.nbytes == len(obj):  # the common read-only source: a whole bytes object
        return ctypes.cast(ctypes.c_char_p(obj), ctypes.c_void_p).value
    return None


def _move(dst: memoryview, src: memoryview) -> None:
    """``dst[:] = src`` as a plain memmove without the GIL where both addresses are known."""
    if not len(dst):
        return
    d, s = _address(dst), _address(src)
    if d is None or s is None:
        dst[:] = src  # e.g. a read-only numpy source: correct, only not parallel
    else:
        ctypes.memmove(d, s, len(dst))


def copy_runs(dst: Sequence[memoryview], src: Sequence[memoryview], hash_dst: bool | None) -> int:
    """Copy the bytes of ``src`` views into ``dst`` views (equal totals); returns xxh3-64 or 0.

    ``hash_dst``: True hashes what was written (a get: verify what the caller
    got), False hashes the source (a put), None hashes nothing. Hashing goes
    chunk by chunk right after each chunk's copy, from cache.
    """
    h = None if hash_dst is None else xxhash.xxh3_64()
    di = si = doff = soff = 0
    while di < len(dst) and si < len(src):
        d, s = dst[di], src[si]
        n = min(len(d) - doff, len(s) - soff, CHUNK if h is not None else 1 << 62)
        if n:
            _move(d[doff:doff + n], s[soff:soff + n])
            if h is not None:
                h.update(d[doff:doff + n] if hash_dst else s[soff:soff + n])
        doff += n
        soff += n
        if doff == len(d):
            di, doff = di + 1, 0
        if soff == len(s):
            si, soff = si + 1, 0
    return 0 if h is None else h.intdigest()


# --------------------------------------------------------------------------- operations


class _InlineSink:
    """Receives the blocks an SHM_GET reply carries inline (tier blocks not in the arena)."""

    def __init__(self, fields: dict[str, Any], keys: Sequence[bytes], buffers: Sequence[memoryview] | None,
                 outcome: GetOutcome) -> None:
        n = len(outcome.out)
        self.keys = keys
        sizes, locs = replies.block_sizes(fields.get("sizes"), n, "SHM_GET"), fields.get("locs")
        if not isinstance(locs, list) or len(locs) != n:
            raise ProtocolError("malformed SHM_GET reply")
        self.index = [i for i, s in enumerate(sizes) if s >= 0 and locs[i] is None]
        self.sizes = [sizes[i] for i in self.index]
        self.buffers = buffers
        self.outcome = outcome

    def target(self, j: int) -> list[memoryview] | None:
        i, size = self.index[j], self.sizes[j]
        if self.buffers is None:
            buf = bytearray(size)
            self.outcome.out[i] = buf
            return [memoryview(buf)]
        if len(self.buffers[i]) != size:
            self.outcome.errors[i] = replies.size_error(self.keys[i], size, len(self.buffers[i]))
            return None
        self.outcome.out[i] = self.buffers[i]
        return [self.buffers[i]]


@dataclass
class GetOutcome:
    """Per key of one server's share of a get: the block (or None), the checksum the
    caller still has to verify (0: nothing left to check), and errors by index."""

    out: list[memoryview | bytearray | None]
    checksums: list[int]
    errors: dict[int, KVStoreError] = field(default_factory=dict)


class CopyExpired(RequestTimeout):
    """A copy out of the arena outlasted its read pins (``--lease-seconds``) and was discarded, or a
    copy into it outlasted its put's slots (``--max-lease-seconds``): the server answered, so it is
    not quarantined, and a halved get still asks for its other half."""


class ShmGone(TransportError):
    """The server no longer shares its arena (restarted with ``--no-shm``) and nothing of the call is
    pending on it: the caller sends the call over the socket instead."""


class ShmChannel:
    """A server's arena as this client uses it: the mapping plus its get and put."""

    #: A put of fewer bytes goes inline over the socket even with the arena mapped: its one round
    #: trip beats SHM_PUT + SHM_COMMIT there (alternating puts over one Unix socket on a 2-core VM,
    #: medians: 64 KiB x 1 262 us inline vs 473 shm, 1 MiB x 1 443 vs 580, 2 MiB x 1 627 vs 615,
    #: 512 KiB x 4 1044 vs 885, 1 MiB x 32 11.4 ms vs 5.6). Gets take the arena at every size.
    inline_put_bytes = 2 << 20

    def __init__(self, node: Node, segment: ShmSegment) -> None:
        self.node = node
        self.segment = segment

    @property
    def client(self) -> AsyncKVClient:
        return self.node.client

    async def _request(self, conn: ClientConnection, msg: Message, make_sink: Any = None,
                       refused: Callable[[], None] | None = None) -> Response:
        def give_back(fields: dict[str, Any]) -> None:  # a reply whose caller was cancelled as it came
            handle = fields.get("handle")
            if type(handle) is int and handle:  # an SHM_GET's pins, an SHM_PUT's reserved slots
                conn.post(ShmRelease(handle=handle), timeout=self.client.timeout)

        try:
            return await conn.request(msg, make_sink=make_sink, timeout=self.client.timeout, orphan=give_back,
                                      refused=refused)
        except RequestTimeout:
            raise RequestTimeout(f"{self.node.addr} did not answer within {self.client.timeout}s") from None

    async def _current_conn(self) -> tuple[ClientConnection, ShmChannel]:
        """A pooled connection to the server whose arena is mapped, with the node's channel. Pooled
        connections to an older instance (a draining server's, kept beside its restarted
        successor's) are dropped on the way, at no cost to the op's retries: its locations would
        point into another arena. (Inside the op's try: a server restarting may refuse the
        connect, as on the socket path.)"""
        for _ in range(self.client.pool_size + 1):  # (each one dropped leaves the pool)
            conn = await self.node.connection()
            channel = self.node.shm
            if channel is None:  # restarted, and the new server refused to share: never touch the old mapping
                raise ShmGone(f"{self.node.addr} restarted without shared memory")
            info = conn.hello.get("shm")
            if isinstance(info, dict) and info.get("instance") == channel.segment.instance:
                return conn, channel
            conn.abort(TransportError("connection to another server instance than the mapped arena"))
        raise NotSent(f"{self.node.addr}: no connection to the server whose arena is mapped")

    async def _with_conn(self, op: Callable[[ShmChannel, ClientConnection], Awaitable[T]], retry: bool = True,
                         unsent: Callable[[], None] | None = None) -> T:
        """Run ``op`` on one pooled connection (handles are per connection); retry on transport
        errors unless told not to (an op that must not run twice) -- but always when its first
        request never left (:class:`NotSent`; a later request of an op raises none, see ``_release``).
        ``unsent``: as for ``Node.call``, when the op ends before its first request could have
        left (not for ``ShmGone``: the socket path then sends it).

        A new connection may find a restarted server: the node then holds a
        channel on the new arena (used from the next attempt on), or none
        (``ShmGone``: the caller goes over the socket).
        """
        c = self.client
        retries = c.retries
        sent = False  # whether the server may have the op's first request
        try:
            self.node.check_up()
            for attempt in range(1 + retries):
                try:
                    conn, channel = await self._current_conn()
                    sent = True  # (an op sends its first request before it first waits)
                    result = await op(channel, conn)
                    self.node.failures = 0
                    return result
                except CopyExpired:
                    raise  # (the server answered: the copy was slow, not the server)
                except RequestTimeout as exc:
                    raise self.node.failed(exc)  # like every other call: a timeout is not retried
                except (ShmGone, NotHome):
                    raise  # (the socket path takes over; a client used where it is not at home)
                except TransportError as exc:
                    sent = sent and not isinstance(exc, NotSent)
                    # A put is retried whole: a TransportError means its connection is gone (conn.request
                    # raises one only then), and the server aborts a closed connection's reservations
                    # (server/shm.py, end_session), so no slot of the failed attempt stays reserved; a
                    # commit that ran before its answer was lost has stored the blocks, which the retry
                    # then finds "existed" -- as a socket PUT retried after a lost reply does.
                    if attempt == retries or c.closed or not (retry or isinstance(exc, NotSent)):
                        if c.closed:
                            raise
                        raise self.node.failed(exc)
                    await asyncio.sleep(c.backoff * 2**attempt)
            raise AssertionError("unreachable")
        except BaseException as exc:
            if not sent and unsent is not None and not isinstance(exc, ShmGone):
                unsent()
            raise

    # -- get
    async def get(self, keys: list[bytes], buffers: list[memoryview] | None, unpin: bool, verify: bool,
                  unsent: Callable[[], None] | None = None) -> GetOutcome:
        """Blocks of ``keys`` (one server's share): copied out of the arena, verified, pins released."""
        return await self._with_conn(lambda ch, conn: ch._get(conn, keys, buffers, unpin, verify, unsent),
                                     retry=not unpin, unsent=unsent)

    async def _get(self, conn: ClientConnection, keys: list[bytes], buffers: list[memoryview] | None,
                   unpin: bool, verify: bool, refused: Callable[[], None] | None = None) -> GetOutcome:
        outcome = GetOutcome([None] * len(keys), [0] * len(keys))
        resp = await self._request(conn, ShmGet(keys=keys, unpin=unpin),
                                   make_sink=lambda f: _InlineSink(f, keys, buffers, outcome), refused=refused)
        fields = resp.fields
        sizes, sums, locs, handle = (fields.get(k) for k in ("sizes", "checksums", "locs", "handle"))
        try:
            sizes = replies.block_sizes(sizes, len(keys), "SHM_GET")
            sums = replies.checksums(sums, len(keys), "SHM_GET")
            if not isinstance(locs, list) or len(locs) != len(keys) or type(handle) is not int:
                raise ProtocolError("malformed SHM_GET reply")
        except ProtocolError:
            if type(handle) is int and handle:
                await self._release(conn, handle)
            raise
        try:
            all_verified = self._copy_out(keys, sizes, sums, locs, buffers, verify, outcome)
        except BaseException:
            if handle:
                conn.post(ShmRelease(handle=handle), timeout=self.client.timeout)
            raise
        if not handle:
            return outcome
        if all_verified and not outcome.errors:
            # Every block copied matched the checksum it was stored with, so what
            # the caller got *is* each block, whether or not the pins lasted: the
            # release needs no answer, and the get saves a round trip.
            conn.post(ShmRelease(handle=handle), timeout=self.client.timeout)
            return outcome
        if not await self._release(conn, handle):
            raise CopyExpired(f"{self.node.addr}: shared-memory read pins expired before the copy finished "
                              "(--lease-seconds); the copy was discarded")
        return outcome

    def _copy_out(self, keys: list[bytes], sizes: list[Any], sums: list[Any], locs: list[Any],
                  buffers: list[memoryview] | None, verify: bool, outcome: GetOutcome) -> bool:
        """Copy every located block out of the arena (in parallel), checking each copy's checksum.

        Returns whether every block copied was checked (none was stored without a checksum).
        """
        jobs: list[Callable[[], int]] = []
        targets: list[tuple[int, memoryview | bytearray, int]] = []
        for i, loc in enumerate(locs):
            if loc is None:  # missing, or sent inline: the caller checks an inline block
                outcome.checksums[i] = sums[i] if outcome.out[i] is not None else 0
                continue
            src = self.segment.views(loc)
            size, expected = sizes[i], sums[i]
            if sum(len(v) for v in src) != size:  # (sizes and checksums are checked ints by now)
                raise ProtocolError("malformed SHM_GET reply: sizes and locations disagree")
            dst = self._destination(i, keys[i], size, buffers, outcome)
            if dst is not None:
                jobs.append(partial(copy_runs, [memoryview(dst)], src, True if verify and expected else None))
                targets.append((i, dst, expected))
        got = run_parallel(jobs, sum(len(t[1]) for t in targets))
        for (i, dst, expected), checksum in zip(targets, got):
            if verify and expected and checksum != expected:
                outcome.errors[i] = IntegrityError(f"block with key {keys[i].hex()} failed its checksum")
            else:
                outcome.out[i] = dst
        return verify and all(expected for _, _, expected in targets)

    def _destination(self, i: int, key: bytes, size: int, buffers: list[memoryview] | None,
                     outcome: GetOutcome) -> memoryview | bytearray | None:
        if buffers is None:  # touched memory when the client has a recycled buffer of this size
            recycler = getattr(self.client, "_recycler", None)
            return recycler.take(size) if recycler is not None else bytearray(size)
        if len(buffers[i]) != size:
            outcome.errors[i] = replies.size_error(key, size, len(buffers[i]))
            return None
        return buffers[i]

    async def _release(self, conn: ClientConnection, handle: int) -> bool:
        try:
            resp = await self._request(conn, ShmRelease(handle=handle))
        except NotSent as exc:  # (the op's first request did go out: running it again is not safe)
            raise TransportError(str(exc)) from None
        return resp.fields.get("held") is True

    # -- put
    async def put(self, keys: list[bytes], views: list[memoryview],
                  parent: bytes | None = None) -> list[tuple[int, str | None]]:
        """Reserve, copy in (checksumming the source on the way), commit: ``(status, message)`` per key."""
        return await self._with_conn(lambda ch, conn: ch._put(conn, keys, views, parent))

    async def _put(self, conn: ClientConnection, keys: list[bytes], views: list[memoryview],
                   parent: bytes | None) -> list[tuple[int, str | None]]:
        resp = await self._request(conn, ShmPut(keys=keys, sizes=[len(v) for v in views], parent=parent))
        fields = resp.fields
        handle, locs = fields.get("handle"), fields.get("locs")
        if type(handle) is not int or not isinstance(locs, list) or len(locs) != len(keys):
            raise ProtocolError("malformed SHM_PUT reply")
        if handle:
            try:
                sums = self._copy_in(locs, views)
            except BaseException:
                await self._release(conn, handle)  # abort the reservations rather than publish them
                raise
            try:
                fields = (await self._request(conn, ShmCommit(handle=handle, checksums=sums))).fields
            except NotFound:  # (this client commits a handle once: the server gave its slots back)
                raise CopyExpired(f"{self.node.addr}: a shared-memory put of {len(keys)} block(s) was not committed "
                                  "within the server's --max-lease-seconds; its slots were given back and none of "
                                  "them was stored") from None
        return replies.statuses(fields, len(keys), "SHM_PUT/SHM_COMMIT")

    def _copy_in(self, locs: list[Any], views: list[memoryview]) -> list[int]:
        """Copy each block into its reserved slot (in parallel); their checksums, 0 where not reserved."""
        jobs: list[Callable[[], int]] = []
        index: list[int] = []
        for i, loc in enumerate(locs):
            if loc is not None:
                dst = self.segment.views(loc)
                if sum(len(d) for d in dst) != len(views[i]):
                    raise ProtocolError("SHM_PUT reply: a slot does not match its block's size")
                jobs.append(partial(copy_runs, dst, [views[i]], False))
                index.append(i)
        sums = [0] * len(locs)
        for i, checksum in zip(index, run_parallel(jobs, sum(len(views[i]) for i in index))):
            sums[i] = checksum
        return sums


#: After an attach that failed or timed out, new connections use the socket for this long before one
#: tries again (each try may hold its connection's opening for up to ``connect_timeout``).
ATTACH_RETRY_S = 30.0


async def open_channel(node: Node, conn: ClientConnection) -> ShmChannel | None:
    """The node's shm channel after opening ``conn``: kept, (re-)attached, or None (socket path).

    Attaches when the server offers shm in its HELLO reply and either the
    client reached it over the Unix socket (``shm=None``, the default) or asked
    for shm explicitly (``shm=True``: a TCP client then tries the socket path
    the server announced -- it works only on the server's host, and the arena
    instance must match the one this connection talks to). One attempt per
    server instance: a refusal is not retried on every new connection -- except a server at its
    connection limit (``Unavailable``), asked again by the next new connection, and one
    that failed or did not answer in time (``TransportError``: loaded, say), asked again by the
    first new connection :data:`ATTACH_RETRY_S` later.
    """
    info = conn.hello.get("shm")
    if not isinstance(info, dict):
        info = {}
    want = node.client.shm
    instance = info.get("instance")
    if node.shm is not None:
        if node.shm.segment.instance == instance:
            return node.shm
        # The server was replaced (with shm or not): new operations leave its arena. Not unmapped
        # here: a read still waiting on an old connection (a server draining) copies out of it
        # when its answer comes; the mapping goes with the last operation holding the channel.
        node.shm = None
    if want is False or not isinstance(instance, str):
        return None
    path = node.unix or (info.get("path") if want else None)
    if not isinstance(path, str) or (node.shm_tried == instance and time.monotonic() < node.shm_retry_at):
        return None
    node.shm_tried, node.shm_retry_at = instance, float("inf")
    c = node.client
    try:
        segment = await asyncio.to_thread(attach, path, namespace=c.namespace, token=c.token,
                                          timeout=c.connect_timeout)
    except Unavailable as exc:  # at its connection limit (or draining): the next new connection asks again
        node.shm_tried = None
        log.info("shared memory not used with %s for now (%s); using the socket", node.addr, exc)
        return None
    except TransportError as exc:  # failed or timed out (loaded?): asked again, but not by every new connection
        node.shm_retry_at = time.monotonic() + ATTACH_RETRY_S  # (each would wait up to connect_timeout)
        log.info("shared memory not used with %s for now (%s); using the socket, and trying again in %g s "
                 "at the earliest", node.addr, exc, ATTACH_RETRY_S)
        return None
    except (KVStoreError, OSError) as exc:
        log.info("shared memory not used with %s (%s); using the socket", node.addr, exc)
        return None
    if segment.instance != instance:  # e.g. the same path on another host: another server
        segment.close()
        log.info("shared memory at unix:%s belongs to another server than %s; using the socket", path, node.addr)
        return None
    return ShmChannel(node, segment)


# --------------------------------------------------------------------------- measuring (for kvstore-bench)


async def measure_throughput(addr: str, *, block_size: int = 4 << 20, batch: int = 32, rounds: int = 8,
                             shm: bool | None = None, verify: bool = True, namespace: str = "bench",
                             token: str | None = None) -> dict[str, float]:
    """GB/s of put and get_into of ``batch`` blocks of ``block_size`` bytes through one client.

    ``addr`` may be ``host:port`` or ``unix:PATH``; ``shm`` as for
    :class:`AsyncKVClient` (``False`` measures the Unix socket without shm).
    Every round puts fresh keys and reads them back; the best round counts
    (a shared machine's noise only ever slows a round down). The keys are
    deleted afterwards. Returns ``{"put_gbps", "get_gbps", "shm"}``.
    """
    from .aio import AsyncKVClient

    payloads = [bytes([i % 251]) * block_size for i in range(batch)]
    bufs = [bytearray(block_size) for _ in range(batch)]
    best_put = best_get = float("inf")
    async with AsyncKVClient(addr, namespace=namespace, token=token, shm=shm, verify=verify, pool_size=1) as kv:
        used_shm = kv.nodes[0].shm is not None
        for r in range(rounds):
            keys = [os.urandom(16) for _ in range(batch)]
            t0 = time.perf_counter()
            await kv.put(keys, payloads)
            t1 = time.perf_counter()
            await kv.get_into(keys, bufs)
            t2 = time.perf_counter()
            best_put, best_get = min(best_put, t1 - t0), min(best_get, t2 - t1)
            await kv.delete(keys)
    total = block_size * batch
    return {"put_gbps": total / best_put / 1e9, "get_gbps": total / best_get / 1e9, "shm": float(used_shm)}


__all__ = ["CHUNK", "GetOutcome", "ShmChannel", "ShmGone", "ShmSegment", "attach", "copy_runs", "measure_throughput",
           "open_channel"]
