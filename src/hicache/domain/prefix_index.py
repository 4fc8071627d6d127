"""The prefix index: for every page key, where its pages live on device, host and storage.

A sans-I/O state machine (h11 style): the cache face feeds it facts and performs the Actions it
returns; it never allocates, copies or waits. Not thread-safe: one owner calls it.

- PrefixIndex(rules, writes): an empty index for a group's GroupRules and WriteSettings (its
  state and shared steps: hicache.domain.index_state.IndexState).
- match(keys): device/host/storage hit lengths at the hybrid-consistent boundary; touches LRU.
- insert(keys, placements): pages a request computed on device; returns duplicates to free and,
  under write_through(_selective), the backups to start. A device page id the index holds for
  another key (or one named twice) is refused before anything changes.
- pin / unpin(tier, keys): keep pages from eviction while a request or a copy uses them.
- prepare_backup / prepare_load / prepare_prefetch / prepare_store: pin the source, reserve the
  destination (invisible to match) and return a Ticket; complete(ticket, ok) makes the good pages
  visible, returns the failed destinations to free, and may ask for storage writes; abort(ticket)
  is complete(ticket, False) (hicache.domain.index_transfers.IndexTransfers, a base class).
- evict(tier, count, pool): frees up to ``count`` least-recently-used unpinned pages of ``pool``
  (the anchor by default: whole pages; an independent pool: only its pages); under write_back the
  victims are backed up first (their ids are freed by that backup's completion).
- drop(tier, keys, pool=None): forget pages (or one pool's objects) on a tier now (e.g. a storage
  MISS); returns their ids to free.
- placement(tier, key) / placements(tier, keys) / on_tier(tier, keys), statistics(), validate()
  (the page record,
  the counts and the invariant checks are in hicache.domain.index_pages).

LRU order: one TickLru slot per (tier, owning pool) (hicache.domain.lru). Pinned, in-flight
and evicting pages carry no stamp, so eviction never picks them. match and insert touch the
anchor's pages tail-first (a prefix's last pages go first: a middle page evicted first would
strand the pages after it) and WINDOW/CHECKPOINT pools' pages head-first (the window and the
checkpoint nearest the deepest boundary stay longest).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from itertools import pairwise
from typing import cast

from hicache.domain.errors import CacheStateError, ConfigError
from hicache.domain.hybrid import usable_boundary
from hicache.domain.index_pages import PageRecord, check_invariants, count_pages
from hicache.domain.index_state import CACHED_TIERS
from hicache.domain.index_transfers import IndexTransfers
from hicache.domain.keys import KeyChain
from hicache.domain.pools import PoolName
from hicache.domain.tiers import (
    NO_ACTIONS,
    Actions,
    Freed,
    IndexStats,
    Match,
    PageOp,
    Placement,
    Tier,
    WritePolicy,
)

_TIERS = (Tier.DEVICE, Tier.HOST, Tier.STORAGE)


def _single_pool_boundaries(
    found: Iterator[PageRecord | None], pages: list[PageRecord]
) -> tuple[int, int, int]:
    """(device, host, storage) leading counts of ``found`` (stopping at the first None),
    appending the pages up to the storage boundary to ``pages``."""
    append = pages.append
    p: PageRecord | None = None
    for p in found:
        if p is None or p.at[0] is None:
            break
        append(p)
    else:
        p = None
    dev = len(pages)
    while p is not None and (p.at[0] is not None or p.at[1] is not None):
        append(p)
        p = next(found, None)
    host = len(pages)
    while p is not None and any(p.at):
        append(p)
        p = next(found, None)
    return dev, host, len(pages)


def _chain_boundaries(
    get: Callable[[bytes], PageRecord | None], keys: Sequence[bytes]
) -> tuple[int, int, int, list[PageRecord]] | None:
    """(device, host, storage) leading counts of ``keys`` and the records of the first
    ``storage`` keys (last first) in O(log n) lookups, or None when the chain links do not
    give them (the caller walks the keys then).

    A binary search finds a ``storage`` whose last key is on some tier and whose next key
    (if any) is on none; the records before it are reached from that last one through their
    ``parent`` links. The answer stands only if every record reached is on some tier (so it is
    the index's live record of its key) and their keys are exactly the first ``storage`` keys:
    then no key before ``storage`` is off every tier, which makes it the leading count, and the
    device and host counts are read off the records. Anything else (a hole, a missing or stale
    link, keys of another chain) returns None.
    """
    lo, hi = 0, len(keys)
    tail: PageRecord | None = None
    while lo < hi:
        mid = (lo + hi) // 2
        p = get(keys[mid])
        if p is not None and any(p.at):
            lo, tail = mid + 1, p
        else:
            hi = mid
    sto = lo
    if tail is None:
        return (0, 0, 0, []) if sto == 0 else None
    out: list[PageRecord] = []
    append = out.append
    dev = host = sto
    r: PageRecord | None = tail
    for pos in range(sto - 1, -1, -1):
        if r is None:
            return None
        at = r.at
        if at[0] is None:
            dev = pos
            if at[1] is None:
                host = pos
                if at[2] is None:
                    return None
        append(r)
        r = r.parent
    if not _keys_are(keys, sto, out):
        return None
    return dev, host, sto, out


def _keys_are(keys: Sequence[bytes], n: int, last_first: list[PageRecord]) -> bool:
    """Whether the records ``last_first`` (in reverse order) carry exactly ``keys[:n]``."""
    got = [r.key for r in last_first]
    got.reverse()
    if isinstance(keys, KeyChain):
        return keys.starts_with(got)
    return got == list(keys[:n])


def _link(pages: list[PageRecord]) -> None:
    """Link each record to the one before it (the walk just found them in this order)."""
    for prev, page in pairwise(pages):
        if page.parent is not prev:
            page.parent = prev


class PrefixIndex(IndexTransfers):
    """Page key -> placements on three tiers, pins, LRU and write policies. See module doc."""

    # ---- queries -------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._pages)

    def __repr__(self) -> str:
        s = self.statistics()
        return (
            f"<PrefixIndex {s.pages} pages: device {s.on_tier.device}, host {s.on_tier.host}, "
            f"storage {s.on_tier.storage}; {s.in_flight} transfers in flight>"
        )

    def placement(self, tier: Tier, key: bytes) -> Placement | None:
        """Where ``key`` lives on ``tier`` (a copy), or None; pending destinations are not shown."""
        page = self._pages.get(key)
        at = page.at[tier] if page is not None else None
        return dict(at) if at is not None else None

    def placements(self, tier: Tier, keys: Sequence[bytes]) -> list[Placement | None]:
        """``placement(tier, k)`` of every key, in one pass (a long prompt's hit)."""
        out: list[Placement | None] = []
        append = out.append
        for page in map(self._pages.get, keys):
            at = page.at[tier] if page is not None else None
            append(dict(at) if at is not None else None)
        return out

    def on_tier(self, tier: Tier, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key has a placement on ``tier`` (``placement`` without the copies)."""
        return [p is not None and p.at[tier] is not None for p in map(self._pages.get, keys)]

    def pins(self, tier: Tier, key: bytes) -> int:
        page = self._pages.get(key)
        return page.pins[tier] if page is not None else 0

    def match(self, keys: Sequence[bytes], *, touch: bool = True) -> Match:
        """Leading pages restorable from device, from device or host, from any tier."""
        pages: list[PageRecord] = []
        get = self._pages.get
        if len(self.rules.rules) == 1:
            # One pool: a page is usable on a tier iff it has a placement there. The chain
            # links give the records in O(log n) lookups when they hold (checked); otherwise
            # one pass looks each page up and checks it while its record is in cache. Pages
            # past the storage boundary are not needed.
            found = _chain_boundaries(get, keys)
            if found is not None:
                dev, host, sto, last = found  # the records, last first: the anchor's order
                if touch and host:
                    self._touch(last if host == sto else last[sto - host :], last_first=True)
                return self._match(keys, dev, host, sto)
            dev, host, sto = _single_pool_boundaries(map(get, keys), pages)
            _link(pages)
        else:
            for k in keys:
                p = get(k)
                if p is None:
                    break
                pages.append(p)
            n = len(pages)
            levels = []
            for level in _TIERS:

                def has(pool: PoolName, i: int, level: int = level) -> bool:
                    return any(self._has(pages[i], t, pool) for t in range(level + 1))

                levels.append(usable_boundary(self.rules, n, has))
            dev, host, sto = levels
        if touch and host:
            self._touch(pages[:host])
        return self._match(keys, dev, host, sto)

    def _match(self, keys: Sequence[bytes], dev: int, host: int, sto: int) -> Match:
        return Match(
            keys=keys[:sto] if isinstance(keys, KeyChain) else tuple(keys[:sto]),
            page_size=self.rules.page_size,
            device_pages=dev,
            host_pages=max(dev, host),
            storage_pages=max(dev, host, sto),
        )

    # ---- insert ----------------------------------------------------------------------------

    def insert(self, keys: Sequence[bytes], placements: Sequence[Placement]) -> Actions:
        """Register pages a request computed on device; counts one hit per page.

        Pages already on device come back in ``free`` (the caller's copy is a duplicate); a
        state checkpoint or window page for a pool the page lacked is added.
        """
        if len(keys) != len(placements):
            raise ConfigError(f"insert: {len(keys)} keys with {len(placements)} placements")
        checked = [self._check_placement(w, "insert") for w in placements]
        # Every check before anything changes: a refused insert leaves the index as it was.
        held = self._held[Tier.DEVICE]
        single = len(self._owners) == 1  # every placement is {anchor: id}
        anchor_ids = held[self._anchor._value_]
        pids: list[int] = [w[self._anchor] for w in checked] if single else []
        if not single or (
            # One pool: the whole check in C-level passes when no id is held or named twice
            # (the common case); otherwise the per-page pass below names the culprit.
            len(set(pids)) != len(pids) or list(map(anchor_ids.get, pids)).count(None) != len(pids)
        ):
            self._check_insert_ids(keys, checked)
        free: list[Freed] = []
        touched: list[PageRecord] = []
        dev = Tier.DEVICE
        prev = self._before(keys)
        get = self._pages.get
        for key, where, pid in zip(keys, checked, pids if single else checked, strict=True):
            page = get(key)
            if page is None:
                page = self._pages[key] = PageRecord(key, self._slots)
            if prev is not None:
                page.parent = prev
            prev = page
            page.hits += 1
            have = page.at[dev]
            if have is None and not page.pending[dev]:
                page.at[dev] = where  # stamped by the touch below, in LRU order
                if single:
                    anchor_ids[cast("int", pid)] = key
                else:
                    for pool, pid in where.items():
                        held[pool._value_][pid] = key
            else:
                for pool, pid in where.items():
                    # a load on its way (a whole page, or a fill of this copy) brings its own
                    if have is None or pool in have or page.pending[dev]:
                        free.append(Freed(dev, pool, pid))
                    else:  # a new dict: placements are never changed in place
                        have = page.at[dev] = {**have, pool: pid}  # stamped by the touch below
                        held[pool._value_][pid] = key
            touched.append(page)
        self._touch(touched, enter=True)
        backup = self._wanted(touched, Tier.HOST)
        store = self._wanted(touched, Tier.STORAGE)
        return Actions(backup=backup, store=store, free=tuple(free))

    def _check_insert_ids(self, keys: Sequence[bytes], checked: list[dict[PoolName, int]]) -> None:
        """Refuse a device page id that holds another key, or one named for two pages."""
        held = self._held[Tier.DEVICE]
        named: dict[str, dict[int, bytes]] = {}  # pool text -> id -> the key placed there
        for key, where in zip(keys, checked, strict=True):
            for pool, pid in where.items():
                name = pool._value_
                other = held[name].get(pid)
                if other is not None and other != key:
                    raise CacheStateError(f"insert: {self._held_by_other(Tier.DEVICE, key, where)}")
                mine = named.get(name)
                if mine is None:
                    mine = named[name] = {}
                if mine.setdefault(pid, key) != key:
                    raise ConfigError(
                        f"insert: device page {pid} of pool {pool.value!r} is named for two "
                        "pages of one request"
                    )

    # ---- pins ------------------------------------------------------------------------------

    def _pages_of(self, keys: Sequence[bytes]) -> list[PageRecord]:
        """The records of ``keys`` (CacheStateError naming the first key the index lacks)."""
        found = list(map(self._pages.get, keys))
        if None in found:
            self._page(keys[found.index(None)])  # raises, naming it
        return cast("list[PageRecord]", found)

    def pin(self, tier: Tier, keys: Sequence[bytes]) -> None:
        """Protect pages on ``tier`` from eviction; each must be there. All or nothing."""
        pages = self._pages_of(keys)
        missing = [p.key.hex()[:16] for p in pages if p.at[tier] is None]
        if missing:
            raise CacheStateError(f"pin: pages {missing} are not on {tier.name}")
        first: list[PageRecord] = []
        for p in pages:
            pins = p.pins
            pins[tier] += 1
            if pins[tier] == 1:
                first.append(p)
        self._lru_remove_all(first, tier)

    def unpin(self, tier: Tier, keys: Sequence[bytes]) -> None:
        """Undo one pin per page; CacheStateError (changing nothing) below zero."""
        pages = self._pages_of(keys)
        counts = Counter(keys)
        if len(counts) == len(pages):  # no key twice: each needs one pin
            over = [p.key.hex()[:16] for p in pages if p.pins[tier] < 1]
        else:
            over = [k.hex()[:16] for k, c in counts.items() if self._pages[k].pins[tier] < c]
        if over:
            raise CacheStateError(f"unpin: pages {over} are not pinned on {tier.name}")
        freed: list[PageRecord] = []
        for p in pages:
            pins = p.pins
            pins[tier] -= 1
            if not pins[tier]:
                freed.append(p)
        self._lru_add_all(freed, tier)  # in key order, as one _lru_add per page would

    # ---- eviction ----------------------------------------------------------------------------

    def evict(self, tier: Tier, count: int, pool: PoolName | None = None) -> Actions:
        """Evict up to ``count`` unpinned pages of ``pool`` (anchor: whole pages) from ``tier``.

        Under write_back a victim not yet on the next tier is copied down first: it comes back
        in ``backup`` (device) or ``store`` (host), pinned until that copy completes, and its
        ids are freed by that completion. ``evicted`` counts both kinds.
        """
        if tier not in CACHED_TIERS:
            raise ConfigError(f"evict: the index evicts from DEVICE or HOST, not {tier.name}")
        scope = self._anchor if pool is None else pool
        if (tier, scope) not in self._slot:
            raise ConfigError(f"evict: pool {scope.value!r} owns no pages (owners: {self._owners})")
        if count <= 0:
            return NO_ACTIONS
        policy = self.writes.host if tier is Tier.DEVICE else self.writes.storage
        nxt = tier + 1
        slot = self._slot[tier, scope]
        free: list[Freed] = []
        copy: list[PageOp] = []
        taken = 0
        while taken < count:
            page = self._lru.pop_oldest(slot)
            if page is None:
                break
            key = page.key
            taken += 1
            self._evictions[tier] += 1
            if policy is WritePolicy.WRITE_BACK and page.at[nxt] is None and not page.pending[nxt]:
                page.set_evicting(tier, scope)
                self._lru_remove(page, tier)
                copy.append(PageOp(key, dict(page.at[tier] or {})))
                continue
            free.extend(self._drop(page, tier, scope))
            if page.idle():
                self._forget(page)
        ops = tuple(copy)
        if tier is Tier.DEVICE:
            return Actions(backup=ops, free=tuple(free), evicted=taken)
        return Actions(store=ops, free=tuple(free), evicted=taken)

    def drop(self, tier: Tier, keys: Sequence[bytes], pool: PoolName | None = None) -> Actions:
        """Forget ``keys`` on ``tier`` now (unknown keys are ignored); pinned pages refuse.

        ``pool``: only that pool's pages (objects, on STORAGE); default: whole pages.
        """
        pages = [p for p in (self._pages.get(k) for k in keys) if p is not None]
        pinned = [p.key.hex()[:16] for p in pages if p.pins[tier]]
        if pinned:
            raise CacheStateError(f"drop: pages {pinned} are pinned on {tier.name}")
        free: list[Freed] = []
        for p in pages:
            if pool is None:
                p.set_evicting(tier, None)
            free.extend(self._drop(p, tier, self._anchor if pool is None else pool))
            if p.idle():
                self._forget(p)
        return Actions(free=tuple(free))

    # ---- inspection ----------------------------------------------------------------------------

    def statistics(self) -> IndexStats:
        """A snapshot; safe from another thread (a metrics scrape): the records are copied in
        one step first, so a concurrent insert or drop cannot break the iteration."""
        return count_pages(
            tuple(self._pages.values()), tickets=len(self._tickets), evictions=self._evictions
        )

    def validate(self) -> None:
        """Check every internal invariant (O(pages)); CacheStateError names the first broken one."""
        check_invariants(
            self._pages,
            tickets=self._tickets,
            slots=self._slot,
            lru=self._lru,
            anchor=self._anchor,
            evictable=self._evictable,
            holders=self._holders(),
        )
