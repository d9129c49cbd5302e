"""How much a busy Python thread slows the sync client: the interpreter lock's convoy.

::

    python -m kvstore.bench.convoy
    python -m kvstore.bench.convoy --switch-ms 5,1,0.5 --sizes 64k,1m --batch 1,32

:class:`~kvstore.client.KVClient` runs its connections on an event-loop thread of its own.
Every wake-up of that thread (a reply's bytes arrived, a request was handed over) needs the
interpreter lock; while another thread of the process runs Python without pause, the loop
thread gets the lock only when the running thread is made to hand it over, every
``sys.getswitchinterval()`` (5 ms by default). An engine whose own threads keep Python busy
(a scheduler, input preparation) makes each of the client's wake-ups cost up to that long.

Starts a kvstore-server on 127.0.0.1, then times ``get_into`` (median and max of the round
trips) alone and beside a thread spinning in Python, under each switch interval given.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from typing import Any

from kvstore.client import KVClient
from kvstore.server.process import ServerProcess

from .common import fmt_size, make_keys, parse_sizes


def _spin(stop: threading.Event) -> None:
    x = 0
    while not stop.is_set():
        for i in range(1000):
            x += i * i


def _round_trips(kv: KVClient, keys: list[bytes], buffers: list[bytearray], n: int) -> list[float]:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        if not all(kv.get_into(keys, buffers)):
            raise RuntimeError("blocks missing from the benchmark's own server")
        times.append(time.perf_counter() - t0)
    return times


def measure(sizes: list[int], batches: list[int], switch_ms: list[float], rounds: int) -> list[dict[str, Any]]:
    """One row per size, batch and setting ("alone", or beside a spinning thread at an interval)."""
    rows = []
    default = sys.getswitchinterval()
    with ServerProcess("--capacity", f"{max(64, 2 * max(sizes) * max(batches) >> 20)}MiB") as srv, \
            KVClient(srv.addr, shm=False) as kv:
        for size in sizes:
            for batch in batches:
                keys = make_keys(f"convoy-{size}-{batch}", batch)
                kv.put(keys, [bytes(size)] * batch)
                buffers = [bytearray(size) for _ in range(batch)]
                _round_trips(kv, keys, buffers, 2)  # warm-up
                settings: list[tuple[str, float | None]] = [("alone", None)]
                settings += [(f"busy thread, switch {ms:g} ms", ms) for ms in switch_ms]
                for label, ms in settings:
                    stop = threading.Event()
                    spinner = threading.Thread(target=_spin, args=(stop,), daemon=True)
                    try:
                        if ms is not None:
                            sys.setswitchinterval(ms / 1e3)
                            spinner.start()
                        times = _round_trips(kv, keys, buffers, rounds)
                    finally:
                        stop.set()
                        if spinner.is_alive():
                            spinner.join()
                        sys.setswitchinterval(default)
                    rows.append({"size": size, "batch": batch, "setting": label, "switch_ms": ms,
                                 "p50_ms": statistics.median(times) * 1e3, "max_ms": max(times) * 1e3})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvstore.bench.convoy", description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="64k,1m", type=parse_sizes)
    p.add_argument("--batch", default="1,32", type=lambda t: [int(x) for x in t.split(",")])
    p.add_argument("--switch-ms", default="5,0.5", type=lambda t: [float(x) for x in t.split(",")],
                   help="switch intervals to try beside the busy thread (Python's default is 5)")
    p.add_argument("--rounds", type=int, default=40)
    args = p.parse_args(argv)
    rows = measure(args.sizes, args.batch, args.switch_ms, args.rounds)
    print(f"{'block':>7} {'batch':>5}  {'setting':<28}{'p50 ms':>9}{'max ms':>9}{'vs alone':>10}")
    alone = {}
    for r in rows:
        if r["switch_ms"] is None:
            alone[(r["size"], r["batch"])] = r["p50_ms"]
        ratio = r["p50_ms"] / alone[(r["size"], r["batch"])]
        print(f"{fmt_size(r['size']):>7} {r['batch']:>5}  {r['setting']:<28}{r['p50_ms']:>9.2f}{r['max_ms']:>9.2f}"
              f"{ratio:>9.1f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
