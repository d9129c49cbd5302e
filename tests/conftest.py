"""Fixtures that start real processes on loopback and always stop them."""

from __future__ import annotations

from typing import Iterator

import pytest

from kvstore.server.process import ServerProcess


@pytest.fixture
def server() -> Iterator[ServerProcess]:
    """A real kvstore-server (64 MiB, LRU) on 127.0.0.1, any free port."""
    with ServerProcess("--capacity", "64MiB") as srv:
        yield srv


@pytest.fixture
def make_server() -> Iterator:
    """Start servers with custom flags: ``make_server("--capacity", "8MiB")``."""
    started: list[ServerProcess] = []

    def make(*args: str, env: dict[str, str] | None = None) -> ServerProcess:
        srv = ServerProcess(*args, env=env).start()
        started.append(srv)
        return srv

    yield make
    for srv in started:
        srv.stop()
