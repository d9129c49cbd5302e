"""A paged KV cache on the GPU to the store and back: what an engine's offload costs end to end.

::

    python -m kvstore.bench.paged                     # CUDA when torch sees a GPU, else CPU
    python -m kvstore.bench.paged --layers 32 --kv-heads 8 --head-dim 128 --dtype bfloat16

The cache is one tensor per layer, ``[2, blocks, block_tokens, kv_heads, head_dim]``
(Llama-3-8B's shape by default: 2 MiB per block over 32 layers). Starts its own
``kvstore-server`` on 127.0.0.1 (with ``--unix`` for the shared-memory path) and measures,
taking turns within each trial (medians reported), a batch of blocks each way:

- ``d2h`` / ``h2d``: one copy of the batch's bytes between the device and a pinned host
  buffer -- the link's ceiling (on CPU: a memcpy);
- ``gather`` / ``scatter``: :class:`PagedKVTransfer` alone, cache <-> pinned payloads;
- ``put`` / ``get_into``: the client alone, payloads already on the host (TCP, shm);
- ``store`` = gather + put of new keys, ``load`` = get_into + scatter (TCP, shm): the engine's
  offload and reload.

GB = 1e9 bytes of payload; ratios are against ``d2h`` (stores) and ``h2d`` (loads).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from typing import Any, Callable

import torch

from kvstore.client import KVClient
from kvstore.engine.transfer import PagedKVTransfer
from kvstore.server.process import ServerProcess

from .common import make_keys


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kvstore.bench.paged", description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--block-tokens", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--factor", type=int, default=1, help="GPU blocks per stored block")
    p.add_argument("--batch", type=int, default=32, help="stored blocks per request")
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--seconds", type=float, default=0.5, help="per measurement, at least")
    p.add_argument("--capacity", default="4GiB", help="the server's")
    p.add_argument("--transports", default="tcp,shm")
    p.add_argument("--json", default="", help="write the results here")
    return p


Op = Callable[[], "Callable[[], Any] | None"]


def _timed(fn: Op, seconds: float, sync: Callable[[], None]) -> tuple[float, int]:
    """Seconds per round (median) and rounds run, running ``fn()`` for ``seconds`` at least; what
    ``fn`` returns, if anything, is run after each round, untimed (puts delete their blocks: the
    store never fills, and the blocks that gets read stay)."""
    times: list[float] = []
    start = time.perf_counter()
    while not times or time.perf_counter() - start < seconds:
        t0 = time.perf_counter()
        after = fn()
        sync()
        times.append(time.perf_counter() - t0)
        if after is not None:
            after()
    return statistics.median(times), len(times)


def _client_ops(kv: KVClient, tr: str, transfer: PagedKVTransfer, payloads: list[torch.Tensor], ids_a: list[int],
                ids_b: list[int]) -> dict[str, Op]:
    """One transport's ops: the client alone, then with the cache's gather or scatter around it."""
    views = [p.numpy().data for p in payloads]
    stored = make_keys(f"paged-{tr}", len(views))
    kv.put(stored, views)
    fresh = make_keys(f"paged-{tr}-new", len(views))

    def put() -> Callable[[], Any]:
        res = kv.put(fresh, views)
        assert res.stored == len(views), res
        return lambda: kv.delete(fresh)

    def store() -> Callable[[], Any]:
        transfer.gather(ids_a, out=payloads)
        return put()

    def get_into() -> None:
        assert all(kv.get_into(stored, views))

    def load() -> None:
        get_into()
        transfer.scatter(payloads, ids_b)

    return {f"put {tr}": put, f"store {tr}": store, f"get_into {tr}": get_into, f"load {tr}": load}


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    nblocks = 2 * args.batch * args.factor
    shape = (2, nblocks, args.block_tokens, args.kv_heads, args.head_dim)
    caches = [torch.empty(shape, dtype=dtype, device=device) for _ in range(args.layers)]
    for c in caches:
        c.view(torch.uint8).random_(0, 256)
    transfer = PagedKVTransfer(caches, args.factor)
    size = transfer.payload_size
    total = size * args.batch
    ids_a = list(range(args.batch * args.factor))
    ids_b = list(range(args.batch * args.factor, nblocks))
    payloads = transfer.new_payloads(args.batch)
    flat = torch.empty(total, dtype=torch.uint8, device=device).random_(0, 256)
    host = torch.empty(total, dtype=torch.uint8, pin_memory=device.type == "cuda")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def d2h() -> None:
        host.copy_(flat, non_blocking=True)

    def h2d() -> None:
        flat.copy_(host, non_blocking=True)

    def gather() -> None:
        transfer.gather(ids_a, out=payloads)

    def scatter() -> None:
        transfer.scatter(payloads, ids_b)

    ops: dict[str, Op] = {"d2h": d2h, "h2d": h2d, "gather": gather, "scatter": scatter}
    directory = tempfile.mkdtemp(prefix="kvsb", dir="/tmp")
    clients: list[KVClient] = []
    results: dict[str, list[tuple[float, int]]] = {}
    shm: dict[str, int] = {}
    try:
        with ServerProcess("--capacity", args.capacity, "--unix", f"{directory}/kv.sock") as srv:
            transfer.gather(ids_a, out=payloads)
            for tr in args.transports.split(","):
                kv = KVClient(srv.addr, shm=tr == "shm")
                clients.append(kv)
                ops.update(_client_ops(kv, tr, transfer, payloads, ids_a, ids_b))
            for fn in ops.values():  # warm-up, one round each: allocators, pinned pools, first attaches
                _timed(fn, 0, sync)
            for _ in range(args.trials):
                for name, fn in ops.items():
                    results.setdefault(name, []).append(_timed(fn, args.seconds, sync))
            shm = clients[0].stats()["shm"] if clients else {}  # did the shm rows go through the arena?
    finally:
        for kv in clients:
            kv.close()
        shutil.rmtree(directory, ignore_errors=True)
    gbps = {name: statistics.median(total / t / 1e9 for t, _ in runs) for name, runs in results.items()}
    lat = {name: statistics.median(t for t, _ in runs) for name, runs in results.items()}
    return {"device": str(device), "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else
            "cpu", "torch": torch.__version__, "cpus": os.cpu_count(), "payload_bytes": size, "batch": args.batch,
            "layers": args.layers, "dtype": args.dtype, "trials": args.trials, "gbps": gbps, "seconds_per_batch": lat,
            "shm_requests": {k: shm.get(k, 0) for k in ("gets", "puts")}}


def table(res: dict[str, Any]) -> str:
    g, lat = res["gbps"], res["seconds_per_batch"]
    lines = [f"{res['device_name']}, torch {res['torch']}, {res['cpus']} CPUs; {res['layers']} layers {res['dtype']}, "
             f"blocks of {res['payload_bytes'] / 2**20:.2f} MiB x {res['batch']}, median of {res['trials']} trials",
             f"{'op':<16}{'GB/s':>8}{'ms/batch':>10}{'vs link':>9}"]
    for name in g:
        ref = g["d2h"] if name.split()[0] in ("d2h", "gather", "put", "store") else g["h2d"]
        lines.append(f"{name:<16}{g[name]:>8.2f}{lat[name] * 1e3:>10.2f}{g[name] / ref:>8.2f}x")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA GPU (use --device cpu)")
    res = run(args)
    print(table(res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
