"""`hicache bench scale`: how hicache's costs grow with size, as ratios measured in one run.

- copy: one native memcpy (the "memcpy" backend's copy loop) of 16 MiB, 64 MiB, 256 MiB and
  1 GiB (up to ``--max-bytes``); the time per byte at the largest size over that at 16 MiB
  (target <= 1.2).
- planner: plan_stack of a Qwen3-Next-shaped hybrid (Gated DeltaNet + full attention every 4th
  layer) of 8, 16, 32, 64, 128 and 256 layers; the time per layer at 256 over that at 8
  (target <= 2).
- cache: the prefix index's match cost per page at 10^3, 10^4 and 10^5 cached pages (up to
  ``--max-pages``); the cost at the largest over that at 10^3 (target <= 2).

Prints one JSON document with --json (docs/bench-scale.md), a short table otherwise. torch is
imported only when the command runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

from hicache.domain import ConfigError, ModelSpec, parse_size, plan_stack

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


def register(sub: Any) -> None:
    p = sub.add_parser(
        "scale",
        help="measure how copy and planning costs grow with size (ratios in one run)",
        description=(
            "Copy time per byte from 16 MiB to 1 GiB (native memcpy) and planner time per "
            "layer from 8 to 256 layers, each as a ratio of largest to smallest."
        ),
    )
    p.add_argument(
        "--max-bytes",
        default="1GiB",
        help="largest copy, at least 16MiB; the sizes are 16 MiB x 4^k",
    )
    p.add_argument(
        "--max-pages",
        type=int,
        default=100_000,
        help="largest prefix index for the cache's match cost, at least 1000; the sizes are "
        "1000 x 10^k (`hicache bench cache` measures 10^6)",
    )
    p.add_argument("--repeats", type=int, default=5, help="samples per point; medians kept")
    p.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    p.set_defaults(handler=run)


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
    from hicache.bench.scale import memcpy_scale
    from hicache.cli.bench_cache import index_costs

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


def render(doc: dict[str, Any]) -> str:
    c, p = doc["copy"], doc["planner"]
    lines = ["copy (native memcpy):"]
    lines += [
        f"  {pt['bytes'] / MiB:8.0f} MiB  {pt['ms']:9.3f} ms  {pt['gbps']:7.2f} GB/s"
        for pt in c["points"]
    ]
    lines.append(
        f"  time per byte, largest / smallest: {c['ratio_per_byte']:.3f} (target <= {c['target']})"
    )
    lines.append("planner (plan_stack, model read included):")
    lines += [
        f"  {pt['layers']:8d} layers  {pt['us']:10.2f} us  {pt['us_per_layer']:8.3f} us/layer"
        for pt in p["points"]
    ]
    lines.append(f"  time per layer, 256 / 8: {p['ratio_per_layer']:.3f} (target <= {p['target']})")
    k = doc["cache"]
    lines.append("cache (prefix index match, page size 64):")
    lines += [
        f"  {pt['pages']:8d} pages  {pt['match_us_per_page']:8.3f} us/page matched"
        for pt in k["points"]
    ]
    lines.append(
        f"  match per page, largest / smallest: {k['ratio_match_per_page']:.3f} "
        f"(target <= {k['target']})"
    )
    lines.append(f"took {doc['seconds']} s")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from hicache.bootstrap.machine import check_count, check_fits

    max_bytes = parse_size(args.max_bytes)
    sizes = copy_sizes(max_bytes)
    repeats = check_count(args.repeats, "--repeats", 100)
    check_fits(2 * sizes[-1], f"bench scale with --max-bytes {args.max_bytes} (two buffers)")
    max_pages = index_sizes(args.max_pages)[-1]
    doc = measure(max_bytes, repeats, max_pages)
    if args.json:
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
    else:
        sys.stdout.write(render(doc) + "\n")
    return 0
