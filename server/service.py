"""What each request does, apart from how its bytes travel.

The connection (:mod:`kvstore.server.connection`) parses frames and moves
payload bytes; this module turns a parsed request into store operations and a
reply. In memory every operation completes synchronously, in the callback that
parsed the frame -- no task per request. A backing tier can make some of them
asynchronous later (a handler may then return an awaitable).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from kvstore import __version__
from kvstore.config import ServerConfig
from kvstore.errors import CapacityError, InvalidRequest, KVStoreError, ServerError, TooLarge, Unauthorized, code_of
from kvstore.protocol import EXISTED, STORED, Delete, Exists, Flush, Get, Hello, Lookup, Message, Ping, Put, Stats, Unpin, VERSION
from kvstore.store import BlockRef, BlockStore, Reservation


@dataclass
class Session:
    """Per-connection state the service needs."""

    namespace: str = "default"
    peer: str = ""
    authenticated: bool = True


@dataclass
class Counters:
    requests: dict[str, int] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)
    bytes_in: int = 0
    bytes_out: int = 0
    connections: int = 0
    connections_total: int = 0

    def count(self, op: str, failed: bool = False) -> None:
        self.requests[op] = self.requests.get(op, 0) + 1
        if failed:
            self.errors[op] = self.errors.get(op, 0) + 1


class PutSink:
    """Receives a PUT's blocks straight into store reservations, one block at a time.

    A block whose key is already stored (dedup) or that does not fit is
    dropped as it arrives; its per-key status says why.
    """

    def __init__(self, store: BlockStore, ns: str, msg: Put) -> None:
        self.store, self.ns, self.msg = store, ns, msg
        self.sizes = msg.sizes
        self.status: list[int] = [STORED] * len(msg.keys)
        self.errors: dict[int, str] = {}
        self.reservations: list[Reservation | None] = [None] * len(msg.keys)

    def target(self, i: int) -> list[memoryview] | None:
        checksum = self.msg.checksums[i] if self.msg.checksums else 0
        try:
            res = self.store.reserve(self.ns, self.msg.keys[i], self.sizes[i], checksum)
        except (CapacityError, TooLarge, InvalidRequest) as exc:
            self.status[i] = exc.code
            self.errors[i] = str(exc)
            return None
        if res is None:
            self.status[i] = EXISTED
            return None
        self.reservations[i] = res
        return res.views

    def commit(self) -> dict[str, Any]:
        keys = self.msg.keys
        for i, res in enumerate(self.reservations):
            if res is not None:
                stored = self.store.commit(res, parent=keys[i - 1] if i else None)
                self.status[i] = STORED if stored else EXISTED
        self.reservations = []
        fields: dict[str, Any] = {"status": self.status}
        if self.errors:
            fields["errors"] = {str(i): m for i, m in self.errors.items()}
        return fields

    def abort(self) -> None:
        """The connection died mid-payload: nothing of this PUT becomes visible."""
        for res in self.reservations:
            if res is not None:
                self.store.abort(res)
        self.reservations = []


@dataclass
class GetResult:
    fields: dict[str, Any]
    payload: list[memoryview]
    refs: list[BlockRef]


class Service:
    """The request logic over a :class:`BlockStore`."""

    def __init__(self, store: BlockStore, config: ServerConfig) -> None:
        self.store = store
        self.config = config
        self.counters = Counters()
        self.started = time.time()

    # -- session set-up
    def hello(self, session: Session, msg: Hello) -> dict[str, Any]:
        if msg.version != VERSION:
            raise InvalidRequest(f"protocol version {msg.version} is not supported (server speaks {VERSION})")
        session.namespace = msg.namespace
        return {"version": VERSION, "server": f"kvstore/{__version__}", "namespace": msg.namespace}

    def check_allowed(self, session: Session, msg: Message) -> None:
        if not session.authenticated and not isinstance(msg, (Hello, Ping)):
            raise Unauthorized("authenticate with HELLO first")

    # -- ops (synchronous, in memory)
    def begin_put(self, session: Session, msg: Put) -> PutSink:
        return PutSink(self.store, session.namespace, msg)

    def lookup(self, session: Session, msg: Lookup) -> dict[str, Any]:
        lease_s = msg.lease_ms / 1000 if msg.lease_ms else self.config.lease_seconds
        n = self.store.lookup(session.namespace, msg.keys, pin=bool(msg.pin), lease_s=lease_s)
        return {"n": n}

    def get(self, session: Session, msg: Get) -> GetResult:
        """Pins every block it returns; the caller releases them once written."""
        sizes: list[int] = []
        checksums: list[int] = []
        payload: list[memoryview] = []
        refs: list[BlockRef] = []
        ns = session.namespace
        for key in msg.keys:
            ref = self.store.acquire(ns, key)
            if ref is None:
                sizes.append(-1)
                checksums.append(0)
                continue
            refs.append(ref)
            sizes.append(ref.size)
            checksums.append(ref.checksum)
            payload.extend(ref.views)
        if msg.unpin:
            self.store.unpin(ns, msg.keys)
        return GetResult({"sizes": sizes, "checksums": checksums}, payload, refs)

    def release(self, refs: list[BlockRef]) -> None:
        for ref in refs:
            self.store.release(ref)

    def exists(self, session: Session, msg: Exists) -> dict[str, Any]:
        return {"present": self.store.exists(session.namespace, msg.keys)}

    def delete(self, session: Session, msg: Delete) -> dict[str, Any]:
        return {"n": self.store.delete(session.namespace, msg.keys)}

    def unpin(self, session: Session, msg: Unpin) -> dict[str, Any]:
        return {"n": self.store.unpin(session.namespace, msg.keys)}

    def flush(self, session: Session, msg: Flush) -> dict[str, Any]:
        return {"n": self.store.flush(msg.namespace or session.namespace)}

    def ping(self, session: Session, msg: Ping) -> dict[str, Any]:
        return {}

    def stats(self, session: Session, msg: Stats) -> dict[str, Any]:
        return {"stats": self.snapshot()}

    def snapshot(self) -> dict[str, Any]:
        c = self.counters
        return {
            "version": __version__,
            "uptime_s": round(time.time() - self.started, 3),
            "store": self.store.stats(),
            "namespaces": self.store.namespaces(),
            "connections": c.connections,
            "connections_total": c.connections_total,
            "requests": dict(c.requests),
            "errors": dict(c.errors),
            "bytes_in": c.bytes_in,
            "bytes_out": c.bytes_out,
        }


def error_fields(exc: BaseException) -> tuple[int, str]:
    """(wire code, message) for an exception raised while serving a request."""
    if isinstance(exc, (KVStoreError, ServerError)):
        return code_of(exc), str(exc) or type(exc).__name__
    return code_of(exc), f"internal error: {type(exc).__name__}"
