"""``AsyncKVClient``: the asyncio client, the one implementation of the client logic.

One client talks to one server, or to several (``addr`` a list): keys are then
spread by rendezvous hashing (:mod:`.sharding`) and each batch operation costs
one round trip per server, in parallel. Each server gets a small pool of
pipelined connections (:mod:`.node`); replies land in :mod:`.buffers`.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import ssl
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Awaitable, Callable, Collection, NoReturn, Sequence, TypeVar

import xxhash

from kvstore.errors import (
    BlockSizeError, CapacityError, IntegrityError, InvalidRequest, KVStoreError, ProtocolError, ServerError, TooLarge,
    TransportError, Unauthorized, from_code,
)
from kvstore.keys import check_keys
from kvstore.messages import MAX_NAMESPACE
from kvstore.protocol import (
    DEFAULT_LIMITS, EXISTED, STORED, Delete, Exists, Flush, Get, Limits, Lookup, Message, Ping, Put, Stats, Unpin,
    flat_bytes, iter_payload,
)

from . import replies, workers
from .buffers import GetSink, Recycler
from .connection import NotHome, Response, refusal
from .node import Node, check_host, claim_home, forks
from .shm import CopyExpired, GetOutcome, ShmGone
from .sharding import Ring
from .workers import run_parallel

T = TypeVar("T")
log = logging.getLogger(__name__)


def checksum(block: memoryview) -> int:
    """The block checksum stored beside every block: xxh3-64 (tens of GB/s)."""
    return xxhash.xxh3_64_intdigest(block)


def checksums(blocks: Sequence[memoryview]) -> list[int]:
    """Each block's checksum; a large batch of large blocks (:func:`workers.run_parallel`) is hashed
    on the helper threads too: a put's server waits for them with its core idle (puts of 1-4 MiB
    x 32 into a full store, A/B runs against hashing inline: 0.96-1.08x, median 1.03-1.06x)."""
    return run_parallel([partial(xxhash.xxh3_64_intdigest, b) for b in blocks], sum(map(len, blocks)))


#: A client holds connections (and the blocking one a thread): a copy in another process could use none of them.
_NOT_PICKLED = ("a kvstore client ({}) cannot be pickled or copied: create one in each process that uses it "
                "(it connects on its first call)")


@dataclass(frozen=True)
class PutResult:
    """Outcome of a put: counts, and per key ``"stored"``, ``"existed"`` or ``"failed"``."""

    stored: int
    existed: int
    failed: int
    statuses: list[str]
    errors: dict[int, KVStoreError] = field(default_factory=dict)


class AsyncKVClient:
    """Asyncio client of one kvstore server, or of several (keys sharded).

    Args:
        addr: ``"host:port"``, ``"unix:/path/to.sock"`` (same host), or a list of them.
        namespace: the namespace every operation works in.
        token: shared secret, when the server requires one; trailing whitespace (the newline of a
            file read whole) is dropped, as the server drops it from its token file's lines.
        tls: an ``ssl.SSLContext``, ``True`` for the system defaults, or a CA file path.
        server_hostname: the name the server's TLS certificate was made for, when it is not the
            host of ``addr`` (an address given as an IP, say).
        pool_size: connections per server.
        timeout: seconds a request may take before ``RequestTimeout`` (None: no limit; bad
            values of this and the other settings raise ``InvalidRequest``).
        connect_timeout: seconds to connect, say HELLO and map a same-host server's arena
            (None: no limit); with ``retries``, a server that never answers costs a call up to
            ``connect_timeout * (1 + retries)`` (and the backoff) before ``TransportError``,
            however many calls share the client: they wait for the same connects (a call sent
            on a connection as the server stopped answering waits up to ``timeout`` first).
        retries: retries of a request after a transport error (never of a pinning lookup,
            an unpinning get or an unpin: the server may have run them already -- unless
            their connection ended before any of their bytes went out).
        backoff: seconds before the first retry, doubled before each next one.
        quarantine: seconds a server that timed out or could not be reached is not asked:
            calls to it fail at once with ``TransportError`` (over several servers, a lookup
            or exists answers from the others at once), then the next call tries it again;
            each failure in a row doubles the time, up to 8x (an ``unpin``, and the leases a
            failed or cancelled lookup gives back, are always tried). For a cache whose caller must
            not wait a timeout per request on a server that stopped answering (an engine's
            scheduler): it waits one ``timeout`` -- or ``connect_timeout``, when the call that
            tries again has to connect -- per quarantine. 0 (default): every call tries.
        verify: check each block's checksum on get (``IntegrityError`` on mismatch).
        limits: the client's own bounds on a request (:class:`~kvstore.messages.Limits`: meta
            and payload bytes, keys); a request goes out within these and the server's, the lower.
        shm: map the server's block arena and copy payloads through it (``docs/shm.md``):
            ``None`` (default) when connected over the Unix socket, ``True`` also from a
            TCP address (via the socket path the server announces, on its host only),
            ``False`` never. Whenever the server does not offer it, the socket is used.
        recycle_bytes: up to this many bytes of blocks returned by ``get`` are reused by
            later ``get`` calls once the caller has dropped every reference to them
            (their memory is already faulted in); 0 allocates every block afresh.
        split_bytes: a get or get_into of at least twice this many bytes from one server is
            split into parts of at least this size, sent in parallel over up to ``pool_size``
            connections (0: one request per server). Puts are never split: a batch is one chain.
    """

    def __init__(self, addr: str | Sequence[str] = "127.0.0.1:7600", *, namespace: str = "default",
                 token: str | None = None, tls: ssl.SSLContext | bool | str | None = None, pool_size: int = 4,
                 timeout: float = 30.0, connect_timeout: float | None = 5.0, retries: int = 2, backoff: float = 0.05,
                 quarantine: float = 0.0, verify: bool = True, limits: Limits = DEFAULT_LIMITS,
                 server_hostname: str | None = None, shm: bool | None = None, recycle_bytes: int = 256 << 20,
                 split_bytes: int = 16 << 20) -> None:
        addrs = [addr] if isinstance(addr, str) else _listed(addr, "addr")
        if not addrs:
            raise InvalidRequest("no server address given")
        if not all(isinstance(a, str) for a in addrs):
            raise InvalidRequest(f"a server address is a string, got {addrs!r}")
        if len(set(addrs)) != len(addrs):
            raise InvalidRequest(f"server addresses must be distinct, got {addrs}")
        self.namespace = _namespace(namespace)
        if token is not None and not isinstance(token, str):
            raise InvalidRequest(f"token must be a string, got {type(token).__name__}")
        # (not the leading: in the server's "GLOB: TOKEN" lines the space is part of the token)
        self.token = token.rstrip() if token is not None else None
        self.tls = _ssl_context(tls)
        if server_hostname is not None and not isinstance(server_hostname, str):
            raise InvalidRequest(f"server_hostname must be a string, got {type(server_hostname).__name__}")
        self.server_hostname = server_hostname and check_host(server_hostname, "server_hostname")
        if type(pool_size) is not int or pool_size < 1:
            raise InvalidRequest(f"pool_size must be an integer >= 1, got {pool_size!r}")
        if type(retries) is not int or retries < 0:
            raise InvalidRequest(f"retries must be an integer >= 0, got {retries!r}")
        self.pool_size = pool_size
        self.timeout = _seconds("timeout", timeout)
        self.connect_timeout = _seconds("connect_timeout", connect_timeout)
        self.retries = retries
        self.backoff = _seconds("backoff", backoff, zero=True)
        self.quarantine = _seconds("quarantine", quarantine, zero=True) or 0.0
        for name, value in (("recycle_bytes", recycle_bytes), ("split_bytes", split_bytes)):
            if type(value) is not int or value < 0:
                raise InvalidRequest(f"{name} must be an integer >= 0 (bytes), got {value!r}")
        if not isinstance(limits, Limits):
            raise InvalidRequest(f"limits must be a kvstore.protocol.Limits, got {limits!r}")
        if shm not in (None, True, False):
            raise InvalidRequest(f"shm must be None, True or False, got {shm!r}")
        if verify not in (True, False):  # ("no" would be true)
            raise InvalidRequest(f"verify must be True or False, got {verify!r}")
        workers.check_setting()
        self.verify = verify
        self.limits = limits
        self.shm = shm
        self._recycler = Recycler(recycle_bytes) if recycle_bytes > 0 else None
        self.split_bytes = split_bytes
        self._block_bytes = 0  # average block size of the last get: how big an unsized read is
        self.nodes = [Node(a, self) for a in addrs]
        self.closed = False  # by close(), until connect()
        #: (fork count, event loop) of the connections, to all its servers: set by the first call
        self.home: tuple[int, asyncio.AbstractEventLoop] | None = None
        self._background: set[asyncio.Future[None]] = set()  # leases given back after a failed lookup
        self.ring = Ring([n.addr for n in self.nodes])

    def __reduce__(self) -> Any:
        raise TypeError(_NOT_PICKLED.format(type(self).__name__))

    async def __aenter__(self) -> AsyncKVClient:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def connect(self) -> None:
        """Open one connection per server now: fails fast on a refused token or request, a TLS
        handshake refused (a certificate, or no TLS there), or when no server can be reached.
        Over several servers, one that cannot be reached (down, silent, at its connection limit)
        is logged and left to the calls, as if it failed later (a lookup counts its keys as
        missing, a put to it fails): an engine starts while one shard is down. When it raises, the
        connections it opened are closed again -- unless calls had opened some before it: those
        and these stay, for the calls (a failed connect must not cut off a healthy server's)."""
        claim_home(self)  # (from another loop: NotHome, and nothing of the home loop's touched)
        in_use = not self.closed and any(n.conns or n.opening for n in self.nodes)
        self.closed = False
        try:
            opened = await asyncio.gather(*(n.connection() for n in self.nodes), return_exceptions=True)
        except BaseException:  # (cancelled, say by a timeout around it: what it opened is closed again)
            if not in_use:
                await asyncio.shield(self._close_nodes())
            raise
        failed = [(n, e) for n, e in zip(self.nodes, opened) if isinstance(e, BaseException)]
        if not failed:
            return
        mistake = next((e for _, e in failed if _the_callers(e)), None)
        if mistake is not None or len(failed) == len(self.nodes):
            if len(self.nodes) > 1:
                for node, e in failed:
                    log.warning("%s failed at connect: %s", node.addr, e)
            if not in_use:
                await self._close_nodes()  # (the client stays usable: calls reconnect, from any loop)
            raise mistake or next((e for _, e in failed if isinstance(e, TransportError)), failed[0][1])
        for node, e in failed:
            log.warning("connected to %d of %d servers; %s failed (%s): calls will try it again",
                        len(self.nodes) - len(failed), len(self.nodes), node.addr, e)

    async def close(self) -> None:
        """Close every connection; later calls raise ``TransportError`` until :meth:`connect`.

        Raises:
            TransportError: called from another event loop while the one it first ran on is not
                closed (close it there: its sockets are that loop's). From a forked child, or once
                that loop is closed (an ``asyncio.run`` ended), it forgets them and frees the client.
        """
        loop = asyncio.get_running_loop()
        home = self.home
        if home is not None and home[0] == forks() and home[1] is not loop and not home[1].is_closed():
            raise NotHome("this AsyncKVClient's connections belong to the event loop it first ran on, which "
                          "is not closed: close the client there")
        giving_back = {f for f in self._background if f.get_loop() is loop}  # (another loop's: not ours to wait on)
        if giving_back:  # leases a failed lookup is giving back: let them go first (a second at most)
            await asyncio.wait(giving_back, timeout=1.0)
        self.closed = True
        await self._close_nodes()

    async def _close_nodes(self) -> None:
        """Close every server's connections and let go of the home, unless a connect() ran meanwhile
        (a forked child, or another loop, may then connect() the client afresh)."""
        await asyncio.gather(*(n.close() for n in self.nodes))
        if self.closed or not any(n.conns or n.opening for n in self.nodes):
            self.home = None

    # -- sharding helpers
    def _groups(self, keys: Sequence[bytes]) -> list[tuple[Node, Sequence[int]]]:
        """Key indexes per server, each in the keys' order (one server: a range, no list)."""
        if len(self.nodes) == 1:
            return [(self.nodes[0], range(len(keys)))]
        groups: dict[int, list[int]] = {}
        for i, k in enumerate(keys):
            groups.setdefault(self.ring.node_of(k), []).append(i)
        return [(self.nodes[n], idx) for n, idx in groups.items()]

    def _local_parent(self, node: Node, key: bytes | None) -> bytes | None:
        """``key`` as the parent of a server's share of a put, if that server holds it: a
        parent named but absent marks the block stranded (its predecessor was evicted)."""
        if key is None or len(self.nodes) == 1 or self.nodes[self.ring.node_of(key)] is node:
            return key
        return None

    def _read_groups(self, keys: Sequence[bytes], buffers: Sequence[memoryview] | None) -> list[tuple[Node, Sequence[int]]]:
        """Like :meth:`_groups`, with a large read split into parts of at least
        ``split_bytes`` that go out in parallel over the server's pooled connections
        (block sizes: the buffers', or the last reply's average for ``get``), and one
        too big for a single reply into parts the server's limits allow."""
        groups = self._groups(keys)
        out: list[tuple[Node, Sequence[int]]] = []
        for node, idx in groups:
            sizes = [len(buffers[i]) for i in idx] if buffers is not None else [self._block_bytes] * len(idx)
            runs = node.batches(sizes)
            if len(runs) > 1:  # one reply could not carry it
                out += [(node, idx[r.start:r.stop]) for r in runs]
                continue
            total = sum(sizes)
            parts = min(self.pool_size, len(idx), total // self.split_bytes) if self.split_bytes > 0 else 1
            if parts <= 1 or node.shm is not None:
                out.append((node, idx))
                continue
            step = -(-len(idx) // parts)
            out += [(node, idx[k:k + step]) for k in range(0, len(idx), step)]
        return out

    async def _per_node(self, keys: Sequence[bytes], fn: Callable[[Node, Sequence[int]], Awaitable[T]],
                        groups: list[tuple[Node, Sequence[int]]] | None = None) -> list[tuple[Sequence[int], T]]:
        groups = self._groups(keys) if groups is None else groups
        if len(groups) == 1:  # one server: no gather, no task (each costs loop iterations per request)
            node, idx = groups[0]
            return [(idx, await fn(node, idx))]
        # Every part settles before any error is raised: a part still running could write into the
        # caller's buffers (or read its blocks) after the call returned.
        results = await asyncio.gather(*(fn(node, idx) for node, idx in groups), return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r
        return [(idx, r) for (_, idx), r in zip(groups, results)]  # type: ignore[misc]

    # -- the API
    async def put(self, keys: Sequence[bytes], blocks: Sequence[Any], *, parent: bytes | None = None) -> PutResult:
        """Store blocks under content keys. Keys already stored are not stored again (``existed``).

        The keys are one chain, in order. ``parent`` is the key just before ``keys[0]``
        when the batch continues a stored prefix (an engine storing the blocks it
        computed after a prefix hit): the server then evicts the batch before that
        prefix, as it would a chain's tail, instead of treating it as a chain of its own.

        Raises:
            CapacityError (or another ServerError) when some block could not be stored, or
            TransportError / RequestTimeout when a server could not be reached or did not
            answer (any error of a server's share: its keys): the exception's ``result``
            attribute holds the per-key outcome (a PutResult), so with several servers the
            keys the others stored are known; ``errors``, each failed key's error.
            "failed" means not known to be stored: a server that took a batch and then
            went silent may have stored it.
        """
        keys = _checked_keys(keys)
        if parent is not None:
            parent = _checked_keys([parent])[0]
        views = iter_payload(_listed(blocks, "blocks"))
        if len(views) != len(keys):
            raise InvalidRequest(f"{len(keys)} keys but {len(views)} blocks")
        if not keys:
            return PutResult(0, 0, 0, [])

        async def one(node: Node, idx: Sequence[int]) -> list[tuple[int, str | None] | KVStoreError]:
            try:
                await node.ready()
            except KVStoreError as exc:  # (this share's keys fail; the others' stand)
                return [exc] * len(idx)
            before = self._local_parent(node, keys[idx[0] - 1] if idx[0] else parent)
            share, blocks = _pick(keys, idx), _pick(views, idx)
            sizes = list(map(len, blocks))
            parts = node.batches(sizes)  # (each part continues the chain of the one before)
            whole = len(parts) == 1
            outcome: list[tuple[int, str | None] | KVStoreError] = []
            for part in parts:
                try:
                    items = await put_part(node, share if whole else share[part.start:part.stop],
                                           blocks if whole else blocks[part.start:part.stop],
                                           sizes if whole else sizes[part.start:part.stop],
                                           before if part.start == 0 else share[part.start - 1])
                except KVStoreError as exc:  # this part failed whole; what was stored before it still counts
                    return outcome + [exc] * (len(idx) - len(outcome))  # (a list: _per_node raises an exception)
                outcome += items
                failed = _failed_whole(items)
                if failed is not None:  # (a halved part's second half, after its first was stored): nor the rest
                    return outcome + [failed] * (len(idx) - len(outcome))
            return outcome

        async def put_part(node: Node, part_keys: list[bytes], blocks: list[memoryview], sizes: list[int],
                           before: bytes | None) -> list[tuple[int, str | None] | KVStoreError]:
            nbytes = sum(sizes)
            too_large = len(sizes) == 1 and nbytes > node.max_payload  # (batches() gives such a block a run of its own)
            # same host: copied into the arena, checksummed on the way (small puts: ShmChannel.inline_put_bytes)
            if node.shm is not None and nbytes >= node.shm.inline_put_bytes and not too_large:
                try:
                    return list(await node.shm.put(part_keys, blocks, before))
                except (ShmGone, CapacityError):
                    pass  # (restarted without shm, or its puts waiting for a commit at their limit: the socket)
                except TooLarge:  # slots in more arena runs than one reply may locate
                    if len(part_keys) > 1:  # in halves, the second continuing the first's chain
                        half = len(part_keys) // 2
                        first = await put_part(node, part_keys[:half], blocks[:half], sizes[:half], before)
                        failed = _failed_whole(first)  # (a server that stopped answering is not asked again)
                        if failed is None:
                            try:
                                return first + await put_part(node, part_keys[half:], blocks[half:], sizes[half:],
                                                              part_keys[half - 1])
                            except KVStoreError as exc:  # (what the first half stored still counts)
                                failed = exc
                        return first + [failed] * (len(part_keys) - half)
                    # (one block: the socket carries it)
            if too_large:  # (the server would drop the connection on its frame, and refuses it through the
                # arena too: no reader over a socket could get it back) -- said here, for this key only
                return [(TooLarge.code, f"a block of {nbytes} bytes is over the {node.max_payload} bytes "
                                        f"one request to {node.addr} may carry (its --max-frame-size)")]
            msg = Put(keys=part_keys, sizes=sizes, checksums=checksums(blocks), parent=before)
            resp = await node.call(msg, blocks, nbytes)
            return list(replies.statuses(resp.fields, len(part_keys), "PUT"))

        statuses: list[str] = [""] * len(keys)
        errors: dict[int, KVStoreError] = {}
        for idx, outcome in await self._per_node(keys, one):
            for i, item in zip(idx, outcome):
                if isinstance(item, KVStoreError):
                    statuses[i] = "failed"
                    errors[i] = item
                    continue
                code, message = item
                if code == STORED:
                    statuses[i] = "stored"
                elif code == EXISTED:
                    statuses[i] = "existed"
                else:
                    statuses[i] = "failed"
                    errors[i] = from_code(code, message or "block not stored")
        result = PutResult(statuses.count("stored"), statuses.count("existed"), len(errors), statuses, errors)
        if errors:
            _raise_partial(errors, len(keys), "not stored", result)
        return result

    async def lookup(self, keys: Sequence[bytes], *, pin: bool = False, lease_ms: int | None = None) -> int:
        """How many leading keys are present: the largest m with keys[:m] all stored.

        One round trip per server (one per ``--max-batch`` keys of a longer chain, until
        one finds a key missing). ``pin=True`` leases those blocks (``lease_ms``, default
        the server's) so eviction cannot take them before the fetch. A pinned lookup that
        raises (or is cancelled) gives back the leases it took: a request in flight when the
        caller is cancelled is seen through, and what it pinned is given back; one that gets
        no answer (a server that stopped answering) may have pinned, its leases end with their time.

        Over several servers, a lookup answers from those that did: a key of a server that
        failed (down, silent, refusing) counts as missing, so the answer is what can be fetched
        now, and a warning is logged (once per server per minute). It raises only when no
        server answered. Leases such a server took before it failed are given back in the
        background; ``close()`` gives that a second, after which they end with their time.
        """
        keys = _checked_keys(keys)
        Lookup.check_lease(lease_ms)
        pin = _flag("pin", pin)
        if not keys:
            return 0

        pinned: list[tuple[Node, Sequence[int]]] = []  # the leases taken, by key index

        def leased(lo: int, hi: int) -> list[tuple[Node, list[bytes]]]:
            return [(node, [keys[i] for i in ix if lo <= i < hi]) for node, ix in pinned]

        async def one(node: Node, idx: Sequence[int]) -> int:
            await node.ready(idempotent=not pin)
            found = 0
            for run in node.key_runs(len(idx)):  # (a run starts where the one before found every key)
                part = _pick(keys, idx[run.start:run.stop])
                resp = await node.call(Lookup(keys=part, pin=pin, lease_ms=lease_ms), idempotent=not pin,
                                       orphan=partial(self._unpin_orphan, node, part) if pin else None)
                n = resp.fields.get("n")
                if type(n) is not int or not 0 <= n <= len(part):
                    raise ProtocolError("malformed LOOKUP reply")
                found += n
                if pin and n:
                    pinned.append((node, idx[run.start:run.start + n]))
                granted = resp.fields.get("lease_ms")
                if lease_ms and type(granted) is int and granted < lease_ms and not node.lease_cut_told:
                    node.lease_cut_told = True  # (once per server: an engine asks the same on every lookup)
                    log.warning("%s leases pinned blocks for at most %d ms (its --max-lease-seconds); "
                                "asked for %d ms", node.addr, granted, lease_ms)
                if n < len(part):
                    break
            return found

        first_missing = len(keys)
        dropping = False
        try:
            shares = await self._answered(keys, one, "a lookup")
            failed = {node for node, _, n in shares if n is None}
            for _, idx, n in shares:
                if n is None:  # (its server failed)
                    first_missing = min(first_missing, idx[0])
                elif n < len(idx):
                    first_missing = min(first_missing, idx[n])
            if pin and len(shares) > 1:  # each server pinned its share's own prefix: drop the leases past the chain's
                dropping = True  # (shielded: a cancel must not cut the drop off half-way)
                past = leased(first_missing, len(keys))
                # (a server that failed after pinning an earlier run: not waited for)
                self._in_background(self._unpin_quietly([(node, ks) for node, ks in past if node in failed]))
                await asyncio.shield(self._in_background(
                    self._unpin_quietly([(node, ks) for node, ks in past if node not in failed])))
        except BaseException:  # (a cancel too) the caller learns of no lease: give back those it took
            # (in the background: not to wait on a server that failed, nor be cut off by a cancel). A LOOKUP
            # whose reply never came may have pinned too: unknown here, its lease ends with its time.
            if pinned:
                self._in_background(self._unpin_quietly(leased(0, first_missing if dropping else len(keys))))
            raise
        return first_missing

    async def _answered(self, keys: Sequence[bytes], one: Callable[[Node, Sequence[int]], Awaitable[T]],
                        what: str, strict: bool = False) -> list[tuple[Node, Sequence[int], T | None]]:
        """Each server, its share of ``keys`` and its answer, None for a server that failed (a
        ``KVStoreError``) while another answered; raises when none did (``strict``: when one did not)."""
        groups = self._groups(keys)
        if len(groups) == 1:
            node, idx = groups[0]
            return [(node, idx, await one(node, idx))]
        results = await asyncio.gather(*(one(node, idx) for node, idx in groups), return_exceptions=True)
        failures = [r for r in results if isinstance(r, BaseException)]
        for exc in failures:
            if not isinstance(exc, KVStoreError) or isinstance(exc, NotHome):  # (a cancel, a bug, a misuse)
                raise exc
        if failures and (strict or len(failures) == len(groups)):
            raise failures[0]
        now = time.monotonic()
        for (node, _), r in zip(groups, results):
            if isinstance(r, KVStoreError) and now - node.failed_told > 60:
                node.failed_told = now
                log.warning("%s goes on without %s, its keys counted as missing: %s", what, node.addr, r)
        return [(node, idx, None if isinstance(r, BaseException) else r) for (node, idx), r in zip(groups, results)]

    def _unpin_orphan(self, node: Node, part: list[bytes], resp: Response) -> None:
        """Give back what a pinned LOOKUP pinned after its caller stopped waiting (cancelled)."""
        n = resp.fields.get("n")
        if type(n) is int and 0 < n <= len(part) and not self.closed:
            self._in_background(self._unpin_quietly([(node, part[:n])]))

    def _give_back(self, keys: list[bytes], node: Node | None = None) -> None:
        """Drop in the background one lease on each of ``keys`` (on ``node``, or each key's server),
        which nobody will: an unpinning get that never reached its server, a pinned lookup whose
        caller was interrupted as it answered (the blocking client)."""
        if not self.closed:
            groups = [(node, keys)] if node is not None else [(n, _pick(keys, ix)) for n, ix in self._groups(keys)]
            self._in_background(self._unpin_quietly(groups))

    def _in_background(self, work: Awaitable[None]) -> asyncio.Future[None]:
        """Run ``work`` on its own, kept until it ends (close() waits for it, a second at most)."""
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    @staticmethod
    async def _unpin_quietly(leases: list[tuple[Node, list[bytes]]]) -> None:
        """Drop leases, in runs the servers take; best effort: a lease not dropped ends with its time."""
        async def drop(node: Node, keys: list[bytes]) -> None:
            for run in node.key_runs(len(keys)):
                await node.call(Unpin(keys=keys[run.start:run.stop]), idempotent=False, always=True)

        await asyncio.gather(*(drop(node, keys) for node, keys in leases if keys), return_exceptions=True)

    async def get(self, keys: Sequence[bytes], *, unpin: bool = False) -> list[bytearray | None]:
        """The blocks, in key order; ``None`` where a key is missing. ``unpin``: as for :meth:`get_into`.

        Raises:
            IntegrityError (a block failed its checksum), TransportError (a server could not
            be reached), ...: once every server's share has settled, with ``result``, the
            blocks in key order, ``None`` where missing or unusable (the others stand), and
            ``errors``, each unusable key's error.
        """
        out = await self._get(keys, None, unpin)
        return out  # type: ignore[return-value]

    async def get_into(self, keys: Sequence[bytes], buffers: Sequence[Any], *, unpin: bool = False) -> list[bool]:
        """Receive blocks straight into writable buffers of exactly the blocks' sizes.

        Returns per key whether it was found. Raises ``BlockSizeError`` when a
        buffer's size differs from its block's (after the whole reply is read); like
        every error of :meth:`get` it carries ``result`` (the filled buffers' views).
        So is a read-only or non-contiguous buffer; an object that is no buffer at all (a
        tensor) is an ``InvalidRequest``, as for :meth:`put`.

        ``unpin=True`` drops one lease per key (a pinned lookup's) as the server answers; a share
        cancelled before it reached its server (waiting for a pooled connection), or that its
        server refused (too large for a reply, shared-memory pins at their limit) after the cancel,
        gives its leases back: a load cancelled by a deadline leaves none -- unless it was
        cancelled before it ever ran (a task cancelled before its first step runs no code).
        """
        views = []
        for i, b in enumerate(_listed(buffers, "buffers")):
            try:
                mv = memoryview(b)
            except TypeError:
                raise InvalidRequest(f"buffer {i} is a {type(b).__name__}, not a writable buffer (tensors: "
                                     "kvstore.engine.transfer.PagedKVTransfer, or a CPU tensor's "
                                     ".view(torch.uint8).numpy())") from None
            except ValueError as exc:  # (numpy's datetime64 exports no buffer)
                raise InvalidRequest(f"buffer {i} is not a plain buffer: {exc} (a numpy array: "
                                     ".view(numpy.uint8))") from None
            if mv.readonly or not mv.c_contiguous:
                raise BlockSizeError(f"buffer {i} is not a writable contiguous buffer")
            views.append(flat_bytes(mv))
        keys = _listed(keys, "keys")  # (an iterator has no len: _get checks the keys themselves)
        if len(views) != len(keys):
            raise InvalidRequest(f"{len(keys)} keys but {len(views)} buffers")
        _refuse_overlaps(views)
        out = await self._get(keys, views, unpin)
        return [b is not None for b in out]

    async def _get(self, keys: Sequence[bytes], buffers: list[memoryview] | None,
                   unpin: bool) -> list[memoryview | bytearray | None]:
        keys = _checked_keys(keys)
        unpin = _flag("unpin", unpin)
        unready: dict[Node, KVStoreError] = {}  # servers whose first connection failed: their shares fail
        if not all(node.limits_known for node in self.nodes):  # (a first call: the parts follow the limits)
            nodes = [node for node, _ in self._groups(keys)]
            try:
                results = await asyncio.gather(*(n.ready(not unpin) for n in nodes), return_exceptions=True)
            except BaseException:  # (a cancel) nothing was asked: the leases it was to drop are given back
                if unpin:
                    self._give_back(keys)
                raise
            for node, r in zip(nodes, results):
                if isinstance(r, KVStoreError):
                    unready[node] = r
                elif isinstance(r, BaseException):
                    raise r

        groups = self._read_groups(keys, buffers)
        begun: set[int] = set()  # the shares whose ``one`` ran (a cancel can end the others' tasks first)

        async def one(node: Node, idx: Sequence[int]) -> GetSink | GetOutcome:
            begun.add(id(idx))
            bufs = _pick(buffers, idx) if buffers is not None else None
            share = _pick(keys, idx)
            # A share that unpins and never left (a cancel while it waited for a pooled connection,
            # a server that could not be reached) gives back the leases it was to drop.
            unsent = _once(partial(self._give_back, share, node)) if unpin else None
            try:
                if node in unready:
                    if unsent is not None:
                        unsent()
                    raise unready[node]
                if node.shm is not None:  # same host: copied out of the arena, verified on the way
                    try:
                        return await node.shm.get(share, bufs, unpin, self.verify, unsent)
                    except (ShmGone, CapacityError):
                        pass  # (restarted without shm, or its shared-memory read pins at their limit: the socket)
                    except TooLarge:  # (refused: no lease dropped) in halves, below; one block over the socket
                        if len(idx) > 1:  # (in more arena runs than a reply may locate, or inline over the limit)
                            raise
                resp = await node.call(Get(keys=share, unpin=unpin), idempotent=not unpin, unsent=unsent,
                                       make_sink=lambda f: GetSink(f, share, bufs, self._recycler, self.verify))
            except TooLarge as exc:
                if len(idx) < 2:  # (a block over the reply limit, or larger than its buffer)
                    if unsent is not None:  # (refused: it dropped no lease)
                        unsent()
                    return GetOutcome([None] * len(idx), [0] * len(idx), dict.fromkeys(range(len(idx)), exc))
                # A reply too large for one frame (blocks of unknown sizes; with buffers, a block
                # larger than its buffer) or, through the arena, blocks in more runs than one reply
                # may locate: nothing was sent, no lease dropped; ask for each half.
                half = len(idx) // 2
                try:
                    first = await one(node, idx[:half])
                except BaseException:  # (a cancel: the second half, never asked, gives its leases back)
                    if unpin:
                        self._give_back(_pick(keys, idx[half:]), node)
                    raise
                gone = next((e for e in first.errors.values()
                             if isinstance(e, TransportError) and not isinstance(e, CopyExpired)), None)
                if gone is None:
                    second = await one(node, idx[half:])
                else:  # the server stopped answering (or could not be reached): the second half is not asked
                    if unpin:
                        self._give_back(_pick(keys, idx[half:]), node)
                    rest = len(idx) - half
                    second = GetOutcome([None] * rest, [0] * rest, dict.fromkeys(range(rest), gone))
                return GetOutcome(first.out + second.out, first.checksums + second.checksums,
                                  {**first.errors, **{half + j: e for j, e in second.errors.items()}})
            except KVStoreError as exc:  # this share failed whole; the blocks of the others stand (.result)
                if unsent is not None and refusal(exc):  # (refused: it dropped no lease)
                    unsent()
                return GetOutcome([None] * len(idx), [0] * len(idx), dict.fromkeys(range(len(idx)), exc))
            assert isinstance(resp.sink, GetSink)  # (a reply without payload has one too)
            resp.sink.finish()
            return resp.sink

        out: list[memoryview | bytearray | None] = [None] * len(keys)
        errors: dict[int, KVStoreError] = {}
        found = nbytes = 0
        try:
            shares = await self._per_node(keys, one, groups)
        except BaseException:  # (a cancel)
            if unpin:
                for node, idx in groups:
                    if id(idx) not in begun:
                        self._give_back(_pick(keys, idx), node)
            raise
        for idx, sink in shares:
            for j, i in enumerate(idx):
                blob = sink.out[j]
                if blob is not None and self.verify and sink.checksums[j] and checksum(memoryview(blob)) != sink.checksums[j]:
                    errors[i] = IntegrityError(f"block {i} (key {keys[i].hex()}) failed its checksum")
                    blob = None
                if blob is not None:
                    found += 1
                    nbytes += len(blob)
                out[i] = blob
            errors.update({idx[j]: e for j, e in sink.errors.items()})
        if found:
            self._block_bytes = nbytes // found
        if errors:
            _raise_partial(errors, len(keys), "unusable", out)
        return out

    async def exists(self, keys: Sequence[bytes], *, strict: bool = False) -> list[bool]:
        """Which keys are stored, in key order.

        Over several servers, as with ``lookup``: a key of a server that failed counts as absent
        (it cannot be read now; an engine asking what to store stores it again, and that put
        reports the server's failure), a warning is logged, and it raises only when no server
        answered -- with ``strict``, when any server failed (for a caller that waits for keys to
        appear: absent is not the answer then). (``stats()`` lists a failed server under
        ``"errors"``; ``delete()``, ``unpin()`` and ``flush()`` raise when one fails.)"""
        keys, strict = _checked_keys(keys), _flag("strict", strict)
        if not keys:
            return []

        async def one(node: Node, idx: Sequence[int]) -> list[bool]:
            await node.ready()
            out: list[bool] = []
            for run in node.key_runs(len(idx)):
                resp = await node.call(Exists(keys=_pick(keys, idx[run.start:run.stop])))
                out += replies.bools(resp.fields.get("present"), len(run), "present")
            return out

        present = [False] * len(keys)
        for _, idx, vals in await self._answered(keys, one, "an exists", strict):
            for i, v in zip(idx, vals or ()):
                present[i] = v
        return present

    async def delete(self, keys: Sequence[bytes]) -> int:
        """Delete blocks; returns how many were present."""
        return await self._count(_checked_keys(keys), lambda sub: Delete(keys=sub))

    async def unpin(self, keys: Sequence[bytes]) -> int:
        """Drop one lease per key (from ``lookup(pin=True)``); returns how many were dropped."""
        return await self._count(_checked_keys(keys), lambda sub: Unpin(keys=sub), idempotent=False, always=True)

    async def flush(self, namespace: str | None = None, *, servers: Collection[str] | None = None) -> int:
        """Delete every block of a namespace (this client's when None) on every server (``servers``:
        on those only, an address or several, as this client was given them; others are refused).
        When a server fails, the error raised (the first's) carries ``.result``, ``{address:
        blocks deleted}`` of the servers flushed, and ``.errors``, ``{address: error}``: a flush
        can be sent again where it failed."""
        ns = self.namespace if namespace is None else _namespace(namespace)  # ("" would mean the own one)
        nodes = self.nodes
        if servers is not None:
            wanted = {servers} if isinstance(servers, str) else _addresses(servers)  # (one address, as addr= takes it)
            unknown = wanted - {n.addr for n in nodes}
            if unknown:  # (a typo, or another spelling of a server, would flush nothing and say 0)
                raise InvalidRequest(f"servers: not addresses of this client: {sorted(unknown)} (it has "
                                     f"{[n.addr for n in nodes]})")
            nodes = [n for n in nodes if n.addr in wanted]
        resps = await asyncio.gather(*(n.call(Flush(namespace=ns), idempotent=True) for n in nodes),
                                     return_exceptions=True)
        errors = {n.addr: r for n, r in zip(nodes, resps) if isinstance(r, BaseException)}
        counts = {n.addr: replies.count(r.fields, "n") for n, r in zip(nodes, resps) if not isinstance(r, BaseException)}
        if errors:
            first = next(iter(errors.values()))
            if isinstance(first, KVStoreError):
                first.result, first.errors = counts, errors  # type: ignore[attr-defined]
            raise first
        return sum(counts.values())

    async def stats(self) -> dict[str, Any]:
        """The server's statistics; with several servers, ``{"servers": {addr: stats}}``, and
        ``"errors": {addr: message}`` for those that failed (it raises only when none answered:
        a dashboard of four servers should show the three that are up)."""
        async def one(node: Node) -> dict[str, Any]:
            st = (await node.call(Stats())).fields.get("stats")
            if not isinstance(st, dict):
                raise ProtocolError(f"malformed STATS reply from {node.addr}")
            return st

        if len(self.nodes) == 1:
            return await one(self.nodes[0])
        results = await asyncio.gather(*(one(n) for n in self.nodes), return_exceptions=True)
        failed = {n.addr: r for n, r in zip(self.nodes, results) if isinstance(r, BaseException)}
        for r in failed.values():
            if not isinstance(r, KVStoreError) or len(failed) == len(self.nodes):  # (a cancel, a bug; or none answered)
                raise r
        out: dict[str, Any] = {"servers": {n.addr: r for n, r in zip(self.nodes, results) if n.addr not in failed}}
        if failed:
            out["errors"] = {addr: f"{type(r).__name__}: {r}" for addr, r in failed.items()}
        return out

    async def ping(self) -> float:
        """Round-trip time in seconds (the slowest server's, when several)."""

        async def one(node: Node) -> float:
            t0 = time.perf_counter()  # (not loop.time(): uvloop's moves in whole milliseconds)
            await node.call(Ping())
            return time.perf_counter() - t0

        if len(self.nodes) == 1:  # (a gather's task would add its loop turns, ~50 us here, to the time)
            return await one(self.nodes[0])
        return max(await asyncio.gather(*(one(n) for n in self.nodes)))

    async def _count(self, keys: list[bytes], make: Callable[[list[bytes]], Message], idempotent: bool = True,
                     always: bool = False) -> int:
        async def one(node: Node, idx: Sequence[int]) -> int:
            await node.ready(idempotent, always)
            n = 0
            for run in node.key_runs(len(idx)):
                resp = await node.call(make(_pick(keys, idx[run.start:run.stop])), idempotent=idempotent,
                                       always=always)
                n += replies.count(resp.fields, "n")
            return n

        return sum(n for _, n in await self._per_node(keys, one)) if keys else 0


#: Which of a batch's errors names the exception raised: the caller's own mistake first, then a
#: corrupt block, then a server's refusal, then a server that could not be reached.
_RAISE_FIRST = (BlockSizeError, IntegrityError, ServerError)


def _flag(name: str, value: object) -> bool:
    """A flag the server takes only as true or false: 1, 0 and numpy bools mean what they say, but
    ``pin="false"`` would be true -- refused, as the constructor refuses ``verify="no"``."""
    try:
        if value in (True, False):
            return bool(value)
    except (ValueError, RuntimeError, TypeError):  # (an array or tensor: no single truth)
        pass
    raise InvalidRequest(f"{name} must be True or False, got {value!r:.40}")


def _addresses(servers: Any) -> set[str]:
    """``flush(servers=...)``: addresses as strings, in any collection."""
    try:
        wanted = set(servers)
    except TypeError:
        raise InvalidRequest(f"servers must be an address or a collection of them, not {type(servers).__name__}") from None
    if not all(isinstance(a, str) for a in wanted):
        raise InvalidRequest(f"servers must be address strings, got {sorted(map(repr, wanted))}")
    return wanted


def _failed_whole(outcome: list[tuple[int, str | None] | KVStoreError]) -> KVStoreError | None:
    """The error of a put's part that failed whole, if one did (per-key statuses are tuples)."""
    return next((item for item in outcome if isinstance(item, KVStoreError)), None)


def _raise_partial(errors: dict[int, KVStoreError], n: int, what: str, result: Any) -> NoReturn:
    """Raise for a batch that partly failed; ``.result`` holds the per-key outcome, ``.errors``
    each failed key's error. An error raised for every failed key at once (a server's share that
    failed whole, so it has a traceback; per-key statuses have none) is raised itself, with its
    own message, traceback and code."""
    def rank(i: int) -> tuple[int, int]:
        return next((r for r, t in enumerate(_RAISE_FIRST) if isinstance(errors[i], t)), len(_RAISE_FIRST)), i

    first = errors[min(errors, key=rank)]
    if first.__traceback__ is not None and all(e is first for e in errors.values()):
        exc = first
    else:
        exc = type(first)(f"{len(errors)} of {n} blocks {what}: {first}")
        exc.__cause__ = first
        if isinstance(first, ServerError):
            exc.code = first.code  # type: ignore[attr-defined]
    exc.result = result  # type: ignore[attr-defined]
    exc.errors = errors  # type: ignore[attr-defined]
    raise exc


def _the_callers(error: BaseException) -> bool:
    """An error of connect() that is the caller's to fix (a token or request refused, a TLS
    handshake refused: a certificate, or no TLS there), or no server's at all (a cancel)."""
    if isinstance(error, (Unauthorized, InvalidRequest)) or not isinstance(error, KVStoreError):
        return True
    cause = error.__cause__
    while cause is not None:  # (the TLS error, chained under the TransportError, perhaps under a copy of it)
        if isinstance(cause, ssl.SSLError) and not isinstance(cause, (ssl.SSLEOFError, ssl.SSLZeroReturnError)):
            return True
        cause = cause.__cause__
    return False


def _once(fn: Callable[[], None]) -> Callable[[], None]:
    """``fn``, run the first time only: a share's leases are given back once, whichever path finds it."""
    done = False

    def once() -> None:
        nonlocal done
        if not done:
            done = True
            fn()
    return once


def _pick(items: Sequence[T], idx: Sequence[int]) -> list[T]:
    """``items`` at ``idx`` (ascending, as the groups hold them); the list itself,
    not a copy, when ``idx`` is all of it: one server, the usual case."""
    if len(idx) == len(items) and isinstance(items, list):
        return items
    return [items[i] for i in idx]


def _listed(items: Any, what: str) -> list[Any]:
    """``items`` as a list: an argument that is no collection at all (e.g. None) is an InvalidRequest too,
    and so is one key or block passed alone (bytes would be taken apart into ints)."""
    if isinstance(items, (bytes, bytearray, str)) or (isinstance(items, memoryview) and items.ndim <= 1):
        raise InvalidRequest(f"{what} must be a sequence of them, not one {type(items).__name__} "
                             f"(for one, pass [{what[:-1]}])")
    try:
        return list(items)
    except (TypeError, NotImplementedError):  # (NotImplementedError: a memoryview of 2 dimensions or more)
        raise InvalidRequest(f"{what} must be a sequence, not {type(items).__name__}") from None


def _refuse_overlaps(views: Sequence[memoryview]) -> None:
    """Two destinations sharing memory would receive two blocks at once (a large read is split
    over connections): the buffer would hold neither, each checksum passing on its own bytes."""
    if len(views) < 2:
        return
    spans = sorted((ctypes.addressof(ctypes.c_char.from_buffer(v)), v.nbytes, i)
                   for i, v in enumerate(views) if v.nbytes)
    for (start, size, i), (nxt, _, j) in zip(spans, spans[1:]):
        if start + size > nxt:
            raise InvalidRequest(f"buffers {min(i, j)} and {max(i, j)} share memory: each block needs its own")


def _namespace(value: Any) -> str:
    """A namespace as the server takes it in HELLO: checked here, not at the first call (or, for
    ``flush``, not taken as the own one, which an empty name means on the wire)."""
    if not isinstance(value, str) or not 1 <= len(value) <= MAX_NAMESPACE:
        shown = repr(value)
        raise InvalidRequest(f"a namespace is a string of 1..{MAX_NAMESPACE} characters, got "
                             f"{shown if len(shown) <= 60 else shown[:50] + '...'}")
    try:
        value.encode()
    except UnicodeEncodeError:  # (a lone surrogate, as from a file name's undecodable bytes)
        raise InvalidRequest(f"a namespace is UTF-8 text, got {value!r}") from None
    return value


def _seconds(name: str, value: Any, zero: bool = False) -> float | None:
    """A setting in seconds: a number > 0 (>= 0 with ``zero``), or None (no limit)."""
    if value is None and not zero:
        return None
    # (the comparison refuses NaN too)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (value >= 0 if zero else value > 0):
        raise InvalidRequest(f"{name} must be a number of seconds {'>= 0' if zero else '> 0 or None'}, got {value!r}")
    return value


def _checked_keys(keys: Sequence[bytes]) -> list[bytes]:
    out = _listed(keys, "keys")
    try:
        check_keys(out)
    except InvalidRequest:  # bytes-like keys are accepted and sent as bytes; anything else fails again
        out = [bytes(k) if isinstance(k, (bytearray, memoryview)) else k for k in out]
        check_keys(out)
    return out


def _ssl_context(tls: ssl.SSLContext | bool | str | None) -> ssl.SSLContext | None:
    if tls is None or tls is False:
        return None
    if isinstance(tls, ssl.SSLContext):
        return tls
    if tls is True:
        return ssl.create_default_context()
    try:
        return ssl.create_default_context(cafile=tls)
    except (OSError, ssl.SSLError, TypeError) as exc:  # (FileNotFoundError names no file; TypeError: not a path)
        raise InvalidRequest(f"tls={tls!r}: cannot load it as a CA file ({getattr(exc, 'strerror', None) or exc})") from None


__all__ = ["AsyncKVClient", "PutResult"]
