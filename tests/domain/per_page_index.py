"""The prefix index as it was before the long-prompt work (issue #19), kept as a reference the
index tests compare the current one against on random prompts.

- PerItemLru: the earlier TickLru, one (tick, item) queue entry per stamp.
- PerPageIndex: match looks pages up then walks them, pins and unpins stamp page by page.
- outcome(result) / dropped(index, keys): comparable forms of a result, and of drop's actions
  or refusal.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from hicache.domain import CacheStateError, GroupRules, PrefixIndex, Tier
from hicache.domain.index_pages import PageRecord
from hicache.domain.pools import PoolName as P
from hicache.domain.tiers import Match


class PerItemLru:
    """The earlier TickLru: one (tick, item) queue entry per stamp."""

    def __init__(self, slots: int) -> None:
        self._queues: list[deque[tuple[int, Any]]] = [deque() for _ in range(slots)]
        self._live = [0] * slots
        self._tick = 0

    def live(self, slot: int) -> int:
        return self._live[slot]

    def stamp(self, item: Any, slot: int) -> None:
        self._tick += 1
        if not item.stamp[slot]:
            self._live[slot] += 1
        item.stamp[slot] = self._tick
        self._queues[slot].append((self._tick, item))

    def unstamp(self, item: Any, slot: int) -> None:
        if item.stamp[slot]:
            item.stamp[slot] = 0
            self._live[slot] -= 1

    def touch(self, items: Iterable[Any], slot: int, admit: Callable[[Any], bool] | None) -> None:
        for item in items:
            if item.stamp[slot] or (admit is not None and admit(item)):
                if not item.stamp[slot]:
                    self._live[slot] += 1
                self._tick += 1
                item.stamp[slot] = self._tick
                self._queues[slot].append((self._tick, item))

    def pop_oldest(self, slot: int) -> Any:
        q = self._queues[slot]
        while q:
            tick, item = q.popleft()
            if item.stamp[slot] == tick:
                return item
        return None

    def holds(self, slot: int) -> set[int]:
        return {id(i) for t, i in self._queues[slot] if i.stamp[slot] == t}


class PerPageIndex(PrefixIndex):
    """The earlier index: match looks pages up then walks them, pins and unpins stamp page by
    page, touches admit on every tier (one pool, as the test uses)."""

    def __init__(self, rules: GroupRules) -> None:
        super().__init__(rules)
        self._lru = PerItemLru(self._slots)  # type: ignore[assignment]

    def match(self, keys: Sequence[bytes], *, touch: bool = True) -> Match:
        pages: list[PageRecord] = []
        for k in keys:
            p = self._pages.get(k)
            if p is None:
                break
            pages.append(p)
        n = len(pages)
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
        if touch and host:
            self._touch(pages[:host])
        return Match(
            keys=tuple(keys[:sto]),
            page_size=self.rules.page_size,
            device_pages=dev,
            host_pages=max(dev, host),
            storage_pages=max(dev, host, sto),
        )

    def pin(self, tier: Tier, keys: Sequence[bytes]) -> None:
        pages = [self._page(k) for k in keys]
        if any(p.at[tier] is None for p in pages):
            super().pin(tier, keys)  # raises the same error
        for p in pages:
            p.pins[tier] += 1
            if p.pins[tier] == 1:
                self._lru_remove(p, tier)

    def unpin(self, tier: Tier, keys: Sequence[bytes]) -> None:
        pages = [self._page(k) for k in keys]
        for p in pages:
            p.pins[tier] -= 1
            if p.pins[tier] == 0:
                self._lru_add(p, tier)

    def _touch(self, pages: Sequence[PageRecord], *, enter: bool = False) -> None:
        for (tier, pool), slot in self._slot.items():
            if not enter and not self._lru.live(slot):
                continue
            seq: Iterable[PageRecord] = pages if pool in self._trailing else reversed(pages)
            admit = None
            if enter:

                def admit(p: PageRecord, tier: int = tier, pool: P = pool) -> bool:
                    at = p.at[tier]
                    return at is not None and pool in at and self._evictable(p, tier)

            self._lru.touch(seq, slot, admit)


def dropped(index: PrefixIndex, keys: list[bytes]) -> Any:
    """drop's actions, or its refusal (a pinned page) as text: both indexes must agree."""
    try:
        return outcome(index.drop(Tier.DEVICE, keys))
    except CacheStateError as e:
        return str(e)


def outcome(result: Any) -> Any:
    if hasattr(result, "device_pages"):
        return (result.keys, result.device_pages, result.host_pages, result.storage_pages)
    return repr(result)
