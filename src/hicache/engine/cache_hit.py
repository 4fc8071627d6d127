"""Finding the hit of ``HiCache.match``: read, cut to a restorable boundary, agreed, pinned.

- HitRules(rules): the face's view of a group's GroupRules for hits: the slot-owning pool of
  every pool, ``boundary(n, at, fallback)`` (the longest prefix every pool can restore from
  those placements) and ``needed(boundary)`` (the owner pools page i must restore).
- agree_hit(cache, keys, stored, d, h, dev_at, host_at): the storage hint, then the
  (device, host, storage) boundaries agreed over the TP ranks (minimum), cut again until every
  rank stops at one it can restore.
- find_hit(cache, token_ids, on_drop): the index's hit, pinned before any await, agreed, the
  pins beyond the agreed hit given back, counted; a CacheMatch holding the rest.
- count_match(counters, page_size, tokens, d, h, s): the face's hit counters for one match.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from hicache.domain.hybrid import GroupRules, Restore, needed_pages, usable_boundary
from hicache.domain.keys import chain_keys
from hicache.domain.pools import PoolName
from hicache.domain.tiers import Placement, Tier
from hicache.engine.cache_load import completes, partial
from hicache.engine.cache_match import CacheMatch, MatchPins
from hicache.engine.cache_storage import storage_boundary
from hicache.engine.cache_work import Counters

if TYPE_CHECKING:
    from hicache.engine.cache import HiCache


class HitRules:
    """Boundaries and needed pools of hits under one group's GroupRules."""

    def __init__(self, rules: GroupRules) -> None:
        self.rules = rules
        self.owner = {r.pool: (rules.anchor if r.follows_anchor else r.pool) for r in rules.rules}
        self.single_owner = len(rules.owners) == 1

    def boundary(
        self,
        n: int,
        at: Sequence[Placement | None],
        fallback: Sequence[Placement | None] | None,
    ) -> int:
        """The longest prefix of ``n`` pages every pool restores from ``at`` (else
        ``fallback``)."""
        owner = self.owner

        def has(pool: PoolName, i: int) -> bool:
            where = at[i]
            if where is not None and owner[pool] in where:
                return True
            if fallback is None:
                return False
            other = fallback[i]
            return other is not None and owner[pool] in other

        return usable_boundary(self.rules, n, has)

    def needed(self, boundary: int) -> list[frozenset[PoolName]]:
        """The slot-owning pools page i must restore for a hit of ``boundary`` pages."""
        rules = self.rules
        base = frozenset(
            self.owner[r.pool] for r in rules.rules if r.restore is Restore.ALL_PAGES
        )
        out = [base] * boundary
        for r in rules.rules:
            if r.restore is not Restore.ALL_PAGES:
                for i in needed_pages(rules, r.pool, boundary):
                    out[i] = out[i] | {self.owner[r.pool]}
        return out


async def agree_hit(
    cache: HiCache,
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
    cache: HiCache, token_ids: Sequence[int], on_drop: Callable[[MatchPins], None]
) -> CacheMatch:
    """The agreed, pinned hit of ``token_ids`` (see CacheMatch); ``on_drop``: the face's
    finalizer queue for a match dropped unreleased."""
    index, hits = cache.index, cache.hits
    keys = chain_keys(token_ids, cache.page_size)
    m = index.match(keys)
    dev_at = [index.placement(Tier.DEVICE, k) for k in keys[: m.host_pages]]
    if hits.single_owner:
        # Every placement holds the one owner: the index's boundaries are the loadable ones.
        host_at: list[Placement | None] = []
        d, h = m.device_pages, m.host_pages
    else:
        host_at = [index.placement(Tier.HOST, k) for k in keys[: m.host_pages]]
        d = hits.boundary(m.device_pages, dev_at, None)
        h = hits.boundary(m.host_pages, dev_at, host_at)
    # Pin what was read before any await: a concurrent eviction during the storage hint
    # or the TP agreement must not take pages this match is about to return.
    # A host copy is pinned where there is no device copy, and where it has pools the
    # device copy lacks (a load may complete the device copy from it).
    on_host = [
        dev_at[i] is None or completes(dev_at[i], host_at[i] if host_at else None)
        for i in range(h)
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
    to_load = [
        i < h and on_host[i] and partial(dev_at[i], needed[i]) for i in range(len(on_host))
    ]
    extra_dev = [keys[i] for i in range(h, len(sources)) if sources[i] is Tier.DEVICE]
    extra_host = [keys[i] for i in range(len(on_host)) if on_host[i] and not to_load[i]]
    index.unpin(Tier.DEVICE, extra_dev)
    index.unpin(Tier.HOST, extra_host)
    pins = MatchPins()
    pins.device = [keys[i] for i in range(h) if sources[i] is Tier.DEVICE]
    pins.host = [keys[i] for i in range(h) if to_load[i]]
    sources = [Tier.HOST if to_load[i] else Tier.DEVICE for i in range(h)]
    count_match(cache.counters, cache.page_size, len(token_ids), d, h, s)
    return CacheMatch(
        cache,
        keys=keys,
        tokens=len(token_ids),
        page_size=cache.page_size,
        device_pages=d,
        host_pages=h,
        storage_pages=s,
        sources=sources,
        needed=needed,
        pins=pins,
        on_drop=on_drop,
    )


def count_match(counters: Counters, page_size: int, tokens: int, d: int, h: int, s: int) -> None:
    """Count one match: tokens asked, and hit tokens and requests per serving tier."""
    counters.add("matches")
    counters.add("matched_tokens", tokens)
    for i, n in enumerate((d, h - d, s - h)):
        counters.add(f"hit_tokens_{i}", n * page_size)
        counters.add(f"hit_requests_{i}", int(n > 0))


__all__ = ["HitRules", "agree_hit", "count_match", "find_hit"]
