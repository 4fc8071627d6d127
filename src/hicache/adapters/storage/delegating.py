"""A Store that forwards every call of the port to another store.

- DelegatingStore(inner): the Store port over ``inner``, unchanged; a wrapper subclasses it and
  overrides only the calls it changes (fault injection, owning what was started for a store).
"""

from __future__ import annotations

from collections.abc import Sequence

from hicache.domain.storage import PageBuffer, Store, StoreHealth, StoreKey, StoreStatus


class DelegatingStore:
    """Forwards name, register (unregister where ``inner`` has one), exists, get, put, remove,
    health and close to ``inner``."""

    def __init__(self, inner: Store) -> None:
        self.inner = inner

    @property
    def name(self) -> str:
        return self.inner.name

    def register(self, regions: Sequence[memoryview]) -> None:
        self.inner.register(regions)

    def unregister(self, address: int) -> None:
        """Forward to ``inner.unregister`` where the inner store has one (Mooncake)."""
        undo = getattr(self.inner, "unregister", None)
        if undo is not None:
            undo(address)

    def exists(self, keys: Sequence[StoreKey], *, deadline: float | None = None) -> list[bool]:
        return self.inner.exists(keys, deadline=deadline)

    def get(
        self,
        keys: Sequence[StoreKey],
        buffers: Sequence[PageBuffer],
        *,
        deadline: float | None = None,
    ) -> list[StoreStatus]:
        return self.inner.get(keys, buffers, deadline=deadline)

    def put(
        self,
        keys: Sequence[StoreKey],
        buffers: Sequence[PageBuffer],
        *,
        deadline: float | None = None,
    ) -> list[StoreStatus]:
        return self.inner.put(keys, buffers, deadline=deadline)

    def remove(self, keys: Sequence[StoreKey]) -> list[StoreStatus]:
        return self.inner.remove(keys)

    def health(self) -> StoreHealth:
        return self.inner.health()

    def close(self) -> None:
        self.inner.close()
