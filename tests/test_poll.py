"""Busy polling (server/poll.py): the loop polls after requests, and an idle server sleeps again."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from kvstore.client import AsyncKVClient
from kvstore.server.poll import BusyPoll


async def test_a_kick_keeps_the_loop_polling_until_the_window_closes() -> None:
    poll = BusyPoll(0.02)
    poll.kick()
    assert poll.spinning
    turns = []
    for _ in range(3):  # other work still runs while the loop polls
        await asyncio.sleep(0)
        turns.append(poll.turns)
    assert turns == sorted(turns) and turns[-1] > turns[0]
    await asyncio.sleep(0.1)  # past the window: polling has stopped
    assert not poll.spinning
    polled = poll.seconds
    assert polled > 0.01  # it polled for about the window (20 ms)
    stopped_at = poll.turns
    await asyncio.sleep(0.05)
    assert poll.turns == stopped_at and poll.seconds == polled  # nothing polls an idle loop
    poll.kick()  # and a new read starts it again
    assert poll.spinning
    await asyncio.sleep(0.1)
    assert poll.turns > stopped_at and not poll.spinning


async def test_time_spent_serving_requests_is_not_counted_as_polling() -> None:
    poll = BusyPoll(0.01)
    poll.kick()
    for _ in range(200):  # a request between every two turns: the loop never waits for one
        await asyncio.sleep(0)
        poll.kick()
    assert poll.spinning and poll.seconds == 0.0
    await asyncio.sleep(0.05)  # no more requests: the window's 10 ms are idle polling
    assert not poll.spinning and poll.seconds > 0.005


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.parametrize("flags", [(), ("--busy-poll-us", "0"), ("--busy-poll-us", "5000")])
async def test_a_server_serves_with_any_window_and_sleeps_once_traffic_stops(make_server, flags) -> None:
    srv = make_server("--capacity", "8MiB", *flags)
    async with AsyncKVClient(srv.addr) as c:
        for i in range(200):
            key = i.to_bytes(32, "big")
            assert (await c.put([key], [bytes([i % 256]) * 4096])).stored == 1
            assert await c.get([key]) == [bytes([i % 256]) * 4096]
        await asyncio.sleep(0.2)  # longer than any window above
        assert srv.proc is not None
        before = _cpu_seconds(srv.proc.pid)
        time.sleep(1.0)
        used = _cpu_seconds(srv.proc.pid) - before
        polled = (await c.stats())["busy_poll"]
    window = int(flags[1]) if flags else 200
    assert polled["window_us"] == window
    assert (polled["turns"] > 0) == (window > 0)  # it polled after requests (or never, window 0)
    # (What polling cost, "seconds", counts only turns that found nothing to do, and each turn yields
    # the core first: a window that a busy core takes whole counts none. The unit tests above check it.)
    if not window:
        assert polled["seconds"] == 0
    # A server still polling would have used the whole second; a sleeping one uses ~nothing.
    assert used < 0.5, f"the server used {used:.2f} s of CPU in 1 s without requests"


async def test_the_server_polls_between_requests_not_while_a_payload_arrives() -> None:
    from kvstore.config import ServerConfig
    from kvstore.server.app import Server

    server = Server(ServerConfig(port=0, capacity=64 << 20, log_level="warning"))
    await server.start()
    try:
        assert server.poll is not None  # on by default
        kicks: list[bool] = []
        real_kick = server.poll.kick
        server.poll.kick = lambda: (kicks.append(True), real_kick())[1]  # type: ignore[method-assign]
        async with AsyncKVClient(f"127.0.0.1:{server.port}", pool_size=1) as c:
            await c.ping()
            small = len(kicks)
            assert small >= 1  # a small request is followed by polling
            blocks = [bytes([i]) * (4 << 20) for i in range(4)]  # 16 MiB: arrives in many reads
            assert (await c.put([bytes([i]) * 32 for i in range(4)], blocks)).stored == 4
            put_kicks = len(kicks) - small
            received = [conn.received for conn in server.connections]
        assert sum(received) > 16 << 20
        assert put_kicks == 1, f"{put_kicks} kicks for one PUT (polling while its payload arrived)"
    finally:
        await server.shutdown()


async def test_a_tls_server_polls_between_requests_too(make_server, tls_files) -> None:
    # Over TLS every reply pauses writing for a moment (the write-buffer limit is 0): the connection
    # starts the window once the reply is out, not right after parsing the request.
    srv = make_server("--capacity", "8MiB", "--tls-cert", str(tls_files["cert"]), "--tls-key", str(tls_files["key"]))
    async with AsyncKVClient(srv.addr, tls=str(tls_files["ca"]), pool_size=1) as c:
        for _ in range(50):
            await c.ping()
        polled = (await c.stats())["busy_poll"]["turns"]
    assert polled > 0, "the server never polled after a TLS request"
