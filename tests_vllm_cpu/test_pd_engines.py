"""P/D disaggregation with real vLLM engines: a prefill engine stores a prompt's KV cache in
kvstore, a decode engine in another process loads it and generates from it.

Each engine is a separate process (``engine.py``) running vLLM's CPU build on a tiny model,
greedy, so the tokens a decode engine generates from loaded KV can be compared with the tokens
the model generates from KV it computed itself.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvstore.client import KVClient
from kvstore.server.process import ServerProcess

ENGINE = Path(__file__).with_name("engine.py")
CHUNK_TOKENS = 64  # offloaded chunk: 2 of the engine's 32-token blocks
PROMPT = [(i * 7 + 3) % 500 + 3 for i in range(300)]  # 4 whole chunks (256 tokens), then 44 tokens
PROMPT_CHUNKS = len(PROMPT) // CHUNK_TOKENS
MAX_TOKENS = 16


def run_engine(model: Path, **job: Any) -> dict[str, Any]:
    """Run one engine to the end; its RESULT line."""
    job = {"model": str(model), "prompt": PROMPT, "max_tokens": MAX_TOKENS, "chunk_tokens": CHUNK_TOKENS, **job}
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
    proc = subprocess.run([sys.executable, str(ENGINE), json.dumps(job)], capture_output=True, text=True,
                          env=env, timeout=300)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"engine exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads(lines[-1].removeprefix("RESULT "))


def served(srv: ServerProcess) -> tuple[int, int]:
    """GET requests the server answered, and the bytes it sent."""
    with KVClient(srv.addr) as kv:
        stats = kv.stats()
    return stats["requests"].get("get", 0), stats["bytes_out"]


@pytest.fixture(scope="module")
def stored(models: dict[str, Path], kvstore_server: ServerProcess) -> dict[str, Any]:
    """A prefill engine of model "a" with kvstore behind it, the prompt marked for a remote decode:
    its tokens (computed from its own KV: the store was empty) and what it left in the store."""
    result = run_engine(models["a"], addr=kvstore_server.addr, namespace="pd", mark="do_remote_decode",
                        wait_blocks=PROMPT_CHUNKS)
    assert result["cached"] == 0 and len(result["tokens"]) == MAX_TOKENS
    assert result["blocks"] == PROMPT_CHUNKS  # every whole chunk of the prompt is in the store
    return result


def test_a_decode_engine_generates_from_the_stored_kv_what_the_model_generates_from_its_own(
        models: dict[str, Path], kvstore_server: ServerProcess, stored: dict[str, Any]) -> None:
    gets, sent = served(kvstore_server)
    decode = run_engine(models["a"], addr=kvstore_server.addr, namespace="pd", mark="do_remote_prefill")
    assert decode["cached"] == PROMPT_CHUNKS * CHUNK_TOKENS  # the prompt's whole chunks were loaded, not computed
    after_gets, after_sent = served(kvstore_server)
    assert after_gets > gets and after_sent - sent >= PROMPT_CHUNKS * 64 * 1024  # (2 layers x K,V x 64 x 64 x 4 B)
    assert decode["tokens"] == stored["tokens"]


def test_the_decode_engines_tokens_come_from_the_loaded_kv(models: dict[str, Path], kvstore_server: ServerProcess,
                                                           stored: dict[str, Any]) -> None:
    """The check above can fail: model "b" stores the prompt's KV in another namespace, model "a"
    decodes from it, and its tokens are no longer those it generates from its own KV."""
    addr, ns = kvstore_server.addr, "other-weights"
    prefill = run_engine(models["b"], addr=addr, namespace=ns, mark="do_remote_decode", wait_blocks=PROMPT_CHUNKS)
    assert prefill["blocks"] == PROMPT_CHUNKS and prefill["tokens"] != stored["tokens"]
    decode = run_engine(models["a"], addr=addr, namespace=ns, mark="do_remote_prefill")
    assert decode["cached"] == PROMPT_CHUNKS * CHUNK_TOKENS
    assert decode["tokens"] != stored["tokens"]
