"""The offload scheduler's decisions, as narrative scenarios (no store: lookup answers are given).

The same behaviour against a real server is in ``test_seed_scenario.py``.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.engine.hashing import BlockHasher
from kvstore.engine.offload import Finished, LoadJob, LookupFn, OffloadScheduler, StoreJob

GPU_BS = 4
FACTOR = 3
OFF_BS = GPU_BS * FACTOR  # 12


def make() -> OffloadScheduler:
    return OffloadScheduler(BlockHasher(OFF_BS), GPU_BS)


def gpu_blocks(n: int, base: int = 100) -> list[int]:
    return list(range(base, base + n))


def hits(n: int, seen: list[list[bytes]] | None = None) -> LookupFn:
    def lookup(keys: list[bytes]) -> int:
        if seen is not None:
            seen.append(keys)
        return min(n, len(keys))

    return lookup


def storing_six_blocks() -> tuple[OffloadScheduler, StoreJob]:
    """Request "r" (24 tokens, nothing found) on GPU blocks 100-105, the store of all six in flight."""
    s = make()
    s.add_request("r", range(24))
    s.num_external_tokens("r", 0, hits(0))
    s.on_alloc("r", gpu_blocks(6), 0)
    (store,) = s.build_step({"r": 24})
    return s, store


def test_stores_full_offloaded_blocks_only_once() -> None:
    s = make()
    s.add_request("r", range(30))
    assert s.num_external_tokens("r", 0, hits(0)) == 0
    assert s.on_alloc("r", gpu_blocks(8), 0) is None
    assert s.build_step({"r": 11}) == []  # not one full offloaded block yet
    (job,) = s.build_step({"r": 30})
    assert isinstance(job, StoreJob)
    assert job.keys == tuple(s.keys("r")) and job.first_block == 0
    assert job.gpu_block_ids == tuple(gpu_blocks(6))
    assert s.build_step({"r": 30}) == []  # the cursor moved on
    assert s.on_store_done(job.job_id) == ()  # request still running: nothing to free
    fin = s.finish_request("r")
    assert fin.free_now == tuple(gpu_blocks(8)) and fin.stores == ()
    assert s.pending_jobs == () and s.num_requests == 0


@pytest.mark.parametrize("remote_decode", [False, True])
def test_loaded_prefix_is_skipped_unless_do_remote_decode(remote_decode: bool) -> None:
    s = make()
    params = {"do_remote_decode": True} if remote_decode else {"do_remote_decode": False}
    s.add_request("r", [0] * 24, params)
    assert s.num_external_tokens("r", 0, hits(1)) == 12
    load = s.on_alloc("r", gpu_blocks(6), 12)
    assert isinstance(load, LoadJob)
    assert load.gpu_block_ids == (100, 101, 102) and load.skip == 0 and load.first_block == 0
    assert load.keys == tuple(s.keys("r")[:1])
    assert s.build_step({"r": 24}) == []  # never store while the load is in flight
    assert s.on_load_done(load.job_id) == ()
    (store,) = s.build_step({})  # became possible: the request's count was already given
    if remote_decode:
        assert store.gpu_block_ids == tuple(gpu_blocks(6)) and store.first_block == 0
        assert store.keys == tuple(s.keys("r"))
    else:
        assert store.gpu_block_ids == (103, 104, 105) and store.first_block == 1
        assert store.keys == tuple(s.keys("r")[1:])


def test_gpu_prefix_hit_inside_an_offloaded_block_loads_the_rest_of_it() -> None:
    s = make()
    s.add_request("r", range(40))
    seen: list[list[bytes]] = []
    # GPU has 4 blocks (16 tokens): offloaded block 0 fully, block 1 one third
    n = s.num_external_tokens("r", 16, hits(2, seen))
    assert seen == [s.keys("r")[1:3]]  # the lookup starts at the first block not fully on GPU
    assert n == 36 - 16
    load = s.on_alloc("r", gpu_blocks(10), n)
    assert load is not None
    assert load.keys == tuple(s.keys("r")[1:3]) and load.first_block == 1 and load.skip == 1
    assert load.gpu_block_ids == tuple(gpu_blocks(10)[4:9])
    s.on_load_done(load.job_id)
    assert s.build_step({"r": 40}) == []  # 3 full blocks: the cursor is past the loaded ones


def test_gpu_hit_covering_everything_needs_no_lookup() -> None:
    s = make()
    s.add_request("r", range(30))
    seen: list[list[bytes]] = []
    assert s.num_external_tokens("r", 24, hits(5, seen)) == 0
    assert seen == []


def test_async_scheduling_stores_a_block_when_its_last_token_is_known() -> None:
    """Decode tokens complete block 1; with async scheduling the token id arrives a step late."""
    s = make()
    s.add_request("r", range(22))
    s.num_external_tokens("r", 0, hits(0))
    s.on_alloc("r", gpu_blocks(6), 0)
    (first,) = s.build_step({"r": 22})  # prefill: block 0
    assert first.first_block == 0
    s.append_tokens("r", [900])  # sampled by the prefill step: 23 tokens known
    assert s.build_step({"r": 23}) == []
    # step computing position 23 (token 901 was sampled from it) -- async: 901 not known yet
    assert s.build_step({"r": 24}) == []
    s.append_tokens("r", [901])
    (second,) = s.build_step({"r": 25})  # one step later
    assert second.first_block == 1 and second.gpu_block_ids == tuple(gpu_blocks(6)[3:6])


def test_after_a_preemption_nothing_is_stored_from_blocks_not_yet_recomputed() -> None:
    """Async scheduling, preempted while block 1's last token id was still on its way: the
    new allocation holds only what was loaded until the engine computes again."""
    s = make()
    s.add_request("r", range(22))
    s.num_external_tokens("r", 0, hits(0))
    s.on_alloc("r", gpu_blocks(6), 0)
    (first,) = s.build_step({"r": 22})
    s.on_store_done(first.job_id)
    s.append_tokens("r", [900])
    assert s.build_step({"r": 24}) == []  # 901 not known yet
    # preempted: blocks 100.. go to other requests; the late token id arrives; resumed with block 0 loaded
    s.append_tokens("r", [901])
    load = s.on_alloc("r", gpu_blocks(7, base=200), s.num_external_tokens("r", 0, hits(1)))
    assert load is not None and load.first_block == 0
    s.on_load_done(load.job_id, True)
    assert s.build_step({}) == []  # (block 1 from GPU blocks 203-205 was stored: never computed there)
    (second,) = s.build_step({"r": 24})  # recomputed
    assert second.first_block == 1 and second.gpu_block_ids == (203, 204, 205)


def test_preempt_stops_stores_from_the_blocks_it_gives_back() -> None:
    """Async scheduling: the token completing block 1 arrives after the engine took the blocks
    back (and gave 103-104 to another request); nothing may be stored from them."""
    s = make()
    s.add_request("r", range(22))
    s.num_external_tokens("r", 0, hits(0))
    s.on_alloc("r", gpu_blocks(6), 0)
    (first,) = s.build_step({"r": 22})
    s.append_tokens("r", [900])
    assert s.build_step({"r": 24}) == []  # 901 not known yet
    # block 0's store still reads 100-102: those come back when it ends, the rest now
    assert s.preempt("r") == (103, 104, 105)
    s.append_tokens("r", [901])
    s.add_request("o", range(5))
    s.num_external_tokens("o", 0, hits(0))
    s.on_alloc("o", [103, 104], 0)
    assert s.build_step({"o": 5}) == []  # (was: block 1 of "r" from 103-105)
    assert s.on_store_done(first.job_id) == (100, 101, 102)
    # resumed: block 0 is in the store; block 1 is stored once recomputed in the new blocks
    load = s.on_alloc("r", gpu_blocks(7, base=200), s.num_external_tokens("r", 0, hits(1)))
    assert load is not None and load.gpu_block_ids == (200, 201, 202)
    assert s.on_load_done(load.job_id) == ()
    assert s.build_step({}) == []
    (second,) = s.build_step({"r": 24})
    assert second.first_block == 1 and second.gpu_block_ids == (203, 204, 205)


def test_a_preempted_request_that_ends_frees_nothing_twice() -> None:
    s, store = storing_six_blocks()
    assert s.preempt("r") == ()  # the store reads all six
    s.append_tokens("r", [7])
    fin = s.finish_request("r")  # aborted before it was resumed
    assert fin == Finished((), ())  # (was: all six again, and a final store from freed blocks)
    assert s.on_store_done(store.job_id) == tuple(gpu_blocks(6))
    assert s.pending_jobs == () and s.num_requests == 0


def test_preempt_during_a_load_waits_for_it_before_the_request_resumes() -> None:
    s = make()
    s.add_request("r", range(30))
    load = s.on_alloc("r", gpu_blocks(8), s.num_external_tokens("r", 0, hits(2)))
    assert load is not None
    assert s.preempt("r") == (106, 107)  # the load writes 100-105
    n = s.num_external_tokens("r", 0, hits(2))
    with pytest.raises(ValueError, match="in flight"):
        s.on_alloc("r", gpu_blocks(8, base=300), n)
    assert s.on_load_done(load.job_id, success=False) == (100, 101, 102, 103, 104, 105)
    again = s.on_alloc("r", gpu_blocks(8, base=300), n)
    assert again is not None and again.gpu_block_ids == tuple(gpu_blocks(6, base=300))


def test_a_step_with_a_bad_count_is_refused_whole() -> None:
    s = make()
    for rid in ("a", "b"):
        s.add_request(rid, range(24))
        s.num_external_tokens(rid, 0, hits(0))
    s.on_alloc("a", gpu_blocks(6), 0)
    s.on_alloc("b", gpu_blocks(3, base=200), 0)  # b has one offloaded block's worth
    with pytest.raises(ValueError, match="need 6 GPU blocks"):
        s.build_step({"a": 24, "b": 24})
    assert s.pending_jobs == ()  # (was: a's store made, tracked, and lost with the exception)
    assert s.build_step({}) == []  # b's bad count was not kept
    s.add_request("c", range(24))
    s.num_external_tokens("c", 12, hits(0))  # a GPU prefix hit of one offloaded block...
    with pytest.raises(ValueError, match="need 3 GPU blocks"):
        s.on_alloc("c", [], 0)  # ... and no blocks for it (was: accepted; the next step failed instead)
    s.extend_blocks("b", gpu_blocks(3, base=203))
    jobs = s.build_step({"a": 24, "b": 24})
    assert [(j.req_id, len(j.keys)) for j in jobs] == [("a", 2), ("b", 2)]


def test_a_refused_on_alloc_changes_nothing() -> None:
    s = make()
    s.keep_unused = True
    s.add_request("r", range(40))
    assert s.num_external_tokens("r", 0, hits(2)) == 24
    with pytest.raises(ValueError, match="do not end at a found offloaded block"):
        s.on_alloc("r", gpu_blocks(10), 20)  # not whole offloaded blocks
    assert s.build_step({}) == []  # (was: a store from blocks 100-102, never loaded nor computed)
    assert s.take_unused() == []  # the finds still wait for the load
    load = s.on_alloc("r", gpu_blocks(10), 24)
    assert load is not None and len(load.keys) == 2


def test_finds_beyond_what_the_engine_takes_after_a_gpu_hit_are_all_unused() -> None:
    """A GPU prefix hit of one offloaded block, four more found in the store, and the engine takes
    one of them: the other three are unused (with pinning lookups their leases are dropped). Only
    the last of them was reported -- the offset counted from the GPU hit -- and the leases of the
    others held those blocks until the server's lease time."""
    s = make()
    s.keep_unused = True
    s.add_request("r", range(5 * OFF_BS + 1))
    keys = s.keys("r")
    assert s.num_external_tokens("r", OFF_BS, hits(4)) == 4 * OFF_BS  # block 0 on the GPU; 1..4 found
    load = s.on_alloc("r", gpu_blocks(2 * FACTOR + 1), OFF_BS)  # the engine takes block 1 only
    assert load is not None and load.keys == tuple(keys[1:2])
    assert s.take_unused() == keys[2:5]


def test_on_alloc_again_without_preempt_waits_for_stores_from_the_blocks_it_replaces() -> None:
    s, store = storing_six_blocks()
    with pytest.raises(ValueError, match="in flight"):
        s.on_alloc("r", gpu_blocks(6, base=200), 0)
    assert s.on_store_done(store.job_id) == ()
    assert s.on_alloc("r", gpu_blocks(6, base=200), 0) is None


def test_a_preempted_remote_decode_request_stores_everything_again() -> None:
    """Blocks it stored may be evicted before it resumes; the remote decoder needs them all."""
    s = make()
    s.add_request("r", range(24), {"do_remote_decode": True})
    s.num_external_tokens("r", 0, hits(0))
    s.on_alloc("r", gpu_blocks(6), 0)
    (store,) = s.build_step({"r": 24})
    assert s.on_store_done(store.job_id) == ()
    assert s.preempt("r") == tuple(gpu_blocks(6))
    # resumed; the store evicted block 0 meanwhile, so the lookup finds nothing: all recomputed
    assert s.on_alloc("r", gpu_blocks(6, base=200), s.num_external_tokens("r", 0, hits(0))) is None
    (again,) = s.build_step({"r": 24})
    assert again.first_block == 0 and len(again.keys) == 2  # (was: nothing, the cursor past both)


def test_a_preempted_remote_decode_request_found_whole_on_resuming_still_stores_everything() -> None:
    """The cursor goes back to the start at the preemption itself: with every block still in the
    store, the resumed request loads them all and, for its remote decoder, stores them all again, as
    before it was preempted (a review found no test failing without the reset in ``preempt``)."""
    s = make()
    s.add_request("r", range(24), {"do_remote_decode": True})
    s.num_external_tokens("r", 0, hits(0))
    s.on_alloc("r", gpu_blocks(6), 0)
    (store,) = s.build_step({"r": 24})
    s.on_store_done(store.job_id)
    s.preempt("r")
    load = s.on_alloc("r", gpu_blocks(6, base=200), s.num_external_tokens("r", 0, hits(2)))
    assert load is not None and load.keys == tuple(s.keys("r")[:2])
    s.on_load_done(load.job_id)
    (again,) = s.build_step({"r": 24})
    assert again.first_block == 0 and again.keys == tuple(s.keys("r")[:2])


def test_a_resumed_request_stores_again_what_the_store_lost_meanwhile() -> None:
    """Stored blocks 0-5, preempted; the store evicted 3-5 meanwhile. The resumed request kept its
    cursor at 6: 3-5 were never stored again, and block 6 went out naming the missing block 5 as
    its parent -- stored, but out of reach of any prefix lookup."""
    s = make()
    s.add_request("r", range(72))
    s.num_external_tokens("r", 0, hits(0))
    s.on_alloc("r", gpu_blocks(18), 0)
    (first,) = s.build_step({"r": 72})
    s.on_store_done(first.job_id)
    s.preempt("r")
    s.append_tokens("r", range(900, 912))  # decoding on completes block 6 later
    load = s.on_alloc("r", gpu_blocks(21, base=200), s.num_external_tokens("r", 0, hits(3)))
    assert load is not None and load.keys == tuple(s.keys("r")[:3])
    s.on_load_done(load.job_id)
    (again,) = s.build_step({"r": 84})  # 3-5 recomputed, 6 computed
    assert again.first_block == 3 and again.keys == tuple(s.keys("r")[3:7])
    assert again.parent == s.keys("r")[2]  # found by the lookup


def test_a_failed_store_stops_the_requests_stores_until_it_resumes() -> None:
    """A store failed (the server full); the next one named a block that store had not stored as
    its parent: unreachable, and it could take the room of reachable blocks."""
    s = make()
    s.add_request("r", range(48))
    s.num_external_tokens("r", 0, hits(0))
    s.on_alloc("r", gpu_blocks(12), 0)
    (first,) = s.build_step({"r": 24})  # chunked prefill: blocks 0-1
    s.on_store_done(first.job_id, success=False)
    assert s.build_step({"r": 48}) == []  # (was: blocks 2-3, with block 1 as their parent)
    s.preempt("r")
    assert s.on_alloc("r", gpu_blocks(12, base=200), s.num_external_tokens("r", 0, hits(0))) is None
    (again,) = s.build_step({"r": 48})  # resumed, recomputed: stored from the first block missing
    assert again.first_block == 0 and len(again.keys) == 4


def test_a_store_from_before_a_preemption_that_fails_later_does_not_stop_the_resumed_requests_stores() -> None:
    s = make()
    s.add_request("r", range(24))
    s.num_external_tokens("r", 0, hits(0))
    s.on_alloc("r", gpu_blocks(6), 0)
    (old,) = s.build_step({"r": 24})
    s.preempt("r")  # its store still in flight
    assert s.on_alloc("r", gpu_blocks(6, base=200), s.num_external_tokens("r", 0, hits(0))) is None
    s.on_store_done(old.job_id, success=False)  # the old store fails now
    (again,) = s.build_step({"r": 24})  # (was: nothing, ever: the old failure stopped the new run)
    assert again.first_block == 0 and again.gpu_block_ids == tuple(gpu_blocks(6, base=200))


def test_finish_flushes_the_block_completed_by_the_last_known_token() -> None:
    s = make()
    s.add_request("r", range(23))
    s.num_external_tokens("r", 0, hits(0))
    s.on_alloc("r", gpu_blocks(6), 0)
    (first,) = s.build_step({"r": 24})  # KV of 24 tokens after this step, 23 token ids known
    assert first.keys == tuple(s.keys("r"))
    s.append_tokens("r", [7])  # the last sampled token arrives; the request ends
    fin = s.finish_request("r")
    (last,) = fin.stores
    assert last.first_block == 1 and last.gpu_block_ids == (103, 104, 105)
    # blocks read by the two stores in flight are not free yet
    assert fin.free_now == ()
    assert s.on_store_done(first.job_id) == (100, 101, 102)
    assert s.on_store_done(last.job_id, success=False) == (103, 104, 105)
    assert s.pending_jobs == () and s.num_requests == 0


def test_finish_during_a_load_defers_the_blocks_being_written() -> None:
    s = make()
    s.add_request("r", range(30))
    n = s.num_external_tokens("r", 0, hits(2))
    load = s.on_alloc("r", gpu_blocks(8), n)
    assert load is not None
    fin = s.finish_request("r")  # aborted while loading
    assert fin.free_now == (106, 107) and fin.stores == ()
    with pytest.raises(KeyError):
        s.build_step({"r": 30})
    assert s.on_load_done(load.job_id) == tuple(gpu_blocks(6))
    assert s.num_requests == 0


def test_failed_load_is_recomputed_and_then_stored() -> None:
    s = make()
    s.add_request("r", range(24))
    n = s.num_external_tokens("r", 0, hits(2))
    load = s.on_alloc("r", gpu_blocks(6), n)
    assert load is not None
    s.on_load_done(load.job_id, success=False)
    assert s.build_step({}) == []  # not scheduled yet: the blocks hold nothing of r's
    (store,) = s.build_step({"r": 24})  # the engine recomputed everything
    assert store.first_block == 0 and store.gpu_block_ids == tuple(gpu_blocks(6))


def test_blocks_added_later_and_missing_blocks() -> None:
    s = make()
    s.add_request("r", range(24))
    s.on_alloc("r", gpu_blocks(3), 0)
    with pytest.raises(ValueError, match="GPU blocks"):
        s.build_step({"r": 24})
    s.extend_blocks("r", [7, 8, 9])
    (store,) = s.build_step({"r": 24})
    assert store.gpu_block_ids == (100, 101, 102, 7, 8, 9)


def test_extra_keys_separate_requests() -> None:
    s = make()
    s.add_request("a", range(12), extra=("lora", 1))
    s.add_request("b", range(12), extra=("lora", 2))
    s.add_request("c", range(12))
    assert len({s.keys("a")[0], s.keys("b")[0], s.keys("c")[0]}) == 3


def test_misuse_is_refused() -> None:
    s = make()
    with pytest.raises(ValueError):
        OffloadScheduler(BlockHasher(10), 4)
    s.add_request("r", range(24))
    with pytest.raises(ValueError):
        s.add_request("r", range(24))
    with pytest.raises(KeyError):
        s.build_step({"nope": 1})
    with pytest.raises(ValueError, match="whole GPU blocks"):
        s.num_external_tokens("r", 5, hits(0))
    with pytest.raises(ValueError, match="answered"):
        s.num_external_tokens("r", 0, lambda keys: 3)
    s.num_external_tokens("r", 0, hits(1))
    with pytest.raises(ValueError, match="found offloaded block"):
        s.on_alloc("r", gpu_blocks(6), 24)  # more than the lookup found
    with pytest.raises(ValueError, match="found offloaded block"):
        s.on_alloc("r", gpu_blocks(6), 6)  # not a block boundary
    load = s.on_alloc("r", gpu_blocks(6), 12)
    assert load is not None
    with pytest.raises(ValueError, match="in flight"):
        s.on_alloc("r", gpu_blocks(6), 0)
    with pytest.raises(ValueError, match="not a store"):
        s.on_store_done(load.job_id)
    # each of these raised a bare KeyError, AttributeError or TypeError, the last one far from its cause
    s.on_load_done(load.job_id)
    with pytest.raises(ValueError, match=f"job {load.job_id} is not pending"):
        s.on_load_done(load.job_id)
    with pytest.raises(ValueError, match="job 999 is not pending"):
        s.on_store_done(999)
    with pytest.raises(TypeError, match="kv_transfer_params must be a mapping, got list"):
        s.add_request("pairs", range(8), [("do_remote_decode", True)])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="answered None"):
        s.num_external_tokens("r", 0, lambda keys: None)  # type: ignore[arg-type,return-value]
    with pytest.raises(ValueError, match="answered 1.0"):
        s.num_external_tokens("r", 0, lambda keys: 1.0)  # type: ignore[arg-type,return-value]
    assert s.num_external_tokens("r", 0, lambda keys: np.int64(0)) == 0  # (a numpy count is a count)
    for size in (4.0, True, "4"):  # (4.0 from a "/" was taken, and failed at the first on_alloc)
        with pytest.raises(ValueError, match="gpu_block_size must be an integer"):
            OffloadScheduler(BlockHasher(8), size)  # type: ignore[arg-type]
