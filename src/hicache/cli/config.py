"""`hicache config --show`: the effective configuration and where each value came from.

Reads the defaults, the file (``--file``, else ``$HICACHE_CONFIG``) and the ``HICACHE_*``
environment variables exactly as ``HiCacheConfig.load()`` does, checks them, and prints every
key with its value and its source (default, file PATH, env VARIABLE). A bad file, key or value
exits 2 with one line naming the key and its source. See docs/config-command.md.

JSON (``--json``): {"file": path or null, "keys": {key: {"value", "source", "from", "env"}}};
"source" is default, file or env, "from" the file's path or the variable's name as well.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def register(sub: Any) -> None:
    p = sub.add_parser(
        "config",
        help="show the effective configuration and where each value came from",
        description=(
            "Show hicache's effective configuration (plan, cache, storage, copy backend, "
            "runtime): the defaults, overridden by the file (--file, else $HICACHE_CONFIG), "
            "overridden by HICACHE_* environment variables. Each value is checked; a bad one "
            "exits 2 naming the key and its source."
        ),
    )
    p.add_argument(
        "--show",
        action="store_true",
        help="print every key, its value and its source (what the command does without it too)",
    )
    p.add_argument(
        "--file",
        metavar="PATH",
        default=None,
        help="a .json, .toml, .yaml or .yml configuration file (default: $HICACHE_CONFIG)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    p.set_defaults(handler=run)


def _shown(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (dict, list)):
        return json.dumps(value, sort_keys=True)
    return str(value)


def render(config: Any) -> str:
    entries = config.entries()
    rows = [("key", "value", "source")]
    rows += [(e.key, _shown(e.value), str(e.source)) for e in entries]
    widths = [max(len(r[i]) for r in rows) for i in range(2)]
    changed = sum(e.source.kind != "default" for e in entries)
    head = (
        f"file: {config.file if config.file is not None else 'none'}; "
        f"{changed} of {len(entries)} keys set, the others at their defaults"
    )
    lines = [head, ""]
    lines += [f"{k:<{widths[0]}}  {v:<{widths[1]}}  {s}".rstrip() for k, v, s in rows]
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:
    from hicache.bootstrap.hicache_config import HiCacheConfig

    config = HiCacheConfig.load(path=args.file)
    if args.json:
        sys.stdout.write(json.dumps(config.as_json(), indent=2) + "\n")
    else:
        sys.stdout.write(render(config))
    return 0
