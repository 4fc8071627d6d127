"""Mooncake wheel probe shared by the tests that run a real local Mooncake cluster.

- PROBLEM: why the Mooncake client cannot be imported here, or None when it can.
- require_mooncake(): skip the calling test module (with PROBLEM as the reason) where the wheel
  is missing, unless HICACHE_REQUIRE_MOONCAKE=1 (CI sets it): then a missing wheel fails the run.
"""

from __future__ import annotations

import importlib
import os

import pytest


def _wheel_problem() -> str | None:
    try:
        importlib.import_module("mooncake.store")
    except Exception as e:  # ImportError, or OSError for a missing libibverbs.so.1
        return f"the Mooncake client cannot be imported ({e}): pip install 'hicache[mooncake]'"
    return None


PROBLEM = _wheel_problem()


def require_mooncake() -> None:
    """Call at module level, before importing anything that needs the wheel."""
    if PROBLEM is None:
        return
    if os.environ.get("HICACHE_REQUIRE_MOONCAKE") == "1":
        raise RuntimeError(f"HICACHE_REQUIRE_MOONCAKE=1 but {PROBLEM}")
    pytest.skip(PROBLEM, allow_module_level=True)
