"""Finding the hit of ``HiCache.match``: read, cut to a restorable boundary, agreed, pinned.

- HitRules: see hicache.cache.rules (re-exported here).
- agree_hit(cache, keys, stored, d, h, dev_at, host_at): the storage hint, then the
  (device, host, storage) boundaries agreed over the TP ranks (minimum), cut again until every
  rank stops at one it can restore.
- find_hit(cache, token_ids, on_drop): the index's hit, pinned before any await, agreed, the
  pins beyond the agreed hit given back, counted; a CacheMatch holding the rest. The keys are
  a KeyChain (the index matches it in O(log n) lookups); with one slot-owning pool and plain
  rules only the device presence of the pages past the device boundary is read.
- count_match(counters, page_size, tokens, d, h, s): the face's hit counters for one match.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from hicache.cache.load import completes, partial
from hicache.cache.match import CacheMatch, MatchPins
from hicache.cache.parts import CacheParts
from hicache.cache.rules import HitRules
from hicache.cache.storage import storage_boundary
from hicache.cache.work import Counters
from hicache.domain.keys import KeyChain, key_chain
from hicache.domain.tiers import Match, Placement, Tier


async def agree_hit(
    cache: CacheParts,
    keys: Sequence[bytes],
    stored: int,
    d: int,
    h: int,
    dev_at: Sequence[Placement | None],
    host_at: Sequence[Placement | None],
) -> tuple[int, ...]:
    """The storage hint, then (device, host, storage) agreed over the TP ranks."""
    hits = cache.hits
    s = max(h, stored)
    if cache.storage is not None:
        s = await storage_boundary(cache, keys, s)
    agreed = await cache.ranks.agree_min((d, h, s))
    # A boundary another rank chose may not be restorable here (hybrid rules): cut it to
    # one that is and agree again, until two agreements in a row are equal (every rank
    # then stops at the same round, with a boundary every rank can restore). When every
    # pool restores all pages, any shorter prefix of a usable hit is usable: one round.
    while not cache.rules.is_plain:
        nd = hits.boundary(min(agreed[0], d), dev_at, None)
        nh = hits.boundary(min(agreed[1], h), dev_at, host_at)
        ns = min(agreed[2], s)
        again = await cache.ranks.agree_min((nd, nh, max(nh, ns)))
        if again == agreed:
            break
        agreed = again
    return agreed


async def find_hit(
    cache: CacheParts, token_ids: Sequence[int], on_drop: Callable[[MatchPins], None]
) -> CacheMatch:
    """The agreed, pinned hit of ``token_ids`` (see CacheMatch); ``on_drop``: the face's
    finalizer queue for a match dropped unreleased."""
    index, hits = cache.index, cache.hits
    keys = key_chain(token_ids, cache.page_size)
    m = index.match(keys)
    if hits.single_owner and cache.rules.is_plain:
        return await _plain_hit(cache, token_ids, keys, m, on_drop)
    dev_at = index.placements(Tier.DEVICE, keys[: m.host_pages])
    if hits.single_owner:
        # Every placement holds the one owner: the index's boundaries are the loadable ones.
        host_at: list[Placement | None] = []
        d, h = m.device_pages, m.host_pages
    else:
        host_at = index.placements(Tier.HOST, keys[: m.host_pages])
        d = hits.boundary(m.device_pages, dev_at, None)
        h = hits.boundary(m.host_pages, dev_at, host_at)
    # Pin what was read before any await: a concurrent eviction during the storage hint
    # or the TP agreement must not take pages this match is about to return.
    # A host copy is pinned where there is no device copy, and where it has pools the
    # device copy lacks (a load may complete the device copy from it).
    on_host = [
        dev_at[i] is None or completes(dev_at[i], host_at[i] if host_at else None) for i in range(h)
    ]
    sources = [Tier.DEVICE if dev_at[i] is not None else Tier.HOST for i in range(h)]
    dev_keys = [keys[i] for i in range(h) if sources[i] is Tier.DEVICE]
    host_keys = [keys[i] for i in range(h) if on_host[i]]
    index.pin(Tier.DEVICE, dev_keys)
    try:
        index.pin(Tier.HOST, host_keys)
    except BaseException:
        index.unpin(Tier.DEVICE, dev_keys)
        raise
    try:
        d, h, s = await agree_hit(cache, keys, m.storage_pages, d, h, dev_at, host_at)
    except BaseException:
        index.unpin(Tier.DEVICE, dev_keys)
        index.unpin(Tier.HOST, host_keys)
        raise
    # Keep the pins of the agreed hit only: a page partly on the device keeps both.
    needed = hits.needed(h)
    to_load = [i < h and on_host[i] and partial(dev_at[i], needed[i]) for i in range(len(on_host))]
    extra_dev = [keys[i] for i in range(h, len(sources)) if sources[i] is Tier.DEVICE]
    extra_host = [keys[i] for i in range(len(on_host)) if on_host[i] and not to_load[i]]
    index.unpin(Tier.DEVICE, extra_dev)
    index.unpin(Tier.HOST, extra_host)
    pins = MatchPins()
    pins.device = [keys[i] for i in range(h) if sources[i] is Tier.DEVICE]
    pins.host = [keys[i] for i in range(h) if to_load[i]]
    sources = [Tier.HOST if to_load[i] else Tier.DEVICE for i in range(h)]
    tokens = len(token_ids) // 4 if isinstance(token_ids, bytes) else len(token_ids)  # packed
    count_match(cache.counters, cache.page_size, tokens, d, h, s)
    return CacheMatch(
        cache,
        keys=keys,
        tokens=tokens,
        page_size=cache.page_size,
        device_pages=d,
        host_pages=h,
        storage_pages=s,
        sources=sources,
        needed=needed,
        pins=pins,
        on_drop=on_drop,
    )


async def _plain_hit(
    cache: CacheParts,
    token_ids: Sequence[int],
    keys: KeyChain,
    m: Match,
    on_drop: Callable[[MatchPins], None],
) -> CacheMatch:
    """find_hit when one pool owns every page and every pool restores all pages: a page is
    restorable from the device iff it has a device placement (which always holds the anchor,
    the one pool a page needs), so only that is read, for the pages past the device boundary
    (the ones before it are on the device), and no placement is copied."""
    index = cache.index
    d, h0 = m.device_pages, m.host_pages
    on_dev = [True] * d + index.on_tier(Tier.DEVICE, keys[d:h0])
    # The keys as bytes objects once: pins, releases and the CacheMatch share them (and the
    # hashes the pins' lookups cache in them).
    listed = list(keys)
    if d == h0:  # all of it on the device: no per-page filtering
        dev_keys = listed[:h0]
        host_keys: list[bytes] = []
    else:
        dev_keys = [listed[i] for i in range(h0) if on_dev[i]]
        host_keys = [listed[i] for i in range(h0) if not on_dev[i]]
    # Pinned before any await, as find_hit does (see there).
    index.pin(Tier.DEVICE, dev_keys)
    try:
        index.pin(Tier.HOST, host_keys)
    except BaseException:
        index.unpin(Tier.DEVICE, dev_keys)
        raise
    try:
        d, h, s = await agree_hit(cache, keys, m.storage_pages, d, h0, [], [])
    except BaseException:
        index.unpin(Tier.DEVICE, dev_keys)
        index.unpin(Tier.HOST, host_keys)
        raise
    # A page past the agreed hit gives its pin back; one before it on the device keeps its
    # device pin, one on host only keeps its host pin (its load copies it).
    index.unpin(Tier.DEVICE, [listed[i] for i in range(h, h0) if on_dev[i]])
    index.unpin(Tier.HOST, [listed[i] for i in range(h, h0) if not on_dev[i]])
    pins = MatchPins()
    if d == h0:
        pins.device = listed[:h]
    else:
        pins.device = [listed[i] for i in range(h) if on_dev[i]]
        pins.host = [listed[i] for i in range(h) if not on_dev[i]]
    sources = [Tier.DEVICE if on_dev[i] else Tier.HOST for i in range(h)]
    tokens = len(token_ids) // 4 if isinstance(token_ids, bytes) else len(token_ids)  # packed
    count_match(cache.counters, cache.page_size, tokens, d, h, s)
    return CacheMatch(
        cache,
        keys=listed,
        tokens=tokens,
        page_size=cache.page_size,
        device_pages=d,
        host_pages=h,
        storage_pages=s,
        sources=sources,
        needed=cache.hits.needed(h),
        pins=pins,
        on_drop=on_drop,
    )


def count_match(counters: Counters, page_size: int, tokens: int, d: int, h: int, s: int) -> None:
    """Count one match: tokens and full pages asked, and hit tokens, pages and requests per
    serving tier (``d``, ``h``, ``s``: the device, host and storage hit depths in pages)."""
    counters.add("matches")
    counters.add("matched_tokens", tokens)
    counters.add("matched_pages", tokens // page_size)
    for tier, n in (("device", d), ("host", h - d), ("storage", s - h)):
        counters.add(f"hit_tokens_{tier}", n * page_size)
        counters.add(f"hit_pages_{tier}", n)
        counters.add(f"hit_requests_{tier}", int(n > 0))


__all__ = ["HitRules", "agree_hit", "count_match", "find_hit"]
