"""Checks of the fields in a server's replies: anything malformed is a ``ProtocolError``.

The codec checks a reply's framing; what its meta holds is checked here, field by
field, so that a broken or hostile server makes the client raise the typed error
the docs promise -- never a ``TypeError`` from the value it sent, never a wrong
answer read out of it (a size of ``"4"`` taken for a missing block, a status of
``0.0`` taken for "stored"). Also the error of a block that does not fit its caller's buffer.
"""

from __future__ import annotations

from typing import Any

from kvstore.errors import BlockSizeError, ProtocolError
from kvstore.messages import EXISTED, STORED

UINT64_MAX = 2**64 - 1


def statuses(fields: dict[str, Any], n: int, what: str) -> list[tuple[int, str | None]]:
    """A PUT-style reply's ``(status code, error message or None)`` per key.

    A failed key whose message the server left out (the same as the last one it sent for that
    status, or one past its budget for messages) gets the last message sent for the same status.
    """
    status, errors = fields.get("status"), fields.get("errors")
    errors = {} if errors is None else errors
    if (not isinstance(status, list) or len(status) != n or any(type(s) is not int for s in status)
            or not isinstance(errors, dict)
            or not all(isinstance(k, str) and isinstance(m, str) for k, m in errors.items())):
        raise ProtocolError(f"malformed {what} reply")
    out: list[tuple[int, str | None]] = []
    last: dict[int, str] = {}
    for j, s in enumerate(status):
        message = errors.get(str(j))
        if message is not None:
            last[s] = message
        elif s not in (STORED, EXISTED):
            message = last.get(s)
        out.append((s, message))
    return out


def block_sizes(sizes: Any, n: int, what: str) -> list[int]:
    """A GET-style reply's size per key: an int >= 0, or -1 for a missing block."""
    if not isinstance(sizes, list) or len(sizes) != n or any(type(s) is not int or s < -1 for s in sizes):
        raise ProtocolError(f"malformed {what} reply: sizes")
    return sizes


def size_error(key: bytes, size: int, buffer_len: int) -> BlockSizeError:
    """A caller's buffer that does not fit its block (named by key: a call split into shares and
    parts numbers its blocks differently from the caller)."""
    return BlockSizeError(f"block of key {key.hex()} has {size} bytes but its buffer has {buffer_len}")


def checksums(sums: Any, n: int, what: str) -> list[int]:
    """A GET-style reply's checksum per key (0: stored without one)."""
    if not isinstance(sums, list) or len(sums) != n or any(type(s) is not int or not 0 <= s <= UINT64_MAX
                                                             for s in sums):
        raise ProtocolError(f"malformed {what} reply: checksums")
    return sums


def bools(values: Any, n: int, name: str) -> list[bool]:
    if not isinstance(values, list) or len(values) != n or any(type(v) is not bool for v in values):
        raise ProtocolError(f"malformed reply: {name}")
    return values


def count(fields: dict[str, Any], name: str) -> int:
    """A non-negative integer field (a count of blocks)."""
    v = fields.get(name)
    if type(v) is not int or v < 0:
        raise ProtocolError(f"malformed reply: {name}")
    return v


__all__ = ["block_sizes", "bools", "checksums", "count", "size_error", "statuses"]
