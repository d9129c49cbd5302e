"""Structured logs: one line per event, ``key=value`` (default) or JSON (``--log-format json``).

Every line carries ``ts`` (UTC, ISO 8601), ``level``, ``logger`` and ``msg``;
a call may add fields with ``extra={"event": "idle_timeout", "peer": ...}``.
A traceback becomes one escaped ``exc`` field, so a log shipper never splits
an event over lines. The server never logs payload bytes or tokens: messages
carry sizes, counts, peers and namespaces only.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any, TextIO

FORMATS = ("kv", "json")

# Attributes every LogRecord has; anything else on a record came from ``extra=``.
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime", "taskName"}


def _timestamp(record: logging.LogRecord) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"


def record_fields(record: logging.LogRecord, formatter: logging.Formatter) -> dict[str, Any]:
    """The ordered fields of one event."""
    fields: dict[str, Any] = {
        "ts": _timestamp(record),
        "level": record.levelname.lower(),
        "logger": record.name,
        "msg": record.getMessage(),
    }
    for name, value in vars(record).items():
        if name not in _STANDARD and not name.startswith("_"):
            fields[name] = value
    if record.exc_info:
        fields["exc"] = formatter.formatException(record.exc_info)
    return fields


def _kv_value(value: Any) -> str:
    """Bare when safe, else double-quoted with backslash escapes (logfmt). Characters that are not
    printable (line breaks of any kind, terminal escapes: a peer's namespace is logged) are escaped
    as Python writes them, ``\\n``, ``\\x1b``, ``\\u2028``."""
    text = value if isinstance(value, str) else json.dumps(value, default=str) if value is not None else "null"
    if text and text.isprintable() and not any(c in text for c in ' ="\\'):
        return text
    escaped = text.replace("\\", "\\\\").replace('"', '\\"')
    if not escaped.isprintable():
        escaped = "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in escaped)
    return '"' + escaped + '"'


class KeyValueFormatter(logging.Formatter):
    """``ts=... level=info logger=kvstore.server.app msg="..." key=value``"""

    def format(self, record: logging.LogRecord) -> str:
        return " ".join(f"{k}={_kv_value(v)}" for k, v in record_fields(record, self).items())


class JsonFormatter(logging.Formatter):
    """One JSON object per line."""

    def format(self, record: logging.LogRecord) -> str:
        return json.dumps(record_fields(record, self), default=str)  # (ASCII: a peer's U+2028 or U+009B escaped)


def setup_logging(level: str = "info", fmt: str = "kv", stream: TextIO | None = None) -> None:
    """Send every log record to ``stream`` (stderr) in ``fmt``, replacing earlier handlers.

    Raises:
        ValueError: unknown ``fmt``.
    """
    if fmt not in FORMATS:
        raise ValueError(f"log format must be one of {', '.join(FORMATS)}, not {fmt!r}")
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else KeyValueFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())


__all__ = ["FORMATS", "JsonFormatter", "KeyValueFormatter", "setup_logging"]
