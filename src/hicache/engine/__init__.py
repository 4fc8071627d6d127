"""The transfer engine: asynchronous orchestration with anyio and structlog (no torch).

- TransferEngine: per-layer loads overlapped with compute, backups (all layers, or layer-wise
  during prefill), merged submissions per scheduling step, shared in-flight loads, cancellation
  that returns slots and pins, statistics (hicache.engine.engine).
- LoadHandle / BackupHandle / LayerwiseBackupHandle: what a load or backup returns
  (hicache.engine.handles).
- OperationState, OperationStatistics, EngineStatistics: frozen snapshots (hicache.engine.stats).
- SyncEngine / open_sync: the synchronous face, the engine on its own event-loop thread
  (hicache.engine.sync).

See docs/engine.md for a complete serving loop.
"""

from hicache.engine.engine import PageSet, TransferEngine
from hicache.engine.handles import BackupHandle, LayerwiseBackupHandle, LoadHandle
from hicache.engine.stats import EngineStatistics, OperationState, OperationStatistics
from hicache.engine.sync import SyncEngine, open_sync

__all__ = [
    "BackupHandle",
    "EngineStatistics",
    "LayerwiseBackupHandle",
    "LoadHandle",
    "OperationState",
    "OperationStatistics",
    "PageSet",
    "SyncEngine",
    "TransferEngine",
    "open_sync",
]
