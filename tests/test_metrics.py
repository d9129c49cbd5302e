"""``/metrics``, ``/healthz`` and ``/livez`` of a real kvstore-server after known traffic."""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import struct
import time
import urllib.error
import urllib.request
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvstore.client import AsyncKVClient, KVClient
from kvstore.client.aio import checksum
from kvstore.errors import TooLarge
from kvstore.protocol import Get, Hello, Lookup, Ping, Put, ShmAttach, encode
from kvstore.server.cli import config_from_args
from kvstore.server.metrics import SHM_METRICS, TIER_METRICS
from redis_fixtures import redis_server, reserved_bytes, wait_until  # noqa: F401  (redis_server: a fixture)
from shm_helpers import raw_exchange, shm_locate, unix_path  # noqa: F401  (unix_path: a fixture)

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def key(i: int, tag: str) -> bytes:
    return hashlib.sha256(f"{tag}{i}".encode()).digest()


def http(url: str, method: str = "GET") -> tuple[int, str, str]:
    """(status, content type, body) of one request; error statuses are returned, not raised."""
    req = urllib.request.Request(url, method=method)
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status, resp.headers["Content-Type"], resp.read().decode()
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, exc.headers["Content-Type"], exc.read().decode()


def scrape(base: str) -> Samples:
    status, ctype, body = http(base + "/metrics")
    assert status == 200 and ctype.startswith("text/plain")
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(body) for s in fam.samples}


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


def frame_len(msg: Any, payload: list[bytes] = ()) -> int:  # type: ignore[assignment]
    return sum(len(b) for b in encode(msg, 1, payload))


def test_the_shm_attach_reply_counts_in_bytes_out(make_server, metrics_url, unix_path: str) -> None:
    """(metrics review) The reply that carries the arena's descriptor is written past the
    connection's transport, and was never counted in kvstore_bytes_out_total."""
    srv = make_server("--capacity", "8MiB", "--metrics-port", "0", "--unix", unix_path)
    base = metrics_url(srv)
    before = value(scrape(base), "kvstore_bytes_out_total")
    frames, fds = raw_exchange(unix_path, Hello(), ShmAttach())
    for fd in fds:
        os.close(fd)
    received = sum(len(b) for f in frames for b in encode(f.msg, f.request_id))  # (the frames as sent)
    assert len(fds) == 1 and value(scrape(base), "kvstore_bytes_out_total") - before == received


def test_a_latency_lands_in_the_first_bucket_whose_bound_holds_it() -> None:
    """Prometheus' ``le``: a 0.3 ms request counts in the 0.5 ms bucket and every one above, not in
    the 0.25 ms one; one of exactly a bound counts in that bound's bucket."""
    from kvstore.server.metrics import LATENCY_BUCKETS, LatencyHistograms

    h = LatencyHistograms()
    h.observe("get", 3e-4)
    h.observe("get", LATENCY_BUCKETS[0])
    h.observe("get", 1e9)  # past every bound: +Inf only
    counts = dict(h.cumulative("get"))
    below = max(b for b in LATENCY_BUCKETS if b < 3e-4)
    above = min(b for b in LATENCY_BUCKETS if b >= 3e-4)
    assert counts[repr(LATENCY_BUCKETS[0])] == 1 and counts[repr(below)] == 1
    assert counts[repr(above)] == 2 and counts[repr(LATENCY_BUCKETS[-1])] == 2 and counts["+Inf"] == 3


async def test_counters_match_known_traffic_exactly(make_server, metrics_url) -> None:
    srv = make_server("--capacity", "16MiB", "--metrics-port", "0")
    base = metrics_url(srv)
    blocks = [b"a" * 1000, b"b" * 2000, b"c" * 3000]
    keys = [key(i, "m") for i in range(3)]
    async with AsyncKVClient(srv.addr, namespace="alpha", pool_size=1) as kv:
        for k, b in zip(keys, blocks):  # exactly 3 puts
            await kv.put([k], [b])
        assert await kv.lookup(keys + [key(9, "m")]) == 3  # 3 keys hit, 1 missed
        assert [bytes(x) for x in await kv.get(keys[:1])] == blocks[:1]
        during = scrape(base)
    # a malformed request (an empty key) on a raw socket: one error reply
    bad = b"".join(bytes(b) for b in encode(Get(keys=[b""]), 5))
    with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as s:
        s.sendall(bad)
        assert s.recv(4096)[:2] == b"KV"
    after = scrape(base)
    # bytes that are no frame: the connection is closed, counted as a malformed request and error
    with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as s:
        s.sendall(b"KV" + bytes(18) + b"garbage")
        s.makefile("rb").read()  # (to the end: the server has closed it)
    garbage = scrape(base)
    assert value(garbage, "kvstore_requests_total", op="malformed") == 1
    assert value(garbage, "kvstore_errors_total", op="malformed") == 1

    expected_in = (frame_len(Hello(namespace="alpha", token=None, client="kvstore-py"))
                   + sum(frame_len(Put(keys=[k], sizes=[len(b)], checksums=[checksum(memoryview(b))]), [b])
                         for k, b in zip(keys, blocks))
                   + frame_len(Lookup(keys=keys + [key(9, "m")], pin=False, lease_ms=None))
                   + frame_len(Get(keys=keys[:1], unpin=False)))
    assert value(during, "kvstore_bytes_in_total") == expected_in
    assert value(after, "kvstore_bytes_in_total") == expected_in + len(bad)
    assert value(during, "kvstore_bytes_out_total") > 1000  # the GET reply carried a 1000-byte block
    assert value(during, "kvstore_connections") == 1
    assert value(after, "kvstore_connections") == 0
    lowered = [int(m.group(1)) for line in srv.log if (m := re.search(r"lowered to (\d+)", line))]
    assert value(after, "kvstore_max_connections") == (lowered or [1024])[0]  # the default cap, or what fits
    assert value(after, "kvstore_connections_accepted_total") == 2
    assert value(after, "kvstore_requests_total", op="put") == 3
    assert value(after, "kvstore_requests_total", op="hello") == 1
    assert value(after, "kvstore_requests_total", op="lookup") == 1
    assert value(after, "kvstore_errors_total", op="put") == 0
    assert value(after, "kvstore_errors_total", op="invalid") == 1
    assert value(after, "kvstore_namespace_blocks", namespace="alpha") == 3
    assert value(after, "kvstore_namespace_bytes", namespace="alpha") == 6000
    assert value(after, "kvstore_blocks") == 3 and value(after, "kvstore_stored_bytes") == 6000
    assert value(after, "kvstore_stored_blocks_total") == 3
    assert value(after, "kvstore_lookup_keys_total", result="hit") == 3
    assert value(after, "kvstore_lookup_keys_total", result="miss") == 1
    assert value(after, "kvstore_lookup_prefix_hit_ratio") == 0.75
    assert value(after, "kvstore_capacity_bytes") == 16 << 20
    assert value(after, "kvstore_pinned_blocks") == 0
    assert value(after, "kvstore_tier_enabled") == 0
    assert value(after, "kvstore_request_duration_seconds_count", op="put") == 3
    assert value(after, "kvstore_request_duration_seconds_bucket", op="put", le="+Inf") == 3
    assert 0 < value(after, "kvstore_request_duration_seconds_sum", op="put") < 5
    assert value(after, "process_resident_memory_bytes") > 0
    assert ("kvstore_busy_poll_seconds_total", frozenset()) in after  # (what it counts: test_poll)
    assert not any(name in TIER_METRICS for name, _ in after)
    assert value(after, "kvstore_shm_offered") == 0 and not any(name in SHM_METRICS for name, _ in after)


def test_replies_written_outside_a_request_count_in_bytes_out(make_server, metrics_url) -> None:
    """(an HTTP client's 400 and a refused connection's error frame went out uncounted)"""
    srv = make_server("--capacity", "8MiB", "--metrics-port", "0", "--max-connections", "1")
    base = metrics_url(srv)

    def reply_to(sent: bytes) -> bytes:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as s:
            s.sendall(sent)
            got = b""
            while chunk := s.recv(65536):
                got += chunk
            return got

    before = value(scrape(base), "kvstore_bytes_out_total")
    http_reply = reply_to(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    assert http_reply.startswith(b"HTTP/1.1 400")
    assert value(scrape(base), "kvstore_bytes_out_total") == before + len(http_reply)
    with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as held:  # the one connection allowed
        held.sendall(b"".join(bytes(b) for b in encode(Ping(), 1)))
        pong = held.recv(4096)
        assert pong[:2] == b"KV"
        refused = reply_to(b"")
        assert refused[:2] == b"KV" and b"limit of 1 connections" in refused
        assert value(scrape(base), "kvstore_bytes_out_total") == before + len(http_reply) + len(pong) + len(refused)


async def test_evictions_and_pins_are_counted(make_server, metrics_url) -> None:
    srv = make_server("--capacity", "1MiB", "--metrics-port", "0")
    base = metrics_url(srv)
    async with AsyncKVClient(srv.addr, namespace="ev") as kv:
        first = [key(0, "ev")]
        await kv.put(first, [bytes(128 << 10)])
        assert await kv.lookup(first, pin=True) == 1  # pinned: eviction must skip it
        for i in range(1, 20):
            await kv.put([key(i, "ev")], [bytes(128 << 10)])
        await kv.delete([key(19, "ev")])  # room: a block no lookup reaches takes only free or stranded room
        await kv.put([key(21, "ev")], [b"tail"], parent=key(20, "ev"))  # its predecessor is absent: stranded
        stats = await kv.stats()
        samples = scrape(base)
    assert stats["store"]["evictions"] >= 12
    assert value(samples, "kvstore_evictions_total") == stats["store"]["evictions"]
    assert value(samples, "kvstore_evicted_bytes_total") == stats["store"]["evictions"] * (128 << 10)
    assert value(samples, "kvstore_pinned_blocks") == 1
    assert value(samples, "kvstore_leases") == 1
    assert value(samples, "kvstore_stranded_blocks") == stats["store"]["stranded_blocks"] == 1
    assert value(samples, "kvstore_used_bytes") <= 1 << 20


def test_health_and_routes(make_server, metrics_url) -> None:
    srv = make_server("--capacity", "8MiB", "--metrics-port", "0")
    base = metrics_url(srv)
    status, ctype, body = http(base + "/healthz")
    assert (status, ctype, json.loads(body)) == (200, "application/json", {"status": "ok", "tier": None})
    assert http(base + "/readyz")[:2] == (200, "application/json")
    assert http(base + "/livez")[0] == 200
    assert http(base + "/nope")[0] == 404
    assert http(base + "/metrics", method="POST")[0] == 405
    with socket.create_connection(("127.0.0.1", int(base.rsplit(":", 1)[1])), timeout=5) as s:
        s.sendall(b"\x00garbage\r\n\r\n")
        assert s.recv(100).startswith(b"HTTP/1.0 400")
    # A head is at most 8 KiB in all (operations.md): many short header lines were read without end.
    with socket.create_connection(("127.0.0.1", int(base.rsplit(":", 1)[1])), timeout=5) as s:
        s.sendall(b"GET /livez HTTP/1.0\r\n" + b"X-Pad: 0123456789abcdef0123456789abcdef\r\n" * 300 + b"\r\n")
        assert s.recv(100).startswith(b"HTTP/1.0 400")
    with socket.create_connection(("127.0.0.1", int(base.rsplit(":", 1)[1])), timeout=5) as s:
        s.sendall(b"GET /livez HTTP/1.0\r\n" + b"X-Pad: 0123456789abcdef0123456789abcdef\r\n" * 100 + b"\r\n")
        assert s.recv(100).startswith(b"HTTP/1.0 200")


def test_a_down_redis_tier_is_unhealthy_but_still_ready(make_server, metrics_url) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    srv = make_server("--capacity", "8MiB", "--metrics-port", "0", "--redis", f"redis://127.0.0.1:{dead}/0",
                      "--redis-timeout", "0.5")
    base = metrics_url(srv)
    status, _, body = http(base + "/healthz")
    assert status == 503 and json.loads(body) == {"status": "degraded", "tier": "degraded"}
    # ready: memory still serves, and a Service would drop its only endpoint for a Redis outage
    status, _, body = http(base + "/readyz")
    assert status == 200 and json.loads(body) == {"status": "degraded", "tier": "degraded"}
    assert http(base + "/livez")[0] == 200  # alive: restarting would not bring Redis back
    samples = scrape(base)
    assert value(samples, "kvstore_tier_enabled") == 1 and value(samples, "kvstore_tier_up") == 0


async def test_healthz_and_tier_metrics_with_a_live_redis(make_server, metrics_url, redis_server) -> None:
    srv = make_server("--capacity", "8MiB", "--metrics-port", "0", "--redis", redis_server.url,
                      "--redis-mode", "write-behind", "--redis-queue-bytes", "3MiB")
    base = metrics_url(srv)
    status, _, body = http(base + "/healthz")
    assert status == 200 and json.loads(body) == {"status": "ok", "tier": "ok"}
    async with AsyncKVClient(srv.addr, namespace="t") as kv:
        await kv.put([key(1, "t")], [b"x" * 100])
    samples = scrape(base)
    assert value(samples, "kvstore_tier_up") == 1
    assert value(samples, "kvstore_tier_state", state="ok", mode="write-behind") == 1
    assert value(samples, "kvstore_tier_backlog_blocks") >= 0
    assert value(samples, "kvstore_tier_backlog_bytes") >= 0
    assert value(samples, "kvstore_tier_backlog_limit_bytes") == 3 << 20  # (the alert's 0.8 x limit, from /metrics)


async def test_failed_put_blocks_and_a_redis_refusing_writes_show_in_metrics(make_server, metrics_url,
                                                                             redis_server) -> None:
    """A PUT whose blocks fail is answered, not refused: it never counted in kvstore_errors_total. And a
    Redis that refuses writes (out of memory) fails every write-through put while the tier is "up":
    nothing on /metrics showed it. Both are counted now."""
    import redis as redis_py

    from kvstore.errors import KVStoreError

    srv = make_server("--capacity", "1MiB", "--metrics-port", "0", "--max-block", "64KiB",
                      "--redis", redis_server.url)
    base = metrics_url(srv)
    r = redis_py.Redis.from_url(redis_server.url)
    async with AsyncKVClient(srv.addr, namespace="fail", retries=0) as kv:
        with pytest.raises(KVStoreError):
            await kv.put([key(1, "big")], [b"x" * (100 << 10)])  # over --max-block: TooLarge
        r.set("filler", b"f" * 3_000_000)
        r.config_set("maxmemory", "2mb")
        r.config_set("maxmemory-policy", "noeviction")
        try:
            for i in range(3):
                with pytest.raises(KVStoreError):
                    await kv.put([key(i, "oom")], [b"y" * 1000])
        finally:
            r.config_set("maxmemory", "0")
            r.delete("filler")
    samples = scrape(base)
    assert value(samples, "kvstore_put_failed_blocks_total", error="TooLarge") == 1
    assert value(samples, "kvstore_put_failed_blocks_total", error="Unavailable") == 3
    assert value(samples, "kvstore_tier_failures_total") == 3
    assert value(samples, "kvstore_tier_up") == 1  # (Redis answers: refused writes are no outage)
    assert value(samples, "kvstore_tier_outages_total") == 0
    assert value(samples, "kvstore_tier_stored_blocks_total") == 0


def test_metrics_port_is_off_by_default_and_loopback_does_not_warn(server) -> None:
    assert not any("metrics served at" in line for line in server.log)
    assert not any("non-loopback" in line or "clear text" in line for line in server.log)


@pytest.mark.parametrize("bad", ["-1", "70000", "x"])
def test_bad_metrics_port_is_a_usage_error(bad: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        config_from_args(["--metrics-port", bad])
    assert info.value.code == 2 and "--metrics-port" in capsys.readouterr().err
    assert config_from_args(["--metrics-port", "off"]).metrics_port is None
    assert config_from_args(["--metrics-port", "9600"]).metrics_port == 9600


def test_healthz_says_draining_after_sigterm(make_server, metrics_url) -> None:
    import signal

    srv = make_server("--capacity", "8MiB", "--metrics-port", "0", "--drain-seconds", "5")
    base = metrics_url(srv)
    head = b"".join(bytes(b) for b in encode(Put(keys=[key(1, "d")], sizes=[1000]), 1, payload_len=1000))
    with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as s:
        s.sendall(head + b"x" * 10)  # a PUT in flight keeps the server draining
        wait_until(lambda: reserved_bytes(srv.addr) > 0, 10, "the server to take the PUT's head")
        assert srv.proc is not None
        srv.proc.send_signal(signal.SIGTERM)
        srv.wait_log("stopping: draining")
        for path in ("/healthz", "/readyz"):
            status, _, body = http(base + path)
            assert status == 503 and json.loads(body)["status"] == "draining"
        assert http(base + "/livez")[0] == 200
        s.sendall(b"x" * 990)  # the PUT completes, its reply comes, the server exits
        assert s.recv(4096)[:2] == b"KV"
    assert srv.proc.wait(10) == 0


def test_labelled_counters_start_at_zero_so_a_first_burst_shows_in_rate(make_server, metrics_url) -> None:
    """A series born at its first event hides that event from rate(): five failed blocks made
    kvstore_put_failed_blocks_total{error="TooLarge"} appear at 5, and an alert on it never fired."""
    srv = make_server("--capacity", "8MiB", "--metrics-port", "0", "--max-block", "64KiB")
    base = metrics_url(srv)
    before = scrape(base)
    for op in ("put", "get", "lookup", "shm_commit", "invalid", "malformed"):
        assert value(before, "kvstore_requests_total", op=op) == 0
        assert value(before, "kvstore_errors_total", op=op) == 0
    for error in ("CapacityError", "InvalidRequest", "TooLarge", "Unavailable"):
        assert value(before, "kvstore_put_failed_blocks_total", error=error) == 0
    with KVClient(srv.addr, namespace="z") as kv:
        with pytest.raises(TooLarge):
            kv.put([key(i, "big") for i in range(5)], [b"x" * (65 << 10)] * 5)
    after = scrape(base)
    assert value(after, "kvstore_put_failed_blocks_total", error="TooLarge") == 5
    assert value(after, "kvstore_requests_total", op="put") == 1


async def test_every_counted_request_is_timed_shm_attach_too(make_server, metrics_url, unix_path: str) -> None:
    """(an attach was counted in kvstore_requests_total but never timed: the latency panel and a
    p99-by-op alert did not see it)"""
    srv = make_server("--capacity", "8MiB", "--metrics-port", "0", "--unix", unix_path)
    base = metrics_url(srv)
    async with AsyncKVClient(f"unix:{unix_path}", namespace="t") as kv:
        await kv.put([key(1, "attach")], [b"x" * 300_000])  # (over shared memory: attached first)
    samples = scrape(base)
    def per_op(metric: str) -> dict[str, float]:  # (every op has a series: those that ran)
        return {dict(labels)["op"]: v for (name, labels), v in samples.items() if name == metric and v}

    requests = per_op("kvstore_requests_total")
    assert requests["shm_attach"] >= 1 and per_op("kvstore_request_duration_seconds_count") == requests
    # and logged at the level every deploy/ file runs (info): a process mapped every namespace's blocks
    srv.wait_log("event=shm_attach")


async def test_shared_memory_counters_and_gauges_are_metrics(make_server, metrics_url, unix_path: str) -> None:
    """(they were in STATS only: a client holding read pins till they expire showed nowhere a
    dashboard or an alert looks)"""
    srv = make_server("--capacity", "8MiB", "--metrics-port", "0", "--unix", unix_path, "--lease-seconds", "1")
    base = metrics_url(srv)
    k = key(1, "shm-metrics")
    async with AsyncKVClient(f"unix:{unix_path}", namespace="t") as kv:
        await kv.put([k], [b"x" * 300_000])  # over shared memory: attached, reserved, committed
        await shm_locate(kv, [k])  # a read handle never released
        held, stats = scrape(base), (await kv.stats())["shm"]
        assert value(held, "kvstore_shm_offered") == 1
        assert value(held, "kvstore_shm_open_handles") == stats["open_handles"] == 1
        assert value(held, "kvstore_shm_read_pins") == stats["pins"] == 1
        assert value(held, "kvstore_shm_attached_total") == stats["attached"] >= 1

        def expired() -> bool:  # past the lease, and past a housekeeping sweep (every second)
            return value(scrape(base), "kvstore_shm_read_pins_expired_total") == 1

        wait_until(expired, 10, "the read pins to expire")
        after, stats = scrape(base), (await kv.stats())["shm"]
    assert value(after, "kvstore_shm_open_handles") == value(after, "kvstore_shm_read_pins") == 0
    fields = {"attached": "attached", "attach_refused": "refused", "read_pins_expired": "expired",
              "puts_expired": "put_expired", "puts_aborted": "aborted_on_close", "inline_blocks": "inline_blocks"}
    assert {name: value(after, f"kvstore_shm_{name}_total") for name in fields} == {
        name: stats[field] for name, field in fields.items()}
    assert {name for name, _ in after if name.startswith("kvstore_shm_")} == {*SHM_METRICS, "kvstore_shm_offered"}


async def test_idle_connections_to_the_metrics_port_cannot_take_the_clients_descriptors(make_server, metrics_url) -> None:
    """(the listener had no cap: ~1,100 idle connections to it used up a server's open-file limit,
    and new kvstore clients were closed without an answer, a log line or a counter)"""
    srv = make_server("--capacity", "8MiB", "--metrics-port", "0")
    assert srv.proc is not None
    base = metrics_url(srv)
    host, port = base.removeprefix("http://").rsplit(":", 1)
    fds = len(os.listdir(f"/proc/{srv.proc.pid}/fd"))
    idle = [socket.create_connection((host, int(port)), timeout=5) for _ in range(100)]
    try:
        srv.wait_log("metrics listener: 16 connections open, closed the oldest one waiting for its request")
        assert len(os.listdir(f"/proc/{srv.proc.pid}/fd")) < fds + 16 + 8  # (the 84 others closed)
        for path in ("/livez", "/readyz", "/metrics"):  # (a probe is answered: it takes an idle one's place)
            assert http(base + path)[0] == 200, path
        async with AsyncKVClient(srv.addr, namespace="m") as kv:
            await kv.put([key(1, "fd")], [b"x"])
    finally:
        for s in idle:
            s.close()
    for _ in range(50):  # connections reset at once (a load balancer's check, a port scan)
        with socket.create_connection((host, int(port)), timeout=5) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    assert http(base + "/livez")[0] == 200
    srv.stop()
    assert not [line for line in srv.log if "level=error" in line or "Traceback" in line]  # (one per connection)
