"""The measurement behind `hicache bench engine` (docs/bench-engine.md).

- NullTransfer: a Transfer that moves nothing (0 bytes, no work), so that what is timed is the
  engine's own bookkeeping and scheduling per load.
- measure_free_us: the cost of one PageAllocator.free of 16 pages at a pool size.
- measure_load_overhead_us: the engine's own wall time per load with N loads in flight at once
  (CPU streams, NullTransfer), each load of one page submitted on its own, then all waited for.
- measure_rss_released_fraction: the share of a shm runtime's host bytes that leave RSS when the
  runtime is closed (no garbage collection, the runtime still referenced).
- run_engine_bench: all three, as the JSON document of the command.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio

from hicache.adapters.streams import open_streams
from hicache.bootstrap.runtime import open_runtime
from hicache.domain import (
    DType,
    HostGroupPlan,
    HostMemory,
    KVGeometry,
    LayerBinding,
    Layout,
    MemoryKind,
    PoolName,
    PoolPlan,
    PoolRole,
)
from hicache.domain.ports import PageMap
from hicache.domain.slots import GroupAllocator, PageAllocator
from hicache.engine import TransferEngine

FREE_POOL_SIZES = (32768, 1048576, 8388608)
LOAD_CONCURRENCY = (1, 16, 256)
FREE_PAGES = 16
MiB = 1 << 20


class NullTransfer:
    """hicache.domain.ports.Transfer that copies nothing and reports 0 bytes."""

    def __init__(self, layers: int) -> None:
        self._layers = layers

    @property
    def transfer_layers(self) -> int:
        return self._layers

    def load_layer(self, layer: int, maps: Sequence[PageMap]) -> int:
        return 0

    def backup(self, maps: Sequence[PageMap]) -> int:
        return 0

    def backup_layer(self, layer: int, maps: Sequence[PageMap]) -> int:
        return 0

    def layer_bytes(self, layer: int, maps: Sequence[PageMap]) -> int:
        return 0


def _plan(kind: str, *, layers: int, pages: int, page_size: int = 16) -> HostGroupPlan:
    return HostGroupPlan(
        host_memory=HostMemory(MemoryKind(kind)),
        pools=[
            PoolPlan(
                name=PoolName.KV,
                role=PoolRole.ANCHOR,
                geometry=KVGeometry(kv_heads=8, head_dim=128, dtype=DType.BF16),
                binding=LayerBinding.contiguous(list(range(layers))),
                layout=Layout.PAGE_FIRST,
                page_size=page_size,
                capacity=pages * page_size,
                device_capacity=pages * page_size,
            )
        ],
    )


def measure_free_us(pages: int, *, repeats: int = 200) -> float:
    """Median microseconds of one free of 16 pages, on a pool of ``pages`` with a used prefix.

    Set-up (untimed): up to 64K pages are allocated and every other one is freed again, so the
    free list holds a realistic mix; then each repeat allocates 16 pages (untimed) and frees
    them (timed).
    """
    alloc = PageAllocator(pages, name="bench")
    held = alloc.allocate(min(pages, 65536))
    alloc.free(held[::2])
    times = []
    for _ in range(repeats):
        taken = alloc.allocate(FREE_PAGES)
        t0 = time.perf_counter()
        alloc.free(taken)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


async def _load_round(engine: TransferEngine, slots: GroupAllocator, host: list[int]) -> float:
    t0 = time.perf_counter()
    handles = [await engine.load({PoolName.KV: [h]}) for h in host]
    for h in handles:
        await h.wait()
    elapsed = time.perf_counter() - t0
    for h in handles:
        slots.free(h.device_pages)
    return elapsed


def measure_load_overhead_us(concurrency: int, *, rounds: int = 20, layers: int = 32) -> float:
    """Median engine time per load (us) with ``concurrency`` one-page loads in flight at once."""
    pages = max(LOAD_CONCURRENCY)
    plan = _plan("anonymous", layers=layers, pages=pages)
    host_slots = GroupAllocator(plan)
    device_slots = GroupAllocator(plan)
    streams = open_streams("cpu")
    engine = TransferEngine(
        plan=plan,
        transfer=NullTransfer(layers),
        streams=streams,
        host_slots=host_slots,
        device_slots=device_slots,
        name="bench",
    )
    host = list(host_slots.allocate({PoolName.KV: concurrency})[PoolName.KV])

    async def main() -> list[float]:
        async with engine:
            await _load_round(engine, device_slots, host)  # warm-up
            return [await _load_round(engine, device_slots, host) for _ in range(rounds)]

    try:
        times = anyio.run(main)
    finally:
        streams.close()
    return statistics.median(times) / concurrency * 1e6


def _rss(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def measure_rss_released_fraction(host_mib: int = 128) -> float:
    """Share of a shm runtime's host bytes that leave RSS (RssShmem) at close, no gc."""
    page_bytes = 16 * 4096  # 16 tokens x 4 KiB (K+V, 8 heads x 128, bf16) per layer
    layers = 4
    pages = host_mib * MiB // (page_bytes * layers)
    plan = _plan("shm", layers=layers, pages=pages)
    runtime = open_runtime(plan, device="cpu")
    host_bytes = sum(r.nbytes for _, _, r in runtime.host.regions())
    in_use: list[int] = []

    async def use_and_close() -> None:
        async with runtime:
            maps = [PageMap(PoolName.KV, list(range(64)), list(range(64)))]
            runtime.transfer.backup(maps)
            for layer in range(layers):
                runtime.transfer.load_layer(layer, maps)
            in_use.append(_rss("RssShmem"))

    anyio.run(use_and_close)
    released = in_use[0] - _rss("RssShmem")
    left = [e.name for e in os.scandir("/dev/shm") if e.name.startswith(f"hicache-{os.getpid()}-")]
    if left:
        return 0.0  # a segment still in /dev/shm: nothing was given back to the machine
    return released / host_bytes


def run_engine_bench(*, rounds: int = 20) -> dict[str, Any]:
    """{"device", "free_us", "load_overhead_us", "rss_released_fraction"} (docs/bench-engine.md)."""
    free = {str(n): round(measure_free_us(n), 3) for n in FREE_POOL_SIZES}
    overhead = {
        str(c): round(measure_load_overhead_us(c, rounds=rounds), 3) for c in LOAD_CONCURRENCY
    }
    return {
        "device": "cpu",
        "free_us": free,
        "load_overhead_us": overhead,
        "rss_released_fraction": round(measure_rss_released_fraction(), 4),
    }


__all__ = [
    "NullTransfer",
    "measure_free_us",
    "measure_load_overhead_us",
    "measure_rss_released_fraction",
    "run_engine_bench",
]
