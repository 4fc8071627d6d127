"""Found by the concurrent soak (``SoakSettings(concurrency=4)``): ``HiCache.match`` reads the
index's placements, then awaits (the storage ``exists`` hint, the TP agreement), then pins what
it read. A page another task evicts during those awaits is gone when match pins it, and match
raises ``CacheStateError: pin: pages [...] are not on DEVICE`` instead of returning a hit.

Expected: match pins (or re-reads) what it returns, so a concurrent eviction either waits for
the pins or shrinks the hit; it never fails. Marked xfail (strict) until the cache face fixes it.
"""

from __future__ import annotations

from collections.abc import Sequence

import anyio
import pytest

from hicache.bootstrap.cache import open_cache
from hicache.domain.tiers import Tier
from hicache.engine.cache_match import CacheMatch
from tests.engine.cache_helpers import Request, assert_clean, stack_plan


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


@pytest.mark.xfail(
    strict=True,
    reason="cache face bug: match pins after its awaits what it read before them",
)
@pytest.mark.asyncio
async def test_a_device_eviction_during_matchs_agreement_does_not_break_the_match() -> None:
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
        for i, where in enumerate(m.sources[: m.device_pages]):
            assert where is Tier.DEVICE
            assert cache.index.placement(Tier.DEVICE, m.keys[i]) is not None
        m.release()
        await cache.wait_idle()
        assert_clean(cache)
