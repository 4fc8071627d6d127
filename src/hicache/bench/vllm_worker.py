"""Measurements of the vLLM worker's data path (WorkerTransfers) without vLLM.

- run_worker_bench(device, ..., layout=...): vLLM-shaped caches (vllm_caches: bf16, in one of
  vLLM's KV cache layouts the connector copies, kv_layouts.BLOCK_RUN_LAYOUTS) on ``device``
  and the worker's host pages; returns one JSON-ready document (``whole_pages``: whether the worker saves a page in one copy, as in
  the block-outermost layouts):
  - ``copy``: saving (device -> host) and loading (host -> device) ``blocks`` blocks of every
    layer through the worker, against one contiguous copy of the same bytes between the same
    memories in the same run (on CUDA: pinned ``cudaMemcpyAsync`` through torch's
    ``copy_(non_blocking=True)``); ``ratio`` = baseline seconds / worker seconds (target >=
    0.8 on a GPU).
  - ``compute``: a step of ``layers`` synthetic layers (SyntheticCompute, calibrated to
    ``layer_ms``) with every layer's blocks saved as vLLM reports it computed, against the
    same step without saves; ``slowdown`` = with / without - 1 (target <= 0.03 on a GPU).

On the CPU the copies and the compute share the cores, so the compute figure says little
there; the copy figures hold.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from hicache.adapters.streams import SyntheticCompute
from hicache.domain import ConfigError
from hicache.domain.storage import StoreKey
from hicache.integrations.vllm.kv_layouts import BLOCK_RUN_LAYOUTS
from hicache.integrations.vllm.plan import LoadOp, SaveOp, StepPlan
from hicache.integrations.vllm.stats import ConnectorStats
from hicache.integrations.vllm.worker import WorkerTransfers, block_rows

COPY_TARGET = 0.8
SLOWDOWN_TARGET = 0.03


def cuda_status() -> tuple[bool, str]:
    """(whether the CUDA part can run here, why not)."""
    if not torch.cuda.is_available():
        return False, "no CUDA GPU visible to torch: the GPU part was skipped"
    if torch.version.hip is not None:
        return (
            False,
            "a ROCm build of torch: the GPU part (CUDA streams, pinned copies) was skipped",
        )
    return True, ""


def vllm_caches(
    layout: str,
    device: torch.device,
    layers: int,
    blocks: int,
    heads: int,
    tokens: int,
    content: int,
) -> dict[str, torch.Tensor]:
    """bf16 attention caches as vLLM 0.32 hands them over under ``layout``: each layer's
    logical ``[blocks, heads, tokens, content]`` view (vllm/v1/kv_cache_interface.py
    create_kv_cache_views); L* layouts: one tensor per layer; B* layouts: one tensor whose
    block holds every layer's page side by side (the worker then copies whole pages)."""
    if layout not in BLOCK_RUN_LAYOUTS:
        raise ConfigError(
            f"vLLM KV cache layout {layout!r}: expected one of {', '.join(BLOCK_RUN_LAYOUTS)}"
        )
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    inner = (heads, tokens) if layout.endswith("HNC") else (tokens, heads)
    swap = (0, 1, 2, 3) if layout.endswith("HNC") else (0, 2, 1, 3)

    def ones(*shape: int) -> torch.Tensor:
        return torch.ones(*shape, dtype=torch.bfloat16, device=device)

    if layout.startswith("L"):
        return {n: ones(blocks, *inner, content).permute(*swap) for n in names}
    raw = ones(blocks, layers, *inner, content)
    return {n: raw.select(1, i).permute(*swap) for i, n in enumerate(names)}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median(fn: Callable[[], None], device: torch.device, repeats: int) -> float:
    fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _paired(
    a: Callable[[], None], b: Callable[[], None], device: torch.device, repeats: int
) -> tuple[float, float]:
    """Median seconds of ``a`` and ``b`` timed alternately (a shared machine's drift hits both)."""
    ta, tb = [], []
    for _ in range(max(3, repeats)):
        ta.append(_median(a, device, 1))
        tb.append(_median(b, device, 1))
    return statistics.median(ta), statistics.median(tb)


def run_worker_bench(
    device: str = "cpu",
    *,
    layers: int = 32,
    blocks: int = 256,
    block_tokens: int = 16,
    kv_heads: int = 8,
    head_dim: int = 128,
    repeats: int = 5,
    layer_ms: float = 2.0,
    copy_backend: str = "auto",
    layout: str = "LBHNC",
) -> dict[str, Any]:
    dev = torch.device(device)
    total_blocks = 2 * blocks
    caches = vllm_caches(layout, dev, layers, total_blocks, kv_heads, block_tokens, 2 * head_dim)
    rows = [(n, block_rows(n, t, total_blocks)) for n, t in caches.items()]
    page_bytes = sum(int(r.shape[1]) for _, r in rows)
    from hicache.integrations.vllm.worker import choose_copier

    copier = None if copy_backend == "auto" else choose_copier(copy_backend, [r for _, r in rows])
    w = WorkerTransfers(
        rows,
        host_bytes=blocks * page_bytes,
        store=None,
        store_key=lambda page: StoreKey(namespace="bench", pool="kv-r0", page_hash=page.hex()),
        stats=ConnectorStats(),
        copier=copier,
    )
    names = [n for n, _ in rows]
    keys = [i.to_bytes(32, "big") for i in range(blocks)]
    saves = [SaveOp("bench", keys[i], i, i, False) for i in range(blocks)]
    load = LoadOp(
        "bench",
        tuple(keys),
        tuple(range(blocks)),
        tuple(range(blocks, 2 * blocks)),
        (False,) * blocks,
    )
    nbytes = blocks * page_bytes
    compute_stream = torch.cuda.Stream(dev) if dev.type == "cuda" else None  # type: ignore[no-untyped-call]

    def on_compute(fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            if compute_stream is None:
                fn()
                return
            with torch.cuda.stream(compute_stream):
                fn()

        return run

    def save_step() -> None:
        w.bind(StepPlan(saves=list(saves)))
        for name in names:
            w.save_layer(name)
        w.finish_step()
        w.wait_saves()
        w.drain_events()

    def load_step() -> None:
        w.bind(StepPlan(loads=[load]))
        w.start_step()
        for name in names:
            w.wait_layer(name)
        w.finish_step()
        w.wait_saves()
        w.drain_events()

    flat_dev = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    flat_host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=dev.type == "cuda")
    side = torch.cuda.Stream(dev) if dev.type == "cuda" else None  # type: ignore[no-untyped-call]

    def baseline(dst: torch.Tensor, src: torch.Tensor) -> Callable[[], None]:
        def run() -> None:
            if side is None:
                dst.copy_(src)
                return
            with torch.cuda.stream(side):
                dst.copy_(src, non_blocking=True)
            side.synchronize()

        return run

    t_d2h, t_save = _paired(baseline(flat_host, flat_dev), on_compute(save_step), dev, repeats)
    t_h2d, t_load = _paired(baseline(flat_dev, flat_host), on_compute(load_step), dev, repeats)

    # compute slowed by saves
    threads = SyntheticCompute.torch_threads(1) if dev.type == "cpu" else None
    try:
        compute = SyntheticCompute(device)
        layer_s = compute.calibrate(layer_ms / 1e3)
        per_step = max(1, blocks // 8)  # the blocks a prefill step fills, per step

        def step(with_saves: bool) -> Callable[[], None]:
            def run() -> None:
                plan = StepPlan(saves=list(saves[:per_step]) if with_saves else [])
                w.bind(plan)
                for name in names:
                    compute.layer()
                    w.save_layer(name)
                w.finish_step()
                compute.synchronize()

            return run

        t_off, t_on = _paired(on_compute(step(False)), on_compute(step(True)), dev, repeats)
        w.wait_saves()
        w.drain_events()
    finally:
        if threads is not None:
            SyntheticCompute.torch_threads(threads)
    pinned = bool(w.host.is_pinned()) if dev.type == "cuda" else False  # before close unpins
    w.close()
    gb = nbytes / 1e9
    return {
        "device": str(dev),
        "copy_backend": w.copier.backend,
        "host_pinned": pinned,
        "layout": layout,
        "whole_pages": w.page_rows is not None,
        "layers": layers,
        "blocks": blocks,
        "page_bytes": page_bytes,
        "copy": {
            "bytes": nbytes,
            "save": {
                "worker_gbps": gb / t_save,
                "baseline_gbps": gb / t_d2h,
                "ratio": t_d2h / t_save,
            },
            "load": {
                "worker_gbps": gb / t_load,
                "baseline_gbps": gb / t_h2d,
                "ratio": t_h2d / t_load,
            },
            "baseline": "pinned cudaMemcpyAsync (torch copy_ non_blocking)"
            if dev.type == "cuda"
            else "one contiguous torch copy_",
            "target_ratio": COPY_TARGET,
        },
        "compute": {
            "layer_ms": layer_s * 1e3,
            "blocks_saved_per_step": per_step,
            "step_ms_without_saves": t_off * 1e3,
            "step_ms_with_saves": t_on * 1e3,
            "slowdown": t_on / t_off - 1,
            "target_slowdown": SLOWDOWN_TARGET,
        },
    }


__all__ = [
    "COPY_TARGET",
    "SLOWDOWN_TARGET",
    "cuda_status",
    "run_worker_bench",
    "vllm_caches",
]
