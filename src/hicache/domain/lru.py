"""LRU order as monotonic ticks: O(1) amortized per touch, no hash lookup, no clock.

- Stamped: anything with a ``stamp`` list of ints, one per slot (0: not in that slot's order).
- TickLru: per slot, a queue of (tick, item) in touch order. Touching stamps the item with the
  next tick and appends; the oldest entry whose tick is still the item's stamp is the least
  recently used item; stale entries (touched again later, or unstamped) are skipped, and a queue
  is compacted when stale entries outnumber live ones.

The prefix index keeps one slot per (cached tier, owning pool). Items without a stamp are
invisible to ``pop_oldest``: that is how pinned and in-flight pages stay safe from eviction.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from typing import Generic, Protocol, TypeVar


class Stamped(Protocol):
    stamp: list[int]


T = TypeVar("T", bound=Stamped)


class TickLru(Generic[T]):
    """Touch order of items over ``slots`` independent slots."""

    def __init__(self, slots: int) -> None:
        self._queues: list[deque[tuple[int, T]]] = [deque() for _ in range(slots)]
        self._live = [0] * slots
        self._tick = 0

    def live(self, slot: int) -> int:
        """How many items are stamped in ``slot``."""
        return self._live[slot]

    def stamp(self, item: T, slot: int) -> None:
        """Make ``item`` the most recently used of ``slot`` (entering it if it was not in)."""
        self._tick += 1
        if not item.stamp[slot]:
            self._live[slot] += 1
        item.stamp[slot] = self._tick
        self._queues[slot].append((self._tick, item))
        self._compact(slot)

    def unstamp(self, item: T, slot: int) -> None:
        """Take ``item`` out of ``slot``'s order (its queue entry goes stale)."""
        if item.stamp[slot]:
            item.stamp[slot] = 0
            self._live[slot] -= 1

    def touch(self, items: Iterable[T], slot: int, admit: Callable[[T], bool] | None) -> None:
        """Restamp, in order, every item of ``items`` stamped in ``slot``; with ``admit``, also
        stamp the unstamped items it accepts."""
        tick = self._tick
        append = self._queues[slot].append
        entered = 0
        for item in items:
            if item.stamp[slot] or (admit is not None and admit(item)):
                if not item.stamp[slot]:
                    entered += 1
                tick += 1
                item.stamp[slot] = tick
                append((tick, item))
        self._tick = tick
        self._live[slot] += entered
        self._compact(slot)

    def pop_oldest(self, slot: int) -> T | None:
        """The least recently used stamped item of ``slot`` (still stamped), or None."""
        q = self._queues[slot]
        while q:
            tick, item = q.popleft()
            if item.stamp[slot] == tick:
                return item
        return None

    def holds(self, slot: int) -> set[int]:
        """ids of the items that ``slot``'s queue holds live (for invariant checks)."""
        return {id(item) for tick, item in self._queues[slot] if item.stamp[slot] == tick}

    def _compact(self, slot: int) -> None:
        q = self._queues[slot]
        if len(q) > 2 * self._live[slot] + 64:
            self._queues[slot] = deque(e for e in q if e[1].stamp[slot] == e[0])
