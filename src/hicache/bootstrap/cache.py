"""The composition root of the cache face: plan in, runtime + store + storage tiers + HiCache out.

- CacheRuntime: the Runtime (host and device pools, copies, streams, engine), the store (if
  any), the storage tiers and the HiCache of one host group plan; ``async with`` opens them in
  order and closes them in reverse, exactly once (the cache drains its background writes
  first, then the engine, then the store, then the pools).
- CacheRuntime.close(): the synchronous close, after a SyncEngine / SyncCache ran it.
- open_cache: build a CacheRuntime: ``open_runtime`` + ``open_store`` (or a given Store) +
  ``HostGroupBuffers`` + one ``StorageTier`` per slot-owning pool + ``HiCache``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hicache.bootstrap.runtime import Runtime, open_runtime
from hicache.cache.face import HiCache
from hicache.cache.storage import CacheStorage, TierPort
from hicache.cache.values import CacheSettings
from hicache.domain import ConfigError, HostGroupPlan, PoolName, PoolRole, StorageSettings
from hicache.domain.exc_info import ExcTraceback, ExcType, ExcValue
from hicache.domain.namespace import RankIdentity, group_namespaces
from hicache.domain.storage import Store
from hicache.engine.engine import TransferEngine
from hicache.engine.logs import get_logger
from hicache.engine.ranks import RankAgreement

if TYPE_CHECKING:
    from hicache.bootstrap.hicache_config import HiCacheConfig


class CacheRuntime:
    """Everything the cache face of one rank needs; ``async with`` it (or ``open_cache``)."""

    def __init__(
        self,
        *,
        runtime: Runtime,
        cache: HiCache,
        store: Store | None,
        storage: CacheStorage | None,
        owns_store: bool,
    ) -> None:
        self.runtime = runtime
        self.cache = cache
        self.store = store
        self.storage = storage
        self._owns_store = owns_store
        self._closed = False

    @property
    def plan(self) -> HostGroupPlan:
        return self.runtime.plan

    @property
    def engine(self) -> TransferEngine:
        return self.runtime.engine

    @property
    def closed(self) -> bool:
        return self._closed

    async def __aenter__(self) -> CacheRuntime:
        try:
            await self.runtime.__aenter__()
        except BaseException:
            self._close_store()
            self._closed = True
            raise
        try:
            await self.cache.__aenter__()
        except BaseException:
            try:
                await self.runtime.aclose()
            finally:
                self._close_store()
                self._closed = True
            raise
        return self

    async def __aexit__(self, exc_type: ExcType, exc: ExcValue, tb: ExcTraceback) -> None:
        try:
            await self.aclose()
        finally:
            # Here, where ``async with`` entered them, the groups are left in any case (not
            # under a shield: a group is left only from the scope it was entered in).
            try:
                await self.cache.__aexit__(None, None, None)
            finally:
                await self.runtime.__aexit__(None, None, None)

    async def aclose(self) -> None:
        """Close the cache (background writes finish), the engine, the store, the pools.

        Callable from any cancel scope and cancellable (the cancellation reaches the caller's
        scope, nothing else): the cache's and the engine's task groups are left where they were
        entered, here or at the ``async with`` exit (hicache.engine._scopes).
        """
        if self._closed:
            try:
                await self.cache._leave_group()
            finally:
                await self.runtime.aclose()  # leaves the engine's group if it is still entered
            return
        self._closed = True
        try:
            await self.cache.aclose()
        finally:
            try:
                await self.runtime.engine.aclose()
            finally:
                try:
                    self._close_store()
                finally:
                    await self.runtime.aclose()

    def close(self) -> None:
        """Synchronous close, for a runtime driven through the synchronous face: after the
        SyncCache and the SyncEngine closed (the cache and the engine), close the store this
        runtime opened and the pools. Idempotent; ``aclose`` does all of it for async users."""
        if self._closed:
            return
        self._closed = True
        try:
            self._close_store()
        finally:
            self.runtime._close_resources()

    def _close_store(self) -> None:
        if self._owns_store and self.store is not None:
            self.store.close()

    def __repr__(self) -> str:
        return f"<CacheRuntime {'closed' if self._closed else repr(self.cache)}>"


def _tiers(
    plan: HostGroupPlan,
    store: Store,
    runtime: Runtime,
    rank: RankIdentity,
    tier_settings: Any,
) -> CacheStorage:
    from hicache.adapters.storage.page_buffers import HostGroupBuffers, whole_bytes
    from hicache.engine.storage_tier import StorageTier

    buffers = HostGroupBuffers(runtime.host)
    namespaces = group_namespaces(plan, rank)
    anchor = plan.anchor.name
    sidecars = tuple(p.name for p in plan.pools if p.role is PoolRole.SIDECAR)
    tiers: dict[PoolName, TierPort] = {}
    for p in plan.independent_pools():
        pools = (anchor, *sidecars) if p.name is anchor else (p.name,)
        tiers[p.name] = StorageTier(store, buffers, namespaces, pools, tier_settings)
    # Zero-copy stores (Mooncake) register the host memory their transfers use, once.
    store.register(
        [whole_bytes(t) for p in plan.pools for t in runtime.host.pool(p.name).buffers.values()]
    )
    return CacheStorage(tiers, anchor=anchor)


_keys_tried = False


def _native_keys() -> None:
    """Hash page keys with the native chain (the same keys, faster for long prompts at small
    page sizes: docs/benchmarks.md); without a C compiler the Python chain stays, logged once."""
    from hicache.adapters.native_keys import install_native_keys
    from hicache.domain.keys import chain_hasher

    global _keys_tried
    if _keys_tried or chain_hasher() != "python":
        return
    _keys_tried = True
    installed, why = install_native_keys()
    if not installed:
        get_logger("hicache.bootstrap").warning("page_keys_python", reason=why)


def open_cache(
    plan: HostGroupPlan,
    *,
    device: str = "cpu",
    store: Store | StorageSettings | None = None,
    settings: CacheSettings | None = None,
    rank: RankIdentity | None = None,
    ranks: RankAgreement | None = None,
    device_ownership: str = "engine",
    config: HiCacheConfig | None = None,
    **runtime_options: Any,
) -> CacheRuntime:
    """Compose the cache face for ``plan``; enter the result with ``async with``.

    ``store``: a Store (kept open: the caller closes it), StorageSettings (opened here with
    ``open_store`` and closed with the cache), or None (no storage tier). ``rank``: the model
    name and tp/pp ranks that name stored objects (default: the plan's model type, rank 0).
    ``ranks``: the TP agreement (default: one process). ``runtime_options`` go to
    ``open_runtime`` (backend, device_tensors, device_capacities, huge_pages, name, ...).
    With a store and no storage write policy in ``settings.writes``, write_through is used
    for storage only if ``settings`` says so: pass ``WriteSettings(storage=...)``.
    ``config``: a HiCacheConfig that gives the settings, the store (its ``storage.*`` keys) and
    the runtime options (device, backend, huge_pages, event_sets, device_ownership); passing
    ``settings``, a store or one of those options as well is a ConfigError, and so is a plan
    made with another page size or storage backend (plan with ``plan_stack(spec, config)``).
    """
    if not isinstance(plan, HostGroupPlan):
        raise ConfigError(f"open_cache needs a HostGroupPlan, got {type(plan).__name__}")
    if config is not None:
        from hicache.bootstrap.hicache_config import resolve_runtime_options

        if settings is not None or store is not None:
            raise ConfigError(
                "open_cache: settings= or store= given together with config=: the config "
                "gives both (its cache.* and storage.* keys); pass one or the other"
            )
        given = {"device": device, "device_ownership": device_ownership}
        given |= {
            k: runtime_options.pop(k)
            for k in ("backend", "huge_pages", "event_sets")
            if k in runtime_options
        }
        options = resolve_runtime_options(config, given, "open_cache")
        config.check_plan(plan)
        device = options.pop("device")
        device_ownership = options.pop("device_ownership")
        runtime_options |= options
        settings = config.cache_settings()
        backend = config.storage_settings()
        store = backend if backend.backend is not None else None
    settings = settings if settings is not None else CacheSettings()
    if not isinstance(settings, CacheSettings):
        raise ConfigError(f"settings must be CacheSettings, got {type(settings).__name__}")
    if rank is None:
        rank = RankIdentity(model=plan.model_type or "model")
    if not isinstance(rank, RankIdentity):
        raise ConfigError(f"rank must be a RankIdentity, got {type(rank).__name__}")
    if store is not None and not isinstance(store, (Store, StorageSettings)):
        raise ConfigError(
            f"store must be a Store, StorageSettings or None, got {type(store).__name__}"
        )
    owns_store = isinstance(store, StorageSettings)
    _native_keys()
    opened: Store | None = None
    if isinstance(store, StorageSettings):
        from hicache.bootstrap.storage import open_store

        opened = open_store(store)
    elif store is not None:
        opened = store
    runtime: Runtime | None = None
    try:
        runtime = open_runtime(
            plan, device=device, device_ownership=device_ownership, **runtime_options
        )
        storage = (
            _tiers(plan, opened, runtime, rank, settings.storage) if opened is not None else None
        )
        cache = HiCache(runtime.engine, settings=settings, storage=storage, ranks=ranks)
    except BaseException:
        try:
            if runtime is not None:
                runtime._close_resources()
        finally:
            if owns_store and opened is not None:
                opened.close()
        raise
    return CacheRuntime(
        runtime=runtime, cache=cache, store=opened, storage=storage, owns_store=owns_store
    )


__all__ = ["CacheRuntime", "open_cache"]
