"""The kvstore exception tree, and the wire codes that carry it.

::

    KVStoreError                      every failure kvstore raises
    ├── ProtocolError                 malformed bytes on the wire (either side)
    ├── TransportError                could not reach the server, or the connection broke
    │   └── RequestTimeout            no reply within the client's timeout
    ├── BlockSizeError                a destination buffer does not fit the block (client side)
    ├── IntegrityError                a block's checksum did not match its bytes
    └── ServerError                   the server answered with an error reply (has ``.code``)
        ├── InvalidRequest            well-framed but invalid: bad key, bad batch shape
        ├── Unauthorized              missing or wrong token
        ├── TooLarge                  block or batch over the server's limits
        ├── CapacityError             no room even after evicting every unpinned block
        ├── NotFound                  a named thing (lease, namespace) does not exist
        ├── Unavailable               a backing tier the request needs is down
        └── InternalError             a bug or an unexpected failure on the server

A miss is not an error: lookups return a shorter prefix and gets return ``None``.
The builtins ``ConnectionError`` and ``TimeoutError`` are deliberately not shadowed.
"""

from __future__ import annotations


class KVStoreError(Exception):
    """Root of every exception kvstore raises."""


class ProtocolError(KVStoreError):
    """Bytes that do not form a valid frame (wrong magic, version, lengths, msgpack, ...)."""


class TransportError(KVStoreError):
    """The connection could not be made or was lost before the reply arrived."""


class RequestTimeout(TransportError):
    """The server did not answer within the client's timeout."""


class BlockSizeError(KVStoreError, ValueError):
    """A caller-supplied buffer does not have the size of the block meant for it."""


class IntegrityError(KVStoreError):
    """A block's bytes do not match the checksum stored with it."""


class ServerError(KVStoreError):
    """An error reply from the server; ``code`` is its wire code."""

    code = 1  # overridden by every subclass

    def __init__(self, message: str = "", *, code: int | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code


class InvalidRequest(ServerError):
    code = 2


class Unauthorized(ServerError):
    code = 3


class TooLarge(ServerError):
    code = 4


class CapacityError(ServerError):
    code = 5


class NotFound(ServerError):
    code = 6


class Unavailable(ServerError):
    code = 7


class InternalError(ServerError):
    code = 8


# Protocol errors detected by the server are sent back with this code, so the
# client can tell "you sent garbage" from "the server sent garbage".
PROTOCOL_ERROR_CODE = 9

_BY_CODE: dict[int, type[KVStoreError]] = {
    cls.code: cls
    for cls in (InvalidRequest, Unauthorized, TooLarge, CapacityError, NotFound, Unavailable, InternalError)
}


def code_of(exc: BaseException) -> int:
    """The wire code for an exception raised while serving a request."""
    if isinstance(exc, ProtocolError):
        return PROTOCOL_ERROR_CODE
    if isinstance(exc, ServerError):
        return exc.code
    return InternalError.code


def from_code(code: int, message: str) -> KVStoreError:
    """Rebuild the exception an error reply stands for (unknown codes become ServerError)."""
    if code == PROTOCOL_ERROR_CODE:
        return ProtocolError(message)
    cls = _BY_CODE.get(code)
    if cls is None:
        return ServerError(message, code=code)
    return cls(message)
