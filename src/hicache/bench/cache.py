"""The measurement behind `hicache bench cache`: page keys and the prefix index, cost per page.

Measured in one process on the CPU (the index is pure Python; no device is involved):

- hash_tokens_per_s: chained sha256 page keys (hicache.domain.keys.chain_keys) over a request
  of ``--tokens`` random token ids at ``--page-size``; the median of ``--repeats`` rounds.
- match_us_per_page / insert_us_per_page: an index of the default write settings
  (write_through, no storage) is filled with N pages (N = 1000 and ``--pages-max``); then, in
  each of ``--repeats`` rounds, a fresh batch of ``--batch`` pages is inserted (timed), matched
  (timed), and as many of its oldest pages evicted (untimed), so it keeps N pages. The rounds
  of the two sizes alternate; medians per page, with the cyclic garbage collector paused (as
  timeit does).
- request_ms: hashing plus matching one fully cached request of ``--tokens`` tokens, for each of
  ``--request-page-sizes``; the keys are a KeyChain (hicache.domain.keys.key_chain: one bytes
  object, as the cache face hashes a request), which the index matches in O(log n) lookups
  plus one checked walk over the hit's records.
- long_prompt_ms: the same for a ``--long-prompt``-token request (131,072) at page sizes 1, 16
  and 64 (targets: under
  50 ms at page 1, under 20 ms at page 16); long_prompt_insert_ms: hashing it and inserting
  it into an empty index (every page new). Medians of ``max(1, --repeats // 3)`` rounds, the
  garbage collector left on (as a server runs).
- key_hasher: which chain hashed the keys: "native-sha-ni" / "native-portable" (the C chain of
  hicache.adapters.native_keys, installed when a C compiler is there) or "python"; with
  ``--python-keys`` the Python chain is used (the same keys).

The JSON document: {"hash_tokens_per_s", "match_us_per_page": {"1000": a, "<pages-max>": b},
"insert_us_per_page": {...}, "page_size", "request_ms": {"<page size>": ms, ...},
"long_prompt_ms": {"1": ms, "16": ms, "64": ms}, "long_prompt_insert_ms": {...},
"long_prompt_tokens", "key_hasher"} (KEYS); measure() returns it.

- use_keys(python): installs the chain that hashes page keys (native unless ``python``).
- measure(...): every figure above, as the JSON document.
- index_costs(sizes, batch, repeats): insert and match microseconds per page at index sizes
  (also the index half of `hicache bench scale`).
The command (flags, table, JSON): hicache.cli.bench_cache.
"""

from __future__ import annotations

import gc
import hashlib
import random
import statistics
import time
from typing import Any

from hicache.domain import (
    GroupRules,
    PoolName,
    PoolRule,
    PrefixIndex,
    Restore,
    Tier,
    chain_keys,
    key_chain,
)
from hicache.domain.keys import chain_hasher, set_chain_hasher

KV = PoolName.KV
SMALL = 1000
LONG_PROMPT = 131_072
LONG_PAGE_SIZES = (1, 16, 64)
KEYS = (
    "hash_tokens_per_s",
    "match_us_per_page",
    "insert_us_per_page",
    "page_size",
    "request_ms",
    "long_prompt_ms",
    "long_prompt_insert_ms",
    "long_prompt_tokens",
    "key_hasher",
)


def _rules(page_size: int) -> GroupRules:
    return GroupRules(page_size=page_size, rules=[PoolRule(pool=KV, restore=Restore.ALL_PAGES)])


def _key(i: int) -> bytes:
    return hashlib.sha256(i.to_bytes(8, "little")).digest()


def _fill(index: PrefixIndex, pages: int, batch: int, start: int) -> int:
    n = start
    while n < start + pages:
        m = min(batch, start + pages - n)
        index.insert([_key(i) for i in range(n, n + m)], [{KV: i} for i in range(n, n + m)])
        n += m
    return n


class _Sized:
    """An index of the default write settings kept at ``pages`` pages between timed rounds."""

    def __init__(self, pages: int, page_size: int, first_id: int) -> None:
        self.index = PrefixIndex(_rules(page_size))
        self.next = _fill(self.index, pages, 4096, first_id)
        self.inserts: list[float] = []
        self.matches: list[float] = []

    def round(self, batch: int) -> None:
        keys = [_key(i) for i in range(self.next, self.next + batch)]
        where = [{KV: i} for i in range(self.next, self.next + batch)]
        self.next += batch
        t0 = time.perf_counter()
        self.index.insert(keys, where)
        t1 = time.perf_counter()
        m = self.index.match(keys)
        t2 = time.perf_counter()
        if m.device_pages != batch:  # pragma: no cover - a broken index, not a slow one
            raise RuntimeError(f"bench: matched {m.device_pages} of {batch} inserted pages")
        self.inserts.append((t1 - t0) / batch * 1e6)
        self.matches.append((t2 - t1) / batch * 1e6)
        self.index.evict(Tier.DEVICE, batch)  # the oldest pages go: the size stays the same


def index_costs(
    sizes: list[int], *, batch: int, repeats: int, page_size: int
) -> dict[int, tuple[float, float]]:
    """Median (insert, match) microseconds per page for an index of each size.

    The rounds of the sizes alternate, so a busy machine slows them alike. The cyclic garbage
    collector is paused meanwhile (as ``timeit`` does): a full collection over a million pages
    is a pause of the whole process, not a cost of the index.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        indexes: list[_Sized] = []
        first = 0
        for n in sizes:
            indexes.append(_Sized(n, page_size, first))
            first = indexes[-1].next + 10 * n + repeats * batch
        for _ in range(repeats):
            for sized in indexes:
                sized.round(batch)
        return {
            n: (statistics.median(s.inserts), statistics.median(s.matches))
            for n, s in zip(sizes, indexes, strict=True)
        }
    finally:
        if enabled:
            gc.enable()


def request_ms(tokens: list[int], page_size: int, repeats: int) -> float:
    """Median milliseconds to hash a fully cached request and match it."""
    index = PrefixIndex(_rules(page_size))
    keys = key_chain(tokens, page_size)
    index.insert(keys, [{KV: i} for i in range(len(keys))])
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        m = index.match(key_chain(tokens, page_size))
        times.append((time.perf_counter() - t0) * 1e3)
        if m.device_pages != len(keys):  # pragma: no cover
            raise RuntimeError("bench: a cached request did not match whole")
    return statistics.median(times)


def insert_ms(tokens: list[int], page_size: int, repeats: int) -> float:
    """Median milliseconds to hash a request and insert all its pages into an empty index."""
    times = []
    for _ in range(repeats):
        index = PrefixIndex(_rules(page_size))
        where = [{KV: i} for i in range(len(tokens) // page_size)]
        t0 = time.perf_counter()
        index.insert(key_chain(tokens, page_size), where)
        times.append((time.perf_counter() - t0) * 1e3)
        if len(index) != len(where):  # pragma: no cover
            raise RuntimeError("bench: an inserted request is not whole in the index")
    return statistics.median(times)


def measure(
    *,
    pages_max: int,
    tokens: int,
    page_size: int,
    request_page_sizes: list[int],
    batch: int,
    repeats: int,
    long_prompt: int = LONG_PROMPT,
) -> dict[str, Any]:
    rng = random.Random(0)
    ids = [rng.randrange(200_000) for _ in range(tokens)]
    long = [rng.randrange(200_000) for _ in range(long_prompt)]
    rounds = max(1, repeats // 3)
    hashing = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        chain_keys(ids, page_size)
        hashing.append(time.perf_counter() - t0)
    sizes = sorted({min(SMALL, pages_max), pages_max})
    costs = index_costs(sizes, batch=batch, repeats=repeats, page_size=page_size)
    insert = {str(n): round(costs[n][0], 3) for n in sizes}
    match = {str(n): round(costs[n][1], 3) for n in sizes}
    return {
        "hash_tokens_per_s": round(tokens / statistics.median(hashing)),
        "match_us_per_page": match,
        "insert_us_per_page": insert,
        "page_size": page_size,
        "request_ms": {str(ps): round(request_ms(ids, ps, rounds), 3) for ps in request_page_sizes},
        "long_prompt_ms": {
            str(ps): round(request_ms(long, ps, rounds), 3) for ps in LONG_PAGE_SIZES
        },
        "long_prompt_insert_ms": {
            str(ps): round(insert_ms(long, ps, rounds), 3) for ps in LONG_PAGE_SIZES
        },
        "long_prompt_tokens": long_prompt,
        "key_hasher": chain_hasher(),
    }


def use_keys(python: bool) -> None:
    """The native chain unless ``python`` (a missing compiler leaves the Python one in use;
    the document's key_hasher says which ran)."""
    if python:
        set_chain_hasher(None)
        return
    from hicache.adapters.native_keys import install_native_keys

    install_native_keys()
