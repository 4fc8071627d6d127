"""The SGLang backend's store and its per-pool tiers: opened, registered and closed together.

- BackendTiers(settings, storage_config, store, zero_copy_only): the backend's one store (opened
  from the extra config unless one is given), its metrics exports (BackendMetrics, whose tier
  source reads the registered pools) and the BoundedStorage that drives every store call. Each
  registered SGLang host pool gets a BackendPool: its pages (hicache.integrations.sglang.pages),
  its namespace and its StorageTier, bounded (``calls``). ``close`` stops the tiers' loop and
  closes the store within ``deadline_s + grace_s`` (a stuck store call is left to finish and
  the store closes when it returns), then the exports; idempotent.

The BoundedStorage is built last: from then on it owns the store (its close closes it); an
export that fails to start closes a store opened here first.
"""

from __future__ import annotations

import threading
from typing import Any

import attrs

from hicache.bootstrap.storage import open_named_store
from hicache.domain.errors import ConfigError, shown
from hicache.domain.pools import PoolName
from hicache.domain.storage import Store
from hicache.engine.bounded import BoundedSettings, BoundedStorage, BoundedTier
from hicache.engine.logs import get_logger
from hicache.engine.storage_settings import StorageTierSettings
from hicache.engine.storage_tier import StorageTier
from hicache.integrations.sglang.keys import pool_namespace
from hicache.integrations.sglang.metrics import BackendMetrics
from hicache.integrations.sglang.pages import PoolPages
from hicache.integrations.sglang.settings import BackendSettings

log = get_logger("hicache.sglang")

# SGLang sends at most this many pages per call (hicache_storage.STORAGE_BATCH_SIZE).
SGLANG_BATCH_PAGES = 128


@attrs.define
class BackendPool:
    """One registered SGLang host pool."""

    name: str
    pages: PoolPages
    calls: BoundedTier  # the pool's StorageTier (``calls.tier``), bounded
    namespace: str
    replicated: bool

    @property
    def tier(self) -> StorageTier:
        return self.calls.tier


class BackendTiers:
    """The store, the metrics exports and the bounded per-pool tiers of one HiCacheBackend
    (module docstring)."""

    def __init__(
        self,
        settings: BackendSettings,
        storage_config: Any,
        store: Store | None,
        *,
        zero_copy_only: bool,
    ) -> None:
        self.settings = settings
        self.storage_config = storage_config
        self.zero_copy_only = zero_copy_only
        self.store: Store = (
            store if store is not None else open_named_store(settings.store, settings.store_config)
        )
        self.pools: dict[str, BackendPool] = {}
        self._lock = threading.Lock()
        try:
            self.exports = BackendMetrics(
                lambda: {name: p.tier for name, p in list(self.pools.items())},
                port=settings.metrics_port,
                register_global=settings.metrics,
                tp_rank=int(getattr(storage_config, "tp_rank", 0) or 0),
            )
        except BaseException:
            if store is None:
                self.store.close()
            raise
        # Built last: it owns the store from here on (its close closes the store).
        self.bounded = BoundedStorage(
            self.store,
            BoundedSettings(deadline_s=settings.deadline_s, grace_s=settings.grace_s),
        )
        self._closed = False

    # -- registration -------------------------------------------------------------------------

    def add(self, name: str, pool: Any) -> None:
        """Register SGLang host pool ``pool`` as ``name``: a StorageTier over the store in the
        pool's namespace; its zero-copy memory registered with the store first."""
        try:
            pages = PoolPages(name, pool)
        except (AttributeError, TypeError, ValueError) as e:
            raise ConfigError(
                f"HiCacheBackend: pool {shown(name)}: {shown(pool)} is not an SGLang host pool "
                f"({type(e).__name__}: {e})"
            ) from e
        if pages.page_size <= 0 or pages.flat_nbytes <= 0:
            raise ConfigError(
                f"HiCacheBackend: pool {shown(name)}: page_size {pages.page_size} and page bytes "
                f"{pages.flat_nbytes}: expected both > 0"
            )
        if self.zero_copy_only and not pages.zero_copy:
            raise ConfigError(
                f"HiCacheBackend: pool {shown(name)} ({type(pool).__name__}, layout "
                f"{shown(pages.layout)}) has no zero-copy segments ({pages.copy_reason}): store "
                f"{shown(self.settings.store)} cannot serve it; use a page_first layout or store "
                "'directory'"
            )
        if pages.zero_copy:
            # Zero-copy stores (Mooncake) must know the host memory first; others ignore it.
            self.store.register(pages.regions())
        namespace, replicated = pool_namespace(self.storage_config, name, pages.describe())
        try:
            internal = PoolName.parse(name)
        except ConfigError:
            internal = PoolName.KV
        tier_settings = StorageTierSettings(
            batch_pages=SGLANG_BATCH_PAGES,
            max_concurrency=self.settings.max_concurrency,
            call_deadline_s=self.settings.deadline_s,
            breaker_threshold=self.settings.breaker_threshold,
            breaker_cooldown_s=self.settings.breaker_cooldown_s,
        )
        calls = self.bounded.tier({internal: namespace}, [internal], tier_settings)
        with self._lock:
            self.pools[name] = BackendPool(name, pages, calls, namespace, replicated)
        log.info(
            "sglang pool registered",
            pool=name,
            namespace=namespace,
            zero_copy=pages.zero_copy,
            copy_reason=pages.copy_reason,
            page_bytes=pages.flat_nbytes,
        )

    def pool(self, name: str) -> BackendPool:
        """The pool registered as ``name``; ConfigError when there is none."""
        found = self.pools.get(name)
        if found is None:
            raise ConfigError(
                f"HiCacheBackend: pool {shown(name)} is not registered: expected one of "
                f"{', '.join(sorted(self.pools)) or 'none (register_mem_pool_host first)'}"
            )
        return found

    # -- state and close ----------------------------------------------------------------------

    @property
    def stuck(self) -> int:
        """Store calls that overran ``deadline_s + grace_s`` and are still running."""
        return self.bounded.stuck

    def close(self) -> None:
        """Stop the tiers' loop and close the store (BoundedStorage.close: within ``deadline_s
        + grace_s``, a stuck store call is left to finish), then the exports; idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self.bounded.close()
        finally:
            self.exports.close()
