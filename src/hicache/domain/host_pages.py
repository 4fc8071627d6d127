"""A host-tier-only page index: page key -> host slot, with pins and LRU eviction.

- HostPages(slots, pool=): ``slots`` host pages of one pool, all free at first.
- lookup(key, touch=): the slot of a READY page, or None; ``known(key)`` also counts a page
  being written (PENDING) or dropped while pinned.
- reserve(key, pins): a free slot for a page about to be written (evicting the least recently
  used unpinned READY page when none is free), PENDING and pinned ``pins`` times; None when
  every slot is pinned or pending.
- ready(key) makes a PENDING page matchable; drop(key) forgets a page whose write or read failed
  (unmatchable at once, its slot free once unpinned); pin / unpin keep a page from eviction.
- clear_unpinned(): forget every READY unpinned page (a cache reset); pinned pages stay.
- on_change(key, held): an optional listener told when a page becomes matchable (``held``
  True: ``ready``) and when a matchable page stops being so (False: evicted, cleared, dropped),
  once each way; what the vLLM connector's KV events are made from.

Built from the domain's own pieces, not a second copy of them: the slots are a PageAllocator
(hicache.domain.slots), the pin counts a PinTable keyed by (pool, slot) (hicache.domain.pins)
and the eviction order a one-slot TickLru (hicache.domain.lru), where only READY unpinned pages
carry a stamp, so eviction can never pick a pinned or pending one.

For a serving engine that owns the device tier itself (vLLM's connector, docs/vllm.md): the
PrefixIndex tracks a page on device, host and storage at once and is fed by the cache face; this
one tracks only which pages the host holds. One owner thread.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hicache.domain.errors import CacheStateError, ConfigError
from hicache.domain.lru import TickLru
from hicache.domain.pins import PinTable
from hicache.domain.pools import PoolName
from hicache.domain.slots import PageAllocator


class _Page:
    __slots__ = ("dropped", "key", "ready", "slot", "stamp")

    def __init__(self, key: bytes, slot: int) -> None:
        self.key = key
        self.slot = slot
        self.ready = False
        self.dropped = False
        self.stamp: list[Any] = [0]  # TickLru's: one LRU slot


class HostPages:
    """Page keys (bytes) -> host slots of one pool; LRU over READY unpinned pages."""

    def __init__(
        self,
        slots: int,
        *,
        pool: PoolName = PoolName.KV,
        on_change: Callable[[bytes, bool], None] | None = None,
    ) -> None:
        if not isinstance(slots, int) or isinstance(slots, bool) or slots < 1:
            raise ConfigError(f"host tier: {slots!r} host pages; expected at least 1")
        self.pool = pool
        self.on_change = on_change
        self._slots = PageAllocator(slots, name=f"host {pool.value}")
        self.pins = PinTable(f"host {pool.value} pins")
        self._lru: TickLru[_Page] = TickLru(1)
        self._pages: dict[bytes, _Page] = {}
        self.evictions = 0

    @property
    def slots(self) -> int:
        return self._slots.pages

    @property
    def free_slots(self) -> int:
        return self._slots.free_count()

    def __len__(self) -> int:
        return len(self._pages)

    def __repr__(self) -> str:
        return (
            f"<HostPages {self.pool.value}: {len(self._pages)}/{self.slots} pages held, "
            f"{len(self.pins)} pinned>"
        )

    def known(self, key: bytes) -> bool:
        return key in self._pages

    def lookup(self, key: bytes, *, touch: bool = False) -> int | None:
        page = self._pages.get(key)
        if page is None or not page.ready:
            return None
        if touch and page.stamp[0]:
            self._lru.stamp(page, 0)
        return page.slot

    def pin_count(self, key: bytes) -> int:
        page = self._pages.get(key)
        return 0 if page is None else self.pins.count(self.pool, page.slot)

    def reserve(self, key: bytes, pins: int = 1) -> int | None:
        if key in self._pages:
            raise CacheStateError(f"host index: page {key.hex()[:16]} is already held")
        if pins < 1:
            raise CacheStateError(f"host index: a reservation takes at least one pin, got {pins}")
        if not self._slots.free_count() and not self._evict_one():
            return None
        (slot,) = self._slots.allocate(1)
        page = self._pages[key] = _Page(key, slot)
        self.pins.pin({self.pool: [page.slot] * pins})
        return slot

    def _evict_one(self) -> bool:
        page = self._lru.pop_oldest(0)
        if page is None:
            return False
        self._lru.unstamp(page, 0)
        self._forget(page)
        self.evictions += 1
        return True

    def _forget(self, page: _Page) -> None:
        self.pins.check_unpinned({self.pool: [page.slot]}, action="free")
        del self._pages[page.key]
        self._slots.free([page.slot])
        if page.ready and self.on_change is not None:
            self.on_change(page.key, False)

    def ready(self, key: bytes) -> None:
        page = self._page(key)
        if page.dropped:
            return
        was_ready, page.ready = page.ready, True
        if not self.pins.is_pinned(self.pool, page.slot):
            self._lru.stamp(page, 0)
        if not was_ready and self.on_change is not None:
            self.on_change(key, True)

    def drop(self, key: bytes) -> None:
        """Forget a page (a failed write or read): unmatchable now, slot free once unpinned."""
        page = self._pages.get(key)
        if page is None:
            return
        self._lru.unstamp(page, 0)
        if self.pins.is_pinned(self.pool, page.slot):
            was_ready, page.ready = page.ready, False
            page.dropped = True
            if was_ready and self.on_change is not None:
                self.on_change(key, False)
        else:
            self._forget(page)

    def pin(self, key: bytes) -> int:
        page = self._page(key)
        if not page.ready:
            raise CacheStateError(f"host index: pin of page {key.hex()[:16]}, which is not ready")
        self.pins.pin({self.pool: [page.slot]})
        self._lru.unstamp(page, 0)
        return page.slot

    def unpin(self, key: bytes) -> None:
        page = self._page(key)
        if not self.pins.is_pinned(self.pool, page.slot):
            raise CacheStateError(f"host index: page {key.hex()[:16]} is not pinned")
        self.pins.unpin({self.pool: [page.slot]})
        if self.pins.is_pinned(self.pool, page.slot):
            return
        if page.dropped:
            self._forget(page)
        elif page.ready:
            self._lru.stamp(page, 0)

    def clear_unpinned(self) -> int:
        """Forget every READY unpinned page (vLLM's reset_prefix_cache with the connector)."""
        n = 0
        while (page := self._lru.pop_oldest(0)) is not None:
            self._lru.unstamp(page, 0)
            self._forget(page)
            n += 1
        return n

    def _page(self, key: bytes) -> _Page:
        page = self._pages.get(key)
        if page is None:
            raise CacheStateError(f"host index: page {key.hex()[:16]} is not held")
        return page
