"""What the server and kvstore-cli say when they cannot start or are used wrong: one line that
names the flag (or variable) and the value at fault, with the documented exit code."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

from kvstore.server.process import ServerProcess

BIN = Path(sys.executable).parent
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "pd_disaggregation.py"


def clean_env(**extra: str) -> dict[str, str]:
    return {**{k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}, **extra}


def server_run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``kvstore-server ARGS`` that must fail at start (one that starts anyway is killed by the timeout)."""
    cmd = [str(BIN / "kvstore-server"), "--host", "127.0.0.1", "--port", "0", "--capacity", "1MiB", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=20, env=clean_env(**(env or {})))


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BIN / "kvstore-cli"), *args], capture_output=True, text=True, timeout=30,
                          env=clean_env(**(env or {})), stdin=subprocess.DEVNULL)


def error_line(r: subprocess.CompletedProcess[str], prog: str) -> str:
    """The one line the program printed (apart from info log lines), no traceback."""
    lines = [line for line in r.stderr.splitlines() if " level=info " not in line]
    assert "Traceback" not in r.stderr and len(lines) == 1, r.stderr
    assert lines[0].startswith(f"{prog}: "), r.stderr
    return lines[0]


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A loopback port someone else listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def dead_addr() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


# ---------------------------------------------------------------- kvstore-server start-up


def test_a_port_in_use_names_the_flag_and_address_and_exits_2(taken_port: int) -> None:
    r = server_run("--port", str(taken_port))
    assert r.returncode == 2  # (was 1, while every other setting that cannot work is 2)
    assert error_line(r, "kvstore-server") == \
        f"kvstore-server: --port {taken_port}: cannot listen on 127.0.0.1:{taken_port}: Address already in use"


def test_an_address_not_of_this_host_is_the_hosts_fault_not_the_ports() -> None:
    """(mutation review) EADDRNOTAVAIL: --host names an address no interface of this host has."""
    r = server_run("--host", "192.0.2.1", "--port", "7601")  # (TEST-NET-1: documentation only, never assigned)
    assert r.returncode == 2
    assert error_line(r, "kvstore-server") == \
        "kvstore-server: --host 192.0.2.1: cannot listen on 192.0.2.1:7601: Cannot assign requested address"


def test_a_port_in_use_fails_before_the_capacity_is_pre_faulted(taken_port: int) -> None:
    """It failed only after --capacity was faulted in: 7 s and 3 GiB of RSS for 3 GiB, at every
    restart by a supervisor."""
    for flag in ("--port", "--metrics-port"):
        r = server_run(flag, str(taken_port), "--capacity", "64MiB", "--log-level", "info")
        assert r.returncode == 2 and f"{flag} {taken_port}: cannot listen" in r.stderr
        assert "pre-faulting" not in r.stderr


def test_a_metrics_port_in_use_is_named_not_the_tcp_address(taken_port: int, tmp_path: Path) -> None:
    sock = tmp_path / "kv.sock"
    r = server_run("--metrics-port", str(taken_port), "--unix", str(sock))
    # (was "cannot listen on 127.0.0.1:0: --metrics-port P: error while attempting to bind on address ...")
    assert r.returncode == 2
    assert error_line(r, "kvstore-server") == (f"kvstore-server: --metrics-port {taken_port}: cannot listen on "
                                               f"127.0.0.1:{taken_port}: Address already in use")
    assert not sock.exists()  # what was bound before the failure is released (the socket file was left)


async def test_a_start_that_cannot_listen_closes_the_tier_it_started() -> None:
    """(In process: the CLI's exit would end the tier's tasks anyway; an embedding program's would run on.)
    The port is taken after the server was made (which checks it), before it listens."""
    import asyncio

    from kvstore.config import ServerConfig
    from kvstore.server.app import Server, StartupError

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = Server(ServerConfig(host="127.0.0.1", port=port, capacity=1 << 20, prefault=False,
                                 redis="redis://127.0.0.1:1/0", redis_mode="write-behind"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        s.listen()
        with pytest.raises(StartupError, match=f"--port {port}"):
            await server.start()
    await asyncio.sleep(0)
    assert [t.get_name() for t in asyncio.all_tasks() if t.get_name() == "redis-write-behind"] == []


def test_a_unix_socket_in_a_missing_folder_does_not_blame_the_tcp_address(tmp_path: Path) -> None:
    path = tmp_path / "no-such-dir" / "kv.sock"
    r = server_run("--unix", str(path))
    assert r.returncode == 2
    assert error_line(r, "kvstore-server") == \
        f"kvstore-server: --unix {path}: No such file or directory (its folder must exist and be writable)"
    assert "pre-faulting" not in r.stderr  # (said after --capacity was mapped: seconds per GiB, every restart)
    (tmp_path / "file").write_text("")
    (tmp_path / "dangling").symlink_to(tmp_path / "nothing")
    for path, why in ((tmp_path / "file", "exists and is not a socket"),
                      (tmp_path / "file" / "kv.sock", "Not a directory (its folder must exist and be writable)"),
                      (tmp_path / ("x" * 110), "AF_UNIX path too long"),
                      (tmp_path / "dangling", "exists, a symbolic link to nothing")):  # ("Address already in use")
        r = server_run("--unix", str(path))
        assert r.returncode == 2
        assert error_line(r, "kvstore-server") == f"kvstore-server: --unix {path}: {why}"
        assert "pre-faulting" not in r.stderr


def test_missing_tls_files_are_named_with_their_flag(tmp_path: Path, tls_files: dict[str, Path]) -> None:
    missing = tmp_path / "nope.pem"
    r = server_run("--tls-cert", str(missing), "--tls-key", str(missing))
    assert r.returncode == 2  # (was "[Errno 2] No such file or directory", naming no file)
    assert error_line(r, "kvstore-server") == f"kvstore-server: --tls-cert {missing}: No such file or directory"
    r = server_run("--tls-cert", str(tls_files["cert"]), "--tls-key", str(missing))
    assert error_line(r, "kvstore-server") == f"kvstore-server: --tls-key {missing}: No such file or directory"
    r = server_run("--tls-cert", str(tls_files["ca"]), "--tls-key", str(tls_files["key"]))  # not its key
    assert r.returncode == 2 and "--tls-cert" in error_line(r, "kvstore-server") and "--tls-key" in r.stderr


def test_an_encrypted_tls_key_is_named_and_never_prompts_for(tmp_path: Path, tls_files: dict[str, Path]) -> None:
    """(OpenSSL asked for a passphrase on the terminal, then: "kvstore-server: [Errno 22] Invalid argument")"""
    from cryptography.hazmat.primitives import serialization

    key = serialization.load_pem_private_key(tls_files["key"].read_bytes(), password=None)
    encrypted = tmp_path / "encrypted.key"
    encrypted.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                            serialization.BestAvailableEncryption(b"secret")))
    r = server_run("--tls-cert", str(tls_files["cert"]), "--tls-key", str(encrypted))
    assert r.returncode == 2 and "pass phrase" not in r.stdout + r.stderr
    assert error_line(r, "kvstore-server").startswith(f"kvstore-server: --tls-key {encrypted}: the private key is "
                                                      "encrypted")


def test_a_missing_token_file_is_named_with_its_flag_before_the_arena_is_faulted(tmp_path: Path) -> None:
    missing = tmp_path / "tokens"
    r = server_run("--token-file", str(missing))
    assert r.returncode == 2
    assert error_line(r, "kvstore-server") == f"kvstore-server: --token-file {missing}: No such file or directory"
    assert "pre-faulting" not in r.stderr  # checked first: a typo costs no seconds of pre-faulting
    empty = tmp_path / "empty"
    empty.write_text("# no token yet\n")
    r = server_run("--token-file", str(empty))
    assert error_line(r, "kvstore-server") == f"kvstore-server: --token-file {empty}: the token file holds no token"


def test_settings_an_operator_gets_wrong_say_so_in_one_line(tmp_path: Path) -> None:
    """Each was accepted or half-said: a token file that is not UTF-8 gave the codec's own words;
    --redis-mode write-behind without a Redis ran memory-only without a word; a Redis URL naming a
    database Redis lacks started degraded and probed for ever (no outage that waiting ends)."""
    from redis_fixtures import RedisProcess

    latin1 = tmp_path / "tokens"
    latin1.write_bytes(b"caf\xe9:token\n")
    r = server_run("--token-file", str(latin1))
    assert r.returncode == 2
    assert error_line(r, "kvstore-server") == \
        f"kvstore-server: --token-file {latin1}: not a text file of tokens (not UTF-8)"
    r = server_run("--port", "7699", "--metrics-port", "7699")  # (each bindable alone: failed once pre-faulted)
    assert error_line(r, "kvstore-server") == "kvstore-server: --metrics-port 7699 is --port too: give each its own"
    r = server_run("--redis-mode", "write-behind")
    assert r.returncode == 2
    assert error_line(r, "kvstore-server") == \
        "kvstore-server: --redis-mode write-behind needs a Redis tier (--redis or --redis-cluster)"
    # redis-py ignores a path that is not a number: the tier wrote to database 0
    r = server_run("--redis", "redis://127.0.0.1:1/db3")
    assert r.returncode == 2
    assert error_line(r, "kvstore-server") == ("kvstore-server: bad --redis URL 'redis://127.0.0.1:1/db3': its path "
                                               "is not a database number (redis://host:port/3 for database 3)")
    r = server_run("--redis-cluster", "127.0.0.1:7000,127.0.0.1:70000")  # (started, degraded for good)
    assert r.returncode == 2
    assert error_line(r, "kvstore-server") == \
        "kvstore-server: --redis-cluster: port 70000 of '127.0.0.1:70000' is not in 1-65535"
    redis = RedisProcess(tmp_path / "redis").start()
    try:
        r = server_run("--redis", f"redis://{redis.addr}/99")
        assert r.returncode == 2
        assert error_line(r, "kvstore-server") == (f"kvstore-server: --redis redis://{redis.addr}/99: Redis refused "
                                                   "the URL's database: ResponseError: DB index is out of range")
        # a plain Redis among the seeds (it started, degraded for good), after one that is down: redis-py
        # tries them in a random order and tells only the last failure (the start failed one time in two)
        seeds = f"{dead_addr()},{redis.addr}"
        for _ in range(3):
            r = server_run("--redis-cluster", seeds)
            assert r.returncode == 2
            assert error_line(r, "kvstore-server") == (f"kvstore-server: --redis-cluster {seeds}: {redis.addr} is not "
                                                       "in cluster mode (a plain Redis: give it to --redis "
                                                       "instead)")
    finally:
        redis.stop()


def test_redis_settings_without_a_redis_tier_are_said_to_do_nothing() -> None:
    """(a forgotten --redis: --redis-ttl and the others were taken without a word)"""
    from kvstore.server.cli import config_from_args

    assert config_from_args(["--redis-ttl", "60", "--redis-timeout", "9"]).idle_redis_flags() == \
        ["--redis-ttl", "--redis-timeout"]
    assert config_from_args(["--redis-ttl", "60", "--redis", "redis://127.0.0.1:1/0"]).idle_redis_flags() == []
    assert config_from_args(["--redis-timeout", "2"]).idle_redis_flags() == []  # (the default, given)
    with ServerProcess("--capacity", "8MiB", "--redis-queue-bytes", "1MiB") as srv:
        assert "--redis-queue-bytes set without a Redis tier (--redis or --redis-cluster): no effect" in \
            srv.wait_log("no effect")
    with ServerProcess("--capacity", "8MiB", env={"KVSTORE_REDIS_TTL": "60"}) as srv:  # (the variable unnamed)
        assert '"--redis-ttl set without a Redis tier (--redis or --redis-cluster): no effect (set by ' \
            'KVSTORE_REDIS_TTL)"' in srv.wait_log("no effect")


def test_a_misspelt_setting_variable_is_warned_of_not_ignored_silently() -> None:
    """(docs review) KVSTORE_CAPACTY=8MiB was ignored without a word: the server ran on the default."""
    with ServerProcess("--capacity", "8MiB", env={"KVSTORE_CAPACTY": "8MiB", "KVSTORE_TIMEOUT": "5",
                                                  "KVSTORE_TLS_CA": "/x"}) as srv:
        line = srv.wait_log("no setting of kvstore-server")
        assert "environment variable KVSTORE_CAPACTY is no setting of kvstore-server (ignored): KVSTORE_CAPACITY?" \
            in line
    assert sum("no setting of kvstore-server" in line for line in srv.log) == 1  # (kvstore-cli's own: not warned)


def test_the_eviction_policy_is_taken_in_any_case() -> None:
    from kvstore.server.cli import config_from_args

    assert config_from_args(["--eviction", "ARC"]).eviction == "arc"  # (as --log-level INFO; was refused)


def test_a_setting_from_the_environment_is_named_with_its_variable(tmp_path: Path, taken_port: int) -> None:
    """The message names the flag; an operator who never typed that flag is told where it came from."""
    missing = tmp_path / "token"
    r = server_run(env={"KVSTORE_TOKEN_FILE": str(missing)})
    assert r.returncode == 2
    assert error_line(r, "kvstore-server") == (f"kvstore-server: --token-file {missing}: No such file or directory "
                                               "(set by KVSTORE_TOKEN_FILE)")
    r = server_run("--token-file", str(missing), env={"KVSTORE_TOKEN_FILE": "/elsewhere"})  # the flag wins: no note
    assert error_line(r, "kvstore-server") == f"kvstore-server: --token-file {missing}: No such file or directory"
    cmd = [str(BIN / "kvstore-server"), "--capacity", "1MiB"]  # a listener's error (raised once serving starts)
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=20,
                       env=clean_env(KVSTORE_HOST="127.0.0.1", KVSTORE_PORT=str(taken_port)))
    assert r.returncode == 2
    assert error_line(r, "kvstore-server").endswith("(set by KVSTORE_PORT)")


@pytest.mark.parametrize(("flag", "value", "expected"), [
    ("--metrics-port", "abc", "a port number 0-65535 or 'off'"),
    ("--port", "http", "a port number 0-65535"),
    ("--max-connections", "many", "a whole number > 0"),
    # 0 started a server that refused everything (--capacity 0: an error naming no flag)
    ("--max-connections", "0", "a whole number > 0"),
    ("--max-batch", "0", "a whole number > 0"),
    ("--capacity", "0", "a size > 0"),
    ("--max-frame-size", "0", "a size > 0"),
    # (taken: GET replies over the clients' 2 GiB were refused by their reader, cutting off the connection)
    ("--max-frame-size", "3GiB", "a size of at most 2.0 GiB (the most a client reads in one reply)"),
    ("--max-block", "0", "a size > 0"),
    ("--redis-ttl", "1.5", "a whole number of seconds 0-2147483647 (0 = never)"),
    # (past Redis's clock: started, then every PUT failed while the tier said "ok")
    ("--redis-ttl", "10000000000000000", "a whole number of seconds 0-2147483647 (0 = never)"),
    ("--busy-poll-us", "fast", "microseconds 0-10000 (0 = off)"),
    ("--idle-timeout", "5m", "a number of seconds >= 0"),
    ("--lease-seconds", "x", "a number of seconds > 0"),
    ("--redis-timeout", "x", "a number of seconds > 0"),
    ("--page-size", "0", "a size >= 4KiB"),  # (was the arena's "page_size must be a positive int": no flag)
    ("--page-size", "3", "a size >= 4KiB"),  # (taken: a byte of page map per byte of block memory)
])
def test_server_flag_errors_say_what_was_expected(flag: str, value: str, expected: str) -> None:
    r = server_run(flag, value)
    assert r.returncode == 2
    # (was "invalid _optional_port value: 'abc'": argparse shows the converter's function name)
    assert f"kvstore-server: error: argument {flag}: expected {expected}, got '{value}'" in r.stderr, r.stderr
    env = "KVSTORE_" + flag[2:].upper().replace("-", "_")
    r = server_run(env={env: value})
    assert f"kvstore-server: error: bad {env}='{value}': expected {expected}, got '{value}'" in r.stderr, r.stderr


def test_server_help_shows_sizes_as_the_flags_take_them() -> None:
    out = subprocess.run([str(BIN / "kvstore-server"), "--help"], capture_output=True, text=True, timeout=20,
                         env=clean_env(COLUMNS="200")).stdout
    assert "KVSTORE_CAPACITY, default 1GiB]" in out and "KVSTORE_PAGE_SIZE, default 64KiB]" in out
    assert "1073741824" not in out


def test_the_server_says_it_is_pre_faulting_before_it_listens() -> None:
    with ServerProcess("--capacity", "8MiB", "--page-size", "1MiB") as srv:
        lines = list(srv.log)
    faulting = [i for i, line in enumerate(lines) if "pre-faulting 8.0 MiB of block memory" in line]
    listening = [i for i, line in enumerate(lines) if "listening on" in line]
    assert faulting and listening and faulting[0] < listening[0], lines
    assert "the server listens when done" in lines[faulting[0]]


# ---------------------------------------------------------------- kvstore-cli


@pytest.mark.parametrize(("args", "expected"), [
    (("--timeout", "abc", "ping"), "argument --timeout: expected a number of seconds > 0, got 'abc'"),
    (("ping", "-c", "0"), "argument --count/-c: expected a whole number >= 1, got '0'"),  # (pinged once)
    (("ping", "-c", "x"), "argument --count/-c: expected a whole number >= 1, got 'x'"),
    (("watch", "-i", "-1"), "argument --interval/-i: expected a number of seconds >= 0, got '-1'"),
    (("-n", "", "stats"), "argument --namespace/-n: expected a namespace of 1..256 characters, got ''"),
    (("get", "00", "-o", "x", "--hex"), "argument --hex: not allowed with argument --output/-o"),  # (was: the file)
])
def test_cli_flag_errors_say_what_was_expected(args: tuple[str, ...], expected: str) -> None:
    r = cli("--addr", dead_addr(), *args)
    assert r.returncode == 2 and expected in r.stderr, r.stderr


def test_an_empty_namespace_is_a_usage_error_against_a_live_server(server: ServerProcess) -> None:
    r = cli("--addr", server.addr, "-n", "", "stats")
    assert r.returncode == 2 and "--namespace" in r.stderr, r.stderr  # (was exit 1, InvalidRequest from HELLO)
    r = cli("--addr", server.addr, "stats", env={"KVSTORE_NAMESPACE": "n" * 257})
    assert r.returncode == 2 and "bad KVSTORE_NAMESPACE=" in error_line(r, "kvstore-cli")
    r = cli("--addr", server.addr, "ping", "-c", "0")
    assert r.returncode == 2 and "PONG" not in r.stdout
    r = subprocess.run([bytes(BIN / "kvstore-cli"), b"--addr", server.addr.encode(), b"-n", b"\xe9t\xe9", b"stats"],
                       capture_output=True, text=True, timeout=30, env=clean_env(), stdin=subprocess.DEVNULL)
    assert r.returncode == 2 and "expected a namespace in UTF-8" in r.stderr, r.stderr  # (was exit 1 from HELLO)


@pytest.mark.parametrize(("command", "closed", "expected"), [
    ("get 01", ">&-", "stdout is closed: give -o FILE"),
    ("get 01 --hex", ">&-", "stdout is closed: give -o FILE"),  # (these exited 0, showing nothing)
    ("get 01 -o -", ">&-", "stdout is closed: give -o FILE"),  # ('-' is stdout: a traceback, in its review)
    ("stats", ">&-", "stdout is closed: stats has nowhere to show its answer"),
    ("put 02 -", "<&-", "stdin is closed: give a FILE"),
    ("flush -n cron", "<&-", "stdin is closed: give --yes to flush without asking"),
])
def test_a_closed_stdin_or_stdout_is_one_line_not_a_traceback(server: ServerProcess, command: str, closed: str,
                                                               expected: str) -> None:
    """(a cron job, a supervisor closing descriptors: AttributeError on None, with a traceback)"""
    assert cli("--addr", server.addr, "put", "01", "/dev/null").returncode == 0  # (get needs a block)
    r = subprocess.run(["bash", "-c", f'"$0" --addr {server.addr} {command} {closed}', str(BIN / "kvstore-cli")],
                       capture_output=True, text=True, timeout=30, env=clean_env())
    assert r.returncode == 1 and error_line(r, "kvstore-cli") == f"kvstore-cli: {expected}"


def test_a_bad_cli_environment_value_names_the_variable_not_python() -> None:
    r = cli("ping", env={"KVSTORE_ADDR": dead_addr(), "KVSTORE_TIMEOUT": "abc"})
    assert r.returncode == 2
    assert error_line(r, "kvstore-cli") == \
        "kvstore-cli: bad KVSTORE_TIMEOUT='abc': expected a number of seconds > 0, got 'abc'"


def test_a_bad_client_threads_variable_is_a_usage_error_and_a_typed_one_in_the_library() -> None:
    """The variable was read when kvstore.client was imported: a traceback from every kvstore-cli
    command (--help too), and a bare ValueError from ``import kvstore.client``."""
    env = {"KVSTORE_ADDR": dead_addr(), "KVSTORE_CLIENT_THREADS": "four"}
    assert cli("--help", env=env).returncode == 0
    r = cli("ping", env=env)
    assert r.returncode == 2
    assert error_line(r, "kvstore-cli") == \
        "kvstore-cli: KVSTORE_CLIENT_THREADS must be a whole number of threads, got 'four'"
    probe = ("import kvstore.client as c, kvstore.errors as e\n"
             "try:\n    c.AsyncKVClient('127.0.0.1:1')\nexcept e.InvalidRequest as exc:\n    print(exc)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=30,
                         env=clean_env(KVSTORE_CLIENT_THREADS="four"))
    assert out.returncode == 0 and "KVSTORE_CLIENT_THREADS must be a whole number" in out.stdout, out.stderr


def test_an_unknown_option_after_the_command_shows_the_commands_usage() -> None:
    r = cli("--addr", dead_addr(), "stats", "--bogus")
    assert r.returncode == 2
    assert r.stderr.startswith("usage: kvstore-cli stats ") and "--json" in r.stderr, r.stderr
    assert r.stderr.strip().endswith("kvstore-cli stats: error: unrecognized arguments: --bogus"), r.stderr


def test_a_key_with_an_odd_number_of_digits_says_so() -> None:
    r = cli("--addr", dead_addr(), "get", "001")
    assert r.returncode == 2
    assert error_line(r, "kvstore-cli") == "kvstore-cli: not a hex key: '001' (3 hex digits, an odd number: each byte takes two)"
    r = cli("--addr", dead_addr(), "get", "0g")
    assert error_line(r, "kvstore-cli") == "kvstore-cli: not a hex key: '0g'"  # not hex at all: nothing to add
    for command in ("put", "exists", "delete"):  # (each before connecting: not a connection error)
        r = cli("--addr", dead_addr(), command, "0g")
        assert r.returncode == 2 and error_line(r, "kvstore-cli") == "kvstore-cli: not a hex key: '0g'", command


def test_a_missing_ca_file_is_named_with_its_flag(tmp_path: Path) -> None:
    missing = tmp_path / "ca.pem"
    r = cli("--addr", dead_addr(), "--tls-ca", str(missing), "ping")
    assert r.returncode == 1
    assert error_line(r, "kvstore-cli") == \
        f"kvstore-cli: --tls-ca {missing}: cannot load it as a CA file (No such file or directory)"


def test_a_cli_setting_from_the_environment_is_named_with_its_variable(tmp_path: Path) -> None:
    missing = tmp_path / "ca.pem"
    for given in ((), ("--tls",)):  # (--tls is a flag of its own, not --tls-ca abbreviated)
        r = cli("--addr", dead_addr(), *given, "ping", env={"KVSTORE_TLS_CA": str(missing)})
        assert r.returncode == 1
        assert error_line(r, "kvstore-cli").endswith("(No such file or directory) (set by KVSTORE_TLS_CA)")


def test_a_missing_token_file_is_named_with_its_flag(tmp_path: Path) -> None:
    missing = tmp_path / "tokens"
    r = cli("--addr", dead_addr(), "--token-file", str(missing), "stats")
    assert r.returncode == 1  # (was "No such file or directory: PATH": which file, for what?)
    assert error_line(r, "kvstore-cli") == f"kvstore-cli: --token-file {missing}: No such file or directory"


# ---------------------------------------------------------------- examples/pd_disaggregation.py


def test_the_pd_example_without_a_server_says_so_in_one_line() -> None:
    pytest.importorskip("torch")
    addr = dead_addr()
    r = subprocess.run([sys.executable, str(EXAMPLE), "decode", "--server", addr, "--prompt", "hello"],
                       capture_output=True, text=True, timeout=120, env=clean_env())
    assert r.returncode == 1 and r.stdout == ""
    line = error_line(r, "decode")  # (was a 34-line traceback)
    assert f"no kvstore server answered at {addr}" in line and "kvstore-server" in line and "--server" in line


def test_an_option_is_never_taken_for_a_longer_one_it_begins() -> None:
    """``--token S`` was taken for ``--token-file S``: a token typed on the command line ended up
    read as a path (and echoed as one)."""
    for r, prog in ((cli("ping", "--token", "s3cret"), "kvstore-cli ping"), (server_run("--token", "s3cret"), "kvstore-server")):
        assert r.returncode == 2
        assert r.stderr.splitlines()[-1] == f"{prog}: error: unrecognized arguments: --token s3cret"


def test_pointed_at_an_http_service_the_cli_says_it_is_not_a_kvstore_server() -> None:
    """`ping` at the metrics port printed "ProtocolError: bad magic b'HT': not a kvstore frame"."""
    import socketserver
    import threading

    class Http400(socketserver.BaseRequestHandler):
        def handle(self) -> None:  # what an HTTP server says to bytes that are no request
            self.request.recv(65536)
            self.request.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")

    httpd = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Http400)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        addr = f"127.0.0.1:{httpd.server_address[1]}"
        r = cli("--addr", addr, "ping")
        assert r.returncode == 1
        assert error_line(r, "kvstore-cli") == (f"kvstore-cli: {addr} does not answer in kvstore's protocol (bad magic "
                                                "b'HT': not a kvstore frame): another service, such as the metrics port?")
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_the_server_names_an_ipv6_host_in_brackets() -> None:
    """(fix review) The server logged ``listening on ::1:7600`` (and ``http://::1:9600/metrics``), a
    form clients refuse, as ambiguous, since they take only ``[::1]:7600``. (Tests bind 127.0.0.1 only:
    the formatting is checked here.)"""
    from kvstore.sockets import bracketed as _shown

    assert (_shown("::1"), _shown("fe80::1%eth0"), _shown("127.0.0.1"), _shown("localhost")) == (
        "[::1]", "[fe80::1%eth0]", "127.0.0.1", "localhost")
