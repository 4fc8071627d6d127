"""The copy half of `hicache bench scale` (docs/bench-scale.md): time per byte as copies grow.

- memcpy_scale: for each size, the median time of one native memcpy (the "memcpy" backend's own
  copy loop, hicache.adapters.copy.native) of that many bytes between two host buffers of the
  largest size, allocated and touched once up front; returns {size: seconds}.

A sample of a small size copies several consecutive slices of the large buffers (at least
SAMPLE_BYTES per sample), so a small copy is not served from a cache that the same few MiB
warmed on the previous repeat: what a pool copy meets, whose pages are spread over the pool.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import numpy as np
import torch

from hicache.adapters.copy.native import load_native

SAMPLE_BYTES = 256 << 20


def memcpy_scale(sizes: Sequence[int], *, repeats: int = 5) -> dict[int, float]:
    """Median seconds of one copy of each size in ``sizes`` (bytes)."""
    lib = load_native()
    largest = max(sizes)
    src = torch.ones(largest, dtype=torch.uint8)
    dst = torch.zeros(largest, dtype=torch.uint8)
    src_base = np.array([src.data_ptr()], dtype=np.int64)
    dst_base = np.array([dst.data_ptr()], dtype=np.int64)
    out: dict[int, float] = {}
    for size in sizes:
        slices = max(1, min(SAMPLE_BYTES, largest) // size)
        offsets = [np.array([i * size], dtype=np.int64) for i in range(slices)]
        length = np.array([size], dtype=np.int64)

        def sample(offsets: list[np.ndarray] = offsets, length: np.ndarray = length) -> float:
            t0 = time.perf_counter()
            for off in offsets:
                lib.copy(dst_base, src_base, off, off, length)
            return (time.perf_counter() - t0) / len(offsets)

        sample()  # warm-up: the native library and the page tables
        out[size] = statistics.median(sample() for _ in range(repeats))
    return out


__all__ = ["memcpy_scale"]
