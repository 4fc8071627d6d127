"""The cache face: match, load, insert, prefetch and evict over the transfer engine and the
storage tier, with hybrid-consistent hits (asynchronous, anyio; no torch). See docs/cache-face.md.

- HiCache: the face a serving framework calls (hicache.cache.face).
- CacheMatch / CacheLoad: what ``match`` and ``load`` return (hicache.cache.match).
- CacheSettings / CacheStatistics / InsertResult / EvictResult / PrefetchResult / PrefetchSkip:
  its settings, results and statistics snapshot (hicache.cache.values).
- CacheStorage: the storage tiers of one host group as the face uses them, one per slot-owning
  pool (hicache.cache.storage).
- SyncCache / SyncCacheLoad / open_sync_cache: the face from plain threads, on a SyncEngine's
  event-loop thread (hicache.cache.sync).

The helpers behind the face: hicache.cache.args (argument checks), .hit (match), .load, .insert,
.prefetch, .rules (hit boundaries), .parts (what the helpers read of the face), .work (frees,
backups, storage writes). The package sits above hicache.engine, which never imports it.
"""

from hicache.cache.face import HiCache
from hicache.cache.match import CacheLoad, CacheMatch
from hicache.cache.storage import CacheStorage
from hicache.cache.sync import SyncCache, SyncCacheLoad, open_sync_cache
from hicache.cache.values import (
    CacheSettings,
    CacheStatistics,
    EvictResult,
    InsertResult,
    PrefetchResult,
    PrefetchSkip,
)

__all__ = [
    "CacheLoad",
    "CacheMatch",
    "CacheSettings",
    "CacheStatistics",
    "CacheStorage",
    "EvictResult",
    "HiCache",
    "InsertResult",
    "PrefetchResult",
    "PrefetchSkip",
    "SyncCache",
    "SyncCacheLoad",
    "open_sync_cache",
]
