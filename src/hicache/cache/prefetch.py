"""Prefetch: bring the stored part of a hit from the storage tier into host pages.

- prefetch(cache, target, deadline=None): for the pages between the host hit and the storage
  hint, in batches of ``CacheSettings.prefetch_batch_pages``: allocate host pages (evicting LRU
  host pages when full), ``index.prepare_prefetch``, ``StorageTier.read`` (off the event loop,
  bounded by the deadline of the prefetch policy), ``index.complete`` with the per-page flags
  (the leading run read is the hit), free the failed destinations, drop the failed pages'
  storage entries (the store did not have them, or could not give them now). Stops at the first
  page that was not read. Cancellation at any await: the ticket is aborted and the host pages
  come back (shielded).
- TP ranks: the end of the read (the storage hint) and the host hit reported are agreed
  (minimum, ``cache.ranks``): two agreements per call on every path, skips included.
- reads(cache, keys, start, end): per page to read, its index and the pools to read: every pool
  the hit needs for a page not on host; for a page on host, only the pools its copy lacks (a
  fill: a state checkpoint or window page evicted from host); nothing for a page whose host copy
  is whole.

What is read per page for a hit of ``end`` pages: the anchor (and its sidecars) on every page, a
window pool on the window's pages before ``end``, a state pool's checkpoint at page ``end - 1``,
less what the page's host copy already holds. A fill pins the page's host copy from before its
host pages are allocated (an eviction to make room cannot take it) until the read completes; a
failed fill frees only the pages it allocated and drops only those pools' storage entries.
"""

from __future__ import annotations

from collections.abc import Sequence

import anyio

from hicache.cache.match import CacheMatch
from hicache.cache.parts import CacheParts
from hicache.cache.storage import storage_boundary
from hicache.cache.values import PrefetchResult, PrefetchSkip
from hicache.cache.work import pool_counts, split_ids
from hicache.domain.errors import CacheStateError, OutOfSlotsError
from hicache.domain.hybrid import needed_pages
from hicache.domain.keys import chain_keys
from hicache.domain.pools import PoolName
from hicache.domain.tiers import Placement, Tier


def _wants(cache: CacheParts, start: int, end: int) -> list[list[PoolName]]:
    sets: list[set[PoolName]] = [set() for _ in range(end - start)]
    for r in cache.rules.rules:
        owner = cache.rules.anchor if r.follows_anchor else r.pool
        for i in needed_pages(cache.rules, r.pool, end):
            if i >= start:
                sets[i - start].add(owner)
    return [sorted(s, key=lambda p: p.value) for s in sets]


def reads(
    cache: CacheParts, keys: Sequence[bytes], start: int, end: int
) -> list[tuple[int, list[PoolName]]]:
    """The pages of ``keys[start:end]`` to read and the pools to read for each (module doc)."""
    out: list[tuple[int, list[PoolName]]] = []
    for i, want in enumerate(_wants(cache, start, end), start):
        have = cache.index.placement(Tier.HOST, keys[i])
        pools = want if have is None else [p for p in want if p not in have]
        if pools:
            out.append((i, pools))
    return out


async def prefetch(
    cache: CacheParts, target: CacheMatch | Sequence[int], *, deadline: float | None = None
) -> PrefetchResult:
    ps = cache.page_size
    storage = cache.storage
    if isinstance(target, CacheMatch):
        keys = list(target.keys)
        hint = target.storage_pages
    else:
        keys = chain_keys(target, ps)
        hint = -1
    m = cache.index.match(keys, touch=False)
    start = m.host_pages
    if storage is not None and hint < 0:
        hint = await storage_boundary(cache, keys, max(start, m.storage_pages))
    # TP ranks: every rank reads up to the same page, and reports the same host hit (the
    # second agreement, in _agreed_host). Two agreements on every path, so that the ranks'
    # calls stay paired whatever each rank skips.
    (end,) = await cache.ranks.agree_min((min(max(hint, start), len(keys)),))
    if storage is None:
        return PrefetchResult(
            requested=0,
            read=0,
            host_pages=await _agreed_host(cache, keys),
            page_size=ps,
            skipped=PrefetchSkip.NO_STORAGE,
        )
    todo = reads(cache, keys, start, end)
    requested = len(todo)
    if requested < cache.settings.prefetch_min_pages:
        return PrefetchResult(
            requested=requested,
            read=0,
            host_pages=await _agreed_host(cache, keys),
            page_size=ps,
            skipped=PrefetchSkip.TOO_FEW_PAGES,
        )
    if deadline is None:
        deadline = storage.deadline_for(requested * ps)
    batch = cache.settings.prefetch_batch_pages
    read = 0
    cache.counters.add("prefetches")
    for pos in range(0, requested, batch):
        part = todo[pos : pos + batch]
        n = await _batch(cache, [keys[i] for i, _ in part], [w for _, w in part], deadline)
        read += n
        if n < len(part):
            break
    return PrefetchResult(
        requested=requested, read=read, host_pages=await _agreed_host(cache, keys), page_size=ps
    )


async def _agreed_host(cache: CacheParts, keys: Sequence[bytes]) -> int:
    """The host hit of ``keys`` after a prefetch, agreed over the TP ranks (minimum)."""
    (host,) = await cache.ranks.agree_min((cache.index.match(keys, touch=False).host_pages,))
    return host


async def _batch(
    cache: CacheParts,
    keys: Sequence[bytes],
    wants: Sequence[Sequence[PoolName]],
    deadline: float | None,
) -> int:
    """One batch: the number of leading pages read."""
    storage = cache.storage
    if storage is None:  # pragma: no cover - checked by the caller
        return 0
    anchor = cache.rules.anchor
    fills = [k for k, w in zip(keys, wants, strict=True) if anchor not in w]
    try:
        # The host copies a fill completes must outlive the eviction an allocation may run.
        cache.index.pin(Tier.HOST, fills)
    except CacheStateError:  # one left host since the pages were chosen: stop before it
        return 0
    try:
        counts = pool_counts(wants)
        try:
            ids = await cache.work.allocate(Tier.HOST, counts)
        except OutOfSlotsError:
            return 0
        dests = split_ids(counts, ids, wants)
        try:
            ticket = cache.index.prepare_prefetch(keys, dests)
        except CacheStateError:
            cache.engine.free_host(ids)
            return 0
    finally:
        cache.index.unpin(Tier.HOST, fills)  # the ticket pins them now (or nothing needs them)
    oks: list[bool] | None = None
    try:
        oks = await storage.read(ticket.keys, ticket.dests, deadline=deadline)
    finally:
        with anyio.CancelScope(shield=True):
            flags = list(oks) if oks is not None else [False] * len(ticket)
            # A hit is the leading run of pages read: nothing after the first failure counts.
            run = next((i for i, f in enumerate(flags) if not f), len(flags))
            flags = [i < run for i in range(len(flags))]
            acts = cache.index.complete(ticket, flags)
            cache.work.free(acts.free)
            lost = [
                (k, d) for k, d, f in zip(ticket.keys, ticket.dests, flags, strict=True) if not f
            ]
            _forget(cache, lost)
            cache.counters.add("prefetched_pages", run)
            cache.work.count_bytes("prefetched", ticket.dests[:run])
            if lost and oks is not None:
                cache.counters.add("store_failures", 1)
    if acts.store:
        await cache.work.store(acts.store, wait=False)
    return run


def _forget(cache: CacheParts, failed: Sequence[tuple[bytes, Placement]]) -> None:
    """Drop the storage entries of pages not read: a whole page's, or a fill's pools only."""
    anchor = cache.rules.anchor
    whole = [k for k, d in failed if anchor in d]
    if whole:
        cache.work.free(cache.index.drop(Tier.STORAGE, whole).free)
    for k, d in failed:
        if anchor not in d:
            for pool in d:
                cache.work.free(cache.index.drop(Tier.STORAGE, [k], pool).free)
