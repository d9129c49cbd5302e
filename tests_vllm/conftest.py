"""Fixtures for the vLLM adapter tests: a real kvstore server, a model directory, engines.

These tests need vLLM 0.33 (``scripts/install-vllm.sh`` builds ``.venv-vllm``) and run on
CPU: vLLM's scheduler and OffloadingConnector are pure Python, and the "GPU" KV cache
is a set of CPU tensors. They live outside ``tests/`` so the default suite never
imports vLLM. Run them with::

    .venv-vllm/bin/python -m pytest tests_vllm -q
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

# Before vLLM is imported: no hub access (the model is a local config.json), quiet logs.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import pytest  # noqa: E402

try:
    import vllm  # noqa: F401
except ImportError:  # a clear refusal, not a silently empty run
    raise pytest.UsageError(
        "tests_vllm needs vLLM 0.33: run scripts/install-vllm.sh, then .venv-vllm/bin/python -m pytest tests_vllm"
    ) from None

from kvstore.server.process import ServerProcess  # noqa: E402
from vllm_harness import Engine, kvstore_extra_config, write_model_dir  # noqa: E402


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A local OPT-125m config (no weights): what vLLM's ModelConfig needs."""
    return write_model_dir(tmp_path_factory.mktemp("models") / "opt-125m")


@pytest.fixture
def kvstore_server() -> Iterator[ServerProcess]:
    """A real kvstore-server on 127.0.0.1 (any free port), stopped after the test."""
    with ServerProcess("--capacity", "64MiB") as srv:
        yield srv


@pytest.fixture
def make_server() -> Iterator[Callable[..., ServerProcess]]:
    """Start servers with custom flags; all are stopped after the test."""
    started: list[ServerProcess] = []

    def make(*args: str) -> ServerProcess:
        srv = ServerProcess(*args).start()
        started.append(srv)
        return srv

    yield make
    for srv in started:
        srv.stop()


@pytest.fixture
def make_engine(model_dir: Path, request: pytest.FixtureRequest) -> Iterator[Callable[..., Engine]]:
    """``make_engine(addr, async_scheduling=..., namespace=..., tensor_parallel_size=..., **extra)``: a
    stepped vLLM engine whose OffloadingConnector uses kvstore at ``addr``; shut down after the test.
    """
    engines: list[Engine] = []

    def make(addr: str, *, async_scheduling: bool = False, namespace: str | None = None,
             offloaded_block_size: int = 12, gpu_block_size: int = 4, num_gpu_blocks: int = 100,
             sliding_window: int | None = None, hybrid: bool = False, load_failure_policy: str | None = None,
             tensor_parallel_size: int = 1, **extra: Any) -> Engine:
        ns = namespace or f"test/{request.node.name}"
        engine = Engine(model_dir, kvstore_extra_config(addr, ns, offloaded_block_size, **extra),
                        gpu_block_size=gpu_block_size, num_gpu_blocks=num_gpu_blocks,
                        async_scheduling=async_scheduling, sliding_window=sliding_window, hybrid=hybrid,
                        load_failure_policy=load_failure_policy, tensor_parallel_size=tensor_parallel_size)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.shutdown()
