"""Eviction policies: the order in which unpinned blocks are dropped.

A policy knows keys only (the store uses ``(namespace, key_bytes)`` tuples);
the store owns the blocks, pins and leases. Contract of :class:`EvictionPolicy`:

- ``add(key, parent=None)``: ``key`` was just stored. It becomes the most
  recent key -- unless ``parent`` (its predecessor in a chain) is tracked in
  the same list, in which case it goes *just before* the parent: a block is
  never worth more than its predecessor, because a prefix lookup cannot reach
  it without it. A put batch arrives head first, so this keeps each chain's
  tail ahead of its head in the eviction queue.
- ``touch(keys, parent=None)``: ``keys`` were accessed together, in chain
  order. ``keys[0]`` becomes the most recent (or goes just before ``parent``)
  and each later key goes just before the previous one: among equally recent
  blocks, the later blocks of a chain are evicted first. Unknown keys are
  ignored; a demoted key that is touched is live again.
- ``remove(key)``: the store deleted ``key``; no trace is kept (no ghost).
  Unknown keys are ignored.
- ``demote(key)``: ``key`` is stranded (its predecessor is gone), so it is
  evicted before every live key; stranded keys leave in demotion order.
- ``evict(protected, stranded_only=False)``: pick exactly one key for which
  ``protected(key)`` is false, drop it from the resident structures and
  return it -- or return ``None``. A protected key it passes over is set aside
  until ``released``, so however many keys are pinned, each costs one step,
  not one per eviction. ``stranded_only``: only a stranded key.
- ``released(key, parent=None)``: ``key`` is no longer protected. Set aside,
  it goes back to the back of its list, as if just used (it was in use:
  leased for a load, or being read) -- but just before ``parent`` where that
  is in the same list, as ``add`` places it. Otherwise nothing happens; the
  store calls it whenever a block's last pin ends, and for keys it had
  ``evict`` pass over for one eviction only. A set-aside key that is touched
  is placed at once.
- ``len(policy)`` and ``key in policy`` count resident keys (live, stranded
  and set aside).

Policies are chosen by name: :data:`POLICIES` and :func:`make_policy`.
vLLM's ``vllm/v1/kv_offload`` (LRU and ARC behind one cache-policy interface,
"evict exactly n, skipping protected keys, or return None and change
nothing") is the precedent; chain order, stranding and setting pinned keys
aside are kvstore's own.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable
from typing import Any, ClassVar, Generic, TypeVar

K = TypeVar("K", bound=Hashable)

# Sentinel of the circular lists: before it is the back (most valuable end).
_END: Any = object()


class _Order(Generic[K]):
    """Keys from the next victim (front) to the most valuable (back).

    A doubly linked list threaded through two dicts: unlike an OrderedDict,
    which only moves keys to its ends, it inserts next to any member in O(1),
    which placing a block just before its chain predecessor needs.
    """

    __slots__ = ("_next", "_prev")

    def __init__(self) -> None:
        self._next: dict[Any, Any] = {_END: _END}
        self._prev: dict[Any, Any] = {_END: _END}

    def __len__(self) -> int:
        return len(self._next) - 1

    def __contains__(self, key: object) -> bool:
        return key in self._next

    def insert_before(self, key: K, anchor: Any) -> None:
        """Link ``key`` (not a member) just before ``anchor`` (a member or _END)."""
        before = self._prev[anchor]
        self._next[before] = key
        self._prev[key] = before
        self._next[key] = anchor
        self._prev[anchor] = key

    def place_run(self, keys: list[K], anchor: Any) -> bool:
        """Stand ``keys`` in order just before ``anchor`` (keys[0] nearest) if they form
        that run somewhere already: in place (nothing changes) or elsewhere (spliced out
        and in, O(1)). False, changing nothing, when they do not form a run, or the run
        holds the anchor: the caller then moves them one by one.

        A chain read again is usually such a run: stored as a batch or read before, and
        in place unless other chains were touched since. One C loop decides it (it runs
        on every lookup and batch read of a chain).
        """
        if not keys:
            return True
        prev, nxt = self._prev, self._next
        front, back = keys[-1], keys[0]
        if (list(map(prev.get, keys[:-1])) != keys[1:]) if len(keys) > 1 else back not in prev:
            return False
        if prev[anchor] == back:
            return True  # in place already
        if anchor is not _END and anchor in keys:
            return False
        before, after = prev[front], nxt[back]
        nxt[before], prev[after] = after, before
        last = prev[anchor]
        nxt[last], prev[front] = front, last
        nxt[back], prev[anchor] = anchor, back
        return True

    def discard(self, key: K) -> bool:
        """Unlink ``key``; False when it was not a member."""
        after = self._next.pop(key, _END)
        if after is _END and key not in self._prev:
            return False
        before = self._prev.pop(key)
        self._next[before] = after
        self._prev[after] = before
        return True

    def pop_victim(self, protected: Callable[[K], bool], aside: dict[K, Any]) -> K | None:
        """Unlink and return the front-most unprotected key, or None; the protected keys
        before it are unlinked too, into ``aside`` (key -> this order)."""
        nxt = self._next
        key = nxt[_END]
        while key is not _END:
            after = nxt[key]
            self.discard(key)
            if not protected(key):
                return key  # type: ignore[no-any-return]
            aside[key] = self
            key = after
        return None

    def append(self, key: K) -> None:
        """Link ``key`` (not a member) at the back."""
        self.insert_before(key, _END)

    def __iter__(self) -> Any:
        key = self._next[_END]
        while key is not _END:
            yield key
            key = self._next[key]


class _Queue(OrderedDict):  # type: ignore[type-arg]
    """The stranded keys, first demoted first out."""

    def pop_victim(self, protected: Callable[[Any], bool], aside: dict[Any, Any]) -> Any:
        """As :meth:`_Order.pop_victim`."""
        while self:
            key, _ = self.popitem(last=False)
            if not protected(key):
                return key
            aside[key] = self
        return None

    def append(self, key: Any) -> None:
        self[key] = None


class EvictionPolicy(ABC, Generic[K]):
    """Orders resident keys for eviction; see the module docstring for the contract."""

    name: ClassVar[str]

    @abstractmethod
    def add(self, key: K, parent: K | None = None) -> None:
        """Track a newly stored key (most recent, or just before ``parent``)."""

    @abstractmethod
    def touch(self, keys: Iterable[K], parent: K | None = None) -> None:
        """Record one access of ``keys`` in chain order (first = most valuable)."""

    @abstractmethod
    def remove(self, key: K) -> None:
        """Forget a key the store deleted (unknown keys are ignored)."""

    @abstractmethod
    def demote(self, key: K) -> None:
        """Mark a key stranded: evict it before anything still reachable."""

    @abstractmethod
    def evict(self, protected: Callable[[K], bool], stranded_only: bool = False) -> K | None:
        """Remove and return one unprotected key (setting aside the protected keys passed over), or None."""

    @abstractmethod
    def released(self, key: K, parent: K | None = None) -> None:
        """``key`` is no longer protected: a key set aside goes back, as just used (not past ``parent``)."""

    @abstractmethod
    def __len__(self) -> int:
        """Resident keys (live and stranded)."""

    @abstractmethod
    def __contains__(self, key: object) -> bool:
        """Whether ``key`` is resident."""


class _ChainPolicy(EvictionPolicy[K]):
    """What LRU and ARC share: the stranded queue, the keys set aside, chain-ordered placement."""

    def __init__(self) -> None:
        self._stranded = _Queue()  # FIFO: the first demoted leaves first
        self._aside: dict[K, Any] = {}  # protected keys evict() passed over -> the list they left

    def released(self, key: K, parent: K | None = None) -> None:
        home = self._aside.pop(key, None)
        if isinstance(home, _Order) and parent is not None and parent in home:
            home.insert_before(key, parent)  # (back at the end, it would outlive its parent)
        elif home is not None:
            home.append(key)

    def __len__(self) -> int:
        return self._resident() + len(self._aside)

    def __contains__(self, key: object) -> bool:
        return key in self._aside or self._holds(key)

    @abstractmethod
    def _resident(self) -> int:
        """Keys in the lists (not set aside)."""

    @abstractmethod
    def _holds(self, key: object) -> bool:
        """Whether ``key`` is in one of the lists."""

    def _place(self, order: _Order[K], keys: Iterable[K], anchor: Any, take: Callable[[K], bool]) -> None:
        """Put ``keys`` into ``order``: the first just before ``anchor``, each
        later one just before the previous. ``take`` unlinks a key from wherever
        it is and says whether it was resident; non-resident keys are skipped."""
        if isinstance(keys, list) and order.place_run(keys, anchor):
            return  # in place already, or a run spliced from elsewhere: not moved key by key
        for key in keys:
            if key == anchor or not take(key):
                continue
            order.insert_before(key, anchor)
            anchor = key

    def _evict_stranded(self, protected: Callable[[K], bool]) -> K | None:
        return self._stranded.pop_victim(protected, self._aside)  # type: ignore[no-any-return]

    def _unstrand(self, key: K) -> bool:
        """Take ``key`` out of the stranded queue, or from the keys set aside."""
        return self._stranded.pop(key, _END) is not _END or self._aside.pop(key, _END) is not _END

    def _demote_aside(self, key: K) -> None:
        """A set-aside key stranded meanwhile goes back to the stranded queue when released."""
        if key in self._aside:
            self._aside[key] = self._stranded


class LRUPolicy(_ChainPolicy[K]):
    """Least recently used first; within one access, later chain blocks first."""

    name: ClassVar[str] = "lru"

    def __init__(self) -> None:
        super().__init__()
        self._live: _Order[K] = _Order()

    def _resident(self) -> int:
        return len(self._live) + len(self._stranded)

    def _holds(self, key: object) -> bool:
        return key in self._live or key in self._stranded

    def add(self, key: K, parent: K | None = None) -> None:
        if key in self:
            self.touch((key,), parent)
        else:
            self._live.insert_before(key, self._anchor(parent))

    def touch(self, keys: Iterable[K], parent: K | None = None) -> None:
        keys = keys if isinstance(keys, list) else list(keys)
        self._place(self._live, keys, self._anchor(parent), self._take)

    def remove(self, key: K) -> None:
        self._take(key)

    def demote(self, key: K) -> None:
        if self._live.discard(key):
            self._stranded[key] = None
        else:
            self._demote_aside(key)

    def evict(self, protected: Callable[[K], bool], stranded_only: bool = False) -> K | None:
        victim = self._evict_stranded(protected)
        if victim is None and not stranded_only:
            victim = self._live.pop_victim(protected, self._aside)
        return victim

    def _anchor(self, parent: K | None) -> Any:
        return parent if parent is not None and parent in self._live else _END

    def _take(self, key: K) -> bool:
        return self._live.discard(key) or self._unstrand(key)


class ARCPolicy(_ChainPolicy[K]):
    """Adaptive Replacement Cache (Megiddo & Modha, FAST 2003), counted in blocks.

    T1 holds keys seen once, T2 keys seen again; B1/B2 remember keys recently
    evicted from each (ghosts, keys only). A re-added key found in B1 means T1
    was too small, so the target size ``p`` of T1 grows; found in B2, it shrinks.
    The cache size ``c`` of the paper is the number of resident blocks when an
    eviction happens (blocks differ in size, so there is no fixed count);
    ghosts are trimmed to ``|T1|+|B1| <= c`` and ``|T1|+|T2|+|B1|+|B2| <= 2c``.
    Evicting a stranded key leaves no ghost: its eviction says nothing about
    recency against frequency.
    """

    name: ClassVar[str] = "arc"

    def __init__(self) -> None:
        super().__init__()
        self._t1: _Order[K] = _Order()
        self._t2: _Order[K] = _Order()
        self._b1: OrderedDict[K, None] = OrderedDict()
        self._b2: OrderedDict[K, None] = OrderedDict()
        self.p: float = 0.0  # target size of T1, in blocks

    def _resident(self) -> int:
        return len(self._t1) + len(self._t2) + len(self._stranded)

    def _holds(self, key: object) -> bool:
        return key in self._t1 or key in self._t2 or key in self._stranded

    def ghosts(self) -> tuple[int, int]:
        """Sizes of B1 and B2 (for tests and stats)."""
        return len(self._b1), len(self._b2)

    def add(self, key: K, parent: K | None = None) -> None:
        if key in self:
            self.touch((key,), parent)
            return
        target = self._t2
        if key in self._b1:  # evicted from T1 too early: favour recency
            self.p = min(self.p + max(1.0, len(self._b2) / len(self._b1)), float(len(self) + 1))
            del self._b1[key]
        elif key in self._b2:  # evicted from T2 too early: favour frequency
            self.p = max(self.p - max(1.0, len(self._b1) / len(self._b2)), 0.0)
            del self._b2[key]
        else:
            target = self._t1
        if parent is not None and parent in self._t1:
            target = self._t1  # never worth more than its predecessor: it goes first, from T1
        target.insert_before(key, parent if parent is not None and parent in target else _END)

    def touch(self, keys: Iterable[K], parent: K | None = None) -> None:
        if parent is not None and parent in self._t1:  # (a suffix read after a head seen once: stays in T1)
            self._place(self._t1, keys if isinstance(keys, list) else list(keys), parent, self._take)
            return
        anchor = parent if parent is not None and parent in self._t2 else _END
        self._place(self._t2, keys, anchor, self._take)

    def remove(self, key: K) -> None:
        self._take(key)

    def demote(self, key: K) -> None:
        if self._t1.discard(key) or self._t2.discard(key):
            self._stranded[key] = None
        else:
            self._demote_aside(key)

    def evict(self, protected: Callable[[K], bool], stranded_only: bool = False) -> K | None:
        victim = self._evict_stranded(protected)
        if victim is not None or stranded_only:
            return victim
        size = len(self)
        if len(self._t1) > self.p:
            lists = ((self._t1, self._b1), (self._t2, self._b2))
        else:
            lists = ((self._t2, self._b2), (self._t1, self._b1))
        for resident, ghosts in lists:
            victim = resident.pop_victim(protected, self._aside)
            if victim is not None:
                ghosts[victim] = None
                self._trim_ghosts(size)
                return victim
        return None

    def _trim_ghosts(self, c: int) -> None:
        t1, b1, b2 = len(self._t1), self._b1, self._b2
        while b1 and t1 + len(b1) > c:
            b1.popitem(last=False)
        while b2 and t1 + len(self._t2) + len(b1) + len(b2) > 2 * c:
            b2.popitem(last=False)

    def _take(self, key: K) -> bool:
        return self._t1.discard(key) or self._t2.discard(key) or self._unstrand(key)


POLICIES: dict[str, type[EvictionPolicy[Any]]] = {"lru": LRUPolicy, "arc": ARCPolicy}


def make_policy(name: str) -> EvictionPolicy[Any]:
    """A fresh policy by name.

    Raises:
        ValueError: unknown name (the message lists the valid ones).
    """
    try:
        cls = POLICIES[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown eviction policy {name!r}; choose one of {', '.join(POLICIES)}") from None
    return cls()
