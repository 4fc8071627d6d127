"""Host memory kinds and their ONE resolution point.

- MemoryKind: anonymous, shm, or memory owned by a store ("store:mooncake").
- Pinning: whether host buffers are page-locked: on, off, or auto (on only where a GPU exists).
- HostMemory: a resolved kind plus its pinning; what a host group holds exactly once.
- StorageSettings: the storage backend name and its extra config (already parsed into a mapping).
- parse_extra_config: a JSON string or a mapping into a mapping (files are read by the caller).
- resolve_host_memory: the only function that turns storage settings into a HostMemory.

Resolution rules: no backend -> anonymous; "shm" -> shm; "dynamic" -> the extra config's
"allocator", or anonymous when it names only a store plug-in (module_path and class_name, or
backend_name); a store that owns host memory -> that store's memory; any other known backend ->
anonymous. An unknown backend or allocator name is a ConfigError that names it.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any

import attrs

from hicache.domain.errors import ConfigError, shown
from hicache.domain.limits import check_tree, parse_json
from hicache.domain.store_plugins import names_store_plugin

ANONYMOUS = "anonymous"
SHM = "shm"
STORE_PREFIX = "store:"

# Stores that hand hicache host memory they own (registered for zero-copy transfers).
MEMORY_OWNING_STORES = frozenset({"mooncake"})
# Backends that keep pages in their own tier and take host memory from hicache.
PLAIN_BACKENDS = frozenset({"directory", "file", "hf3fs", "nixl", "aibrix", "eic", "lmcache"})
KNOWN_BACKENDS = frozenset({SHM, "dynamic"}) | MEMORY_OWNING_STORES | PLAIN_BACKENDS
KNOWN_ALLOCATORS = frozenset({ANONYMOUS, SHM}) | {STORE_PREFIX + s for s in MEMORY_OWNING_STORES}


def _check_kind(_inst: object, _attr: object, value: str) -> None:
    if not isinstance(value, str):
        raise ConfigError(f"a host memory kind must be a name, got {shown(value)}")
    if value in (ANONYMOUS, SHM):
        return
    if value.startswith(STORE_PREFIX) and value[len(STORE_PREFIX) :] in MEMORY_OWNING_STORES:
        return
    raise ConfigError(
        f"unknown host memory kind {shown(value)}: expected one of {', '.join(sorted(KNOWN_ALLOCATORS))}"
    )


@attrs.frozen
class MemoryKind:
    """Where host buffers come from: "anonymous", "shm" or "store:<name>"."""

    name: str = attrs.field(validator=_check_kind)

    @property
    def store(self) -> str | None:
        """The owning store's name for a store-owned kind, else None."""
        return self.name[len(STORE_PREFIX) :] if self.name.startswith(STORE_PREFIX) else None

    def __str__(self) -> str:
        return self.name


class Pinning(enum.Enum):
    ON = "on"
    OFF = "off"
    AUTO = "auto"

    @classmethod
    def parse(cls, value: bool | str | Pinning | None) -> Pinning:
        if isinstance(value, Pinning):
            return value
        if value is None:
            return cls.AUTO
        if isinstance(value, bool):
            return cls.ON if value else cls.OFF
        text = str(value).strip().lower()
        aliases = {"on": cls.ON, "true": cls.ON, "off": cls.OFF, "false": cls.OFF, "auto": cls.AUTO}
        if text not in aliases:
            raise ConfigError(f"unknown pinning {shown(value)}: expected on, off or auto")
        return aliases[text]

    def as_json(self) -> bool | str:
        if self is Pinning.AUTO:
            return "auto"
        return self is Pinning.ON


@attrs.frozen
class HostMemory:
    """A resolved host memory kind and its pinning. A host group holds exactly one."""

    kind: MemoryKind
    pinned: Pinning = Pinning.AUTO

    def as_json(self) -> dict[str, Any]:
        return {"kind": self.kind.name, "pinned": self.pinned.as_json()}

    def __str__(self) -> str:
        return f"{self.kind.name}(pinned={self.pinned.value})"


def parse_extra_config(value: str | Mapping[str, Any] | None) -> dict[str, Any]:
    """A JSON object string or a mapping into a dict. ``"@path"`` must be read by the caller."""
    if value is None:
        return {}
    if isinstance(value, Mapping):
        check_tree(value, "extra config")
        for key in value:
            if not isinstance(key, str) or not key:
                raise ConfigError(
                    f"extra config key {shown(key)} ({type(key).__name__}): expected the "
                    f"keys to be non-empty text"
                )
        return dict(value)
    if not isinstance(value, str):
        raise ConfigError(
            f"extra config must be a JSON string, a mapping or None, got {type(value).__name__} "
            f"{shown(value)}; "
            f"a file path goes through hicache.bootstrap.load_extra_config"
        )
    text = value.strip()
    if not text:
        return {}
    if text.startswith("@"):
        raise ConfigError(
            f"extra config {shown(value)} names a file; read it with "
            f"hicache.bootstrap.load_extra_config"
        )
    cut = value if len(value) <= 80 else value[:77] + "..."
    parsed = parse_json(text, f"extra config {shown(cut)}")
    if not isinstance(parsed, dict):
        raise ConfigError(
            f"extra config must be a JSON object, got {type(parsed).__name__}: {shown(cut)}"
        )
    return parsed


@attrs.frozen
class StorageSettings:
    """The storage (L3) backend and its extra config, as a serving framework passes them."""

    backend: str | None = attrs.field(default=None)
    extra_config: Mapping[str, Any] = attrs.field(factory=dict, converter=parse_extra_config)

    def __attrs_post_init__(self) -> None:
        if self.backend is not None and not isinstance(self.backend, str):
            raise ConfigError(f"storage backend must be a name or None, got {shown(self.backend)}")
        if self.backend is not None and self.backend not in KNOWN_BACKENDS:
            raise ConfigError(
                f"unknown storage backend {shown(self.backend)}: expected one of "
                f"{', '.join(sorted(KNOWN_BACKENDS))} or none"
            )


def _allocator_kind(name: object) -> MemoryKind:
    if not isinstance(name, str):
        raise ConfigError(f"extra config 'allocator' must be a string, got {shown(name)}")
    candidate = name.strip().lower()
    if candidate in MEMORY_OWNING_STORES:
        candidate = STORE_PREFIX + candidate
    if candidate not in KNOWN_ALLOCATORS:
        raise ConfigError(
            f"unknown allocator {shown(name)} in the storage extra config: expected one of "
            f"{', '.join(sorted(KNOWN_ALLOCATORS))}"
        )
    return MemoryKind(candidate)


def resolve_host_memory(
    storage: StorageSettings | str | None, pinned: bool | str | Pinning | None = None
) -> HostMemory:
    """THE resolution point: storage settings -> the one host memory kind of a whole group.

    ``storage`` may also be a backend name ("shm", "mooncake"; taken as
    StorageSettings(backend=name)) or None (no storage backend).
    """
    if storage is None or isinstance(storage, str):
        storage = StorageSettings(backend=storage)
    elif not isinstance(storage, StorageSettings):
        raise ConfigError(
            f"storage must be a StorageSettings, a backend name or None, got "
            f"{type(storage).__name__}"
        )
    backend = storage.backend
    if backend is None:
        kind = MemoryKind(ANONYMOUS)
    elif backend == SHM:
        kind = MemoryKind(SHM)
    elif backend == "dynamic":
        if "allocator" in storage.extra_config:
            kind = _allocator_kind(storage.extra_config["allocator"])
        elif names_store_plugin(storage.extra_config):
            kind = MemoryKind(ANONYMOUS)  # a plug-in store takes host memory from hicache
        else:
            raise ConfigError(
                "storage backend 'dynamic' needs an 'allocator' in its extra config, e.g. "
                "'{\"allocator\": \"shm\"}', or a store plug-in ('module_path' and "
                "'class_name', or 'backend_name'); got keys "
                f"{sorted(storage.extra_config)}"
            )
    elif backend in MEMORY_OWNING_STORES:
        kind = MemoryKind(STORE_PREFIX + backend)
    else:
        kind = MemoryKind(ANONYMOUS)
    return HostMemory(kind, Pinning.parse(pinned))
