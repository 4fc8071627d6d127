"""Fixtures of the SGLang backend tests: SGLang's storage config and backends built by its factory.

Every test module here calls support.require_sglang() first: without sglang (and without
HICACHE_REQUIRE_SGLANG=1) the module is skipped; with it, the real package is used.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integrations.sglang.support import PROBLEM

MODULE = "hicache.integrations.sglang"


def extra(store_path: Path | str | None, **more: Any) -> dict[str, Any]:
    """The extra config an SGLang user passes (docs/sglang.md), plus ``more``."""
    config: dict[str, Any] = {
        "backend_name": "hicache",
        "module_path": MODULE,
        "class_name": "HiCacheBackend",
        "interface_v1": 1,
        "store": "directory",
    }
    if store_path is not None:
        config["store_path"] = str(store_path)
    config.update(more)
    return config


def storage_config(extra_config: dict[str, Any] | None, **fields: Any) -> Any:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    values: dict[str, Any] = {
        "tp_rank": 0,
        "tp_size": 1,
        "pp_rank": 0,
        "pp_size": 1,
        "attn_cp_rank": 0,
        "attn_cp_size": 1,
        "is_mla_model": False,
        "enable_storage_metrics": False,
        "is_page_first_layout": False,
        "model_name": "org/test-model",
        "extra_config": extra_config,
    }
    values.update(fields)
    return HiCacheStorageConfig(**values)


@pytest.fixture
def make_backend(tmp_path: Path) -> Iterator[Callable[..., Any]]:
    """Build a backend through SGLang's own factory and register ``pool`` (and side pools);
    every backend built is closed at the end of the test."""
    if PROBLEM is not None:
        pytest.skip(PROBLEM)
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    made: list[Any] = []

    def make(
        pool: Any,
        side: dict[str, Any] | None = None,
        *,
        store_path: Path | str | None = None,
        config: dict[str, Any] | None = None,
        **fields: Any,
    ) -> Any:
        cfg = storage_config(extra(store_path or tmp_path / "store", **(config or {})), **fields)
        backend = StorageBackendFactory.create_backend("dynamic", cfg, pool)
        made.append(backend)
        backend.register_mem_pool_host(pool)
        for name, side_pool in (side or {}).items():
            backend.register_mem_host_pool_v2(side_pool, name)
        backend.on_host_pools_registered()
        return backend

    yield make
    for backend in made:
        backend.close()
