"""Redis or Redis Cluster as kvstore's backing tier (see ``docs/redis-layout.md``).

Memory answers first; this tier receives every stored block and answers
memory's misses. Each batch call is one pipelined round trip (one per node in
a cluster: redis-py's cluster pipeline groups commands by node and sends the
groups in parallel), never one per key -- LMCache's per-chunk ``EXISTS`` loop
is the trap (PEERS.md).

Two modes:

* ``write-through``: ``store()`` returns once Redis has every block, so an
  acknowledged block survives a ``kill -9`` of the server.
* ``write-behind``: ``store()`` copies the blocks into a queue bounded in
  bytes (while it is full a put waits, or fails if Redis is down) and
  returns; one task flushes the queue in batches. Queued blocks are served
  from the queue, so nothing acknowledged is lost while the process lives,
  and :meth:`RedisTier.close` flushes the queue before exit.

Faults: a failure of Redis itself (connection, timeout, cluster down) marks
the tier ``degraded`` (logged once on the transition, once again on recovery);
an error reply to one command (``WRONGTYPE`` from a key someone else wrote,
``OOM``) concerns that key only: a miss for a read, a failed put or delete.
While degraded no request waits on Redis: reads are answered from memory and
the queue, write-through puts, deletes and write-behind puts that find the
queue full fail at once with :class:`~kvstore.errors.Unavailable`, and
:meth:`RedisTier.check_health` (called periodically by the server) probes
with back-off until Redis answers again; the write-behind queue then drains.

Beside it: :mod:`.redis_layout` (key names, the value header), :mod:`.redis_client` (the client
the flags name) and :mod:`.write_queue` (the write-behind queue).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Sequence

import xxhash
from redis.asyncio import Redis
from redis.asyncio.cluster import ClusterNode, PipelineCommand, RedisCluster
from redis.exceptions import (
    AskError, ClusterDownError, ClusterError, ReadOnlyError, RedisClusterException, RedisError, ResponseError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from kvstore.config import ServerConfig, format_size
from kvstore.errors import Unavailable
from kvstore.sockets import bracketed
from kvstore.throttle import ThrottledLog

from .redis_client import client_for
from .redis_layout import (
    HEADER_SIZE, KEY_PREFIX, block_key, decode_value, encode_value, key_tag, misplaced,
    namespace_record, ns_part, ns_record_key,
)
from .tier import Tier, TierBlock
from .write_queue import BATCH_BYTES, QueuedBlock, WriteQueue

log = logging.getLogger(__name__)

MODES = ("write-through", "write-behind")
#: Pipelines the tier runs at once (the rest wait their turn). redis-py raises, rather than waits,
#: once its pool holds ``max_connections`` (100 by default): under a burst of requests that read
#: through, that failed requests and marked the tier down. The pool keeps a few connections more
#: for what runs beside the pipelines (the health probe, a flush's SCAN).
MAX_PIPELINES = 64
_SPARE_CONNECTIONS = 16
#: Block bytes in flight to and from Redis at once, and in one pipeline (a request's blocks go in
#: pipelines of this size at most). Each reply must come within --redis-timeout: 64 pipelines of
#: 32 MiB of 4 MiB blocks (a burst of read-throughs after a restart) left a reply waiting over 2 s,
#: the tier went down and every block answered "missing"; a put of 1 GiB could not be written in
#: one pipeline within it. 64 MiB moves in ~0.6 s over a 1 Gbit/s link.
MAX_INFLIGHT_BYTES = 64 << 20
_PIPELINE_BYTES = 16 << 20
_VALUE_GUESS = 1 << 20  # a read's size before any value was seen: typical KV blocks are 0.1-4 MiB
# (RuntimeError: under uvloop, redis-py writing to a connection Redis reset right after accepting it
# raises "unable to perform operation on <TCPTransport closed=True>": an outage like the others.)
_REDIS_ERRORS = (RedisError, RedisClusterException, OSError, asyncio.TimeoutError, RuntimeError)
# Error replies that speak of the server (cluster down, a replica, slots moving), not of one command's key.
_SERVER_STATE_ERRORS = (ClusterDownError, ReadOnlyError, TryAgainError, AskError)
_BULK_LEN = 512 << 20  # Redis's default proto-max-bulk-len: it drops a client that sends a longer value
#: Namespaces whose largest value is remembered (a forgotten one's next read asks STRLEN first).
_VALUE_HINTS = 4096
_PROBE_MIN_S, _PROBE_MAX_S = 0.25, 2.0  # health-probe back-off while degraded (asked at most once a second: app.py)


def _command_error(result: Any) -> bool:
    """An error reply to one command (``WRONGTYPE`` on a foreign key, ``OOM``...): that key's failure only."""
    return isinstance(result, ResponseError) and not isinstance(result, _SERVER_STATE_ERRORS)


def _not_counted(names: Sequence[str | bytes], deleted: Sequence[int], dropped: set[str]) -> int:
    """How many of ``names`` DEL found, less those already counted as dropped from the queue."""
    if not dropped:
        return sum(deleted)
    return sum(1 for name, r in zip(names, deleted)
               if r and (name.decode() if isinstance(name, bytes) else name) not in dropped)


def _describe(exc: BaseException) -> str:
    """A short printable reason: redis-py's pipeline errors quote the failed command, block bytes included."""
    text = str(exc)
    if "caused error:" in text:
        text = text.rsplit("caused error:", 1)[1].strip()
    text = "".join(c if c.isprintable() else "?" for c in text)
    return f"{type(exc).__name__}: {text[:200]}"


# -- bytes in flight, and the heap


def _trim_heap() -> None:
    """Give the C heap's free pages back to the system (glibc's ``malloc_trim``; elsewhere nothing)."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return
    trim(0)


def _pieces(sizes: Sequence[int], limit: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` runs of ``sizes`` adding up to ``limit`` at most (one item at least)."""
    runs, lo, total = [], 0, 0
    for i, n in enumerate(sizes):
        if i > lo and total + n > limit:
            runs.append((lo, i))
            lo, total = i, 0
        total += n
    if lo < len(sizes):
        runs.append((lo, len(sizes)))
    return runs


class _ByteBudget:
    """Bytes in flight, bounded: :meth:`acquire` waits, first come first served, until ``n`` more
    fit (an amount over the limit goes when nothing else is in flight)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._waiting: deque[tuple[int, asyncio.Future[None]]] = deque()

    def _fits(self, n: int) -> bool:
        return self.used == 0 or self.used + n <= self.limit

    async def acquire(self, n: int) -> None:
        if not self._waiting and self._fits(n):
            self.used += n
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.append((n, waiter))
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.release(n)  # granted as it was cancelled
            else:
                with contextlib.suppress(ValueError):
                    self._waiting.remove((n, waiter))
                self._grant()  # (it may have held back smaller ones behind it)
            raise

    def release(self, n: int) -> None:
        self.used -= n
        self._grant()

    def _grant(self) -> None:
        while self._waiting and self._fits(self._waiting[0][0]):
            n, waiter = self._waiting.popleft()
            if not waiter.done():
                self.used += n
                waiter.set_result(None)


# -- the tier


@dataclass(eq=False)
class _FlushGate:
    """Flushes of one namespace running now; ``done`` is set when the last one ends."""

    running: int = 0
    done: asyncio.Event = field(default_factory=asyncio.Event)


class RedisTier(Tier):
    """Blocks in Redis (``redis.asyncio.Redis``) or a Redis Cluster (``RedisCluster``).

    Args:
        client: a connected-on-demand redis-py asyncio client.
        target: where it points (password redacted), for logs and stats.
        mode: ``"write-through"`` or ``"write-behind"``.
        queue_bytes: write-behind queue bound.
        ttl_s: expiry of stored blocks in seconds (0: none).
        flush_timeout: how long :meth:`close` keeps trying to flush the queue.
        timeout_s: the client's socket timeout (write-behind batches are sized to fit in it).
    """

    def __init__(self, client: Redis | RedisCluster, *, target: str, mode: str = "write-through",
                 queue_bytes: int = 256 << 20, ttl_s: int = 0, flush_timeout: float = 30.0,
                 timeout_s: float = 2.0) -> None:
        if mode not in MODES:
            raise ValueError(f"redis mode must be one of {', '.join(MODES)}, got {mode!r}")
        self.client = client
        self.cluster = isinstance(client, RedisCluster)
        self.target = target
        self.mode = mode
        self.write_through = mode == "write-through"
        self.ttl_s = ttl_s
        self.flush_timeout = flush_timeout
        self.timeout_s = timeout_s
        self.queue = WriteQueue(max(1, queue_bytes))
        self._up = asyncio.Event()  # set while Redis answers
        self._last_error = ""
        self._last_error_at: float | None = None  # (wall clock: when, for the stats)
        self._degraded_since: float | None = None
        self._next_probe = 0.0
        self._probe_delay = _PROBE_MIN_S
        self._key_warnings = ThrottledLog(log)
        self._flusher: asyncio.Task[None] | None = None
        self._batch_bytes = BATCH_BYTES  # write-behind batch bound (see BATCH_BYTES)
        self._refusing = False  # write-behind: Redis answers but refuses the blocks (say OOM)
        self._giving_up = asyncio.Event()  # close(): stop flushing now
        #: The largest block Redis takes (its proto-max-bulk-len, less the value header); a larger
        #: one is refused at PUT rather than acknowledged and then never written.
        self.max_block: int = _BULK_LEN - HEADER_SIZE
        #: Acknowledged write-behind blocks dropped for being over that limit (queued while Redis,
        #: down, had not said it): never written, so a stop counts them as unwritten -- unless
        #: deleted or flushed since.
        self.dropped_too_big: set[tuple[str, bytes]] = set()
        self._limit_read = False  # read when Redis answers, again after each outage (it may restart with another)
        #: Namespaces being flushed: their tier writes wait, or the flush's SCAN could delete a block
        #: acknowledged meanwhile (and kept in memory), which a restart would then lose.
        self._flushing: dict[str, _FlushGate] = {}
        #: Keys whose delete has yet to send its DEL, with an event per such delete: a copy put from
        #: the delete's call on must reach Redis after that DEL, or memory would keep a block Redis
        #: lost. Write-through puts wait for the events; write-behind ones are queued, held there.
        self._deleting: dict[tuple[str, bytes], list[asyncio.Event]] = {}
        self.queue.held = self._deleting
        self._seq = 0  # puts so far (``QueuedBlock.seq``)
        self._waking: asyncio.Task[None] | None = None
        self._wakers: set[asyncio.Task[None]] = set()
        self._pipelines = asyncio.Semaphore(MAX_PIPELINES)  # in flight at once, each on a connection per node
        self._inflight = _ByteBudget(MAX_INFLIGHT_BYTES)  # block bytes in those pipelines
        #: Per namespace, the largest value seen: what a read counts per key (one model's blocks are
        #: alike; another's, say 64 KiB beside 16 MiB, must not make its reads go one key at a time).
        self._value_bytes: dict[str, int] = {}
        self.counters = {"stored_blocks": 0, "stored_bytes": 0, "fetched_blocks": 0, "fetch_misses": 0,
                         "checksum_mismatches": 0, "misplaced_values": 0, "failures": 0, "outages": 0}

    @classmethod
    def from_config(cls, config: ServerConfig) -> RedisTier | None:
        """The tier the config asks for, or ``None`` (memory only). Raises ``ValueError`` on bad settings."""
        made = client_for(config, max_connections=MAX_PIPELINES + _SPARE_CONNECTIONS)
        if made is None:
            return None
        client, target = made
        return cls(client, target=target, mode=config.redis_mode, queue_bytes=config.redis_queue_bytes,
                   ttl_s=config.redis_ttl, flush_timeout=max(config.drain_seconds, 5.0),
                   timeout_s=config.redis_timeout)

    # -- lifecycle

    async def start(self) -> None:
        """Connect (a Redis that is down only makes the tier start degraded) and start the flusher.

        A wrong password is an outage, as it would be after a password change (logged, in
        ``/healthz`` and the stats, with Redis's answer).

        Raises:
            ValueError: Redis has no database of the URL's number, or --redis-cluster names a Redis
                that is not in cluster mode: no outage that waiting would end.
        """
        try:
            await self._ping()
        except ResponseError as exc:
            if "DB index" in str(exc):  # ("DB index is out of range": SELECT of the URL's /N)
                raise ValueError(f"Redis refused the URL's database: {_describe(exc)}") from None
            self._mark_down(exc)
        except RedisClusterException as exc:
            plain = await self._plain_seed()
            if plain is not None:
                raise ValueError(f"{plain} is not in cluster mode (a plain Redis: give it to --redis "
                                 "instead)") from None
            self._mark_down(exc)
        except _REDIS_ERRORS as exc:
            self._mark_down(exc)
        else:
            self._mark_up()
            await self._read_bulk_limit()
            log.info("redis tier %s: %s, ttl=%s", self.target, self.mode, f"{self.ttl_s}s" if self.ttl_s else "none")
        if not self.write_through:
            self._flusher = asyncio.create_task(self._flush_loop(), name="redis-write-behind")

    async def _plain_seed(self) -> str | None:
        """A seed of --redis-cluster that answers as a plain Redis (``cluster_enabled:0``), if any.

        Asked of every seed: redis-py tries them in a random order and reports only the last
        failure, and it words any refused ``CLUSTER SLOTS`` (an ACL's ``NOPERM`` too) as "cluster
        mode is not enabled". A seed that is down or refuses ``INFO`` tells nothing.
        """
        assert isinstance(self.client, RedisCluster)
        seeds = list(self.client.nodes_manager.startup_nodes.values())

        async def plain(node: Any) -> bool:
            try:
                info = await asyncio.wait_for(node.execute_command("INFO", "cluster"), self.timeout_s)
            except (*_REDIS_ERRORS, ValueError):
                return False
            return isinstance(info, dict) and info.get("cluster_enabled") == 0

        answers = await asyncio.gather(*(plain(node) for node in seeds))  # (at once: a seed may hang)
        for node, is_plain in zip(seeds, answers):
            if is_plain:
                return f"{bracketed(str(node.host))}:{node.port}"
        return None

    async def _read_bulk_limit(self) -> None:
        """Take Redis's proto-max-bulk-len where CONFIG GET is allowed (else its default, 512 MB)."""
        self._limit_read = True
        try:
            every_master = {"target_nodes": RedisCluster.PRIMARIES} if self.cluster else {}  # (else: a random node)
            reply: Any = await self.client.config_get("proto-max-bulk-len", **every_master)  # (cluster: per node)
            limits = [reply] if "proto-max-bulk-len" in reply else list(reply.values())
            values = [int(r["proto-max-bulk-len"]) for r in limits if str(r.get("proto-max-bulk-len", "")).isdigit()]
        except (*_REDIS_ERRORS, AttributeError, TypeError):  # a managed Redis may refuse CONFIG
            return
        if values:
            self.max_block = min(values) - HEADER_SIZE

    async def close(self) -> int:
        """Flush the write-behind queue (probing a degraded Redis until ``flush_timeout``), then
        disconnect; the number of acknowledged blocks that were not written (queued still, or
        dropped as over Redis's limit)."""
        deadline = time.monotonic() + self.flush_timeout
        queued = len(self.queue)
        if queued:
            log.info("flushing %d write-behind block(s) to redis before exit", queued)
        started = time.monotonic()
        while len(self.queue) and time.monotonic() < deadline and not self._giving_up.is_set():
            if self._flusher is None or self._flusher.done():
                break
            # (a probe of a Redis that hangs takes --redis-timeout: cut at the deadline, which the
            # deploy files' stop timeouts are sized from)
            await self._unless_giving_up(self.check_health(), deadline)
            await self._unless_giving_up(asyncio.sleep(0.05), deadline)
        unwritten = len(self.queue)
        if queued and not unwritten and not self.dropped_too_big:  # (an operator reading the log learns the flush ended, and how fast)
            log.info("flushed %d write-behind block(s) to redis in %.1fs", queued, time.monotonic() - started)
        if unwritten:
            why = "did not take them" if self._up.is_set() and self._refusing else (
                "was too slow" if self._up.is_set() else "unreachable")
            log.error("redis %s %s: %d acknowledged write-behind block(s) (%d bytes) were not written within "
                      "%.0fs%s (last error: %s)", self.target, why, len(self.queue), self.queue.nbytes,
                      time.monotonic() - started, " (the stop was asked again)" if self._giving_up.is_set() else "",
                      self._last_error or "none")
        if self.dropped_too_big:
            log.error("redis %s: %d acknowledged write-behind block(s) over its proto-max-bulk-len were never "
                      "written (dropped from the queue when Redis said its limit)", self.target,
                      len(self.dropped_too_big))
        if self._flusher is not None:
            self._flusher.cancel()
            await asyncio.gather(self._flusher, return_exceptions=True)
        await self.client.aclose()
        return unwritten + len(self.dropped_too_big)

    def give_up(self) -> None:
        """Stop a flush in :meth:`close` now (the operator asked twice): what is queued stays unwritten."""
        self._giving_up.set()

    async def _unless_giving_up(self, step: Awaitable[Any], deadline: float) -> None:
        """Await ``step`` until it ends, the stop is asked again, or ``deadline`` (monotonic) passes."""
        task = asyncio.ensure_future(step)
        stop = asyncio.ensure_future(self._giving_up.wait())
        await asyncio.wait([task, stop], timeout=max(0.0, deadline - time.monotonic()),
                           return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        if not task.done():
            task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    def max_connections(self) -> int:
        """The most connections the tier holds to Redis: its pool, per node of a cluster (as far
        as it knows the cluster: from its start on, if Redis answered then)."""
        nodes = len(self.client.get_nodes()) if isinstance(self.client, RedisCluster) else 1
        return (MAX_PIPELINES + _SPARE_CONNECTIONS) * max(1, nodes)

    # -- health

    def _error(self, what: str) -> None:
        self._last_error, self._last_error_at = what, time.time()

    def _mark_down(self, exc: BaseException) -> None:
        self.counters["failures"] += 1
        self._error(_describe(exc))
        if self._up.is_set() or self._degraded_since is None:
            self._up.clear()
            self._degraded_since = time.time()
            self._probe_delay = _PROBE_MIN_S
            self._next_probe = time.monotonic() + self._probe_delay
            self.counters["outages"] += 1
            self._limit_read = False  # a Redis that comes back may take smaller values (proto-max-bulk-len)
            self._waking = asyncio.get_running_loop().create_task(self.queue.wake())  # puts waiting for room fail
            log.warning("redis tier degraded (%s): serving from memory; %s", self.target, self._last_error)

    def _mark_up(self) -> None:
        if not self._up.is_set():
            if self._degraded_since is not None:
                log.warning("redis tier recovered (%s) after %.1fs; %d write-behind block(s) to catch up",
                            self.target, time.time() - self._degraded_since, len(self.queue))
            self._degraded_since = None
            self._up.set()

    def _wake_queue(self) -> None:
        """Let the flusher look again: keys it held back are free."""
        if self.queue.waiting:
            task = asyncio.get_running_loop().create_task(self.queue.wake())
            self._wakers.add(task)
            task.add_done_callback(self._wakers.discard)

    async def _ping(self) -> None:
        if not isinstance(self.client, RedisCluster):
            await self._ping_master()
            return
        try:
            await self._cluster_ok()
        except _REDIS_ERRORS:
            # redis-py renews its view of the cluster after a connection error or a MOVED only: a
            # master removed from it (`redis-cli --cluster del-node`, which leaves it running after
            # CLUSTER RESET) answers, cluster_state:fail, and would have been asked for good.
            await self.client.nodes_manager.initialize()
            await self._cluster_ok()

    async def _cluster_ok(self) -> None:
        # Every master must answer *and* see the cluster as ok: a master that just came back
        # answers PING before the cluster agrees it is up, and writes fail until then.
        assert isinstance(self.client, RedisCluster)
        info: dict[str, Any] = await self.client.cluster_info(target_nodes=RedisCluster.PRIMARIES)
        per_node: dict[str, Any] = {"": info} if "cluster_state" in info else info  # one node: not keyed by node
        bad = [node or "cluster" for node, i in per_node.items() if i.get("cluster_state") != "ok"]
        if bad:
            raise RedisError(f"cluster_state is not ok on {', '.join(sorted(bad))}")

    async def _ping_master(self) -> None:
        """Probe a plain Redis: it must answer and take writes. A replica (an old master a failover
        demoted, or the wrong address) answers PING and refuses every write with READONLY: taken for
        up, the tier went down and up again once a second. ``ROLE`` tells; a Redis that refuses it
        (an ACL, ``rename-command``) is probed with PING alone."""
        try:
            role = await self.client.execute_command("ROLE")
        except ResponseError:  # an ACL's NOPERM; renamed away (rename-command), or a proxy without it
            await self.client.ping()
            return
        if role and role[0] in (b"slave", "slave", b"replica", "replica"):
            host = role[1].decode(errors="replace") if isinstance(role[1], bytes) else role[1]
            master = f"{host}:{role[2]}" if len(role) > 2 else "its master"
            raise ReadOnlyError(f"a replica of {master} (ROLE): it takes no writes; give --redis the master")

    async def check_health(self) -> None:
        """Probe Redis: notices an outage with no traffic, and a recovery (back-off while degraded)."""
        now = time.monotonic()
        if not self._up.is_set() and now < self._next_probe:
            return
        try:
            await self._ping()
        except _REDIS_ERRORS as exc:
            self._mark_down(exc)
            self._probe_delay = min(self._probe_delay * 2, _PROBE_MAX_S)
            self._next_probe = time.monotonic() + self._probe_delay
        else:
            if not self._limit_read:  # before the queue drains: what it holds is checked against it
                await self._read_bulk_limit()
            self._mark_up()

    def _unavailable(self) -> Unavailable:
        # Says the request is lost, not pending: only the tier's reconnect runs in the background.
        return Unavailable(f"redis tier {self.target} is unavailable ({self._last_error}): this request failed "
                           "and is not retried (send it again later); the server reconnects to redis on its own")

    async def _execute(self, commands: Sequence[tuple[Any, ...]], nbytes: int = 0) -> list[Any]:
        """Run commands as one pipeline (one round trip per node) carrying about ``nbytes`` of blocks.

        A failure of Redis itself marks the tier down and raises ``Unavailable``.
        An error reply to one command (say ``WRONGTYPE`` from a key someone else
        wrote) is left in its place in the results: it concerns that key only.
        """
        if not self._up.is_set():
            raise self._unavailable()
        if not nbytes:  # (a question, not blocks: never queued behind them)
            return await self._run(commands)
        await self._inflight.acquire(nbytes)
        try:
            return await self._run(commands, nbytes)
        finally:
            self._inflight.release(nbytes)

    async def _run(self, commands: Sequence[tuple[Any, ...]], nbytes: int = 0) -> list[Any]:
        async with self._pipelines:  # (a burst of requests beyond redis-py's pool failed as an outage)
            if not self._up.is_set():  # (it went down while this one waited its turn)
                raise self._unavailable()
            # A cluster pipeline returns a node's lost connection in its commands' places instead of
            # reconnecting: such a result gets the pipeline sent again (every command here may run
            # more than once: SET, GET, EXISTS, DEL, and counters that are only hints). redis-py
            # checks no cluster connection before use and renews a node's idle ones only once one
            # of them failed: with the connections of every master cut (CLIENT KILL, a proxy's idle
            # timeout), each master may cost a try, so a lost connection gets one try per master.
            # Anything else is tried twice.
            tries = 2
            attempt = 0
            while True:
                pipe = self.client.pipeline(transaction=False)
                for cmd in commands:
                    pipe.execute_command(*cmd)
                try:
                    results = await pipe.execute(raise_on_error=False)  # resets the pipeline whatever happens
                    if self.cluster:
                        await self._follow_asks(commands, results)
                except _REDIS_ERRORS as exc:
                    outage: BaseException | None = exc
                    break
                outage = next((r for r in results if isinstance(r, BaseException) and not _command_error(r)), None)
                if outage is None:
                    return results
                if isinstance(outage, RedisConnectionError) and isinstance(self.client, RedisCluster):
                    tries = max(tries, 1 + len(self.client.get_primaries()))
                attempt += 1
                if attempt >= tries:
                    break
        assert outage is not None
        if nbytes and isinstance(outage, (RedisTimeoutError, asyncio.TimeoutError)) and await self._answers():
            # Too many bytes for the link within --redis-timeout: this request fails, the others go on.
            self.counters["failures"] += 1
            self._error(f"moving {format_size(nbytes)} timed out while redis answers (a link too slow "
                        f"for --redis-timeout {self.timeout_s:g}s)")
            raise Unavailable(f"redis tier {self.target}: {self._last_error}: this request failed and is not retried")
        self._mark_down(outage)
        raise self._unavailable()

    async def _follow_asks(self, commands: Sequence[tuple[Any, ...]], results: list[Any]) -> None:
        """Send again, redirects followed here, the commands redis-py gave up on ("TTL exhausted")
        or failed inside of (an ``AttributeError``: an ASK to a master it does not know).

        While a slot migrates (each step of a reshard), a key its master does not hold is asked for
        on the new master (ASK): redis-py sends ``ASKING`` on one of its pooled connections to that
        master and the command on another (the pool hands them out in turn), so the new master
        answers MOVED back to the old one, and round it goes; and a new master with no slots yet is
        not in its view at all. Every block new to the slot failed, and the tier went degraded, for
        as long as the slot migrated."""
        for i, result in enumerate(results):
            # (ClusterError itself: "TTL exhausted"; not its kinds, CLUSTERDOWN and MASTERDOWN, which
            # speak of the cluster: sent again one by one, they doubled an outage's commands)
            if type(result) is ClusterError or (isinstance(result, Exception) and not isinstance(result, RedisError)):
                try:
                    results[i] = await self._asked(commands[i])
                except _REDIS_ERRORS as exc:
                    results[i] = exc

    async def _asked(self, cmd: tuple[Any, ...]) -> Any:
        """One command (its key second), an ASK answered by ``ASKING`` and the command on one connection."""
        assert isinstance(self.client, RedisCluster)
        node: ClusterNode | None = self.client.get_node_from_key(cmd[1])
        asking = made = False
        result = None
        for _ in range(3):  # (a slot whose new master migrates it on: asked again there)
            if node is None:  # (no master for the key's slot in redis-py's view)
                raise ClusterError(f"no master serves the slot of {cmd[1]!r}")
            sent = PipelineCommand(1, *cmd)
            try:
                await node.execute_pipeline([PipelineCommand(0, "ASKING"), sent] if asking else [sent])
            finally:
                if made:  # (one made for this command, below)
                    await node.disconnect()
            result = sent.result
            if not isinstance(result, AskError):
                return result
            # A master with no slots yet (importing its first, a rebalance onto a new node) is not
            # in redis-py's view: a node of its own for this command.
            known = self.client.get_node(host=result.host, port=result.port)
            node = known or ClusterNode(result.host, result.port, "primary", **self.client.nodes_manager.connection_kwargs)
            asking, made = True, known is None
        return result

    async def _answers(self) -> bool:
        """Whether Redis answers a probe now (within the timeout)."""
        try:
            await asyncio.wait_for(self._ping(), self.timeout_s)
        except _REDIS_ERRORS:
            return False
        return True

    def _refused(self, results: Sequence[Any], what: str) -> None:
        """Raise ``Unavailable`` (the tier stays up) if Redis refused any of ``results``' commands."""
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            self.counters["failures"] += 1
            self._error(_describe(errors[0]))
            raise Unavailable(f"redis {self.target} refused {len(errors)} of {len(results)} {what} "
                              f"({_describe(errors[0])})")

    # -- writes

    def _set_commands(self, items: Sequence[QueuedBlock]) -> list[tuple[Any, ...]]:
        """SET per block, plus the namespace records' hints (HINCRBY) in the same round trip."""
        ttl = ("EX", self.ttl_s) if self.ttl_s else ()
        cmds: list[tuple[Any, ...]] = [("SET", block_key(it.ns, it.key), it.value, *ttl) for it in items]
        per_ns: dict[str, list[int]] = {}
        for it in items:
            hint = per_ns.setdefault(it.ns, [0, 0])
            hint[0] += 1
            hint[1] += len(it.value) - HEADER_SIZE
        now = str(int(time.time()))
        for ns, (n, nbytes) in per_ns.items():
            rec = ns_record_key(ns)
            # The static fields too, every time: another server's flush, a Redis restarted without
            # persistence, or its eviction may have dropped the record since (a few small commands
            # beside the blocks' SETs).
            cmds.append(("HSETNX", rec, "created", now))
            cmds.append(("HSET", rec, *[x for kv in namespace_record(ns, self.ttl_s).items() for x in kv]))
            cmds += [("HSET", rec, "last_put", now), ("HINCRBY", rec, "blocks_hint", n),
                     ("HINCRBY", rec, "bytes_hint", nbytes)]
            if self.ttl_s:  # (it goes with the namespace's last blocks, not for ever)
                cmds.append(("EXPIRE", rec, self.ttl_s))
        return cmds

    def _seen(self, ns: str, value_bytes: int) -> None:
        if value_bytes > self._value_bytes.get(ns, 0):
            self._value_bytes.pop(ns, None)  # (set again last: the oldest hint goes first)
            self._value_bytes[ns] = value_bytes
            if len(self._value_bytes) > _VALUE_HINTS:  # (namespaces come and go: a hint each held for good)
                del self._value_bytes[next(iter(self._value_bytes))]

    async def _write(self, items: Sequence[QueuedBlock]) -> None:
        """SET ``items`` in pipelines of at most ``_PIPELINE_BYTES``."""
        sizes = [len(it.value) for it in items]
        for it, n in zip(items, sizes):
            self._seen(it.ns, n)
        runs = _pieces(sizes, _PIPELINE_BYTES)
        outcomes = await self._in_parts([(self._set_commands(items[lo:hi]), sum(sizes[lo:hi])) for lo, hi in runs])
        failure: BaseException | None = None
        for (lo, hi), results in zip(runs, outcomes):
            if isinstance(results, BaseException):
                failure = failure or results
                continue
            # Counted as Redis took them, also beside blocks it refused (they are in Redis, and read back).
            written = [it for it, r in zip(items[lo:hi], results) if not isinstance(r, BaseException)]
            self.counters["stored_blocks"] += len(written)
            self.counters["stored_bytes"] += sum(len(it.value) - HEADER_SIZE for it in written)
            if failure is None and len(written) < hi - lo:
                try:
                    self._refused(results[:hi - lo], "block write(s)")  # (the record's hints after: best effort)
                except Unavailable as exc:
                    failure = exc
        if failure is not None:
            raise failure

    def refusal(self) -> Unavailable | None:
        return self._unavailable() if self.write_through and not self._up.is_set() else None

    async def store(self, ns: str, blocks: Sequence[TierBlock]) -> None:
        """Write-through: one pipelined round trip. Write-behind: copy into the queue; while it is
        full, wait for room if Redis is up (back-pressure), fail at once if it is down.

        Either waits first for a running flush of ``ns`` to end (see ``_flushing``); write-through
        also for the DELs of running deletes of these keys (see ``_deleting``).
        """
        # The views are pinned only while this call runs: copy them out before the first await.
        self._seq += 1
        items = [QueuedBlock(ns, b.key, encode_value(b.data, b.checksum, key_tag(block_key(ns, b.key))), b.checksum,
                             self._seq) for b in blocks]
        dels = {ev for it in items for ev in self._deleting.get((ns, it.key), ())} if self._deleting else ()
        gate = self._flushing.get(ns)
        if gate is not None:
            await gate.done.wait()
        if self.write_through:
            for ev in dels:  # (only those running now: later ones must not hold this put for ever)
                await ev.wait()
            await self._write(items)
        elif not await self.queue.put(items, refuse=lambda: not self._up.is_set()):
            raise self._unavailable()

    async def _flush_loop(self) -> None:
        """Write-behind: drain the queue in batches while Redis is up; a failed batch goes back to the
        head and the next one is half its size, a written one sizes the next to the link (a timeout on
        a slow link must not repeat for ever: see ``BATCH_BYTES``)."""
        while True:
            await self._up.wait()
            drained = False
            batch = await self.queue.take(self._batch_bytes)
            too_big = [it for it in batch if len(it.value) - HEADER_SIZE > self.max_block]
            if too_big:  # queued before Redis's limit was known (it was down): Redis would drop each try
                self.counters["failures"] += len(too_big)
                self.dropped_too_big.update((it.ns, it.key) for it in too_big)
                log.error("redis %s takes blocks of at most %d bytes (proto-max-bulk-len): %d acknowledged "
                          "write-behind block(s) larger than that stay in memory only", self.target,
                          self.max_block, len(too_big))
                batch = [it for it in batch if len(it.value) - HEADER_SIZE <= self.max_block]
                if not batch:
                    if await self.queue.finish(too_big, written=True):
                        too_big = []
                        _trim_heap()
                    continue
            nbytes, began = sum(len(it.value) for it in batch), time.monotonic()
            try:
                await self._write(batch)
            except Unavailable as exc:
                drained = await self.queue.finish(batch, written=False)
                self._batch_bytes = max(1, nbytes // 2)
                if self._up.is_set():  # refused (say OOM) while Redis is up: retry later, not in a busy loop
                    if not self._refusing:
                        self._refusing = True
                        log.warning("redis write-behind blocks not taken (%s); %d block(s) wait, retrying every %.0fs",
                                    self._last_error or exc, len(self.queue), _PROBE_MAX_S)
                    await asyncio.sleep(_PROBE_MAX_S)
            except Exception:  # a bug must not silently stop the flusher and strand acknowledged blocks
                log.exception("redis write-behind flush failed; retrying")
                drained = await self.queue.finish(batch, written=False)
                await asyncio.sleep(_PROBE_MAX_S)
            else:
                drained = await self.queue.finish(batch, written=True)
                rate = nbytes / max(time.monotonic() - began, 1e-4)
                self._batch_bytes = int(min(BATCH_BYTES, max(1.0, rate * self.timeout_s / 4)))
                if self._refusing:
                    self._refusing = False
                    log.warning("redis %s takes write-behind blocks again; %d block(s) to catch up",
                                self.target, len(self.queue))
            if too_big:  # (done after the rest: a finish tells a delete waiting in _settle the batch landed)
                drained = await self.queue.finish(too_big, written=True) or drained
            if drained:
                batch = too_big = []  # (the last references to the backlog's values)
                _trim_heap()

    # -- reads

    async def fetch(
        self, ns: str, keys: Sequence[bytes]
    ) -> list[tuple[bytes | memoryview, int] | None]:
        """``(block, checksum)`` per key from the queue or pipelined GETs (see :meth:`_read_into`).

        The block is a ``memoryview`` into the reply (no second copy). While
        Redis is down only queued blocks are found, which the service treats
        like a miss.
        """
        out: list[tuple[bytes | memoryview, int] | None] = [None] * len(keys)
        ask: list[int] = []
        for i, k in enumerate(keys):
            item = self.queue.get(ns, k) if len(self.queue) else None
            if item is not None:  # (write-behind, not yet in Redis: read through all the same)
                out[i] = (memoryview(item.value)[HEADER_SIZE:], item.checksum)
                self.counters["fetched_blocks"] += 1
            else:
                ask.append(i)
        each = self._value_bytes.get(ns)
        if ask and self._up.is_set() and each is None:
            # Nothing of ns read since the start: the values' lengths first (no block bytes), so that
            # the reads are cut to the byte budget (a guess of 1 MiB a key put 4x it in flight, 64
            # first reads of 4 MiB blocks at once); an absent key needs no GET.
            try:
                lengths = await self._execute([("STRLEN", block_key(ns, keys[i])) for i in ask])
            except Unavailable:
                return out
            for i, n in zip(ask, lengths):
                if n == 0:
                    out[i] = self._decoded(ns, keys[i], None)
            ask = [i for i, n in zip(ask, lengths) if n != 0]  # (an error reply, WRONGTYPE: the GET tells)
            each = max([n for n in lengths if isinstance(n, int)], default=0) or _VALUE_GUESS
        if ask and self._up.is_set():
            await self._read_into(out, ns, keys, ask, each or _VALUE_GUESS)
        return out

    async def _read_into(self, out: list[Any], ns: str, keys: Sequence[bytes], ask: list[int], each: int) -> None:
        """GET ``keys[i]`` for ``i`` in ``ask`` into ``out[i]``, in pipelines of ``_PIPELINE_BYTES`` at
        most, each key counted as ``each`` bytes."""
        parts = [ask[lo:hi] for lo, hi in _pieces([each] * len(ask), _PIPELINE_BYTES)]
        outcomes = await self._in_parts([([("GET", block_key(ns, keys[i])) for i in part], each * len(part))
                                         for part in parts])
        for part, values in zip(parts, outcomes):
            if isinstance(values, Unavailable):
                continue  # degraded: those are found in memory or not at all
            if isinstance(values, BaseException):
                raise values
            for i, value in zip(part, values):
                out[i] = self._decoded(ns, keys[i], value)

    async def _in_parts(self, pipelines: Sequence[tuple[Sequence[tuple[Any, ...]], int]]) -> list[Any]:
        """Run ``(commands, block bytes)`` pipelines two at a time: one result or exception each. (All
        at once, a large request's parts would queue for the byte budget ahead of every request
        after it: a 1-key read waited 1.8 s behind a put of 512 MiB.)"""
        width = asyncio.Semaphore(2)

        async def one(commands: Sequence[tuple[Any, ...]], nbytes: int) -> list[Any]:
            async with width:
                return await self._execute(commands, nbytes)

        return await asyncio.gather(*(one(c, n) for c, n in pipelines), return_exceptions=True)

    def _decoded(self, ns: str, key: bytes, value: bytes | Exception | None) -> tuple[memoryview, int] | None:
        if value is None:
            self.counters["fetch_misses"] += 1
            return None
        if isinstance(value, Exception):  # e.g. WRONGTYPE: not a string, so not one of our blocks
            self.counters["fetch_misses"] += 1
            self._key_warnings.warning("redis key %s could not be read (%s); treated as a miss",
                                       block_key(ns, key), _describe(value))
            return None
        decoded = decode_value(value)
        if decoded is None:
            self.counters["fetch_misses"] += 1
            self._key_warnings.warning("redis key %s does not hold a kvstore block value; ignored",
                                       block_key(ns, key))
            return None
        data, checksum, tag = decoded
        if misplaced(tag, block_key(ns, key)):
            # Its checksum holds (it is another key's block, whole), so only the server can tell: a miss.
            self.counters["fetch_misses"] += 1
            self.counters["misplaced_values"] += 1
            self._key_warnings.warning("redis key %s holds the block of another key (copied or "
                                       "renamed in redis); treated as a miss", block_key(ns, key))
            return None
        self.counters["fetched_blocks"] += 1
        self._seen(ns, len(value))  # (a kvstore block of ns: a foreign value must not size its reads)
        if checksum and xxhash.xxh3_64_intdigest(data) != checksum:
            # Returned anyway: the client checks the same checksum and reports the corruption.
            self.counters["checksum_mismatches"] += 1
            self._key_warnings.warning("redis key %s fails its checksum (corrupted in redis)",
                                       block_key(ns, key))
        return data, checksum

    async def exists(self, ns: str, keys: Sequence[bytes], *, strict: bool = False, renew: bool = False,
                     max_size: int | None = None) -> list[bool]:
        """Per key: queued, or in Redis with a kvstore value header (one pipelined round of
        ``GETRANGE key 0 15``: a foreign value or type is absent, as a GET would find it;
        damage inside the block shows only when the client checks its checksum). Redis down:
        absent, or with ``strict`` ``Unavailable``. ``renew``: under ``--redis-ttl`` an
        ``EXPIRE`` beside each ``GETRANGE`` restarts the keys' expiry (a block put again).
        ``max_size``: a ``STRLEN`` beside each, and a block over it is absent. (Queued blocks
        came from this server: they fit.)"""
        out = [bool(len(self.queue)) and self.queue.get(ns, k) is not None for k in keys]
        ask = [i for i, p in enumerate(out) if not p]
        if ask and strict and not self._up.is_set():
            raise self._unavailable()
        if ask and self._up.is_set():
            expire = bool(renew and self.ttl_s)
            step = 1 + (max_size is not None) + expire
            cmds: list[tuple[Any, ...]] = []
            for i in ask:
                name = block_key(ns, keys[i])
                cmds.append(("GETRANGE", name, 0, HEADER_SIZE - 1))
                if max_size is not None:
                    cmds.append(("STRLEN", name))
                if expire:
                    cmds.append(("EXPIRE", name, self.ttl_s))
            if expire:  # the namespace's record lives as long as its blocks
                cmds.append(("EXPIRE", ns_record_key(ns), self.ttl_s))
            try:
                answers = (await self._execute(cmds))[:step * len(ask)]
            except Unavailable:
                if strict:
                    raise
                return out  # (what is queued; the rest absent)
            for j, i in enumerate(ask):
                head = answers[step * j]
                decoded = decode_value(head) if isinstance(head, bytes) else None
                out[i] = decoded is not None and not misplaced(decoded[2], block_key(ns, keys[i]))
                if out[i] and max_size is not None:
                    length = answers[step * j + 1]
                    out[i] = isinstance(length, int) and length - HEADER_SIZE <= max_size
        return out

    # -- deletes

    async def _settle(self, match: Callable[[QueuedBlock], bool]) -> set[str]:
        """Drop queued blocks (the Redis names of those dropped are returned: they count as deleted);
        if one is being written, let that write land first, so our DEL comes after."""
        dropped, inflight = await self.queue.discard(match)
        if inflight:
            try:
                await asyncio.wait_for(self.queue.batch_done.wait(), self.flush_timeout)
            except asyncio.TimeoutError:  # (Redis may not be down: not the tier's last error, nor a reconnect)
                raise Unavailable(f"deleted from memory but not from redis tier {self.target}: a write of some "
                                  f"of these blocks was still in flight after {self.flush_timeout:g} s (send the "
                                  "request again later; until then a read may find them in redis)") from None
        return {block_key(ns, key) for ns, key in dropped}

    def delete(self, ns: str, keys: Sequence[bytes]) -> Awaitable[int]:
        """DEL in one round trip; counts the blocks deleted from Redis or dropped from the queue.
        The namespace hint goes down by what was deleted from Redis.

        Not a coroutine function, as :meth:`flush`: copies of these keys put from this call on
        (the service has deleted them from memory) are neither dropped nor written before the DEL.
        """
        wanted = {(ns, k) for k in keys}
        self.dropped_too_big -= wanted  # (the client let them go: no longer owed to Redis)
        done = asyncio.Event()
        for k in wanted:
            self._deleting.setdefault(k, []).append(done)
        return self._delete(ns, keys, wanted, self._seq, done)

    async def _delete(self, ns: str, keys: Sequence[bytes], wanted: set[tuple[str, bytes]], before: int,
                      done: asyncio.Event) -> int:
        try:
            dropped = await self._settle(lambda it: it.seq <= before and (it.ns, it.key) in wanted)
            if not keys:
                return 0
            names = list(dict.fromkeys(block_key(ns, k) for k in keys))
            res = await self._delete_names(names)
        finally:
            for k in wanted:
                self._deleting[k].remove(done)
                if not self._deleting[k]:
                    del self._deleting[k]
            done.set()
            self._wake_queue()  # (the flusher may hold these keys' later copies)
        if sum(res):
            await self._execute([("HINCRBY", ns_record_key(ns), "blocks_hint", -sum(res))])  # a hint: its error ignored
        return len(dropped) + _not_counted(names, res, dropped)

    def flush(self, ns: str) -> Awaitable[int]:
        """Delete every block of ``ns`` (SCAN MATCH on every master, DEL in pipelined batches) and its record.

        The namespace's tier writes wait from this call until the flush ends (not a coroutine
        function, so that the gate is up before the caller's next step: the service has already
        flushed memory, and a block put from then on must not be caught by the SCAN).
        """
        gate = self._flushing.setdefault(ns, _FlushGate())
        gate.running += 1
        self.dropped_too_big = {k for k in self.dropped_too_big if k[0] != ns}
        return self._flush(ns, gate)

    async def _flush(self, ns: str, gate: _FlushGate) -> int:
        try:
            dropped = await self._settle(lambda it: it.ns == ns)
            if not self._up.is_set():
                raise self._unavailable()
            pattern = f"{KEY_PREFIX}{ns_part(ns)}:*"
            n = len(dropped)
            batch: list[str | bytes] = []
            try:
                if isinstance(self.client, RedisCluster):
                    # SCAN asks the masters redis-py lists; one given slots since (a node added, then
                    # rebalanced) is listed only after a MOVED reached it: its blocks stayed.
                    await self.client.nodes_manager.initialize()
                async for name in self.client.scan_iter(match=pattern, count=1000):
                    batch.append(name)
                    if len(batch) >= 1000:
                        n += _not_counted(batch, await self._delete_names(batch), dropped)
                        batch = []
            except _REDIS_ERRORS as exc:
                self._mark_down(exc)
                raise self._unavailable() from None
            n += _not_counted(batch, await self._delete_names(batch), dropped)
            await self._execute([("DEL", ns_record_key(ns))])
            self._value_bytes.pop(ns, None)
            return n
        finally:
            gate.running -= 1
            if not gate.running:
                del self._flushing[ns]
                gate.done.set()

    async def _delete_names(self, names: Sequence[str | bytes]) -> list[int]:
        """DEL ``names`` in one round trip; per name, 1 if it existed."""
        if not names:
            return []
        res = await self._execute([("DEL", name) for name in names])
        self._refused(res, "delete(s)")
        return res

    # -- introspection

    def stats(self) -> dict[str, Any]:
        return {
            "backend": "redis-cluster" if self.cluster else "redis",
            "target": self.target,
            "state": "ok" if self._up.is_set() else "degraded",
            "mode": self.mode,
            "ttl_s": self.ttl_s,
            "backlog_bytes": self.queue.nbytes,
            "backlog_blocks": len(self.queue),
            "queue_limit_bytes": self.queue.limit,
            "degraded_since": self._degraded_since,
            "last_error": self._last_error,
            "last_error_at": self._last_error_at,
            **self.counters,
        }
