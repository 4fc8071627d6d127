"""Every stack archetype round-trips byte-exact through the cache face: device -> host -> device.

The request's device pages are filled with random bytes, inserted (write_through backs them up
to host), evicted from the device and overwritten; a later match hits them on host, the load
brings them back, and every byte of every pool (sidecars included) matches what was computed.
"""

from __future__ import annotations

import pytest

from hicache.bootstrap.cache import open_cache
from hicache.domain.tiers import Tier
from tests.engine.cache_helpers import STACKS, Request, assert_clean, poison_device, stack_plan


@pytest.mark.asyncio
@pytest.mark.parametrize("name", sorted(STACKS))
async def test_a_prefix_comes_back_byte_exact_from_host(name: str) -> None:
    plan, settings = stack_plan(name)
    async with open_cache(plan, backend="torch", settings=settings) as rt:
        cache = rt.cache
        pages = 10 if name == "sliding" else 4
        req = Request(rt, pages)
        await req.insert(cache)
        await cache.wait_idle()
        evicted = await cache.evict(Tier.DEVICE, 100)
        assert evicted.evicted == pages
        poison_device(rt)
        match = await cache.match(req.tokens)
        assert (match.device_pages, match.host_pages) == (0, pages)
        load = await cache.load(match)
        for layer in range(plan.transfer_layers):
            load.wait_layer(layer)
        await load.wait()
        assert match.loaded
        assert req.check_restored(match.placements(), pages) >= pages
        match.release()
        assert_clean(cache)
        assert cache.statistics().hit_tokens[1] == pages * cache.page_size
    assert rt.closed
