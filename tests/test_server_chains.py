"""Chains, stranded blocks and leases through a real server: what test_store checks on the
store alone, here through the requests that reach it (PUT with and without ``parent``, GET, pinned
LOOKUP, UNPIN). Each case is a rule whose mutation the store-level tests did not see from the wire.

A store of four 64 KiB pages holds four one-page blocks, so every put after that evicts.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from kvstore.client import KVClient
from kvstore.errors import CapacityError, TooLarge
from shm_helpers import MakeServer

PAGE = 64 * 1024


def key(name: str) -> bytes:
    return name.encode().ljust(16, b"_")


def block(fill: int) -> bytes:
    return bytes([fill]) * PAGE


@pytest.fixture
def kv(make_server: MakeServer) -> Iterator[KVClient]:
    srv = make_server("--capacity", str(4 * PAGE), "--page-size", str(PAGE))
    with KVClient(srv.addr, namespace="chains") as client:
        yield client


def store_stats(kv: KVClient) -> dict[str, int]:
    return kv.stats()["store"]


def present(kv: KVClient, *names: str) -> list[bool]:
    return kv.exists([key(n) for n in names])


def test_a_put_continuing_a_chain_never_evicts_a_leased_block(kv: KVClient) -> None:
    """The path that spares the chain a put continues passed over leased blocks only while they
    were being read: a block a decoder had pinned with a lookup was evicted under its lease."""
    kv.put([key("a0")], [block(1)])
    assert kv.lookup([key("a0")], pin=True, lease_ms=60_000) == 1
    kv.put([key("c0"), key("c1")], [block(2), block(3)])
    with pytest.raises(CapacityError):  # c2 takes the last free page; c3 would need a0's or its own chain's
        kv.put([key("c2"), key("c3")], [block(4), block(5)], parent=key("c1"))
    assert present(kv, "a0") == [True]
    assert kv.get([key("a0")]) == [block(1)]


def test_reading_a_stranded_block_does_not_make_it_outlive_reachable_ones(kv: KVClient) -> None:
    """A block whose parent is not stored cannot be reached by any prefix lookup: it goes first,
    read or not (a read moved it among the reachable blocks, and a reachable block went instead)."""
    kv.put([key("r0")], [block(1)])
    kv.put([key("x1")], [block(2)], parent=key("x0"))  # x0 never stored: x1 stranded
    assert kv.get([key("x1")]) == [block(2)]
    for i, name in enumerate(("n0", "n1", "n2")):
        kv.put([key(name)], [block(10 + i)])
    assert present(kv, "r0", "x1") == [True, False]


def test_a_batch_behind_a_missing_parent_is_stranded_whole_and_counted(kv: KVClient) -> None:
    kv.put([key("x1"), key("x2")], [block(2), block(3)], parent=key("x0"))
    assert store_stats(kv)["stranded_blocks"] == 2
    kv.put([key("x1"), key("x2")], [block(2), block(3)], parent=key("x0"))  # the same again: both existed
    assert store_stats(kv)["stranded_blocks"] == 2


def test_a_put_that_runs_through_a_stranded_block_makes_it_reachable(kv: KVClient) -> None:
    kv.put([key("a0")], [block(0)])
    kv.put([key("a2")], [block(2)], parent=key("x"))  # x never stored: a2 stranded
    assert store_stats(kv)["stranded_blocks"] == 1
    assert kv.put([key("a1"), key("a2")], [block(1), block(2)], parent=key("a0")).statuses == ["stored", "existed"]
    assert store_stats(kv)["stranded_blocks"] == 0


def test_a_batch_that_joins_a_stranded_block_evicts_as_a_reachable_chain(kv: KVClient) -> None:
    """[n1, s2, n3] with s2 stored but stranded: once n1 is in, s2 and n3 continue it, so n3 may
    take any unpinned block's room (it was refused as the tail of a stranded chain)."""
    kv.put([key("r0")], [block(1)])
    kv.put([key("s2")], [block(2)], parent=key("x"))  # x never stored: s2 stranded
    kv.put([key("f0")], [block(3)])
    res = kv.put([key("n1"), key("s2"), key("n3")], [block(4), block(2), block(5)])
    assert res.statuses == ["stored", "existed", "stored"]
    assert present(kv, "n1", "s2", "n3") == [True, True, True]


def test_unpin_drops_a_live_lease_not_one_whose_time_is_up(kv: KVClient) -> None:
    """After a short lease had run out and a long one was taken, UNPIN dropped the dead one: the
    block stayed pinned for the long lease's minute though its reader had let it go."""
    kv.put([key("a")], [block(1)])
    assert kv.lookup([key("a")], pin=True, lease_ms=50) == 1
    time.sleep(0.3)
    assert kv.lookup([key("a")], pin=True, lease_ms=60_000) == 1
    assert kv.unpin([key("a")]) == 1
    stats = store_stats(kv)
    assert (stats["pinned_blocks"], stats["leases"]) == (0, 0)


def test_a_block_larger_than_the_whole_store_is_too_large_not_a_full_store(kv: KVClient) -> None:
    """TooLarge says "never"; CapacityError says "the store is full, try later" -- wrong for a block
    no eviction can make room for."""
    with pytest.raises(TooLarge):
        kv.put([key("big")], [bytes(5 * PAGE)])
    kv.put([key("fits")], [bytes(4 * PAGE)])


def test_a_put_cut_into_parts_by_the_servers_batch_limit_stays_one_chain(make_server: MakeServer) -> None:
    """Each part names the last key of the part before it as its parent (it named the batch's
    parent, so every part but the first was a chain of its own): with the head gone, every block
    after it is stranded."""
    srv = make_server("--capacity", "16MiB", "--max-batch", "4")
    with KVClient(srv.addr, namespace="parts") as kv:
        keys = [key(f"p{i}") for i in range(12)]
        assert kv.put(keys, [b"y" * 1000] * 12).stored == 12  # three PUTs of four
        assert kv.delete(keys[:1]) == 1
        assert store_stats(kv)["stranded_blocks"] == 11
