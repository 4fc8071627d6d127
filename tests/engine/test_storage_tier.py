"""StorageTier: store <-> host pages off the loop, leading runs, deadlines, breaker, background writes."""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import anyio
import pytest

from hicache.adapters.host_pool import HostGroup, materialise_host_group
from hicache.adapters.storage import DirectorySettings, DirectoryStore, HostGroupBuffers
from hicache.domain import ConfigError, EngineClosedError, Layout, PoolName
from hicache.domain.breaker import BreakerState
from hicache.domain.namespace import RankIdentity, group_namespaces
from hicache.domain.storage import HostPageBuffers, PageBuffer, Store, StoreKey, StoreStatus
from hicache.engine.storage_settings import PrefetchPolicy, StorageTierSettings
from hicache.engine.storage_tier import StorageTier
from tests.adapters.pool_plans import fill_random, group_plan, page_bytes
from tests.storage.fakes import FakeStore

KV, IDX = PoolName.KV, PoolName.INDEXER
POOLS = (KV, IDX)
NS = {KV: "ns-kv", IDX: "ns-idx"}
PAGE_BYTES = 64

pytestmark = pytest.mark.timeout(60)


def pkeys(n: int, tag: str = "p") -> list[bytes]:
    return [hashlib.sha256(f"{tag}{i}".encode()).digest() for i in range(n)]


def same(pages: Sequence[int]) -> dict[PoolName, list[int]]:
    return {p: list(pages) for p in POOLS}


class ByteBuffers:
    """HostPageBuffers over plain bytearrays: page ``i`` of each pool, PAGE_BYTES each."""

    def __init__(self, pages: int = 16) -> None:
        self.mem = {p: [bytearray(PAGE_BYTES) for _ in range(pages)] for p in POOLS}

    def buffer(self, pool: PoolName, page: int) -> PageBuffer:
        return [memoryview(self.mem[pool][page])]

    def fill(self, seed: int) -> None:
        for p in POOLS:
            for i, b in enumerate(self.mem[p]):
                b[:] = hashlib.sha256(f"{seed}{p.value}{i}".encode()).digest() * 2


class Clock:
    """Monotonic time plus an offset the test advances (store deadlines stay meaningful)."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.offset


class CountingStore(FakeStore):
    """A FakeStore that counts the get calls running on threads right now."""

    def __init__(self) -> None:
        super().__init__()
        self.running = 0
        self.entered = threading.Event()

    def get(
        self,
        keys: Sequence[StoreKey],
        buffers: Sequence[PageBuffer],
        *,
        deadline: float | None = None,
    ) -> list[StoreStatus]:
        self.running += 1
        self.entered.set()
        try:
            return super().get(keys, buffers, deadline=deadline)
        finally:
            self.running -= 1


def tier(
    store: Store,
    buffers: HostPageBuffers | None = None,
    clock: Clock | None = None,
    **settings: object,
) -> StorageTier:
    return StorageTier(
        store,
        buffers if buffers is not None else ByteBuffers(),
        NS,
        POOLS,
        StorageTierSettings(**settings),  # type: ignore[arg-type]
        clock=clock if clock is not None else time.monotonic,
    )


async def stored(store: FakeStore, n: int, **settings: object) -> list[bytes]:
    """Write n pages (pages 0..n-1 of fresh buffers) and return their keys."""
    src = ByteBuffers()
    src.fill(1)
    keys = pkeys(n)
    assert (
        await tier(store, src, **settings).write(keys, same(range(n)), deadline=None) == [True] * n
    )
    return keys


# -- round trips ------------------------------------------------------------------------------


@pytest.fixture
def groups() -> Iterator[tuple[HostGroup, HostGroup, Mapping[PoolName, str]]]:
    plan, _ = group_plan("indexer", Layout.LAYER_FIRST)  # a KV anchor and an indexer sidecar
    with materialise_host_group(plan) as src, materialise_host_group(plan) as dst:
        for i, pool in enumerate(src.pools.values()):
            fill_random(pool, 10 + i)
        for i, pool in enumerate(dst.pools.values()):
            fill_random(pool, 20 + i)
        yield src, dst, group_namespaces(plan, RankIdentity(model="m"))


@pytest.mark.parametrize("which", ["directory", "fake"])
@pytest.mark.asyncio
async def test_pages_written_from_one_host_group_come_back_byte_exact_in_another(
    tmp_path: Path, groups: tuple[HostGroup, HostGroup, Mapping[PoolName, str]], which: str
) -> None:
    src, dst, ns = groups
    store: Store = (
        DirectoryStore(DirectorySettings(root=tmp_path)) if which == "directory" else FakeStore()
    )
    settings = StorageTierSettings(batch_pages=2)
    keys = pkeys(3)
    a = StorageTier(store, HostGroupBuffers(src), ns, POOLS, settings)
    assert isinstance(HostGroupBuffers(src), HostPageBuffers)
    b = StorageTier(store, HostGroupBuffers(dst), ns, POOLS, settings)
    before = [page_bytes(dst.pool(p), 7) for p in POOLS]
    assert await a.write(keys, same([0, 1, 2]), deadline=None) == [True] * 3
    assert await b.exists(keys) == 3
    assert await b.read(keys, same([4, 5, 6]), deadline=None) == [True] * 3
    for pool in POOLS:
        for s, d in zip([0, 1, 2], [4, 5, 6], strict=True):
            assert page_bytes(dst.pool(pool), d) == page_bytes(src.pool(pool), s)
    assert [page_bytes(dst.pool(p), 7) for p in POOLS] == before  # nothing spilled
    stats = b.statistics()
    per_page = sum(src.pool(p).plan.bytes_per_page for p in POOLS)
    assert (stats.pages_read_ok, stats.bytes_read) == (3, 3 * per_page)
    assert stats.calls["get"] == 2  # batches of 2 pages
    assert a.statistics().bytes_written == 3 * per_page
    store.close()


# -- leading runs -----------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_missing_middle_page_makes_it_and_every_later_page_a_miss() -> None:
    store = FakeStore()
    keys = await stored(store, 5)
    store.remove([StoreKey(NS[IDX], IDX.value, keys[2].hex())])  # one pool's object of page 2
    t = tier(store, batch_pages=1)
    assert await t.exists(keys) == 2
    calls = store.calls["get"]
    assert await t.read(keys, same(range(5)), deadline=None) == [True, True, False, False, False]
    assert store.calls["get"] - calls == 3  # stopped after the failed page
    one_batch = tier(store, batch_pages=8)
    assert await one_batch.read(keys, same(range(5)), deadline=None) == [True, True] + [False] * 3
    assert one_batch.statistics().pages_read_failed == 3


@pytest.mark.asyncio
async def test_a_phantom_in_exists_is_still_a_miss_on_read() -> None:
    store = FakeStore()
    keys = await stored(store, 2)
    extra = pkeys(3, "x")[0]
    for p in POOLS:
        store.phantom(StoreKey(NS[p], p.value, extra.hex()))
    t = tier(store)
    assert await t.exists([*keys, extra]) == 3
    assert await t.read([*keys, extra], same(range(3)), deadline=None) == [True, True, False]


@pytest.mark.asyncio
async def test_a_full_page_fails_alone_on_write_and_is_not_a_store_failure() -> None:
    store = FakeStore()
    keys = pkeys(4)
    store.fail("put", StoreStatus.FULL, keys=[StoreKey(NS[KV], KV.value, keys[1].hex())])
    src = ByteBuffers()
    t = tier(store, src, batch_pages=2, breaker_threshold=1)
    assert await t.write(keys, same(range(4)), deadline=None) == [True, False, True, True]
    s = t.statistics()
    assert (s.failed_calls, s.breaker.state, s.statuses) == (0, BreakerState.CLOSED, {"full": 1})
    assert await t.remove(keys) == [True] * 4
    assert store.objects == {}


# -- deadlines --------------------------------------------------------------------------------


@pytest.mark.timeout(20)
@pytest.mark.asyncio
async def test_a_slow_store_turns_into_misses_by_the_deadline_never_a_hang() -> None:
    store = FakeStore()
    keys = await stored(store, 8)
    store.slow(0.15)  # before every key: a batch of 2 pages (4 keys) takes 0.6 s
    t = tier(store, batch_pages=2, breaker_threshold=100)
    start = time.monotonic()
    result = await t.read(keys, same(range(8)), deadline=start + 0.4)
    elapsed = time.monotonic() - start
    assert sum(result) <= 1
    assert result == sorted(result, reverse=True)  # a leading run, if any
    assert elapsed < 0.4 + 1.0  # the deadline plus one key's delay and scheduling slack
    assert t.statistics().statuses.get("transient", 0) >= 1


@pytest.mark.asyncio
async def test_a_deadline_already_passed_calls_no_store() -> None:
    store = FakeStore()
    keys = await stored(store, 2)
    calls = store.calls["get"]
    t = tier(store, prefetch_policy="best_effort")
    deadline = t.deadline_for(256)
    assert await t.read(keys, same(range(2)), deadline=deadline) == [False, False]
    assert store.calls["get"] == calls


def test_deadline_for_follows_the_policy_and_the_capped_linear_timeout() -> None:
    s = {"timeout_base_s": 1.0, "timeout_per_ki_token_s": 0.5, "timeout_max_s": 3.0}
    assert tier(FakeStore(), prefetch_policy="wait_complete", **s).deadline_for(4096, 10.0) is None
    assert tier(FakeStore(), prefetch_policy="best_effort", **s).deadline_for(4096, 10.0) == 10.0
    timeout = tier(FakeStore(), prefetch_policy=PrefetchPolicy.TIMEOUT, **s)
    assert timeout.deadline_for(2048, 10.0) == 10.0 + 1.0 + 0.5 * 2
    assert timeout.deadline_for(1 << 20, 10.0) == 13.0  # capped at max
    with pytest.raises(ConfigError, match="tokens"):
        timeout.deadline_for(-1, 0.0)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("prefetch_policy", "eager"),
        ("batch_pages", 0),
        ("max_concurrency", True),
        ("call_deadline_s", 0),
        ("timeout_base_s", float("inf")),
        ("timeout_max_s", 1.0),  # below the default base of 2 s
        ("write_queue", -3),
    ],
)
def test_bad_settings_are_config_errors_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=field.split("_s")[0].replace("prefetch_", "")):
        StorageTierSettings(**{field: value})  # type: ignore[arg-type]


@pytest.mark.asyncio
async def test_host_pages_not_paired_with_page_keys_are_a_config_error() -> None:
    t = tier(FakeStore())
    with pytest.raises(ConfigError, match="indexer"):
        await t.read(pkeys(2), {KV: [0, 1], IDX: [0]}, deadline=None)


# -- failures and the breaker -----------------------------------------------------------------


@pytest.mark.asyncio
async def test_the_breaker_opens_after_n_failed_calls_and_closes_after_the_cooldown() -> None:
    store = FakeStore()
    keys = await stored(store, 2)
    clock = Clock()
    t = tier(store, clock=clock, breaker_threshold=3, breaker_cooldown_s=30.0)
    store.fail("get", StoreStatus.TRANSIENT, times=3 * 4)  # 3 calls of 2 pages x 2 pools
    for _ in range(3):
        assert await t.read(keys, same(range(2)), deadline=None) == [False, False]
    assert t.breaker_state is BreakerState.OPEN
    calls = dict(store.calls)
    assert await t.read(keys, same(range(2)), deadline=None) == [False, False]
    assert await t.exists(keys) == 0
    assert dict(store.calls) == calls  # refused: the store was not called
    assert t.statistics().refused_calls == 2
    clock.offset += 30.0
    assert await t.read(keys, same(range(2)), deadline=None) == [True, True]  # the probe
    assert t.breaker_state is BreakerState.CLOSED
    s = t.statistics()
    assert (s.failed_calls, s.breaker.trips, s.statuses["transient"]) == (3, 1, 12)


@pytest.mark.asyncio
async def test_a_probe_cancelled_before_it_ran_does_not_keep_the_breaker_half_open() -> None:
    store = FakeStore()
    keys = await stored(store, 1)
    clock = Clock()
    t = tier(store, clock=clock, max_concurrency=1, breaker_threshold=1, breaker_cooldown_s=5.0)
    store.fail("get", StoreStatus.TRANSIENT, times=2)
    assert await t.read(keys, same([0]), deadline=None) == [False]
    assert t.breaker_state is BreakerState.OPEN
    clock.offset += 5.0
    release = anyio.Event()

    async def hold() -> None:  # another call holds the only worker slot
        async with t._limiter:
            await release.wait()

    async with anyio.create_task_group() as tg:
        tg.start_soon(hold)
        await anyio.sleep(0.01)
        with anyio.move_on_after(0.05):
            await t.read(keys, same([0]), deadline=None)  # the probe waits for the slot
        release.set()
    assert t.breaker_state is BreakerState.HALF_OPEN
    assert await t.read(keys, same([0]), deadline=None) == [True]  # the next call probes
    assert t.breaker_state is BreakerState.CLOSED


@pytest.mark.asyncio
async def test_a_fatal_answer_and_a_raising_store_are_failures_never_exceptions() -> None:
    store = FakeStore()
    keys = await stored(store, 2)
    t = tier(store, breaker_threshold=2)
    store.raise_on("get", RuntimeError("plug-in bug"))
    assert await t.read(keys, same(range(2)), deadline=None) == [False, False]
    store.raise_on("exists", OSError("gone"))
    assert await t.exists(keys) == 0
    assert t.breaker_state is BreakerState.OPEN
    store.close()
    t2 = tier(store)
    assert await t2.write(keys, same(range(2)), deadline=None) == [False, False]
    assert t2.statistics().statuses == {"fatal": 4}


@pytest.mark.asyncio
async def test_after_a_transient_read_host_pages_are_unsafe_while_the_store_is_unhealthy() -> None:
    store = FakeStore()
    keys = await stored(store, 1)
    t = tier(store)
    store.unhealthy = "1 Mooncake call(s) overran their deadline and still run"
    assert t.buffers_safe()  # nothing overran yet
    store.fail("get", StoreStatus.TRANSIENT)
    assert await t.read(keys, same([0]), deadline=None) == [False]
    assert not t.buffers_safe()
    assert not t.statistics().buffers_safe
    store.unhealthy = None
    assert t.buffers_safe()
    assert t.statistics().buffers_safe


# -- cancellation -----------------------------------------------------------------------------


@pytest.mark.timeout(20)
@pytest.mark.asyncio
async def test_a_read_cancelled_mid_call_returns_only_after_the_thread_call_finished() -> None:
    store = CountingStore()
    keys = await stored(store, 4)  # type: ignore[arg-type]
    store.slow(0.1)
    t = tier(store, batch_pages=1)
    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as tg:

            async def cancel_when_entered() -> None:
                await anyio.to_thread.run_sync(store.entered.wait, 5)
                scope.cancel()

            tg.start_soon(cancel_when_entered)
            await t.read(keys, same(range(4)), deadline=None)
    assert scope.cancelled_caught
    assert store.running == 0  # no thread still writes host pages
    assert store.calls["get"] == 1  # the running call finished; no later batch started
    s = t.statistics()
    assert s.pages_read_ok + s.pages_read_failed == 4


# -- background writes ------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_background_writes_report_once_and_closing_drains_them() -> None:
    store = FakeStore()
    done: list[list[bool]] = []
    keys = pkeys(6)
    async with tier(store, batch_pages=2) as t:
        t.start_write(keys[:3], same(range(3)), done.append)
        t.start_write(keys[3:], same(range(3, 6)), done.append)
    assert sorted(done) == [[True] * 3, [True] * 3]
    assert len(store.objects) == 12
    assert t.statistics().writes_pending == 0
    with pytest.raises(EngineClosedError):
        t.start_write(keys, same(range(6)), done.append)


@pytest.mark.timeout(20)
@pytest.mark.asyncio
async def test_closing_with_cancel_fails_every_pending_write_exactly_once() -> None:
    store = FakeStore()
    store.slow(0.05)
    done: list[tuple[int, list[bool]]] = []
    t = tier(store, max_concurrency=1, write_queue=8)
    async with t:
        for i in range(5):
            t.start_write(pkeys(4, f"w{i}"), same(range(4)), lambda r, i=i: done.append((i, r)))
        await anyio.sleep(0.1)
        await t.aclose(cancel=True)
    assert sorted(i for i, _ in done) == [0, 1, 2, 3, 4]
    assert all(r == [False] * 4 for i, r in done if i > 0)  # never started, or cancelled
    assert t.statistics().writes_pending == 0


@pytest.mark.asyncio
async def test_a_full_queue_drops_the_write_at_once_and_a_bad_callback_stops_nothing() -> None:
    store = FakeStore()
    store.slow(0.05)
    done: list[list[bool]] = []

    def bad(_r: list[bool]) -> None:
        raise ValueError("callback bug")

    async with tier(store, max_concurrency=1, write_queue=1) as t:
        t.start_write(pkeys(1, "a"), same([0]), bad)
        await anyio.sleep(0.01)  # the worker takes the first; the queue holds one more
        t.start_write(pkeys(1, "b"), same([1]), done.append)
        t.start_write(pkeys(1, "c"), same([2]), done.append)
        assert done == [[False]]  # dropped: on_done before start_write returned
        assert t.statistics().writes_dropped == 1
    assert done == [[False], [True]]


@pytest.mark.asyncio
async def test_an_exception_in_the_body_cancels_background_writes_cleanly() -> None:
    store = FakeStore()
    store.slow(0.05)
    done: list[list[bool]] = []

    async def body() -> None:
        async with tier(store, max_concurrency=1) as t:
            for i in range(3):
                t.start_write(pkeys(2, f"e{i}"), same([0, 1]), done.append)
            raise RuntimeError("body")

    with pytest.raises(RuntimeError, match="body"):
        await body()
    assert len(done) == 3
    assert all(r == [False, False] for r in done)
