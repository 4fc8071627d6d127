"""The transfer engine: asynchronous orchestration with anyio and structlog (no torch).

- TransferEngine: per-layer loads overlapped with compute, backups (all layers, or layer-wise
  during prefill), merged submissions per scheduling step, shared in-flight loads, cancellation
  that returns slots and pins, statistics (hicache.engine.engine).
- LoadHandle / BackupHandle / LayerwiseBackupHandle: what a load or backup returns
  (hicache.engine.handles).
- OperationState, OperationStatistics, EngineStatistics: frozen snapshots (hicache.engine.stats).
- StorageTier / StorageTierSettings / PrefetchPolicy / StorageTierStatistics: the storage (L3)
  tier seen from the engine: store <-> host pages off the loop, breaker, deadlines
  (hicache.engine.storage_tier, hicache.engine.storage_settings).
- BoundedStorage / BoundedTier / BoundedSettings / BoundedStatistics / Answer / Outcome: the
  storage tier from plain threads, each call bounded by deadline + grace, a stuck call refusing
  the next ones (hicache.engine.bounded; docs/storage.md).
- RankAgreement / SingleProcess: agreement of hit lengths over TP ranks (hicache.engine.ranks).
- SyncEngine / open_sync: the synchronous face, the engine on its own event-loop thread
  (hicache.engine.sync).

The cache face above the engine (HiCache, SyncCache, ...) is hicache.cache; the engine never
imports it. See docs/engine.md for a complete serving loop.
"""

from hicache.engine.bounded import (
    Answer,
    BoundedSettings,
    BoundedStatistics,
    BoundedStorage,
    BoundedTier,
    Outcome,
)
from hicache.engine.engine import PageSet, TransferEngine
from hicache.engine.handles import BackupHandle, LayerwiseBackupHandle, LoadHandle
from hicache.engine.ranks import RankAgreement, SingleProcess
from hicache.engine.stats import EngineStatistics, OperationState, OperationStatistics
from hicache.engine.storage_settings import (
    PrefetchPolicy,
    StorageTierSettings,
    StorageTierStatistics,
)
from hicache.engine.storage_tier import StorageTier
from hicache.engine.sync import SyncEngine, open_sync

__all__ = [
    "Answer",
    "BackupHandle",
    "BoundedSettings",
    "BoundedStatistics",
    "BoundedStorage",
    "BoundedTier",
    "EngineStatistics",
    "LayerwiseBackupHandle",
    "LoadHandle",
    "OperationState",
    "OperationStatistics",
    "Outcome",
    "PageSet",
    "PrefetchPolicy",
    "RankAgreement",
    "SingleProcess",
    "StorageTier",
    "StorageTierSettings",
    "StorageTierStatistics",
    "SyncEngine",
    "TransferEngine",
    "open_sync",
]
