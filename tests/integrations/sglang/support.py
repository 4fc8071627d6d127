"""SGLang probe shared by the tests of hicache's SGLang backend.

- PROBLEM: why SGLang's storage interface cannot be imported here, or None when it can.
- require_sglang(): skip the calling test module where sglang is missing, unless
  HICACHE_REQUIRE_SGLANG=1 (CI sets it): then a missing sglang fails the run.

Where no torchvision is installed (a CPU machine: PyPI's torchvision is a CUDA build that does
not import beside a CPU torch), hicache.integrations.sglang.sglang_imports registers a stand-in module
so that SGLang's module-level ``import torchvision`` succeeds while MODULES are imported, then
withdraws it: other tests in the same run see no torchvision, as before. Nothing calls into the
stand-in (a call raises ImportError). Where a real torchvision is installed it is used and
nothing is stood in.
"""

from __future__ import annotations

import importlib
import os

import pytest

from hicache.integrations.sglang.sglang_imports import (
    allow_sglang_without_torchvision,
    withdraw_stand_in,
)

# Every SGLang module the tests (and the modules they test) import, imported here at once, so
# that the torchvision stand-in can be withdrawn before any other test runs.
MODULES = (
    "sglang.srt.mem_cache.hicache_storage",
    "sglang.srt.mem_cache.device_pool_info",
    "sglang.srt.mem_cache.pool_host.common",
    "sglang.srt.mem_cache.pool_host.mha",
    "sglang.srt.mem_cache.pool_host.mla",
    "sglang.srt.mem_cache.pool_host.mamba",
    "sglang.srt.mem_cache.pool_host.dsa",
    "sglang.srt.mem_cache.pool_host.host_pool_decl",
    "sglang.srt.mem_cache.pool_host.minimax_m3_nvfp4",
    "sglang.srt.mem_cache.storage.backend_factory",
    "sglang.srt.mem_cache.storage.file.lru_file_evictor",
    "sglang.srt.mem_cache.utils",
    "sglang.srt.managers.cache_controller",
    "sglang.srt.observability.metrics_collector",
    "hicache.integrations.sglang.backend",
    "hicache.integrations.sglang.bench",
)


def _problem() -> str | None:
    if importlib.util.find_spec("sglang") is None:
        return "sglang is not installed: pip install 'hicache[sglang]' (see docs/sglang.md)"
    stood_in = allow_sglang_without_torchvision()
    try:
        for name in MODULES:
            importlib.import_module(name)
    except Exception as e:
        return f"sglang cannot be imported ({type(e).__name__}: {e})"
    finally:
        if stood_in:
            withdraw_stand_in()
    return None


PROBLEM = _problem()


def require_sglang() -> None:
    """Call at module level, before importing anything that needs sglang."""
    if PROBLEM is None:
        return
    if os.environ.get("HICACHE_REQUIRE_SGLANG") == "1":
        raise RuntimeError(f"HICACHE_REQUIRE_SGLANG=1 but {PROBLEM}")
    pytest.skip(PROBLEM, allow_module_level=True)
