"""SGLang probe shared by the tests of hicache's SGLang backend.

- PROBLEM: why SGLang's storage interface cannot be imported here, or None when it can.
- require_sglang(): skip the calling test module where sglang is missing, unless
  HICACHE_REQUIRE_SGLANG=1 (CI sets it): then a missing sglang fails the run.

Where no torchvision is installed (a CPU machine: PyPI's torchvision is a CUDA build that does
not import beside a CPU torch), hicache.integrations.sglang_imports registers a stand-in module
so that SGLang's module-level ``import torchvision`` succeeds; nothing here calls into it (a call
raises ImportError). Where a real torchvision is installed it is used and nothing is stood in.
"""

from __future__ import annotations

import importlib
import os

import pytest

from hicache.integrations.sglang_imports import allow_sglang_without_torchvision


def _problem() -> str | None:
    if importlib.util.find_spec("sglang") is None:
        return "sglang is not installed: pip install 'hicache[sglang]' (see docs/sglang.md)"
    allow_sglang_without_torchvision()
    try:
        importlib.import_module("sglang.srt.mem_cache.hicache_storage")
        importlib.import_module("sglang.srt.mem_cache.pool_host.mha")
    except Exception as e:
        return f"sglang cannot be imported ({type(e).__name__}: {e})"
    return None


PROBLEM = _problem()


def require_sglang() -> None:
    """Call at module level, before importing anything that needs sglang."""
    if PROBLEM is None:
        return
    if os.environ.get("HICACHE_REQUIRE_SGLANG") == "1":
        raise RuntimeError(f"HICACHE_REQUIRE_SGLANG=1 but {PROBLEM}")
    pytest.skip(PROBLEM, allow_module_level=True)
