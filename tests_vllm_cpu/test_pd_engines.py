"""P/D disaggregation with real vLLM engines: prefill engines store prompts' KV caches in
kvstore, a decode engine in another process loads them and generates from them.

Each engine is a separate process (``engine.py``) running vLLM's CPU build on a tiny model,
greedy, so the tokens a decode engine generates from loaded KV can be compared with the tokens
the model generated from KV it computed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvstore.client import AsyncKVClient, KVClient
from kvstore.server.process import ServerProcess

ENGINE = Path(__file__).with_name("engine.py")
CHUNK = 64  # tokens of an offloaded chunk: 2 of the engine's 32-token blocks
MAX_TOKENS = 16


def tokens(n: int, step: int, start: int = 3) -> list[int]:
    return [(i * step + start) % 500 + 3 for i in range(n)]


P0 = tokens(300, 7)  # 4 whole chunks, then 44 tokens
P1 = P0[:128] + tokens(200, 11)  # 5 whole chunks, the first 2 P0's
P2 = tokens(200, 13, 1)  # 3 whole chunks, none shared
P3 = P0[:256] + tokens(100, 17)  # P0's 4 whole chunks, then one of its own
P4 = P0[:256] + tokens(100, 19)  # the same, then another
PROMPTS = [P0, P1, P2]


def run_engine(model: Path, *steps: dict[str, Any], between: Callable[[int], None] | None = None,
               **job: Any) -> list[dict[str, Any]]:
    """Run one engine through its steps (``engine.py``); its result of each. ``between(i)``, if
    given, runs before step i after the first, the engine waiting for it."""
    job = {"model": str(model), "chunk_tokens": CHUNK, "steps": [{"max_tokens": MAX_TOKENS, **s} for s in steps],
           "pause": between is not None, **job}
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
    if job.get("tp", 1) > 1:  # (vLLM binds each rank's threads to a NUMA node of its own, unless told: a core each)
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(c % (os.cpu_count() or 1)) for c in range(job["tp"]))
    # (a session of its own: vLLM's engine core and workers are its children, stopped with it)
    with tempfile.TemporaryFile("w+") as err, subprocess.Popen(
            [sys.executable, str(ENGINE), json.dumps(job)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=err, text=True, env=env, start_new_session=True) as proc:
        assert proc.stdin is not None and proc.stdout is not None
        timer = threading.Timer(300, os.killpg, (proc.pid, signal.SIGKILL))  # (its stdout then ends)
        timer.start()
        out = []
        try:
            for line in proc.stdout:
                out.append(line)
                if line.startswith("PAUSED ") and between is not None:
                    between(int(line.split()[1]))
                    proc.stdin.write("\n")
                    proc.stdin.flush()
            proc.wait()
        finally:
            timer.cancel()
            stop_session(proc.pid)
        err.seek(0)
        log = err.read()
    lines = [line for line in out if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, (f"engine exited {proc.returncode} (-9: killed, as after 300 s):\n"
                                            f"{''.join(out)[-3000:]}\n{log[-6000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def stop_session(pgid: int, grace: float = 10.0) -> None:
    """Give what is left of an engine's session (vLLM's resource tracker cleaning up after it) a
    few seconds to end, then kill it."""
    deadline = time.monotonic() + grace
    with contextlib.suppress(ProcessLookupError):
        while time.monotonic() < deadline:
            os.killpg(pgid, 0)
            time.sleep(0.1)
        os.killpg(pgid, signal.SIGKILL)


def stats(srv: ServerProcess) -> dict[str, Any]:
    with KVClient(srv.addr) as kv:
        return kv.stats()


def served(srv: ServerProcess) -> tuple[int, int]:
    """GET requests the server answered, and the bytes it sent."""
    st = stats(srv)
    return st["requests"].get("get", 0), st["bytes_out"]


@pytest.fixture(scope="module")
def prefilled(models: dict[str, Path], kvstore_server: ServerProcess) -> dict[str, Any]:
    """A prefill engine of model "a", the prompts marked for a remote decode: its tokens, from KV
    it computed (the store was empty), and the chunks it stored."""
    # 12 keys PUT: P1 restates the 2 chunks it shares with P0, as a prompt marked so does
    (step,) = run_engine(models["a"], {"prompts": PROMPTS, "mark": "do_remote_decode", "put_keys": 12},
                         addr=kvstore_server.addr, namespace="pd")
    assert [c % CHUNK for c in step["cached"]] == [0, 0, 0]  # (at most the local prefix cache: P1's 2 chunks of P0)
    assert step["stored"] == 4 + 3 + 3  # every whole chunk of each prompt, once
    return step


@pytest.fixture(scope="module")
def restated(models: dict[str, Path], kvstore_server: ServerProcess, unix_path: str,
             prefilled: dict[str, Any]) -> list[dict[str, Any]]:
    """A second prefill engine: P3 loads P0's 4 chunks from the store, computes its fifth, and is
    marked for a remote decode; then P4, the same but not marked. This engine is on the server's
    host and names its Unix socket: it reads the chunks out of the server's shared memory."""
    shm_gets = stats(kvstore_server)["shm"]["gets"]
    steps = run_engine(models["a"], {"prompts": [P3], "mark": "do_remote_decode", "put_keys": 1},
                       {"prompts": [P4], "put_keys": 1}, addr=f"unix:{unix_path}", namespace="pd")
    assert stats(kvstore_server)["shm"]["gets"] > shm_gets
    return steps


def test_a_decode_engine_generates_from_the_stored_kv_what_the_model_generated_from_its_own(
        models: dict[str, Path], kvstore_server: ServerProcess, prefilled: dict[str, Any],
        restated: list[dict[str, Any]]) -> None:
    gets, sent = served(kvstore_server)
    (decode,) = run_engine(models["a"], {"prompts": PROMPTS + [P3], "mark": "do_remote_prefill"},
                           addr=kvstore_server.addr, namespace="pd")
    assert decode["cached"] == [256, 320, 192, 320]  # each prompt's whole chunks were loaded, not computed
    after_gets, after_sent = served(kvstore_server)
    # 11 chunks: P1 and P3 share 2 and 4 of P0's, which the engine loads once
    assert after_gets > gets and after_sent - sent >= 11 * 64 * 1024  # (a chunk: 2 layers x K,V x 64 x 64 x 4 B)
    assert decode["tokens"] == prefilled["tokens"] + restated[0]["tokens"]


def test_a_prefill_marked_for_a_remote_decode_stores_the_prefix_it_loaded_too(restated: list[dict[str, Any]]) -> None:
    """The seed's rule, in a real engine: the marked request PUTs its loaded prefix with the chunk it
    computed (so a decode node finds the whole prompt even if the prefix was evicted since); the
    other request only the chunk it computed."""
    marked, plain = restated
    assert marked["cached"] == [256] and (marked["stored"], marked["existed"]) == (1, 4)
    assert plain["cached"] == [256] and (plain["stored"], plain["existed"]) == (1, 0)


def test_the_decode_engines_tokens_come_from_the_loaded_kv(models: dict[str, Path], kvstore_server: ServerProcess,
                                                           prefilled: dict[str, Any]) -> None:
    """The first check can fail: model "b" stores P0's KV in another namespace, model "a" decodes
    from it, and its tokens are no longer those it generated from its own KV."""
    addr, ns = kvstore_server.addr, "other-weights"
    (prefill,) = run_engine(models["b"], {"prompts": [P0], "mark": "do_remote_decode", "put_keys": 4},
                            addr=addr, namespace=ns)
    assert prefill["stored"] == 4 and prefill["tokens"][0] != prefilled["tokens"][0]
    (decode,) = run_engine(models["a"], {"prompts": [P0], "mark": "do_remote_prefill"}, addr=addr, namespace=ns)
    assert decode["cached"] == [256]
    assert decode["tokens"][0] != prefilled["tokens"][0]


def test_a_model_with_a_sliding_window_layer_loads_both_kinds_of_kv(models: dict[str, Path],
                                                                    kvstore_server: ServerProcess) -> None:
    """A Gemma 3 whose first layer sees only the last 128 tokens (2 chunks) and whose second sees
    all: two KV-cache groups. vLLM frees the windowed layer's chunks that fall out of its window
    as it goes, so the prefill engine stores each prompt's whole chunks of the full layer and
    only the last two of the windowed one; the decode engine loads both, counts the prompts up to
    them as cached, and generates what the model generated from its own KV."""
    addr, ns = kvstore_server.addr, "hybrid"
    (prefill,) = run_engine(models["hybrid"], {"prompts": [P0, P2], "mark": "do_remote_decode", "put_keys": 11},
                            addr=addr, namespace=ns)
    assert prefill["stored"] == (4 + 3) + (2 + 2)  # (P0's and P2's whole chunks; of the windowed layer two each)
    assert stats(kvstore_server)["namespaces"][ns]["blocks"] == 11
    (decode,) = run_engine(models["hybrid"], {"prompts": [P0, P2], "mark": "do_remote_prefill"},
                           addr=addr, namespace=ns)
    assert decode["cached"] == [256, 192]
    assert decode["tokens"] == prefill["tokens"]


def test_an_engine_goes_on_through_a_crash_of_its_server_and_then_its_memory_gone_bad(
        models: dict[str, Path], prefilled: dict[str, Any], unix_path: str) -> None:
    """The store is a cache, and what it returns is checked. Between two steps of an engine the
    test kills its server: the next step can neither load nor store, and the engine generates the
    model's own tokens. A new, empty server then listens at that address, and the step after
    stores its prompt's five chunks there. Nobody restarts the engine. Then the test overwrites
    all of the new server's block memory (as bad RAM would), the engine forgets its own prefix
    cache, and the same prompt comes again: the server has its chunks, the engine's loads find
    them corrupted and delete them, and it computes the prompt itself (``"kv_load_failure_policy":
    "recompute"``) -- the model never reads the bad bytes -- and, the prompt marked for a remote
    decode, stores its chunks again. (Unmarked, vLLM 0.32 would not: it stores only the chunks
    past a load's hits, failed or not.)"""
    first = ServerProcess("--capacity", "64MiB").start()
    servers = [first]

    def between(step: int) -> None:
        if step == 1:
            first.kill()  # SIGKILL: a crash, connections reset
        elif step == 2:  # (the fixture's server listens on unix_path: this one gets a path of its own)
            servers.append(ServerProcess("--capacity", "64MiB", "--port", str(first.port),
                                         "--unix", unix_path + ".2").start())
        else:
            scribble_over_the_arena(unix_path + ".2")

    try:
        # kvstore_quarantine_s 0: every lookup and store asks (and a refused connect is quick), so
        # the first step after the restart finds the server without waiting out a quarantine
        before, down, after, corrupted = run_engine(
            models["a"], {"prompts": [P2], "mark": "do_remote_decode", "put_keys": 3},
            {"prompts": [P0], "mark": "do_remote_decode"},
            {"prompts": [P1], "mark": "do_remote_decode", "put_keys": 5},
            {"prompts": [P1], "mark": "do_remote_decode", "forget": True, "put_keys": 5},
            between=between, addr=first.addr, namespace="restart", policy="recompute", quarantine_s=0)
        assert len(servers) == 2
        new_server = stats(servers[1])
    finally:
        for srv in servers:
            srv.stop()
    assert before["stored"] == 3 and before["tokens"] == [prefilled["tokens"][2]]
    assert down["cached"] == [0] and down["tokens"] == [prefilled["tokens"][0]]
    # P1's 5 chunks, the 2 it shares with P0 too (computed while the server was down, in vLLM's own
    # prefix cache now): the marked prompt stores its whole prefix
    assert (after["stored"], after["existed"]) == (5, 0) and after["tokens"] == [prefilled["tokens"][1]]
    assert corrupted["cached"] == [0] and corrupted["tokens"] == [prefilled["tokens"][1]]
    assert (corrupted["stored"], corrupted["existed"]) == (5, 0)  # the bad chunks were deleted, then stored anew
    assert new_server["requests"]["delete"] == 1
    assert new_server["namespaces"]["restart"]["blocks"] == 5


def scribble_over_the_arena(unix_path: str) -> None:
    """Overwrite a server's block memory, mapped as a same-host client maps it: all of it but the
    first 16 bytes of each page. A block begins on a page, and the adapter's chunks with a 16-byte
    header of their own, checked on load: left whole, only the checksum tells the chunk is bad."""

    async def scribble() -> None:
        async with AsyncKVClient(f"unix:{unix_path}", namespace="restart") as kv:
            await kv.ping()  # (connected and attached)
            channel = kv.nodes[0].shm
            assert channel is not None
            arena, page = channel.segment.buffer, channel.segment.page_size
            bad = b"\xff" * (page - 16)  # (NaN wherever float32 KV is read)
            for at in range(0, len(arena), page):
                arena[at + 16:at + page] = bad

    asyncio.run(scribble())


def test_each_tensor_parallel_rank_stores_and_loads_its_own_slice(models: dict[str, Path],
                                                                  kvstore_server: ServerProcess) -> None:
    """Two ranks, a worker process each holding one of the model's two KV heads: every chunk is
    two blocks on the server, a rank's half each, and a decode engine of two ranks loads them back
    into the right workers (a rank that took the other's half would attend with the other head's KV)."""
    addr, ns, steps = kvstore_server.addr, "tp2", {"prompts": [P0], "max_tokens": 8}
    (prefill,) = run_engine(models["tp2"], {**steps, "mark": "do_remote_decode", "put_keys": 8},
                            addr=addr, namespace=ns, tp=2)
    assert prefill["stored"] == 4 * 2 and prefill["cached"] == [0]
    half = 2 * 2 * CHUNK * 64 * 4  # a rank's slice of a chunk: 2 layers x K,V x 64 tokens x one head of 64 x 4 B
    assert 8 * half <= stats(kvstore_server)["namespaces"][ns]["bytes"] < 8 * (half + 1024)  # (+ a header each)
    (decode,) = run_engine(models["tp2"], {**steps, "mark": "do_remote_prefill"}, addr=addr, namespace=ns, tp=2)
    assert decode["cached"] == [256]
    assert decode["tokens"] == prefill["tokens"]
