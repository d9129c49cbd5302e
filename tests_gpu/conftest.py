"""Fixtures for the GPU tests: a real kvstore server, clients over TCP and shared memory.

These tests move KV blocks between CUDA tensors and the store: pinned staging, the side
stream's order against the compute stream, several threads on one cache. No CI machine has
a GPU, so they live outside ``tests/`` and run on a machine that has one::

    python -m pytest tests_gpu -q

``KVSTORE_TEST_DEVICE=cpu`` runs them on CPU tensors instead, through the device route (a dry
run of their logic: the stream-order checks then have no streams to check).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest
import torch

from kvstore.client import KVClient
from kvstore.client.shm import ShmChannel
from kvstore.engine.transfer import PagedKVTransfer
from kvstore.server.process import ServerProcess

DEVICE = torch.device(os.environ.get("KVSTORE_TEST_DEVICE", "cuda"))
if DEVICE.type == "cuda" and not torch.cuda.is_available():  # a clear refusal, not a silently empty run
    raise pytest.UsageError("tests_gpu needs a CUDA GPU (torch.cuda.is_available() is False); "
                            "KVSTORE_TEST_DEVICE=cpu dry-runs them on CPU tensors")


@pytest.fixture(scope="session")
def device() -> torch.device:
    return DEVICE


@pytest.fixture(autouse=True)
def device_route_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """In a CPU dry run, caches take the route a GPU's do (payloads staged "on the device")."""
    if DEVICE.type == "cpu":
        init = PagedKVTransfer.__init__

        def staged(self: PagedKVTransfer, *args: object, **kwargs: object) -> None:
            init(self, *args, **kwargs)  # type: ignore[arg-type]
            self._staged = True

        monkeypatch.setattr(PagedKVTransfer, "__init__", staged)


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    """A real kvstore-server that offers its arena to same-host clients (shm needs ``--unix``)."""
    directory = tempfile.mkdtemp(prefix="kvs", dir="/tmp")  # (AF_UNIX paths: 107 bytes at most)
    try:
        with ServerProcess("--capacity", "1GiB", "--unix", f"{directory}/kv.sock") as srv:
            yield srv
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(params=["tcp", "shm"])
def client(request: pytest.FixtureRequest, server: ServerProcess,
           monkeypatch: pytest.MonkeyPatch) -> Iterator[KVClient]:
    """A client over the socket, or through the server's shared arena (puts of every size)."""
    shm = request.param == "shm"
    if shm:
        monkeypatch.setattr(ShmChannel, "inline_put_bytes", 0)
    before = server_shm(server)
    with KVClient(server.addr, shm=shm) as kv:
        yield kv
        after = server_shm(server)
    moved = after["puts"] + after["gets"] - before["puts"] - before["gets"]
    assert (moved > 0) == shm, f"{request.param} client: {moved} shared-memory puts and gets"


def server_shm(server: ServerProcess) -> dict[str, int]:
    with KVClient(server.addr, shm=False) as kv:
        return kv.stats()["shm"]  # type: ignore[no-any-return]
