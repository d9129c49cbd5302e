"""Server configuration: one frozen dataclass, and the size parser the CLI uses.

Every field has a command-line flag and a ``KVSTORE_<NAME>`` environment
variable (see :mod:`kvstore.server.cli`); new features add a field here.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence, TypeVar

from .protocol import Limits

T = TypeVar("T")

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "ki": 1024, "kib": 1024, "mi": 1024**2, "mib": 1024**2, "gi": 1024**3, "gib": 1024**3, "ti": 1024**4, "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int) -> int:
    """``"512MiB"`` -> 536870912; ``"4GiB"``, ``"1.5G"`` (decimal), ``"65536"`` (bytes)."""
    if isinstance(text, int):
        return text
    m = _SIZE_RE.match(text)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise ValueError(f"not a size: {text!r} (use e.g. 65536, 512MiB, 4GiB, 1.5GB)")
    return int(float(m.group(1)) * _UNITS[unit])


def parse_bool(text: str) -> bool:
    """``1/true/yes/on`` or ``0/false/no/off`` (environment switches); ValueError otherwise."""
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {text!r}")


def parse_number(text: str, kind: Callable[[str], T], ok: Callable[[T], bool], expected: str) -> T:
    """``kind(text)`` when ``ok`` accepts it, else ``argparse.ArgumentTypeError`` saying what was
    expected (both CLIs' converters: one that lets ValueError out makes argparse print its own
    function's name, ``invalid _port value``). NaN fails every comparison, so no check lets it in."""
    try:
        value = kind(text)
    except ValueError:
        pass
    else:
        if ok(value):
            return value
    raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")


def note_env(message: str, argv: Sequence[str], flags: Iterable[str], prefix: str = "KVSTORE_") -> str:
    """``message`` plus the environment variables behind the ``flags`` it names that ``argv`` does not
    give: an operator who never typed ``--token-file`` learns that ``KVSTORE_TOKEN_FILE`` set it."""
    given = [a.split("=", 1)[0] for a in argv if a.startswith("--") and len(a) > 2]
    named = [f for f in dict.fromkeys(re.findall(r"--[a-z][a-z-]*", message))  # (argparse takes --token for
             if f in flags and not any(f == g or (g not in flags and f.startswith(g)) for g in given)]  # --token-file)
    names = [n for n in (prefix + f[2:].replace("-", "_").upper() for f in named) if os.environ.get(n)]
    return f"{message} (set by {', '.join(names)})" if names else message


def format_size(n: float) -> str:
    """``1536`` -> ``1.5 KiB``; the unit is picked after rounding (1023.96 is ``1.0 KiB``, not ``1024 B``)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        shown = f"{n:.0f}" if unit == "B" else f"{n:.1f}"
        if abs(float(shown)) < 1024 or unit == "TiB":
            return f"{shown} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 7600
    capacity: int = 1 << 30
    eviction: str = "lru"
    page_size: int = 64 << 10
    lease_seconds: float = 30.0
    # A LOOKUP's own lease_ms is cut to this (leased blocks cannot be evicted); None: 600 s, or
    # lease_seconds where that is longer (a deployment that raised the default keeps starting).
    max_lease_seconds: float | None = None
    drain_seconds: float = 10.0
    log_level: str = "info"
    max_pending_out: int = 64 << 20  # stop reading a connection whose unsent replies exceed this
    prefault: bool = True
    busy_poll_us: int = 200  # keep polling this long after a request instead of sleeping (server/poll.py); 0 = off
    # Backing tier (kvstore.server.redis_tier): at most one of redis / redis_cluster.
    redis: str | None = None  # redis://[:password@]host:port/db or rediss://...
    redis_cluster: str | None = None  # "host:port,..." or "redis[s]://[[user]:password@]host:port,..." (cluster seeds)
    redis_mode: str = "write-through"  # or "write-behind"
    redis_queue_bytes: int = 256 << 20  # write-behind queue bound; puts wait while it is full
    redis_ttl: int = 0  # seconds until a stored block expires in Redis; 0 = never
    redis_timeout: float = 2.0  # socket timeout; short, so a dead Redis cannot stall the server
    # Operations and hardening (docs/operations.md).
    metrics_port: int | None = None  # HTTP /metrics + /healthz on `host`; None = off, 0 = any free port
    log_format: str = "kv"  # "kv" (key=value) or "json", one line per event
    token_file: str | None = None  # shared-secret tokens, `TOKEN` or `NAMESPACE_GLOB:TOKEN` per line
    tls_cert: str | None = None  # PEM certificate chain; TLS needs both cert and key
    tls_key: str | None = None
    idle_timeout: float = 300.0  # close a connection that sent nothing and awaits nothing this long; 0 = never
    frame_timeout: float = 60.0  # drop a connection whose started frame (or reply) does not complete this long; 0 = never
    max_connections: int = 1024  # connections over the cap get an error reply and are closed
    max_batch: int = 16384  # keys per request
    max_frame_size: int = 2 << 30  # payload bytes per frame
    max_block: int = 1 << 30  # bytes per block
    # Same-host transport (docs/shm.md): a Unix socket, and the arena shared over it as a memfd.
    unix: str | None = None  # path of a Unix socket to listen on too (mode 0660; removed on shutdown)
    shm: bool = True  # offer the block arena as shared memory on the Unix socket (--no-shm: never)

    def lease_cap(self) -> float:
        """The longest lease a client gets (``max_lease_seconds`` with its default filled in)."""
        if self.max_lease_seconds is not None:
            return self.max_lease_seconds
        return max(600.0, self.lease_seconds)

    def check(self) -> None:
        """Refuse settings that contradict each other (ValueError naming the flags)."""
        if self.lease_seconds > self.lease_cap():
            raise ValueError(f"--lease-seconds {self.lease_seconds:g} is over --max-lease-seconds {self.lease_cap():g}")
        if self.metrics_port and self.metrics_port == self.port:
            raise ValueError(f"--metrics-port {self.metrics_port} is --port too: give each its own")
        if self.redis_mode != "write-through" and not (self.redis or self.redis_cluster):
            raise ValueError(f"--redis-mode {self.redis_mode} needs a Redis tier (--redis or --redis-cluster)")

    def idle_redis_flags(self) -> list[str]:
        """The Redis tier's settings changed from their defaults on a server without a tier (a
        forgotten --redis, say): they do nothing, which the server says at start."""
        if self.redis or self.redis_cluster:
            return []
        default = ServerConfig()
        return ["--" + name.replace("_", "-") for name in ("redis_queue_bytes", "redis_ttl", "redis_timeout")
                if getattr(self, name) != getattr(default, name)]

    def limits(self) -> Limits:
        """The codec limits these settings ask for; the meta limit grows with the batch limit."""
        return Limits(max_meta=max(4 << 20, self.max_batch * 256), max_payload=self.max_frame_size,
                      max_batch=self.max_batch)

    def replace(self, **changes: Any) -> ServerConfig:
        return dataclasses.replace(self, **changes)
