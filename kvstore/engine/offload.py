"""Which KV blocks to load from the store and which to store, over the life of each request.

Engine-agnostic and pure: no network, no torch, no clock. It emits :class:`LoadJob` and
:class:`StoreJob` values (store keys <-> GPU block ids) and is told when they are done; what
runs the jobs (see :mod:`kvstore.engine.transfer`) is the engine's business. Modelled on the
scheduler side of vLLM's ``OffloadingConnector``.

Units: the engine's paged cache has GPU blocks of ``gpu_block_size`` tokens; the store keeps
*offloaded blocks* of ``factor`` consecutive GPU blocks (``hasher.block_size`` tokens), each
named by a key of the request's chain. Only full offloaded blocks are ever stored.

Life of a request (every call takes the engine's request id)::

    add_request(rid, prompt_ids, kv_transfer_params)
    n = num_external_tokens(rid, gpu_prefix_hit_tokens, lookup)   # lookup(keys) -> present prefix
    load = on_alloc(rid, gpu_block_ids, n)      # LoadJob | None; run it, then on_load_done
    per engine step:
        extend_blocks(rid, new_gpu_block_ids)   # when the engine grows the request
        stores = build_step({rid: tokens_with_kv_after_this_step, ...})
        ... forward pass, then run the StoreJobs, then on_store_done(job_id, ok) ...
        append_tokens(rid, sampled_ids)
    free = preempt(rid)                         # the engine takes the GPU blocks back: free `free`;
    ... then num_external_tokens and on_alloc again when it resumes
    fin = finish_request(rid)                   # free fin.free_now; run fin.stores
    on_*_done(...) returns the GPU blocks of finished requests that became free

The store cursor: per request, the index of the next offloaded block to store. After a load
it moves past the loaded prefix, so what was just loaded is not stored again -- **unless**
``kv_transfer_params["do_remote_decode"]`` is true: a prefill whose decode runs elsewhere
stores every block, the loaded prefix included, so the remote decoder finds the complete cache
in the store (vLLM's ``REQUEST_LEVEL`` offload policy).

Asynchronous scheduling needs no switch: a block is stored once its KV is computed *and* its
tokens are known (they name it). With async scheduling the engine learns a sampled token only
after scheduling the next step, so a block completed by that token is emitted one step later
-- or by :meth:`OffloadScheduler.finish_request` if the request ends first (vLLM leaves that
last block behind).
"""

from __future__ import annotations

import operator
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kvstore.engine.hashing import BlockHasher, KeyChain, whole_number

__all__ = ["Finished", "LoadJob", "LookupFn", "OffloadScheduler", "StoreJob"]

LookupFn = Callable[[list[bytes]], int]
"""Given chain keys, the number of leading keys present in the store (``KVClient.lookup``)."""


@dataclass(frozen=True)
class LoadJob:
    """Fetch ``keys`` from the store into GPU blocks.

    ``gpu_block_ids`` has ``len(keys) * factor - skip`` entries: the first ``skip`` GPU blocks
    of ``keys[0]`` are already in the GPU cache (prefix hit) and must not be written.
    """

    job_id: int
    req_id: str
    keys: tuple[bytes, ...]
    first_block: int  # chain index of keys[0]
    gpu_block_ids: tuple[int, ...]
    skip: int = 0


@dataclass(frozen=True)
class StoreJob:
    """Put the GPU blocks ``gpu_block_ids`` (``factor`` per key, in order) under ``keys``."""

    job_id: int
    req_id: str
    keys: tuple[bytes, ...]
    first_block: int  # chain index of keys[0]
    gpu_block_ids: tuple[int, ...]
    parent: bytes | None = None  # the chain's key before keys[0] (put's ``parent``), None at the head


J = TypeVar("J", "LoadJob", "StoreJob")


@dataclass(frozen=True)
class Finished:
    """What :meth:`OffloadScheduler.finish_request` allows.

    ``free_now``: GPU blocks no transfer reads or writes; free them now. The other blocks of
    the request are returned by ``on_load_done``/``on_store_done`` when their last job ends.
    ``stores``: final stores (blocks whose last token became known only at the end).
    """

    free_now: tuple[int, ...]
    stores: tuple[StoreJob, ...]


@dataclass
class _Request:
    chain: KeyChain
    remote_decode: bool
    block_ids: list[int] = field(default_factory=list)
    next_store: int = 0  # chain index of the next offloaded block to store
    computed: int = 0  # tokens whose KV is in the GPU cache once the current step has run
    gpu_hit: int | None = None  # GPU prefix-hit tokens seen by num_external_tokens
    hit_end: int = 0  # chain index after the last block the lookup found present
    found: tuple[bytes, ...] = ()  # keys the last lookup found that no load has taken yet
    loading: int | None = None  # job id of the in-flight load
    cursor_before_load: int = 0
    store_failed: bool = False  # a store failed: nothing after it is stored until the request resumes
    stale: set[int] = field(default_factory=set)  # stores from before a preemption, still running
    finished: bool = False
    busy: Counter[int] = field(default_factory=Counter)  # GPU block -> in-flight jobs using it
    retired: set[int] = field(default_factory=set)  # busy blocks a preemption gave up: freed when idle


class OffloadScheduler:
    """Tracks requests and emits the load/store jobs that move their KV blocks.

    Args:
        hasher: names the offloaded blocks; its ``block_size`` is the offloaded block size.
        gpu_block_size: tokens per GPU block; must divide ``hasher.block_size``.

    Raises:
        ValueError: the block sizes do not fit.
    """

    def __init__(self, hasher: BlockHasher, gpu_block_size: int) -> None:
        gpu_block_size = whole_number(gpu_block_size, "gpu_block_size")
        if hasher.block_size % gpu_block_size:
            raise ValueError(
                f"offloaded block size {hasher.block_size} is not a multiple of the "
                f"GPU block size {gpu_block_size}"
            )
        self.hasher = hasher
        self.gpu_block_size = gpu_block_size
        self.offloaded_block_size = hasher.block_size
        self.factor = hasher.block_size // gpu_block_size
        self._requests: dict[str, _Request] = {}
        self._jobs: dict[int, LoadJob | StoreJob] = {}
        self._next_job_id = 0
        #: Note the keys lookups found that no load takes (:meth:`take_unused`); off, they are not kept.
        self.keep_unused = False
        self._unused: list[bytes] = []

    # -- request life -------------------------------------------------------------------

    def add_request(
        self,
        req_id: str,
        token_ids: Iterable[int],
        kv_transfer_params: Mapping[str, Any] | None = None,
        *,
        extra: object = None,
    ) -> None:
        """Start tracking a request; ``extra`` (LoRA id, multimodal hashes) salts its keys.

        Raises:
            ValueError: the id is already tracked -- also after ``finish_request`` while a job of that
                request is still in flight: its id is free once the job's ``on_*_done`` is reported
                (an engine that retries an aborted request under the same id waits for that).
            TypeError: ``kv_transfer_params`` is not a mapping.
        """
        if req_id in self._requests:
            raise ValueError(f"request {req_id!r} is already tracked")
        if kv_transfer_params is not None and not isinstance(kv_transfer_params, Mapping):
            raise TypeError(f"kv_transfer_params must be a mapping, got {type(kv_transfer_params).__name__}")
        remote_decode = bool(kv_transfer_params and kv_transfer_params.get("do_remote_decode"))
        self._requests[req_id] = _Request(self.hasher.chain(extra, token_ids), remote_decode)

    def append_tokens(self, req_id: str, token_ids: Iterable[int]) -> None:
        """Record sampled tokens (they name the blocks they complete)."""
        self._live(req_id).chain.extend(token_ids)

    def keys(self, req_id: str) -> list[bytes]:
        """The keys of the request's full offloaded blocks so far."""
        return self._live(req_id).chain.keys

    def num_external_tokens(self, req_id: str, num_gpu_computed_tokens: int, lookup: LookupFn) -> int:
        """How many tokens beyond the GPU prefix hit the store can supply.

        ``lookup`` receives the keys from the first offloaded block the GPU hit does not fully
        cover to the last full block, and returns how many of them, from the first, are
        present (one round trip: ``KVClient.lookup``, with ``pin=True`` to lease them).
        ``num_gpu_computed_tokens + result`` is always a whole number of offloaded blocks. If it
        covers the whole prompt the engine still recomputes the last token for its logits.

        Raises:
            ValueError: the GPU hit is not a whole number of GPU blocks, or lookup's answer
                is out of range.
        """
        req = self._live(req_id)
        if num_gpu_computed_tokens < 0 or num_gpu_computed_tokens % self.gpu_block_size:
            raise ValueError(f"GPU prefix hit {num_gpu_computed_tokens} is not whole GPU blocks")
        start = num_gpu_computed_tokens // self.offloaded_block_size
        req.gpu_hit, req.hit_end = num_gpu_computed_tokens, start
        candidates = req.chain.slice(start, len(req.chain))
        if not candidates:
            return 0
        answer = lookup(candidates)
        try:  # (None: a lookup that returned nothing; a numpy integer is a count)
            hits = operator.index(answer)
        except TypeError:
            hits = -1
        if not 0 <= hits <= len(candidates):
            raise ValueError(f"lookup of {len(candidates)} keys answered {answer!r}, not a count of 0 to {len(candidates)}")
        self._unuse(req.found)  # a lookup asked again: the last one's finds go unused
        req.found = tuple(candidates[:hits])
        if hits == 0:
            return 0
        req.hit_end = start + hits
        return req.hit_end * self.offloaded_block_size - num_gpu_computed_tokens

    def on_alloc(self, req_id: str, gpu_block_ids: Sequence[int], num_external_tokens: int) -> LoadJob | None:
        """The engine allocated the request's GPU blocks (all of them, prefix hits included).

        Returns the load to run before the request computes, or None. After :meth:`preempt`
        it gives the resumed request its new blocks (the load of the old ones must have ended).

        Raises:
            ValueError: ``num_external_tokens`` was not offered by :meth:`num_external_tokens`,
                too few blocks, or a load, or a store from the blocks it replaces, is in flight.
        """
        req = self._live(req_id)
        if req.loading is not None or any(req.busy[b] for b in req.block_ids):
            raise ValueError(f"request {req_id!r} still has transfers in flight")
        gpu_hit = req.gpu_hit  # every check comes first: a refused call changes nothing
        if num_external_tokens and gpu_hit is None:
            raise ValueError("call num_external_tokens before on_alloc with external tokens")
        end, rest = divmod((gpu_hit or 0) + num_external_tokens, self.offloaded_block_size)  # held once loaded
        if num_external_tokens and (num_external_tokens < 0 or rest or end > req.hit_end):
            raise ValueError(
                f"{num_external_tokens} external tokens after a GPU hit of {gpu_hit} "
                f"do not end at a found offloaded block (found up to block {req.hit_end})"
            )
        if len(gpu_block_ids) < end * self.factor:  # (a later step would fail on it, not this call)
            raise ValueError(f"{end} offloaded blocks need {end * self.factor} GPU blocks, "
                             f"the request has {len(gpu_block_ids)}")
        req.block_ids = list(gpu_block_ids)
        # What these blocks hold once the load is done: a count from before a preemption would
        # name blocks of the new allocation that were never computed.
        req.computed = (gpu_hit or 0) + num_external_tokens
        if gpu_hit is not None:
            # Resumed after a preemption: what the lookup did not find is gone from the store (evicted
            # meanwhile, or its store failed). Stored again from there, so that the blocks after it
            # hang off a present one -- not stored stranded, out of reach of any prefix lookup.
            req.next_store = min(req.next_store, req.hit_end)
            req.store_failed = False
        found, req.found = req.found, ()
        if num_external_tokens == 0:
            self._unuse(found)
            return None
        assert gpu_hit is not None
        start = gpu_hit // self.offloaded_block_size
        self._unuse(found[end - start:])  # found, but beyond what the engine takes
        first_gpu = gpu_hit // self.gpu_block_size
        job = LoadJob(
            job_id=self._new_job_id(),
            req_id=req_id,
            keys=tuple(req.chain.slice(start, end)),
            first_block=start,
            gpu_block_ids=tuple(req.block_ids[first_gpu : end * self.factor]),
            skip=first_gpu - start * self.factor,
        )
        req.loading = job.job_id
        req.cursor_before_load = req.next_store
        if not req.remote_decode:
            # the loaded prefix is in the store already; a remote decoder needs it re-stored
            req.next_store = max(req.next_store, end)
        self._track(req, job)
        return job

    def extend_blocks(self, req_id: str, gpu_block_ids: Iterable[int]) -> None:
        """Append GPU blocks the engine allocated to the request after ``on_alloc``."""
        self._live(req_id).block_ids.extend(gpu_block_ids)

    def build_step(self, num_computed_tokens: Mapping[str, int]) -> list[StoreJob]:
        """Stores for one engine step; run them after the step's forward pass.

        Args:
            num_computed_tokens: per scheduled request, the tokens whose KV is in the GPU cache
                once this step has run. Requests not named keep their last count; they still
                get stores that became possible (tokens appended, a load finished).

        Raises:
            KeyError: an unknown request id.
            ValueError: a count needs GPU blocks the request has not been given (the step is
                refused whole: no count taken, no job made).
        """
        for req_id, computed in num_computed_tokens.items():
            req = self._live(req_id)
            if computed < 0:
                raise ValueError(f"request {req_id!r}: negative token count {computed}")
            self._need_blocks(req, computed // self.offloaded_block_size)
        for req_id, computed in num_computed_tokens.items():
            self._requests[req_id].computed = computed
        jobs: list[StoreJob] = []
        for req_id, req in self._requests.items():
            job = self._store_ready(req_id, req)
            if job is not None:
                jobs.append(job)
        return jobs

    def on_load_done(self, job_id: int, success: bool = True) -> tuple[int, ...]:
        """A load ended. On failure the engine must recompute those tokens; they will be stored.

        Returns:
            GPU blocks of finished (or preempted) requests that no transfer uses any more.

        Raises:
            ValueError: no such load is pending (never emitted, or reported already).
        """
        job = self._pop_job(job_id, LoadJob)
        req = self._requests[job.req_id]
        req.loading = None
        if not success:  # nothing past the GPU hit is in those blocks until the engine computes it
            req.next_store = req.cursor_before_load
            req.computed = min(req.computed, req.gpu_hit or 0)
        return self._release(job.req_id, job)

    def on_store_done(self, job_id: int, success: bool = True) -> tuple[int, ...]:
        """A store ended. A failed store is not retried (the blocks are missing, not wrong), and
        nothing after it is stored for the request until it resumes from a preemption: those blocks
        would hang off a missing one, out of reach of a prefix lookup, and take the room of
        reachable blocks.

        Returns:
            GPU blocks of finished (or preempted) requests that no transfer uses any more.

        Raises:
            ValueError: no such store is pending (never emitted, or reported already).
        """
        job = self._pop_job(job_id, StoreJob)
        req = self._requests[job.req_id]
        if not success and job_id not in req.stale:  # (a store from before a resume: not this run's)
            req.store_failed = True
        req.stale.discard(job_id)
        return self._release(job.req_id, job)

    def _pop_job(self, job_id: int, kind: type[J]) -> J:
        job = self._jobs.get(job_id)
        if job is None:
            raise ValueError(f"job {job_id!r} is not pending: never emitted, or already reported done")
        if not isinstance(job, kind):
            raise ValueError(f"job {job_id} is not a {kind.__name__.removesuffix('Job').lower()}")
        del self._jobs[job_id]
        return job

    def preempt(self, req_id: str) -> tuple[int, ...]:
        """The engine takes the request's GPU blocks back; it stays tracked, to resume later.

        What the store holds of it stays there, and the cursor keeps its place -- except with
        ``do_remote_decode``, where it goes back to the start: the store may evict some of those
        blocks before the request resumes, and the remote decoder needs every one (those still
        there are answered "existed"). Resuming goes through :meth:`num_external_tokens` and
        :meth:`on_alloc` again; until then nothing is stored from the old blocks, whatever
        tokens arrive.

        Returns:
            the blocks no transfer uses, to free now; blocks a transfer still reads or writes
            come back from ``on_load_done``/``on_store_done`` when it ends.
        """
        req = self._live(req_id)
        free_now = tuple(b for b in req.block_ids if not req.busy[b])
        req.retired.update(b for b in req.block_ids if req.busy[b])
        req.stale.update(j.job_id for j in self._jobs.values() if j.req_id == req_id and isinstance(j, StoreJob))
        req.block_ids, req.computed = [], 0
        if req.remote_decode:
            req.next_store = 0
        self._unuse(req.found)
        req.found, req.gpu_hit, req.hit_end = (), None, 0
        return free_now

    def finish_request(self, req_id: str) -> Finished:
        """The request ended (done, aborted or preempted for good); see :class:`Finished`."""
        req = self._live(req_id)
        final = self._store_ready(req_id, req)
        req.finished = True
        self._unuse(req.found)
        free_now = tuple(b for b in req.block_ids if not req.busy[b])
        if not req.busy:
            del self._requests[req_id]
        return Finished(free_now, (final,) if final is not None else ())

    def take_unused(self) -> list[bytes]:
        """Keys a lookup found that no load will fetch (the engine took fewer tokens, asked
        again, or the request ended first), once each, since the last call, while
        ``keep_unused`` is set. With pinning lookups, drop one lease for each (``unpin``):
        :class:`TransferExecutor` with ``pin=True`` does both."""
        unused, self._unused = self._unused, []
        return unused

    # -- introspection ------------------------------------------------------------------

    @property
    def pending_jobs(self) -> tuple[int, ...]:
        """Ids of the jobs emitted and not yet reported done."""
        return tuple(self._jobs)

    @property
    def num_requests(self) -> int:
        """Requests tracked: live ones and finished ones with transfers in flight."""
        return len(self._requests)

    # -- internals ----------------------------------------------------------------------

    def _unuse(self, keys: Sequence[bytes]) -> None:
        if self.keep_unused:
            self._unused += keys

    def _live(self, req_id: str) -> _Request:
        req = self._requests.get(req_id)
        if req is None or req.finished:
            raise KeyError(f"unknown or finished request {req_id!r}")
        return req

    def _new_job_id(self) -> int:
        self._next_job_id += 1
        return self._next_job_id

    def _need_blocks(self, req: _Request, num_offloaded: int) -> None:
        if len(req.block_ids) < num_offloaded * self.factor:
            raise ValueError(
                f"{num_offloaded} offloaded blocks need {num_offloaded * self.factor} GPU blocks, "
                f"the request has {len(req.block_ids)}"
            )

    def _store_ready(self, req_id: str, req: _Request) -> StoreJob | None:
        # a loading request stores nothing: its loaded prefix is not in the GPU cache yet
        if req.finished or req.loading is not None or req.store_failed:
            return None
        end = min(req.computed // self.offloaded_block_size, len(req.chain))
        if end <= req.next_store:
            return None
        self._need_blocks(req, end)
        start = req.next_store
        job = StoreJob(
            job_id=self._new_job_id(),
            req_id=req_id,
            keys=tuple(req.chain.slice(start, end)),
            first_block=start,
            gpu_block_ids=tuple(req.block_ids[start * self.factor : end * self.factor]),
            parent=req.chain.slice(start - 1, start)[0] if start else None,
        )
        req.next_store = end
        self._track(req, job)
        return job

    def _track(self, req: _Request, job: LoadJob | StoreJob) -> None:
        self._jobs[job.job_id] = job
        req.busy.update(job.gpu_block_ids)

    def _release(self, req_id: str, job: LoadJob | StoreJob) -> tuple[int, ...]:
        req = self._requests[req_id]
        req.busy.subtract(job.gpu_block_ids)
        idle = tuple(b for b in dict.fromkeys(job.gpu_block_ids) if req.busy[b] <= 0)
        for block in idle:
            del req.busy[block]
        if not req.finished:
            freed = tuple(b for b in idle if b in req.retired)
            req.retired.difference_update(freed)
            return freed
        if not req.busy:
            del self._requests[req_id]
        return idle
