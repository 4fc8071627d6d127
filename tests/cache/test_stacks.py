"""Every stack archetype round-trips byte-exact through the cache face: device -> host -> device.

The request's device pages are filled with random bytes, inserted (write_through backs them up
to host), evicted from the device and overwritten; a later match hits them on host, the load
brings them back, and every byte of every pool (sidecars included) matches what was computed.
"""

from __future__ import annotations

import pytest

from hicache.bootstrap.cache import open_cache
from hicache.domain import ConfigError, PoolName
from hicache.domain.tiers import Tier
from tests.cache.helpers import STACKS, Request, assert_clean, poison_device, stack_plan


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
        assert cache.statistics().hit_tokens.host == pages * cache.page_size
    assert rt.closed


@pytest.mark.asyncio
async def test_a_hole_in_the_sliding_window_moves_the_boundary() -> None:
    plan, settings = stack_plan("sliding")
    async with open_cache(plan, backend="torch", settings=settings) as rt:
        cache = rt.cache
        window = cache.rules.rule(PoolName.SWA).window_pages
        assert window == 8  # gpt-oss: 128 tokens at 16 per page
        pages = 12
        req = Request(rt, pages)
        kv_ids = list(req.device[PoolName.KV])
        swa = list(req.device[PoolName.SWA])
        keep = set(range(pages - window, pages))  # the framework kept only the last window
        swa_ids: list[int | None] = [p if i in keep else None for i, p in enumerate(swa[:pages])]
        await cache.insert(req.tokens, {PoolName.KV: kv_ids, PoolName.SWA: swa_ids})
        rt.runtime.engine.free_device(
            {PoolName.SWA: [swa[i] for i in range(pages) if i not in keep]}
        )
        async with await cache.match(req.tokens) as m:
            assert m.device_pages == pages  # the window before page 12 is whole
        ten = req.tokens[: 10 * cache.page_size]
        async with await cache.match(ten) as m:
            # boundary 10 needs sliding pages 2..9 and 2, 3 are gone; no shorter boundary has
            # a whole window either (it would need pages 0..b-1): no hit at all
            assert m.device_pages == 0
        await cache.wait_idle()
        assert_clean(cache)


@pytest.mark.asyncio
async def test_framework_owned_device_pages_are_named_by_the_framework() -> None:
    plan, settings = stack_plan("dense")
    async with open_cache(
        plan, backend="torch", settings=settings, device_ownership="framework"
    ) as rt:
        cache = rt.cache
        req = Request(rt, 3)  # page ids from device_slots' ranges; the framework owns them
        await req.insert(cache)
        await cache.wait_idle()
        evicted = await cache.evict(Tier.DEVICE, 10)
        assert sorted(evicted.freed[PoolName.KV]) == sorted(req.device[PoolName.KV][:3])
        poison_device(rt)
        async with await cache.match(req.tokens) as m:
            with pytest.raises(ConfigError, match="framework owns device pages"):
                await cache.load(m)
            target = {PoolName.KV: [12, 13, 14]}  # wherever the framework wants them
            load = await cache.load(m, target)
            await load.wait()
            assert [w[PoolName.KV] for w in m.placements()] == [12, 13, 14]
            req.check_restored(m.placements(), 3)
        assert_clean(cache)


def test_the_cache_runtime_served_from_plain_threads() -> None:
    from hicache.cache.sync import open_sync_cache
    from hicache.engine import open_sync

    plan, settings = stack_plan("state")
    rt = open_cache(plan, backend="torch", settings=settings)  # not entered: the sync face runs it
    with open_sync(rt.engine) as sync, open_sync_cache(sync, rt.cache) as cache:
        req = Request(rt, 2)
        pages, checkpoints = req.insert_args()
        cache.insert(req.tokens, pages, checkpoints=checkpoints)
        cache.call(rt.cache.wait_idle)
        cache.evict(Tier.DEVICE, 10)
        poison_device(rt)
        match = cache.match(req.tokens)
        assert match.host_pages == 2
        load = cache.load(match)
        for layer in range(plan.transfer_layers):
            load.wait_layer(layer)
        load.wait()
        req.check_restored(cache.placements(match), 2)
        cache.release(match)
        cache.call(assert_clean, rt.cache)
    rt.close()
    assert rt.closed
    assert rt.runtime.closed
