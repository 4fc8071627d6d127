"""Fixed-bucket histograms the engine fills as it measures (no dependency; thread-safe).

- Histogram(bounds): ``observe(seconds)`` counts one value into the first bucket whose upper
  bound holds it (one bisect and two additions under a lock); ``snapshot()`` returns a frozen
  HistogramSnapshot.
- HistogramSnapshot: bucket upper bounds, the count per bucket (not cumulative; the last is the
  overflow above the largest bound), the sum and the count, ``cumulative()`` in Prometheus's
  ``le`` form (the last bound infinite), ``as_json()``.
- LOAD_SECONDS_BUCKETS / WAIT_SECONDS_BUCKETS: the engine's bounds for a load's latency and for
  one forward-pass wait.

The metrics layer (hicache.metrics) turns snapshots into Prometheus histograms at scrape time, so
the engine never imports prometheus_client.
"""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Sequence

import attrs

from hicache.domain.errors import ConfigError

# A load: from prepare to settled, 0.5 ms (a few pages on a GPU) to 10 s (a stalled copy).
LOAD_SECONDS_BUCKETS: tuple[float, ...] = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
# One wait of the forward pass for a layer: 0 when the copy was already there (10 µs bucket)
# up to a quarter second.
WAIT_SECONDS_BUCKETS: tuple[float, ...] = (
    1e-5,
    5e-5,
    1e-4,
    2.5e-4,
    5e-4,
    1e-3,
    2.5e-3,
    5e-3,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
)


@attrs.frozen(kw_only=True)
class HistogramSnapshot:
    """A histogram at one moment: ``counts[i]`` values fell in (bounds[i-1], bounds[i]];
    ``counts[-1]`` is the overflow above ``bounds[-1]``. ``count == sum(counts)``."""

    bounds: tuple[float, ...]
    counts: tuple[int, ...]
    sum: float
    count: int

    def cumulative(self) -> list[tuple[float, int]]:
        """``(le, values <= le)`` per bound, then ``(inf, count)``: Prometheus's buckets."""
        out: list[tuple[float, int]] = []
        running = 0
        for bound, n in zip(self.bounds, self.counts, strict=False):
            running += n
            out.append((bound, running))
        out.append((math.inf, self.count))
        return out

    def as_json(self) -> dict[str, object]:
        return {
            "bounds": list(self.bounds),
            "counts": list(self.counts),
            "sum": self.sum,
            "count": self.count,
        }


class Histogram:
    """Counts of observed values per bucket; ``observe`` may be called from any thread."""

    def __init__(self, bounds: Sequence[float]) -> None:
        b = tuple(float(x) for x in bounds)
        if not b or any(not math.isfinite(x) for x in b) or list(b) != sorted(set(b)):
            raise ConfigError(
                f"histogram bounds must be finite and strictly increasing, got {list(bounds)!r}"
            )
        self._bounds = b
        self._counts = [0] * (len(b) + 1)
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        i = bisect.bisect_left(self._bounds, value)
        with self._lock:
            self._counts[i] += 1
            self._sum += value

    def snapshot(self) -> HistogramSnapshot:
        with self._lock:
            counts = tuple(self._counts)
            total = self._sum
        return HistogramSnapshot(bounds=self._bounds, counts=counts, sum=total, count=sum(counts))


__all__ = [
    "LOAD_SECONDS_BUCKETS",
    "WAIT_SECONDS_BUCKETS",
    "Histogram",
    "HistogramSnapshot",
]
