"""LRU order as a queue of touch runs: O(1) amortized per touch, no hash lookup, no clock.

- Stamped: anything with a ``stamp`` list, one entry per slot (0: not in that slot's order;
  otherwise the run that holds the item's latest touch there).
- TickLru: per slot, a queue of runs in touch order. A touch of n items appends ONE run (their
  list, in order) and points each item's stamp at it; an entry is live while its item's stamp
  is still its run. The oldest live entry is the least recently used item; stale entries
  (touched again later, or unstamped) are skipped, and a queue is compacted when its entries
  outnumber the live ones four to one.

Each run counts the items whose stamp it is, so a run that every item has left (a long prompt
touched again: all of its 131,072 entries went stale at once) is skipped or dropped whole,
without looking at its entries; only a run some items still hold is filtered item by item.
The order is exactly the one a (tick, item) entry per touched item gave; earlier versions kept
one entry per item, then one tick per item (a new int object each), which a long prompt's
match paid for per page.

The prefix index keeps one slot per (cached tier, owning pool). Items without a stamp are
invisible to ``pop_oldest``: that is how pinned and in-flight pages stay safe from eviction.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from typing import Any, Generic, Protocol, TypeVar


class Stamped(Protocol):
    stamp: list[Any]


T = TypeVar("T", bound=Stamped)


class _Run(Generic[T]):
    """One touch's items in order, and how many of them still have it as their stamp."""

    __slots__ = ("items", "live")

    def __init__(self, items: list[T]) -> None:
        self.items = items
        self.live = 0


class TickLru(Generic[T]):
    """Touch order of items over ``slots`` independent slots."""

    def __init__(self, slots: int) -> None:
        self._queues: list[deque[_Run[T]]] = [deque() for _ in range(slots)]
        self._head = [0] * slots  # entries of the first run already popped
        self._queued = [0] * slots  # entries in the queue, live or stale
        self._live = [0] * slots

    def live(self, slot: int) -> int:
        """How many items are stamped in ``slot``."""
        return self._live[slot]

    def queued(self, slot: int) -> int:
        """How many entries ``slot``'s queue holds, live or stale (bounded by compaction)."""
        return self._queued[slot]

    def stamp(self, item: T, slot: int) -> None:
        """Make ``item`` the most recently used of ``slot`` (entering it if it was not in)."""
        self.touch((item,), slot, _always)

    def unstamp(self, item: T, slot: int) -> None:
        """Take ``item`` out of ``slot``'s order (its queue entry goes stale)."""
        run = item.stamp[slot]
        if run:
            run.live -= 1
            item.stamp[slot] = 0
            self._live[slot] -= 1

    def unstamp_all(self, items: Iterable[T], slot: int) -> None:
        """``unstamp`` of every item (a long prompt's pin), counted off their runs in stretches."""
        taken: list[T] = []
        append = taken.append
        left: _Run[T] | None = None
        mark = 0
        for item in items:
            stamps = item.stamp
            run = stamps[slot]
            if not run:
                continue
            if run is not left:
                if left is not None:
                    left.live -= len(taken) - mark
                left, mark = run, len(taken)
            stamps[slot] = 0
            append(item)
        if left is not None:
            left.live -= len(taken) - mark
        self._live[slot] -= len(taken)

    def touch(self, items: Iterable[T], slot: int, admit: Callable[[T], bool] | None) -> None:
        """Restamp, in order, every item of ``items`` stamped in ``slot``; with ``admit``, also
        stamp the unstamped items it accepts."""
        run: _Run[T] = _Run([])
        listed = run.items
        append = listed.append
        entered = 0
        again = False  # an item listed twice: only its last place counts
        # Items leave their old runs in stretches (a prompt touched again left one run): each
        # stretch is counted off its run once, not per item.
        left: _Run[T] | None = None
        mark = 0
        for item in items:
            stamps = item.stamp
            old = stamps[slot]
            if old is not left:
                if left is not None:
                    left.live -= len(listed) - mark
                    left = None
                if old:
                    if old is run:
                        again = True
                        append(item)
                        continue
                    left, mark = old, len(listed)
                elif admit is None or not admit(item):
                    continue
                else:
                    entered += 1
            stamps[slot] = run
            append(item)
        if left is not None:
            left.live -= len(listed) - mark
        if not listed:
            return
        if again:
            seen: set[int] = set()
            last: list[T] = []
            for item in reversed(listed):
                if id(item) not in seen:
                    seen.add(id(item))
                    last.append(item)
            last.reverse()
            run.items = listed = last
        run.live = len(listed)
        self._live[slot] += entered
        self._queues[slot].append(run)
        self._queued[slot] += len(listed)
        self._compact(slot)

    def pop_oldest(self, slot: int) -> T | None:
        """The least recently used stamped item of ``slot`` (still stamped), or None."""
        q = self._queues[slot]
        j = self._head[slot]
        while q:
            run = q[0]
            items = run.items
            n = len(items)
            if run.live:
                while j < n:
                    item = items[j]
                    j += 1
                    self._queued[slot] -= 1
                    if item.stamp[slot] is run:
                        if j == n:
                            q.popleft()
                            j = 0
                        self._head[slot] = j
                        return item
            else:  # every item left this run: skip it whole
                self._queued[slot] -= n - j
            q.popleft()
            j = 0
        self._head[slot] = 0
        return None

    def holds(self, slot: int) -> set[int]:
        """ids of the items that ``slot``'s queue holds live (for invariant checks)."""
        return {id(item) for item in self._live_items(slot)}

    def _live_items(self, slot: int) -> list[T]:
        out: list[T] = []
        head = self._head[slot]
        for k, run in enumerate(self._queues[slot]):
            if run.live:
                start = head if k == 0 else 0
                out.extend(item for item in run.items[start:] if item.stamp[slot] is run)
        return out

    def _compact(self, slot: int) -> None:
        if self._queued[slot] <= 4 * self._live[slot] + 64:
            return
        head = self._head[slot]
        kept: deque[_Run[T]] = deque()
        total = 0
        for k, run in enumerate(self._queues[slot]):
            if not run.live:
                continue
            start = head if k == 0 else 0
            items = run.items
            live = [item for item in items[start:] if item.stamp[slot] is run]
            if not live:
                continue
            if len(live) != len(items):
                run.items = live  # the same run: its items' stamps still name it
            kept.append(run)
            total += len(live)
        self._queues[slot] = kept
        self._head[slot] = 0
        self._queued[slot] = total


def _always(_item: object) -> bool:
    return True
