"""`hicache shm`: the shared-memory segments hicache left under /dev/shm.

- shm list [--json]: every hicache segment with its owner pid, alive or dead, and size.
- shm gc [--json]: remove the segments whose owner died; print what was removed.

JSON: list -> {"segments": [{"name", "owner_pid", "alive", "size"}]}; gc -> {"removed": [names]}.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from hicache.cli._format import human_bytes


def register(sub: Any) -> None:
    p = sub.add_parser(
        "shm",
        help="list or clean up hicache shared-memory segments",
        description="List hicache shared-memory segments under /dev/shm, or remove dead ones.",
    )
    inner = p.add_subparsers(
        dest="shm_command", metavar="{list,gc}", required=True, parser_class=type(p)
    )
    ls = inner.add_parser(
        "list",
        help="show segments with owner pid, alive or dead, and size in bytes",
        description="List hicache's shared-memory segments under /dev/shm (or $HICACHE_SHM_DIR) "
        "with their owner's pid, whether it is alive, and their size.",
    )
    ls.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    ls.set_defaults(handler=run_list)
    gc = inner.add_parser(
        "gc",
        help="remove the segments whose owner process died",
        description="Remove the hicache shared-memory segments whose owner process died, and "
        "print what was removed.",
    )
    gc.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    gc.set_defaults(handler=run_gc)


def run_list(args: argparse.Namespace) -> int:
    from hicache.adapters.host_memory import list_segments

    segments = list_segments()
    if args.json:
        doc = {"segments": [s.as_json() for s in segments]}
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
        return 0
    if not segments:
        sys.stdout.write("no hicache shared-memory segments in /dev/shm\n")
        return 0
    width = max(len("name"), *(len(s.name) for s in segments))
    lines = [f"{'name':<{width}}  {'owner':>8}  {'state':<5}  {'size':>12}  bytes"]
    lines += [
        f"{s.name:<{width}}  {s.owner_pid:>8}  {'alive' if s.alive else 'dead':<5}  "
        f"{human_bytes(s.size):>12}  {s.size}"
        for s in segments
    ]
    dead = sum(not s.alive for s in segments)
    if dead:
        lines.append(f"{dead} segment(s) of dead owners: `hicache shm gc` removes them")
    sys.stdout.write("\n".join(lines) + "\n")
    return 0


def run_gc(args: argparse.Namespace) -> int:
    from hicache.adapters.host_memory import gc_segments

    removed = gc_segments()
    if args.json:
        sys.stdout.write(json.dumps({"removed": removed}, indent=2) + "\n")
        return 0
    if not removed:
        sys.stdout.write("no segments of dead owners to remove\n")
    for name in removed:
        sys.stdout.write(f"removed {name}\n")
    return 0
