"""`hicache bench scale`: the command (flags, table, JSON) over hicache.bench.scale.

- register(sub): the subcommand and its flags.
- run(args): checks the flags and that two copy buffers of the largest size fit in memory, runs
  hicache.bench.scale.measure (copy time per byte, planner time per layer, index match cost per
  page as sizes grow), prints one JSON document with --json (docs/bench-scale.md), a short
  table otherwise. torch is imported only when the command runs.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from hicache.bench.scale import MiB, copy_sizes, index_sizes, measure
from hicache.domain import parse_size


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
