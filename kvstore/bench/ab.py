"""Before/after on a noisy machine: another source tree against this one, interleaved in short bursts.

::

    python -m kvstore.bench.ab --rev 69cf365          # a git revision (exported with `git archive`)
    python -m kvstore.bench.ab --before /path/to/tree  # or a checkout laid out like this repository

Whole benchmark runs minutes apart differ by more than most changes do on a
shared 2-core VM (the same raw socket pair read 2.7 and 4.3 GB/s in two runs),
so this compares the two trees side by side, a burst each in turn:

- client side: one server (this tree); two client processes, one per tree;
- server side: one client (this tree); two servers, one per tree.

Reported per case: median request latency (p50 of each burst), client CPU
(microseconds of CPU per request, from the client process) and server CPU
(from ``/proc``). The worker is this file run as a script, so it imports the
*other* tree's ``kvstore.client``; it uses nothing but the client's public API.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":  # the worker runs this file as a script: its folder must not shadow the stdlib
    _here = os.path.dirname(os.path.abspath(__file__))  # (copy.py, profile.py; tarfile imports copy)
    sys.path[:] = [d for d in sys.path if os.path.abspath(d or ".") != _here]

import argparse  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tarfile  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

# (case, requests per burst)
CASES = [("ping", 300), ("put 64KiB x1", 200), ("get 64KiB x1", 200), ("get_into 64KiB x1", 200),
         ("lookup 1024", 50), ("put 1MiB x32", 4), ("get 1MiB x32", 4), ("get_into 1MiB x32", 4)]


# ---------------------------------------------------------------- worker (runs against either tree)


def _keys(tag: str, n: int) -> list[bytes]:
    return [hashlib.sha256(f"{tag}:{i}".encode()).digest() for i in range(n)]


async def _worker(addr: str, tag: str) -> None:
    import asyncio

    from kvstore.client import AsyncKVClient  # the tree on PYTHONPATH

    kv = AsyncKVClient(addr, namespace="ab")
    await kv.connect()
    k64, b64 = _keys("k64", 1), [bytearray(b"\x01") * 65536]
    k1m, b1m = _keys("k1m", 32), [bytearray(bytes([i + 1])) * (1 << 20) for i in range(32)]
    chain = _keys("chain", 1024)
    for keys, blocks in ((k64, b64), (k1m, b1m), (chain, [b"x" * 64] * 1024)):
        await kv.put(keys, blocks)
    d64, d1m = [bytearray(65536)], [bytearray(1 << 20) for _ in range(32)]
    seq = [0]

    def put(blocks: list[Any]) -> Any:
        seq[0] += 1
        return kv.put(_keys(f"{tag}:{seq[0]}", len(blocks)), blocks)

    async def get(keys: list[bytes]) -> None:
        out = await kv.get(keys)
        del out  # dropped at once, as a caller that copies the block elsewhere would

    ops = {"ping": kv.ping, "put 64KiB x1": lambda: put(b64), "get 64KiB x1": lambda: get(k64),
           "get_into 64KiB x1": lambda: kv.get_into(k64, d64), "lookup 1024": lambda: kv.lookup(chain),
           "put 1MiB x32": lambda: put(b1m), "get 1MiB x32": lambda: get(k1m),
           "get_into 1MiB x32": lambda: kv.get_into(k1m, d1m)}
    for op in ops.values():
        for _ in range(3):
            await op()
    print("READY", flush=True)
    loop = asyncio.get_running_loop()
    while True:
        line = (await loop.run_in_executor(None, sys.stdin.readline)).strip()
        if not line:
            break
        case, n = line.rsplit(" ", 1)
        lat = []
        c0 = time.process_time()
        for _ in range(int(n)):
            t = time.perf_counter_ns()
            await ops[case]()
            lat.append(time.perf_counter_ns() - t)
        cpu = time.process_time() - c0
        lat.sort()
        print(json.dumps({"p50_us": lat[len(lat) // 2] / 1e3, "cli_us": 1e6 * cpu / int(n)}), flush=True)
    await kv.close()


# ---------------------------------------------------------------- driver


def package_dir(tree: str, out: str) -> str:
    """An importable copy of a repository tree: kvstore/, with server/ and client/ inside it."""
    pkg = os.path.join(out, "pkg")
    shutil.copytree(os.path.join(tree, "kvstore"), os.path.join(pkg, "kvstore"))
    for sub in ("server", "client"):
        shutil.copytree(os.path.join(tree, sub), os.path.join(pkg, "kvstore", sub), dirs_exist_ok=True)
    return pkg


def export_rev(rev: str, out: str) -> str:
    """``git archive REV`` (read-only) unpacked into ``out``."""
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    data = subprocess.run(["git", "-C", repo, "archive", "--format=tar", rev], capture_output=True, check=True).stdout
    tree = os.path.join(out, "tree")
    tar = os.path.join(out, "rev.tar")
    with open(tar, "wb") as f:
        f.write(data)
    with tarfile.open(tar) as t:
        try:
            t.extractall(tree, filter="data")
        except TypeError:  # Python without extraction filters (< 3.10.12): our own repository's archive
            t.extractall(tree)
    return tree


def _env(pkg: str | None) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    if pkg:
        env["PYTHONPATH"] = pkg
    return env


def _run_in(pkg: str | None) -> dict[str, Any]:
    """``subprocess`` arguments for a child that imports ``pkg``'s kvstore (None: the installed one).
    It runs in that tree: ``python -m`` imports from the working folder first, and run from the
    repository the "before" server imported the working tree's package."""
    return {"env": _env(pkg), "cwd": pkg}


def _cpu(pid: int) -> float:
    from kvstore.bench.common import proc_cpu_s

    return proc_cpu_s(pid) or 0.0


class _Worker:
    def __init__(self, addr: str, tag: str, pkg: str | None) -> None:
        self.p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", addr, tag],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, **_run_in(pkg))
        assert self.p.stdin is not None and self.p.stdout is not None
        line = self.p.stdout.readline().strip()
        if line != "READY":
            self.p.kill()
            raise RuntimeError(f"worker for {tag} did not start: {line!r}")

    def run(self, case: str, n: int) -> dict[str, float]:
        assert self.p.stdin is not None and self.p.stdout is not None
        self.p.stdin.write(f"{case} {n}\n")
        self.p.stdin.flush()
        return json.loads(self.p.stdout.readline())

    def close(self) -> None:
        if self.p.stdin is not None:
            self.p.stdin.write("\n")
            self.p.stdin.close()
        self.p.wait(30)


def compare(before_pkg: str, side: str, reps: int) -> dict[str, Any]:
    """Alternate bursts of every case between the before and after trees on one ``side``."""
    from kvstore.server.process import ServerProcess

    servers: dict[str, Any] = {}
    workers: dict[str, _Worker] = {}
    res: dict[str, dict[str, list[dict[str, float]]]] = {t: {c: [] for c, _ in CASES} for t in ("before", "after")}
    try:
        if side == "client":
            srv = servers["after"] = ServerProcess("--capacity", "1GiB", "--idle-timeout", "0", env=_env(None)).start()
            for t, pkg in (("before", before_pkg), ("after", None)):
                workers[t] = _Worker(srv.addr, t, pkg)
        else:
            for t, pkg in (("before", before_pkg), ("after", None)):
                srv = servers[t] = ServerProcess("--capacity", "1GiB", "--idle-timeout", "0", **_run_in(pkg)).start()
                workers[t] = _Worker(srv.addr, t, None)
        for rep in range(reps):
            for case, n in CASES:
                for t in (("before", "after") if rep % 2 == 0 else ("after", "before")):
                    srv = servers["after" if side == "client" else t]
                    s0 = _cpu(srv.proc.pid)
                    r = workers[t].run(case, n)
                    r["srv_us"] = 1e6 * (_cpu(srv.proc.pid) - s0) / n
                    res[t][case].append(r)
    finally:
        for w in workers.values():
            w.close()
        for s in servers.values():
            s.stop()
    out: dict[str, Any] = {}
    for case, _ in CASES:
        out[case] = {t: {k: round(statistics.median(x[k] for x in res[t][case]), 1) for k in ("p50_us", "cli_us", "srv_us")}
                     for t in ("before", "after")}
    return out


def table(side: str, out: dict[str, Any]) -> str:
    lines = [f"{side} side: {'case':18s} {'p50 before':>10s} {'p50 after':>10s} {'cli us b':>9s} {'cli us a':>9s} "
             f"{'srv us b':>9s} {'srv us a':>9s}"]
    for case, r in out.items():
        b, a = r["before"], r["after"]
        lines.append(f"{'':13s}{case:18s} {b['p50_us']:10.1f} {a['p50_us']:10.1f} {b['cli_us']:9.1f} {a['cli_us']:9.1f} "
                     f"{b['srv_us']:9.1f} {a['srv_us']:9.1f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvstore.bench.ab", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--rev", help="git revision to compare against (exported read-only with git archive)")
    g.add_argument("--before", help="a source tree laid out like this repository")
    p.add_argument("--sides", default="client,server")
    p.add_argument("--reps", type=int, default=16, help="bursts per case and tree")
    p.add_argument("--json", default="", help="write the medians here")
    p.add_argument("--worker", nargs=2, metavar=("ADDR", "TAG"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        try:
            import uvloop
            uvloop.run(_worker(*args.worker))
        except ImportError:  # pragma: no cover
            import asyncio
            asyncio.run(_worker(*args.worker))
        return 0
    if not (args.rev or args.before):
        p.error("give --rev or --before")
    with tempfile.TemporaryDirectory(prefix="kvstore-ab-") as tmp:
        tree = export_rev(args.rev, tmp) if args.rev else args.before
        pkg = package_dir(tree, tmp)
        results = {}
        for side in args.sides.split(","):
            results[side] = compare(pkg, side, args.reps)
            print(table(side, results[side]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"before": args.rev or args.before, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
