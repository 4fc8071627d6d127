"""HiCacheConfig: one configuration for a whole cache, from defaults, a file, a mapping and the
environment, each value remembering where it came from.

- HiCacheConfig.load(path=None, env=None, *, mapping=None, source="mapping"): the defaults, then
  the file (``path``, else ``$HICACHE_CONFIG``; .json, .toml, .yaml or .yml), then ``mapping``
  (labelled ``source``), then the ``HICACHE_*`` variables of ``env`` (default: os.environ).
  Later layers override earlier ones: the environment overrides the file.
- HiCacheConfig.from_mapping(data, source=...): the defaults, then ``data`` only (what a serving
  framework's integration passes: its own configuration dict).
- with_values(data, source): a new config with ``data`` layered on top.
- plan_settings() / cache_settings() / storage_settings() / runtime_options() / open_store():
  the domain values and arguments the entry points take (plan_stack, open_runtime, open_cache
  also take the config itself).
- entries() / as_json() / as_mapping(): each key's value and source, for ``hicache config``.

A mapping or file is nested by section (``{"plan": {"page_size": 64}}``) or uses dotted keys
(``{"plan.page_size": 64}``). An unknown key, a value of the wrong kind, and a value the
settings classes refuse are ConfigErrors naming the key and its source (the file's path, the
variable's name or the mapping's label). Everything is checked when the config is built.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import attrs

from hicache.bootstrap.config_keys import (
    BY_ENV,
    BY_NAME,
    CONFIG_FILE_VAR,
    DEFAULT,
    ENV_PREFIX,
    KEYS,
    OTHER_ENV_VARS,
    SECTIONS,
    Key,
    Kind,
    Source,
)
from hicache.bootstrap.config_values import parse_value, suggest
from hicache.cache.values import CacheSettings
from hicache.domain import (
    BudgetSizing,
    ConfigError,
    HostGroupPlan,
    PlanSettings,
    RatioSizing,
    StorageSettings,
    WriteSettings,
)
from hicache.domain.errors import shown
from hicache.domain.host_memory import resolve_host_memory
from hicache.domain.hybrid import CheckpointPolicy
from hicache.domain.limits import MAX_EVENT_SETS
from hicache.engine.storage_settings import StorageTierSettings

if TYPE_CHECKING:
    from hicache.domain.storage import Store

_T = TypeVar("_T")
_PREFIXES = tuple({k.name.rsplit(".", 1)[0] for k in KEYS} | set(SECTIONS))


@attrs.frozen
class Entry:
    """One key of an effective configuration: its value, where it came from, its variable."""

    key: str
    value: Any
    source: Source
    env: str


def _flatten(data: object, source: Source) -> list[tuple[Key, object]]:
    """The (key, value) pairs of a nested and/or dotted mapping. One key given twice (nested
    and dotted, ``{"storage": {"backend": ...}, "storage.backend": ...}``) is a ConfigError
    naming it, never last-one-wins."""
    out: list[tuple[Key, object]] = []
    seen: set[str] = set()
    for key, value in _walk(data, source, ""):
        if key.name in seen:
            raise ConfigError(
                f"key {key.name!r} is given twice (from {source}): nested and dotted forms "
                f"name the same key; keep one"
            )
        seen.add(key.name)
        out.append((key, value))
    return out


def _walk(data: object, source: Source, prefix: str) -> Iterator[tuple[Key, object]]:
    if not isinstance(data, Mapping):
        where = f"section {prefix.rstrip('.')!r}" if prefix else "the configuration"
        raise ConfigError(
            f"{where} (from {source}) must be a mapping, got {type(data).__name__} {shown(data)}"
        )
    for raw, value in data.items():
        if not isinstance(raw, str) or not raw:
            raise ConfigError(
                f"key {shown(raw)} ({type(raw).__name__}, from {source}): keys must be "
                f"non-empty text"
            )
        name = prefix + raw
        key = BY_NAME.get(name)
        if key is not None:
            yield key, value
        elif name in _PREFIXES:
            yield from _walk(value, source, name + ".")
        else:
            raise ConfigError(
                f"unknown key {shown(name)} (from {source}): not a hicache configuration key"
                f"{suggest(name, BY_NAME)}; `hicache config --show` lists them"
            )


def _from_env(env: Mapping[str, str]) -> Iterator[tuple[Key, object, Source]]:
    odd = next((var for var in env if not isinstance(var, str)), None)
    if odd is not None:
        raise ConfigError(
            f"environment variable name {shown(odd)} ({type(odd).__name__}): expected text"
        )
    for var in sorted(env):
        if not var.startswith(ENV_PREFIX) or var in OTHER_ENV_VARS:
            continue
        key = BY_ENV.get(var)
        if key is None:
            raise ConfigError(
                f"unknown environment variable {var}: not a hicache configuration key"
                f"{suggest(var, BY_ENV)}; `hicache config --show` lists them"
            )
        yield key, env[var], Source("env", var)


def _mentioned(message: str, key: Key) -> bool:
    return re.search(rf"\b{re.escape(key.leaf)}\b", message) is not None


class HiCacheConfig:
    """The effective configuration of one cache: a value and a source for every key."""

    def __init__(self) -> None:
        """The defaults. Build others with load, from_mapping or with_values, which parse and
        label every value."""
        self._setup({k.name: k.default for k in KEYS}, {k.name: DEFAULT for k in KEYS}, None)

    def _setup(self, values: dict[str, Any], sources: dict[str, Source], file: Path | None) -> None:
        self._values, self._sources, self.file = values, sources, file
        self._check_sizing()
        self._check_runtime()
        # Everything is built once, so a bad combination fails here and names its keys.
        self._storage = self._build(("storage.backend", "storage.extra_config"), self._storage_of)
        self._plan = self._build(("plan.",), self._plan_of)
        self._tier = self._build(("storage.tier.",), self._tier_of)
        self._cache = self._build(("cache.",), self._cache_of)

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def load(
        cls,
        path: str | os.PathLike[str] | None = None,
        env: Mapping[str, str] | None = None,
        *,
        mapping: Mapping[str, Any] | None = None,
        source: str = "mapping",
    ) -> HiCacheConfig:
        """Defaults, then the file, then ``mapping``, then the environment's HICACHE_* keys.

        ``path``: a .json, .toml, .yaml or .yml file; None reads ``$HICACHE_CONFIG`` if set.
        ``env``: the variables to read (default os.environ; ``{}`` reads none).
        """
        env = os.environ if env is None else env
        config = cls()
        if path is not None:
            config = config._with_file(Path(path).expanduser())
        elif env.get(CONFIG_FILE_VAR):
            try:
                config = config._with_file(Path(env[CONFIG_FILE_VAR]).expanduser())
            except ConfigError as e:
                raise ConfigError(f"{e} (the file env {CONFIG_FILE_VAR} names)") from None
        if mapping is not None:
            config = config.with_values(mapping, source=source)
        layered = [(k, v, s) for k, v, s in _from_env(env)]
        return config._layered(layered) if layered else config

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], source: str = "mapping") -> HiCacheConfig:
        """The defaults with ``data`` on top; errors name each key with ``source``."""
        return cls().with_values(data, source=source)

    def with_values(self, data: Mapping[str, Any], source: str = "mapping") -> HiCacheConfig:
        """A new config: this one with ``data`` (nested or dotted keys) on top."""
        if not isinstance(source, str) or not source:
            raise ConfigError(f"source must be a non-empty label, got {shown(source)}")
        label = Source("mapping", source)
        return self._layered([(k, v, label) for k, v in _flatten(data, label)])  # checks keys

    def _with_file(self, path: Path) -> HiCacheConfig:
        from hicache.bootstrap.config import read_mapping_file

        data = read_mapping_file(path, "hicache config file")
        label = Source("file", str(path))
        layered = self._layered([(k, v, label) for k, v in _flatten(data, label)])
        layered.file = path
        return layered

    def _layered(self, items: list[tuple[Key, object, Source]]) -> HiCacheConfig:
        values, sources = dict(self._values), dict(self._sources)
        for key, raw, source in items:
            values[key.name] = parse_value(key, raw, source)
            sources[key.name] = source
        config = HiCacheConfig.__new__(HiCacheConfig)
        config._setup(values, sources, self.file)
        return config

    # -- checks ---------------------------------------------------------------------------------

    def _origin(self, name: str) -> str:
        return f"{name} = {shown(self._values[name])} from {self._sources[name]}"

    def _check_runtime(self) -> None:
        """runtime.* values open_runtime would refuse, refused now (when the config is built)."""
        sets = self._values["runtime.event_sets"]
        if not 1 <= sets <= MAX_EVENT_SETS:
            raise ConfigError(
                f"{self._origin('runtime.event_sets')}: expected an integer in "
                f"[1, {MAX_EVENT_SETS}]"
            )

    def _check_sizing(self) -> None:
        size, ratio = "plan.host_size", "plan.host_ratio"
        if self._values[size] is not None and self._sources[ratio] != DEFAULT:
            raise ConfigError(
                f"{self._origin(size)} and {self._origin(ratio)}: give one of the two"
            )

    def _build(self, prefixes: tuple[str, ...], build: Callable[[], _T]) -> _T:
        try:
            return build()
        except ConfigError as e:
            message = str(e)
            keys = [k for k in KEYS if k.name.startswith(prefixes)]
            named = [k for k in keys if _mentioned(message, k)]
            if all(self._sources[k.name] == DEFAULT for k in named):  # what the caller set too
                named += [k for k in keys if self._sources[k.name] != DEFAULT and k not in named]
            if not named:
                raise
            origins = "; ".join(self._origin(k.name) for k in named)
            raise ConfigError(f"{message} ({origins})") from None

    # -- the values the entry points take ---------------------------------------------------------

    def _section(self, prefix: str) -> dict[str, Any]:
        return {
            name[len(prefix) :]: value
            for name, value in self._values.items()
            if name.startswith(prefix) and "." not in name[len(prefix) :]
        }

    def _storage_of(self) -> StorageSettings:
        return StorageSettings(
            backend=self._values["storage.backend"],
            extra_config=self._values["storage.extra_config"],
        )

    def _plan_of(self) -> PlanSettings:
        fields = self._section("plan.")
        ratio, size = fields.pop("host_ratio"), fields.pop("host_size")
        sizing = BudgetSizing(size) if size is not None else RatioSizing(ratio)
        return PlanSettings(**fields, sizing=sizing, storage=self._storage)

    def _tier_of(self) -> StorageTierSettings:
        return StorageTierSettings(**self._section("storage.tier."))

    def _cache_of(self) -> CacheSettings:
        return CacheSettings(
            **self._section("cache."),
            writes=WriteSettings(**self._section("cache.writes.")),
            checkpoints=CheckpointPolicy(**self._section("cache.checkpoints.")),
            storage=self._tier,
        )

    def plan_settings(self) -> PlanSettings:
        """PlanSettings from the ``plan.*`` keys and the storage settings."""
        return self._plan

    def cache_settings(self) -> CacheSettings:
        """CacheSettings from the ``cache.*`` keys, with the ``storage.tier.*`` settings."""
        return self._cache

    def storage_settings(self) -> StorageSettings:
        """StorageSettings from ``storage.backend`` and ``storage.extra_config``."""
        return self._storage

    def storage_tier_settings(self) -> StorageTierSettings:
        return self._tier

    def runtime_options(self) -> dict[str, Any]:
        """The keyword arguments of open_runtime that the config covers."""
        return {
            "device": self._values["runtime.device"],
            "backend": self._values["copy.backend"],
            "huge_pages": self._values["runtime.huge_pages"],
            "event_sets": self._values["runtime.event_sets"],
            "device_ownership": self._values["runtime.device_ownership"],
        }

    def open_store(self) -> Store | None:
        """The store ``storage.*`` names, opened (the caller closes it), or None without one."""
        if self._storage.backend is None:
            return None
        from hicache.bootstrap.storage import open_store

        return open_store(self._storage)

    def check_plan(self, plan: HostGroupPlan, call: str = "open_cache") -> None:
        """A ConfigError when ``plan`` was not planned with this config's page size and storage
        (its host memory kind follows ``storage.backend``): plan with ``plan_stack(spec,
        config)``."""
        page = self._plan.page_size
        anchor = plan.anchor.page_size
        kind = resolve_host_memory(self._storage, self._plan.pinned).kind
        if anchor != page:
            raise ConfigError(
                f"{call}: the plan's pages hold {anchor} tokens but {self._origin('plan.page_size')}"
                f": plan with plan_stack(spec, config)"
            )
        if plan.host_memory.kind != kind:
            raise ConfigError(
                f"{call}: the plan's host memory is {plan.host_memory.kind.name} but "
                f"{self._origin('storage.backend')} needs {kind.name}: plan with "
                f"plan_stack(spec, config)"
            )

    # -- what it holds --------------------------------------------------------------------------

    def value(self, key: str) -> Any:
        if key not in BY_NAME:
            raise ConfigError(f"unknown key {shown(key)}{suggest(str(key), BY_NAME)}")
        return self._values[key]

    def source(self, key: str) -> Source:
        if key not in BY_NAME:
            raise ConfigError(f"unknown key {shown(key)}{suggest(str(key), BY_NAME)}")
        return self._sources[key]

    def entries(self) -> list[Entry]:
        return [Entry(k.name, self._values[k.name], self._sources[k.name], k.env) for k in KEYS]

    def as_mapping(self) -> dict[str, Any]:
        """The values nested by section: what from_mapping and a JSON/YAML file take back."""
        out: dict[str, Any] = {}
        for key in KEYS:
            *parents, leaf = key.name.split(".")
            node = out
            for part in parents:
                node = node.setdefault(part, {})
            node[leaf] = self._values[key.name]
        return out

    def as_json(self) -> dict[str, Any]:
        return {
            "file": None if self.file is None else str(self.file),
            "keys": {
                e.key: {
                    "value": e.value,
                    "source": e.source.kind,
                    "from": str(e.source),
                    "env": e.env,
                }
                for e in self.entries()
            },
        }

    def __repr__(self) -> str:
        changed = [
            f"{k}={shown(v)}" for k, v in self._values.items() if self._sources[k] != DEFAULT
        ]
        return f"HiCacheConfig({', '.join(changed)})"


__all__ = ["Entry", "HiCacheConfig", "Kind"]


_RUNTIME_KEYS = {
    "device": "runtime.device",
    "backend": "copy.backend",
    "huge_pages": "runtime.huge_pages",
    "event_sets": "runtime.event_sets",
    "device_ownership": "runtime.device_ownership",
}
_RUNTIME_DEFAULTS = {arg: BY_NAME[key].default for arg, key in _RUNTIME_KEYS.items()}


def resolve_runtime_options(config: object, given: Mapping[str, Any], call: str) -> dict[str, Any]:
    """The runtime options of ``call`` (open_runtime, open_cache) when ``config`` is passed:
    the config's values. An argument passed with a value other than its default as well is a
    ConfigError naming it and the config key that covers it (never a silent choice)."""
    if not isinstance(config, HiCacheConfig):
        raise ConfigError(f"{call}: config must be a HiCacheConfig, got {type(config).__name__}")
    for arg, value in given.items():
        if value != _RUNTIME_DEFAULTS[arg]:
            key = _RUNTIME_KEYS[arg]
            raise ConfigError(
                f"{call}: {arg}={shown(value)} given together with config= ({config._origin(key)}): "
                f"set {key} in the configuration, or leave config= out"
            )
    return config.runtime_options()
