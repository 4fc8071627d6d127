"""The scheduler's view of the host tier: page key -> host slot, with pins and LRU eviction.

- HostIndex(slots): ``slots`` host pages, all free at first.
- lookup(key): READY slot or None; ``known(key)`` also counts a page being saved or read.
- reserve(key, pins): a free slot (evicting the least recently used unpinned READY page when
  none is free) for a page about to be written, PENDING and pinned ``pins`` times; None when
  every slot is pinned.
- ready(key) makes a PENDING page matchable; drop(key) forgets a page whose write failed
  (its slot is free again once unpinned); pin / unpin keep a page from eviction.

Torch- and vLLM-free: the scheduler owns it and never touches the bytes; the worker holds the
host memory and tells the scheduler (through the worker metadata) which writes succeeded.
"""

from __future__ import annotations

from collections import OrderedDict

import attrs

from hicache.domain import CacheStateError, ConfigError


@attrs.define
class _Entry:
    slot: int
    ready: bool = False
    pins: int = 0
    dropped: bool = False


class HostIndex:
    """Page keys (bytes) -> host slots; LRU over READY unpinned pages. One owner thread."""

    def __init__(self, slots: int) -> None:
        if slots < 1:
            raise ConfigError(f"host tier: {slots} host pages; expected at least 1")
        self.slots = slots
        self._free = list(range(slots - 1, -1, -1))
        self._pages: dict[bytes, _Entry] = {}
        self._lru: OrderedDict[bytes, None] = OrderedDict()  # READY and unpinned, oldest first
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._pages)

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def known(self, key: bytes) -> bool:
        return key in self._pages

    def lookup(self, key: bytes, *, touch: bool = False) -> int | None:
        e = self._pages.get(key)
        if e is None or not e.ready:
            return None
        if touch and key in self._lru:
            self._lru.move_to_end(key)
        return e.slot

    def reserve(self, key: bytes, pins: int = 1) -> int | None:
        if key in self._pages:
            raise CacheStateError(f"host index: page {key.hex()[:16]} is already held")
        if not self._free and not self._evict_one():
            return None
        slot = self._free.pop()
        self._pages[key] = _Entry(slot=slot, pins=pins)
        return slot

    def _evict_one(self) -> bool:
        if not self._lru:
            return False
        key, _ = self._lru.popitem(last=False)
        e = self._pages.pop(key)
        self._free.append(e.slot)
        self.evictions += 1
        return True

    def ready(self, key: bytes) -> None:
        e = self._entry(key)
        if e.dropped:
            return
        e.ready = True
        if e.pins == 0:
            self._lru[key] = None

    def drop(self, key: bytes) -> None:
        """Forget a page (a failed write or read): unmatchable now, slot free once unpinned."""
        e = self._pages.get(key)
        if e is None:
            return
        self._lru.pop(key, None)
        if e.pins == 0:
            del self._pages[key]
            self._free.append(e.slot)
        else:
            e.ready = False
            e.dropped = True

    def pin(self, key: bytes) -> int:
        e = self._entry(key)
        if not e.ready:
            raise CacheStateError(f"host index: pin of page {key.hex()[:16]}, which is not ready")
        e.pins += 1
        self._lru.pop(key, None)
        return e.slot

    def unpin(self, key: bytes) -> None:
        e = self._entry(key)
        if e.pins <= 0:
            raise CacheStateError(f"host index: page {key.hex()[:16]} is not pinned")
        e.pins -= 1
        if e.pins:
            return
        if e.dropped:
            del self._pages[key]
            self._free.append(e.slot)
        elif e.ready:
            self._lru[key] = None

    def clear_unpinned(self) -> int:
        """Forget every READY unpinned page (vLLM's reset_prefix_cache with the connector)."""
        n = len(self._lru)
        while self._evict_one():
            pass
        self.evictions -= n
        return n

    def _entry(self, key: bytes) -> _Entry:
        e = self._pages.get(key)
        if e is None:
            raise CacheStateError(f"host index: page {key.hex()[:16]} is not held")
        return e
