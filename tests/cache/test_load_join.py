"""Two requests loading the same host pages at once: the second joins the first (the pages are
then device hits for it too, pinned for it) instead of preparing them twice. Found by the
concurrent soak (``bench soak --concurrency 4``: "load: page ... is already on DEVICE or on its
way"). Each test holds one request at an await of its load while the other acts."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from hicache.bootstrap.cache import CacheRuntime, open_cache
from hicache.cache.match import CacheLoad, CacheMatch
from hicache.domain import PoolName
from hicache.domain.tiers import Tier
from tests.cache.helpers import KV, Request, assert_clean, stack_plan


class Gate:
    """Holds the first call of a wrapped coroutine function until ``open()``."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self.armed = True
        self.entered = anyio.Event()
        self.gate = anyio.Event()

    async def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.armed:
            self.armed = False
            self.entered.set()
            await self.gate.wait()
        return await self.fn(*args, **kwargs)


async def _on_host_only(rt: CacheRuntime, pages: int) -> Request:
    cache = rt.cache
    req = Request(rt, pages)
    await req.insert(cache)
    await cache.wait_idle()  # write_through: the pages are backed up to host
    await cache.evict(Tier.DEVICE, 100)
    await cache.wait_idle()
    m = await cache.match(req.tokens)
    assert (m.device_pages, m.host_pages) == (0, pages)
    m.release()
    return req


async def _race(
    rt: CacheRuntime, req: Request, hold: Gate
) -> tuple[CacheMatch, CacheMatch, CacheLoad, CacheLoad]:
    """Match twice; load the first (held by ``hold``), load the second meanwhile."""
    cache = rt.cache
    first = await cache.match(req.tokens)
    second = await cache.match(req.tokens)
    loads: dict[str, CacheLoad] = {}

    async def load(name: str, m: CacheMatch) -> None:
        loads[name] = ld = await cache.load(m)
        await ld.wait()

    async with anyio.create_task_group() as tg:
        tg.start_soon(load, "first", first)
        await hold.entered.wait()
        tg.start_soon(load, "second", second)
        for _ in range(20):  # let the second get as far as it can
            await anyio.lowlevel.checkpoint()
        hold.gate.set()
    return first, second, loads["first"], loads["second"]


async def _check(rt: CacheRuntime, req: Request, first: CacheMatch, second: CacheMatch) -> None:
    cache = rt.cache
    for m in (first, second):
        assert m.loaded
        req.check_restored(m.placements(), req.pages)
        for key in m.keys[: req.pages]:
            assert key in m.pins.device  # a device hit for each, pinned for each
    assert cache.index.pins(Tier.DEVICE, first.keys[0]) == 2
    first.release()
    second.release()
    await cache.wait_idle()
    assert_clean(cache)


@pytest.mark.asyncio
@pytest.mark.parametrize("stack", ["dense", "sliding"])
async def test_a_load_issued_while_another_load_of_the_same_pages_starts_joins_it(
    stack: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    plan, settings = stack_plan(stack)
    async with open_cache(plan, backend="torch", settings=settings) as rt:
        req = await _on_host_only(rt, 3)
        hold = Gate(rt.cache.engine.load)  # the first load is prepared, the copy not yet issued
        monkeypatch.setattr(rt.cache.engine, "load", hold)
        first, second, a, b = await _race(rt, req, hold)
        assert a.handle is not None  # copied once, by the first
        assert b.handle is None
        await _check(rt, req, first, second)


@pytest.mark.asyncio
@pytest.mark.parametrize("stack", ["dense", "sliding"])
async def test_a_load_whose_allocation_waited_joins_a_load_that_brought_its_pages_meanwhile(
    stack: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    plan, settings = stack_plan(stack)
    async with open_cache(plan, backend="torch", settings=settings) as rt:
        req = await _on_host_only(rt, 3)
        anchor = rt.cache.engine.device_slots.allocator(rt.cache.rules.anchor)
        before = anchor.used_count()
        hold = Gate(rt.cache.work.allocate)  # the first waits for device pages (an eviction)
        monkeypatch.setattr(rt.cache.work, "allocate", hold)
        first, second, a, b = await _race(rt, req, hold)
        assert a.handle is None  # the first joined
        assert b.handle is not None  # the second copied
        await _check(rt, req, first, second)
        assert anchor.used_count() == before + 3  # the first's own pages came back


@pytest.mark.asyncio
@pytest.mark.parametrize("stack", ["parallel_hybrid", "sliding"])
async def test_a_page_the_device_holds_without_the_pools_the_match_restores_gets_only_those(
    stack: str,
) -> None:
    # Found by the soak as "already on DEVICE" on the parallel hybrid stack: after the match,
    # another request inserted the same pages without a state checkpoint / window page. The
    # load keeps that device copy and copies only the pools it lacks.
    plan, settings = stack_plan(stack)
    async with open_cache(plan, backend="torch", settings=settings) as rt:
        cache = rt.cache
        req = await _on_host_only(rt, 3)
        m = await cache.match(req.tokens)
        ids = rt.runtime.device_slots.allocate({KV: 3}).pages[KV]
        # checkpoints={}: inserted on purpose without a state checkpoint
        await cache.insert(req.tokens[: 3 * cache.page_size], {KV: list(ids)}, checkpoints={})
        assert cache.index.placement(Tier.DEVICE, m.keys[2]) == {KV: ids[2]}
        load = await cache.load(m)
        await load.wait()
        assert [w[KV] for w in m.placements()] == list(ids)  # the inserted copies, completed
        req.check_restored(m.placements(), 3)
        m.release()
        await cache.wait_idle()
        assert_clean(cache)


@pytest.mark.asyncio
async def test_a_partial_device_copy_pinned_by_another_match_is_completed_in_place() -> None:
    # Was a CacheStateError ("cannot be replaced: pinned there by another match") while a load
    # replaced partial device copies whole; a load now copies only the pools they lack.
    plan, settings = stack_plan("parallel_hybrid")
    async with open_cache(plan, backend="torch", settings=settings) as rt:
        cache = rt.cache
        req = await _on_host_only(rt, 3)
        m = await cache.match(req.tokens)
        ids = rt.runtime.device_slots.allocate({KV: 3}).pages[KV]
        # checkpoints={}: inserted on purpose without a state checkpoint
        await cache.insert(req.tokens[: 3 * cache.page_size], {KV: list(ids)}, checkpoints={})
        cache.index.pin(Tier.DEVICE, [m.keys[2]])  # what another request's match would hold
        assert m.load_counts() == {PoolName.MAMBA: 1}  # only the checkpoint is missing
        load = await cache.load(m)
        await load.wait()
        assert cache.index.placement(Tier.DEVICE, m.keys[2])[KV] == ids[2]  # type: ignore[index]
        cache.index.unpin(Tier.DEVICE, [m.keys[2]])
        req.check_restored(m.placements(), 3)
        m.release()
        await cache.wait_idle()
        assert_clean(cache)
