"""Per-op request latency, counted on the request path; :mod:`kvstore.server.metrics` exports it.

Apart from the exporter so that a server without ``--metrics-port`` never imports prometheus-client.
"""

from __future__ import annotations

from bisect import bisect_left

#: Upper bounds (seconds) of the request latency buckets: from a 50 µs in-memory
#: lookup on loopback to a 10 s multi-GiB transfer or a slow tier call.
LATENCY_BUCKETS: tuple[float, ...] = (
    50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 100e-3, 250e-3, 500e-3, 1.0, 2.5, 10.0,
)


class LatencyHistograms:
    """Per-op latency bucket counts, cheap to update on the request path."""

    __slots__ = ("counts", "sums")

    def __init__(self) -> None:
        self.counts: dict[str, list[int]] = {}
        self.sums: dict[str, float] = {}

    def observe(self, op: str, seconds: float) -> None:
        counts = self.counts.get(op)
        if counts is None:
            counts = self.counts[op] = [0] * (len(LATENCY_BUCKETS) + 1)
            self.sums[op] = 0.0
        counts[bisect_left(LATENCY_BUCKETS, seconds)] += 1  # first bound >= seconds: Prometheus' "le"
        self.sums[op] += seconds

    def cumulative(self, op: str) -> list[tuple[str, float]]:
        """``(le, count)`` pairs as the exposition wants them, ``+Inf`` last."""
        out, total = [], 0
        for bound, n in zip((*map(repr, LATENCY_BUCKETS), "+Inf"), self.counts[op]):
            total += n
            out.append((bound, float(total)))
        return out


__all__ = ["LATENCY_BUCKETS", "LatencyHistograms"]
