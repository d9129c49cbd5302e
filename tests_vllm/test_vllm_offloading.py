"""vLLM 0.33's real Scheduler/AsyncScheduler and OffloadingConnector, offloading to a real
kvstore server through :mod:`kvstore.integrations.vllm`.

The seed scenario (P/D prefill stores everything): with GPU blocks of 4 tokens and
offloaded blocks of 12, a 12-token request stores GPU blocks (0, 1, 2); after the GPU
prefix cache is reset, a 24-token request finds the first offloaded block on the server,
loads GPU blocks (0, 1, 2), and then stores (0, ..., 5) if it has ``do_remote_decode`` --
only the new (3, 4, 5) if not.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from vllm.v1.kv_offload.base import make_offload_key
from vllm import SamplingParams
from vllm.v1.request import Request, RequestStatus

from kvstore.client import KVClient
from kvstore.client.sharding import Ring
from kvstore.engine.transfer import HEADER_SIZE
from kvstore.errors import KVStoreError
from kvstore.integrations.vllm import store_key
from kvstore.server.process import ServerProcess
from vllm_harness import EOS_TOKEN_ID, LAYERS, Engine

BLOCKS_PER_CHUNK = 3  # offloaded block of 12 tokens / GPU block of 4
SYNC_ASYNC = pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
REMOTE_DECODE = pytest.mark.parametrize("remote_decode", [True, False], ids=["do_remote_decode", "plain"])


# --------------------------------------------------------------------------- helpers


def chunk_key(req: Request, chunk: int, rank: int = 0) -> bytes:
    """The server key of a request's offloaded block, derived from vLLM's own block hashes."""
    last_gpu_block = chunk * BLOCKS_PER_CHUNK + BLOCKS_PER_CHUNK - 1
    return store_key(make_offload_key(req.block_hashes[last_gpu_block], 0), rank)


def gpu_bytes(engine: Engine, block_ids: list[int]) -> list[bytes]:
    """Per layer, the raw bytes of the given GPU blocks, in order."""
    return [engine.kv_caches[name][block_ids].contiguous().view(torch.uint8).numpy().tobytes() for name in LAYERS]


def payload_layers(payload: bytes | bytearray) -> list[bytes]:
    """Split a stored payload (header, then each layer's pages of the chunk) by layer."""
    body = bytes(payload[HEADER_SIZE:])
    n = len(body) // len(LAYERS)
    assert n * len(LAYERS) == len(body)
    return [body[i * n : (i + 1) * n] for i in range(len(LAYERS))]


def wipe_gpu_cache(engine: Engine) -> None:
    """Forget every GPU block's contents: what a load brings back can only come from the store."""
    for cache in engine.kv_caches.values():
        cache.fill_(0.0)


def count_calls(client: KVClient, *names: str) -> dict[str, list[int]]:
    """Record the batch sizes of some client methods (wraps them in place)."""
    calls: dict[str, list[int]] = {name: [] for name in names}
    for name in names:
        method = getattr(client, name)

        def spy(keys: Any, *args: Any, _m: Callable[..., Any] = method, _n: str = name, **kwargs: Any) -> Any:
            calls[_n].append(len(keys))
            return _m(keys, *args, **kwargs)

        setattr(client, name, spy)
    return calls


def nothing_listens() -> str:
    """A loopback address nothing listens on (a server that is down)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"  # (closed again: nothing listens there)


# --------------------------------------------------------------------------- the seed scenario


@SYNC_ASYNC
@REMOTE_DECODE
def test_prefill_for_remote_decode_stores_every_block(make_engine: Callable[..., Engine],
                                                      kvstore_server: ServerProcess, async_scheduling: bool,
                                                      remote_decode: bool) -> None:
    engine = make_engine(kvstore_server.addr, async_scheduling=async_scheduling)
    kv = KVClient(kvstore_server.addr, namespace=engine.manager.client.namespace)

    # A 12-token request stores one offloaded block: GPU blocks (0, 1, 2).
    first = engine.new_request([0] * 12)
    log = engine.run([EOS_TOKEN_ID])
    assert log.stored == (0, 1, 2)
    assert log.loaded == ()
    [store] = log.stores
    original = gpu_bytes(engine, store.gpu_block_ids)
    [payload] = kv.get([chunk_key(first, 0)])
    assert payload is not None and payload_layers(payload) == original  # real bytes on the server

    # Reset the GPU prefix cache and wipe the GPU KV cache: the block now lives only in kvstore.
    assert engine.scheduler.reset_prefix_cache()
    wipe_gpu_cache(engine)

    # 24 tokens: the lookup finds the first offloaded block on the server, which is loaded ...
    params = {"do_remote_decode": True} if remote_decode else None
    second = engine.new_request([0] * 24, kv_transfer_params=params)
    log = engine.run([0])
    assert log.loaded == (0, 1, 2)
    assert log.stored == ()
    [load] = log.loads
    assert gpu_bytes(engine, load.gpu_block_ids) == original  # the server's bytes, back in the "GPU"

    # ... and then a P/D prefill stores all its blocks, the loaded ones too; a plain one the new ones.
    log = engine.run([EOS_TOKEN_ID])
    assert log.stored == ((0, 1, 2, 3, 4, 5) if remote_decode else (3, 4, 5))
    assert log.loaded == ()
    second_blocks = [i for t in log.stores for i in t.gpu_block_ids]
    if not remote_decode:
        second_blocks = load.gpu_block_ids + second_blocks
    for chunk in (0, 1):
        [payload] = kv.get([chunk_key(second, chunk)])
        ids = second_blocks[chunk * BLOCKS_PER_CHUNK : (chunk + 1) * BLOCKS_PER_CHUNK]
        assert payload is not None and payload_layers(payload) == gpu_bytes(engine, ids)
    assert engine.worker.store_failures == 0
    kv.close()


@SYNC_ASYNC
@REMOTE_DECODE
def test_a_prompt_computed_over_several_steps_stores_as_the_seed_says(make_engine: Callable[..., Engine],
                                                                      kvstore_server: ServerProcess,
                                                                      async_scheduling: bool,
                                                                      remote_decode: bool) -> None:
    """The seed scenario with the prompt split over steps (8 tokens each: a chunked prefill), its
    two-block prefix loaded from the store first. (The harness handed back a sampled token for each
    step of a partial prefill, which vLLM's runner discards: no test split a prompt before.)"""
    engine = make_engine(kvstore_server.addr, async_scheduling=async_scheduling)
    prefix = list(range(500, 524))  # two offloaded blocks
    engine.new_request(prefix)
    assert engine.run([EOS_TOKEN_ID]).stored == tuple(range(6))
    assert engine.scheduler.reset_prefix_cache()
    wipe_gpu_cache(engine)
    engine.scheduler.max_num_scheduled_tokens = 8
    params = {"do_remote_decode": True} if remote_decode else None
    req = engine.new_request(prefix + list(range(600, 640)), kv_transfer_params=params)  # 64 tokens: 5 blocks + 4
    log = engine.run([EOS_TOKEN_ID])
    assert log.loaded == (0, 1, 2, 3, 4, 5)
    assert sorted(log.stored) == list(range(15) if remote_decode else range(6, 15))
    assert len(log.stores) > 1  # (stored as the steps computed the blocks, not at the end)
    blocks = {i: b for t in log.loads + log.stores for i, b in zip(t.gpu_block_indexes, t.gpu_block_ids)}
    with KVClient(kvstore_server.addr, namespace=engine.manager.client.namespace) as kv:
        for chunk in range(5):
            [payload] = kv.get([chunk_key(req, chunk)])
            ids = [blocks[i] for i in range(chunk * BLOCKS_PER_CHUNK, (chunk + 1) * BLOCKS_PER_CHUNK)]
            assert payload is not None and payload_layers(payload) == gpu_bytes(engine, ids)
    assert engine.worker.store_failures == 0 and not engine.manager._storing


@SYNC_ASYNC
@REMOTE_DECODE
def test_a_request_preempted_mid_prompt_is_stored_whole_once_it_resumes(make_engine: Callable[..., Engine],
                                                                        kvstore_server: ServerProcess,
                                                                        async_scheduling: bool,
                                                                        remote_decode: bool) -> None:
    engine = make_engine(kvstore_server.addr, async_scheduling=async_scheduling, num_gpu_blocks=30)
    engine.scheduler.max_num_scheduled_tokens = 16
    decoding = engine.new_request(list(range(100, 144)))  # 11 GPU blocks, and growing as it decodes
    params = {"do_remote_decode": True} if remote_decode else None
    req = engine.new_request(list(range(200, 264)), kv_transfer_params=params)  # 16 GPU blocks
    preempted = False
    for _ in range(80):  # both cannot fit: one is preempted (its blocks freed), then runs again
        preempted |= bool(engine.step(0).preempted_req_ids)
        if preempted and req.num_computed_tokens >= 64:
            break
    assert preempted
    engine.scheduler.finish_requests(decoding.request_id, RequestStatus.FINISHED_ABORTED)
    engine.run([EOS_TOKEN_ID])
    with KVClient(kvstore_server.addr, namespace=engine.manager.client.namespace) as kv:
        assert kv.lookup([chunk_key(req, c) for c in range(5)]) == 5
    assert engine.worker.store_failures == 0 and not engine.manager._storing


@SYNC_ASYNC
@REMOTE_DECODE
def test_a_request_aborted_mid_prompt_leaves_no_store_behind(make_engine: Callable[..., Engine],
                                                              kvstore_server: ServerProcess, async_scheduling: bool,
                                                              remote_decode: bool) -> None:
    engine = make_engine(kvstore_server.addr, async_scheduling=async_scheduling)
    engine.scheduler.max_num_scheduled_tokens = 12
    prompt = list(range(900, 960))  # 5 offloaded blocks
    params = {"do_remote_decode": True} if remote_decode else None
    req = engine.new_request(prompt, kv_transfer_params=params)
    engine.step(0, like_vllm=True)
    engine.step(0, like_vllm=True)
    assert req.is_prefill_chunk
    engine.scheduler.finish_requests(req.request_id, RequestStatus.FINISHED_ABORTED)
    engine.drain()
    engine.worker.wait_all()
    assert not engine.manager._storing  # (nothing held as in flight for a request that is gone)
    again = engine.new_request(prompt)
    engine.run([EOS_TOKEN_ID])
    with KVClient(kvstore_server.addr, namespace=engine.manager.client.namespace) as kv:
        assert kv.lookup([chunk_key(again, c) for c in range(5)]) == 5


@SYNC_ASYNC
def test_expedited_load(make_engine: Callable[..., Engine], kvstore_server: ServerProcess,
                        async_scheduling: bool) -> None:
    # With a sync-load budget vLLM loads within the step (expedited) and computes right after.
    engine = make_engine(kvstore_server.addr, async_scheduling=async_scheduling, sync_load_budget_bytes=1 << 30)
    engine.new_request([5] * 12)
    original = gpu_bytes(engine, engine.run([EOS_TOKEN_ID]).stores[0].gpu_block_ids)
    assert engine.scheduler.reset_prefix_cache()
    wipe_gpu_cache(engine)
    engine.new_request([5] * 24)
    log = engine.run([0])
    [load] = log.loads
    assert load.expedited and load.gpu_block_indexes == (0, 1, 2)
    assert gpu_bytes(engine, load.gpu_block_ids) == original


def test_on_new_request_policy(make_engine: Callable[..., Engine], kvstore_server: ServerProcess) -> None:
    from vllm.v1.kv_offload.base import OffloadPolicy, ReqContext

    manager = make_engine(kvstore_server.addr).manager
    assert manager.on_new_request(ReqContext("a", {"do_remote_decode": True})).policy is OffloadPolicy.REQUEST_LEVEL
    assert manager.on_new_request(ReqContext("b", {"do_remote_decode": False})).policy is OffloadPolicy.CHUNK_LEVEL
    assert manager.on_new_request(ReqContext("c", None)).policy is OffloadPolicy.CHUNK_LEVEL


# --------------------------------------------------------------------------- lookups


@SYNC_ASYNC
def test_lookup_is_one_round_trip_per_request(make_engine: Callable[..., Engine], kvstore_server: ServerProcess,
                                              async_scheduling: bool) -> None:
    engine = make_engine(kvstore_server.addr, async_scheduling=async_scheduling)
    prompt = list(range(100, 165))  # 5 offloaded blocks and 5 tokens
    engine.new_request(prompt)
    assert engine.run([EOS_TOKEN_ID]).stored == tuple(range(15))
    assert engine.scheduler.reset_prefix_cache()
    wipe_gpu_cache(engine)

    client = engine.manager.client
    calls = count_calls(client, "lookup", "exists", "unpin")
    asked: list[bytes] = []
    lookup = engine.manager.lookup

    def spy(key: Any, req_context: Any) -> Any:
        asked.append(key)
        return lookup(key, req_context)

    engine.manager.lookup = spy  # type: ignore[method-assign]
    engine.new_request(prompt + [7] * 12)  # 6 offloaded blocks and 5 tokens
    log = engine.run([0])
    assert log.loaded == tuple(range(15))
    assert len(asked) == 6  # vLLM asks about each block: five hits, then the new one, a miss ...
    assert calls["lookup"] == [6]  # ... and one LOOKUP of six keys answered all of them
    assert calls["unpin"] == []  # every pinned block was loaded: the loads' GETs drop the pins
    stats = KVClient(kvstore_server.addr, namespace=client.namespace).stats()
    assert _pinned(stats) == 0


def _pinned(stats: dict[str, Any]) -> int:
    """Blocks the server holds pinned (leased)."""
    return int(stats["store"]["pinned_blocks"])


def test_unloaded_hits_are_unpinned_at_step_end(make_engine: Callable[..., Engine],
                                                kvstore_server: ServerProcess) -> None:
    engine = make_engine(kvstore_server.addr)
    prompt = list(range(200, 236))  # 3 offloaded blocks
    engine.new_request(prompt)
    engine.run([EOS_TOKEN_ID])
    assert engine.scheduler.reset_prefix_cache()
    calls = count_calls(engine.manager.client, "lookup", "unpin")

    # All three blocks are stored and the lookup pins them, but the request may load only one
    # (max_load_tokens): the pins of the other two are dropped when the step ends.
    engine.new_request(prompt + [1], kv_transfer_params={"max_load_tokens": 12})
    log = engine.run([EOS_TOKEN_ID])
    assert log.loaded == (0, 1, 2)
    assert calls["lookup"] == [3]
    assert calls["unpin"] == [2]
    assert _pinned(KVClient(kvstore_server.addr, namespace=engine.manager.client.namespace).stats()) == 0


# --------------------------------------------------------------------------- stores and dedup


def test_stores_skip_what_the_server_has(make_engine: Callable[..., Engine], kvstore_server: ServerProcess) -> None:
    prefill = make_engine(kvstore_server.addr, namespace="shared")
    other = make_engine(kvstore_server.addr, namespace="shared")  # another engine, same model
    prompt = list(range(300, 336))  # 3 offloaded blocks

    prefill.new_request(prompt)
    assert prefill.run([EOS_TOKEN_ID]).stored == tuple(range(9))

    # The other engine computes the same prompt itself (max_load_tokens=0: no load) and
    # offers it for storing: one EXISTS finds it all on the server, nothing is sent.
    no_load = {"max_load_tokens": 0}
    other.new_request(prompt, kv_transfer_params=no_load)
    log = other.run([EOS_TOKEN_ID])
    assert (log.loaded, log.stored) == ((), ())

    # One block longer: only the new block is stored.
    assert other.scheduler.reset_prefix_cache()
    other.new_request(prompt + list(range(12)), kv_transfer_params=no_load)
    assert other.run([EOS_TOKEN_ID]).stored == (9, 10, 11)

    # A P/D prefill stores every block even when the server has them all.
    assert other.scheduler.reset_prefix_cache()
    other.new_request(prompt, kv_transfer_params={**no_load, "do_remote_decode": True})
    assert other.run([EOS_TOKEN_ID]).stored == tuple(range(9))


def test_flush_on_reset(make_engine: Callable[..., Engine], kvstore_server: ServerProcess) -> None:
    engine = make_engine(kvstore_server.addr, kvstore_flush_on_reset=True)
    req = engine.new_request(list(range(12)))
    engine.run([EOS_TOKEN_ID])
    kv = KVClient(kvstore_server.addr, namespace=engine.manager.client.namespace)
    assert kv.exists([chunk_key(req, 0)]) == [True]
    assert engine.scheduler.reset_prefix_cache(reset_connector=True)
    assert kv.exists([chunk_key(req, 0)]) == [False]


def test_flush_on_reset_also_drops_a_store_the_reset_caught_in_flight(make_engine: Callable[..., Engine],
                                                                      kvstore_server: ServerProcess) -> None:
    """vLLM submits a finished request's store a step late: a reset right after it (a weight
    update) caught it queued, and it wrote KV of the old weights after the flush."""
    engine = make_engine(kvstore_server.addr, kvstore_flush_on_reset=True)
    prompt = list(range(900, 924))
    req = engine.new_request(prompt)
    engine.step(EOS_TOKEN_ID, like_vllm=True)  # prefill and EOS: finished, its store still queued
    kv = KVClient(kvstore_server.addr, namespace=engine.manager.client.namespace)
    keys = [chunk_key(req, c) for c in range(2)]
    assert kv.exists(keys) == [False, False]
    assert engine.scheduler.reset_prefix_cache(reset_connector=True)
    for _ in range(3):
        engine.step(None, like_vllm=True)
        engine.worker.wait_all()
    assert kv.exists(keys) == [False, False]

    # Once the reset is through, lookups find what is stored after it.
    engine.new_request(prompt)
    assert engine.run([EOS_TOKEN_ID]).stored
    assert engine.scheduler.reset_prefix_cache()
    engine.new_request(prompt)
    assert engine.run([0, EOS_TOKEN_ID]).loaded


def test_a_reset_whose_flush_cannot_reach_the_server_misses_until_a_flush_does(
        make_engine: Callable[..., Engine], kvstore_server: ServerProcess) -> None:
    """(coverage review) With the server in the scheduler client's quarantine at the reset (one
    lookup had timed out while the server stalled), no FLUSH was sent, the reset was reported done,
    and once the quarantine ended the engine loaded KV from before the reset (the old weights')."""
    import signal

    engine = make_engine(kvstore_server.addr, kvstore_flush_on_reset=True, kvstore_timeout=0.5,
                         kvstore_quarantine_s=1.0)
    prompt = list(range(500, 524))
    req = engine.new_request(prompt)
    assert engine.run([EOS_TOKEN_ID]).stored
    assert engine.scheduler.reset_prefix_cache()  # (the GPU's prefix cache: a hit must come from kvstore)
    assert kvstore_server.proc is not None
    kvstore_server.proc.send_signal(signal.SIGSTOP)  # the server stalls for a moment
    try:
        engine.new_request(list(range(9000, 9024)))
        engine.step(None)  # one lookup times out: the server is quarantined
    finally:
        kvstore_server.proc.send_signal(signal.SIGCONT)
    engine.run([0, EOS_TOKEN_ID])
    assert engine.scheduler.reset_prefix_cache(reset_connector=True)  # (a weight update, say)
    kv = KVClient(kvstore_server.addr, namespace=engine.manager.client.namespace)
    assert kv.exists([chunk_key(req, 0)]) == [True]  # the flush could not be sent...
    engine.new_request(prompt)
    assert engine.run([0, EOS_TOKEN_ID]).loaded == ()  # ... so nothing is loaded until it is
    time.sleep(2.5)  # (past the quarantine, and the retry's pause)
    assert engine.scheduler.reset_prefix_cache()
    engine.new_request(prompt)
    log = engine.run([0, EOS_TOKEN_ID])  # the flush goes through at its lookup: computed and stored anew
    assert log.loaded == () and len(log.stored) == 6 and not engine.manager._resetting
    kv.close()


def test_a_pending_reset_flushes_again_only_the_server_that_missed_it(make_engine: Callable[..., Engine],
                                                                       kvstore_server: ServerProcess) -> None:
    """(its review) Over two servers, one down at the reset: the flush was tried again on both about
    once a second, so what anyone stored on the one that had taken it -- KV from after the reset,
    a prefill's chain for its decode node -- lasted a second at most."""
    down = nothing_listens()
    engine = make_engine(f"{kvstore_server.addr},{down}", kvstore_flush_on_reset=True)
    assert engine.scheduler.reset_prefix_cache(reset_connector=True)
    with KVClient(kvstore_server.addr, namespace=engine.manager.client.namespace) as live:
        live.put([b"after the reset".ljust(32, b".")], [b"kv"])
        for i in range(4):  # (the retries: after 1 s, then 2 s)
            engine.new_request(list(range(7000 + 100 * i, 7024 + 100 * i)))
            assert engine.run([0, EOS_TOKEN_ID]).loaded == ()
            time.sleep(0.8)
        assert live.exists([b"after the reset".ljust(32, b".")]) == [True]
        assert engine.manager._resetting and engine.manager._unflushed == {down}


def test_a_flush_that_keeps_failing_waits_twice_as_long_each_time_up_to_its_cap(
        make_engine: Callable[..., Engine], kvstore_server: ServerProcess) -> None:
    """A server whose Redis tier is down empties its memory at each try (what was stored there
    since is lost each time): the pause between tries doubles from FLUSH_RETRY_S to
    FLUSH_RETRY_MAX_S (a mutant kept it at 1 s). Each try is due at once here (its due time
    cleared) and the pause it sets is read off the next due time."""
    from kvstore.integrations.vllm import FLUSH_RETRY_MAX_S, FLUSH_RETRY_S

    down = nothing_listens()
    engine = make_engine(f"{kvstore_server.addr},{down}", kvstore_flush_on_reset=True)
    assert engine.scheduler.reset_prefix_cache(reset_connector=True)
    engine.new_request(list(range(7000, 7024)))
    assert engine.run([0, EOS_TOKEN_ID]).loaded == ()  # (vLLM reports the jobs the reset caught)
    manager = engine.manager
    pauses = []
    for _ in range(7):
        manager._flush_again_at = 0.0
        assert not manager._end_reset() and manager._unflushed == {down}
        pauses.append(manager._flush_again_at - time.monotonic())
    series = [min(FLUSH_RETRY_S * 2 ** i, FLUSH_RETRY_MAX_S) for i in range(12)]
    # (the engine's lookups above already tried once or twice)
    assert any([round(p, 1) for p in pauses] == series[k:k + 7] for k in range(3)), pauses
    assert pauses[-1] <= FLUSH_RETRY_MAX_S == round(pauses[-1], 1)  # (the cap is reached)
    due = manager._flush_again_at
    assert not manager._end_reset() and manager._flush_again_at == due  # (not due yet: not tried)


# --------------------------------------------------------------------------- failures


def test_unreachable_server_means_misses(make_engine: Callable[..., Engine], kvstore_server: ServerProcess) -> None:
    engine = make_engine(kvstore_server.addr)
    prompt = list(range(400, 424))
    engine.new_request(prompt)
    engine.run([EOS_TOKEN_ID])
    assert engine.scheduler.reset_prefix_cache()
    kvstore_server.stop()

    # The request runs as if the store were empty: no load, and nothing it could store.
    engine.new_request(prompt)
    log = engine.run([0, EOS_TOKEN_ID])
    assert (log.loaded, log.stored) == ((), ())
    assert not engine.scheduler.requests


class _Lines(logging.Handler):
    """The messages a logger emits (vLLM's loggers do not propagate to pytest's caplog)."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_a_server_down_costs_no_vllm_warning_per_step(make_engine: Callable[..., Engine],
                                                       kvstore_server: ServerProcess) -> None:
    """prepare_store answered None when the server could not be asked, which vLLM counts as an
    allocation failure, logs ("Request N: cannot store chunks") and retries at the next step: one line
    per request and step for as long as the server stayed down (11 for this one request)."""
    engine = make_engine(kvstore_server.addr)
    kvstore_server.stop()
    lines = _Lines()
    vllm_log = logging.getLogger("vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler")
    vllm_log.addHandler(lines)
    try:
        engine.new_request(list(range(400, 424)))
        log = engine.run([0] * 10 + [EOS_TOKEN_ID])
    finally:
        vllm_log.removeHandler(lines)
    assert (log.loaded, log.stored) == ((), ())
    assert not [line for line in lines.lines if "cannot store" in line]
    assert engine.manager.round_trips == 2  # its lookup, and one EXISTS: not one at every step (12 before)
    assert not engine.scheduler.requests


def test_waiting_decode_requests_stop_waiting_when_the_server_fails(make_engine: Callable[..., Engine],
                                                                    kvstore_server: ServerProcess) -> None:
    """A round's failure ends the wait of every request it asked about: they compute their prompts
    at once instead of waiting out kvstore_remote_prefill_wait_s on a server that is gone."""
    engine = make_engine(kvstore_server.addr, kvstore_remote_prefill_wait_s=600)
    waiting = [engine.new_request(list(range(2000 + 100 * i, 2030 + 100 * i)),
                                  kv_transfer_params={"do_remote_prefill": True}) for i in range(3)]
    assert not engine.step(None).num_scheduled_tokens  # all three wait
    kvstore_server.stop()
    engine.run([0, EOS_TOKEN_ID])  # (raises "tokens were never sampled" if they still wait)
    assert all(r.num_computed_tokens >= 30 for r in waiting) and not engine.scheduler.requests


def test_waiting_decode_requests_stop_waiting_when_one_of_two_servers_is_down(
        make_engine: Callable[..., Engine], kvstore_server: ServerProcess) -> None:
    """Over two servers, one down: its keys read as "not stored yet" (an exists goes on without a
    server that fails), so a decode request whose chain had a chunk there waited out the whole
    kvstore_remote_prefill_wait_s, blaming its prefill engine. A failed server ends the wait."""
    down = nothing_listens()
    engine = make_engine(f"{kvstore_server.addr},{down}", kvstore_remote_prefill_wait_s=600)
    waiting = [engine.new_request(list(range(3000 + 100 * i, 3037 + 100 * i)),  # 3 chunks each: some on `down`
                                  kv_transfer_params={"do_remote_prefill": True}) for i in range(4)]
    # (probe rounds are >= 20 ms apart, and a request that came after a step's round joins the next:
    # step until each has been asked and computed its prompt, 10 s at most against the 600 s wait)
    until = time.monotonic() + 10
    while any(r.num_computed_tokens == 0 for r in waiting) and time.monotonic() < until:
        engine.step(None)
        time.sleep(0.03)
    engine.run([0, EOS_TOKEN_ID])  # (raises "tokens were never sampled" if they still wait)
    assert all(r.num_computed_tokens >= 37 for r in waiting) and not engine.scheduler.requests


def _blocks_gone_after_the_lookup(engine: Engine, addr: str) -> Callable[[], None]:
    """Make the next load find nothing: its blocks are flushed right after the lookup that found
    them (as by a memory-only server restarted in between). Returns the undo."""
    manager = engine.manager
    prepare_load = manager.prepare_load
    flusher = KVClient(addr, namespace=manager.client.namespace)

    def flushed_then(keys: Any, req_context: Any) -> Any:
        spec = prepare_load(keys, req_context)
        flusher.flush()
        return spec

    manager.prepare_load = flushed_then  # type: ignore[method-assign]

    def undo() -> None:
        manager.prepare_load = prepare_load  # type: ignore[method-assign]
        flusher.close()
    return undo


def _stored_then_lost(engine: Engine, addr: str, prompt: list[int]) -> Callable[[], None]:
    """Run ``prompt`` (its chunks stored), clear the GPU prefix cache, and make the next load of
    them fail (:func:`_blocks_gone_after_the_lookup`; returns its undo)."""
    engine.new_request(prompt)
    engine.run([EOS_TOKEN_ID])
    assert engine.scheduler.reset_prefix_cache()
    return _blocks_gone_after_the_lookup(engine, addr)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_load_that_fails_is_recomputed_under_kvstores_connector(
        make_engine: Callable[..., Engine], kvstore_server: ServerProcess, async_scheduling: bool) -> None:
    """vLLM's OffloadingConnector stops the engine on a failed load (``assert transfer_result.success``);
    KVStoreConnector reports the request to the scheduler, which computes it (policy "recompute")."""
    engine = make_engine(kvstore_server.addr, async_scheduling=async_scheduling, load_failure_policy="recompute")
    prompt = list(range(700, 724))
    undo = _stored_then_lost(engine, kvstore_server.addr, prompt)
    schedule, computed = engine.scheduler.schedule, []

    def counting() -> Any:
        out = schedule()
        computed.append(out.num_scheduled_tokens.get(request.request_id, 0))
        return out

    engine.scheduler.schedule = counting  # type: ignore[method-assign]
    try:
        request = engine.new_request(prompt + [5, 6])
        log = engine.run([0, EOS_TOKEN_ID])
    finally:
        undo()
    assert log.loaded  # the load ran, and failed: ...
    assert sum(computed) >= len(prompt) + 2  # ... so the whole prompt was computed (a hit: 2 tokens and on)
    assert request.status == RequestStatus.FINISHED_STOPPED and list(request.output_token_ids) == [0, EOS_TOKEN_ID]
    assert log.stored == tuple(range(6))  # and stored again
    assert not engine.scheduler.requests


@pytest.mark.parametrize("damage", ["another layout's header", "another size"])
def test_a_chunk_that_cannot_be_loaded_is_deleted_not_offered_again(make_engine: Callable[..., Engine],
                                                                    kvstore_server: ServerProcess, damage: str) -> None:
    """Chunks another engine's layout wrote (or corrupted ones) stay on the server: each lookup
    found them, each load failed, and under "recompute" the request went back and forth for good.
    Only the chunk that cannot be loaded goes: the others are valid for every engine."""
    engine = make_engine(kvstore_server.addr, load_failure_policy="recompute")
    prompt = list(range(600, 624))
    req = engine.new_request(prompt)
    engine.run([EOS_TOKEN_ID])
    keys = [chunk_key(req, c) for c in range(2)]
    kv = KVClient(kvstore_server.addr, namespace=engine.manager.client.namespace)
    blobs = [bytes(b) for b in kv.get(keys)]  # type: ignore[arg-type]
    kv.delete(keys[1:])
    bad = blobs[1][:12] + bytes([blobs[1][12] ^ 0xFF]) + blobs[1][13:] if damage == "another layout's header" \
        else blobs[1][:-4]
    kv.put(keys[1:], [bad])
    assert engine.scheduler.reset_prefix_cache()
    again = engine.new_request(prompt + [5, 6])
    log = engine.run([0, EOS_TOKEN_ID])
    # One try; then the chunk left loads and the rest is computed, and stored.
    assert [t.gpu_block_indexes for t in log.loads] == [(0, 1, 2, 3, 4, 5), (0, 1, 2)]
    assert again.status == RequestStatus.FINISHED_STOPPED and log.stored == (3, 4, 5)
    first, second = (bytes(b) for b in kv.get(keys))  # type: ignore[arg-type]
    assert first == blobs[0]  # kept (a recompute's store of it would hold the fake model's other KV)
    assert second[:HEADER_SIZE] == blobs[1][:HEADER_SIZE] and len(second) == len(blobs[1])  # deleted, stored anew


@pytest.mark.parametrize("sync_load", [False, True], ids=["async-load", "load-within-the-step"])
def test_a_load_that_fails_ends_its_request_under_the_fail_policy(make_engine: Callable[..., Engine],
                                                                  kvstore_server: ServerProcess, sync_load: bool) -> None:
    extra = {"sync_load_budget_bytes": 1 << 30} if sync_load else {}
    engine = make_engine(kvstore_server.addr, load_failure_policy="fail", **extra)
    prompt = list(range(800, 824))
    undo = _stored_then_lost(engine, kvstore_server.addr, prompt)
    lines = _Lines()
    logging.getLogger("kvstore.integrations.vllm").addHandler(lines)
    try:
        failed = engine.new_request(prompt + [5, 6])
        for _ in range(10):
            engine.step(0)
            if failed.is_finished():
                break
    finally:
        undo()
        logging.getLogger("kvstore.integrations.vllm").removeHandler(lines)
    assert failed.status == RequestStatus.FINISHED_ERROR
    if not sync_load:  # (coverage review: the warning said the request "computes what it did not load")
        assert [line for line in lines.lines if "ends with an error (kv_load_failure_policy 'fail')" in line]
        assert not [line for line in lines.lines if "computes what it did not load" in line]
    engine.new_request(list(range(900, 912)))  # the engine goes on
    assert engine.run([EOS_TOKEN_ID]).stored == (0, 1, 2)


def test_a_load_within_the_step_that_fails_under_recompute_still_stops_the_engine(
        make_engine: Callable[..., Engine], kvstore_server: ServerProcess) -> None:
    """vLLM 0.33 recomputes a failed load within the step (sync_load_budget_bytes) from GPU blocks it
    keeps and may already have run the model on: KVStoreConnector does not report it under
    "recompute" (vLLM's worker asserts, as without it); under "fail" it does (above)."""
    engine = make_engine(kvstore_server.addr, load_failure_policy="recompute", sync_load_budget_bytes=1 << 30)
    prompt = list(range(300, 324))
    undo = _stored_then_lost(engine, kvstore_server.addr, prompt)
    try:
        engine.new_request(prompt + [5, 6])
        with pytest.raises(AssertionError):  # (vLLM's worker: assert transfer_result.success)
            engine.run([0, EOS_TOKEN_ID])
    finally:
        undo()


def test_refused_store_is_not_fatal(make_engine: Callable[..., Engine],
                                    make_server: Callable[..., ServerProcess]) -> None:
    server = make_server("--capacity", "1MiB")
    with KVClient(server.addr, namespace="filler") as filler:  # fill the store with pinned blocks
        blocks = [bytes([i]) * 60_000 for i in range(64)]
        filler_keys = [b"filler-%d" % i for i in range(64)]
        try:
            filler.put(filler_keys, blocks)
        except KVStoreError:
            pass  # what did not fit did not fit
        filler.lookup(filler_keys, pin=True, lease_ms=600_000)
        engine = make_engine(server.addr)
        engine.new_request(list(range(500, 512)))
        log = engine.run([EOS_TOKEN_ID])
        assert log.stored == (0, 1, 2)  # the store job ran ...
        assert engine.worker.store_failures == 1  # ... the server refused it (full), and vLLM went on
        assert not engine.scheduler.requests


def test_a_store_job_over_two_servers_with_one_down_still_stores_the_live_ones_chunks(
        make_engine: Callable[..., Engine], kvstore_server: ServerProcess) -> None:
    """A store job cut in stretches (the chunks a server had already were skipped) stopped at the
    first put that failed: with one of two servers down, the live server's chunks of the later
    stretches were dropped with it, and every later request recomputed them."""
    down = nothing_listens()
    live = kvstore_server.addr
    engine = make_engine(f"{live},{down}", namespace="one-down")
    ring = Ring([live, down])
    for base in range(10_000, 1_000_000, 100):  # chunk 0 on the down server, 1 on the live one, and more there
        prompt = list(range(base, base + 72))
        probe = Request(request_id="probe", prompt_token_ids=prompt, sampling_params=SamplingParams(max_tokens=1),
                        pooling_params=None, block_hasher=engine._block_hasher)
        on_live = [ring.nodes[ring.node_of(chunk_key(probe, c))] == live for c in range(6)]
        if not on_live[0] and on_live[1] and any(on_live[2:]):
            break
    engine.new_request(prompt[:24])  # chunk 1 is stored on the live server, chunk 0 fails
    engine.run([EOS_TOKEN_ID])
    assert engine.scheduler.reset_prefix_cache()
    req = engine.new_request(prompt + [1])  # its store: [chunk 0] (fails), then [chunks 2..5]
    engine.run([0, EOS_TOKEN_ID])
    assert engine.worker.store_failures == 2
    with KVClient(live, namespace="one-down") as check:
        assert check.exists([chunk_key(req, c) for c in range(6)]) == on_live


def test_prefill_for_remote_decode_stores_the_chunks_a_failing_store_of_another_request_holds(
        make_engine: Callable[..., Engine], make_server: Callable[..., ServerProcess]) -> None:
    """A ``do_remote_decode`` request left the chunks another request was storing to that store; when it
    failed (the server full), the remote decoder found none of them. It stores them itself now."""
    server = make_server("--capacity", "1MiB")
    with KVClient(server.addr, namespace="filler") as filler:
        filler_keys = [b"filler-%d" % i for i in range(16)]
        try:
            filler.put(filler_keys, [bytes([i]) * 60_000 for i in range(16)])
        except KVStoreError:
            pass  # what did not fit did not fit
        filler.lookup(filler_keys, pin=True, lease_ms=600_000)  # full of pinned blocks: a store fails
        engine = make_engine(server.addr, async_scheduling=True)  # (a store's outcome comes a step late)
        prompt = list(range(1000, 1026))  # two offloaded blocks and two tokens
        engine.new_request(prompt)
        remote = None
        for step in range(12):
            engine.step(0 if step < 6 else EOS_TOKEN_ID)
            if engine.worker.store_failures and remote is None:  # the plain request's store failed ...
                filler.unpin(filler_keys)
                filler.delete(filler_keys)  # ... and there is room again
                in_flight = set(engine.manager._storing)
                remote = engine.new_request(prompt + list(range(2000, 2012)),
                                            kv_transfer_params={"do_remote_decode": True})
        engine.drain()
        assert remote is not None and engine.worker.store_failures == 1
        keys = [chunk_key(remote, c) for c in range(3)]
        assert in_flight & {make_offload_key(remote.block_hashes[2], 0)}  # (the window the test is about)
        with KVClient(server.addr, namespace=engine.manager.client.namespace) as kv:
            assert kv.exists(keys) == [True, True, True]
            assert kv.lookup(keys) == 3  # the remote decoder finds the whole prompt


# --------------------------------------------------------------------------- the docs


def test_documented_config_selects_the_kvstore_spec() -> None:
    import json
    import re
    from pathlib import Path

    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    from kvstore.integrations.vllm import KVStoreConnector, KVStoreOffloadingSpec

    doc = (Path(__file__).resolve().parents[1] / "docs" / "vllm.md").read_text()
    configs = re.findall(r"--kv-transfer-config '([^']+)'", doc)
    assert configs, "docs/vllm.md shows no --kv-transfer-config"
    for raw in configs:
        config = KVTransferConfig(**json.loads(raw))
        assert KVConnectorFactory.get_connector_class(config) is KVStoreConnector
        assert config.kv_load_failure_policy == "recompute"
        assert OffloadingSpecFactory.get_spec_cls(config.kv_connector_extra_config) is KVStoreOffloadingSpec


@pytest.mark.parametrize("window", [None, 8], ids=["full", "sliding-window"])
@SYNC_ASYNC
def test_a_decode_request_waits_for_its_remote_prefills_blocks(make_engine: Callable[..., Engine],
                                                               kvstore_server: ServerProcess,
                                                               async_scheduling: bool, window: int | None) -> None:
    """vLLM answers a finished prefill before its stores run (at the next step, in the background):
    a decode request sent on at once found part of the prompt, or none, and computed the rest. One
    marked do_remote_prefill now waits (kvstore_remote_prefill_wait_s) for the whole chain (for a
    sliding-window group: its last chunk), alone: a plain request with the same prompt does not."""
    import time

    def engine(ns: str, **extra: Any) -> Engine:
        return make_engine(kvstore_server.addr, namespace=ns, async_scheduling=async_scheduling,
                           sliding_window=window, **extra)

    prefill, decode = engine("pd"), engine("pd")
    prompt = list(range(100, 150))  # four whole offloaded blocks (48 tokens) and 2 more
    waiting = decode.new_request(prompt, kv_transfer_params={"do_remote_prefill": True})
    for _ in range(3):  # its prefill has stored nothing yet: deferred, nothing computed
        assert waiting.request_id not in decode.step(None).num_scheduled_tokens
    prefill.new_request(prompt, kv_transfer_params={"do_remote_decode": True})
    stored = set(prefill.run([EOS_TOKEN_ID]).stored)
    time.sleep(0.05)  # (past the probe interval: the next step asks the server)
    log = decode.run([7, EOS_TOKEN_ID])
    loaded = set(log.loaded)
    assert loaded and loaded <= stored and waiting.num_computed_tokens >= len(prompt)
    if window is None:
        assert loaded == set(range(12))  # the whole chain came from the store
    with KVClient(kvstore_server.addr, namespace="pd") as kv:
        assert kv.stats()["store"]["leases"] == 0

    late = engine("pd-none", kvstore_remote_prefill_wait_s=0.2)
    alone = late.new_request(prompt, kv_transfer_params={"do_remote_prefill": True})
    plain = late.new_request(prompt)  # the same prompt, no P/D: takes what is there (nothing) at once
    out = late.step(None)
    assert alone.request_id not in out.num_scheduled_tokens and plain.request_id in out.num_scheduled_tokens
    time.sleep(0.25)  # no prefill stores it: past its wait, it computes the prompt (or takes plain's blocks)
    log = late.run([7])
    assert log.loaded == () and alone.num_computed_tokens >= len(prompt)


@SYNC_ASYNC
def test_a_decode_request_of_a_hybrid_model_waits_for_every_groups_chain(make_engine: Callable[..., Engine],
                                                                         kvstore_server: ServerProcess,
                                                                         async_scheduling: bool) -> None:
    """A full-attention and a sliding-window group: the wait ended as soon as one group's chain
    looked whole, and the request computed its whole prompt (the worker stores group 0's part,
    then group 1's: a probe between the two saw exactly that)."""
    import time

    from vllm.v1.kv_offload.base import OffloadKey, get_offload_group_idx

    prefill = make_engine(kvstore_server.addr, namespace="hy", async_scheduling=async_scheduling, hybrid=True)
    decode = make_engine(kvstore_server.addr, namespace="hy", async_scheduling=async_scheduling, hybrid=True)
    prompt = list(range(300, 350))
    prefill.new_request(prompt, kv_transfer_params={"do_remote_decode": True})
    keys = [k for t in prefill.run([EOS_TOKEN_ID]).stores for k in t.keys]
    window_last = [k for k in keys if get_offload_group_idx(OffloadKey(k)) == 1][-1]
    with KVClient(kvstore_server.addr, namespace="hy") as kv:  # group 1's last chunk: "not stored yet"
        held = kv.get([store_key(window_last, 0)])
        assert kv.delete([store_key(window_last, 0)]) == 1
        waiting = decode.new_request(prompt, kv_transfer_params={"do_remote_prefill": True})
        for _ in range(3):
            assert waiting.request_id not in decode.step(None).num_scheduled_tokens
            time.sleep(0.03)
        kv.put([store_key(window_last, 0)], [held[0]])  # it lands
        time.sleep(0.05)
        log = decode.run([7, EOS_TOKEN_ID])
        assert len(log.loaded) == 14 and waiting.num_computed_tokens >= len(prompt)  # both groups' blocks
        assert kv.stats()["store"]["leases"] == 0


@SYNC_ASYNC
def test_waiting_decode_requests_are_asked_about_together_in_one_round_trip(make_engine: Callable[..., Engine],
                                                                             kvstore_server: ServerProcess,
                                                                             async_scheduling: bool) -> None:
    """Each waiting request was probed on its own: 16 waiting cost ~440 LOOKUPs a second. A round
    now asks about every waiting request at once, new ones from the step after they came (400 new
    requests in one step cost 400 rounds, 0.23 s); each still ends its wait on its own chain."""
    import time

    prefill = make_engine(kvstore_server.addr, namespace="many", async_scheduling=async_scheduling)
    decode = make_engine(kvstore_server.addr, namespace="many", async_scheduling=async_scheduling,
                         kvstore_remote_prefill_wait_s=30)
    prompts = [list(range(1000 + 100 * i, 1050 + 100 * i)) for i in range(8)]
    waiting = [decode.new_request(p, kv_transfer_params={"do_remote_prefill": True}) for p in prompts]
    decode.step(None)  # the first request's question is a round; the 7 others join the next step's
    assert decode.manager.round_trips == 1  # (was 8: each new request's first question a round of its own)
    server = decode.manager.client
    for _ in range(4):
        time.sleep(0.03)  # (past the probe interval: the next step asks again)
        before, ops = decode.manager.round_trips, server.stats()["requests"]
        out = decode.step(None)
        after = server.stats()["requests"]
        assert not set(out.num_scheduled_tokens) & {r.request_id for r in waiting}
        assert decode.manager.round_trips - before == 1  # (8, one per waiting request)
        asked = {op: after.get(op, 0) - ops.get(op, 0) for op in ("exists", "lookup")}
        assert asked == {"exists": 1, "lookup": 0}, asked
    prefill.new_request(prompts[3], kv_transfer_params={"do_remote_decode": True})
    prefill.run([EOS_TOKEN_ID])
    scheduled: set[str] = set()
    gets = server.stats()["requests"].get("get", 0)
    for _ in range(20):  # its round finds prompt 3 whole: that one request ends its wait, loads, runs
        time.sleep(0.03)
        scheduled |= set(decode.step(None).num_scheduled_tokens)
        if waiting[3].request_id in scheduled:
            break
    assert scheduled == {waiting[3].request_id}
    assert server.stats()["requests"].get("get", 0) > gets  # (its chain loaded, not computed)


def test_a_sliding_window_hit_is_leased_before_it_is_answered(make_engine: Callable[..., Engine],
                                                              kvstore_server: ServerProcess) -> None:
    """A sliding-window group is asked with EXISTS, which leases nothing: a block evicted between
    that answer and prepare_load's pin failed its load, and vLLM 0.33 stops on a failed load."""
    prefill = make_engine(kvstore_server.addr, namespace="sw", sliding_window=8)
    decode = make_engine(kvstore_server.addr, namespace="sw", sliding_window=8)
    prompt = list(range(400, 450))
    prefill.new_request(prompt)
    prefill.run([EOS_TOKEN_ID])
    client = decode.manager.client
    exists = client.exists
    evictor = KVClient(kvstore_server.addr, namespace="sw")

    def exists_then_evicted(keys: list[bytes], **kwargs: Any) -> list[bool]:  # (another engine's stores evict them)
        present = exists(keys, **kwargs)
        evictor.delete(keys)
        return present

    client.exists = exists_then_evicted  # type: ignore[method-assign]
    try:
        request = decode.new_request(prompt)
        log = decode.run([7, EOS_TOKEN_ID])  # (raised AssertionError in vLLM's worker: a failed load)
    finally:
        client.exists = exists  # type: ignore[method-assign]
        evictor.close()
    assert log.loaded == () and request.num_computed_tokens >= len(prompt)


def test_a_sliding_window_prompt_shorter_than_its_window_still_loads(make_engine: Callable[..., Engine],
                                                                    kvstore_server: ServerProcess) -> None:
    """vLLM takes a run of hits that reaches the chain's start even when it is shorter than the
    window; leasing only runs a window long left such a prompt (2 chunks, a 4-chunk window) with
    nothing to load."""
    prefill = make_engine(kvstore_server.addr, namespace="short", sliding_window=48)
    decode = make_engine(kvstore_server.addr, namespace="short", sliding_window=48)
    prompt = list(range(500, 530))
    prefill.new_request(prompt)
    assert prefill.run([EOS_TOKEN_ID]).stored == (0, 1, 2, 3, 4, 5)
    decode.new_request(prompt)
    assert decode.run([7, EOS_TOKEN_ID]).loaded == (0, 1, 2, 3, 4, 5)
    with KVClient(kvstore_server.addr, namespace="short") as kv:
        assert kv.stats()["store"]["leases"] == 0


def test_a_waiting_decode_request_is_never_answered_an_unpinned_hit(make_engine: Callable[..., Engine],
                                                                    kvstore_server: ServerProcess) -> None:
    """With max_load_tokens vLLM scans only the chunks below it: the wait answered those HIT from
    its unpinned probe (its RETRY lay past them), vLLM loaded at once, and a chunk evicted before
    prepare_load's pin failed the load, which stops vLLM."""
    prefill = make_engine(kvstore_server.addr, namespace="mu")
    decode = make_engine(kvstore_server.addr, namespace="mu", kvstore_remote_prefill_wait_s=5)
    prompt = list(range(600, 650))
    stored = prefill.new_request(prompt, kv_transfer_params={"do_remote_decode": True})
    prefill.run([EOS_TOKEN_ID])
    kv = KVClient(kvstore_server.addr, namespace="mu")
    kv.delete([chunk_key(stored, 3)])  # the prefill's last chunk: "not stored yet"
    client = decode.manager.client
    lookup, exists = client.lookup, client.exists

    def unpinned_then_evicted(keys: list[bytes], pin: bool = False, **kw: Any) -> int:
        n = lookup(keys, pin=pin, **kw)
        if not pin:
            kv.delete([chunk_key(stored, 0)])  # another engine's stores evict a chunk it found
        return n

    def exists_then_evicted(keys: list[bytes], **kwargs: Any) -> list[bool]:
        present = exists(keys, **kwargs)
        kv.delete([chunk_key(stored, 0)])
        return present

    client.lookup, client.exists = unpinned_then_evicted, exists_then_evicted  # type: ignore[method-assign]
    try:
        waiting = decode.new_request(prompt, kv_transfer_params={"do_remote_prefill": True, "max_load_tokens": 24})
        assert waiting.request_id not in decode.step(None).num_scheduled_tokens  # (it was loaded at once)
    finally:
        client.lookup, client.exists = lookup, exists  # type: ignore[method-assign]
    assert decode.manager.client.stats()["store"]["leases"] == 0
    kv.close()


def test_a_hybrid_models_sliding_window_hits_are_leased_in_every_run_vllm_may_take(
        make_engine: Callable[..., Engine], kvstore_server: ServerProcess) -> None:
    """A prefill stores a sliding-window group's chunks only inside each prompt's window, so a
    short prompt then a longer one with it as prefix leave a gap; only the rightmost run was
    leased (the rest answered MISS), and where the full group's hit stopped before that run,
    vLLM's scan of the window group saw only misses and the request loaded nothing."""
    from vllm.v1.kv_offload.base import OffloadKey, get_offload_group_idx

    prefill = make_engine(kvstore_server.addr, namespace="gap", hybrid=True)
    decode = make_engine(kvstore_server.addr, namespace="gap", hybrid=True)
    prompt = list(range(700, 825))  # 10 chunks
    prefill.new_request(prompt[:48], kv_transfer_params={"do_remote_decode": True})
    prefill.run([EOS_TOKEN_ID])
    prefill.new_request(prompt, kv_transfer_params={"do_remote_decode": True})
    keys = [k for t in prefill.run([EOS_TOKEN_ID]).stores for k in t.keys]
    full = [k for k in keys if get_offload_group_idx(OffloadKey(k)) == 0]
    with KVClient(kvstore_server.addr, namespace="gap") as kv:
        assert kv.delete([store_key(full[5], 0)]) == 1  # the full group's hit stops at chunk 5
        decode.new_request(prompt)
        log = decode.run([7, EOS_TOKEN_ID])
        assert log.loaded  # (loaded nothing: the window group's scan saw only misses)
        assert kv.stats()["store"]["leases"] == 0
