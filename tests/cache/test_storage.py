"""The cache face with a storage tier: prefixes come back from the DirectoryStore after the host
copy is gone (and after a restart), and store faults become misses within the deadline.

Stacks run on the real CPU adapters (open_cache); fault tests on the engine's fakes with
FakeStore behind a real StorageTier (hicache.engine.storage_tier).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import attrs
import pytest

from hicache.adapters.storage import DirectorySettings, DirectoryStore
from hicache.bootstrap.cache import open_cache
from hicache.cache.face import HiCache
from hicache.cache.storage import CacheStorage
from hicache.cache.values import CacheSettings
from hicache.domain import PoolName
from hicache.domain.keys import chain_keys
from hicache.domain.storage import StoreStatus
from hicache.domain.tiers import PerTier, Tier, WriteSettings
from hicache.engine.storage_settings import StorageTierSettings
from hicache.engine.storage_tier import StorageTier
from tests.cache.fake_rig import FakeBuffers
from tests.cache.helpers import STACKS, Request, assert_clean, restore, stack_plan
from tests.engine.fakes import Rig, dense_plan
from tests.storage.fakes import FakeStore

KV = PoolName.KV
STORE_THROUGH = WriteSettings(host="write_through", storage="write_through")


@pytest.mark.asyncio
@pytest.mark.parametrize("name", sorted(STACKS))
async def test_a_prefix_comes_back_from_the_directory_store_after_host_eviction_and_restart(
    name: str, tmp_path: Path
) -> None:
    plan, base = stack_plan(name)
    settings = attrs.evolve(base, writes=STORE_THROUGH)
    pages = 10 if name == "sliding" else 4
    store = DirectoryStore(DirectorySettings(root=str(tmp_path / "store")))
    try:
        async with open_cache(plan, backend="torch", settings=settings, store=store) as rt:
            cache = rt.cache
            req = Request(rt, pages)
            await req.insert(cache)
            await cache.wait_idle()
            assert cache.statistics().stored_pages == pages
            await cache.evict(Tier.DEVICE, 100)
            assert (await cache.evict(Tier.HOST, 100)).evicted == pages
            await restore(rt, req, pages)
            await cache.wait_idle()
            assert_clean(cache)
        # A new process over the same directory: nothing in its index, the store has it all.
        async with open_cache(plan, backend="torch", settings=settings, store=store) as rt2:
            again = Request.replay(rt2, req)  # what comes back is what the first run stored
            await restore(rt2, again, pages)
            assert rt2.cache.statistics().matches == 2
            assert_clean(rt2.cache)
    finally:
        store.close()


# ---- faults with FakeStore ------------------------------------------------------------------


class Clock:
    """time.monotonic() plus a jump the test controls (store deadlines stay real)."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.offset


def _faulty(store: FakeStore, clock: Clock | None = None, **tier: object) -> tuple[Rig, HiCache]:
    rig = Rig(dense_plan())
    settings = StorageTierSettings(**tier)  # type: ignore[arg-type]
    storage_tier = StorageTier(
        store,
        FakeBuffers(),
        {KV: "ns"},
        (KV,),
        settings,
        **({"clock": clock} if clock is not None else {}),
    )
    storage = CacheStorage({KV: storage_tier}, anchor=KV)
    cache = HiCache(rig.engine, settings=CacheSettings(writes=STORE_THROUGH), storage=storage)
    return rig, cache


def _tokens(pages: int) -> list[int]:
    return list(range(pages * 4))


async def _stored(rig: Rig, cache: HiCache, pages: int) -> list[int]:
    tokens = _tokens(pages)
    got = rig.device_slots.allocate({KV: pages}).pages
    await cache.insert(tokens, {KV: list(got[KV])})
    await cache.wait_idle()
    await cache.evict(Tier.DEVICE, 100)
    await cache.evict(Tier.HOST, 100)
    return tokens


def _clean(rig: Rig, cache: HiCache) -> None:
    cache.index.validate()
    s = cache.index.statistics()
    assert s.pinned == PerTier()
    assert s.in_flight == 0
    rig.assert_no_leaks(host_used={KV: s.on_tier.host}, device_used={KV: s.on_tier.device})


@pytest.mark.asyncio
async def test_a_full_store_skips_the_backup_and_nothing_claims_the_pages() -> None:
    store = FakeStore()
    store.fail("put", StoreStatus.FULL, times=100)
    rig, cache = _faulty(store)
    async with rig.engine, cache:
        tokens = await _stored(rig, cache, 2)
        s = cache.statistics()
        assert (s.stored_pages, s.store_failures) == (0, 2)
        assert s.breaker == "closed"  # FULL is an answer, not a store failure
        async with await cache.match(tokens) as m:
            assert m.storage_pages == 0
        _clean(rig, cache)


@pytest.mark.asyncio
async def test_a_transient_get_makes_the_hit_the_leading_run_read() -> None:
    store = FakeStore()
    rig, cache = _faulty(store)
    async with rig.engine, cache:
        tokens = await _stored(rig, cache, 3)
        second = StorageTier.store_keys(cache.storage.anchor_tier, chain_keys(tokens, 4)[1])  # type: ignore[union-attr, arg-type]
        store.fail("get", StoreStatus.TRANSIENT, keys=second)
        async with await cache.match(tokens) as m:
            got = await cache.prefetch(m)
        assert (got.requested, got.read, got.host_pages) == (3, 1, 1)
        _clean(rig, cache)
        again = await cache.prefetch(tokens)  # the store answers now
        assert (again.read, again.host_pages) == (2, 3)
        assert got.skipped is None  # they ran: no skip reason
        assert again.skipped is None
        _clean(rig, cache)


@pytest.mark.asyncio
async def test_fatal_answers_open_the_breaker_and_a_cool_down_closes_it() -> None:
    store = FakeStore()
    clock = Clock()
    rig, cache = _faulty(store, clock, breaker_threshold=2, breaker_cooldown_s=5.0)
    async with rig.engine, cache:
        tokens = await _stored(rig, cache, 2)
        store.fail("get", StoreStatus.FATAL, times=4)  # two prefetches of two keys
        async with await cache.match(tokens) as m:  # the index knows both pages are stored
            assert m.storage_pages == 2
            for _ in range(2):
                assert (await cache.prefetch(m)).read == 0
            assert cache.statistics().breaker == "open"
            gets = store.calls["get"]
            refused = await cache.prefetch(m)
            assert refused.read == 0
            assert store.calls["get"] == gets  # the open breaker kept the store out of it
            _clean(rig, cache)
            clock.offset += 6.0  # the cool-down passed: one probe goes through, and succeeds
            assert (await cache.prefetch(m)).read == 2
        assert cache.statistics().breaker == "closed"
        _clean(rig, cache)
        doc = json.loads(json.dumps(cache.statistics().as_json()))
        assert doc["storage"]["breaker"]["trips"] == 1
        assert doc["breaker"] == "closed"


@pytest.mark.asyncio
async def test_a_slow_store_becomes_a_miss_within_the_deadline() -> None:
    store = FakeStore()
    rig, cache = _faulty(store, batch_pages=1)
    async with rig.engine, cache:
        tokens = await _stored(rig, cache, 6)
        store.slow(0.05)
        start = time.monotonic()
        got = await cache.prefetch(tokens, deadline=start + 0.12)
        elapsed = time.monotonic() - start
        assert got.read < 6
        assert elapsed < 2.0  # the deadline plus one call in flight, not six slow calls
        store.slow(0.0)
        _clean(rig, cache)


@pytest.mark.asyncio
async def test_write_back_evictions_wait_for_their_copies_down_each_tier() -> None:
    store = FakeStore()
    rig = Rig(dense_plan())
    tier = StorageTier(store, FakeBuffers(), {KV: "ns"}, (KV,), StorageTierSettings())
    storage = CacheStorage({KV: tier}, anchor=KV)
    settings = CacheSettings(writes=WriteSettings(host="write_back", storage="write_back"))
    async with rig.engine, HiCache(rig.engine, settings=settings, storage=storage) as cache:
        tokens = _tokens(2)
        got = rig.device_slots.allocate({KV: 2}).pages
        await cache.insert(tokens, {KV: list(got[KV])})
        await cache.wait_idle()
        assert cache.index.statistics().on_tier == PerTier(device=2)  # nothing copied down yet
        freed = await cache.evict(Tier.DEVICE, 2)
        assert sorted(freed.freed[KV]) == sorted(got[KV])  # after the backup finished
        assert cache.index.statistics().on_tier == PerTier(host=2)
        assert store.calls["put"] == 0
        await cache.evict(Tier.HOST, 2)
        assert cache.index.statistics().on_tier == PerTier(storage=2)
        assert len(store.objects) == 2
        _clean(rig, cache)
        assert (await cache.prefetch(tokens)).read == 2


@pytest.mark.asyncio
async def test_host_pages_of_a_store_call_that_overran_are_held_until_the_store_is_healthy() -> (
    None
):
    store = FakeStore()
    rig, cache = _faulty(store, batch_pages=4)
    async with rig.engine, cache:
        tokens = await _stored(rig, cache, 4)
        store.slow(0.03)
        store.unhealthy = "a call overran its deadline and still runs"
        got = await cache.prefetch(tokens, deadline=time.monotonic() + 0.05)
        assert got.read < 4
        s = cache.index.statistics()
        held = rig.host_slots.allocator(KV).used_count() - s.on_tier.host
        assert held == 4 - got.read  # the failed reads' host pages are not reused yet
        store.slow(0.0)
        store.unhealthy = None
        (await cache.match([])).release()  # any call frees them once the store is healthy
        _clean(rig, cache)


@pytest.mark.asyncio
async def test_a_prefetch_cancelled_mid_read_gives_its_host_pages_back() -> None:
    import anyio

    store = FakeStore()
    rig, cache = _faulty(store, batch_pages=1)
    async with rig.engine, cache:
        tokens = await _stored(rig, cache, 4)
        store.slow(0.02)
        for delay in (0.0, 0.01, 0.03, 0.05):
            with anyio.move_on_after(delay):
                await cache.prefetch(tokens)
            await cache.wait_idle()
            _clean(rig, cache)  # whatever was read is on host, the rest is free
            await cache.evict(Tier.HOST, 100)
        store.slow(0.0)
        assert (await cache.prefetch(tokens)).read == 4
