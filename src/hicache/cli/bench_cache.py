"""`hicache bench cache`: the command (flags, table, JSON) over hicache.bench.cache.

- register(sub): the subcommand and its flags.
- run(args): checks every flag before anything is built or timed, runs
  hicache.bench.cache.measure, prints the table or one JSON document (KEYS). What is measured:
  hicache.bench.cache and docs/cache.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from hicache.bench.cache import KEYS, LONG_PROMPT, measure, use_keys
from hicache.cli._options import (
    MAX_BENCH_TOKENS,
    MAX_INDEX_PAGES,
    MAX_PAGE_SIZE,
    MAX_REPEATS,
    comma_items,
    count_option,
)
from hicache.domain import ConfigError
from hicache.domain.errors import shown


def register(sub: Any) -> None:
    p = sub.add_parser(
        "cache",
        help="measure page-key hashing and the prefix index's cost per page",
        description=(
            "Hash a request into chained page keys and time the prefix index's insert and "
            "match per page when it holds 1000 pages and --pages-max pages."
        ),
    )
    p.add_argument("--pages-max", type=int, default=1_000_000, help="largest index")
    p.add_argument("--tokens", type=int, default=131072, help="request tokens")
    p.add_argument("--page-size", type=int, default=64, help="tokens per page")
    p.add_argument(
        "--request-page-sizes",
        default="1,16,64",
        help="page sizes of the request_ms figure, comma-separated",
    )
    p.add_argument("--batch", type=int, default=256, help="pages per timed batch")
    p.add_argument("--repeats", type=int, default=15, help="rounds; medians are reported")
    p.add_argument(
        "--long-prompt",
        type=int,
        default=LONG_PROMPT,
        help="tokens of the long_prompt figures",
    )
    p.add_argument(
        "--python-keys",
        action="store_true",
        help="hash page keys with the Python chain, not the native one (the same keys)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    p.set_defaults(handler=run)


def _sizes(text: str, tokens: int) -> list[int]:
    top = min(MAX_PAGE_SIZE, tokens)
    expected = f"expected 1 to 16 integers in [1, {top}] separated by commas"
    try:  # an empty item ("1,,16"), too many, or a non-integer: the same one-line refusal
        sizes = [int(x) for x in comma_items("--request-page-sizes", text, most=16)]
    except ValueError:  # ConfigError is one
        sizes = []
    if not sizes or any(not 1 <= s <= top for s in sizes):
        raise ConfigError(f"--request-page-sizes {shown(text)}: {expected}")
    return sizes


def run(args: argparse.Namespace) -> int:
    pages_max = count_option("pages-max", args.pages_max, MAX_INDEX_PAGES)
    tokens = count_option("tokens", args.tokens, MAX_BENCH_TOKENS)
    # A page larger than the request would hash no page at all: meaningless figures.
    page_size = count_option("page-size", args.page_size, min(MAX_PAGE_SIZE, tokens))
    # Every option is checked before anything is built or timed.
    sizes = _sizes(args.request_page_sizes, tokens)
    batch = count_option("batch", args.batch, pages_max)
    repeats = count_option("repeats", args.repeats, MAX_REPEATS)
    long_prompt = count_option("long-prompt", args.long_prompt, MAX_BENCH_TOKENS)
    use_keys(args.python_keys)
    result = measure(
        pages_max=pages_max,
        tokens=tokens,
        page_size=page_size,
        request_page_sizes=sizes,
        batch=batch,
        repeats=repeats,
        long_prompt=long_prompt,
    )
    if args.json:
        sys.stdout.write(json.dumps({k: result[k] for k in KEYS}) + "\n")
        return 0
    sys.stdout.write(_human(result, args.tokens))
    return 0


def _human(r: dict[str, Any], tokens: int) -> str:
    lines = [
        f"page keys: {r['hash_tokens_per_s'] / 1e6:.1f} M tokens/s at page size {r['page_size']}",
        f"{'pages in index':>16} {'insert us/page':>15} {'match us/page':>14}",
    ]
    lines.extend(
        f"{int(n):>16,} {r['insert_us_per_page'][n]:>15.2f} {r['match_us_per_page'][n]:>14.2f}"
        for n in r["insert_us_per_page"]
    )
    for ps, ms in r["request_ms"].items():
        lines.append(f"hash + match of a {tokens:,}-token request at page size {ps}: {ms:.1f} ms")
    for ps, ms in r["long_prompt_ms"].items():
        ins = r["long_prompt_insert_ms"][ps]
        lines.append(
            f"{r['long_prompt_tokens']:,}-token prompt at page size {ps}: hash + match {ms:.1f} ms, "
            f"hash + insert {ins:.1f} ms"
        )
    lines.append(f"page keys hashed by: {r['key_hasher']}")
    return "\n".join(lines) + "\n"
