"""ThrottledLog: one line per kind per window, the next one counting what was held back."""

from __future__ import annotations

import logging

import pytest

from kvstore.throttle import ThrottledLog


def test_a_kind_is_logged_once_per_window_and_the_next_line_counts_the_rest(caplog: pytest.LogCaptureFixture) -> None:
    now = [100.0]
    log = ThrottledLog(logging.getLogger("kvstore.test.throttle"), seconds=10.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="kvstore.test.throttle"):
        for key in ("a", "b", "c"):
            log.warning("redis key %s is corrupt", key)
        log.warning("redis %s is down", "r1")  # another kind: not held back by the first
        now[0] += 9.9
        log.warning("redis key %s is corrupt", "d")
        now[0] += 0.1
        log.warning("redis key %s is corrupt", "e")
        log.warning("redis key %s is corrupt", "f")
    assert [r.getMessage() for r in caplog.records] == [
        "redis key a is corrupt",
        "redis r1 is down",
        "redis key e is corrupt (3 more like it held back)",
    ]


def test_info_lines_are_throttled_alike(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    log = ThrottledLog(logging.getLogger("kvstore.test.throttle"), seconds=10.0, clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger="kvstore.test.throttle"):
        for n in range(5):
            log.info("wrote %d block(s) again", n, extra={"event": "again"})
        now[0] += 10
        log.info("wrote %d block(s) again", 9)
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.INFO, "wrote 0 block(s) again"), (logging.INFO, "wrote 9 block(s) again (4 more like it held back)")]
    assert getattr(caplog.records[0], "event") == "again"


def test_the_count_held_back_starts_again_with_each_window(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    log = ThrottledLog(logging.getLogger("kvstore.test.throttle"), seconds=10.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="kvstore.test.throttle"):
        for window, lines in enumerate((3, 2, 1, 1)):
            now[0] = 10.0 * window + (30.0 if window == 3 else 0.0)  # (the last after a quiet minute)
            for _ in range(lines):
                log.warning("peer refused")
    assert [r.getMessage() for r in caplog.records] == [
        "peer refused", "peer refused (2 more like it held back)", "peer refused (1 more like it held back)",
        "peer refused"]
