"""One vLLM engine, run as its own process by the tests: ``python engine.py JOB`` (JSON).

JOB: ``model`` (a local model directory), ``prompt`` (token ids), ``max_tokens``, and for an
engine with kvstore behind it ``addr``, ``namespace`` and ``mark`` (``do_remote_decode`` for a
P/D prefill, ``do_remote_prefill`` for its decode). ``wait_blocks``: stay until the namespace
holds that many blocks (vLLM answers before its stores reach the server). Prints one line,
``RESULT {"tokens": [...], "cached": N, "blocks": N}``.

vLLM starts its engine core as a child process by spawning: hence the ``__main__`` guard.
"""

from __future__ import annotations

import json
import sys
import time


def main() -> None:
    job = json.loads(sys.argv[1])
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kw = {}
    if job.get("addr"):
        kw["kv_transfer_config"] = {
            "kv_connector": "KVStoreConnector", "kv_connector_module_path": "kvstore.integrations.vllm",
            "kv_load_failure_policy": "fail", "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "spec_name": "KVStoreOffloadingSpec", "spec_module_path": "kvstore.integrations.vllm",
                "block_size": job["chunk_tokens"], "kvstore_addr": job["addr"], "kvstore_namespace": job["namespace"]}}
    # (the CPU backend's attention takes GPU blocks of a multiple of 32 tokens)
    llm = LLM(model=job["model"], skip_tokenizer_init=True, enforce_eager=True, dtype="float32",
              max_model_len=1024, block_size=32, seed=0, **kw)
    extra = {"kv_transfer_params": {job["mark"]: True}} if job.get("mark") else None
    params = SamplingParams(temperature=0, max_tokens=job["max_tokens"], detokenize=False, extra_args=extra)
    out = llm.generate([TokensPrompt(prompt_token_ids=job["prompt"])], params, use_tqdm=False)[0]
    blocks = 0
    if job.get("wait_blocks"):
        from kvstore.client import KVClient

        with KVClient(job["addr"]) as kv:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                blocks = kv.stats()["namespaces"].get(job["namespace"], {}).get("blocks", 0)
                if blocks >= job["wait_blocks"]:
                    break
                time.sleep(0.1)
    print("RESULT " + json.dumps({"tokens": list(out.outputs[0].token_ids), "cached": out.num_cached_tokens,
                                  "blocks": blocks}), flush=True)


if __name__ == "__main__":
    main()
