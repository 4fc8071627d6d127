"""The extra config of hicache's SGLang backend: which keys are whose, checked once at start.

- SGLANG_KEYS: keys SGLang itself reads from ``--hicache-storage-backend-extra-config`` (or
  leaves there after reading); the backend accepts and ignores them.
- BackendSettings.parse(extra_config, env=None): the backend's own keys, the store's name and
  the store's settings (everything else). A bad value is a ConfigError naming the key; an
  unknown key is named by the store's own parser (DirectoryStore, Mooncake) before anything is
  opened.
- TIER_KEYS: the backend's keys that are hicache configuration keys too (``deadline_s`` is
  ``storage.tier.call_deadline_s``, ...). Their values go through HiCacheConfig (the same
  checks as a hicache config file, source ``hicache_storage_backend_extra_config``); a key the
  extra config leaves out takes its ``HICACHE_*`` environment variable
  (``HICACHE_STORAGE_TIER_CALL_DEADLINE_S``, ...), if set, else the backend's default
  (docs/sglang.md, "Every key").

Key sources: ``backend_name``, ``module_path``, ``class_name``
(python/sglang/srt/mem_cache/storage/backend_factory.py, ``_create_dynamic_backend``),
``interface_v1`` (python/sglang/srt/managers/cache_controller.py, ``attach_storage_backend``),
``allocator`` (python/sglang/srt/mem_cache/pool_host/common.py, ``get_allocator_type``),
``tp_lcm_size`` (cache_controller.py, ``_generate_storage_config``), the ``prefetch_*`` keys and
``hicache_storage_pass_prefix_keys`` (python/sglang/srt/mem_cache/hybrid_cache/
hybrid_cache_controller.py, ``parse_storage_backend_extra_config``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import attrs

from hicache.domain.errors import ConfigError, shown
from hicache.domain.limits import bounded_seconds

SGLANG_KEYS = frozenset(
    {
        "backend_name",
        "module_path",
        "class_name",
        "interface_v1",
        "allocator",
        "tp_lcm_size",
        "prefetch_threshold",
        "prefetch_timeout_base",
        "prefetch_timeout_per_ki_token",
        "prefetch_timeout_max",
        "hicache_storage_pass_prefix_keys",
    }
)
# The backend's own keys with their defaults.
BACKEND_KEYS = (
    "store",
    "store_path",
    "deadline_s",
    "grace_s",
    "breaker_threshold",
    "breaker_cooldown_s",
    "max_concurrency",
    "metrics",
    "metrics_port",
)


# The backend's keys that are hicache configuration keys too (docs/configuration.md).
TIER_KEYS = {
    "deadline_s": "storage.tier.call_deadline_s",
    "breaker_threshold": "storage.tier.breaker_threshold",
    "breaker_cooldown_s": "storage.tier.breaker_cooldown_s",
    "max_concurrency": "storage.tier.max_concurrency",
}
SOURCE = "hicache_storage_backend_extra_config"


def _env_var(key: str) -> str:
    return "HICACHE_" + key.upper().replace(".", "_")


def _through_hicache_config(
    own: Mapping[str, Any], env: Mapping[str, str] | None
) -> dict[str, Any]:
    """The TIER_KEYS values: the extra config's, else their HICACHE_* variables', checked by
    HiCacheConfig; errors name the backend's key, hicache's key and the source."""
    from hicache.bootstrap.config_keys import DEFAULT
    from hicache.bootstrap.hicache_config import HiCacheConfig

    env = os.environ if env is None else env
    tier_env = {_env_var(k): env[_env_var(k)] for k in TIER_KEYS.values() if _env_var(k) in env}
    given = {TIER_KEYS[k]: own[k] for k in TIER_KEYS if k in own}
    try:
        config = HiCacheConfig.load(env=tier_env).with_values(given, source=SOURCE)
    except ConfigError as exc:
        named = [k for k, key in TIER_KEYS.items() if key in str(exc)]
        which = f" {shown(named[0])}" if named else "s"
        raise ConfigError(f"hicache sglang backend key{which}: {exc}") from None
    return {
        k: config.value(key)
        for k, key in TIER_KEYS.items()
        if k in own or config.source(key) != DEFAULT
    }


def _seconds(_inst: object, attr: attrs.Attribute[Any], value: object) -> None:
    bounded_seconds(value, f"hicache sglang backend key {shown(attr.name)}", positive=True)


def _positive_int(_inst: object, attr: attrs.Attribute[Any], value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(
            f"hicache sglang backend key {shown(attr.name)}: expected an integer > 0, got {shown(value)}"
        )


def _store_name(_inst: object, _attr: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, str) or not value.strip() or value == "dynamic":
        raise ConfigError(
            f"hicache sglang backend key 'store': expected a store name ('directory', "
            f"'mooncake' or an installed hicache.stores plug-in), got {shown(value)}"
        )


def _path(_inst: object, _attr: attrs.Attribute[Any], value: object) -> None:
    if value is not None and (not isinstance(value, str) or not value.strip()):
        raise ConfigError(
            f"hicache sglang backend key 'store_path': expected a directory path, got {shown(value)}"
        )


def _bool(_inst: object, attr: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, bool):
        raise ConfigError(
            f"hicache sglang backend key {shown(attr.name)}: expected true or false, got {shown(value)}"
        )


def _port(_inst: object, attr: attrs.Attribute[Any], value: object) -> None:
    if value is not None and (
        isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 65535
    ):
        raise ConfigError(
            f"hicache sglang backend key {shown(attr.name)}: expected a port in 0..65535 (0: a free "
            f"one), got {shown(value)}"
        )


@attrs.frozen(kw_only=True)
class BackendSettings:
    """How the backend talks to its store; ``store_config`` is the store's own settings."""

    store: str = attrs.field(default="directory", validator=_store_name)
    store_path: str | None = attrs.field(default=None, validator=_path)
    deadline_s: float = attrs.field(default=10.0, validator=_seconds)
    grace_s: float = attrs.field(default=2.0, validator=_seconds)
    breaker_threshold: int = attrs.field(default=5, validator=_positive_int)
    breaker_cooldown_s: float = attrs.field(default=10.0, validator=_seconds)
    max_concurrency: int = attrs.field(default=4, validator=_positive_int)
    metrics: bool = attrs.field(default=False, validator=_bool)
    metrics_port: int | None = attrs.field(default=None, validator=_port)
    store_config: Mapping[str, Any] = attrs.field(factory=dict)

    @classmethod
    def parse(
        cls, extra_config: Mapping[str, Any] | None, env: Mapping[str, str] | None = None
    ) -> BackendSettings:
        """Split SGLang's extra config into SGLang's keys (dropped), the backend's and the
        store's; TIER_KEYS also from ``env`` (default os.environ, module docstring)."""
        if not isinstance(extra_config, Mapping | None):
            raise ConfigError(
                f"hicache sglang backend: extra_config must be a mapping, got "
                f"{type(extra_config).__name__} {shown(extra_config)}"
            )
        config = dict(extra_config or {})
        for key in config:
            if not isinstance(key, str):
                raise ConfigError(
                    f"hicache sglang backend: extra_config key {shown(key)} "
                    f"({type(key).__name__}): expected a string"
                )
        own = {k: config[k] for k in BACKEND_KEYS if k in config}
        rest = {k: v for k, v in config.items() if k not in SGLANG_KEYS and k not in own}
        settings = cls(**own)
        settings = attrs.evolve(settings, **_through_hicache_config(own, env))
        store_config = dict(rest)
        if settings.store == "directory":
            if "root" in store_config:
                raise ConfigError(
                    "hicache sglang backend key 'root': the directory is 'store_path' here"
                )
            if settings.store_path is not None:
                store_config["root"] = settings.store_path
            # Checked now, so that an unknown key fails the start and names the key.
            from hicache.adapters.storage.directory_settings import DirectorySettings

            DirectorySettings.from_config(store_config)
        elif settings.store_path is not None:
            raise ConfigError(
                f"hicache sglang backend key 'store_path': only store 'directory' has one, "
                f"store is {shown(settings.store)}"
            )
        elif settings.store == "mooncake" and rest:
            from hicache.adapters.storage.mooncake_config import KEYS

            unknown = sorted(set(rest) - set(KEYS))
            if unknown:
                raise ConfigError(
                    f"hicache sglang backend: unknown key {shown(unknown[0])} (keys of store "
                    f"'mooncake': {', '.join(sorted(KEYS))}; of the backend: "
                    f"{', '.join(BACKEND_KEYS)})"
                )
        return attrs.evolve(settings, store_config=store_config)
