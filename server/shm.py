"""Same-host transport: the Unix socket listener and the shared-memory block path.

Why: TCP loopback tops out at a few GB/s because every payload byte crosses
the kernel twice. A client on the same host can instead map the server's block
arena itself -- then a get is one ``memcpy`` out of the arena into the
caller's buffer and a put one ``memcpy`` into a slot the server reserved,
while only small control frames cross the socket. ``docs/shm.md`` is the
design note; this module is the server half.

How the arena is shared (the safe way): the arena is a sealed memfd
(:class:`kvstore.arena.Arena` with ``shared=True``), never a file in
``/dev/shm`` that other users could open. Its descriptor is passed with
``SCM_RIGHTS`` over the Unix socket, only in answer to SHM_ATTACH on a
connection whose HELLO passed the token check, so only an authenticated
same-host client ever holds it. asyncio/uvloop transports cannot send
ancillary data, so the reply to SHM_ATTACH is written with ``sendmsg`` on a
``dup`` of the transport's descriptor (the transport's own buffer being empty,
the bytes cannot overtake anything).

Safety of the copies:

* SHM_GET pins every block it locates (``BlockStore.acquire``) under a handle;
  the pins hold until SHM_RELEASE, until the connection closes, or until the
  lease time (``--lease-seconds``) passes -- and SHM_RELEASE answers
  ``held: false`` in that last case, so the client knows its copy may be torn
  and throws it away. Eviction never reuses a pinned slot.
* SHM_PUT reserves slots (invisible to every read); SHM_COMMIT publishes them.
  A connection that closes first -- a client killed mid-put -- has its
  reservations aborted, so no half-written block ever becomes visible.
  Reservations do not time out: freeing a slot a live client may still be
  writing would let it scribble over the slot's next owner.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import stat
import struct
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Awaitable, Sequence

import xxhash

from kvstore.arena import Extent, byte_runs
from kvstore.errors import CapacityError, InvalidRequest, NotFound, TooLarge, Unauthorized, Unavailable
from kvstore.protocol import Put, ShmAttach, ShmCommit, ShmGet, ShmPut, ShmRelease, reply
from kvstore.store import BlockRef, Reservation

from .auth import is_loopback
from .service import Fields, GetResult, PutSink, over_reply_limit

if TYPE_CHECKING:
    import asyncio

    from .service import Service, Session

log = logging.getLogger(__name__)

#: Mode of the Unix socket file: owner and group may connect, nobody else.
SOCKET_MODE = 0o660

#: Block pins SHM_GET handles may hold at once, per page of the arena, and at least. Each costs
#: ~150 bytes until released, so without a bound a client that never releases (or lets its
#: handles run to --lease-seconds) grows the server's memory with its request rate.
PINS_PER_PAGE = 8
MIN_PINS = 1 << 16

Loc = list[list[int]]  # [[offset, length], ...] in the shared arena, in order

#: Arena runs one SHM_GET or SHM_PUT reply may locate. A run takes at most 15 bytes of msgpack,
#: so 200,000 of them stay inside the 4 MiB a client reads of a reply's meta, beside the sizes,
#: checksums, statuses and error texts of 16,384 keys. Blocks scattered over many runs (an old
#: arena of small pages; a 2 GiB block in 4 KiB pages may lie in 524,288) would otherwise make a
#: reply the client refuses (a ProtocolError that costs it the connection). Over this a request
#: is refused as TooLarge: the client asks for (or puts) each half, a single block over the socket.
MAX_REPLY_RUNS = 200_000


def _check_runs(located: Sequence[BlockRef | Reservation | None]) -> None:
    """Raise TooLarge when a reply would locate more than MAX_REPLY_RUNS runs (None: not located)."""
    runs = sum(len(r.extent) for r in located if r is not None)
    if runs > MAX_REPLY_RUNS:
        raise TooLarge(f"the {len(located)} block(s) lie in {runs} separate runs of the arena, more than one "
                       f"reply may locate ({MAX_REPLY_RUNS}): ask for fewer at once, or one over the socket")


def extent_locs(extent: Extent, size: int, page_size: int) -> Loc:
    """Where the first ``size`` bytes of ``extent`` lie in the arena, one pair per run (msgpack-ready)."""
    return [[offset, length] for offset, length in byte_runs(extent, size, page_size)]


# --------------------------------------------------------------------------- per-connection state


@dataclass
class _GetGrant:
    """Pins taken by one SHM_GET, held while the client copies."""

    refs: list[BlockRef]
    deadline: float


@dataclass
class _PutGrant:
    """Slots reserved by one SHM_PUT, waiting for SHM_COMMIT (until ``deadline``)."""

    sink: PutSink
    deadline: float


@dataclass(eq=False)
class ShmSession:
    """One connection's open handles; everything is undone when the connection closes."""

    grants: dict[int, _GetGrant | _PutGrant] = field(default_factory=dict)
    next_handle: int = 1
    closed: bool = False
    attached: bool = False  # the arena's descriptor went out on this connection

    def add(self, grant: _GetGrant | _PutGrant) -> int:
        handle = self.next_handle
        while handle in self.grants:  # (wrapped around to a handle still open)
            handle = handle % 0xFFFFFFFF + 1
        self.next_handle = handle % 0xFFFFFFFF + 1  # 1..2**32-1, never 0
        self.grants[handle] = grant
        return handle


@dataclass
class ShmGetResult(GetResult):
    """SHM_GET's reply: arena locations for pinned blocks, inline payload for the rest.

    ``blocks`` holds only the inline blocks (fetched from the tier and not
    promoted into the arena); the pins are held by the grant, not released
    when the reply is written (``refs`` stays empty).
    """

    locs: list[Loc | None] = field(default_factory=list)
    handle: int = 0

    @property
    def fields(self) -> Fields:
        return {"sizes": self.sizes, "checksums": self.checksums, "locs": self.locs, "handle": self.handle}

    @property
    def payload_len(self) -> int | None:
        return None  # it sizes blocks it does not send


# --------------------------------------------------------------------------- the service


class ShmService:
    """The SHM_* ops over the server's store; a no-op shell when shm is not offered."""

    def __init__(self, service: Service) -> None:
        self.service = service
        self.store = service.store
        self.config = service.config
        self.tier = service.tier
        self.fd = self.store.arena.fd
        # Announced in HELLO, to clients that may run in another directory: absolute (it is bound
        # relative to the server's working directory, which does not change while it runs).
        self.path = os.path.abspath(self.config.unix) if self.config.unix else None
        self.offered = bool(self.path) and self.config.shm and self.fd is not None
        # Tells a client whether the segment it mapped belongs to the server it talks to
        # (a restarted server has a new arena; a path on another host is another server).
        self.instance = os.urandom(8).hex()
        self.sessions: set[ShmSession] = set()
        self.pins = 0  # block pins SHM_GETs hold (granted, or waiting for the tier)
        self.max_pins = max(MIN_PINS, PINS_PER_PAGE * self.store.arena.num_pages)
        # Keys of SHM_PUTs waiting for their commit, bounded alike: each holds its status and error, a
        # pin for a key that existed, a reservation, until the commit (or --max-lease-seconds).
        self.put_keys = 0
        self.counters = {"attached": 0, "refused": 0, "gets": 0, "puts": 0, "commits": 0, "expired": 0,
                         "aborted_on_close": 0, "put_expired": 0, "inline_blocks": 0}

    # -- helpers
    def _session(self, session: Session) -> ShmSession:
        """The connection's shm state, after checking it may use shm at all.

        Only a same-host peer (Unix socket or loopback) whose token may map the
        whole arena: anyone else could, say, commit a reserved slot it never
        wrote and read back the stale bytes of another namespace's freed block.
        """
        if not self.offered:
            raise InvalidRequest("this server does not offer shared memory (" + (
                "its arena could not be shared at start: see the server's log" if self.path and self.config.shm
                else "it needs --unix PATH and no --no-shm") + ")")
        if not _same_host(session):
            raise InvalidRequest("shared memory is only for clients on the server's host")
        if not self._may_map(session):
            self.counters["refused"] += 1
            raise Unauthorized("the shared arena holds every namespace: using it needs a token valid for all ('*')")
        st: ShmSession | None = session.shm
        if st is None:
            st = session.shm = ShmSession()
            self.sessions.add(st)
        return st

    def hello_fields(self, session: Session) -> Fields:
        """What HELLO's reply says about shm: where to attach and which arena it is -- not told to a
        TCP peer that is not loopback (a same-host client that came in by the host's own network
        address would attach, then have every shm request refused: it uses the socket)."""
        if not self.offered or not self._may_map(session) or not _same_host(session):
            return {}
        return {"shm": {"path": self.path, "instance": self.instance, "size": self.store.arena.capacity}}

    @staticmethod
    def _may_map(session: Session) -> bool:
        """The mapping shows every namespace's blocks, so only a token valid for all may have it
        (no grant on an authenticated session: the server has no token file)."""
        return session.authenticated and (session.grant is None or "*" in session.grant.patterns)

    # -- SHM_ATTACH
    def attach(self, session: Session, transport: asyncio.Transport, request_id: int) -> None:
        """Answer SHM_ATTACH with the arena's memfd as SCM_RIGHTS ancillary data.

        Raises:
            InvalidRequest: shm not offered, not on the Unix socket, or no HELLO yet.
            Unauthorized: the connection's token is limited to some namespaces.
            Unavailable: the reply could not be sent with the fd now (retry).
        """
        if self.offered and not session.unix:
            raise InvalidRequest("SHM_ATTACH is answered only on the Unix socket (--unix)")
        if not session.greeted:  # (on a server without tokens, too: the arena goes to a client that said who it is)
            raise InvalidRequest("SHM_ATTACH needs a successful HELLO on this connection first")
        st = self._session(session)
        if st.attached:
            # Until a peer reads it, each reply's descriptor counts against the server user's
            # open-file limit: a peer asking again and again without reading would have the
            # kernel refuse every other client's attach.
            raise InvalidRequest("SHM_ATTACH is answered once per connection (its reply carries the arena)")
        assert self.fd is not None
        arena = self.store.arena
        frame = b"".join(reply(ShmAttach.OP, request_id, size=arena.capacity, page_size=arena.page_size,
                               instance=self.instance))
        if not send_with_fd(transport, frame, self.fd):
            log.debug("%s hung up before its SHM_ATTACH reply", session.peer)
            transport.abort()
            return
        self.service.counters.bytes_out += len(frame)  # (written past the connection, which counts the rest)
        st.attached = True
        self.counters["attached"] += 1
        log.info("shared arena mapped by %s", session.peer, extra={"event": "shm_attach", "peer": session.peer})

    # -- SHM_GET
    def get(self, session: Session, msg: ShmGet) -> ShmGetResult | Awaitable[ShmGetResult]:
        """Pin and locate the present blocks; a tier's blocks are promoted first (or sent inline)."""
        st = self._session(session)
        ns = session.namespace
        budget = len(msg.keys)  # every key may end up pinned (a tier's block once promoted)
        if self.pins + budget > self.max_pins:
            raise CapacityError(f"shared-memory reads hold {self.pins} block pins; {budget} more would be "
                                f"over the {self.max_pins} this server allows (read over the socket)")
        refs = self.store.acquire_many(ns, msg.keys)
        self.pins += budget  # (counted before the tier is asked: requests read meanwhile see it)
        self.counters["gets"] += 1
        missing = [i for i, r in enumerate(refs) if r is None]
        if self.tier is None or not missing:
            try:
                _check_runs(refs)
            except TooLarge:  # (before any lease is dropped: the client asks again in halves)
                self._release_refs(self._settle(budget, refs))
                raise
            if msg.unpin:
                self.store.unpin(ns, msg.keys)
            return self._grant(st, refs, {}, budget)
        # The leases to drop: of the blocks found now, if still stored when the tier has answered
        # (a key missing now, or deleted meanwhile, may hold another client's block and lease then).
        unpin = [r for r in refs if r is not None] if msg.unpin else []
        return self._get_tier(st, ns, msg.keys, refs, missing, unpin, budget)

    async def _get_tier(self, st: ShmSession, ns: str, keys: list[bytes], refs: list[BlockRef | None],
                        missing: list[int], unpin: list[BlockRef], budget: int) -> ShmGetResult:
        """Read memory's misses through the tier; promote each into the arena when it can
        (not when a delete ran meanwhile: see :meth:`Service.may_promote`); then drop the
        leases ``unpin`` -- once the reply is known to fit, as on the socket path.

        Raises:
            TooLarge: the blocks to send inline add up to more than a reply may carry (pins
                released, leases kept: the client asks again in parts).
        """
        assert self.tier is not None
        token = self.service.read_token()
        inline: dict[int, tuple[memoryview, int]] = {}
        try:
            try:
                fetched = await self.tier.fetch(ns, [keys[i] for i in missing])
            except Unavailable:
                fetched = [None] * len(missing)
            promote = self.service.may_promote(token)
            for i, item in zip(missing, fetched):
                if item is None:
                    continue
                data, checksum = memoryview(item[0]).cast("B"), item[1]
                if promote:
                    refs[i] = self._promote(ns, keys[i], data, checksum, keys[i - 1] if i else None)
                if refs[i] is None:
                    inline[i] = (data, checksum)  # the client still gets it (and checks it) over the socket
            inline_bytes = sum(len(data) for data, _ in inline.values())
            if inline_bytes > self.service.max_reply:
                raise TooLarge(over_reply_limit(inline_bytes, len(inline), self.service.max_reply))
            _check_runs(refs)
        except BaseException:  # (TooLarge, or cancelled: the pins go with it)
            held = self._settle(budget, refs)
            self._release_refs(held)
            raise
        if unpin:
            self.store.unpin_refs(unpin)
        return self._grant(st, refs, inline, budget)

    def _promote(self, ns: str, key: bytes, data: memoryview, checksum: int, parent: bytes | None) -> BlockRef | None:
        """Copy a tier block into the arena and pin it; None when it fails its checksum or finds no room.

        A corrupted block is never cached: it goes inline, so the client reports it.
        """
        if checksum and xxhash.xxh3_64_intdigest(data) != checksum:
            return None
        try:
            self.store.put(ns, key, data, checksum, parent=parent, counted=False)
        except (CapacityError, TooLarge):
            return None
        return self.store.acquire(ns, key)

    def _settle(self, budget: int, refs: list[BlockRef | None]) -> list[BlockRef]:
        """The request's pins, counted one by one in ``pins`` from now on instead of its budget."""
        held = [r for r in refs if r is not None]
        self.pins -= budget - len(held)
        return held

    def _grant(self, st: ShmSession, refs: list[BlockRef | None],
               inline: dict[int, tuple[memoryview, int]], budget: int) -> ShmGetResult:
        page_size = self.store.arena.page_size
        res = ShmGetResult(blocks=[], checksums=[], refs=[])
        held = self._settle(budget, refs)
        for i, ref in enumerate(refs):
            if ref is not None:
                res.sizes.append(ref.size)
                res.checksums.append(ref.checksum)
                res.locs.append(extent_locs(ref.extent, ref.size, page_size))
                res.blocks.append(None)
            elif i in inline:
                data, checksum = inline[i]
                res.sizes.append(len(data))
                res.checksums.append(checksum)
                res.locs.append(None)
                res.blocks.append([data])
            else:
                res.sizes.append(-1)
                res.checksums.append(0)
                res.locs.append(None)
                res.blocks.append(None)
        self.counters["inline_blocks"] += len(inline)
        if held and st.closed:  # the connection went away while the tier answered
            self._release_refs(held)
        elif held:
            res.handle = st.add(_GetGrant(held, time.monotonic() + self.config.lease_seconds))
        return res

    # -- SHM_PUT / SHM_COMMIT
    def put(self, session: Session, msg: ShmPut) -> Fields | Awaitable[Fields]:
        """Reserve a slot per new key; the client writes them, then commits.

        With nothing reserved the client has nothing to commit, so this answer
        is the put's acknowledgement: like a socket PUT's, it waits for the
        tier writes other PUTs still have running for keys it found stored.
        """
        st = self._session(session)
        if self.put_keys + len(msg.keys) > self.max_pins:
            raise CapacityError(f"shared-memory puts waiting for their commit hold {self.put_keys} keys; "
                                f"{len(msg.keys)} more would be over the {self.max_pins} this server allows "
                                "(put over the socket)")
        put = Put(keys=msg.keys, sizes=msg.sizes, parent=msg.parent)
        sink = self.service.begin_put(session, put)  # (shares the service's pending tier writes)
        page_size = self.store.arena.page_size
        locs: list[Loc | None] = []
        for i, size in enumerate(msg.sizes):
            res = sink.reserve(i)  # the client writes the pages itself: no views needed
            locs.append(None if res is None else extent_locs(res.extent, size, page_size))
        self.counters["puts"] += 1
        try:
            _check_runs(sink.reservations)
        except TooLarge:
            sink.abort()
            raise
        if any(r is not None for r in sink.reservations):
            grant = _PutGrant(sink, time.monotonic() + self.config.lease_cap())
            self.put_keys += len(msg.keys)
            return {"handle": st.add(grant), "locs": locs, **sink.fields()}
        done = sink.commit()  # nothing to publish: only waits for pending tier writes of "existed" keys
        if isinstance(done, dict):
            return {"handle": 0, "locs": locs, **done}

        async def acknowledged() -> Fields:
            return {"handle": 0, "locs": locs, **await done}
        return acknowledged()

    def commit(self, session: Session, msg: ShmCommit) -> Fields | Awaitable[Fields]:
        """Publish an SHM_PUT's slots with the checksums the client computed while writing.

        Raises:
            NotFound: no open SHM_PUT has this handle (already committed or released).
            InvalidRequest: ``checksums`` is neither empty nor one per key.
        """
        st = self._session(session)
        grant = st.grants.get(msg.handle)
        if not isinstance(grant, _PutGrant):
            raise NotFound(f"no open SHM_PUT with handle {msg.handle} (committed or released already, or "
                           "not committed within --max-lease-seconds: its slots were given back)")
        del st.grants[msg.handle]
        sink = grant.sink
        self.put_keys -= len(sink.msg.keys)
        if msg.checksums and len(msg.checksums) != len(sink.msg.keys):
            sink.abort()
            raise InvalidRequest(f"{len(msg.checksums)} checksums for {len(sink.msg.keys)} keys")
        for i, res in enumerate(sink.reservations):
            if res is not None and msg.checksums:
                res.checksum = msg.checksums[i]
        self.counters["commits"] += 1
        try:
            return sink.commit()
        except BaseException:
            sink.abort()
            raise

    # -- SHM_RELEASE, expiry, close
    def release(self, session: Session, msg: ShmRelease) -> Fields:
        """Drop an SHM_GET's pins (``held``: they lasted until now) or abort an uncommitted SHM_PUT."""
        st = self._session(session)
        grant = st.grants.pop(msg.handle, None)
        if grant is None:
            return {"held": False}  # expired (or never issued): the client's copy is not to be trusted
        self._undo(grant)
        return {"held": True}

    def _undo(self, grant: _GetGrant | _PutGrant) -> None:
        if isinstance(grant, _GetGrant):
            self._release_refs(grant.refs)
        else:
            self.put_keys -= len(grant.sink.msg.keys)
            grant.sink.abort()

    def _release_refs(self, refs: list[BlockRef]) -> None:
        self.pins -= len(refs)
        for ref in refs:
            self.store.release(ref)

    def expire(self, now: float | None = None) -> int:
        """Drop read pins held past their lease (a client that hangs mid-copy), and put slots held
        past the longest lease (--max-lease-seconds: a client paused that long, or a dead one whose
        socket a forked child keeps open); returns how many handles."""
        now = time.monotonic() if now is None else now
        reads = puts = 0
        for st in self.sessions:
            for handle in [h for h, g in st.grants.items() if g.deadline <= now]:
                grant = st.grants.pop(handle)
                self._undo(grant)
                if isinstance(grant, _GetGrant):
                    reads += 1
                else:
                    puts += 1
        if reads:
            self.counters["expired"] += reads
            log.warning("dropped %d shared-memory read pin set(s) held past --lease-seconds", reads,
                        extra={"event": "shm_pins_expired"})
        if puts:
            self.counters["put_expired"] += puts
            log.warning("aborted %d shared-memory put(s) not committed within --max-lease-seconds; a client that "
                        "still writes their slots overwrites their next owners (readers' checksums catch it)", puts,
                        extra={"event": "shm_puts_expired"})
        return reads + puts

    def end_session(self, session: Session) -> None:
        """The connection closed: release its pins, abort its reservations (no half-put block survives)."""
        st: ShmSession | None = session.shm
        if st is None:
            return
        st.closed = True
        self.sessions.discard(st)
        grants, st.grants = st.grants, {}
        for grant in grants.values():
            if isinstance(grant, _PutGrant):
                self.counters["aborted_on_close"] += 1
            self._undo(grant)

    def writing(self, session: Session) -> bool:
        """A client holds reserved slots on this connection: it may be copying into them now."""
        st: ShmSession | None = session.shm
        return st is not None and any(isinstance(g, _PutGrant) for g in st.grants.values())

    def busy(self, session: Session) -> bool:
        """A client is mid-copy on this connection (a drain waits for it)."""
        st: ShmSession | None = session.shm
        return st is not None and bool(st.grants)

    def stats(self) -> dict[str, Any]:
        return {"offered": self.offered, "path": self.path if self.offered else None,
                "open_handles": sum(len(st.grants) for st in self.sessions), "pins": self.pins,
                "put_keys": self.put_keys, **self.counters}


# --------------------------------------------------------------------------- the socket side


def _same_host(session: Session) -> bool:
    """A Unix-socket client, or a TCP peer (``host:port``) on this host: a ``shm=True`` client over TCP."""
    return session.unix or is_loopback(session.peer.rpartition(":")[0])


def send_with_fd(transport: asyncio.BaseTransport, data: bytes, fd: int) -> bool:
    """Write ``data`` on the transport's socket with ``fd`` attached (SCM_RIGHTS); False when
    the peer has hung up.

    The transport itself cannot carry ancillary data, so this writes on a dup
    of its descriptor; with the transport's buffer empty nothing can be
    overtaken. What the kernel does not take at once goes through the
    transport (the fd rode on the first byte).

    Raises:
        Unavailable: unsent replies are still queued, the socket is full, or the kernel
            refuses the descriptor now (too many in flight: ``ETOOMANYREFS``).
    """
    raw = transport.get_extra_info("socket")
    write_buffer = getattr(transport, "get_write_buffer_size", lambda: 0)()
    if raw is None or write_buffer:
        raise Unavailable("connection busy: send SHM_ATTACH on a fresh connection")
    dup = socket.socket(fileno=os.dup(raw.fileno()))
    try:
        sent = socket.send_fds(dup, [data], [fd])
    except (BlockingIOError, InterruptedError):
        raise Unavailable("socket buffer full: retry SHM_ATTACH") from None
    except ConnectionError:
        return False
    except OSError as exc:
        raise Unavailable(f"the arena's descriptor cannot be passed now ({exc.strerror or exc}): retry SHM_ATTACH") from None
    finally:
        dup.close()  # closes the dup only; the transport keeps its descriptor
    if sent < len(data):
        transport.write(data[sent:])  # type: ignore[attr-defined]
    return True


def unix_peer(sock: Any) -> str:
    """``unix:pid=P,uid=U`` from SO_PEERCRED (for logs), or ``unix`` where it is not available."""
    try:
        pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                           struct.calcsize("3i")))
    except (OSError, AttributeError):
        return "unix"
    return f"unix:pid={pid},uid={uid}"


def bind_unix_listener(path: str) -> socket.socket:
    """A Unix stream socket bound at ``path``, mode 0660, not listening yet.

    The mode is set between ``bind`` and ``listen``: until ``listen`` no one can
    connect, so there is no window with looser permissions. A stale socket
    file (nobody accepts on it) is replaced; a live one is an error.

    Raises:
        OSError: the path is in use by a live server or is not a socket.
    """
    _remove_stale(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
        os.chmod(path, SOCKET_MODE)
    except OSError as exc:  # name the path: the caller's message names the TCP address
        sock.close()
        hint = " (its folder must exist and be writable)" if exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.EACCES, errno.EROFS) else ""
        raise OSError(exc.errno, f"--unix {path}: {exc.strerror or exc}{hint}") from None
    except BaseException:
        sock.close()
        raise
    sock.setblocking(False)
    return sock


def check_unix_path(path: str) -> None:
    """Fail now on a ``--unix`` path that cannot be bound, not after ``--capacity`` is pre-faulted:
    bound once and let go (a stale socket file goes now rather than later).

    Raises:
        OSError: as :func:`bind_unix_listener` does.
    """
    bind_unix_listener(path).close()
    os.unlink(path)


_PROBE_TIMEOUT = 2.0


def _remove_stale(path: str) -> None:
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):  # (the folder's fault: the bind names it)
        if os.path.islink(path):  # (the bind would say "Address already in use")
            raise OSError(errno.EEXIST, f"--unix {path}: exists, a symbolic link to nothing") from None
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise OSError(errno.EEXIST, f"--unix {path}: exists and is not a socket")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(_PROBE_TIMEOUT)  # (a listener that accepts nothing, its backlog full, blocks a connect)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        os.unlink(path)  # left behind by a server that died
        return
    except (TimeoutError, BlockingIOError):
        pass  # someone is listening and not accepting (a Unix socket's full backlog answers EAGAIN)
    finally:
        probe.close()
    raise OSError(errno.EADDRINUSE, f"--unix {path}: another server is listening there")


def remove_unix_listener(path: str, sock_inode: int | None) -> None:
    """Unlink the socket file at shutdown, unless it is no longer ours."""
    try:
        if sock_inode is None or os.stat(path).st_ino == sock_inode:
            os.unlink(path)
    except FileNotFoundError:
        pass


__all__ = ["ShmService", "ShmSession", "bind_unix_listener", "extent_locs", "remove_unix_listener",
           "send_with_fd", "unix_peer"]
