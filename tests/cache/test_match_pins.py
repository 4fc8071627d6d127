"""match pins what it read before its awaits (the storage hint, the TP agreement): a device
eviction by another task during the agreement can neither break the match nor take its pages.
Found by the concurrent soak (main's tests/cache/test_match_race.py, an xfail there)."""

from __future__ import annotations

from collections.abc import Sequence

import anyio
import pytest

from hicache.bootstrap.cache import open_cache
from hicache.cache.match import CacheMatch
from hicache.domain.tiers import Tier
from tests.cache.helpers import Request, assert_clean, stack_plan


class HeldAgreement:
    """One rank whose agreement can be held open (a slow all-reduce)."""

    def __init__(self) -> None:
        self.hold = False
        self.entered = anyio.Event()
        self.gate = anyio.Event()

    async def agree_min(self, values: Sequence[int]) -> tuple[int, ...]:
        if self.hold:
            self.entered.set()
            await self.gate.wait()
        await anyio.lowlevel.checkpoint()
        return tuple(values)


@pytest.mark.asyncio
async def test_an_eviction_during_the_agreement_neither_breaks_the_match_nor_takes_its_pages() -> (
    None
):
    plan, settings = stack_plan("dense")
    ranks = HeldAgreement()
    async with open_cache(plan, backend="torch", settings=settings, ranks=ranks) as rt:
        cache = rt.cache
        req = Request(rt, 3)
        await req.insert(cache)
        await cache.wait_idle()
        got: list[CacheMatch] = []
        ranks.hold = True

        async def matcher() -> None:
            got.append(await cache.match(req.tokens))

        async with anyio.create_task_group() as tg:
            tg.start_soon(matcher)
            await ranks.entered.wait()  # match has read the index and waits for the ranks
            await cache.evict(Tier.DEVICE, 100)  # another request's memory pressure
            ranks.hold = False
            ranks.gate.set()
        (m,) = got
        assert m.device_pages == 3  # its pins kept the pages from the eviction
        for i, where in enumerate(m.sources[: m.device_pages]):
            assert where is Tier.DEVICE
            assert cache.index.placement(Tier.DEVICE, m.keys[i]) is not None
        m.release()
        await cache.wait_idle()
        assert_clean(cache)


@pytest.mark.asyncio
async def test_a_window_eviction_on_host_during_the_agreement_leaves_the_matched_window_loadable() -> (
    None
):
    # The soak's "ConfigError: load: page ... has pools ['kv'] on HOST; a destination for
    # ['kv', 'swa']" (sliding stack): the window copies a match needs on host were evicted
    # between the match's read of the index and its pins. The pins now come first.
    plan, settings = stack_plan("sliding")
    ranks = HeldAgreement()
    async with open_cache(plan, backend="torch", settings=settings, ranks=ranks) as rt:
        cache = rt.cache
        swa = next(p for p in cache.rules.owners if p is not cache.rules.anchor)
        req = Request(rt, 3)
        await req.insert(cache)
        await cache.wait_idle()  # write_through: on host too
        await cache.evict(Tier.DEVICE, 100)
        await cache.wait_idle()
        got: list[CacheMatch] = []
        ranks.hold = True

        async def matcher() -> None:
            got.append(await cache.match(req.tokens))

        async with anyio.create_task_group() as tg:
            tg.start_soon(matcher)
            await ranks.entered.wait()
            assert (await cache.evict(Tier.HOST, 100, swa)).evicted == 0  # all pinned
            ranks.hold = False
            ranks.gate.set()
        (m,) = got
        assert m.host_pages == 3
        for key in m.keys[:3]:
            assert swa in (cache.index.placement(Tier.HOST, key) or {})
        load = await cache.load(m)
        await load.wait()
        req.check_restored(m.placements(), 3)
        m.release()
        await cache.wait_idle()
        assert_clean(cache)
