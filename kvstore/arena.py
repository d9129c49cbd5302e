"""A pre-allocated, pre-faulted memory region handed out in fixed-size pages.

Why: copying a payload into freshly allocated memory runs at page-fault speed
(~1 GB/s on a small VM), into already touched memory at memcpy speed (tens of
GB/s). The server therefore receives block payloads straight into pages of one
big region that was faulted in once, at start-up.

Contract of the primitives:

- ``Arena(capacity, page_size)`` maps ``capacity`` bytes rounded down to whole
  pages (at least one page) of anonymous memory, populated up front
  (``MAP_POPULATE`` where the OS has it, else one write per OS page).
- ``alloc(nbytes)`` returns an :data:`Extent` of ``ceil(nbytes / page_size)``
  pages, or ``None`` (changing nothing) when fewer pages are free. The pages of
  an extent need not be contiguous, so there is no external fragmentation: any
  request that fits the free page count succeeds. A whole free run of the
  right size is preferred (best fit), so a fresh arena, and blocks that reuse
  freed blocks of the same size, get one run each -- one view, one
  ``recv_into``.
- ``free(extent)`` returns its pages; freed runs coalesce with free neighbours.
  Freeing pages that are not allocated (a double free) raises ``ValueError``
  and changes nothing.
- ``views(extent, nbytes)`` returns writable memoryviews covering exactly the
  first ``nbytes`` of the extent, one per run of consecutive pages, in order.

- ``Arena(..., shared=True)`` backs the region with a sealed memfd mapped
  ``MAP_SHARED`` instead (Linux): ``fd`` can then be passed to a same-host
  client (SCM_RIGHTS, see ``docs/shm.md``), which maps the very same pages.
  The memfd is sealed against shrinking and growing, so a client holding the
  fd cannot truncate it under the server (which would SIGBUS on access).

Cost: ``alloc`` and ``free`` touch a few dicts per run, never each page; the
only per-page state is one byte in a bytearray (the allocation map that
catches double frees). Not thread-safe: the server runs it on one event loop.
"""

from __future__ import annotations

import mmap
import os
from bisect import bisect_left, insort
import weakref

#: The pages of one block: ``(first_page, n_pages)`` runs, never adjacent to
#: one another (free runs are coalesced, so two pieces never touch).
Extent = tuple[tuple[int, int], ...]


def _map_region(size: int, prefault: bool) -> mmap.mmap:
    """Map ``size`` bytes of private anonymous memory, faulted in when asked.

    MAP_POPULATE faults the whole region in one system call (0.3-3 s per GiB, by machine);
    transparent huge pages were measured slower to set up on this class of VM.
    """
    anonymous = getattr(mmap, "MAP_ANONYMOUS", None)
    if anonymous is None:  # Windows: mmap(-1, n) is anonymous already
        region = mmap.mmap(-1, size)
        populate = 0
    else:
        populate = getattr(mmap, "MAP_POPULATE", 0) if prefault else 0
        region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | anonymous | populate)
    if prefault and not populate:
        step = mmap.PAGESIZE
        with memoryview(region) as whole:
            whole[::step] = bytes(len(range(0, size, step)))  # one write per OS page
    return region


def _shared_memfd(size: int) -> int:
    """A sealed memfd of ``size`` bytes: the shareable backing of a ``shared`` arena.

    Sealed against shrink and grow (and further sealing) so that a client we
    hand the fd to cannot truncate it: the server would take SIGBUS touching a
    page past the new end. Close-on-exec: a child process never inherits it.
    """
    import fcntl

    fd = os.memfd_create("kvstore-arena", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _map_shared(fd: int, size: int, prefault: bool) -> mmap.mmap:
    """Map a memfd ``MAP_SHARED`` read-write, populated up front when asked."""
    populate = getattr(mmap, "MAP_POPULATE", 0) if prefault else 0
    return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | populate, prot=mmap.PROT_READ | mmap.PROT_WRITE)


def byte_runs(extent: Extent, nbytes: int, page_size: int) -> list[tuple[int, int]]:
    """``(offset, length)`` in the region of the first ``nbytes`` of ``extent``, one per run, in order."""
    out = []
    left = nbytes
    for start, n in extent:
        if left <= 0:
            break
        length = min(n * page_size, left)
        out.append((start * page_size, length))
        left -= length
    return out


class Arena:
    """``capacity`` bytes of pre-faulted memory split into fixed-size pages."""

    def __init__(self, capacity: int, page_size: int = 64 * 1024, *, prefault: bool = True,
                 shared: bool = False) -> None:
        """Map and (by default) pre-fault the region.

        Args:
            shared: back the region with a sealed memfd mapped ``MAP_SHARED``
                (its descriptor is ``fd``) so same-host clients can map it.

        Raises:
            ValueError: ``capacity`` or ``page_size`` is not a positive int.
            OSError: ``shared`` where memfds are not available.
        """
        for name, value in (("capacity", capacity), ("page_size", page_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.page_size: int = page_size
        self.num_pages: int = max(1, capacity // page_size)
        self.capacity: int = self.num_pages * page_size
        self.free_pages: int = self.num_pages
        #: The memfd behind a ``shared`` arena (None otherwise); closed with the arena's last reference.
        self.fd: int | None = None
        if shared:
            if not hasattr(os, "memfd_create"):
                raise OSError("a shared arena needs memfd_create (Linux)")
            self.fd = _shared_memfd(self.capacity)
            weakref.finalize(self, os.close, self.fd)
            self._region = _map_shared(self.fd, self.capacity, prefault)
        else:
            self._region = _map_region(self.capacity, prefault)
        self.buffer: memoryview = memoryview(self._region)
        self._readonly = self.buffer.toreadonly()  # what readers' views are cut from
        # One byte per page, 1 = allocated: O(run) checks against double frees.
        self._used = bytearray(self.num_pages)
        self._ones = memoryview(b"\x01" * self.num_pages)
        self._zeros = memoryview(bytes(self.num_pages))
        # Free runs, three ways: by start, by end (to coalesce), by length (best fit).
        self._runs: dict[int, int] = {}
        self._run_ends: dict[int, int] = {}
        self._bins: dict[int, dict[int, None]] = {}
        self._lengths: list[int] = []  # sorted distinct lengths of free runs
        self._add_run(0, self.num_pages)

    @property
    def used_bytes(self) -> int:
        """Bytes in allocated pages (whole pages, so at least the payload)."""
        return (self.num_pages - self.free_pages) * self.page_size

    @property
    def free_bytes(self) -> int:
        return self.free_pages * self.page_size

    def pages_for(self, nbytes: int) -> int:
        """Pages that ``alloc(nbytes)`` takes."""
        return -(-nbytes // self.page_size)

    @staticmethod
    def pages(extent: Extent) -> int:
        """Pages an extent holds."""
        return sum(n for _, n in extent)

    def alloc(self, nbytes: int) -> Extent | None:
        """Take ``ceil(nbytes / page_size)`` pages, as few runs as possible.

        Returns:
            The extent, ``()`` for ``nbytes == 0``, or ``None`` (nothing
            changed) when not enough pages are free.

        Raises:
            ValueError: ``nbytes`` is negative.
        """
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        need = self.pages_for(nbytes)
        if need > self.free_pages:
            return None
        runs: list[tuple[int, int]] = []
        while need:
            start, taken = self._take(need)
            runs.append((start, taken))
            self._used[start : start + taken] = self._ones[:taken]
            self.free_pages -= taken
            need -= taken
        return tuple(runs)

    def free(self, extent: Extent) -> None:
        """Return an extent's pages; they coalesce with free neighbours.

        Raises:
            ValueError: a page of the extent is not allocated (double free or
                a foreign extent); nothing is freed then.
        """
        used = self._used
        for start, n in extent:
            if n <= 0 or start < 0 or start + n > self.num_pages or used.count(0, start, start + n):
                raise ValueError(f"pages {start}..{start + n - 1} are not allocated (double free?)")
        if len(extent) > 1:
            runs = sorted(extent)
            if any(start + n > nxt for (start, n), (nxt, _) in zip(runs, runs[1:])):
                raise ValueError(f"extent {extent} has overlapping runs (not one this arena gave out)")
        for start, n in extent:
            used[start : start + n] = self._zeros[:n]
            self.free_pages += n
            self._release(start, n)

    def views(self, extent: Extent, nbytes: int, *, readonly: bool = False) -> list[memoryview]:
        """Views over exactly the first ``nbytes`` of ``extent``, one per run
        (writable, or ``readonly`` for a reader).

        Raises:
            ValueError: ``nbytes`` is negative or larger than the extent.
        """
        page_size = self.page_size
        buffer = self._readonly if readonly else self.buffer
        if len(extent) == 1:  # the usual case, kept cheap: it runs once per block sent or received
            start, n = extent[0]
            if not 0 <= nbytes <= n * page_size:
                raise ValueError(f"nbytes {nbytes} does not fit the extent")
            return [buffer[start * page_size : start * page_size + nbytes]] if nbytes else []
        if nbytes < 0 or nbytes > self.pages(extent) * page_size:
            raise ValueError(f"nbytes {nbytes} does not fit the extent")
        return [buffer[offset : offset + size] for offset, size in byte_runs(extent, nbytes, page_size)]

    def __repr__(self) -> str:
        return (
            f"Arena(capacity={self.capacity}, page_size={self.page_size}, "
            f"free_pages={self.free_pages}/{self.num_pages}, free_runs={len(self._runs)})"
        )

    # -- free-run bookkeeping -------------------------------------------------

    def _take(self, need: int) -> tuple[int, int]:
        """Remove and return ``(start, n)``: ``need`` pages from the best-fitting
        free run, or the largest run whole when none is long enough."""
        lengths = self._lengths
        i = bisect_left(lengths, need)
        length = lengths[i] if i < len(lengths) else lengths[-1]
        start = self._pop_run(length)
        if length > need:  # split: keep the tail free, so the run stays contiguous
            self._add_run(start + need, length - need)
            length = need
        return start, length

    def _release(self, start: int, n: int) -> None:
        """Make pages ``start .. start+n-1`` a free run, merged with its neighbours."""
        left = self._run_ends.get(start)
        if left is not None:
            left_len = self._runs[left]
            self._del_run(left, left_len)
            start, n = left, n + left_len
        right_len = self._runs.get(start + n)
        if right_len is not None:
            self._del_run(start + n, right_len)
            n += right_len
        self._add_run(start, n)

    def _add_run(self, start: int, n: int) -> None:
        self._runs[start] = n
        self._run_ends[start + n] = start
        bin_ = self._bins.get(n)
        if bin_ is None:
            self._bins[n] = {start: None}
            insort(self._lengths, n)
        else:
            bin_[start] = None

    def _del_run(self, start: int, n: int) -> None:
        del self._runs[start]
        del self._run_ends[start + n]
        bin_ = self._bins[n]
        del bin_[start]
        if not bin_:
            self._drop_length(n)

    def _pop_run(self, n: int) -> int:
        """Remove the most recently freed run of length ``n`` (its pages are warm)."""
        bin_ = self._bins[n]
        start, _ = bin_.popitem()
        del self._runs[start]
        del self._run_ends[start + n]
        if not bin_:
            self._drop_length(n)
        return start

    def _drop_length(self, n: int) -> None:
        del self._bins[n]
        del self._lengths[bisect_left(self._lengths, n)]
