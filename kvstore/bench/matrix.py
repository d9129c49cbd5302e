"""The throughput matrix (block size x batch x system op) and the prefix-lookup latencies.

Interleaved: within a cell, every trial runs every system op once, in an order
rotated from trial to trial, so a burst of background load hits all systems
alike; the figures are medians over trials.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable

from .common import fmt_size, make_blocks, make_keys, median, pct, proc_cpu_s, proc_minflt, self_cpu_s
from .targets import KVStoreTarget, Op, RedisTarget, Target, timed_rounds

Log = Callable[[str], None]


@dataclass
class Series:
    """One system op in one cell: a value per trial."""

    system: str
    op: str
    size: int
    batch: int
    rounds: int
    gbps: list[float] = field(default_factory=list)
    p50_us: list[float] = field(default_factory=list)
    p99_us: list[float] = field(default_factory=list)
    server_cpu: list[float] = field(default_factory=list)  # cores used by the server while measured
    client_cpu: list[float] = field(default_factory=list)  # cores used by this (client) process
    server_faults: list[float] = field(default_factory=list)  # minor page faults per 4 KiB of payload
    client_faults: list[float] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        g = median(self.gbps)
        return {
            "system": self.system, "op": self.op, "size": self.size, "batch": self.batch, "rounds": self.rounds,
            "gbps": round(g, 3), "gbps_trials": [round(x, 3) for x in self.gbps],
            "blocks_per_s": round(g * 1e9 / self.size), "requests_per_s": round(g * 1e9 / self.size / self.batch),
            "p50_us": round(median(self.p50_us), 1), "p99_us": round(median(self.p99_us), 1),
            "server_cpu": round(median(self.server_cpu), 2) if self.server_cpu else None,
            "client_cpu": round(median(self.client_cpu), 2),
            "server_cpu_s_per_gb": round(median(c / g for c, g in zip(self.server_cpu, self.gbps)), 3)
            if self.server_cpu else None,
            "client_cpu_s_per_gb": round(median(c / g for c, g in zip(self.client_cpu, self.gbps)), 3),
            "server_faults_per_page": round(median(self.server_faults), 3) if self.server_faults else None,
            "client_faults_per_page": round(median(self.client_faults), 3),
        }


def rounds_for(size: int, batch: int, target_bytes: int, min_rounds: int) -> int:
    return max(min_rounds, target_bytes // (size * batch))


def rounds_for_time(rounds: int, warm_s: float, warm_rounds: int, min_seconds: float, min_rounds: int = 1) -> int:
    """Requests per measurement, from the byte target ``rounds`` and the warm-up's pace.

    At least ``min_seconds`` of requests: a measurement of a few tens of ms is dominated by
    the ramp-up after another system ran (measured: the raw socket pair's 8 MiB ``down`` at
    40 ms per measurement read 1.5 GB/s interleaved, 2.4 GB/s alone). At most twice that,
    beyond ``min_rounds``: the byte target alone made each 64 KiB x 1 measurement 1536
    requests, 0.9 s on a busy machine, and that one cell 100 s of a full run.
    """
    per_round = warm_s / max(1, warm_rounds)
    if per_round <= 0 or min_seconds <= 0:
        return rounds
    return max(min_rounds, int(min_seconds / per_round) + 1, min(rounds, int(2 * min_seconds / per_round)))


async def measure(target: Target, op: Op, rounds: int, series: Series) -> None:
    c0, s0 = self_cpu_s(), proc_cpu_s(target.pid)
    f0, g0 = proc_minflt(os.getpid()), proc_minflt(target.pid)
    wall, lat = await timed_rounds(op, rounds)
    c1, s1 = self_cpu_s(), proc_cpu_s(target.pid)
    f1, g1 = proc_minflt(os.getpid()), proc_minflt(target.pid)
    pages = series.size * series.batch * rounds / 4096
    if f0 is not None and f1 is not None:
        series.client_faults.append((f1 - f0) / pages)
    if g0 is not None and g1 is not None:
        series.server_faults.append((g1 - g0) / pages)
    series.gbps.append(series.size * series.batch * rounds / wall / 1e9)
    series.p50_us.append(pct(lat, 0.50) / 1e3)
    series.p99_us.append(pct(lat, 0.99) / 1e3)
    series.client_cpu.append((c1 - c0) / wall)
    if s0 is not None and s1 is not None:
        series.server_cpu.append((s1 - s0) / wall)


async def run_matrix(targets: list[Target], sizes: list[int], batches: list[int], trials: int,
                     target_bytes: int, min_rounds: int, log: Log, min_seconds: float = 0.0,
                     warmup: int = 3, settle: int = 1) -> list[dict[str, Any]]:
    """The cells, each interleaved over ``trials``; every measurement follows ``settle`` untimed
    requests of its own op (the first after another system ran pays for the switch)."""
    out: list[dict[str, Any]] = []
    for size in sizes:
        for batch in batches:
            rounds = rounds_for(size, batch, target_bytes, min_rounds)
            plan: list[tuple[Target, str, Op, Series]] = []
            for t in targets:
                ops = await t.prepare(size, batch, rounds)
                for name, op in ops.items():
                    warm, _ = await timed_rounds(op, warmup)  # warm-up: connections, buffers, caches
                    n = rounds_for_time(rounds, warm, warmup, min_seconds, min_rounds)
                    plan.append((t, name, op, Series(t.name, name, size, batch, n)))
            for trial in range(trials):
                k = trial % len(plan)
                for t, _, op, series in plan[k:] + plan[:k]:
                    await timed_rounds(op, settle)  # untimed: the switch from the system before
                    await measure(t, op, series.rounds, series)
            for t in targets:
                await t.release()
            for *_, series in plan:
                s = series.summary()
                out.append(s)
                log(f"# {s['system']:12s} {s['op']:11s} {fmt_size(size):>6s} x{batch:<3d} {s['gbps']:7.3f} GB/s "
                    f"{s['blocks_per_s']:>8d} blocks/s p50={s['p50_us']:9.1f}us p99={s['p99_us']:9.1f}us "
                    f"cpu srv={s['server_cpu']} cli={s['client_cpu']} faults/4KiB srv={s['server_faults_per_page']} "
                    f"cli={s['client_faults_per_page']} trials={s['gbps_trials']}")
    return out


#: Chains of each length the lookup benchmark reads in turn.
LOOKUP_CHAINS = 4


async def run_lookups(kv: KVStoreTarget, redis: RedisTarget | None, chains: list[int], reps: int, trials: int,
                      log: Log) -> list[dict[str, Any]]:
    """Prefix lookup of a fully present chain of n keys: one request, n keys checked.

    Each request reads the next of ``LOOKUP_CHAINS`` chains, so the chain read
    is never the one read last, as for an engine serving several requests.
    Redis has no prefix call; its nearest equivalent is one pipelined round
    trip of n EXISTS (which cannot stop at the first miss).
    """
    out = []
    tiny = make_blocks(64, 1)[0]
    for n in chains:
        chain_keys = [make_keys(f"chain:{n}:{c}", n) for c in range(LOOKUP_CHAINS)]
        for keys in chain_keys:
            await kv.client.put(keys, [tiny] * n)
        ops: list[tuple[str, str, Op]] = []

        async def kv_lookup(i: int, chain_keys: list[list[bytes]] = chain_keys, n: int = n) -> None:
            m = await kv.client.lookup(chain_keys[i % LOOKUP_CHAINS])
            if m != n:
                raise RuntimeError(f"kvstore lookup found {m} of {n}")

        ops.append(("kvstore", "lookup", kv_lookup))
        if redis is not None:
            for keys in chain_keys:
                await redis.client.mset({k: bytes(tiny) for k in keys})

            async def redis_exists(i: int, chain_keys: list[list[bytes]] = chain_keys, n: int = n) -> None:
                keys = chain_keys[i % LOOKUP_CHAINS]
                if n == 1:
                    found = [await redis.client.exists(keys[0])]
                else:
                    p = redis.client.pipeline(transaction=False)
                    for k in keys:
                        p.exists(k)
                    found = await p.execute()
                if sum(found) != n:
                    raise RuntimeError("redis: chain key missing")

            ops.append(("redis", "exists_pipelined", redis_exists))
        lat: dict[str, list[list[int]]] = {name: [] for name, _, _ in ops}
        walls: dict[str, list[float]] = {name: [] for name, _, _ in ops}
        for _, _, op in ops:
            await timed_rounds(op, 5)
        for trial in range(trials):
            order = ops[trial % len(ops):] + ops[:trial % len(ops)]
            for name, _, op in order:
                wall, l = await timed_rounds(op, reps)
                lat[name].append(l)
                walls[name].append(wall)
        # Requests one lookup takes: one, unless the chain is over the server's --max-batch (Redis: one pipeline).
        kv_trips = len(kv.client.nodes[0].key_runs(n))
        for name, opname, _ in ops:
            r = {
                "system": name, "op": opname, "chain": n, "reps": reps,
                "p50_us": round(median(pct(l, 0.5) for l in lat[name]) / 1e3, 1),
                "p99_us": round(median(pct(l, 0.99) for l in lat[name]) / 1e3, 1),
                "lookups_per_s": round(median(reps / w for w in walls[name])),
                "round_trips": kv_trips if name == "kvstore" else 1,
            }
            out.append(r)
            log(f"# {name:8s} {opname:16s} chain={n:<5d} p50={r['p50_us']:8.1f}us p99={r['p99_us']:8.1f}us "
                f"{r['lookups_per_s']} lookups/s")
    return out
