"""Server configuration: one frozen dataclass, and the size parser the CLI uses.

Every field has a command-line flag and a ``KVSTORE_<NAME>`` environment
variable (see :mod:`kvstore.server.cli`); new features add a field here.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

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


def format_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
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
    drain_seconds: float = 10.0
    log_level: str = "info"
    max_pending_out: int = 64 << 20  # stop reading a connection whose unsent replies exceed this
    prefault: bool = True

    def replace(self, **changes: object) -> ServerConfig:
        return dataclasses.replace(self, **changes)
