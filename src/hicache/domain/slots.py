"""Slot bookkeeping: page-granular free lists and atomic allocation across a group's pools.

- PageAllocator: one pool's free pages, lowest id first; allocate and free cost O(k log n) for k
  pages touched (a heap of freed ids below a never-used watermark, plus a free flag per page);
  thread-safe; double free and foreign ids raise.
- GroupAllocation: the pages one allocation took from each slot-owning pool (sidecars follow the
  anchor and have no list of their own).
- GroupAllocator: allocates from the anchor and the independent pools of a group all or nothing,
  in a fixed order (anchor first, then the group's order), rolling back on failure.
"""

from __future__ import annotations

import heapq
import threading
from collections.abc import Iterable, Mapping, Sequence

import attrs

from hicache.domain.errors import ConfigError, DoubleFreeError, ForeignIndexError, OutOfSlotsError
from hicache.domain.pools import HostGroupPlan, PoolName, PoolRole, page_ids, pool_keyed


class PageAllocator:
    """The free pages ``0..pages-1``, handed out lowest id first; safe to share between threads.

    Pages at or above ``_watermark`` have never been handed out and are free without being
    listed; freed pages below it sit in a min-heap. So the lowest free page is the heap's top
    if the heap is not empty, else the watermark, and one allocate or free of k pages costs
    O(k log n) whatever the pool size (no list of every page, no re-sort).
    """

    def __init__(self, pages: int, *, name: str = "pool") -> None:
        if not isinstance(pages, int) or isinstance(pages, bool) or pages < 0:
            raise ConfigError(f"pages must be a non-negative integer, got {pages!r}")
        self._name = name
        self._pages = pages
        self._watermark = 0  # pages >= this were never handed out: all free
        self._freed: list[int] = []  # min-heap of free pages below the watermark
        self._is_free = bytearray(b"\x01") * pages
        self._lock = threading.Lock()

    @property
    def name(self) -> str:
        return self._name

    @property
    def pages(self) -> int:
        return self._pages

    def free_count(self) -> int:
        with self._lock:
            return self._free_locked()

    def _free_locked(self) -> int:
        return len(self._freed) + self._pages - self._watermark

    def used_count(self) -> int:
        return self._pages - self.free_count()

    def is_free(self, page: int) -> bool:
        self._check(page)
        return bool(self._is_free[page])

    def _check(self, page: object) -> int:
        if not isinstance(page, int) or isinstance(page, bool) or not 0 <= page < self._pages:
            raise ForeignIndexError(
                f"page {page!r} does not belong to pool {self._name!r} (ids 0..{self._pages - 1})"
            )
        return page

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` pages (lowest free ids first) or raise OutOfSlotsError taking none."""
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ConfigError(f"page count must be a non-negative integer, got {n!r}")
        with self._lock:
            available = self._free_locked()
            if n > available:
                raise OutOfSlotsError(
                    f"pool {self._name!r} has {available} free pages, {n} were asked"
                )
            from_heap = min(n, len(self._freed))
            taken = [heapq.heappop(self._freed) for _ in range(from_heap)]
            fresh = n - from_heap
            taken.extend(range(self._watermark, self._watermark + fresh))
            self._watermark += fresh
            for p in taken:
                self._is_free[p] = 0
            return taken

    def check_free(self, pages: Iterable[int]) -> None:
        """Raise what free(pages) would raise, changing nothing."""
        ids = page_ids(pages, f"pages of pool {self._name!r}")
        with self._lock:
            self._check_free_locked(ids)

    def _check_free_locked(self, ids: list[int]) -> None:
        seen: set[int] = set()
        for p in ids:
            self._check(p)
            if self._is_free[p] or p in seen:
                raise DoubleFreeError(f"page {p} of pool {self._name!r} is already free")
            seen.add(p)

    def free(self, pages: Iterable[int]) -> None:
        """Return pages; all-or-nothing: a foreign or already free id raises and frees none."""
        ids = page_ids(pages, f"pages of pool {self._name!r}")
        with self._lock:
            self._check_free_locked(ids)
            for p in ids:
                self._is_free[p] = 1
                heapq.heappush(self._freed, p)

    def __repr__(self) -> str:
        return f"<PageAllocator {self._name}: {self.used_count()}/{self._pages} pages used>"


@attrs.frozen
class GroupAllocation:
    """Pages taken from each slot-owning pool; sidecars read the anchor's entry."""

    pages: Mapping[PoolName, tuple[int, ...]]

    def __getitem__(self, name: PoolName | str) -> tuple[int, ...]:
        pool = PoolName.parse(name)
        if pool not in self.pages:
            raise ForeignIndexError(f"this allocation took no pages from pool {pool.value!r}")
        return self.pages[pool]


class GroupAllocator:
    """All-or-nothing allocation over the anchor and the independent pools of a group."""

    def __init__(self, plan: HostGroupPlan, pages: Mapping[PoolName, int] | None = None) -> None:
        self._plan = plan
        self._order: tuple[PoolName, ...] = tuple(p.name for p in plan.independent_pools())
        self._sidecars = tuple(p.name for p in plan.pools if p.role is PoolRole.SIDECAR)
        counts = {p.name: p.pages for p in plan.pools}
        if pages is not None:
            counts.update(pages)
        self._allocators = {n: PageAllocator(counts[n], name=n.value) for n in self._order}
        self._lock = threading.Lock()

    @property
    def order(self) -> tuple[PoolName, ...]:
        return self._order

    def allocator(self, name: PoolName | str) -> PageAllocator:
        name = PoolName.parse(name)
        owner = self._plan.anchor.name if name in self._sidecars else name
        try:
            return self._allocators[owner]
        except KeyError:
            raise ForeignIndexError(f"pool {name.value!r} is not part of this group") from None

    def allocate(self, counts: Mapping[PoolName, int]) -> GroupAllocation:
        """Take pages from every named pool, in the group's order, or none at all."""
        counts = pool_keyed(counts, "page counts")
        unknown = [n.value for n in counts if n not in self._allocators]
        if unknown:
            raise ConfigError(
                f"cannot allocate from {unknown}: slot-owning pools are "
                f"{[n.value for n in self._order]} (sidecars use the anchor's pages)"
            )
        taken: dict[PoolName, tuple[int, ...]] = {}
        with self._lock:
            try:
                for name in self._order:
                    if name in counts:
                        taken[name] = tuple(self._allocators[name].allocate(counts[name]))
            except BaseException:
                for name, ids in taken.items():
                    self._allocators[name].free(ids)
                raise
        return GroupAllocation(taken)

    def free(self, allocation: GroupAllocation | Mapping[PoolName, Sequence[int]]) -> None:
        """Free the pages of an allocation; a sidecar's pages are never freed on their own."""
        pages = pool_keyed(
            allocation.pages if isinstance(allocation, GroupAllocation) else allocation,
            "an allocation to free",
        )
        sidecar = [n.value for n in pages if n in self._sidecars]
        if sidecar:
            raise ForeignIndexError(
                f"sidecar pools {sidecar} borrow the anchor's pages and are never freed on their own"
            )
        unknown = [n.value for n in pages if n not in self._allocators]
        if unknown:
            raise ForeignIndexError(f"pools {unknown} are not slot-owning pools of this group")
        with self._lock:
            for name in self._order:
                if name in pages:
                    self._allocators[name].check_free(pages[name])
            for name in self._order:
                if name in pages:
                    self._allocators[name].free(pages[name])

    def free_counts(self) -> dict[PoolName, int]:
        return {n: a.free_count() for n, a in self._allocators.items()}

    def __repr__(self) -> str:
        inner = ", ".join(repr(a) for a in self._allocators.values())
        return f"<GroupAllocator {inner}>"
