"""The Unix domain socket listener (--unix / KVSTORE_UNIX) as a transport of its own, without shm."""

from __future__ import annotations

import os
import signal
import socket
import stat
import subprocess
import sys
import termios
import time
from fcntl import ioctl

import pytest

from kvstore.client import AsyncKVClient, KVClient
from kvstore.errors import InvalidRequest, TransportError
from kvstore.protocol import Frame, FrameReader, Get, Hello, ShmAttach, encode
from kvstore.server.process import ServerProcess
from kvstore.sockets import UNIX_SNDBUF

from shm_helpers import (  # noqa: F401  (unix_path is a fixture)
    MakeServer, assert_attach_maps, data, error_code, key, reply_fields, unix_path,
)

SIZES = [1, 4095, 64 << 10, (1 << 20) + 3]


async def test_unix_round_trip_without_shm(make_server: MakeServer, unix_path: str) -> None:
    srv = make_server("--capacity", "32MiB", "--unix", unix_path, "--no-shm")
    st = os.stat(unix_path)
    assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o660
    keys = [key(i, "unix") for i in range(len(SIZES))]
    blocks = [data(k, n) for k, n in zip(keys, SIZES)]
    async with AsyncKVClient(f"unix:{unix_path}", namespace="u") as kv:
        assert kv.nodes[0].shm is None  # --no-shm: the socket carries the payload
        assert (await kv.put(keys, blocks)).stored == len(keys)
        assert await kv.lookup(keys) == len(keys)
        assert [bytes(b) for b in await kv.get(keys)] == blocks
        bufs = [bytearray(n) for n in SIZES]
        assert await kv.get_into(keys, bufs) == [True] * len(keys)
        assert bufs == blocks
        stats = await kv.stats()
    assert stats["shm"]["offered"] is False and stats["shm"]["gets"] == 0
    assert stats["bytes_in"] > sum(SIZES)  # the payload crossed the socket
    async with AsyncKVClient(srv.addr, namespace="u") as tcp:  # the same store, seen over TCP
        assert [bytes(b) for b in await tcp.get(keys)] == blocks


def _wmem_max() -> int:
    with open("/proc/sys/net/core/wmem_max") as f:
        return int(f.read())


async def test_both_ends_of_a_unix_socket_ask_for_a_larger_send_buffer(make_server: MakeServer,
                                                                       unix_path: str) -> None:
    """A Unix socket's send buffer is not autotuned as TCP's is; at the 208 KiB default a
    32 MiB put or get went through ~160 sleeps and wakeups of the writer (slower than TCP).

    Client end: its socket's SO_SNDBUF. Server end, seen from outside: the bytes of a GET reply
    that the server got into the socket while this client reads nothing (at most its send buffer).
    """
    srv = make_server("--capacity", "32MiB", "--unix", unix_path, "--no-shm")
    want = min(UNIX_SNDBUF, _wmem_max())  # what the kernel grants (it reports twice that)
    k = key(1, "sndbuf")
    block = data(k, want // 2)
    async with AsyncKVClient(f"unix:{unix_path}", namespace="b") as kv:
        sock = (await kv.nodes[0].connection()).transport.get_extra_info("socket")
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) >= 2 * want
        await kv.put([k], [block])
    with socket.socket(socket.AF_UNIX) as raw:
        raw.connect(unix_path)
        raw.sendall(b"".join(bytes(b) for b in [*encode(Hello(namespace="b"), 1), *encode(Get(keys=[k]), 2)]))
        deadline, queued = time.monotonic() + 10, 0
        while queued < len(block) and time.monotonic() < deadline:  # the server writes what the buffer takes
            time.sleep(0.01)
            queued = int.from_bytes(ioctl(raw, termios.FIONREAD, bytes(4)), sys.byteorder)
        assert queued >= len(block), f"only {queued} bytes of a {len(block)}-byte reply reached the socket"
    assert srv.proc.poll() is None


def test_sync_client_over_unix_env_var_and_socket_removed_on_sigterm(unix_path: str) -> None:
    srv = ServerProcess("--capacity", "16MiB", env={"KVSTORE_UNIX": unix_path, "KVSTORE_NO_SHM": "1"}).start()
    try:
        with KVClient(f"unix:{unix_path}", namespace="env") as kv:
            kv.put([key(1, "env")], [b"hello over a unix socket"])
            assert kv.get([key(1, "env")]) == [b"hello over a unix socket"]
        assert os.path.exists(unix_path)
    finally:
        assert srv.stop(signal.SIGTERM) == 0
    assert not os.path.exists(unix_path)  # removed on shutdown


def test_stale_socket_file_is_replaced_and_a_live_one_refused(unix_path: str) -> None:
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(unix_path)  # bound, never listening: what a crashed server leaves behind
    stale.close()
    with ServerProcess("--capacity", "8MiB", "--unix", unix_path) as srv:
        with KVClient(f"unix:{unix_path}") as kv:
            assert kv.ping() >= 0
        second = subprocess.run([sys.executable, "-m", "kvstore.server.cli", "--port", "0", "--capacity", "8MiB",
                                 "--unix", unix_path], capture_output=True, text=True, timeout=30)
        assert second.returncode != 0
        assert "another server is listening" in second.stderr
        with KVClient(f"unix:{unix_path}") as kv:  # the first server kept its socket
            assert kv.ping() >= 0
        assert srv.proc is not None and srv.proc.poll() is None


def test_a_start_that_finds_its_socket_path_taken_late_leaves_the_other_servers_socket(unix_path: str) -> None:
    """The path is checked before pre-faulting and the Redis connect; another server can take it
    before the bind (here while this one waits on a Redis that never answers). The start then
    fails, and what it leaves must not include unlinking the other's socket file (a mutant did:
    that server kept serving TCP, but no same-host client could reach it again)."""
    hang = socket.socket()
    hang.bind(("127.0.0.1", 0))
    hang.listen(8)  # accepts, never answers: the Redis connect waits --redis-timeout
    try:
        late = subprocess.Popen([sys.executable, "-m", "kvstore.server.cli", "--port", "0", "--metrics-port", "off",
                                 "--capacity", "8MiB", "--unix", unix_path, "--redis-timeout", "3",
                                 "--redis", f"redis://127.0.0.1:{hang.getsockname()[1]}/0"],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            time.sleep(1)  # (its checks done: waiting on Redis)
            with ServerProcess("--capacity", "8MiB", "--unix", unix_path) as first:
                out, _ = late.communicate(timeout=30)
                assert late.returncode == 2 and "another server is listening" in out, out
                assert os.path.exists(unix_path)
                with KVClient(f"unix:{unix_path}") as kv:
                    assert kv.ping() >= 0
                assert first.proc is not None and first.proc.poll() is None
        finally:
            if late.poll() is None:
                late.kill()
                late.communicate()
    finally:
        hang.close()


def test_a_listener_that_accepts_nothing_is_refused_not_waited_on(unix_path: str) -> None:
    from kvstore.server.shm import check_unix_path

    frozen = socket.socket(socket.AF_UNIX)
    frozen.bind(unix_path)
    frozen.listen(0)  # a server stopped (SIGSTOP, a debugger) with its backlog full
    queued = []
    try:
        for _ in range(4):  # (listen(0) still queues one; the next connects would block)
            c = socket.socket(socket.AF_UNIX)
            c.setblocking(False)
            try:
                c.connect(unix_path)
            except BlockingIOError:
                c.close()
                break
            queued.append(c)
        with pytest.raises(OSError, match="another server is listening there"):
            check_unix_path(unix_path)  # (was: a blocking connect, for as long as that server stays stopped)
        assert os.path.exists(unix_path)
    finally:
        for c in queued:
            c.close()
        frozen.close()


def test_a_unix_socket_in_a_missing_folder_is_named_in_the_error(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "no-such-dir" / "kv.sock"
    done = subprocess.run([sys.executable, "-m", "kvstore.server.cli", "--port", "0", "--capacity", "8MiB",
                           "--unix", str(path)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 2  # as every setting the server cannot use
    assert f"--unix {path}: No such file or directory (its folder must exist" in done.stderr  # (named only the TCP address)


async def test_bad_unix_addresses_are_clear_errors(unix_path: str) -> None:
    with pytest.raises(InvalidRequest):
        AsyncKVClient("unix:")
    with pytest.raises(TransportError, match="cannot connect to unix:"):
        async with AsyncKVClient(f"unix:{unix_path}", retries=0):
            pass


def test_shm_attach_is_refused_over_tcp(make_server: MakeServer, unix_path: str) -> None:
    srv = make_server("--capacity", "8MiB", "--unix", unix_path)
    with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as sock:
        sock.sendall(b"".join(bytes(b) for i, m in enumerate((Hello(), ShmAttach()), 1) for b in encode(m, i)))
        reader, frames = FrameReader(is_server=False), list[Frame]()
        while len(frames) < 2:
            chunk, fds, _, _ = socket.recv_fds(sock, 65536, 4)
            assert not fds and chunk
            reader.feed(chunk)
            while isinstance(event := reader.next_event(), Frame):
                frames.append(event)
    assert reply_fields(frames[0])["shm"]["path"] == unix_path  # announced (for shm=True clients on this host)
    assert error_code(frames[1]) == InvalidRequest.code  # only ever answered on the Unix socket
    assert_attach_maps(unix_path, 8 << 20)  # ... and on the Unix socket of the same server it is answered


def test_cli_speaks_over_the_unix_socket(make_server: MakeServer, unix_path: str) -> None:
    """... without mapping the arena: it did, for every command (a 4 GiB arena: 4 GiB of RSS and
    0.6 s for a `stats`, and a writable mapping of every namespace in an operator's shell)."""
    srv = make_server("--capacity", "16MiB", "--unix", unix_path)
    out = subprocess.run([sys.executable, "-m", "kvstore.client.cli", "--addr", f"unix:{unix_path}", "ping"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and out.stdout.startswith("PONG from unix:"), out.stderr
    for command in (["put", "6b6b"], ["get", "6b6b"], ["stats"]):
        out = subprocess.run([sys.executable, "-m", "kvstore.client.cli", "--addr", f"unix:{unix_path}", *command],
                             input="a block", capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
    with KVClient(srv.addr, namespace="check") as kv:
        assert kv.stats()["shm"]["attached"] == 0


def test_the_unix_path_a_server_announces_is_absolute(unix_path: str) -> None:
    """A server started with a relative --unix announced it as given: a same-host client running in
    another directory (``shm=True`` over TCP) looked for the socket there, and stayed on TCP."""
    folder, name = os.path.split(unix_path)
    with ServerProcess("--capacity", "16MiB", "--unix", name, cwd=folder) as srv:
        with KVClient(srv.addr, namespace="rel", shm=True) as kv:
            kv.put([key(1, "rel")], [b"over the arena"])
            assert kv.get([key(1, "rel")]) == [b"over the arena"]
            assert kv._aio.nodes[0].shm is not None  # (found the socket from /tmp/kv..., not this folder)
            assert kv.stats()["shm"]["path"] == unix_path
