"""One client over several kvstore-servers: rendezvous placement, correctness, one round trip per server."""

from __future__ import annotations

import hashlib
import random

import pytest

from kvstore.client import AsyncKVClient, KVClient
from kvstore.client.sharding import Ring
from kvstore.errors import InvalidRequest, KVStoreError
from shm_helpers import unix_path  # noqa: F401  (a fixture)

MEM = "16MiB"


def chain(n: int, tag: str) -> list[bytes]:
    return [hashlib.sha256(f"{tag}:{i}".encode()).digest() for i in range(n)]


def payloads(got: list[bytearray | None]) -> list[bytes | None]:
    """A get's result as comparable bytes (None stays None)."""
    return [None if g is None else bytes(g) for g in got]


def test_adding_a_fourth_server_moves_a_quarter_of_the_keys_all_to_it() -> None:
    three = [f"10.0.0.{i}:7600" for i in range(1, 4)]
    before, after = Ring(three), Ring([*three, "10.0.0.4:7600"])
    keys = chain(10_000, "ring")
    moved = [k for k in keys if before.nodes[before.node_of(k)] != after.nodes[after.node_of(k)]]
    assert 0.2 <= len(moved) / len(keys) <= 0.3
    assert all(after.nodes[after.node_of(k)] == "10.0.0.4:7600" for k in moved)
    load = [sum(before.node_of(k) == n for k in keys) for n in range(3)]
    assert all(abs(n - len(keys) / 3) < 0.05 * len(keys) for n in load)  # evenly spread
    assert Ring(list(reversed(three))).nodes[Ring(list(reversed(three))).node_of(keys[0])] == \
        three[before.node_of(keys[0])]  # placement depends on the addresses, not their order


def test_placement_is_the_documented_function_and_does_not_change_between_versions() -> None:
    """Engines of different kvstore versions share servers: a key must go where every version
    puts it. Each key goes to the address whose xxh3-64 of the key, seeded with the xxh3-64 of the
    address string, is highest (client/sharding.py); the answers below are frozen."""
    import xxhash

    addrs = ["10.0.0.1:7600", "10.0.0.2:7600", "10.0.0.3:7600"]
    keys = [hashlib.sha256(b"block %d" % i).digest() for i in range(12)]
    ring = Ring(addrs)

    def highest(k: bytes) -> int:
        scores = [xxhash.xxh3_64_intdigest(k, seed=xxhash.xxh3_64_intdigest(a.encode())) for a in addrs]
        return scores.index(max(scores))

    assert [ring.node_of(k) for k in keys] == [highest(k) for k in keys] == [0, 1, 1, 1, 1, 2, 1, 0, 2, 0, 0, 0]


async def test_a_chain_spread_over_three_servers(make_server) -> None:
    servers = [make_server("--capacity", MEM) for _ in range(3)]
    addrs = [s.addr for s in servers]
    keys = chain(30, "spread")
    data = [random.Random(k).randbytes(5000) for k in keys]
    async with AsyncKVClient(addrs, namespace="sh") as kv:
        assert (await kv.put(keys, data)).stored == 30
        per_server = {a: s["namespaces"]["sh"]["blocks"] for a, s in (await kv.stats())["servers"].items()}
        ring = Ring(addrs)
        assert per_server == {a: sum(ring.nodes[ring.node_of(k)] == a for k in keys) for a in addrs}
        assert all(n > 0 for n in per_server.values())

        lookups_before = await lookup_counts(kv)
        assert await kv.lookup(keys) == 30
        lookups_after = await lookup_counts(kv)
        assert {a: lookups_after[a] - lookups_before[a] for a in addrs} == {a: 1 for a in addrs}  # one each

        assert payloads(await kv.get(keys)) == data
        gap = 17
        assert await kv.delete([keys[gap], chain(1, "absent")[0]]) == 1
        assert await kv.lookup(keys) == gap  # the gap is on one server; the others' answers are longer
        assert await kv.lookup(keys[:gap]) == gap
        got = await kv.get(keys)
        assert got[gap] is None and payloads(got[:gap]) == data[:gap]
        assert await kv.exists(keys[gap - 1:gap + 2]) == [True, False, True]
        assert await kv.lookup(keys, pin=True) == gap
        leases = sum(s["store"]["leases"] for s in (await kv.stats())["servers"].values())
        assert leases == gap  # each server pinned its share's own prefix; those past the gap were dropped
        assert await kv.unpin(keys[:gap]) == gap
        assert await kv.delete(keys) == 29
        assert await kv.lookup(keys) == 0

    with KVClient(addrs, namespace="sh") as sync:  # the blocking facade shards the same way
        sync.put(keys[:6], data[:6])
        assert sync.lookup(keys) == 6 and sync.get(keys[5:7])[1] is None


async def lookup_counts(kv: AsyncKVClient) -> dict[str, int]:
    stats = (await kv.stats())["servers"]
    return {a: s["requests"].get("lookup", 0) for a, s in stats.items()}


def test_a_put_names_a_parent_only_to_the_server_that_holds_it() -> None:
    """A parent named but absent marks a block stranded, so each server's share of a sharded
    put gets its first key's predecessor only when that predecessor lives on the same server."""
    addrs = [f"10.0.0.{i}:7600" for i in range(1, 4)]
    kv = AsyncKVClient(addrs, namespace="sh")  # nothing is connected: placement only
    ring = Ring(addrs)
    for k in chain(60, "parent"):
        owner = ring.node_of(k)
        assert [kv._local_parent(node, k) for node in kv.nodes] == [k if n == owner else None for n in range(3)]
        assert [kv._local_parent(node, None) for node in kv.nodes] == [None] * 3
    single = AsyncKVClient("10.0.0.1:7600", namespace="sh")
    assert single._local_parent(single.nodes[0], b"k") == b"k"


def test_bad_address_lists_are_kvstore_errors() -> None:
    for addrs in ([], ["127.0.0.1:7600", "127.0.0.1:7600"]):  # (a duplicate raised a bare ValueError)
        with pytest.raises(InvalidRequest) as info:
            AsyncKVClient(addrs)
        assert isinstance(info.value, KVStoreError)
        with pytest.raises(InvalidRequest):
            KVClient(addrs)


async def test_a_lookup_answers_from_the_servers_that_answer(make_server) -> None:
    """With a server down, a lookup used to fail whole (an engine takes that for a miss of every
    block) even where the servers that answered already told the answer; its keys now count as
    missing, and the lookup raises only when no server answered."""
    from kvstore.errors import TransportError

    servers = [make_server("--capacity", MEM) for _ in range(3)]
    addrs = [s.addr for s in servers]
    ring = Ring(addrs)
    keys = chain(40, "down")
    data = [random.Random(k).randbytes(3000) for k in keys]
    async with AsyncKVClient(addrs, namespace="sh", retries=0, connect_timeout=2) as kv:
        await kv.put(keys, data)
        down = next(ring.node_of(k) for k in keys if ring.node_of(k) != ring.node_of(keys[0]))  # not the first key's
        first_down = next(i for i, k in enumerate(keys) if ring.node_of(k) == down)
        servers[down].stop()
        assert await kv.lookup(keys) == first_down  # what can be fetched now
        assert payloads(await kv.get(keys[:first_down])) == data[:first_down]
        assert await kv.lookup(keys, pin=True) == first_down
        leases = 0
        for addr in (a for n, a in enumerate(addrs) if n != down):
            async with AsyncKVClient(addr, namespace="sh") as one:
                leases += (await one.stats())["store"]["leases"]
        assert leases == first_down  # the live servers' leases past the answer were dropped
        assert await kv.unpin(keys[:first_down]) == first_down
        assert first_down > 0 and await kv.delete(keys[:1]) == 1
        assert await kv.lookup(keys) == 0  # told by a server that answered: the one down does not matter
        for n, s in enumerate(servers):
            if n != down:
                s.stop()
        with pytest.raises(TransportError, match=r"127\.0\.0\.1:\d+"):  # (naming a server)
            await kv.lookup(keys)  # no server answered


async def test_exists_and_stats_answer_from_the_servers_that_answer(make_server) -> None:
    """With a server down, exists() failed whole, so the vLLM adapter's prepare_store (which asks
    it) stored nothing on any server, and stats() showed none of them. exists() now answers as a
    lookup does (the failed server's keys absent); stats() lists the failed server apart."""
    from kvstore.errors import TransportError

    servers = [make_server("--capacity", MEM) for _ in range(3)]
    addrs = [s.addr for s in servers]
    ring = Ring(addrs)
    keys = chain(30, "exists")
    async with AsyncKVClient(addrs, namespace="sh", retries=0, connect_timeout=2) as kv:
        await kv.put(keys[:20], [k * 10 for k in keys[:20]])
        assert await kv.exists([]) == []
        servers[1].stop()
        on_live = [ring.node_of(k) != 1 for k in keys]
        assert 0 < sum(on_live) < len(keys)
        assert await kv.exists(keys) == [i < 20 and live for i, live in enumerate(on_live)]
        st = await kv.stats()
        assert sorted(st["servers"]) == sorted([addrs[0], addrs[2]])
        assert list(st["errors"]) == [addrs[1]] and "TransportError" in st["errors"][addrs[1]]
        stored = sum(s["namespaces"]["sh"]["blocks"] for s in st["servers"].values())
        assert stored == sum(on_live[:20])
        servers[0].stop()
        servers[2].stop()
        with pytest.raises(TransportError):
            await kv.exists(keys)  # no server answered
        with pytest.raises(TransportError):
            await kv.stats()


async def test_a_flush_that_fails_on_a_server_says_where_and_can_be_sent_there_alone(make_server) -> None:
    """(vLLM flush-on-reset review) A flush over several servers raised the first failure, saying
    neither which servers it had reached nor letting a retry skip them: the adapter's retries
    emptied the servers that had taken the flush, again and again."""
    from kvstore.errors import TransportError

    servers = [make_server("--capacity", MEM) for _ in range(3)]
    addrs = [s.addr for s in servers]
    keys = chain(30, "flush")
    async with AsyncKVClient(addrs, namespace="fl", retries=0, connect_timeout=2) as kv:
        await kv.put(keys, [k * 10 for k in keys])
        servers[1].stop()
        with pytest.raises(TransportError) as failed:
            await kv.flush()
        assert list(failed.value.errors) == [addrs[1]]  # type: ignore[attr-defined]
        assert sorted(failed.value.result) == sorted([addrs[0], addrs[2]])  # type: ignore[attr-defined]
        assert sum(failed.value.result.values()) == sum(Ring(addrs).node_of(k) != 1 for k in keys)  # type: ignore[attr-defined]
        after = [next(k for k in keys if Ring(addrs).node_of(k) != 1)]  # (on a server that is up)
        await kv.put(after, [b"after"])
        with pytest.raises(TransportError):
            await kv.flush(servers=[addrs[1]])  # the server that failed, alone
        assert await kv.exists(after) == [True]  # (the others were not flushed again)
        assert await kv.flush(servers=[addrs[0], addrs[2]]) == 1
        # (its review) one address as a string is that server (a substring test took "h:80" in
        # "h:8080"); an address the client does not have is refused, not taken as nothing to flush
        await kv.put(after, [b"again"])
        other = [a for a in (addrs[0], addrs[2]) if Ring(addrs).node_of(after[0]) != addrs.index(a)][0]
        assert await kv.flush(servers=other) == 0 and await kv.exists(after) == [True]
        for unknown in (["127.0.0.1:1"], [addrs[0].replace("127.0.0.1", "localhost")]):
            with pytest.raises(InvalidRequest, match="not addresses of this client"):
                await kv.flush(servers=unknown)
        assert await kv.exists(after) == [True]


async def test_a_flush_given_one_address_as_a_string_flushes_that_server_only(make_server, unix_path: str) -> None:
    """(review) servers="unix:/p/kv.sock2" was taken as a collection of characters, so the address
    "unix:/p/kv.sock" -- in it as a substring -- was flushed too."""
    paths = [unix_path, unix_path + "2"]
    for path in paths:
        make_server("--capacity", MEM, "--unix", path)
    addrs = [f"unix:{path}" for path in paths]
    keys = chain(20, "one")
    async with AsyncKVClient(addrs, namespace="fl1", retries=0, shm=False) as kv:
        await kv.put(keys, [k * 10 for k in keys])
        ring = Ring(addrs)
        on_first = [ring.node_of(k) == 0 for k in keys]
        assert 0 < sum(on_first) < len(keys)
        assert await kv.flush(servers=addrs[1]) == len(keys) - sum(on_first)
        assert await kv.exists(keys) == on_first


async def test_a_put_failing_on_two_servers_counts_every_block_not_stored(make_server) -> None:
    """Each server's share that fails whole raises its own error; with two such shares, the error
    raised says how many blocks of the put were not stored in all and keeps each key's error (a
    mutant raised the first server's error as it was: its message counted nothing, and named one
    server of two)."""
    from kvstore.errors import TransportError

    servers = [make_server("--capacity", MEM) for _ in range(3)]
    addrs = [s.addr for s in servers]
    ring = Ring(addrs)
    keys = chain(30, "two-down")
    async with AsyncKVClient(addrs, namespace="sh", retries=0, connect_timeout=2) as kv:
        await kv.ping()
        servers[0].stop()
        servers[1].stop()
        lost = [i for i, k in enumerate(keys) if ring.node_of(k) in (0, 1)]
        with pytest.raises(TransportError) as failed:
            await kv.put(keys, [b"x" * 100] * len(keys))
        assert str(failed.value).startswith(f"{len(lost)} of {len(keys)} blocks not stored: ")
        assert sorted(failed.value.errors) == lost  # type: ignore[attr-defined]
        assert failed.value.result.stored == len(keys) - len(lost)  # type: ignore[attr-defined]
        for i in lost:  # (each key's error names its own server)
            assert addrs[ring.node_of(keys[i])] in str(failed.value.errors[i])  # type: ignore[attr-defined]
