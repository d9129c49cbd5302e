"""The seam behind the in-memory store: a slower, larger, possibly shared tier.

Memory is the first tier and always answers first; a backing tier (Redis,
Redis Cluster: :mod:`kvstore.server.redis_tier`) is consulted on a miss and
receives every stored block. The service calls these coroutines; each batch
call must cost one round trip to the backend (pipelined), not one per key.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Awaitable, Sequence

from kvstore.errors import Unavailable


@dataclass(frozen=True)
class TierBlock:
    """A block on its way to or from a tier. ``data`` is a list of views that
    add up to the block (memory pages, pinned by the caller while the call runs)."""

    key: bytes
    data: Sequence[memoryview | bytes]
    checksum: int
    size: int


class Tier(ABC):
    """A backing tier. Failures raise :class:`kvstore.errors.Unavailable`."""

    write_through: bool = True  # False: store() may return before the backend has the blocks
    max_block: int | None = None  # the largest block the backend takes (None: no limit of its own)

    @abstractmethod
    async def start(self) -> None: ...

    @abstractmethod
    async def close(self) -> int:
        """Flush anything not yet written (write-behind) and disconnect; the number of
        acknowledged blocks that could not be written (0: nothing lost)."""

    def give_up(self) -> None:
        """Make a :meth:`close` in progress stop flushing now (the operator asked again)."""

    def refusal(self) -> Unavailable | None:
        """The error :meth:`store` would raise now without trying (write-through while the backend
        is known down), else None: a put then evicts nothing from memory for blocks it must drop."""
        return None

    @abstractmethod
    async def store(self, ns: str, blocks: Sequence[TierBlock]) -> None:
        """Write-through: return once the backend has every block. Write-behind:
        return once they are queued (waiting while the queue is full and the backend is up)."""

    @abstractmethod
    async def fetch(self, ns: str, keys: Sequence[bytes]) -> list[tuple[bytes | memoryview, int] | None]:
        """``(data, checksum)`` per key, ``None`` where absent; one pipelined round trip."""

    @abstractmethod
    async def exists(self, ns: str, keys: Sequence[bytes], *, strict: bool = False, renew: bool = False,
                     max_size: int | None = None) -> list[bool]:
        """Per key: held (or queued); with ``strict`` a backend that cannot answer raises
        ``Unavailable`` instead of counting as absent; with ``renew`` the held keys' expiry starts
        again, as if written now; a block over ``max_size`` bytes counts as absent (this server
        could not send it: another one with a larger --max-frame-size stored it)."""

    @abstractmethod
    def delete(self, ns: str, keys: Sequence[bytes]) -> Awaitable[int]:
        """Delete ``keys``; the count deleted. The caller has deleted them from memory already: as
        in :meth:`flush`, a copy stored from the moment of this call on must survive the delete."""

    @abstractmethod
    def flush(self, ns: str) -> Awaitable[int]:
        """Delete every block of ``ns``; the count deleted. The caller has flushed memory already:
        a block stored from the moment of this call on (before the awaitable first runs) must
        survive the flush, so a tier orders such writes after it."""

    @abstractmethod
    def stats(self) -> dict[str, Any]:
        """At least ``state`` ("ok" | "degraded"), ``mode``, ``backlog_bytes``, ``backlog_blocks``."""
