"""`hicache bench engine`: the engine's own costs, copies excluded (docs/bench-engine.md).

Prints {"device", "free_us", "load_overhead_us", "rss_released_fraction"} with --json, a short
table otherwise: one free of 16 pages per pool size, the engine's time per load at 1, 16 and 256
loads in flight (a transfer that moves nothing, CPU streams), and the share of host bytes a
closed runtime gives back. The measuring code: hicache.bench.engine.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from hicache.cli._logs import QuietLogs

MAX_ROUNDS = 10_000


def register(sub: Any) -> None:
    p = sub.add_parser(
        "engine",
        help="measure the engine's own costs: slot frees, per-load overhead, memory given back",
        description=(
            "Measure one free of 16 pages at 32K, 1M and 8M pages; the engine's own time per "
            "load (no copies) at 1, 16 and 256 concurrent loads; and the share of host bytes "
            "given back when a runtime is closed."
        ),
    )
    p.add_argument(
        "--rounds", type=int, default=20, help="timed rounds per concurrency (median kept)"
    )
    p.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    p.set_defaults(handler=run)


def render(doc: dict[str, Any]) -> str:
    lines = [f"device {doc['device']}", "free of 16 pages (us):"]
    lines += [f"  {k:>8} pages  {v:10.3f}" for k, v in doc["free_us"].items()]
    lines.append("engine time per load, copies excluded (us):")
    lines += [f"  {k:>8} loads  {v:10.3f}" for k, v in doc["load_overhead_us"].items()]
    lines.append(f"host bytes given back at close: {doc['rss_released_fraction']:.4f}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from hicache.bootstrap.machine import check_count

    check_count(args.rounds, "--rounds", MAX_ROUNDS)
    from hicache.bench.engine import run_engine_bench

    with QuietLogs():
        doc = run_engine_bench(rounds=args.rounds)
    if args.json:
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
    else:
        sys.stdout.write(render(doc) + "\n")
    return 0
