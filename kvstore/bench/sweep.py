"""Concurrency sweep, capacity run and per-block memory overhead.

Concurrency: N asyncio clients (each its own ``AsyncKVClient`` with one
connection) in this one process, all looping on the same op for a fixed
time. On a 2-core machine a second client *process* would only compete with
the server for the same two cores; one process whose client work per byte is
a ``recv_into`` (``get_into``) or a scatter-gather write (``put``) keeps the
client's share of the CPU as small as it gets, so the figure measures the
server. The server's own CPU use is reported beside it.

Capacity: a fresh server is filled to several times its capacity (eviction
running all along) while its RSS is sampled.

Memory overhead: many small blocks in a server with 4 KiB pages (RSS growth
per block) and the same in-process under tracemalloc (Python objects of the
index per block).
"""

from __future__ import annotations

import asyncio
import gc
import hashlib
import sys
import time
import tracemalloc
from typing import Any, Callable

from .common import KiB, LoadMeter, MiB, fmt_size, make_blocks, make_keys, median, pct, proc_cpu_s, proc_rss, self_cpu_s
from .targets import KVStoreTarget

Log = Callable[[str], None]


async def run_concurrency(kv: KVStoreTarget, clients: list[int], workloads: list[tuple[str, int]], size: int,
                          seconds: float, trials: int, log: Log) -> list[dict[str, Any]]:
    """``workloads``: (op, batch) pairs, e.g. ``[("get_into", 4), ("put", 4), ("get", 1)]``."""
    from kvstore.client import AsyncKVClient

    most = max(clients)
    conns = [AsyncKVClient(kv.server.addr, namespace="bench", pool_size=1, timeout=120) for _ in range(most)]
    await asyncio.gather(*(c.connect() for c in conns))
    biggest = max(b for _, b in workloads)
    keys = make_keys(f"conc:{size}", biggest)
    blocks = make_blocks(size, biggest)
    await kv.client.put(keys, blocks)
    dsts = [[bytearray(b"\x01") * size for _ in range(biggest)] for _ in range(most)]  # each client's own
    seq = [0]

    def make_op(op: str, batch: int, j: int) -> Callable[[], Any]:
        c, ks = conns[j], keys[:batch]
        if op == "get_into":
            dst = dsts[j][:batch]

            async def get_into() -> None:
                if not all(await c.get_into(ks, dst)):
                    raise RuntimeError("concurrency: a block went missing")
            return get_into
        if op == "get":
            async def get() -> None:
                if None in await c.get(ks):
                    raise RuntimeError("concurrency: a block went missing")
            return get
        if op == "put":
            def put() -> Any:
                seq[0] += 1
                return c.put(make_keys(f"cput:{seq[0]}", batch), blocks[:batch])
            return put
        raise ValueError(op)

    async def loop(fn: Callable[[], Any], stop: float, lat: list[int]) -> None:
        clock = time.perf_counter_ns
        while time.monotonic() < stop:
            s = clock()
            await fn()
            lat.append(clock() - s)

    results: dict[tuple[str, int, int], dict[str, list[float]]] = {}
    try:
        for op, batch in workloads:
            await kv.client.put(keys, blocks)  # stored again: the put workload may have evicted them
            for n in clients:  # warm every connection once
                await asyncio.gather(*(make_op(op, batch, j)() for j in range(n)))
            for trial in range(trials):
                order = clients[trial % len(clients):] + clients[:trial % len(clients)]
                for n in order:
                    lats: list[list[int]] = [[] for _ in range(n)]
                    c0, s0, t0 = self_cpu_s(), proc_cpu_s(kv.pid), time.perf_counter()
                    stop = time.monotonic() + seconds
                    await asyncio.gather(*(loop(make_op(op, batch, j), stop, lats[j]) for j in range(n)))
                    wall = time.perf_counter() - t0
                    c1, s1 = self_cpu_s(), proc_cpu_s(kv.pid)
                    flat = [x for l in lats for x in l]
                    r = results.setdefault((op, batch, n), {"gbps": [], "p50": [], "p99": [], "srv": [], "cli": [],
                                                             "fair": []})
                    r["gbps"].append(len(flat) * batch * size / wall / 1e9)
                    r["p50"].append(pct(flat, 0.5) / 1e3)
                    r["p99"].append(pct(flat, 0.99) / 1e3)
                    r["cli"].append((c1 - c0) / wall)
                    if s0 is not None and s1 is not None:
                        r["srv"].append((s1 - s0) / wall)
                    counts = [len(l) for l in lats]
                    r["fair"].append(min(counts) / max(1, max(counts)))
    finally:
        await asyncio.gather(*(c.close() for c in conns), return_exceptions=True)
    out = []
    for op, batch in workloads:
        base = median(results[(op, batch, clients[0])]["gbps"])
        for n in clients:
            r = results[(op, batch, n)]
            g = median(r["gbps"])
            p50, p99 = median(r["p50"]), median(r["p99"])
            row = {"op": op, "clients": n, "size": size, "batch": batch, "seconds": seconds,
                   "gbps": round(g, 3), "gbps_trials": [round(x, 3) for x in r["gbps"]],
                   "vs_first": round(g / base, 2) if base else None,
                   "p50_us": round(p50, 1), "p99_us": round(p99, 1),
                   "p99_over_p50": round(p99 / p50, 2) if p50 else None,
                   "server_cpu": round(median(r["srv"]), 2) if r["srv"] else None,
                   "client_cpu": round(median(r["cli"]), 2),
                   "fairness_min_over_max": round(median(r["fair"]), 2)}
            out.append(row)
            log(f"# conc {op:8s} {fmt_size(size)} x{batch} clients={n:<3d}: {row['gbps']:.3f} GB/s "
                f"({row['vs_first']}x of {clients[0]} client) p50={row['p50_us']:.0f}us p99={row['p99_us']:.0f}us "
                f"p99/p50={row['p99_over_p50']} srv_cpu={row['server_cpu']} cli_cpu={row['client_cpu']} "
                f"fairness={row['fairness_min_over_max']}")
    return out


async def run_capacity(capacity: int, block: int, batch: int, fill_factor: float, log: Log,
                       meter: LoadMeter | None = None) -> dict[str, Any]:
    """Fill a fresh server to ``fill_factor`` x its capacity (eviction running); sample its RSS."""
    block = max(4 * KiB, min(block, capacity // 64))
    batch = max(1, min(batch, capacity // (4 * block)))  # a batch must fit well within the store
    kv = KVStoreTarget(str(capacity))
    await kv.start()
    if meter is not None:
        meter.watch(kv.pid)
    try:
        rss_start = proc_rss(kv.pid) or 0
        blocks = make_blocks(block, batch)
        total = int(capacity * fill_factor)
        rounds = max(1, total // (block * batch))
        peak, samples = rss_start, []
        t0 = time.perf_counter()
        for i in range(rounds):
            await kv.client.put(make_keys(f"fill:{i}", batch), blocks)
            rss = proc_rss(kv.pid) or 0
            peak = max(peak, rss)
            if i % max(1, rounds // 20) == 0:
                samples.append([round((i + 1) * block * batch / capacity, 2), rss])
        wall = time.perf_counter() - t0
        st = await kv.stats()
        store = st["store"]
        rss_end = proc_rss(kv.pid) or 0
    finally:
        if meter is not None:
            meter.sample()
        await kv.stop()
    limit = capacity * 1.1 + 64 * MiB
    r = {"capacity": capacity, "block": block, "batch": batch, "written_bytes": rounds * block * batch,
         "put_gbps_under_eviction": round(rounds * block * batch / wall / 1e9, 3),
         "rss_start": rss_start, "rss_peak": peak, "rss_end": rss_end,
         "rss_peak_over_capacity": round(peak / capacity, 3), "limit_bytes": int(limit), "within_limit": peak <= limit,
         "evictions": store.get("evictions"), "stored_blocks": store.get("blocks"), "stored_bytes": store.get("bytes"),
         "used_bytes": store.get("used_bytes"), "samples_fill_rss": samples}
    log(f"# capacity {fmt_size(capacity)}: wrote {r['written_bytes'] / capacity:.1f}x capacity in {fmt_size(block)} "
        f"blocks, {r['evictions']} evictions, RSS start {rss_start / MiB:.0f} MiB peak {peak / MiB:.0f} MiB "
        f"= {r['rss_peak_over_capacity']}x capacity (limit {limit / MiB:.0f} MiB: "
        f"{'ok' if r['within_limit'] else 'OVER'}); put under eviction {r['put_gbps_under_eviction']} GB/s")
    return r


async def run_small_blocks(n: int, block: int, log: Log,
                           meter: LoadMeter | None = None) -> dict[str, Any]:
    """RSS growth per stored block in a server with ``block``-sized pages."""
    page = max(4 * KiB, block)
    capacity = int(n * page * 1.05) + 16 * MiB
    kv = KVStoreTarget(str(capacity), server_args=("--page-size", str(page)))
    await kv.start()
    if meter is not None:
        meter.watch(kv.pid)
    try:
        await kv.client.ping()
        rss0 = proc_rss(kv.pid) or 0
        data = make_blocks(block, 1)[0]
        batch = 512
        t0 = time.perf_counter()
        for i in range(0, n, batch):
            m = min(batch, n - i)
            await kv.client.put(make_keys(f"small:{i}", m), [data] * m)
        wall = time.perf_counter() - t0
        rss1 = proc_rss(kv.pid) or 0
        store = (await kv.stats())["store"]
    finally:
        if meter is not None:
            meter.sample()
        await kv.stop()
    per_block = (rss1 - rss0) / max(1, store["blocks"])
    r = {"blocks": n, "block": block, "page_size": page, "capacity": capacity, "rss_empty": rss0, "rss_full": rss1,
         "rss_growth_per_block": round(per_block), "stored_blocks": store["blocks"],
         "puts_per_s": round(n / wall)}
    log(f"# small blocks: {n} x {fmt_size(block)} in {fmt_size(page)} pages: RSS {rss0 / MiB:.0f} -> "
        f"{rss1 / MiB:.0f} MiB = {per_block:.0f} B per block over the payload; {r['puts_per_s']} blocks/s")
    return r


def index_overhead(n: int, eviction: str = "lru") -> dict[str, Any]:
    """Python heap bytes per block of the store's index (tracemalloc; the arena's mmap is not counted)."""
    from kvstore.store import BlockStore

    store = BlockStore(n * 4096 + 4096, page_size=4096, eviction=eviction, prefault=False)
    data = b"x" * 16
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    prev = None
    for i in range(n):
        key = hashlib.sha256(b"%d" % i).digest()  # a new 32-byte key object, as msgpack decodes it
        store.put("bench", key, data, 0, parent=prev)
        prev = key
    del key, prev
    gc.collect()
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    return {"blocks": n, "eviction": eviction, "heap_bytes_per_block": round(used / n),
            "of_which_key_object": sys.getsizeof(b"x" * 32)}
