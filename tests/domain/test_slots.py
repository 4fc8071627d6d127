"""Slot bookkeeping: page free lists and all-or-nothing allocation over a group's pools."""

from __future__ import annotations

import random
import threading
import tracemalloc

import pytest

from hicache.domain import (
    ConfigError,
    DoubleFreeError,
    ForeignIndexError,
    HostGroupPlan,
    OutOfSlotsError,
    PoolName,
    SlotError,
)
from hicache.domain.slots import GroupAllocation, GroupAllocator, PageAllocator
from tests.domain.builders import SHM, anchor, sidecar, state_pool

KV, IX, MAMBA = PoolName.KV, PoolName.INDEXER, PoolName.MAMBA


def test_pages_come_lowest_first() -> None:
    a = PageAllocator(8, name="kv")
    assert a.allocate(3) == [0, 1, 2]
    assert a.allocate(2) == [3, 4]
    a.free([1, 3])
    assert a.allocate(2) == [1, 3]
    assert a.free_count() == 3
    assert a.used_count() == 5
    assert repr(a) == "<PageAllocator kv: 5/8 pages used>"


def test_pages_come_lowest_first_after_any_mix_of_frees() -> None:
    rng = random.Random(7)
    a = PageAllocator(64, name="kv")
    held: set[int] = set()
    for _ in range(300):
        if held and rng.random() < 0.5:
            give = rng.sample(sorted(held), rng.randint(1, len(held)))
            a.free(give)
            held.difference_update(give)
        else:
            n = rng.randint(0, a.free_count())
            expect = sorted(set(range(64)) - held)[:n]
            assert a.allocate(n) == expect
            held.update(expect)
        assert a.free_count() == 64 - len(held)


def test_a_large_pool_keeps_no_list_of_every_page() -> None:
    # 8M pages: one flag byte per page (8 MiB), not a Python list of 8M ints (~290 MiB) that a
    # free would have to re-sort.
    tracemalloc.start()
    try:
        a = PageAllocator(8 * 1024 * 1024, name="kv")
        a.free(a.allocate(16))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 * 1024 * 1024
    assert a.allocate(2) == [0, 1]


def test_double_free_raises_and_changes_nothing() -> None:
    a = PageAllocator(4, name="kv")
    a.allocate(2)
    a.free([0])
    with pytest.raises(DoubleFreeError, match="page 0 of pool 'kv' is already free"):
        a.free([1, 0])
    assert not a.is_free(1)  # the valid id in the same call was not freed either
    with pytest.raises(DoubleFreeError):
        a.free([1, 1])
    assert a.free_count() == 3


@pytest.mark.parametrize("page", [4, -1, "1", True, 1.0])
def test_foreign_index_raises(page: object) -> None:
    a = PageAllocator(4, name="kv")
    a.allocate(4)
    with pytest.raises(ForeignIndexError, match=r"does not belong to pool 'kv' \(ids 0..3\)"):
        a.free([page])  # type: ignore[list-item]
    assert a.free_count() == 0


def test_out_of_slots_takes_nothing() -> None:
    a = PageAllocator(4, name="mamba")
    a.allocate(3)
    with pytest.raises(OutOfSlotsError, match="pool 'mamba' has 1 free pages, 2 were asked"):
        a.allocate(2)
    assert a.free_count() == 1
    assert a.allocate(0) == []


def test_bad_arguments() -> None:
    with pytest.raises(ConfigError):
        PageAllocator(-1)
    with pytest.raises(ConfigError):
        PageAllocator(4).allocate(-1)


def test_page_allocator_is_thread_safe() -> None:
    a = PageAllocator(64, name="kv")
    held: set[int] = set()
    guard = threading.Lock()
    errors: list[str] = []

    def worker() -> None:
        for _ in range(300):
            try:
                pages = a.allocate(3)
            except OutOfSlotsError:
                continue
            with guard:
                clash = held.intersection(pages)
                if clash:
                    errors.append(f"pages {clash} handed out twice")
                held.update(pages)
            with guard:
                held.difference_update(pages)
            a.free(pages)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert a.free_count() == 64
    assert a.allocate(64) == list(range(64))


def group() -> GroupAllocator:
    # kv: 64 tokens / 16 = 4 pages; indexer: sidecar of kv; mamba: 8 slots
    plan = HostGroupPlan(host_memory=SHM, pools=[anchor(), sidecar(), state_pool()])
    return GroupAllocator(plan)


def test_the_group_allocates_anchor_first_then_independent_pools() -> None:
    g = group()
    assert g.order == (KV, MAMBA)
    got = g.allocate({MAMBA: 2, KV: 1})
    assert got[KV] == (0,)
    assert got[MAMBA] == (0, 1)
    assert g.free_counts() == {KV: 3, MAMBA: 6}


def test_sidecars_use_the_anchors_pages() -> None:
    g = group()
    assert g.allocator(IX) is g.allocator(KV)
    with pytest.raises(ConfigError, match=r"cannot allocate from \['indexer'\]"):
        g.allocate({IX: 1})
    with pytest.raises(ForeignIndexError, match="'swa' is not part of this group"):
        g.allocator(PoolName.SWA)


def test_sidecars_are_never_freed_alone() -> None:
    g = group()
    got = g.allocate({KV: 2})
    with pytest.raises(ForeignIndexError, match=r"sidecar pools \['indexer'\] borrow"):
        g.free({IX: got[KV]})
    assert g.free_counts()[KV] == 2


def test_running_out_in_one_pool_rolls_back_the_others() -> None:
    g = group()
    g.allocate({MAMBA: 7})
    with pytest.raises(OutOfSlotsError, match="pool 'mamba' has 1 free pages, 2 were asked"):
        g.allocate({KV: 3, MAMBA: 2})
    assert g.free_counts() == {KV: 4, MAMBA: 1}
    # and the rolled-back pages come out first again
    assert g.allocate({KV: 1})[KV] == (0,)


def test_group_free_is_all_or_nothing() -> None:
    g = group()
    got = g.allocate({KV: 2, MAMBA: 2})
    g.free({MAMBA: got[MAMBA]})
    with pytest.raises(DoubleFreeError):
        g.free(got)  # kv pages are in use, mamba pages already free
    assert g.free_counts() == {KV: 2, MAMBA: 8}
    g.free({KV: got[KV]})
    assert g.free_counts() == {KV: 4, MAMBA: 8}


def test_free_of_an_unknown_pool() -> None:
    with pytest.raises(ForeignIndexError, match=r"pools \['swa'\] are not slot-owning"):
        group().free({PoolName.SWA: (0,)})


def test_page_counts_can_be_given() -> None:
    plan = HostGroupPlan(host_memory=SHM, pools=[anchor(), state_pool()])
    g = GroupAllocator(plan, pages={MAMBA: 2})
    assert g.free_counts() == {KV: 4, MAMBA: 2}


def test_allocation_is_deterministic() -> None:
    def run() -> list[GroupAllocation]:
        g = group()
        a = g.allocate({KV: 2, MAMBA: 3})
        b = g.allocate({KV: 1, MAMBA: 1})
        g.free(a)
        return [a, b, g.allocate({KV: 3, MAMBA: 4})]

    assert run() == run()
    assert run()[2] == GroupAllocation({KV: (0, 1, 3), MAMBA: (0, 1, 2, 4)})


def test_group_allocator_is_thread_safe() -> None:
    g = group()
    held: dict[PoolName, set[int]] = {KV: set(), MAMBA: set()}
    guard = threading.Lock()
    errors: list[str] = []

    def worker() -> None:
        for _ in range(200):
            try:
                got = g.allocate({KV: 1, MAMBA: 2})
            except OutOfSlotsError:
                continue
            with guard:
                for name, ids in got.pages.items():
                    if held[name].intersection(ids):
                        errors.append(f"{name} pages {ids} handed out twice")
                    held[name].update(ids)
            with guard:
                for name, ids in got.pages.items():
                    held[name].difference_update(ids)
            g.free(got)

    threads = [threading.Thread(target=worker) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert g.free_counts() == {KV: 4, MAMBA: 8}


def test_slot_errors_share_a_root() -> None:
    for cls in (DoubleFreeError, ForeignIndexError, OutOfSlotsError):
        assert issubclass(cls, SlotError)
