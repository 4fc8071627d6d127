"""The measurement behind `hicache bench scale` (docs/bench-scale.md): how hicache's costs grow
with size, as ratios measured in one run.

- copy: one native memcpy (the "memcpy" backend's copy loop) of 16 MiB, 64 MiB, 256 MiB and
  1 GiB (up to ``max_bytes``); the time per byte at the largest size over that at 16 MiB
  (target <= 1.2).
- planner: plan_stack of a Qwen3-Next-shaped hybrid (Gated DeltaNet + full attention every 4th
  layer) of 8, 16, 32, 64, 128 and 256 layers; the time per layer at 256 over that at 8
  (target <= 2).
- cache: the prefix index's match cost per page at 10^3, 10^4 and 10^5 cached pages (up to
  ``max_pages``); the cost at the largest over that at 10^3 (target <= 2).

- measure(max_bytes, repeats, max_pages): all three, as the JSON document of the command.
- copy_sizes / index_sizes: the sizes measured; ConfigError names a flag out of range.
- planner_seconds: median seconds of one plan_stack at a layer count.
- memcpy_scale: for each size, the median time of one native memcpy (the "memcpy" backend's own
  copy loop, hicache.adapters.copy.native) of that many bytes between two host buffers of the
  largest size, allocated and touched once up front; returns {size: seconds}.

A sample of a small size copies several consecutive slices of the large buffers (at least
SAMPLE_BYTES per sample), so a small copy is not served from a cache that the same few MiB
warmed on the previous repeat: what a pool copy meets, whose pages are spread over the pool.

torch is imported only when memcpy_scale runs, so the command line can import this module.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

from hicache.domain import ConfigError, ModelSpec, plan_stack

SAMPLE_BYTES = 256 << 20
MiB = 1 << 20
MIN_BYTES = 16 * MiB
DEFAULT_MAX_BYTES = 1 << 30
LAYERS = (8, 16, 32, 64, 128, 256)
COPY_TARGET = 1.2
PLANNER_TARGET = 2.0
CACHE_TARGET = 2.0  # issue 9: match cost per page at a large index <= 2x at a small one
PLANNER_SAMPLE_S = 0.05  # each planner sample repeats plan_stack for at least this long

HYBRID = {
    "model_type": "qwen3_next",
    "hidden_size": 2048,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "full_attention_interval": 4,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "torch_dtype": "bfloat16",
}


def memcpy_scale(sizes: Sequence[int], *, repeats: int = 5) -> dict[int, float]:
    """Median seconds of one copy of each size in ``sizes`` (bytes)."""
    import numpy as np
    import torch

    from hicache.adapters.copy.native import load_native

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


def copy_sizes(max_bytes: int) -> list[int]:
    if max_bytes < MIN_BYTES:
        raise ConfigError(f"--max-bytes must be at least {MIN_BYTES} B (16 MiB), got {max_bytes}")
    sizes = [MIN_BYTES]
    while sizes[-1] * 4 <= max_bytes:
        sizes.append(sizes[-1] * 4)
    return sizes


def planner_seconds(layers: int, repeats: int) -> float:
    """Median seconds of one plan_stack (model spec read included) at ``layers`` layers."""
    config = {**HYBRID, "num_hidden_layers": layers}

    def once() -> None:
        plan_stack(ModelSpec.from_hf_config(config))

    once()
    n = 1
    while True:  # calibrate: enough calls per sample to outlast the clock's noise
        t0 = time.perf_counter()
        for _ in range(n):
            once()
        if time.perf_counter() - t0 >= PLANNER_SAMPLE_S or n >= 1 << 16:
            break
        n *= 2
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            once()
        samples.append((time.perf_counter() - t0) / n)
    return statistics.median(samples)


def index_sizes(max_pages: object) -> list[int]:
    if not isinstance(max_pages, int) or isinstance(max_pages, bool) or max_pages < 1000:
        raise ConfigError(f"--max-pages must be an integer of at least 1000, got {max_pages!r}")
    if max_pages > 10_000_000:
        raise ConfigError(f"--max-pages must be at most 10000000, got {max_pages}")
    sizes = [1000]
    while sizes[-1] * 10 <= max_pages:
        sizes.append(sizes[-1] * 10)
    return sizes


def measure(max_bytes: int, repeats: int, max_pages: int = 100_000) -> dict[str, Any]:
    from hicache.bench.cache import index_costs

    started = time.perf_counter()
    sizes = copy_sizes(max_bytes)
    copy = memcpy_scale(sizes, repeats=repeats)
    per_byte = {n: t / n for n, t in copy.items()}
    plans = {n: planner_seconds(n, repeats) for n in LAYERS}
    per_layer = {n: t / n for n, t in plans.items()}
    pages = index_sizes(max_pages)
    costs = index_costs(pages, batch=256, repeats=repeats, page_size=64)
    match_ratio = costs[pages[-1]][1] / costs[pages[0]][1]
    copy_ratio = per_byte[sizes[-1]] / per_byte[sizes[0]]
    planner_ratio = per_layer[LAYERS[-1]] / per_layer[LAYERS[0]]
    return {
        "copy": {
            "backend": "memcpy",
            "points": [
                {"bytes": n, "ms": round(t * 1e3, 3), "gbps": round(n / t / 1e9, 3)}
                for n, t in copy.items()
            ],
            "ratio_per_byte": round(copy_ratio, 3),
            "target": COPY_TARGET,
            "ok": copy_ratio <= COPY_TARGET,
        },
        "planner": {
            "model": "qwen3_next-shaped hybrid",
            "points": [
                {"layers": n, "us": round(t * 1e6, 2), "us_per_layer": round(t / n * 1e6, 3)}
                for n, t in plans.items()
            ],
            "ratio_per_layer": round(planner_ratio, 3),
            "target": PLANNER_TARGET,
            "ok": planner_ratio <= PLANNER_TARGET,
        },
        "cache": {
            "points": [
                {
                    "pages": n,
                    "match_us_per_page": round(costs[n][1], 3),
                    "insert_us_per_page": round(costs[n][0], 3),
                }
                for n in pages
            ],
            "ratio_match_per_page": round(match_ratio, 3),
            "target": CACHE_TARGET,
            "ok": match_ratio <= CACHE_TARGET,
        },
        "seconds": round(time.perf_counter() - started, 2),
    }


__all__ = ["copy_sizes", "index_sizes", "measure", "memcpy_scale", "planner_seconds"]
