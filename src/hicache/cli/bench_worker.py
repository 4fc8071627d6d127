"""`hicache bench vllm-worker`: the vLLM connector's worker data path (no vLLM needed) on the
CPU and, where torch sees one, on a CUDA GPU (hicache.bench.vllm_worker).

JSON: {"cpu": {...}, "cuda": {...} or {"skipped": why}}; each device: "copy" (save and load
through the worker against one contiguous copy of the same bytes: ``ratio``, target 0.8 on a
GPU) and "compute" (a step of synthetic layers with saves against one without:
``slowdown``, target 0.03 on a GPU).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from hicache.cli._options import MAX_REPEATS, count_option, one_of
from hicache.domain import ConfigError
from hicache.integrations.vllm.kv_layouts import BLOCK_RUN_LAYOUTS


def register(sub: Any) -> None:
    p = sub.add_parser(
        "vllm-worker",
        help="the vLLM connector's worker copies (save, load) and compute slowed by saves",
        description=(
            "Save and load vLLM-shaped block-first caches through the connector's worker "
            "(WorkerTransfers: hicache host memory, copy backends and streams) against one "
            "contiguous copy of the same bytes, and time a step of synthetic layers with and "
            "without saves; on the CPU, and on a CUDA GPU when torch sees one."
        ),
    )
    p.add_argument("--layers", type=int, default=32, help="attention layers")
    p.add_argument("--blocks", type=int, default=256, help="blocks saved and loaded")
    p.add_argument("--repeats", type=int, default=5, help="timed runs; medians are reported")
    p.add_argument("--layer-ms", type=float, default=2.0, help="synthetic compute per layer")
    p.add_argument(
        "--layout",
        default="LBHNC",
        help=f"vLLM's KV cache layout of the caches, {one_of(BLOCK_RUN_LAYOUTS)}: LBHNC is the "
        "CPU backend's, LBNHC what vLLM picks on CUDA unless the backend says otherwise; the "
        "worker copies whole pages under the block-outermost BLHNC and BLNHC "
        "(default: LBHNC)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    layers = count_option("layers", args.layers, 512)
    blocks = count_option("blocks", args.blocks, 1 << 16)
    repeats = count_option("repeats", args.repeats, MAX_REPEATS)
    if args.layout not in BLOCK_RUN_LAYOUTS:
        raise ConfigError(f"--layout {args.layout!r}: expected {one_of(BLOCK_RUN_LAYOUTS)}")
    from hicache.bench.vllm_worker import cuda_status, run_worker_bench

    sizes = {
        "layers": layers,
        "blocks": blocks,
        "repeats": repeats,
        "layer_ms": args.layer_ms,
        "layout": args.layout,
    }
    doc: dict[str, Any] = {"cpu": run_worker_bench("cpu", **sizes)}
    gpu, why = cuda_status()
    if gpu:
        doc["cuda"] = run_worker_bench("cuda", **sizes)
    else:
        doc["cuda"] = {"skipped": why}
        print(f"hicache bench vllm-worker: {why}", file=sys.stderr)
    if args.json:
        print(json.dumps(doc, indent=2))
        return 0
    for name, d in doc.items():
        if "skipped" in d:
            print(f"{name}: skipped ({d['skipped']})")
            continue
        c, k = d["copy"], d["compute"]
        print(
            f"{name} ({d['copy_backend']}, {d['layout']}"
            f"{', whole pages' if d['whole_pages'] else ''}, "
            f"{d['layers']} layers x {d['blocks']} blocks, "
            f"{c['bytes'] / 2**20:.0f} MiB): save {c['save']['worker_gbps']:.2f} GB/s = "
            f"{c['save']['ratio']:.2f}x baseline; load {c['load']['worker_gbps']:.2f} GB/s = "
            f"{c['load']['ratio']:.2f}x; step {k['step_ms_without_saves']:.1f} ms -> "
            f"{k['step_ms_with_saves']:.1f} ms with saves ({100 * k['slowdown']:+.1f}%)"
        )
    return 0
