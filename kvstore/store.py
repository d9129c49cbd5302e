"""The block store: blocks in a pre-faulted arena, with capacity, pins and eviction.

Pure and synchronous: no I/O, no asyncio, no logging -- it returns or raises.
The server drives it from one event loop; it is not thread-safe.
Contract of the primitives (``ns`` is a namespace string; blocks of different
namespaces never meet, even under equal key bytes):

- ``reserve(ns, key, size)`` sets ``size`` bytes of pages aside for a block the
  server is about to receive (``Reservation.views``: writable memoryviews, one
  ``recv_into`` each). It returns ``None`` when the key is already stored
  (dedup; the caller discards the payload). It evicts unpinned blocks as
  needed; when even evicting every evictable block would not make room it
  raises :class:`CapacityError` and evicts nothing. A reservation is invisible
  to every read until ``commit``, and is never evicted. ``keep`` names the
  stored chain the put continues (:class:`Keep`), which it does not evict.
- ``commit(res, parent)`` publishes the block, or returns ``False`` (pages
  freed) when another reservation committed the same key first. ``parent`` is
  the key before it in its chain: the parent->children links let eviction
  demote a block's descendants when the block goes (they are *stranded*: no
  prefix lookup can reach them, so they are evicted before anything
  reachable). A stranded block whose parent is gone waits for it: stored again,
  the parent takes it back, and with it every block after it (reachable again
  when the parent is). ``abort(res)`` frees a reservation whose payload never arrived.
- ``lookup(ns, keys)`` returns the largest ``m`` with ``keys[:m]`` all stored,
  touches them as one chain access and, with ``pin=True``, gives each a lease
  (until ``clock() + lease_s``) that keeps it from eviction.
- ``acquire`` pins a block for an in-flight read (a reference count) and
  ``release`` unpins it. ``delete`` and ``flush`` take blocks out of the index
  at once; their pages return to the arena when the last reader releases them.
- A block is *pinned* while it has a reader or an unexpired lease. Pinned
  blocks are never evicted; leases past their time count as gone.
- A zero-byte block still holds one page, so the page count bounds the number
  of blocks (and the index's memory).

Chain order: a put batch and a read both go head first, so the store tells the
policy each block's parent (``EvictionPolicy.add``/``touch``): a block sits in
the eviction queue just before its parent and a chain loses its tail first.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from bisect import bisect_left, bisect_right, insort
from collections.abc import Callable, Iterable, Sequence
from operator import attrgetter, itemgetter
from typing import Any, NoReturn, TypedDict, cast

from .arena import Arena, Extent
from .config import format_size
from .errors import CapacityError, InvalidRequest, TooLarge
from .keys import check_key, check_keys
from .eviction import EvictionPolicy, make_policy

#: Leases a store keeps at once, per page of its capacity, and at least (``BlockStore(max_leases=)``).
LEASES_PER_PAGE = 64
MIN_LEASES = 1 << 16

BlockKey = tuple[str, bytes]  # the policy's key: (namespace, key bytes)


def _check_ns(ns: object) -> None:
    if not isinstance(ns, str):
        raise InvalidRequest(f"a namespace must be a str, got {type(ns).__name__}")


class StoreStats(TypedDict):
    """``BlockStore.stats()``: gauges and monotonic counters, all ints but ``eviction``."""

    blocks: int  # stored blocks (reservations not included)
    bytes: int  # their payload bytes
    used_bytes: int  # bytes of pages in use: blocks, reservations, deleted blocks still being read
    capacity: int
    free_bytes: int
    reserved_bytes: int  # bytes of pages held by open reservations
    pinned_blocks: int  # blocks with a reader or an unexpired lease
    stranded_blocks: int  # blocks whose chain predecessor is gone: evicted first
    leases: int
    evictions: int
    evicted_bytes: int  # payload bytes evicted
    stored: int  # commits that stored a block
    dedup: int  # puts of a key already stored (at reserve, or a lost commit race)
    lookups: int
    lookup_hit_keys: int
    lookup_miss_keys: int
    page_size: int
    eviction: str  # the policy's name


def _parent_key(block: _Block) -> BlockKey | None:
    """The policy key of a block's parent while it reaches the block (a hint: no lookup)."""
    return None if block.parent is None or block.stranded else (block.pkey[0], block.parent)


class _Block:
    """A stored block. ``children`` is None, one key, or a set (fan-out is rare)."""

    __slots__ = ("checksum", "children", "dead", "extent", "leases", "pages", "parent", "pkey", "refs", "size",
                 "stranded", "waits")

    def __init__(self, pkey: BlockKey, size: int, checksum: int, extent: Extent, pages: int) -> None:
        self.pkey = pkey
        self.size = size
        self.checksum = checksum
        self.extent = extent
        self.pages = pages  # arena pages it holds (the pinned/index page counts move by this)
        self.parent: bytes | None = None  # the parent's key, set only while it was present
        self.children: bytes | set[bytes] | None = None
        self.refs = 0  # in-flight readers
        self.leases: list[float] | None = None  # deadlines, soonest first
        self.stranded = False
        self.waits: bytes | None = None  # the key of its parent, while that is gone (see BlockStore._waiting)
        self.dead = False  # out of the index, pages kept for readers

    @property
    def pinned(self) -> bool:
        return self.refs > 0 or self.leases is not None

    def add_child(self, key: bytes) -> None:
        children = self.children
        if children is None:
            self.children = key
        elif isinstance(children, set):
            children.add(key)
        elif children != key:
            self.children = {children, key}

    def drop_child(self, key: bytes) -> None:
        children = self.children
        if isinstance(children, set):
            children.discard(key)
        elif children == key:
            self.children = None

    def child_keys(self) -> Iterable[bytes]:
        children = self.children
        if children is None:
            return ()
        return (children,) if isinstance(children, bytes) else tuple(children)


# Field getters for the C loops over a batch's blocks.
_PKEY, _PARENT, _STRANDED = attrgetter("pkey"), attrgetter("parent"), attrgetter("stranded")
_SECOND = itemgetter(1)

_LEASE_HEAP_MIN = 4096  # keys named by lease deadlines before the first sweep of stale ones


class Keep:
    """The stored chain a put's next block continues: its parent and the parent's predecessors.

    Making room for the block passes over them: evicting one would strand the
    new block (out of every prefix lookup's reach) as it is committed. The
    chain is found as eviction meets it, at no cost per put: a chain stands in
    the eviction order tail first (each block just before its parent), so its
    blocks come up one after the other, each the parent of the one before. The
    run met is then touched, as read: it goes just before the rest of its chain
    (at the back when it reached the head). Where that order does not hold
    (ARC's two lists), a block of the chain can be taken for another's: once
    evicting it strands the parent, the block is one that no lookup reaches,
    and it makes room as such a block does (below).

    With a parent that is not stored or stranded (evicted, refused), the block
    will be stranded itself: it may evict only stranded blocks, never one a
    lookup reaches; and is refused (``CapacityError``) where nothing else is
    left to evict -- so a chain longer than the capacity keeps its head. (A
    server with a lower tier, which holds what memory evicts, uses no keep.)
    """

    __slots__ = ("ns", "parent", "keys", "edge")

    def __init__(self, ns: str, parent: bytes) -> None:
        self.ns, self.parent = ns, parent
        self.keys: set[bytes] = set()  # the chain's keys met so far
        self.edge: bytes | None = None  # of those, the one nearest the head


class Reservation:
    """Pages set aside for one incoming block; fill ``views`` then commit or abort."""

    __slots__ = ("_arena", "_extent", "_open", "checksum", "key", "ns", "pages", "size")

    def __init__(self, ns: str, key: bytes, size: int, checksum: int, arena: Arena, extent: Extent,
                 pages: int) -> None:
        self.ns = ns
        self.key = key
        self.size = size
        self.checksum = checksum
        self.pages = pages
        self._arena = arena
        self._extent = extent
        self._open = True

    @property
    def views(self) -> list[memoryview]:
        """Writable views of exactly ``size`` bytes, one per page run; empty once closed.
        (Made on demand: a shared-memory put needs only the ``extent``.)"""
        return self._arena.views(self._extent, self.size) if self._open else []

    @property
    def extent(self) -> Extent:
        """The arena pages set aside (a shared-memory client is told where to write)."""
        return self._extent

    def __repr__(self) -> str:
        state = "open" if self._open else "closed"
        return f"<Reservation {self.ns!r} {self.key.hex()[:16]} {self.size}B {state}>"


class BlockRef:
    """A pinned block being read; its ``views`` stay valid until ``release``."""

    __slots__ = ("_arena", "_block", "_open", "checksum", "key", "ns", "size")

    def __init__(self, ns: str, key: bytes, block: _Block, arena: Arena) -> None:
        self.ns = ns
        self.key = key
        self.size = block.size
        self.checksum = block.checksum
        self._block = block
        self._arena = arena
        self._open = True

    @property
    def views(self) -> list[memoryview]:
        """Read-only views of the block's bytes, one per page run (made on demand: a
        shared-memory read needs only the ``extent``); empty once released."""
        if not self._open:
            return []
        block = self._block
        return self._arena.views(block.extent, block.size, readonly=True)

    @property
    def extent(self) -> Extent:
        """The block's arena pages (a shared-memory client is told where to read)."""
        return self._block.extent

    @property
    def gone(self) -> bool:
        """Deleted or evicted since it was pinned (its bytes stay readable until released)."""
        return self._block.dead

    def __repr__(self) -> str:
        return f"<BlockRef {self.ns!r} {self.key.hex()[:16]} {self.size}B>"


class BlockStore:
    """Blocks by ``(namespace, key)`` in one arena, evicted by a named policy."""

    def __init__(
        self,
        capacity: int,
        *,
        eviction: str = "lru",
        page_size: int = 64 * 1024,
        lease_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        prefault: bool = True,
        max_block_size: int | None = None,
        shared_arena: bool = False,
        max_leases: int | None = None,
    ) -> None:
        """Map the arena (``capacity`` rounded down to whole pages); ``shared_arena``
        backs it with a memfd that same-host clients can map (:class:`Arena`).

        ``max_leases``: leases outstanding at once (default :data:`LEASES_PER_PAGE`
        per page, at least :data:`MIN_LEASES`). Each costs ~16 bytes until it ends,
        so without a bound a client repeating pinned lookups grows the server's
        memory with its request rate.

        Raises:
            ValueError: unknown ``eviction``, non-positive sizes or ``lease_s``, a bad ``max_block_size``
                or ``max_leases``.
        """
        self._policy: EvictionPolicy[BlockKey] = make_policy(eviction)
        if not (isinstance(lease_s, (int, float)) and math.isfinite(lease_s) and lease_s > 0):
            raise ValueError(f"lease_s must be a positive number of seconds, got {lease_s!r}")
        for name, limit in (("max_block_size", max_block_size), ("max_leases", max_leases)):
            if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
                raise ValueError(f"{name} must be an int >= 0, got {limit!r}")
        self._arena = Arena(capacity, page_size, prefault=prefault, shared=shared_arena)
        self._max_block = self._arena.capacity if max_block_size is None else min(max_block_size, self._arena.capacity)
        self._lease_s = float(lease_s)
        self._max_leases = max_leases if max_leases is not None else max(
            MIN_LEASES, LEASES_PER_PAGE * self._arena.num_pages)
        self._clock = clock
        self._blocks: dict[str, dict[bytes, _Block]] = {}
        self._ns_bytes: dict[str, int] = {}
        self._lease_heap: list[tuple[float, int, str, list[bytes]]] = []  # (deadline, seq, ns, keys)
        self._lease_seq = itertools.count()
        self._lease_heap_keys = 0  # keys the heap's entries name
        self._lease_heap_limit = _LEASE_HEAP_MIN
        # Accounting over indexed blocks (dead blocks kept for readers are not counted).
        self._count = 0
        self._payload = 0
        self._index_pages = 0
        self._pinned_pages = 0
        self._pinned_blocks = 0
        self._stranded = 0  # blocks with .stranded set: while none is, a lookup need not look for one
        # A gone parent's policy key -> its stored children's keys, which wait for it (.waits): a put
        # that stores it again joins them to it, and they leave the stranded queue with it.
        self._waiting: dict[BlockKey, set[bytes]] = {}
        self._leases = 0
        self._reserved_pages = 0
        self._events = dict.fromkeys(
            ("evictions", "evicted_bytes", "stored", "dedup", "lookups", "lookup_hit_keys", "lookup_miss_keys"), 0
        )

    @property
    def arena(self) -> Arena:
        return self._arena

    @property
    def policy(self) -> EvictionPolicy[BlockKey]:
        return self._policy

    # -- write path -------------------------------------------------------------

    def reserve(self, ns: str, key: bytes, size: int, checksum: int = 0, *,
                keep: Keep | None = None) -> Reservation | None:
        """Set pages aside for a block about to be received.

        A key already stored counts as read: a batch that restates a stored
        prefix (a whole prompt) takes the room for its new blocks from other
        chains, not from that prefix. ``keep``: the chain the block continues
        (:class:`Keep`), which is not evicted for it either.

        Returns:
            The reservation, or ``None`` when ``(ns, key)`` is already stored.

        Raises:
            InvalidRequest: bad namespace, key or size.
            TooLarge: ``size`` is over the capacity or ``max_block_size``.
            CapacityError: no room even after evicting every unpinned block (nothing
                is evicted then); or, with ``keep``, no room but by evicting the chain, or
                a reachable block for a block that will be stranded (blocks met before, or
                stranded ones, may have been evicted then).
        """
        _check_ns(ns)
        check_key(key)
        self.check_size(size)
        ns_blocks = self._blocks.get(ns, {})
        block = ns_blocks.get(key)
        if block is not None:
            self._events["dedup"] += 1
            if not block.stranded:
                self._policy.touch([block.pkey], self._parent_hint(ns_blocks, block))
            return None
        pages = self._pages(size)
        self._make_room(pages, keep if keep is not None and keep.ns == ns else None)
        extent = self._arena.alloc(max(size, 1))
        if extent is None:  # _make_room guarantees the pages
            raise RuntimeError("arena accounting out of step with the store")
        self._reserved_pages += pages
        return Reservation(ns, key, size, checksum, self._arena, extent, pages)

    def commit(self, res: Reservation, parent: bytes | None = None, *, counted: bool = True) -> bool:
        """Publish a filled reservation.

        Args:
            parent: the key before this one in its chain (same namespace), if known.
            counted: count it in ``stored`` now; False for a block a lower tier may still
                refuse (see :meth:`count_stored`), so that the count never goes back.

        Returns:
            True if stored; False if the key was committed meanwhile by another
            reservation (this one's pages are freed).

        Raises:
            ValueError: the reservation was already committed or aborted.
            InvalidRequest: ``parent`` is not a valid key.
        """
        if parent is not None:
            check_key(parent)
        self._close(res)
        ns_blocks = self._blocks.get(res.ns)
        if ns_blocks is not None and res.key in ns_blocks:
            self._arena.free(res._extent)
            self._events["dedup"] += 1
            return False
        block = _Block((res.ns, res.key), res.size, res.checksum, res._extent, res.pages)
        if ns_blocks is None:
            ns_blocks = self._blocks[res.ns] = {}
            self._ns_bytes[res.ns] = 0
        ns_blocks[res.key] = block
        self._count += 1
        self._payload += block.size
        self._index_pages += block.pages
        self._ns_bytes[res.ns] += block.size
        if counted:
            self._events["stored"] += 1
        parent_block = ns_blocks.get(parent) if parent is not None and parent != res.key else None
        if parent_block is None:
            block.stranded = parent is not None and parent != res.key  # its predecessor is gone
            if block.stranded:
                self._wait(block, cast(bytes, parent))
        else:
            block.parent = parent_block.pkey[1]
            parent_block.add_child(res.key)
            block.stranded = parent_block.stranded
        self._policy.add(block.pkey, None if parent_block is None else parent_block.pkey)
        if block.stranded:
            self._stranded += 1
            self._policy.demote(block.pkey)
        if self._waiting:
            self._adopt(ns_blocks, block)
        return True

    def join(self, ns: str, keys: Sequence[bytes], parent: bytes | None = None) -> None:
        """A put batch's keys, committed: one chain, in order, after ``parent``. Its stranded blocks
        whose predecessor there is reachable are joined to it and reachable again, as a lookup of
        the chain would make them (a put that filled the chain's gap). O(len(keys)) while any block
        is stranded, else nothing."""
        if not self._stranded:
            return
        ns_blocks = self._blocks.get(ns, {})
        prev = None if parent is None else ns_blocks.get(parent)
        for key in keys:
            block = ns_blocks.get(key)
            if block is not None and block.stranded and prev is not None and not prev.stranded and block is not prev:
                self._relink(ns_blocks, block, prev)
                self._unstrand(ns_blocks, block)
            prev = block

    def count_stored(self, n: int) -> None:
        """Count ``n`` blocks committed uncounted as stored (a lower tier took them)."""
        self._events["stored"] += n

    def abort(self, res: Reservation) -> None:
        """Free a reservation whose payload never arrived (no-op once closed).

        Raises:
            InvalidRequest: not a reservation of this store.
        """
        if not res._open:
            self._check_own(res)  # (_close checks it otherwise)
            return
        self._close(res)
        self._arena.free(res._extent)

    def put(self, ns: str, key: bytes, data: Any, checksum: int = 0, parent: bytes | None = None, *,
            counted: bool = True) -> bool:
        """reserve + copy + commit, for tests and promotion from a lower tier (not counted stored:
        ``counted=False``).

        Returns:
            True if stored, False if the key existed (dedup).
        """
        src = memoryview(data).cast("B")
        res = self.reserve(ns, key, src.nbytes, checksum)
        if res is None:
            return False
        try:
            offset = 0
            for view in res.views:
                view[:] = src[offset : offset + len(view)]
                offset += len(view)
        except BaseException:
            self.abort(res)
            raise
        return self.commit(res, parent, counted=counted)

    # -- read path --------------------------------------------------------------

    def lookup(self, ns: str, keys: Sequence[bytes], *, pin: bool = False, lease_s: float | None = None) -> int:
        """The largest ``m`` such that ``keys[:m]`` are all stored.

        The ``m`` blocks are touched as one chain access; with ``pin`` each gets
        a lease until ``clock() + lease_s`` (default: the store's ``lease_s``).

        Raises:
            InvalidRequest: bad namespace, key or ``lease_s``.
            CapacityError: with ``pin``, the leases would be more than ``max_leases``
                (nothing is changed).
        """
        _check_ns(ns)
        deadline = self._deadline(lease_s) if pin else 0.0
        ns_blocks = self._blocks.get(ns, {})
        indexed = self._index(ns_blocks, keys)
        if not all(indexed):  # (a block is always true: a fast C test)
            indexed = indexed[:indexed.index(None)]
        found = cast("list[_Block]", indexed)  # (the blocks before the first miss)
        if pin and self._leases + len(found) > self._max_leases:
            self.expire_leases()
            if self._leases + len(found) > self._max_leases:
                raise CapacityError(f"{len(found)} more leases would be over the {self._max_leases} this server "
                                    f"keeps at once ({self._leases} outstanding): unpin, or let them end")
        if found and not self._linked(found, keys):
            self._link(ns_blocks, found)
        events = self._events
        events["lookups"] += 1
        events["lookup_hit_keys"] += len(found)
        events["lookup_miss_keys"] += len(keys) - len(found)
        if found:
            self._policy.touch(list(map(_PKEY, found)), self._parent_hint(ns_blocks, found[0]))
            if pin:  # (filed under the blocks' own keys: a caller's key may be any object equal to them)
                self._add_leases(ns, list(map(_SECOND, map(_PKEY, found))), found, deadline)
        return len(found)

    @staticmethod
    def _index(ns_blocks: dict[bytes, _Block], keys: Sequence[bytes]) -> list[_Block | None]:
        """The blocks of a read's keys (None where missing), the keys checked.

        Only valid keys are ever stored, so a key found is valid: only the
        misses are checked, and a chain read again costs no key check at all
        (the server's codec has checked the batch already).

        Raises:
            InvalidRequest: a bad key.
        """
        try:
            found = list(map(ns_blocks.get, keys))
        except TypeError:  # an unhashable "key": check_keys names it
            check_keys(keys)
            raise
        if not all(found):
            check_keys([key for key, block in zip(keys, found) if block is None])
        return found

    def _linked(self, found: list[_Block], keys: Sequence[bytes]) -> bool:
        """Whether each found block is already linked to the one before it and none
        is stranded: a chain read again, the common case, checked in C loops."""
        before = keys[:len(found) - 1]
        return (list(map(_PARENT, found[1:])) == (before if isinstance(before, list) else list(before))
                and not (self._stranded and any(map(_STRANDED, found))))

    def _link(self, ns_blocks: dict[bytes, _Block], found: list[_Block]) -> None:
        """A lookup reached ``found`` in this order: link unparented or stranded
        blocks to their predecessor, and none of them (nor what follows them) is
        stranded any more."""
        for prev, block in zip(found, found[1:]):
            if (block.stranded or block.parent is None) and block is not prev:
                self._relink(ns_blocks, block, prev)
        for block in found:
            if block.stranded:
                self._unstrand(ns_blocks, block)

    def acquire(self, ns: str, key: bytes) -> BlockRef | None:
        """Pin a block for an in-flight read and touch it (its leases keep their deadlines).

        Returns:
            A reference (read-only ``views``) to pass to ``release``, or None.
        """
        return self.acquire_many(ns, [key])[0]

    def acquire_many(self, ns: str, keys: Sequence[bytes]) -> list[BlockRef | None]:
        """``acquire`` for each key of a batch read (None where missing), the blocks
        found touched as one chain access in key order, as a lookup touches them.

        Raises:
            InvalidRequest: bad namespace or key.
        """
        _check_ns(ns)
        ns_blocks = self._blocks.get(ns, {})
        refs: list[BlockRef | None] = []
        touched: list[_Block] = []
        for key, block in zip(keys, self._index(ns_blocks, keys)):
            if block is None:
                refs.append(None)
                continue
            if not block.refs and block.leases is None:  # pinned from now on (inline: this loop runs per block sent)
                self._pinned_pages += block.pages
                self._pinned_blocks += 1
            block.refs += 1
            if not block.stranded:
                touched.append(block)
            refs.append(BlockRef(ns, block.pkey[1], block, self._arena))
        if touched:
            self._policy.touch(list(map(_PKEY, touched)), self._parent_hint(ns_blocks, touched[0]))
        return refs

    def release(self, ref: BlockRef) -> None:
        """End a read; a deleted block's pages are freed with its last reader.

        Raises:
            ValueError: ``ref`` was already released.
        """
        self.release_many((ref,))

    def release_many(self, refs: Iterable[BlockRef]) -> None:
        """``release`` each of a batch read's references, in order.

        Raises:
            ValueError: a reference was already released (those before it are released).
            InvalidRequest: not a reference of this store (those before it are released).
        """
        arena = self._arena
        for ref in refs:
            if ref._arena is not arena:
                raise InvalidRequest(f"{ref!r} is not a reference of this store")
            if not ref._open:
                raise ValueError(f"{ref!r} was already released")
            ref._open = False
            block = ref._block
            block.refs -= 1
            if block.refs:
                continue
            if block.dead:
                self._arena.free(block.extent)
            elif block.leases is None:  # it was pinned by its readers alone
                self._pinned_pages -= block.pages
                self._pinned_blocks -= 1
                self._policy.released(block.pkey, _parent_key(block))

    def get(self, ns: str, key: bytes) -> bytes | None:
        """A copy of a block's bytes, or None (touches it like a read)."""
        ref = self.acquire(ns, key)
        if ref is None:
            return None
        try:
            return b"".join(ref.views)
        finally:
            self.release(ref)

    def reachable(self, ns: str, key: bytes) -> bool:
        """Whether ``key`` is stored and not stranded (its predecessors, if it has any, are stored)."""
        block = self._blocks.get(ns, {}).get(key)
        return block is not None and not block.stranded

    def exists(self, ns: str, keys: Sequence[bytes]) -> list[bool]:
        """Which keys are stored (no touch)."""
        _check_ns(ns)
        check_keys(keys)
        ns_blocks = self._blocks.get(ns, {})
        return [key in ns_blocks for key in keys]

    # -- removal and pins -------------------------------------------------------

    def delete(self, ns: str, keys: Sequence[bytes]) -> int:
        """Remove blocks from the index now; returns how many were stored."""
        _check_ns(ns)
        check_keys(keys)
        removed = 0
        for key in keys:
            block = self._find(ns, key)
            if block is not None:
                self._policy.remove(block.pkey)
                self._drop(block)
                removed += 1
        return removed

    def flush(self, ns: str) -> int:
        """Delete every block of a namespace; returns how many there were."""
        _check_ns(ns)
        blocks = list(self._blocks.get(ns, {}).values())
        for block in blocks:
            self._policy.remove(block.pkey)
            self._drop(block)
        return len(blocks)

    def unpin(self, ns: str, keys: Sequence[bytes]) -> int:
        """Drop one lease per key (the soonest-expiring); returns how many were dropped."""
        _check_ns(ns)
        check_keys(keys)
        self.expire_leases()
        dropped = 0
        for key in keys:
            block = self._find(ns, key)
            if block is not None and block.leases is not None:
                self._drop_leases(block, 1)
                dropped += 1
        return dropped

    def unpin_refs(self, refs: Sequence[BlockRef]) -> int:
        """Drop one lease of each block read, if that block is still the one under its key: a
        read that waited (on a tier) may find its block deleted, its leases gone with it, and a
        newer block there whose leases are other clients'. Returns how many were dropped."""
        self.expire_leases()
        dropped = 0
        for ref in refs:
            block = self._find(ref.ns, ref.key)
            if block is ref._block and block.leases is not None:
                self._drop_leases(block, 1)
                dropped += 1
        return dropped

    def expire_leases(self) -> int:
        """Drop every lease past its deadline; returns how many."""
        now = self._clock()
        heap = self._lease_heap
        dropped = 0
        while heap and heap[0][0] <= now:
            _, _, ns, keys = heapq.heappop(heap)
            self._lease_heap_keys -= len(keys)
            for key in keys:
                block = self._find(ns, key)  # may be gone, or a newer block under the key
                if block is not None and block.leases is not None and block.leases[0] <= now:
                    n = bisect_right(block.leases, now)
                    self._drop_leases(block, n)
                    dropped += n
        return dropped

    # -- introspection ----------------------------------------------------------

    def stats(self) -> StoreStats:
        """Counters and gauges as plain ints (``eviction`` is the policy's name)."""
        self.expire_leases()
        arena = self._arena
        events = self._events
        return StoreStats(
            blocks=self._count,
            bytes=self._payload,
            used_bytes=arena.used_bytes,
            capacity=arena.capacity,
            free_bytes=arena.free_bytes,
            reserved_bytes=self._reserved_pages * arena.page_size,
            pinned_blocks=self._pinned_blocks,
            stranded_blocks=self._stranded,
            leases=self._leases,
            evictions=events["evictions"],
            evicted_bytes=events["evicted_bytes"],
            stored=events["stored"],
            dedup=events["dedup"],
            lookups=events["lookups"],
            lookup_hit_keys=events["lookup_hit_keys"],
            lookup_miss_keys=events["lookup_miss_keys"],
            page_size=arena.page_size,
            eviction=self._policy.name,
        )

    def namespaces(self) -> dict[str, dict[str, int]]:
        """``{ns: {"blocks": n, "bytes": payload}}`` for every non-empty namespace."""
        return {ns: {"blocks": len(blocks), "bytes": self._ns_bytes[ns]} for ns, blocks in self._blocks.items()}

    # -- internals --------------------------------------------------------------

    def _find(self, ns: str, key: bytes) -> _Block | None:
        ns_blocks = self._blocks.get(ns)
        return None if ns_blocks is None else ns_blocks.get(key)

    def _pages(self, size: int) -> int:
        return max(1, -(-size // self._arena.page_size))

    def check_size(self, size: object) -> None:
        """Raises what :meth:`reserve` raises for a size no block may have here."""
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise InvalidRequest(f"a block size must be an int >= 0, got {size!r}")
        if size > self._max_block:
            raise TooLarge(f"a block of {size} bytes is over the {self._max_block} bytes a block may hold here "
                           f"(--max-block, and at most --max-frame-size and the capacity)")

    def _deadline(self, lease_s: float | None) -> float:
        if lease_s is None:
            lease_s = self._lease_s
        elif isinstance(lease_s, bool) or not isinstance(lease_s, (int, float)) or not 0 < lease_s < math.inf:
            raise InvalidRequest(f"lease_s must be a positive number of seconds, got {lease_s!r}")
        return self._clock() + lease_s

    def _check_own(self, res: Reservation) -> None:
        if type(res) is not Reservation or res._arena is not self._arena:
            raise InvalidRequest(f"{res!r} is not a reservation of this store")

    def _close(self, res: Reservation) -> None:
        self._check_own(res)
        if not res._open:
            raise ValueError(f"{res!r} was already committed or aborted")
        res._open = False
        self._reserved_pages -= res.pages

    def _make_room(self, pages: int, keep: Keep | None = None) -> None:
        """Evict until ``pages`` are free, or raise CapacityError (having evicted nothing, but with
        ``keep``: stranded blocks, and blocks met before its chain)."""
        arena = self._arena
        if arena.free_pages >= pages:
            return
        self.expire_leases()  # expired leases pin nothing
        evictable = self._index_pages - self._pinned_pages
        if arena.free_pages + evictable < pages:
            self._no_room(pages, evictable)
        spared: list[BlockKey] = []
        protected = self._sparing(keep, spared) if keep is not None and self._reachable(keep) else self._is_protected
        try:
            while arena.free_pages < pages:
                orphan = keep is not None and not self._reachable(keep)
                if orphan and spared:  # a block of the chain met out of order was evicted: it broke
                    self._put_back(spared, None)
                    spared.clear()
                pkey = self._policy.evict(self._is_protected if orphan else protected, stranded_only=orphan)
                if pkey is None:
                    if keep is None:
                        raise RuntimeError("eviction policy out of step with the store's pin accounting")
                    self._no_room(pages, self._index_pages - self._pinned_pages, "orphan" if orphan else "chain")
                block = self._blocks[pkey[0]][pkey[1]]
                self._drop(block)
                self._events["evictions"] += 1
                self._events["evicted_bytes"] += block.size
        finally:
            if spared:
                self._put_back(spared, keep)

    def _reachable(self, keep: Keep) -> bool:
        """Whether the parent ``keep`` names is stored and reachable (so the new block will be)."""
        return self.reachable(keep.ns, keep.parent)

    def _sparing(self, keep: Keep, spared: list[BlockKey]) -> Callable[[BlockKey], bool]:
        """The eviction filter of a block continuing ``keep``'s chain: pinned blocks, and the chain
        (each block of it met is noted in ``spared``, to be put back)."""
        blocks, ns, kept = self._blocks, keep.ns, keep.keys
        ns_blocks = blocks[ns]

        def protected(pkey: BlockKey) -> bool:
            block = blocks[pkey[0]][pkey[1]]
            key, chain = pkey[1], False
            if pkey[0] == ns:
                chain = key in kept
                if not chain:  # the next block of the chain is the parent of the last one met
                    edge = None if keep.edge is None else ns_blocks.get(keep.edge)
                    chain = key == (keep.parent if keep.edge is None else edge and edge.parent)
                    if chain:
                        kept.add(key)
                        keep.edge = key
            if block.refs > 0 or block.leases is not None:
                return True  # set aside until released, as every pinned block
            if chain:
                spared.append(pkey)
            return chain

        return protected

    def _put_back(self, spared: list[BlockKey], keep: Keep | None) -> None:
        """The chain's blocks a put passed over: still reachable, touched as read, just before the
        rest of their chain (``keep``: None, or it broke meanwhile: each back where it was going)."""
        live = []
        for pkey in spared:
            block = self._blocks.get(pkey[0], {}).get(pkey[1])
            if block is None or block.stranded or keep is None or not self._reachable(keep):
                self._policy.released(pkey)  # (stranded meanwhile: back to the stranded queue)
            else:
                live.append(pkey)
        if live:
            assert keep is not None
            edge = self._blocks[keep.ns].get(keep.edge) if keep.edge is not None else None
            parent = None if edge is None or edge.parent is None else (keep.ns, edge.parent)
            live.reverse()  # head first, as a read goes
            self._policy.touch(live, parent)

    def _no_room(self, pages: int, evictable: int, left: str = "") -> NoReturn:
        arena = self._arena

        def size(n: int) -> str:  # pages, in bytes as --capacity is given
            return format_size(n * arena.page_size)

        why = {"chain": " (all of it the stored chain this block continues)",
               "orphan": " (none of it stranded: the block's parent is not stored, or stranded itself, so no lookup "
                         "would reach the block, and it may not take a reachable block's room)"}.get(left, "")
        raise CapacityError(
            f"no room for a block of {size(pages)} in {size(arena.num_pages)}: {size(arena.free_pages)} free, "
            f"{size(evictable)} evictable{why}, {size(self._pinned_pages)} pinned (leases, reads, checks in Redis), "
            f"{size(self._reserved_pages)} taken by puts being received (this batch's earlier blocks too)"
        )

    def _is_protected(self, pkey: BlockKey) -> bool:
        block = self._blocks[pkey[0]][pkey[1]]
        return block.refs > 0 or block.leases is not None

    def _drop(self, block: _Block) -> None:
        """Take a block (already out of the policy) out of the index; free its
        pages unless a reader holds them; strand its descendants."""
        ns, key = block.pkey
        ns_blocks = self._blocks[ns]
        del ns_blocks[key]
        pages = block.pages
        if block.pinned:  # it leaves the pinned counts with the index
            self._pinned_pages -= pages
            self._pinned_blocks -= 1
        if block.leases is not None:
            self._leases -= len(block.leases)
            block.leases = None
        self._count -= 1
        self._payload -= block.size
        self._index_pages -= pages
        self._ns_bytes[ns] -= block.size
        if block.stranded:
            self._stranded -= 1
        if block.waits is not None:
            self._unwait(block)
        if block.parent is not None and (parent := ns_blocks.get(block.parent)) is not None:
            parent.drop_child(key)
        for child_key in block.child_keys():
            child = ns_blocks.get(child_key)
            if child is not None:
                child.parent = None  # links only join present blocks
                self._wait(child, key)
        if block.children is not None:
            self._strand_descendants(ns_blocks, block)
        if not ns_blocks:
            del self._blocks[ns], self._ns_bytes[ns]
        if block.refs > 0:
            block.dead = True
        else:
            self._arena.free(block.extent)

    def _strand_descendants(self, ns_blocks: dict[bytes, _Block], block: _Block) -> None:
        """Demote every descendant not yet stranded, deepest first (they leave first)."""
        stack = list(block.child_keys())
        stranded: list[_Block] = []
        while stack:
            child = ns_blocks.get(stack.pop())
            if child is None or child.stranded:
                continue  # a stranded block's descendants are stranded already
            child.stranded = True
            self._stranded += 1
            stranded.append(child)
            stack.extend(child.child_keys())
        for child in reversed(stranded):
            self._policy.demote(child.pkey)

    def _relink(self, ns_blocks: dict[bytes, _Block], block: _Block, parent: _Block) -> None:
        """Make ``parent`` the block's parent (a lookup reached it through it)."""
        old = block.parent
        if old is not None and old != parent.pkey[1] and (old_parent := ns_blocks.get(old)) is not None:
            old_parent.drop_child(block.pkey[1])
        if block.waits is not None:
            self._unwait(block)
        block.parent = parent.pkey[1]
        parent.add_child(block.pkey[1])

    def _unstrand(self, ns_blocks: dict[bytes, _Block], top: _Block) -> None:
        """A stranded block is reachable again (through its parent, or a lookup started at it):
        so are the stranded blocks after it, each touched just before its parent, head first."""
        stack = [top]
        while stack:
            block = stack.pop()
            if not block.stranded:
                continue  # (nor is anything after it: a stranded block's descendants are stranded)
            block.stranded = False
            self._stranded -= 1
            self._policy.touch([block.pkey], self._parent_hint(ns_blocks, block))
            stack.extend(child for key in block.child_keys() if (child := ns_blocks.get(key)) is not None)

    def _wait(self, block: _Block, parent: bytes) -> None:
        """File a stranded block under the key of its gone parent (see :meth:`_adopt`)."""
        block.waits = parent
        self._waiting.setdefault((block.pkey[0], parent), set()).add(block.pkey[1])

    def _unwait(self, block: _Block) -> None:
        """Take a block out of :attr:`_waiting` (it is dropped, or linked to another parent)."""
        pkey = (block.pkey[0], cast(bytes, block.waits))
        block.waits = None
        waiting = self._waiting[pkey]
        waiting.discard(block.pkey[1])
        if not waiting:
            del self._waiting[pkey]

    def _adopt(self, ns_blocks: dict[bytes, _Block], block: _Block) -> None:
        """A block just stored takes back the blocks that waited for it (it was their parent,
        then gone): linked to it again, they are reachable when it is (they were stranded)."""
        keys = self._waiting.pop(block.pkey, None)
        if keys is None:
            return
        for key in keys:
            child = ns_blocks[key]
            child.waits = None
            child.parent = block.pkey[1]
            block.add_child(key)
        if not block.stranded:
            for key in keys:
                self._unstrand(ns_blocks, ns_blocks[key])

    def _parent_hint(self, ns_blocks: dict[bytes, _Block], block: _Block) -> BlockKey | None:
        """The parent's policy key while the block is reachable through it."""
        if block.parent is None or block.stranded:
            return None
        parent = ns_blocks.get(block.parent)
        return None if parent is None else parent.pkey

    # -- pins -------------------------------------------------------------------

    def _repinned(self, block: _Block, was: bool) -> None:
        """Keep the pinned counters in step after a block's refs or leases changed."""
        now = block.refs > 0 or block.leases is not None
        if now != was:
            pages = block.pages
            self._pinned_pages += pages if now else -pages
            self._pinned_blocks += 1 if now else -1
            if not now:
                self._policy.released(block.pkey, _parent_key(block))

    def _add_leases(self, ns: str, keys: list[bytes], blocks: list[_Block], deadline: float) -> None:
        """One lease until ``deadline`` on each block (the blocks of ``keys``; one
        listed twice gets two); one heap entry covers the whole batch."""
        for block in blocks:
            leases = block.leases
            if leases is None:
                if block.refs == 0:
                    self._pinned_pages += block.pages
                    self._pinned_blocks += 1
                block.leases = [deadline]
            elif deadline >= leases[-1]:
                leases.append(deadline)
            else:
                insort(leases, deadline)
        self._leases += len(blocks)
        self._push_lease(deadline, ns, keys)

    def _push_lease(self, deadline: float, ns: str, keys: list[bytes]) -> None:
        """File a deadline for :meth:`expire_leases`. Its entry outlives a lease dropped before it
        ends (a client pinning for an hour and unpinning at once, say): once the entries
        name twice the keys the last sweep kept, :meth:`_sweep_leases` drops those."""
        heapq.heappush(self._lease_heap, (deadline, next(self._lease_seq), ns, keys))
        self._lease_heap_keys += len(keys)
        if self._lease_heap_keys > self._lease_heap_limit:
            self._sweep_leases()
            self._lease_heap_limit = 2 * self._lease_heap_keys + _LEASE_HEAP_MIN

    def _sweep_leases(self) -> None:
        """Keep the entries that still stand for a lease: every lease was filed with its very
        deadline, so a block holding ``n`` leases ending at ``t`` needs ``n`` entries at ``t``."""
        left: dict[tuple[str, bytes, float], int] = {}
        kept = []
        for entry in self._lease_heap:
            deadline, _, ns, keys = entry
            needed = False
            for key in keys:
                n = left.get((ns, key, deadline))
                if n is None:
                    block = self._find(ns, key)
                    leases = block.leases if block is not None else None
                    n = bisect_right(leases, deadline) - bisect_left(leases, deadline) if leases else 0
                if n:
                    needed = True
                    n -= 1
                left[ns, key, deadline] = n
            if needed:
                kept.append(entry)
        heapq.heapify(kept)
        self._lease_heap = kept
        self._lease_heap_keys = sum(len(e[3]) for e in kept)

    def _drop_leases(self, block: _Block, n: int) -> None:
        """Drop the block's ``n`` soonest-expiring leases."""
        assert block.leases is not None
        was = block.pinned
        del block.leases[:n]
        self._leases -= n
        if not block.leases:
            block.leases = None
        self._repinned(block, was)
