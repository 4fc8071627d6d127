"""The composition root: the only code that names concrete adapters and reads config files.

- config: extra config (JSON / @file / Path), model configs (path or bundled name) into domain
  values; files are read bounded and only when they are regular files.
- storage: open_store / open_named_store / register_store_factory / store_names, the storage
  tier's backends, "dynamic" plug-ins and entry points (adapters load only when a store opens).
- machine: what this machine can hold (available memory), checked before large allocations.
- runtime: open_runtime / Runtime, a plan materialised into host and device pools, copies,
  streams and the transfer engine. Loaded on first use, so importing hicache.bootstrap does not
  load torch.
- hicache_config: HiCacheConfig, one configuration for a whole cache (plan, cache, storage, copy
  backend, runtime) from defaults, a file, a mapping and HICACHE_* variables; config_keys lists
  its keys, config_values reads their values. Loaded on first use (it imports the engine's
  settings).
- cache: open_cache / CacheRuntime, the runtime + store + storage tiers + the cache face
  (HiCache). Loaded on first use, like runtime.
"""

from typing import Any

from hicache.bootstrap.config import (
    bundled_models,
    load_extra_config,
    load_model_config,
    load_model_spec,
    storage_settings,
)
from hicache.bootstrap.storage import (
    open_named_store,
    open_store,
    register_store_factory,
    store_names,
)


def __getattr__(name: str) -> Any:
    if name in ("open_runtime", "Runtime"):
        from hicache.bootstrap import runtime

        return getattr(runtime, name)
    if name == "HiCacheConfig":
        from hicache.bootstrap import hicache_config

        return hicache_config.HiCacheConfig
    if name in ("open_cache", "CacheRuntime"):
        from hicache.bootstrap import cache

        return getattr(cache, name)
    raise AttributeError(f"module 'hicache.bootstrap' has no attribute {name!r}")


__all__ = [
    "CacheRuntime",
    "HiCacheConfig",
    "Runtime",
    "bundled_models",
    "load_extra_config",
    "load_model_config",
    "load_model_spec",
    "open_cache",
    "open_named_store",
    "open_runtime",
    "open_store",
    "register_store_factory",
    "storage_settings",
    "store_names",
]
