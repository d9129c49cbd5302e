"""``kvstore-server``: command-line flags (each also a ``KVSTORE_*`` variable) -> a running server.

The only place that exits the process; the library code raises.
"""

from __future__ import annotations

import argparse
import asyncio
import difflib
import logging
import os
import signal
import sys
from typing import Any, Callable, Sequence

from kvstore import __version__
from kvstore.config import ServerConfig, format_size, note_env, parse_bool, parse_number, parse_size
from kvstore.messages import DEFAULT_LIMITS
from kvstore.eviction import POLICIES

from .app import STOP_SIGNALS, Server, StartupError
from .logs import setup_logging

ENV_PREFIX = "KVSTORE_"


def _env_default(p: argparse.ArgumentParser, dest: str, default: Any, convert: Callable[[str], Any],
                 choices: Sequence[Any] | None = None) -> Any:
    """The flag's default from ``KVSTORE_<DEST>``, checked as the flag is (argparse checks only the command line)."""
    name = ENV_PREFIX + dest.upper()
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = convert(raw)
    except (ValueError, argparse.ArgumentTypeError) as exc:
        p.error(f"bad {name}={raw!r}: {exc}")
    if choices is not None and value not in choices:
        p.error(f"bad {name}={raw!r}: invalid choice (choose from {', '.join(map(repr, choices))})")
    return value


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive_size(text: str) -> int:
    """A size that must be > 0: with 0 the server would start and refuse everything (or, for
    --capacity, fail with an error that names no flag)."""
    size = _size(text)
    if size <= 0:
        raise argparse.ArgumentTypeError(f"expected a size > 0, got {text!r}")
    return size


def _frame_size(text: str) -> int:
    """At most the clients' own payload limit (``Limits.max_payload``, 2 GiB): a server allowing
    more sent GET replies a client's reader refuses, cutting off every request on the connection."""
    size = _positive_size(text)
    if size > DEFAULT_LIMITS.max_payload:
        raise argparse.ArgumentTypeError(f"expected a size of at most {format_size(DEFAULT_LIMITS.max_payload)} "
                                         f"(the most a client reads in one reply), got {text!r}")
    return size


def _page_size(text: str) -> int:
    """At least 4 KiB, the memory's own page: each page costs the store bookkeeping (``--page-size 1``
    was taken: a byte of page map per page, as much again as the block memory)."""
    size = _size(text)
    if size < 4096:
        raise argparse.ArgumentTypeError(f"expected a size >= 4KiB, got {text!r}")
    return size


def _size_text(n: int) -> str:
    """A byte count as --capacity takes it: 1073741824 -> ``1GiB``, 65536 -> ``64KiB``; others as they are."""
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return str(n)


def _port(text: str) -> int:
    # --port 99999 used to start a server, listening on some other port
    return parse_number(text, int, lambda v: 0 <= v <= 65535, "a port number 0-65535")


def _optional_port(text: str) -> int | None:
    """A TCP port, or None for ``off``/empty (the listener is not started)."""
    if text.strip().lower() in ("", "off", "none"):
        return None
    return parse_number(text, int, lambda v: 0 <= v <= 65535, "a port number 0-65535 or 'off'")


def _count(text: str) -> int:
    return parse_number(text, int, lambda v: v >= 0, "a whole number >= 0")


#: The longest --redis-ttl (68 years). Redis refuses every ``SET ... EX`` whose expiry overflows its
#: clock in milliseconds, as it refuses a negative one: every PUT would fail while the tier looks up.
MAX_TTL = 2**31 - 1


def _ttl(text: str) -> int:
    return parse_number(text, int, lambda v: 0 <= v <= MAX_TTL, f"a whole number of seconds 0-{MAX_TTL} (0 = never)")


def _positive_count(text: str) -> int:
    return parse_number(text, int, lambda v: v > 0, "a whole number > 0")


def _poll_window(text: str) -> int:
    """Microseconds of busy polling: 0 (off) up to 10 ms; a longer window only burns a core longer."""
    return parse_number(text, int, lambda v: 0 <= v <= 10_000, "microseconds 0-10000 (0 = off)")


def _policy(text: str) -> str:
    text = text.lower()  # (as --log-level: ARC is arc)
    if text not in POLICIES:
        raise argparse.ArgumentTypeError(f"unknown eviction policy {text!r}; choose one of {', '.join(POLICIES)}")
    return text


def _seconds(text: str) -> float:
    return parse_number(text, float, lambda v: v >= 0, "a number of seconds >= 0")


def _lease(text: str) -> float:
    return parse_number(text, float, lambda v: 0 < v < float("inf"), "a number of seconds > 0")


def _timeout(text: str) -> float:
    # a socket timeout of 0 is a non-blocking socket: every Redis call would fail
    return parse_number(text, float, lambda v: v > 0, "a number of seconds > 0")


def build_parser() -> argparse.ArgumentParser:
    d = ServerConfig()
    p = argparse.ArgumentParser(
        prog="kvstore-server",
        description="KV-cache block store daemon. Every flag can also be set as KVSTORE_<FLAG> "
                    "(e.g. KVSTORE_CAPACITY=4GiB); flags win over the environment.",
        allow_abbrev=False,  # (`--token S` would be taken for --token-file, and S echoed in its error)
    )

    def add(flag: str, convert: Callable[[str], Any], default: Any, help: str, **kw: Any) -> None:
        dest = flag.lstrip("-").replace("-", "_")
        env_default = _env_default(p, dest, default, convert, kw.get("choices"))
        shown = _size_text(default) if convert in (_size, _positive_size, _page_size, _frame_size) else \
            "unset" if default is None else default
        p.add_argument(flag, dest=dest, type=convert, default=env_default,
                       help=f"{help} [env {ENV_PREFIX}{dest.upper()}, default {shown}]", **kw)

    add("--host", str, d.host, "address to bind")
    add("--port", _port, d.port, "TCP port (0 = any free port)")
    add("--capacity", _positive_size, d.capacity, "bytes of block memory, e.g. 512MiB, 4GiB")
    add("--eviction", _policy, d.eviction, f"eviction policy: {' or '.join(POLICIES)}")
    add("--page-size", _page_size, d.page_size, "allocation unit of the block arena")
    add("--lease-seconds", _lease, d.lease_seconds, "how long a pinned prefix lookup protects its blocks")
    add("--max-lease-seconds", _lease, d.max_lease_seconds,
        "the longest lease a client may ask for (longer ones are cut to it; leased blocks cannot be evicted); "
        "unset: 600, or --lease-seconds if longer")
    add("--busy-poll-us", _poll_window, d.busy_poll_us,
        "after each request, poll without sleeping for this many microseconds (lower latency, more CPU; 0 = off)")
    add("--drain-seconds", _seconds, d.drain_seconds, "how long SIGTERM waits for in-flight requests")
    add("--log-level", str.lower, d.log_level, "log level", choices=["debug", "info", "warning", "error"])
    add("--redis", str, d.redis, "back the store with Redis: redis://[:password@]host:port/db (or rediss://)")
    add("--redis-cluster", str, d.redis_cluster, "back the store with a Redis Cluster: host:port[,host:port...], or "
        "redis://[[user]:password@]host:port[,host:port...] (rediss:// for TLS, e.g. ?ssl_ca_certs=FILE)")
    add("--redis-mode", str, d.redis_mode, "acknowledge puts after Redis has them, or after memory",
        choices=["write-through", "write-behind"])
    add("--redis-queue-bytes", _size, d.redis_queue_bytes, "write-behind queue bound (puts wait while full)")
    add("--redis-ttl", _ttl, d.redis_ttl, "seconds until a block stored in Redis expires (0 = never)")
    add("--redis-timeout", _timeout, d.redis_timeout, "Redis socket timeout in seconds")
    # operations and hardening (docs/operations.md)
    add("--metrics-port", _optional_port, d.metrics_port,
        "serve /metrics, /readyz, /healthz, /livez over HTTP on --host at this port (0 = any free port; off if unset)")
    add("--log-format", str.lower, d.log_format, "one line per event: key=value or JSON", choices=["kv", "json"])
    add("--token-file", str, d.token_file, "require a token: file of TOKEN or NAMESPACE_GLOB:TOKEN lines")
    add("--tls-cert", str, d.tls_cert, "serve TLS with this PEM certificate (chain)")
    add("--tls-key", str, d.tls_key, "the PEM private key of --tls-cert")
    add("--idle-timeout", _seconds, d.idle_timeout, "close a connection silent for this long (0 = never)")
    add("--frame-timeout", _seconds, d.frame_timeout,
        "drop a connection whose frame is incomplete, or whose reply does not move, this long (0 = never)")
    add("--max-connections", _positive_count, d.max_connections, "refuse connections over this many")
    add("--max-pending-out", _size, d.max_pending_out, "stop reading a connection whose unsent replies exceed this")
    add("--max-batch", _positive_count, d.max_batch, "most keys in one request")
    add("--max-frame-size", _frame_size, d.max_frame_size, "most payload bytes in one frame (at most 2GiB)")
    add("--max-block", _positive_size, d.max_block, "most bytes in one block")
    # same-host transport (docs/shm.md)
    add("--unix", str, d.unix, "also listen on this Unix socket path (mode 0660, removed on exit); "
        "same-host clients use unix:PATH and map the block arena over it")
    no_shm = _env_default(p, "no_shm", not d.shm, parse_bool)
    p.add_argument("--no-shm", dest="shm", action="store_false", default=not no_shm,
                   help="never offer the block arena as shared memory on the Unix socket "
                        f"[env {ENV_PREFIX}NO_SHM=1, default: offered when --unix is set]")
    p.add_argument("--version", action="version", version=f"kvstore-server {__version__}")
    return p


def config_from_args(argv: Sequence[str] | None = None) -> ServerConfig:
    args = build_parser().parse_args(argv)
    return ServerConfig(**{k: v for k, v in vars(args).items()})


async def _serve(server: Server) -> None:
    try:
        await server.serve_forever()
    finally:  # stopped: a stop signal repeated now (a supervisor's second SIGTERM) must not kill the exit
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)


def _run(coro: Any) -> None:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux/macOS
        asyncio.run(coro)
    else:
        uvloop.run(coro)


def _say(exc: BaseException, argv: Sequence[str]) -> None:
    """One line on stderr; a flag set by its ``KVSTORE_*`` variable says so."""
    print(f"kvstore-server: {note_env(str(exc), argv, build_parser()._option_string_actions)}", file=sys.stderr)


#: Variables of kvstore-cli and the client, which may share an environment with the server.
_CLIENT_ENV = {ENV_PREFIX + n for n in ("ADDR", "NAMESPACE", "TIMEOUT", "TLS", "TLS_CA", "TLS_SERVER_NAME",
                                        "CLIENT_THREADS", "SHM_COPY_THREADS")}


def _misspelt_env(parser: argparse.ArgumentParser) -> list[str]:
    """A warning for each ``KVSTORE_*`` variable that no flag reads but one's nearly does
    (``KVSTORE_CAPACTY``): ignored, the setting it was meant for silently kept its default.
    """
    known = {ENV_PREFIX + o[2:].replace("-", "_").upper() for a in parser._actions for o in a.option_strings
             if o.startswith("--")}
    out = []
    for name in sorted(os.environ):
        if name.startswith(ENV_PREFIX) and name not in known and name not in _CLIENT_ENV:
            near = difflib.get_close_matches(name, known, n=1, cutoff=0.85)
            if near:
                out.append(f"environment variable {name} is no setting of kvstore-server (ignored): {near[0]}?")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    config = config_from_args(argv)
    setup_logging(config.log_level, config.log_format)
    for line in _misspelt_env(build_parser()):
        logging.getLogger("kvstore.server").warning(line)
    if idle := config.idle_redis_flags():  # (named as given: a flag, or its KVSTORE_* variable)
        message = f"{', '.join(idle)} set without a Redis tier (--redis or --redis-cluster): no effect"
        logging.getLogger("kvstore.server").warning(note_env(message, argv, build_parser()._option_string_actions))
    # A setting that cannot work (a file, an address, the memory) exits 2, as a bad flag does;
    # a StartupError's message names the flag and the value (and the variable it came from).
    try:
        server = Server(config)
    except (StartupError, ValueError, OSError, MemoryError) as exc:
        _say(exc, argv)
        return 2
    except KeyboardInterrupt:  # Ctrl-C while the arena is pre-faulted: a line, not a traceback
        print("kvstore-server: interrupted before it listened", file=sys.stderr)
        return 130
    try:
        _run(_serve(server))
    except StartupError as exc:  # a listener
        _say(exc, argv)
        return 2
    # Acknowledged write-behind blocks that never reached Redis (logged): a supervisor should see
    # a failed stop, not a clean one.
    return 1 if server.unwritten_blocks else 0


if __name__ == "__main__":
    sys.exit(main())
