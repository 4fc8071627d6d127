"""`hicache bench copy`: host <-> device copy methods against a contiguous copy of the same bytes.

Measures, in one process and under one torch thread: a contiguous copy (the baseline), the
naive peer method (one copy_ per buffer, layer and page) and hicache's chosen backend, for the
all-layer backup and for per-layer loads of every layer, per layout and page size; prints one
JSON document with --json (docs/bench-copy.md), a table otherwise. The measuring code is
hicache.bench.copy (torch), imported only when the command runs.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from hicache.cli._options import comma_items, one_of
from hicache.domain import ConfigError, Layout
from hicache.domain.errors import shown

DEFAULT_PAGE_SIZES = "1,16,64,256"
DEFAULT_LAYOUTS = ",".join(layout.value for layout in Layout)


def register(sub: Any) -> None:
    p = sub.add_parser(
        "copy",
        help="measure host <-> device copy backends against a contiguous copy",
        description=(
            "Measure hicache's copy backend and the naive one-copy-per-layer-per-page method "
            "against a contiguous copy of the same bytes, for all-layer backup and per-layer "
            "load, on a synthetic 32-layer MHA bf16 pool (2 KiB per token per layer)."
        ),
    )
    p.add_argument("--device", default="cpu", help="cpu, cuda[:N] or rocm[:N]")
    p.add_argument(
        "--page-sizes",
        default=DEFAULT_PAGE_SIZES,
        help="comma-separated tokens per page",
    )
    p.add_argument(
        "--layouts",
        default=DEFAULT_LAYOUTS,
        help=f"comma-separated host layouts, each {one_of(Layout)}",
    )
    p.add_argument(
        "--host-memory",
        default="anonymous",
        choices=("anonymous", "shm"),
        help="host memory kind of the host pool",
    )
    p.add_argument(
        "--repeats", type=int, default=3, help="timed runs per measurement; the median is kept"
    )
    p.add_argument(
        "--backend",
        default="auto",
        help="hicache backend to measure: one of auto (the measured default), naive, torch, "
        "memcpy, cuda_batch",
    )
    p.add_argument(
        "--tokens",
        type=int,
        default=4096,
        help="tokens moved per measurement (default: 4096, 256 MiB with 32 layers)",
    )
    p.add_argument("--layers", type=int, default=32, help="layers of the pool")
    p.add_argument(
        "--huge-pages",
        action="store_true",
        help="map anonymous host pools on transparent huge pages (fewer TLB misses)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    p.set_defaults(handler=run)


def _ints(text: str, flag: str) -> tuple[int, ...]:
    items = comma_items(flag, text)
    try:
        return tuple(int(t) for t in items)
    except ValueError:
        raise ConfigError(f"{flag} expects comma-separated integers, got {shown(text)}") from None


def _layouts(text: str) -> tuple[Layout, ...]:
    return tuple(Layout.parse(t) for t in comma_items("--layouts", text))


def render_table(doc: dict[str, Any]) -> str:
    head = (
        f"device {doc['device']}   baseline (contiguous copy) {doc['baseline_gbps']:.2f} GB/s"
        f"   limit (one native copy) {doc['limit_gbps']:.2f} GB/s"
    )
    cols = ("layout", "page", "op", "method", "backend", "GB/s", "x baseline", "x limit")
    rows = [cols] + [
        (
            r["layout"],
            str(r["page_size"]),
            r["op"],
            r["method"],
            r["backend"],
            f"{r['gbps']:.2f}",
            f"{r['ratio_to_baseline']:.2f}",
            f"{r['ratio_to_limit']:.2f}",
        )
        for r in doc["results"]
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(len(cols))]
    lines = [head, ""]
    lines.extend(
        "  ".join(
            c.rjust(w) if i >= 5 else c.ljust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        ).rstrip()
        for r in rows
    )
    return "\n".join(lines)


MAX_REPEATS = 1000
BYTES_PER_TOKEN_LAYER = 2048  # the synthetic pool: 8 KV heads x 64 x bf16, K and V
# Baseline host and device buffers (1x the moved bytes each) plus a host and a device pool of
# twice the moved tokens (2x each): six times the moved bytes are resident at once.
RESIDENT_MULTIPLE = 6


def check_sizes(*, tokens: int, layers: int, repeats: int) -> None:
    """Ceilings checked before anything is allocated: counts, then this machine's memory."""
    from hicache.bootstrap.machine import check_count, check_fits
    from hicache.domain.limits import MAX_LAYERS, MAX_UNITS

    check_count(tokens, "--tokens", MAX_UNITS)
    check_count(layers, "--layers", MAX_LAYERS)
    check_count(repeats, "--repeats", MAX_REPEATS)
    moved = tokens * layers * BYTES_PER_TOKEN_LAYER
    check_fits(
        RESIDENT_MULTIPLE * moved,
        f"bench copy with --tokens {tokens} --layers {layers} ({moved} B moved, "
        f"{RESIDENT_MULTIPLE}x resident)",
    )


def run(args: argparse.Namespace) -> int:
    page_sizes = _ints(args.page_sizes, "--page-sizes")
    layouts = _layouts(args.layouts)
    check_sizes(tokens=args.tokens, layers=args.layers, repeats=args.repeats)
    from hicache.bench.copy import BenchSettings, run_copy_bench

    settings = BenchSettings(
        device=args.device,
        page_sizes=page_sizes,
        layouts=layouts,
        host_memory=args.host_memory,
        repeats=args.repeats,
        backend=args.backend,
        tokens=args.tokens,
        layers=args.layers,
        huge_pages=args.huge_pages,
    )

    def progress(msg: str) -> None:
        sys.stderr.write(f"hicache bench copy: {msg}\n")

    doc = run_copy_bench(settings, progress=None if args.json else progress)
    if args.json:
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
    else:
        sys.stdout.write(render_table(doc) + "\n")
    return 0
