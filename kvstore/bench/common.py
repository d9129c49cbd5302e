"""Small helpers of the benchmark: sizes, percentiles, process CPU/RSS, a background-load meter.

Linux only where it reads ``/proc`` (RSS, CPU time of the servers); elsewhere
those figures are reported as ``None``.
"""

from __future__ import annotations

import hashlib
import os
import socket
import statistics
import time
from typing import Iterable, Sequence

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB
_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


#: glibc's mallopt parameters, and what the bench sets them to (see :func:`steady_allocator`).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_STEADY = {"M_MMAP_THRESHOLD": (_M_MMAP_THRESHOLD, 32 * MiB), "M_TRIM_THRESHOLD": (_M_TRIM_THRESHOLD, GiB)}


def steady_allocator() -> dict[str, int]:
    """Have glibc keep freed memory of this process for reuse; returns what was set.

    Why: a peer's client that allocates every value it reads (redis-py makes a new ``bytes``
    per value) pays page faults, ~1 GB/s, whenever glibc hands a large allocation back to the
    kernel (mmap'd chunks, a trimmed heap) -- and whether it does depends on what the process
    allocated before (glibc raises its mmap threshold after large frees): copies of SET values
    made by redis-py's packer had doubled Redis GET. Kept memory makes every system's client
    side steady and the peers' reads as fast as they get. Nothing is set where the run's
    environment tunes malloc itself (``MALLOC_*``, ``GLIBC_TUNABLES``) or libc is not glibc.
    """
    if any(k.startswith(("MALLOC_", "GLIBC_TUNABLES")) for k in os.environ):
        return {}
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        return {name: value for name, (param, value) in _STEADY.items() if libc.mallopt(param, value) == 1}
    except (OSError, AttributeError):
        return {}


def parse_sizes(text: str) -> list[int]:
    """``"64k,1m,4096"`` -> ``[65536, 1048576, 4096]`` (k and m are binary)."""
    out = []
    for tok in text.split(","):
        tok = tok.strip().lower().removesuffix("ib").removesuffix("b")
        mult = 1
        if tok.endswith("k"):
            mult, tok = KiB, tok[:-1]
        elif tok.endswith("m"):
            mult, tok = MiB, tok[:-1]
        elif tok.endswith("g"):
            mult, tok = GiB, tok[:-1]
        out.append(int(float(tok) * mult))
    return out


def parse_ints(text: str) -> list[int]:
    return [int(t) for t in text.split(",") if t.strip()]


def fmt_size(n: int) -> str:
    """1048576 -> '1MiB', 65536 -> '64KiB'."""
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return f"{n}B"


def pct(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) by nearest rank; 0.0 for no values."""
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def median(values: Iterable[float]) -> float:
    vals = list(values)
    return statistics.median(vals) if vals else 0.0


def make_keys(tag: str, n: int) -> list[bytes]:
    """``n`` distinct 32-byte keys (sha256, like a chained block hash)."""
    return [hashlib.sha256(f"{tag}:{i}".encode()).digest() for i in range(n)]


def make_blocks(size: int, n: int) -> list[bytearray]:
    """``n`` distinct, already-touched source blocks of ``size`` bytes."""
    return [bytearray(bytes([i % 251 + 1])) * size for i in range(n)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---------------------------------------------------------------- processes


def proc_cpu_s(pid: int | None) -> float | None:
    """CPU seconds used so far by process ``pid``, all its threads (None when unknown).

    From ``/proc/PID/task/*/schedstat`` (nanoseconds) where the kernel has it:
    ``/proc/PID/stat`` counts in 10 ms ticks, too coarse for a 20 ms measurement.
    """
    if pid is None:
        return None
    try:
        total = 0
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        return total / 1e9
    except (OSError, IndexError, ValueError):
        pass
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _TCK
    except (OSError, IndexError, ValueError):
        return None


def proc_minflt(pid: int | None) -> int | None:
    """Minor page faults of ``pid`` so far (first touches of fresh memory); None when unknown."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[7])
    except (OSError, IndexError, ValueError):
        return None


def proc_rss(pid: int | None) -> int | None:
    """Resident set size of ``pid`` in bytes (None when unknown)."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return None


def self_cpu_s() -> float:
    return time.process_time()


def _busy_s() -> float | None:
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:9]]
    except OSError:
        return None
    return (sum(v) - v[3] - v[4]) / _TCK  # everything but idle and iowait


class LoadMeter:
    """How busy the machine was with work that is not ours (a shared machine is noisy).

    ``other_cpu_cores`` = CPU used by everything except this process and the
    ``pids`` it watches (the servers it started), averaged over the interval,
    in cores. Kernel softirq time spent on our own loopback traffic can show
    up there too, so a figure of 0.1-0.3 on an otherwise quiet machine is
    normal; a figure near a whole core means someone else was running.
    """

    def __init__(self, pids: Sequence[int | None] = ()) -> None:
        self.pids = [p for p in pids if p]
        self._last: dict[int, float] = {}  # CPU last seen per watched process (it may have exited since)
        self.reset()

    def _own(self) -> float:
        return self_cpu_s() + sum(self._cpu(p) for p in self.pids)

    def _cpu(self, pid: int) -> float:
        cpu = proc_cpu_s(pid)
        if cpu is None:
            return self._last.get(pid, 0.0)
        self._last[pid] = cpu
        return cpu

    def sample(self) -> None:
        """Remember the watched processes' CPU now: call before stopping one."""
        for p in self.pids:
            self._cpu(p)

    def reset(self) -> None:
        self.t0 = time.monotonic()
        self.busy0 = _busy_s()
        self.own0 = self._own()
        self.la0 = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0

    def watch(self, pid: int | None) -> None:
        """Count a process started after the meter as 'own': all its CPU (its start-up too) falls
        inside the interval, so none of it is subtracted."""
        if pid and pid not in self.pids:
            self.pids.append(pid)

    def report(self) -> dict[str, float | int | None]:
        elapsed = max(1e-9, time.monotonic() - self.t0)
        busy = _busy_s()
        own = self._own() - self.own0
        other = None
        if busy is not None and self.busy0 is not None:
            other = round(max(0.0, (busy - self.busy0) - own) / elapsed, 2)
        return {
            "elapsed_s": round(elapsed, 1),
            "ncpu": os.cpu_count(),
            "own_cpu_cores": round(own / elapsed, 2),
            "other_cpu_cores": other,
            "loadavg1_start": round(self.la0, 2),
            "loadavg1_end": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        }
