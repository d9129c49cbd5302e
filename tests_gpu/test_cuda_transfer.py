"""KV blocks between GPU tensors and a real kvstore-server, as an engine moves them.

Each test puts random bytes (never zeros: a block left unwritten must show) through
:class:`PagedKVTransfer` and a real client, and compares bytes, not values (bf16 and fp8
travel bit-exact, NaN patterns included).
"""

from __future__ import annotations

import hashlib
import os
import threading

import pytest
import torch

from kvstore.client import KVClient
from kvstore.engine.transfer import HEADER_SIZE, PagedKVTransfer

BLOCKS = 64
LAYERS = 4
POISON = 0xA5


def keys(tag: str, n: int) -> list[bytes]:
    """``n`` keys no other call returns (the server outlives a test)."""
    salt = os.urandom(8).hex()
    return [hashlib.sha256(f"{tag}:{salt}:{i}".encode()).digest() for i in range(n)]


def random_bytes(t: torch.Tensor) -> torch.Tensor:
    t.view(torch.uint8).random_(0, 256)
    return t


def layers(device: torch.device, layout: str, dtype: torch.dtype) -> tuple[list[torch.Tensor], int, str | None]:
    """Per-layer caches of the ``layout``, random bytes: (tensors, block_dim, layout_tag)."""
    if layout == "2NBHD":  # [2, num_blocks, block_size, kv_heads, head_dim]
        shape, dim, tag = (2, BLOCKS, 16, 8, 128), 1, None
    elif layout == "N2BHD":
        shape, dim, tag = (BLOCKS, 2, 16, 8, 128), 0, None
    else:  # vLLM's pages: a byte view per block, the layout named by a tag
        shape, dim, tag, dtype = (BLOCKS, 2 * 16 * 8 * 128 * 2), 0, "bf16 NHD", torch.int8
    return [random_bytes(torch.empty(shape, dtype=dtype, device=device)) for _ in range(LAYERS)], dim, tag


def block(cache: torch.Tensor, dim: int, b: int) -> torch.Tensor:
    return cache.view(torch.uint8).select(dim, b)


def poisoned_like(caches: list[torch.Tensor]) -> list[torch.Tensor]:
    out = [torch.empty_like(c) for c in caches]
    for c in out:
        c.view(torch.uint8).fill_(POISON)
    return out


LAYOUTS = [("2NBHD", torch.bfloat16), ("2NBHD", torch.float8_e4m3fn), ("2NBHD", torch.float32),
           ("N2BHD", torch.float16), ("pages", torch.int8)]


@pytest.mark.parametrize("layout,dtype", LAYOUTS, ids=[f"{lay}-{str(dt)[6:]}" for lay, dt in LAYOUTS])
def test_blocks_go_to_the_store_and_back_into_other_gpu_blocks_bit_exact(
        client: KVClient, device: torch.device, layout: str, dtype: torch.dtype) -> None:
    src, dim, tag = layers(device, layout, dtype)
    dst = poisoned_like(src)
    send = PagedKVTransfer(src, 2, block_dim=dim, layout_tag=tag)
    recv = PagedKVTransfer(dst, 2, block_dim=dim, layout_tag=tag)
    src_ids, dst_ids = [3, 9, 10, 40, 41, 63], [50, 0, 7, 8, 20, 21]
    ks = keys(f"round-{layout}-{dtype}", 3)

    payloads = send.gather(src_ids)
    assert all(p.device.type == "cpu" and p.is_pinned() == (device.type == "cuda") for p in payloads)
    assert client.put(ks, [p.numpy().data for p in payloads]).stored == 3
    back = recv.new_payloads(3)
    assert client.get_into(ks, [b.numpy().data for b in back]) == [True] * 3
    assert all(torch.equal(a, b) for a, b in zip(payloads, back))
    recv.scatter(back, dst_ids)

    for s, d in zip(src, dst):
        for a, b in zip(src_ids, dst_ids):
            assert torch.equal(block(s, dim, a), block(d, dim, b)), f"GPU block {a} -> {b} differs"
        untouched = [b for b in range(BLOCKS) if b not in dst_ids]
        assert bool((d.view(torch.uint8).index_select(dim, torch.tensor(untouched, device=device)) == POISON).all())


@pytest.mark.parametrize("stage", ["whole", "1 payload"])
def test_a_load_that_skips_cached_blocks_writes_only_the_rest(client: KVClient, device: torch.device, stage: str,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Also staged one payload at a time (a job larger than ``STAGE_BYTES``)."""
    from kvstore.engine import transfer

    src, dim, tag = layers(device, "2NBHD", torch.bfloat16)
    dst = poisoned_like(src)
    send, recv = PagedKVTransfer(src, 4, block_dim=dim), PagedKVTransfer(dst, 4, block_dim=dim)
    if stage != "whole":
        monkeypatch.setattr(transfer, "STAGE_BYTES", send.payload_size)
    ks = keys("skip", 2)
    client.put(ks, [p.numpy().data for p in send.gather(list(range(8)))])
    back = recv.new_payloads(2)
    assert client.get_into(ks, [b.numpy().data for b in back]) == [True, True]
    recv.scatter(back, [11, 12, 13, 14, 15], skip=3)  # the first payload's first 3 blocks are cached
    for s, d in zip(src, dst):
        for a, b in zip(range(3, 8), range(11, 16)):
            assert torch.equal(block(s, dim, a), block(d, dim, b))
        untouched = [b for b in range(BLOCKS) if b not in range(11, 16)]
        assert bool((d.view(torch.uint8).index_select(dim, torch.tensor(untouched, device=device)) == POISON).all())


def _slow_then(device: torch.device, work: list[torch.Tensor], value: int) -> None:
    """Queue a GPU sleep, then fills of ``work`` with ``value``, on the current stream: they land
    well after the host has moved on (on the CPU: at once)."""
    if device.type == "cuda":
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU clock cycles
    for w in work:
        w.fill_(value)


@pytest.mark.parametrize("stream", ["default", "own"])
def test_a_gather_sees_the_writes_queued_before_it_on_the_compute_stream(
        device: torch.device, stream: str) -> None:
    """The forward pass that writes a block is queued, not done, when its store starts: on the
    default stream, and on a stream of its own (as an engine may run its forward pass). Checked on
    an H200 with the side stream's wait taken out: ``own`` failed; ``default`` still passed there
    (what else ordered it was not found)."""
    src, dim, _ = layers(device, "2NBHD", torch.bfloat16)
    send = PagedKVTransfer(src, 1, block_dim=dim)
    own = torch.cuda.Stream(device) if device.type == "cuda" and stream == "own" else None
    send.gather([5])  # (a first pinned allocation synchronizes the device: it would hide a missing wait)
    with torch.cuda.stream(own) if own is not None else _nothing():
        _slow_then(device, [block(c, dim, 5) for c in src], 0x3C)
        payload = send.gather([5])[0]
    assert bool((payload[HEADER_SIZE:] == 0x3C).all()), "the gather read the block before its queued writes"


def test_a_scatter_lands_after_queued_work_and_is_done_when_it_returns(client: KVClient, device: torch.device) -> None:
    """A load's blocks are zeroed (queued) first; the scatter must land after that, and be visible
    to the compute stream once it returns."""
    src, dim, _ = layers(device, "2NBHD", torch.bfloat16)
    dst = poisoned_like(src)
    send, recv = PagedKVTransfer(src, 1, block_dim=dim), PagedKVTransfer(dst, 1, block_dim=dim)
    ks = keys("order", 4)
    client.put(ks, [p.numpy().data for p in send.gather([1, 2, 3, 4])])
    back = recv.new_payloads(4)
    assert client.get_into(ks, [b.numpy().data for b in back]) == [True] * 4
    recv.scatter(back, [30, 31, 32, 33])  # (a first pinned allocation synchronizes the device)
    _slow_then(device, [block(d, dim, b) for d in dst for b in (30, 31, 32, 33)], 0)
    recv.scatter(back, [30, 31, 32, 33])
    got = [block(d, dim, b).clone() for d in dst for b in (30, 31, 32, 33)]  # queued on the compute stream
    want = [block(s, dim, b) for s in src for b in (1, 2, 3, 4)]
    assert all(torch.equal(g, w) for g, w in zip(got, want)), "the scatter was overwritten or not yet done"


def test_stores_and_loads_on_two_threads_share_one_cache(server, device: torch.device) -> None:  # type: ignore[no-untyped-def]
    """As the vLLM worker runs them: gathers + puts on one thread, gets + scatters on another, one
    transfer (one side stream) between them, while the compute stream keeps writing other blocks."""
    src, dim, _ = layers(device, "2NBHD", torch.bfloat16)
    cache = PagedKVTransfer(src, 2, block_dim=dim)
    rounds, errors = 25, []
    stored = keys("threads-stored", rounds)
    ks_in = keys("threads-in", rounds)
    other, _, _ = layers(device, "2NBHD", torch.bfloat16)  # what the load thread fetches
    incoming = PagedKVTransfer(other, 2, block_dim=dim).gather(list(range(2 * rounds)))
    expected = {r: p for r, p in enumerate(incoming)}
    with KVClient(server.addr, shm=True) as kv:
        kv.put(ks_in, [p.numpy().data for p in incoming])

        def stores() -> None:
            try:
                for r in range(rounds):
                    ids = [2 * (r % 8), 2 * (r % 8) + 1]  # blocks 0..15
                    p = cache.gather(ids)
                    kv.put([stored[r]], [p[0].numpy().data])
                    ref = torch.cat([c.view(torch.uint8).index_select(dim, torch.tensor(ids, device=device))
                                     .reshape(-1).cpu() for c in src])
                    if not torch.equal(p[0][HEADER_SIZE:], ref):
                        errors.append(f"store {r}: gathered bytes differ")
            except Exception as exc:  # pragma: no cover - reported below
                errors.append(f"store thread: {exc!r}")

        def loads() -> None:
            try:
                for r in range(rounds):
                    ids = [32 + 2 * (r % 8), 33 + 2 * (r % 8)]  # blocks 32..47
                    buf = cache.new_payloads(1)
                    if kv.get_into([ks_in[r]], [buf[0].numpy().data]) != [True]:
                        errors.append(f"load {r}: missing")
                        continue
                    cache.scatter(buf, ids)
                    got = torch.cat([c.view(torch.uint8).index_select(dim, torch.tensor(ids, device=device))
                                     .reshape(-1).cpu() for c in src])
                    if not torch.equal(got, expected[r][HEADER_SIZE:]):
                        errors.append(f"load {r}: scattered bytes differ")
            except Exception as exc:  # pragma: no cover - reported below
                errors.append(f"load thread: {exc!r}")

        threads = [threading.Thread(target=stores), threading.Thread(target=loads)]
        for t in threads:
            t.start()
        for r in range(rounds):  # the "forward pass": writes to blocks 50..63 meanwhile
            random_bytes(src[r % LAYERS].view(torch.uint8).select(dim, 50 + r % 14))
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads)
        assert errors == []
        assert kv.exists(stored) == [True] * rounds
        shm = kv.stats()["shm"]
        assert shm["gets"] >= rounds and shm["puts"] >= 1  # (the first put, 12.5 MiB; the 512 KiB ones go inline)


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None
