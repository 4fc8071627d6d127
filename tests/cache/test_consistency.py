"""The cache face stays consistent on every failure path: copy faults, cancellation, dropped
matches, ranks that disagree, hybrid boundaries. Built on the engine's fakes (no torch)."""

from __future__ import annotations

import gc
from collections.abc import Sequence

import anyio
import pytest

from hicache.cache.face import HiCache
from hicache.cache.values import CacheSettings
from hicache.domain import (
    CacheStateError,
    ConfigError,
    PoolName,
    TransferError,
)
from hicache.domain.hybrid import CheckpointPolicy
from hicache.domain.tiers import Tier, WriteSettings
from tests.cache.fake_rig import assert_consistent, cached_on_host, hybrid_plan, prompt
from tests.engine.fakes import Rig

KV, MAMBA = PoolName.KV, PoolName.MAMBA


@pytest.mark.asyncio
async def test_a_copy_failure_during_load_gives_every_slot_and_pin_back() -> None:
    rig = Rig(hybrid_plan())
    async with rig.engine, HiCache(rig.engine) as cache:
        tokens = await cached_on_host(rig, cache, 2)
        rig.transfer.fail("load", layer=1)
        match = await cache.match(tokens)
        assert match.host_pages == 2
        assert match.load_counts() == {KV: 2, MAMBA: 1}
        load = await cache.load(match)
        with pytest.raises(TransferError):
            await load.wait()
        assert cache.statistics().loads_failed == 1
        assert rig.device_slots.free_counts() == {KV: 8, MAMBA: 4}
        match.release()
        assert_consistent(rig, cache)
        # carry on: the same prefix loads
        async with await cache.match(tokens) as again:
            load = await cache.load(again)
            await load.wait()
            placements = again.placements()
            assert [set(p) for p in placements] == [{KV}, {KV, MAMBA}]
            # the bytes computed by the request are back: (pool layer 0 of each pool)
            kv_pages = [w[KV] for w in placements]
            assert [rig.transfer.device[KV][0][d] for d in kv_pages] == [
                f"r0/kv/0/{i}".encode() for i in range(2)
            ]
            state = rig.transfer.device[MAMBA][0][placements[1][MAMBA]]
            assert state.startswith(b"r0/mamba/0/")
        assert_consistent(rig, cache)


@pytest.mark.asyncio
async def test_cancelling_a_load_in_flight_returns_its_device_pages() -> None:
    rig = Rig(hybrid_plan())
    async with rig.engine, HiCache(rig.engine) as cache:
        tokens = await cached_on_host(rig, cache, 2)
        gate = rig.transfer.gate("load", layer=2)
        async with await cache.match(tokens) as match:
            load = await cache.load(match)
            await anyio.to_thread.run_sync(gate.entered.wait, 5)
            async with anyio.create_task_group() as tg:
                tg.start_soon(load.cancel)
                await anyio.sleep(0.01)
                gate.open()
            assert load.finished
            assert not load.ok
            assert rig.device_slots.free_counts() == {KV: 8, MAMBA: 4}
        assert_consistent(rig, cache)


@pytest.mark.asyncio
@pytest.mark.parametrize("where", ["match", "load", "insert", "evict"])
async def test_cancellation_at_each_await_leaves_the_cache_consistent(where: str) -> None:
    rig = Rig(hybrid_plan(), delay_s=0.002)
    settings = CacheSettings(writes=WriteSettings(host="write_back"))
    async with rig.engine, HiCache(rig.engine, settings=settings) as cache:
        tokens = prompt(2)
        got = rig.device_slots.allocate({KV: 2, MAMBA: 1}).pages
        await cache.insert(tokens, {KV: list(got[KV])}, checkpoints={2: {MAMBA: got[MAMBA][0]}})
        if where == "load":
            await cache.evict(Tier.DEVICE, 100)
        for delay in (0.0, 0.001, 0.003, 0.01):
            with anyio.move_on_after(delay):
                if where == "match":
                    (await cache.match(tokens)).release()
                elif where == "load":
                    async with await cache.match(tokens) as m:
                        await (await cache.load(m)).wait()
                    await cache.evict(Tier.DEVICE, 100)
                elif where == "insert":
                    more = rig.device_slots.allocate({KV: 2, MAMBA: 1}).pages
                    await cache.insert(
                        prompt(2, 50),
                        {KV: list(more[KV])},
                        checkpoints={2: {MAMBA: more[MAMBA][0]}},
                    )
                else:
                    await cache.evict(Tier.DEVICE, 100)
            await cache.wait_idle()
            gc.collect()
            await cache.wait_idle()
            (await cache.match([])).release()  # releases matches the cancellation dropped
            assert_consistent(rig, cache)


@pytest.mark.asyncio
async def test_a_dropped_match_is_released_at_the_next_call() -> None:
    rig = Rig(hybrid_plan())
    async with rig.engine, HiCache(rig.engine) as cache:
        tokens = await cached_on_host(rig, cache, 2)
        match = await cache.match(tokens)
        assert cache.index.statistics().pinned.host == 2
        del match
        gc.collect()
        (await cache.match([])).release()
        assert_consistent(rig, cache)
        m = await cache.match(tokens)
        m.release()
        with pytest.raises(CacheStateError, match="released"):
            await cache.load(m)


@pytest.mark.asyncio
async def test_a_missing_state_checkpoint_shrinks_the_hit() -> None:
    rig = Rig(hybrid_plan())
    settings = CacheSettings(checkpoints=CheckpointPolicy(every_pages=2, at_end=False))
    async with rig.engine, HiCache(rig.engine, settings=settings) as cache:
        tokens = prompt(3)
        got = rig.device_slots.allocate({KV: 3, MAMBA: 2}).pages
        slot2, slot1 = got[MAMBA]
        result = await cache.insert(
            tokens, {KV: list(got[KV])}, checkpoints={2: {MAMBA: slot2}, 1: {MAMBA: slot1}}
        )
        # boundary 1 is not one the policy keeps: its slot comes back (freed by the cache)
        assert result.released == {MAMBA: (slot1,)}
        assert result.freed_by_cache
        assert rig.device_slots.allocator(MAMBA).is_free(slot1)
        async with await cache.match(tokens) as match:
            assert (match.device_pages, match.host_pages) == (2, 2)  # no checkpoint at 3
        await cache.wait_idle()
        await cache.evict(Tier.DEVICE, 1, MAMBA)  # the state pool's page only
        async with await cache.match(tokens) as match:
            # Page 1 keeps its KV on the device but its checkpoint only on host: not a device
            # hit, but a host hit whose load copies only the checkpoint.
            assert (match.device_pages, match.host_pages) == (0, 2)
            assert match.load_counts() == {MAMBA: 1}
            await (await cache.load(match)).wait()
            assert [w[KV] for w in match.placements()] == list(got[KV][:2])
        assert_consistent(rig, cache)
        await cache.evict(Tier.HOST, 1, MAMBA)  # now the checkpoint is nowhere but the device
        await cache.evict(Tier.DEVICE, 1, MAMBA)  # and then nowhere: the hit shrinks
        async with await cache.match(tokens) as match:
            assert (match.device_pages, match.host_pages) == (0, 0)
        assert_consistent(rig, cache)


class TwoRanks:
    """Two ranks in one process: agree_min waits for both ranks' values of the same round."""

    def __init__(self) -> None:
        self.values: dict[int, list[tuple[int, ...]]] = {}
        self.rounds = [0, 0]
        self.events: dict[int, anyio.Event] = {}

    def rank(self, r: int) -> _Rank:
        return _Rank(self, r)


class _Rank:
    def __init__(self, group: TwoRanks, rank: int) -> None:
        self.group, self.rank = group, rank

    async def agree_min(self, values: Sequence[int]) -> tuple[int, ...]:
        g = self.group
        n = g.rounds[self.rank]
        g.rounds[self.rank] += 1
        got = g.values.setdefault(n, [])
        got.append(tuple(values))
        event = g.events.setdefault(n, anyio.Event())
        if len(got) == 2:
            event.set()
        await event.wait()
        return tuple(min(v) for v in zip(*got, strict=True))


@pytest.mark.asyncio
async def test_two_ranks_that_disagree_both_use_the_minimum() -> None:
    group = TwoRanks()
    rigs = [Rig(hybrid_plan()), Rig(hybrid_plan())]
    results: dict[int, tuple[int, int]] = {}
    settings = CacheSettings(checkpoints=CheckpointPolicy(every_pages=1))
    async with rigs[0].engine, rigs[1].engine:
        caches = [
            HiCache(r.engine, settings=settings, ranks=group.rank(i)) for i, r in enumerate(rigs)
        ]
        async with caches[0], caches[1]:
            for i, (rig, cache) in enumerate(zip(rigs, caches, strict=True)):
                pages = 3 if i == 0 else 2  # rank 1 cached less of the prefix
                got = rig.device_slots.allocate({KV: pages, MAMBA: pages}).pages
                await cache.insert(
                    prompt(pages),
                    {KV: list(got[KV])},
                    checkpoints={b + 1: {MAMBA: s} for b, s in enumerate(got[MAMBA])},
                )

            async def run(i: int) -> None:
                async with await caches[i].match(prompt(3)) as m:
                    results[i] = (m.device_pages, m.host_pages)

            async with anyio.create_task_group() as tg:
                tg.start_soon(run, 0)
                tg.start_soon(run, 1)
            assert results == {0: (2, 2), 1: (2, 2)}
            for rig, cache in zip(rigs, caches, strict=True):
                await cache.wait_idle()
                assert_consistent(rig, cache)


@pytest.mark.asyncio
async def test_bad_input_is_a_typed_error_naming_it() -> None:
    rig = Rig(hybrid_plan())
    with pytest.raises(ConfigError, match="sliding_window"):
        CacheSettings(sliding_window=0)
    with pytest.raises(ConfigError, match="needs a storage tier"):
        HiCache(rig.engine, settings=CacheSettings(writes=WriteSettings(storage="write_through")))
    with pytest.raises(ConfigError, match="unknown write policy"):
        CacheSettings(writes={"host": "sometimes"})
    async with rig.engine, HiCache(rig.engine) as cache:
        with pytest.raises(ConfigError, match="needs the anchor"):
            await cache.insert(prompt(1), {MAMBA: [0]})
        with pytest.raises(ConfigError, match="expected 2"):
            await cache.insert(prompt(2), {KV: [0]})
        with pytest.raises(ConfigError, match="checkpoint at boundary 5"):
            await cache.insert(prompt(2), {KV: [0, 1]}, checkpoints={5: {MAMBA: 0}})
        with pytest.raises(ConfigError, match=r"Tier\.DEVICE or Tier\.HOST"):
            await cache.evict(Tier.STORAGE, 1)
        assert_consistent(rig, cache)


def test_match_load_insert_from_a_plain_thread_through_the_sync_engine() -> None:
    from hicache.cache.sync import open_sync_cache
    from hicache.engine import open_sync

    rig = Rig(hybrid_plan())
    with open_sync(rig.engine) as sync, open_sync_cache(sync, HiCache(rig.engine)) as face:
        tokens = prompt(2)
        got = rig.device_slots.allocate({KV: 2, MAMBA: 1}).pages
        rig.transfer.fill_device(KV, got[KV], "s")
        rig.transfer.fill_device(MAMBA, got[MAMBA], "s")
        result = face.insert(tokens, {KV: list(got[KV])}, checkpoints={2: {MAMBA: got[MAMBA][0]}})
        assert result.pages == 2
        face.call(face.cache.wait_idle)
        assert face.evict(Tier.DEVICE, 10).evicted == 2
        match = face.match(tokens)
        assert match.host_pages == 2
        load = face.load(match)
        for layer in range(rig.layers):
            load.wait_layer(layer)  # on this (forward-pass) thread
        load.wait()
        where = face.placements(match)
        assert rig.transfer.device[KV][0][where[0][KV]] == b"s/kv/0/" + str(got[KV][0]).encode()
        face.release(match)
        assert face.statistics().loads == 1
        face.call(assert_consistent, rig, face.cache)


@pytest.mark.asyncio
async def test_an_unknown_pool_in_insert_is_a_config_error() -> None:
    rig = Rig(hybrid_plan())
    async with rig.engine, HiCache(rig.engine) as cache:
        with pytest.raises(ConfigError, match="unknown pool 'nope'"):
            await cache.insert(prompt(1), {"nope": [0]})  # type: ignore[dict-item]


def test_a_match_released_from_a_plain_thread_is_released_on_the_loop() -> None:
    from hicache.cache.sync import open_sync_cache
    from hicache.engine import open_sync

    rig = Rig(hybrid_plan())
    with open_sync(rig.engine) as sync, open_sync_cache(sync, HiCache(rig.engine)) as face:
        got = rig.device_slots.allocate({KV: 2, MAMBA: 1}).pages
        face.insert(prompt(2), {KV: list(got[KV])}, checkpoints={2: {MAMBA: got[MAMBA][0]}})
        with face.match(prompt(2)) as match:  # released from this thread on exit: queued
            assert match.device_pages == 2
        face.match([]).release()  # the next call on the loop releases it (and this one)
        face.call(face.cache.wait_idle)
        face.call(assert_consistent, rig, face.cache)


@pytest.mark.asyncio
async def test_a_boundary_one_rank_cannot_restore_is_cut_and_agreed_again() -> None:
    group = TwoRanks()
    rigs = [Rig(hybrid_plan()), Rig(hybrid_plan())]
    marks = [[2, 4], [2, 3]]  # the pages each rank keeps a state checkpoint at
    settings = CacheSettings(checkpoints=CheckpointPolicy(every_pages=1))
    results: dict[int, int] = {}
    async with rigs[0].engine, rigs[1].engine:
        caches = [
            HiCache(r.engine, settings=settings, ranks=group.rank(i)) for i, r in enumerate(rigs)
        ]
        async with caches[0], caches[1]:
            for rig, cache, mine in zip(rigs, caches, marks, strict=True):
                got = rig.device_slots.allocate({KV: mine[-1], MAMBA: 2}).pages
                await cache.insert(
                    prompt(mine[-1]),
                    {KV: list(got[KV])},
                    checkpoints={b: {MAMBA: s} for b, s in zip(mine, got[MAMBA], strict=True)},
                )

            async def run(i: int) -> None:
                async with await caches[i].match(prompt(4)) as m:
                    results[i] = m.host_pages

            async with anyio.create_task_group() as tg:
                tg.start_soon(run, 0)
                tg.start_soon(run, 1)
    # min(4, 3) = 3, which rank 0 cannot restore (no checkpoint at 3): cut to 2, agreed again
    assert results == {0: 2, 1: 2}
    assert group.rounds == [3, 3]


@pytest.mark.asyncio
async def test_two_requests_loading_the_same_prefix_copy_it_once() -> None:
    rig = Rig(hybrid_plan(), delay_s=0.002)
    async with rig.engine, HiCache(rig.engine) as cache:
        tokens = await cached_on_host(rig, cache, 2)
        first = await cache.match(tokens)
        second = await cache.match(tokens)
        load1 = await cache.load(first)
        load2 = await cache.load(second)  # waits for the first load, then takes its pages
        await load1.wait()
        await load2.wait()
        assert load2.handle is None  # nothing left to copy
        assert first.placements() == second.placements()
        assert cache.statistics().loaded_pages == 2
        assert len(rig.transfer.calls_of("load")) == rig.layers  # one copy per layer, once
        first.release()
        second.release()
        assert_consistent(rig, cache)
