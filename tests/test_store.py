"""BlockStore scenarios, in the style of vLLM's kv_offload manager tests.

Blocks are one page (1 KiB) unless said otherwise, so "capacity 4" means four
blocks. Comments narrate each step: ``# put [4] -> evicts [0]``.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import pytest

from kvstore.errors import CapacityError, InvalidRequest, TooLarge
from kvstore.keys import MAX_KEY_LEN, check_key, check_keys
from kvstore.store import BlockRef, BlockStore, Keep
import kvstore.store as store_module

PS = 1024
NS = "model/bf16/tp0"


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(params=["lru", "arc"])
def policy(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def make(policy: str, blocks: int, clock: FakeClock | None = None, **kw: object) -> BlockStore:
    return BlockStore(blocks * PS, eviction=policy, page_size=PS, clock=clock or FakeClock(), **kw)  # type: ignore[arg-type]


def k(name: object) -> bytes:
    return f"key-{name}".encode()


def data(name: object, size: int = PS) -> bytes:
    seed = sum(k(name))
    return bytes((seed + i) % 256 for i in range(size))


def put_batch(store: BlockStore, names: Sequence[object], ns: str = NS, size: int = PS,
              after: object | None = None) -> list[bool]:
    """What the server does for one PUT: reserve, receive, commit with the previous key as parent
    (``after``, the PUT's parent, for the first: the chain it continues is kept)."""
    keep = None if after is None else Keep(ns, k(after))
    out = []
    for i, name in enumerate(names):
        res = store.reserve(ns, k(name), size, checksum=i, keep=keep)
        if res is None:
            out.append(False)
            continue
        payload = data(name, size)
        offset = 0
        for view in res.views:
            view[:] = payload[offset : offset + len(view)]
            offset += len(view)
        out.append(store.commit(res, parent=k(names[i - 1]) if i else None if after is None else k(after)))
    return out


def present(store: BlockStore, names: Sequence[object], ns: str = NS) -> list[object]:
    return [name for name, ok in zip(names, store.exists(ns, [k(n) for n in names]), strict=True) if ok]


# -- basics ---------------------------------------------------------------------


def test_put_get_roundtrip_across_pages(policy: str) -> None:
    store = make(policy, 8)
    payload = data("big", 3 * PS + 500)
    assert store.put(NS, k("big"), payload, checksum=42)
    assert store.get(NS, k("big")) == payload
    ref = store.acquire(NS, k("big"))
    assert ref is not None and (ref.size, ref.checksum) == (len(payload), 42)
    store.release(ref)
    stats = store.stats()
    assert (stats["blocks"], stats["bytes"], stats["used_bytes"], stats["stored"]) == (1, len(payload), 4 * PS, 1)
    assert store.get(NS, k("missing")) is None and store.acquire(NS, k("missing")) is None


def test_zero_byte_block_holds_one_page(policy: str) -> None:
    store = make(policy, 2)
    assert store.put(NS, k("empty"), b"")
    assert store.get(NS, k("empty")) == b""
    assert store.stats()["used_bytes"] == PS


def test_check_key_contract() -> None:
    assert check_key(b"x") == b"x" and check_key(b"x" * MAX_KEY_LEN) == b"x" * MAX_KEY_LEN
    for bad in (b"", b"x" * (MAX_KEY_LEN + 1), "text", None, bytearray(b"ab"), 7):
        with pytest.raises(InvalidRequest):
            check_key(bad)


def test_check_keys_names_the_bad_key_of_a_batch() -> None:
    good = [b"a" * n for n in (1, 16, MAX_KEY_LEN)]
    check_keys(good)
    check_keys([])
    for bad in (b"", b"x" * (MAX_KEY_LEN + 1), "text", None, bytearray(b"ab"), 7):
        with pytest.raises(InvalidRequest, match="block key must be"):
            check_keys([*good[:2], bad, good[2]])


def test_invalid_requests_are_rejected_before_any_effect(policy: str) -> None:
    store = make(policy, 4)
    assert store.put(NS, k(0), data(0))
    bad_key = b"x" * (MAX_KEY_LEN + 1)
    calls: list[Callable[[], object]] = [
        lambda: store.reserve(NS, bad_key, 10),
        lambda: store.reserve(NS, k(1), -1),
        lambda: store.reserve(NS, k(1), 1.5),  # type: ignore[arg-type]
        lambda: store.reserve(b"ns", k(1), 10),  # type: ignore[arg-type]
        lambda: store.lookup(NS, [k(0), b""]),
        lambda: store.lookup(NS, [k(0), k(5), bad_key]),  # after the first miss, every key is checked
        lambda: store.lookup(NS, [k(0), [b"unhashable"]]),  # type: ignore[list-item]
        lambda: store.lookup("never-used", [k(0), 7]),  # type: ignore[list-item]
        lambda: store.acquire_many(NS, [k(0), "text", k(0)]),  # type: ignore[list-item]
        lambda: store.acquire_many(NS, [{}]),  # type: ignore[list-item]
        lambda: store.lookup(NS, [k(0)], pin=True, lease_s=-1),
        lambda: store.lookup(NS, [k(0)], pin=True, lease_s=float("inf")),
        lambda: store.exists(NS, [k(0), "k"]),  # type: ignore[list-item]
        lambda: store.delete(NS, [k(0), bad_key]),
        lambda: store.unpin(NS, [bad_key]),
        lambda: store.acquire(NS, b""),
    ]
    for call in calls:
        with pytest.raises(InvalidRequest):
            call()
    stats = store.stats()
    assert store.exists(NS, [k(0)]) == [True]  # the delete with a bad key deleted nothing
    assert (stats["lookups"], stats["leases"], stats["used_bytes"], stats["pinned_blocks"]) == (0, 0, PS, 0)


def test_too_large_and_bad_configuration(policy: str) -> None:
    store = make(policy, 4, max_block_size=2 * PS)
    with pytest.raises(TooLarge):
        store.reserve(NS, k(0), 2 * PS + 1)
    with pytest.raises(TooLarge):
        make(policy, 4).reserve(NS, k(0), 4 * PS + 1)
    with pytest.raises(ValueError, match="lru"):
        BlockStore(PS, eviction="mru")
    with pytest.raises(ValueError):
        BlockStore(PS, lease_s=0)
    for bad in (-1, 1.5, True, "8"):
        with pytest.raises(ValueError, match="max_leases"):
            BlockStore(PS, max_leases=bad)  # type: ignore[arg-type]


def test_another_stores_reservations_and_references_are_refused(policy: str) -> None:
    """A reservation or reference carries its store's arena: taken by another store it would free
    (or publish) that store's pages under a block of this one."""
    mine, other = make(policy, 4), make(policy, 4)
    mine.put(NS, k("mine"), data("mine"))
    other.put(NS, k("theirs"), data("theirs"))
    res = other.reserve(NS, k("r"), PS)
    ref = other.acquire(NS, k("theirs"))
    assert res is not None and ref is not None
    with pytest.raises(InvalidRequest):
        mine.commit(res)
    with pytest.raises(InvalidRequest):
        mine.abort(res)
    with pytest.raises(InvalidRequest):
        mine.release(ref)
    assert mine.get(NS, k("mine")) == data("mine")
    assert mine.stats()["used_bytes"] == PS and mine.stats()["pinned_blocks"] == 0
    assert other.stats()["reserved_bytes"] == PS and other.stats()["pinned_blocks"] == 1
    other.commit(res)
    other.release(ref)
    assert other.stats()["reserved_bytes"] == 0 and other.stats()["pinned_blocks"] == 0


def test_a_lease_taken_with_a_key_of_another_type_ends(policy: str, clock: FakeClock) -> None:
    store = make(policy, 4, clock)
    store.put(NS, k(1), data(1))
    view = memoryview(k(1))  # equal to the key and hashing like it
    assert store.lookup(NS, [view], pin=True, lease_s=1) == 1
    view.release()  # (the store must not have kept it)
    clock.now += 2
    store.expire_leases()
    assert store.stats()["leases"] == 0 and store.stats()["pinned_blocks"] == 0


def test_a_shared_arenas_descriptor_goes_with_the_store() -> None:
    import gc
    import os

    store = BlockStore(4 * PS, page_size=PS, shared_arena=True)
    fd = store.arena.fd
    assert fd is not None and os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:")
    del store
    gc.collect()
    assert not os.path.exists(f"/proc/self/fd/{fd}") or not os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:")


def test_dedup_keeps_the_first_copy(policy: str) -> None:
    store = make(policy, 4)
    # put [a] -> stored; put [a] again -> existed, bytes discarded
    assert store.put(NS, k("a"), data("a"))
    assert not store.put(NS, k("a"), data("other"))
    assert store.reserve(NS, k("a"), PS) is None
    assert store.get(NS, k("a")) == data("a")
    stats = store.stats()
    assert (stats["blocks"], stats["stored"], stats["dedup"], stats["used_bytes"]) == (1, 1, 2, PS)


def test_namespaces_are_isolated(policy: str) -> None:
    store = make(policy, 8)
    assert store.put("A", k(1), b"in A")
    assert store.put("B", k(1), b"in B!")  # same key bytes, another block
    assert (store.get("A", k(1)), store.get("B", k(1))) == (b"in A", b"in B!")
    assert store.lookup("C", [k(1)]) == 0
    assert store.delete("A", [k(1)]) == 1
    assert store.exists("A", [k(1)]) == [False] and store.exists("B", [k(1)]) == [True]
    assert store.namespaces() == {"B": {"blocks": 1, "bytes": 5}}


def test_flush_empties_one_namespace(policy: str) -> None:
    store = make(policy, 8)
    put_batch(store, [0, 1, 2], ns="A")
    put_batch(store, [0, 1], ns="B")
    assert store.namespaces() == {"A": {"blocks": 3, "bytes": 3 * PS}, "B": {"blocks": 2, "bytes": 2 * PS}}
    assert store.flush("A") == 3 and store.flush("A") == 0
    assert store.namespaces() == {"B": {"blocks": 2, "bytes": 2 * PS}}
    assert store.stats()["used_bytes"] == 2 * PS


def test_lookup_returns_the_present_prefix(policy: str) -> None:
    store = make(policy, 8)
    put_batch(store, [0, 1, 2, 4])
    # lookup [0 1 2 3 4] -> 3 (3 is missing, so 4 cannot count)
    assert store.lookup(NS, [k(i) for i in range(5)]) == 3
    assert store.lookup(NS, [k(9), k(0)]) == 0
    assert store.lookup(NS, []) == 0
    stats = store.stats()
    assert (stats["lookups"], stats["lookup_hit_keys"], stats["lookup_miss_keys"]) == (3, 3, 4)


def test_stats_are_plain_ints(policy: str) -> None:
    store = make(policy, 4)
    stats: dict[str, object] = dict(store.stats())
    assert stats.pop("eviction") == policy
    expected = {
        "blocks", "bytes", "used_bytes", "capacity", "free_bytes", "reserved_bytes", "pinned_blocks", "stranded_blocks", "leases",
        "evictions", "evicted_bytes", "stored", "dedup", "lookups", "lookup_hit_keys", "lookup_miss_keys", "page_size",
    }  # fmt: skip
    assert set(stats) == expected
    assert all(type(v) is int for v in stats.values())
    assert (stats["capacity"], stats["free_bytes"], stats["page_size"]) == (4 * PS, 4 * PS, PS)


# -- the write path ---------------------------------------------------------------


def test_reservation_is_invisible_until_commit(policy: str) -> None:
    store = make(policy, 4)
    res = store.reserve(NS, k(0), 2 * PS - 1)
    assert res is not None and sum(len(v) for v in res.views) == 2 * PS - 1
    assert all(not v.readonly for v in res.views)
    assert store.exists(NS, [k(0)]) == [False]
    assert store.lookup(NS, [k(0)]) == 0 and store.get(NS, k(0)) is None
    assert store.stats()["reserved_bytes"] == 2 * PS and store.stats()["used_bytes"] == 2 * PS
    res.views[0][:3] = b"abc"
    assert store.commit(res)
    assert store.get(NS, k(0))[:3] == b"abc"  # type: ignore[index]
    assert store.stats()["reserved_bytes"] == 0
    with pytest.raises(ValueError):
        store.commit(res)


def test_racing_reservations_first_commit_wins(policy: str) -> None:
    store = make(policy, 4)
    # two clients put [a] at once: both reserve, the first commit stores it
    first = store.reserve(NS, k("a"), PS)
    second = store.reserve(NS, k("a"), PS)
    assert first is not None and second is not None
    first.views[0][:] = b"1" * PS
    second.views[0][:] = b"2" * PS
    assert store.stats()["used_bytes"] == 2 * PS
    assert store.commit(second)
    assert not store.commit(first)  # the loser's pages are freed
    assert store.get(NS, k("a")) == b"2" * PS
    stats = store.stats()
    assert (stats["used_bytes"], stats["blocks"], stats["dedup"]) == (PS, 1, 1)


def test_abort_frees_and_closes(policy: str) -> None:
    store = make(policy, 4)
    res = store.reserve(NS, k(0), 3 * PS)
    assert res is not None and store.stats()["free_bytes"] == PS
    store.abort(res)
    store.abort(res)  # idempotent, safe in a finally block
    assert store.stats()["free_bytes"] == 4 * PS and store.exists(NS, [k(0)]) == [False]
    with pytest.raises(ValueError):
        store.commit(res)


def test_reservations_are_never_evicted(policy: str) -> None:
    store = make(policy, 4)
    held = store.reserve(NS, k("incoming"), 3 * PS)
    assert held is not None
    put_batch(store, [0])
    # put [1] -> evicts [0]; the reservation stays
    assert put_batch(store, [1]) == [True]
    assert present(store, [0, 1]) == [1]
    with pytest.raises(CapacityError):  # 1 free + 1 evictable < 2
        store.reserve(NS, k(2), 2 * PS)
    assert store.commit(held)


def test_put_of_a_non_byte_buffer(policy: str) -> None:
    store = make(policy, 4)
    words = memoryview(bytearray(range(16))).cast("I")
    assert store.put(NS, k(0), words)
    assert store.get(NS, k(0)) == bytes(range(16))


# -- eviction -------------------------------------------------------------------


def test_least_recent_block_goes_first(policy: str) -> None:
    store = make(policy, 4)
    for i in range(4):  # put [0] [1] [2] [3], separate requests
        put_batch(store, [i])
    # put [4] -> evicts [0]
    put_batch(store, [4])
    assert present(store, range(5)) == [1, 2, 3, 4]
    # get [1]; put [5] -> evicts [2]
    assert store.get(NS, k(1)) is not None
    put_batch(store, [5])
    assert present(store, range(6)) == [1, 3, 4, 5]
    stats = store.stats()
    assert (stats["evictions"], stats["evicted_bytes"], stats["used_bytes"]) == (2, 2 * PS, 4 * PS)


def test_put_batch_loses_its_tail_first(policy: str) -> None:
    store = make(policy, 6)
    put_batch(store, ["a0", "a1", "a2"])
    put_batch(store, ["b0", "b1", "b2"])
    # put [c0] -> evicts [a2]: chain a keeps a usable prefix
    put_batch(store, ["c0"])
    assert store.lookup(NS, [k("a0"), k("a1"), k("a2")]) == 2
    # that lookup made a newest; put [c1] -> evicts [b2], put [c2] -> evicts [b1]
    put_batch(store, ["c1"])
    put_batch(store, ["c2"])
    assert present(store, ["b0", "b1", "b2"]) == ["b0"]


def test_get_batch_touches_the_chain_as_one(policy: str) -> None:
    store = make(policy, 5)
    put_batch(store, ["a0", "a1", "a2"])
    put_batch(store, ["x", "y"])
    for name in ["a0", "a1", "a2"]:  # a GET reads the chain head first, one block at a time
        assert store.get(NS, k(name)) is not None
    # put [z] -> evicts [y] (tail of the older x,y chain); put [w] -> evicts [x]; then [a2]
    put_batch(store, ["z"])
    put_batch(store, ["w"])
    assert present(store, ["x", "y", "a0", "a1", "a2"]) == ["a0", "a1", "a2"]
    # put [v] -> LRU evicts [a2], the chain's tail; ARC keeps the re-read chain in T2 and evicts [z]
    put_batch(store, ["v"])
    expected = {"lru": ["a0", "a1", "z"], "arc": ["a0", "a1", "a2"]}[policy]
    assert present(store, ["a0", "a1", "a2", "z"]) == expected


def test_acquire_many_pins_each_found_block_and_touches_them_as_one_chain(policy: str) -> None:
    store = make(policy, 5)
    put_batch(store, ["a0", "a1", "a2"])
    put_batch(store, ["x", "y"])
    refs = store.acquire_many(NS, [k("a0"), k("nope"), k("a1"), k("a1"), k("a2")])
    assert [r is None for r in refs] == [False, True, False, False, False]
    assert [b"".join(r.views) for r in refs if r is not None] == [data("a0"), data("a1"), data("a1"), data("a2")]
    assert store.stats()["pinned_blocks"] == 3
    held = [r for r in refs if r is not None]
    store.release_many(held[:3])  # a1 is still read once
    assert store.stats()["pinned_blocks"] == 1
    store.release_many(held[3:])
    assert store.stats()["pinned_blocks"] == 0 and refs[0] is not None and refs[0].views == []
    with pytest.raises(ValueError, match="already released"):
        store.release_many(held[2:])
    # as a chain read: x, y go first; then the re-read chain from its tail
    put_batch(store, ["z"])
    put_batch(store, ["w"])
    assert present(store, ["x", "y", "a0", "a1", "a2"]) == ["a0", "a1", "a2"]


def test_stranded_tails_go_before_reachable_blocks(policy: str) -> None:
    store = make(policy, 6)
    put_batch(store, ["old0", "old1"])
    put_batch(store, ["a0", "a1", "a2", "a3"])
    # delete [a1] -> a2, a3 can never be reached by a lookup again
    assert store.delete(NS, [k("a1")]) == 1
    assert store.stats()["stranded_blocks"] == 2
    assert store.lookup(NS, [k(n) for n in ["a0", "a1", "a2", "a3"]]) == 1
    # put [n0 n1 n2] -> n0 takes a1's page, then evicts [a3] and [a2], although old0/old1 are older
    put_batch(store, ["n0", "n1", "n2"])
    assert present(store, ["old0", "old1", "a0", "a2", "a3"]) == ["old0", "old1", "a0"]
    assert (store.stats()["evictions"], store.stats()["stranded_blocks"]) == (2, 0)


def test_a_put_restating_a_stored_prefix_never_evicts_that_prefix(policy: str) -> None:
    """The prefill side of P/D stores a whole prompt whose head is stored already (those keys
    answer "existed"): the room for the new blocks comes from other chains, not from that head."""
    store = make(policy, 6)
    put_batch(store, ["p0", "p1", "p2"])
    put_batch(store, ["o0", "o1", "o2"])  # full: o* are newer than p*
    names = ["p0", "p1", "p2", "p3", "p4"]
    res = [store.reserve(NS, k(n), PS) for n in names]  # as the server: all reserved, then committed
    assert [r is None for r in res] == [True, True, True, False, False]
    for i, r in enumerate(res):
        if r is not None:
            assert store.commit(r, parent=k(names[i - 1]))
    assert store.lookup(NS, [k(n) for n in names]) == 5  # was 1: p1, p2 evicted, p3, p4 stranded
    assert present(store, ["o0", "o1", "o2"]) == ["o0"]  # the other chain lost its tail


def test_reading_a_chains_suffix_does_not_outlive_its_head(policy: str) -> None:
    """An engine with a chain's head on its GPU reads only the rest; the head stays no older."""
    store = make(policy, 5)
    put_batch(store, [0, 1, 2, 3])
    put_batch(store, ["x"])
    assert store.lookup(NS, [k(2), k(3)]) == 2
    put_batch(store, ["y"])  # -> one eviction: the chain's tail or x, never its head
    assert store.stats()["stranded_blocks"] == 0
    assert store.lookup(NS, [k(i) for i in range(4)]) == len(present(store, [0, 1, 2, 3]))


def test_a_block_stored_again_behind_its_parent_goes_before_it(policy: str) -> None:
    store = make(policy, 4)
    put_batch(store, ["a0", "a1", "a2"])
    put_batch(store, ["x0", "x1"])  # -> evicts [a2], the chain's tail
    store.delete(NS, [k("x1")])
    assert store.put(NS, k("a2"), data("a2"), parent=k("a1"))  # back (ARC: a ghost hit), behind a1
    put_batch(store, ["y"])  # -> one eviction
    assert store.stats()["stranded_blocks"] == 0


def test_evicted_head_strands_its_chain(policy: str) -> None:
    store = make(policy, 5)
    put_batch(store, ["a0", "a1", "a2"])
    put_batch(store, ["b0", "b1"])
    refs = [store.acquire(NS, k(n)) for n in ["a1", "a2", "b0", "b1"]]  # readers pin all but a0
    # put [c0] -> evicts [a0] (the only unpinned block); a1, a2 are stranded now
    put_batch(store, ["c0"])
    assert present(store, ["a0", "a1", "a2"]) == ["a1", "a2"]
    for ref in refs:
        assert ref is not None
        store.release(ref)
    # put [d0] -> evicts [a2], put [d1] -> evicts [a1]: stranded first, b stays
    put_batch(store, ["d0"])
    put_batch(store, ["d1"])
    assert present(store, ["a1", "a2", "b0", "b1", "c0"]) == ["b0", "b1", "c0"]


def test_lookup_through_a_restored_head_makes_the_tail_reachable_again(policy: str) -> None:
    store = make(policy, 5)
    put_batch(store, ["a0", "a1", "a2"])
    store.delete(NS, [k("a0")])  # a1, a2 stranded
    assert store.stats()["stranded_blocks"] == 2
    put_batch(store, ["a0"])  # promoted back from a lower tier, alone
    put_batch(store, ["x0", "x1"])
    assert store.lookup(NS, [k("a0"), k("a1"), k("a2")]) == 3  # reached again: live, relinked
    assert store.stats()["stranded_blocks"] == 0
    # put [y0] -> evicts [x1], the older chain's tail; stranded a2 would have gone first
    put_batch(store, ["y0"])
    assert present(store, ["a0", "a1", "a2", "x0", "x1"]) == ["a0", "a1", "a2", "x0"]
    # the relinked chain strands again when its head goes
    store.delete(NS, [k("a0")])
    # put [y1] -> a0's page; put [y2] -> evicts [a2], although the a chain is newer than x0
    put_batch(store, ["y1"])
    put_batch(store, ["y2"])
    assert present(store, ["a1", "a2", "x0", "y0", "y1", "y2"]) == ["a1", "x0", "y0", "y1", "y2"]


def test_a_gap_block_stored_again_alone_makes_the_blocks_after_it_reachable(policy: str) -> None:
    """A block deleted (or evicted) out of a chain strands the blocks after it; a put of that
    block alone, with its parent, joins them again, as a lookup of the whole chain would."""
    store = make(policy, 8)
    put_batch(store, ["a0", "a1", "a2", "a3", "a4"])
    store.delete(NS, [k("a2")])  # a3, a4 stranded
    assert store.stats()["stranded_blocks"] == 2
    put_batch(store, ["a2"], after="a1")
    assert store.stats()["stranded_blocks"] == 0
    put_batch(store, ["x0", "x1", "x2"])  # full: x* newer than a*
    # put [y0 y1] -> evicts [a4] and [a3], the oldest chain's tail (stranded, they went before x2 as well)
    put_batch(store, ["y0", "y1"])
    assert present(store, ["a0", "a1", "a2", "x0", "x1", "x2"]) == ["a0", "a1", "a2", "x0", "x1", "x2"]
    assert store.lookup(NS, [k(n) for n in ["a0", "a1", "a2", "a3"]]) == 3


def test_a_gap_filled_behind_a_missing_head_stays_stranded_until_the_head_is_back(policy: str) -> None:
    store = make(policy, 8)
    put_batch(store, ["a0", "a1", "a2", "a3"])
    store.delete(NS, [k("a0"), k("a2")])  # a1 (after a0), a3 (after a2) stranded
    put_batch(store, ["a2"], after="a1")  # joins a3 to it: stranded both, a1 is
    assert store.stats()["stranded_blocks"] == 3
    put_batch(store, ["a0"])  # the head: all of it reachable
    assert store.stats()["stranded_blocks"] == 0
    assert store.lookup(NS, [k(n) for n in ["a0", "a1", "a2", "a3"]]) == 4


def test_a_lookup_ending_inside_a_stranded_chain_makes_the_rest_of_it_reachable(policy: str) -> None:
    """A lookup that finds a chain whole again (its gap put back without a parent) joins all of it,
    also the blocks after the ones it asked for."""
    store = make(policy, 8)
    put_batch(store, ["a0", "a1", "a2", "a3"])
    store.delete(NS, [k("a1")])  # a2, a3 stranded
    assert store.put(NS, k("a1"), data("a1"))  # stored without its parent, then found through it
    assert store.lookup(NS, [k("a0"), k("a1")]) == 2
    assert store.stats()["stranded_blocks"] == 0


# -- pins and leases --------------------------------------------------------------


def test_pinned_blocks_survive_eviction(policy: str, clock: FakeClock) -> None:
    store = make(policy, 4, clock)
    put_batch(store, [0, 1])
    put_batch(store, [2, 3])
    # lookup [0 1] with pin -> leased; put [4 5] -> evicts [3 2], never [0 1]
    assert store.lookup(NS, [k(0), k(1)], pin=True) == 2
    put_batch(store, [4, 5])
    assert present(store, range(6)) == [0, 1, 4, 5]
    stats = store.stats()
    assert (stats["pinned_blocks"], stats["leases"]) == (2, 2)


@pytest.mark.parametrize("unpinned_by", ["unpin", "expiry", "release"])
def test_blocks_eviction_passed_over_while_pinned_are_evictable_once_unpinned(clock: FakeClock, unpinned_by: str) -> None:
    """LRU: the new batch at the end evicts all that came before (ARC would evict its own blocks first)."""
    store = make("lru", 4, clock, lease_s=10.0)
    put_batch(store, [0, 1])
    put_batch(store, [2, 3])
    if unpinned_by == "release":
        refs = store.acquire_many(NS, [k(0), k(1)])
    else:
        assert store.lookup(NS, [k(0), k(1)], pin=True) == 2
    assert store.lookup(NS, [k(2), k(3)]) == 2  # read since: [0 1] are the next victims
    put_batch(store, [4, 5])  # passes [0 1] over
    assert present(store, range(2)) == [0, 1]
    if unpinned_by == "unpin":
        assert store.unpin(NS, [k(0), k(1)]) == 2
    elif unpinned_by == "expiry":
        clock.now = 10.0  # (seen by the next eviction)
    else:
        store.release_many(refs)
    assert put_batch(store, [6, 7, 8, 9]) == [True] * 4  # every older block is evictable again
    assert present(store, range(10)) == [6, 7, 8, 9]
    assert store.stats()["pinned_blocks"] == 0


def test_pinned_lookups_over_max_leases_are_refused_until_leases_end(policy: str, clock: FakeClock) -> None:
    store = make(policy, 4, clock, lease_s=10.0, max_leases=5)
    put_batch(store, [0, 1])
    assert store.lookup(NS, [k(0), k(1)], pin=True) == 2
    clock.now = 1.0
    assert store.lookup(NS, [k(0), k(1)], pin=True) == 2
    with pytest.raises(CapacityError, match="over the 5"):
        store.lookup(NS, [k(0), k(1)], pin=True)
    assert store.stats()["leases"] == 4  # the refused lookup changed nothing
    assert store.lookup(NS, [k(0)], pin=True) == 1  # up to the bound
    assert store.lookup(NS, [k(0), k(1)]) == 2  # a lookup without pin is not bounded
    assert store.unpin(NS, [k(1)]) == 1
    assert store.lookup(NS, [k(1)], pin=True) == 1
    clock.now = 11.0  # every lease ends
    assert store.lookup(NS, [k(0), k(1)] * 2, pin=True) == 4


def test_max_leases_by_default_grows_with_the_capacity() -> None:
    pages = 4 * store_module.MIN_LEASES // store_module.LEASES_PER_PAGE
    store = BlockStore(pages * PS, page_size=PS, prefault=False)
    put_batch(store, [0])
    for _ in range(4 * store_module.MIN_LEASES // 1024):
        store.lookup(NS, [k(0)] * 1024, pin=True)  # 4 x MIN_LEASES leases: under the bound
    with pytest.raises(CapacityError):
        store.lookup(NS, [k(0)], pin=True)
    assert make("lru", 4)._max_leases == store_module.MIN_LEASES


def test_lease_expiry_releases_the_pin(policy: str, clock: FakeClock) -> None:
    store = make(policy, 2, clock, lease_s=10.0)
    put_batch(store, [0, 1])
    assert store.lookup(NS, [k(0), k(1)], pin=True) == 2
    clock.now = 9.9
    with pytest.raises(CapacityError):  # both pinned
        put_batch(store, [2])
    assert present(store, [0, 1]) == [0, 1]
    clock.now = 10.0  # leases expire at clock() + lease_s; eviction sees them as gone
    assert put_batch(store, [2]) == [True]
    assert store.stats()["leases"] == 0 and store.stats()["pinned_blocks"] == 0


def test_expire_leases_counts_what_it_drops(policy: str, clock: FakeClock) -> None:
    store = make(policy, 4, clock, lease_s=10.0)
    put_batch(store, [0, 1])
    store.lookup(NS, [k(0), k(1)], pin=True)
    store.lookup(NS, [k(0)], pin=True, lease_s=3.0)
    assert store.stats()["leases"] == 3
    clock.now = 5.0
    assert store.expire_leases() == 1
    clock.now = 11.0
    assert store.expire_leases() == 2
    assert store.expire_leases() == 0 and store.stats()["pinned_blocks"] == 0


def test_a_pinned_lookup_leases_each_listed_key_once_per_listing(policy: str, clock: FakeClock) -> None:
    store = make(policy, 4, clock, lease_s=10.0)
    put_batch(store, [0, 1, 2])
    assert store.lookup(NS, [k(0), k(0), k(1), k(9), k(2)], pin=True) == 3  # the prefix stops at 9
    assert store.stats()["leases"] == 3 and store.stats()["pinned_blocks"] == 2
    assert len(store.policy) == 3
    clock.now = 10.0
    assert store.expire_leases() == 3
    assert store.stats()["pinned_blocks"] == 0 and store.stats()["leases"] == 0


def test_unpin_drops_the_soonest_lease(policy: str, clock: FakeClock) -> None:
    store = make(policy, 2, clock)
    put_batch(store, [0, 1])
    store.lookup(NS, [k(0)], pin=True, lease_s=100.0)
    store.lookup(NS, [k(0)], pin=True, lease_s=5.0)
    # unpin [0 1] -> drops the 5 s lease of 0; 1 had none
    assert store.unpin(NS, [k(0), k(1), k("nope")]) == 1
    clock.now = 50.0
    with pytest.raises(CapacityError):  # 0 still leased (100 s), and 1 + 2 pages needed
        store.reserve(NS, k(2), 2 * PS)
    assert store.unpin(NS, [k(0)]) == 1 and store.unpin(NS, [k(0)]) == 0
    assert store.reserve(NS, k(2), 2 * PS) is not None


def test_unpin_refs_drops_a_lease_only_of_the_block_read(policy: str, clock: FakeClock) -> None:
    store = make(policy, 4, clock)
    put_batch(store, [0, 1])
    store.lookup(NS, [k(0), k(1)], pin=True)
    refs = [store.acquire(NS, k(0)), store.acquire(NS, k(1))]
    assert all(r is not None for r in refs)
    store.delete(NS, [k(0)])  # its lease goes with it; then another block under the key, leased
    put_batch(store, [0])
    store.lookup(NS, [k(0)], pin=True)
    assert store.unpin_refs(refs) == 1  # k(1)'s; the new k(0) keeps its (not the block read)
    assert store.stats()["leases"] == 1 and store.unpin(NS, [k(0)]) == 1
    store.release_many(refs)  # type: ignore[arg-type]


def test_acquire_pins_until_release_and_leases_keep_their_time(policy: str, clock: FakeClock) -> None:
    store = make(policy, 2, clock, lease_s=10.0)
    put_batch(store, [0])
    put_batch(store, [1])
    ref = store.acquire(NS, k(0))
    assert ref is not None and store.stats()["pinned_blocks"] == 1
    # put [2] -> evicts [1], never the block being read
    put_batch(store, [2])
    assert present(store, [0, 1, 2]) == [0, 2]
    store.release(ref)
    with pytest.raises(ValueError):
        store.release(ref)
    assert store.stats()["pinned_blocks"] == 0
    # a lease from t=0 (lease_s 10) protects through a read at t=8 until t=10, not beyond
    store.lookup(NS, [k(2)], pin=True)
    clock.now = 8.0
    ref = store.acquire(NS, k(2))
    assert ref is not None
    store.release(ref)
    clock.now = 9.5
    put_batch(store, [3])  # evicts [0]
    assert present(store, [0, 2, 3]) == [2, 3]
    clock.now = 10.5
    put_batch(store, [4], size=2 * PS)  # the lease is over: [2] may go too
    assert present(store, [2, 3, 4]) == [4]


def test_a_block_leased_while_it_is_read_counts_as_pinned_once(policy: str, clock: FakeClock) -> None:
    """A lease taken on a block a read holds, the read released, the lease dropped: the block is
    unpinned and its room can be taken (it counted pinned twice, once for good: the store saw
    fewer evictable pages until full puts were refused)."""
    store = make(policy, 2, clock)
    put_batch(store, [0])
    ref = store.acquire(NS, k(0))
    assert store.lookup(NS, [k(0)], pin=True) == 1
    assert store.stats()["pinned_blocks"] == 1
    store.release(ref)
    assert store.stats()["pinned_blocks"] == 1  # (the lease still holds it)
    assert store.unpin(NS, [k(0)]) == 1
    assert store.stats()["pinned_blocks"] == 0
    put_batch(store, [1], size=2 * PS)  # the whole store: [0] is evicted, as any unpinned block
    assert present(store, [0, 1]) == [1]


def test_a_read_does_not_extend_leases(policy: str, clock: FakeClock) -> None:
    """A lease ends at its time (or at UNPIN). Leases belong to no reader, so a read that
    renewed them kept the leases of clients long gone alive while anyone read the block."""
    store = make(policy, 4, clock, lease_s=10.0)
    put_batch(store, [0])
    assert store.lookup(NS, [k(0)], pin=True) == store.lookup(NS, [k(0)], pin=True) == 1
    clock.now = 8.0
    ref = store.acquire(NS, k(0))
    assert ref is not None
    store.release(ref)
    clock.now = 10.5
    assert store.stats()["leases"] == 0 and store.stats()["pinned_blocks"] == 0


def test_deadlines_of_dropped_leases_do_not_pile_up(policy: str, clock: FakeClock) -> None:
    """Each pinned lookup files a deadline; an hour-long lease dropped at once must not leave
    its entry behind for the hour."""
    store = make(policy, 4, clock)
    put_batch(store, [0])
    for _ in range(10_000):
        store.lookup(NS, [k(0)], pin=True, lease_s=3600.0)
        assert store.unpin(NS, [k(0)]) == 1
    assert len(store._lease_heap) < 5000  # (of 10,000 filed; nothing public shows the entries)
    assert store.stats()["leases"] == 0
    store.lookup(NS, [k(0)], pin=True, lease_s=5.0)  # and expiry still works after the sweeps
    clock.now = 6.0
    assert store.stats()["leases"] == 0


def test_block_ref_views_are_read_only(policy: str) -> None:
    store = make(policy, 4)
    payload = data(0, 2 * PS + 7)
    store.put(NS, k(0), payload)
    ref = store.acquire(NS, k(0))
    assert isinstance(ref, BlockRef) and b"".join(ref.views) == payload
    with pytest.raises(TypeError):
        ref.views[0][0] = 1
    store.release(ref)


def test_delete_while_acquired_keeps_pages_until_release(policy: str) -> None:
    store = make(policy, 3)
    put_batch(store, [0])
    ref = store.acquire(NS, k(0))
    assert ref is not None
    # delete [0] -> gone from the index at once, pages kept for the reader
    assert store.delete(NS, [k(0)]) == 1
    assert store.get(NS, k(0)) is None and store.exists(NS, [k(0)]) == [False]
    stats = store.stats()
    assert (stats["blocks"], stats["used_bytes"], stats["pinned_blocks"]) == (0, PS, 0)
    with pytest.raises(CapacityError):  # its page is not reusable yet
        store.reserve(NS, k(1), 3 * PS)
    put_batch(store, [1, 2])
    assert b"".join(ref.views) == data(0)  # the reader's bytes are intact
    again = store.acquire(NS, k(1))
    assert again is not None
    store.release_many([ref, again])  # the last reader of the deleted block frees its page
    assert store.stats()["used_bytes"] == 2 * PS and store.stats()["pinned_blocks"] == 0
    assert put_batch(store, [3]) == [True] and store.stats()["evictions"] == 0


def test_a_put_continuing_a_chain_takes_its_room_from_other_chains(policy: str) -> None:
    """An engine stores a request's blocks step by step; meanwhile other requests stored theirs. The
    chain extended is in use: its blocks stay, the room comes from the others."""
    store = make(policy, 6)
    put_batch(store, ["a0", "a1", "a2"])
    put_batch(store, ["b0", "b1", "b2"])  # full: a is the older chain, its tail a2 the next victim
    put_batch(store, ["a3"], after="a2")  # -> evicts [b2], not a2 (which would strand a3)
    assert store.lookup(NS, [k(f"a{i}") for i in range(4)]) == 4
    assert present(store, ["b0", "b1", "b2"]) == ["b0", "b1"]
    assert store.stats()["stranded_blocks"] == 0
    put_batch(store, ["a4"], after="a3")  # -> evicts [b1]
    put_batch(store, ["c0"])  # -> evicts [b0]: b is the chain least recently used now
    assert store.lookup(NS, [k(f"a{i}") for i in range(5)]) == 5
    assert present(store, ["b0", "c0"]) == ["c0"]


def test_a_chain_longer_than_the_store_keeps_its_head_and_refuses_its_tail(policy: str) -> None:
    """Evicting the chain's own last block for each new one would leave every new block out of reach."""
    store = make(policy, 6)
    put_batch(store, [0, 1, 2])
    for i in range(3, 6):
        put_batch(store, [i], after=i - 1)
    with pytest.raises(CapacityError, match=r"6.0 KiB evictable \(all of it the stored chain this block continues\)"):
        put_batch(store, [6], after=5)
    with pytest.raises(CapacityError):
        put_batch(store, [6, 7], after=5)
    assert store.lookup(NS, [k(i) for i in range(8)]) == 6
    assert store.stats()["evictions"] == 0
    put_batch(store, ["x"])  # another chain: the long one's tail goes first, as before the refusals
    assert present(store, list(range(6))) == [0, 1, 2, 3, 4]
    assert store.stats()["stranded_blocks"] == 0


def test_a_put_stops_sparing_a_chain_once_its_own_eviction_broke_it() -> None:
    """ARC, the chain's head read again (T2), its tail in T1, and ARC's target taking T2 first: the
    eviction meets the head before the parent and takes it, which strands the parent. The put
    went on sparing the stranded tail, and evicted the last reachable block of the chain too."""
    store = make("arc", 8)
    for i in range(4):  # ARC's target p grows to 2: blocks evicted from T1 and stored again
        put_batch(store, [f"t{i}"])
        store.lookup(NS, [k(f"t{i}")])
    for name in ["f0", "f1", "f2", "f3", "g0", "g1", "f0", "f1"]:
        put_batch(store, [name])
    store.flush(NS)
    put_batch(store, ["c1"])
    put_batch(store, ["c2"], after="c1")
    store.lookup(NS, [k("c1"), k("c2")])  # the head read again: T2
    for i in range(4):
        put_batch(store, [f"o{i}"])
        store.lookup(NS, [k(f"o{i}")])
    put_batch(store, ["c3"], after="c2")
    put_batch(store, ["c4"], after="c3")  # the tail: T1
    put_batch(store, ["c5"], after="c4", size=2 * PS)  # -> evicts c2 (stranding c3, c4), then c4: not c1
    assert present(store, ["c1", "c2", "c3", "c4"]) == ["c1", "c3"]
    assert store.lookup(NS, [k("c1")]) == 1 and len(store.policy) == store.stats()["blocks"]


def test_the_run_of_the_chain_met_goes_back_before_the_rest_of_its_chain(policy: str) -> None:
    """A chain whose blocks are not side by side in the eviction order: a branch off its head (a
    prompt sharing a prefix) stands between them. The run met goes back just before the rest of
    its chain, so the chain's order holds (at the back, its tail would outlive its head)."""
    store = make(policy, 4)
    put_batch(store, ["a0", "a1"])
    put_batch(store, ["o"], after="a0")  # a branch: just before a0 -> order a1, o, a0
    put_batch(store, ["z"])
    put_batch(store, ["a2"], after="a1")  # meets a1 (kept), then o -> evicts [o]
    assert present(store, ["a0", "a1", "a2", "o", "z"]) == ["a0", "a1", "a2", "z"]
    put_batch(store, ["y"])  # -> evicts [a2], the chain's tail (had a1 gone to the back: a0, all three lost)
    assert store.lookup(NS, [k("a0"), k("a1"), k("a2")]) == 2
    assert store.stats()["stranded_blocks"] == 0


def test_a_chain_passed_over_while_part_of_it_is_leased_keeps_its_order(policy: str) -> None:
    """A request stores its chain step by step while another loads its prefix (a pinned lookup,
    then unpin). The put that passed over the leased prefix sent the rest of the chain to the
    back, and the unpin released the prefix behind it: the next put's eviction took the head."""
    store = make(policy, 12)
    chain = [f"k{i}" for i in range(1, 9)]
    put_batch(store, chain[:1])
    for i in range(1, 6):
        put_batch(store, [chain[i]], after=chain[i - 1])
    assert store.lookup(NS, [k(n) for n in chain[:3]], pin=True) == 3
    put_batch(store, [f"o{i}" for i in range(6)])  # full
    put_batch(store, ["k7"], after="k6")  # passes over k6..k1, the prefix leased
    assert store.unpin(NS, [k(n) for n in chain[:3]]) == 3
    for i in range(6, 11):
        put_batch(store, [f"o{i}"])  # other traffic
    put_batch(store, ["k8"], after="k7")
    assert store.lookup(NS, [k(n) for n in chain]) == 8 and store.stats()["stranded_blocks"] == 0  # (was 0 of 8)


def test_a_block_whose_parent_is_not_stored_takes_only_a_stranded_blocks_room(policy: str) -> None:
    """No lookup reaches such a block: it is stranded as it is committed. It took a reachable
    block's room (an engine's store still in flight when the one before it was refused evicted
    the request's own last block: a lookup found 5 of 6)."""
    store = make(policy, 5)
    put_batch(store, [0, 1, 2])
    put_batch(store, ["s0", "s1"])
    with pytest.raises(CapacityError, match="parent is not stored, or stranded itself, so no lookup would reach the block"):
        put_batch(store, [4], after=3)  # 3 was refused: 4 continues nothing stored
    assert store.stats()["evictions"] == 0
    store.delete(NS, [k("s0")])  # s1 stranded, a page free
    put_batch(store, ["y"])
    assert put_batch(store, [4], after=3) == [True]  # -> evicts [s1], stranded
    assert present(store, [0, 1, 2, "s1", "y"]) == [0, 1, 2, "y"]
    assert store.stats()["stranded_blocks"] == 1  # (4 itself)
    assert put_batch(store, [5], after="y") == [True]  # a reachable parent: the room of stranded 4 first
    assert present(store, [4]) == []


def test_a_put_continuing_a_chain_of_looped_links_ends(policy: str) -> None:
    store = make(policy, 4)
    put_batch(store, ["b", "a"])  # a's parent is b ...
    assert store.lookup(NS, [k("a"), k("b")]) == 2  # ... and this lookup made b's parent a: a loop
    put_batch(store, ["z0", "z1"])
    assert put_batch(store, ["n"], after="a") == [True]
    assert store.stats()["blocks"] == 4 and len(store.policy) == 4


# -- capacity -------------------------------------------------------------------


def test_capacity_error_changes_nothing(policy: str, clock: FakeClock) -> None:
    store = make(policy, 4, clock)
    put_batch(store, [0, 1, 2, 3])
    store.lookup(NS, [k(0), k(1)], pin=True)
    before = (store.exists(NS, [k(i) for i in range(4)]), store.stats())
    # put a 3-page block -> 2 evictable pages only -> CapacityError, nothing evicted
    with pytest.raises(CapacityError):
        store.reserve(NS, k("big"), 3 * PS)
    assert (store.exists(NS, [k(i) for i in range(4)]), store.stats()) == before


def test_partial_batch_stops_at_capacity(policy: str, clock: FakeClock) -> None:
    store = make(policy, 8, clock)
    put_batch(store, [0, 1, 2, 3, 4, 5])
    store.lookup(NS, [k(i) for i in range(6)], pin=True)  # six pages pinned
    # put [x (1 page), y (3 pages)] -> x stored, y: 1 free + 1 evictable < 3
    assert put_batch(store, ["x"]) == [True]
    with pytest.raises(CapacityError):
        put_batch(store, ["y"], size=3 * PS)
    assert present(store, ["x", "y"]) == ["x"]
    stats = store.stats()
    assert (stats["blocks"], stats["evictions"], stats["used_bytes"]) == (7, 0, 7 * PS)


@pytest.mark.parametrize("seed", [7, 8, 9])
@pytest.mark.parametrize("sweep_at", [None, 4])
def test_random_churn_keeps_every_invariant(policy: str, seed: int, sweep_at: int | None,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    if sweep_at is not None:  # stale lease deadlines swept out all along (the store's own minimum is larger)
        monkeypatch.setattr(store_module, "_LEASE_HEAP_MIN", sweep_at)
    rng = random.Random(seed)
    clock = FakeClock()
    store = BlockStore(32 * PS, eviction=policy, page_size=PS, lease_s=5.0, clock=clock)
    namespaces = ["A", "B"]
    pool = [k(i) for i in range(30)]
    contents: dict[tuple[str, bytes], tuple[bytes, int]] = {}  # last stored bytes and generation
    leases: dict[tuple[str, bytes], list[float]] = {}
    refs: list[tuple[BlockRef, str, bytes, bytes, int]] = []
    generation = 0

    def pages(size: int) -> int:
        return max(1, -(-size // PS))

    def check() -> None:
        nonlocal leases
        stats = store.stats()
        live = {(ns, key) for ns in namespaces for key, ok in zip(pool, store.exists(ns, pool), strict=True) if ok}
        leases = {nk: [t for t in ts if t > clock.now] for nk, ts in leases.items()}
        leases = {nk: ts for nk, ts in leases.items() if ts and nk in live}
        readers = {(ns, key) for _, ns, key, _, gen in refs if contents[ns, key][1] == gen and (ns, key) in live}
        zombies = {(ns, key, gen) for _, ns, key, _, gen in refs if (ns, key) not in readers}
        assert leases.keys() | readers <= live  # pinned blocks are never evicted
        used = sum(pages(len(contents[nk][0])) for nk in live)
        used += sum(pages(len(b)) for b in {(n, kk, g): d for _, n, kk, d, g in refs if (n, kk, g) in zombies}.values())
        assert stats["used_bytes"] == used * PS <= stats["capacity"]
        assert stats["blocks"] == len(live) == len(store.policy)
        assert stats["bytes"] == sum(len(contents[nk][0]) for nk in live)
        assert stats["pinned_blocks"] == len(leases.keys() | readers)
        assert stats["stranded_blocks"] == sum(b.stranded for blocks in store._blocks.values() for b in blocks.values())
        waiting: dict[tuple[str, bytes], set[bytes]] = {}
        for ns, blocks in store._blocks.items():
            for key, b in blocks.items():
                if b.waits is not None:  # it waits for a parent that is gone (stranded, or a lookup began at it)
                    assert b.parent is None and b.waits not in blocks
                    waiting.setdefault((ns, b.waits), set()).add(key)
                elif b.stranded:  # else it is stranded only after a stranded parent
                    assert b.parent is not None and blocks[b.parent].stranded
        assert store._waiting == waiting
        assert stats["leases"] == sum(len(ts) for ts in leases.values())
        assert stats["reserved_bytes"] == 0
        for ns, key in rng.sample(sorted(live), min(4, len(live))):
            assert store.get(ns, key) == contents[ns, key][0]

    for _ in range(500):
        ns = rng.choice(namespaces)
        op = rng.random()
        start = rng.randrange(len(pool))
        chain = pool[start : start + rng.randint(1, 4)]
        if op < 0.35:  # a PUT batch, as the server runs it; half of them continue a stored chain
            parent = pool[start - 1] if start and rng.random() < 0.5 else None
            keep = None if parent is None else Keep(ns, parent)
            for i, key in enumerate(chain):
                size = rng.choice([0, 10, PS, 2 * PS + 3, 5 * PS])
                try:
                    res = store.reserve(ns, key, size, keep=keep)
                except CapacityError:
                    break
                if res is None:
                    continue
                generation += 1
                payload = rng.randbytes(size)
                offset = 0
                for view in res.views:
                    view[:] = payload[offset : offset + len(view)]
                    offset += len(view)
                if rng.random() < 0.05:
                    store.abort(res)
                    continue
                assert store.commit(res, parent=chain[i - 1] if i else parent)
                contents[ns, key] = (payload, generation)
        elif op < 0.55:
            pin = rng.random() < 0.5
            m = store.lookup(ns, chain, pin=pin)
            assert store.exists(ns, chain)[:m] == [True] * m
            if pin:
                for key in chain[:m]:
                    leases.setdefault((ns, key), []).append(clock.now + 5.0)
        elif op < 0.65:
            ref = store.acquire(ns, chain[0])
            if ref is not None:
                refs.append((ref, ns, chain[0], contents[ns, chain[0]][0], contents[ns, chain[0]][1]))
        elif op < 0.75 and refs:
            ref, _, _, payload, _ = refs.pop(rng.randrange(len(refs)))
            assert b"".join(ref.views) == payload  # intact while held, even if deleted
            store.release(ref)
        elif op < 0.82:
            store.delete(ns, chain)
        elif op < 0.90:
            store.unpin(ns, chain)
            for key in chain:
                ts = sorted(t for t in leases.get((ns, key), []) if t > clock.now)
                leases[ns, key] = ts[1:]
        else:
            clock.now += rng.choice([0.5, 1.0, 3.0])
        check()
    for ref, *_ in refs:
        store.release(ref)
    refs.clear()
    check()
