"""The messages of the kvstore wire protocol: what a frame's meta carries, and how each is checked.

Each request is a frozen dataclass with its op code and a ``validate`` that the
frame reader calls on the decoded meta (types, ranges, limits), so a bad request
is refused before anything is reserved for it; replies are a free-form
:class:`Reply` or an :class:`ErrorReply`.
The framing around them (header, meta, payload) is in :mod:`kvstore.protocol`;
the byte layout in ``docs/protocol.md``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

from .errors import InvalidRequest, TooLarge
from .keys import check_key, check_keys

VERSION = 1  # of the protocol: the header's version byte, and what HELLO announces
MAX_NAMESPACE = 256  # characters


@dataclass(frozen=True)
class Limits:
    """Sizes checked before anything big is buffered or reserved.

    The meta limit bounds the only buffer the reader grows on a peer's say-so;
    4 MiB holds a batch of 16384 keys of 128 bytes with room to spare.
    """

    max_meta: int = 4 << 20
    max_payload: int = 2 << 30
    max_batch: int = 16384


DEFAULT_LIMITS = Limits()


@dataclass(frozen=True)
class Message:
    """A frame's meta as a typed value; ``OP`` is its wire op code."""

    OP: ClassVar[int] = 0

    def to_meta(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in _field_names(type(self))}

    @classmethod
    def from_meta(cls, meta: dict[str, Any], payload_len: int, limits: Limits) -> Message:
        """The message a meta map holds. Fields it does not know are left out (a newer peer's
        additions), but a field name that is not a string is refused, as is a missing required
        field: either would otherwise read as an empty batch and get a plausible wrong answer."""
        names = _field_names(cls)
        values = {}
        for k, v in meta.items():
            if k in names:
                values[k] = v
            elif type(k) is not str:  # (the codec lets bytes through: a peer packing names as bin)
                raise InvalidRequest(f"{OP_NAMES[cls].upper()}: meta field names must be strings, "
                                     f"got a {type(k).__name__} name")
        try:
            return cls(**values)
        except TypeError:  # a required field is missing
            missing = [f.name for f in dataclasses.fields(cls) if f.name not in values and
                       f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
            raise InvalidRequest(f"{OP_NAMES[cls].upper()} needs the field(s) {', '.join(missing)}") from None


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


def _field_names(cls: type) -> tuple[str, ...]:
    """A message class's field names, computed once (``dataclasses.fields`` costs microseconds per call)."""
    names = _FIELD_NAMES.get(cls)
    if names is None:
        names = _FIELD_NAMES[cls] = tuple(f.name for f in dataclasses.fields(cls))
    return names


def _check_flag(name: str, value: Any) -> None:
    if type(value) is not bool:  # (taken for its truth, "false" pinned)
        raise InvalidRequest(f"{name} must be true or false, got a value of type {type(value).__name__}")


def _check_keys(keys: Any, limits: Limits) -> None:
    if not isinstance(keys, list):
        raise InvalidRequest("keys must be a list of byte strings")
    if len(keys) > limits.max_batch:
        raise TooLarge(f"batch of {len(keys)} keys is over the limit of {limits.max_batch}")
    check_keys(keys)


def _check_ints(name: str, values: Any, n: int, *, lo: int = 0, hi: int = 2**64 - 1) -> None:
    if not isinstance(values, list) or len(values) != n:
        raise InvalidRequest(f"{name} must be a list of {n} integers")
    for v in values:
        if type(v) is not int or not lo <= v <= hi:
            # (named by type unless an int: a wire value's repr may be huge, or nested too deep to make)
            shown = v if type(v) is int else f"a {type(v).__name__}"
            raise InvalidRequest(f"{name} holds {shown}, not an integer in {lo}..{hi}")


def _check_parent(parent: Any) -> None:
    if parent is not None:
        check_key(parent)


class _KeysRequest(Message):
    """Base for requests that carry only a batch of keys."""

    def validate(self, payload_len: int, limits: Limits) -> None:
        _check_keys(self.keys, limits)  # type: ignore[attr-defined]
        _no_payload(self, payload_len)


def _no_payload(msg: Message, payload_len: int) -> None:
    if payload_len:
        raise InvalidRequest(f"{type(msg).__name__} carries no payload")


@dataclass(frozen=True)
class Hello(Message):
    OP: ClassVar[int] = 1
    version: int = VERSION
    namespace: str = "default"
    token: str | None = None
    client: str = ""

    def validate(self, payload_len: int, limits: Limits) -> None:
        _no_payload(self, payload_len)
        if type(self.version) is not int:
            raise InvalidRequest("version must be an integer")
        if not isinstance(self.namespace, str) or not 1 <= len(self.namespace) <= MAX_NAMESPACE:
            raise InvalidRequest(f"namespace must be a string of 1..{MAX_NAMESPACE} characters")
        if self.token is not None and not isinstance(self.token, str):
            raise InvalidRequest("token must be a string")


@dataclass(frozen=True)
class Ping(Message):
    OP: ClassVar[int] = 2

    def validate(self, payload_len: int, limits: Limits) -> None:
        _no_payload(self, payload_len)


@dataclass(frozen=True)
class Put(Message):
    """Store blocks; the payload is the blocks in key order, ``sizes`` bytes each.

    ``checksums`` (xxh3-64 of each block, or an empty list) is stored with the
    block and returned on every get, so the reader can verify it end to end.
    The keys are one chain, in order; ``parent`` is the key just before
    ``keys[0]`` when the batch continues a stored prefix (else None).
    """

    OP: ClassVar[int] = 3
    keys: list[bytes]
    sizes: list[int]
    checksums: list[int] = field(default_factory=list)
    parent: bytes | None = None

    def validate(self, payload_len: int, limits: Limits) -> None:
        _check_keys(self.keys, limits)
        _check_parent(self.parent)
        _check_ints("sizes", self.sizes, len(self.keys))  # (--max-block: per block, at reserve)
        if not isinstance(self.checksums, list):  # (nil, false or {} were taken for "none", as SHM_COMMIT does not)
            raise InvalidRequest("checksums must be a list of integers (empty for none)")
        if self.checksums:
            _check_ints("checksums", self.checksums, len(self.keys))
        if sum(self.sizes) != payload_len:
            raise InvalidRequest(f"sizes add up to {sum(self.sizes)} but the payload has {payload_len} bytes")


@dataclass(frozen=True)
class Lookup(_KeysRequest):
    """The longest present prefix of ``keys``; ``pin`` leases those blocks for ``lease_ms``."""

    OP: ClassVar[int] = 4
    keys: list[bytes]
    pin: bool = False
    lease_ms: int | None = None

    def validate(self, payload_len: int, limits: Limits) -> None:
        super().validate(payload_len, limits)
        _check_flag("pin", self.pin)
        self.check_lease(self.lease_ms)

    @staticmethod
    def check_lease(lease_ms: object) -> None:
        """(The client checks it too, before it is sent: a number msgpack cannot hold would say so.)"""
        if lease_ms is not None and (type(lease_ms) is not int or not 0 < lease_ms <= 2**31):
            raise InvalidRequest(f"lease_ms must be a positive integer of milliseconds, at most 2**31; "
                                 f"got {lease_ms!r:.40}")


@dataclass(frozen=True)
class Get(_KeysRequest):
    """Blocks in key order; ``unpin`` also drops one lease per key once read."""

    OP: ClassVar[int] = 5
    keys: list[bytes]
    unpin: bool = False

    def validate(self, payload_len: int, limits: Limits) -> None:
        super().validate(payload_len, limits)
        _check_flag("unpin", self.unpin)


@dataclass(frozen=True)
class Exists(_KeysRequest):
    OP: ClassVar[int] = 6
    keys: list[bytes]


@dataclass(frozen=True)
class Delete(_KeysRequest):
    OP: ClassVar[int] = 7
    keys: list[bytes]


@dataclass(frozen=True)
class Unpin(_KeysRequest):
    OP: ClassVar[int] = 8
    keys: list[bytes]


@dataclass(frozen=True)
class Stats(Message):
    OP: ClassVar[int] = 9

    def validate(self, payload_len: int, limits: Limits) -> None:
        _no_payload(self, payload_len)


@dataclass(frozen=True)
class Flush(Message):
    """Delete every block of a namespace (the connection's own when empty)."""

    OP: ClassVar[int] = 10
    namespace: str = ""

    def validate(self, payload_len: int, limits: Limits) -> None:
        _no_payload(self, payload_len)
        if not isinstance(self.namespace, str) or len(self.namespace) > MAX_NAMESPACE:
            raise InvalidRequest(f"namespace must be a string of at most {MAX_NAMESPACE} characters")


# -- shared memory (same-host clients over the Unix socket; docs/shm.md)


def _check_handle(handle: Any) -> None:
    if type(handle) is not int or not 1 <= handle <= 0xFFFFFFFF:
        raise InvalidRequest("handle must be an integer in 1..2**32-1")


@dataclass(frozen=True)
class ShmAttach(Message):
    """Ask for the block arena's memfd. Honoured only on the Unix socket: the
    reply frame carries the descriptor as SCM_RIGHTS ancillary data."""

    OP: ClassVar[int] = 11

    def validate(self, payload_len: int, limits: Limits) -> None:
        _no_payload(self, payload_len)


@dataclass(frozen=True)
class ShmGet(_KeysRequest):
    """Like GET, but present blocks are pinned under a handle and located in the
    shared arena (``locs``) instead of sent; the client copies, then SHM_RELEASEs."""

    OP: ClassVar[int] = 12
    keys: list[bytes]
    unpin: bool = False

    def validate(self, payload_len: int, limits: Limits) -> None:
        super().validate(payload_len, limits)
        _check_flag("unpin", self.unpin)


@dataclass(frozen=True)
class ShmPut(Message):
    """Reserve arena slots for blocks the client will write itself (no payload);
    they become visible at SHM_COMMIT, and vanish with SHM_RELEASE or the connection."""

    OP: ClassVar[int] = 13
    keys: list[bytes]
    sizes: list[int]
    parent: bytes | None = None  # as for PUT

    def validate(self, payload_len: int, limits: Limits) -> None:
        _check_keys(self.keys, limits)
        _check_parent(self.parent)
        _check_ints("sizes", self.sizes, len(self.keys))  # (--max-block: per block, at reserve)
        _no_payload(self, payload_len)


@dataclass(frozen=True)
class ShmCommit(Message):
    """Publish an SHM_PUT's written slots; ``checksums`` (xxh3-64, one per key of
    the SHM_PUT, or empty) are computed by the client while it copies."""

    OP: ClassVar[int] = 14
    handle: int = 0
    checksums: list[int] = field(default_factory=list)

    def validate(self, payload_len: int, limits: Limits) -> None:
        _check_handle(self.handle)
        if not isinstance(self.checksums, list):
            raise InvalidRequest("checksums must be a list of integers")
        _check_ints("checksums", self.checksums, len(self.checksums))
        _no_payload(self, payload_len)


@dataclass(frozen=True)
class ShmRelease(Message):
    """End an SHM_GET (drop its pins) or abandon an uncommitted SHM_PUT (abort its slots)."""

    OP: ClassVar[int] = 15
    handle: int = 0

    def validate(self, payload_len: int, limits: Limits) -> None:
        _check_handle(self.handle)
        _no_payload(self, payload_len)


REQUESTS: dict[int, type[Message]] = {
    cls.OP: cls for cls in (Hello, Ping, Put, Lookup, Get, Exists, Delete, Unpin, Stats, Flush,
                            ShmAttach, ShmGet, ShmPut, ShmCommit, ShmRelease)
}

#: Each request's name, as the server's counters, logs and metrics label it.
OP_NAMES: dict[type, str] = {
    Hello: "hello", Ping: "ping", Put: "put", Lookup: "lookup", Get: "get", Exists: "exists", Delete: "delete",
    Unpin: "unpin", Stats: "stats", Flush: "flush", ShmAttach: "shm_attach", ShmGet: "shm_get", ShmPut: "shm_put",
    ShmCommit: "shm_commit", ShmRelease: "shm_release",
}

REPLY_BIT = 0x80
ERROR_OP = 0xFF

# Per-key outcome of a PUT (the other values are error codes from kvstore.errors).
STORED = 0
EXISTED = 1


@dataclass(frozen=True)
class Reply(Message):
    """A reply's meta is free-form: a dict of plain values for the op that asked."""

    OP: ClassVar[int] = REPLY_BIT
    op: int = 0
    fields: dict[str, Any] = field(default_factory=dict)

    def to_meta(self) -> dict[str, Any]:
        return self.fields


@dataclass(frozen=True)
class ErrorReply(Message):
    OP: ClassVar[int] = ERROR_OP
    code: int = 8
    message: str = ""
