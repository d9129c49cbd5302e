"""The P/D example end to end: a real server, a prefill process and a decode process.

The decode process generates from KV it loaded (computed by another process) and must produce
the tokens -- and, to float tolerance, the logits -- of one process doing everything.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from kvstore.server.process import ServerProcess

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "pd_disaggregation.py"
P1 = "The quick brown fox jumps over"  # 30 tokens: 3 full offloaded blocks of 8
P2 = "The quick brown fox jumps under the lazy dog"  # 44 tokens; its first 3 blocks are P1's
MAX_TOKENS = 8


def load_example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("pd_disaggregation", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it executes
    spec.loader.exec_module(module)
    return module


def run_process(mode: str, addr: str, cwd: Path, by_env: bool = False) -> list[dict[str, Any]]:
    """``by_env``: the address in KVSTORE_ADDR (as kvstore-cli takes it), not ``--server``."""
    where = [] if by_env else ["--server", addr]
    env = {**os.environ, "KVSTORE_ADDR": addr} if by_env else {k: v for k, v in os.environ.items() if k != "KVSTORE_ADDR"}
    cmd = [sys.executable, str(EXAMPLE), mode, *where, "--prompt", P1, "--prompt", P2, "--max-tokens", str(MAX_TOKENS)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=cwd, env=env)
    assert proc.returncode == 0, proc.stderr
    return [json.loads(line) for line in proc.stdout.splitlines()]


def counts(result: dict[str, Any]) -> tuple[int, int, int]:
    return result["loaded_tokens"], result["computed_tokens"], result["offloaded_blocks"]


def test_decode_process_continues_what_the_prefill_process_computed(kv_server: ServerProcess,
                                                                      tmp_path: Path) -> None:
    prefill = run_process("prefill", kv_server.addr, tmp_path)
    decode = run_process("decode", kv_server.addr, tmp_path, by_env=True)
    local = load_example().run("local", [P1, P2], MAX_TOKENS, None)

    # P1: nothing to load; all 3 full blocks offloaded. P2 loads P1's 3 blocks, computes only the
    # rest, and -- do_remote_decode -- offloads all 5 of its full blocks, the loaded ones included.
    assert counts(prefill[0]) == (0, 30, 3)
    assert counts(prefill[1]) == (24, 20, 5)
    # decode loads every full block the prefill stored and computes the partial tail
    assert counts(decode[0])[:2] == (24, 6)
    assert counts(decode[1])[:2] == (40, 4)
    assert [counts(r)[:2] for r in local] == [(0, 30), (0, 44)]

    for p, d, lo in zip(prefill, decode, local):
        assert len(d["tokens"]) == MAX_TOKENS
        assert d["tokens"] == lo["tokens"]
        assert p["tokens"] == lo["tokens"][:1]
        torch.testing.assert_close(torch.tensor(d["logits"]), torch.tensor(lo["logits"]), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(torch.tensor(p["logits"]), torch.tensor(lo["logits"][:1]), rtol=1e-4, atol=1e-4)
    assert local[0]["tokens"] != local[1]["tokens"]  # the prompts really lead to different text


def test_a_prefill_whose_stores_fail_says_so_and_exits_1(make_server, tmp_path: Path) -> None:
    srv = make_server("--capacity", "8MiB", "--max-block", "1KiB")  # every offloaded block is larger
    cmd = [sys.executable, str(EXAMPLE), "prefill", "--server", srv.addr, "--prompt", P1]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 1  # (was 0 with nothing stored)
    assert "prefill: 1 store(s) failed" in proc.stderr and "offloaded 0 blocks" in proc.stderr


def test_model_notices_wrong_kv() -> None:
    """The comparison above can fail: the same tokens with corrupted cached KV give other logits."""
    ex = load_example()
    model = ex.TinyLM(ex.Config())
    prompt = list(P1.encode())
    cache = model.new_cache()
    table = list(range(8))
    good = model.forward(prompt, 0, cache, table)[-1]
    cache[0][0, 0, 0] += 0.5  # one K vector of position 0
    bad = model.forward(prompt[-1:], len(prompt) - 1, cache, table)[-1]
    assert not torch.allclose(good, bad, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(("args", "expected"), [
    (["--max-tokens", "0"], "--max-tokens: expected at least 1, got 0"),
    (["--prompt", ""], "expected 1 byte or more"),
    (["--prompt", "x" * 30, "--max-tokens", "250"], "at most 256 tokens (the tiny model's paged KV cache), got 30 + 250"),
])
def test_the_examples_bad_arguments_are_usage_errors(args: list[str], expected: str) -> None:
    """(they ended in an IndexError or a RuntimeError from torch, deep in the model)"""
    argv = [sys.executable, str(EXAMPLE), "local", *args]
    if "--prompt" not in args:
        argv += ["--prompt", "hello"]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and expected in r.stderr and "Traceback" not in r.stderr, r.stderr
