"""kvstore-servers in front of a real 3-master Redis Cluster (one cluster for the module).

Blocks spread over every master (no hash tags), prefix lookups and gets stay
correct across slots, and several servers share every block.
"""

from __future__ import annotations

import asyncio
import subprocess
from typing import Any

import pytest

from kvstore.client import AsyncKVClient
from kvstore.errors import TooLarge, Unavailable
from kvstore.server.redis_layout import block_key, ns_record_key

from redis_fixtures import (  # noqa: F401  (redis_cluster is a fixture)
    REDIS_CLI, RedisClusterProcesses, RedisProcess, blocks, chain, eventually, payloads, redis_cluster, wait_until,
)

MEM = "16MiB"


def holders(cluster: RedisClusterProcesses | list[RedisProcess], ns: str, keys: list[bytes]) -> list[int]:
    """Per key, how many masters hold its block (asked of each master directly, no redirects)."""
    nodes = cluster.nodes if isinstance(cluster, RedisClusterProcesses) else cluster
    return [sum(node.cli("EXISTS", block_key(ns, k)) == "1" for node in nodes) for k in keys]


async def test_blocks_spread_over_every_master(redis_cluster: RedisClusterProcesses, make_server) -> None:
    srv = make_server("--capacity", MEM, "--redis-cluster", redis_cluster.spec)
    keys = chain(48, "spread")
    data = blocks(keys, 10_000)
    async with AsyncKVClient(srv.addr, namespace="spread/bf16/tp0") as kv:
        assert (await kv.put(keys, data)).stored == 48
        tier = (await kv.stats())["tier"]
        assert tier["backend"] == "redis-cluster" and tier["target"] == "cluster " + redis_cluster.spec  # (no URL)
    pattern = "kvstore:spread/bf16/tp0:*"
    per_node = [len(node.cli("--scan", "--pattern", pattern).split()) for node in redis_cluster.nodes]
    assert all(n > 0 for n in per_node) and sum(per_node) == 48  # every master holds some of one namespace
    assert all(int(node.cli("DBSIZE")) > 0 for node in redis_cluster.nodes)
    assert holders(redis_cluster, "spread/bf16/tp0", keys) == [1] * 48
    record = redis_cluster.nodes[0].cli("-c", "HGET", ns_record_key("spread/bf16/tp0"), "blocks_hint")
    assert record == "48"


async def test_two_servers_share_one_cluster(redis_cluster: RedisClusterProcesses, make_server) -> None:
    a = make_server("--capacity", MEM, "--redis-cluster", redis_cluster.spec)
    b = make_server("--capacity", MEM, "--redis-cluster", redis_cluster.nodes[1].addr)  # one startup node is enough
    keys = chain(30, "shared")
    data = blocks(keys, 20_000)
    async with AsyncKVClient(a.addr, namespace="shared") as via_a, \
            AsyncKVClient(b.addr, namespace="shared") as via_b:
        await via_a.put(keys, data)
        assert await via_b.lookup(keys) == 30  # B's memory is empty: found in the cluster, across slots
        assert await via_b.lookup(chain(3, "absent") + keys) == 0
        got = await via_b.get(keys[:10])
        assert payloads(got) == data[:10]
        st = await via_b.stats()
        assert st["store"]["blocks"] == 10 and st["tier"]["fetched_blocks"] == 10  # promoted into B

        assert await via_a.delete([keys[17]]) == 1  # gone from A's memory and from the cluster
        assert holders(redis_cluster, "shared", keys[16:19]) == [1, 0, 1]
        assert await via_b.lookup(keys) == 17  # B still sees the rest, up to the gap
        assert (await via_b.get(keys[15:19]))[2] is None
        assert await via_b.exists(keys[16:19]) == [True, False, True]

        await via_b.put(keys[17:18], data[17:18])  # put back through B: A finds it
        assert await via_a.lookup(keys) == 30

        assert await via_a.flush() == 30  # SCAN on every master, then DEL
        assert holders(redis_cluster, "shared", keys) == [0] * 30
        assert redis_cluster.nodes[0].cli("-c", "EXISTS", ns_record_key("shared")) == "0"
        assert await via_b.lookup(keys) == 10  # only B's memory copies are left


async def test_a_master_down_and_back(redis_cluster: RedisClusterProcesses, make_server) -> None:
    """Last in the module: the restarted master comes back empty (no persistence)."""
    wt = make_server("--capacity", MEM, "--redis-cluster", redis_cluster.spec)
    wb = make_server("--capacity", MEM, "--redis-cluster", redis_cluster.spec, "--redis-mode", "write-behind")
    keys = chain(20, "master-down")
    data = blocks(keys, 2000)
    async with AsyncKVClient(wt.addr, namespace="md", retries=0) as a, \
            AsyncKVClient(wb.addr, namespace="md", retries=0) as b:
        await a.put(keys[:5], data[:5])
        redis_cluster.nodes[2].stop()

        async def degraded() -> bool:
            return all([(await kv.stats())["tier"]["state"] == "degraded" for kv in (a, b)])

        await eventually(degraded, 10, "both servers to see the cluster degraded")
        assert await a.lookup(keys) == 5  # from memory
        with pytest.raises(Unavailable):
            await a.put(keys[5:], data[5:])
        assert (await b.put(keys[5:], data[5:])).stored == 15  # queued
        redis_cluster.nodes[2].start()

        async def caught_up() -> bool:
            st = [(await kv.stats())["tier"] for kv in (a, b)]
            return all(s["state"] == "ok" for s in st) and st[1]["backlog_blocks"] == 0

        await eventually(caught_up, 20, "the cluster to recover and the queue to drain")
    assert holders(redis_cluster, "md", keys[5:]) == [1] * 15
    for srv in (wt, wb):
        srv.wait_log("redis tier recovered")  # (a thread reads the server's log)
        assert sum("redis tier degraded" in line for line in srv.log) == 1
        assert sum("redis tier recovered" in line for line in srv.log) == 1


async def test_connections_the_cluster_dropped_are_reopened_not_an_outage(
        redis_cluster: RedisClusterProcesses, make_server) -> None:
    srv = make_server("--capacity", MEM, "--redis-cluster", redis_cluster.spec)
    keys = chain(12, "dropped")
    data = blocks(keys, 1000)
    async with AsyncKVClient(srv.addr, namespace="dropped/bf16/tp0") as kv:
        assert (await kv.put(keys[:6], data[:6])).stored == 6  # the tier's pooled connections are open now
        for node in redis_cluster.nodes:
            node.cli("CLIENT", "KILL", "TYPE", "normal")  # an idle timeout, a restart: the connections are gone
        assert (await kv.put(keys[6:], data[6:])).stored == 6  # (was: Unavailable, the tier degraded)
        tier = (await kv.stats())["tier"]
        assert tier["state"] == "ok" and tier["outages"] == 0


async def test_the_value_limit_is_the_lowest_of_every_master(redis_cluster: RedisClusterProcesses,
                                                             make_server) -> None:
    low = redis_cluster.nodes[2]
    low.cli("CONFIG", "SET", "proto-max-bulk-len", "1mb")
    try:
        srv = make_server("--capacity", MEM, "--redis-cluster", redis_cluster.spec)
        keys = chain(2, "bulk")
        async with AsyncKVClient(srv.addr, namespace="bulk", retries=0) as kv:
            with pytest.raises(TooLarge, match="backing tier"):  # whichever master the key would go to
                await kv.put(keys, [b"s" * 1000, b"b" * (2 << 20)])
    finally:
        low.cli("CONFIG", "SET", "proto-max-bulk-len", "512mb")


async def test_a_server_started_while_a_master_is_down_starts_degraded_and_recovers(
        redis_cluster: RedisClusterProcesses, make_server) -> None:
    """With redis-py before 7.2 a master down at start crashed the server (redis-py closed the
    connections its other nodes' commands were using: AttributeError ... 'writelines'), and one
    down later could leave the tier degraded for good ("at least one reachable node: None")."""
    redis_cluster.nodes[2].stop()
    try:
        srv = make_server("--capacity", MEM, "--redis-cluster", redis_cluster.spec)
        async with AsyncKVClient(srv.addr, namespace="late-master", retries=0) as kv:
            assert (await kv.stats())["tier"]["state"] == "degraded"
            redis_cluster.nodes[2].start()

            async def ok() -> bool:
                return (await kv.stats())["tier"]["state"] == "ok"

            await eventually(ok, 20, "the tier to see the whole cluster")
            keys = chain(12, "late-master")
            assert (await kv.put(keys, blocks(keys, 1000))).stored == 12
        assert holders(redis_cluster, "late-master", keys) == [1] * 12
    finally:
        if redis_cluster.nodes[2].proc is None or redis_cluster.nodes[2].proc.poll() is not None:
            redis_cluster.nodes[2].start()


async def test_connections_cut_on_one_master_after_another_cost_no_outage(redis_cluster: RedisClusterProcesses) -> None:
    """redis-py checks no cluster connection before use, and renews a node's idle ones only once one of
    them failed: with one master's connections cut before a request and the next master's while it
    was sent again (CLIENT KILL on each in turn, a proxy's idle timeout), the second try met a dead
    connection too, and the whole tier went degraded (5-8 times in 30 rounds of a review's run).
    (In process: the second cut goes in between the tries.)"""
    from kvstore.config import ServerConfig
    from kvstore.server.redis_tier import RedisTier

    tier = RedisTier.from_config(ServerConfig(redis_cluster=redis_cluster.spec, capacity=1 << 20, prefault=False))
    assert tier is not None
    await tier.start()
    try:
        keys = chain(48, "cut")
        assert await tier.exists("cut", keys, strict=True) == [False] * 48  # a connection to every master
        first, second = redis_cluster.nodes[0], redis_cluster.nodes[1]
        first.cli("CLIENT", "KILL", "TYPE", "normal")
        sent = 0
        pipeline = tier.client.pipeline

        def cutting_pipeline(*args: Any, **kwargs: Any) -> Any:
            pipe = pipeline(*args, **kwargs)
            execute = pipe.execute

            async def execute_then_cut(*a: Any, **kw: Any) -> Any:
                nonlocal sent
                sent += 1
                try:
                    return await execute(*a, **kw)
                finally:
                    if sent == 1:
                        second.cli("CLIENT", "KILL", "TYPE", "normal")

            pipe.execute = execute_then_cut
            return pipe

        tier.client.pipeline = cutting_pipeline  # type: ignore[method-assign]
        assert await tier.exists("cut", keys, strict=True) == [False] * 48
        assert sent == 3 and tier.counters["outages"] == 0
    finally:
        await tier.close()


def _node_id(node: Any) -> str:
    return node.cli("CLUSTER", "MYID").strip()


def _owner(cluster: RedisClusterProcesses, slot: int) -> Any:
    for line in cluster.nodes[0].cli("CLUSTER", "NODES").splitlines():
        fields = line.split()
        for r in fields[8:]:
            lo, _, hi = r.partition("-")
            if lo.isdigit() and int(lo) <= slot <= int(hi or lo):
                return next(n for n in cluster.nodes if n.addr == fields[1].split("@")[0])
    raise LookupError(slot)


async def test_a_slot_being_migrated_is_written_and_read_through_its_ask_redirect(
        redis_cluster: RedisClusterProcesses, make_server) -> None:
    """(cluster review) While a slot migrates (the first step of every reshard: MIGRATING on its
    master, IMPORTING on the new one), a block new to it is asked for on the new master (ASK).
    redis-py sends ASKING on one pooled connection and the command on another, so the new master
    answered MOVED back and the command went round until "TTL exhausted": every such put failed
    and the whole tier went degraded, again and again for the whole migration."""
    from redis.crc import key_slot

    writer = make_server("--capacity", MEM, "--redis-cluster", redis_cluster.spec)
    reader = make_server("--capacity", MEM, "--redis-cluster", redis_cluster.spec)  # (empty memory: reads Redis)
    ns = "migrating"
    keys = chain(400, "migrating")
    slot = key_slot(block_key(ns, keys[0]).encode())
    source = _owner(redis_cluster, slot)
    assert source.cli("CLUSTER", "COUNTKEYSINSLOT", str(slot)) == "0"
    target = next(n for n in redis_cluster.nodes if n is not source)
    moving = [k for k in keys if key_slot(block_key(ns, k).encode()) == slot][:1] + \
        [k for k in keys if key_slot(block_key(ns, k).encode()) != slot][:8]  # one of the slot's, others beside it
    data = blocks(moving, 5000)
    async with AsyncKVClient(writer.addr, namespace=ns) as w:
        assert (await w.put(moving[1:], data[1:])).stored == 8  # pooled connections to every master
        warm = chain(64, "warm")  # puts at once: the tier's pipelines at once, several connections to each master
        await asyncio.gather(*(w.put([k], [b"w" * 4096]) for k in warm))
        target.cli("CLUSTER", "SETSLOT", str(slot), "IMPORTING", _node_id(source))
        source.cli("CLUSTER", "SETSLOT", str(slot), "MIGRATING", _node_id(target))
        try:
            assert (await w.put(moving[:1], data[:1])).stored == 1  # (was: Unavailable, TTL exhausted)
            tier = (await w.stats())["tier"]
            assert tier["state"] == "ok" and tier["outages"] == 0
            async with AsyncKVClient(reader.addr, namespace=ns) as r:
                await asyncio.gather(*(r.get([k]) for k in warm))  # (the reader's connections too)
                assert payloads(await r.get(moving)) == data  # read through the same redirect
                tier = (await r.stats())["tier"]
                assert tier["state"] == "ok" and tier["outages"] == 0
        finally:  # the migration finished: the slot is the target's (its one key is there already)
            for node in (target, source, *(n for n in redis_cluster.nodes if n not in (source, target))):
                node.cli("CLUSTER", "SETSLOT", str(slot), "NODE", _node_id(target))
    assert holders(redis_cluster, ns, moving[:1]) == [1]


async def test_a_master_added_then_removed_under_a_running_server(tmp_path, make_server) -> None:
    """(cluster review) A master added: its first slot is imported through ASK redirects to a node
    redis-py does not know yet (it lists masters with slots only), and a flush then reaches it
    (redis-py's SCAN asked the masters it listed). Then removed as Redis documents
    it (its slots resharded away, then `--cluster del-node`, which leaves it running after CLUSTER
    RESET): it answered the health probe with cluster_state:fail, and redis-py still listed it (its
    view is renewed after connection errors and MOVED replies only, and none came while the tier
    was degraded): the tier stayed degraded until the process stopped."""
    from redis.crc import key_slot

    cluster = RedisClusterProcesses(tmp_path / "cluster").start()
    new = RedisProcess(tmp_path / "new", cluster=True)
    try:
        srv = make_server("--capacity", MEM, "--redis-cluster", cluster.spec)
        keep = cluster.nodes[0]
        ns = "added"
        keys = chain(24, ns)
        slot = key_slot(block_key(ns, keys[0]).encode())
        source = _owner(cluster, slot)
        async with AsyncKVClient(srv.addr, namespace=ns) as kv:
            assert (await kv.put(keys[1:12], blocks(keys[1:12], 1000))).stored == 11  # (every master has some)
            new.start()
            subprocess.run([REDIS_CLI, "--cluster", "add-node", new.addr, keep.addr], capture_output=True,
                           timeout=60, check=True)
            wait_until(lambda: all(n.cli("CLUSTER", "NODES").count("master") == 4 for n in cluster.nodes) and
                       "cluster_state:ok" in new.cli("CLUSTER", "INFO"), 20, "every node to know the new one")
            new.cli("CLUSTER", "SETSLOT", str(slot), "IMPORTING", _node_id(source))
            source.cli("CLUSTER", "SETSLOT", str(slot), "MIGRATING", _node_id(new))
            assert (await kv.put(keys[:1], blocks(keys[:1], 1000))).stored == 1  # (was: the tier degraded)
            for node in (new, source, *(n for n in cluster.nodes if n is not source)):
                node.cli("CLUSTER", "SETSLOT", str(slot), "NODE", _node_id(new))
            assert holders([*cluster.nodes, new], ns, keys[:1]) == [1]
            assert new.cli("EXISTS", block_key(ns, keys[0])) == "1"
            await kv.flush()  # (before any MOVED showed redis-py the new master: its SCAN had left it out)
            assert holders([*cluster.nodes, new], ns, keys[:12]) == [0] * 12
            assert (await kv.put(keys[:12], blocks(keys[:12], 1000))).stored == 12

            for args in (["reshard", keep.addr, "--cluster-from", _node_id(new), "--cluster-to", _node_id(keep),
                          "--cluster-slots", "16384", "--cluster-yes"], ["del-node", keep.addr, _node_id(new)]):
                subprocess.run([REDIS_CLI, "--cluster", *args], capture_output=True, timeout=120, check=True)
            assert "cluster_state:fail" in new.cli("CLUSTER", "INFO")  # (still running)
            await asyncio.sleep(3)  # a few health probes
            tier = (await kv.stats())["tier"]
            assert tier["state"] == "ok" and tier["outages"] == 0, tier["last_error"]
            assert (await kv.put(keys[12:], blocks(keys[12:], 1000))).stored == 12
        assert holders([*cluster.nodes, new], ns, keys[1:]) == [1] * 23
    finally:
        new.stop()
        cluster.stop()
