"""Where a GET reply's blocks land: the caller's buffers, or buffers of a ``get`` recycled
once their last holder dropped them (``Recycler``), checked against their checksums as they land.
"""

from __future__ import annotations

import sys
from collections import deque
from typing import Any, Sequence

import xxhash

from kvstore.errors import KVStoreError

from . import replies


class Recycler:
    """Buffers for ``get`` without caller buffers: the ones callers dropped, reused.

    A new ``bytearray(n)`` of a large block is fresh memory from the OS, zeroed
    and page-faulted before a byte is received (~1 GB/s on a small VM against
    tens of GB/s into touched memory; the benchmark's ``get`` of 1 MiB x 32 ran
    at 40 % of ``get_into`` for it). A block ``get`` returns is the caller's for
    as long as it holds a reference -- or anything made from it: a memoryview,
    a numpy array or a tensor over it holds one too. When the recycler's own
    reference is the last (CPython's reference count), the block is unreachable
    and its touched memory serves the next ``get`` of that size. Holds at most
    ``max_bytes`` of blocks; looks at a few per request, never scans them all.
    """

    _PROBE = 4  # candidates checked per request before a new buffer is made

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.held = 0
        self._by_size: dict[int, deque[bytearray]] = {}

    def take(self, size: int) -> bytearray:
        q = self._by_size.get(size)
        if q:
            for _ in range(min(len(q), self._PROBE)):
                buf = q.popleft()
                q.append(buf)
                if sys.getrefcount(buf) == 3:  # the deque, `buf`, getrefcount's argument: nobody else
                    if len(buf) == size:
                        return buf
                    q.pop()  # resized by its last holder (extend, del buf[i:]): not of this size any more
                    self.held -= size
        buf = bytearray(size)
        if self.held + size > self.max_bytes:
            self._trim(size)
        if self.held + size <= self.max_bytes:
            self._by_size.setdefault(size, deque()).append(buf)
            self.held += size
        return buf

    def _trim(self, size: int) -> None:
        """Let go of a few dropped buffers of other sizes (a size no longer asked for must not pin memory)."""
        looked = 0
        for other, q in list(self._by_size.items()):
            if other == size:
                continue
            for _ in range(len(q)):
                looked += 1
                buf = q.popleft()
                if sys.getrefcount(buf) == 2:  # `buf`, getrefcount's argument: free, forget it
                    self.held -= other
                else:
                    q.append(buf)
                if looked >= 16:
                    break
            if not q:
                del self._by_size[other]
            if looked >= 16 or self.held + size <= self.max_bytes:
                return


class GetSink:
    """Receives a GET reply's blocks into new (or recycled) buffers, or into the caller's.

    With ``verify``, each block is checksummed piece by piece as it lands
    (``received``), while the piece is still in cache; a block that passes gets
    checksum 0 (nothing left to check), one that fails keeps its checksum and the
    caller reports it. ``finish`` settles the last block.
    """

    def __init__(self, fields: dict[str, Any], keys: Sequence[bytes], buffers: Sequence[memoryview] | None,
                 recycler: Recycler | None = None, verify: bool = False) -> None:
        n = len(keys)
        self.keys = keys
        sizes = replies.block_sizes(fields.get("sizes"), n, "GET")
        sums = replies.checksums(fields.get("checksums"), n, "GET")
        self.index = [i for i, s in enumerate(sizes) if s >= 0]
        self.sizes = [sizes[i] for i in self.index]
        self.checksums = sums
        self.buffers = buffers
        self.recycler = recycler
        self.verify = verify
        self.out: list[memoryview | bytearray | None] = [None] * n
        self.errors: dict[int, KVStoreError] = {}
        self._hasher: Any = None  # of the block arriving now, when it is checked
        self._hashing = -1

    def target(self, j: int) -> list[memoryview] | None:
        self.finish()  # block j-1 is complete
        i, size = self.index[j], self.sizes[j]
        if self.buffers is None:
            buf = self.recycler.take(size) if self.recycler is not None else bytearray(size)
            dst: memoryview | bytearray = buf
        else:
            dst = self.buffers[i]
            if len(dst) != size:
                self.errors[i] = replies.size_error(self.keys[i], size, len(dst))
                return None
        self.out[i] = dst
        if self.verify and self.checksums[i]:
            self._hasher, self._hashing = xxhash.xxh3_64(), i
        return [memoryview(dst)]

    def received(self, j: int, piece: memoryview) -> None:
        if self._hasher is not None:
            self._hasher.update(piece)

    def finish(self) -> None:
        if self._hasher is not None:
            if self._hasher.intdigest() == self.checksums[self._hashing]:
                self.checksums[self._hashing] = 0
            self._hasher = None
