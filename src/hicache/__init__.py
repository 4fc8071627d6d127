"""hicache: hierarchical KV-cache memory (host L2, storage L3) for LLM serving engines.

Everything a serving loop needs comes from here (``from hicache import open_cache, ...``):

- plan: ``load_model_spec``, ``bundled_models``, ``ModelSpec``, ``PlanSettings``, ``plan_stack``,
  ``HostGroupPlan``, ``StorageSettings``;
- pools, tiers, policies: ``PoolName``, ``Tier``, ``WriteSettings``, ``CheckpointPolicy``,
  ``RankIdentity``;
- the cache face: ``open_cache``, ``CacheRuntime``, ``HiCache``, ``CacheSettings``,
  ``CacheMatch``, ``CacheLoad``, ``InsertResult``, ``EvictResult``, ``PrefetchResult``,
  ``PrefetchSkip``, ``CacheStatistics``, ``SyncCache``, ``open_sync_cache``;
- the engine: ``open_runtime``, ``Runtime``, ``TransferEngine``, ``LoadHandle``,
  ``BackupHandle``, ``OperationState``, ``SyncEngine``, ``open_sync``, ``CpuFence``;
- storage: ``DirectoryStore``, ``DirectorySettings``, ``open_store``, ``open_named_store``,
  ``register_store_factory``, ``StorageTierSettings``, ``PrefetchPolicy``;
- TP ranks: ``RankAgreement``, ``SingleProcess``, ``TorchRankAgreement`` (torch.distributed);
- configuration and metrics: ``HiCacheConfig``, ``HiCacheMetrics``, ``PerTier``;
- errors: ``HiCacheError`` and every error under it.

The deep paths (``hicache.domain``, ``hicache.engine``, ``hicache.cache``,
``hicache.bootstrap``, ``hicache.adapters.storage``, ...) stay valid and name the same objects.
Importing hicache loads only the domain (stdlib + attrs): the engine and the cache face (anyio,
structlog), the bootstrap and the adapters (torch) load on the first use of one of their names
here.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from hicache.domain import (
    AllocatorMismatchError,
    BindingError,
    CacheStateError,
    CheckpointPolicy,
    ConfigError,
    DeviceError,
    DoubleFreeError,
    EngineClosedError,
    ForeignIndexError,
    GroupError,
    HiCacheError,
    HostGroupPlan,
    HostMemoryError,
    LayoutError,
    ModelSpec,
    OutOfSlotsError,
    PinnedMemoryError,
    PlanSettings,
    PoolName,
    RankIdentity,
    SizingError,
    SlotError,
    StorageSettings,
    StoreError,
    Tier,
    TransferError,
    UnsupportedModelError,
    WriteSettings,
    plan_stack,
)
from hicache.domain.pins import PinnedPageError
from hicache.domain.tiers import PerTier

if TYPE_CHECKING:
    from hicache.adapters.storage import DirectorySettings, DirectoryStore
    from hicache.adapters.streams import CpuFence
    from hicache.adapters.tp_agreement import TorchRankAgreement
    from hicache.bootstrap.cache import CacheRuntime, open_cache
    from hicache.bootstrap.config import bundled_models, load_model_spec
    from hicache.bootstrap.hicache_config import HiCacheConfig
    from hicache.bootstrap.runtime import Runtime, open_runtime
    from hicache.bootstrap.storage import open_named_store, open_store, register_store_factory
    from hicache.cache import (
        CacheLoad,
        CacheMatch,
        CacheSettings,
        CacheStatistics,
        EvictResult,
        HiCache,
        InsertResult,
        PrefetchResult,
        PrefetchSkip,
        SyncCache,
        SyncCacheLoad,
        open_sync_cache,
    )
    from hicache.engine import (
        BackupHandle,
        LayerwiseBackupHandle,
        LoadHandle,
        OperationState,
        PrefetchPolicy,
        RankAgreement,
        SingleProcess,
        StorageTierSettings,
        SyncEngine,
        TransferEngine,
        open_sync,
    )
    from hicache.metrics import HiCacheMetrics

__version__ = "0.1.0"

# The names loaded on first use, by the module that defines them (or the package that exports
# them). tests/test_public_api.py checks that each one is the object its deep path names.
_LAZY: dict[str, str] = {
    **dict.fromkeys(("DirectorySettings", "DirectoryStore"), "hicache.adapters.storage"),
    "CpuFence": "hicache.adapters.streams",
    "TorchRankAgreement": "hicache.adapters.tp_agreement",
    "HiCacheConfig": "hicache.bootstrap.hicache_config",
    "HiCacheMetrics": "hicache.metrics",
    **dict.fromkeys(("CacheRuntime", "open_cache"), "hicache.bootstrap.cache"),
    **dict.fromkeys(("bundled_models", "load_model_spec"), "hicache.bootstrap.config"),
    **dict.fromkeys(("Runtime", "open_runtime"), "hicache.bootstrap.runtime"),
    **dict.fromkeys(
        ("open_named_store", "open_store", "register_store_factory"), "hicache.bootstrap.storage"
    ),
    **dict.fromkeys(
        (
            "CacheLoad",
            "CacheMatch",
            "CacheSettings",
            "CacheStatistics",
            "EvictResult",
            "HiCache",
            "InsertResult",
            "PrefetchResult",
            "PrefetchSkip",
            "SyncCache",
            "SyncCacheLoad",
            "open_sync_cache",
        ),
        "hicache.cache",
    ),
    **dict.fromkeys(
        (
            "BackupHandle",
            "LayerwiseBackupHandle",
            "LoadHandle",
            "OperationState",
            "PrefetchPolicy",
            "RankAgreement",
            "SingleProcess",
            "StorageTierSettings",
            "SyncEngine",
            "TransferEngine",
            "open_sync",
        ),
        "hicache.engine",
    ),
}

if not TYPE_CHECKING:  # mypy sees the imports above, so a misspelt name stays an error

    def __getattr__(name: str) -> Any:
        module = _LAZY.get(name)
        if module is None:
            raise AttributeError(f"module 'hicache' has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        globals()[name] = value  # later lookups skip __getattr__
        return value

    def __dir__() -> list[str]:
        return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "AllocatorMismatchError",
    "BackupHandle",
    "BindingError",
    "CacheLoad",
    "CacheMatch",
    "CacheRuntime",
    "CacheSettings",
    "CacheStateError",
    "CacheStatistics",
    "CheckpointPolicy",
    "ConfigError",
    "CpuFence",
    "DeviceError",
    "DirectorySettings",
    "DirectoryStore",
    "DoubleFreeError",
    "EngineClosedError",
    "EvictResult",
    "ForeignIndexError",
    "GroupError",
    "HiCache",
    "HiCacheConfig",
    "HiCacheError",
    "HiCacheMetrics",
    "HostGroupPlan",
    "HostMemoryError",
    "InsertResult",
    "LayerwiseBackupHandle",
    "LayoutError",
    "LoadHandle",
    "ModelSpec",
    "OperationState",
    "OutOfSlotsError",
    "PerTier",
    "PinnedMemoryError",
    "PinnedPageError",
    "PlanSettings",
    "PoolName",
    "PrefetchPolicy",
    "PrefetchResult",
    "PrefetchSkip",
    "RankAgreement",
    "RankIdentity",
    "Runtime",
    "SingleProcess",
    "SizingError",
    "SlotError",
    "StorageSettings",
    "StorageTierSettings",
    "StoreError",
    "SyncCache",
    "SyncCacheLoad",
    "SyncEngine",
    "Tier",
    "TorchRankAgreement",
    "TransferEngine",
    "TransferError",
    "UnsupportedModelError",
    "WriteSettings",
    "__version__",
    "bundled_models",
    "load_model_spec",
    "open_cache",
    "open_named_store",
    "open_runtime",
    "open_store",
    "open_sync",
    "open_sync_cache",
    "plan_stack",
    "register_store_factory",
]
