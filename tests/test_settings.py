"""How the server's and kvstore-cli's settings read their values, in process: sizes, switches,
bounds, and empty environment variables. (What they print when a value is wrong is
test_cli_messages'; these hold the edges a mutation review found no test at.)"""

from __future__ import annotations

import pytest

from kvstore.client.cli import build_parser as cli_parser
from kvstore.config import format_size, parse_bool, parse_size
from kvstore.server.cli import _misspelt_env, build_parser, config_from_args


@pytest.fixture(autouse=True)
def no_settings_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Defaults are read with no KVSTORE_* variable set (a developer's shell may have some)."""
    import os

    for name in [n for n in os.environ if n.startswith("KVSTORE_")]:
        monkeypatch.delenv(name)


@pytest.mark.parametrize("text, size", [
    ("65536", 65536), ("1kB", 1000), ("1k", 1000), ("1MB", 10**6), ("1.5G", 1_500_000_000), ("2TB", 2 * 10**12),
    ("64KiB", 65536), ("1ki", 1024), ("512MiB", 512 << 20), ("1.5GiB", 3 << 29), ("1TiB", 1 << 40), (" 4 gib ", 4 << 30),
])
def test_sizes_are_decimal_without_the_i_and_binary_with_it(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("n, text", [
    (0, "0 B"), (1023, "1023 B"), (1023.96, "1.0 KiB"), (1536, "1.5 KiB"), ((1 << 20) - 1, "1.0 MiB"),
    ((1 << 20) - 60_000, "965.4 KiB"), (3 << 30, "3.0 GiB"), (5 << 50, "5120.0 TiB"), (-2048, "-2.0 KiB"),
])
def test_sizes_are_shown_in_the_unit_their_rounded_value_fits(n: float, text: str) -> None:
    assert format_size(n) == text  # (just under 1 MiB read "1024.0 KiB")


@pytest.mark.parametrize("text, value", [
    *[(t, True) for t in ("1", "true", "yes", "on", "ON", " True ")],
    *[(t, False) for t in ("0", "false", "no", "off", "Off", " NO ")],
])
def test_switches_take_the_usual_words(text: str, value: bool) -> None:
    assert parse_bool(text) is value


def test_the_largest_frame_a_client_reads_is_a_frame_size_the_server_takes() -> None:
    assert config_from_args(["--max-frame-size", "2GiB"]).max_frame_size == 2 << 30  # (the default, written out)
    with pytest.raises(SystemExit) as refused:
        config_from_args(["--max-frame-size", str((2 << 30) + 1)])
    assert refused.value.code == 2


@pytest.mark.parametrize("flag, edge, beyond", [("--port", "65535", "65536"), ("--busy-poll-us", "10000", "10001"),
                                                ("--page-size", "4096", "4095")])
def test_a_bound_is_taken_and_one_past_it_refused(flag: str, edge: str, beyond: str) -> None:
    dest = flag[2:].replace("-", "_")
    assert getattr(config_from_args([flag, edge]), dest) == int(edge)
    with pytest.raises(SystemExit):
        config_from_args([flag, beyond])


def test_an_empty_server_variable_means_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    """A line ``KVSTORE_CAPACITY=`` in an env file: the default, not a usage error."""
    default = config_from_args([])
    for name in ("CAPACITY", "PORT", "EVICTION", "NO_SHM"):
        monkeypatch.setenv(f"KVSTORE_{name}", "")
    assert config_from_args([]) == default


def test_the_clients_variables_are_no_misspelt_server_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Server and kvstore-cli may share an environment: KVSTORE_TIMEOUT is the CLI's, not a
    misspelt KVSTORE_IDLE_TIMEOUT (their names are that close)."""
    for name in ("ADDR", "NAMESPACE", "TIMEOUT", "TLS", "TLS_CA", "TLS_SERVER_NAME", "CLIENT_THREADS"):
        monkeypatch.setenv(f"KVSTORE_{name}", "1")
    assert _misspelt_env(build_parser()) == []
    monkeypatch.setenv("KVSTORE_IDLE_TIMEOT", "5")
    assert _misspelt_env(build_parser()) == [
        "environment variable KVSTORE_IDLE_TIMEOT is no setting of kvstore-server (ignored): KVSTORE_IDLE_TIMEOUT?"]


def test_cli_empty_variables_mean_unset_and_its_edges_are_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("TIMEOUT", "NAMESPACE", "ADDR", "TLS"):
        monkeypatch.setenv(f"KVSTORE_{name}", "")
    args = cli_parser().parse_args(["watch", "-i", "0", "-c", "1"])
    assert (args.timeout, args.namespace, args.addr, args.tls, args.interval) == (10.0, "default", "127.0.0.1:7600",
                                                                                 False, 0.0)
    assert cli_parser().parse_args(["--namespace", "n" * 256, "stats"]).namespace == "n" * 256  # (as HELLO)
    with pytest.raises(SystemExit):
        cli_parser().parse_args(["--namespace", "n" * 257, "stats"])


@pytest.mark.parametrize("flag", ["--lease-seconds", "--max-lease-seconds", "--redis-timeout"])
def test_seconds_that_must_be_positive_refuse_zero(flag: str) -> None:
    """A lease of 0 s would pin nothing; a Redis socket timeout of 0 is a non-blocking socket, on
    which every Redis call fails."""
    assert getattr(config_from_args([flag, "0.5"]), flag[2:].replace("-", "_")) == 0.5
    with pytest.raises(SystemExit):
        config_from_args([flag, "0"])


def test_cli_reads_its_token_file_from_the_environment_and_ping_pings_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSTORE_TOKEN_FILE", "/etc/kvstore/token")
    args = cli_parser().parse_args(["ping"])
    assert (args.token_file, args.count) == ("/etc/kvstore/token", 1)


@pytest.mark.parametrize("text", ["00112233445566778899aabbccddeeff", "0x00112233445566778899AABBCCDDEEFF",
                                  "00:11:22:33:44:55:66:77:88:99:aa:bb:cc:dd:ee:ff",
                                  " 0011 2233 4455 6677 8899 aabb ccdd eeff "])
def test_cli_keys_are_hex_with_or_without_0x_colons_and_spaces(text: str) -> None:
    from kvstore.client.cli import parse_key

    assert parse_key(text) == bytes.fromhex("00112233445566778899aabbccddeeff")


def test_cli_tls_without_a_ca_file_verifies_against_the_system_cas(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvstore.client.cli import _tls

    assert _tls(cli_parser().parse_args(["--tls", "stats"])) is True
    assert _tls(cli_parser().parse_args(["stats"])) is None
    monkeypatch.setenv("KVSTORE_TLS", "on")
    assert _tls(cli_parser().parse_args(["stats"])) is True


def test_cli_percentages() -> None:
    from kvstore.client.cli import _pct

    assert (_pct(1, 4), _pct(0, 4), _pct(3, 3), _pct(0, 0)) == ("25.0%", "0.0%", "100.0%", "-")


def test_the_documented_defaults() -> None:
    """README, docs/operations.md and --help give these: a change is one for every operator."""
    c = config_from_args([])
    assert (c.host, c.port, c.capacity, c.eviction, c.drain_seconds, c.metrics_port) == \
        ("127.0.0.1", 7600, 1 << 30, "lru", 10.0, None)


def test_the_meta_limit_grows_with_the_batch_limit() -> None:
    """A batch of --max-batch keys of 128 bytes fits a request's meta (msgpack: ~130 bytes a key)."""
    assert config_from_args([]).limits().max_meta == 4 << 20
    assert config_from_args(["--max-batch", "65536"]).limits().max_meta == 65536 * 256  # (16 MiB)


def test_the_defaults_in_the_operations_guide_are_the_servers() -> None:
    """Each row of docs/operations.md's flag table with a value as its default names the server's."""
    import re
    from pathlib import Path

    guide = (Path(__file__).resolve().parents[1] / "docs" / "operations.md").read_text()
    config, checked = config_from_args([]), []
    for flag, default in re.findall(r"^\| `(--[a-z-]+)[^`]*` \| `([^`]+)` \|", guide, re.M):
        value = getattr(config, flag[2:].replace("-", "_"))
        if isinstance(value, str):
            assert value == default, flag
        else:
            assert value == (parse_size(default) if default[-1] == "B" else float(default)), (flag, default, value)
        checked.append(flag)
    assert len(checked) >= 10 and "--idle-timeout" in checked, checked
