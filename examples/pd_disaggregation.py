"""Prefill/decode disaggregation through kvstore, with a tiny transformer and a paged KV cache.

A prefill process computes a prompt's KV cache and stores *all* of it (``do_remote_decode``);
a decode process -- another OS process, possibly another host -- finds the chain in the store,
loads it into its own paged cache and generates. Its tokens equal those of ``local``: the
reference, which never contacts the server and computes every prompt itself, in one process.

    kvstore-server &
    python examples/pd_disaggregation.py prefill --prompt "The quick brown fox jumps over"
    python examples/pd_disaggregation.py decode  --prompt "The quick brown fox jumps over"
    python examples/pd_disaggregation.py local   --prompt "The quick brown fox jumps over"

Tokens are the prompt's UTF-8 bytes (vocabulary 256); weights are random from a fixed seed,
so no downloads. Each ``--prompt`` gets a fresh engine (an empty GPU prefix cache): a prompt
sharing a prefix with an earlier one loads that prefix from the store and computes the rest.
Prints one JSON object per prompt on stdout: generated tokens, their logits, and how many
prompt tokens were loaded vs computed; a summary goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from kvstore.engine.hashing import BlockHasher, namespace_for
from kvstore.engine.offload import LoadJob, OffloadScheduler, StoreJob
from kvstore.engine.transfer import PagedKVTransfer, TransferExecutor
from kvstore.errors import TransportError


@dataclass(frozen=True)
class Config:
    vocab: int = 256
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 16
    d_ff: int = 128
    max_pos: int = 512
    seed: int = 0
    gpu_block_size: int = 4
    block_size_factor: int = 2  # offloaded block = 8 tokens
    num_gpu_blocks: int = 64


class TinyLM:
    """A decoder-only transformer (GQA, RMSNorm, SiLU MLP) reading and writing a paged KV cache."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        gen = torch.Generator().manual_seed(cfg.seed)

        def w(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=gen) / math.sqrt(shape[0])

        d, kv = cfg.d_model, cfg.n_kv_heads * cfg.head_dim
        self.embed = torch.randn(cfg.vocab, d, generator=gen)
        self.head = w(d, cfg.vocab) * 4  # untied: a tied head would mostly echo the last token
        self.pos = torch.randn(cfg.max_pos, d, generator=gen) * 0.5
        self.layers = [
            {"q": w(d, cfg.n_heads * cfg.head_dim), "k": w(d, kv), "v": w(d, kv),
             "o": w(cfg.n_heads * cfg.head_dim, d), "up": w(d, cfg.d_ff), "down": w(cfg.d_ff, d)}
            for _ in range(cfg.n_layers)
        ]

    def new_cache(self) -> list[torch.Tensor]:
        """Per layer ``[2, num_gpu_blocks, gpu_block_size, kv_heads, head_dim]`` (K, V)."""
        c = self.cfg
        shape = (2, c.num_gpu_blocks, c.gpu_block_size, c.n_kv_heads, c.head_dim)
        return [torch.full(shape, float("nan")) for _ in range(c.n_layers)]  # NaN: unwritten shows

    def forward(self, tokens: Sequence[int], start: int, cache: list[torch.Tensor],
                block_table: Sequence[int]) -> torch.Tensor:
        """Logits for positions ``start .. start+len(tokens)-1``; writes their K/V to the cache."""
        c = self.cfg
        n, end = len(tokens), start + len(tokens)
        table = torch.tensor(list(block_table), dtype=torch.long)
        positions = torch.arange(end)
        blocks, offsets = table[positions // c.gpu_block_size], positions % c.gpu_block_size
        x = self.embed[torch.tensor(list(tokens))] + self.pos[start:end]
        mask = torch.ones(n, end, dtype=torch.bool).tril(diagonal=start)
        for layer, kv in zip(self.layers, cache):
            h = _rms(x)
            q = (h @ layer["q"]).view(n, c.n_heads, c.head_dim)
            kv[0, blocks[start:], offsets[start:]] = (h @ layer["k"]).view(n, c.n_kv_heads, c.head_dim)
            kv[1, blocks[start:], offsets[start:]] = (h @ layer["v"]).view(n, c.n_kv_heads, c.head_dim)
            rep = c.n_heads // c.n_kv_heads
            k = kv[0, blocks, offsets].repeat_interleave(rep, dim=1)  # [end, heads, dim]
            v = kv[1, blocks, offsets].repeat_interleave(rep, dim=1)
            att = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                                 attn_mask=mask)
            x = x + att.transpose(0, 1).reshape(n, -1) @ layer["o"]
            x = x + F.silu(_rms(x) @ layer["up"]) @ layer["down"]
        return _rms(x) @ self.head


def _rms(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def namespace(cfg: Config) -> str:
    return namespace_for("kvstore-examples/tiny-lm", torch.float32, "2,N,B,H,D", 0,
                         cfg.gpu_block_size * cfg.block_size_factor, gpu_block_size=cfg.gpu_block_size,
                         seed=cfg.seed)


class Engine:
    """One request at a time, synchronous scheduling; a fresh engine has an empty GPU cache."""

    def __init__(self, model: TinyLM, client: Any | None) -> None:
        cfg = model.cfg
        self.model = model
        self.cache = model.new_cache()
        self.free = list(range(cfg.num_gpu_blocks))
        self.scheduler = OffloadScheduler(BlockHasher(cfg.gpu_block_size * cfg.block_size_factor),
                                          cfg.gpu_block_size)
        self.executor = None
        if client is not None:
            self.executor = TransferExecutor(client, PagedKVTransfer(self.cache, cfg.block_size_factor),
                                             self.scheduler, pin=True)
        self.offloaded_blocks = 0
        self.failed_stores = 0

    def generate(self, prompt: list[int], max_tokens: int, params: dict[str, Any] | None = None) -> dict[str, Any]:
        cfg, sched, rid = self.model.cfg, self.scheduler, "req"
        sched.add_request(rid, prompt, params)
        external = sched.num_external_tokens(rid, 0, self.executor.lookup) if self.executor else 0
        table = self._take(-(-len(prompt) // cfg.gpu_block_size))
        load = sched.on_alloc(rid, table, external)
        if load is not None and self._run([load]):
            external = 0  # the load failed: compute everything
        # at least the last prompt token is computed: its logits give the first new token
        start = min(external, len(prompt) - 1)
        stores = sched.build_step({rid: len(prompt)})
        logits = self.model.forward(prompt[start:], start, self.cache, table)[-1]
        self._run(stores)
        tokens: list[int] = []
        all_logits: list[list[float]] = []
        while True:
            token = int(logits.argmax())
            tokens.append(token)
            all_logits.append(logits.tolist())
            sched.append_tokens(rid, [token])
            if len(tokens) == max_tokens:
                break
            pos = len(prompt) + len(tokens) - 1
            if pos // cfg.gpu_block_size >= len(table):
                new = self._take(1)
                table += new
                sched.extend_blocks(rid, new)
            stores = sched.build_step({rid: pos + 1})
            logits = self.model.forward([token], pos, self.cache, table)[-1]
            self._run(stores)
        fin = sched.finish_request(rid)
        self.free += fin.free_now
        self._run(fin.stores)
        assert not sched.pending_jobs and not sched.num_requests
        return {"prompt_tokens": len(prompt), "loaded_tokens": external, "computed_tokens": len(prompt) - start,
                "offloaded_blocks": self.offloaded_blocks, "failed_stores": self.failed_stores, "tokens": tokens,
                "logits": all_logits}

    def _take(self, n: int) -> list[int]:
        taken, self.free = self.free[:n], self.free[n:]
        return taken

    def _run(self, jobs: Sequence[LoadJob | StoreJob]) -> bool:
        """Runs jobs; True if any failed."""
        if self.executor is None:  # local mode: no store, the jobs are dropped
            for job in jobs:
                assert isinstance(job, StoreJob)
                self.free += self.scheduler.on_store_done(job.job_id, success=False)
            return False
        done = self.executor.run(jobs)
        self.free += done.freed
        self.offloaded_blocks += sum(len(j.keys) for j in jobs if isinstance(j, StoreJob) and j not in done.failed)
        self.failed_stores += sum(isinstance(j, StoreJob) for j in done.failed)
        return bool(done.failed)


class NoServer(Exception):
    """No kvstore server answered at the address."""


def run(mode: str, prompts: list[str], max_tokens: int, server: str | None,
        cfg: Config | None = None) -> list[dict[str, Any]]:
    """Runs each prompt in a fresh engine; ``server`` is unused in ``local`` mode."""
    cfg = cfg or Config()
    model = TinyLM(cfg)
    results = []
    client = None
    if mode != "local":
        from kvstore.client import KVClient

        client = KVClient(server or "127.0.0.1:7600", namespace=namespace(cfg))
        try:
            client.connect()
        except TransportError as exc:
            client.close()
            raise NoServer(f"no kvstore server answered at {server or '127.0.0.1:7600'} ({exc})") from None
    try:
        for text in prompts:
            engine = Engine(model, client)
            if mode == "prefill":  # the decode runs elsewhere: store every block, produce one token
                res = engine.generate(list(text.encode()), 1, {"do_remote_decode": True})
            else:
                res = engine.generate(list(text.encode()), max_tokens)
            results.append({"mode": mode, "prompt": text, **res})
    finally:
        if client is not None:
            client.close()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["prefill", "decode", "local"],
                        help="prefill: compute and store; decode: load and generate; local: the reference, no server")
    parser.add_argument("--prompt", action="append", required=True, help="repeat for several prompts")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--server", default=os.environ.get("KVSTORE_ADDR") or "127.0.0.1:7600",
                        help="kvstore-server host:port [KVSTORE_ADDR, as kvstore-cli; default 127.0.0.1:7600]")
    args = parser.parse_args(argv)
    room = Config.num_gpu_blocks * Config.gpu_block_size  # tokens the paged cache holds
    if args.max_tokens < 1:
        parser.error(f"--max-tokens: expected at least 1, got {args.max_tokens}")
    for text in args.prompt:
        if not text or len(text.encode()) + args.max_tokens > room:
            parser.error(f"--prompt {text!r}: expected 1 byte or more, and with --max-tokens at most {room} tokens "
                         f"(the tiny model's paged KV cache), got {len(text.encode())} + {args.max_tokens}")
    failed = 0
    try:
        results = run(args.mode, args.prompt, args.max_tokens, args.server)
    except NoServer as exc:
        print(f"{args.mode}: {exc}; start one (`kvstore-server &` serves 127.0.0.1:7600) or give its "
              f"address with --server HOST:PORT (or KVSTORE_ADDR)", file=sys.stderr)
        return 1
    for res in results:
        print(json.dumps(res), flush=True)
        print(f"{res['mode']}: {res['prompt']!r}: loaded {res['loaded_tokens']} tokens, computed "
              f"{res['computed_tokens']}, offloaded {res['offloaded_blocks']} blocks, "
              f"generated {bytes(res['tokens'])!r}", file=sys.stderr)
        failed += res["failed_stores"]
    if failed and args.mode == "prefill":  # its whole job: a decode node would not find those blocks
        print(f"prefill: {failed} store(s) failed (see the warnings above)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
