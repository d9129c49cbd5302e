"""What each request does, apart from how its bytes travel.

The connection (:mod:`kvstore.server.connection`) parses frames and moves
payload bytes; this module turns a parsed request into store operations and a
reply. In memory every operation completes synchronously, in the callback that
parsed the frame -- no task per request. A backing tier can make some of them
asynchronous later (a handler may then return an awaitable).
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Awaitable, Union

import xxhash

from kvstore import __version__
from kvstore.config import ServerConfig
from kvstore.errors import (
    CapacityError, InvalidRequest, KVStoreError, ServerError, TooLarge, Unauthorized, Unavailable, code_of,
    from_code,
)
from kvstore.protocol import EXISTED, STORED, Delete, Exists, Flush, Get, Hello, Lookup, Ping, Put, Stats, Unpin, VERSION
from kvstore.messages import OP_NAMES, REQUESTS
from kvstore.store import BlockRef, BlockStore, Keep, Reservation
from kvstore.throttle import ThrottledLog

from .auth import Grant, TokenTable
from .latency import LatencyHistograms
from .poll import BusyPoll
from .tier import Tier, TierBlock

if TYPE_CHECKING:
    from .shm import ShmSession

log = logging.getLogger(__name__)

#: Namespaces a STATS reply lists, the largest first (all of them are on /metrics).
STATS_NAMESPACES = 1000

Fields = dict[str, Any]
MaybeAsync = Union[Fields, Awaitable[Fields]]
#: (namespace, key) -> the outcome of the tier write of a block already in memory: None, or its error.
TierWrites = dict[tuple[str, bytes], "asyncio.Future[Unavailable | None]"]
#: Bytes of per-key error texts one PUT-style reply carries (16,384 keys refused with a 341-byte
#: CapacityError each were 5.7 MiB of meta, over the 4 MiB a client reads: a ProtocolError, and
#: the outcome of every key lost). A key's text is left out where the client can tell it: the
#: same as the last one sent for its status (it repeats that one). Past the budget a text is
#: left out too, unless it is the first of its status: its key gets the last one sent for it.
ERROR_TEXT_BUDGET = 256 << 10

#: Write-behind: checks in the tier of blocks put again (see ``PutSink.commit``) running at once;
#: past it a put's check is skipped (the next put of those blocks checks them).
MAX_TIER_CHECKS = 8


@dataclass
class Session:
    """Per-connection state the service needs."""

    namespace: str = "default"
    peer: str = ""
    connected: bool = False  # its transport came up (with TLS: the handshake succeeded)
    authenticated: bool = True
    grant: Grant | None = None  # the namespaces its token may use (None: no auth configured)
    unix: bool = False  # came in over the Unix socket (a same-host peer: may map the arena)
    greeted: bool = False  # a HELLO succeeded on this connection
    refused: bool = False  # a refusal was counted (one per connection: it closes after it)
    shm: ShmSession | None = None  # its open shared-memory handles (kvstore.server.shm)


@dataclass
class Counters:
    requests: dict[str, int] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)
    bytes_in: int = 0
    bytes_out: int = 0
    connections: int = 0
    connections_total: int = 0
    connections_rejected: int = 0  # over --max-connections
    tls_handshake_failures: int = 0  # TLS connections that never came up (refused, or past the timeout)
    auth_failures: int = 0
    timeouts: dict[str, int] = field(default_factory=lambda: {"idle": 0, "frame": 0, "reply": 0, "auth": 0})
    latency: LatencyHistograms = field(default_factory=LatencyHistograms)
    #: Blocks PUTs (and shm commits) answered as not stored, by error (the PUT itself is answered,
    #: not an error reply: these never show in ``errors``).
    put_failed_blocks: dict[str, int] = field(default_factory=dict)

    def count(self, op: str, failed: bool = False) -> None:
        self.requests[op] = self.requests.get(op, 0) + 1
        if failed:
            self.errors[op] = self.errors.get(op, 0) + 1


#: After a Redis restart every put of a block memory still holds writes it again: one line per put would
#: flood the log at the request rate.
_again_log = ThrottledLog(log)
#: Refused HELLOs and requests: a line a second of each kind at most, with a count of those held
#: back (a flood of bad peers wrote ~2,500 lines in 4 s); each is counted in auth_failures.
_refusal_log = ThrottledLog(log, seconds=1.0)


def _written_again(n: int, ns: str) -> None:
    _again_log.info("wrote %d block(s) of namespace %r to the tier again: put again, in memory, missing there "
                    "(a Redis restarted without persistence, a key expired or evicted)", n, ns)


class PutSink:
    """Receives a PUT's blocks straight into store reservations, one block at a time.

    A block whose key is already stored (dedup) or that does not fit is
    dropped as it arrives; its per-key status says why. A stored one stays
    pinned until the commit, so that the batch's later blocks cannot evict
    what the reply will call "existed". Empty blocks are reserved at the
    commit: a frame that never arrives whole costs no page for them.
    """

    def __init__(self, store: BlockStore, ns: str, msg: Put, tier: Tier | None = None,
                 tier_writes: TierWrites | None = None, failed_blocks: dict[str, int] | None = None,
                 tier_checks: set[asyncio.Task[None]] | None = None) -> None:
        self.store, self.ns, self.msg, self.tier = store, ns, msg, tier
        self.tier_writes: TierWrites = {} if tier_writes is None else tier_writes
        self.tier_checks: set[asyncio.Task[None]] = set() if tier_checks is None else tier_checks
        self.failed_blocks = failed_blocks  # counted into at the end (Counters.put_failed_blocks)
        self.sizes = msg.sizes
        self.status: list[int] = [STORED] * len(msg.keys)
        self.errors: dict[int, str] = {}
        self.reservations: list[Reservation | None] = [None] * len(msg.keys)
        self.existing: dict[int, BlockRef] = {}  # pinned until the commit (write-through: its tier check)
        self.twins: dict[int, int] = {}  # a key's second copy in the batch -> its first
        self.waits: dict[int, asyncio.Future[Unavailable | None]] = {}  # found in memory while its tier write ran
        self.empty: list[int] = []  # reserved at the commit
        # The stored chain the next block continues (kvstore.store.Keep): the PUT's parent, then the last
        # block found stored or refused -- but a stranded one after a block that will be reachable (a new
        # one, filling a gap; the kept chain), which the commit joins to it. None with a tier: it holds
        # what memory evicts.
        self.keep = None if msg.parent is None or tier is not None else Keep(ns, msg.parent)
        self.filling = False  # a block was reserved since self.keep was set

    def target(self, i: int) -> list[memoryview] | None:
        if not self.sizes[i]:
            self.empty.append(i)
            return None
        res = self.reserve(i)
        return None if res is None else res.views

    def reserve(self, i: int, in_order: bool = True) -> Reservation | None:
        """Reserve block ``i`` (None: dropped; its status says why). ``in_order``: the batch's
        blocks before it were reserved before it (they name the chain it continues)."""
        res = self._reserve(i, self.keep if in_order else None)
        if not in_order or self.tier is not None:
            return res
        key = self.msg.keys[i]
        if res is not None:
            self.filling = True
        elif (self.status[i] != EXISTED or self.store.reachable(self.ns, key)
              or not (self.filling or (self.keep is not None and self.store.reachable(self.ns, self.keep.parent)))):
            self.keep, self.filling = Keep(self.ns, key), False  # what the next block continues
        # (else: stored but stranded after a block that will be reachable; the commit joins it to that)
        return res

    def _reserve(self, i: int, keep: Keep | None) -> Reservation | None:
        checksum = self.msg.checksums[i] if self.msg.checksums else 0
        limit = self.tier.max_block if self.tier is not None else None
        try:
            if limit is not None and self.sizes[i] > limit:  # acknowledged, it could never reach the tier
                raise TooLarge(f"a block of {self.sizes[i]} bytes is over the {limit} the backing tier takes")
            refusal = self.tier.refusal() if self.tier is not None else None
            if refusal is not None:  # (a key in memory too: it may not be in Redis, see commit)
                self.store.check_size(self.sizes[i])  # (a block that can never be stored says so first)
                raise refusal  # (reserving would evict blocks of memory for a block then dropped)
            res = self.store.reserve(self.ns, self.msg.keys[i], self.sizes[i], checksum, keep=keep)
        except (CapacityError, TooLarge, InvalidRequest, Unavailable) as exc:
            self.status[i] = exc.code
            self.errors[i] = str(exc)
            return None
        if res is None:
            self.status[i] = EXISTED
            ref = self.store.acquire(self.ns, self.msg.keys[i])
            if ref is not None:
                self.existing[i] = ref
            fut = self.tier_writes.get((self.ns, self.msg.keys[i]))
            if fut is not None:  # (noted now: that write may fail, and end, before this put's commit)
                self.waits[i] = fut
            return None
        self.reservations[i] = res
        return res

    def commit(self) -> MaybeAsync:
        """Make the received blocks visible; with a tier, also hand them to it.

        A block that "existed" only because another PUT's tier write of it is
        still running is not acknowledged yet: that write may fail, and then
        the block leaves memory again. Such keys wait for that write's outcome.

        The other "existed" blocks are checked in the tier (it may have lost
        them: a Redis restarted without persistence, a key expired or evicted)
        and written to it again if missing, their expiry renewed if not:
        before the answer in write-through, after it in write-behind.
        """
        keys = self.msg.keys
        for i in self.empty:
            self.reserve(i, in_order=False)
        self.empty = []
        first: dict[bytes, int] = {}  # key -> the batch's index that stored it
        for i, res in enumerate(self.reservations):
            if res is not None:  # (with a tier, counted stored once it has them: it may refuse)
                stored = self.store.commit(res, parent=keys[i - 1] if i else self.msg.parent, counted=self.tier is None)
                if stored:
                    first.setdefault(keys[i], i)
                else:  # another put committed it first: judged like a block found in memory
                    self.status[i] = EXISTED
                    if (ref := self.store.acquire(self.ns, keys[i])) is not None:
                        self.existing[i] = ref
        self.reservations = []
        self.store.join(self.ns, keys, self.msg.parent)  # (a batch that filled a gap: what follows it is reachable)
        # The same key again in the batch shares the outcome of the copy that stored it.
        self.twins = {i: first[k] for i, k in enumerate(keys) if self.status[i] == EXISTED and first.get(k, i) != i}
        existing, self.existing = self.existing, {}
        if self.tier is None:
            self.store.release_many(existing.values())
            return self._answer()
        stored_idx = [i for i, st in enumerate(self.status) if st == STORED]
        others, recheck = self._judge_existed(existing)
        if recheck and not self.tier.write_through:
            self._check_later(recheck)
            recheck = {}
        if not stored_idx and not others and not recheck:
            return self._answer()
        mine: asyncio.Future[Unavailable | None] = asyncio.get_running_loop().create_future()
        for i in stored_idx:  # registered now, before any await: a PUT parsed next must find it
            self.tier_writes[(self.ns, keys[i])] = mine
        # Pinned now, as they become visible: before the tier write's first step, other connections'
        # puts could evict them, and a block gone from memory was left out of the write, acknowledged.
        refs = self.store.acquire_many(self.ns, [keys[i] for i in stored_idx])
        return self._store_in_tier(stored_idx, refs, mine, others, recheck)

    def _judge_existed(self, existing: dict[int, BlockRef]) -> tuple[dict[int, asyncio.Future[Unavailable | None]],
                                                                     dict[int, BlockRef]]:
        """The "existed" keys (a batch's later copies aside) that wait for another put's tier write
        still running, and those to check in the tier, pinned by the returned
        refs; the other pins of ``existing`` are released. A key whose write failed and that left
        memory with it fails now."""
        keys = self.msg.keys
        others: dict[int, asyncio.Future[Unavailable | None]] = {}
        for i, st in enumerate(self.status):
            if st != EXISTED or i in self.twins:
                continue
            fut = self.tier_writes.get((self.ns, keys[i])) or self.waits.get(i)  # (running now, or when found)
            if fut is None:
                continue
            if not fut.done():
                others[i] = fut
            elif (error := fut.result()) is not None and not self.store.exists(self.ns, [keys[i]])[0]:
                self.status[i], self.errors[i] = error.code, str(error)  # its write failed: gone with it
            # (else it ended, and the block is in memory: judged as any found there, below)
        for i, ref in list(existing.items()):  # (left memory since it was found: stored again since?)
            if ref.gone:
                self.store.release(ref)
                fresh = self.store.acquire(self.ns, keys[i])
                if fresh is None:
                    del existing[i]
                else:
                    existing[i] = fresh
        # An "existed" block is acknowledged as in Redis (write-behind: on its way); check that it still
        # is (a Redis restarted without persistence, a key expired or evicted there), pinned meanwhile.
        recheck = {i: ref for i, ref in existing.items()
                   if self.status[i] == EXISTED and i not in others and i not in self.twins}
        self.store.release_many(ref for i, ref in existing.items() if i not in recheck)
        return others, recheck

    async def _store_in_tier(self, idx: list[int], refs: list[BlockRef | None], mine: asyncio.Future[Unavailable | None],
                             others: dict[int, asyncio.Future[Unavailable | None]],
                             recheck: dict[int, BlockRef]) -> Fields:
        keys = [self.msg.keys[i] for i in idx]
        failure: Unavailable | None = Unavailable("the tier write of this block did not finish")
        check = asyncio.ensure_future(self._missing_in_tier(recheck)) if recheck else None  # (beside the write)
        try:
            failure = await self._write_to_tier(idx, refs) if idx else None
            if check is not None:
                await self._write_again(await check)
        finally:  # (anything else raised, or cancelled: the PUTs waiting on it fail too)
            if check is not None:
                check.cancel()
            self.store.release_many([ref for ref in refs if ref is not None])
            self.store.release_many(recheck.values())
            mine.set_result(failure)
            for k in keys:
                if self.tier_writes.get((self.ns, k)) is mine:
                    del self.tier_writes[(self.ns, k)]
        if others:
            await asyncio.wait(set(others.values()))  # (wait() never cancels the futures it waits on)
        for i, fut in others.items():
            error = fut.result()
            if error is not None:  # gone from memory again: the client must store it again
                self.status[i] = error.code
                self.errors[i] = str(error)
        for i, j in self.twins.items():
            if self.status[j] in (STORED, EXISTED):
                self.status[i] = EXISTED
                self.errors.pop(i, None)
            else:  # (its first copy's tier write failed: it is gone too)
                self.status[i], self.errors[i] = self.status[j], self.errors[j]
        return self._answer()

    def _answer(self) -> Fields:
        """The reply's fields, once final: its failed blocks counted."""
        if self.failed_blocks is not None:
            for st in self.status:
                if st not in (STORED, EXISTED):
                    name = type(from_code(st, "")).__name__
                    self.failed_blocks[name] = self.failed_blocks.get(name, 0) + 1
        return self.fields()

    async def _missing_in_tier(self, recheck: dict[int, BlockRef]) -> dict[int, BlockRef]:
        """Of the "existed" blocks ``recheck``, those the tier lacks (all, if it cannot say)."""
        assert self.tier is not None
        try:
            present = await self.tier.exists(self.ns, [self.msg.keys[i] for i in recheck], strict=True, renew=True)
        except Unavailable:
            return recheck
        return {i: ref for (i, ref), p in zip(recheck.items(), present) if not p}

    def _check_later(self, recheck: dict[int, BlockRef]) -> None:
        """Write-behind: check ``recheck`` in the tier after the answer, in a task of the service's
        (``Service.tier_checks``, awaited before the tier's last flush); skipped while
        :data:`MAX_TIER_CHECKS` run (the pins are then let go at once)."""
        if len(self.tier_checks) >= MAX_TIER_CHECKS:
            self.store.release_many(recheck.values())
            return

        def done(task: asyncio.Task[None]) -> None:  # (also for a task cancelled before its first step)
            self.tier_checks.discard(task)
            self.store.release_many(recheck.values())

        task = asyncio.ensure_future(self._check_now(recheck))
        self.tier_checks.add(task)
        task.add_done_callback(done)

    async def _check_now(self, recheck: dict[int, BlockRef]) -> None:
        """Check ``recheck`` (pinned until the task ends) in the tier; queue again those it lacks."""
        assert self.tier is not None
        try:
            present = await self.tier.exists(self.ns, [self.msg.keys[i] for i in recheck], strict=True, renew=True)
        except Unavailable:  # (cannot say now: the next put of these blocks asks again)
            return
        except Exception:  # (a bug: said, not left to "Task exception was never retrieved")
            log.exception("the check in the tier of %d block(s) put again failed", len(recheck))
            return
        limit = self.tier.max_block  # (a block over it was queued before Redis said its limit: dropped once)
        again = {i: ref for (i, ref), p in zip(recheck.items(), present)
                 if not p and not ref.gone and (limit is None or ref.size <= limit)}
        if not again:
            return
        try:  # (queued: the copy and its place in the order are taken before the first await)
            await self.tier.store(self.ns, [TierBlock(self.msg.keys[i], ref.views, ref.checksum, ref.size)
                                            for i, ref in again.items()])
        except Exception as exc:
            log.warning("could not queue %d block(s) of namespace %r missing from the tier: %s",
                        len(again), self.ns, exc)
            return
        _written_again(len(again), self.ns)

    async def _write_again(self, again: dict[int, BlockRef]) -> None:
        """Write "existed" blocks the tier lacks to it from memory; on failure fail those keys (they
        stay in memory: a retry checks them again). A block deleted since is not written."""
        again = {i: ref for i, ref in again.items() if not ref.gone}
        if not again:
            return
        assert self.tier is not None
        try:
            await self.tier.store(self.ns, [TierBlock(self.msg.keys[i], ref.views, ref.checksum, ref.size)
                                            for i, ref in again.items()])
        except Exception as exc:
            failure = self._tier_failure(exc, len(again))
            for i in again:
                self.status[i], self.errors[i] = failure.code, str(failure)
            return
        # (A delete that ran during the write may have reached Redis before it: the block is then
        # there as if this put, answered after that delete, came after it. Deleting it again here
        # could remove a third put's copy, acknowledged.)
        _written_again(len(again), self.ns)

    def _tier_failure(self, exc: Exception, n: int) -> Unavailable:
        if isinstance(exc, Unavailable):
            return exc
        log.exception("the backing tier failed to store %d block(s)", n)  # a bug in the tier
        return Unavailable(f"the backing tier failed to store the blocks ({type(exc).__name__}: {exc})")

    async def _write_to_tier(self, idx: list[int], refs: list[BlockRef | None]) -> Unavailable | None:
        """Hand the blocks ``idx`` (pinned by ``refs`` since their commit) to the tier; on failure
        drop them from memory and return the error."""
        try:
            if not all(refs):  # (cannot happen: committed and pinned in one step)
                raise Unavailable("a block left memory before it could be written to the tier")
            # A block deleted since its commit (a DELETE read in the same turn) is not written: the
            # tier orders puts against deletes from the moment it is called, which is now.
            blocks = [TierBlock(self.msg.keys[i], ref.views, ref.checksum, ref.size)
                      for i, ref in zip(idx, refs) if ref is not None and not ref.gone]
            assert self.tier is not None
            if blocks:
                await self.tier.store(self.ns, blocks)
            self.store.count_stored(len(idx))
        except Exception as exc:  # (a bug in the tier too: these blocks must not stay acknowledged-less)
            failure = self._tier_failure(exc, len(idx))
            # Not acknowledged, so not kept: a retry must store it again rather than find it "existed".
            # (Only this put's blocks: one deleted meanwhile may have been stored again by another.)
            self.store.delete(self.ns, [self.msg.keys[i] for i, ref in zip(idx, refs) if ref is not None and not ref.gone])
            for i in idx:
                self.status[i] = failure.code
                self.errors[i] = str(failure)
            return failure
        return None

    def fields(self) -> Fields:
        """The per-key statuses (and error messages) as they stand."""
        fields: Fields = {"status": self.status}
        if self.errors:
            texts: dict[str, str] = {}
            last: dict[int, str] = {}  # per status, the last text sent
            left = ERROR_TEXT_BUDGET
            for i in sorted(self.errors):  # (key order: a key without one takes an earlier key's)
                text, code = self.errors[i], self.status[i]
                if last.get(code) == text or (code in last and len(text) > left):
                    continue
                left -= len(text)
                last[code] = texts[str(i)] = text
            fields["errors"] = texts
        return fields

    def abort(self) -> None:
        """The connection died mid-payload: nothing of this PUT becomes visible."""
        for res in self.reservations:
            if res is not None:
                self.store.abort(res)
        self.reservations = []
        self._release_existing()

    def _release_existing(self) -> None:
        existing, self.existing = self.existing, {}
        self.store.release_many(existing.values())
        self.reservations = []


@dataclass
class GetResult:
    """Per key: the block's views (``None`` when missing), its size (-1 when missing)
    and checksum; and the pins to release once sent."""

    blocks: list[list[memoryview] | None]
    checksums: list[int]
    refs: list[BlockRef]
    sizes: list[int] = field(default_factory=list)

    @property
    def fields(self) -> Fields:
        return {"sizes": self.sizes, "checksums": self.checksums}

    @property
    def payload(self) -> list[memoryview]:
        return [v for b in self.blocks if b is not None for v in b]

    @property
    def payload_len(self) -> int | None:
        """The payload's bytes (None: let the encoder count them): every block sized is sent."""
        sizes = self.sizes
        return sum(sizes) + sizes.count(-1)  # (each missing block counted -1, added back)


class Service:
    """The request logic over a :class:`BlockStore`."""

    def __init__(self, store: BlockStore, config: ServerConfig, tier: Tier | None = None,
                 auth: TokenTable | None = None) -> None:
        """``auth``: the tokens clients must present (the server loads ``--token-file``); None: no auth."""
        config.check()
        self.store = store
        self.config = config
        self.tier = tier
        self.counters = Counters()
        self.max_connections = config.max_connections  # the server's cap once fitted to the open-file limit
        self.started = time.time()
        self.auth = auth
        self.max_reply = config.limits().max_payload  # a bigger GET reply is refused by the client's codec
        # Announced in HELLO: clients split bigger batches into requests within them.
        self.hello_limits = {"max_payload": config.max_frame_size, "max_batch": config.max_batch}
        self.tier_writes: TierWrites = {}  # blocks in memory whose tier write is still running
        self.tier_checks: set[asyncio.Task[None]] = set()  # write-behind: blocks put again, checked in the tier
        # Tier deletes (and flushes) started and finished: a read-through that overlapped one must not
        # promote what it read, or the deleted block would come back into memory.
        self.deletes_started = self.deletes_finished = 0
        from .shm import ShmService  # imported here: shm builds on this module's PutSink and GetResult

        self.shm = ShmService(self)
        # Busy polling (server/poll.py): kicked by the connections, reported in STATS.
        self.poll = BusyPoll(config.busy_poll_us / 1e6) if config.busy_poll_us else None

    # -- session set-up
    def new_session(self) -> Session:
        """A connection's session: unauthenticated until HELLO when tokens are required."""
        return Session(authenticated=self.auth is None)

    def authorize(self, session: Session, msg: Hello) -> None:
        """Check HELLO's token against the token file (no-op without one).

        Raises:
            Unauthorized: no or a wrong token, or one not granted this namespace;
            the connection answers and then closes.
        """
        if self.auth is None:
            return
        grant = self.auth.authenticate(msg.token)
        if grant is None or not grant.allows(msg.namespace):
            session.authenticated, session.refused = False, True
            self.counters.auth_failures += 1
            _refusal_log.warning("refused HELLO from %s for namespace %r: %s", session.peer, msg.namespace,
                        "no token" if not msg.token else "wrong token" if grant is None else "namespace not granted",
                        extra={"event": "auth_failed", "peer": session.peer, "namespace": msg.namespace})
            raise Unauthorized("token missing or wrong" if grant is None else
                               f"token not valid for namespace {msg.namespace!r}")
        session.authenticated, session.grant = True, grant

    def hello(self, session: Session, msg: Hello) -> dict[str, Any]:
        if msg.version != VERSION:
            raise InvalidRequest(f"protocol version {msg.version} is not supported (server speaks {VERSION})")
        self.authorize(session, msg)
        session.namespace = msg.namespace
        session.greeted = True
        return {"version": VERSION, "server": f"kvstore/{__version__}", "namespace": msg.namespace,
                "limits": self.hello_limits, **self.shm.hello_fields(session)}

    def check_allowed(self, session: Session, op: int) -> None:
        """Before HELLO only HELLO and PING are served (checked by op: a malformed frame too).
        A request before HELLO is a refusal like a wrong token's (a probe that skips HELLO),
        logged and counted once per connection (it closes after the refusal)."""
        if not session.authenticated and op not in (Hello.OP, Ping.OP):
            if not session.refused:
                session.refused = True
                self.counters.auth_failures += 1
                what = OP_NAMES[REQUESTS[op]].upper() if op in REQUESTS else f"op {op}"
                _refusal_log.warning("refused %s from %s: no HELLO first", what, session.peer,
                            extra={"event": "auth_failed", "peer": session.peer})  # (no namespace: none was named)
            raise Unauthorized("authenticate with HELLO first")

    # -- ops: synchronous in memory; a coroutine where the tier must be asked
    def begin_put(self, session: Session, msg: Put) -> PutSink:
        return PutSink(self.store, session.namespace, msg, self.tier, self.tier_writes,
                       self.counters.put_failed_blocks, self.tier_checks)

    def lookup(self, session: Session, msg: Lookup) -> MaybeAsync:
        """A pinned lookup's lease is cut to --max-lease-seconds: leased blocks cannot be evicted,
        and a client asking for days (lease_ms goes up to 2**31) could fill the store with them."""
        lease_s = min(msg.lease_ms / 1000 if msg.lease_ms else self.config.lease_seconds,
                      self.config.lease_cap())
        n = self.store.lookup(session.namespace, msg.keys, pin=bool(msg.pin), lease_s=lease_s)
        granted = {"lease_ms": round(lease_s * 1000)} if msg.pin else {}
        if self.tier is None or n == len(msg.keys):
            return {"n": n, **granted}
        return self._lookup_tier(session.namespace, msg.keys, n, granted)

    async def _lookup_tier(self, ns: str, keys: list[bytes], n: int, granted: Fields) -> Fields:
        """Extend the in-memory prefix with what the tier holds (its blocks come in on GET)."""
        assert self.tier is not None
        try:
            present = await self.tier.exists(ns, keys[n:], max_size=self.max_reply)  # (GET could not send more)
        except Unavailable:
            return {"n": n, **granted}  # degraded: memory's answer is still a correct lower bound
        for p in present:
            if not p:
                break
            n += 1
        return {"n": n, **granted}

    def get(self, session: Session, msg: Get) -> GetResult | Awaitable[GetResult]:
        """Pins every block it returns; the caller releases them once written.

        Raises:
            TooLarge: the blocks found add up to more than one reply may carry (pins released).
        """
        ns = session.namespace
        res = GetResult([], [], [])
        for ref in self.store.acquire_many(ns, msg.keys):
            if ref is None:
                res.blocks.append(None)
                res.sizes.append(-1)
                res.checksums.append(0)
            else:
                res.blocks.append(ref.views)
                res.sizes.append(ref.size)
                res.checksums.append(ref.checksum)
                res.refs.append(ref)
        self.check_reply_size(res)
        missing = [i for i, b in enumerate(res.blocks) if b is None]
        if self.tier is None or not missing:
            if msg.unpin:
                self.store.unpin(ns, msg.keys)
            return res
        # The leases to drop: of the blocks found now, if still stored when the tier has answered
        # (a key missing now, or deleted meanwhile, may hold another client's block and lease then).
        return self._get_tier(ns, msg.keys, res, missing, list(res.refs) if msg.unpin else [])

    def check_reply_size(self, res: GetResult) -> None:
        """Refuse a reply over the payload limit: the client's codec would drop the connection on it.

        Raises:
            TooLarge: after releasing ``res.refs``.
        """
        total = res.payload_len
        if total is not None and total > self.max_reply:
            blocks = sum(b is not None for b in res.blocks)  # (read through from a tier: no refs)
            self.store.release_many(res.refs)
            res.refs = []
            raise TooLarge(over_reply_limit(total, blocks, self.max_reply))

    def read_token(self) -> int | None:
        """Taken before a read-through: None while a tier delete runs (then nothing read may be promoted)."""
        return self.deletes_started if self.deletes_started == self.deletes_finished else None

    def may_promote(self, token: int | None) -> bool:
        """True when no tier delete overlapped the read that began with ``token``."""
        return token is not None and token == self.deletes_started

    async def _get_tier(self, ns: str, keys: list[bytes], res: GetResult, missing: list[int],
                        unpin: list[BlockRef]) -> GetResult:
        """Read through: fetch memory's misses in one round trip and promote them; then drop the
        leases ``unpin`` -- once the reply is known to fit, as on the memory path (a refused GET
        keeps them: the client asks again in parts)."""
        assert self.tier is not None
        token = self.read_token()
        try:
            fetched = await self.tier.fetch(ns, [keys[i] for i in missing])
        except Unavailable:
            fetched = [None] * len(missing)  # degraded: serve what memory has
        promote = self.may_promote(token)
        for i, item in zip(missing, fetched):
            if item is None:
                continue
            data, checksum = item
            res.blocks[i] = [memoryview(data)]
            res.sizes[i] = len(data)
            res.checksums[i] = checksum
            if checksum and xxhash.xxh3_64_intdigest(data) != checksum:
                continue  # corrupted in the tier: sent as is so the client reports it, never cached in memory
            if not promote:
                continue  # a delete ran meanwhile: serve this copy, but keep no deleted block in memory
            try:
                self.store.put(ns, keys[i], data, checksum, parent=keys[i - 1] if i else None, counted=False)
            except (CapacityError, TooLarge):
                pass  # promotion is best effort; the block is served from the fetched copy
        self.check_reply_size(res)
        if unpin:
            self.store.unpin_refs(unpin)
        return res

    def release(self, refs: list[BlockRef]) -> None:
        self.store.release_many(refs)

    def exists(self, session: Session, msg: Exists) -> MaybeAsync:
        present = self.store.exists(session.namespace, msg.keys)
        if self.tier is None or all(present):
            return {"present": present}
        return self._exists_tier(session.namespace, msg.keys, present)

    async def _exists_tier(self, ns: str, keys: list[bytes], present: list[bool]) -> Fields:
        assert self.tier is not None
        missing = [i for i, p in enumerate(present) if not p]
        try:
            for i, p in zip(missing, await self.tier.exists(ns, [keys[i] for i in missing], max_size=self.max_reply)):
                present[i] = p
        except Unavailable:
            pass
        return {"present": present}

    def delete(self, session: Session, msg: Delete) -> MaybeAsync:
        n = self.store.delete(session.namespace, msg.keys)
        if self.tier is None:
            return {"n": n}
        return self._in_tier_too(n, self.tier.delete(session.namespace, msg.keys))

    def unpin(self, session: Session, msg: Unpin) -> Fields:
        return {"n": self.store.unpin(session.namespace, msg.keys)}

    def flush(self, session: Session, msg: Flush) -> MaybeAsync:
        ns = msg.namespace or session.namespace
        if session.grant is not None and not session.grant.allows(ns):
            self.counters.auth_failures += 1  # (a refusal like HELLO's: logged and counted alike)
            _refusal_log.warning("refused FLUSH from %s of namespace %r: namespace not granted", session.peer, ns,
                        extra={"event": "auth_failed", "peer": session.peer, "namespace": ns})
            raise Unauthorized(f"token not valid for namespace {ns!r}")
        n = self.store.flush(ns)
        if self.tier is None:
            return {"n": n}
        return self._in_tier_too(n, self.tier.flush(ns))

    def _in_tier_too(self, n_memory: int, tier_call: Awaitable[int]) -> Awaitable[Fields]:
        """Deletes must reach the tier (or fail), or the blocks would come back on the next miss.

        Counted from now (memory has already dropped the blocks) until the tier is done,
        so that no read-through running meanwhile promotes a block back (:meth:`may_promote`).
        """
        self.deletes_started += 1

        async def finish() -> Fields:
            try:
                return {"n": max(n_memory, await tier_call)}
            finally:
                self.deletes_finished += 1
        return finish()

    def ping(self, session: Session, msg: Ping) -> dict[str, Any]:
        return {}

    def stats(self, session: Session, msg: Stats) -> dict[str, Any]:
        """The snapshot, with only the STATS_NAMESPACES largest namespaces listed (and how many
        there are): every one of 16,000 made a reply the client's 4 MiB meta limit refused."""
        snap = self.snapshot()
        listed = snap["namespaces"]
        snap["namespaces_total"] = len(listed)
        if len(listed) > STATS_NAMESPACES:
            largest = heapq.nlargest(STATS_NAMESPACES, listed.items(), key=lambda item: item[1]["bytes"])
            snap["namespaces"] = dict(largest)
        return {"stats": snap}

    def snapshot(self) -> dict[str, Any]:
        c = self.counters
        return {
            "version": __version__,
            "uptime_s": round(time.time() - self.started, 3),
            "started": round(self.started, 6),  # (Unix time: tells a restart apart from a slow sample)
            "store": self.store.stats(),
            "namespaces": self.store.namespaces(),
            "connections": c.connections,
            "max_connections": self.max_connections,
            "connections_total": c.connections_total,
            "connections_rejected": c.connections_rejected,
            "tls_handshake_failures": c.tls_handshake_failures,
            "auth_failures": c.auth_failures,
            "timeouts": dict(c.timeouts),
            "requests": dict(c.requests),
            "errors": dict(c.errors),
            "put_failed_blocks": dict(c.put_failed_blocks),
            "bytes_in": c.bytes_in,
            "bytes_out": c.bytes_out,
            "tier": self.tier.stats() if self.tier is not None else None,
            "shm": self.shm.stats(),
            "busy_poll": {"window_us": self.config.busy_poll_us,
                          "seconds": round(self.poll.seconds, 6) if self.poll is not None else 0.0,  # idle polling
                          "turns": self.poll.turns if self.poll is not None else 0},
        }


def over_reply_limit(total: int, blocks: int, limit: int) -> str:
    """Why a read is refused whole: what to do differs for one block and for several."""
    if blocks == 1:
        return (f"a block of {total} bytes is over the reply limit of {limit} (--max-frame-size): it cannot "
                f"be read from this server in one piece")
    return (f"the {blocks} blocks asked for add up to {total} bytes, over the reply limit of {limit} "
            f"(--max-frame-size): ask for fewer at a time")


def error_fields(exc: BaseException) -> tuple[int, str]:
    """(wire code, message) for an exception raised while serving a request."""
    if isinstance(exc, (KVStoreError, ServerError)):
        return code_of(exc), str(exc) or type(exc).__name__
    return code_of(exc), f"internal error: {type(exc).__name__}"
