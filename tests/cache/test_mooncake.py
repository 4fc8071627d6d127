"""The cache face over MooncakeStore on a real local cluster (a master and a storage node).

Dense, state and indexer stacks: a prefix stored from the device comes back byte-exact after the
host copy is evicted (and in a fresh cache whose index knows nothing); a page missing in the
store makes the hit the leading run actually read. Skipped without the Mooncake wheel.
"""

from __future__ import annotations

from collections.abc import Iterator

import attrs
import pytest

from tests.storage.mooncake_support import require_mooncake

require_mooncake()

from hicache.adapters.storage.mooncake import MooncakeStore  # noqa: E402
from hicache.adapters.storage.mooncake_config import load_mooncake_config  # noqa: E402
from hicache.adapters.storage.mooncake_local import LocalMooncake, local_mooncake  # noqa: E402
from hicache.bootstrap.cache import open_cache  # noqa: E402
from hicache.domain.keys import chain_keys  # noqa: E402
from hicache.domain.namespace import RankIdentity  # noqa: E402
from hicache.domain.tiers import Tier, WriteSettings  # noqa: E402
from tests.cache.helpers import Request, assert_clean, restore, stack_plan  # noqa: E402

pytestmark = [pytest.mark.mooncake, pytest.mark.timeout(120)]
THROUGH = WriteSettings(host="write_through", storage="write_through")


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalMooncake]:
    with local_mooncake(segment_bytes=256 << 20) as c:
        yield c


@pytest.fixture
def store(cluster: LocalMooncake) -> Iterator[MooncakeStore]:
    s = MooncakeStore.open(load_mooncake_config(cluster.extra_config()))
    try:
        yield s
    finally:
        s.close()


def _rank(request: pytest.FixtureRequest) -> RankIdentity:
    """A model name of this test alone (the module's cluster outlives each test)."""
    name = request.node.name.replace("[", ".").replace("]", "")
    return RankIdentity(model=f"mc.{name}"[-60:])


@pytest.mark.asyncio
@pytest.mark.parametrize("name", ["dense", "state", "indexer"])
async def test_a_prefix_comes_back_from_mooncake_after_host_eviction(
    name: str, store: MooncakeStore, request: pytest.FixtureRequest
) -> None:
    plan, base = stack_plan(name)
    settings = attrs.evolve(base, writes=THROUGH)
    rank = _rank(request)
    pages = 3
    opts = {"backend": "torch", "settings": settings, "store": store, "rank": rank}
    async with open_cache(plan, **opts) as rt:  # type: ignore[arg-type]
        cache = rt.cache
        req = Request(rt, pages)
        await req.insert(cache)
        await cache.wait_idle()
        assert cache.statistics().stored_pages == pages
        await cache.evict(Tier.DEVICE, 100)
        await cache.evict(Tier.HOST, 100)
        await restore(rt, req, pages)
        await cache.wait_idle()
        assert_clean(cache)
    async with open_cache(plan, **opts) as rt2:  # type: ignore[arg-type]
        await restore(rt2, Request.replay(rt2, req), pages)  # found through exists
        assert_clean(rt2.cache)


@pytest.mark.asyncio
@pytest.mark.parametrize("name", ["dense", "indexer"])
async def test_a_page_missing_in_mooncake_makes_the_hit_the_leading_run_read(
    name: str, store: MooncakeStore, request: pytest.FixtureRequest
) -> None:
    plan, base = stack_plan(name)
    settings = attrs.evolve(base, writes=THROUGH)
    opts = {"backend": "torch", "settings": settings, "store": store, "rank": _rank(request)}
    pages = 4
    async with open_cache(plan, **opts) as rt:  # type: ignore[arg-type]
        req = Request(rt, pages)
        await req.insert(rt.cache)
        await rt.cache.wait_idle()
        # The third page goes missing in the store (nothing read it: no lease holds it).
        tier = rt.storage.anchor_tier  # type: ignore[union-attr]
        third = chain_keys(req.tokens, rt.cache.page_size)[2]
        assert all(s.ok for s in store.remove(tier.store_keys(third)))  # type: ignore[attr-defined]
    async with open_cache(plan, **opts) as rt2:  # type: ignore[arg-type]
        cache = rt2.cache
        async with await cache.match(req.tokens) as m:
            assert m.storage_pages == 2  # the leading run the store holds
            got = await cache.prefetch(m)
            assert (got.requested, got.read, got.host_pages) == (2, 2, 2)
        async with await cache.match(req.tokens) as m:
            assert (m.host_pages, m.storage_pages) == (2, 2)
            load = await cache.load(m)
            await load.wait()
            Request.replay(rt2, req).check_restored(m.placements(), 2)
        assert_clean(cache)
