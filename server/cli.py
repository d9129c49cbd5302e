"""``kvstore-server``: command-line flags (each also a ``KVSTORE_*`` variable) -> a running server.

The only place that exits the process; the library code raises.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from typing import Any, Callable, Sequence

from kvstore import __version__
from kvstore.config import ServerConfig, parse_size
from kvstore.eviction import POLICIES

from .app import Server

ENV_PREFIX = "KVSTORE_"


def _env_default(dest: str, default: Any, convert: Callable[[str], Any]) -> Any:
    raw = os.environ.get(ENV_PREFIX + dest.upper())
    if raw is None or raw == "":
        return default
    try:
        return convert(raw)
    except ValueError as exc:
        raise SystemExit(f"kvstore-server: bad {ENV_PREFIX}{dest.upper()}={raw!r}: {exc}") from None


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    d = ServerConfig()
    p = argparse.ArgumentParser(
        prog="kvstore-server",
        description="KV-cache block store daemon. Every flag can also be set as KVSTORE_<FLAG> "
                    "(e.g. KVSTORE_CAPACITY=4GiB); flags win over the environment.",
    )

    def add(flag: str, convert: Callable[[str], Any], default: Any, help: str, **kw: Any) -> None:
        dest = flag.lstrip("-").replace("-", "_")
        p.add_argument(flag, dest=dest, type=convert, default=_env_default(dest, default, convert),
                       help=f"{help} [env {ENV_PREFIX}{dest.upper()}, default {default}]", **kw)

    add("--host", str, d.host, "address to bind")
    add("--port", int, d.port, "TCP port (0 = any free port)")
    add("--capacity", _size, d.capacity, "bytes of block memory, e.g. 512MiB, 4GiB")
    add("--eviction", str, d.eviction, "eviction policy", choices=sorted(POLICIES))
    add("--page-size", _size, d.page_size, "allocation unit of the block arena")
    add("--lease-seconds", float, d.lease_seconds, "how long a pinned prefix lookup protects its blocks")
    add("--drain-seconds", float, d.drain_seconds, "how long SIGTERM waits for in-flight requests")
    add("--log-level", str.lower, d.log_level, "log level", choices=["debug", "info", "warning", "error"])
    p.add_argument("--version", action="version", version=f"kvstore-server {__version__}")
    return p


def config_from_args(argv: Sequence[str] | None = None) -> ServerConfig:
    args = build_parser().parse_args(argv)
    return ServerConfig(**{k: v for k, v in vars(args).items()})


def _run(coro: Any) -> None:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux/macOS
        asyncio.run(coro)
    else:
        uvloop.run(coro)


def main(argv: Sequence[str] | None = None) -> int:
    config = config_from_args(argv)
    logging.basicConfig(level=config.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        server = Server(config)
    except (ValueError, OSError, MemoryError) as exc:
        print(f"kvstore-server: {exc}", file=sys.stderr)
        return 2
    try:
        _run(server.serve_forever())
    except OSError as exc:
        print(f"kvstore-server: cannot listen on {config.host}:{config.port}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
