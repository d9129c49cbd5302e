"""The adapter's edges that the other tests_vllm files left open (a mutation review changed each
rule and nothing failed): keys and hit counts of tensor-parallel ranks, settings that must reach
the engine (lease, remote-decode dedup), namespaces of context-parallel and hybrid layouts, a load
missing a middle chunk, a lookup during a reset, a decode request's wait for a whole chain, and the
chunk a lookup starts from. Real servers; the real vLLM scheduler where the behaviour is the engine's."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from vllm.v1.kv_offload.base import GPULoadStoreSpec, LookupResult, make_offload_key
from vllm.v1.request import Request

from kvstore.client import KVClient
from kvstore.integrations.vllm import KVStoreLoadStoreSpec, KVStoreOffloadingSpec, default_namespace, store_key
from kvstore.server.process import ServerProcess
from test_vllm_parts import context, finish, keys, offloading_config, paged_caches
from vllm_harness import EOS_TOKEN_ID, Engine


def test_the_spec_keys_and_counts_chunks_by_its_ranks(kvstore_server: ServerProcess) -> None:
    """TP=2: the manager counts a chunk present only when both ranks' slices are (else the other
    rank's load fails: vLLM stops), and rank 1's worker stores under rank 1's key (else both ranks
    write one key and rank 1 loads rank 0's heads: wrong KV, no error)."""
    spec = KVStoreOffloadingSpec(offloading_config(
        {"kvstore_addr": kvstore_server.addr, "kvstore_namespace": "ranks"}, tp=2, rank=1))
    k0, k1 = keys(2)
    with KVClient(kvstore_server.addr, namespace="ranks") as kv:
        kv.put([store_key(k0, 0)], [b"rank 0 only"])
        m = spec.get_manager()
        assert m.lookup(k0, context("r", [k0, k1])) is LookupResult.MISS
        m.on_schedule_end(None)  # type: ignore[arg-type]
        w = spec.get_worker(paged_caches(seed=1)[1])
        assert w.submit_store(1, GPULoadStoreSpec([0, 1, 2], [3], [0]), KVStoreLoadStoreSpec([k1]))
        finish(w, 1)
        assert kv.exists([store_key(k1, 1), store_key(k1, 0)]) == [True, False]
        w.shutdown()
        m.shutdown()


def test_the_configured_lease_is_the_lookups(kvstore_server: ServerProcess) -> None:
    """kvstore_lease_ms reaches the scheduler's pins: a pin no load took ends after it."""
    spec = KVStoreOffloadingSpec(offloading_config(
        {"kvstore_addr": kvstore_server.addr, "kvstore_namespace": "lease", "kvstore_lease_ms": 300}))
    [k0] = keys(1)
    with KVClient(kvstore_server.addr, namespace="lease") as kv:
        kv.put([store_key(k0, 0)], [b"x"])
        m = spec.get_manager()
        assert m.lookup(k0, context("r", [k0])) is LookupResult.HIT  # pinned, never loaded nor unpinned
        assert kv.stats()["store"]["leases"] == 1
        time.sleep(0.8)
        assert kv.stats()["store"]["leases"] == 0  # (the server's default lease: 10 minutes)
        m.on_schedule_end(None)  # type: ignore[arg-type]  # (its unpin finds the lease gone)
        m.shutdown()


def test_remote_decode_dedup_setting_reaches_the_engine(make_engine: Callable[..., Engine],
                                                        kvstore_server: ServerProcess) -> None:
    engine = make_engine(kvstore_server.addr, kvstore_remote_decode_dedup=True)
    prompt = list(range(300, 336))  # 3 offloaded blocks
    engine.new_request(prompt)
    assert engine.run([EOS_TOKEN_ID]).stored == tuple(range(9))
    assert engine.scheduler.reset_prefix_cache()
    engine.new_request(prompt, kv_transfer_params={"max_load_tokens": 0, "do_remote_decode": True})
    assert engine.run([EOS_TOKEN_ID]).stored == ()  # all on the server: touched, not sent again


def test_the_default_namespace_tells_context_parallel_layouts_and_group_geometry_apart() -> None:
    """A pcp/dcp rank holds a slice of the tokens' KV, and a group's chunk geometry is its own:
    engines that differ there must not share chunks."""
    base = offloading_config()
    names = {default_namespace(base)}
    for change in ({"pcp_size": 2}, {"dcp_size": 2}):
        names.add(default_namespace(dataclasses.replace(base, parallel=dataclasses.replace(base.parallel, **change))))
    g0 = base.groups[0]
    for size in (4, 8):
        second = dataclasses.replace(g0, tokens_per_block=size, group_id=1)
        names.add(default_namespace(dataclasses.replace(base, groups=(g0, second))))
    assert len(names) == 5


def test_a_load_missing_some_of_its_chunks_fails(kvstore_server: ServerProcess) -> None:
    """The second of a load's two chunks is not on the server: the load fails. (A reused host
    buffer still holds an earlier load's valid payload: scattering it would put another chunk's
    KV in the GPU blocks without any error.)"""
    src, src_caches = paged_caches(seed=1)
    _, dst_caches = paged_caches(seed=None)
    a, b, gone = keys(3, b"m")
    config = offloading_config({"kvstore_addr": kvstore_server.addr})
    w = KVStoreOffloadingSpec(config).get_worker(src_caches)
    assert w.submit_store(1, GPULoadStoreSpec([0, 1, 2, 3, 4, 5], [6], [0]), KVStoreLoadStoreSpec([a, b]))
    finish(w, 1)
    d = KVStoreOffloadingSpec(config).get_worker(dst_caches)
    assert d.submit_load(2, KVStoreLoadStoreSpec([a, b]), GPULoadStoreSpec([6, 7, 8, 9, 10, 11], [6], [0]))
    finish(d, 2)  # (its host buffers go back to the pool, b's payload in the second)
    assert d.submit_load(3, KVStoreLoadStoreSpec([a, gone]), GPULoadStoreSpec([6, 7, 8, 9, 10, 11], [6], [0]))
    d.wait_all()
    [result] = d.get_finished()
    assert (result.job_id, result.success) == (3, False)
    w.shutdown()
    d.shutdown()


def test_a_lookup_during_a_reset_does_not_end_it_before_the_caught_store_lands(
        make_engine: Callable[..., Engine], kvstore_server: ServerProcess) -> None:
    """A reset flushes the namespace at once (other engines share it), and again once vLLM
    reports the stores it caught in flight. A reset (the engine's second: the first ended at once)
    catches a finished request's store in flight, and another request's lookup comes before vLLM
    reports that store done: the reset must not end there (a flush, then the store writes KV from
    before the reset, and nothing flushes it again)."""
    engine = make_engine(kvstore_server.addr, kvstore_flush_on_reset=True)
    assert engine.scheduler.reset_prefix_cache(reset_connector=True)  # (nothing in flight: over at once)
    assert not engine.manager._resetting
    earlier = engine.new_request(list(range(800, 824)))
    assert engine.run([EOS_TOKEN_ID]).stored  # stored before the reset
    prompt = list(range(900, 924))
    req = engine.new_request(prompt)
    engine.step(EOS_TOKEN_ID, like_vllm=True)  # prefill and EOS: finished, its store still queued
    with KVClient(kvstore_server.addr, namespace=engine.manager.client.namespace) as kv:
        keys_ = [store_key(k, 0) for k in _chunk_keys(req, 2)]
        assert kv.exists(keys_) == [False, False]
        assert engine.scheduler.reset_prefix_cache(reset_connector=True)
        # flushed at once, not once vLLM reports the store in flight (other engines share the namespace)
        assert kv.exists([store_key(k, 0) for k in _chunk_keys(earlier, 2)]) == [False, False]
        engine.new_request(list(range(5000, 5024)))  # its lookup comes while the store is in flight
        for _ in range(3):
            engine.step(None, like_vllm=True)
            engine.worker.wait_all()
        assert kv.exists(keys_) == [False, False]


def _chunk_keys(req: Request, n: int) -> list[bytes]:
    """The OffloadKeys of a request's first ``n`` chunks (3 GPU blocks each)."""
    return [make_offload_key(req.block_hashes[c * 3 + 2], 0) for c in range(n)]


def test_a_decode_request_waits_while_a_middle_chunk_of_its_chain_is_missing(
        make_engine: Callable[..., Engine], kvstore_server: ServerProcess) -> None:
    """Full attention: the chain is whole only when every chunk is there, not just its last (one
    in the middle not stored yet, or evicted and being stored again by the prefill)."""
    prefill = make_engine(kvstore_server.addr, namespace="mid")
    decode = make_engine(kvstore_server.addr, namespace="mid", kvstore_remote_prefill_wait_s=30)
    prompt = list(range(100, 150))  # four offloaded blocks and 2 tokens
    stored = prefill.new_request(prompt, kv_transfer_params={"do_remote_decode": True})
    prefill.run([EOS_TOKEN_ID])
    with KVClient(kvstore_server.addr, namespace="mid") as kv:
        [middle] = [store_key(k, 0) for k in _chunk_keys(stored, 2)[1:]]
        held = kv.get([middle])
        assert kv.delete([middle]) == 1
        waiting = decode.new_request(prompt, kv_transfer_params={"do_remote_prefill": True})
        for _ in range(3):
            assert waiting.request_id not in decode.step(None).num_scheduled_tokens
            time.sleep(0.03)
        kv.put([middle], [held[0]])
        time.sleep(0.05)
        assert set(decode.run([7, EOS_TOKEN_ID]).loaded) == set(range(12))


def test_a_lookup_asks_from_the_chunk_vllm_asks_about_not_from_the_prompts_start(
        make_engine: Callable[..., Engine], kvstore_server: ServerProcess) -> None:
    """The GPU prefix cache holds the prompt's first chunk, which the store has lost; the store
    has the next two: vLLM asks from the second chunk on, and they load."""
    engine = make_engine(kvstore_server.addr)
    prompt = list(range(400, 436))  # three offloaded blocks
    first = engine.new_request(prompt)
    assert engine.run([EOS_TOKEN_ID]).stored == tuple(range(9))
    with KVClient(kvstore_server.addr, namespace=engine.manager.client.namespace) as kv:
        chunk0 = store_key(_chunk_keys(first, 1)[0], 0)
        assert engine.scheduler.reset_prefix_cache()
        engine.new_request(prompt[:13])  # chunk 0 back in the GPU prefix cache (loaded from the store)
        assert engine.run([EOS_TOKEN_ID]).loaded == (0, 1, 2)
        assert kv.delete([chunk0]) == 1  # ... and gone from the store
        engine.new_request(prompt + [1])
        assert engine.run([0, EOS_TOKEN_ID]).loaded == (3, 4, 5, 6, 7, 8)
