"""Paged KV cache <-> payload round trips (CPU tensors), refusals, and the job executor's logic."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import torch

from kvstore.engine.hashing import BlockHasher
from kvstore.engine.offload import OffloadScheduler
from kvstore.engine.transfer import HEADER_SIZE, PagedKVTransfer, PayloadMismatch, TransferExecutor
from kvstore.errors import BlockSizeError, CapacityError, KVStoreError

LAYERS, NUM_BLOCKS, BS, HEADS, DIM = 3, 10, 4, 2, 8
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn]
LAYOUTS = {
    1: (2, NUM_BLOCKS, BS, HEADS, DIM),  # [2, num_blocks, block_size, heads, dim] (vLLM flash-attn)
    0: (NUM_BLOCKS, 2, BS, HEADS, DIM),  # [num_blocks, 2, block_size, heads, dim]
}


def make_caches(dtype: torch.dtype, block_dim: int, fill: str = "random", seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shape = LAYOUTS[block_dim]
    if fill == "zeros":
        return [torch.zeros(shape, dtype=dtype) for _ in range(LAYERS)]
    return [(torch.randn(shape, generator=gen) * 4).to(dtype) for _ in range(LAYERS)]


def blocks_of(cache: torch.Tensor, block_dim: int, ids: Sequence[int]) -> torch.Tensor:
    return cache.index_select(block_dim, torch.tensor(ids))


def same(a: torch.Tensor, b: torch.Tensor) -> None:
    if a.dtype == torch.float8_e4m3fn:  # compare fp8 bit for bit
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("block_dim", sorted(LAYOUTS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip(dtype: torch.dtype, block_dim: int) -> None:
    src = make_caches(dtype, block_dim)
    before = [c.clone() for c in src]
    dst = make_caches(dtype, block_dim, "zeros")
    src_ids, dst_ids = [7, 2, 5, 0], [1, 9, 3, 4]  # two offloaded blocks of factor 2, shuffled
    payloads = PagedKVTransfer(src, 2, block_dim=block_dim).gather(src_ids)
    assert len(payloads) == 2
    PagedKVTransfer(dst, 2, block_dim=block_dim).scatter(payloads, dst_ids)
    for s, b, d in zip(src, before, dst):
        same(s, b)  # source unchanged
        same(blocks_of(d, block_dim, dst_ids), blocks_of(s, block_dim, src_ids))
        untouched = [i for i in range(NUM_BLOCKS) if i not in dst_ids]
        assert not blocks_of(d, block_dim, untouched).view(torch.uint8).any()


@pytest.mark.parametrize("block_dim", sorted(LAYOUTS))
def test_payload_layout_is_the_documented_one(block_dim: int) -> None:
    src = make_caches(torch.bfloat16, block_dim)
    ids = [3, 8]
    t = PagedKVTransfer(src, 2, block_dim=block_dim)
    (payload,) = t.gather(ids)
    expected = torch.cat([blocks_of(c, block_dim, ids).contiguous().view(torch.uint8).flatten() for c in src])
    assert torch.equal(payload[HEADER_SIZE:], expected)
    assert bytes(payload[:4].numpy()) == b"kvsP"
    assert t.payload_size == HEADER_SIZE + LAYERS * 2 * 2 * BS * HEADS * DIM * 2


def test_bytes_payloads_and_skip() -> None:
    src = make_caches(torch.float16, 1)
    dst = make_caches(torch.float16, 1, "zeros")
    payloads = [bytes(p.numpy()) for p in PagedKVTransfer(src, 3).gather([0, 1, 2, 3, 4, 5])]
    # the first GPU block of the first payload is already cached at the destination: skip it
    PagedKVTransfer(dst, 3).scatter(payloads, [6, 7, 8, 9, 0], skip=1)
    for s, d in zip(src, dst):
        same(blocks_of(d, 1, [6, 7, 8, 9, 0]), blocks_of(s, 1, [1, 2, 3, 4, 5]))
        assert not d[:, 1:6].any()


def test_gather_into_given_buffers() -> None:
    src = make_caches(torch.float32, 0)
    t = PagedKVTransfer(src, 1, block_dim=0)
    out = t.new_payloads(2)
    got = t.gather([4, 5], out=out)
    assert got[0] is out[0] and got[1] is out[1]
    with pytest.raises(PayloadMismatch):
        t.gather([4], out=[torch.empty(t.payload_size - 1, dtype=torch.uint8)])
    with pytest.raises(PayloadMismatch):
        t.gather([4], out=[torch.empty(t.payload_size // 4, dtype=torch.float32)])


def test_wrong_payloads_are_refused_clearly() -> None:
    src = make_caches(torch.bfloat16, 1)
    (payload,) = PagedKVTransfer(src, 2).gather([0, 1])
    dst_bf16 = PagedKVTransfer(make_caches(torch.bfloat16, 1, "zeros"), 2)
    with pytest.raises(PayloadMismatch, match=f"has {payload.numel() - 1} bytes") as info:
        dst_bf16.scatter([payload[:-1]], [2, 3])
    assert isinstance(info.value, BlockSizeError) and isinstance(info.value, KVStoreError)
    with pytest.raises(PayloadMismatch):
        dst_bf16.scatter([bytes(payload.numpy()) + b"\0"], [2, 3])
    with pytest.raises(PayloadMismatch, match="empty"):
        dst_bf16.scatter([b""], [2, 3])
    # same size, other dtype: only the header can tell
    fp16_caches = make_caches(torch.float16, 1, "zeros")
    dst_fp16 = PagedKVTransfer(fp16_caches, 2)
    assert dst_fp16.payload_size == dst_bf16.payload_size
    with pytest.raises(PayloadMismatch, match="another dtype"):
        dst_fp16.scatter([payload], [2, 3])
    # same bytes, other layout (the block axis elsewhere)
    other_layout = [c.reshape(NUM_BLOCKS, 2, BS, HEADS, DIM).clone() for c in make_caches(torch.bfloat16, 1)]
    with pytest.raises(PayloadMismatch):
        PagedKVTransfer(other_layout, 2, block_dim=0).scatter([payload], [2, 3])
    strided = np.frombuffer(bytes(payload.numpy()) * 2, dtype=np.uint8)[::2]  # right size, not contiguous
    with pytest.raises(PayloadMismatch, match="contiguous"):
        dst_bf16.scatter([strided], [2, 3])
    garbage = bytearray(dst_bf16.payload_size)
    with pytest.raises(PayloadMismatch, match="not a kvstore KV payload"):
        dst_bf16.scatter([garbage], [2, 3])
    assert not any(c.view(torch.uint8).any() for c in fp16_caches)  # nothing was written


def test_bad_ids_and_layouts_are_refused() -> None:
    caches = make_caches(torch.float32, 1)
    t = PagedKVTransfer(caches, 2)
    payloads = t.gather([0, 1])
    with pytest.raises(ValueError, match="whole offloaded blocks"):
        t.gather([0, 1, 2])
    with pytest.raises(ValueError, match="in 0..9"):
        t.gather([0, NUM_BLOCKS])
    with pytest.raises(ValueError, match="need 2 GPU blocks"):
        t.scatter(payloads, [0])
    with pytest.raises(ValueError, match="duplicate"):
        t.scatter(payloads, [3, 3])
    with pytest.raises(ValueError, match="integers"):  # (2.7 was taken for block 2)
        t.scatter(payloads, [2.7, 3.9])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="integers"):
        t.gather([0.5, 1.5])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="integers"):  # (taken as blocks 1 and 0)
        t.gather([True, False])
    assert t.gather(np.array([0, 1]))[0].numel() == t.payload_size  # numpy integers are integers
    with pytest.raises(ValueError):
        PagedKVTransfer(caches, 2, block_dim=4)
    with pytest.raises(ValueError, match="does not match layer 0"):
        PagedKVTransfer([caches[0], caches[1][:, :5]], 2)
    with pytest.raises(ValueError):
        PagedKVTransfer([], 2)
    for factor in (2.0, 1.5, True):  # (a struct.error, or True taken for 1)
        with pytest.raises(ValueError, match="block_size_factor must be an integer"):
            PagedKVTransfer(caches, factor)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="skip=2: it counts GPU blocks of the first payload, 0 to 1"):
        t.scatter(payloads, [], skip=2)  # (said "need 0 GPU blocks, got 0")


def test_a_layer_whose_elements_overlap_is_refused_before_anything_is_written() -> None:
    """(engine review) An expand()ed layer was taken; a load then wrote the layers before it and
    failed on it with a bare RuntimeError, the cache half-written."""
    caches = make_caches(torch.float32, 1)
    payloads = PagedKVTransfer(caches, 2).gather([0, 1])
    shared = caches[1][:, :1].expand(caches[1].shape)  # every block one block's memory
    for layer in (shared, caches[1].flatten().as_strided(caches[1].shape, (1,) * caches[1].dim())):
        with pytest.raises(ValueError, match="layer 1: its elements overlap"):
            PagedKVTransfer([caches[0].clone(), layer], 2)
    assert PagedKVTransfer([caches[0], caches[1].transpose(2, 3)], 2).gather([0, 1])  # (strided, not overlapping)
    PagedKVTransfer(caches, 2).scatter(payloads, [2, 3])  # (the usual layers still load)


@pytest.mark.parametrize("block_dim", sorted(LAYOUTS))
@pytest.mark.parametrize("skip", [0, 1])
@pytest.mark.parametrize("stage", ["whole", "2 payloads"])
def test_devices_other_than_the_cpu_go_through_device_side_payloads(block_dim: int, skip: int, stage: str,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Off the CPU (CUDA, and xpu, mps, ...: any device torch copies to and from the host) blocks
    are gathered into payloads on the device and copied once each way, a layer's blocks of a stage
    (``STAGE_BYTES`` of payloads) in one operation (tests_gpu runs this on CUDA); only CUDA took
    that path before, and another device failed in torch's copy with a bare RuntimeError. Here the
    path runs on CPU tensors, its copies included. The meta device holds no data."""
    from kvstore.engine import transfer

    src, dst = make_caches(torch.bfloat16, block_dim), make_caches(torch.bfloat16, block_dim, "zeros")
    out, into = PagedKVTransfer(src, 2, block_dim=block_dim), PagedKVTransfer(dst, 2, block_dim=block_dim)
    if stage != "whole":
        monkeypatch.setattr(transfer, "STAGE_BYTES", 2 * (out.payload_size - HEADER_SIZE))  # 2 blocks' bytes
        assert out._stages(3) == [(0, 1), (1, 3)]  # as few stages as fit, of even sizes
    expected = [p.clone() for p in out.gather([7, 2, 5, 0, 9, 8])]
    out._staged = into._staged = True
    payloads = out.gather([7, 2, 5, 0, 9, 8])
    assert all(torch.equal(p, e) for p, e in zip(payloads, expected))
    into.scatter(payloads, [1, 6, 3, 4, 0, 2][skip:], skip=skip)
    for s, d in zip(src, dst):
        same(blocks_of(d, block_dim, [1, 6, 3, 4, 0, 2][skip:]), blocks_of(s, block_dim, [7, 2, 5, 0, 9, 8][skip:]))
        if skip:
            assert not blocks_of(d, block_dim, [1]).any()
    assert out.gather([]) == []
    into.scatter([], [])
    with pytest.raises(ValueError, match="duplicate"):  # (ids as a tensor too)
        into.scatter(payloads[:1], torch.tensor([3, 3]))
    with pytest.raises(ValueError, match="meta device"):
        PagedKVTransfer([torch.empty(2, 4, 2, 2, device="meta")], 2)


class DictStore:
    """An in-process stand-in with the client's contract, for the executor's own logic only
    (the executor against the real server: test_seed_scenario.py, test_pd_example.py)."""

    def __init__(self) -> None:
        self.blocks: dict[bytes, bytes] = {}
        self.fail_puts = False

    def delete(self, keys: Sequence[bytes]) -> int:
        return sum(self.blocks.pop(k, None) is not None for k in keys)

    def put(self, keys: Sequence[bytes], blocks: Sequence[Any], *, parent: bytes | None = None) -> None:
        if self.fail_puts:
            raise CapacityError("full")
        for k, b in zip(keys, blocks):
            self.blocks.setdefault(k, bytes(b))

    def lookup(self, keys: Sequence[bytes]) -> int:
        n = 0
        while n < len(keys) and keys[n] in self.blocks:
            n += 1
        return n

    def get_into(self, keys: Sequence[bytes], buffers: Sequence[Any]) -> list[bool]:
        found = []
        for k, buf in zip(keys, buffers):
            if k in self.blocks:
                memoryview(buf)[:] = self.blocks[k]
            found.append(k in self.blocks)
        return found


def test_executor_moves_jobs_and_reports_them() -> None:
    store = DictStore()
    src = make_caches(torch.bfloat16, 1)
    prefill = OffloadScheduler(BlockHasher(8), 4)
    ex = TransferExecutor(store, PagedKVTransfer(src, 2), prefill)
    prefill.add_request("p", range(20))
    prefill.on_alloc("p", [5, 6, 7, 8, 9], 0)
    stores = prefill.build_step({"p": 20})
    done = ex.run(stores)
    assert done.failed == () and prefill.pending_jobs == ()
    assert len(store.blocks) == 2

    dst = make_caches(torch.bfloat16, 1, "zeros")
    decode = OffloadScheduler(BlockHasher(8), 4)
    dx = TransferExecutor(store, PagedKVTransfer(dst, 2), decode)
    decode.add_request("d", range(20))
    n = decode.num_external_tokens("d", 0, dx.lookup)
    assert n == 16
    load = decode.on_alloc("d", [0, 1, 2, 3, 4], n)
    assert load is not None
    fin = decode.finish_request("d")  # ends while loading: blocks 0..3 are freed by the load
    assert fin.free_now == (4,)
    done = dx.run([load])
    assert done.failed == () and done.freed == (0, 1, 2, 3)
    for s, d in zip(src, dst):
        same(d[:, :4], s[:, 5:9])


def test_executor_failures_are_reported_not_raised() -> None:
    store = DictStore()
    caches = make_caches(torch.float32, 1)
    s = OffloadScheduler(BlockHasher(8), 4)
    ex = TransferExecutor(store, PagedKVTransfer(caches, 2), s)
    s.add_request("r", range(16))
    s.num_external_tokens("r", 0, lambda keys: 2)  # a lookup that lies: blocks not there
    load = s.on_alloc("r", list(range(4)), 16)
    assert load is not None
    before = [c.clone() for c in caches]
    done = ex.run([load])
    assert done.failed == (load,) and s.pending_jobs == ()
    for b, c in zip(before, caches):
        same(b, c)  # a failed load writes nothing
    store.fail_puts = True
    stores = s.build_step({"r": 16})  # recomputed after the failed load; stored from block 0
    assert [j.first_block for j in stores] == [0]
    done = ex.run(stores)
    assert done.failed == tuple(stores) and s.pending_jobs == ()


def test_an_unexpected_error_fails_its_job_and_the_others_still_run(caplog) -> None:  # type: ignore[no-untyped-def]
    store = DictStore()
    s = OffloadScheduler(BlockHasher(8), 4)
    ex = TransferExecutor(store, PagedKVTransfer(make_caches(torch.float32, 1), 2), s)
    for rid, ids in (("bad", [NUM_BLOCKS, NUM_BLOCKS + 1]), ("good", [0, 1])):  # the engine's mistake: no such block
        s.add_request(rid, range(8))
        s.num_external_tokens(rid, 0, lambda keys: 0)
        s.on_alloc(rid, ids, 0)
    bad, good = s.build_step({"bad": 8, "good": 8})
    done = ex.run([bad, good])
    assert done.failed == (bad,) and s.pending_jobs == ()  # (was: ValueError, both jobs pending for good)
    assert len(store.blocks) == 1 and "Traceback" in caplog.text and "in 0..9" in caplog.text


@pytest.mark.parametrize("pin", [False, True])
def test_a_store_that_cannot_be_reached_is_a_miss_not_an_error_in_the_scheduling_step(pin: bool, caplog) -> None:  # type: ignore[no-untyped-def]
    """The scheduler asks the store during the engine's scheduling step: a store that is down
    raised out of num_external_tokens (the engine's step failed); the store is a cache."""
    from kvstore.client import KVClient
    from kvstore.server.process import ServerProcess

    with ServerProcess("--capacity", "16MiB") as srv:
        kv = KVClient(srv.addr, namespace="gone", timeout=2.0, retries=0)
        kv.connect()
    try:
        sched = OffloadScheduler(BlockHasher(8), 4)
        ex = TransferExecutor(kv, PagedKVTransfer(make_caches(torch.float32, 1), 2), sched, pin=pin)
        sched.add_request("r", range(24))
        assert sched.num_external_tokens("r", 0, ex.lookup) == 0
        assert "kvstore lookup failed, treating it as a miss" in caplog.text
        assert sched.on_alloc("r", list(range(6)), 0) is None  # and the request goes on: nothing to load
    finally:
        kv.close()


def test_a_load_that_finds_only_some_of_its_blocks_writes_nothing_and_deletes_nothing() -> None:
    """A block evicted between the lookup and the load (no pin): the load fails as a miss, before
    any payload is scattered, and the blocks it did find stay (they are fine). Scattered, the
    missing block's payload would be whatever the fresh buffer held -- a payload of an earlier
    load, in memory the allocator handed out again, would pass its header check."""
    from kvstore.client import KVClient
    from kvstore.server.process import ServerProcess

    hasher, prompt = BlockHasher(8), list(range(24))
    keys = hasher.keys(prompt)
    src = make_caches(torch.float32, 1)
    with ServerProcess("--capacity", "16MiB") as srv, KVClient(srv.addr, namespace="gap") as kv:
        kv.put(keys, [bytes(p.numpy()) for p in PagedKVTransfer(src, 2).gather(list(range(6)))])
        dst = make_caches(torch.float32, 1, "zeros")
        sched = OffloadScheduler(hasher, 4)
        ex = TransferExecutor(kv, PagedKVTransfer(dst, 2), sched)
        sched.add_request("r", prompt + [1])
        assert sched.num_external_tokens("r", 0, ex.lookup) == 24
        load = sched.on_alloc("r", list(range(7)), 24)
        assert load is not None
        kv.delete([keys[1]])
        assert ex.load(load) is False
        assert not any(d.any() for d in dst)
        assert kv.exists(keys) == [True, False, True]


def put_with_a_wrong_checksum(addr: str, ns: str, keys: list[bytes], blocks: list[bytes], bad: int) -> None:
    """A PUT whose checksum of block ``bad`` does not match its bytes: a block corrupted on its way."""
    import socket

    import xxhash

    from kvstore.messages import Hello, Put
    from kvstore.protocol import Frame, FrameReader, encode

    sums = [xxhash.xxh3_64_intdigest(b) ^ (i == bad) for i, b in enumerate(blocks)]
    frames = encode(Hello(namespace=ns), 1) + encode(Put(keys=keys, sizes=[len(b) for b in blocks],
                                                         checksums=sums), 2, blocks)
    host, port = addr.rsplit(":", 1)
    reader, replies = FrameReader(is_server=False), 0
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(b"".join(bytes(f) for f in frames))
        while replies < 2:
            chunk = sock.recv(65536)
            assert chunk, "the server closed the connection"
            reader.feed(chunk)
            while isinstance(reader.next_event(), Frame):
                replies += 1


@pytest.mark.parametrize("damage", ["checksum", "layout", "same size, another layout"])
def test_a_block_that_cannot_be_loaded_is_deleted_so_the_recomputed_prefix_is_stored(damage: str) -> None:
    """A stored block the engine cannot load (corrupted; another engine's layout in the namespace)
    failed every load of its prefix for good: each lookup offered it, and the recomputed prefix's
    store found it present and left it. The executor now deletes it -- only it."""
    from kvstore.client import KVClient
    from kvstore.errors import IntegrityError
    from kvstore.server.process import ServerProcess

    hasher, prompt = BlockHasher(8), list(range(16))
    keys = hasher.keys(prompt)
    src = make_caches(torch.float32, 1)
    payloads = [bytes(p.numpy()) for p in PagedKVTransfer(src, 2).gather([0, 1, 2, 3])]
    with ServerProcess("--capacity", "16MiB") as srv, KVClient(srv.addr, namespace="bad") as kv:
        if damage == "checksum":
            put_with_a_wrong_checksum(srv.addr, "bad", keys, payloads, bad=1)
            with pytest.raises(IntegrityError):
                kv.get(keys)
        else:  # the same prompt's blocks from an engine whose cache is float16 (another payload size),
            # or of the same shape whose bytes mean something else (its layout_tag: fp8 against int8, say)
            other = PagedKVTransfer(make_caches(torch.float16, 1), 2) if damage == "layout" else \
                PagedKVTransfer(make_caches(torch.float32, 1), 2, layout_tag="another engine")
            kv.put(keys, [bytes(p.numpy()) for p in other.gather([0, 1, 2, 3])])
        dst = make_caches(torch.float32, 1, "zeros")
        sched = OffloadScheduler(hasher, 4)
        ex = TransferExecutor(kv, PagedKVTransfer(dst, 2), sched, pin=True)
        for rid, expect_failed in (("first", True), ("second", False)):
            sched.add_request(rid, prompt + [7])
            assert sched.num_external_tokens(rid, 0, ex.lookup) == 16  # (both blocks offered)
            load = sched.on_alloc(rid, [0, 1, 2, 3, 4], 16)
            assert load is not None
            done = ex.run([load])
            assert bool(done.failed) is expect_failed
            if expect_failed:  # the engine computes the prompt into its blocks 0..3 and stores it
                for s, d in zip(src, dst):
                    d[:, :4] = s[:, :4]
                assert kv.exists(keys) == ([True, False] if damage == "checksum" else [False, False])
                assert ex.run(sched.build_step({rid: 17})).failed == ()
                for d in dst:
                    d.zero_()
            sched.finish_request(rid)
        for s, d in zip(src, dst):  # the second request loaded what the first one stored
            same(d[:, :4], s[:, :4])
