"""A bounded map kept in least-recently-used order on the domain's one LRU (hicache.domain.lru).

- LruMap(limit): ``put(key, value)`` enters or replaces an entry as the most recently used and
  returns the entries it evicted to stay within ``limit`` (oldest first); ``touch(key)`` makes a
  held entry the most recently used; ``get`` reads without touching; ``pop`` takes an entry out.
  ConfigError for a limit below one.

For bookkeeping that must stay bounded but has no slots of its own (e.g. which pages an event
stream has announced); the host tiers and the prefix index use TickLru directly.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any, Generic, TypeVar

from hicache.domain.errors import CacheStateError, ConfigError
from hicache.domain.lru import TickLru

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class _Entry(Generic[K, V]):
    __slots__ = ("key", "stamp", "value")

    def __init__(self, key: K, value: V) -> None:
        self.key = key
        self.value = value
        self.stamp: list[Any] = [0]  # TickLru's: one slot


class LruMap(Generic[K, V]):
    """At most ``limit`` entries; the least recently put or touched goes first."""

    def __init__(self, limit: int) -> None:
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ConfigError(f"LruMap limit {limit!r}: expected a whole number of at least 1")
        self.limit = limit
        self._entries: dict[K, _Entry[K, V]] = {}
        self._lru: TickLru[_Entry[K, V]] = TickLru(1)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def get(self, key: K) -> V | None:
        entry = self._entries.get(key)
        return entry.value if entry is not None else None

    def values(self) -> list[V]:
        return [entry.value for entry in self._entries.values()]

    def touch(self, key: K) -> bool:
        """Make ``key`` the most recently used; False when it is not held."""
        entry = self._entries.get(key)
        if entry is None:
            return False
        self._lru.stamp(entry, 0)
        return True

    def put(self, key: K, value: V) -> list[tuple[K, V]]:
        """Hold ``value`` under ``key`` as the most recently used; the (key, value) entries
        evicted to stay within the limit, least recently used first."""
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = _Entry(key, value)
        else:
            entry.value = value
        self._lru.stamp(entry, 0)
        evicted: list[tuple[K, V]] = []
        while len(self._entries) > self.limit:
            old = self._lru.pop_oldest(0)
            if old is None:  # every entry is stamped: only a bug in this class gets here
                raise CacheStateError(f"LruMap: {len(self._entries)} entries, none in LRU order")
            self._lru.unstamp(old, 0)
            del self._entries[old.key]
            evicted.append((old.key, old.value))
        return evicted

    def pop(self, key: K) -> V | None:
        """Take ``key`` out; its value, or None when it was not held."""
        entry = self._entries.pop(key, None)
        if entry is None:
            return None
        self._lru.unstamp(entry, 0)
        return entry.value


__all__ = ["LruMap"]
