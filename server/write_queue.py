"""The write-behind queue: acknowledged blocks on their way to Redis, bounded in bytes.

Readable by key while queued (a get finds a block there before Redis has it), and taken by the
tier's one flusher in batches. A delete or flush cancels what it matches; a delete's keys are
``held`` until its ``DEL`` is answered, so a copy put after it reaches Redis after the ``DEL``.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Container, Sequence

#: A write-behind backlog that grew past this gives the C heap's free pages back once it drains:
#: its values are block-sized ``bytes``, and after the first of them is freed glibc serves that
#: size from its heap (its mmap threshold rises), which it keeps -- RSS stayed at the backlog's
#: peak (+176 MiB) after every later outage.
TRIM_AFTER_BYTES = 32 << 20
BATCH_BLOCKS = 64  # write-behind: blocks per flush round trip
BATCH_BYTES = 32 << 20  # ... and bytes at most; sized to a quarter of --redis-timeout at the rate the last
# batch went (a failed one halves it), so a link too slow for 32 MiB per timeout still drains


@dataclass(eq=False)  # identity, not the value's bytes: the queue's set of pending items holds these objects
class QueuedBlock:
    """One acknowledged block as Redis will hold it."""

    ns: str
    key: bytes
    value: bytes  # header + block, copied out of the arena
    checksum: int
    seq: int = 0  # the put's place in arrival order (a delete drops only the copies put before it)
    cancelled: bool = False  # deleted while in flight or waiting for room: not to be (re-)queued


@dataclass
class WriteQueue:
    """Acknowledged blocks not yet in Redis, bounded in bytes; readable by key."""

    limit: int
    waiting: OrderedDict[tuple[str, bytes], QueuedBlock] = field(default_factory=OrderedDict)
    inflight: dict[tuple[str, bytes], QueuedBlock] = field(default_factory=dict)
    #: Items whose put waits for room: a delete must cancel them there, or the put would queue
    #: a block deleted meanwhile and write it back into Redis.
    pending: set[QueuedBlock] = field(default_factory=set)
    nbytes: int = 0
    peak: int = 0  # the largest nbytes since the heap was last trimmed
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)
    batch_done: asyncio.Event = field(default_factory=asyncio.Event)
    #: Keys not to be taken for now: a delete of them has yet to send its DEL, and a copy put
    #: after the delete began must reach Redis after that DEL, not before it.
    held: Container[tuple[str, bytes]] = ()

    def __len__(self) -> int:
        return len(self.waiting) + len(self.inflight)

    def get(self, ns: str, key: bytes) -> QueuedBlock | None:
        """The queued block, unless a delete or flush has cancelled it (it is then only being written)."""
        item = self.waiting.get((ns, key)) or self.inflight.get((ns, key))
        return None if item is None or item.cancelled else item

    def _fits(self, item: QueuedBlock) -> bool:
        return self.nbytes == 0 or self.nbytes + len(item.value) <= self.limit

    def _may_go(self, item: QueuedBlock, refuse: Callable[[], bool]) -> bool:
        """What ``put`` waits for: the item cancelled, room for it, or a refusal."""
        return item.cancelled or self._fits(item) or refuse()

    async def put(self, items: Sequence[QueuedBlock], refuse: Callable[[], bool]) -> bool:
        """Queue ``items`` in order, each once there is room (one item larger than the limit still
        passes alone); an item a delete cancels meanwhile is dropped.

        Returns False, leaving none of ``items`` queued, if the queue is full while ``refuse()``
        holds (Redis is down: the room would come only with the end of the outage).
        """
        self.pending.update(items)  # before any await: a delete from now on must find them
        replaced: dict[int, QueuedBlock] = {}  # item index -> the waiting item it took the place of
        try:
            async with self.changed:
                for i, item in enumerate(items):
                    await self.changed.wait_for(partial(self._may_go, item, refuse))
                    self.pending.discard(item)
                    if item.cancelled:
                        continue
                    if not self._fits(item):
                        self._unqueue(items[:i], replaced)
                        return False
                    old = self.waiting.pop((item.ns, item.key), None)
                    if old is not None:
                        self.nbytes -= len(old.value)
                        replaced[i] = old
                    self.waiting[(item.ns, item.key)] = item
                    self.nbytes += len(item.value)
                    self.peak = max(self.peak, self.nbytes)
                    self.changed.notify_all()
                return True
        finally:
            self.pending.difference_update(items)

    def _unqueue(self, items: Sequence[QueuedBlock], replaced: dict[int, QueuedBlock]) -> None:
        """Take back ``items`` still waiting (their put failed; in flight, they are written anyway),
        putting back the items of earlier puts they replaced: those puts were acknowledged."""
        for i, item in enumerate(items):
            k = (item.ns, item.key)
            if self.waiting.get(k) is item:
                del self.waiting[k]
                self.nbytes -= len(item.value)
                old = replaced.get(i)
                if old is not None and not old.cancelled:
                    self.waiting[k] = old
                    self.nbytes += len(old.value)

    async def wake(self) -> None:
        """Let puts waiting for room look again (the tier went down: they are refused now), and the
        flusher (keys no longer ``held``)."""
        async with self.changed:
            self.changed.notify_all()

    async def take(self, max_bytes: int = BATCH_BYTES) -> list[QueuedBlock]:
        """The oldest blocks not ``held``, up to a batch of ``max_bytes``, moved in flight (waits for
        at least one; one block larger than ``max_bytes`` goes alone)."""
        async with self.changed:
            await self.changed.wait_for(lambda: any(k not in self.held for k in self.waiting))
            batch: list[QueuedBlock] = []
            size = 0
            for k, item in self.waiting.items():
                if k in self.held:
                    continue
                if len(batch) >= BATCH_BLOCKS or (batch and size + len(item.value) > max_bytes):
                    break
                batch.append(item)
                size += len(item.value)
            for item in batch:
                k = (item.ns, item.key)
                del self.waiting[k]
                self.inflight[k] = item
            self.batch_done.clear()
            return batch

    async def finish(self, batch: list[QueuedBlock], written: bool) -> bool:
        """Written: forget the batch. Not written: put it back at the head, in order. True when this
        drained a backlog large enough for the tier's ``_trim_heap`` to be worth it, once the caller has let
        go of the batch (its values are still referenced here)."""
        async with self.changed:
            for item in reversed(batch):
                k = (item.ns, item.key)
                self.inflight.pop(k, None)
                if written or item.cancelled or k in self.waiting:
                    self.nbytes -= len(item.value)
                else:
                    self.waiting[k] = item
                    self.waiting.move_to_end(k, last=False)
            drained = not self.waiting and not self.inflight and self.peak > TRIM_AFTER_BYTES
            if drained:
                self.peak = 0
            self.batch_done.set()
            self.changed.notify_all()
            return drained

    async def discard(self, match: Callable[[QueuedBlock], bool]) -> tuple[set[tuple[str, bytes]], bool]:
        """Drop the blocks for which ``match(item)`` holds, waiting ones and those whose put waits
        for room: the keys dropped, and True if any matching block is in flight (cancelled, so not
        re-queued; the caller waits for its write to land)."""
        async with self.changed:
            dropped = {k for k, item in self.waiting.items() if match(item)}
            for k in dropped:
                self.nbytes -= len(self.waiting.pop(k).value)
            for item in self.pending:
                if match(item) and not item.cancelled:
                    item.cancelled = True
                    dropped.add((item.ns, item.key))
            hit = [item for item in self.inflight.values() if match(item)]
            for item in hit:
                item.cancelled = True
            self.changed.notify_all()
            return dropped, bool(hit)
