"""The storage tiers of one host group as the cache face uses them, one StorageTier per owner.

- TierPort: what the face uses of hicache.engine.storage_tier.StorageTier (every page of a
  call carries an object of each of the tier's ``pools``).
- CacheStorage: one tier per slot-owning pool: the anchor's tier stores the anchor and its
  sidecars (indexer, draft) on every page; a state pool's tier stores checkpoints only on the
  pages that keep one; a window pool's tier its pages. ``read`` / ``write`` take the pages'
  host placements and call each tier with the pages that have its pool; a page is read (or
  written) only when every one of its pools was. ``exists`` is the anchor's leading run.
- storage_boundary(cache, keys, host_pages): (``cache``: BoundaryParts, what it reads of the
  face) the hybrid-consistent storage hint beyond a host
  hit: the anchor's leading run in the store, cut to a boundary whose state checkpoint and
  window pages the store also holds.

Breakers: each tier has its own (one per owner pool on the same store); ``statistics()`` and
``breaker`` report the anchor's tier, whose calls happen on every page.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from hicache.cache.values import CacheSettings
from hicache.domain.errors import ConfigError
from hicache.domain.hybrid import GroupRules, Restore
from hicache.domain.pools import PoolName
from hicache.domain.tiers import Placement
from hicache.engine.storage_settings import StorageTierStatistics


class TierPort(Protocol):
    """The face's view of one StorageTier."""

    @property
    def pools(self) -> tuple[PoolName, ...]: ...

    async def exists(self, page_keys: Sequence[bytes]) -> int: ...

    async def read(
        self,
        page_keys: Sequence[bytes],
        host_pages: Mapping[PoolName, Sequence[int]],
        *,
        deadline: float | None,
    ) -> list[bool]: ...

    async def write(
        self,
        page_keys: Sequence[bytes],
        host_pages: Mapping[PoolName, Sequence[int]],
        *,
        deadline: float | None,
    ) -> list[bool]: ...

    def deadline_for(self, tokens: int, now: float | None = None) -> float | None: ...

    def buffers_safe(self) -> bool: ...

    def statistics(self) -> StorageTierStatistics: ...


class CacheStorage:
    """Storage tiers per owner pool (see the module docstring)."""

    def __init__(self, tiers: Mapping[PoolName, TierPort], *, anchor: PoolName) -> None:
        if anchor not in tiers:
            raise ConfigError(f"storage tiers {[p.value for p in tiers]} lack the anchor's")
        self.tiers = dict(tiers)
        self.anchor = anchor
        # pool stored -> the owner whose host page holds it (sidecars: the anchor)
        self._owner_of = {p: owner for owner, t in self.tiers.items() for p in t.pools}

    @property
    def anchor_tier(self) -> TierPort:
        return self.tiers[self.anchor]

    async def exists(self, page_keys: Sequence[bytes]) -> int:
        return await self.anchor_tier.exists(page_keys)

    async def exists_in(self, owner: PoolName, page_keys: Sequence[bytes]) -> int:
        return await self.tiers[owner].exists(page_keys)

    def deadline_for(self, tokens: int) -> float | None:
        """The prefetch deadline of ``tokens`` tokens, on the tiers' own clock."""
        return self.anchor_tier.deadline_for(tokens)

    def buffers_safe(self) -> bool:
        return all(t.buffers_safe() for t in self.tiers.values())

    def statistics(self) -> StorageTierStatistics:
        return self.anchor_tier.statistics()

    @property
    def breaker(self) -> str:
        return self.statistics().breaker.state.value

    async def read(
        self, page_keys: Sequence[bytes], host: Sequence[Placement], *, deadline: float | None
    ) -> list[bool]:
        return await self._each("read", page_keys, host, deadline)

    async def write(self, page_keys: Sequence[bytes], host: Sequence[Placement]) -> list[bool]:
        return await self._each("write", page_keys, host, None)

    async def _each(
        self,
        op: str,
        page_keys: Sequence[bytes],
        host: Sequence[Placement],
        deadline: float | None,
    ) -> list[bool]:
        ok = [True] * len(page_keys)
        for owner, tier in self.tiers.items():
            idx = [i for i, where in enumerate(host) if owner in where]
            if not idx:
                continue
            keys = [page_keys[i] for i in idx]
            pages = {p: [host[i][owner] for i in idx] for p in tier.pools}
            if op == "read":
                got = await tier.read(keys, pages, deadline=deadline)
            else:
                got = await tier.write(keys, pages, deadline=deadline)
            for i, g in zip(idx, got, strict=True):
                ok[i] = ok[i] and g
        return ok


class BoundaryParts(Protocol):
    """What ``storage_boundary`` reads of the face."""

    @property
    def storage(self) -> CacheStorage | None: ...

    @property
    def rules(self) -> GroupRules: ...

    @property
    def settings(self) -> CacheSettings: ...


async def storage_boundary(cache: BoundaryParts, keys: Sequence[bytes], start: int) -> int:
    """The storage hint beyond ``start`` pages (see the module docstring)."""
    storage = cache.storage
    if storage is None or start >= len(keys):
        return start
    top = start + await storage.exists(keys[start:])
    rules = cache.rules
    states = [r.pool for r in rules.rules if r.restore is Restore.CHECKPOINT]
    windows = [r for r in rules.rules if r.restore is Restore.WINDOW and not r.follows_anchor]
    if top <= start or (not states and not windows):
        return top
    every = cache.settings.checkpoints.every_pages
    candidates = [top] + [b for b in range(top - top % every, start, -every) if b != top]
    for b in candidates:
        if b <= start:
            break
        good = True
        for pool in states:
            if pool not in storage.tiers or await storage.exists_in(pool, [keys[b - 1]]) < 1:
                good = False
                break
        for r in windows if good else ():
            lo = max(start, b - r.window_pages)
            if r.pool not in storage.tiers or await storage.exists_in(r.pool, keys[lo:b]) < b - lo:
                good = False
                break
        if good:
            return b
    return start
