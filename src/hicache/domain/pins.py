"""Pins: pages that in-flight transfers touch, so that nobody frees or evicts them meanwhile.

- PinnedPageError: a page was about to be freed, evicted or overwritten while pinned.
- PinTable: reference counts per (pool, page); pin and unpin whole page sets all or nothing;
  thread-safe; ``check_unpinned`` is the question an allocator or an eviction policy asks first.

Pages are keyed by their slot-owning pool (the anchor or an independent pool): a sidecar shares
the anchor's indices, so pinning an anchor page pins the sidecar rows with the same index.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping, Sequence

from hicache.domain.errors import SlotError
from hicache.domain.pools import PoolName, page_ids, pool_keyed

PageSet = Mapping[PoolName, Sequence[int]]


class PinnedPageError(SlotError):
    """A page is pinned by an in-flight transfer and cannot be freed, evicted or overwritten."""


def _items(pages: PageSet) -> list[tuple[PoolName, list[int]]]:
    """Pool names ("kv" or PoolName.KV) and page ids checked; wrong types raise ConfigError."""
    out: list[tuple[PoolName, list[int]]] = []
    for pool, ids in pool_keyed(pages, "a pin's page set").items():
        checked = page_ids(ids, f"the pages of pool {pool.value!r}")
        for page in checked:
            if type(page) is not int or page < 0:
                raise SlotError(
                    f"page {page!r} of pool {pool.value!r} is not a non-negative integer"
                )
        out.append((pool, checked))
    return out


class PinTable:
    """Reference counts of pinned pages; a page may be pinned by several transfers at once."""

    def __init__(self, name: str = "pins") -> None:
        self._name = name
        self._counts: dict[PoolName, dict[int, int]] = {}
        self._lock = threading.Lock()

    @property
    def name(self) -> str:
        return self._name

    def pin(self, pages: PageSet) -> None:
        """Add one reference to every page (a page listed twice gets two)."""
        items = _items(pages)
        with self._lock:
            for pool, ids in items:
                counts = self._counts.setdefault(pool, {})
                for page in ids:
                    counts[page] = counts.get(page, 0) + 1

    def unpin(self, pages: PageSet) -> None:
        """Drop one reference from every page; all or nothing: an unpinned page raises SlotError."""
        items = _items(pages)
        with self._lock:
            need: dict[PoolName, dict[int, int]] = {}
            for pool, ids in items:
                per = need.setdefault(pool, {})
                for page in ids:
                    per[page] = per.get(page, 0) + 1
            for pool, per in need.items():
                counts = self._counts.get(pool, {})
                for page, n in per.items():
                    have = counts.get(page, 0)
                    if have < n:
                        raise SlotError(
                            f"{self._name}: page {page} of pool {pool.value!r} is pinned {have} "
                            f"time(s), cannot unpin it {n} time(s)"
                        )
            for pool, per in need.items():
                counts = self._counts[pool]
                for page, n in per.items():
                    left = counts[page] - n
                    if left:
                        counts[page] = left
                    else:
                        del counts[page]
                if not counts:
                    del self._counts[pool]

    def count(self, pool: PoolName | str, page: int) -> int:
        name = PoolName.parse(pool)
        with self._lock:
            return self._counts.get(name, {}).get(page, 0)

    def is_pinned(self, pool: PoolName | str, page: int) -> bool:
        return self.count(pool, page) > 0

    def pinned(self, pages: PageSet) -> list[tuple[PoolName, int]]:
        """The (pool, page) pairs among ``pages`` that are pinned, in the order given."""
        items = _items(pages)
        with self._lock:
            return [
                (pool, page)
                for pool, ids in items
                for page in ids
                if page in self._counts.get(pool, {})
            ]

    def check_unpinned(self, pages: PageSet, *, action: str = "free") -> None:
        """Raise PinnedPageError naming the first pinned pages, if any of ``pages`` is pinned."""
        if not self._counts:  # the common case: nothing in flight
            return
        hits = self.pinned(pages)
        if hits:
            shown = ", ".join(f"{pool.value}:{page}" for pool, page in hits[:8])
            more = f" and {len(hits) - 8} more" if len(hits) > 8 else ""
            raise PinnedPageError(
                f"{self._name}: cannot {action} pages {shown}{more}: an in-flight transfer "
                f"uses them; wait for it or cancel it first"
            )

    def pages_of(self, pool: PoolName | str) -> frozenset[int]:
        name = PoolName.parse(pool)
        with self._lock:
            return frozenset(self._counts.get(name, {}))

    def snapshot(self) -> dict[PoolName, dict[int, int]]:
        """Every pinned page with its count, per pool."""
        with self._lock:
            return {pool: dict(counts) for pool, counts in self._counts.items()}

    def __len__(self) -> int:
        """The number of distinct pinned pages (over all pools)."""
        with self._lock:
            return sum(len(counts) for counts in self._counts.values())

    def __bool__(self) -> bool:
        # A table is an object, not a container to test for emptiness by accident.
        return True

    def __repr__(self) -> str:
        with self._lock:
            pages = sum(len(c) for c in self._counts.values())
            refs = sum(sum(c.values()) for c in self._counts.values())
        return f"<PinTable {self._name}: {pages} pages pinned, {refs} references>"


def page_set(pages: Mapping[PoolName, Iterable[int]]) -> dict[PoolName, tuple[int, ...]]:
    """A normalised copy of a page set (tuples of ints), for keys and messages."""
    return {pool: tuple(int(p) for p in ids) for pool, ids in pages.items()}
