"""Busy polling: the event loop stays awake for a short window after each request.

A server that sleeps in ``epoll_wait`` between requests is woken by the kernel
for each one. On a virtual machine that wake-up, and the cold caches after it,
cost more than a small request itself (measured on the 2-vCPU benchmark host:
a single 64 KiB GET took 165-260 us round trip with the server sleeping between
requests, 115-170 us with a 200 us window; docs/perf/journal.md, "Busy polling"). The same idea as
Linux's ``net.core.busy_poll`` and Seastar's ``--idle-poll-time-us``: keep
polling, without blocking, for a while after work, so the next request of a busy
client is read at once. An idle server still sleeps: the window closes
``window_s`` after the last request.

The window is the server's. A connection opens it once it has answered a request
and has nothing left to send (after parsing, or when a large reply has drained),
and closes it early while a payload arrives or a reply drains: polling then only
splits the transfer into more, smaller reads and writes (measured: 0.25 instead of
0.18 s of server CPU per GB of 1 MiB x 32 puts).
Each polling turn yields the core (``sched_yield``): a thread or process that
wants it -- the client's copy threads on a small host -- runs first (measured: same
single-request latency as without the yield, and shm puts no slower than with
polling off). ``seconds`` counts only turns that found nothing to do since the
previous one, so time spent serving requests inside the window is not mistaken
for the window's cost.
"""

from __future__ import annotations

import asyncio
import os
import time


class BusyPoll:
    """``kick()`` after a request; the loop then polls without blocking until ``window_s`` has passed."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self.until = 0.0
        self.spinning = False
        self.turns = 0  # loop iterations spent polling
        self.seconds = 0.0  # time spent polling with nothing to do: roughly the CPU the window costs
        self._loop: asyncio.AbstractEventLoop | None = None
        self._last = 0.0  # when the previous turn (or the kick that began the spell) ran
        self._served = False  # a request was handled since the previous turn: that interval was work

    def kick(self) -> None:
        now = time.perf_counter()
        self.until = now + self.window_s
        self._served = True
        loop = asyncio.get_running_loop()
        if not self.spinning or loop is not self._loop:  # (a loop that ended mid-spell left it "spinning")
            self.spinning, self._loop, self._last = True, loop, now
            loop.call_soon(self._spin)

    def stop(self) -> None:
        """Sleep when the loop next may: a transfer is under way (it wakes the loop itself)."""
        self.until = 0.0

    def _spin(self) -> None:
        # A ready callback makes the loop poll its sockets with a zero timeout instead of sleeping.
        self.turns += 1
        os.sched_yield()  # but let anything else that wants this core have it first
        now = time.perf_counter()
        if not self._served:
            self.seconds += now - self._last
        self._served, self._last = False, now
        if now < self.until:
            asyncio.get_running_loop().call_soon(self._spin)
        else:
            self.spinning = False


__all__ = ["BusyPoll"]
