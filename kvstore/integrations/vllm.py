"""kvstore as the storage tier of vLLM's ``OffloadingConnector`` (vLLM 0.33).

Start vLLM with (``docs/vllm.md`` has the details)::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KVStoreConnector",
        "kv_connector_module_path": "kvstore.integrations.vllm",
        "kv_load_failure_policy": "recompute", "kv_role": "kv_both", "kv_connector_extra_config": {
            "spec_name": "KVStoreOffloadingSpec",
            "spec_module_path": "kvstore.integrations.vllm",
            "block_size": 64, "kvstore_addr": "127.0.0.1:7600"}}'

vLLM's ``OffloadingSpecFactory`` imports this module and builds
:class:`KVStoreOffloadingSpec`, whose two halves replace vLLM's CPU tier:

- Scheduler side, :class:`KVStoreOffloadingManager`: which chunks the server
  has, which to load, which to store. It keeps no index of its own -- the
  server is the index, shared by every engine that uses the same namespace.
- Worker side, :class:`KVStoreOffloadingWorker`: moves the KV bytes of GPU
  blocks to and from the server (gather/scatter by
  :class:`kvstore.engine.transfer.PagedKVTransfer`), on background threads.

:class:`KVStoreConnector` is vLLM's connector with a failed load recomputed
rather than fatal (``"kv_connector": "OffloadingConnector"`` works too).

Keys. vLLM names an offloaded chunk (``blocks_per_chunk`` GPU blocks of one
KV-cache group) by an ``OffloadKey``: the block hash of its last GPU block plus
the group index (4 bytes). Every worker (TP/PP rank) holds its own slice of a
chunk, so the store key is the ``OffloadKey`` followed by the rank (2 bytes,
big-endian); a chunk counts as present only when the keys of all ranks are.
The payload is :class:`~kvstore.engine.transfer.PagedKVTransfer`'s: a header
with a layout fingerprint, then each layer's pages of the chunk.

P/D. A request whose ``kv_transfer_params`` has ``do_remote_decode`` gets
``OffloadPolicy.REQUEST_LEVEL`` from :meth:`KVStoreOffloadingManager.on_new_request`,
so vLLM offers every chunk of it for storing, the loaded prefix included, and
:meth:`~KVStoreOffloadingManager.prepare_store` stores them all (without the
dedup against the server and the stores in flight that other requests get): when the prefill finishes,
the whole prompt is in the store for the remote decode engine, even chunks
evicted since the lookup.

Only this module imports vLLM; kvstore itself never does.
"""

from __future__ import annotations

import hashlib
import logging
import sys
import threading
import time
from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    LookupResult,
    OffloadingManager,
    OffloadingSpec,
    OffloadingWorker,
    OffloadKey,
    OffloadPolicy,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
    TransferResult,
    get_offload_group_idx,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
from vllm.v1.kv_offload.config import OffloadingConfig, OffloadingGroupConfig

from kvstore.client import KVClient, PutResult
from kvstore.client.tokens import read_token_file
from kvstore.engine.transfer import PagedKVTransfer, PayloadMismatch, unusable
from kvstore.errors import BlockSizeError, IntegrityError, KVStoreError, RequestTimeout
from kvstore.throttle import ThrottledLog

__all__ = [
    "KVStoreConnector",
    "KVStoreLoadStoreSpec",
    "KVStoreOffloadingManager",
    "KVStoreOffloadingSpec",
    "KVStoreOffloadingWorker",
    "KVStoreSettings",
    "default_namespace",
    "store_key",
]

logger = logging.getLogger(__name__)

DEFAULT_ADDR = "127.0.0.1:7600"
# The scheduler blocks on its lookups: a dead server must turn into misses
# quickly, not stall the engine for the client's default 30 s. Transfers run in
# the background and may move hundreds of MB in one request: they get longer.
DEFAULT_TIMEOUT_S = 5.0
MIN_TRANSFER_TIMEOUT_S = 30.0
# A server that stopped answering would cost the scheduler a timeout per request, step after step:
# after one, its lookups miss (and stores wait) at once for this long, doubled while it stays silent.
DEFAULT_QUARANTINE_S = 5.0
# With kvstore_flush_on_reset, a reset whose flush could not reach a server (down, quarantined)
# keeps every lookup missing and tries the flush again there after this long, doubled each time
# it fails again up to FLUSH_RETRY_MAX_S (a server whose Redis tier is down empties its memory
# at every try: what was stored there since is lost each time).
FLUSH_RETRY_S = 1.0
FLUSH_RETRY_MAX_S = 30.0
# vLLM answers a finished prefill before its stores run (they start at the next engine step): a
# decode request sent on at once would find part of the prompt and compute the rest. One marked
# do_remote_prefill waits this long for the whole chain; the scheduler asks again at every step,
# the server is asked about all the waiting requests at once, at most every PREFILL_PROBE_S.
DEFAULT_REMOTE_PREFILL_WAIT_S = 3.0
PREFILL_PROBE_S = 0.02
# Host payload buffers a worker keeps for reuse, per direction (pinned memory is
# slow to allocate on CUDA).
BUFFER_POOL_BYTES = 256 << 20
# Stores gathered off the GPU and waiting for the server (one that hangs, until its timeout): past
# this, a new store job is skipped (its chunks stay uncached) rather than hold more host memory.
MAX_STORE_BACKLOG_BYTES = 1 << 30
_MAX_NAMESPACE = 256
_RANK_BYTES = 2


def store_key(key: OffloadKey | bytes, rank: int) -> bytes:
    """The server key of one rank's slice of an offloaded chunk."""
    return bytes(key) + rank.to_bytes(_RANK_BYTES, "big")


def _runs(keys: Sequence[bytes], parents: Sequence[bytes | None]) -> list[tuple[int, int]]:
    """``[lo, hi)`` stretches of chained chunks: a stretch ends where a chunk's known
    predecessor is not the chunk before it (a store skips the chunks the server has)."""
    starts = [0] + [i for i in range(1, len(keys)) if parents[i] is not None and parents[i] != keys[i - 1]]
    return list(zip(starts, starts[1:] + [len(keys)]))


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.0f} MiB"


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# --------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class KVStoreSettings:
    """The ``kvstore_*`` entries of ``kv_connector_extra_config``.

    Attributes:
        addr: ``kvstore_addr``: ``"host:port"``, or several (a list, or one string
            separated by commas) for a client that shards over servers.
        namespace: ``kvstore_namespace``; default :func:`default_namespace`.
        token: ``kvstore_token``, or the first token line of ``kvstore_token_file`` (as
            ``kvstore-cli --token-file`` reads it).
        tls: ``kvstore_tls``: ``true`` for the system CAs, or a CA file path.
        tls_server_name: ``kvstore_tls_server_name``: the name to verify in the server's
            certificate when ``addr`` is an IP address or another name.
        timeout: ``kvstore_timeout`` in seconds, per request of the scheduler (a
            lookup that times out is a miss); the workers' transfers wait at least
            ``MIN_TRANSFER_TIMEOUT_S``. Connecting, with its retries, fits in it too.
        shm: ``kvstore_shm``: ``true`` maps a same-host server's arena also when ``addr``
            names it by ``host:port`` (the spelling every engine sharing sharded servers
            must use alike); default: only for ``unix:`` addresses.
        lease_ms: ``kvstore_lease_ms``: how long a lookup's pin protects a block
            from eviction if its load never comes; default the server's.
        flush_on_reset: ``kvstore_flush_on_reset``: make vLLM's connector cache
            reset delete the whole namespace on the server (off by default: the
            store is shared with other engines).
        remote_decode_dedup: ``kvstore_remote_decode_dedup``: for ``do_remote_decode``
            requests too, send only the chunks the server lacks, and refresh (touch)
            the ones it has instead of sending them again. Off by default: such a
            request stores every chunk, as vLLM's seed semantics say.
        remote_prefill_wait_s: ``kvstore_remote_prefill_wait_s``: how long a request whose
            ``kv_transfer_params`` has ``do_remote_prefill`` (a P/D decode request) waits for
            its prompt's chain to be whole in the store before computing what is missing
            (0: not at all).
        quarantine_s: ``kvstore_quarantine_s``: after a scheduler request to a server
            times out (or cannot connect), that server is not asked for this long (doubled
            while it stays silent, up to 8x): its lookups miss at once. 0: every request
            tries. The workers' stores too are skipped for that long after one timed out or
            could not connect (a server restarted meanwhile misses those stores);
            their loads always try (a load that fails stops vLLM unless through :class:`KVStoreConnector`).
        switch_interval_ms: ``kvstore_switch_interval_ms``: set Python's thread switch
            interval (``sys.setswitchinterval``, 5 ms by default) in the processes that load the
            spec. A client call hands over between the caller's thread and the client's
            event-loop thread, and each wake-up needs the interpreter lock; while another thread
            runs Python without pause, a waking thread gets it once per interval
            (``python -m kvstore.bench.convoy``: a 64 KiB get 0.28 -> 21 ms at 5 ms, 2.8 ms at
            0.5 ms). Process-wide and kept after the connector closes. None (default): leave it.
    """

    addr: str | tuple[str, ...] = DEFAULT_ADDR
    namespace: str = "default"
    token: str | None = field(default=None, repr=False)  # (a secret: not in logs of the settings)
    tls: bool | str | None = None
    tls_server_name: str | None = None
    timeout: float = DEFAULT_TIMEOUT_S
    lease_ms: int | None = None
    flush_on_reset: bool = False
    remote_decode_dedup: bool = False
    shm: bool | None = None
    quarantine_s: float = DEFAULT_QUARANTINE_S
    remote_prefill_wait_s: float = DEFAULT_REMOTE_PREFILL_WAIT_S
    switch_interval_ms: float | None = None

    @classmethod
    def from_config(cls, config: OffloadingConfig) -> KVStoreSettings:
        """Read the settings from an ``OffloadingConfig``.

        Raises:
            ValueError: an entry has the wrong type, both token forms are given, or the token file
                cannot be read or holds no token.
        """
        extra = config.extra_config
        addr = _parse_addr(extra.get("kvstore_addr", DEFAULT_ADDR))
        namespace = extra.get("kvstore_namespace") or default_namespace(config)
        if not isinstance(namespace, str) or len(namespace) > _MAX_NAMESPACE:
            raise ValueError(f"kvstore_namespace must be a string of 1..{_MAX_NAMESPACE} characters")
        token = extra.get("kvstore_token")
        token_file = extra.get("kvstore_token_file")
        if token is not None and token_file is not None:
            raise ValueError("give kvstore_token or kvstore_token_file, not both")
        if token_file is not None:  # (read as kvstore-cli reads --token-file)
            try:
                token = read_token_file(token_file, namespace)
            except OSError as exc:
                raise ValueError(f"kvstore_token_file {token_file}: {exc.strerror or exc}") from None
            except ValueError as exc:
                raise ValueError(f"kvstore_token_file {exc}") from None
        tls = extra.get("kvstore_tls")
        if tls is not None and not isinstance(tls, (bool, str)):
            raise ValueError("kvstore_tls must be true/false or a CA file path")
        server_name = extra.get("kvstore_tls_server_name")
        if server_name is not None and not (isinstance(server_name, str) and server_name):
            raise ValueError("kvstore_tls_server_name must be a host name")
        lease = extra.get("kvstore_lease_ms")
        quarantine = _parse_seconds(extra, "kvstore_quarantine_s", DEFAULT_QUARANTINE_S)
        prefill_wait = _parse_seconds(extra, "kvstore_remote_prefill_wait_s", DEFAULT_REMOTE_PREFILL_WAIT_S)
        switch = extra.get("kvstore_switch_interval_ms")
        if switch is not None:
            try:
                switch = -1.0 if isinstance(switch, bool) else float(switch)
            except (TypeError, ValueError, OverflowError):
                switch = -1.0
            if not 0.001 <= switch <= 1000:
                raise ValueError("kvstore_switch_interval_ms must be a number of milliseconds in 0.001..1000, "
                                 f"got {extra.get('kvstore_switch_interval_ms')!r}")
        return cls(
            addr=addr,
            namespace=namespace,
            token=token,
            tls=tls,
            tls_server_name=server_name,
            timeout=float(extra.get("kvstore_timeout", DEFAULT_TIMEOUT_S)),
            lease_ms=None if lease is None else int(lease),
            flush_on_reset=bool(_parse_bool(extra, "kvstore_flush_on_reset")),
            remote_decode_dedup=bool(_parse_bool(extra, "kvstore_remote_decode_dedup")),
            shm=_parse_bool(extra, "kvstore_shm"),
            quarantine_s=quarantine,
            remote_prefill_wait_s=prefill_wait,
            switch_interval_ms=switch,
        )

    def client(self, timeout: float | None = None, quarantine: bool = False) -> KVClient:
        """A connected blocking client.

        Args:
            timeout: seconds per request; default :attr:`timeout`.
            quarantine: give up on a silent server for :attr:`quarantine_s` (the scheduler's).

        Raises:
            KVStoreError: the server cannot be reached or refuses the token.
        """
        timeout = self.timeout if timeout is None else timeout
        retries = 2  # (a lost connection is asked again: connect, with HELLO, in a third of the timeout)
        client = KVClient(self.addr, namespace=self.namespace, token=self.token, tls=self.tls,
                          server_hostname=self.tls_server_name, shm=self.shm, timeout=timeout,
                          connect_timeout=timeout / (1 + retries), retries=retries,
                          quarantine=self.quarantine_s if quarantine else 0.0)
        try:
            client.connect()
        except KVStoreError as exc:
            client.close()
            raise type(exc)(f"kvstore server {self.addr} (namespace {self.namespace!r}): {exc}") from exc
        return client


#: The adapter's payload format, in the default namespace: bumped whenever chunks written before
#: would fail to load (2: the fingerprint covers the KV dtype and layout). An engine upgraded past a
#: bump finds the old chunks as misses, instead of a load failure that vLLM 0.33 treats as fatal.
PAYLOAD_FORMAT = 2


def default_namespace(config: OffloadingConfig) -> str:
    """A namespace that only engines with byte-compatible chunks share.

    It names the model, KV dtype and layout, the parallel layout (a rank's slice
    depends on it), the chunk geometry and the payload format. It does not name vLLM's prefix hash
    algorithm nor its seed: engines that share a namespace must hash alike, with one
    ``PYTHONHASHSEED`` (or none, with ``sha256`` / ``sha256_cbor``) -- vLLM seeds every hash
    algorithm with it when it is set.
    """
    par = config.parallel
    layout = f"tp{par.tp_size}pp{par.pp_size}"
    if par.pcp_size > 1:
        layout += f"pcp{par.pcp_size}"
    if par.dcp_size > 1:
        layout += f"dcp{par.dcp_size}"
    blocks = "+".join(str(g.tokens_per_block) for g in config.groups)
    parts = ["vllm", config.model.name, config.model.dtype, config.kv_cache_layout or "auto", layout,
             f"b{blocks}x{config.cache.blocks_per_chunk}", f"p{PAYLOAD_FORMAT}"]
    ns = "/".join(parts)
    if len(ns) > _MAX_NAMESPACE:  # a long local model path: keep it unique, not readable
        ns = "vllm/" + hashlib.sha256(ns.encode()).hexdigest()
    return ns


def layout_tag(config: OffloadingConfig) -> str:
    """What a worker's int8 pages mean: the KV dtype and layout, folded into every payload's
    fingerprint, so that an engine never loads another's chunk read as its own dtype or axis
    order (from a namespace shared on purpose, ``kvstore_namespace``)."""
    return f"{config.model.dtype}/{config.kv_cache_layout or 'auto'}"


def _parse_addr(value: Any) -> str | tuple[str, ...]:
    if isinstance(value, str):
        addrs = [a.strip() for a in value.split(",") if a.strip()]
    elif isinstance(value, (list, tuple)) and all(isinstance(a, str) for a in value):
        addrs = list(value)
    else:
        raise ValueError(f"kvstore_addr must be 'host:port' or a list of them, got {value!r}")
    if not addrs:
        raise ValueError("kvstore_addr is empty")
    return addrs[0] if len(addrs) == 1 else tuple(addrs)


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _parse_bool(extra: Mapping[str, Any], name: str) -> bool | None:
    """The setting ``name``: ``true``/``false`` (also ``1``/``0``, ``yes``/``no``, ``on``/``off``,
    JSON booleans), None when absent or null (its default); anything else is a ValueError: a typo
    must not quietly mean false (``kvstore_shm: "ture"``)."""
    value = extra.get(name)
    if value is None:
        return None
    text = str(value).strip().lower() if isinstance(value, (str, bool, int)) else None
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ValueError(f"{name} must be true or false, got {value!r}")


# --------------------------------------------------------------------------- scheduler side


class KVStoreLoadStoreSpec(LoadStoreSpec):
    """The chunks of one transfer: their ``OffloadKey``\\s, in the GPU blocks' order.

    Travels from the scheduler to every worker; each worker adds its rank. A store's
    ``parents`` name each chunk's predecessor in its request's chain (None: the
    first chunk, or not known), so the server files a store that continues a stored
    prefix behind that prefix for eviction rather than as a chain of its own.
    """

    def __init__(self, keys: Sequence[OffloadKey | bytes],
                 parents: Sequence[OffloadKey | bytes | None] | None = None) -> None:
        self.keys: list[bytes] = [bytes(k) for k in keys]
        self.parents: list[bytes | None] = [None] * len(self.keys) if parents is None else [
            None if p is None else bytes(p) for p in parents]
        if len(self.parents) != len(self.keys):
            raise ValueError(f"{len(self.parents)} parents for {len(self.keys)} chunks")

    def __repr__(self) -> str:
        return f"KVStoreLoadStoreSpec({len(self.keys)} chunks)"


class KVStoreOffloadingManager(OffloadingManager):
    """vLLM's scheduler-side offloading manager, with the kvstore server as its index.

    Round trips. vLLM asks :meth:`lookup` one key at a time. The first question
    about a request in a scheduling step sends the request's whole remaining
    chain (every rank's key) in one prefix LOOKUP that also pins the hits; the
    other answers of the step come from that reply. Windowed (sliding-window,
    Mamba) groups are scanned from the end, so they ask one EXISTS for all the
    group's chunks instead, and pin in :meth:`prepare_load`.

    Pins. A pin is a lease on the server. Those of this step's hits that a load
    takes (:meth:`prepare_load`) are dropped by the worker's GET once it has the
    bytes; the rest are dropped at the end of the step (:meth:`on_schedule_end`).
    A lease that nobody drops expires on the server.

    Stores. :meth:`prepare_store` skips chunks that are already stored (one
    EXISTS) or being stored, except for ``do_remote_decode`` requests, which
    store everything: a chunk the server still has is answered "existed", one
    evicted since the lookup is stored again, so the whole prompt is there when
    the prefill ends. (``remote_decode_dedup`` trades that resend for a touch.)
    Eviction is the server's business, so ``evicted_keys`` is always empty and
    there are no offloading events.

    Errors. The store is a cache: an unreachable server makes lookups miss and
    stores be skipped (``prepare_store`` returns ``None``), with a warning.

    Only vLLM's scheduler thread enters it, so the default no-op ``lock`` fits.
    """

    def __init__(
        self,
        client: KVClient,
        *,
        world_size: int = 1,
        groups: Sequence[OffloadingGroupConfig] = (),
        blocks_per_chunk: int = 1,
        lease_ms: int | None = None,
        flush_on_reset: bool = False,
        remote_decode_dedup: bool = False,
        remote_prefill_wait_s: float = 0.0,
    ) -> None:
        if world_size < 1:
            raise ValueError("world_size must be >= 1")
        self._client = client
        self._world_size = world_size
        self._chunk_tokens = {g.group_id: g.tokens_per_block * blocks_per_chunk for g in groups}
        # Sliding-window groups: their window in chunks (a run of that many hits is what vLLM loads).
        # (vLLM 0.32's group configs have no window: there every group is asked as full attention,
        # a prefix from the chunk asked on; 0.32 scans windows from the end, so they are still found.)
        windows = {g.group_id: getattr(g, "sliding_window_size_in_chunks", None) for g in groups}
        self._windows = {group: max(1, w) for group, w in windows.items() if w is not None}
        self._windowed = frozenset(self._windows)
        self._lease_ms = lease_ms
        self._flush_on_reset = flush_on_reset
        self._resetting = False  # flushed on reset; jobs in flight then may still write (on_reset_flushed)
        self._reset_settled = False  # vLLM reported those jobs done: the reset ends once every server took a flush
        self._unflushed: Collection[str] | None = None  # servers that flush still has to reach (None: all)
        self._flush_again_at = 0.0  # (monotonic) when a reset's failed flush is tried again ...
        self._flush_pause = FLUSH_RETRY_S  # ... and how long after the next failure
        self._remote_decode_dedup = remote_decode_dedup
        self._remote_prefill_wait_s = remote_prefill_wait_s
        self._known: dict[bytes, LookupResult] = {}  # this step's answers
        self._steps = 0  # scheduling steps ended
        self._prefill_probed = False  # whether this step asked the server for a waiting request
        self._waiting: dict[str, tuple[ReqContext, _PrefillWait]] = {}  # req_id -> a do_remote_prefill wait
        self._next_prefill_probe = 0.0  # when the waiting requests may be asked about again
        self._step_pins: Counter[bytes] = Counter()  # leases this step took that no load has claimed
        self._storing: Counter[bytes] = Counter()  # chunks in prepared, uncompleted stores
        self.round_trips = 0  # requests sent to the server (for tests and diagnostics)
        self._warnings = ThrottledLog(logger)

    @property
    def client(self) -> KVClient:
        """The manager's connection to the server (its namespace is the engine's)."""
        return self._client

    # -- keys
    def _wire(self, keys: Sequence[bytes]) -> list[bytes]:
        return [store_key(k, r) for k in keys for r in range(self._world_size)]

    def _all_ranks(self, flags: Sequence[bool], i: int) -> bool:
        ws = self._world_size
        return all(flags[i * ws : (i + 1) * ws])

    def _chain(self, key: bytes, req_context: ReqContext, whole_group: bool) -> list[bytes]:
        """The request's chunk keys of ``key``'s group, from ``key`` on (or all of them).

        vLLM's scheduler records every key's end-token position in the request
        context "so managers can recover prefix order" (``ReqContext``); that is
        where the rest of the chain comes from. Without it: just ``key``.
        """
        positions: Mapping[bytes, int] | None = getattr(req_context, "_offload_key_positions", None)
        group = get_offload_group_idx(OffloadKey(key))
        step = self._chunk_tokens.get(group)
        pos = positions.get(key) if positions else None
        if positions is None or pos is None or not step or pos % step:
            return [key]
        start = 0 if whole_group else pos
        chain = sorted(
            (p, k) for k, p in positions.items()
            if p >= start and p % step == 0 and get_offload_group_idx(OffloadKey(k)) == group
        )
        return [k for _, k in chain]

    def _parents(self, keys: Sequence[bytes], req_context: ReqContext) -> list[bytes | None]:
        """Each key's predecessor in its group's chain, from the positions vLLM recorded (None: unknown)."""
        positions: Mapping[bytes, int] | None = getattr(req_context, "_offload_key_positions", None)
        if not positions:
            return [None] * len(keys)
        at = {(get_offload_group_idx(OffloadKey(k)), p): k for k, p in positions.items()}
        out: list[bytes | None] = []
        for key in keys:
            group = get_offload_group_idx(OffloadKey(key))
            step, pos = self._chunk_tokens.get(group), positions.get(key)
            out.append(at.get((group, pos - step)) if step and pos is not None and pos > step else None)
        return out

    # -- lookups
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        if self._resetting and not self._end_reset():  # (what the server has may be KV from before the reset)
            return LookupResult.MISS
        wait = req_context.get_state(_PrefillWait)
        if wait is not None and not wait.over:
            return self._lookup_waiting(key, req_context, wait)
        known = self._known.get(key)
        if known is None:
            self._probe(key, req_context)
            known = self._known.get(key, LookupResult.MISS)
        return known

    def _ask(self, key: bytes, req_context: ReqContext, pin: bool) -> tuple[list[bytes], list[bool], bool]:
        """The request's chain of ``key``'s group, whether the server has each chunk (all ranks),
        and whether the group is a sliding-window one: those vLLM scans from the end are asked
        whole with one ``EXISTS`` (then, when ``pin``, the runs vLLM may load are leased:
        :meth:`_lease_window`); the others with one prefix ``LOOKUP`` from ``key`` on (which
        leases the hits when ``pin``), the chunks past the first missing one counted absent.

        Raises:
            KVStoreError: the server failed.
        """
        group = get_offload_group_idx(OffloadKey(key))
        windowed = group in self._windowed
        chain = self._chain(key, req_context, whole_group=windowed)
        wire = self._wire(chain)
        self.round_trips += 1
        if windowed:
            present = self._client.exists(wire)
            have = [self._all_ranks(present, i) for i in range(len(chain))]
            return chain, self._lease_window(wire, have, self._windows[group]) if pin else have, True
        n = self._client.lookup(wire, pin=pin, lease_ms=self._lease_ms if pin else None)
        if pin:
            self._step_pins.update(wire[:n])
        hits = n // self._world_size
        return chain, [i < hits for i in range(len(chain))], False

    def _lease_window(self, wire: list[bytes], have: list[bool], window: int) -> list[bool]:
        """Lease the chunks vLLM may load from a sliding-window chain that ``have`` says are
        present -- each run of at least ``window``, and a shorter one from the chain's start
        (vLLM scans only as far as other groups and ``max_load_tokens`` allow, and takes the
        rightmost such run it sees) -- with one pinned ``LOOKUP`` a run; the chunks it answers as
        present are those leased (a hit not leased could be evicted before its load, and a
        failed load stops vLLM). Unused leases go at the step's end."""
        ws, leased, start = self._world_size, [False] * len(have), 0
        while start < len(have):
            end = start
            while end < len(have) and have[end]:
                end += 1
            if end > start and (end - start >= window or start == 0):
                self.round_trips += 1
                n = self._client.lookup(wire[start * ws:end * ws], pin=True, lease_ms=self._lease_ms)
                self._step_pins.update(wire[start * ws:start * ws + n])
                leased[start:start + n // ws] = [True] * (n // ws)
            start = end + 1
        return leased

    def _probe(self, key: bytes, req_context: ReqContext) -> None:
        try:
            chain, have, windowed = self._ask(key, req_context, pin=True)
        except KVStoreError as exc:
            self._warnings.warning("kvstore lookup failed, treating it as a miss: %s", exc)
            self._known[key] = LookupResult.MISS
            return
        for k, present in zip(chain, have):
            self._known[k] = LookupResult.HIT if present else LookupResult.MISS
            if not (present or windowed):  # (a prefix: what lies past its end is not known)
                break

    def _lookup_waiting(self, key: bytes, req_context: ReqContext, wait: _PrefillWait) -> LookupResult:
        """A decode request whose remote prefill is still storing: RETRY (vLLM defers the request
        and asks again next step) until every KV-cache group's chain is whole -- for a
        sliding-window group, until its last chunk is there -- or the wait is over; then one RETRY
        more, and from the next step the lookup any request gets (pinned, every group asked anew).

        Its answers are its own (another request with the same prompt neither waits with it nor
        ends its wait). The server is asked in rounds (:meth:`_probe_waiting`): at most one a
        step for a group, in steps at least ``PREFILL_PROBE_S`` apart engine-wide, unless vLLM
        asks about a chunk no round has covered yet (a new request, another group) and no round
        ran this step yet (else it waits for the next step's round)."""
        group = get_offload_group_idx(OffloadKey(key))
        fresh = key not in wait.deferred
        if fresh:
            wait.starts[group] = bytes(key)  # (a full group is asked from past the engine's own prefix cache)
            # A round ran this step already: this request joins the next step's (a burst of N new
            # requests costs two rounds, not N).
            if self._prefill_probed:
                self._waiting[req_context.req_id] = (req_context, wait)
                return LookupResult.RETRY
        if fresh or (wait.probed.get(group) != self._steps and time.monotonic() >= self._next_prefill_probe):
            if not self._probe_waiting(req_context, wait, group):
                return LookupResult.MISS  # (no waiting on a server that fails)
        if not (wait.whole >= wait.groups or time.monotonic() >= wait.deadline):
            # Every chunk RETRY, none an unpinned HIT: vLLM may stop scanning before a RETRY (its
            # max_load_tokens, another group's shorter hit) and load what it saw as hits.
            return LookupResult.RETRY
        self._end_wait(req_context.req_id, wait)
        if not wait.whole >= wait.groups:
            self._warnings.warning(
                "kvstore: a do_remote_prefill request's chain was not whole after waiting %.1fs "
                "(kvstore_remote_prefill_wait_s; KV-cache groups whole: %s of %s); computing the rest "
                "(does its prefill engine store to this namespace?)", self._remote_prefill_wait_s,
                sorted(wait.whole), sorted(wait.groups))
        return LookupResult.RETRY  # (this step's other answers came unpinned: the next asks anew)

    def _probe_waiting(self, req_context: ReqContext, wait: _PrefillWait, group: int) -> bool:
        """One unpinned ``EXISTS`` for this request's ``group`` and for every group of every waiting
        request that no round asked about this step, so that many waiting requests cost one round
        trip, not one each. False (every wait of the round over) when the server failed."""
        now = time.monotonic()
        for req_id, (_, w) in list(self._waiting.items()):
            if now >= w.deadline + 60:  # (finished without on_request_finished: forgotten)
                del self._waiting[req_id]
        self._waiting[req_context.req_id] = (req_context, wait)
        due = [(ctx, w, g) for ctx, w in self._waiting.values() if w is wait or not (w.over or now >= w.deadline)
               for g in w.starts if w.probed.get(g) != self._steps or (w is wait and g == group)]
        chains = [self._chain(w.starts[g], ctx, whole_group=g in self._windowed) for ctx, w, g in due]
        self._prefill_probed = True
        self.round_trips += 1
        try:
            # (strict: over several servers, one that fails must end the wait too, not read as "not yet")
            present = self._client.exists(self._wire([k for chain in chains for k in chain]), strict=True)
        except KVStoreError as exc:
            self._warnings.warning("kvstore lookup failed, treating it as a miss: %s", exc)
            for ctx, w, _ in due:
                self._end_wait(ctx.req_id, w)
            return False
        at = 0
        for (ctx, w, g), chain in zip(due, chains):
            have = [self._all_ranks(present, at + i) for i in range(len(chain))]
            at += len(chain)
            w.probed[g] = self._steps
            w.deferred.update(chain)
            if have[-1] if g in self._windowed else all(have):
                w.whole.add(g)
            else:
                w.whole.discard(g)
            positions = getattr(ctx, "_offload_key_positions", ())
            w.groups = {get_offload_group_idx(OffloadKey(k)) for k in positions} & set(self._chunk_tokens) \
                or set(w.starts)
        return True

    def _end_wait(self, req_id: str, wait: _PrefillWait) -> None:
        wait.over, wait.deferred = True, set()
        self._waiting.pop(req_id, None)

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        keys = list(keys)
        unpinned: list[bytes] = []
        for w in self._wire(keys):
            if self._step_pins[w] > 0:
                self._step_pins[w] -= 1  # the worker's GET drops this lease
            else:
                unpinned.append(w)
        if unpinned:
            try:
                self.round_trips += 1
                n = self._client.lookup(unpinned, pin=True, lease_ms=self._lease_ms)
            except KVStoreError as exc:
                self._warnings.warning("kvstore: could not pin %d blocks to load: %s", len(unpinned), exc)
            else:
                if n < len(unpinned):
                    logger.warning("kvstore: %d of %d blocks to load are gone already", len(unpinned) - n,
                                   len(unpinned))
        return KVStoreLoadStoreSpec(keys)

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._waiting.pop(req_context.req_id, None)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._steps += 1
        if self._prefill_probed:
            self._prefill_probed, self._next_prefill_probe = False, time.monotonic() + PREFILL_PROBE_S
        self._known.clear()
        self._release_step_pins()

    def _release_step_pins(self) -> None:
        leftover = list(self._step_pins.elements())
        self._step_pins.clear()
        if not leftover:
            return
        try:
            self.round_trips += 1
            self._client.unpin(leftover)
        except KVStoreError as exc:  # the leases expire on their own
            self._warnings.warning("kvstore: could not unpin %d blocks: %s", len(leftover), exc)

    # -- stores
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        params = req_context.kv_transfer_params
        if self._remote_prefill_wait_s and params and params.get("do_remote_prefill"):
            wait = _PrefillWait(deadline=time.monotonic() + self._remote_prefill_wait_s)
            req_context.set_state(wait)
            self._waiting[req_context.req_id] = (req_context, wait)
        if _remote_decode(req_context):
            return RequestOffloadingContext(policy=OffloadPolicy.REQUEST_LEVEL)
        return RequestOffloadingContext(policy=OffloadPolicy.CHUNK_LEVEL)

    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext) -> PrepareStoreOutput | None:
        remote_decode = _remote_decode(req_context)
        # A chunk another request is storing is left to it -- but not by a request whose decoder runs
        # elsewhere: that store may fail (its failure reaches nobody), and this prompt must be whole.
        todo = [bytes(k) for k in keys if remote_decode or not self._storing[k]]
        if todo and (self._remote_decode_dedup or not remote_decode):
            try:
                self.round_trips += 1
                present = self._client.exists(self._wire(todo))
                stored = [k for i, k in enumerate(todo) if self._all_ranks(present, i)]
                if remote_decode and stored:  # the decode engine reads them soon: refresh them
                    self.round_trips += 1
                    self._client.lookup(self._wire(stored))
            except KVStoreError as exc:
                # Skipped, not refused: on None vLLM asks again, and logs "cannot store chunks", at
                # every step of every request for as long as the server is down (quarantined or not).
                self._warnings.warning("kvstore: cannot store %d chunks, skipped: %s", len(todo), exc)
                todo = []
            else:
                todo = [k for i, k in enumerate(todo) if not self._all_ranks(present, i)]
        self._storing.update(todo)
        return PrepareStoreOutput(
            keys_to_store=[OffloadKey(k) for k in todo],
            store_spec=KVStoreLoadStoreSpec(todo, self._parents(todo, req_context)),
            evicted_keys=[],
        )

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True) -> None:
        for k in keys:
            if self._storing[k] > 1:
                self._storing[k] -= 1
            else:
                self._storing.pop(k, None)

    # -- lifecycle
    def reset_cache(self) -> None:
        """Forget this step's answers; with ``flush_on_reset``, empty the namespace now and again
        in :meth:`on_reset_flushed`: a store job the reset caught in flight (vLLM submits stores a
        step late) still writes KV computed before the reset, after the first flush. Until then
        every lookup misses."""
        self._known.clear()
        self._release_step_pins()
        self._storing.clear()  # vLLM drops the jobs in flight: no complete_store will come
        if self._flush_on_reset:
            self._resetting, self._reset_settled = True, False
            self._flush(None)

    def on_reset_flushed(self) -> None:
        """vLLM: every job in flight at the last reset has been reported; none writes any more."""
        if self._resetting:
            self._reset_settled, self._unflushed = True, None
            self._flush_again_at, self._flush_pause = 0.0, FLUSH_RETRY_S
            self._end_reset()

    def _end_reset(self) -> bool:
        """Once vLLM has reported the jobs the reset caught, flush again; the reset ends once every
        server took that flush. A server that could not be asked (down, in the client's
        quarantine) keeps the blocks from before the reset: lookups miss until it takes one,
        tried again there only (what the others stored since is KV from after the reset), after
        FLUSH_RETRY_S, doubled at each failure. Whether the reset is over."""
        if not self._reset_settled or time.monotonic() < self._flush_again_at:
            return False
        self._unflushed = self._flush(self._unflushed)
        if self._unflushed is None or self._unflushed:
            self._flush_again_at = time.monotonic() + self._flush_pause
            self._flush_pause = min(2 * self._flush_pause, FLUSH_RETRY_MAX_S)
            return False
        self._resetting = False
        self._known.clear()
        return True

    def _flush(self, servers: Collection[str] | None) -> Collection[str] | None:
        """Flush the namespace on ``servers`` (None: all); the addresses it failed on (None: all)."""
        try:
            self._client.flush(servers=servers)
        except KVStoreError as exc:
            logger.warning("kvstore: could not flush namespace %s: %s", self._client.namespace, exc)
            failed: Collection[str] | None = getattr(exc, "errors", None)  # (the client says where, when it can)
            return set(failed) if failed else servers
        return ()

    def shutdown(self) -> None:
        self._release_step_pins()
        try:
            self._client.close()
        except KVStoreError:  # pragma: no cover - closing never needs the server
            pass


def _parse_seconds(extra: Mapping[str, Any], name: str, default: float) -> float:
    """A setting in seconds, >= 0 (a number or a numeric string; null: the default)."""
    value = extra.get(name)
    try:
        seconds = default if value is None else -1.0 if isinstance(value, bool) else float(value)
    except (TypeError, ValueError, OverflowError):
        seconds = -1.0
    if not 0 <= seconds < float("inf"):
        raise ValueError(f"{name} must be a number of seconds >= 0, got {value!r}")
    return seconds


@dataclass
class _PrefillWait:
    """A decode request's wait for its remote prefill's chain (its ReqContext state)."""

    deadline: float
    starts: dict[int, bytes] = field(default_factory=dict)  # KV-cache group -> the chunk vLLM asks it from
    deferred: set[bytes] = field(default_factory=set)  # chunks a probe covered (all answered RETRY)
    probed: dict[int, int] = field(default_factory=dict)  # KV-cache group -> the step of its last probe
    whole: set[int] = field(default_factory=set)  # the groups whose chain was whole at their last probe
    groups: set[int] = field(default_factory=set)  # the request's KV-cache groups (known at a probe)
    over: bool = False  # every group's chain was whole, or the time ran out


def _remote_decode(req_context: ReqContext) -> bool:
    params = req_context.kv_transfer_params
    return bool(params and params.get("do_remote_decode"))


# --------------------------------------------------------------------------- worker side


@dataclass(frozen=True)
class _Part:
    """One KV-cache group's share of a transfer."""

    transfer: PagedKVTransfer
    keys: list[bytes]  # this rank's store keys, one per chunk
    block_ids: list[int]  # GPU blocks, in chunk order
    skip: int  # GPU blocks of the first chunk outside the transfer
    parents: list[bytes | None]  # each chunk's predecessor (this rank's store key), if known


class _BufferPool:
    """Host payload buffers for reuse, up to a byte budget (a store's are taken by the gathering
    thread and given back by the putting one)."""

    def __init__(self, budget: int = BUFFER_POOL_BYTES) -> None:
        self._free: dict[PagedKVTransfer, list[torch.Tensor]] = {}
        self._budget = budget
        self._bytes = 0
        self._lock = threading.Lock()

    def take(self, transfer: PagedKVTransfer, n: int) -> list[torch.Tensor]:
        with self._lock:
            free = self._free.setdefault(transfer, [])
            got = [free.pop() for _ in range(min(n, len(free)))]
            self._bytes -= len(got) * transfer.payload_size
        return got + transfer.new_payloads(n - len(got))

    def give(self, transfer: PagedKVTransfer, buffers: list[torch.Tensor]) -> None:
        with self._lock:
            room = max(0, (self._budget - self._bytes) // max(1, transfer.payload_size))
            kept = buffers[:room]
            self._free.setdefault(transfer, []).extend(kept)
            self._bytes += len(kept) * transfer.payload_size


@dataclass
class _Staged:
    """A store job's chunks gathered into host buffers, waiting for their PUTs."""

    parts: list[tuple[_Part, list[bytes], list[bytes | None], list[torch.Tensor]]]
    nbytes: int


class KVStoreOffloadingWorker(OffloadingWorker):
    """Moves chunks between this worker's paged KV cache and the server.

    A store is gathered into host buffers on one thread, then PUT on another;
    loads run on a third, in submission order each (expedited loads, which vLLM
    waits for within the step, on a fourth so they never queue behind the
    others); a load is GET (straight into host buffers) + scatter. vLLM may reuse
    a store's GPU blocks once it is gathered (:meth:`wait`): a server that hangs
    holds host memory, at most ``max_store_backlog`` bytes (then new stores are
    skipped), not the engine. On CUDA,
    each job first waits for the work queued on the submitting stream (the
    forward pass that wrote the blocks to store; the zeroing of blocks to load
    into).

    A store that the server refuses (full, unreachable) is logged and reported
    done: the chunks simply stay uncached. A load that cannot get every block
    is reported failed -- vLLM 0.33's ``OffloadingConnector`` treats that as fatal
    rather than compute on garbage -- unless :class:`KVStoreConnector` has set
    ``report_failed_loads``: then it is reported done and its GPU blocks are kept
    for :meth:`take_failed_loads`, which the connector tells vLLM's scheduler.

    Stores may go through a client of their own (``store_client``, the spec's
    gives up on a silent server for a while: the stores queued behind one that
    timed out then fail at once instead of a timeout each, holding their GPU
    blocks); loads always try.
    """

    def __init__(self, kv_caches: CanonicalKVCaches, client: KVClient, *, blocks_per_chunk: int,
                 rank: int = 0, layout_tag: str | None = None, store_client: KVClient | None = None) -> None:
        self._client = client
        self._store_client = client if store_client is None else store_client
        self._rank = rank
        self._bpc = blocks_per_chunk
        self._transfers: list[PagedKVTransfer | None] = []
        for refs in kv_caches.group_data_refs:
            views = [kv_caches.tensors[r.tensor_idx].tensor[:, : r.page_size_bytes] for r in refs]
            # (int8 pages show no dtype nor layout: the tag puts them in the payloads' fingerprint)
            self._transfers.append(PagedKVTransfer(views, blocks_per_chunk, block_dim=0, layout_tag=layout_tag)
                                   if views else None)
        self._device = kv_caches.tensors[0].tensor.device if kv_caches.tensors else torch.device("cpu")
        self._gathers = ThreadPoolExecutor(1, thread_name_prefix="kvstore-gather")
        self._stores = ThreadPoolExecutor(1, thread_name_prefix="kvstore-store")
        self._loads = ThreadPoolExecutor(1, thread_name_prefix="kvstore-load")
        self._expedited = ThreadPoolExecutor(1, thread_name_prefix="kvstore-load-now")
        self._store_buffers = _BufferPool()  # (taken by the gathering thread, given back by the storing one)
        self._load_buffers = _BufferPool()
        self._expedited_buffers = _BufferPool()
        self._jobs: dict[int, Future[TransferResult]] = {}
        self._gathered: dict[int, Future[_Staged | None]] = {}  # a store job's GPU reads (what vLLM waits for)
        self.store_failures = 0  # stores the server refused, skipped, or that crashed (for tests and diagnostics)
        self._warnings = ThrottledLog(logger)  # (a server down fails every store job: a line each would flood)
        self.max_store_backlog = MAX_STORE_BACKLOG_BYTES  # gathered bytes waiting for the server, at most
        self._backlog = 0
        self._backlog_lock = threading.Lock()
        self.report_failed_loads = False  # KVStoreConnector: failed loads are reported done, kept here
        self.report_failed_sync_loads = False  # ... those vLLM waits for within the step too
        self._failed_loads: dict[int, list[int]] = {}  # job id -> its GPU block ids (written by load threads)
        self._failed_lock = threading.Lock()

    # -- the OffloadingWorker API
    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        assert isinstance(dst_spec, KVStoreLoadStoreSpec), type(dst_spec)
        parts = self._parts(src_spec, dst_spec.keys, dst_spec.parents)
        gathered = self._gathers.submit(self._gather, parts, self._ready_event())
        self._gathered[job_id] = gathered
        self._jobs[job_id] = self._stores.submit(self._store, job_id, gathered)
        return True

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec,
                    expedited: bool = False) -> bool:
        assert isinstance(src_spec, KVStoreLoadStoreSpec), type(src_spec)
        parts = self._parts(dst_spec, src_spec.keys)
        if expedited:
            executor, buffers = self._expedited, self._expedited_buffers
        else:
            executor, buffers = self._loads, self._load_buffers
        self._jobs[job_id] = executor.submit(self._load, job_id, parts, self._ready_event(), buffers, expedited)
        return True

    def get_finished(self) -> list[TransferResult]:
        done = [job_id for job_id, fut in self._jobs.items() if fut.done()]
        for job_id in done:
            self._gathered.pop(job_id, None)
        return [self._jobs.pop(job_id).result() for job_id in done]

    def take_failed_loads(self, job_ids: Collection[int]) -> dict[int, list[int]]:
        """Of ``job_ids`` (reported done), the loads that failed: their GPU block ids, given once."""
        with self._failed_lock:
            return {j: self._failed_loads.pop(j) for j in job_ids if j in self._failed_loads}

    def wait(self, job_ids: set[int]) -> None:
        """vLLM waits for a job before it reuses the job's GPU blocks: a load's are written when
        it is done, a store's read once gathered into host buffers -- its PUT may go on (a server
        that hangs would hold every engine step that reuses a block for the transfer timeout)."""
        for job_id in job_ids:
            fut = self._gathered.get(job_id) or self._jobs.get(job_id)
            if fut is not None:
                futures_wait([fut])  # stays in _jobs: get_finished still reports it

    def wait_all(self) -> None:
        """Wait until every submitted job is done (they are still reported by :meth:`get_finished`)."""
        futures_wait(list(self._jobs.values()))

    def shutdown(self) -> None:
        for executor in (self._gathers, self._stores, self._loads, self._expedited):
            executor.shutdown(wait=True)
        for client in {id(c): c for c in (self._client, self._store_client)}.values():
            try:
                client.close()
            except KVStoreError:  # pragma: no cover
                pass

    # -- planning
    def _parts(self, gpu: GPULoadStoreSpec, keys: Sequence[bytes],
               parents: Sequence[bytes | None] | None = None) -> list[_Part]:
        """Split a transfer by KV-cache group, as vLLM's CPU worker does.

        Group ``g`` has ``group_sizes[g]`` GPU blocks starting at logical block
        ``block_indices[g]`` of its request, so its first chunk may be entered
        ``block_indices[g] % blocks_per_chunk`` blocks in; its chunks are the next
        keys of the spec.
        """
        ids: list[int] = gpu.block_ids.tolist()
        parts: list[_Part] = []
        k = b = 0
        for g, (size, first) in enumerate(zip(gpu.group_sizes, gpu.block_indices)):
            if size == 0:
                continue
            transfer = self._transfers[g]
            if transfer is None:
                raise ValueError(f"KV-cache group {g} has no layers to transfer")
            skip = first % self._bpc
            n = _cdiv(skip + size, self._bpc)
            preds = parents[k : k + n] if parents is not None else [None] * n
            parts.append(_Part(transfer, [store_key(key, self._rank) for key in keys[k : k + n]],
                               ids[b : b + size], skip,
                               [None if p is None else store_key(p, self._rank) for p in preds]))
            k += n
            b += size
        if k != len(keys) or b != len(ids):
            raise ValueError(f"transfer of {len(ids)} GPU blocks does not match its {len(keys)} chunks")
        return parts

    def _ready_event(self) -> torch.cuda.Event | None:
        if self._device.type != "cuda":
            return None
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(torch.cuda.current_stream(self._device))
        return event

    # -- the jobs (on the executor threads)
    def _gather(self, parts: list[_Part], ready: torch.cuda.Event | None) -> _Staged | None:
        """Copy a store job's whole chunks into host buffers (None: skipped, the backlog is full)."""
        if ready is not None:
            ready.synchronize()
        chunks = [(part, *self._whole_chunks(part)) for part in parts]
        nbytes = sum(len(keys) * part.transfer.payload_size for part, keys, _, _ in chunks)
        with self._backlog_lock:
            if self._backlog and self._backlog + nbytes > self.max_store_backlog:
                return None
            self._backlog += nbytes
        staged = _Staged([], nbytes)
        try:
            for part, keys, ids, parents in chunks:
                if keys:
                    buffers = self._store_buffers.take(part.transfer, len(keys))
                    staged.parts.append((part, keys, parents, buffers))
                    part.transfer.gather(ids, out=buffers)
        except BaseException:
            self._unstage(staged)
            raise
        return staged

    def _unstage(self, staged: _Staged) -> None:
        for part, _, _, buffers in staged.parts:
            self._store_buffers.give(part.transfer, buffers)
        with self._backlog_lock:
            self._backlog -= staged.nbytes

    def _store(self, job_id: int, gathered: Future[_Staged | None]) -> TransferResult:
        start = time.perf_counter()
        try:
            staged = gathered.result()
        except Exception:  # (a store is a cache fill: vLLM 0.33 stops the engine on a failed job)
            self.store_failures += 1
            logger.exception("kvstore: store job %d crashed, its chunks stay uncached", job_id)
            return TransferResult(job_id=job_id, success=True)
        if staged is None:
            self.store_failures += 1
            logger.warning("kvstore: store job %d skipped, its chunks stay uncached: %s of earlier stores are "
                           "still waiting for the server", job_id, _mib(self._backlog))
            return TransferResult(job_id=job_id, success=True)
        try:
            failed = self._put_stretches(staged)
            if failed is not None:
                self.store_failures += 1
                self._warnings.warning("kvstore: store job %d failed, %d of its %d chunks stay uncached: %s",
                                       job_id, *failed)
                return TransferResult(job_id=job_id, success=True)  # (no size: vLLM's metrics count what moved)
        except Exception:
            self.store_failures += 1
            logger.exception("kvstore: store job %d crashed, its chunks stay uncached", job_id)
            return TransferResult(job_id=job_id, success=True)
        finally:  # put has returned: the server has the bytes, or will never get them
            self._unstage(staged)
        return TransferResult(job_id=job_id, success=True, transfer_size=staged.nbytes,
                              transfer_time=time.perf_counter() - start)

    def _put_stretches(self, staged: _Staged) -> tuple[int, int, KVStoreError] | None:
        """One put per stretch of consecutive chunks; a stretch that fails does not stop the others
        (over several servers, one down fails only its own chunks), unless it timed out: a server
        that hangs costs a job one timeout, not one per stretch. Returns (chunks not stored, of
        how many, the first error), or None when every put went through."""
        error: KVStoreError | None = None
        timed_out = False
        lost = total = 0
        for _part, keys, parents, buffers in staged.parts:
            total += len(keys)
            for lo, hi in _runs(keys, parents):
                if timed_out:
                    lost += hi - lo
                    continue
                try:
                    self._store_client.put(keys[lo:hi], [b.numpy().data for b in buffers[lo:hi]], parent=parents[lo])
                except KVStoreError as exc:
                    result = getattr(exc, "result", None)  # (a put over several servers: what failed)
                    lost += result.failed if isinstance(result, PutResult) else hi - lo
                    error = error or exc
                    timed_out = isinstance(exc, RequestTimeout)
        return None if error is None else (lost, total, error)

    def _whole_chunks(self, part: _Part) -> tuple[list[bytes], list[int], list[bytes | None]]:
        """The part's fully covered chunks (keys, GPU blocks, parents): a payload is always a whole chunk.

        vLLM stores whole chunks; only windowed groups can leave a chunk partly
        covered (null blocks outside the window), and such a chunk is skipped.
        """
        keys, ids, parents = part.keys, part.block_ids, part.parents
        if part.skip:
            keys, ids, parents = keys[1:], ids[self._bpc - part.skip :], parents[1:]
        tail = len(ids) % self._bpc
        if tail:
            keys, ids, parents = keys[:-1], ids[:-tail], parents[:-1]
        return keys, ids, parents

    def _load(self, job_id: int, parts: list[_Part], ready: torch.cuda.Event | None,
              pool: _BufferPool, expedited: bool = False) -> TransferResult:
        start = time.perf_counter()
        nbytes = 0
        try:
            if ready is not None:
                ready.synchronize()
            for part in parts:
                buffers = pool.take(part.transfer, len(part.keys))
                try:
                    try:
                        found = self._client.get_into(part.keys, [b.numpy().data for b in buffers],
                                                      unpin=True)
                    except (BlockSizeError, IntegrityError) as exc:
                        bad = unusable(exc)
                        return self._unloadable(job_id, parts, expedited, [part.keys[i] for i in bad], exc)
                    if not all(found):
                        logger.error("kvstore: load job %d: %d of %d chunks are missing", job_id,
                                     found.count(False), len(found))
                        return self._failed_load(job_id, parts, expedited)
                    try:
                        part.transfer.scatter(buffers, part.block_ids, skip=part.skip)  # synchronized
                    except PayloadMismatch as exc:  # (checked before anything is written)
                        bad = part.transfer.misfits(buffers)
                        return self._unloadable(job_id, parts, expedited, [part.keys[i] for i in bad], exc)
                finally:
                    pool.give(part.transfer, buffers)
                nbytes += len(part.keys) * part.transfer.payload_size
        except KVStoreError as exc:  # (a server down or silent fails every load: a traceback each flooded the log)
            self._warnings.warning("kvstore: load job %d failed: %s", job_id, exc)
            return self._failed_load(job_id, parts, expedited)
        except Exception:
            logger.exception("kvstore: load job %d failed", job_id)
            return self._failed_load(job_id, parts, expedited)
        return TransferResult(job_id=job_id, success=True, transfer_size=nbytes,
                              transfer_time=time.perf_counter() - start)

    def _unloadable(self, job_id: int, parts: list[_Part], expedited: bool, keys: list[bytes],
                    why: Exception) -> TransferResult:
        """A load failed on chunks that are stored but cannot be loaded here (another engine's dtype,
        layout or format; corrupted): deleted, or every lookup would offer them again."""
        logger.error("kvstore: load job %d: %d chunk(s) on the server cannot be loaded (%s); deleting them",
                     job_id, len(keys), why)
        if keys:
            try:
                self._client.delete(keys)
            except KVStoreError as exc:
                logger.warning("kvstore: could not delete the chunks load job %d could not load: %s", job_id, exc)
        return self._failed_load(job_id, parts, expedited)

    def _failed_load(self, job_id: int, parts: list[_Part], expedited: bool) -> TransferResult:
        if not (self.report_failed_sync_loads if expedited else self.report_failed_loads):
            return TransferResult(job_id=job_id, success=False)
        with self._failed_lock:  # (before the result is seen: the connector asks once it is)
            self._failed_loads[job_id] = [b for part in parts for b in part.block_ids]
        return TransferResult(job_id=job_id, success=True)


# --------------------------------------------------------------------------- the connector


class KVStoreConnector(OffloadingConnector):
    """vLLM's ``OffloadingConnector``, with a load that fails reported to the scheduler.

    vLLM 0.33's connector stops the engine on a failed transfer. A store on the
    network can fail a load the lookup promised: a memory-only server restarted
    in between, a lease that ran out. With this connector
    (``"kv_connector": "KVStoreConnector", "kv_connector_module_path":
    "kvstore.integrations.vllm"``) such a request is recomputed under vLLM's
    ``"kv_load_failure_policy": "recompute"``, or ends with an error under the
    default ``"fail"``; the engine goes on. A request waiting for its load is
    reported in ``failed_recving``; the GPU blocks of a load vLLM runs within
    the step (expedited) in ``get_block_ids_with_load_errors`` -- only under
    ``"fail"``: vLLM 0.33's recompute of such a load can run the model on blocks
    never loaded, so under ``"recompute"`` its failure still stops the engine.

    It reads which load job is whose from the worker's ``_load_jobs`` (vLLM 0.33).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._invalid_block_ids: set[int] = set()

    def _kvstore_worker(self) -> KVStoreOffloadingWorker | None:
        cw = self.connector_worker
        worker = getattr(cw, "worker", None) if cw is not None else None
        return worker if isinstance(worker, KVStoreOffloadingWorker) else None

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        worker = self._kvstore_worker()
        if worker is not None:  # (before any load is submitted)
            worker.report_failed_loads = True
            # vLLM 0.33 recomputes a failed load within the step from its GPU blocks, which it keeps
            # in its prefix cache and may already have run a step on (async scheduling): the model
            # would read what never arrived. Under "fail" it drops them and ends the request.
            worker.report_failed_sync_loads = self._vllm_config.kv_transfer_config.kv_load_failure_policy == "fail"
        super().start_load_kv(forward_context, **kwargs)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        worker, cw = self._kvstore_worker(), self.connector_worker
        if worker is None or cw is None:
            return super().get_transfer_results(finished_req_ids)
        loads = dict(cw._load_jobs)  # job id -> request id (None: expedited), as vLLM 0.33 keeps them
        sending, recving = self.get_finished(finished_req_ids)
        done = {job: req for job, req in loads.items() if job not in cw._load_jobs}
        failed: set[str] = set()
        fails = self._vllm_config.kv_transfer_config.kv_load_failure_policy == "fail"
        for job, block_ids in worker.take_failed_loads(done).items():
            req = done[job]
            logger.warning("kvstore: load job %d failed: %s", job,
                           f"request {req} " + ("ends with an error (kv_load_failure_policy 'fail')" if fails else
                                                "computes what it did not load") if req is not None else
                           f"{len(block_ids)} GPU blocks reported to vLLM as not loaded")
            if req is not None:
                failed.add(req)
            else:
                self._invalid_block_ids.update(block_ids)
        return KVConnectorTransferResults(finished_sending=set(sending or ()), finished_recving=set(recving or ()),
                                          failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        ids, self._invalid_block_ids = self._invalid_block_ids, set()
        return ids


# --------------------------------------------------------------------------- the spec


class KVStoreOffloadingSpec(OffloadingSpec):
    """The ``spec_name`` to give vLLM (``spec_module_path``: ``kvstore.integrations.vllm``).

    Besides vLLM's own entries of ``kv_connector_extra_config`` (``block_size``
    or ``blocks_per_chunk``, ``offload_prompt_only``, ...) it reads the
    ``kvstore_*`` ones described by :class:`KVStoreSettings`.

    Raises:
        ValueError: a ``kvstore_*`` entry is invalid, or ``canonical_layout`` is
            asked for (chunks are stored in each rank's own layout).
    """

    def __init__(self, config: OffloadingConfig) -> None:
        super().__init__(config)
        if config.canonical_layout:
            raise ValueError("KVStoreOffloadingSpec does not support canonical_layout")
        self.settings = KVStoreSettings.from_config(config)
        if self.settings.switch_interval_ms is not None:  # (the scheduler's process and each worker's load a spec)
            before = sys.getswitchinterval() * 1e3
            sys.setswitchinterval(self.settings.switch_interval_ms / 1e3)
            logger.info("kvstore: Python's thread switch interval set to %g ms (was %g ms; kvstore_switch_interval_ms)",
                        self.settings.switch_interval_ms, before)
        self._manager: KVStoreOffloadingManager | None = None
        self._worker: KVStoreOffloadingWorker | None = None

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            self._manager = KVStoreOffloadingManager(
                self.settings.client(quarantine=True),
                world_size=self.config.parallel.world_size,
                groups=self.config.groups,
                blocks_per_chunk=self.blocks_per_chunk,
                lease_ms=self.settings.lease_ms,
                flush_on_reset=self.settings.flush_on_reset,
                remote_decode_dedup=self.settings.remote_decode_dedup,
                remote_prefill_wait_s=self.settings.remote_prefill_wait_s,
            )
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            timeout = max(self.settings.timeout, MIN_TRANSFER_TIMEOUT_S)
            loads = self.settings.client(timeout=timeout)
            try:
                stores = self.settings.client(timeout=timeout, quarantine=True)
            except BaseException:
                loads.close()
                raise
            self._worker = KVStoreOffloadingWorker(
                kv_caches,
                loads,
                blocks_per_chunk=self.blocks_per_chunk,
                rank=self.config.parallel.rank,
                layout_tag=layout_tag(self.config),
                store_client=stores,
            )
        return self._worker
