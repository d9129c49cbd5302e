"""The seed's scenario (vLLM ``test_do_remote_decode_stores_all_blocks``) against a real server.

``gpu_block_size=4``, ``offloaded_block_size=12``. A 12-token request stores GPU blocks (0,1,2).
After the GPU prefix cache is reset, a 24-token request whose lookup -- against the real
server -- finds one offloaded block loads GPU blocks (0,1,2); with ``do_remote_decode`` it then
stores (0,1,2,3,4,5), without it only (3,4,5). Both with synchronous and asynchronous scheduling.

``MiniEngine`` is a toy engine loop in the shape of vLLM's (a GPU block pool with a prefix cache,
a forward pass writing position-dependent KV, async scheduling learning sampled tokens one step
late) driving the real scheduler, transfer, executor and client.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from kvstore.client import KVClient
from kvstore.engine.hashing import BlockHasher
from kvstore.engine.offload import Finished, LoadJob, OffloadScheduler, StoreJob
from kvstore.engine.transfer import PagedKVTransfer, TransferExecutor
from kvstore.server.process import ServerProcess

GPU_BS, OFF_BS = 4, 12
FACTOR = OFF_BS // GPU_BS
NUM_GPU_BLOCKS = 64
LAYERS = 2
EOS = 99


class RecordingClient:
    """The real client, noting which keys went out in puts (to assert on what was sent)."""

    def __init__(self, kv: KVClient) -> None:
        self.kv = kv
        self.put_keys: list[bytes] = []
        self.put_parents: list[bytes | None] = []

    def put(self, keys: Sequence[bytes], blocks: Sequence[Any], *, parent: bytes | None = None) -> Any:
        self.put_keys += keys
        self.put_parents.append(parent)
        return self.kv.put(keys, blocks, parent=parent)

    def get_into(self, keys: Sequence[bytes], buffers: Sequence[Any]) -> list[bool]:
        return list(self.kv.get_into(keys, buffers))

    def lookup(self, keys: Sequence[bytes]) -> int:
        return int(self.kv.lookup(keys))


@dataclass
class _Req:
    req_id: str
    tokens: list[int]  # known to the scheduler: with async scheduling the last sample comes late
    gpu_tokens: list[int]  # what the forward pass sees: the prompt and every sampled token
    decoded: Iterator[int]
    table: list[int]
    computed: int = 0
    finished: bool = False


class MiniEngine:
    def __init__(self, client: RecordingClient, async_scheduling: bool, jobs_may_fail: bool = False) -> None:
        self.async_scheduling = async_scheduling
        self.jobs_may_fail = jobs_may_fail
        self.failed: list[int] = []  # job ids (only with jobs_may_fail)
        self.caches = [torch.full((2, NUM_GPU_BLOCKS, GPU_BS, 1, 2), -1.0) for _ in range(LAYERS)]
        self.transfer = PagedKVTransfer(self.caches, FACTOR)
        self.sched = OffloadScheduler(BlockHasher(OFF_BS), GPU_BS)
        self.executor = TransferExecutor(client, self.transfer, self.sched)
        self.free = list(range(NUM_GPU_BLOCKS))
        self.prefix_cache: dict[tuple[int, ...], int] = {}  # token prefix of a full GPU block -> block
        self.loads: list[tuple[int, ...]] = []  # per job: GPU block *indexes* within the request
        self.stores: list[tuple[int, ...]] = []
        self._ids = itertools.count()
        self.tables: dict[str, list[int]] = {}  # request -> its GPU blocks, in order

    def reset_prefix_cache(self) -> None:
        self.free += self.prefix_cache.values()
        self.prefix_cache.clear()

    def run(self, token_ids: list[int], decoded: list[int], params: dict[str, Any] | None = None) -> list[int]:
        """Admit a request and run engine steps until it finishes; returns its GPU blocks."""
        rid = f"r{next(self._ids)}"
        self.sched.add_request(rid, token_ids, params)
        hit: list[int] = []
        for i in range((len(token_ids) - 1) // GPU_BS):  # like vLLM: never the whole prompt
            block = self.prefix_cache.get(tuple(token_ids[: (i + 1) * GPU_BS]))
            if block is None:
                break
            hit.append(block)
        external = self.sched.num_external_tokens(rid, len(hit) * GPU_BS, self.executor.lookup)
        table = hit + self._take(-(-len(token_ids) // GPU_BS) - len(hit))
        self.tables[rid] = table
        req = _Req(rid, list(token_ids), list(token_ids), iter(decoded), table, len(hit) * GPU_BS + external)
        load = self.sched.on_alloc(rid, table, external)
        if load is not None:
            self._run_jobs([load])
        pending_output: int | None = None
        while not req.finished:
            output = self._step(req)
            if self.async_scheduling:  # the sampled token is learnt after the next step was scheduled
                if pending_output is not None:
                    self._process(req, pending_output)
                pending_output = output
            else:
                self._process(req, output)
        return req.table

    def _step(self, req: _Req) -> int:
        after = len(req.gpu_tokens)
        while len(req.table) * GPU_BS < after:
            block = self._take(1)
            req.table += block
            self.sched.extend_blocks(req.req_id, block)
        stores = self.sched.build_step({req.req_id: after})
        for pos in range(req.computed, after):  # the forward pass
            write_kv(self.caches, req.table, pos, req.gpu_tokens[pos])
        req.computed = after
        self._run_jobs(stores)
        token = next(req.decoded, 0)  # async: a step scheduled before EOS was seen
        req.gpu_tokens.append(token)
        return token

    def _process(self, req: _Req, token: int) -> None:
        if req.finished:
            return
        req.tokens.append(token)
        self.sched.append_tokens(req.req_id, [token])
        if token == EOS:
            req.finished = True
            fin: Finished = self.sched.finish_request(req.req_id)
            self._run_jobs(fin.stores)
            for i in range(len(req.tokens) // GPU_BS):  # full blocks go to the GPU prefix cache
                self.prefix_cache.setdefault(tuple(req.tokens[: (i + 1) * GPU_BS]), req.table[i])

    def _run_jobs(self, jobs: Sequence[LoadJob | StoreJob]) -> None:
        for job in jobs:
            table = self.tables[job.req_id]
            idx = tuple(table.index(b) for b in job.gpu_block_ids)
            (self.loads if isinstance(job, LoadJob) else self.stores).append(idx)
        done = self.executor.run(jobs)
        if self.jobs_may_fail:
            self.failed += done.failed
        else:
            assert done.failed == ()

    def _take(self, n: int) -> list[int]:
        taken, self.free = self.free[:n], self.free[n:]
        return taken


def kv_value(pos: int, token: int, layer: int, kv: int) -> float:
    return token * 1000.0 + pos + kv * 0.5 + layer * 0.25


def write_kv(caches: list[torch.Tensor], table: list[int], pos: int, token: int) -> None:
    for layer, cache in enumerate(caches):
        for kv in (0, 1):
            cache[kv, table[pos // GPU_BS], pos % GPU_BS] = kv_value(pos, token, layer, kv)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("remote_decode", [True, False], ids=["do_remote_decode", "plain"])
def test_do_remote_decode_stores_all_blocks(kv_server: ServerProcess, async_scheduling: bool,
                                            remote_decode: bool) -> None:
    namespace = f"seed/{async_scheduling}/{remote_decode}"
    with KVClient(kv_server.addr, namespace=namespace) as kv:
        client = RecordingClient(kv)
        engine = MiniEngine(client, async_scheduling)
        keys = BlockHasher(OFF_BS).keys([0] * 24)

        # 1. a plain 12-token request stores one offloaded block: GPU blocks (0, 1, 2)
        engine.run([0] * OFF_BS, [EOS])
        assert engine.loads == [] and engine.stores == [(0, 1, 2)]
        assert kv.lookup(keys) == 1

        # 2. reset the GPU prefix cache: the next request must load from the store
        engine.reset_prefix_cache()
        engine.loads, engine.stores, client.put_keys, client.put_parents = [], [], [], []

        # 3. 24 tokens; the lookup against the server finds the first offloaded block
        params = {"do_remote_decode": True} if remote_decode else None
        table = engine.run([0] * OFF_BS * 2, [0, EOS], params)
        assert engine.loads == [(0, 1, 2)]
        if remote_decode:
            assert engine.stores == [(0, 1, 2, 3, 4, 5)]
            assert client.put_keys == keys  # the loaded block went out again
            assert client.put_parents == [None]  # from the chain's head
        else:
            assert engine.stores == [(3, 4, 5)]
            assert client.put_keys == keys[1:]
            assert client.put_parents == [keys[0]]  # continues the loaded prefix
        assert engine.sched.pending_jobs == () and engine.sched.num_requests == 0

        # the store now holds the whole chain, byte for byte what the GPU cache holds
        assert kv.lookup(keys) == 2
        gpu = engine.transfer.gather(table[:6])
        assert [bytes(b) for b in kv.get(keys)] == [bytes(p.numpy()) for p in gpu]
        # ... and the loaded GPU blocks hold request 1's KV, not the -1 they were allocated with
        for layer, cache in enumerate(engine.caches):
            for pos in range(OFF_BS):
                got = cache[:, table[pos // GPU_BS], pos % GPU_BS]
                assert got[0].eq(kv_value(pos, 0, layer, 0)).all() and got[1].eq(kv_value(pos, 0, layer, 1)).all()


def test_a_request_longer_than_the_store_leaves_the_most_it_can_hold_findable(make_server) -> None:
    """A store of 12 offloaded blocks; a request of 12 prompt blocks decodes 8 more, each stored as
    it completes (naming the one before as parent). The later stores fail: the store keeps the
    request's first 12 blocks. (It kept evicting the block each new one hangs off: a decoder then
    found 11 of 20, each new block stored out of reach.)"""
    page = 4096
    srv = make_server("--capacity", str(12 * page), "--page-size", str(page))  # an offloaded block is 384 bytes
    with KVClient(srv.addr, namespace="long") as kv:
        client = RecordingClient(kv)
        engine = MiniEngine(client, async_scheduling=False, jobs_may_fail=True)
        prompt = [t % 7 for t in range(12 * OFF_BS)]
        decoded = [1] * (8 * OFF_BS) + [EOS]
        engine.run(prompt, decoded)
        keys = BlockHasher(OFF_BS).keys(prompt + decoded)[:20]
        assert len(client.put_keys) > 12 and engine.failed  # it tried, and the store refused
        assert kv.lookup(keys) == 12
        stats = kv.stats()["store"]
        assert stats["blocks"] == 12 and stats["stranded_blocks"] == 0


def test_pinned_lookups_that_no_load_takes_drop_their_leases(kv_server: ServerProcess) -> None:
    """With ``pin=True`` every lookup leases what it finds. A request that ends before its load,
    a lookup asked again, and a load shorter than what was found leave leases no GET drops:
    the executor's next run drops them (they used to pin their blocks for the lease time)."""
    caches = [torch.arange(2 * NUM_GPU_BLOCKS * GPU_BS * 2, dtype=torch.float32).reshape(2, NUM_GPU_BLOCKS, GPU_BS, 1, 2)
              for _ in range(LAYERS)]
    transfer = PagedKVTransfer(caches, FACTOR)
    sched = OffloadScheduler(BlockHasher(OFF_BS), GPU_BS)
    with KVClient(kv_server.addr, namespace="leases") as kv:
        ex = TransferExecutor(kv, transfer, sched, pin=True)
        prompt = list(range(100, 137))  # three full offloaded blocks
        sched.add_request("stored", prompt)
        keys = sched.keys("stored")
        kv.put(keys, [p.numpy().data for p in transfer.gather(list(range(9)))])
        sched.finish_request("stored")

        def leases() -> int:
            return int(kv.stats()["store"]["leases"])

        sched.add_request("aborted", prompt)
        assert sched.num_external_tokens("aborted", 0, ex.lookup) == 36
        sched.finish_request("aborted")  # before any allocation
        sched.add_request("asked-twice", prompt)
        sched.num_external_tokens("asked-twice", 0, ex.lookup)
        sched.add_request("takes-less", prompt)
        sched.num_external_tokens("takes-less", 0, ex.lookup)
        assert leases() == 9
        assert sched.num_external_tokens("asked-twice", 0, ex.lookup) == 36  # waited a step, asked again
        loads = [sched.on_alloc("asked-twice", list(range(20, 30)), 36),
                 sched.on_alloc("takes-less", list(range(30, 40)), 12)]  # the engine takes one block of three
        done = ex.run([job for job in loads if job is not None])
        assert done.failed == ()
        assert leases() == 0
