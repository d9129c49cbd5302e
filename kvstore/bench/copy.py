"""How fast this host copies blocks out of and into a shared mapping: the shared-memory path's wall.

::

    python -m kvstore.bench.copy             # this process's glibc settings
    python -m kvstore.bench.copy --compare   # glibc's copy tunables side by side

The shm path (``docs/shm.md``) moves every payload byte with one ``memmove`` in
the client (:func:`kvstore.client.shm.copy_runs`). glibc chooses how to copy by
size, from thresholds it derives from the CPU's cache sizes; on some hosts the
choice is slow. Seen on the benchmark VM (AMD EPYC, glibc 2.36, which read the
shared cache as 320 MiB): every copy from ~2 KiB up to 240 MiB used ``rep
movsb``, and none used non-temporal stores (``docs/shm.md``). glibc reads its
tunables at process start only, so ``--compare`` runs the probe in child
processes, one per setting of ``GLIBC_TUNABLES``, taking turns; if a setting
wins, set it in the environment of the engine processes that use shm.

Two measurements per size and direction: ``copy``, one thread and no checksum
(the copy alone), and ``client``, what the client does per batch: copy and
checksum, on its threads (:mod:`kvstore.client.workers`). GB = 1e9 bytes.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import platform
import statistics
import subprocess
import sys
import time
from functools import partial
from typing import Sequence

from kvstore.client.shm import copy_runs
from kvstore.client.workers import check_setting, run_parallel
from kvstore.errors import InvalidRequest

from .common import parse_sizes

#: ``--compare``'s settings: glibc's choice; its vector loop instead of ``rep movsb``; non-temporal
#: stores from 256 KiB (they skip reading the destination into the cache first); both.
TUNABLES = ("", "glibc.cpu.x86_rep_movsb_threshold=1073741824", "glibc.cpu.x86_non_temporal_threshold=0x40000",
            "glibc.cpu.x86_rep_movsb_threshold=1073741824:glibc.cpu.x86_non_temporal_threshold=0x40000")
KINDS = ("copy", "client")


def measure(sizes: Sequence[int], batch: int = 32, trials: int = 15,
            arena_bytes: int = 512 << 20) -> dict[str, dict[int, float]]:
    """Median GB/s per ``"<kind> <direction>"`` (kinds ``copy``, ``client``; directions ``get``:
    mapping -> buffers, ``put``: buffers -> mapping) and block size.

    The mapping is a memfd like the server's arena, populated up front; each
    trial copies at the next offset, so the arena side is as cold as a
    server's (the buffers are reused, as an engine's staging buffers are).
    Sizes, kinds and directions take turns within each trial (a noisy host slows all alike).
    """
    fd = os.memfd_create("kvstore-copy-probe")
    try:
        os.ftruncate(fd, arena_bytes)
        region = mmap.mmap(fd, arena_bytes, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
    finally:
        os.close(fd)
    arena = memoryview(region)
    buffers = {size: [memoryview(bytearray(b"\x01") * size) for _ in range(batch)] for size in sizes}
    cells = [(f"{kind} {direction}", size) for size in sizes for kind in KINDS for direction in ("get", "put")]
    times: dict[tuple[str, int], list[float]] = {cell: [] for cell in cells}
    offset = 0
    try:
        for _ in range(trials):
            for cell in cells:
                size = cell[1]
                if offset + size * batch > arena_bytes:
                    offset = 0
                times[cell].append(_copy_batch(arena[offset:offset + size * batch], buffers[size], cell[0]))
                offset += size * batch
    finally:
        arena.release()  # (every slice of it is gone with _copy_batch's frame)
        region.close()
    res: dict[str, dict[int, float]] = {}
    for (name, size), ts in times.items():
        res.setdefault(name, {})[size] = size * batch / statistics.median(ts) / 1e9
    return res


def _copy_batch(window: memoryview, buffers: list[memoryview], name: str) -> float:
    """Seconds to copy each buffer's block out of (get) or into (put) its slot of ``window``."""
    kind, direction = name.split()
    size = len(buffers[0])
    with window:
        slots = [window[i * size:(i + 1) * size] for i in range(len(buffers))]
        get = direction == "get"
        pairs = list(zip(buffers, slots) if get else zip(slots, buffers))
        t0 = time.perf_counter()
        if kind == "copy":
            for dst, src in pairs:
                copy_runs([dst], [src], None)
        else:  # as client/shm.py does: a get hashes what it wrote, a put what it read
            run_parallel([partial(copy_runs, [dst], [src], get) for dst, src in pairs], size * len(pairs))
        elapsed = time.perf_counter() - t0
        for slot in slots:
            slot.release()
    return elapsed


def compare(argv: list[str], tunables: Sequence[str], rounds: int) -> dict[str, dict[str, dict[int, list[float]]]]:
    """Run the probe (``argv``) once per setting and round, settings taking turns; GB/s per round."""
    runs: dict[str, dict[str, dict[int, list[float]]]] = {t: {} for t in tunables}
    for _ in range(rounds):
        for setting in tunables:
            env = {**os.environ, "GLIBC_TUNABLES": setting}
            out = json.loads(subprocess.run([sys.executable, "-m", "kvstore.bench.copy", *argv, "--json"], env=env,
                                            check=True, capture_output=True, text=True).stdout)
            if out["GLIBC_TUNABLES"] != setting:
                raise RuntimeError(f"the probe ran under GLIBC_TUNABLES={out['GLIBC_TUNABLES']!r}, not {setting!r}")
            for name, by_size in out["medians"].items():
                for size, gbps in by_size.items():
                    runs[setting].setdefault(name, {}).setdefault(int(size), []).append(gbps)
    return runs


def _print_compare(runs: dict[str, dict[str, dict[int, list[float]]]], sizes: Sequence[int]) -> None:
    settings = list(runs)
    print(f"# {' '.join(platform.libc_ver())}; GB/s, median of {len(runs[settings[0]]['copy get'][sizes[0]])} "
          "processes per setting; the ratio is against the first setting")
    for n, setting in enumerate(settings):
        print(f"#  [{n}] GLIBC_TUNABLES={setting!r}")
    for name in (f"{k} {d}" for k in KINDS for d in ("get", "put")):
        print(f"{name:>12}  " + "  ".join(f"{f'[{n}]':>14}" for n in range(len(settings))))
        for size in sizes:
            base = statistics.median(runs[settings[0]][name][size])
            cols = []
            for setting in settings:
                med = statistics.median(runs[setting][name][size])
                cols.append(f"{med:6.2f} ({med / base:4.2f}x)")
            print(f"{size >> 10:>10}Ki  " + "  ".join(cols))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvstore.bench.copy", description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="64k,256k,1m,4m", help="block sizes (k/m binary)")
    p.add_argument("--batch", type=int, default=32, help="blocks per trial")
    p.add_argument("--trials", type=int, default=15, help="trials per size (median reported)")
    p.add_argument("--arena-mib", type=int, default=512, help="size of the shared mapping")
    p.add_argument("--compare", action="store_true", help="run under each GLIBC_TUNABLES setting, side by side")
    p.add_argument("--tunables", action="append", metavar="SETTING",
                   help="a GLIBC_TUNABLES value for --compare (repeat; '' is glibc's default; "
                        "default: glibc's choice, its vector loop, non-temporal stores, both)")
    p.add_argument("--rounds", type=int, default=3, help="--compare: processes per setting, taking turns")
    p.add_argument("--json", action="store_true", help="print the medians as JSON")
    args = p.parse_args(argv)
    try:
        check_setting()  # (the "client" rows run on the client's threads)
    except InvalidRequest as exc:
        p.error(str(exc))
    sizes = parse_sizes(args.sizes)
    if args.arena_mib << 20 < max(sizes) * args.batch:
        p.error("--arena-mib must hold one batch of the largest size")
    if args.compare:
        probe = ["--sizes", args.sizes, "--batch", str(args.batch), "--trials", str(args.trials),
                 "--arena-mib", str(args.arena_mib)]
        runs = compare(probe, args.tunables if args.tunables is not None else TUNABLES, args.rounds)
        if args.json:
            print(json.dumps(runs))
        else:
            _print_compare(runs, sizes)
        return 0
    res = measure(sizes, args.batch, args.trials, args.arena_mib << 20)
    if args.json:
        print(json.dumps({"GLIBC_TUNABLES": os.environ.get("GLIBC_TUNABLES", ""), "medians": res}))
        return 0
    print(f"# {' '.join(platform.libc_ver())}, GLIBC_TUNABLES={os.environ.get('GLIBC_TUNABLES', '')!r}")
    print(f"{'block':>8}  " + "  ".join(f"{name:>11}" for name in res))
    for size in sizes:
        print(f"{size >> 10:>6}Ki  " + "  ".join(f"{res[name][size]:11.2f}" for name in res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
