"""The prefix index: for every page key, where its pages live on device, host and storage.

A sans-I/O state machine (h11 style): the cache face feeds it facts and performs the Actions it
returns; it never allocates, copies or waits. Not thread-safe: one owner calls it.

- PrefixIndex(rules, writes): an empty index for a group's GroupRules and WriteSettings.
- match(keys): device/host/storage hit lengths at the hybrid-consistent boundary; touches LRU.
- insert(keys, placements): pages a request computed on device; returns duplicates to free and,
  under write_through(_selective), the backups to start.
- pin / unpin(tier, keys): keep pages from eviction while a request or a copy uses them.
- prepare_backup / prepare_load / prepare_prefetch / prepare_store: pin the source, reserve the
  destination (invisible to match) and return a Ticket; complete(ticket, ok) makes the good pages
  visible, returns the failed destinations to free, and may ask for storage writes; abort(ticket)
  is complete(ticket, False). A load or prefetch destination without the anchor is a fill: it
  adds the pools a page's copy on that tier lacks (the copy stays pinned until complete).
- evict(tier, count, pool): frees up to ``count`` least-recently-used unpinned pages of ``pool``
  (the anchor by default: whole pages; an independent pool: only its pages); under write_back the
  victims are backed up first (their ids are freed by that backup's completion).
- drop(tier, keys, pool=None): forget pages (or one pool's objects) on a tier now (e.g. a storage
  MISS); returns their ids to free.
- placement(tier, key), statistics(), validate() (hicache.domain.index_pages holds the page
  record, the counts and the invariant checks).

LRU order: one TickLru slot per (tier, owning pool) (hicache.domain.lru). Pinned, in-flight
and evicting pages carry no stamp, so eviction never picks them. match and insert touch the
anchor's pages tail-first (a prefix's last pages go first: a middle page evicted first would
strand the pages after it) and WINDOW/CHECKPOINT pools' pages head-first (the window and the
checkpoint nearest the deepest boundary stay longest).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from hicache.domain.errors import CacheStateError, ConfigError
from hicache.domain.hybrid import GroupRules, Restore, usable_boundary
from hicache.domain.index_pages import (
    PageRecord,
    check_invariants,
    count_pages,
    destination_refusal,
)
from hicache.domain.lru import TickLru
from hicache.domain.pools import PoolName
from hicache.domain.tiers import (
    NO_ACTIONS,
    Actions,
    Freed,
    IndexStats,
    Match,
    OpKind,
    PageOp,
    Placement,
    Ticket,
    Tier,
    WritePolicy,
    WriteSettings,
)
from hicache.domain.validators import is_int

_TIERS = (Tier.DEVICE, Tier.HOST, Tier.STORAGE)
_CACHED = (Tier.DEVICE, Tier.HOST)  # tiers whose pages the index evicts


class PrefixIndex:
    """Page key -> placements on three tiers, pins, LRU and write policies. See module doc."""

    def __init__(self, rules: GroupRules, writes: WriteSettings | None = None) -> None:
        self.rules = rules
        self.writes = writes or WriteSettings()
        self._anchor = rules.anchor
        self._owners = rules.owners
        self._follows = {r.pool: r.follows_anchor for r in rules.rules}
        self._trailing = {r.pool for r in rules.rules if r.restore is not Restore.ALL_PAGES}
        self._pages: dict[bytes, PageRecord] = {}
        n = len(self._owners)
        self._slots = len(_CACHED) * n
        self._slot: dict[tuple[int, PoolName], int] = {
            (t, p): t * n + i for t in _CACHED for i, p in enumerate(self._owners)
        }
        self._lru: TickLru[PageRecord] = TickLru(self._slots)
        self._tickets: dict[int, Ticket] = {}
        self._next_ticket = 1
        self._evictions = [0, 0, 0]

    # ---- queries -------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._pages)

    def __repr__(self) -> str:
        s = self.statistics()
        return (
            f"<PrefixIndex {s.pages} pages: device {s.on_tier[0]}, host {s.on_tier[1]}, "
            f"storage {s.on_tier[2]}; {s.in_flight} transfers in flight>"
        )

    def placement(self, tier: Tier, key: bytes) -> Placement | None:
        """Where ``key`` lives on ``tier`` (a copy), or None; pending destinations are not shown."""
        page = self._pages.get(key)
        at = page.at[tier] if page is not None else None
        return dict(at) if at is not None else None

    def pins(self, tier: Tier, key: bytes) -> int:
        page = self._pages.get(key)
        return page.pins[tier] if page is not None else 0

    def _has(self, page: PageRecord, tier: int, pool: PoolName) -> bool:
        at = page.at[tier]
        if at is None:
            return False
        if tier != Tier.STORAGE and self._follows[pool]:
            return self._anchor in at
        return pool in at

    def match(self, keys: Sequence[bytes], *, touch: bool = True) -> Match:
        """Leading pages restorable from device, from device or host, from any tier."""
        pages: list[PageRecord] = []
        get = self._pages.get
        for k in keys:
            p = get(k)
            if p is None:
                break
            pages.append(p)
        n = len(pages)
        if len(self.rules.rules) == 1:
            # One pool: a page is usable on a tier iff it has a placement there.
            i = 0
            while i < n and pages[i].at[0] is not None:
                i += 1
            dev = i
            while i < n and (pages[i].at[0] is not None or pages[i].at[1] is not None):
                i += 1
            host = i
            while i < n and any(pages[i].at):
                i += 1
            sto = i
        else:
            levels = []
            for level in _TIERS:

                def has(pool: PoolName, i: int, level: int = level) -> bool:
                    return any(self._has(pages[i], t, pool) for t in range(level + 1))

                levels.append(usable_boundary(self.rules, n, has))
            dev, host, sto = levels
        if touch and host:
            self._touch(pages[:host])
        return Match(
            keys=tuple(keys[:sto]),
            page_size=self.rules.page_size,
            device_pages=dev,
            host_pages=max(dev, host),
            storage_pages=max(dev, host, sto),
        )

    # ---- LRU -----------------------------------------------------------------------------

    def _evictable(self, page: PageRecord, tier: int) -> bool:
        return not page.pins[tier] and page.evicting[tier] is None and page.at[tier] is not None

    def _lru_add(self, page: PageRecord, tier: int) -> None:
        if tier == Tier.STORAGE or not self._evictable(page, tier):
            return
        at = page.at[tier] or {}
        for pool in self._owners:
            if pool in at:
                self._lru.stamp(page, self._slot[tier, pool])

    def _lru_remove(self, page: PageRecord, tier: int, pools: Iterable[PoolName] | None = None) -> None:
        if tier == Tier.STORAGE:
            return
        for pool in self._owners if pools is None else pools:
            self._lru.unstamp(page, self._slot[tier, pool])

    def _touch(self, pages: Sequence[PageRecord], *, enter: bool = False) -> None:
        """Make pages most recently used: the anchor's tail-first, trailing pools head-first.

        ``enter``: also stamp evictable pages that have no stamp yet (new placements).
        """
        for (tier, pool), slot in self._slot.items():
            if not enter and not self._lru.live(slot):
                continue
            seq: Iterable[PageRecord] = pages if pool in self._trailing else reversed(pages)
            admit = None
            if enter:

                def admit(p: PageRecord, tier: int = tier, pool: PoolName = pool) -> bool:
                    at = p.at[tier]
                    return at is not None and pool in at and self._evictable(p, tier)

            self._lru.touch(seq, slot, admit)

    # ---- insert ----------------------------------------------------------------------------

    def _check_placement(
        self, where: Mapping[PoolName, int], what: str, *, fill: bool = False
    ) -> dict[PoolName, int]:
        if fill and not where:
            raise ConfigError(f"{what}: an empty placement")
        if self._anchor not in where and not fill:
            raise ConfigError(f"{what}: a placement needs the anchor {self._anchor.value!r}")
        bad = [p.value for p in where if p not in self._follows or self._follows[p]]
        if bad:
            raise ConfigError(
                f"{what}: pools {bad} have no pages of their own here (owners: "
                f"{[p.value for p in self._owners]})"
            )
        odd = [pid for pid in where.values() if not is_int(pid) or pid < 0]
        if odd:
            raise ConfigError(f"{what}: page ids must be non-negative integers, got {odd}")
        return dict(where)

    def insert(self, keys: Sequence[bytes], placements: Sequence[Placement]) -> Actions:
        """Register pages a request computed on device; counts one hit per page.

        Pages already on device come back in ``free`` (the caller's copy is a duplicate); a
        state checkpoint or window page for a pool the page lacked is added.
        """
        if len(keys) != len(placements):
            raise ConfigError(f"insert: {len(keys)} keys with {len(placements)} placements")
        checked = [self._check_placement(w, "insert") for w in placements]
        free: list[Freed] = []
        touched: list[PageRecord] = []
        dev = Tier.DEVICE
        for key, where in zip(keys, checked, strict=True):
            page = self._pages.get(key)
            if page is None:
                page = self._pages[key] = PageRecord(key, self._slots)
            page.hits += 1
            have = page.at[dev]
            if have is None and not page.pending[dev]:
                page.at[dev] = where  # stamped by the touch below, in LRU order
            else:
                for pool, pid in where.items():
                    # a load on its way (a whole page, or a fill of this copy) brings its own
                    if have is None or pool in have or page.pending[dev]:
                        free.append(Freed(dev, pool, pid))
                    else:
                        have[pool] = pid  # stamped by the touch below
            touched.append(page)
        self._touch(touched, enter=True)
        backup = self._wanted(touched, Tier.HOST)
        store = self._wanted(touched, Tier.STORAGE)
        return Actions(backup=backup, store=store, free=tuple(free))

    def _wanted(self, pages: Iterable[PageRecord], dest: Tier) -> tuple[PageOp, ...]:
        """Pages the write-through policies want copied down to ``dest`` now."""
        limit = self.writes.threshold(dest)
        if limit is None:
            return ()
        src = dest - 1
        return tuple(
            PageOp(p.key, dict(p.at[src] or {}))
            for p in pages
            if p.hits >= limit
            and p.at[src] is not None
            and p.at[dest] is None
            and not p.pending[dest]
            and p.evicting[src] is None
        )

    # ---- pins ------------------------------------------------------------------------------

    def _page(self, key: bytes) -> PageRecord:
        page = self._pages.get(key)
        if page is None:
            raise CacheStateError(f"page {key.hex()[:16]}… is not in the index")
        return page

    def pin(self, tier: Tier, keys: Sequence[bytes]) -> None:
        """Protect pages on ``tier`` from eviction; each must be there. All or nothing."""
        pages = [self._page(k) for k in keys]
        missing = [p.key.hex()[:16] for p in pages if p.at[tier] is None]
        if missing:
            raise CacheStateError(f"pin: pages {missing} are not on {tier.name}")
        for p in pages:
            p.pins[tier] += 1
            if p.pins[tier] == 1:
                self._lru_remove(p, tier)

    def unpin(self, tier: Tier, keys: Sequence[bytes]) -> None:
        """Undo one pin per page; CacheStateError (changing nothing) below zero."""
        pages = [self._page(k) for k in keys]
        counts: dict[bytes, int] = {}
        for p in pages:
            counts[p.key] = counts.get(p.key, 0) + 1
        over = [k.hex()[:16] for k, c in counts.items() if self._pages[k].pins[tier] < c]
        if over:
            raise CacheStateError(f"unpin: pages {over} are not pinned on {tier.name}")
        for p in pages:
            p.pins[tier] -= 1
            if p.pins[tier] == 0:
                self._lru_add(p, tier)

    # ---- two-phase transfers -----------------------------------------------------------------

    def _new_ticket(
        self,
        kind: OpKind,
        pages: Sequence[PageRecord],
        dests: Sequence[Placement],
    ) -> Ticket:
        src, dst = kind.source, kind.dest
        seen: set[bytes] = set()
        for p, dest in zip(pages, dests, strict=True):
            if p.key in seen:
                raise CacheStateError(f"{kind.value}: page {p.key.hex()[:16]} twice in one batch")
            seen.add(p.key)
            refused = destination_refusal(p, kind, dest, self._anchor)
            if refused is not None:
                raise CacheStateError(refused)
            source = p.at[src]
            if src == Tier.STORAGE:
                continue
            if source is None:
                raise CacheStateError(
                    f"{kind.value}: page {p.key.hex()[:16]} is not on {src.name}"
                )
            if dst != Tier.STORAGE and not dest.keys() <= source.keys():
                # The source's pools are the index's state, which may have changed since the
                # caller read it (a race), so this is a state error, not bad input.
                raise CacheStateError(
                    f"{kind.value}: page {p.key.hex()[:16]} has pools "
                    f"{sorted(q.value for q in source)} on {src.name}; a destination for "
                    f"{sorted(q.value for q in dest)} would register pages nothing was copied to"
                )
        ticket = Ticket(
            id=self._next_ticket,
            kind=kind,
            keys=tuple(p.key for p in pages),
            sources=tuple(dict(p.at[src] or {}) for p in pages),
            dests=tuple(dests),
        )
        self._next_ticket += 1
        for p, dest in zip(pages, dests, strict=True):
            p.pending[dst] = ticket.id
            if self._anchor not in dest:  # a fill: keep the copy it completes where it is
                p.pins[dst] += 1
                if p.pins[dst] == 1:
                    self._lru_remove(p, dst)
            if src != Tier.STORAGE:
                p.pins[src] += 1
                if p.pins[src] == 1:
                    self._lru_remove(p, src)
        self._tickets[ticket.id] = ticket
        return ticket

    def prepare_backup(self, keys: Sequence[bytes], host: Sequence[Placement]) -> Ticket:
        """Device -> host into the caller's host pages ``host`` (one placement per key)."""
        self._same_len(keys, host, "prepare_backup")
        dests = [self._check_placement(w, "prepare_backup") for w in host]
        return self._new_ticket(OpKind.BACKUP, [self._page(k) for k in keys], dests)

    def prepare_load(self, keys: Sequence[bytes], device: Sequence[Placement]) -> Ticket:
        """Host -> device into the caller's device pages ``device`` (without the anchor: a fill)."""
        self._same_len(keys, device, "prepare_load")
        dests = [self._check_placement(w, "prepare_load", fill=True) for w in device]
        return self._new_ticket(OpKind.LOAD, [self._page(k) for k in keys], dests)

    def prepare_prefetch(self, keys: Sequence[bytes], host: Sequence[Placement]) -> Ticket:
        """Storage -> host into ``host``; pages the index did not know are created (hidden).

        A placement without the anchor is a fill of a page on host that lacks those pools.
        """
        self._same_len(keys, host, "prepare_prefetch")
        dests = [self._check_placement(w, "prepare_prefetch", fill=True) for w in host]
        fresh = [k for k in dict.fromkeys(keys) if k not in self._pages]
        for k in fresh:
            self._pages[k] = PageRecord(k, self._slots)
        try:
            return self._new_ticket(OpKind.PREFETCH, [self._pages[k] for k in keys], dests)
        except BaseException:
            for k in fresh:
                del self._pages[k]
            raise

    def prepare_store(self, keys: Sequence[bytes]) -> Ticket:
        """Host -> storage; the ticket's ``sources`` are the host placements to write from."""
        pages = [self._page(k) for k in keys]
        dests = [self._objects(p.at[Tier.HOST] or {}) for p in pages]
        return self._new_ticket(OpKind.STORE, pages, dests)

    def _objects(self, where: Placement) -> dict[PoolName, int]:
        """The storage objects of a page placed at ``where``: its pools plus the sidecars."""
        return {p: 0 for p in self.rules.names if p in where or self._follows[p]}

    @staticmethod
    def _same_len(keys: Sequence[bytes], where: Sequence[Placement], what: str) -> None:
        if len(keys) != len(where):
            raise ConfigError(f"{what}: {len(keys)} keys with {len(where)} placements")

    def complete(self, ticket: Ticket, ok: bool | Sequence[bool]) -> Actions:
        """Finish a transfer: pages whose copy succeeded become visible on the destination.

        ``ok`` is one flag for the batch or one per page. Failed destinations come back in
        ``free``; so do sources that a write_back eviction was waiting on.
        """
        if self._tickets.get(ticket.id) is not ticket:
            raise CacheStateError(f"ticket {ticket.id} ({ticket.kind.value}) is not in flight")
        flags = [ok] * len(ticket) if isinstance(ok, bool) else list(ok)
        if len(flags) != len(ticket):
            raise ConfigError(f"complete: {len(flags)} flags for a ticket of {len(ticket)} pages")
        del self._tickets[ticket.id]
        src, dst = ticket.kind.source, ticket.kind.dest
        free: list[Freed] = []
        arrived: list[PageRecord] = []
        for key, dest, good in zip(ticket.keys, ticket.dests, flags, strict=True):
            page = self._pages[key]
            page.pending[dst] = 0
            fill = self._anchor not in dest
            if fill:
                page.pins[dst] -= 1
            if good:
                page.at[dst] = {**(page.at[dst] or {}), **dest}
                if ticket.kind is OpKind.PREFETCH:
                    got = dict.fromkeys(dest, 0) if fill else self._objects(dest)
                    page.at[Tier.STORAGE] = {**(page.at[Tier.STORAGE] or {}), **got}
                arrived.append(page)
            elif dst != Tier.STORAGE:
                free.extend(Freed(dst, pool, pid) for pool, pid in dest.items())
            self._lru_add(page, dst)  # no-op unless the copy there is whole and unpinned
            if src != Tier.STORAGE:
                page.pins[src] -= 1
                scope = page.evicting[src]
                if scope is not None and ticket.kind in (OpKind.BACKUP, OpKind.STORE):
                    # The copy a write_back eviction waited for: drop the source now, unless a
                    # request pinned it meanwhile (then it stays and returns to the LRU on unpin).
                    page.evicting[src] = None
                    if page.pins[src] == 0:
                        free.extend(self._drop(page, src, scope))
                    self._lru_add(page, src)  # what the eviction did not take (another pool's)
                elif page.pins[src] == 0:
                    self._lru_add(page, src)
            if page.idle():
                del self._pages[key]
        if arrived and dst != Tier.STORAGE:
            self._touch(arrived)
        store = self._wanted(arrived, Tier.STORAGE) if dst == Tier.HOST else ()
        return Actions(store=store, free=tuple(free))

    def abort(self, ticket: Ticket) -> Actions:
        """Give up a transfer: complete(ticket, False)."""
        return self.complete(ticket, False)

    # ---- eviction ----------------------------------------------------------------------------

    def _drop(self, page: PageRecord, tier: int, scope: PoolName) -> list[Freed]:
        """Remove ``scope``'s pages (every pool's when scope is the anchor) from ``tier``."""
        at = page.at[tier]
        if at is None:
            return []
        pools = list(at) if scope is self._anchor else [scope] if scope in at else []
        if tier != Tier.STORAGE:
            self._lru_remove(page, tier, [q for q in pools if (tier, q) in self._slot])
        freed = [Freed(Tier(tier), pool, at.pop(pool)) for pool in pools]
        if not at:
            page.at[tier] = None
        # The store frees its own space: nothing to give back for STORAGE.
        return [] if tier == Tier.STORAGE else freed

    def evict(self, tier: Tier, count: int, pool: PoolName | None = None) -> Actions:
        """Evict up to ``count`` unpinned pages of ``pool`` (anchor: whole pages) from ``tier``.

        Under write_back a victim not yet on the next tier is copied down first: it comes back
        in ``backup`` (device) or ``store`` (host), pinned until that copy completes, and its
        ids are freed by that completion. ``evicted`` counts both kinds.
        """
        if tier not in _CACHED:
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
            if (
                policy is WritePolicy.WRITE_BACK
                and page.at[nxt] is None
                and not page.pending[nxt]
            ):
                page.evicting[tier] = scope
                self._lru_remove(page, tier)
                copy.append(PageOp(key, dict(page.at[tier] or {})))
                continue
            free.extend(self._drop(page, tier, scope))
            if page.idle():
                del self._pages[key]
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
                p.evicting[tier] = None
            free.extend(self._drop(p, tier, self._anchor if pool is None else pool))
            if p.idle():
                del self._pages[p.key]
        return Actions(free=tuple(free))

    # ---- inspection ----------------------------------------------------------------------------

    def statistics(self) -> IndexStats:
        return count_pages(
            self._pages.values(), tickets=len(self._tickets), evictions=self._evictions
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
        )
