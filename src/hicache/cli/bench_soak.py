"""`hicache bench soak`: random operations with injected faults on each path; leak and byte checks.

- register(sub): the ``soak`` subcommand (``--ops N`` per path, ``--seed S``, ``--concurrency C``
  for the cache path, ``--paths cache,vllm,sglang``, ``--json``).
- run(args): runs each path (the cache face: hicache.bench.soak; the vLLM connector:
  hicache.integrations.vllm.soak; the SGLang backend: hicache.integrations.sglang.soak, the
  last two imported only when asked for) and prints their reports; exits 1 when a path leaked,
  read back a wrong byte or raised an error (the JSON still comes first), 2 for bad input (a
  bad count, an unknown path, or a path whose serving engine is not installed).

The JSON document: {"paths": {path: {"path", "ops", "faults", "errors", "leaks",
"corrupt_pages", "checked_pages", "seconds", "operations", "fault_kinds", "error_kinds",
"error_samples", "details"}}, "errors", "leaks", "corrupt_pages", "checked_pages", "seconds"}
with the totals over the paths (docs/bench-soak.md).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import sys
from collections.abc import Callable
from typing import Any

from hicache.cli._options import MAX_CONCURRENCY, MAX_SEED, MAX_SOAK_OPS, count_option
from hicache.domain import ConfigError
from hicache.domain.errors import shown

PATHS = ("cache", "vllm", "sglang")
TOTALS = ("errors", "leaks", "corrupt_pages", "checked_pages")


def register(sub: Any) -> None:
    p = sub.add_parser(
        "soak",
        help="random operations with injected faults on the cache, vLLM and SGLang paths",
        description=(
            "Run N random operations on each path, with store (and copy) faults injected: the "
            "cache face over every stack archetype, HiCacheConnector under vLLM's real "
            "scheduler, HiCacheBackend under SGLang's calls; check every byte read back, then "
            "leaked slots, pins, blocks and store calls (docs/bench-soak.md)."
        ),
    )
    p.add_argument("--ops", type=int, default=10_000, help="operations per path")
    p.add_argument("--seed", type=int, default=0, help="random seed")
    p.add_argument(
        "--concurrency", type=int, default=4, help="cache path: requests in flight at once"
    )
    p.add_argument(
        "--paths",
        default=",".join(PATHS),
        help=f"comma-separated paths to soak, of {', '.join(PATHS)} (default: {','.join(PATHS)})",
    )
    p.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    p.set_defaults(handler=run)


def parse_paths(value: object) -> tuple[str, ...]:
    """``--paths``: a comma-separated subset of PATHS, in PATHS' order, each once."""
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"--paths must name some of {', '.join(PATHS)}, got {shown(value)}")
    names = [v.strip() for v in value.split(",") if v.strip()]
    bad = [n for n in names if n not in PATHS]
    if bad or not names:
        raise ConfigError(
            f"--paths: unknown path {shown(bad[0] if bad else value)}; expected a "
            f"comma-separated list of {', '.join(PATHS)}"
        )
    return tuple(p for p in PATHS if p in names)


def _runner(path: str, args: argparse.Namespace) -> Callable[[], Any]:
    """The soak of ``path``; a ConfigError when its serving engine is not installed."""
    if path == "cache":
        from hicache.bench.soak import SoakSettings, run_soak

        settings = SoakSettings(ops=args.ops, seed=args.seed, concurrency=args.concurrency)
        return lambda: run_soak(settings).as_path()
    if importlib.util.find_spec(path) is None:
        raise ConfigError(
            f"bench soak --paths {path}: {path} is not installed (pip install 'hicache[{path}]'); "
            f"leave it out of --paths"
        )
    if path == "vllm":
        from hicache.integrations.vllm.soak import soak_vllm

        return lambda: soak_vllm(args.ops, args.seed)
    from hicache.integrations.sglang.sglang_imports import (
        allow_sglang_without_torchvision,
        withdraw_stand_in,
    )

    stood_in = allow_sglang_without_torchvision()
    try:
        from hicache.integrations.sglang.soak import soak_sglang
    finally:
        if stood_in:
            withdraw_stand_in()
    return lambda: soak_sglang(args.ops, args.seed)


def _line(doc: dict[str, Any]) -> str:
    return (
        f"{doc['path']}: {doc['ops']} ops, {doc['faults']} faults injected, "
        f"{doc['checked_pages']} pages checked in {doc['seconds']:.1f} s: {doc['errors']} "
        f"errors, {doc['leaks']} leaks, {doc['corrupt_pages']} corrupt pages\n"
    )


def run(args: argparse.Namespace) -> int:
    count_option("ops", args.ops, MAX_SOAK_OPS)
    count_option("concurrency", args.concurrency, MAX_CONCURRENCY)
    seed = args.seed
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed <= MAX_SEED:
        raise ConfigError(f"--seed must be an integer in [0, {MAX_SEED}], got {shown(seed)}")
    paths = parse_paths(args.paths)
    runners = {path: _runner(path, args) for path in paths}  # a missing engine: before any run
    import structlog

    was = structlog.is_configured()
    saved = dict(structlog.get_config())
    # Injected faults log a warning each; the report counts them.
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
    )
    quiet = [logging.getLogger(name) for name in ("vllm", "sglang")]
    levels = [log.level for log in quiet]
    for log in quiet:
        log.setLevel(logging.ERROR)  # vLLM's own warnings (a recovered load, a refused reset)
    try:
        reports = {path: runner().as_json() for path, runner in runners.items()}
    finally:
        for log, level in zip(quiet, levels, strict=True):
            log.setLevel(level)
        if was:
            structlog.configure(**saved)
        else:
            structlog.reset_defaults()
    doc: dict[str, Any] = {"paths": reports}
    for key in TOTALS:
        doc[key] = sum(r[key] for r in reports.values())
    doc["seconds"] = round(sum(r["seconds"] for r in reports.values()), 3)
    if args.json:
        sys.stdout.write(json.dumps(doc) + "\n")
    else:
        for report in reports.values():
            sys.stdout.write(_line(report))
    bad = doc["errors"] or doc["leaks"] or doc["corrupt_pages"]
    if bad:
        sys.stderr.write("soak: leaks, corrupt pages or errors found\n")
    return 1 if bad else 0
