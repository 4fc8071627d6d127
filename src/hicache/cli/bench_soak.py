"""`hicache bench soak`: random cache operations over every stack with faults; leak and byte checks.

- register(sub): the ``soak`` subcommand (``--ops N``, ``--seed S``, ``--concurrency C``,
  ``--json``).
- run(args): runs hicache.bench.soak.run_soak and prints its report; exits 1 when a slot
  or pin leaked, a restored page differed or the face raised an error (the JSON still comes
  first), 2 for bad input.

The JSON document: {"ops", "faults", "leaked_slots", "leaked_pins", "corrupt_pages", "errors",
"seconds", "cpu_seconds", "checked_pages", "operations": {op: n}, "fault_kinds": {kind: n}} (docs/bench-soak.md).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any

from hicache.cli._options import MAX_CONCURRENCY, MAX_SEED, MAX_SOAK_OPS, count_option
from hicache.domain import ConfigError

KEYS = ("ops", "faults", "leaked_slots", "leaked_pins", "corrupt_pages", "seconds")


def register(sub: Any) -> None:
    p = sub.add_parser(
        "soak",
        help="random cache operations with injected faults over every stack; leak checks",
        description=(
            "Run N random match/insert/load/evict/prefetch/cancel operations over every stack "
            "archetype on the CPU adapters, with store and copy faults injected; check every "
            "restored byte, then leaked slots and pins (docs/bench-soak.md)."
        ),
    )
    p.add_argument("--ops", type=int, default=10_000, help="operations")
    p.add_argument("--seed", type=int, default=0, help="random seed")
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight at once")
    p.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    count_option("ops", args.ops, MAX_SOAK_OPS)
    count_option("concurrency", args.concurrency, MAX_CONCURRENCY)
    seed = args.seed
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed <= MAX_SEED:
        raise ConfigError(f"--seed must be an integer in [0, {MAX_SEED}], got {seed!r}")
    import structlog

    from hicache.bench.soak import SoakSettings, run_soak

    settings = SoakSettings(ops=args.ops, seed=args.seed, concurrency=args.concurrency)
    was = structlog.is_configured()
    saved = dict(structlog.get_config())
    # Injected faults log a warning each; the report counts them.
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
    )
    try:
        report = run_soak(settings)
    finally:
        if was:
            structlog.configure(**saved)
        else:
            structlog.reset_defaults()
    doc = report.as_json()
    if args.json:
        sys.stdout.write(json.dumps(doc) + "\n")
    else:
        sys.stdout.write(
            f"{doc['ops']} ops, {doc['faults']} faults injected, {doc['checked_pages']} pages "
            f"checked in {doc['seconds']:.1f} s: {doc['leaked_slots']} leaked slots, "
            f"{doc['leaked_pins']} leaked pins, {doc['corrupt_pages']} corrupt pages, "
            f"{doc['errors']} errors\n"
        )
    bad = doc["leaked_slots"] or doc["leaked_pins"] or doc["corrupt_pages"] or doc["errors"]
    if bad:
        sys.stderr.write("soak: leaks, corrupt pages or errors found\n")
    return 1 if bad else 0
