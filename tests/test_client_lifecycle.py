"""A client through its servers' and its own lifecycle: a same-host server restarted without shared
memory, close() while calls are still connecting, arguments refused with typed errors, and a blocking
call interrupted (Ctrl-C) that must have ended when the interrupt is raised."""

from __future__ import annotations

import ast
import asyncio
import copy
import gc
import os
import pickle
import random
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from typing import Any, Callable

import pytest

from kvstore.client import AsyncKVClient, KVClient
from kvstore.errors import InvalidRequest, TransportError, Unavailable

from shm_helpers import MakeServer, arena_mappings, data, key, unix_path  # noqa: F401  (unix_path is a fixture)


async def idle_and_watched(kv: AsyncKVClient) -> None:
    """Until the server closed the client's connections for being idle and the client watches it."""
    for _ in range(100):
        if all(c.closed for c in kv.nodes[0].conns) and kv.nodes[0].probing:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the connections were not closed for being idle, or nothing watches the server")


async def test_a_server_restarted_without_shm_is_used_over_the_socket(make_server: MakeServer, unix_path: str) -> None:
    k = key(1, "no-shm-restart")
    gc.collect()  # (other tests' arenas and clients, not yet collected, would go during this one)
    mapped = arena_mappings()
    kv = AsyncKVClient(f"unix:{unix_path}", namespace="r")
    try:
        first = make_server("--capacity", "8MiB", "--unix", unix_path)
        await kv.put([k], [b"first"])
        old = kv.nodes[0].shm
        assert old is not None
        first.stop()
        make_server("--capacity", "8MiB", "--unix", unix_path, "--no-shm")
        await kv.put([k], [b"second"])  # "whenever the server does not offer it, the socket is used"
        assert [bytes(b) for b in await kv.get([k])] == [b"second"]
        assert kv.nodes[0].shm is None
        del old
        gc.collect()
        assert arena_mappings() == mapped  # the dead arena is unmapped
    finally:
        await kv.close()


async def test_an_idle_client_lets_go_of_a_stopped_servers_arena(make_server: MakeServer, unix_path: str) -> None:
    """A client kept a stopped server's arena mapped until its next call: restarting a server with
    clients attached took twice --capacity of the host's memory (the old arena lives while a process
    maps it; the new one is pre-faulted at start). A stopping server now says so as it closes."""
    gc.collect()  # (other tests' arenas and clients, not yet collected, would go during this one)
    mapped = arena_mappings()
    kv = AsyncKVClient(f"unix:{unix_path}", namespace="idle", pool_size=2)
    try:
        first = make_server("--capacity", "8MiB", "--unix", unix_path)
        await asyncio.gather(*(kv.put([key(i, "idle")], [b"x" * (3 << 20)]) for i in range(2)))  # (2 connections)
        assert kv.nodes[0].shm is not None and len(kv.nodes[0].conns) == 2
        assert arena_mappings() == mapped + 1
        first.stop()
        for _ in range(100):  # no call: the client only hears its connections close
            if kv.nodes[0].shm is None:
                break
            await asyncio.sleep(0.05)
        assert kv.nodes[0].shm is None
        gc.collect()
        assert arena_mappings() == mapped  # unmapped before any new server pre-faults its arena
        make_server("--capacity", "8MiB", "--unix", unix_path)
        await kv.put([key(3, "idle")], [b"y" * (3 << 20)])  # the next call attaches the new arena
        assert kv.nodes[0].shm is not None and arena_mappings() == mapped + 1
        assert [bytes(b) for b in await kv.get([key(3, "idle")])] == [b"y" * (3 << 20)]
    finally:
        await kv.close()


async def test_a_draining_servers_last_connection_leaves_the_new_servers_arena_mapped(
        make_server: MakeServer, unix_path: str) -> None:
    """A server restarted on the same path while one connection still drained on the old one: the
    client attached to the new arena, and the old connection's close must not take it away (a pool
    of live connections would never attach again: every call over the socket from then on)."""
    from shm_helpers import shm_locate, shm_release

    old = make_server("--capacity", "8MiB", "--unix", unix_path, "--drain-seconds", "20")
    async with AsyncKVClient(f"unix:{unix_path}", namespace="drain", pool_size=2) as kv:
        k = key(1, "drain")
        await kv.put([k], [b"x" * (3 << 20)])
        conn, fields = await shm_locate(kv, [k])  # pins held: the old server's drain waits for them
        old.proc.send_signal(signal.SIGTERM)
        for _ in range(100):
            if not os.path.exists(unix_path):  # (the old server has let go of the path)
                break
            await asyncio.sleep(0.05)
        new = make_server("--capacity", "8MiB", "--unix", unix_path)
        # (a call would still pick the old server's live connection: the pool opens one, as a call
        # finding its connections busy would)
        await kv.nodes[0]._open()  # a new connection: the new arena
        channel = kv.nodes[0].shm
        assert channel is not None and channel.segment.instance != conn.hello["shm"]["instance"]
        await shm_release(conn, fields["handle"])  # the old server's drain ends: it closes that connection
        assert old.proc.wait(10) == 0
        await asyncio.sleep(0.5)
        assert kv.nodes[0].shm is channel
        puts = (await kv.stats())["shm"]["puts"]
        await kv.put([key(3, "drain")], [b"z" * (3 << 20)])
        assert (await kv.stats())["shm"]["puts"] == puts + 1  # still through the new arena
        del new


async def test_a_killed_servers_arena_is_unmapped_without_waiting_for_the_garbage_collector(
        make_server: MakeServer, unix_path: str) -> None:
    """The client dropped its reference to a gone server's arena, but a failed call's traceback held
    the channel in reference cycles: the arena stayed mapped until a full collection."""
    from kvstore.errors import KVStoreError

    gc.collect()
    mapped = arena_mappings()
    srv = make_server("--capacity", "8MiB", "--unix", unix_path)
    async with AsyncKVClient(f"unix:{unix_path}", namespace="kill", retries=0) as kv:
        k = key(1, "kill")
        await kv.put([k], [b"x" * (3 << 20)])
        assert arena_mappings() == mapped + 1
        srv.proc.kill()
        srv.proc.wait(10)
        with pytest.raises(KVStoreError):
            await kv.get_into([k], [bytearray(3 << 20)])  # (fails: its traceback holds the channel)
        for _ in range(100):
            if arena_mappings() == mapped:
                break
            await asyncio.sleep(0.05)
        assert arena_mappings() == mapped and kv.nodes[0].shm is None


async def test_a_killed_servers_arena_is_unmapped_when_the_probe_finds_its_socket_answering_no_hello(
        make_server: MakeServer, unix_path: str) -> None:
    """Right after a SIGKILL the probe may still connect (the dead server's listener not yet closed)
    and its HELLO fail: the client kept the arena, and the failed probe's traceback held it in
    reference cycles (3 of 6 restarts in a review's run), beside the one the restarted server
    pre-faults. Now its socket file is watched: the file gone (a restarted server removes it first),
    or another server there, lets go."""
    gc.collect()
    mapped = arena_mappings()
    srv = make_server("--capacity", "8MiB", "--unix", unix_path)

    async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.close()  # connections taken and closed unanswered, as by a server dying

    dying = await asyncio.start_unix_server(hang_up, unix_path + ".dying")
    try:
        async with AsyncKVClient(f"unix:{unix_path}", namespace="dying", pool_size=1) as kv:
            await kv.put([key(1, "dying")], [b"x" * (3 << 20)])
            assert kv.nodes[0].shm is not None and arena_mappings() == mapped + 1
            os.rename(unix_path + ".dying", unix_path)  # (the server's socket file replaced by it)
            srv.proc.kill()
            srv.proc.wait(10)
            await asyncio.sleep(1.5)  # no call: the probe meets the stand-in, answering no HELLO
            assert kv.nodes[0].shm is not None  # (no proof the server is gone: watched)
            dying.close()
            os.unlink(unix_path)  # as a restarted server does before it pre-faults
            for _ in range(100):
                if kv.nodes[0].shm is None:
                    break
                await asyncio.sleep(0.05)
            assert kv.nodes[0].shm is None and arena_mappings() == mapped
    finally:
        dying.close()


async def test_a_chmod_of_a_live_servers_socket_keeps_an_idle_clients_arena(make_server: MakeServer,
                                                                            unix_path: str) -> None:
    """(the watch told a new file by its change time too, and a chmod changes it: the arena was
    unmapped and populated again at the next call)"""
    make_server("--capacity", "8MiB", "--unix", unix_path, "--idle-timeout", "0.5")
    async with AsyncKVClient(f"unix:{unix_path}", namespace="chmod") as kv:
        await kv.put([key(1, "chmod")], [b"x" * (3 << 20)])
        channel = kv.nodes[0].shm
        await idle_and_watched(kv)
        os.chmod(unix_path, 0o660)  # (the same mode: only its change time moves)
        await asyncio.sleep(2.5)  # (the watch looks about once a second)
        assert kv.nodes[0].shm is channel


async def when_room(call: Callable[[], Any]) -> Any:
    """``call()`` once a server at its connection limit has room (connections closing elsewhere)."""
    for _ in range(50):
        try:
            return await call()
        except Unavailable:
            await asyncio.sleep(0.1)
    return await call()


async def test_a_changed_socket_file_of_a_full_server_is_asked_once(make_server: MakeServer, unix_path: str) -> None:
    """A server at its connection limit refuses the watch's probe: asked again every second, each
    idle client counted two refused connections a second against it for as long as it stayed full."""
    import socket

    srv = make_server("--capacity", "8MiB", "--unix", unix_path, "--idle-timeout", "0.5", "--max-connections", "2",
                      "--metrics-port", "0")
    async with AsyncKVClient(f"unix:{unix_path}", namespace="full") as kv:
        await kv.put([key(1, "full")], [b"x" * (3 << 20)])
        channel = kv.nodes[0].shm
        await idle_and_watched(kv)
        await asyncio.sleep(1.0)  # (the probe after the idle close has run)
        holders = [AsyncKVClient(srv.addr, namespace="full", shm=False, pool_size=1) for _ in range(2)]
        for h in holders:
            await when_room(h.ping)

        async def keep_busy(h: AsyncKVClient) -> None:  # (not closed for being idle)
            while True:
                await h.ping()
                await asyncio.sleep(0.1)

        busy = [asyncio.ensure_future(keep_busy(h)) for h in holders]  # the server is full
        try:
            os.chmod(unix_path, 0o660)  # the socket file changed: the watch asks, and is refused
            await asyncio.sleep(4.0)
            assert kv.nodes[0].shm is channel  # (no proof the server is gone)
        finally:
            for task in busy:
                task.cancel()
            await asyncio.gather(*busy, return_exceptions=True)
            for h in holders:
                await h.close()
    from conftest import metrics_address

    with urllib.request.urlopen(metrics_address(srv) + "/metrics", timeout=5) as resp:
        rejected = re.search(r"^kvstore_connections_rejected_total (\S+)$", resp.read().decode(), re.M)
    assert rejected is not None and float(rejected.group(1)) <= 2  # one probe: its connect and its HELLO


async def test_a_stalled_server_keeps_its_arena_mapped(make_server: MakeServer, unix_path: str) -> None:
    """A stall is no proof the server is gone: the probe's HELLO timing out unmapped the arena of a
    server that came back, and the next call populated it all again."""
    from kvstore.errors import RequestTimeout

    srv = make_server("--capacity", "8MiB", "--unix", unix_path)
    async with AsyncKVClient(f"unix:{unix_path}", namespace="stall", timeout=1, connect_timeout=1,
                             pool_size=1) as kv:
        await kv.put([key(1, "stall")], [b"x" * (3 << 20)])
        channel = kv.nodes[0].shm
        assert channel is not None
        os.kill(srv.proc.pid, signal.SIGSTOP)
        try:
            with pytest.raises(RequestTimeout):
                await kv.exists([key(1, "stall")])  # its connection is discarded: the probe runs
            await asyncio.sleep(2.5)  # (its HELLO times out after connect_timeout)
        finally:
            os.kill(srv.proc.pid, signal.SIGCONT)
        assert kv.nodes[0].shm is channel


def test_a_forked_child_does_not_inherit_the_arena(make_server: MakeServer, unix_path: str) -> None:
    """A process forked after the attach (a worker pool) kept the arena mapped for its whole life, a
    restarted server's old arena with it."""
    make_server("--capacity", "8MiB", "--unix", unix_path)
    with KVClient(f"unix:{unix_path}", namespace="fork", shm=True) as kv:
        kv.put([key(1, "fork")], [b"x" * (3 << 20)])
        assert arena_mappings() >= 1
        pid = os.fork()
        if pid == 0:
            os._exit(0 if arena_mappings() == 0 else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0


def test_a_forked_child_closing_its_parents_async_client_keeps_its_own_arena(make_server: MakeServer,
                                                                              unix_path: str) -> None:
    """The child inherits the parent's arena as an object only (MADV_DONTFORK): its own client's
    arena was mapped at the same address, and closing the parent's client unmapped it there -- the
    child's next copy died of SIGSEGV."""
    make_server("--capacity", "64MiB", "--unix", unix_path)
    loop = asyncio.new_event_loop()
    parent = AsyncKVClient(f"unix:{unix_path}", namespace="fork")
    keys, blocks = [key(i, "forkshm") for i in range(4)], [bytes([i + 1]) * (1 << 20) for i in range(4)]
    try:
        loop.run_until_complete(parent.put(keys, blocks))
        assert parent.nodes[0].shm is not None
        pid = os.fork()
        if pid == 0:
            signal.signal(signal.SIGALRM, signal.SIG_DFL)
            signal.alarm(20)
            code = 3
            try:
                async def child() -> int:
                    own = AsyncKVClient(f"unix:{unix_path}", namespace="fork")
                    bufs = [bytearray(1 << 20) for _ in range(4)]
                    await own.get_into(keys, bufs)
                    assert own.nodes[0].shm is not None
                    await parent.close()
                    parent.nodes[0].shm = None  # (the last reference to the inherited copy)
                    gc.collect()
                    bufs = [bytearray(1 << 20) for _ in range(4)]
                    await own.get_into(keys, bufs)  # (SIGSEGV here: its arena was unmapped)
                    await own.close()
                    return 0 if bufs == blocks else 1
                code = asyncio.run(child())
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        bufs = [bytearray(1 << 20) for _ in range(4)]
        loop.run_until_complete(parent.get_into(keys, bufs))
        assert bufs == blocks
    finally:
        loop.run_until_complete(parent.close())
        loop.close()


async def test_an_idle_timeout_keeps_the_arena_mapped(make_server: MakeServer, unix_path: str) -> None:
    """Only a server that stops makes the client let go of its arena: after an idle timeout the
    server is still there, and attaching again would populate the whole mapping anew."""
    make_server("--capacity", "8MiB", "--unix", unix_path, "--idle-timeout", "0.5")
    async with AsyncKVClient(f"unix:{unix_path}", namespace="idle") as kv:
        await kv.put([key(1, "idle")], [b"x" * (3 << 20)])
        channel = kv.nodes[0].shm
        assert channel is not None
        for _ in range(100):
            if all(c.closed for c in kv.nodes[0].conns):
                break
            await asyncio.sleep(0.05)
        assert all(c.closed for c in kv.nodes[0].conns)  # closed for being idle
        assert kv.nodes[0].shm is channel
        await kv.put([key(2, "idle")], [b"y" * (3 << 20)])
        assert kv.nodes[0].shm is channel
    assert not kv.nodes[0].probing  # its own close asks the server nothing (a probe ran after it did)


async def test_a_client_idle_past_the_idle_timeout_still_lets_go_of_a_stopped_servers_arena(
        make_server: MakeServer, unix_path: str) -> None:
    """With its connections closed for being idle, a client had none left to lose when the server
    stopped, and held the arena until its next call (beside the one a restarted server pre-faults)."""
    gc.collect()
    mapped = arena_mappings()
    srv = make_server("--capacity", "8MiB", "--unix", unix_path, "--idle-timeout", "0.5")
    async with AsyncKVClient(f"unix:{unix_path}", namespace="idle") as kv:
        await kv.put([key(1, "idle")], [b"x" * (3 << 20)])
        channel = kv.nodes[0].shm
        await idle_and_watched(kv)
        await asyncio.sleep(0.5)  # (the probe: the server is still there)
        assert kv.nodes[0].shm is channel and arena_mappings() == mapped + 1
        assert srv.stop() == 0  # no connection of the client's sees it
        for _ in range(60):
            if arena_mappings() == mapped:
                break
            await asyncio.sleep(0.05)
        assert arena_mappings() == mapped and kv.nodes[0].shm is None  # (was: until the next call)


async def test_an_idle_client_lets_go_of_a_killed_servers_arena_as_the_restarted_server_starts(
        make_server: MakeServer, unix_path: str) -> None:
    """A SIGKILL leaves the socket file in place, so the idle client's watch sees nothing; the
    restarted server removes that file before it pre-faults its own arena, and the watch lets go."""
    gc.collect()
    mapped = arena_mappings()
    srv = make_server("--capacity", "8MiB", "--unix", unix_path, "--idle-timeout", "0.5")
    async with AsyncKVClient(f"unix:{unix_path}", namespace="idle") as kv:
        await kv.put([key(1, "idle")], [b"x" * (3 << 20)])
        await idle_and_watched(kv)
        srv.proc.kill()
        srv.proc.wait(10)
        await asyncio.sleep(1.5)  # (the watch: the dead server's file is still there)
        assert kv.nodes[0].shm is not None and arena_mappings() == mapped + 1
        make_server("--capacity", "8MiB", "--unix", unix_path)
        for _ in range(60):
            if arena_mappings() == mapped:
                break
            await asyncio.sleep(0.05)
        assert arena_mappings() == mapped and kv.nodes[0].shm is None
        await kv.put([key(2, "idle")], [b"y" * (3 << 20)])  # the next call attaches the new arena
        assert kv.nodes[0].shm is not None and arena_mappings() == mapped + 1


@pytest.mark.parametrize("op", ["put", "get_into"])
async def test_a_shm_call_made_while_its_server_restarts_is_retried(make_server: MakeServer, unix_path: str,
                                                                     op: str) -> None:
    """A same-host call whose first connect finds no server (it is restarting at the same path) is
    retried after the backoff, as a call over the socket is; it used to fail at once."""
    k = key(1, "shm-restart")
    block = data(k, 64 << 10)
    kv = AsyncKVClient(f"unix:{unix_path}", namespace="r", retries=1, backoff=1.0)
    try:
        first = make_server("--capacity", "8MiB", "--unix", unix_path)
        await kv.put([k], [block])
        old = kv.nodes[0].shm
        assert old is not None
        first.stop()
        for _ in range(100):  # (the client notices the closed connection on its loop's time)
            if all(c.closed for c in kv.nodes[0].conns):
                break
            await asyncio.sleep(0.05)
        buf = bytearray(len(block))
        call = asyncio.ensure_future(kv.put([k], [block]) if op == "put" else kv.get_into([k], [buf]))
        await asyncio.sleep(0.2)  # its first connect has failed: nothing listens at the path
        make_server("--capacity", "8MiB", "--unix", unix_path)  # (blocks this loop: the retry finds it up)
        outcome = await call
        node = kv.nodes[0]
        assert node.shm is not None and node.shm is not old  # the new server's arena, mapped
        if op == "put":
            assert outcome.stored == 1
            assert await kv.get_into([k], [buf]) == [True] and buf == block
        else:
            assert outcome == [False]  # (the new server starts empty)
    finally:
        await kv.close()


@pytest.mark.parametrize("transport", ["tcp", "shm"])
async def test_close_while_calls_connect_leaves_no_connection_and_no_mapping(
        make_server: MakeServer, unix_path: str, transport: str) -> None:
    """The server is stopped: one call waits for its reply, the others for the HELLO of new pool
    connections. close() must end all three, and nothing they opened may outlive it once the
    server answers again."""
    srv = make_server("--capacity", "8MiB", "--unix", unix_path)
    assert srv.proc is not None
    keys = [key(i, "closing") for i in range(3)]
    kv = AsyncKVClient(f"unix:{unix_path}" if transport == "shm" else srv.addr, namespace="c", pool_size=4)
    await kv.connect()
    await kv.put(keys, [b"x" * 1000] * 3)
    os.kill(srv.proc.pid, signal.SIGSTOP)
    try:
        calls = [asyncio.ensure_future(kv.exists(keys)) for _ in range(3)]
        await asyncio.sleep(0.3)  # all three are waiting on the stopped server by now
        await kv.close()
    finally:
        os.kill(srv.proc.pid, signal.SIGCONT)
    outcomes = await asyncio.gather(*calls, return_exceptions=True)
    assert all(isinstance(o, TransportError) and "client is closed" in str(o) for o in outcomes), outcomes
    assert kv.nodes[0].conns == [] and kv.nodes[0].shm is None
    async with AsyncKVClient(srv.addr, namespace="probe", pool_size=1) as probe:
        for _ in range(100):  # (the server notices closed connections on its own time)
            if (await probe.stats())["connections"] == 1:
                break
            await asyncio.sleep(0.05)
        assert (await probe.stats())["connections"] == 1  # the probe's own
    with pytest.raises(TransportError, match="client is closed"):
        await kv.exists(keys)


def test_arguments_of_the_wrong_kind_raise_invalid_request(make_server: MakeServer) -> None:
    srv = make_server("--capacity", "8MiB")
    keys = [key(1, "bad")]
    with KVClient(srv.addr, namespace="bad", pool_size=1) as kv:
        for call in (lambda: kv.put(keys, None), lambda: kv.exists(None), lambda: kv.get_into(keys, None)):
            with pytest.raises(InvalidRequest):
                call()
        assert kv.exists(keys) == [False]  # nothing left half-done
        # one key or block where a list goes (bytes would be taken apart into ints: "got int")
        for call, what in ((lambda: kv.put(keys[0], [b"x"]), "keys"), (lambda: kv.put(keys, b"x"), "blocks"),
                           (lambda: kv.lookup(keys[0]), "keys"), (lambda: kv.get_into(keys, bytearray(1)), "buffers")):
            with pytest.raises(InvalidRequest, match=f"{what} must be a sequence of them, not one"):
                call()
        with pytest.raises(InvalidRequest, match="buffers must be a sequence"):  # (was NotImplementedError)
            kv.get_into(keys, memoryview(bytearray(8)).cast("B", (2, 4)))
        # KVClient runs on uvloop, whose loop clock moves in whole milliseconds: ping() read 0.0
        assert all(kv.ping() > 0 for _ in range(5))
    for addr, settings in ((None, {}), (srv.addr, {"pool_size": "2"}), (srv.addr, {"timeout": -1}),
                           (srv.addr, {"timeout": 0}), (srv.addr, {"connect_timeout": float("nan")}),
                           (srv.addr, {"retries": -1}), (srv.addr, {"tls": 5}), (srv.addr, {"verify": "no"})):
        with pytest.raises(InvalidRequest):
            KVClient(addr, **settings)


@pytest.mark.parametrize("copy_it", [pickle.dumps, copy.copy, copy.deepcopy], ids=["pickle", "copy", "deepcopy"])
def test_a_client_is_not_pickled_or_copied_but_says_where_to_make_one(copy_it: Callable[[Any], Any]) -> None:
    """Handing a client to a worker process (multiprocessing pickles it) failed with uvloop's
    "no default __reduce__ due to non-trivial __cinit__"; an AsyncKVClient pickled, unusable."""
    blocking = KVClient("127.0.0.1:1")  # (neither connects before its first call)
    for client in (blocking, AsyncKVClient("127.0.0.1:1")):
        with pytest.raises(TypeError, match=rf"client \({type(client).__name__}\) cannot be pickled or copied: "
                                            "create one in each process that uses it"):
            copy_it(client)
    blocking.close()


def test_an_interrupted_blocking_call_has_ended_when_it_raises() -> None:
    """KVClient's promise: no reply lands in the caller's buffers after the interrupt is raised.
    A call that swallows the first cancel (as asyncio.wait_for around HELLO does on Python 3.11
    when the reply arrives in the same turn) must be cancelled again and waited for."""
    from kvstore.client.sync import _LoopThread

    buf = bytearray(4)

    async def call() -> None:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            pass  # swallowed
        await asyncio.sleep(0.2)  # e.g. a reply on its way
        buf[:] = b"late"

    signal.setitimer(signal.ITIMER_REAL, 0.2)
    old = signal.signal(signal.SIGALRM, signal.default_int_handler)  # a Ctrl-C, in effect
    try:
        with pytest.raises(KeyboardInterrupt):
            _LoopThread.get().run(call)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    time.sleep(0.5)  # longer than the call would take to write
    assert buf == bytearray(4)


@pytest.mark.parametrize("again", [False, True], ids=["interrupted once", "clean-up interrupted too"])
def test_a_call_that_succeeded_as_its_caller_was_interrupted_hands_its_result_to_the_orphan(again: bool) -> None:
    """(sync client review) The interrupt comes in once the loop thread lets go of the GIL, mostly after
    the reply was handled: the call had succeeded, and what it handed over (a pinned lookup's leases)
    was dropped with its result. (Second fix review) Only the caller's clean-up, after it had waited
    the call out, handed the result over: a second interrupt during that wait skipped it. The loop
    thread hands it over now, as the abandoned call ends."""
    from kvstore.client.sync import _LoopThread

    runner, orphaned, interrupts = _LoopThread.get(), [], []

    async def call() -> int:
        time.sleep(0.4)  # (the loop thread busy, the GIL let go: the caller's wait is interrupted meanwhile)
        return 7

    def handler(signum: int, frame: Any) -> None:
        if not _in_client(frame):
            return  # (back in this test, or in the interpreter's own callbacks: nothing of the client's)
        interrupts.append(signum)
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, 0.1, 0.05 if again else 0)  # (again: every 50 ms from 0.1 s on)
    try:
        with pytest.raises(KeyboardInterrupt):
            runner.run(call, orphan=orphaned.append)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert len(interrupts) >= (2 if again else 1)  # (the wait, and the clean-up's wait-out)
    for _ in range(50):
        if orphaned:
            break
        time.sleep(0.02)
    assert orphaned == [7]


def _in_client(frame: Any) -> bool:
    """Whether a signal handler was called in the client's code (a handler raising in an interpreter
    callback, a WeakSet's, is an "Exception ignored" that pytest fails the test for)."""
    import kvstore.client

    return frame is not None and frame.f_code.co_filename.startswith(os.path.dirname(kvstore.client.__file__))


_INTERRUPTED_CALLS = """
import random, signal, sys
from kvstore.client import KVClient

class Interrupt(Exception):
    pass

def handler(signum, frame):
    raise Interrupt()

signal.signal(signal.SIGALRM, handler)
rng, seen = random.Random(0), {}
with KVClient(sys.argv[1], namespace="i") as kv:
    keys = [bytes([i]) * 16 for i in range(4)]
    kv.put(keys, [b"x" * 1024] * 4)
    for _ in range(3000):
        try:
            try:
                signal.setitimer(signal.ITIMER_REAL, rng.uniform(1e-5, 3e-4))
                kv.exists(keys)
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            outcome = "answered"
        except Exception as exc:
            outcome = type(exc).__name__
        seen[outcome] = seen.get(outcome, 0) + 1
    print(sorted(seen.items()))
    print(kv.exists(keys))
"""


def test_blocking_calls_interrupted_at_random_never_hang_the_loop_thread(make_server: MakeServer) -> None:
    """(fix review) KVClient waited on a concurrent.futures.Future: a signal handler raising while the
    caller held the future's lock left it held, the loop thread blocked on it as it settled the
    call, and every KVClient of the process hung (within 600-2,300 interrupted calls); others raised
    "RuntimeError: cannot release un-acquired lock" instead of the caller's own exception. And a
    coroutine made in the caller's thread, then interrupted, warned "never awaited"."""
    srv = make_server("--capacity", "8MiB", "--busy-poll-us", "0")
    done = subprocess.run([sys.executable, "-c", _INTERRUPTED_CALLS, srv.addr], capture_output=True, text=True,
                          timeout=90)
    assert done.returncode == 0, done.stderr[-2000:]
    counts, found = done.stdout.splitlines()[-2:]
    seen = dict(ast.literal_eval(counts))
    assert set(seen) <= {"answered", "Interrupt"} and seen.get("Interrupt"), seen
    assert found == "[True, True, True, True]"  # (the client still answers)
    assert "never awaited" not in done.stderr  # (a coroutine made before an interrupt, then dropped)


def test_a_blocking_pinned_lookup_interrupted_leaves_no_leases(make_server: MakeServer) -> None:
    """(sync client review) A KVClient.lookup(pin=True) interrupted by a signal handler that raises left
    its leases whenever its reply had come in (about half the interrupts), pinned for their time.
    (mutation review) And it gives back only the prefix it leased: an UNPIN drops a lease whoever
    holds it, so one of a block past the chain's gap would be another client's (a mutant did so)."""
    srv = make_server("--capacity", "16MiB", "--busy-poll-us", "0")
    keys = [key(i, "interrupted-pin") for i in range(64)]
    after_gap = key(65, "interrupted-pin")  # (key 64 is never stored)
    chain = [*keys, key(64, "interrupted-pin"), after_gap]

    class Interrupt(Exception):
        pass

    def handler(signum: int, frame: Any) -> None:
        if not _in_client(frame):
            return  # (the lookup had returned to this test, or a weakref callback runs: no interrupt of the client)
        raise Interrupt()

    old = signal.signal(signal.SIGALRM, handler)
    rnd, interrupted = random.Random(0), 0
    try:
        with KVClient(srv.addr, namespace="i") as kv, KVClient(srv.addr, namespace="i") as other:
            kv.put(keys, [b"x" * 4096] * 64)
            kv.put([after_gap], [b"x" * 4096])
            assert other.lookup([after_gap], pin=True, lease_ms=600_000) == 1  # another client's lease
            for i in range(60):
                signal.setitimer(signal.ITIMER_REAL, rnd.uniform(0.00005, 0.002))
                try:
                    try:  # (keys given as an iterator too: what is given back is named by key)
                        n = kv.lookup(iter(chain) if i % 2 else chain, pin=True, lease_ms=600_000)
                    finally:
                        signal.setitimer(signal.ITIMER_REAL, 0)
                except Interrupt:
                    interrupted += 1
                    continue
                assert n == 64 and kv.unpin(keys) == 64
            leases = -1
            for _ in range(50):  # (given back in the background)
                leases = kv.stats()["store"]["leases"]
                if leases <= 1:
                    break
                time.sleep(0.1)
            time.sleep(0.2)  # (a give-back past the gap would come with the others)
            leases = kv.stats()["store"]["leases"]
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert interrupted and leases == 1, (interrupted, leases)  # the other client's, past the gap


def test_an_async_client_used_in_a_forked_child_raises_there_and_the_parent_keeps_its_connections() -> None:
    """A forked child's copy of an AsyncKVClient shares the parent's sockets: a request from it went out
    on the parent's connection with the parent's next request id, and the parent could take the child's
    reply (another key's block, its checksum valid) for its own. The child gets a TransportError now,
    and its close() touches nothing of the parent's."""
    from kvstore.server.process import ServerProcess

    with ServerProcess("--capacity", "16MiB") as srv:
        loop = asyncio.new_event_loop()
        kv = AsyncKVClient(srv.addr, namespace="fork", pool_size=1)
        try:
            keys = [key(i, "fork") for i in range(2)]
            loop.run_until_complete(kv.put(keys, [b"A" * 4096, b"B" * 4096]))
            (conn,) = kv.nodes[0].conns
            pid = os.fork()
            if pid == 0:  # the child: a loop of its own, the inherited client
                signal.signal(signal.SIGALRM, signal.SIG_DFL)  # (pytest-timeout's handler would not end a hung child)
                signal.alarm(20)
                code = 3
                try:
                    async def child() -> int:
                        try:
                            await kv.get([keys[1]])
                            return 1
                        except TransportError as exc:
                            await kv.close()  # (must not close the parent's sockets)
                            return 0 if "fork" in str(exc) else 2
                    code = asyncio.run(child())
                finally:
                    os._exit(code)
            _, status = os.waitpid(pid, 0)
            assert os.waitstatus_to_exitcode(status) == 0
            buf = bytearray(4096)
            assert loop.run_until_complete(kv.get_into([keys[0]], [buf])) == [True] and buf == b"A" * 4096
            assert kv.nodes[0].conns == [conn] and not conn.closed  # the child did not touch it
        finally:
            loop.run_until_complete(kv.close())
            loop.close()


def test_a_kvclient_closed_in_a_forked_child_leaves_the_parents_client_working() -> None:
    """In a forked child a KVClient's calls raise TransportError, and close() (a ``with`` block's end)
    raised it too; it now lets the parent's client be, as AsyncKVClient.close() does. Its
    ``closed`` read False there (it reads True: nothing of it works in the child)."""
    from kvstore.server.process import ServerProcess

    with ServerProcess("--capacity", "16MiB") as srv, KVClient(srv.addr, namespace="fork", pool_size=1) as kv:
        kv.put([key(1, "fork")], [b"P" * 4096])
        pid = os.fork()
        if pid == 0:
            signal.signal(signal.SIGALRM, signal.SIG_DFL)  # (pytest-timeout's handler would not end a hung child)
            signal.alarm(20)
            code = 3
            try:
                if not kv.closed:
                    os._exit(4)
                try:
                    kv.exists([key(1, "fork")])
                    code = 1
                except TransportError as exc:
                    kv.close()
                    kv.close()
                    code = 0 if "fork" in str(exc) else 2
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert not kv.closed and kv.get([key(1, "fork")]) == [bytearray(b"P" * 4096)]


def test_a_child_forked_while_another_thread_makes_a_kvclient_can_make_its_own() -> None:
    """The child of a fork taken while another thread held the lock that guards the clients' loop
    thread (making the first KVClient), or the one guarding the helper threads (a large batch),
    found it held for good: its first KVClient, or its first large put, hung."""
    from kvstore.client.sync import _LoopThread
    from kvstore.client.workers import _Pool
    from kvstore.server.process import ServerProcess

    with ServerProcess("--capacity", "16MiB") as srv:
        with _LoopThread._lock, _Pool._lock:  # (as other threads would, for a moment)
            pid = os.fork()
            if pid == 0:
                signal.signal(signal.SIGALRM, signal.SIG_DFL)  # (pytest-timeout's handler would not end a hung child)
                signal.alarm(20)  # (hung: killed, and the parent sees it)
                code = 3
                try:
                    with KVClient(srv.addr, namespace="fork", pool_size=1) as kv:
                        blocks = [bytes([i]) * (1 << 20) for i in range(4)]  # 4 MiB: hashed on the helpers
                        kv.put([key(i, "fork-big") for i in range(4)], blocks)
                        code = 0 if kv.ping() > 0 else 1
                finally:
                    os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0


# (the first asyncio.run closes its loop with the client's connection open: asyncio warns of it when
# the forgotten transport is collected, as it should)
@pytest.mark.filterwarnings("ignore::ResourceWarning", "ignore::pytest.PytestUnraisableExceptionWarning")
def test_an_async_client_used_from_another_event_loop_says_so_at_once() -> None:
    """Its connections belong to the loop it first ran on: a call from another loop (an
    ``asyncio.run`` per call) waited out the timeout and raised RequestTimeout, though the server had
    answered. It raises a TransportError that says why, at once; close() lets it start over."""
    from kvstore.server.process import ServerProcess

    with ServerProcess("--capacity", "16MiB") as srv:
        kv = AsyncKVClient(srv.addr, namespace="loops", timeout=20)
        asyncio.run(kv.put([key(1, "loops")], [b"x" * 100]))
        t0 = time.monotonic()
        with pytest.raises(TransportError, match="event loop"):
            asyncio.run(kv.exists([key(1, "loops")]))
        assert time.monotonic() - t0 < 5

        async def again() -> list[bool]:
            await kv.close()
            await kv.connect()
            try:
                return await kv.exists([key(1, "loops")])
            finally:
                await kv.close()

        assert asyncio.run(again()) == [True]
        gc.collect()  # (the first loop's transport: its warning is this test's)


def _run_child(script: str, timeout: float = 30) -> str:
    """Run ``script`` in a fresh interpreter; its output, or a failure if it has not exited by ``timeout``."""
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
    try:
        out, _ = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        child.kill()
        out, _ = child.communicate()
        pytest.fail(f"the child hung ({timeout} s); its output:\n{out}")
    assert child.returncode == 0, out
    return out


def test_a_kvclient_closed_by_a_del_at_interpreter_exit_lets_the_process_exit() -> None:
    """An engine's wrapper that closes its client in ``__del__``, still alive when the script ends:
    the close ran while the interpreter shut down, waited for the loop thread, which no longer runs,
    and the process never exited."""
    from kvstore.server.process import ServerProcess

    with ServerProcess("--capacity", "16MiB") as srv:
        out = _run_child(f"""
from kvstore.client import KVClient
from kvstore.errors import TransportError

class Connector:
    def __init__(self):
        self.kv = KVClient({srv.addr!r}, namespace="exit")
        self.kv.ping()
    def __del__(self):
        self.kv.close()
        try:
            self.kv.ping()
        except TransportError as exc:
            print("ping:", exc, flush=True)
        print("closed", flush=True)

connector = Connector()
""")
    assert "ping: a KVClient call cannot wait here: the interpreter is shutting down" in out and "closed" in out


def test_a_kvclient_closed_on_the_clients_loop_thread_does_not_stop_every_client() -> None:
    """The cycle collector runs a ``__del__`` on whichever thread allocates at the time, often the
    clients' loop thread: a close() there waited for that thread itself, and every KVClient of the
    process hung with it. It now starts the close without waiting; another call raises."""
    from kvstore.server.process import ServerProcess

    with ServerProcess("--capacity", "16MiB") as srv:
        out = _run_child(f"""
import threading
from kvstore.client import KVClient
from kvstore.client.sync import _LoopThread
from kvstore.errors import TransportError

dropped, other = KVClient({srv.addr!r}, namespace="a"), KVClient({srv.addr!r}, namespace="b")
dropped.ping()
done = threading.Event()

def on_loop_thread():  # what a __del__ run there by the garbage collector does
    try:
        dropped.ping()
    except TransportError as exc:
        print("ping:", exc, flush=True)
    dropped.close()
    done.set()

_LoopThread.get().loop.call_soon_threadsafe(on_loop_thread)
assert done.wait(10), "the loop thread is stuck"
other.put([b"k" * 16], [b"v" * 100])
assert other.get([b"k" * 16]) == [bytearray(b"v" * 100)]
other.close()
print("ok", flush=True)
""")
    assert "ping: a KVClient call cannot wait here: this is the clients' own event-loop thread" in out
    assert out.rstrip().endswith("ok")


async def test_a_call_from_another_event_loop_is_refused_at_once_and_not_held_against_the_server(
        make_server: MakeServer) -> None:
    """It was retried (with backoff), then counted as the server failing: with a quarantine, the
    client's own loop found a healthy server "not asked for 5.0s more"."""
    srv = make_server("--capacity", "8MiB")
    async with AsyncKVClient(srv.addr, namespace="loops", quarantine=5.0, retries=2, backoff=1.0) as kv:
        await kv.ping()
        with pytest.raises(TransportError, match="belong to the event loop it first ran on"):
            await asyncio.to_thread(asyncio.run, kv.ping())  # (backoff 1.0: retried, it took 3 s)
        assert kv.nodes[0].down_error is None
        await kv.ping()


async def test_a_call_from_another_loop_over_servers_not_yet_used_raises_and_takes_none_of_them(
        make_server: MakeServer) -> None:
    """Each server kept its own home: a call from another loop adopted the servers the client had
    not used yet, answered from those alone (a lookup of 0 of 8, a warning), and the client's own
    loop had lost them until close()."""
    servers = [make_server("--capacity", "8MiB") for _ in range(2)]
    keys = [key(i, "homes") for i in range(8)]
    async with AsyncKVClient([s.addr for s in servers], namespace="homes") as setup:
        await setup.put(keys, [b"v" * 1000] * 8)
    kv = AsyncKVClient([s.addr for s in servers], namespace="homes")  # (no connect(): used lazily)
    try:
        first = [k for k in keys if kv.ring.node_of(k) == 0][:1]
        assert await kv.lookup(first) == 1  # (server 0 only)
        for call in (lambda: kv.lookup(keys), lambda: kv.exists(keys), kv.stats):
            with pytest.raises(TransportError, match="belong to the event loop it first ran on"):
                await asyncio.to_thread(asyncio.run, call())
        assert await kv.lookup(keys) == 8 and all(b is not None for b in await kv.get(keys))
    finally:
        await kv.close()


async def test_connect_from_another_loop_and_close_overlapping_connect_keep_the_clients_home(
        make_server: MakeServer) -> None:
    """connect() from another loop dropped the own loop's connections unclosed (a warning per server
    first); and close() overlapping connect() on the own loop left live connections with no home,
    which another loop then took (its lookup went out on the first loop's socket)."""
    servers = [make_server("--capacity", "8MiB") for _ in range(2)]
    keys = [key(i, "home2") for i in range(8)]
    async with AsyncKVClient([s.addr for s in servers], namespace="home2") as kv:
        await kv.put(keys, [b"v" * 100] * 8)
        conns = [list(n.conns) for n in kv.nodes]
        with pytest.raises(TransportError, match="belong to the event loop it first ran on"):
            await asyncio.to_thread(asyncio.run, kv.connect())
        assert [list(n.conns) for n in kv.nodes] == conns and not any(c.closed for cs in conns for c in cs)
        await asyncio.gather(kv.close(), kv.connect())
        with pytest.raises(TransportError, match="belong to the event loop it first ran on"):
            await asyncio.to_thread(asyncio.run, kv.lookup(keys))
        assert await kv.lookup(keys) == 8


def test_a_failed_connect_leaves_the_client_free_for_another_loop() -> None:
    """connect() claimed the client for its loop and kept it when it failed: nothing was open, yet
    the next asyncio.run (or a forked child) was refused with NotHome instead of trying again."""
    import socket as socket_module

    with socket_module.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    kv = AsyncKVClient(f"127.0.0.1:{port}", retries=0, connect_timeout=2)
    for _ in range(2):
        with pytest.raises(TransportError, match="cannot connect"):
            asyncio.run(kv.connect())
    assert kv.home is None


def test_a_client_closed_is_used_again_from_another_loop_with_its_arena_opened_concurrently(
        make_server: MakeServer, unix_path: str) -> None:
    """(the attach lock, made once per server, was bound to the first loop that waited on it: the
    second asyncio.run failed with a RuntimeError, not even a KVStoreError)"""
    make_server("--capacity", "8MiB", "--unix", unix_path)
    kv = AsyncKVClient(f"unix:{unix_path}", pool_size=4, namespace="relock")
    keys = [key(i, "relock") for i in range(4)]

    async def run() -> list[int]:
        try:
            results = await asyncio.gather(kv.connect(), *(kv.lookup(keys) for _ in range(3)))
            assert kv.nodes[0].shm is not None
            return results[1:]
        finally:
            await kv.close()

    assert asyncio.run(run()) == [0, 0, 0]
    assert asyncio.run(run()) == [0, 0, 0]


def test_close_from_another_loop_while_the_first_still_runs_is_refused(make_server: MakeServer) -> None:
    """It forgot the running loop's connections unclosed (their sockets stayed open for good) and
    freed the client for the caller's loop."""
    import threading

    srv = make_server("--capacity", "8MiB")
    home = asyncio.new_event_loop()
    thread = threading.Thread(target=home.run_forever, daemon=True)
    thread.start()
    try:
        kv = asyncio.run_coroutine_threadsafe(_made(srv.addr), home).result(10)
        assert asyncio.run_coroutine_threadsafe(kv.lookup([key(1, "fc")]), home).result(10) == 0
        with pytest.raises(TransportError, match="which is not closed: close the client there"):
            asyncio.run(kv.close())
        assert asyncio.run_coroutine_threadsafe(kv.lookup([key(1, "fc")]), home).result(10) == 0
        (conn,) = kv.nodes[0].conns
        asyncio.run_coroutine_threadsafe(kv.close(), home).result(10)
        assert conn.closed and kv.home is None
    finally:
        home.call_soon_threadsafe(home.stop)
        thread.join(10)
        home.close()


async def _made(addr: str) -> AsyncKVClient:
    return AsyncKVClient(addr, namespace="fc")


async def test_a_connect_that_fails_leaves_the_connections_calls_opened_before_it(make_server: MakeServer) -> None:
    """connect() closed every server's connections when it failed, those its calls had opened on a
    healthy server too: calls in flight there failed with 'the client is closed' (and were held
    against that server), and the client's home was let go of for another loop to take."""
    srv = make_server("--capacity", "8MiB")
    with socket.socket() as silent:  # accepts (in the kernel), never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        kv = AsyncKVClient([srv.addr, f"127.0.0.1:{silent.getsockname()[1]}"], namespace="cin", quarantine=5.0)
        try:
            ours = [k for k in (key(i, "cin") for i in range(64)) if kv.ring.node_of(k) == 0][:4]
            await kv.put(ours, [b"v" * 100] * 4)
            conns = list(kv.nodes[0].conns)
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(kv.connect(), 0.3)
            assert kv.nodes[0].conns == conns and not any(c.closed for c in conns)
            with pytest.raises(TransportError, match="belong to the event loop it first ran on"):
                await asyncio.to_thread(asyncio.run, kv.lookup(ours))
            assert await kv.lookup(ours) == 4 and kv.nodes[0].down_error is None
        finally:
            await kv.close()


def test_close_from_another_loop_while_the_first_is_stopped_but_not_closed_is_refused(make_server: MakeServer) -> None:
    """(a loop.run_until_complete program: the first loop still holds the sockets, and closing the
    client elsewhere forgot them unclosed)"""
    srv = make_server("--capacity", "8MiB")
    home = asyncio.new_event_loop()
    try:
        kv = home.run_until_complete(_made(srv.addr))
        assert home.run_until_complete(kv.lookup([key(1, "stopped")])) == 0
        with pytest.raises(TransportError, match="which is not closed: close the client there"):
            asyncio.run(kv.close())
        (conn,) = kv.nodes[0].conns
        home.run_until_complete(kv.close())
        assert conn.closed and kv.home is None
    finally:
        home.close()
