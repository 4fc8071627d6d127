"""The prefix index's per-key record and what is computed over all records (pure).

- PageRecord: one page key's state in the index: placements per tier, pins, the transfer
  reserving each tier, the pool an eviction drops after its copy-down, LRU stamps, hits, and
  the record before it in a chain of keys (a link match follows and checks).
- count_pages(records, tickets, evictions): the IndexStats of a set of records.
- destination_refusal(page, kind, dest, anchor): why a transfer may not reserve ``dest`` on its
  destination tier for this page (None: it may); a destination without the anchor is a fill,
  which completes a copy already there with the pools it lacks.
- check_invariants(records, ...): raise CacheStateError naming the first broken invariant of the
  index (idle records, negative pins, stale or lost transfers, the anchor missing, LRU stamps
  that disagree with the state, unpinned sources); ``PrefixIndex.validate()`` calls it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from hicache.domain.errors import CacheStateError
from hicache.domain.lru import TickLru
from hicache.domain.pools import PoolName
from hicache.domain.tiers import IndexStats, OpKind, PerTier, Placement, Ticket, Tier

_TIERS = (Tier.DEVICE, Tier.HOST, Tier.STORAGE)


_NO_TICKETS = (0, 0, 0)
_NO_SCOPES = (None, None, None)


class PageRecord:
    """One page key's state in the index (mutable; owned by one PrefixIndex)."""

    __slots__ = ("at", "evicting", "hits", "key", "parent", "pending", "pins", "stamp")

    def __init__(self, key: bytes, slots: int) -> None:
        self.key = key
        # The record of the page before this one in the last chain of keys that named it (a
        # hint for PrefixIndex.match, which checks every record it reaches through it); None
        # when unknown. A record that leaves the index drops its own link.
        self.parent: PageRecord | None = None
        # Per (cached tier, owning pool): the LRU run of its latest touch (hicache.domain.lru);
        # 0: not evictable there.
        self.stamp: list[Any] = [0] * slots
        self.at: list[dict[PoolName, int] | None] = [None, None, None]
        self.pins = [0, 0, 0]
        # Ticket id reserving each tier as a destination, and the drop scope after a copy-down:
        # shared "none" tuples until a transfer or an eviction sets one (set_pending /
        # set_evicting), so a new page costs two objects fewer to make and to collect.
        self.pending: Sequence[int] = _NO_TICKETS
        self.evicting: Sequence[PoolName | None] = _NO_SCOPES
        self.hits = 0

    def set_pending(self, tier: int, ticket: int) -> None:
        pending = self.pending
        if type(pending) is not list:
            pending = self.pending = list(pending)
        pending[tier] = ticket

    def set_evicting(self, tier: int, scope: PoolName | None) -> None:
        evicting = self.evicting
        if type(evicting) is not list:
            if scope is None and evicting[tier] is None:
                return
            evicting = self.evicting = list(evicting)
        evicting[tier] = scope

    def idle(self) -> bool:
        return not any(self.at) and not any(self.pending)


def count_pages(records: Iterable[PageRecord], *, tickets: int, evictions: list[int]) -> IndexStats:
    """Pages per tier, pinned pages per tier, transfers in flight, evictions per tier.

    One pass with plain int indexes, unrolled over the three tiers: a metrics scrape calls this
    over every record (about 5x faster than looping over the Tier enum per record).
    """
    d = h = s = pd = ph = ps = total = 0
    for p in records:
        total += 1
        at, pins = p.at, p.pins
        if at[0] is not None:
            d += 1
        if at[1] is not None:
            h += 1
        if at[2] is not None:
            s += 1
        if pins[0] > 0:
            pd += 1
        if pins[1] > 0:
            ph += 1
        if pins[2] > 0:
            ps += 1
    return IndexStats(
        pages=total,
        on_tier=PerTier(device=d, host=h, storage=s),
        pinned=PerTier(device=pd, host=ph, storage=ps),
        in_flight=tickets,
        evictions=PerTier.from_counts(evictions),
    )


def destination_refusal(
    page: PageRecord, kind: OpKind, dest: Placement, anchor: PoolName
) -> str | None:
    """Why ``kind`` may not reserve ``dest`` on its destination tier for ``page`` (None: it may).

    A whole page (``dest`` holds the anchor) needs the tier free of the page; a fill (no anchor)
    needs the page's copy there with the anchor, none of ``dest``'s pools, and no eviction
    waiting on it.
    """
    dst = kind.dest
    name = f"{kind.value}: page {page.key.hex()[:16]}"
    if page.pending[dst]:
        return f"{name} is already on its way to {dst.name}"
    at = page.at[dst]
    if anchor in dest:
        return None if at is None else f"{name} is already on {dst.name}"
    if at is None or anchor not in at:
        return (
            f"{name}: a destination without the anchor completes a copy on {dst.name}, and "
            f"there is none"
        )
    if page.evicting[dst] is not None:
        return f"{name}: its copy on {dst.name} is being evicted"
    both = sorted(q.value for q in dest if q in at)
    if both:
        return f"{name} already has {both} on {dst.name}"
    return None


HolderKey = tuple[int, str, int]


def holder_key(tier: int, pool: PoolName, page: int) -> HolderKey:
    """The key of a cached page id in the index's holder map: plain ints and the pool's text
    (an enum member's hash is a Python call; the index does this per page on insert)."""
    return (int(tier), pool._value_, page)


def check_invariants(
    records: Mapping[bytes, PageRecord],
    *,
    tickets: Mapping[int, Ticket],
    slots: Mapping[tuple[int, PoolName], int],
    lru: TickLru[PageRecord],
    anchor: PoolName,
    evictable: Callable[[PageRecord, int], bool],
    holders: Mapping[HolderKey, bytes] | None = None,
) -> None:
    """Check every invariant of an index's state (O(pages)); CacheStateError names the first.

    ``slots`` maps (cached tier, owning pool) to the LRU slot; ``evictable(record, tier)`` is
    the index's rule for a page that may carry an LRU stamp on that tier.
    """
    pending_ids = set(tickets)
    for key, p in records.items():
        if p.idle():
            raise CacheStateError(f"page {key.hex()[:16]} is on no tier and in no transfer")
        for t in _TIERS:
            if p.pins[t] < 0:
                raise CacheStateError(f"page {key.hex()[:16]}: negative pins on {t.name}")
            if p.pending[t] and p.pending[t] not in pending_ids:
                raise CacheStateError(f"page {key.hex()[:16]}: stale transfer on {t.name}")
            at = p.at[t]
            if t != Tier.STORAGE and at is not None and anchor not in at:
                raise CacheStateError(f"page {key.hex()[:16]}: {t.name} lacks the anchor")
        for (ct, pool), slot in slots.items():
            want = evictable(p, ct) and pool in (p.at[ct] or {})
            if want != bool(p.stamp[slot]):
                raise CacheStateError(
                    f"page {key.hex()[:16]}: LRU of {pool.value} on {Tier(ct).name} says "
                    f"{bool(p.stamp[slot])}, state says {want}"
                )
    for (ct, pool), slot in slots.items():
        live = lru.holds(slot)
        stamped = [pg for pg in records.values() if pg.stamp[slot]]
        if len(stamped) != lru.live(slot) or any(id(pg) not in live for pg in stamped):
            raise CacheStateError(f"LRU of {pool.value} on {Tier(ct).name} lost track of its pages")
    for ticket in tickets.values():
        src = ticket.kind.source
        for k in ticket.keys:
            page = records.get(k)
            if page is None or page.pending[ticket.kind.dest] != ticket.id:
                raise CacheStateError(f"ticket {ticket.id} lost page {k.hex()[:16]}")
            if src != Tier.STORAGE and page.pins[src] < 1:
                raise CacheStateError(f"ticket {ticket.id}: source of {k.hex()[:16]} unpinned")
    if holders is not None:
        _check_holders(records, tickets, holders)


def _check_holders(
    records: Mapping[bytes, PageRecord],
    tickets: Mapping[int, Ticket],
    holders: Mapping[HolderKey, bytes],
) -> None:
    """Every cached page id holds exactly one key: the copies and reserved destinations."""
    want: dict[HolderKey, bytes] = {}

    def claim(tier: int, key: bytes, where: Mapping[PoolName, int]) -> None:
        for pool, pid in where.items():
            other = want.setdefault(holder_key(tier, pool, pid), key)
            if other != key:
                raise CacheStateError(
                    f"{Tier(tier).name} page {pid} of pool {pool.value!r} holds two pages: "
                    f"{other.hex()[:16]} and {key.hex()[:16]}"
                )

    for key, p in records.items():
        for t in (Tier.DEVICE, Tier.HOST):
            claim(t, key, p.at[t] or {})
    for ticket in tickets.values():
        if ticket.kind.dest != Tier.STORAGE:
            for k, dest in zip(ticket.keys, ticket.dests, strict=True):
                claim(ticket.kind.dest, k, dest)
    if dict(holders) != want:
        raise CacheStateError(
            f"the page-id holders disagree with the placements ({len(holders)} held, "
            f"{len(want)} placed)"
        )


__all__ = [
    "HolderKey",
    "PageRecord",
    "check_invariants",
    "count_pages",
    "destination_refusal",
    "holder_key",
]
