"""The connector's settings: ``kv_connector_extra_config`` parsed and checked at start.

- ConnectorSettings: host tier size, storage backend and its config, write policy, decode saves.
- ConnectorSettings.from_extra_config: a mapping (vLLM's extra config) to settings; an unknown
  key or a bad value is one ConfigError naming the key, the value and what was expected.

Torch- and vLLM-free, so a bad config is refused before any memory is touched.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from hicache.domain import ConfigError, StorageSettings

BACKENDS = ("directory", "mooncake", "dynamic")
WRITE_POLICIES = ("write_through", "host_only")
KEYS = (
    "host_gib",
    "storage_backend",
    "storage_path",
    "storage_extra_config",
    "write_policy",
    "save_decode",
)


@attrs.frozen(kw_only=True)
class ConnectorSettings:
    """What ``kv_connector_extra_config`` asks of the connector (see docs/vllm.md)."""

    host_gib: float = 4.0
    storage_backend: str | None = None
    storage_path: str | None = None
    storage_extra_config: Mapping[str, Any] = attrs.field(factory=dict)
    write_policy: str = "write_through"
    save_decode: bool = True

    @property
    def host_bytes(self) -> int:
        return int(self.host_gib * (1 << 30))

    @property
    def writes_storage(self) -> bool:
        return self.storage_backend is not None and self.write_policy == "write_through"

    def storage(self) -> StorageSettings | None:
        """The hicache StorageSettings of the store, or None without one."""
        if self.storage_backend is None:
            return None
        extra = dict(self.storage_extra_config)
        if self.storage_backend == "directory":
            extra["root"] = self.storage_path
        return StorageSettings(backend=self.storage_backend, extra_config=extra)

    @classmethod
    def from_extra_config(cls, config: Mapping[str, Any] | None) -> ConnectorSettings:
        config = dict(config or {})
        unknown = sorted(set(config) - set(KEYS))
        if unknown:
            raise ConfigError(
                f"kv_connector_extra_config key {unknown[0]!r} is unknown to HiCacheConnector: "
                f"expected some of {', '.join(KEYS)}"
            )
        out: dict[str, Any] = {}
        if "host_gib" in config:
            v = config["host_gib"]
            if isinstance(v, bool) or not isinstance(v, int | float) or not v > 0:
                raise ConfigError(
                    f"kv_connector_extra_config 'host_gib' = {v!r}: expected a positive number "
                    "of GiB (the host tier's size)"
                )
            out["host_gib"] = float(v)
        backend = config.get("storage_backend")
        if backend is not None and backend not in (*BACKENDS, "none"):
            raise ConfigError(
                f"kv_connector_extra_config 'storage_backend' = {backend!r}: expected one of "
                f"{', '.join(BACKENDS)}, 'none' or null (no storage tier)"
            )
        if backend == "none":
            backend = None
        out["storage_backend"] = backend
        path = config.get("storage_path")
        if backend == "directory":
            if not isinstance(path, str) or not path.strip():
                raise ConfigError(
                    f"kv_connector_extra_config 'storage_path' = {path!r}: the directory store "
                    "needs a non-empty directory path"
                )
            out["storage_path"] = path
        elif path is not None:
            raise ConfigError(
                f"kv_connector_extra_config 'storage_path' = {path!r}: only the 'directory' "
                f"storage backend takes a path (storage_backend is {backend!r})"
            )
        extra = config.get("storage_extra_config", {})
        if not isinstance(extra, Mapping):
            raise ConfigError(
                f"kv_connector_extra_config 'storage_extra_config' = {extra!r}: expected a "
                "mapping (hicache's storage extra config)"
            )
        if extra and backend is None:
            raise ConfigError(
                "kv_connector_extra_config 'storage_extra_config' is set but storage_backend "
                "is null: name a storage backend or drop it"
            )
        out["storage_extra_config"] = dict(extra)
        policy = config.get("write_policy", "write_through")
        if policy not in WRITE_POLICIES:
            raise ConfigError(
                f"kv_connector_extra_config 'write_policy' = {policy!r}: expected one of "
                f"{', '.join(WRITE_POLICIES)}"
            )
        out["write_policy"] = policy
        decode = config.get("save_decode", True)
        if not isinstance(decode, bool):
            raise ConfigError(
                f"kv_connector_extra_config 'save_decode' = {decode!r}: expected true or false"
            )
        out["save_decode"] = decode
        settings = cls(**out)
        if settings.storage_backend is not None:
            settings.storage()  # hicache's own checks of the backend and its extra config
        return settings
