"""The measurement behind `hicache bench copy` (docs/bench-copy.md): torch lives here, not in cli.

- BenchSettings: device, page sizes, layouts, host memory kind, repeats, backend, geometry.
- run_copy_bench: measures, in one process and under one torch thread count, the naive peer
  method and hicache's chosen backend, for the all-layer backup and for per-layer loads of every
  layer one after another; each repeat also times, right before, a contiguous torch copy of the
  same bytes (the baseline) and the machine's limit (the same contiguous bytes as one piece
  through the native helper, in one call, on CPU; one contiguous copy on a GPU), so every ratio
  compares figures measured side by side; returns the JSON document of the command.

The synthetic pool: one MHA pool of ``layers`` layers (32), bf16, 8 KV heads x head_dim 64 for K
and for V (1 KiB + 1 KiB = 2 KiB per token per layer, 64 KiB per token over all layers); host and
device capacity 2 x ``tokens`` tokens each; every measurement moves ``tokens`` tokens (4096 ->
256 MiB) in pages chosen at random on both sides (without repeats, shuffled).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import numpy as np
import torch

from hicache.adapters.copy.native import load_native
from hicache.adapters.copy.transfer import GroupTransfer, check_backend_name
from hicache.adapters.device_pool import DeviceGroup, parse_torch_device
from hicache.adapters.host_pool import materialise_host_group
from hicache.domain import (
    ConfigError,
    DType,
    HostGroupPlan,
    HostMemory,
    KVGeometry,
    LayerBinding,
    Layout,
    MemoryKind,
    Pinning,
    PoolName,
    PoolPlan,
    PoolRole,
)
from hicache.domain.ports import PageMap

KV_HEADS = 8
HEAD_DIM = 64
OPS = ("backup", "load_layer")
METHODS = ("hicache", "naive")


def _positive(_inst: object, attribute: attrs.Attribute[int], value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{attribute.name} must be a positive integer, got {value!r}")


@attrs.frozen(kw_only=True)
class BenchSettings:
    device: str = "cpu"
    page_sizes: tuple[int, ...] = (1, 16, 64, 256)
    layouts: tuple[Layout, ...] = tuple(Layout)
    host_memory: str = "anonymous"
    repeats: int = attrs.field(default=3, validator=_positive)
    backend: str = "auto"
    tokens: int = attrs.field(default=4096, validator=_positive)
    layers: int = attrs.field(default=32, validator=_positive)
    threads: int = attrs.field(default=1, validator=_positive)
    huge_pages: bool = False
    seed: int = 0

    def __attrs_post_init__(self) -> None:
        if not self.page_sizes:
            raise ConfigError("page sizes must name at least one page size")
        for ps in self.page_sizes:
            if isinstance(ps, bool) or not isinstance(ps, int) or ps <= 0:
                raise ConfigError(f"page sizes must be positive integers, got {ps!r}")
            if self.tokens % ps:
                raise ConfigError(
                    f"tokens={self.tokens} is not a whole number of pages of {ps}: choose tokens "
                    f"that every page size divides"
                )
        if not self.layouts:
            raise ConfigError("layouts must name at least one layout")
        if self.host_memory not in ("anonymous", "shm"):
            raise ConfigError(
                f"host memory {self.host_memory!r} cannot be benchmarked: expected anonymous or shm"
            )
        check_backend_name(self.backend)
        if self.huge_pages and self.host_memory != "anonymous":
            raise ConfigError("huge pages apply to anonymous host memory only")

    @property
    def bytes_per_token_layer(self) -> int:
        return 2 * KV_HEADS * HEAD_DIM * DType.BF16.itemsize

    @property
    def moved_bytes(self) -> int:
        return self.tokens * self.layers * self.bytes_per_token_layer


def _plan(s: BenchSettings, layout: Layout, page_size: int) -> HostGroupPlan:
    capacity = 2 * s.tokens
    pool = PoolPlan(
        name=PoolName.KV,
        role=PoolRole.ANCHOR,
        geometry=KVGeometry(kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype=DType.BF16),
        binding=LayerBinding.contiguous(list(range(s.layers))),
        layout=layout,
        page_size=page_size,
        capacity=capacity,
        device_capacity=capacity,
    )
    return HostGroupPlan(
        host_memory=HostMemory(MemoryKind(s.host_memory), Pinning.AUTO), pools=[pool]
    )


class _Clock:
    """Wall time of a call, synchronising the GPU around it where there is one."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream: torch.cuda.Stream | None = None
        if device.type == "cuda":
            self.stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]

    def time(self, fn: Callable[[], object]) -> float:
        if self.stream is None:
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0
        torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        with torch.cuda.stream(self.stream):
            fn()
        torch.cuda.synchronize(self.device)
        return time.perf_counter() - t0


def run_copy_bench(
    settings: BenchSettings, *, progress: Callable[[str], None] | None = None
) -> dict[str, Any]:
    """Measure and return {"device", "baseline_gbps", "results": [...]} (see docs/bench-copy.md)."""
    s = settings
    dev = parse_torch_device(s.device)
    say = progress or (lambda _msg: None)
    threads = torch.get_num_threads()
    torch.set_num_threads(s.threads)
    try:
        return _run(s, dev, say)
    finally:
        torch.set_num_threads(threads)


def _run(s: BenchSettings, dev: torch.device, say: Callable[[str], None]) -> dict[str, Any]:
    clock = _Clock(dev)
    nbytes = s.moved_bytes
    # Baseline buffers: a contiguous copy of the same bytes (host <-> device), touched up front.
    pin = dev.type == "cuda"
    host_buf = torch.ones(nbytes, dtype=torch.uint8, pin_memory=pin)
    dev_buf = torch.ones(nbytes, dtype=torch.uint8, device=dev)
    if dev.type == "cpu":
        dev_buf.fill_(2)
    baselines: dict[str, Callable[[], object]] = {
        "load_layer": lambda: dev_buf.copy_(host_buf, non_blocking=True),
        "backup": lambda: host_buf.copy_(dev_buf, non_blocking=True),
    }
    limits = _limit_fns(dev, host_buf, dev_buf)
    for fn in (*baselines.values(), *limits.values()):
        clock.time(fn)  # warm-up, not kept

    rng = np.random.default_rng(s.seed)
    first = _plan(s, s.layouts[0], s.page_sizes[0])
    devices = DeviceGroup.allocate(first, device=dev)
    tensors: dict[PoolName | str, Mapping[str, Sequence[torch.Tensor]]] = {
        PoolName.KV: dict(devices.pool(PoolName.KV).buffers)
    }
    base_all: dict[str, list[float]] = {op: [] for op in OPS}
    limit_all: dict[str, list[float]] = {op: [] for op in OPS}
    results: list[dict[str, Any]] = []
    for layout in s.layouts:
        for page_size in s.page_sizes:
            plan = _plan(s, layout, page_size)
            pages = s.tokens // page_size
            host_pages = rng.permutation(plan.anchor.pages)[:pages].tolist()
            device_pages = rng.permutation(plan.anchor.pages)[:pages].tolist()
            maps = [PageMap(PoolName.KV, host_pages, device_pages)]
            group = DeviceGroup.wrap(plan, tensors)
            host = materialise_host_group(plan, device=s.device, huge_pages=s.huge_pages)
            try:
                methods = {
                    "hicache": GroupTransfer(host, group, backend=s.backend),
                    "naive": GroupTransfer(host, group, backend="naive"),
                }
                for op in OPS:
                    for method, transfer in methods.items():
                        fn = _op(transfer, op, maps, s.layers)
                        # The naive method has nothing to warm up; its page-1 runs are the
                        # slowest part of the bench, so it is timed without a warm-up run.
                        if method == "hicache":
                            clock.time(fn)
                        # Each repeat times the baseline, the limit and the method back to back,
                        # so a result is compared with references measured beside it: the
                        # memory bandwidth of a shared machine drifts between seconds.
                        base_t, limit_t, op_t = [], [], []
                        for _ in range(s.repeats):
                            base_t.append(clock.time(baselines[op]))
                            limit_t.append(clock.time(limits[op]))
                            op_t.append(clock.time(fn))
                        base_all[op] += base_t
                        limit_all[op] += limit_t
                        gbps = nbytes / statistics.median(op_t) / 1e9
                        base = nbytes / statistics.median(base_t) / 1e9
                        limit = nbytes / statistics.median(limit_t) / 1e9
                        results.append(
                            {
                                "layout": layout.value,
                                "page_size": page_size,
                                "op": op,
                                "method": method,
                                "backend": transfer.backends[PoolName.KV],
                                "gbps": round(gbps, 3),
                                "limit_gbps": round(limit, 3),
                                "ratio_to_baseline": round(gbps / base, 3),
                                "ratio_to_limit": round(gbps / limit, 3),
                            }
                        )
                        say(
                            f"{layout.value} page {page_size} {op} {method}: {gbps:.2f} GB/s "
                            f"({gbps / limit:.2f}x the limit)"
                        )
            finally:
                host.close()

    def rate(samples: Sequence[float]) -> float:
        return round(nbytes / statistics.median(samples) / 1e9, 3)

    # On CPU both directions are the same memcpy: one baseline over both.
    base_samples = base_all["load_layer"] + ([] if pin else base_all["backup"])
    return {
        "device": str(dev),
        "baseline_gbps": rate(base_samples),
        "limit_gbps": rate(limit_all["load_layer"] + limit_all["backup"]),
        "limit_gbps_by_op": {op: rate(v) for op, v in limit_all.items()},
        "results": results,
    }


def _limit_fns(
    dev: torch.device, host_buf: torch.Tensor, dev_buf: torch.Tensor
) -> dict[str, Callable[[], object]]:
    """The plain copy behind the machine's limit, per op.

    CPU: the same contiguous bytes as one piece through the native helper, in one call (the
    ``memcpy`` backend's own loop, streaming stores), both directions being the same operation.
    GPU: one contiguous pinned copy per direction (one cudaMemcpyAsync: the copy engine's limit).
    """
    if dev.type != "cpu":
        return {
            "load_layer": lambda: dev_buf.copy_(host_buf, non_blocking=True),
            "backup": lambda: host_buf.copy_(dev_buf, non_blocking=True),
        }
    lib = load_native()
    dst = np.array([dev_buf.data_ptr()], dtype=np.int64)
    src = np.array([host_buf.data_ptr()], dtype=np.int64)
    zero = np.zeros(1, dtype=np.int64)
    whole = np.array([host_buf.numel()], dtype=np.int64)

    def one() -> object:
        return lib.copy(dst, src, zero, zero, whole)

    return {"load_layer": one, "backup": one}


def _op(
    transfer: GroupTransfer, op: str, maps: Sequence[PageMap], layers: int
) -> Callable[[], object]:
    if op == "backup":
        return lambda: transfer.backup(maps)

    def load_all() -> None:
        for layer in range(layers):
            transfer.load_layer(layer, maps)

    return load_all


__all__ = ["BenchSettings", "run_copy_bench"]
