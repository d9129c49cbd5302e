"""``kvstore-bench``: kvstore beside the raw socket limit and Redis, measured in one run.

Starts its own servers on 127.0.0.1 (a raw uvloop receiver, kvstore-server,
redis-server with persistence off) and stops them by PID. Measures, for each
block size and batch, interleaved over several trials (medians):

- raw:     ``up`` / ``down``, the same bytes through a minimal uvloop socket pair;
- kvstore: ``put`` / ``get`` / ``get_into`` with the asyncio client;
- redis:   pipelined ``SET`` / ``GET`` and ``MGET`` via redis-py + hiredis;

then prefix lookups (chains of 1, 64, 1024 keys), a concurrency sweep, a
capacity run and the memory overhead per block. Prints tables with
kvstore/raw and kvstore/redis ratios and the issue's targets, writes JSON and
a PNG chart. GB = 1e9 bytes; "blocks/s" counts blocks, latencies are per
request (one batch).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import shlex
import signal
import sys
import time
from typing import Any, Callable, Coroutine, NamedTuple

from kvstore.config import parse_size

from .common import MiB, LoadMeter, fmt_size, parse_ints, parse_sizes, proc_rss, steady_allocator
from .matrix import LOOKUP_CHAINS, run_lookups, run_matrix
from .report import (add_ratios, check_targets, concurrency_table, draw_chart, lookup_table, matrix_table,
                     memory_lines, rss_summary, targets_table)
from .sweep import index_overhead, run_capacity, run_concurrency, run_small_blocks
from .targets import KVStoreTarget, RawTarget, RedisTarget, Target, lmcache_status


class Preset(NamedTuple):
    """How much a run measures; ``--quick`` and the full run differ only here."""

    trials: int  # interleaved trials per cell
    target_mib: float  # payload per measurement
    lookup_reps: int
    conc_seconds: float  # per concurrency point and trial
    fill_mib: int  # capacity run
    small_blocks: int  # memory run
    min_seconds: float  # per measurement at least
    warmup: int  # requests per op and cell before measuring
    min_rounds: int  # requests per measurement at least


PRESETS = {
    # Quick warms up with one request and measures at least one: with five systems, three of a
    # 128 MiB request (4 MiB x 32) per op and trial made the large cells most of the quick run.
    "quick": Preset(3, 16, 50, 0.25, 64, 10_000, 0.03, 1, 1),
    "full": Preset(7, 96, 300, 1.5, 512, 100_000, 0.15, 3, 3),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvstore-bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer trials and bytes: done in under a minute")
    p.add_argument("--sizes", default="64k,256k,1m,4m", help="block sizes (k/m binary)")
    p.add_argument("--batches", default="1,32", help="blocks per request")
    p.add_argument("--trials", type=int, help="interleaved trials per cell (median reported)")
    p.add_argument("--target-mib", type=float, help="payload per measurement")
    p.add_argument("--min-rounds", type=int, help="requests per measurement at least (quick 1, full 3)")
    p.add_argument("--min-seconds", type=float, help="seconds per measurement at least (estimated from the warm-up)")
    p.add_argument("--systems", default="raw,kvstore,kvstore-unix,kvstore-shm,redis,lmcache",
                   help="which systems to run")
    p.add_argument("--capacity", default=None, help="kvstore-server capacity for the matrix (default 1GiB, quick 512MiB)")
    p.add_argument("--pool-size", type=int, default=4, help="kvstore client connections")
    p.add_argument("--server-args", default="",
                   help="extra kvstore-server flags for the matrix, lookup and concurrency servers "
                        "(e.g. '--busy-poll-us 0')")
    p.add_argument("--chains", default="1,64,1024", help="prefix-lookup chain lengths")
    p.add_argument("--lookup-reps", type=int, help="lookups per trial")
    p.add_argument("--clients", default="1,8,64", help="concurrency sweep: clients")
    p.add_argument("--conc", default="get_into:4,put:4,get:1",
                   help="concurrency sweep: op:batch workloads (ops: get_into, get, put)")
    p.add_argument("--conc-size", default="1m", help="concurrency sweep: block size")
    p.add_argument("--conc-seconds", type=float, help="concurrency sweep: seconds per point and trial")
    p.add_argument("--fill-mib", type=int, help="capacity run: server capacity in MiB")
    p.add_argument("--small-blocks", type=int, help="memory run: number of 4 KiB blocks")
    p.add_argument("--skip", default="", help="comma list of phases to skip: fill,matrix,lookup,concurrency,capacity,memory")
    p.add_argument("--json", default="kvstore-bench.json", help="write the results here ('' = no file)")
    p.add_argument("--chart", default="kvstore-bench.png", help="write the chart here ('' = no chart)")
    p.add_argument("--redis-server", default="redis-server", help="redis-server executable")
    return p


SYSTEMS = ("raw", "kvstore", "kvstore-unix", "kvstore-shm", "redis", "lmcache")
CHART_FORMATS = (".png", ".svg", ".pdf")
PHASES = ("fill", "matrix", "lookup", "concurrency", "capacity", "memory")
CONC_OPS = ("get_into", "get", "put")


def matrix_capacity(args: argparse.Namespace) -> str:
    return str(args.capacity or ("512MiB" if args.quick else "1GiB"))


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse what the run would trip over later (a traceback after servers started) or ignore
    (an unknown phase to skip, which then ran): a usage error, exit 2."""
    def listed(flag: str, text: str, known: tuple[str, ...]) -> None:
        unknown = [n for n in (t.strip() for t in text.split(",")) if n and n not in known]
        if unknown:
            p.error(f"{flag}: unknown {', '.join(map(repr, unknown))} (known: {', '.join(known)})")

    def positive(flag: str, parse: Any, text: str) -> None:
        try:
            values = parse(text)
        except (ValueError, OverflowError):  # (OverflowError: 'inf')
            values = []
        if not values or min(values) < 1:
            p.error(f"{flag}: expected a comma list of positive numbers, got {text!r}")

    listed("--systems", args.systems, SYSTEMS)
    listed("--skip", args.skip, PHASES)
    for flag, parse, text in (("--sizes", parse_sizes, args.sizes), ("--batches", parse_ints, args.batches),
                              ("--chains", parse_ints, args.chains), ("--clients", parse_ints, args.clients),
                              ("--conc-size", parse_sizes, args.conc_size)):
        positive(flag, parse, text)
    for w in args.conc.split(","):
        op, colon, batch = w.strip().partition(":")
        if op not in CONC_OPS or (colon and not (batch.isdigit() and int(batch) > 0)):
            p.error(f"--conc: expected op:batch with op one of {', '.join(CONC_OPS)}, got {w!r}")
    for flag in ("trials", "lookup_reps", "min_rounds", "fill_mib", "small_blocks", "pool_size"):
        value = getattr(args, flag)
        if value is not None and value < (0 if flag == "small_blocks" else 1):
            p.error(f"--{flag.replace('_', '-')}: must be at least {0 if flag == 'small_blocks' else 1}, got {value}")
    for flag in ("target_mib", "conc_seconds", "min_seconds"):
        value = getattr(args, flag)
        if value is not None and not (math.isfinite(value) and value > (0 if flag != "min_seconds" else -1)):
            p.error(f"--{flag.replace('_', '-')}: must be a positive number, got {value}")
    page = 64 << 10
    if args.server_args:
        from kvstore.server.cli import build_parser as server_parser

        given = shlex.split(args.server_args)
        if {"-h", "--help", "--version"} & set(given):
            p.error("--server-args: flags for the servers' runs, not --help or --version")
        server = server_parser()
        server.exit_on_error = False  # (a bad value raises, to be said as ours)
        try:
            flags, unknown = server.parse_known_args(given)
        except argparse.ArgumentError as exc:
            p.error(f"--server-args: {exc}")
        if unknown:
            p.error(f"--server-args: not kvstore-server flags: {' '.join(unknown)}")
        page = flags.page_size
    try:
        capacity = parse_size(matrix_capacity(args))
    except ValueError as exc:
        p.error(f"--capacity: {exc}")
    stores = {"kvstore", "kvstore-unix", "kvstore-shm", "redis"} & {t.strip() for t in args.systems.split(",")}
    if stores and "matrix" not in args.skip.split(","):
        # A cell's blocks (leased for its gets) and a put's new ones side by side, each in whole pages.
        need = 2 * -(-max(parse_sizes(args.sizes)) // page) * page * max(parse_ints(args.batches))
        if capacity < need:
            p.error(f"--capacity {matrix_capacity(args)}: the largest cell needs at least {fmt_size(need)} "
                    "(its blocks, which the gets read, beside a put's new ones)")
    for flag, path, kinds in (("--json", args.json, None), ("--chart", args.chart, CHART_FORMATS)):
        if path:  # checked now, not after a run of minutes
            folder = os.path.dirname(os.path.abspath(path))
            if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
                p.error(f"{flag} {path}: its folder {folder} does not exist or is not writable")
            if kinds is not None and os.path.splitext(path)[1].lower() not in kinds:
                p.error(f"{flag} {path}: a file ending in {', '.join(kinds)}")


def _cpu_model() -> str:
    """The CPU's model name (Linux), e.g. to tell which hosts' copy speeds a run can be compared with."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return ""


def _say(msg: str) -> None:
    print(msg, flush=True)


class _Stopper:
    """SIGTERM (`timeout`, a cancelled CI job, kill) and Ctrl-C end the run with its servers stopped.

    The run is cancelled, and again every half second until it has reached its clean-up: a
    cancel can be lost (``asyncio.wait_for`` on Python 3.11, which redis-py uses, drops one that
    comes as its awaitable completes; the run then went on, or hung, with every server running).
    """

    signals = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)  # (SIGHUP: the terminal closed)
    received: int | None = None  # the signal that ended the run (main's exit code)

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop, self.task = loop, asyncio.current_task()
        self.cleaning = False
        self.handled = [sig for sig in self.signals if signal.getsignal(sig) is not signal.SIG_IGN]
        for sig in self.handled:  # (a SIGINT ignored, as by a shell's background job, stays ignored)
            loop.add_signal_handler(sig, self._on_signal, sig)

    def _on_signal(self, sig: int) -> None:
        _Stopper.received = _Stopper.received or sig
        self._cancel()

    def _cancel(self) -> None:
        if self.task is not None and not self.task.done() and not self.cleaning:
            self.task.cancel()
            self.loop.call_later(0.5, self._cancel)

    def close(self) -> None:
        for sig in self.handled:
            self.loop.remove_signal_handler(sig)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    preset = PRESETS["quick" if args.quick else "full"]
    trials = args.trials or preset.trials
    target_bytes = int((args.target_mib or preset.target_mib) * MiB)
    lookup_reps = args.lookup_reps or preset.lookup_reps
    conc_seconds = args.conc_seconds or preset.conc_seconds
    fill_mib = args.fill_mib or preset.fill_mib
    small_blocks = args.small_blocks if args.small_blocks is not None else preset.small_blocks
    min_seconds = args.min_seconds if args.min_seconds is not None else preset.min_seconds
    min_rounds = args.min_rounds or preset.min_rounds
    sizes, batches = parse_sizes(args.sizes), parse_ints(args.batches)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    capacity = matrix_capacity(args)
    server_args = tuple(shlex.split(args.server_args))
    notes: list[str] = []
    res: dict[str, Any] = {
        "bench": "kvstore-bench",
        "config": {"sizes": sizes, "batches": batches, "trials": trials, "target_bytes": target_bytes,
                   "min_seconds": min_seconds, "min_rounds": min_rounds,
                   "systems": systems, "capacity": capacity, "pool_size": args.pool_size, "quick": args.quick,
                   "server_args": server_args,
                   "argv": sys.argv[1:]},
        "host": {"python": platform.python_version(), "platform": platform.platform(), "ncpu": os.cpu_count(),
                 "cpu": _cpu_model(), "libc": " ".join(platform.libc_ver()),
                 "malloc_env": {k: v for k, v in os.environ.items() if k.startswith(("MALLOC_", "GLIBC_TUNABLES"))},
                 "mallopt": steady_allocator()},
        "notes": notes,
    }
    meter = LoadMeter()
    targets: list[Target] = []  # started: stopped however the run ends
    kv: KVStoreTarget | None = None
    redis: RedisTarget | None = None
    stopper = _Stopper(asyncio.get_running_loop())
    try:
        planned: list[Target] = []
        if "raw" in systems:
            planned.append(RawTarget())
        if "kvstore" in systems:
            kv = KVStoreTarget(capacity, pool_size=args.pool_size, server_args=server_args)
            planned.append(kv)
        for transport in ("unix", "shm"):  # same-host transports, beside TCP in the same cells
            if KVStoreTarget.NAMES[transport] in systems:
                planned.append(KVStoreTarget(capacity, pool_size=args.pool_size, server_args=server_args,
                                             transport=transport))
        if "redis" in systems:
            if RedisTarget.available(args.redis_server):
                redis = RedisTarget(parse_size(capacity), args.redis_server)
                planned.append(redis)
            else:
                notes.append(f"redis: `{args.redis_server}` or redis-py not found: skipped")
        if "lmcache" in systems:
            notes.append(lmcache_status()[1])
        for t in planned:
            await t.start()  # (a start that fails or is cancelled stops what it had started)
            targets.append(t)
            meter.watch(t.pid)
        if redis is not None:
            res["host"]["redis"] = {"version": redis.version, "hiredis": redis.hiredis}
        for n in notes:
            _say(f"# note: {n}")
        if "matrix" not in skip and "fill" not in skip:
            res["fill"] = {}
            for t in targets:
                t0 = time.perf_counter()
                written = await t.fill()
                if written:
                    res["fill"][t.name] = written
                    _say(f"# filled {t.name}: {written / MiB:.0f} MiB in {time.perf_counter() - t0:.1f}s "
                         f"(a full store: every put evicts)")
        if "matrix" not in skip and targets:
            _say(f"# matrix: sizes {[fmt_size(s) for s in sizes]} batches {batches}, {trials} trials, "
                 f"{target_bytes / MiB:.0f} MiB per measurement")
            m0 = LoadMeter([t.pid for t in targets])
            res["matrix"] = await run_matrix(targets, sizes, batches, trials, target_bytes, min_rounds, _say,
                                             min_seconds, warmup=preset.warmup)
            res["matrix_load"] = m0.report()
            add_ratios(res["matrix"])
            rss: dict[str, Any] = {}
            if kv is not None:
                st = (await kv.stats())["store"]
                rss["kvstore"] = rss_summary(proc_rss(kv.pid), st["bytes"])
                rss["kvstore"]["capacity"] = st["capacity"]
            if redis is not None:
                if "fill" not in skip:  # its big replies made it evict (RedisTarget): full again, as kvstore is
                    await redis.fill()
                mem = await redis.memory()
                rss["redis"] = rss_summary(mem["used_memory_rss"], await redis.stored_bytes())
                rss["redis"]["used_memory"] = mem["used_memory"]
            res["rss_per_stored_gib"] = rss
        if "lookup" not in skip and kv is not None:
            _say(f"# prefix lookup: chains {args.chains}, {lookup_reps} lookups x {trials} trials")
            res["lookup"] = await run_lookups(kv, redis, parse_ints(args.chains), lookup_reps, trials, _say)
        meter.sample()
        for t in targets:  # the rest measures kvstore alone
            if t is not kv:
                await t.stop()
        targets = [kv] if kv is not None else []
        if "concurrency" not in skip and kv is not None:
            conc_size = parse_sizes(args.conc_size)[0]
            workloads = [(w.split(":")[0].strip(), int(w.split(":")[1]) if ":" in w else 1)
                         for w in args.conc.split(",")]
            conc_trials = min(trials, 5)
            _say(f"# concurrency: clients {args.clients}, {fmt_size(conc_size)} blocks, {workloads}, "
                 f"{conc_seconds}s per point, {conc_trials} trials")
            c0 = LoadMeter([kv.pid])
            res["concurrency"] = await run_concurrency(kv, parse_ints(args.clients), workloads, conc_size,
                                                       conc_seconds, conc_trials, _say)
            res["concurrency_load"] = c0.report()
        if kv is not None:
            meter.sample()
            await kv.stop()
            targets = []
        if "capacity" not in skip and "kvstore" in systems:
            res["capacity"] = await run_capacity(fill_mib * MiB, 256 * 1024, 32, 3.0, _say, meter)
        if "memory" not in skip and "kvstore" in systems:
            if small_blocks:
                res["small_blocks"] = await run_small_blocks(small_blocks, 4096, _say, meter)
            res["index_overhead"] = index_overhead(min(small_blocks or 10_000, 100_000))
    finally:
        stopper.cleaning = True  # (no more cancels: they would cut the stops short)
        for t in targets:
            try:
                await t.stop()
            except Exception as exc:  # keep stopping the others
                _say(f"# warning: stopping {t.name}: {exc!r}")
        stopper.close()
    res["load"] = meter.report()
    res["targets"] = check_targets(res)
    return res


def print_report(res: dict[str, Any]) -> None:
    load = res["load"]
    _say("")
    _say(f"kvstore-bench  {time.strftime('%Y-%m-%d %H:%M')}  python {res['host']['python']}  "
         f"{res['host']['ncpu']} CPUs  trials={res['config']['trials']}  "
         f"redis={res['host'].get('redis', {}).get('version', '-')}")
    _say(f"load: other work on the machine {load['other_cpu_cores']} cores on average "
         f"(ours {load['own_cpu_cores']}), loadavg {load['loadavg1_start']} -> {load['loadavg1_end']}, "
         f"{load['elapsed_s']} s")
    for phase in ("matrix_load", "concurrency_load"):
        if res.get(phase):
            pl = res[phase]
            _say(f"  during {phase.split('_')[0]}: other work {pl['other_cpu_cores']} cores, ours {pl['own_cpu_cores']}")
    for n in res["notes"]:
        _say(f"note: {n}")
    if res.get("matrix"):
        _say("\nthroughput (medians; p50/p99 per request of `batch` blocks; cpu = cores used while measured;\n"
             "vs raw: / the faster direction of the raw socket pair; vs redis: put / SET, get(_into) / the faster\n"
             "of pipelined GET and MGET, (s)/(g)/(m) says which)")
        _say(matrix_table(res["matrix"]))
    if res.get("lookup"):
        _say(f"\nprefix lookup of a fully present chain ({LOOKUP_CHAINS} chains of each length, read in turn)")
        _say(lookup_table(res["lookup"]))
    if res.get("concurrency"):
        _say("\nconcurrency (one client process, N asyncio clients, one connection each)")
        _say(concurrency_table(res["concurrency"]))
    mem = memory_lines(res)
    if mem:
        _say("\nmemory")
        for line in mem:
            _say(line)
    if res.get("targets"):
        _say("\ntargets")
        _say(targets_table(res["targets"]))


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    runner: Callable[[Coroutine[Any, Any, dict[str, Any]]], dict[str, Any]]
    try:
        import uvloop
        runner = uvloop.run
    except ImportError:  # pragma: no cover
        runner = asyncio.run
    try:
        res = runner(run(args))
    except (KeyboardInterrupt, asyncio.CancelledError):
        sig = _Stopper.received or signal.SIGINT
        print(f"kvstore-bench: {'terminated' if sig == signal.SIGTERM else 'interrupted'}; its servers are stopped",
              file=sys.stderr)
        return 128 + sig
    print_report(res)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
        _say(f"\nwrote {args.json}")
    if args.chart and res.get("matrix"):
        why = draw_chart(res, args.chart)
        _say(f"# {why}" if why else f"wrote {args.chart}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
