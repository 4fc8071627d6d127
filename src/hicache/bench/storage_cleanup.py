"""What `hicache bench storage` put and has not removed yet, kept within the store's room.

- Leftovers: the store keys and raw client names a bench put; retry() removes what it can,
  make_room(nbytes) also waits (untimed) until what is left plus ``nbytes`` fits the budget,
  drain() waits for the rest at the end.
- segment_budget(store): the bytes a bench may keep in the local Mooncake cluster started for
  ``store`` (SEGMENT_HEADROOM of its segment), or None for any other store.
- check_room(store, round_bytes): StoreError when one round cannot fit that budget.

Why: Mooncake refuses to remove an object read within the master's lease
(``--default_kv_lease_ttl``, 10 s by default: OBJECT_HAS_LEASE, a TRANSIENT remove) and cannot
evict it either. A bench that moves its pages faster than that and drops what it could not
remove fills the segment in a few rounds: every later put answers FULL. Removal is retried
before each put, and the bench waits only when what it still holds would overflow the segment.
"""

from __future__ import annotations

import time
from typing import Any

from hicache.domain import StoreError
from hicache.domain.storage import Store, StoreKey, StoreStatus

REMOVE_WAIT_S = 15.0  # longer than Mooncake's default object lease (10 s)
REMOVE_PAUSE_S = 0.1
SEGMENT_HEADROOM = 0.8  # Mooncake's master evicts from 90% full; stay clear of it
# Mooncake's answers to the client's own remove: done, not there; held by a lease (retried).
_REMOVED = (0, -704)
_LEASED = -706


def _segment(store: Store) -> int | None:
    segment = getattr(getattr(store, "cluster", None), "segment_bytes", None)
    if not isinstance(segment, int) or isinstance(segment, bool):
        return None
    return segment


def segment_budget(store: Store) -> int | None:
    """SEGMENT_HEADROOM of the segment of the local cluster started for ``store``, or None."""
    segment = _segment(store)
    return None if segment is None else int(segment * SEGMENT_HEADROOM)


def check_room(store: Store, round_bytes: int) -> None:
    """StoreError when one round's objects cannot fit the local cluster's segment."""
    segment = _segment(store)
    budget = segment_budget(store)
    if budget is not None and round_bytes > budget:
        raise StoreError(
            f"bench storage: one round keeps {round_bytes} B in the store (its pages, and as "
            f"much again for the client's own calls) but the local Mooncake segment of "
            f"{segment} B takes {budget} B ({SEGMENT_HEADROOM:.0%}, below the master's "
            "eviction): lower --pages, --page-size or --layers, or name a cluster in "
            "--store-config"
        )


class Leftovers:
    """Objects a bench put and has not removed yet; see the module docstring."""

    def __init__(self, store: Store, client: Any, page_bytes: int, budget: int | None) -> None:
        self._store = store
        self._client = client
        self._page_bytes = page_bytes
        self._budget = budget
        self.keys: list[StoreKey] = []
        self.names: list[str] = []

    @property
    def held(self) -> int:
        """Bytes of the objects not removed yet."""
        return (len(self.keys) + len(self.names)) * self._page_bytes

    def retry(self) -> None:
        """One remove of everything left; what a lease still holds stays."""
        if self.keys:
            statuses = self._store.remove(self.keys)
            bad = [s for s in statuses if s not in (StoreStatus.OK, StoreStatus.TRANSIENT)]
            if bad:
                raise StoreError(
                    f"bench remove: {len(bad)} of {len(self.keys)} pages answered {bad[0].value}"
                )
            self.keys = [
                k for k, s in zip(self.keys, statuses, strict=True) if s is StoreStatus.TRANSIENT
            ]
        if self.names and self._client is not None:
            codes = list(self._client.batch_remove(self.names))
            odd = sorted({c for c in codes if c not in _REMOVED and c != _LEASED})
            if odd:
                raise StoreError(f"bench: the Mooncake client's own remove answered {odd}")
            self.names = [n for n, c in zip(self.names, codes, strict=True) if c == _LEASED]

    def make_room(self, nbytes: int) -> None:
        """Remove what can be; wait (at most REMOVE_WAIT_S) until ``nbytes`` more fit."""
        deadline = time.monotonic() + REMOVE_WAIT_S
        self.retry()
        while self._budget is not None and self.held + nbytes > self._budget:
            if time.monotonic() >= deadline:
                raise StoreError(
                    f"bench: {self.held} B of objects read in the last {REMOVE_WAIT_S:g} s "
                    f"could not be removed (a lease holds them) and {nbytes} B more do not "
                    f"fit the {self._budget} B the segment takes: lower --pages"
                )
            time.sleep(REMOVE_PAUSE_S)
            self.retry()

    def drain(self) -> None:
        """Remove everything, waiting out leases for at most REMOVE_WAIT_S; what is still held
        then is left to the store's eviction."""
        deadline = time.monotonic() + REMOVE_WAIT_S
        self.retry()
        while (self.keys or self.names) and time.monotonic() < deadline:
            time.sleep(REMOVE_PAUSE_S)
            self.retry()
