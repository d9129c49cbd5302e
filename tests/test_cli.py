"""The real ``kvstore-cli`` console script against a real kvstore-server."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kvstore.client import AsyncKVClient, KVClient
from kvstore.errors import InvalidRequest

CLI = Path(sys.executable).with_name("kvstore-cli")
KEY = "00112233445566778899aabbccddeeff"
VALUE = bytes(range(256)) * 8 + b"\x00\n\xff"


def cli(*args: str, addr: str | None = None, stdin: bytes = b"", env: dict[str, str] | None = None,
        ) -> subprocess.CompletedProcess[bytes]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    if addr is not None:
        full_env["KVSTORE_ADDR"] = addr
    full_env.update(env or {})
    return subprocess.run([str(CLI), *args], input=stdin, capture_output=True, env=full_env, timeout=30)


def one_error_line(r: subprocess.CompletedProcess[bytes]) -> str:
    err = r.stderr.decode()
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert err.startswith("kvstore-cli: ")
    return err.strip()


def test_the_console_script_is_installed() -> None:
    r = cli("--version")
    assert r.returncode == 0 and r.stdout.decode().startswith("kvstore-cli ")


def test_put_get_exists_delete_round_trip_in_hex(server, tmp_path: Path) -> None:
    r = cli("put", KEY, "--namespace", "dbg", addr=server.addr, stdin=VALUE)  # value from stdin
    assert r.returncode == 0 and b"stored" in r.stdout
    r = cli("--namespace", "dbg", "get", KEY, "--hex", addr=server.addr)
    assert r.returncode == 0 and bytes.fromhex(r.stdout.decode().strip()) == VALUE
    r = cli("get", f"0x{KEY}", "-n", "dbg", addr=server.addr)  # raw bytes on stdout
    assert r.returncode == 0 and r.stdout == VALUE
    out = tmp_path / "block.bin"
    assert cli("get", KEY, "-n", "dbg", "-o", str(out), addr=server.addr).returncode == 0
    assert out.read_bytes() == VALUE
    src = tmp_path / "value.bin"
    src.write_bytes(b"from a file")
    assert cli("put", "ab" * 16, str(src), "-n", "dbg", addr=server.addr).returncode == 0
    r = cli("put", "ab" * 16, "-", "-n", "dbg", addr=server.addr, stdin=b"other bytes, 23 of them")
    assert r.returncode == 0  # (it said "existed: ... (23 B)", the size of bytes it did not store)
    assert r.stdout.decode().strip() == (f"existed: {'ab' * 16} in namespace 'dbg', kept as it was (blocks are "
                                         "immutable: delete it first to store other bytes)")
    with KVClient(server.addr, namespace="dbg") as kv:  # what the CLI stored is what a client reads
        assert [bytes(b) for b in kv.get([bytes.fromhex(KEY), bytes.fromhex("ab" * 16)])] == [VALUE, b"from a file"]
    r = cli("exists", KEY, "cd" * 16, "-n", "dbg", addr=server.addr)
    assert r.returncode == 1 and r.stdout.decode().split("\n")[:2] == [f"{KEY} present", f"{'cd' * 16} missing"]
    r = cli("delete", KEY, "cd" * 16, "-n", "dbg", addr=server.addr)  # (one of them was never there)
    assert r.returncode == 0 and "deleted 1 of 2" in r.stdout.decode()
    r = cli("get", KEY, "-n", "dbg", addr=server.addr)
    assert r.returncode == 1 and "not found" in one_error_line(r)


def test_stats_namespaces_ping_watch(server) -> None:
    with KVClient(server.addr, namespace="llama/tp0") as kv:
        kv.put([b"a" * 32, b"b" * 32], [b"x" * 1000, b"y" * 3000])
    env = {"KVSTORE_NAMESPACE": "llama/tp0"}
    r = cli("stats", addr=server.addr, env=env)
    text = r.stdout.decode()
    assert r.returncode == 0 and "2 in 1 namespace(s)" in text and "memory" in text and "tier" in text
    assert re.search(r"polling     200 us after each request .* \d+ polling turns", text)
    r = cli("stats", "--json", addr=server.addr)
    st = json.loads(r.stdout)
    assert f"open of at most {st['max_connections']}," in text  # the cap in force (lowered by ulimit -n?)
    assert st["namespaces"]["llama/tp0"] == {"blocks": 2, "bytes": 4000}
    r = cli("namespaces", addr=server.addr)
    assert r.returncode == 0
    header, row = r.stdout.decode().splitlines()
    assert header.split() == ["NAMESPACE", "BLOCKS", "BYTES"] and row.split()[:2] == ["llama/tp0", "2"]
    assert json.loads(cli("namespaces", "--json", addr=server.addr).stdout)["llama/tp0"]["bytes"] == 4000
    r = cli("ping", "-c", "2", addr=server.addr)
    assert r.returncode == 0 and r.stdout.decode().count("PONG") == 2
    r = cli("watch", "--interval", "0.2", "--count", "3", addr=server.addr)
    lines = r.stdout.decode().splitlines()
    assert r.returncode == 0 and len(lines) == 3 and all("blocks        2" in line for line in lines)


def test_watch_leaves_its_own_sample_out_of_the_request_rate_and_connections(server) -> None:
    """(an idle server read "req/s 1.0 ... conns 1": the watch's own STATS, on its own connection)"""
    from kvstore.client.cli import watch_line
    with KVClient(server.addr, namespace="w") as kv:
        first = kv.stats()
        second = kv.stats()
        kv.ping()
        third = kv.stats()
    assert re.search(r"req/s +0\.0 .* conns 0$", watch_line(first, second, 1.0)), watch_line(first, second, 1.0)
    assert re.search(r"req/s +1\.0 ", watch_line(second, third, 1.0))  # (the PING between)


def test_watch_leaves_its_own_reconnections_out_of_the_request_rate(make_server) -> None:
    """(an idle server closing the watch's connection between samples read "req/s 0.7": the HELLO of
    the watch's next connection)"""
    srv = make_server("--capacity", "16MiB", "--idle-timeout", "1")
    r = cli("watch", "--interval", "2.5", "--count", "3", addr=srv.addr)
    lines = r.stdout.decode().splitlines()
    assert r.returncode == 0 and len(lines) == 3, r.stdout + r.stderr
    assert all(re.search(r"req/s +0\.0 .* conns 0$", line) for line in lines), lines
    with KVClient(srv.addr, namespace="w") as kv:
        assert kv.stats()["timeouts"]["idle"] >= 1  # (the watch did reconnect)


def test_watch_across_a_server_restart_shows_no_negative_rates(make_server) -> None:
    """The counters of a restarted server start again from 0: watch subtracted the old ones and
    printed "req/s -32.9  in -196.1 KiB/s" for the first sample after a restart."""
    from kvstore.client.cli import watch_line
    srv = make_server("--capacity", "16MiB")
    with KVClient(srv.addr, namespace="w") as kv:
        kv.put([b"a" * 32], [b"x" * 100_000])
        for _ in range(20):
            kv.get([b"a" * 32])
        before = kv.stats()
    srv.stop()
    again = make_server("--capacity", "16MiB")
    with KVClient(again.addr, namespace="w") as kv:
        after = kv.stats()
        while after["uptime_s"] <= before["uptime_s"]:  # up longer than the old one was: uptime alone missed it
            time.sleep(0.1)
            after = kv.stats()
    line = watch_line(before, after, 1.0)
    assert "server restarted" in line and not re.search(r"req/s +-|in -|out -|evict/s +-", line), line
    assert "server restarted" not in watch_line(after, after, 1.0)
    older = [{k: v for k, v in sample.items() if k != "started"} for sample in (before, after)]  # (an older server)
    assert "server restarted" in watch_line(*older, 1.0) and "server restarted" not in watch_line(older[1], older[1], 1.0)


def test_watch_goes_on_through_a_server_restart(make_server) -> None:
    """An operator watching a server through its restart: watch exited at the first sample the
    stopped server did not answer (its client makes no retries), and at the first one a restarted
    server refused at its connection limit (the clients that reconnected first took the slots)."""
    srv = make_server("--capacity", "16MiB", "--max-connections", "1")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    seen: list[str] = []
    with subprocess.Popen([str(CLI), "--addr", srv.addr, "watch", "-i", "0.1", "-c", "300"],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True) as watch:
        assert watch.stdout is not None

        def until(word: str) -> None:
            while not seen or word not in seen[-1]:
                line = watch.stdout.readline()  # (a line every 0.1 s, and -c bounds them)
                assert line, (seen, watch.stderr.read() if watch.stderr else "")
                seen.append(line)

        until("blocks")
        srv.stop()
        until("unreachable")
        again = make_server("--capacity", "16MiB", "--port", str(srv.port), "--max-connections", "1")
        with KVClient(again.addr, pool_size=1) as other:  # takes the one slot
            other.ping()
            until("limit")
        until("blocks")
        assert watch.poll() is None  # still watching
        watch.kill()
    assert not any(re.search(r"req/s +-|in -|out -|evict/s +-", line) for line in seen), seen


def test_watch_with_a_count_exits_1_when_its_last_sample_found_no_server(make_server) -> None:
    srv = make_server("--capacity", "16MiB")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    with subprocess.Popen([str(CLI), "--addr", srv.addr, "watch", "-i", "0.3", "-c", "3"],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True) as watch:
        assert watch.stdout is not None
        assert "blocks" in watch.stdout.readline()
        srv.stop()
        out, _ = watch.communicate(timeout=30)
    assert watch.returncode == 1 and out.count("unreachable") == 2  # (was 0: a check saw no outage)


def test_stats_lists_the_largest_namespaces_and_says_how_many(make_server) -> None:
    """A STATS reply listing every namespace outgrew the client's 4 MiB meta limit (16,000 of
    them, long names: `stats` failed); it lists the largest STATS_NAMESPACES and the count."""
    from kvstore.server.service import STATS_NAMESPACES
    srv = make_server("--capacity", "128MiB", "--page-size", "4KiB")
    n = STATS_NAMESPACES + 100

    async def fill() -> None:
        async def one(i: int) -> None:
            async with AsyncKVClient(srv.addr, namespace=f"ns{i:05d}", pool_size=1) as kv:
                await kv.put([b"k" * 32], [b"x" * (8192 if i == n - 1 else 100)])
        for start in range(0, n, 50):
            await asyncio.gather(*(one(i) for i in range(start, min(n, start + 50))))

    asyncio.run(fill())
    st = json.loads(cli("stats", "--json", addr=srv.addr).stdout)
    assert st["namespaces_total"] == n and len(st["namespaces"]) == STATS_NAMESPACES
    assert st["namespaces"][f"ns{n - 1:05d}"] == {"blocks": 1, "bytes": 8192}  # the largest is listed
    assert f"{n} in {n} namespace(s)" in cli("stats", addr=srv.addr).stdout.decode()
    assert cli("namespaces", addr=srv.addr).stdout.decode().splitlines()[-1] == \
        f"... the largest {STATS_NAMESPACES} of {n} namespaces (all of them: /metrics)"


def test_flush_asks_first(server) -> None:
    keys = [bytes([i]) * 32 for i in range(3)]
    with KVClient(server.addr, namespace="victim") as kv:
        kv.put(keys, [b"v"] * 3)
        r = cli("flush", "--namespace", "victim", addr=server.addr, stdin=b"n\n")
        assert r.returncode == 1 and "Delete all 3 block(s)" in r.stdout.decode()
        r = cli("flush", "--namespace", "nothing-there", addr=server.addr, stdin=b"n\n")
        assert r.returncode == 1 and "Delete all 0 block(s)" in r.stdout.decode()  # (every namespace is listed)
        assert kv.exists(keys) == [True] * 3  # answered "n": nothing deleted
        r = cli("flush", "--namespace", "victim", addr=server.addr, stdin=b"")  # EOF is a no too
        assert r.returncode == 1 and kv.exists(keys) == [True] * 3
        r = cli("flush", "--namespace", "victim", addr=server.addr, stdin=b"y\n")
        assert r.returncode == 0 and kv.exists(keys) == [False] * 3
        for answer in (b"yes\n", b" Y \n"):  # (a mutant took "yes" for a no)
            kv.put(keys, [b"v"] * 3)
            r = cli("flush", "--namespace", "victim", addr=server.addr, stdin=answer)
            assert r.returncode == 0 and kv.exists(keys) == [False] * 3, r
        kv.put(keys, [b"v"] * 3)
        r = cli("--namespace", "victim", "flush", "--yes", addr=server.addr)  # no question asked
        assert r.returncode == 0 and "flushed 3 block(s)" in r.stdout.decode() and kv.exists(keys) == [False] * 3


def test_errors_are_one_readable_line(make_server, tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    r = cli("stats", addr=dead)
    assert r.returncode == 1 and "cannot connect" in one_error_line(r)
    r = cli("stats", addr="no-port-here")
    assert r.returncode == 2 and "HOST:PORT" in one_error_line(r)
    for bad in ("xyz", "00" * 129):
        r = cli("get", bad, addr=dead)  # refused before any connection is tried
        assert r.returncode == 2 and "key" in one_error_line(r)

    tokens = tmp_path / "tokens"
    tokens.write_text("right-token\n")
    srv = make_server("--capacity", "8MiB", "--token-file", str(tokens))
    wrong = tmp_path / "wrong"
    wrong.write_text("# my token\nwrong-token\n")
    r = cli("ping", "--token-file", str(wrong), addr=srv.addr)
    assert r.returncode == 1 and "refused" in one_error_line(r) and "wrong-token" not in r.stderr.decode()
    r = cli("ping", addr=srv.addr)  # no token: a bare PING, the health check that needs no secret
    assert r.returncode == 0 and b"PONG" in r.stdout, r.stderr
    r = cli("stats", addr=srv.addr)  # ... while anything else without a token is refused
    assert r.returncode == 1 and "refused" in one_error_line(r)
    assert cli("ping", addr=srv.addr, env={"KVSTORE_TOKEN_FILE": str(tokens)}).returncode == 0
    r = cli("ping", "--token-file", str(tmp_path / "missing"), addr=srv.addr)
    assert r.returncode == 1 and "missing" in one_error_line(r)
    r = cli("bogus-command", addr=srv.addr)
    assert r.returncode == 2


def test_tls_options(make_server, tls_files: dict[str, Path]) -> None:
    srv = make_server("--capacity", "8MiB", "--tls-cert", str(tls_files["cert"]), "--tls-key", str(tls_files["key"]))
    r = cli("ping", "--tls-ca", str(tls_files["ca"]), addr=srv.addr)
    assert r.returncode == 0 and b"PONG" in r.stdout
    r = cli("ping", addr=srv.addr, env={"KVSTORE_TLS_CA": str(tls_files["ca"]), "KVSTORE_TLS_SERVER_NAME": "localhost"})
    assert r.returncode == 0
    r = cli("ping", "--tls", "--timeout", "3", addr=srv.addr)  # system CAs do not know the test CA
    assert r.returncode == 1 and "TLS" in one_error_line(r)
    for command in ("ping", "stats"):  # plain text against TLS: both say what is likely wrong (ping, without
        r = cli(command, "--timeout", "3", addr=srv.addr)  # a token, said only "connection closed by server")
        assert r.returncode == 1 and "does it expect TLS" in one_error_line(r), one_error_line(r)


def test_ping_of_a_server_that_does_not_answer_says_so(make_server) -> None:
    """(a timeout was taken for a closed connection: 'does it expect TLS?')"""
    srv = make_server("--capacity", "1MiB")
    os.kill(srv.proc.pid, signal.SIGSTOP)
    try:
        r = cli("ping", "--timeout", "1", addr=srv.addr)
    finally:
        os.kill(srv.proc.pid, signal.SIGCONT)
    assert r.returncode == 1 and "TLS" not in one_error_line(r) and "1" in one_error_line(r), one_error_line(r)


def test_module_entry_point_is_the_same_program(server) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    with KVClient(server.addr, namespace="m") as kv:
        kv.put([b"k" * 16], [b"v"])
    r = subprocess.run([sys.executable, "-m", "kvstore.client.cli", "--addr", server.addr, "namespaces", "--json"],
                       capture_output=True, timeout=30, env=env)
    assert r.returncode == 0 and json.loads(r.stdout) == {"m": {"blocks": 1, "bytes": 1}}
    assert r.stdout == cli("namespaces", "--json", addr=server.addr).stdout



def dead_addr() -> str:
    """A loopback address where nothing listens."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


@pytest.mark.parametrize("addr", ["127.0.0.1:99999", "127.0.0.1:0", "127.0.0.1:\u00b2"])
def test_an_addr_without_a_valid_port_is_a_usage_error(addr: str) -> None:
    r = cli("ping", "--addr", addr)  # refused before connect() (OverflowError for 99999)
    assert r.returncode == 2 and "HOST:PORT" in one_error_line(r)
    r = cli("ping", addr=addr)  # the same from KVSTORE_ADDR
    assert r.returncode == 2 and "HOST:PORT" in one_error_line(r)


@pytest.mark.parametrize("args", [["--addr", "a..b:7600"], ["--addr", "a" * 64 + ".example:7600"],
                                  ["--addr", b"unix:/tmp/\xff.sock"], ["--addr", b"\xff:7600"],
                                  ["--tls", "--tls-server-name", "a..b"], ["--tls", "--tls-server-name", b"\xff"]],
                         ids=["empty label", "label over 63", "path not utf-8", "host not utf-8",
                              "server name", "server name not utf-8"])
def test_a_host_name_the_resolver_cannot_take_is_a_usage_error(args: list[str | bytes]) -> None:
    """(CLI review) These ended in a UnicodeError's traceback, at connect time (the library raised
    it too, past its typed errors): refused before connecting now."""
    r = subprocess.run([str(CLI), *args, "ping"], capture_output=True, timeout=30,
                       env={k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")})
    assert r.returncode == 2 and re.search(r"--addr|--tls-server-name", one_error_line(r))


def test_a_host_name_the_resolver_cannot_take_is_refused_by_the_library_too() -> None:
    for addr in ("a..b:7600", "x" * 64 + ":7600", "unix:/tmp/\udcff.sock"):
        with pytest.raises(InvalidRequest):
            AsyncKVClient(addr)
    with pytest.raises(InvalidRequest, match="server_hostname"):
        AsyncKVClient("127.0.0.1:7600", server_hostname="a..b")
    assert AsyncKVClient("b\u00fccher.example:7600").nodes[0].host == "b\u00fccher.example"  # (IDNA: fine)


@pytest.mark.parametrize("addr", ["::1", "::1:7600", "[::1:7600", "::1]:7600", "[::1]]:7600", "[[::1]]:7600",
                                  "[::1]:7600,[::2]:7600", "h1:7600,h2:7600"])
def test_an_ipv6_address_without_brackets_is_a_usage_error(addr: str) -> None:
    """(CLI review) ``--addr ::1`` was read as the host ':' and port 1, and failed at the resolver
    (exit 1, "cannot connect"); ``::1:7600`` could mean either. (Its review:) brackets not around
    the whole host, and a comma-separated list (a vLLM ``kvstore_addr`` may be one), reached the
    resolver as a host name too."""
    r = cli("ping", "--addr", addr)
    assert r.returncode == 2 and "[IPV6]:PORT" in one_error_line(r)
    with pytest.raises(InvalidRequest, match=r"one address per string" if "," in addr else r"brackets, once"):
        AsyncKVClient(addr)
    assert (AsyncKVClient("[::1]:7600").nodes[0].host, AsyncKVClient("[::1]:7600").nodes[0].port) == ("::1", 7600)


def test_files_the_get_and_put_commands_cannot_use_are_named(server, tmp_path: Path) -> None:
    """(CLI review) ``get -o ""`` wrote the block to stdout; an error of a read or write, not of the
    open (EIO from /proc/version), named no file."""
    assert cli("put", KEY, "-", addr=server.addr, stdin=VALUE).returncode == 0
    for args in (["get", KEY, "-o", ""], ["put", KEY, ""]):
        r = cli(*args, addr=server.addr)
        assert r.returncode == 2 and "empty file name" in one_error_line(r) and r.stdout == b""
    r = cli("get", KEY, "-o", "/proc/version", addr=server.addr)
    assert r.returncode == 1 and one_error_line(r).startswith("kvstore-cli: --output /proc/version: ")
    r = cli("put", KEY, "/proc/self/mem", addr=server.addr)
    assert r.returncode == 1 and one_error_line(r).startswith("kvstore-cli: /proc/self/mem: ")
    r = cli("put", KEY, str(tmp_path), addr=server.addr)  # (an error of the open: named as before)
    assert r.returncode == 1 and one_error_line(r) == f"kvstore-cli: {tmp_path}: Is a directory"
    r = cli("get", KEY, "-o", str(tmp_path / "block"), addr=server.addr)
    assert r.returncode == 0 and (tmp_path / "block").read_bytes() == VALUE
    r = cli("get", KEY, "-o", "-", addr=server.addr)  # (as put's FILE: '-' is stdout, not a file named '-')
    assert r.returncode == 0 and r.stdout == VALUE


def test_exit_codes_stand_when_the_reader_of_stdout_has_gone(server) -> None:
    """(CLI review) `kvstore-cli exists ... | head -1`: the broken pipe made every exit 0, so an
    exists that found a key missing said all were there. (Its review:) a watch, which ended by
    that error, ran on for good once it no longer came."""
    with KVClient(server.addr) as kv:
        kv.put([bytes.fromhex(KEY)], [b"v"])
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")} | {"KVSTORE_ADDR": server.addr}
    for args, code in ((["exists", *[KEY] * 4000], 0), (["exists", *[KEY, "ff" * 16] * 2000], 1),
                       (["watch", "--interval", "0.1"], 0), (["ping", "--count", "50"], 0),
                       (["get", KEY, "-o", "/dev/stdout"], 0), (["get", KEY, "-o", "-"], 0)):
        read, write = os.pipe()
        os.close(read)  # (the reader is gone before the first line)
        try:
            r = subprocess.run([str(CLI), *args], stdout=write, stderr=subprocess.PIPE, env=env, timeout=30)
        finally:
            os.close(write)
        assert r.returncode == code and r.stderr == b"", args[0]


def test_a_reader_of_an_output_fifo_that_leaves_early_ends_get_quietly_with_stdout_closed(server, tmp_path: Path) -> None:
    """(fix review) The broken pipe of ``-o FIFO`` ends the command as a reader of stdout leaving
    does; with stdout closed (``>&-``) that path dropped a stdout that was None: a traceback."""
    with KVClient(server.addr) as kv:
        kv.put([bytes.fromhex(KEY)], [bytes(1 << 20)])  # (over a pipe's buffer: the write meets the reader gone)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)

    def read_one_byte() -> None:
        with open(fifo, "rb") as f:
            f.read(1)

    reader = threading.Thread(target=read_one_byte, daemon=True)
    reader.start()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    try:
        r = subprocess.run(["bash", "-c", f'"$0" --addr {server.addr} get {KEY} -o {fifo} >&-', str(CLI)],
                           capture_output=True, text=True, timeout=30, env=env)
    finally:
        if reader.is_alive():  # (the command never opened the FIFO: let the reader's open return)
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        reader.join(10)
    assert r.returncode == 0 and r.stderr == "", r.stderr


@pytest.mark.parametrize("args", [["put", KEY], ["flush", "--namespace", "ctrl-c"], ["put", KEY, "FIFO"],
                                  ["--namespace", "ctrl-c", "get", KEY, "-o", "FIFO"]],
                         ids=["put stdin", "flush", "put fifo", "get -o fifo"])
def test_the_first_ctrl_c_ends_a_command_waiting_on_stdin(server, args: list[str], tmp_path: Path) -> None:
    """(CLI review) A read of stdin in the event loop's thread was resumed after the first SIGINT
    (it only cancelled the command): `put KEY` with no FILE, or flush's [y/N], took a second. (Its
    review:) so did the open of a FIFO no one writes to or reads from."""
    os.mkfifo(tmp_path / "fifo")
    args = [str(tmp_path / "fifo") if a == "FIFO" else a for a in args]
    with KVClient(server.addr, namespace="ctrl-c") as kv:
        kv.put([bytes.fromhex(KEY)], [b"v"])
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")} | {"KVSTORE_ADDR": server.addr}
        with subprocess.Popen([str(CLI), *args], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, env=env,  # (stdin left open: it waits)
                              # (as from a terminal: a test run started in the background, `(cmd &)`,
                              # hands its children SIGINT ignored, which a command keeps, as it should)
                              preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)) as proc:
            try:
                deadline = time.monotonic() + 20
                while kv.stats()["connections"] < 2:  # the command is connected: it reads stdin next
                    assert time.monotonic() < deadline and proc.poll() is None
                    time.sleep(0.05)
                time.sleep(0.3)
                proc.send_signal(signal.SIGINT)
                assert proc.wait(10) == 130
            finally:
                proc.kill()
        assert kv.exists([bytes.fromhex(KEY)]) == [True]  # (nothing flushed)


@pytest.mark.parametrize(("name", "value"), [("KVSTORE_TIMEOUT", "abc"), ("KVSTORE_TIMEOUT", "-1"),
                                             ("KVSTORE_TLS", "maybe")])
def test_a_bad_environment_value_is_a_usage_error(name: str, value: str) -> None:
    r = cli("ping", addr=dead_addr(), env={name: value})
    assert r.returncode == 2 and f"{name}='{value}'" in one_error_line(r)


def test_a_timeout_must_be_positive() -> None:
    r = cli("ping", "--timeout", "0", addr=dead_addr())
    assert r.returncode == 2 and "argument --timeout" in r.stderr.decode()


def test_a_token_file_that_is_not_utf8_is_a_usage_error(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_bytes(b"\xff\xfe\x00bad\n")
    r = cli("ping", "--token-file", str(token), addr=dead_addr())
    assert r.returncode == 2 and "UTF-8" in one_error_line(r)


SERVER = CLI.with_name("kvstore-server")


def server_run(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``kvstore-server ARGS`` with only ``env`` as KVSTORE_*; one that starts anyway is killed by the timeout."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    return subprocess.run([str(SERVER), "--host", "127.0.0.1", "--capacity", "1MiB", *args], capture_output=True,
                          text=True, timeout=10, env={**full_env, "KVSTORE_PORT": "0", **env})


@pytest.mark.parametrize(("name", "value"), [
    ("LOG_LEVEL", "verbose"), ("LOG_FORMAT", "xml"), ("REDIS_MODE", "bogus"), ("EVICTION", "fifo"),
    ("REDIS_TTL", "-1"), ("PORT", "99999"), ("NO_SHM", "maybe"), ("BUSY_POLL_US", "-5"),
    ("BUSY_POLL_US", "20000")])
def test_server_checks_an_environment_value_as_it_checks_the_flag(name: str, value: str) -> None:
    r = server_run(env={f"KVSTORE_{name}": value})
    assert r.returncode == 2 and f"kvstore-server: error: bad KVSTORE_{name}='{value}'" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize(("flag", "value"), [("--redis-ttl", "-1"), ("--port", "99999"), ("--max-connections", "-1"),
                                              ("--busy-poll-us", "-1"), ("--busy-poll-us", "10001")])
def test_server_refuses_out_of_range_flags(flag: str, value: str) -> None:
    r = server_run(flag, value, env={})
    assert r.returncode == 2 and f"argument {flag}" in r.stderr, r.stderr


def test_namespaces_chosen_by_clients_cannot_write_control_characters_to_the_terminal(server) -> None:
    """Any client names its namespace: a newline forged a table row, ESC [2J cleared the screen."""
    evil = "a\nFORGED  999  1 GiB\x1b[2J\u2028"
    with KVClient(server.addr, namespace=evil) as kv:
        kv.put([b"k" * 16], [b"v"])
    out = cli("namespaces", addr=server.addr).stdout.decode()
    assert "\x1b" not in out and "\u2028" not in out
    rows = out.splitlines()
    assert not any(r.startswith("FORGED") for r in rows)
    assert any(r.startswith("a\\nFORGED  999  1 GiB\\x1b[2J\\u2028") for r in rows), rows
