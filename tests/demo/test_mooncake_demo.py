"""The demo's storage hit through Mooncake: a local master and storage node started by
``open_named_store("mooncake", {})``, the host copy evicted, prefetch, load, identical output.

Skipped (with the reason) where the Mooncake wheel cannot be imported, unless
HICACHE_REQUIRE_MOONCAKE=1 (CI sets it): then a missing wheel fails the run.
"""

from __future__ import annotations

import pytest

from tests.storage.mooncake_support import require_mooncake

require_mooncake()

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
