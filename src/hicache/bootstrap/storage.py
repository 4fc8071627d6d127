"""Opening the storage (L3) tier: built-in stores, "dynamic" plug-ins and entry points.

- StoreFactory: a callable from an extra config (a mapping) to an open Store.
- register_store_factory / store_factories: the built-in stores by name ("directory", and
  "mooncake": Mooncake Store on the cluster its settings name, or on a local master and storage
  node started for it and stopped when the store closes); others through register_store_factory.
- open_mooncake(config, provide_host_memory=True): the "mooncake" factory; without
  ``provide_host_memory`` the store serves no store:mooncake host memory.
- store_names: the names ``open_named_store`` accepts (built-ins, then entry points).
- open_named_store: a store by name with its extra config.
- open_store: the store that StorageSettings name.

How a backend name resolves (open_store):
  "dynamic"       the extra config's "module_path" + "class_name": exactly that class is
                  imported and called with the extra config; or, with only "backend_name",
                  the entry point of that name in group ``hicache.stores``. Nothing else loads.
  a built-in      its factory ("directory": DirectoryStore, root from "root" or a temp dir;
                  "mooncake": MooncakeStore, settings as docs/storage-mooncake.md says).
  any other name  the entry point of that name in group ``hicache.stores``, if one exists.
The "allocator" key is not read here: host memory goes through
hicache.domain.resolve_host_memory only. Errors: a name, module or class that cannot be found
or is no Store, and a module whose import raises (or calls sys.exit), is a ConfigError; a store
whose constructor fails (or calls sys.exit) is a StoreError.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import threading
from collections.abc import Callable, Mapping
from typing import Any

from hicache.domain import (
    ConfigError,
    HiCacheError,
    StorageSettings,
    StoreError,
    parse_extra_config,
)
from hicache.domain.errors import shown
from hicache.domain.storage import Store
from hicache.domain.store_plugins import STORE_ENTRY_POINT_GROUP, StorePlugin

StoreFactory = Callable[[Mapping[str, Any]], Store]
# The memory a local Mooncake storage node mounts when no cluster is named (tests, benches).
LOCAL_MOONCAKE_SEGMENT_BYTES = 2 << 30
_PORT_METHODS = ("register", "exists", "get", "put", "remove", "health", "close")


def _open_directory(config: Mapping[str, Any]) -> Store:
    from hicache.adapters.storage.directory import DirectoryStore

    return DirectoryStore.from_config(config)


def open_mooncake(config: Mapping[str, Any], *, provide_host_memory: bool = True) -> Store:
    """The "mooncake" store: on the cluster ``config`` names, else on a local one. Without
    ``provide_host_memory`` it serves no store:mooncake host memory (a caller that registers
    its own memory, such as the vLLM connector: then several may open in one process)."""
    from hicache.adapters.storage.mooncake_config import names_master
    from hicache.adapters.storage.mooncake_local import open_mooncake_or_local
    from hicache.bootstrap.machine import check_fits

    if not names_master(config):
        # The node's segment is allocated lazily: refuse now what the machine could not back.
        check_fits(
            LOCAL_MOONCAKE_SEGMENT_BYTES,
            "the local Mooncake storage node's segment (started because no master is named)",
        )
    return open_mooncake_or_local(
        config,
        segment_bytes=LOCAL_MOONCAKE_SEGMENT_BYTES,
        provide_host_memory=provide_host_memory,
    )


_lock = threading.Lock()
_factories: dict[str, StoreFactory] = {"directory": _open_directory, "mooncake": open_mooncake}


def register_store_factory(name: str, factory: StoreFactory) -> None:
    """Make ``name`` a built-in store (what the composition root does for "mooncake")."""
    if not isinstance(name, str) or not name or name == "dynamic":
        raise ConfigError(f"store name {name!r}: expected a non-empty name other than 'dynamic'")
    if not callable(factory):
        raise ConfigError(f"store factory for {name!r} must be callable, got {factory!r}")
    with _lock:
        _factories[name] = factory


def store_factories() -> dict[str, StoreFactory]:
    with _lock:
        return dict(_factories)


def entry_points() -> list[importlib.metadata.EntryPoint]:
    """The entry points of group ``hicache.stores`` (metadata only: nothing is imported)."""
    return list(importlib.metadata.entry_points(group=STORE_ENTRY_POINT_GROUP))


def store_names() -> list[str]:
    """Built-in store names, then the names of installed entry points not shadowed by one."""
    builtin = sorted(store_factories())
    return builtin + sorted({ep.name for ep in entry_points()} - set(builtin))


def _checked(store: object, label: str) -> Store:
    missing = [m for m in _PORT_METHODS if not callable(getattr(store, m, None))]
    if missing or not isinstance(store, Store):
        close = getattr(store, "close", None)
        if callable(close):
            close()
        raise ConfigError(
            f"store {label} returned {type(store).__name__}, which is no Store: it lacks "
            f"{', '.join(missing) or 'the name property'} (see hicache.domain.storage.Store)"
        )
    return store


def _construct(factory: Callable[..., object], config: Mapping[str, Any], label: str) -> Store:
    try:
        store = factory(dict(config))
    except HiCacheError:
        raise
    except (Exception, SystemExit) as e:
        raise StoreError(f"store {label} failed to open: {type(e).__name__}: {e}") from e
    return _checked(store, label)


def _entry_point(name: str) -> importlib.metadata.EntryPoint | None:
    matches = [ep for ep in entry_points() if ep.name == name]
    if len(matches) > 1:
        raise ConfigError(
            f"{len(matches)} installed entry points of group {STORE_ENTRY_POINT_GROUP!r} are "
            f"named {name!r} ({', '.join(ep.value for ep in matches)}): uninstall all but one"
        )
    return matches[0] if matches else None


def _load_entry_point(ep: importlib.metadata.EntryPoint) -> Callable[..., object]:
    try:
        target = ep.load()
    except (Exception, SystemExit) as e:
        raise ConfigError(
            f"entry point {ep.name!r} of group {STORE_ENTRY_POINT_GROUP!r} ({ep.value}) cannot "
            f"be loaded: {type(e).__name__}: {e}"
        ) from e
    if not callable(target):
        raise ConfigError(
            f"entry point {ep.name!r} ({ep.value}) is {type(target).__name__}, not a store class "
            "or factory"
        )
    return target  # type: ignore[no-any-return]


def _load_class(plugin: StorePlugin) -> Callable[..., object]:
    module_path, class_name = plugin.module_path, plugin.class_name
    if module_path is None or class_name is None:  # from_extra_config pairs them
        raise ConfigError(f"store plug-in {plugin.label} names no module and class")
    try:
        module = importlib.import_module(module_path)
    except (Exception, SystemExit) as e:
        # Whatever the module's own code raises at import (or a sys.exit there) is the
        # plug-in's failure, never the host process's end.
        raise ConfigError(
            f"storage backend 'dynamic': cannot import module_path {module_path!r}: "
            f"{type(e).__name__}: {e}"
        ) from e
    klass = getattr(module, class_name, None)
    if klass is None:
        raise ConfigError(
            f"storage backend 'dynamic': module {module_path!r} has no class_name {class_name!r}"
        )
    if not isinstance(klass, type):
        raise ConfigError(
            f"storage backend 'dynamic': {module_path}.{class_name} is a "
            f"{type(klass).__name__}, not a class"
        )
    return klass


def open_named_store(name: str, config: Mapping[str, Any] | None = None) -> Store:
    """The built-in store ``name``, else the entry point ``name``, opened with ``config`` (a
    mapping with text keys; a list of pairs or another type is a ConfigError)."""
    if config is not None and not isinstance(config, Mapping):
        raise ConfigError(
            f"store {shown(name)}: its config must be a mapping of text keys, got "
            f"{type(config).__name__} {shown(config)}"
        )
    config = parse_extra_config(config)  # text keys, bounded depth and numbers
    factory = store_factories().get(name)
    if factory is not None:
        return _construct(factory, config, repr(name))
    ep = _entry_point(name)
    if ep is None:
        raise ConfigError(
            f"no store named {name!r}: expected one of {', '.join(store_names())}, or backend "
            f"'dynamic' with module_path and class_name"
        )
    return _construct(_load_entry_point(ep), config, f"{name!r} ({ep.value})")


def open_store(settings: StorageSettings) -> Store:
    """The store ``settings`` name (see the module docstring); ConfigError when none is named."""
    backend = settings.backend
    if backend is None:
        raise ConfigError("no storage backend is configured: there is no store to open")
    if backend != "dynamic":
        return open_named_store(backend, settings.extra_config)
    plugin = StorePlugin.from_extra_config(settings.extra_config)
    if plugin.module_path is None:
        return open_named_store(str(plugin.backend_name), settings.extra_config)
    return _construct(_load_class(plugin), settings.extra_config, plugin.label)


__all__ = [
    "StoreFactory",
    "entry_points",
    "open_mooncake",
    "open_named_store",
    "open_store",
    "register_store_factory",
    "store_factories",
    "store_names",
]
