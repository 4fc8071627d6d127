"""The measurement behind `hicache bench overlap`: how much of a layer-wise load stays exposed
behind compute (the command, hicache.cli.bench_overlap, parses and prints).

A synthetic forward pass over ``--layers`` layers reads a prefix that the real engine loads
through the real copy backend and streams, while each layer "computes" a matrix product sized
so that one layer's compute takes at least one layer's copy. Measured in one process, medians
of ``--repeats`` rounds (each round runs the four modes; compute-only and overlapped back to
back, in alternating order):

- transfer_ms: load every layer, nothing else (submit, then wait_layer for each layer);
- compute_ms: compute every layer, nothing else;
- serial_ms: load everything, then compute (what a non-overlapping engine does);
- overlapped_ms: load, and compute layer i right after ``handle.wait_layer(i)``.

exposed_fraction = (overlapped - compute-only) / transfer-only, computed within each round and
the median over rounds reported: 0 when compute hid the whole load, 1 when nothing was hidden. signal_us_per_layer: the mean time ``wait_layer(i)``
takes when layer i's copy has already finished (the per-layer cost of the signalling path when
compute hides the copies). See docs/bench-overlap.md.

On CPU the copy worker and the compute each get one core (``torch.set_num_threads(1)``).

``--timeline`` adds "timeline" to the JSON: one more overlapped round, stamped. Times are
milliseconds from the start of that round: "submit" [start, end] of ``engine.load`` on the
calling thread, and per layer "copy" [start, end] of the copy backend's ``load_layer`` on the
copy worker's thread (on a GPU: when the copies were issued, not when they ran), "wait" [start,
end] of ``wait_layer(i)`` and "compute" [start, end] on the calling thread; "exposed_ms" is the
sum of the waits and "first_copy_ms" when layer 0's copy began. See docs/bench-overlap.md.

- bench_plan: the synthetic plan (one MHA KV pool) for layers, tokens, page size and layout;
  ConfigError names a flag that is out of range.
- run_overlap_bench(plan, device=, repeats=, timeline=): the measurement; returns the JSON
  document's keys (KEYS, plus "timeline") and extras for the human summary (keys with "_").
- OtherLoad: a context manager; ``cores()`` says how many CPU cores other processes kept busy
  during the run (Linux /proc/stat; else None).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from hicache.domain import (
    ConfigError,
    DType,
    HostGroupPlan,
    KVGeometry,
    LayerBinding,
    Layout,
    Pinning,
    PoolName,
    PoolPlan,
    PoolRole,
    StorageSettings,
    resolve_host_memory,
)

if TYPE_CHECKING:
    from hicache.bootstrap.runtime import Runtime

KV = PoolName.KV
KEYS = (
    "device",
    "layers",
    "transfer_ms",
    "compute_ms",
    "serial_ms",
    "overlapped_ms",
    "exposed_fraction",
    "signal_us_per_layer",
)
# The synthetic pool: MHA K and V, 8 KV heads of 64 in bf16: 2 KiB per token per layer.
KV_HEADS = 8
HEAD_DIM = 64
COMPUTE_MARGIN = 1.25  # one layer's compute is calibrated to >= 1.25x one layer's copy
SIGNAL_ROUNDS = 200
MAX_REPEATS = 1000


def check_positive(name: str, value: object, ceiling: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"--{name} must be a positive integer, got {value!r}")
    if value > ceiling:
        raise ConfigError(f"--{name} must be at most {ceiling}, got {value}")
    return value


def bench_plan(*, layers: int, tokens: int, page_size: int, layout: str) -> HostGroupPlan:
    """One MHA KV pool of ``layers`` layers holding exactly ``tokens`` on host and device."""
    from hicache.domain.limits import MAX_LAYERS, MAX_UNITS

    check_positive("layers", layers, MAX_LAYERS)
    check_positive("tokens", tokens, MAX_UNITS)
    check_positive("page-size", page_size, MAX_UNITS)
    if tokens % page_size:
        raise ConfigError(
            f"--tokens {tokens} must be a whole number of pages of --page-size {page_size}"
        )
    return HostGroupPlan(
        host_memory=resolve_host_memory(StorageSettings(), Pinning.AUTO),
        pools=[
            PoolPlan(
                name=KV,
                role=PoolRole.ANCHOR,
                geometry=KVGeometry(kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype=DType.BF16),
                binding=LayerBinding.contiguous(list(range(layers))),
                layout=Layout.parse(layout),
                page_size=page_size,
                capacity=tokens,
                device_capacity=tokens,
            )
        ],
        model_type="synthetic",
    )


def run_overlap_bench(
    plan: HostGroupPlan, *, device: str, repeats: int, timeline: bool = False
) -> dict[str, Any]:
    import anyio

    from hicache.adapters.streams import SyntheticCompute

    threads = SyntheticCompute.torch_threads(1)  # one core for the copy worker, one for compute
    try:
        result: dict[str, Any] = anyio.run(_measure, plan, device, repeats, timeline)
    finally:
        SyntheticCompute.torch_threads(threads)
    return result


class _Stamps:
    """Per-layer copy start/end stamps taken by a wrapper around the copy backend."""

    def __init__(self) -> None:
        self.on = False
        self.copy: dict[int, list[float]] = {}

    def wrap(self, inner: Any) -> Any:
        stamps = self

        class Stamped:
            def __getattr__(self, name: str) -> Any:
                return getattr(inner, name)

            @property
            def transfer_layers(self) -> int:
                return int(inner.transfer_layers)

            def load_layer(self, layer: int, maps: Any) -> int:
                if not stamps.on:
                    return int(inner.load_layer(layer, maps))
                start = time.perf_counter()
                try:
                    return int(inner.load_layer(layer, maps))
                finally:
                    stamps.copy[layer] = [start, time.perf_counter()]

        return Stamped()


async def _measure(
    plan: HostGroupPlan, device: str, repeats: int, timeline: bool = False
) -> dict[str, Any]:
    from hicache.adapters.streams import SyntheticCompute
    from hicache.bootstrap.runtime import open_runtime

    stamps = _Stamps()
    async with open_runtime(plan, device=device, name="bench", wrap_transfer=stamps.wrap) as rt:
        host_pages = await _fill_host(rt)
        forward = SyntheticCompute(str(rt.device.device))
        layers = plan.transfer_layers
        engine = rt.engine

        async def transfer_only() -> float:
            start = time.perf_counter()
            handle = await engine.load(host_pages)
            for i in range(layers):
                handle.wait_layer(i)
            forward.synchronize()
            took = time.perf_counter() - start
            await handle.wait()
            engine.free_device(handle.device_pages)
            return took

        async def compute_only() -> float:
            start = time.perf_counter()
            for _ in range(layers):
                forward.layer()
            forward.synchronize()
            return time.perf_counter() - start

        async def serial() -> float:
            start = time.perf_counter()
            handle = await engine.load(host_pages)
            for i in range(layers):
                handle.wait_layer(i)
            for _ in range(layers):
                forward.layer()
            forward.synchronize()
            took = time.perf_counter() - start
            await handle.wait()
            engine.free_device(handle.device_pages)
            return took

        async def overlapped() -> float:
            start = time.perf_counter()
            handle = await engine.load(host_pages)
            for i in range(layers):
                handle.wait_layer(i)
                forward.layer()
            forward.synchronize()
            took = time.perf_counter() - start
            await handle.wait()
            engine.free_device(handle.device_pages)
            return took

        # Warm up (first-touch costs, native helper), then calibrate compute to the slowest of
        # a few loads: copy times drift, and compute must stay at least as long as the copies.
        await transfer_only()
        copy_s = max([await transfer_only() for _ in range(5)])
        forward.calibrate(COMPUTE_MARGIN * copy_s / layers)

        modes: list[tuple[str, Callable[[], Awaitable[float]]]] = [
            ("transfer", transfer_only),
            ("compute", compute_only),
            ("overlapped", overlapped),
            ("serial", serial),
        ]
        samples: dict[str, list[float]] = {name: [] for name, _ in modes}
        for r in range(repeats):
            # compute and overlapped run back to back, in alternating order, so that a drift
            # of the machine's speed hits both alike.
            for name, fn in modes if r % 2 == 0 else modes[::-1]:
                samples[name].append(await fn())
        signal = await _signal(engine, host_pages, layers, forward.synchronize)
        traced: dict[str, Any] | None = None
        if timeline:
            stamps.on = True
            t0 = time.perf_counter()
            handle = await engine.load(host_pages)
            t1 = time.perf_counter()
            rows = []
            for i in range(layers):
                w0 = time.perf_counter()
                handle.wait_layer(i)
                w1 = time.perf_counter()
                forward.layer()
                forward.synchronize()
                rows.append((i, w0, w1, time.perf_counter()))
            await handle.wait()
            engine.free_device(handle.device_pages)
            stamps.on = False
            traced = _timeline(t0, t1, rows, stamps.copy)
        stats = engine.statistics()

    ms = {name: statistics.median(v) * 1e3 for name, v in samples.items()}
    # The machine's speed drifts between rounds more than the effect measured, so the fraction
    # is taken within each round (its own three times) and the median over rounds reported.
    exposed = statistics.median(
        (ov - co) / tr
        for ov, co, tr in zip(
            samples["overlapped"], samples["compute"], samples["transfer"], strict=True
        )
        if tr > 0
    )
    return {
        "device": str(rt.device.device),
        "layers": layers,
        "transfer_ms": round(ms["transfer"], 3),
        "compute_ms": round(ms["compute"], 3),
        "serial_ms": round(ms["serial"], 3),
        "overlapped_ms": round(ms["overlapped"], 3),
        "exposed_fraction": round(exposed, 4),
        "signal_us_per_layer": round(signal * 1e6, 3),
        "timeline": traced,
        # Extras for the human summary (not in the JSON document).
        "_tokens": plan.anchor.capacity,
        "_bytes_per_layer": plan.anchor.capacity * plan.anchor.bytes_per_unit_per_layer,
        "_matmul_n": forward.n,
        "_load_gbps": stats.load_gbps,
        "_backend": getattr(rt.transfer, "backends", {}),
        "_repeats": repeats,
    }


def _timeline(
    t0: float,
    t1: float,
    rows: list[tuple[int, float, float, float]],
    copies: dict[int, list[float]],
) -> dict[str, Any]:
    """The stamped round as milliseconds from its start (see the module docstring)."""

    def ms(t: float) -> float:
        return round((t - t0) * 1e3, 4)

    layers = [
        {
            "layer": i,
            "copy": [ms(x) for x in copies.get(i, [t0, t0])],
            "wait": [ms(w0), ms(w1)],
            "compute": [ms(w1), ms(c1)],
        }
        for i, w0, w1, c1 in rows
    ]
    return {
        "submit": [0.0, ms(t1)],
        "layers": layers,
        "exposed_ms": round(sum((w1 - w0) * 1e3 for _, w0, w1, _ in rows), 4),
        "first_copy_ms": ms(copies[0][0]) if 0 in copies else None,
    }


async def _fill_host(rt: Runtime) -> dict[PoolName, tuple[int, ...]]:
    """Write every device page, back it up through the engine, free the device pages."""
    pages = rt.device_slots.allocator(KV).pages
    device_pages = rt.device_slots.allocate({KV: pages}).pages
    for pool in rt.device.pools.values():
        for tensors in pool.buffers.values():
            for layer, t in enumerate(tensors):
                t.fill_(layer + 1)
    handle = await rt.engine.backup(device_pages)
    await handle.wait()
    rt.engine.free_device(device_pages)
    return handle.host_pages


async def _signal(
    engine: Any, host_pages: Any, layers: int, synchronize: Callable[[], None]
) -> float:
    """Mean seconds of wait_layer(i) on layers whose copies already finished."""
    handle = await engine.load(host_pages)
    handle.wait_layer(layers - 1)  # copies run in order: on CPU every layer is in place now
    synchronize()  # on a GPU, wait for them too
    for i in range(layers):
        handle.wait_layer(i)  # warm
    start = time.perf_counter()
    for _ in range(SIGNAL_ROUNDS):
        for i in range(layers):
            handle.wait_layer(i)
    took = (time.perf_counter() - start) / (SIGNAL_ROUNDS * layers)
    await handle.wait()
    engine.free_device(handle.device_pages)
    return took


class OtherLoad:
    """How many CPU cores other processes kept busy meanwhile (Linux /proc/stat; else None)."""

    def __enter__(self) -> OtherLoad:
        self._start = self._sample()
        self._end: tuple[float, float, float] | None = None
        return self

    def __exit__(self, *exc: object) -> None:
        self._end = self._sample()

    @staticmethod
    def _sample() -> tuple[float, float, float] | None:
        import os
        import resource

        try:
            with open("/proc/stat", encoding="ascii") as f:
                fields = [int(v) for v in f.readline().split()[1:9]]
        except (OSError, ValueError):
            return None
        ticks = os.sysconf("SC_CLK_TCK")
        busy = (sum(fields) - fields[3] - fields[4]) / ticks  # all but idle and iowait
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return busy, usage.ru_utime + usage.ru_stime, time.monotonic()

    def cores(self) -> float | None:
        if self._start is None or self._end is None:
            return None
        busy = self._end[0] - self._start[0]
        ours = self._end[1] - self._start[1]
        wall = self._end[2] - self._start[2]
        return max(0.0, busy - ours) / wall if wall > 0 else None
