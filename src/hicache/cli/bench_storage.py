"""`hicache bench storage`: a store's put, get and exists against plain file I/O of the same bytes.

The pages are those of a synthetic MHA pool (8 KV heads of 64, bf16: 2 KiB per token per layer,
``--layers`` layers, ``--page-size`` tokens per page, ``--layout``), materialised on host
memory; put reads them from one host pool and get writes them into another (checked
byte-exact). The baseline is one plain sequential write and read of the same total bytes in the
same directory in the same run (docs/storage.md). ``--store`` takes any name
hicache.bootstrap.storage knows (built-in stores, then installed entry points). The measuring
code is hicache.bench.storage (torch), imported only when the command runs.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from hicache.cli._options import (
    MAX_PAGE_SIZE,
    MAX_REPEATS,
    MAX_STORAGE_PAGES,
    count_option,
    one_of,
)
from hicache.domain import Layout

MOONCAKE_KEYS = ("raw_put_gbps", "raw_get_gbps")  # the client's own speed (stores with one)
KEYS = (
    "store",
    "pages",
    "page_bytes",
    "put_gbps",
    "get_gbps",
    "exists_per_s",
    "raw_read_gbps",
    "raw_write_gbps",
)


def register(sub: Any) -> None:
    from hicache.bootstrap.storage import store_names

    p = sub.add_parser(
        "storage",
        help="measure a store's put/get/exists against plain file I/O of the same bytes",
        description=(
            "Put every page of a synthetic host pool into a store, probe exists, get them back "
            "into a second pool; compare with one sequential file write and read of the same "
            "bytes in the same directory."
        ),
    )
    p.add_argument(
        "--store",
        default="directory",
        choices=store_names(),
        help="the store to measure",
    )
    p.add_argument(
        "--store-config",
        default=None,
        help="the store's extra config: a JSON object or @file (.json, .toml, .yaml)",
    )
    p.add_argument("--pages", type=int, default=64, help="pages moved per round")
    p.add_argument("--page-size", type=int, default=64, help="tokens per page")
    p.add_argument("--layers", type=int, default=32, help="layers of the pool")
    p.add_argument(
        "--layout",
        default="page_first_direct",
        help=f"host layout: {one_of(Layout)} (default: page_first_direct, the planner's)",
    )
    p.add_argument("--repeats", type=int, default=5, help="rounds; medians are reported")
    p.add_argument(
        "--dir",
        default=None,
        help="where the raw file goes when the store has no local root (default: the temp dir)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    p.set_defaults(handler=run)


def _human(doc: dict[str, Any]) -> str:
    from hicache.cli._format import human_bytes

    lines = [
        f"store {doc['store']}: {doc['pages']} pages of {human_bytes(doc['page_bytes'])}",
        f"  put    {doc['put_gbps']:7.2f} GB/s   raw write {doc['raw_write_gbps']:7.2f} GB/s   "
        f"x{doc['put_gbps'] / max(doc['raw_write_gbps'], 1e-9):.2f}",
        f"  get    {doc['get_gbps']:7.2f} GB/s   raw read  {doc['raw_read_gbps']:7.2f} GB/s   "
        f"x{doc['get_gbps'] / max(doc['raw_read_gbps'], 1e-9):.2f}",
        f"  exists {doc['exists_per_s']:,} keys/s",
    ]
    if "raw_put_gbps" in doc:
        lines.append(
            f"  the client's own batch calls: put {doc['raw_put_gbps']:.2f} GB/s "
            f"(store x{doc['put_gbps'] / max(doc['raw_put_gbps'], 1e-9):.2f}), get "
            f"{doc['raw_get_gbps']:.2f} GB/s (store x{doc['get_gbps'] / max(doc['raw_get_gbps'], 1e-9):.2f})"
        )
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:
    from hicache.bench.overlap import bench_plan
    from hicache.bootstrap import load_extra_config
    from hicache.bootstrap.machine import check_fits
    from hicache.bootstrap.storage import open_named_store

    pages = count_option("pages", args.pages, MAX_STORAGE_PAGES)
    page_size = count_option("page-size", args.page_size, MAX_PAGE_SIZE)
    repeats = count_option("repeats", args.repeats, MAX_REPEATS)
    plan = bench_plan(
        layers=args.layers,
        tokens=pages * page_size,
        page_size=page_size,
        layout=Layout.parse(args.layout).value,
    )
    # The host pool, and as much again read back: refused before anything is allocated.
    check_fits(
        2 * plan.nbytes,
        f"bench storage with --pages {pages} --page-size {page_size} --layers {args.layers}",
    )
    config = load_extra_config(args.store_config)
    store = open_named_store(args.store, config)
    try:
        from hicache.bench.storage import StorageBench, run_storage_bench

        root = getattr(store, "root", None)
        raw_dir = Path(root) if root is not None else Path(args.dir or tempfile.gettempdir())
        doc = run_storage_bench(store, StorageBench(plan=plan, repeats=repeats, raw_dir=raw_dir))
    finally:
        store.close()
    if args.json:
        keys = KEYS + tuple(k for k in MOONCAKE_KEYS if k in doc)
        sys.stdout.write(json.dumps({k: doc[k] for k in keys}) + "\n")
    else:
        sys.stdout.write(_human(doc))
    return 0
