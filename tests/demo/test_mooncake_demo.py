"""The demo's storage hit through Mooncake: a local master and storage node started by
``open_named_store("mooncake", {})``, the host copy evicted, prefetch, load, identical output.

Skipped (with the reason) where the Mooncake wheel cannot be imported, unless
HICACHE_REQUIRE_MOONCAKE=1 (CI sets it): then a missing wheel fails the run.
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


_PROBLEM = _wheel_problem()
if _PROBLEM is not None:
    if os.environ.get("HICACHE_REQUIRE_MOONCAKE") == "1":
        raise RuntimeError(f"HICACHE_REQUIRE_MOONCAKE=1 but {_PROBLEM}")
    pytest.skip(_PROBLEM, allow_module_level=True)

from hicache.demo.harness import compare  # noqa: E402
from hicache.demo.workload import open_demo_store  # noqa: E402
from tests.demo.conftest import prompt, serving  # noqa: E402

pytestmark = [pytest.mark.mooncake, pytest.mark.timeout(120)]


@pytest.mark.asyncio
async def test_a_mooncake_storage_hit_matches_recompute() -> None:
    with open_demo_store("mooncake") as store:
        assert store is not None
        async with serving(store) as server:
            result = await compare(server, prompt(448), 384, decode_steps=2, tier="storage")
            assert result.max_abs_diff <= 1e-5
            assert result.tokens_identical
            assert result.cached.hit == 384
            assert server.cache.statistics().prefetched_pages > 0
