"""The synchronous face of the cache: HiCache on the SyncEngine's event-loop thread.

- SyncCache(sync_engine, cache): blocking ``match``, ``load``, ``insert``, ``prefetch``,
  ``evict``, ``statistics``, ``release``, ``close``, callable from any plain thread (a
  synchronous scheduler). Every call runs on the engine's loop (``SyncEngine.call``), so the
  cache keeps one owner. A SyncCacheLoad's per-layer waits run on the calling thread, as the
  engine's (``wait_layer`` / ``wait_model_layer``); ``wait`` and ``cancel`` block.
- open_sync_cache(sync_engine, cache): the cache opened on a SyncEngine's loop thread.
  Closing the SyncEngine closes a SyncCache still open on it first (its writes finish).
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator, Mapping, Sequence
from typing import Any

import anyio
import anyio.abc
from anyio.from_thread import BlockingPortal

from hicache.cache.face import HiCache
from hicache.cache.match import CacheLoad, CacheMatch
from hicache.cache.values import CacheStatistics, EvictResult, InsertResult, PrefetchResult
from hicache.domain.errors import ConfigError, EngineClosedError
from hicache.domain.pools import PoolName
from hicache.domain.tiers import Tier
from hicache.engine.sync import SyncEngine


class SyncCacheLoad:
    """A CacheLoad seen from a plain thread."""

    def __init__(self, portal: BlockingPortal, load: CacheLoad) -> None:
        self._portal = portal
        self.load = load

    def wait_layer(self, layer: int) -> None:
        self.load.wait_layer(layer)

    def wait_model_layer(self, model_layer: int) -> None:
        self.load.wait_model_layer(model_layer)

    def wait(self) -> None:
        self._portal.call(self.load.wait)

    def cancel(self) -> None:
        self._portal.call(self.load.cancel)


class SyncCache:
    """A HiCache driven from plain threads through ``sync``'s loop (see the module docstring).

    The cache is opened on the loop by a long-lived task (its task group is entered and left
    by that task) and closed by ``close()``; the SyncEngine stays the caller's to close.
    """

    def __init__(self, sync: SyncEngine, cache: HiCache) -> None:
        if not isinstance(sync, SyncEngine):
            raise ConfigError(f"sync must be a SyncEngine (open_sync), got {type(sync).__name__}")
        if not isinstance(cache, HiCache):
            raise ConfigError(f"cache must be a HiCache, got {type(cache).__name__}")
        if cache.engine is not sync.engine:
            raise ConfigError(
                f"cache {cache!r} runs on {cache.engine!r}, not on this SyncEngine's "
                f"{sync.engine!r}: build the HiCache over sync.engine"
            )
        if sync.closed:
            raise EngineClosedError(f"{sync!r} is closed: open the cache on an open SyncEngine")
        self._sync = sync
        self.cache = cache
        self._stop: anyio.Event | None = None
        self._closed = False
        # The engine's own portal (same package): every cache call runs on the engine's loop.
        self._portal: BlockingPortal = sync._portal
        self._host, _ = self._portal.start_task(self._serve, name="hicache cache host")
        sync._on_close(self.close)  # closing the SyncEngine closes this cache first

    async def _serve(self, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        self._stop = anyio.Event()
        async with self.cache:
            task_status.started()
            await self._stop.wait()

    def match(self, token_ids: Sequence[int]) -> CacheMatch:
        return self._portal.call(self.cache.match, token_ids)

    def release(self, match: CacheMatch) -> None:
        """Give ``match``'s pins back; anything but a CacheMatch of this cache is a ConfigError."""
        self.cache._own_match(match, "release")
        self._sync.call(match.release)

    def load(
        self,
        match: CacheMatch,
        device_pages: Mapping[PoolName, Sequence[int]] | None = None,
        *,
        after: object | None = None,
    ) -> SyncCacheLoad:
        async def run() -> CacheLoad:
            return await self.cache.load(match, device_pages, after=after)

        return SyncCacheLoad(self._portal, self._portal.call(run))

    def insert(
        self,
        token_ids: Sequence[int],
        device_pages: Mapping[PoolName, Sequence[int | None]],
        *,
        checkpoints: Mapping[int, Mapping[PoolName, int]] | None = None,
    ) -> InsertResult:
        async def run() -> InsertResult:
            return await self.cache.insert(token_ids, device_pages, checkpoints=checkpoints)

        return self._portal.call(run)

    def prefetch(
        self, target: CacheMatch | Sequence[int], *, deadline: float | None = None
    ) -> PrefetchResult:
        async def run() -> PrefetchResult:
            return await self.cache.prefetch(target, deadline=deadline)

        return self._portal.call(run)

    def evict(self, tier: Tier, pages: int, pool: PoolName | str | None = None) -> EvictResult:
        return self._portal.call(self.cache.evict, tier, pages, pool)

    def checkpoint_boundaries(self, total_pages: int, hit: CacheMatch | int = 0) -> list[int]:
        return self._sync.call(self.cache.checkpoint_boundaries, total_pages, hit)

    def placements(self, match: CacheMatch) -> list[dict[PoolName, int]]:
        """``match.placements()``; anything but a CacheMatch of this cache is a ConfigError."""
        self.cache._own_match(match, "placements")
        return self._sync.call(match.placements)

    def statistics(self) -> CacheStatistics:
        return self._sync.call(self.cache.statistics)

    def call(self, func: Any, *args: Any) -> Any:
        """Any other cache call, on the loop."""
        return self._sync.call(func, *args)

    def close(self) -> None:
        """Close the cache (background writes finish); idempotent. The SyncEngine stays open."""
        if self._closed:
            return
        self._closed = True
        try:
            stop = self._stop
            if stop is not None:
                self._portal.call(stop.set)
            self._host.result()
        finally:
            self._sync._forget(self.close)

    def __enter__(self) -> SyncCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def open_sync_cache(sync: SyncEngine, cache: HiCache) -> Generator[SyncCache]:
    """``with open_sync_cache(sync, cache) as c:`` the cache on the engine's loop thread."""
    face = SyncCache(sync, cache)
    try:
        yield face
    finally:
        face.close()


__all__ = ["SyncCache", "SyncCacheLoad", "open_sync_cache"]
