"""Close order and concurrent use of one match, through the async and the synchronous faces.

- Closing the SyncEngine while a SyncCache on it is open closes the cache first (its background
  writes finish) instead of waiting forever for the cache's long-lived task.
- Loading one match twice at once is a CacheStateError (docs/cache-face.md), both while the
  first load's copy runs and while the first ``load`` call itself is still running.
- A SyncCache over the wrong objects, or on a closed SyncEngine, is a typed error.
"""

from __future__ import annotations

import threading

import anyio
import pytest

from hicache.cache.face import HiCache
from hicache.cache.sync import SyncCache, open_sync_cache
from hicache.domain import CacheStateError, ConfigError, EngineClosedError, PoolName
from hicache.domain.tiers import Tier
from hicache.engine import SyncEngine, open_sync
from tests.engine.fakes import Rig, dense_plan

KV = PoolName.KV


def _tokens(pages: int) -> list[int]:
    return list(range(pages * 4 + 1))


def test_closing_the_sync_engine_with_a_sync_cache_open_closes_the_cache_first() -> None:
    rig = Rig(dense_plan(), delay_s=0.1)  # the insert's backup is still running at close
    done = threading.Event()
    state: dict[str, object] = {}

    def scenario() -> None:
        sync = SyncEngine(rig.engine)
        face = SyncCache(sync, HiCache(rig.engine))
        got = rig.device_slots.allocate({KV: 2}).pages
        face.insert(_tokens(2), {KV: list(got[KV])})
        sync.close()  # the cache is still open: before, this waited forever
        state["cache"] = repr(face.cache)
        state["host"] = face.cache.index.statistics().on_tier.host
        face.close()  # idempotent
        done.set()

    worker = threading.Thread(target=scenario, daemon=True)
    worker.start()
    assert done.wait(30), "closing the SyncEngine hung with a SyncCache open"
    assert "closed" in str(state["cache"])
    assert state["host"] == 2  # the backup finished before the engine closed
    rig.assert_no_leaks(host_used={KV: 2}, device_used={KV: 2})


def test_a_sync_cache_over_the_wrong_objects_is_a_typed_error() -> None:
    rig, other = Rig(dense_plan()), Rig(dense_plan())
    with open_sync(rig.engine) as sync:
        with pytest.raises(ConfigError, match="sync must be a SyncEngine"):
            SyncCache("engine", HiCache(rig.engine))  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match="cache must be a HiCache"):
            SyncCache(sync, None)  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match=r"build the HiCache over sync\.engine"):
            SyncCache(sync, HiCache(other.engine))
        with (
            pytest.raises(ConfigError, match="sync must be a SyncEngine"),
            open_sync_cache(None, HiCache(rig.engine)),  # type: ignore[arg-type]
        ):
            pass
    with pytest.raises(EngineClosedError, match="is closed"):
        SyncCache(sync, HiCache(rig.engine))


async def _on_host(rig: Rig, cache: HiCache, pages: int) -> list[int]:
    tokens = _tokens(pages)
    got = rig.device_slots.allocate({KV: pages}).pages
    await cache.insert(tokens, {KV: list(got[KV])})
    await cache.wait_idle()
    await cache.evict(Tier.DEVICE, 100)
    return tokens


@pytest.mark.asyncio
async def test_loading_one_match_twice_at_once_is_a_cache_state_error() -> None:
    rig = Rig(dense_plan())
    async with rig.engine, HiCache(rig.engine) as cache:
        tokens = await _on_host(rig, cache, 2)
        gate = rig.transfer.gate("load")
        async with await cache.match(tokens) as m:
            load = await cache.load(m)  # its copy is held at the gate
            with pytest.raises(CacheStateError, match="is being loaded already"):
                await cache.load(m)
            gate.open()
            await load.wait()
            again = await cache.load(m)  # once settled, a load has nothing left to copy
            assert again.handle is None
        await cache.wait_idle()
        cache.index.validate()


@pytest.mark.asyncio
async def test_two_load_calls_of_one_match_started_together_let_exactly_one_through() -> None:
    rig = Rig(dense_plan())
    async with rig.engine, HiCache(rig.engine) as cache:
        tokens = await _on_host(rig, cache, 2)
        outcomes: list[str] = []
        async with await cache.match(tokens) as m:

            async def load() -> None:
                try:
                    await (await cache.load(m)).wait()
                    outcomes.append("loaded")
                except CacheStateError:
                    outcomes.append("refused")

            async with anyio.create_task_group() as tg:
                tg.start_soon(load)
                tg.start_soon(load)
            assert sorted(outcomes) == ["loaded", "refused"]
            assert m.loaded
        await cache.wait_idle()
        cache.index.validate()
        assert cache.index.statistics().pinned.total == 0


@pytest.mark.parametrize(
    "timeout", [float("nan"), float("inf"), -1, "1", True, 1e308, 10**400, 1e6 + 1]
)
def test_a_sync_wait_refuses_a_time_out_that_is_not_a_finite_number(timeout: object) -> None:
    rig = Rig(dense_plan())
    with open_sync(rig.engine) as sync:
        host = rig.host_slots.allocate({KV: 1})
        handle = sync.load(host)
        with pytest.raises(ConfigError, match="timeout must be None or a finite number"):
            handle.wait(timeout)  # type: ignore[arg-type]
        handle.wait(10)  # the operation was not cancelled by the refused wait
        sync.free_device(handle.device_pages)
        rig.host_slots.free(host)
    rig.assert_no_leaks()
