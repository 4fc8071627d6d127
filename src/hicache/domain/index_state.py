"""The prefix index's state and the steps its operations share (pure; one owner).

- CACHED_TIERS: the tiers whose pages the index evicts (DEVICE, HOST).
- IndexState(rules, writes): the records by page key, the LRU slot per (cached tier, owning
  pool), the transfers in flight and the eviction counts; the base of PrefixIndex.
- _page(key): the record of a key the index knows (CacheStateError otherwise); _forget(page)
  removes one that holds nothing.
- _has(page, tier, pool): whether a page has ``pool`` on ``tier`` (a pool that follows the
  anchor: the anchor's placement on DEVICE / HOST).
- _evictable / _lru_add / _lru_remove / _touch: LRU stamps of unpinned, settled pages (the
  ``_all`` forms do many pages at once, in order, as one run per slot); touch
  orders the anchor's pages tail-first and trailing pools' pages head-first.
- _held_by_other / _hold / _unhold: which key each cached page id holds (a copy, or a
  destination reserved for one): a page id holds one key's bytes at a time.
- _check_placement(where, what): a placement's anchor, owner pools and ids (ConfigError).
- _wanted(pages, dest): the copies down to ``dest`` the write-through policies want now.
- _drop(page, tier, scope): remove ``scope``'s pages from a tier; the ids to free.
- _objects(where): the storage objects of a page placed at ``where`` (pools and sidecars).
- _same_len(keys, where, what): ConfigError when keys and placements differ in number.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from hicache.domain.errors import CacheStateError, ConfigError
from hicache.domain.hybrid import GroupRules, Restore
from hicache.domain.index_pages import HolderKey, PageRecord
from hicache.domain.keys import KeyChain
from hicache.domain.lru import TickLru
from hicache.domain.pools import PoolName
from hicache.domain.tiers import Freed, PageOp, Placement, Ticket, Tier, WriteSettings
from hicache.domain.validators import is_int

CACHED_TIERS = (Tier.DEVICE, Tier.HOST)  # tiers whose pages the index evicts


class IndexState:
    """The index's mutable state and its shared steps (see the module docstring)."""

    def __init__(self, rules: GroupRules, writes: WriteSettings | None = None) -> None:
        self.rules = rules
        self.writes = writes or WriteSettings()
        self._anchor = rules.anchor
        self._owners = rules.owners
        self._follows = {r.pool: r.follows_anchor for r in rules.rules}
        self._trailing = {r.pool for r in rules.rules if r.restore is not Restore.ALL_PAGES}
        self._pages: dict[bytes, PageRecord] = {}
        n = len(self._owners)
        self._slots = len(CACHED_TIERS) * n
        self._slot: dict[tuple[int, PoolName], int] = {
            (t, p): t * n + i for t in CACHED_TIERS for i, p in enumerate(self._owners)
        }
        self._lru: TickLru[PageRecord] = TickLru(self._slots)
        self._tickets: dict[int, Ticket] = {}
        self._next_ticket = 1
        self._evictions = [0, 0, 0]
        # Per cached tier, per owning pool's text, page id -> the key whose copy (or reserved
        # destination) uses that page: one page id never holds two keys' bytes. Nested dicts
        # of plain keys: no tuple or enum hash per page on the insert path.
        self._held: tuple[dict[str, dict[int, bytes]], ...] = tuple(
            {p._value_: {} for p in self._owners} for _ in CACHED_TIERS
        )

    def _page(self, key: bytes) -> PageRecord:
        page = self._pages.get(key)
        if page is None:
            raise CacheStateError(f"page {key.hex()[:16]}… is not in the index")
        return page

    def _before(self, keys: Sequence[bytes]) -> PageRecord | None:
        """The record of the key before ``keys[0]``, when ``keys`` is a KeyChain that names it."""
        prior = keys.prior if isinstance(keys, KeyChain) else None
        return None if prior is None else self._pages.get(prior)

    def _forget(self, page: PageRecord) -> None:
        """Remove a record from the index (it holds nothing now) and drop its chain link."""
        del self._pages[page.key]
        page.parent = None

    def _has(self, page: PageRecord, tier: int, pool: PoolName) -> bool:
        at = page.at[tier]
        if at is None:
            return False
        if tier != Tier.STORAGE and self._follows[pool]:
            return self._anchor in at
        return pool in at

    def _evictable(self, page: PageRecord, tier: int) -> bool:
        return not page.pins[tier] and page.evicting[tier] is None and page.at[tier] is not None

    def _lru_add(self, page: PageRecord, tier: int) -> None:
        if tier == Tier.STORAGE or not self._evictable(page, tier):
            return
        at = page.at[tier] or {}
        for pool in self._owners:
            if pool in at:
                self._lru.stamp(page, self._slot[tier, pool])

    def _lru_remove(
        self, page: PageRecord, tier: int, pools: Iterable[PoolName] | None = None
    ) -> None:
        if tier == Tier.STORAGE:
            return
        for pool in self._owners if pools is None else pools:
            self._lru.unstamp(page, self._slot[tier, pool])

    def _lru_add_all(self, pages: Sequence[PageRecord], tier: int) -> None:
        """``_lru_add`` of each page, in order, as one run per slot (a long prompt's unpin)."""
        if tier == Tier.STORAGE or not pages:
            return
        for pool in self._owners:

            def admit(p: PageRecord, pool: PoolName = pool) -> bool:
                at = p.at[tier]  # _evictable, inline: a long prompt's release asks it per page
                return (
                    at is not None and pool in at and not p.pins[tier] and p.evicting[tier] is None
                )

            self._lru.touch(pages, self._slot[tier, pool], admit)

    def _lru_remove_all(self, pages: Sequence[PageRecord], tier: int) -> None:
        """``_lru_remove`` of each page (every owner pool's stamp on ``tier``)."""
        if tier == Tier.STORAGE:
            return
        for pool in self._owners:
            self._lru.unstamp_all(pages, self._slot[tier, pool])

    def _touch(
        self, pages: Sequence[PageRecord], *, enter: bool = False, last_first: bool = False
    ) -> None:
        """Make pages most recently used: the anchor's tail-first, trailing pools head-first.

        ``enter``: also stamp evictable pages that have no stamp yet (new placements, which
        only insert makes, and only on DEVICE: the other tiers' stamps are already right).
        ``last_first``: ``pages`` are given last page first (the chain match's order).
        """
        for (tier, pool), slot in self._slot.items():
            admits = enter and tier == Tier.DEVICE
            if not admits and not self._lru.live(slot):
                continue
            seq: Iterable[PageRecord] = (
                pages if (pool in self._trailing) != last_first else reversed(pages)
            )
            admit = None
            if admits:

                def admit(p: PageRecord, tier: int = tier, pool: PoolName = pool) -> bool:
                    at = p.at[tier]  # _evictable, inline: an insert asks this per new page
                    return (
                        at is not None
                        and pool in at
                        and not p.pins[tier]
                        and p.evicting[tier] is None
                    )

            self._lru.touch(seq, slot, admit)

    def _held_by_other(self, tier: int, key: bytes, where: Mapping[PoolName, int]) -> str | None:
        """Why ``where`` on ``tier`` cannot hold ``key``'s bytes (None: it can): a page id
        there holds (or is reserved for) another key."""
        if tier == Tier.STORAGE:
            return None
        by = self._held[tier]
        for pool, pid in where.items():
            other = by[pool._value_].get(pid)
            if other is not None and other != key:
                return (
                    f"{Tier(tier).name} page {pid} of pool {pool.value!r} holds page "
                    f"{other.hex()[:16]} of another prefix, not {key.hex()[:16]}"
                )
        return None

    def _hold(self, tier: int, key: bytes, where: Mapping[PoolName, int]) -> None:
        if tier != Tier.STORAGE:
            by = self._held[tier]
            for pool, pid in where.items():
                by[pool._value_][pid] = key

    def _unhold(self, tier: int, pool: PoolName, pid: int) -> None:
        if tier != Tier.STORAGE:
            self._held[tier][pool._value_].pop(pid, None)

    def _holders(self) -> dict[HolderKey, bytes]:
        """The holder map flattened (validate compares it with the placements)."""
        return {
            (t, name, pid): key
            for t, by in enumerate(self._held)
            for name, ids in by.items()
            for pid, key in ids.items()
        }

    def _check_placement(
        self, where: Mapping[PoolName, int], what: str, *, fill: bool = False
    ) -> dict[PoolName, int]:
        if type(where) is dict and len(where) == 1 and not fill:
            # The common case (one anchor id), checked without the general path's passes.
            pid = where.get(self._anchor)
            if type(pid) is int and pid >= 0:
                return {self._anchor: pid}
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

    def _wanted(self, pages: Iterable[PageRecord], dest: Tier) -> tuple[PageOp, ...]:
        """Pages the write-through policies want copied down to ``dest`` now."""
        limit = self.writes.threshold(dest)
        if limit is None:
            return ()
        src = dest - 1
        return tuple(
            PageOp(p.key, p.at[src] or {})  # not copied: the index never changes it in place
            for p in pages
            if p.hits >= limit
            and p.at[src] is not None
            and p.at[dest] is None
            and not p.pending[dest]
            and p.evicting[src] is None
        )

    def _drop(self, page: PageRecord, tier: int, scope: PoolName) -> list[Freed]:
        """Remove ``scope``'s pages (every pool's when scope is the anchor) from ``tier``."""
        at = page.at[tier]
        if at is None:
            return []
        pools = list(at) if scope is self._anchor else [scope] if scope in at else []
        if tier != Tier.STORAGE:
            self._lru_remove(page, tier, [q for q in pools if (tier, q) in self._slot])
        freed = [Freed(Tier(tier), pool, at[pool]) for pool in pools]
        for f in freed:
            self._unhold(tier, f.pool, f.page)
        # A new dict (or None): placements are never changed in place, so a PageOp may hold one.
        left = {p: i for p, i in at.items() if p not in pools}
        page.at[tier] = left or None
        # The store frees its own space: nothing to give back for STORAGE.
        return [] if tier == Tier.STORAGE else freed

    def _objects(self, where: Placement) -> dict[PoolName, int]:
        """The storage objects of a page placed at ``where``: its pools plus the sidecars."""
        return {p: 0 for p in self.rules.names if p in where or self._follows[p]}

    @staticmethod
    def _same_len(keys: Sequence[bytes], where: Sequence[Placement], what: str) -> None:
        if len(keys) != len(where):
            raise ConfigError(f"{what}: {len(keys)} keys with {len(where)} placements")


__all__ = ["CACHED_TIERS", "IndexState"]
