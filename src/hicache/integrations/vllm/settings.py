"""The connector's settings: ``kv_connector_extra_config`` parsed and checked at start.

- ConnectorSettings: host tier size, storage backend and its config, write policy, decode
  saves, load policy (load or recompute), how hicache's metrics are exported (metrics_port, metrics), and the bound of every
  store call (deadline_s, grace_s: hicache.engine.bounded).
- ConnectorSettings.from_extra_config(config, env=None): a mapping (vLLM's extra config) to
  settings; an unknown key or a bad value is one ConfigError naming the key, the value and what
  was expected. The keys that overlap hicache's configuration (host_gib, storage_backend,
  storage_path, storage_extra_config) are then checked again through HiCacheConfig, labelled
  ``kv_connector_extra_config``, on top of the operator's ``$HICACHE_CONFIG`` file and
  ``HICACHE_*`` variables, which fill in what the extra config leaves out
  (docs/vllm.md, "Configuration").
- ConnectorSettings.open_store(): the store they name (Mooncake serving no store:mooncake host
  memory: the connector registers its own pages, and vLLM at tp 1 opens two stores in one
  process).

vLLM-free, so a bad config is refused before any memory is touched; the store's own extra
config is checked by that store's settings parser (DirectorySettings.from_config,
load_mooncake_config's keys and values), which imports hicache's storage adapters.
HiCacheConnector runs this parser from the class hooks vLLM calls while it builds its
configuration, before the model loads (docs/vllm.md, "Bad settings"); ``python -m
hicache.integrations.vllm.check '<json>'`` runs it without vLLM.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import attrs

from hicache.bootstrap.hicache_config import HiCacheConfig
from hicache.domain import ConfigError, StorageSettings
from hicache.domain.errors import shown
from hicache.domain.limits import MAX_BYTES, bounded_seconds, is_finite_number
from hicache.domain.storage import Store
from hicache.domain.store_plugins import StorePlugin
from hicache.integrations.vllm.load_policy import check_mode

BACKENDS = ("directory", "mooncake", "dynamic")
WRITE_POLICIES = ("write_through", "host_only")
KEYS = (
    "host_gib",
    "storage_backend",
    "storage_path",
    "storage_extra_config",
    "write_policy",
    "save_decode",
    "metrics_port",
    "metrics",
    "copy_backend",
    "deadline_s",
    "grace_s",
    "load_policy",
)
SOURCE = "kv_connector_extra_config"
METRICS_MODES = ("off", "register")
COPY_BACKENDS = ("auto", "native", "cuda_batch", "torch")
_GIB = 1 << 30
# The largest host tier accepted: hicache's byte ceiling (hicache.domain.limits.MAX_BYTES).
MAX_HOST_GIB = MAX_BYTES / _GIB
# The store call bound (hicache.engine.bounded). Shorter than the SGLang backend's 10 s + 2 s:
# the scheduler's exists runs on vLLM's scheduling thread, where every running request waits.
DEADLINE_S = 2.0
GRACE_S = 1.0


@attrs.frozen(kw_only=True)
class ConnectorSettings:
    """What ``kv_connector_extra_config`` asks of the connector (see docs/vllm.md)."""

    host_gib: float = 4.0
    storage_backend: str | None = None
    storage_path: str | None = None
    storage_extra_config: Mapping[str, Any] = attrs.field(factory=dict)
    write_policy: str = "write_through"
    save_decode: bool = True
    metrics_port: int | None = None  # serve hicache's metrics: scheduler here, rank r at +1+r
    metrics: str = "off"  # "register": into prometheus_client's global REGISTRY
    # which of hicache's row-copy backends (hicache.adapters.copy.rows) moves blocks between
    # host pages and vLLM's caches: "auto" (memcpy on CPU, cuda_batch on CUDA), "native" (memcpy),
    # "cuda_batch" or "torch"
    copy_backend: str = "auto"
    deadline_s: float = DEADLINE_S  # what one store call may take
    grace_s: float = GRACE_S  # how much longer vLLM waits for a store past its deadline
    # load or recompute (hicache.integrations.vllm.load_policy): measured, always, never
    load_policy: str = "measured"

    @property
    def host_bytes(self) -> int:
        return int(self.host_gib * (1 << 30))

    @property
    def writes_storage(self) -> bool:
        return self.storage_backend is not None and self.write_policy == "write_through"

    def bounds(self) -> dict[str, float]:
        """The bound of every store call: BoundedSettings' keyword arguments."""
        return {"deadline_s": self.deadline_s, "grace_s": self.grace_s}

    def storage(self) -> StorageSettings | None:
        """The hicache StorageSettings of the store, or None without one."""
        if self.storage_backend is None:
            return None
        extra = dict(self.storage_extra_config)
        if self.storage_backend == "directory":
            extra["root"] = self.storage_path
        return StorageSettings(backend=self.storage_backend, extra_config=extra)

    def open_store(self) -> Store | None:
        """The store these settings name (None without one), opened as hicache.bootstrap's
        open_store does, except that Mooncake serves no store:mooncake host memory: the
        connector registers its own host pages (Store.register), and vLLM at tp 1 runs the
        scheduler and the worker in one process, each opening a store (a second store serving
        that memory is refused)."""
        from hicache.bootstrap.storage import open_mooncake, open_store

        storage = self.storage()
        if storage is None:
            return None
        if storage.backend == "mooncake":
            return open_mooncake(storage.extra_config, provide_host_memory=False)
        return open_store(storage)

    @classmethod
    def from_extra_config(
        cls, config: Mapping[str, Any] | None, env: Mapping[str, str] | None = None
    ) -> ConnectorSettings:
        """Settings from vLLM's extra config, then hicache's file and environment (``env``,
        default os.environ; ``{}`` reads neither) for the overlapping keys it leaves out."""
        if config is None:
            config = {}
        if not isinstance(config, Mapping):  # pairs, text, a number: never read as a mapping
            raise ConfigError(
                f"{SOURCE} must be a mapping of text keys (a JSON object), got "
                f"{type(config).__name__} {shown(config)}"
            )
        config = dict(config)
        _string_keys(config, SOURCE)
        unknown = sorted(set(config) - set(KEYS))
        if unknown:
            raise ConfigError(
                f"kv_connector_extra_config key {shown(unknown[0])} is unknown to HiCacheConnector: "
                f"expected some of {', '.join(KEYS)}"
            )
        out: dict[str, Any] = {}
        if "host_gib" in config:
            v = config["host_gib"]
            if not is_finite_number(v) or not 0 < v <= MAX_HOST_GIB:
                raise ConfigError(
                    f"kv_connector_extra_config 'host_gib' = {shown(v)}: expected a finite "
                    f"number of GiB in (0, {MAX_HOST_GIB:.0f}] (the host tier's size)"
                )
            out["host_gib"] = float(v)
        backend = config.get("storage_backend")
        if backend is not None and backend not in (*BACKENDS, "none"):
            raise ConfigError(
                f"kv_connector_extra_config 'storage_backend' = {shown(backend)}: expected one of "
                f"{', '.join(BACKENDS)}, 'none' or null (no storage tier)"
            )
        if backend == "none":
            backend = None
        out["storage_backend"] = backend
        path = config.get("storage_path")
        if backend == "directory":
            if not isinstance(path, str) or not path.strip():
                raise ConfigError(
                    f"kv_connector_extra_config 'storage_path' = {shown(path)}: the directory store "
                    "needs a non-empty directory path"
                )
            out["storage_path"] = path
        elif path is not None:
            raise ConfigError(
                f"kv_connector_extra_config 'storage_path' = {shown(path)}: only the 'directory' "
                f"storage backend takes a path (storage_backend is {shown(backend)})"
            )
        extra = config.get("storage_extra_config", {})
        if not isinstance(extra, Mapping):
            raise ConfigError(
                f"kv_connector_extra_config 'storage_extra_config' = {shown(extra)}: expected a "
                "mapping (hicache's storage extra config)"
            )
        _string_keys(extra, f"{SOURCE} 'storage_extra_config'")
        if backend == "directory" and "root" in extra:
            raise ConfigError(
                f"kv_connector_extra_config 'storage_extra_config' key 'root' = "
                f"{shown(extra['root'])}: the directory store's root is 'storage_path' here "
                "(drop 'root')"
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
                f"kv_connector_extra_config 'write_policy' = {shown(policy)}: expected one of "
                f"{', '.join(WRITE_POLICIES)}"
            )
        out["write_policy"] = policy
        decode = config.get("save_decode", True)
        if not isinstance(decode, bool):
            raise ConfigError(
                f"kv_connector_extra_config 'save_decode' = {shown(decode)}: expected true or false"
            )
        out["save_decode"] = decode
        port = config.get("metrics_port")
        if port is not None and (
            isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535
        ):
            raise ConfigError(
                f"kv_connector_extra_config 'metrics_port' = {shown(port)}: expected a port in "
                "1..65535 (the scheduler's; worker rank r serves port + 1 + r) or null"
            )
        out["metrics_port"] = port
        mode = config.get("metrics", "off")
        if mode not in METRICS_MODES:
            raise ConfigError(
                f"kv_connector_extra_config 'metrics' = {shown(mode)}: expected one of "
                f"{', '.join(METRICS_MODES)}"
            )
        out["metrics"] = mode
        copy = config.get("copy_backend", "auto")
        if copy not in COPY_BACKENDS:
            raise ConfigError(
                f"kv_connector_extra_config 'copy_backend' = {shown(copy)}: expected one of "
                f"{', '.join(COPY_BACKENDS)}"
            )
        out["copy_backend"] = copy
        for name in ("deadline_s", "grace_s"):
            if name in config:
                out[name] = bounded_seconds(
                    config[name], f"kv_connector_extra_config {shown(name)}", positive=True
                )
        out["load_policy"] = check_mode(config.get("load_policy", "measured"))
        _layer_hicache_config(config, out, os.environ if env is None else env)
        settings = cls(**out)
        storage = settings.storage()  # hicache's own checks of the backend and its extra config
        if storage is not None and settings.storage_backend is not None:
            _check_store_config(settings.storage_backend, storage.extra_config)
        return settings


def _string_keys(config: Mapping[Any, Any], where: str) -> None:
    bad = [k for k in config if not isinstance(k, str)]
    if bad:
        raise ConfigError(f"{where} key {shown(bad[0])}: expected string keys (JSON object keys)")


def _check_store_config(backend: str, extra: Mapping[str, Any]) -> None:
    """The store's own parser over its extra config, so that a misspelt or bad store key fails
    here (before memory is touched or the store opened), as the SGLang backend does. The
    "dynamic" plug-in's keys other than those naming it are the plug-in's to check.
    Imports hicache's storage adapters (and torch through them) only when a store is set."""
    where = f"{SOURCE} 'storage_extra_config' (store {shown(backend)})"
    if backend == "directory":
        from hicache.adapters.storage.directory_settings import DirectorySettings

        try:
            DirectorySettings.from_config(extra)
        except (TypeError, ValueError) as exc:  # ConfigError is a ValueError
            raise ConfigError(f"{where}: {exc}") from exc
    elif backend == "mooncake":
        from hicache.adapters.storage.mooncake_config import KEYS as MOONCAKE_KEYS
        from hicache.adapters.storage.mooncake_config import load_mooncake_config

        unknown = sorted(set(extra) - set(MOONCAKE_KEYS))
        if unknown:
            raise ConfigError(
                f"{where} key {shown(unknown[0])} is unknown to the Mooncake store: expected some of "
                f"{', '.join(MOONCAKE_KEYS)}"
            )
        if "master_server_address" in extra:  # else the store reads its file or environment
            try:
                load_mooncake_config(extra, environ={})
            except (TypeError, ValueError) as exc:
                raise ConfigError(f"{where}: {exc}") from exc
    elif backend == "dynamic":
        try:
            StorePlugin.from_extra_config(extra)  # the keys naming it; the rest is the plug-in's
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from exc


def _layer_hicache_config(
    config: Mapping[str, Any], out: dict[str, Any], env: Mapping[str, str]
) -> None:
    """Check the overlapping keys through HiCacheConfig and fill ``out`` from the operator's
    file and environment where the extra config says nothing (the extra config wins)."""
    given: dict[str, Any] = {}
    if "host_gib" in config:
        given["plan.host_size"] = int(out["host_gib"] * _GIB)
    if "storage_backend" in config:  # the storage section comes whole from one place
        given["storage.backend"] = out["storage_backend"]
        extra = dict(out["storage_extra_config"])
        if out["storage_backend"] == "directory":
            extra["root"] = out["storage_path"]
        given["storage.extra_config"] = extra
    hc = HiCacheConfig.load(env=env).with_values(given, source=SOURCE)
    if "host_gib" not in config and hc.value("plan.host_size") is not None:
        out["host_gib"] = hc.value("plan.host_size") / _GIB
    if "storage_backend" in config:
        return
    backend = hc.value("storage.backend")
    if backend is None:
        return
    where = hc.source("storage.backend")
    if backend not in BACKENDS:
        raise ConfigError(
            f"storage.backend = {shown(backend)} from {where}: HiCacheConnector supports "
            f"{', '.join(BACKENDS)} (or set 'storage_backend' in {SOURCE})"
        )
    extra = dict(hc.value("storage.extra_config"))
    out["storage_backend"] = backend
    if backend == "directory":
        root = extra.pop("root", None)
        if not isinstance(root, str) or not root.strip():
            raise ConfigError(
                f"storage.extra_config = {shown(hc.value('storage.extra_config'))} from "
                f"{hc.source('storage.extra_config')}: the directory store needs a 'root' "
                f"(storage.backend = 'directory' from {where})"
            )
        out["storage_path"] = root
    out["storage_extra_config"] = extra
