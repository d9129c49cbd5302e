"""How much a busy Python thread slows the sync client: the interpreter lock's convoy.

::

    python -m kvstore.bench.convoy
    python -m kvstore.bench.convoy --switch-ms 5,1,0.5 --sizes 64k,1m --batch 1,32

:class:`~kvstore.client.KVClient` runs its connections on an event-loop thread of its own. A
call hands the request to that thread and waits for it to hand the reply back; the loop thread
wakes when the request comes and when reply bytes arrive, the calling thread when the reply is
handed over. Each wake-up needs the interpreter lock. While another thread of the process runs
Python without pause, a waking thread gets it only when the running one is made to hand it over,
every ``sys.getswitchinterval()`` (5 ms by default): a round trip costs several intervals.

Starts a kvstore-server on 127.0.0.1, then times ``get_into`` round trips: alone; beside a
*process* spinning in Python (a control: it takes a core as the thread does, but no lock); beside
a thread spinning in Python, under each switch interval given. Settings take turns (``--repeat``
passes, all round trips of a setting pooled: median and max).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

from kvstore.client import KVClient
from kvstore.server.process import ServerProcess

from .common import fmt_size, make_keys, parse_sizes


_SPIN = "import time\nend = time.monotonic() + 600\nwhile time.monotonic() < end:\n    sum(i * i for i in range(1000))"


def _spin(stop: threading.Event) -> None:
    while not stop.is_set():
        sum(i * i for i in range(1000))


def _round_trips(kv: KVClient, keys: list[bytes], buffers: list[bytearray], n: int) -> list[float]:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        if not all(kv.get_into(keys, buffers)):
            raise RuntimeError("blocks missing from the benchmark's own server")
        times.append(time.perf_counter() - t0)
    return times


def _beside(setting: float | str | None, run: Any) -> list[float]:
    """``run()`` alone (None), beside a spinning process ("process"), or beside a spinning thread
    with the switch interval at ``setting`` ms; the interval is given back, the spinner stopped."""
    if setting is None:
        return run()  # type: ignore[no-any-return]
    if setting == "process":
        spinner = subprocess.Popen([sys.executable, "-c", _SPIN])
        try:
            time.sleep(0.05)  # (running)
            return run()  # type: ignore[no-any-return]
        finally:
            spinner.kill()
            spinner.wait()
    default = sys.getswitchinterval()
    stop = threading.Event()
    thread = threading.Thread(target=_spin, args=(stop,), daemon=True)
    try:
        sys.setswitchinterval(float(setting) / 1e3)
        thread.start()
        return run()  # type: ignore[no-any-return]
    finally:
        sys.setswitchinterval(default)
        stop.set()
        if thread.is_alive():
            thread.join()


def _label(setting: float | str | None) -> str:
    if setting is None:
        return "alone"
    return "busy process (control)" if setting == "process" else f"busy thread, switch {setting:g} ms"


def measure(sizes: list[int], batches: list[int], switch_ms: list[float], rounds: int,
            repeat: int = 3) -> list[dict[str, Any]]:
    """One row per size, batch and setting: alone, beside a busy process, beside a busy thread
    at each switch interval; the settings take turns ``repeat`` times, ``rounds`` round trips each."""
    rows = []
    settings: list[float | str | None] = [None, "process", *switch_ms]
    with ServerProcess("--capacity", f"{max(64, 2 * max(sizes) * max(batches) >> 20)}MiB") as srv, \
            KVClient(srv.addr, shm=False) as kv:
        for size in sizes:
            for batch in batches:
                keys = make_keys(f"convoy-{size}-{batch}", batch)
                kv.put(keys, [bytes(size)] * batch)
                buffers = [bytearray(size) for _ in range(batch)]
                _round_trips(kv, keys, buffers, 2)  # warm-up
                times: dict[int, list[float]] = {i: [] for i in range(len(settings))}
                for _ in range(repeat):
                    for i, setting in enumerate(settings):
                        times[i] += _beside(setting, lambda: _round_trips(kv, keys, buffers, rounds))
                for i, setting in enumerate(settings):
                    rows.append({"size": size, "batch": batch, "setting": _label(setting),
                                 "switch_ms": setting if isinstance(setting, float) else None,
                                 "p50_ms": statistics.median(times[i]) * 1e3, "max_ms": max(times[i]) * 1e3})
    return rows


def _positive(kind: type) -> Any:
    def parse(text: str) -> Any:
        value = kind(text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value
    return parse


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvstore.bench.convoy", description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="64k,1m", type=parse_sizes)
    p.add_argument("--batch", default="1,32", type=lambda t: [int(x) for x in t.split(",")])
    p.add_argument("--switch-ms", default="5,0.5", type=lambda t: [_positive(float)(x) for x in t.split(",")],
                   help="switch intervals to try beside the busy thread (Python's default is 5)")
    p.add_argument("--rounds", type=_positive(int), default=15, help="round trips per setting and pass")
    p.add_argument("--repeat", type=_positive(int), default=3, help="passes over the settings, taking turns")
    args = p.parse_args(argv)
    rows = measure(args.sizes, args.batch, args.switch_ms, args.rounds, args.repeat)
    print(f"{'block':>7} {'batch':>5}  {'setting':<28}{'p50 ms':>9}{'max ms':>9}{'vs alone':>10}")
    alone = {}
    for r in rows:
        if r["setting"] == "alone":
            alone[(r["size"], r["batch"])] = r["p50_ms"]
        ratio = r["p50_ms"] / alone[(r["size"], r["batch"])]
        print(f"{fmt_size(r['size']):>7} {r['batch']:>5}  {r['setting']:<28}{r['p50_ms']:>9.2f}{r['max_ms']:>9.2f}"
              f"{ratio:>9.1f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
