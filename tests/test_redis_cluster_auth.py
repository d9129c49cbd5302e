"""``--redis-cluster`` as a URL: a Redis Cluster with a password (requirepass), over TLS too.

Real 3-master clusters (one with a password, one with a password and TLS on client and bus
ports); the password must never show in the server's log, its STATS or the errors it sends.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

from kvstore.client import AsyncKVClient
from kvstore.errors import Unavailable
from kvstore.server.process import ServerProcess
from kvstore.server.redis_layout import block_key

from redis_fixtures import RedisClusterProcesses, RedisProcess, blocks, chain, free_port, payloads, wait_until

PASSWORD = "s3cret-Pw9"  # appears in no log line unless leaked
MEM = "16MiB"


class SecureCluster(RedisClusterProcesses):
    """Three masters with ``requirepass`` and ``masterauth``; with ``tls``, TLS on the client and
    bus ports, every node with the same self-signed certificate (so the nodes trust each other)."""

    def __init__(self, directory: Path, *, tls: bool = False) -> None:
        args = ["--masterauth", PASSWORD, *(["--tls-cluster", "yes"] if tls else [])]
        self.nodes = [RedisProcess(directory / f"node{i}", cluster=True, password=PASSWORD, tls=tls, args=args)
                      for i in range(3)]
        first = self.nodes[0].cert
        for node in self.nodes[1:]:
            if first is not None and node.cert is not None:
                shutil.copy(first, node.cert)
                shutil.copy(first.with_suffix(".key"), node.cert.with_suffix(".key"))

    def start(self, timeout: float = 20.0) -> SecureCluster:
        for node in self.nodes:
            node.start()
        subprocess.run([*self.nodes[0].cli_args(), "--cluster", "create", *(n.addr for n in self.nodes),
                        "--cluster-replicas", "0", "--cluster-yes"], capture_output=True, text=True,
                       timeout=timeout, check=True)
        wait_until(self.ok, timeout, "cluster_state:ok on every node", interval=0.1)
        return self

    def url(self, seeds: str, password: str = PASSWORD) -> str:
        """The ``--redis-cluster`` URL: ``redis[s]://:password@seeds`` (TLS: with the CA file)."""
        cert = self.nodes[0].cert
        if cert is None:
            return f"redis://:{password}@{seeds}"
        return f"rediss://:{password}@{seeds}?ssl_ca_certs={cert}"


def _cluster(directory: Path, tls: bool) -> Iterator[SecureCluster]:
    cluster = SecureCluster(directory, tls=tls)
    try:
        yield cluster.start()
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def auth_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureCluster]:
    yield from _cluster(tmp_path_factory.mktemp("auth-cluster"), tls=False)


@pytest.fixture(scope="module")
def tls_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureCluster]:
    yield from _cluster(tmp_path_factory.mktemp("tls-cluster"), tls=True)


def holders(cluster: SecureCluster, ns: str, keys: list[bytes]) -> list[int]:
    """Per key, how many masters hold its block (``redis-cli -a`` on each master, no redirects)."""
    return [sum(node.cli("EXISTS", block_key(ns, k)) == "1" for node in cluster.nodes) for k in keys]


def assert_never_shown(srv: ServerProcess, *texts: str) -> None:
    srv.stop()  # every line it logged, shutdown included
    logged = "".join(srv.log)
    assert PASSWORD not in logged and all(PASSWORD not in t for t in texts)


async def _write_and_read_back(cluster: SecureCluster, make_server, seeds: str, ns: str) -> None:  # type: ignore[no-untyped-def]
    url = cluster.url(seeds)
    writer = make_server("--capacity", MEM, "--redis-cluster", url)
    reader = make_server("--capacity", MEM, "--redis-cluster", url)  # empty memory: reads through
    keys = chain(24, ns)
    data = blocks(keys, 5000)
    async with AsyncKVClient(writer.addr, namespace=ns) as kv:
        assert (await kv.put(keys, data)).stored == 24
        st = await kv.stats()
    scheme = url.split("://")[0]
    assert st["tier"]["state"] == "ok" and st["tier"]["backend"] == "redis-cluster"
    assert st["tier"]["target"].startswith(f"cluster {scheme}://:***@{seeds}")
    assert holders(cluster, ns, keys) == [1] * 24  # in the cluster, seen with redis-cli -a
    assert all(len(node.cli("--scan", "--pattern", f"kvstore:{ns}:*").split()) > 0 for node in cluster.nodes)
    assert cluster.nodes[0].cli_bytes("-c", "GET", block_key(ns, keys[5]))[16:-1] == data[5]  # (header; newline)
    async with AsyncKVClient(reader.addr, namespace=ns) as kv:
        assert payloads(await kv.get(keys)) == data
        st2 = await kv.stats()
    assert st2["tier"]["fetched_blocks"] == 24
    for srv, stats in ((writer, st), (reader, st2)):
        assert_never_shown(srv, json.dumps(stats))


async def test_a_password_cluster_through_a_redis_url(auth_cluster: SecureCluster, make_server) -> None:
    seeds = f"{auth_cluster.nodes[0].addr},{auth_cluster.nodes[1].addr}"  # two seeds of three
    await _write_and_read_back(auth_cluster, make_server, seeds, "auth/bf16/tp0")


async def test_a_tls_cluster_with_a_password_through_a_rediss_url(tls_cluster: SecureCluster,
                                                                  make_server) -> None:
    await _write_and_read_back(tls_cluster, make_server, tls_cluster.nodes[2].addr, "tls/bf16/tp0")


async def test_the_password_never_shows_when_the_cluster_fails(auth_cluster: SecureCluster, make_server) -> None:
    """Unreachable, or reachable with a wrong password: the tier degrades and says so, redacted;
    a put or delete then fails saying it is not retried (only the reconnect goes on)."""
    down = f"127.0.0.1:{free_port()}"
    unreachable = make_server("--capacity", MEM, "--redis-cluster", auth_cluster.url(down))
    wrong = make_server("--capacity", MEM, "--redis-cluster",
                        auth_cluster.url(auth_cluster.nodes[0].addr, password=f"not-{PASSWORD}"))
    keys = chain(3, "fails")
    for srv, seeds in ((unreachable, down), (wrong, auth_cluster.nodes[0].addr)):
        line = srv.wait_log("redis tier degraded")
        assert f"(cluster redis://:***@{seeds})" in line
        async with AsyncKVClient(srv.addr, namespace="fails", retries=0) as kv:
            tier = (await kv.stats())["tier"]
            assert tier["state"] == "degraded" and tier["target"] == f"cluster redis://:***@{seeds}"
            with pytest.raises(Unavailable) as put:
                await kv.put(keys, blocks(keys, 100))
            with pytest.raises(Unavailable) as delete:
                await kv.delete(keys)
            assert await kv.exists(keys) == [False] * 3  # the failed put left nothing
        for err in (put.value, delete.value):
            assert "this request failed and is not retried" in str(err)
            assert "reconnects to redis on its own" in str(err) and "retrying in the background" not in str(err)
        assert_never_shown(srv, json.dumps(tier), str(put.value), str(delete.value))
        if srv is wrong:
            assert "invalid username-password pair" in tier["last_error"]  # Redis' answer, no password in it


def test_a_cluster_user_refused_cluster_slots_starts_degraded_not_called_a_plain_redis(
        auth_cluster: SecureCluster, make_server) -> None:  # type: ignore[no-untyped-def]
    """redis-py words any refused CLUSTER SLOTS (here an ACL's NOPERM) as "cluster mode is not
    enabled": the start ended (exit 2, which systemd does not restart) saying a plain Redis."""
    for node in auth_cluster.nodes:
        node.cli("ACL", "SETUSER", "nocluster", "on", ">pw-nocluster", "~*", "+@all", "-cluster")
    try:
        srv = make_server("--capacity", MEM, "--redis-cluster", f"redis://nocluster:pw-nocluster@{auth_cluster.nodes[0].addr}")
        srv.wait_log("redis tier degraded")  # (an outage: it heals when the user is given CLUSTER)
        assert srv.proc is not None and srv.proc.poll() is None
    finally:
        for node in auth_cluster.nodes:
            node.cli("ACL", "DELUSER", "nocluster")


@pytest.mark.parametrize("value", [
    f"redis://:{PASSWORD}@127.0.0.1",  # no port
    f"http://:{PASSWORD}@127.0.0.1:7000",
    f"redis://:{PASSWORD}@127.0.0.1:7000/3",  # a cluster has db 0 only
    f"redis://:{PASSWORD}@127.0.0.1:7000?no_such_option=1",
    f"{PASSWORD}@127.0.0.1:7000",  # the scheme forgotten
    "redis://:Top/Secret@127.0.0.1:7000,127.0.0.1:7001",  # a password urllib splits: its error quotes a piece
])
def test_a_bad_cluster_value_exits_2_without_the_password(value: str) -> None:
    done = subprocess.run([sys.executable, "-m", "kvstore.server.cli", "--port", "0", "--capacity", "1MiB",
                           "--redis-cluster", value], capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and "--redis-cluster" in done.stderr, done.stderr
    assert PASSWORD not in done.stderr + done.stdout and "Top" not in done.stderr and "Secret" not in done.stderr


@pytest.mark.parametrize("url, said", [
    ("redis://:s3/cr?et@127.0.0.1:1/0", "Port could not be cast"),  # a password urllib splits: its error quotes a piece
    ("redis://127.0.0.1:1/0?foo=1", "unexpected keyword argument 'foo'"),  # was a traceback at the first request
])
def test_a_bad_redis_url_exits_2_at_start_without_any_piece_of_the_password(url: str, said: str) -> None:
    done = subprocess.run([sys.executable, "-m", "kvstore.server.cli", "--port", "0", "--capacity", "1MiB",
                           "--redis", url], capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and "bad --redis URL" in done.stderr and said in done.stderr, done.stderr
    for piece in ("s3", "cr", "et"):
        assert f"'{piece}'" not in done.stderr and f"{piece}@" not in done.stderr
