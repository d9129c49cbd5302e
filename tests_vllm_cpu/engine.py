"""One vLLM engine, run as its own process by the tests: ``python engine.py JOB`` (JSON).

JOB: ``model`` (a local model directory), ``tp`` (tensor-parallel ranks, one worker process
each; 1 by default), ``steps``, and for an engine with kvstore behind it
``addr``, ``namespace`` and ``chunk_tokens`` (the offloaded block size). Each step generates
for its ``prompts`` (token ids) at once, greedily, ``max_tokens`` each, all of them marked with
``mark`` when given (``do_remote_decode`` for a P/D prefill, ``do_remote_prefill`` for its
decode). vLLM answers before its stores reach the server, so a step with ``put_keys`` then
waits until the server has taken that many more keys in PUTs (stored, or already there),
and a second more. With ``pause``, the engine prints ``PAUSED i`` before each step i after the
first and waits for a line on its stdin (the test restarts the server meanwhile, say). A step
with ``forget`` first empties vLLM's own prefix cache, so what the engine computed before must
come from the server again. ``policy`` is vLLM's ``kv_load_failure_policy`` (``fail`` by
default) and ``quarantine_s`` the adapter's ``kvstore_quarantine_s``. Prints one line,
``RESULT [{"tokens": [[...], ...], "cached": [...], "stored": N, "existed": N}, ...]``, a step each.

vLLM starts its engine core as a child process by spawning: hence the ``__main__`` guard.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any


def put_keys(addr: str, since: tuple[int, int] = (0, 0)) -> tuple[int, int]:
    """Keys the server has stored, and keys PUT again that it already had (since ``since``)."""
    from kvstore.client import KVClient

    with KVClient(addr) as kv:
        store = kv.stats()["store"]
    return store["stored"] - since[0], store["dedup"] - since[1]


def main() -> None:
    job = json.loads(sys.argv[1])
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kw: dict[str, Any] = {}
    if job.get("addr"):
        kw["kv_transfer_config"] = {
            "kv_connector": "KVStoreConnector", "kv_connector_module_path": "kvstore.integrations.vllm",
            "kv_load_failure_policy": job.get("policy", "fail"), "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "spec_name": "KVStoreOffloadingSpec", "spec_module_path": "kvstore.integrations.vllm",
                "block_size": job["chunk_tokens"], "kvstore_addr": job["addr"], "kvstore_namespace": job["namespace"],
                **({"kvstore_quarantine_s": job["quarantine_s"]} if "quarantine_s" in job else {})}}
    # (the CPU backend's attention takes GPU blocks of a multiple of 32 tokens)
    llm = LLM(model=job["model"], skip_tokenizer_init=True, enforce_eager=True, dtype="float32",
              max_model_len=1024, block_size=32, seed=0, tensor_parallel_size=job.get("tp", 1), **kw)
    results = []
    for i, step in enumerate(job["steps"]):
        if job.get("pause") and i:
            print(f"PAUSED {i}", flush=True)
            sys.stdin.readline()
        if step.get("forget"):
            assert llm.reset_prefix_cache()
        before = put_keys(job["addr"]) if step.get("put_keys") else (0, 0)
        extra = {"kv_transfer_params": {step["mark"]: True}} if step.get("mark") else None
        params = SamplingParams(temperature=0, max_tokens=step["max_tokens"], detokenize=False, extra_args=extra)
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in step["prompts"]], params, use_tqdm=False)
        stored = existed = 0
        if step.get("put_keys"):
            deadline = time.monotonic() + 60
            while stored + existed < step["put_keys"] and time.monotonic() < deadline:
                time.sleep(0.1)
                stored, existed = put_keys(job["addr"], before)
            time.sleep(1)  # (a PUT more than asked for would count too)
            stored, existed = put_keys(job["addr"], before)
        results.append({"tokens": [list(o.outputs[0].token_ids) for o in outs],
                        "cached": [o.num_cached_tokens for o in outs], "stored": stored, "existed": existed})
    print("RESULT " + json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
