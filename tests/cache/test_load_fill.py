"""A load completes a page that is partly on the device (its KV there, its state checkpoint or
window page only on host): only the missing pools are copied into new device pages, the device
copy stays (also when another match pins it), and the hit is whole.

Byte-exact on the real CPU adapters; copy failure and cancellation on the engine's fakes.
"""

from __future__ import annotations

import anyio
import pytest

from hicache.bootstrap.cache import open_cache
from hicache.cache.face import HiCache
from hicache.domain import ConfigError, PoolName, TransferError
from hicache.domain.tiers import Tier
from tests.cache.fake_rig import assert_consistent, cached_on_host, hybrid_plan
from tests.cache.helpers import Request, assert_clean, stack_plan
from tests.engine.fakes import Rig

KV, SWA, MAMBA = PoolName.KV, PoolName.SWA, PoolName.MAMBA


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("name", "pool"), [("state", MAMBA), ("parallel_hybrid", MAMBA), ("sliding", SWA)]
)
async def test_a_pool_evicted_from_the_device_is_loaded_alone_byte_exact(
    name: str, pool: PoolName
) -> None:
    plan, settings = stack_plan(name)
    async with open_cache(plan, backend="torch", settings=settings) as rt:
        cache = rt.cache
        pages = 10 if name == "sliding" else 4
        req = Request(rt, pages)
        await req.insert(cache)
        await cache.wait_idle()  # backed up to host
        assert (await cache.evict(Tier.DEVICE, 100, pool)).evicted >= 1
        async with await cache.match(req.tokens) as m:
            assert m.host_pages == pages
            counts = m.load_counts()
            assert set(counts) == {pool}  # the KV pages on the device are not copied again
            load = await cache.load(m)
            await load.wait()
            assert m.loaded
            placements = m.placements()
            # the KV device pages are the request's own, still there
            assert [w[KV] for w in placements] == req.device[KV][:pages]
            req.check_restored(placements, pages)
        await cache.wait_idle()
        assert_clean(cache)
        assert cache.statistics().loaded_pages == sum(counts.values())


@pytest.mark.asyncio
async def test_a_partial_device_copy_pinned_by_another_match_is_completed() -> None:
    plan, settings = stack_plan("parallel_hybrid")
    async with open_cache(plan, backend="torch", settings=settings) as rt:
        cache = rt.cache
        req = Request(rt, 3)
        await req.insert(cache)
        await cache.wait_idle()
        await cache.evict(Tier.DEVICE, 100, MAMBA)
        async with await cache.match(req.tokens) as first:  # pins the partial device copies
            async with await cache.match(req.tokens) as m:
                assert m.host_pages == 3
                load = await cache.load(m)
                await load.wait()
                req.check_restored(m.placements(), 3)
            # the first match's pages are whole on the device now: nothing left to copy
            joined = await cache.load(first)
            await joined.wait()
            assert joined.handle is None
            req.check_restored(first.placements(), 3)
        await cache.wait_idle()
        assert_clean(cache)


@pytest.mark.asyncio
async def test_a_fill_into_framework_owned_device_pages_takes_only_the_missing_pools() -> None:
    plan, settings = stack_plan("state")
    async with open_cache(
        plan, backend="torch", settings=settings, device_ownership="framework"
    ) as rt:
        cache = rt.cache
        req = Request(rt, 4)
        await req.insert(cache)
        await cache.wait_idle()
        evicted = await cache.evict(Tier.DEVICE, 10, MAMBA)
        assert evicted.freed[MAMBA] == (req.device[MAMBA][0],)  # back to the framework
        async with await cache.match(req.tokens) as m:
            assert m.load_counts() == {MAMBA: 1}
            with pytest.raises(ConfigError, match=r"pass device_pages with \{'mamba': 1\} pages"):
                await cache.load(m)
            with pytest.raises(
                ConfigError,
                match=r"give \{'kv': 4, 'mamba': 1\} pages; this load needs \{'mamba': 1\}",
            ):
                await cache.load(m, {KV: [0, 1, 2, 3], MAMBA: [3]})  # the KV is not wanted
            load = await cache.load(m, {MAMBA: [3]})  # wherever the framework wants it
            await load.wait()
            assert m.placements()[3][MAMBA] == 3
            req.check_restored(m.placements(), 4)
        assert_clean(cache)


# ---- failure paths on the fakes ----------------------------------------------------------


async def _state_off_device(rig: Rig, cache: HiCache, pages: int = 2) -> list[int]:
    """A request of ``pages`` pages with its checkpoint at the end, backed up to host; then its
    checkpoint leaves the device (its KV stays)."""
    tokens = await cached_on_host(rig, cache, pages)  # evicts the device: load it back first
    async with await cache.match(tokens) as m:
        await (await cache.load(m)).wait()
    assert (await cache.evict(Tier.DEVICE, 100, MAMBA)).evicted == 1
    return tokens


def _device_kv(cache: HiCache, tokens: list[int], pages: int) -> list[int]:
    from hicache.domain.keys import chain_keys

    out = []
    for k in chain_keys(tokens, 4)[:pages]:
        where = cache.index.placement(Tier.DEVICE, k)
        assert where is not None
        out.append(where[KV])
    return out


@pytest.mark.asyncio
async def test_a_copy_failure_of_a_fill_frees_its_slot_and_keeps_the_device_copy() -> None:
    rig = Rig(hybrid_plan())
    async with rig.engine, HiCache(rig.engine) as cache:
        tokens = await _state_off_device(rig, cache)
        kv = _device_kv(cache, tokens, 2)
        free_state = rig.device_slots.free_counts()[MAMBA]
        rig.transfer.fail("load", layer=1)
        async with await cache.match(tokens) as m:
            assert m.load_counts() == {MAMBA: 1}
            load = await cache.load(m)
            with pytest.raises(TransferError):
                await load.wait()
        assert rig.device_slots.free_counts()[MAMBA] == free_state
        assert _device_kv(cache, tokens, 2) == kv
        assert_consistent(rig, cache)
        async with await cache.match(tokens) as m:  # carry on: the same prefix loads
            await (await cache.load(m)).wait()
            placements = m.placements()
            assert [w[KV] for w in placements] == kv
            assert rig.transfer.device[MAMBA][0][placements[1][MAMBA]].startswith(b"r0/mamba/0/")
        assert_consistent(rig, cache)


@pytest.mark.asyncio
async def test_cancelling_a_fill_in_flight_returns_its_slot() -> None:
    rig = Rig(hybrid_plan())
    async with rig.engine, HiCache(rig.engine) as cache:
        tokens = await _state_off_device(rig, cache)
        kv = _device_kv(cache, tokens, 2)
        free_state = rig.device_slots.free_counts()[MAMBA]
        gate = rig.transfer.gate("load", layer=2)
        async with await cache.match(tokens) as m:
            load = await cache.load(m)
            await anyio.to_thread.run_sync(gate.entered.wait, 5)
            async with anyio.create_task_group() as tg:
                tg.start_soon(load.cancel)
                await anyio.sleep(0.01)
                gate.open()
            assert load.finished
            assert not load.ok
        assert rig.device_slots.free_counts()[MAMBA] == free_state
        assert _device_kv(cache, tokens, 2) == kv
        assert_consistent(rig, cache)
