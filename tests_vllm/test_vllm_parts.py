"""The adapter's parts one at a time: settings, the manager with several ranks, the worker
with partial chunks -- against a real kvstore server where one is needed.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
    LookupResult,
    ReqContext,
    make_offload_key,
)
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)

from kvstore.client import KVClient
from kvstore.integrations.vllm import (
    DEFAULT_ADDR,
    KVStoreLoadStoreSpec,
    KVStoreOffloadingManager,
    KVStoreOffloadingSpec,
    KVStoreOffloadingWorker,
    KVStoreSettings,
    default_namespace,
    layout_tag,
    store_key,
)
from kvstore.server.process import ServerProcess

GROUP = OffloadingGroupConfig(tokens_per_block=4, layer_names=("layer0", "layer1"), group_id=0)


def offloading_config(extra: dict[str, Any] | None = None, *, tp: int = 1, rank: int = 0,
                      model: str = "facebook/opt-125m") -> OffloadingConfig:
    return OffloadingConfig(
        groups=(GROUP,),
        worker_kv_bytes_per_block=512,
        enable_kv_cache_events=False,
        extra_config=extra or {},
        engine_id="engine-0",
        model=OffloadingModelConfig(name=model, dtype="float16", max_model_len=2048),
        cache=OffloadingCacheConfig(tokens_per_hash=4, blocks_per_chunk=3),
        parallel=OffloadingParallelConfig(rank=rank, world_size=tp, tp_size=tp, pp_size=1, pcp_size=1, dcp_size=1,
                                          data_parallel_index=0, data_parallel_size=1,
                                          data_parallel_rank_local=None, is_parallelism_agnostic=False),
    )


def keys(n: int, tag: bytes = b"h") -> list[bytes]:
    """``n`` distinct OffloadKeys of group 0 (32-byte "hashes")."""
    return [make_offload_key(tag + bytes([i]) * 31, 0) for i in range(n)]


def context(req_id: str, chain: list[bytes], params: dict[str, Any] | None = None) -> ReqContext:
    """A request context in which vLLM has recorded the chain's positions (12 tokens a chunk)."""
    ctx = ReqContext(req_id, params)
    for i, key in enumerate(chain):
        ctx.set_offload_key_position(key, (i + 1) * 12)  # type: ignore[arg-type]
    return ctx


# --------------------------------------------------------------------------- settings


def test_settings_defaults_and_namespace() -> None:
    config = offloading_config(tp=2)
    settings = KVStoreSettings.from_config(config)
    assert settings.addr == DEFAULT_ADDR
    assert settings.namespace == default_namespace(config) == "vllm/facebook/opt-125m/float16/auto/tp2pp1/b4x3/p2"
    assert (settings.token, settings.tls, settings.lease_ms) == (None, None, None)
    assert not settings.flush_on_reset and not settings.remote_decode_dedup and settings.shm is None
    assert settings.switch_interval_ms is None
    nulls = KVStoreSettings.from_config(offloading_config({  # (a template's null: the default)
        "kvstore_flush_on_reset": None, "kvstore_remote_decode_dedup": None, "kvstore_shm": None}))
    assert (nulls.flush_on_reset, nulls.remote_decode_dedup, nulls.shm) == (False, False, None)
    long_name = default_namespace(offloading_config(model="/models/" + "x" * 300))
    assert long_name.startswith("vllm/") and len(long_name) <= 256


def test_settings_from_extra_config(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_bytes(b"\xef\xbb\xbf# the engines' token\r\n\r\ns3cret\r\n")  # as kvstore-cli reads it: BOM, comment
    settings = KVStoreSettings.from_config(offloading_config({
        "kvstore_addr": "10.0.0.1:7600, 10.0.0.2:7600", "kvstore_namespace": "llama/tp0",
        "kvstore_token_file": str(token), "kvstore_lease_ms": "2500", "kvstore_timeout": 1,
        "kvstore_flush_on_reset": "true", "kvstore_tls": "/etc/ca.pem", "kvstore_remote_decode_dedup": 1,
        "kvstore_tls_server_name": "kvstore.internal", "kvstore_shm": "true", "kvstore_quarantine_s": "2.5",
        "kvstore_remote_prefill_wait_s": 0, "kvstore_switch_interval_ms": "0.5"}))
    assert settings.addr == ("10.0.0.1:7600", "10.0.0.2:7600")
    assert (settings.namespace, settings.token, settings.lease_ms, settings.timeout) == ("llama/tp0", "s3cret", 2500, 1.0)
    assert settings.flush_on_reset and settings.remote_decode_dedup and settings.tls == "/etc/ca.pem"
    assert settings.tls_server_name == "kvstore.internal" and settings.shm is True and settings.quarantine_s == 2.5
    assert settings.remote_prefill_wait_s == 0.0 and settings.switch_interval_ms == 0.5
    assert "s3cret" not in repr(settings)


@pytest.mark.parametrize("extra", [
    {"kvstore_addr": 7600},
    {"kvstore_addr": ""},
    {"kvstore_tls": 3},
    {"kvstore_token": "a", "kvstore_token_file": "b"},
    {"kvstore_namespace": "n" * 300},
    {"kvstore_token_file": "/nonexistent/token"},
    {"kvstore_shm": "ture"},
    {"kvstore_flush_on_reset": "maybe"},
    {"kvstore_remote_decode_dedup": 2},
    {"kvstore_tls_server_name": ""},
    {"kvstore_quarantine_s": -1},
    {"kvstore_quarantine_s": "soon"},
    {"kvstore_quarantine_s": float("nan")},
    {"kvstore_remote_prefill_wait_s": "a while"},
    {"kvstore_switch_interval_ms": 0},
    {"kvstore_switch_interval_ms": "fast"},
    {"kvstore_switch_interval_ms": float("inf")},
    {"kvstore_switch_interval_ms": True},  # (not 1 ms)
    {"kvstore_switch_interval_ms": 10**400},  # (OverflowError in float())
    {"kvstore_quarantine_s": True},
    {"kvstore_remote_prefill_wait_s": 10**400},
])
def test_bad_settings_are_refused(extra: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        KVStoreSettings.from_config(offloading_config(extra))


def test_the_spec_sets_pythons_switch_interval_only_when_asked(kvstore_server: ServerProcess) -> None:
    """The client's loop thread waits up to a switch interval for the interpreter lock at each
    wake-up while another thread runs Python (kvstore.bench.convoy); the setting shortens it."""
    before = sys.getswitchinterval()
    try:
        KVStoreOffloadingSpec(offloading_config({"kvstore_addr": kvstore_server.addr}))
        assert sys.getswitchinterval() == before
        KVStoreOffloadingSpec(offloading_config({"kvstore_addr": kvstore_server.addr,
                                                 "kvstore_switch_interval_ms": 0.5}))
        assert sys.getswitchinterval() == pytest.approx(0.0005)
    finally:
        sys.setswitchinterval(before)


def test_the_clients_connect_and_retry_within_their_timeout(make_server: Any) -> None:
    """A stalled server made each scheduler call wait connect_timeout (5 s) x 3 tries: 15 s per
    lookup where kvstore_timeout says 5."""
    server = make_server("--capacity", "1MiB")
    settings = KVStoreSettings.from_config(offloading_config({"kvstore_addr": server.addr, "kvstore_timeout": 3}))
    client = settings.client()
    try:
        aio = client._aio  # (the blocking client's settings live in its asyncio client)
        assert (aio.timeout, aio.connect_timeout, aio.retries, aio.quarantine) == (3.0, 1.0, 2, 0.0)
    finally:
        client.close()


def test_a_silent_server_costs_the_scheduler_one_timeout_not_one_per_request(make_server: Any) -> None:
    """A paused server cost each lookup, and each prepare_store's EXISTS, kvstore_timeout, every
    step (vLLM: 8.6 s per step for 4 requests). The scheduler's client now gives up on it for
    kvstore_quarantine_s; the workers' (whose failed load stops vLLM) always try."""
    import os
    import signal

    server = make_server("--capacity", "1MiB")
    spec = KVStoreOffloadingSpec.__new__(KVStoreOffloadingSpec)  # (its settings alone: no vLLM config)
    spec.settings = KVStoreSettings.from_config(offloading_config({"kvstore_addr": server.addr, "kvstore_timeout": 1}))
    spec.config, spec._manager, spec._worker = offloading_config(), None, None
    spec.blocks_per_chunk = 3
    m = spec.get_manager()
    assert m.client._aio.quarantine == 5.0
    chain = keys(4)
    os.kill(server.proc.pid, signal.SIGSTOP)
    try:
        assert m.lookup(chain[0], context("a", chain)) is LookupResult.MISS  # (one timeout)
        for i in range(3):  # other requests of the step, and the next steps: no wait, no round trip
            m.on_schedule_end(None)  # type: ignore[arg-type]
            assert m.lookup(chain[0], context(f"r{i}", chain)) is LookupResult.MISS
            assert m.prepare_store(chain, context(f"r{i}", chain)).keys_to_store == []  # skipped
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
    # The timed-out request took its connection down; a request that tried again would have connected
    # anew (the paused server's kernel queues the connects, and the server accepts them once resumed).
    with KVClient(server.addr, namespace="parts") as kv:
        assert kv.stats()["connections_total"] == 2  # the manager's first, and this one
    m.shutdown()


def test_vllm_reuses_a_stores_gpu_blocks_once_gathered_not_once_the_server_answers(make_server: Any) -> None:
    """vLLM waits for a store job before it hands the job's GPU blocks to another request. The wait
    lasted until the PUT was answered: a server that hung held every engine step reusing a block for
    the transfer timeout (30 s). The blocks are free once gathered into host buffers."""
    import os
    import signal

    server = make_server("--capacity", "1MiB")
    spec = KVStoreOffloadingSpec.__new__(KVStoreOffloadingSpec)  # (its settings alone: no vLLM config)
    spec.settings = KVStoreSettings.from_config(offloading_config({"kvstore_addr": server.addr}))
    spec.config, spec._manager, spec._worker = offloading_config(), None, None
    spec.blocks_per_chunk = 3
    src, caches = paged_caches(seed=5)
    w = spec.get_worker(caches)
    chain = keys(1, b"hung")
    gpu = GPULoadStoreSpec([0, 1, 2], [3], [0])
    before = [s[[0, 1, 2]].clone() for s in src]
    w.max_store_backlog = 1  # (one job's gathered chunks at a time)
    os.kill(server.proc.pid, signal.SIGSTOP)
    try:
        assert w.submit_store(1, gpu, KVStoreLoadStoreSpec(chain))
        w.wait({1})  # (waited out the 30 s transfer timeout before)
        assert w.get_finished() == []  # its PUT still waits for the server
        for s in src:  # vLLM reuses the blocks
            s[[0, 1, 2]] = 0
        other = keys(1, b"skipped")  # a store past the backlog's bound is skipped, not held
        assert w.submit_store(3, GPULoadStoreSpec([6, 7, 8], [3], [0]), KVStoreLoadStoreSpec(other))
        w.wait({3})
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
    w.wait_all()
    assert sorted((r.job_id, r.success) for r in w.get_finished()) == [(1, True), (3, True)]
    assert w.store_failures == 1
    with KVClient(server.addr, namespace=spec.settings.namespace) as kv:
        assert kv.exists([store_key(chain[0], 0), store_key(other[0], 0)]) == [True, False]
    assert w.submit_load(2, KVStoreLoadStoreSpec(chain), GPULoadStoreSpec([3, 4, 5], [3], [0]))
    finish(w, 2)
    for s, b in zip(src, before):  # stored: what the blocks held before they were reused
        assert torch.equal(s[[3, 4, 5]], b)


def test_a_silent_server_costs_the_workers_stores_one_timeout_not_one_per_job(make_server: Any,
                                                                              monkeypatch: Any) -> None:
    """The worker stores on one thread: with the server paused, each queued store job waited the
    transfer timeout (30 s at least) in turn, its GPU blocks held. Its stores now give up on a
    silent server for kvstore_quarantine_s; its loads still try."""
    import os
    import signal

    import kvstore.integrations.vllm as adapter

    monkeypatch.setattr(adapter, "MIN_TRANSFER_TIMEOUT_S", 1.0)
    server = make_server("--capacity", "1MiB")
    spec = KVStoreOffloadingSpec.__new__(KVStoreOffloadingSpec)  # (its settings alone: no vLLM config)
    spec.settings = KVStoreSettings.from_config(offloading_config({"kvstore_addr": server.addr, "kvstore_timeout": 1}))
    spec.config, spec._manager, spec._worker = offloading_config(), None, None
    spec.blocks_per_chunk = 3
    src, caches = paged_caches(seed=3)
    w = spec.get_worker(caches)
    chains = [keys(1, b"silent%d" % i) for i in range(4)]
    gpu = GPULoadStoreSpec([0, 1, 2], [3], [0])
    assert w.submit_store(1, gpu, KVStoreLoadStoreSpec(chains[0]))
    finish(w, 1)  # (both clients connected before the pause)
    assert w.submit_load(2, KVStoreLoadStoreSpec(chains[0]), GPULoadStoreSpec([3, 4, 5], [3], [0]))
    finish(w, 2)
    os.kill(server.proc.pid, signal.SIGSTOP)
    try:
        for job in (3, 4, 5):
            assert w.submit_store(job, gpu, KVStoreLoadStoreSpec(chains[job - 2]))
        w.wait_all()
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
    assert sorted((r.job_id, r.success) for r in w.get_finished()) == [(3, True), (4, True), (5, True)]
    assert w.store_failures == 3  # (reported done: the chunks stay uncached)
    assert w.submit_load(6, KVStoreLoadStoreSpec(chains[0]), GPULoadStoreSpec([6, 7, 8], [3], [0]))
    finish(w, 6)  # the load client was not quarantined
    for s in src:
        assert torch.equal(s[[6, 7, 8]], s[[0, 1, 2]])
    with KVClient(server.addr, namespace="parts") as kv:
        # the worker's two and this one: no store after the first timeout connected again (each
        # did, 9 connections in all, and waited out its timeout)
        assert kv.stats()["connections_total"] == 3
    w.shutdown()


def test_spec_refuses_canonical_layout() -> None:
    import dataclasses

    with pytest.raises(ValueError, match="canonical_layout"):
        KVStoreOffloadingSpec(dataclasses.replace(offloading_config(), canonical_layout=True))


def test_spec_fails_fast_without_a_server(make_server: Any) -> None:
    from kvstore.errors import TransportError

    server = make_server("--capacity", "1MiB")
    addr = server.addr
    server.stop()
    spec = KVStoreOffloadingSpec(offloading_config({"kvstore_addr": addr, "kvstore_timeout": 2}))
    with pytest.raises(TransportError, match=addr):
        spec.get_manager()


# --------------------------------------------------------------------------- the manager


@pytest.fixture
def kv(kvstore_server: ServerProcess) -> Any:
    with KVClient(kvstore_server.addr, namespace="parts") as client:
        yield client


def manager(addr: str, world_size: int = 1) -> KVStoreOffloadingManager:
    client = KVClient(addr, namespace="parts")
    client.connect()
    return KVStoreOffloadingManager(client, world_size=world_size, groups=(GROUP,), blocks_per_chunk=3)


def test_a_chunk_is_present_only_when_every_rank_stored_it(kv: KVClient, kvstore_server: ServerProcess) -> None:
    m = manager(kvstore_server.addr, world_size=2)
    k0, k1 = keys(2)
    ctx = context("r", [k0, k1])
    kv.put([store_key(k0, 0)], [b"rank0"])
    assert m.lookup(k0, ctx) is LookupResult.MISS  # rank 1's slice is missing
    m.on_schedule_end(None)  # type: ignore[arg-type]

    kv.put([store_key(k0, 1), store_key(k1, 0)], [b"rank1", b"rank0"])
    assert m.lookup(k0, ctx) is LookupResult.HIT
    assert m.lookup(k1, ctx) is LookupResult.MISS
    out = m.prepare_store([k0, k1], ctx)
    assert out is not None and out.keys_to_store == [k1] and out.evicted_keys == []
    m.complete_store([k1], ctx)
    m.on_schedule_end(None)  # type: ignore[arg-type]
    m.shutdown()


def test_lookup_answers_from_one_round_trip_and_caches_per_step(kv: KVClient,
                                                                kvstore_server: ServerProcess) -> None:
    m = manager(kvstore_server.addr)
    chain = keys(6)
    kv.put([store_key(k, 0) for k in chain[:4]], [b"x"] * 4)
    ctx = context("r", chain)
    assert [m.lookup(k, ctx) for k in chain] == [LookupResult.HIT] * 4 + [LookupResult.MISS] * 2
    assert m.round_trips == 2  # one LOOKUP for chain[0..5]; chain[5] is past the first miss: asked again
    spec = m.prepare_load(chain[:3], ctx)
    assert isinstance(spec, KVStoreLoadStoreSpec) and spec.keys == chain[:3]
    m.on_schedule_end(None)  # type: ignore[arg-type]  # unpins chain[3], which no load took
    assert m.round_trips == 3


def test_stores_are_deduplicated_against_the_server_and_in_flight(kv: KVClient,
                                                                  kvstore_server: ServerProcess) -> None:
    m = manager(kvstore_server.addr)
    chain = keys(3)
    kv.put([store_key(chain[0], 0)], [b"x"])
    plain, pd = context("a", chain), context("b", chain, {"do_remote_decode": True})
    out = m.prepare_store(chain, plain)
    assert out is not None and out.keys_to_store == chain[1:]
    out = m.prepare_store(chain, context("c", chain))  # what is being stored right now is left to that store
    assert out is not None and out.keys_to_store == []
    # P/D stores all, also what another request is storing: that store may fail (nobody hears of
    # it), and the remote decoder needs the whole prompt
    out = m.prepare_store(chain, pd)
    assert out is not None and out.keys_to_store == chain
    m.complete_store(chain[1:], plain)
    m.complete_store(chain, pd)
    assert not m._storing
    out = m.prepare_store(chain, plain)
    assert out is not None and out.keys_to_store == chain[1:]


def test_a_store_names_each_chunks_predecessor(kv: KVClient, kvstore_server: ServerProcess) -> None:
    m = manager(kvstore_server.addr)
    chain = keys(5)
    kv.put([store_key(k, 0) for k in chain[:2]], [b"x"] * 2)
    out = m.prepare_store(chain, context("a", chain))  # the delta after a stored prefix
    assert out is not None and isinstance(out.store_spec, KVStoreLoadStoreSpec)
    assert out.store_spec.keys == chain[2:] and out.store_spec.parents == chain[1:4]
    m.complete_store(chain[2:], context("a", chain))
    out = m.prepare_store(chain, context("b", chain, {"do_remote_decode": True}))  # everything
    assert out is not None and isinstance(out.store_spec, KVStoreLoadStoreSpec)
    assert out.store_spec.parents == [None, *chain[:4]]
    out = m.prepare_store(keys(3, b"z"), ReqContext("c"))  # vLLM recorded no positions: not known
    assert out is not None and isinstance(out.store_spec, KVStoreLoadStoreSpec)
    assert out.store_spec.parents == [None] * 3
    with pytest.raises(ValueError, match="parents"):
        KVStoreLoadStoreSpec(chain, chain[:2])
    m.shutdown()


def test_remote_decode_dedup_touches_instead_of_resending(kv: KVClient, kvstore_server: ServerProcess) -> None:
    client = KVClient(kvstore_server.addr, namespace="parts")
    client.connect()
    m = KVStoreOffloadingManager(client, groups=(GROUP,), blocks_per_chunk=3, remote_decode_dedup=True)
    chain = keys(3)
    kv.put([store_key(k, 0) for k in chain[:2]], [b"x", b"y"])
    lookups = kv.stats()["store"]["lookups"]
    out = m.prepare_store(chain, context("b", chain, {"do_remote_decode": True}))
    assert out is not None and out.keys_to_store == chain[2:]
    assert kv.stats()["store"]["lookups"] == lookups + 1  # the two stored chunks were touched
    m.shutdown()


def test_an_unreachable_server_reads_as_empty(make_server: Any) -> None:
    server = make_server("--capacity", "1MiB")
    m = manager(server.addr)
    server.stop()
    chain = keys(2)
    ctx = context("r", chain)
    assert m.lookup(chain[0], ctx) is LookupResult.MISS
    out = m.prepare_store(chain, ctx)  # skipped: None would have vLLM ask (and warn) again every step
    assert out is not None and out.keys_to_store == [] and not m._storing
    m.on_schedule_end(None)  # type: ignore[arg-type]
    m.shutdown()


def test_with_one_of_two_servers_down_the_other_still_gets_its_stores(make_server: Any) -> None:
    """prepare_store's EXISTS failed whole while any server was down, so no server got a block."""
    from kvstore.client.sharding import Ring

    servers = [make_server("--capacity", "1MiB") for _ in range(2)]
    addrs = [s.addr for s in servers]
    client = KVClient(addrs, namespace="parts", retries=0, connect_timeout=2)
    client.connect()
    m = KVStoreOffloadingManager(client, groups=(GROUP,), blocks_per_chunk=3)
    chain = keys(12)
    on_live = [Ring(addrs).node_of(store_key(k, 0)) == 0 for k in chain]
    assert any(on_live) and not all(on_live)
    with KVClient(addrs[0], namespace="parts") as live:
        live.put([store_key(k, 0) for k, up in zip(chain, on_live) if up][:1], [b"x"])
    servers[1].stop()
    out = m.prepare_store(chain, context("r", chain))
    assert out is not None  # (was None: nothing stored anywhere)
    first_live = on_live.index(True)
    assert out.keys_to_store == chain[:first_live] + chain[first_live + 1:]  # all but the one present
    m.complete_store(out.keys_to_store, context("r", chain))
    m.shutdown()


# --------------------------------------------------------------------------- the worker

NUM_BLOCKS = 16
PAGE = 64  # bytes of one GPU block of one layer


# The CUDA case exists only where a GPU does (never in CI): no skipped test stands in for it.
DEVICES = pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))


def paged_caches(seed: int | None, device: str = "cpu") -> tuple[list[torch.Tensor], CanonicalKVCaches]:
    """Two layers' "GPU" caches as vLLM hands them to a worker: (blocks, page bytes) int8."""
    gen = torch.Generator().manual_seed(seed or 0)
    tensors = [
        (torch.randint(-128, 127, (NUM_BLOCKS, PAGE), dtype=torch.int8, generator=gen) if seed is not None
         else torch.zeros(NUM_BLOCKS, PAGE, dtype=torch.int8)).to(device)
        for _ in range(2)
    ]
    canonical = CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(t, PAGE) for t in tensors],
        group_data_refs=[[CanonicalKVCacheRef(0, PAGE), CanonicalKVCacheRef(1, PAGE)]],
    )
    return tensors, canonical


def worker(addr: str, caches: CanonicalKVCaches, rank: int = 0, namespace: str = "parts",
           layout_tag: str | None = None) -> KVStoreOffloadingWorker:
    client = KVClient(addr, namespace=namespace)
    client.connect()
    return KVStoreOffloadingWorker(caches, client, blocks_per_chunk=3, rank=rank, layout_tag=layout_tag)


def finish(w: KVStoreOffloadingWorker, job_id: int) -> None:
    w.wait_all()  # (wait() returns once a store has read its GPU blocks; its PUT may still run)
    [result] = w.get_finished()
    assert (result.job_id, result.success) == (job_id, True)


@DEVICES
def test_worker_round_trip_with_a_partial_first_chunk(kv: KVClient, kvstore_server: ServerProcess,
                                                      device: str) -> None:
    src, src_caches = paged_caches(seed=1, device=device)
    dst, dst_caches = paged_caches(seed=None, device=device)
    chunk = keys(2)
    prefill, decode = worker(kvstore_server.addr, src_caches, rank=1), worker(kvstore_server.addr, dst_caches, rank=1)

    # Store two chunks: GPU blocks 5, 6, 7 and 2, 3, 4 (logical blocks 0..5 of a request).
    assert prefill.submit_store(1, GPULoadStoreSpec([5, 6, 7, 2, 3, 4], [6], [0]), KVStoreLoadStoreSpec(chunk))
    finish(prefill, 1)
    assert kv.exists([store_key(k, 1) for k in chunk]) == [True, True]  # under this rank's keys
    assert kv.exists([store_key(k, 0) for k in chunk]) == [False, False]

    # Load logical blocks 1..5 (block 0 is in the GPU prefix cache): the first chunk is entered
    # one block in.
    assert decode.submit_load(2, KVStoreLoadStoreSpec(chunk), GPULoadStoreSpec([10, 11, 12, 13, 14], [5], [1]))
    finish(decode, 2)
    for s, d in zip(src, dst):
        s, d = s.cpu(), d.cpu()
        assert torch.equal(d[[10, 11, 12, 13, 14]], s[[6, 7, 2, 3, 4]])
        assert not d[:10].any() and not d[15:].any()  # nothing else written

    # Again, into other blocks: the worker reuses its host buffers.
    assert decode.submit_load(3, KVStoreLoadStoreSpec(chunk[1:]), GPULoadStoreSpec([0, 1, 15], [3], [3]))
    finish(decode, 3)
    for s, d in zip(src, dst):
        assert torch.equal(d[[0, 1, 15]].cpu(), s[[2, 3, 4]].cpu())
    prefill.shutdown()
    decode.shutdown()


def test_a_stored_continuation_is_evicted_before_its_prefix(make_server: Any) -> None:
    """Room for 4 chunks (one 4 KiB page each): prefix A (2 chunks), its continuation B (2),
    then 2 chunks of another request C must evict 2. With B's parent named (as prepare_store
    does), B goes first, as a chain's tail; without it, B counts as a newer chain and A goes."""
    srv = make_server("--capacity", "16KiB", "--page-size", "4KiB")
    _, caches = paged_caches(seed=2)
    a, b, c = keys(2, b"a"), keys(2, b"b"), keys(2, b"c")
    gpu = GPULoadStoreSpec([0, 1, 2, 3, 4, 5], [6], [0])
    for ns, parents in (("linked", [a[1], b[0]]), ("unlinked", None)):
        w = worker(srv.addr, caches, namespace=ns)
        assert w.submit_store(1, gpu, KVStoreLoadStoreSpec(a, [None, a[0]]))
        finish(w, 1)
        assert w.submit_store(2, gpu, KVStoreLoadStoreSpec(b, parents))
        finish(w, 2)
        assert w.submit_store(3, gpu, KVStoreLoadStoreSpec(c))
        finish(w, 3)
        client = KVClient(srv.addr, namespace=ns)
        stored = client.exists([store_key(k, 0) for k in a + b + c])
        if parents:
            assert stored == [True, True, False, False, True, True]
            assert client.lookup([store_key(k, 0) for k in a + b]) == 2
        else:
            assert stored == [False, False, True, True, True, True]
        client.flush(ns)
        client.close()
        w.shutdown()


def test_a_store_with_a_gap_puts_each_stretch_behind_its_own_predecessor(make_server: Any) -> None:
    # Chunks 0, 1 and 3 of a chain (2 is stored already): 3 is put with 2 as its parent, not 1.
    srv = make_server("--capacity", "16KiB", "--page-size", "4KiB")
    _, caches = paged_caches(seed=3)
    chain = keys(4, b"g")
    w = worker(srv.addr, caches, namespace="gap")
    client = KVClient(srv.addr, namespace="gap")
    client.put([store_key(chain[2], 0)], [b"\x07" * 384])
    spec = KVStoreLoadStoreSpec([chain[0], chain[1], chain[3]], [None, chain[0], chain[2]])
    assert w.submit_store(1, GPULoadStoreSpec([0, 1, 2, 3, 4, 5, 6, 7, 8], [9], [0]), spec)
    finish(w, 1)
    puts = client.stats()["requests"]["put"]
    assert puts == 3  # the test's own, then one per stretch
    client.put(keys(1, b"x"), [b"\x08" * 384])  # a full store: one block must go -- the chain's tail, chunk 3
    assert client.exists([store_key(k, 0) for k in chain]) == [True, True, True, False]
    assert client.lookup([store_key(k, 0) for k in chain]) == 3
    client.close()
    w.shutdown()


def test_a_chunk_of_another_kv_dtype_or_layout_is_refused_not_loaded(kvstore_server: ServerProcess) -> None:
    """vLLM hands workers int8 pages: an fp16 engine's chunk has the bytes, size and shape a bf16
    (or HND) engine expects, and was loaded as its own -- garbage values, reported a success -- by
    engines sharing a namespace. The KV dtype and layout are in the payload's fingerprint now."""
    src, src_caches = paged_caches(seed=1)
    chunk = keys(1)
    prefill = worker(kvstore_server.addr, src_caches, namespace="shared", layout_tag="float16/NHD")
    for job, tag in enumerate(["bfloat16/NHD", "float16/HND", None], start=2):
        assert prefill.submit_store(10 + job, GPULoadStoreSpec([0, 1, 2], [3], [0]), KVStoreLoadStoreSpec(chunk))
        finish(prefill, 10 + job)
        dst, dst_caches = paged_caches(seed=None)
        decode = worker(kvstore_server.addr, dst_caches, namespace="shared", layout_tag=tag)
        assert decode.submit_load(job, KVStoreLoadStoreSpec(chunk), GPULoadStoreSpec([3, 4, 5], [3], [0]))
        decode.wait({job})
        [result] = decode.get_finished()
        assert (result.job_id, result.success) == (job, False), tag
        assert not any(d.any() for d in dst)  # nothing scattered
        with KVClient(kvstore_server.addr, namespace="shared") as kv:  # and deleted: no lookup offers it again
            assert kv.exists([store_key(chunk[0], 0)]) == [False]
        decode.shutdown()
    assert prefill.submit_store(1, GPULoadStoreSpec([0, 1, 2], [3], [0]), KVStoreLoadStoreSpec(chunk))
    finish(prefill, 1)
    dst, dst_caches = paged_caches(seed=None)
    decode = worker(kvstore_server.addr, dst_caches, namespace="shared", layout_tag="float16/NHD")
    assert decode.submit_load(9, KVStoreLoadStoreSpec(chunk), GPULoadStoreSpec([3, 4, 5], [3], [0]))
    finish(decode, 9)  # the same dtype and layout load
    assert all(torch.equal(d[[3, 4, 5]], s[[0, 1, 2]]) for s, d in zip(src, dst))
    prefill.shutdown()
    decode.shutdown()


def test_the_spec_tags_payloads_with_the_engines_kv_dtype_and_layout(kvstore_server: ServerProcess) -> None:
    config = offloading_config({"kvstore_addr": kvstore_server.addr})
    assert layout_tag(config) == f"{config.model.dtype}/{config.kv_cache_layout or 'auto'}"
    bf16 = dataclasses.replace(config, model=dataclasses.replace(config.model, dtype="bfloat16"))
    hnd = dataclasses.replace(config, kv_cache_layout="HND")
    assert len({layout_tag(config), layout_tag(bf16), layout_tag(hnd)}) == 3
    headers = []
    for c in (config, bf16, hnd):  # the spec's worker puts its engine's tag in its payloads
        w = KVStoreOffloadingSpec(c).get_worker(paged_caches(seed=None)[1])
        headers.append(bytes(w._transfers[0]._header.numpy()))
        w.shutdown()
    assert len(set(headers)) == 3


def test_a_store_that_crashes_is_counted_not_reported_as_failed(kvstore_server: ServerProcess,
                                                                 monkeypatch: Any) -> None:
    """vLLM 0.33 stops the engine on a transfer reported as failed. A store is a cache fill: one
    that crashes (a bug, an error of the device in its gather, a put that raises) is logged and
    counted, its chunks stay uncached, its host buffers are given back, and the next store works."""
    src, caches = paged_caches(seed=9)
    w = worker(kvstore_server.addr, caches)
    transfer = w._transfers[0]
    real_gather, real_put = transfer.gather, w._store_client.put

    def gather_fails(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("an error of the device")

    def put_fails(*args: Any, **kwargs: Any) -> None:
        raise TypeError("a bug")

    chains = [keys(1, b"crash%d" % i) for i in range(3)]
    gpu = GPULoadStoreSpec([0, 1, 2], [3], [0])
    monkeypatch.setattr(transfer, "gather", gather_fails)
    assert w.submit_store(1, gpu, KVStoreLoadStoreSpec(chains[0]))
    finish(w, 1)
    monkeypatch.setattr(transfer, "gather", real_gather)
    monkeypatch.setattr(w._store_client, "put", put_fails)
    assert w.submit_store(2, gpu, KVStoreLoadStoreSpec(chains[1]))
    w.wait_all()
    [result] = w.get_finished()
    assert (result.job_id, result.success, result.transfer_size) == (2, True, None)  # (vLLM's metrics: nothing moved)
    monkeypatch.setattr(w._store_client, "put", real_put)
    assert w.store_failures == 2 and w._backlog == 0
    assert w.submit_store(3, gpu, KVStoreLoadStoreSpec(chains[2]))
    finish(w, 3)
    with KVClient(kvstore_server.addr, namespace="parts") as kv:
        assert kv.exists([store_key(c[0], 0) for c in chains]) == [False, False, True]
    assert w.submit_load(4, KVStoreLoadStoreSpec(chains[2]), GPULoadStoreSpec([3, 4, 5], [3], [0]))
    finish(w, 4)
    for s in src:
        assert torch.equal(s[[3, 4, 5]], s[[0, 1, 2]])
    w.shutdown()


def test_worker_reports_a_missing_chunk_as_a_failed_load(kvstore_server: ServerProcess) -> None:
    _, caches = paged_caches(seed=None)
    w = worker(kvstore_server.addr, caches)
    assert w.submit_load(7, KVStoreLoadStoreSpec(keys(1)), GPULoadStoreSpec([1, 2, 3], [3], [0]))
    w.wait({7})
    [result] = w.get_finished()
    assert (result.job_id, result.success) == (7, False)
    w.shutdown()


def test_worker_rejects_a_spec_that_does_not_add_up(kvstore_server: ServerProcess) -> None:
    _, caches = paged_caches(seed=None)
    w = worker(kvstore_server.addr, caches)
    with pytest.raises(ValueError, match="does not match"):
        w.submit_store(1, GPULoadStoreSpec([1, 2, 3], [3], [0]), KVStoreLoadStoreSpec(keys(2)))
    w.shutdown()
