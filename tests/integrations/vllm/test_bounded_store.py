"""The connector over a store that hangs, without vLLM: the scheduler's exists and the worker's
reads and writes are bounded by deadline_s + grace_s, a hung store is a miss, and a host slot
handed to a store call that overran is not reused until that call really returned."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch

from hicache.domain.keys import chain_keys
from hicache.domain.storage import StoreKey
from hicache.engine.bounded import BoundedSettings, BoundedStorage
from hicache.integrations.vllm.plan import Event, Op, StepPlan, store_key
from hicache.integrations.vllm.scheduler import Scheduled, SchedulerSide
from hicache.integrations.vllm.stats import ConnectorStats
from hicache.integrations.vllm.worker import WorkerTransfers, block_rows
from tests.integrations.vllm.worker_helpers import BLOCKS, caches
from tests.storage.fakes import HangingStore

pytestmark = pytest.mark.timeout(60)
BS = 4
PROMPT = list(range(1, 18))  # 4 full blocks and 1 token
KEYS = chain_keys(PROMPT, BS)[:4]
SLOTS = 8
BOUND = BoundedSettings(deadline_s=0.2, grace_s=0.2)


def rank_keys(page: bytes) -> list[StoreKey]:
    return [store_key("t", 0, page)]


@pytest.fixture
def store() -> Iterator[HangingStore]:
    s = HangingStore()
    yield s
    s.release.set()


def scheduler(store: HangingStore) -> SchedulerSide:
    return SchedulerSide(
        block_size=BS,
        host_slots=SLOTS,
        store=BoundedStorage(store, BOUND),
        store_keys=rank_keys,
        write_storage=True,
        save_decode=False,
        ranks=1,
        stats=ConnectorStats(),
    )


def worker(store: HangingStore) -> tuple[WorkerTransfers, dict[str, torch.Tensor]]:
    c = caches()
    layers = [(n, block_rows(n, t, BLOCKS)) for n, t in c.items()]
    w = WorkerTransfers(
        layers,
        host_bytes=SLOTS * sum(r.shape[1] for _, r in layers),
        store=BoundedStorage(store, BOUND),
        store_key=lambda page: rank_keys(page)[0],
        stats=ConnectorStats(),
    )
    return w, c


def step(s: SchedulerSide, w: WorkerTransfers, plan: StepPlan) -> list[Event]:
    w.start_step(plan)
    w.finish_step()
    start = time.monotonic()
    w.wait_idle()
    assert time.monotonic() - start < BOUND.bound_s + 1.0  # vLLM's store thread is never held
    events = w.drain_events()
    s.on_events(events)
    return events


def late_events(w: WorkerTransfers, store: HangingStore) -> list[Event]:
    store.hang.clear()
    store.release.set()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        got = w.drain_events()
        if got:
            return got
        time.sleep(0.02)
    raise AssertionError("the late store call never reported")


def prefill(s: SchedulerSide, w: WorkerTransfers, rid: str) -> list[Event]:
    s.match(rid, PROMPT, 0)
    return step(s, w, s.build([Scheduled(rid, PROMPT, 0, len(PROMPT))], lambda _r: [0, 1, 2, 3, 4]))


def test_a_hung_exists_is_a_miss_within_the_bound_then_refused_at_once(
    store: HangingStore,
) -> None:
    s = scheduler(store)
    w, _ = worker(store)
    prefill(s, w, "a")
    s.index.clear_unpinned()  # the pages are in the store only
    assert s.match("b", PROMPT, 0) == (16, True)
    store.hang.set()
    start = time.monotonic()
    assert s.match("c", PROMPT, 0) == (0, False)
    assert BOUND.bound_s <= time.monotonic() - start < BOUND.bound_s + 1.0
    start = time.monotonic()
    assert s.match("d", PROMPT, 0) == (0, False)  # refused while the first call hangs
    assert time.monotonic() - start < 0.1
    errors = s.stats.counters.statistics().errors
    assert errors == {("exists", "timeout"): 1, ("exists", "stuck"): 1}
    store.hang.clear()
    store.release.set()
    deadline = time.monotonic() + 10
    while s.store is not None and s.store.storage.stuck and time.monotonic() < deadline:
        time.sleep(0.02)
    assert s.match("e", PROMPT, 0) == (16, True)  # the store answers again


def test_a_hung_read_fails_its_load_in_time_and_keeps_its_slots_until_it_returns(
    store: HangingStore,
) -> None:
    s = scheduler(store)
    w, c = worker(store)
    prefill(s, w, "a")
    stored = {k: w.host[s.index.lookup(k)].clone() for k in KEYS}  # type: ignore[index]
    s.index.clear_unpinned()
    w.host.zero_()
    assert s.match("b", PROMPT, 0) == (16, True)
    s.after_alloc("b", [4, 5, 6, 7, 3], 16)
    plan = s.build([], lambda _r: [])
    (op,) = plan.async_loads
    before = {n: t[4:8].clone() for n, t in c.items()}
    store.hang.set()
    events = step(s, w, plan)
    assert w.drain_finished() == {"b"}
    assert w.drain_errors() == {4, 5, 6, 7}  # vLLM recomputes the blocks
    assert {(e.op, e.ok) for e in events} == {(Op.READ, False)}  # no LOAD: slots stay pinned
    assert all(torch.equal(c[n][4:8], before[n]) for n in c)  # nothing was copied
    # The slots of the hung read are not handed to other pages while it runs.
    others = chain_keys([99, *PROMPT[1:]] * 2, BS)
    taken = [s.index.reserve(k) for k in others]
    assert set(taken) - {None} == set(range(SLOTS)) - set(op.slots)
    assert taken[-1] is None  # the host tier is full: the read's slots were not evicted
    late = late_events(w, store)
    assert sorted((e.op, e.ok, e.key) for e in late) == sorted((Op.LOAD, True, k) for k in op.keys)
    # the late store call did write those slots: another page in them would have been damaged
    for key, slot in zip(op.keys, op.slots, strict=True):
        assert torch.equal(w.host[slot], stored[key])
    free = s.index.free_slots
    s.on_events(late)
    assert s.index.free_slots == free + len(op.slots)


def test_a_hung_write_keeps_only_its_host_slots_and_vllm_keeps_serving(
    store: HangingStore,
) -> None:
    s = scheduler(store)
    w, _ = worker(store)
    store.hang.set()
    events = prefill(s, w, "a")  # the store write hangs; the step does not
    assert {(e.op, e.ok) for e in events} == {(Op.SAVE, True)}  # no STORE yet
    assert s.match("b", PROMPT, 0) == (16, False)  # a host hit: vLLM keeps serving
    s.after_alloc("b", [4, 5, 6, 7, 3], 16)
    loads = step(s, w, s.build([], lambda _r: []))
    assert {(e.op, e.ok) for e in loads} == {(Op.LOAD, True)}
    assert s.index.clear_unpinned() == 0  # the written slots are still pinned by the store
    late = late_events(w, store)
    assert {(e.op, e.ok) for e in late} == {(Op.STORE, False)}  # answered as failed
    s.on_events(late)
    assert s.index.clear_unpinned() == len(KEYS)
    assert w.stats.counters.statistics().errors == {("put", "timeout"): 1}
