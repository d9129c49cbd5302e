"""How fast this host copies blocks out of and into a shared mapping: the shared-memory path's wall.

::

    python -m kvstore.bench.copy
    GLIBC_TUNABLES=glibc.cpu.x86_rep_movsb_threshold=1073741824 python -m kvstore.bench.copy

The shm path (``docs/shm.md``) moves every payload byte with one ``memmove`` in
the client (:func:`kvstore.client.shm.copy_runs`). glibc chooses how to copy by
size, from thresholds it derives from the CPU's cache sizes; on some hosts the
choice is slow. Seen on the benchmark VM (AMD EPYC, glibc 2.36, which read the
shared cache as 320 MiB): every copy from ~2 KiB up to 240 MiB used ``rep
movsb``, which there read 256 KiB blocks out of the mapping at 60-70 % of the
speed of glibc's vector loop (``docs/shm.md``). Run this twice, with and without
the tunable above (glibc reads it at process start only); if the tunable wins,
set it in the environment of the engine processes that use shm. Copies run on
one thread, as one helper thread of the client does; GB = 1e9 bytes.
"""

from __future__ import annotations

import argparse
import mmap
import os
import platform
import statistics
import time
from typing import Sequence

from kvstore.client.shm import copy_runs

from .common import parse_sizes


def measure(sizes: Sequence[int], batch: int = 32, trials: int = 15,
            arena_bytes: int = 512 << 20) -> dict[str, dict[int, float]]:
    """Median GB/s of copying ``batch`` blocks per size, ``get`` (mapping -> buffers) and ``put``.

    The mapping is a memfd like the server's arena, populated up front; each
    trial copies at the next offset, so the arena side is as cold as a
    server's (the buffers are reused, as an engine's staging buffers are).
    Sizes and directions take turns within each trial (a noisy host slows all alike).
    """
    fd = os.memfd_create("kvstore-copy-probe")
    try:
        os.ftruncate(fd, arena_bytes)
        region = mmap.mmap(fd, arena_bytes, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
    finally:
        os.close(fd)
    arena = memoryview(region)
    buffers = {size: [memoryview(bytearray(b"\x01") * size) for _ in range(batch)] for size in sizes}
    times: dict[tuple[str, int], list[float]] = {}
    offset = 0
    try:
        for _ in range(trials):
            for size in sizes:
                for direction in ("get", "put"):
                    if offset + size * batch > arena_bytes:
                        offset = 0
                    times.setdefault((direction, size), []).append(
                        _copy_batch(arena[offset:offset + size * batch], buffers[size], direction))
                    offset += size * batch
    finally:
        arena.release()  # (every slice of it is gone with _copy_batch's frame)
        region.close()
    return {direction: {size: size * batch / statistics.median(times[(direction, size)]) / 1e9 for size in sizes}
            for direction in ("get", "put")}


def _copy_batch(window: memoryview, buffers: list[memoryview], direction: str) -> float:
    """Seconds to copy each buffer's block out of (``get``) or into (``put``) its slot of ``window``."""
    size = len(buffers[0])
    with window:
        slots = [window[i * size:(i + 1) * size] for i in range(len(buffers))]
        pairs = list(zip(buffers, slots) if direction == "get" else zip(slots, buffers))
        t0 = time.perf_counter()
        for dst, src in pairs:
            copy_runs([dst], [src], None)
        elapsed = time.perf_counter() - t0
        for slot in slots:
            slot.release()
    return elapsed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvstore.bench.copy", description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="64k,256k,1m,4m", help="block sizes (k/m binary)")
    p.add_argument("--batch", type=int, default=32, help="blocks per trial")
    p.add_argument("--trials", type=int, default=15, help="trials per size (median reported)")
    p.add_argument("--arena-mib", type=int, default=512, help="size of the shared mapping")
    args = p.parse_args(argv)
    sizes = parse_sizes(args.sizes)
    if args.arena_mib << 20 < max(sizes) * args.batch:
        p.error("--arena-mib must hold one batch of the largest size")
    res = measure(sizes, args.batch, args.trials, args.arena_mib << 20)
    print(f"# {' '.join(platform.libc_ver())}, GLIBC_TUNABLES={os.environ.get('GLIBC_TUNABLES', '')!r}")
    print(f"{'block':>8}  {'get GB/s':>9}  {'put GB/s':>9}")
    for size in sizes:
        print(f"{size >> 10:>6}Ki  {res['get'][size]:9.2f}  {res['put'][size]:9.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
