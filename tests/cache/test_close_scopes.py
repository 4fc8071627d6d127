"""A cancelled or nested ``aclose`` of the cache face keeps the task's cancel scopes in order.

Before: ``aclose`` left the face's task group wherever it was called, so an ``aclose`` inside
a ``move_on_after`` (or cancelled there) raised "Attempted to exit a cancel scope that isn't the
current tasks's current cancel scope" and the inner scope's cancellation escaped it: a later,
unrelated close in the same task got CancelledError. Now the cancellation ends at the caller's
scope, background work settles (index clean), and the groups are left where they were entered.
"""

from __future__ import annotations

import anyio
import pytest

from hicache.bootstrap.cache import open_cache
from hicache.cache.face import HiCache
from hicache.domain import PoolName
from tests.engine.fakes import Rig, dense_plan

KV = PoolName.KV


async def _later_scopes_work(rig: Rig) -> None:
    """An unrelated close and cancel scope in the same task, afterwards."""
    with anyio.move_on_after(5) as scope:
        await anyio.sleep(0)
    assert not scope.cancelled_caught
    async with rig.engine:
        pass


@pytest.mark.asyncio
@pytest.mark.parametrize("how", ["cancel", "deadline"])
async def test_a_cancelled_aclose_inside_the_body_ends_at_the_callers_scope(how: str) -> None:
    rig = Rig(dense_plan(), delay_s=0.3)  # the background backup outlives the deadline
    other = Rig(dense_plan())
    async with rig.engine, HiCache(rig.engine) as cache:
        ids = list(rig.device_slots.allocate({KV: 2}).pages[KV])
        await cache.insert(list(range(9)), {KV: ids})
        assert cache.work.busy == 1
        with anyio.CancelScope() as cs:
            if how == "cancel":
                cs.cancel()
            else:
                cs.deadline = anyio.current_time() + 0.05
            await cache.aclose()
        assert cs.cancelled_caught
        assert cache.work.busy == 0  # the backup settled (aborted or done), nothing in flight
        cache.index.validate()
        assert cache.index.statistics().in_flight == 0
        with anyio.move_on_after(5) as later:
            await anyio.sleep(0)
        assert not later.cancelled_caught
    await _later_scopes_work(other)


@pytest.mark.asyncio
async def test_a_cache_runtime_closed_by_hand_inside_a_cancelled_scope_leaves_scopes_in_order() -> (
    None
):
    plan = dense_plan()
    async with open_cache(plan, backend="torch") as first:
        rt = open_cache(plan, backend="torch")
        await rt.__aenter__()
        ids = list(rt.runtime.device_slots.allocate({KV: 2}).pages[KV])
        await rt.cache.insert(list(range(9)), {KV: ids})
        with anyio.CancelScope() as cs:
            cs.cancel()
            await rt.aclose()
        assert cs.cancelled_caught
        assert rt.closed
        await rt.aclose()  # from where it was opened: leaves the groups it could not leave
        with anyio.move_on_after(5) as later:
            await anyio.sleep(0)
        assert not later.cancelled_caught
        assert not first.closed
    assert first.closed


@pytest.mark.asyncio
async def test_a_cache_runtime_closed_inside_its_body_then_left_by_async_with() -> None:
    plan = dense_plan()
    async with open_cache(plan, backend="torch") as rt:
        with anyio.move_on_after(5):
            await rt.aclose()  # nested: the groups wait for the async with exit
        assert rt.closed
    with anyio.CancelScope() as scope:
        await anyio.sleep(0)
    assert not scope.cancelled_caught
