"""Tensor parallelism, engine-wide: vLLM's scheduler with world_size 2 and two GPU workers (rank 0
and rank 1), each with its own worker connector (``parallel_config.rank`` set as vLLM's worker
sets it) and its own "GPU" KV cache holding different bytes; both get each step's connector
metadata, and their outputs are combined by vLLM's ``KVOutputAggregator``. A real server.

Each rank stores its slice of a chunk under ``store_key(chunk, rank)``; a chunk counts as stored
only when every rank's slice is; each rank loads back its own slice -- a rank that loaded the
other's would run on another rank's heads, with no error anywhere.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from vllm.v1.kv_offload.base import make_offload_key
from vllm.v1.request import Request

from kvstore.client import KVClient
from kvstore.integrations.vllm import store_key
from kvstore.server.process import ServerProcess
from test_vllm_offloading import payload_layers
from vllm_harness import EOS_TOKEN_ID, LAYERS, Engine, StepLog

TP = 2
BLOCKS_PER_CHUNK = 3  # offloaded block of 12 tokens / GPU block of 4
CHUNKS = 4
PROMPT = list(range(1000, 1000 + CHUNKS * 12 + 1))  # four whole chunks and one token


def chunk_keys(req: Request) -> list[bytes]:
    """The OffloadKeys of the prompt's chunks, from vLLM's own block hashes."""
    return [bytes(make_offload_key(req.block_hashes[c * BLOCKS_PER_CHUNK + BLOCKS_PER_CHUNK - 1], 0))
            for c in range(CHUNKS)]


def rank_bytes(engine: Engine, rank: int, block_ids: list[int]) -> list[bytes]:
    """Per layer, the raw bytes of some GPU blocks of one rank's KV cache."""
    caches = engine.rank_kv_caches[rank]
    return [caches[name][block_ids].contiguous().view(torch.uint8).numpy().tobytes() for name in LAYERS]


def chunk_blocks(log: StepLog, loads: bool = False) -> dict[bytes, list[int]]:
    """Each transferred chunk's GPU block ids, from the transfers one rank's worker ran."""
    out: dict[bytes, list[int]] = {}
    for t in log.loads if loads else log.stores:
        for i, key in enumerate(t.keys):
            out[key] = t.gpu_block_ids[i * BLOCKS_PER_CHUNK : (i + 1) * BLOCKS_PER_CHUNK]
    return out


def refill(engine: Engine, seed: int) -> None:
    """New random bytes in every rank's KV cache: what a load brings back can only come from the store."""
    gen = torch.Generator().manual_seed(seed)
    for caches in engine.rank_kv_caches:
        for cache in caches.values():
            cache.copy_(torch.randn(cache.shape, generator=gen, dtype=torch.float32).to(cache.dtype))


def matched_tokens(engine: Engine) -> list[int]:
    """Record what the connector's lookup answers the scheduler (tokens to load), per request."""
    connector = engine.scheduler.connector
    assert connector is not None
    ask = connector.get_num_new_matched_tokens
    answers: list[int] = []

    def spy(request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        n, load_async = ask(request, num_computed_tokens)
        if n is not None:
            answers.append(n)
        return n, load_async

    connector.get_num_new_matched_tokens = spy  # type: ignore[method-assign]
    return answers


def prefill(engine: Engine) -> tuple[list[bytes], dict[bytes, list[list[bytes]]]]:
    """Run PROMPT to its end: each rank stores all four chunks. Returns the chunks' OffloadKeys and,
    per chunk, each rank's bytes of it (per layer) as they were in its KV cache."""
    assert engine.vllm_config.parallel_config.world_size == TP
    req = engine.new_request(PROMPT)
    engine.run([EOS_TOKEN_ID])
    keys = chunk_keys(req)
    blocks = chunk_blocks(engine.rank_logs[0])
    assert list(blocks) == keys
    assert all(log.stored == tuple(range(CHUNKS * BLOCKS_PER_CHUNK)) for log in engine.rank_logs)
    assert all(chunk_blocks(log) == blocks for log in engine.rank_logs)  # one plan, run by every rank
    original = {k: [rank_bytes(engine, r, blocks[k]) for r in range(TP)] for k in keys}
    assert all(original[k][0] != original[k][1] for k in keys)  # (else the ranks' bytes tell nothing)
    return keys, original


def test_a_tp2_prefill_stores_each_ranks_slice_under_its_rank(make_engine: Callable[..., Engine],
                                                              kvstore_server: ServerProcess) -> None:
    """Two keys per chunk, the chunk's OffloadKey followed by the rank (2 bytes, big-endian), each
    holding that rank's own bytes; nothing else in the namespace."""
    engine = make_engine(kvstore_server.addr, tensor_parallel_size=TP)
    keys, original = prefill(engine)
    ns = engine.manager.client.namespace
    with KVClient(kvstore_server.addr, namespace=ns) as kv:
        for key in keys:
            wire = [key + b"\x00\x00", key + b"\x00\x01"]
            assert wire == [store_key(key, 0), store_key(key, 1)]
            payloads = kv.get(wire)
            for rank, payload in enumerate(payloads):
                assert payload is not None, f"rank {rank}'s slice was not stored"
                assert payload_layers(payload) == original[key][rank], f"rank {rank}'s key holds other bytes"
        assert kv.stats()["namespaces"][ns]["blocks"] == TP * CHUNKS
        # Each rank's slices form a chain of their own on the server (each put names its rank's
        # predecessor): one rank's chunk gone strands that rank's later chunks, not the other's.
        assert kv.stats()["store"]["stranded_blocks"] == 0
        assert kv.delete([store_key(keys[1], 0)]) == 1
        assert kv.stats()["store"]["stranded_blocks"] == CHUNKS - 2


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_tp2_engine_loads_each_rank_its_own_slice(make_engine: Callable[..., Engine],
                                                    kvstore_server: ServerProcess, async_scheduling: bool) -> None:
    """After the GPU prefix cache is reset, the same prompt finds all four chunks (both ranks'
    slices) and loads them; each rank's KV cache gets back exactly its own bytes."""
    engine = make_engine(kvstore_server.addr, tensor_parallel_size=TP, async_scheduling=async_scheduling)
    keys, original = prefill(engine)
    assert engine.scheduler.reset_prefix_cache()
    refill(engine, seed=7)
    answers = matched_tokens(engine)
    engine.new_request(PROMPT)
    engine.run([EOS_TOKEN_ID])
    assert answers == [CHUNKS * 12]
    for rank, log in enumerate(engine.rank_logs):
        assert log.loaded == tuple(range(CHUNKS * BLOCKS_PER_CHUNK)), f"rank {rank}"
        assert log.stored == ()  # every chunk is stored, by both ranks
        blocks = chunk_blocks(log, loads=True)
        assert list(blocks) == keys
        for key in keys:
            got = rank_bytes(engine, rank, blocks[key])
            assert got != original[key][1 - rank], f"rank {rank} loaded rank {1 - rank}'s slice"
            assert got == original[key][rank], f"rank {rank} did not get its own bytes back"


@pytest.mark.parametrize("missing_rank", [0, 1])
def test_a_tp2_lookup_stops_at_a_chunk_one_rank_lacks(make_engine: Callable[..., Engine],
                                                      kvstore_server: ServerProcess, missing_rank: int) -> None:
    """One rank's slice of the third chunk is gone from the server: the lookup counts the two
    chunks before it (the fourth, whole on the server, is not loaded: a prefix ends at its first
    hole), each rank loads its own bytes of them, and the third chunk is stored again -- by both
    ranks (the rank that still has its slice included: the chunk is not whole until both are)."""
    engine = make_engine(kvstore_server.addr, tensor_parallel_size=TP)
    keys, original = prefill(engine)
    with KVClient(kvstore_server.addr, namespace=engine.manager.client.namespace) as kv:
        assert kv.delete([store_key(keys[2], missing_rank)]) == 1
        assert engine.scheduler.reset_prefix_cache()
        refill(engine, seed=11)
        answers = matched_tokens(engine)
        engine.new_request(PROMPT)
        engine.run([EOS_TOKEN_ID])
        assert answers == [2 * 12]
        for rank, log in enumerate(engine.rank_logs):
            assert log.loaded == tuple(range(2 * BLOCKS_PER_CHUNK)), f"rank {rank}"
            blocks = chunk_blocks(log, loads=True)
            assert list(blocks) == keys[:2]
            for key in keys[:2]:
                assert rank_bytes(engine, rank, blocks[key]) == original[key][rank], f"rank {rank}"
            # computed again, then stored again (the fourth chunk is whole on the server: not sent)
            assert log.stored == tuple(range(2 * BLOCKS_PER_CHUNK, 3 * BLOCKS_PER_CHUNK)), f"rank {rank}"
        # The chunk is whole again: the missing slice is the bytes its rank computed anew (the
        # other rank's put found its key there and kept it: a model computes the same KV again).
        recomputed = chunk_blocks(engine.rank_logs[0])[keys[2]]
        payloads = kv.get([store_key(keys[2], r) for r in range(TP)])
        assert all(p is not None for p in payloads)
        assert payload_layers(payloads[missing_rank]) == rank_bytes(engine, missing_rank, recomputed)
        assert payload_layers(payloads[1 - missing_rank]) == original[keys[2]][1 - missing_rank]
