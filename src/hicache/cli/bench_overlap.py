"""`hicache bench overlap`: the command (flags, table, JSON) over hicache.bench.overlap.

- register(sub): the subcommand and its flags.
- run(args): checks the flags and the memory the run would hold, runs
  hicache.bench.overlap.run_overlap_bench with logs quiet, prints the table or one JSON document
  (KEYS, plus "timeline" with --timeline), and notes on stderr when other processes kept CPU
  cores busy meanwhile. What is measured: hicache.bench.overlap and docs/bench-overlap.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from hicache.bench.overlap import (
    KEYS,
    MAX_REPEATS,
    OtherLoad,
    bench_plan,
    check_positive,
    run_overlap_bench,
)
from hicache.cli._logs import QuietLogs
from hicache.cli._options import one_of
from hicache.domain import Layout


def register(sub: Any) -> None:
    p = sub.add_parser(
        "overlap",
        help="measure how much of a layer-wise load compute hides",
        description=(
            "Load a synthetic prefix layer by layer through the engine while a synthetic "
            "forward pass computes; report transfer, compute, serial and overlapped times."
        ),
    )
    p.add_argument("--device", default="cpu", help="cpu, cuda[:N] or rocm[:N]")
    p.add_argument("--layers", type=int, default=32, help="transfer layers")
    p.add_argument(
        "--tokens",
        type=int,
        default=4096,
        help="tokens of the loaded prefix (default: 4096, 8 MiB per layer)",
    )
    p.add_argument("--page-size", type=int, default=64, help="tokens per page")
    p.add_argument(
        "--layout",
        default="page_first_direct",
        help=f"host layout: {one_of(Layout)} (default: page_first_direct, the planner's)",
    )
    p.add_argument("--repeats", type=int, default=11, help="rounds; medians are reported")
    p.add_argument(
        "--timeline",
        action="store_true",
        help="add a per-layer timeline of one overlapped round to the JSON (key 'timeline')",
    )
    p.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from hicache.bootstrap.machine import check_fits

    plan = bench_plan(
        layers=args.layers, tokens=args.tokens, page_size=args.page_size, layout=args.layout
    )
    repeats = check_positive("repeats", args.repeats, MAX_REPEATS)
    # Host and device pools of the plan's bytes each, checked before either is mapped.
    check_fits(
        2 * plan.nbytes,
        f"bench overlap with --layers {args.layers} --tokens {args.tokens} (host + device pools)",
    )
    with QuietLogs(), OtherLoad() as others:
        result = run_overlap_bench(
            plan, device=args.device, repeats=repeats, timeline=args.timeline
        )
    if args.json:
        keys = (*KEYS, "timeline") if args.timeline else KEYS
        sys.stdout.write(json.dumps({k: result[k] for k in keys}) + "\n")
    else:
        sys.stdout.write(_human(result))
    busy = others.cores()
    if busy is not None and busy > 0.05:
        sys.stderr.write(
            f"hicache: note: other processes kept {busy:.2f} CPU cores busy during the run; "
            f"overlap needs a core for the copies and one for compute, so these figures "
            f"understate it\n"
        )
    return 0


def _human(r: dict[str, Any]) -> str:
    backends = ", ".join(f"{k.value}={v}" for k, v in r["_backend"].items()) or "?"
    return (
        f"hicache bench overlap on {r['device']}: {r['layers']} layers x "
        f"{r['_bytes_per_layer'] / 2**20:.1f} MiB ({r['_tokens']} tokens), copy backend "
        f"{backends}, compute = {r['_matmul_n']}x{r['_matmul_n']} matmul per layer, "
        f"medians of {r['_repeats']}\n"
        f"  transfer only   {r['transfer_ms']:9.3f} ms\n"
        f"  compute only    {r['compute_ms']:9.3f} ms\n"
        f"  serial          {r['serial_ms']:9.3f} ms\n"
        f"  overlapped      {r['overlapped_ms']:9.3f} ms\n"
        f"  exposed fraction {r['exposed_fraction']:.3f} of the transfer stayed visible "
        f"(target <= 0.10 on CPU, <= 0.05 on a GPU)\n"
        f"  signal          {r['signal_us_per_layer']:9.3f} us per layer "
        f"(wait_layer on a finished copy; target <= 20 on CPU)\n"
    )
