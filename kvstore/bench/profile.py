"""Where the time goes: one workload against a fresh kvstore-server, sampled by py-spy.

::

    python -m kvstore.bench.profile --op put --size 1m --batch 32 --seconds 5
    python -m kvstore.bench.profile --op lookup --chain 1024 --client-profile
    python -m kvstore.bench.profile --op put --transport shm --full   # a full store: every put evicts

The server is attached to by ``py-spy record`` (``--idle`` off, so only
samples where it runs count; ``--native`` adds C frames) while this process
loops on the op; the collapsed stacks are summarized as the functions with
the most *own* samples and the most *inclusive* samples. ``--client-profile``
also runs the client under cProfile. Needs ``py-spy`` (``pip install
py-spy``) and permission to ptrace the server (same user, usually fine).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import collections
import contextlib
import io
import os
import pstats
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any, Awaitable, Callable

from .common import fmt_size, make_blocks, make_keys, parse_sizes
from .targets import KVStoreTarget


def summarize_collapsed(path: str, top: int = 25) -> str:
    """Own and inclusive sample shares per function from a py-spy ``--format raw`` file."""
    own: collections.Counter[str] = collections.Counter()
    incl: collections.Counter[str] = collections.Counter()
    total = 0
    with open(path) as f:
        for line in f:
            stack, _, n = line.rstrip("\n").rpartition(" ")
            if not n.isdigit():
                continue
            count = int(n)
            frames = [_short(fr) for fr in stack.split(";")]
            total += count
            own[frames[-1]] += count
            for fr in set(frames):
                incl[fr] += count
    if not total:
        return "no samples (was the server busy? is ptrace allowed?)"
    lines = [f"{total} samples", "", "own time (the function itself):"]
    lines += [f"  {100 * c / total:5.1f}%  {fn}" for fn, c in own.most_common(top)]
    lines += ["", "inclusive time (the function and what it calls):"]
    lines += [f"  {100 * c / total:5.1f}%  {fn}" for fn, c in incl.most_common(top)]
    return "\n".join(lines)


def _short(frame: str) -> str:
    """'get_buffer (kvstore/protocol.py:312)' -> 'get_buffer (protocol.py)'."""
    name, _, where = frame.partition(" (")
    where = where.rstrip(")")
    file = where.rsplit(":", 1)[0]
    return f"{name} ({os.path.basename(file)})" if file else name


async def workload(kv: KVStoreTarget, args: argparse.Namespace) -> Callable[[], Awaitable[Any]]:
    c = kv.client
    size, batch = parse_sizes(args.size)[0], args.batch
    if args.op == "lookup":
        keys = make_keys("prof-chain", args.chain)
        await c.put(keys, [b"x" * 64] * args.chain)
        return lambda: c.lookup(keys)
    keys = make_keys(f"prof:{size}:{batch}", batch)
    blocks = make_blocks(size, batch)
    await c.put(keys, blocks)
    if args.op == "get":
        return lambda: c.get(keys)
    if args.op == "get_into":
        dst = [bytearray(b"\x01") * size for _ in range(batch)]
        return lambda: c.get_into(keys, dst)
    if args.op == "put":
        seq = [0]

        def put() -> Awaitable[Any]:
            seq[0] += 1
            return c.put(make_keys(f"prof-put:{seq[0]}", batch), blocks)
        return put
    raise SystemExit(f"unknown op {args.op}")


async def run(args: argparse.Namespace) -> None:
    spy = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
    if not os.path.exists(spy):
        raise SystemExit("py-spy not found: pip install py-spy")
    kv = KVStoreTarget(args.capacity, transport=args.transport)
    await kv.start()
    fd, out = (-1, args.out) if args.out else tempfile.mkstemp(prefix="kvstore-prof-", suffix=".txt")
    if fd >= 0:
        os.close(fd)
    try:
        if args.full:
            await kv.fill()  # every put evicts, as in service
        fn = await workload(kv, args)
        for _ in range(5):
            await fn()
        cmd = [spy, "record", "--pid", str(kv.pid), "--duration", str(int(args.seconds)), "--rate", str(args.rate),
               "--format", "raw", "--output", out]
        cmd.append("--native" if args.native else "--nonblocking")
        rec = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        prof = cProfile.Profile() if args.client_profile else None
        n, t0 = 0, time.perf_counter()
        stop = time.monotonic() + args.seconds + 0.5
        if prof:
            prof.enable()
        while time.monotonic() < stop:
            await fn()
            n += 1
        if prof:
            prof.disable()
        wall = time.perf_counter() - t0
        _, err = rec.communicate(timeout=60)
        size = parse_sizes(args.size)[0]
        what = f"chain of {args.chain}" if args.op == "lookup" else f"{fmt_size(size)} x{args.batch}"
        moved = "" if args.op == "lookup" else f", {n * size * args.batch / wall / 1e9:.3f} GB/s"
        print(f"# {args.op} {what}: {n} requests in {wall:.1f}s = {n / wall:.0f} req/s, "
              f"{1e6 * wall / max(1, n):.0f} us each{moved}")
        if rec.returncode:
            print(f"# py-spy failed: {err.strip()[-500:]}")
        else:
            print(f"# server profile ({args.out or 'keep the stacks with --out FILE'}):")
            print(summarize_collapsed(out, args.top))
        if prof:
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(args.top)
            print("# client profile (cProfile, tottime):")
            print(s.getvalue())
    finally:
        await kv.stop()
        if not args.out:
            with contextlib.suppress(OSError):
                os.remove(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvstore.bench.profile", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--op", default="put", choices=["put", "get", "get_into", "lookup"])
    p.add_argument("--size", default="1m")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--chain", type=int, default=1024)
    p.add_argument("--seconds", type=float, default=5)
    p.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    p.add_argument("--native", action="store_true", help="include C frames (libc, uvloop)")
    p.add_argument("--capacity", default="1GiB")
    p.add_argument("--transport", default="tcp", choices=["tcp", "unix", "shm"])
    p.add_argument("--full", action="store_true", help="fill the store first, so that every put evicts")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--out", default="", help="keep the collapsed stacks here")
    p.add_argument("--client-profile", action="store_true", help="also cProfile the client")
    args = p.parse_args(argv)
    try:
        import uvloop
        uvloop.run(run(args))
    except ImportError:  # pragma: no cover
        asyncio.run(run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
