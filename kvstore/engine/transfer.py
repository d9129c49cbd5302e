"""Paged KV-cache tensors <-> store payloads, and an executor for the scheduler's jobs.

Payload layout (one offloaded block = ``factor`` GPU blocks x all layers of one TP rank)::

    offset 0   16-byte header: magic b"kvsP", u16 version (1), u16 factor,
               8-byte layout fingerprint (sha256 of the per-layer shapes/dtypes,
               block dimension and factor, and the caller's ``layout_tag``)
    offset 16  layer 0 part, then layer 1 part, ... in the order of ``kv_caches``

A layer part is the raw bytes (``.view(torch.uint8)``, so bf16 and fp8 travel bit-exact) of
``cache.index_select(block_dim, ids)``, C-contiguous -- the layer tensor cut down to the
offloaded block's ``factor`` GPU blocks along its block dimension, in job order. For the
usual ``[2, num_blocks, block_size, heads, dim]`` (``block_dim=1``) a part is
``[2, factor, block_size, heads, dim]``: all K of the block, then all V. For
``[num_blocks, 2, block_size, heads, dim]`` (``block_dim=0``) it is ``[factor, 2, ...]``.

The header makes a payload from a different dtype, shape or factor fail loudly
(:class:`PayloadMismatch`, a :class:`~kvstore.errors.BlockSizeError`) even when its size
happens to match. Tensors that are untyped byte views (vLLM hands its workers ``int8``
pages) show no dtype or axis order: ``layout_tag`` names what their bytes mean. Payloads of
one layout are interchangeable between processes and hosts.

On CUDA, gathers and scatters run on a side stream, after the work queued on the caller's
stream, through pinned host buffers, and are synchronized before returning: a layer's blocks
move in one operation (per-block copies were launch-bound: 3.6 GB/s against 22 GB/s for 32
blocks of 2 MiB on an H200, ``python -m kvstore.bench.paged``), then one device->host or
host->device copy per payload. On a CPU cache they go straight between CPU tensors.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import operator
import struct
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from kvstore.engine.hashing import whole_number
from kvstore.engine.offload import LoadJob, OffloadScheduler, StoreJob
from kvstore.errors import BlockSizeError, IntegrityError, KVStoreError

__all__ = [
    "HEADER_SIZE",
    "BlockClient",
    "Completed",
    "PagedKVTransfer",
    "PayloadMismatch",
    "TransferExecutor",
    "unusable",
]

logger = logging.getLogger(__name__)

_HEADER = struct.Struct("<4sHH8s")
_MAGIC = b"kvsP"
_VERSION = 1
HEADER_SIZE = _HEADER.size  # 16: keeps every layer part 16-byte aligned
#: Payload bytes a gather or scatter stages on the device at a time, whatever the job's size (a KV
#: cache leaves little room beside it; the copies add about one layer's share of a stage). A
#: layer's blocks of a stage move in one operation: on an H200, 64 blocks of 2 MiB gathered at
#: 32-33 GB/s, 32 at 21-22.
STAGE_BYTES = 128 << 20


class PayloadMismatch(BlockSizeError):
    """A payload does not have the size or layout of this cache's offloaded block."""


class PagedKVTransfer:
    """Gathers offloaded blocks out of a paged KV cache and scatters them back in.

    Args:
        kv_caches: one tensor per layer, all with the GPU-block axis at ``block_dim`` and the
            same number of GPU blocks, on one device; any dtype.
        block_size_factor: GPU blocks per offloaded block.
        block_dim: the GPU-block axis of every layer tensor (1 for ``[2, N, B, H, D]``,
            0 for ``[N, 2, B, H, D]``); not the last axis.
        layout_tag: what the tensors do not show of their bytes' meaning (e.g. the KV dtype
            and layout behind byte views), folded into the fingerprint; None adds nothing.

    Raises:
        ValueError: the tensors disagree or the layout is unsupported.
    """

    def __init__(self, kv_caches: Sequence[torch.Tensor], block_size_factor: int, *, block_dim: int = 1,
                 layout_tag: str | None = None) -> None:
        if not kv_caches:
            raise ValueError("no KV cache tensors given")
        block_size_factor = whole_number(block_size_factor, "block_size_factor")
        first = kv_caches[0]
        ndim = first.dim()
        dim = block_dim + ndim if block_dim < 0 else block_dim
        if not 0 <= dim < ndim - 1:
            raise ValueError(f"block_dim {block_dim} must name an axis before the last of a {ndim}-d tensor")
        self.device = first.device
        if self.device.type == "meta":
            raise ValueError("the KV cache tensors are on the meta device: they hold no data to move")
        self.block_dim = dim
        self.factor = block_size_factor
        self.num_gpu_blocks = first.shape[dim]
        self._layers: list[torch.Tensor] = []  # uint8 views: bytes move, never values
        self._part_shapes: list[tuple[int, ...]] = []
        description: list[object] = [dim, block_size_factor]
        for i, cache in enumerate(kv_caches):
            if cache.dim() != ndim or cache.device != self.device or cache.shape[dim] != self.num_gpu_blocks:
                raise ValueError(f"layer {i} {tuple(cache.shape)} on {cache.device} does not match layer 0")
            if cache.stride(-1) != 1:
                raise ValueError(f"layer {i}: the last axis must be contiguous")
            if _self_overlapping(cache):  # (a load would fail part-way, the layers before it written)
                raise ValueError(f"layer {i}: its elements overlap, or may (an expand()ed or interleaved "
                                 "as_strided view); a KV cache needs memory of its own for every element")
            raw = cache.view(torch.uint8)
            shape = list(raw.shape)
            shape[dim] = block_size_factor
            self._layers.append(raw)
            self._part_shapes.append(tuple(shape))
            description.append((str(cache.dtype), tuple(cache.shape[:dim] + cache.shape[dim + 1 :])))
        if layout_tag is not None:
            description.append(("tag", layout_tag))
        self._part_sizes = [_numel(s) for s in self._part_shapes]
        self._offsets = [HEADER_SIZE + sum(self._part_sizes[:i]) for i in range(len(self._part_sizes))]
        self.payload_size = HEADER_SIZE + sum(self._part_sizes)
        fingerprint = hashlib.sha256(repr(description).encode()).digest()[:8]
        self._header = torch.frombuffer(
            bytearray(_HEADER.pack(_MAGIC, _VERSION, block_size_factor, fingerprint)), dtype=torch.uint8
        )
        # Off the CPU, blocks are gathered into (and scattered from) device-side payloads, moved to
        # and from the host in one copy each; CUDA does that on a side stream, with pinned buffers.
        self._staged = self.device.type != "cpu"
        self._cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if self._cuda else None  # type: ignore[no-untyped-call]

    def new_payloads(self, n: int) -> list[torch.Tensor]:
        """``n`` host buffers of ``payload_size`` bytes (pinned when the cache is on CUDA)."""
        return [torch.empty(self.payload_size, dtype=torch.uint8, pin_memory=self._cuda) for _ in range(n)]

    def gather(self, gpu_block_ids: Sequence[int], out: Sequence[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """Payloads of the offloaded blocks made of ``gpu_block_ids`` (``factor`` ids each).

        Args:
            gpu_block_ids: GPU blocks in chain order.
            out: host uint8 buffers to fill (one per payload); new ones when None.

        Returns:
            One contiguous host uint8 tensor per offloaded block; the cache is not modified.

        Raises:
            ValueError: the ids are not whole offloaded blocks or are out of range.
            PayloadMismatch: an ``out`` buffer has the wrong size.
        """
        n, rest = divmod(len(gpu_block_ids), self.factor)
        if rest:
            raise ValueError(f"{len(gpu_block_ids)} GPU blocks are not whole offloaded blocks of {self.factor}")
        ids = self._ids(gpu_block_ids)
        payloads = list(out) if out is not None else self.new_payloads(n)
        if len(payloads) != n:
            raise ValueError(f"{n} payloads to gather but {len(payloads)} buffers")
        for i, p in enumerate(payloads):
            if p.dtype != torch.uint8 or p.dim() != 1 or not p.is_contiguous() or p.device.type != "cpu":
                raise PayloadMismatch(f"buffer {i} must be a contiguous 1-d uint8 CPU tensor")
            self._check_size(i, p.numel())
        if not n:  # (nothing to stage: no side stream, no pinned ids)
            return payloads
        with self._on_side_stream():
            if self._staged:
                self._gather_staged(ids, payloads)
            else:  # straight into the host payloads
                for i, dst in enumerate(payloads):
                    block_ids = ids[i * self.factor : (i + 1) * self.factor]
                    for raw, off, size, shape in self._parts():
                        torch.index_select(raw, self.block_dim, block_ids, out=dst[off : off + size].view(shape))
        for p in payloads:
            p[:HEADER_SIZE].copy_(self._header)
        return payloads

    def scatter(self, payloads: Sequence[Any], gpu_block_ids: Sequence[int], *, skip: int = 0) -> None:
        """Write payloads into the cache's GPU blocks (the inverse of :meth:`gather`).

        Args:
            payloads: bytes-like objects or uint8 tensors, one per offloaded block.
            gpu_block_ids: ``len(payloads) * factor - skip`` destination GPU blocks.
            skip: leading GPU blocks of the first payload not to write (already cached).

        Raises:
            PayloadMismatch: a payload's size or header does not match this cache.
            ValueError: wrong number of ids, duplicates or ids out of range.
        """
        n = len(payloads)
        if not 0 <= skip < self.factor:
            raise ValueError(f"skip={skip}: it counts GPU blocks of the first payload, 0 to {self.factor - 1}")
        if len(gpu_block_ids) != n * self.factor - skip:
            raise ValueError(f"{n} payloads with skip={skip} need {n * self.factor - skip} GPU blocks, "
                             f"got {len(gpu_block_ids)}")
        ids = self._ids(gpu_block_ids)
        if ids.unique().numel() != ids.numel():  # (on the parsed ids: a tensor's elements hash by identity)
            raise ValueError("duplicate destination GPU blocks")
        sources = [self._checked(i, p) for i, p in enumerate(payloads)]
        if not n:
            return
        with self._on_side_stream():
            if self._staged:
                self._scatter_staged(ids, sources, skip)
            else:
                pos = 0
                for i, src in enumerate(sources):
                    first = skip if i == 0 else 0
                    block_ids = ids[pos : pos + self.factor - first]
                    pos += self.factor - first
                    for raw, off, size, shape in self._parts():
                        part = src[off : off + size].view(shape).narrow(self.block_dim, first, self.factor - first)
                        raw.index_copy_(self.block_dim, block_ids, part)

    def _gather_staged(self, ids: torch.Tensor, payloads: list[torch.Tensor]) -> None:
        """Stage by stage: a layer's blocks into the stage buffer in one operation, then one copy to
        the host per payload (the side stream orders the buffer's reuse)."""
        f, dim = self.factor, self.block_dim
        ids = self._on_device(ids)
        for lo, hi, stage in self._stage_buffers(len(payloads)):
            m = hi - lo
            for raw, off, size, shape in self._parts():
                picked = raw.index_select(dim, ids[lo * f : hi * f]).unflatten(dim, (m, f))
                stage[:, off : off + size].view(m, *shape).copy_(picked.movedim(dim, 0))
            for dst, src in zip(payloads[lo:hi], stage):
                dst.copy_(src, non_blocking=self._cuda)  # (waited for as the side stream ends)

    def _scatter_staged(self, ids: torch.Tensor, sources: list[torch.Tensor], skip: int) -> None:
        """Stage by stage: one copy to the device per payload, then a layer's blocks in one operation."""
        f, dim = self.factor, self.block_dim
        ids = self._on_device(ids)
        for lo, hi, stage in self._stage_buffers(len(sources)):
            m = hi - lo
            for dst, src in zip(stage, sources[lo:hi]):
                dst.copy_(src, non_blocking=self._cuda)
            first = max(lo * f, skip)  # the stage's first block to write, counted over all payloads' blocks
            for raw, off, size, shape in self._parts():
                part = stage[:, off : off + size].view(m, *shape).movedim(0, dim).flatten(dim, dim + 1)
                part = part.narrow(dim, first - lo * f, hi * f - first)
                raw.index_copy_(dim, ids[first - skip : hi * f - skip], part)

    def _stage_buffers(self, n: int) -> Iterator[tuple[int, int, torch.Tensor]]:
        """Each stage's ``[lo, hi)`` payloads and its rows of one device buffer, reused stage after
        stage (on CUDA the side stream orders the reuse)."""
        stages = self._stages(n)
        work = torch.empty((max((hi - lo for lo, hi in stages), default=0), self.payload_size), dtype=torch.uint8,
                           device=self.device)
        for lo, hi in stages:
            yield lo, hi, work[: hi - lo]

    def _stages(self, n: int) -> list[tuple[int, int]]:
        """``[lo, hi)`` runs of ``n`` payloads, as few as fit :data:`STAGE_BYTES` (one payload at
        least), of even sizes: no small last stage paying a stage's launches for a few blocks."""
        count = -(-n // max(1, STAGE_BYTES // max(1, self.payload_size - HEADER_SIZE)))  # (64 blocks of 2 MiB: one)
        bounds = [n * k // count for k in range(count + 1)] if n else [0]
        return list(zip(bounds, bounds[1:]))

    def _parts(self) -> Iterable[tuple[torch.Tensor, int, int, tuple[int, ...]]]:
        """Per layer: its byte view, and its part's offset, size and shape in a payload."""
        return zip(self._layers, self._offsets, self._part_sizes, self._part_shapes)

    def _ids(self, gpu_block_ids: Sequence[int]) -> torch.Tensor:
        try:  # (torch.tensor would truncate a float id to another block; a bool is no block id either)
            if any(isinstance(b, bool) for b in gpu_block_ids):
                raise TypeError
            ids = torch.tensor([operator.index(b) for b in gpu_block_ids], dtype=torch.long)
        except TypeError:
            raise ValueError(f"GPU block ids must be integers, got {list(gpu_block_ids)!r}") from None
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_gpu_blocks):
            raise ValueError(f"GPU block ids must be in 0..{self.num_gpu_blocks - 1}")
        return ids

    def _on_device(self, ids: torch.Tensor) -> torch.Tensor:
        """The ids on the cache's device, copied on the current (side) stream: a blocking copy would
        make the host wait for all the compute stream has queued."""
        return ids.pin_memory().to(self.device, non_blocking=True) if self._cuda else ids.to(self.device)

    def misfits(self, payloads: Sequence[Any]) -> list[int]:
        """Indexes of the payloads :meth:`scatter` would refuse (another size, dtype, layout or format)."""
        out = []
        for i, p in enumerate(payloads):
            try:
                self._checked(i, p)
            except PayloadMismatch:
                out.append(i)
        return out

    def _check_size(self, index: int, size: int) -> None:
        if size != self.payload_size:
            raise PayloadMismatch(
                f"payload {index} has {size} bytes; this cache's offloaded block is {self.payload_size} "
                f"({HEADER_SIZE} header + {self.factor} GPU blocks x {len(self._layers)} layers)"
            )

    def _checked(self, index: int, payload: Any) -> torch.Tensor:
        if isinstance(payload, torch.Tensor):
            if payload.dtype != torch.uint8 or payload.dim() != 1 or not payload.is_contiguous():
                raise PayloadMismatch(f"payload {index} must be a contiguous 1-d uint8 tensor")
            tensor = payload
        else:
            try:
                view = memoryview(payload).cast("B")
            except TypeError as exc:  # e.g. a strided numpy view
                raise PayloadMismatch(f"payload {index} must be a contiguous buffer: {exc}") from None
            if not len(view):
                raise PayloadMismatch(f"payload {index} is empty; this cache's offloaded block is {self.payload_size}")
            # torch.frombuffer warns on read-only memory (e.g. bytes): copy it rather than risk writes
            tensor = torch.frombuffer(bytearray(view) if view.readonly else view, dtype=torch.uint8)
        self._check_size(index, tensor.numel())
        header = bytes(tensor[:HEADER_SIZE].cpu().numpy())
        if header != bytes(self._header.numpy()):
            magic, version, factor, _ = _HEADER.unpack(header)
            what = "not a kvstore KV payload" if magic != _MAGIC else (
                f"version {version}, factor {factor}, another dtype/shape/layout")
            raise PayloadMismatch(f"payload {index} does not fit this cache: {what}")
        return tensor

    def _on_side_stream(self) -> Any:
        if self._stream is None:
            return contextlib.nullcontext()
        return _SideStream(self._stream)


class _SideStream:
    """Run on a side stream after the compute stream's pending work; wait for it on exit."""

    def __init__(self, stream: torch.cuda.Stream) -> None:
        self.stream = stream
        self._ctx = torch.cuda.stream(stream)

    def __enter__(self) -> None:
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        self._ctx.__enter__()  # type: ignore[no-untyped-call]

    def __exit__(self, *exc: object) -> None:
        self._ctx.__exit__(*exc)
        self.stream.synchronize()


def _self_overlapping(t: torch.Tensor) -> bool:
    """Whether two indices of ``t`` may reach one element: unless its axes, by stride, each step
    past all the elements of the axes before it (as every real cache layout does). Conservative:
    an interleaved ``as_strided`` view that does not overlap is refused too."""
    reach = 0  # the furthest element the axes so far reach, from the first
    for stride, size in sorted((t.stride(d), t.shape[d]) for d in range(t.dim()) if t.shape[d] > 1):
        if stride <= reach:
            return True
        reach += stride * (size - 1)
    return False


def _numel(shape: Iterable[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def unusable(exc: KVStoreError) -> list[int]:
    """Indexes of the blocks a failed ``get_into`` found stored but could not use: a checksum that
    does not match, another size. (The client names them in ``exc.errors``; the rest may be fine.)"""
    errors = getattr(exc, "errors", None) or {}
    return [i for i, e in errors.items() if isinstance(e, (BlockSizeError, IntegrityError))]


class BlockClient(Protocol):
    """What the executor needs of a client (:class:`kvstore.client.KVClient` has it)."""

    def put(self, keys: Sequence[bytes], blocks: Sequence[Any], *, parent: bytes | None = None) -> Any: ...

    def get_into(self, keys: Sequence[bytes], buffers: Sequence[Any]) -> list[bool]: ...

    def lookup(self, keys: Sequence[bytes]) -> int: ...

    def delete(self, keys: Sequence[bytes]) -> int: ...


@dataclass(frozen=True)
class Completed:
    """Result of :meth:`TransferExecutor.run`: GPU blocks now free, and the jobs that failed.

    A failed load means the engine must compute those tokens itself.
    """

    freed: tuple[int, ...]
    failed: tuple[LoadJob | StoreJob, ...]


class TransferExecutor:
    """Runs the scheduler's jobs against a client, synchronously, and reports them done.

    Args:
        client: the store (``put``/``get_into``/``lookup``).
        transfer: the engine's paged cache.
        scheduler: told about every finished job.
        pin: lease the blocks a lookup finds until the load fetches them, so eviction cannot
            take them in between; the leases of blocks no load fetches are dropped at the next
            :meth:`run` (needs ``lookup(pin=)``, ``get_into(unpin=)`` and ``unpin``, as ``KVClient``).
    """

    def __init__(
        self, client: BlockClient, transfer: PagedKVTransfer, scheduler: OffloadScheduler, *, pin: bool = False
    ) -> None:
        if scheduler.factor != transfer.factor:
            raise ValueError(f"scheduler factor {scheduler.factor} != transfer factor {transfer.factor}")
        self.client = client
        self.transfer = transfer
        self.scheduler = scheduler
        self.pin = pin
        scheduler.keep_unused = pin  # run() drops the leases no load takes

    def lookup(self, keys: list[bytes]) -> int:
        """The :data:`~kvstore.engine.offload.LookupFn` to give ``num_external_tokens``. A store that
        fails (unreachable, timed out) is a miss, logged: the engine computes the prefix itself
        rather than fail its scheduling step -- the store is a cache."""
        try:
            if self.pin:
                return self.client.lookup(keys, pin=True)  # type: ignore[call-arg]
            return self.client.lookup(keys)
        except KVStoreError as exc:
            logger.warning("kvstore lookup failed, treating it as a miss: %s", exc)
            return 0

    def load(self, job: LoadJob) -> bool:
        """Fetch and scatter one load; False (cache untouched) if a block is missing.

        Raises what the client or :meth:`PagedKVTransfer.scatter` raises. Blocks stored but not
        loadable here (corrupted, another engine's layout in the namespace) are deleted first:
        every lookup would offer them again, and the recomputed prefix's store would find them
        present and leave them.
        """
        keys = list(job.keys)
        payloads = self.transfer.new_payloads(len(keys))
        buffers = [p.numpy().data for p in payloads]
        try:
            if self.pin:
                found = self.client.get_into(keys, buffers, unpin=True)  # type: ignore[call-arg]
            else:
                found = self.client.get_into(keys, buffers)
        except (BlockSizeError, IntegrityError) as exc:
            self._delete(job, [keys[i] for i in unusable(exc)], exc)
            raise
        if not all(found):
            return False
        try:
            self.transfer.scatter(payloads, job.gpu_block_ids, skip=job.skip)
        except PayloadMismatch as exc:  # (checked before anything is written)
            self._delete(job, [keys[i] for i in self.transfer.misfits(payloads)], exc)
            raise
        return True

    def _delete(self, job: LoadJob, keys: list[bytes], why: Exception) -> None:
        if not keys:
            return
        logger.error("load %d of request %s: %d stored block(s) cannot be loaded (%s); deleting them",
                     job.job_id, job.req_id, len(keys), why)
        try:
            self.client.delete(keys)
        except Exception as exc:  # (any: the load's error is the one to report; a client may lack delete)
            logger.warning("could not delete the blocks load %d could not load: %r", job.job_id, exc)

    def store(self, job: StoreJob) -> None:
        """Gather and put one store; raises what the client raises."""
        payloads = self.transfer.gather(job.gpu_block_ids)
        self.client.put(list(job.keys), [p.numpy().data for p in payloads], parent=job.parent)

    def run(self, jobs: Iterable[LoadJob | StoreJob]) -> Completed:
        """Run jobs in order and report each to the scheduler (with ``pin``, first drop the
        leases of blocks lookups found and no load takes).

        A :class:`~kvstore.errors.KVStoreError` (store unreachable, full, corrupt block, payload
        of another layout) fails the job -- logged, reported, returned -- instead of the step.
        So does any other exception (a bad block id, say), logged with its traceback: a job
        left unreported would hold its GPU blocks for good.
        """
        freed: list[int] = []
        failed: list[LoadJob | StoreJob] = []
        unused = self.scheduler.take_unused()
        if unused:
            try:
                self.client.unpin(unused)  # type: ignore[attr-defined]
            except KVStoreError as exc:  # they expire anyway (the server's lease time)
                logger.warning("dropping %d unused leases failed: %s", len(unused), exc)
        for job in jobs:
            try:
                if isinstance(job, LoadJob):
                    ok = self.load(job)
                else:
                    self.store(job)
                    ok = True
            except KVStoreError as exc:
                logger.warning("%s %d of request %s failed: %s", type(job).__name__, job.job_id, job.req_id, exc)
                ok = False
            except Exception:
                logger.exception("%s %d of request %s failed", type(job).__name__, job.job_id, job.req_id)
                ok = False
            if not ok:
                failed.append(job)
            done = self.scheduler.on_load_done if isinstance(job, LoadJob) else self.scheduler.on_store_done
            freed.extend(done(job.job_id, ok))
        return Completed(tuple(freed), tuple(failed))
