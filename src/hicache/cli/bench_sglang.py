"""`hicache bench sglang`: SGLang's HiCacheFile against hicache's SGLang backend (directory store).

Both move the pages of one SGLang host pool through the calls SGLang's controller makes for
each (hicache.integrations.sglang.bench); the JSON is ``{"pages", "page_bytes", "hicache":
{"put_gbps", "get_gbps", "exists_per_s", "pages_put", "pages_got"}, "hicache_file": {...},
"ratios": {"put", "get"}, "hicache_store_pages_written", "corruption_detected": {"hicache",
"hicache_file"}}`` plus the layout, rounds and paths (docs/sglang.md). The integration (and so sglang
and torch) is imported only when the command runs; without sglang the command exits 2 with one
line.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

from hicache.cli._options import (
    MAX_PAGE_SIZE,
    MAX_REPEATS,
    MAX_STORAGE_PAGES,
    count_option,
    positive_option,
)
from hicache.domain import ConfigError

KEYS = ("pages", "page_bytes", "hicache", "hicache_file", "corruption_detected")
LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")


def register(sub: Any) -> None:
    p = sub.add_parser(
        "sglang",
        help="SGLang's HiCacheFile against hicache's SGLang backend over one SGLang host pool",
        description=(
            "Put, probe and get the pages of one SGLang MHA host pool through SGLang's "
            "HiCacheFile and through hicache's backend (directory store, checksums on); flip a "
            "stored byte of each and read it back."
        ),
    )
    p.add_argument("--pages", type=int, default=64, help="pages per round")
    p.add_argument("--page-size", type=int, default=64, help="tokens per page")
    p.add_argument("--layers", type=int, default=32, help="layers")
    p.add_argument("--heads", type=int, default=8, help="KV heads")
    p.add_argument("--head-dim", type=int, default=64, help="head dim (bf16)")
    p.add_argument("--layout", default="page_first_direct", choices=LAYOUTS, help="host layout")
    p.add_argument("--repeats", type=int, default=5, help="rounds; medians are reported")
    p.add_argument(
        "--dir", default=None, help="where both backends write (default: a temporary folder)"
    )
    p.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    p.set_defaults(handler=run)


def _human(doc: dict[str, Any]) -> str:
    from hicache.cli._format import human_bytes

    hi, hf = doc["hicache"], doc["hicache_file"]
    lines = [f"{doc['pages']} pages of {human_bytes(doc['page_bytes'])} ({doc['layout']})"]
    for what in ("put_gbps", "get_gbps", "exists_per_s"):
        ratio = hi[what] / max(hf[what], 1e-9)
        lines.append(
            f"  {what:13} hicache {hi[what]:>12,}  hicache_file {hf[what]:>12,}  x{ratio:.2f}"
        )
    det = doc["corruption_detected"]
    lines.append(
        f"  corruption detected: hicache {det['hicache']}, hicache_file {det['hicache_file']}"
    )
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:
    if importlib.util.find_spec("sglang") is None:
        raise ConfigError(
            "bench sglang needs sglang: pip install 'hicache[sglang]' (docs/sglang.md)"
        )
    from hicache.integrations.sglang.sglang_imports import (
        allow_sglang_without_torchvision,
        withdraw_stand_in,
    )

    stood_in = allow_sglang_without_torchvision()
    try:
        from hicache.integrations.sglang.bench import SglangBench, run_sglang_bench
    finally:
        if stood_in:
            withdraw_stand_in()

    bench = SglangBench(
        pages=count_option("pages", args.pages, MAX_STORAGE_PAGES),
        page_size=count_option("page-size", args.page_size, MAX_PAGE_SIZE),
        layers=positive_option("layers", args.layers),
        heads=positive_option("heads", args.heads),
        head_dim=positive_option("head-dim", args.head_dim),
        layout=args.layout,
        repeats=count_option("repeats", args.repeats, MAX_REPEATS),
        root=Path(args.dir) if args.dir else None,
    )
    doc = run_sglang_bench(bench)
    if args.json:
        sys.stdout.write(json.dumps(doc) + "\n")
    else:
        sys.stdout.write(_human(doc))
    return 0
