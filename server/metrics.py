"""Prometheus metrics and health checks, served over HTTP on the server's own event loop.

Why a custom collector: the request path already keeps plain-int counters
(:class:`~kvstore.server.service.Counters`) and the store keeps its own
(``BlockStore.stats()``); the collector turns them into ``kvstore_*`` metric
families *at scrape time*, so serving a request costs no metric-library call.
The one per-request cost is a latency observation: a ``perf_counter`` in the
connection and :meth:`LatencyHistograms.observe` (a bisect over 16 bounds and
two additions; prometheus-client's ``Histogram.observe`` takes a lock and
costs several times that).

Why on the event loop instead of ``prometheus_client.start_http_server``: that
server runs in a thread, and a scrape would then read dicts the loop is
mutating. Here a scrape runs between two callbacks and sees one consistent
state. The listener is a few dozen lines of HTTP/1.0 for four paths:

``/metrics``  the Prometheus text exposition.
``/readyz``   readiness: 200 while serving (a degraded tier too: memory still
              answers), 503 while draining. A Kubernetes Service drops a pod
              that is not ready, and clients place keys by server, not through
              a load balancer: a readiness that followed Redis would turn a
              Redis outage into a kvstore outage.
``/healthz``  health: 200 ``{"status": "ok"}`` while serving with a healthy
              backing tier, 503 while draining or while the tier is degraded.
``/livez``    liveness: 200 whenever the event loop answers. Kubernetes
              restarts a pod that fails liveness, and a Redis outage is not
              cured by restarting kvstore, so liveness does not look at the tier.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, PlatformCollector, ProcessCollector
from prometheus_client.core import (
    CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, InfoMetricFamily, Metric,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from kvstore.messages import OP_NAMES

from .latency import LATENCY_BUCKETS, LatencyHistograms

if TYPE_CHECKING:
    from .service import Service

log = logging.getLogger(__name__)

#: The tier's counters (``kvstore-cli stats``), exported as ``kvstore_tier_<name>_total``.
_TIER_COUNTERS = {
    "stored_blocks": "Blocks written to the tier",
    "stored_bytes": "Payload bytes written to the tier",
    "fetched_blocks": "Blocks read through from the tier",
    "fetch_misses": "Reads through that found no block (or a value that is not one)",
    "checksum_mismatches": "Blocks read from the tier that failed their checksum",
    "misplaced_values": "Values found under a key they do not belong to (copied or renamed in Redis)",
    "failures": "Tier calls that failed (a refused write, e.g. Redis out of memory, too)",
    "outages": "Times the tier went from healthy to degraded",
}

#: The shared-memory path's own counters (``kvstore-cli stats``' "shm"; its requests count in
#: ``kvstore_requests_total`` as ``shm_*`` ops), exported as ``kvstore_shm_<name>_total``.
_SHM_COUNTERS = {
    "attached": ("attached", "Same-host connections handed the arena (SHM_ATTACH)"),
    "refused": ("attach_refused", "SHM_ATTACHes refused: the token is not valid for every namespace"),
    "expired": ("read_pins_expired", "SHM_GET pin sets dropped unreleased after --lease-seconds (a client "
                                     "that hung or died mid-copy)"),
    "put_expired": ("puts_expired", "SHM_PUTs aborted uncommitted after --max-lease-seconds"),
    "aborted_on_close": ("puts_aborted", "SHM_PUTs aborted uncommitted as their connection closed"),
    "inline_blocks": ("inline_blocks", "Blocks SHM_GETs sent on the socket (read from the tier but not promoted: "
                                       "no room, or a bad checksum)"),
}
_SHM_GAUGES = {
    "open_handles": ("kvstore_shm_open_handles", "SHM_GET and SHM_PUT handles not yet released or committed"),
    "pins": ("kvstore_shm_read_pins", "Block pins the open SHM_GET handles hold"),
    "put_keys": ("kvstore_shm_put_keys", "Keys of SHM_PUTs waiting for their commit"),
}

#: Shared-memory metrics exist only when the server offers its arena (--unix and no --no-shm).
SHM_METRICS = (*(name for name, _ in _SHM_GAUGES.values()),
               *(f"kvstore_shm_{name}_total" for name, _ in _SHM_COUNTERS.values()))

#: Tier metrics exist only when the server has a backing tier.
TIER_METRICS = ("kvstore_tier_up", "kvstore_tier_state", "kvstore_tier_backlog_bytes", "kvstore_tier_backlog_blocks",
                "kvstore_tier_backlog_limit_bytes",
                *(f"kvstore_tier_{name}_total" for name in _TIER_COUNTERS))


#: The ``op`` label's values: each request, a well-framed invalid one, a connection closed for bytes that are no frame.
OPS_COUNTED = (*OP_NAMES.values(), "invalid", "malformed")
#: What a PUT's block can fail with (its per-key status), as ``kvstore_put_failed_blocks`` names it.
PUT_BLOCK_ERRORS = ("CapacityError", "InvalidRequest", "TooLarge", "Unavailable")


def _with_zeros(counts: dict[str, int], names: Iterable[str]) -> dict[str, int]:
    return {**dict.fromkeys(names, 0), **counts}


class KVStoreCollector:
    """Reads the service's snapshot at scrape time and yields the ``kvstore_*`` families."""

    def __init__(self, service: Service) -> None:
        self.service = service

    def collect(self) -> Iterator[Metric]:
        snap = self.service.snapshot()
        yield InfoMetricFamily("kvstore_build", "kvstore version", value={"version": str(snap["version"])})
        yield GaugeMetricFamily("kvstore_uptime_seconds", "Seconds since the server started", value=snap["uptime_s"])
        yield from self._traffic(snap)
        yield from self._store(snap["store"])
        yield from self._namespaces(snap["namespaces"])
        yield from self._connections(snap)
        yield from _tier(snap.get("tier"))
        yield from _shm(snap.get("shm"))
        yield self._latency()

    @staticmethod
    def _traffic(snap: dict[str, Any]) -> Iterator[Metric]:
        # Every known label value from the start, at 0: a series born at its first event hides that
        # event from rate() and increase(), and an alert on a first burst of failures never fires.
        req = CounterMetricFamily("kvstore_requests", "Requests answered, by op", labels=["op"])
        for op, n in sorted(_with_zeros(snap["requests"], OPS_COUNTED).items()):
            req.add_metric([op], n)
        err = CounterMetricFamily("kvstore_errors", "Requests answered with an error, by op", labels=["op"])
        for op, n in sorted(_with_zeros(snap["errors"], OPS_COUNTED).items()):
            err.add_metric([op], n)
        failed = CounterMetricFamily("kvstore_put_failed_blocks",
                                     "Blocks PUTs answered as not stored (the PUT itself succeeds), by error",
                                     labels=["error"])
        for name, n in sorted(_with_zeros(snap.get("put_failed_blocks", {}), PUT_BLOCK_ERRORS).items()):
            failed.add_metric([name], n)
        yield req
        yield err
        yield failed
        yield CounterMetricFamily("kvstore_bytes_in", "Bytes received from clients", value=snap["bytes_in"])
        yield CounterMetricFamily("kvstore_bytes_out", "Bytes sent to clients", value=snap["bytes_out"])
        yield CounterMetricFamily("kvstore_busy_poll_seconds",
                                  "Seconds the server polled with nothing to do instead of sleeping (--busy-poll-us)",
                                  value=snap["busy_poll"]["seconds"])

    @staticmethod
    def _store(st: dict[str, Any]) -> Iterator[Metric]:
        gauges = {
            "blocks": ("kvstore_blocks", "Blocks stored in memory"),
            "bytes": ("kvstore_stored_bytes", "Payload bytes of the blocks stored in memory"),
            "capacity": ("kvstore_capacity_bytes", "Bytes of block memory"),
            "used_bytes": ("kvstore_used_bytes", "Bytes of block memory in use (whole pages, incl. reservations)"),
            "free_bytes": ("kvstore_free_bytes", "Bytes of block memory free"),
            "reserved_bytes": ("kvstore_reserved_bytes", "Bytes reserved for PUT payloads still arriving"),
            "pinned_blocks": ("kvstore_pinned_blocks", "Blocks protected from eviction (leased or being sent)"),
            "stranded_blocks": ("kvstore_stranded_blocks", "Blocks whose chain predecessor is gone (evicted first)"),
            "leases": ("kvstore_leases", "Live leases from pinned prefix lookups"),
        }
        for field, (name, doc) in gauges.items():
            if field in st:
                yield GaugeMetricFamily(name, doc, value=st[field])
        counters = {
            "evictions": ("kvstore_evictions", "Blocks evicted to make room"),
            "evicted_bytes": ("kvstore_evicted_bytes", "Payload bytes evicted"),
            "stored": ("kvstore_stored_blocks", "Blocks stored (new keys)"),
            "dedup": ("kvstore_dedup_blocks", "Blocks of puts found present in memory (payload skipped)"),
            "lookups": ("kvstore_lookups", "Prefix lookups"),
        }
        for field, (name, doc) in counters.items():
            if field in st:
                yield CounterMetricFamily(name, doc, value=st[field])
        hit, miss = st.get("lookup_hit_keys", 0), st.get("lookup_miss_keys", 0)
        keys = CounterMetricFamily("kvstore_lookup_keys", "Keys asked by prefix lookups, by result",
                                   labels=["result"])
        keys.add_metric(["hit"], hit)
        keys.add_metric(["miss"], miss)
        yield keys
        yield GaugeMetricFamily("kvstore_lookup_prefix_hit_ratio",
                                "Share of looked-up keys found in memory since start (0 before any lookup)",
                                value=hit / (hit + miss) if hit + miss else 0.0)

    @staticmethod
    def _namespaces(namespaces: dict[str, dict[str, int]]) -> Iterator[Metric]:
        blocks = GaugeMetricFamily("kvstore_namespace_blocks", "Blocks stored, by namespace", labels=["namespace"])
        nbytes = GaugeMetricFamily("kvstore_namespace_bytes", "Payload bytes stored, by namespace",
                                   labels=["namespace"])
        for ns, st in sorted(namespaces.items()):
            blocks.add_metric([ns], st["blocks"])
            nbytes.add_metric([ns], st["bytes"])
        yield blocks
        yield nbytes

    @staticmethod
    def _connections(snap: dict[str, Any]) -> Iterator[Metric]:
        yield GaugeMetricFamily("kvstore_connections", "Open client connections", value=snap["connections"])
        yield GaugeMetricFamily("kvstore_max_connections", "Client connections served at most (--max-connections, "
                                "lowered where the open-file limit is too low)", value=snap["max_connections"])
        yield CounterMetricFamily("kvstore_connections_accepted", "Client connections accepted",
                                  value=snap["connections_total"])
        yield CounterMetricFamily("kvstore_connections_rejected", "Connections refused over --max-connections",
                                  value=snap.get("connections_rejected", 0))
        yield CounterMetricFamily("kvstore_tls_handshake_failures", "TLS connections whose handshake failed or "
                                  "timed out (--frame-timeout): a client without TLS, or trusting another CA",
                                  value=snap.get("tls_handshake_failures", 0))
        yield CounterMetricFamily("kvstore_auth_failures", "HELLOs refused (a missing or wrong token, or a "
                                  "namespace the token does not cover), requests before HELLO (once per "
                                  "connection) and FLUSHes refused for their scope",
                                  value=snap.get("auth_failures", 0))
        timeouts = CounterMetricFamily("kvstore_connection_timeouts",
                                       "Connections closed by --idle-timeout or --frame-timeout (auth: no "
                                       "successful HELLO within --frame-timeout, or crowded out by newer "
                                       "connections without one)", labels=["kind"])
        for kind in ("idle", "frame", "reply", "auth"):
            timeouts.add_metric([kind], snap.get("timeouts", {}).get(kind, 0))
        yield timeouts

    def _latency(self) -> Metric:
        hist = HistogramMetricFamily("kvstore_request_duration_seconds",
                                     "Time from a request's first parsed byte to its reply, by op", labels=["op"])
        lat = self.service.counters.latency
        for op in sorted(lat.counts):
            hist.add_metric([op], lat.cumulative(op), sum_value=lat.sums[op])
        return hist


def _tier(tier: dict[str, Any] | None) -> Iterator[Metric]:
    yield GaugeMetricFamily("kvstore_tier_enabled", "1 when a backing tier (Redis) is configured",
                            value=0 if tier is None else 1)
    if tier is None:
        return
    state = str(tier.get("state", "unknown"))
    yield GaugeMetricFamily("kvstore_tier_up", "1 while the backing tier is healthy", value=int(state == "ok"))
    info = GaugeMetricFamily("kvstore_tier_state", "The backing tier's state (value 1)", labels=["state", "mode"])
    info.add_metric([state, str(tier.get("mode", ""))], 1)
    yield info
    yield GaugeMetricFamily("kvstore_tier_backlog_bytes", "Write-behind bytes not yet in the tier",
                            value=tier.get("backlog_bytes", 0))
    yield GaugeMetricFamily("kvstore_tier_backlog_blocks", "Write-behind blocks not yet in the tier",
                            value=tier.get("backlog_blocks", 0))
    yield GaugeMetricFamily("kvstore_tier_backlog_limit_bytes", "The most write-behind bytes held (--redis-queue-bytes)",
                            value=tier.get("queue_limit_bytes", 0))
    for field, doc in _TIER_COUNTERS.items():
        if field in tier:
            yield CounterMetricFamily(f"kvstore_tier_{field}", doc, value=tier[field])


def _shm(shm: dict[str, Any] | None) -> Iterator[Metric]:
    offered = bool(shm and shm.get("offered"))
    yield GaugeMetricFamily("kvstore_shm_offered", "1 when same-host clients may map the arena (--unix, no --no-shm)",
                            value=int(offered))
    if not offered:
        return
    assert shm is not None
    for field, (name, doc) in _SHM_GAUGES.items():
        yield GaugeMetricFamily(name, doc, value=shm.get(field, 0))
    for field, (name, doc) in _SHM_COUNTERS.items():
        yield CounterMetricFamily(f"kvstore_shm_{name}", doc, value=shm.get(field, 0))


def make_registry(service: Service) -> CollectorRegistry:
    """The kvstore families plus the standard ``process_*`` (RSS, CPU, fds) and ``python_info``."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(KVStoreCollector(service))
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    return registry


def health(service: Service, draining: bool, *, ready_only: bool = False) -> tuple[int, dict[str, Any]]:
    """(HTTP status, body) of ``/healthz``: serving, with a healthy tier if there is one; of
    ``/readyz`` (``ready_only``): serving."""
    tier = service.tier.stats() if service.tier is not None else None
    tier_state = None if tier is None else str(tier.get("state", "unknown"))
    if draining:
        return 503, {"status": "draining", "tier": tier_state}
    if tier_state is not None and tier_state != "ok":
        return (200 if ready_only else 503), {"status": "degraded", "tier": tier_state}
    return 200, {"status": "ok", "tier": tier_state}


_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed", 503: "Service Unavailable"}
_MAX_HEAD = 8192
_READ_TIMEOUT = 5.0
#: Connections the listener holds at once. One more ends the oldest still waiting for its request
#: (each may wait _READ_TIMEOUT), or is answered 503 where all are being answered: the server's
#: descriptors besides its clients' are few (``app.FD_RESERVE``), and idle connections here must
#: take neither the clients' room nor a probe's.
MAX_SCRAPES = 16


class MetricsServer:
    """A minimal HTTP/1.0 listener for ``/metrics``, ``/readyz``, ``/healthz`` and ``/livez``.

    Every response closes its connection (Prometheus and kubelet open one per
    probe); a request head must arrive within 5 s and 8 KiB; :data:`MAX_SCRAPES`
    connections at once; an answer not taken within 5 s is dropped.
    """

    def __init__(self, service: Service, host: str, port: int, draining: Callable[[], bool]) -> None:
        self.service = service
        self.host = host
        self.port = port
        self.draining = draining
        self.registry = make_registry(service)
        self._server: asyncio.AbstractServer | None = None
        self._open = 0
        self._idle: dict[asyncio.StreamWriter, None] = {}  # connections waiting for their request, oldest first
        self._dropped: set[asyncio.StreamWriter] = set()  # of those, closed for a newer one (no longer open)
        self._refused_logged = -math.inf

    async def start(self) -> int:
        """Listen; returns the bound port (``port=0`` picks a free one)."""
        self._server = await asyncio.start_server(self._handle, self.host, self.port, reuse_address=True,
                                                  limit=_MAX_HEAD)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._open += 1
        try:
            await self._serve(reader, writer)
        finally:
            if writer in self._dropped:
                self._dropped.discard(writer)
            else:
                self._open -= 1

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        method = "GET"
        if self._open > MAX_SCRAPES and self._idle:
            oldest = next(iter(self._idle))
            del self._idle[oldest]
            self._dropped.add(oldest)
            self._open -= 1
            oldest.transport.abort()  # (its wait for a request ends, its answer goes nowhere)
            self._say_full("closed the oldest one waiting for its request")
        if self._open > MAX_SCRAPES:  # (all of them being answered)
            self._say_full("refusing more")
            status, ctype, body = 503, "text/plain", b"too many connections to the metrics listener\n"
        else:
            self._idle[writer] = None
            try:
                method, path = await asyncio.wait_for(_read_head(reader), _READ_TIMEOUT)
                status, ctype, body = self.respond(method, path)
            except (asyncio.TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError,
                    ConnectionError):
                status, ctype, body = 400, "text/plain", b"bad request\n"
            finally:
                self._idle.pop(writer, None)
            if writer.transport.is_closing():
                return  # (reset by the peer, or closed for a newer connection: no answer)
        head = (f"HTTP/1.0 {status} {_REASONS[status]}\r\nContent-Type: {ctype}\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
        try:
            writer.write(head if method == "HEAD" else head + body)
            await asyncio.wait_for(writer.drain(), _READ_TIMEOUT)
        except (ConnectionError, RuntimeError, asyncio.TimeoutError):  # (RuntimeError: closed meanwhile)
            writer.transport.abort()  # (a peer that does not read its answer keeps no slot)
        finally:
            writer.close()

    def _say_full(self, what: str) -> None:
        now = time.monotonic()
        if now - self._refused_logged > 10.0:  # (a flood must not flood the log too)
            self._refused_logged = now
            log.warning("metrics listener: %d connections open, %s (each may wait %.0f s for its request)",
                        MAX_SCRAPES, what, _READ_TIMEOUT, extra={"event": "metrics_refused"})

    def respond(self, method: str, path: str) -> tuple[int, str, bytes]:
        """Route one request: (status, content type, body)."""
        if method not in ("GET", "HEAD"):
            return 405, "text/plain", b"only GET and HEAD\n"
        route = path.split("?", 1)[0]
        if route == "/metrics":
            return 200, CONTENT_TYPE_LATEST, generate_latest(self.registry)
        if route in ("/healthz", "/readyz"):
            status, body = health(self.service, self.draining(), ready_only=route == "/readyz")
            return status, "application/json", json.dumps(body).encode() + b"\n"
        if route == "/livez":
            return 200, "application/json", b'{"status": "alive"}\n'
        return 404, "text/plain", b"try /metrics, /readyz, /healthz or /livez\n"


async def _read_head(reader: asyncio.StreamReader) -> tuple[str, str]:
    """Method and path of the request line; the headers are read and ignored."""
    line = await reader.readuntil(b"\n")  # (the reader's limit bounds one line; this, the whole head)
    parts = line.decode("latin-1").split()
    if len(parts) != 3 or not parts[2].startswith("HTTP/"):
        raise ValueError("not an HTTP request line")
    size = len(line)
    while (line := await reader.readuntil(b"\n")).strip():
        size += len(line)
        if size > _MAX_HEAD:
            raise ValueError(f"request head over {_MAX_HEAD} bytes")
    return parts[0], parts[1]


__all__ = ["LATENCY_BUCKETS", "TIER_METRICS", "KVStoreCollector", "LatencyHistograms", "MetricsServer", "health",
           "make_registry"]
