"""hicache's stores as an SGLang HiCache storage backend (``--hicache-storage-backend dynamic``).

- HiCacheBackend: a ``sglang.srt.mem_cache.hicache_storage.HiCacheStorage`` that SGLang's own
  factory loads with extra config ``{"backend_name": "hicache", "module_path":
  "hicache.integrations.sglang", "class_name": "HiCacheBackend", "interface_v1": 1, "store":
  "directory", "store_path": PATH, ...}`` (see docs/sglang.md). It serves the legacy calls
  (``batch_get`` / ``batch_set`` / ``batch_exists`` of flat pages), the v1 zero-copy calls
  (``batch_get_v1`` / ``batch_set_v1`` of host indices) and the v2 calls of hybrid side pools
  (``batch_exists_v2`` / ``batch_get_v2`` / ``batch_set_v2`` with ``PoolTransfer``), with the
  return values SGLang's controller relies on (python/sglang/srt/managers/cache_controller.py).

Every store call goes through hicache's StorageTier (one per registered SGLang pool, one shared
store): a deadline per call, the circuit breaker, statuses and statistics, driven through
hicache.engine.bounded.BoundedStorage: SGLang's controller threads wait for a call at most
``deadline_s + grace_s`` and then get a miss (get, exists) or a failed backup (set); while that
call is still running every call is refused at once, so a dead or stalled store never stalls
them, and ``close`` returns within the same bound. Pages are stored in SGLang's flat page
order whatever path moves them (hicache.integrations.sglang.pages). Importing this module imports
SGLang; nothing else in hicache does (an import-linter contract keeps it so).

This module is SGLang's interface: the calls' arguments checked, then handed on to
- tiers (BackendTiers): the store, its bounded per-pool tiers and metrics exports; ``close``;
- moves (PageMoves): the one read path and one write path (zero-copy or staged/flat pages);
- v2: the hybrid side pools' calls (hit policies, per-pool transfers);
- stats: SGLang's ``get_stats`` window and hicache's ``statistics()``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolTransfer,
    PoolTransferResult,
)

from hicache.domain.errors import ConfigError, shown
from hicache.domain.storage import Store
from hicache.integrations.sglang.arguments import flat_pages, host_tokens, one_key, page_keys
from hicache.integrations.sglang.moves import PageMoves
from hicache.integrations.sglang.settings import BackendSettings
from hicache.integrations.sglang.stats import CallWindow, backend_statistics
from hicache.integrations.sglang.tiers import SGLANG_BATCH_PAGES, BackendPool, BackendTiers
from hicache.integrations.sglang.v2 import exists_v2, move_v2

__all__ = ["SGLANG_BATCH_PAGES", "HiCacheBackend"]


class HiCacheBackend(HiCacheStorage):  # type: ignore[misc]
    """hicache's storage tier behind SGLang's HiCacheStorage interface (module docstring)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None):
        if not isinstance(storage_config, HiCacheStorageConfig):
            raise ConfigError(
                f"HiCacheBackend: storage_config must be SGLang's HiCacheStorageConfig, got "
                f"{type(storage_config).__name__}"
            )
        self.settings = BackendSettings.parse(storage_config.extra_config)
        extra = dict(storage_config.extra_config or {})
        self.storage_config = storage_config
        self.interface_v1 = bool(extra.get("interface_v1", 0))
        # Mooncake moves bytes only from and to host memory registered with it: the pools'
        # (zero-copy) memory, never SGLang's per-call flat pages or a staging page.
        self.zero_copy_only = self.settings.store == "mooncake"
        if self.zero_copy_only and not self.interface_v1:
            raise ConfigError(
                "hicache sglang backend key 'interface_v1': store 'mooncake' needs "
                "interface_v1: 1 (the legacy calls hand over flat page copies, which Mooncake "
                "cannot read or write)"
            )
        if kwargs is not None and not isinstance(kwargs, Mapping):
            raise ConfigError(
                f"HiCacheBackend: kwargs must be a mapping, got {type(kwargs).__name__} "
                f"{shown(kwargs)}"
            )
        given = (kwargs or {}).get("store")
        if given is not None and not isinstance(given, Store):
            raise ConfigError(
                f"HiCacheBackend: kwargs['store'] must be a hicache Store, got {shown(given)}"
            )
        self._tiers = BackendTiers(
            self.settings, storage_config, given, zero_copy_only=self.zero_copy_only
        )
        self.store: Store = self._tiers.store
        self._exports = self._tiers.exports
        # hicache's metrics of this backend (docs/sglang.md, "Metrics"): a HiCacheMetrics a
        # framework may register itself; ``counters`` is its IntegrationCounters.
        self.metrics = self._exports.metrics
        self.counters = self._exports.counters
        self._window = CallWindow()
        self._moves = PageMoves(self.counters, self._window, storage_config)

    # -- registration -------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        self._tiers.add("kv", mem_pool_host)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        name = getattr(host_pool_name, "value", host_pool_name)
        if not isinstance(name, str) or not name:  # checked before SGLang keys a dict by it
            raise ConfigError(
                f"HiCacheBackend: host_pool_name {shown(host_pool_name)}: expected a pool name "
                "(SGLang's PoolName or a non-empty str)"
            )
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        existing = self._tiers.pools.get(name)
        if existing is not None and existing.pages.pool is host_pool:
            return
        self._tiers.add(name, host_pool)

    def pool(self, name: str) -> BackendPool:
        """The registered pool ``name`` (its pages, tier, namespace); ConfigError if none."""
        return self._tiers.pool(name)

    @property
    def _stuck(self) -> int:
        """Store calls that overran ``deadline_s + grace_s`` and are still running."""
        return self._tiers.stuck

    # -- v1: zero-copy by host indices --------------------------------------------------------

    def _v1(self, op: str, keys: object, host_indices: object) -> list[bool]:
        call = f"batch_{op}_v1"
        checked = page_keys(keys, call)
        pool = self.pool("kv")
        tokens = host_tokens(host_indices, len(checked), pool.pages.page_size, pool.name, call)
        return self._moves.host(op)(pool, checked, tokens)

    def batch_get_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """One bool per key; the Trues are a leading run (a prefetch stops at the first miss)."""
        return self._v1("get", keys, host_indices)

    def batch_set_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """One bool per key (a FULL page fails alone; SGLang stops a backup at the first False)."""
        return self._v1("set", keys, host_indices)

    # -- legacy: flat pages -------------------------------------------------------------------

    def batch_get(
        self,
        keys: list[str],
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> list[torch.Tensor | None]:
        """Each target (a flat page, e.g. ``get_dummy_flat_data_page()``) filled, or None."""
        keys = page_keys(keys, "batch_get")
        pool = self.pool("kv")
        buffers = flat_pages(
            target_locations, len(keys), pool.pages.flat_nbytes, pool.name, "target_locations"
        )
        ok = self._moves.get(pool, keys, buffers)
        return [t if good else None for t, good in zip(target_locations, ok, strict=True)]

    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        """True when every flat page was stored."""
        keys = page_keys(keys, "batch_set")
        pool = self.pool("kv")
        if isinstance(values, list | tuple):
            values = [v.contiguous() if isinstance(v, torch.Tensor) else v for v in values]
        return all(
            self._moves.set(
                pool,
                keys,
                flat_pages(values, len(keys), pool.pages.flat_nbytes, pool.name, "values"),
            )
        )

    def get(
        self, key: str, target_location: Any = None, target_sizes: Any = None
    ) -> torch.Tensor | None:
        one_key(key, "get")
        if target_location is None:
            target_location = self.pool("kv").pages.staging()
        return self.batch_get([key], [target_location])[0]

    def set(
        self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None
    ) -> bool:
        one_key(key, "set")
        return self.batch_set([key], [value])

    def exists(self, key: str) -> bool:
        one_key(key, "exists")
        return self.batch_exists([key]) == 1

    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        """The number of leading keys the store probably holds (0 when it cannot answer)."""
        keys = page_keys(keys, "batch_exists")
        if not keys:
            return 0
        return self._moves.exists(self.pool("kv"), keys)

    # -- v2: hybrid side pools (hicache.integrations.sglang.v2) -------------------------------

    def batch_exists_v2(
        self,
        keys: list[str],
        pool_transfers: list[PoolTransfer] | None = None,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> PoolTransferResult:
        """The usable prefix under each side pool's hit policy (SGLang's file backend's rules):
        ``kv_hit_pages``, the pages each pool has, and the prefix lengths every pool can restore."""
        return exists_v2(self._tiers, self._moves, keys, pool_transfers)

    def batch_get_v2(
        self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> dict[str, list[bool]]:
        """Per pool name, one bool per key (a leading run per pool)."""
        return move_v2(self._tiers, self._moves, transfers, "get")

    def batch_set_v2(
        self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> dict[str, list[bool]]:
        """Per pool name, one bool per key."""
        return move_v2(self._tiers, self._moves, transfers, "set")

    # -- statistics and lifecycle -------------------------------------------------------------

    def statistics(self) -> dict[str, Any]:
        """hicache's statistics: per pool, the tier's (pages, bytes, calls, statuses, breaker)."""
        return backend_statistics(self._tiers, self._moves.skipped_non_writer)

    def get_stats(self) -> Any:
        """SGLang's StorageMetrics (pages and GB/s per call since the last get_stats), with
        hicache's statistics() as its ``hicache`` attribute."""
        metrics = self._window.drain()
        metrics.hicache = self.statistics()
        return metrics

    def close(self) -> None:
        """Stop the tiers' loop and close the store (BoundedStorage.close: within ``deadline_s
        + grace_s``, a stuck store call is left to finish); idempotent. Later calls miss."""
        self._tiers.close()
