"""Warnings that could come once per request, logged at most once per kind every few seconds.

A hot corrupted block read again and again, or a server that stopped answering every request
of every scheduling step, must not flood the log; the line that gets through says how many like
it were held back.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Any, Callable


class ThrottledLog:
    """``warning()`` and ``info()`` log at most one line of a kind (its message template) every
    ``seconds``, the next one counting those held back meanwhile."""

    def __init__(self, logger: logging.Logger, seconds: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.logger = logger
        self.seconds = seconds
        self._clock = clock
        self._next: dict[str, float] = {}
        self._held: Counter[str] = Counter()

    def warning(self, msg: str, *args: Any, **kw: Any) -> None:
        self._log(logging.WARNING, msg, args, kw)

    def info(self, msg: str, *args: Any, **kw: Any) -> None:
        self._log(logging.INFO, msg, args, kw)

    def _log(self, level: int, msg: str, args: tuple[Any, ...], kw: dict[str, Any]) -> None:
        now = self._clock()
        if now < self._next.get(msg, -float("inf")):
            self._held[msg] += 1
            return
        self._next[msg] = now + self.seconds
        held = self._held.pop(msg, 0)
        self.logger.log(level, msg + (f" ({held} more like it held back)" if held else ""), *args, **kw)
