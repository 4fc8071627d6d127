"""Prefetch completes pages that are on host without every pool their hit needs: the missing
pools' objects (a state checkpoint, window pages) come from the store into newly allocated host
pages of those pools only, and the hit is whole again.

Byte-exact on the real CPU adapters with a DirectoryStore; failure paths (MISS, a store error,
cancellation, the deadline) on the engine's fakes with FakeStore behind real StorageTiers.
"""

from __future__ import annotations

import time
from pathlib import Path

import anyio
import attrs
import pytest

from hicache.adapters.storage import DirectorySettings, DirectoryStore
from hicache.bootstrap.cache import open_cache
from hicache.cache.face import HiCache
from hicache.cache.storage import CacheStorage, TierPort
from hicache.cache.values import CacheSettings
from hicache.domain import PoolName
from hicache.domain.keys import chain_keys
from hicache.domain.storage import StoreKey, StoreStatus
from hicache.domain.tiers import Tier, WriteSettings
from hicache.engine.storage_settings import StorageTierSettings
from hicache.engine.storage_tier import StorageTier
from tests.cache.fake_rig import FakeBuffers, assert_consistent, cached_on_host, hybrid_plan
from tests.cache.helpers import Request, assert_clean, poison_device, stack_plan
from tests.engine.fakes import Rig
from tests.storage.fakes import FakeStore

KV, SWA, MAMBA, IDX = PoolName.KV, PoolName.SWA, PoolName.MAMBA, PoolName.INDEXER
STORE_THROUGH = WriteSettings(host="write_through", storage="write_through")


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("name", "pool"), [("state", MAMBA), ("parallel_hybrid", MAMBA), ("sliding", SWA)]
)
async def test_a_pool_evicted_from_host_comes_back_from_the_store_byte_exact(
    name: str, pool: PoolName, tmp_path: Path
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
            # Only the state checkpoint (or the window pages) leaves host: the anchor stays.
            assert (await cache.evict(Tier.HOST, 100, pool)).evicted >= 1
            kv_host = {k: cache.index.placement(Tier.HOST, k) for k in req_keys(cache, req)}
            assert all(w is not None and KV in w for w in kv_host.values())
            poison_device(rt)
            async with await cache.match(req.tokens) as m:
                assert m.host_pages < pages
                assert m.storage_pages == pages
                got = await cache.prefetch(m)
            assert got.host_pages == pages
            assert got.read >= 1
            # The anchor's host pages were kept, not read again.
            for k, w in kv_host.items():
                now = cache.index.placement(Tier.HOST, k)
                assert now is not None
                assert w is not None
                assert now[KV] == w[KV]
            async with await cache.match(req.tokens) as m:
                assert m.host_pages == pages
                load = await cache.load(m)
                await load.wait()
                req.check_restored(m.placements(), pages)
            await cache.wait_idle()
            assert_clean(cache)
    finally:
        store.close()


def req_keys(cache: HiCache, req: Request) -> list[bytes]:
    return chain_keys(req.tokens, cache.page_size)[: req.pages]


# ---- failure paths with FakeStore -----------------------------------------------------------


def _rig(store: FakeStore, **tier: object) -> tuple[Rig, HiCache]:
    rig = Rig(hybrid_plan())
    settings = StorageTierSettings(**tier)  # type: ignore[arg-type]
    names = {KV: "ns", IDX: "ns", MAMBA: "ns"}
    buffers = FakeBuffers()
    tiers: dict[PoolName, TierPort] = {
        KV: StorageTier(store, buffers, names, (KV, IDX), settings),
        MAMBA: StorageTier(store, buffers, names, (MAMBA,), settings),
    }
    storage = CacheStorage(tiers, anchor=KV)
    return rig, HiCache(rig.engine, settings=CacheSettings(writes=STORE_THROUGH), storage=storage)


async def _state_only_in_storage(rig: Rig, cache: HiCache, pages: int = 4) -> list[int]:
    """A request of ``pages`` pages (checkpoint at the end) on host and in the store, then off
    the device, and its checkpoint off host: the anchor's host pages stay."""
    tokens = await cached_on_host(rig, cache, pages)
    assert cache.statistics().stored_pages == pages
    assert (await cache.evict(Tier.HOST, 100, MAMBA)).evicted == 1
    m = cache.index.match(chain_keys(tokens, 4))
    assert (m.host_pages, m.storage_pages) == (0, pages)
    return tokens


def _state_key(cache: HiCache, tokens: list[int], page: int) -> list[StoreKey]:
    tier = cache.storage.tiers[MAMBA]  # type: ignore[union-attr]
    return StorageTier.store_keys(tier, chain_keys(tokens, 4)[page])  # type: ignore[arg-type]


def _consistent(rig: Rig, cache: HiCache, pages: int) -> None:
    """Index invariants, no pins or tickets, the anchor's host pages all still there, and every
    MAMBA host slot given out is one the index holds."""
    assert_consistent(rig, cache)
    assert cache.index.statistics().on_tier.host == pages
    on = sum(
        MAMBA in (cache.index.placement(Tier.HOST, k) or {})
        for k in list(cache.index._pages)  # every page the index knows
    )
    assert rig.host_slots.allocator(MAMBA).used_count() == on


@pytest.mark.asyncio
async def test_a_fill_reads_only_the_missing_pools_objects() -> None:
    store = FakeStore()
    rig, cache = _rig(store)
    async with rig.engine, cache:
        tokens = await _state_only_in_storage(rig, cache)
        gets = store.calls["get"]
        got = await cache.prefetch(tokens)
        assert (got.requested, got.read, got.host_pages) == (1, 1, 4)
        assert store.calls["get"] - gets == 1  # one object: the checkpoint, no KV or indexer
        _consistent(rig, cache, 4)
        assert rig.host_slots.allocator(MAMBA).used_count() == 1
        async with await cache.match(tokens) as m:
            assert m.host_pages == 4
            load = await cache.load(m)
            await load.wait()
        _consistent(rig, cache, 4)


@pytest.mark.asyncio
@pytest.mark.parametrize("status", [StoreStatus.MISS, StoreStatus.TRANSIENT, StoreStatus.FATAL])
async def test_a_failed_fill_frees_its_slot_and_keeps_the_anchor(status: StoreStatus) -> None:
    store = FakeStore()
    rig, cache = _rig(store)
    async with rig.engine, cache:
        tokens = await _state_only_in_storage(rig, cache)
        store.fail("get", status, keys=_state_key(cache, tokens, 3))
        got = await cache.prefetch(tokens)
        assert (got.requested, got.read, got.host_pages) == (1, 0, 0)
        _consistent(rig, cache, 4)
        key = chain_keys(tokens, 4)[3]
        # only the checkpoint's storage entry is dropped; the anchor's stays known
        assert cache.index.placement(Tier.STORAGE, key) == {KV: 0, IDX: 0}
        again = await cache.prefetch(tokens)  # the store answers now (its exists hint)
        assert (again.read, again.host_pages) == (1, 4)
        _consistent(rig, cache, 4)


@pytest.mark.asyncio
async def test_a_store_call_that_raises_fails_the_fill_cleanly() -> None:
    store = FakeStore()
    rig, cache = _rig(store)
    async with rig.engine, cache:
        tokens = await _state_only_in_storage(rig, cache)
        store.raise_on("get", OSError("the store's socket closed"))
        got = await cache.prefetch(tokens)
        assert (got.read, got.host_pages) == (0, 0)
        _consistent(rig, cache, 4)
        assert (await cache.prefetch(tokens)).host_pages == 4
        _consistent(rig, cache, 4)


@pytest.mark.asyncio
async def test_a_fill_past_its_deadline_is_a_miss_and_frees_its_slot() -> None:
    store = FakeStore()
    rig, cache = _rig(store)
    async with rig.engine, cache:
        tokens = await _state_only_in_storage(rig, cache)
        store.slow(0.05)
        got = await cache.prefetch(tokens, deadline=time.monotonic() - 1.0)
        assert (got.read, got.host_pages) == (0, 0)
        store.slow(0.0)
        _consistent(rig, cache, 4)


@pytest.mark.asyncio
async def test_a_fill_cancelled_mid_read_gives_its_slot_back() -> None:
    store = FakeStore()
    rig, cache = _rig(store)
    async with rig.engine, cache:
        tokens = await _state_only_in_storage(rig, cache)
        store.slow(0.02)
        for delay in (0.0, 0.005, 0.03, 0.06):
            with anyio.move_on_after(delay):
                await cache.prefetch(tokens)
            await cache.wait_idle()
            _consistent(rig, cache, 4)  # whatever was read is on host, the rest is free
            await cache.evict(Tier.HOST, 100, MAMBA)
        store.slow(0.0)
        assert (await cache.prefetch(tokens)).host_pages == 4
        _consistent(rig, cache, 4)


@pytest.mark.asyncio
async def test_a_prefetch_mixes_whole_pages_and_fills() -> None:
    store = FakeStore()
    rig, cache = _rig(store)
    async with rig.engine, cache:
        tokens = await _state_only_in_storage(rig, cache)
        await cache.evict(Tier.HOST, 2)  # two of the pages leave host whole
        keys = chain_keys(tokens, 4)
        gone = [cache.index.placement(Tier.HOST, k) is None for k in keys[:4]]
        assert sum(gone) == 2
        assert not gone[3]  # the page whose checkpoint is missing stays: a fill
        got = await cache.prefetch(tokens)
        assert (got.requested, got.read, got.host_pages) == (3, 3, 4)
        _consistent(rig, cache, 4)
