"""LRU order as monotonic ticks: O(1) amortized per touch, no hash lookup, no clock.

- Stamped: anything with a ``stamp`` list of ints, one per slot (0: not in that slot's order).
- TickLru: per slot, a queue of runs in touch order. A run is (first tick, items): touching
  stamps each item with the next tick, so the j-th item of a run is live while its stamp is
  ``first + j``. The oldest live entry is the least recently used item; stale entries (touched
  again later, or unstamped) are skipped, and a queue is compacted when stale entries outnumber
  the live ones three to one.

A touch of n items appends ONE run (a list) rather than n (tick, item) tuples: a long prompt's
match restamps every page it hits, and 131,072 tuples per match were most of its cost (and fed
the cyclic garbage collector). The order is exactly the one per-item entries gave.

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
        self._queues: list[deque[tuple[int, list[T]]]] = [deque() for _ in range(slots)]
        self._head = [0] * slots  # items of the first run already popped
        self._queued = [0] * slots  # entries in the queue, live or stale
        self._live = [0] * slots
        self._tick = 0

    def live(self, slot: int) -> int:
        """How many items are stamped in ``slot``."""
        return self._live[slot]

    def queued(self, slot: int) -> int:
        """How many entries ``slot``'s queue holds, live or stale (bounded by compaction)."""
        return self._queued[slot]

    def stamp(self, item: T, slot: int) -> None:
        """Make ``item`` the most recently used of ``slot`` (entering it if it was not in)."""
        self._tick += 1
        if not item.stamp[slot]:
            self._live[slot] += 1
        item.stamp[slot] = self._tick
        self._queues[slot].append((self._tick, [item]))
        self._queued[slot] += 1
        self._compact(slot)

    def unstamp(self, item: T, slot: int) -> None:
        """Take ``item`` out of ``slot``'s order (its queue entry goes stale)."""
        if item.stamp[slot]:
            item.stamp[slot] = 0
            self._live[slot] -= 1

    def touch(self, items: Iterable[T], slot: int, admit: Callable[[T], bool] | None) -> None:
        """Restamp, in order, every item of ``items`` stamped in ``slot``; with ``admit``, also
        stamp the unstamped items it accepts."""
        first = tick = self._tick + 1
        run: list[T] = []
        append = run.append
        entered = 0
        if admit is None:
            for item in items:
                stamps = item.stamp
                if stamps[slot]:
                    stamps[slot] = tick
                    tick += 1
                    append(item)
        else:
            for item in items:
                stamps = item.stamp
                if stamps[slot] or admit(item):
                    if not stamps[slot]:
                        entered += 1
                    stamps[slot] = tick
                    tick += 1
                    append(item)
        if not run:
            return
        self._tick = tick - 1
        self._live[slot] += entered
        self._queues[slot].append((first, run))
        self._queued[slot] += len(run)
        self._compact(slot)

    def pop_oldest(self, slot: int) -> T | None:
        """The least recently used stamped item of ``slot`` (still stamped), or None."""
        q = self._queues[slot]
        j = self._head[slot]
        while q:
            first, run = q[0]
            n = len(run)
            while j < n:
                item = run[j]
                j += 1
                if item.stamp[slot] == first + j - 1:
                    if j == n:
                        q.popleft()
                        j = 0
                    self._queued[slot] -= 1
                    self._head[slot] = j
                    return item
                self._queued[slot] -= 1
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
        for k, (first, run) in enumerate(self._queues[slot]):
            start = head if k == 0 else 0
            out.extend(
                item for j, item in enumerate(run[start:], start) if item.stamp[slot] == first + j
            )
        return out

    def _compact(self, slot: int) -> None:
        if self._queued[slot] <= 4 * self._live[slot] + 64:
            return
        q = self._queues[slot]
        head = self._head[slot]
        kept: deque[tuple[int, list[T]]] = deque()
        total = 0
        for k, (first, run) in enumerate(q):
            start = head if k == 0 else 0
            live = [j for j in range(start, len(run)) if run[j].stamp[slot] == first + j]
            if not live:
                continue
            if len(live) == len(run):
                kept.append((first, run))
            else:
                # Split into runs of consecutive ticks so every item keeps its own tick.
                begin = prev = live[0]
                for j in [*live[1:], -1]:
                    if j != prev + 1:
                        kept.append((first + begin, run[begin : prev + 1]))
                        begin = j
                    prev = j
            total += len(live)
        self._queues[slot] = kept
        self._head[slot] = 0
        self._queued[slot] = total
