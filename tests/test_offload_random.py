"""Randomized model-based test: OffloadScheduler driven by a simulated engine.

``test_offload.py`` walks single paths; this hunts the interleavings nobody wrote down. GPU
block slots hold the "true KV" of a position (a digest of extra + tokens so far; freed blocks
get garbage). Sync or async scheduling, chunked prefill, GPU prefix hits, changing lookups,
do_remote_decode on and off, extras, jobs run out of order and sometimes failed, aborts
mid-load and mid-store, and ``preempt()`` with transfers in flight, tokens arriving after it
and aborts before resuming. Checked: a store has the right chain keys and parent and reads
exactly the true KV, a load leaves it in its blocks; no block comes back while a pending job
uses it, every block handed out comes back exactly once (``preempt``, ``free_now`` or
``on_*_done``); no store during the request's load, no block stored twice (but all again by a
do_remote_decode request after a preemption, and what its lookup does not find by any other);
where no store failed, every full computed block
is stored (do_remote_decode) or stored or loaded (without: and no loaded block stored again);
each lookup find is loaded or ``take_unused`` once; at the end nothing is pending or tracked.
200 seeds run in about a second.
"""

from __future__ import annotations

import hashlib
import random
from collections import Counter
from dataclasses import dataclass, field
from itertools import takewhile

import pytest

from kvstore.engine.hashing import BlockHasher
from kvstore.engine.offload import LoadJob, OffloadScheduler, StoreJob

GARBAGE = b"?"
VOCAB = 3  # a tiny vocabulary: many shared prefixes, so many lookup hits


@dataclass
class Req:
    rid: str
    tokens: list[int]  # every token the engine knows; async, the scheduler lags one behind
    extra: object
    remote: bool
    max_tokens: int
    told: int  # tokens the scheduler has been given
    kv: list[bytes] = field(default_factory=list)  # true KV per position, see true_kv
    blocks: list[int] = field(default_factory=list)  # GPU blocks of the current allocation
    computed: int = 0  # leading tokens whose true KV is in `blocks`
    state: str = "waiting"  # waiting (new or preempted) | loading | running | ended
    load: int | None = None  # the request's pending load, whatever its state
    preempted: bool = False
    emitted: set[int] = field(default_factory=set)  # chain blocks put in store jobs
    stored: set[int] = field(default_factory=set)  # ... by stores that succeeded
    loaded_end: int = 0  # chain block after the last one a load fetched
    store_failed: bool = False
    final_blocks: int | None = None  # full computed blocks at the end; None: not checked

    def true_kv(self) -> list[bytes]:
        while len(self.kv) < len(self.tokens):
            prev = self.kv[-1] if self.kv else repr(self.extra).encode()
            tok = self.tokens[len(self.kv)].to_bytes(8, "little")
            self.kv.append(hashlib.blake2b(prev + tok, digest_size=8).digest())
        return self.kv


class Sim:
    def __init__(self, seed: int) -> None:
        rng = self.rng = random.Random(seed)
        self.gbs, self.factor = rng.choice([1, 2, 4]), rng.choice([1, 2, 3])
        self.obs = self.gbs * self.factor  # offloaded block size
        self.async_ = rng.random() < 0.5
        self.hasher = BlockHasher(self.obs, algo=rng.choice(["sha256", "xxh3_128"]))
        self.s = OffloadScheduler(self.hasher, self.gbs)
        self.s.keep_unused = True
        self.gpu = [[GARBAGE] * self.gbs for _ in range(500)]
        self.free = rng.sample(range(500), 500)
        self.owner: dict[int, str] = {}  # block handed to a request -> its id
        self.store: dict[bytes, tuple[bytes, ...]] = {}
        self.jobs: dict[int, LoadJob | StoreJob] = {}  # pending
        self.reqs: dict[str, Req] = {}  # live
        self.ended: dict[str, Req] = {}
        self.leases: Counter[bytes] = Counter()  # lookup finds not yet loaded or given as unused
        self.late: list[Req] = []  # async: sampled a token the scheduler has not been told
        self.seen: Counter[str] = Counter()  # situations reached, so the test cannot go vacuous

    def req(self, rid: str) -> Req:
        return self.reqs.get(rid) or self.ended[rid]

    def alloc(self, r: Req, n: int) -> list[int]:
        ids = [self.free.pop() for _ in range(n)]
        self.owner.update(dict.fromkeys(ids, r.rid))
        r.blocks += ids
        return ids

    def give_back(self, rid: str, blocks: tuple[int, ...]) -> None:
        busy = {b for job in self.jobs.values() for b in job.gpu_block_ids}
        for b in blocks:
            assert b not in busy, f"block {b} of {rid} handed back while a pending job uses it"
            assert self.owner.get(b) == rid and b not in self.req(rid).blocks, (
                f"block {b} handed back for {rid}: held by {self.owner.get(b)}, or still in its allocation")
            del self.owner[b]
            self.gpu[b] = [GARBAGE] * self.gbs
            self.free.append(b)

    def tell(self, r: Req) -> None:
        self.seen["token after preempt"] += r.state == "waiting" and r.preempted
        self.s.append_tokens(r.rid, r.tokens[r.told :])
        r.told = len(r.tokens)

    def lookup(self, keys: list[bytes]) -> int:
        found = list(takewhile(self.store.__contains__, keys))
        self.leases.update(found)
        return len(found)

    def emit(self, jobs) -> None:
        for job in jobs:
            r, blocks = self.req(job.req_id), range(job.first_block, job.first_block + len(job.keys))
            assert r.load is None, f"{r.rid} stores while its load is in flight"
            assert not r.emitted.intersection(blocks), f"{r.rid} stores blocks {blocks} twice"
            assert r.remote or job.first_block >= r.loaded_end, f"{r.rid} stores loaded blocks again"
            r.emitted.update(blocks)
            self.jobs[job.job_id] = job

    def new_request(self) -> None:
        rng, obs, others = self.rng, self.obs, [*self.reqs.values(), *self.ended.values()]
        n = rng.choice([1, obs - 1, obs, obs + 1, 2 * obs, rng.randint(1, 5 * obs)])
        prompt = [rng.randrange(VOCAB) for _ in range(n)]
        if others and rng.random() < 0.5:  # share a prefix with another request
            base = rng.choice(others).tokens
            prompt = base[: rng.randint(0, len(base))] + prompt
        prompt, extra = prompt or [0], rng.choice([None, None, ("lora", 1), {"mm": [b"h1"]}])
        max_tokens = len(prompt) + rng.randint(1, 2 * obs)
        r = Req(f"r{len(others)}", prompt, extra, rng.random() < 0.5, max_tokens, len(prompt))
        params = {"do_remote_decode": True} if r.remote else rng.choice([None, {}, {"do_remote_decode": False}])
        self.s.add_request(r.rid, prompt, params, extra=extra)
        self.reqs[r.rid] = r

    def admit(self, r: Req) -> None:
        rng, s, gbs = self.rng, self.s, self.gbs
        hit = rng.randint(0, (r.told - 1) // gbs) * gbs if rng.random() < 0.3 else 0
        n = s.num_external_tokens(r.rid, hit, self.lookup)
        if rng.random() < 0.2:  # asked again, the store changed meanwhile
            if self.store and rng.random() < 0.7:
                del self.store[rng.choice(list(self.store))]
            n = s.num_external_tokens(r.rid, hit, self.lookup)
        if r.load is not None:  # the load into its old blocks still runs: not yet
            with pytest.raises(ValueError, match="in flight"):
                s.on_alloc(r.rid, [], n)
            self.seen["resume refused"] += 1
            return
        r.blocks, r.computed, end = [], hit, (hit + n) // self.obs
        if r.preempted and not r.remote:  # resumed: what the lookup did not find is stored again
            r.emitted -= set(range(end, len(r.tokens) // self.obs + 1))
            r.loaded_end = min(r.loaded_end, end)
        self.alloc(r, -(-(hit + n) // gbs) + rng.randint(0, 1))
        for p in range(hit):  # the GPU prefix cache holds these
            self.gpu[r.blocks[p // gbs]][p % gbs] = r.true_kv()[p]
        job = s.on_alloc(r.rid, list(r.blocks), n)
        r.state = "running" if job is None else "loading"
        if job is not None:
            assert job.keys == tuple(self.hasher.keys(r.tokens, r.extra)[hit // self.obs : end])
            assert job.gpu_block_ids == tuple(r.blocks[hit // gbs : end * self.factor])
            assert job.skip == hit // gbs - job.first_block * self.factor
            self.leases.subtract(job.keys)
            self.jobs[job.job_id], r.load = job, job.job_id

    def run_job(self, jid: int) -> None:
        job, f, gbs, obs = self.jobs.pop(jid), self.factor, self.gbs, self.obs
        r, end = self.req(job.req_id), job.first_block + len(job.keys)
        assert all(self.owner.get(b) == r.rid for b in job.gpu_block_ids), f"job {jid} uses blocks {r.rid} lacks"
        if isinstance(job, StoreJob):
            ok, keys, kv = self.rng.random() < 0.95, self.hasher.keys(r.tokens, r.extra), r.true_kv()
            assert job.keys == tuple(keys[job.first_block : end]) and len(job.gpu_block_ids) == len(job.keys) * f
            assert job.parent == (keys[job.first_block - 1] if job.first_block else None)
            for b, key in enumerate(job.keys, job.first_block):
                i = b - job.first_block
                got = tuple(v for g in job.gpu_block_ids[i * f : (i + 1) * f] for v in self.gpu[g])
                assert got == tuple(kv[b * obs : (b + 1) * obs]), f"{r.rid} stores wrong KV for block {b}"
                if ok:
                    self.store[key] = got
                    r.stored.add(b)
            r.store_failed |= not ok
            self.give_back(r.rid, self.s.on_store_done(jid, ok))
            return
        payloads = [self.store.get(k) for k in job.keys]
        ok = None not in payloads and self.rng.random() < 0.92
        if ok:
            slots = [v for p in payloads for v in p][job.skip * gbs :]  # type: ignore[union-attr]
            for i, g in enumerate(job.gpu_block_ids):
                self.gpu[g] = slots[i * gbs : (i + 1) * gbs]
            r.loaded_end = max(r.loaded_end, end)
        r.load = None
        freed = self.s.on_load_done(jid, ok)
        if r.state == "loading":  # not preempted or ended meanwhile
            r.state = "running"  # (a full hit still computes the last token)
            if ok:  # else only the GPU hit is there
                r.computed = min(end * obs, len(r.tokens) - 1)
            for p in range(r.computed):
                assert self.gpu[r.blocks[p // gbs]][p % gbs] == r.true_kv()[p], f"{r.rid}: wrong KV at {p}"
        self.give_back(r.rid, freed)

    def preempt(self, r: Req) -> None:
        self.seen["preempt mid-load"] += r.load is not None
        self.seen["preempt mid-store"] += any(j.req_id == r.rid for j in self.jobs.values())
        free = self.s.preempt(r.rid)
        r.blocks, r.computed, r.state, r.preempted = [], 0, "waiting", True
        if r.remote:  # it stores everything again (the store may have evicted some meanwhile)
            r.emitted.clear()
        self.give_back(r.rid, free)

    def end(self, r: Req) -> None:
        if r in self.late:  # an abort may never report the last token
            self.late.remove(r)
            if self.rng.random() < 0.7:
                self.tell(r)
        self.seen["aborted mid-load"] += r.state == "loading"
        self.seen["aborted while preempted"] += r.state == "waiting" and r.preempted
        if r.state != "loading":
            r.final_blocks = min(r.computed, r.told) // self.obs
        fin = self.s.finish_request(r.rid)
        self.ended[r.rid] = self.reqs.pop(r.rid)
        self.emit(fin.stores)
        r.blocks, r.state = [], "ended"
        self.give_back(r.rid, fin.free_now)

    def step(self) -> None:
        rng, s, gbs = self.rng, self.s, self.gbs
        if rng.random() < 0.5 and len(self.reqs) + len(self.ended) < 12:
            self.new_request()
        for r in list(self.reqs.values()):
            if r.state == "waiting" and rng.random() < 0.7:
                self.admit(r)
        counts = {}
        for r in self.reqs.values():
            if r.state == "running" and r.computed < len(r.tokens) and rng.random() < 0.8:
                counts[r.rid] = min(len(r.tokens), r.computed + rng.randint(1, 3 * self.obs))  # chunks
                if (need := -(-counts[r.rid] // gbs) - len(r.blocks)) > 0:
                    s.extend_blocks(r.rid, self.alloc(r, need))
        idle = [r.rid for r in self.reqs.values() if r.state == "waiting"]
        if idle and rng.random() < 0.1:  # a count for blocks a request lacks: refused whole
            with pytest.raises(ValueError, match="GPU blocks"):
                s.build_step({**counts, rng.choice(idle): self.obs})
        self.emit(s.build_step(counts))
        for r in self.late:  # async: last step's tokens are known only after scheduling this one
            self.tell(r)
        self.late = []
        for rid, new in counts.items():  # forward pass, then sampling
            r = self.reqs[rid]
            for p in range(r.computed, new):
                self.gpu[r.blocks[p // gbs]][p % gbs] = r.true_kv()[p]
            r.computed = new
            if new == len(r.tokens) < r.max_tokens:
                r.tokens.append(rng.randrange(VOCAB))
                (self.late.append if self.async_ else self.tell)(r)
        for jid in list(self.jobs):
            if rng.random() < 0.4:
                self.run_job(jid)
        for r in list(self.reqs.values()):
            x = rng.random()
            if x < 0.04 or (r.state == "running" and r.computed >= len(r.tokens) - 1 >= r.max_tokens - 1):
                self.end(r)
            elif x < 0.1 and r.state != "waiting":
                self.preempt(r)
        self.leases.subtract(s.take_unused())
        assert not -self.leases, "a lookup find was loaded or given as unused twice"

    def run(self) -> None:
        for _ in range(self.rng.randint(20, 60)):
            self.step()
        for r in list(self.reqs.values()):
            self.end(r)
        while self.jobs:
            self.run_job(self.rng.choice(list(self.jobs)))
        self.leases.subtract(self.s.take_unused())
        assert not self.s.pending_jobs, f"jobs never reported done: {self.s.pending_jobs}"
        assert not self.s.num_requests, f"{self.s.num_requests} requests still tracked"
        assert not self.owner, f"blocks never handed back: {self.owner}"
        assert not +self.leases and not -self.leases, f"lookup finds unaccounted for: {self.leases}"
        for r in self.ended.values():
            if r.final_blocks is not None and not r.store_failed:
                have = r.stored if r.remote else r.stored | set(range(r.loaded_end))
                missing = set(range(r.final_blocks)) - have
                assert not missing, f"{r.rid} (remote={r.remote}) never stored blocks {sorted(missing)}"
                self.seen["remote re-store of loaded"] += r.remote and bool(r.stored & set(range(r.loaded_end)))


@pytest.mark.parametrize("first_seed", range(0, 200, 50))
def test_scheduler_against_a_simulated_engine(first_seed: int) -> None:
    seen: Counter[str] = Counter()
    for seed in range(first_seed, first_seed + 50):
        sim = Sim(seed)
        try:
            sim.run()
        except (Exception, pytest.fail.Exception) as exc:  # name the seed; the cause follows
            what = " / ".join(str(exc).splitlines()[:3])
            raise AssertionError(f"seed {seed} (async={sim.async_}, factor={sim.factor}): "
                                 f"{type(exc).__name__}: {what}") from exc
        seen += sim.seen
    wanted = ["preempt mid-load", "preempt mid-store", "token after preempt", "aborted while preempted",
              "aborted mid-load", "resume refused", "remote re-store of loaded"]
    assert all(seen[w] for w in wanted), f"situations not reached: {seen}"
