"""The engine's fixed-bucket histograms: values land in the bucket whose bound holds them."""

from __future__ import annotations

import math
import threading

import pytest

from hicache.domain import ConfigError
from hicache.engine.histogram import Histogram


def test_a_value_equal_to_a_bound_counts_in_that_bucket_and_a_large_one_overflows() -> None:
    h = Histogram([0.001, 0.01])
    for v in (0.0, 0.001, 0.005, 0.01, 3.0):
        h.observe(v)
    s = h.snapshot()
    assert s.counts == (2, 2, 1)
    assert s.count == 5
    assert s.sum == pytest.approx(3.016)
    assert s.cumulative() == [(0.001, 2), (0.01, 4), (math.inf, 5)]


def test_observations_from_many_threads_are_all_counted() -> None:
    h = Histogram([0.5])
    threads = [
        threading.Thread(target=lambda: [h.observe(0.25) for _ in range(2000)]) for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    s = h.snapshot()
    assert s.count == 8000
    assert s.sum == pytest.approx(2000.0)


@pytest.mark.parametrize("bounds", [[], [0.1, 0.1], [0.2, 0.1], [0.1, math.inf]])
def test_bounds_must_be_finite_and_strictly_increasing(bounds: list[float]) -> None:
    with pytest.raises(ConfigError, match="strictly increasing"):
        Histogram(bounds)
